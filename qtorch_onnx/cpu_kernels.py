"""CPU copies of formats/ functions in C (``cpu_kernels.c``), one pass over memory instead of a chain of torch
operations; for evaluation-mode forwards of a prepared model on a CPU (the staged forward passes of fast finetune,
bias correction, sensitivity analysis, evaluation).

Like the Triton kernels (``triton_kernels/``), each is an accelerated copy of a formats/ function, tested against
it bit for bit (tests/test_cpu_kernels.py), and :class:`~qtorch_onnx.fakequant.FakeQuantize` picks it only where
it gives the same bits and no gradient is needed. ``qt_fake_quantize_tensor`` is
:func:`qtorch_onnx.formats.integer.fake_quantize` for a per-tensor scale and zero point and a type of at most 16
bits: the in-place torch path makes seven passes over the tensor (division, rounding, zero point, clamp, NaN,
zero point, scale), this one pass (``benchmarks/integer_fake_quant.py`` measures both). ``qt_bfp_values`` is
:func:`qtorch_onnx.formats.bfp.bfp_reference` for ``to_bfp`` (BFP16 and other widths) without the bfloat16
conversion, with its straight-through mask on request: the torch reference is about thirty operations, each a
pass (``benchmarks/bfp_cpu.py``); ``qt_bfp_prime_values`` the same for ``to_bfp_prime`` (MX4 / MX6 / MX9), and
``qt_mx_values`` :func:`qtorch_onnx.formats.mx.mx_reference` (MXINT8, MXFP8 / 6 / 4); ``qt_bf16_qdq``
:func:`qtorch_onnx.formats.floating.scaled_bf16` in its Q/DQ form for one scale (about ten torch passes:
conversion, NaN patching, dequantization), ``qt_fp16_round``
:func:`qtorch_onnx.formats.floating.fp16_round` (clip, two conversions) with its straight-through mask on request,
where the compiler has ``_Float16``.

Built on first use by :mod:`qtorch_onnx.native` into ``$QTORCH_ONNX_CACHE/cpu_kernels/<hash>/``. No compiler, a
failed build or ``QTORCH_ONNX_CPU_KERNELS=0``: the torch path runs (a warning says why, once). Tensors from
``PARALLEL_MIN`` elements up are split between ``torch.get_num_threads()`` threads (ctypes releases the GIL).
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Optional

import torch

from . import native

__all__ = ["available", "library", "fake_quantize_tensor", "bf16_fake_quantize", "fp16_available", "fp16_round",
           "bfp_fake_quantize", "bfp_prime_fake_quantize",
           "mx_fake_quantize", "block_format_covered", "block_fake_quantize", "ENV_SWITCH", "MIN_ELEMENTS",
           "PARALLEL_MIN", "PRIME_MAX_BLOCK"]

SOURCE = Path(__file__).resolve().parent / "cpu_kernels.c"
ENV_SWITCH = "QTORCH_ONNX_CPU_KERNELS"
_VERSION = 9
#: tensors below this many elements stay with torch (a ctypes call costs about as much as torch's passes there)
MIN_ELEMENTS = 1 << 12
#: tensors from this many elements up are split between torch's intra-op threads
PARALLEL_MIN = 1 << 18
#: the largest BFP-prime block the C kernel takes (BFP_PRIME_MAX_BLOCK in cpu_kernels.c; MX4/6/9's is 16)
PRIME_MAX_BLOCK = 1024

_state: dict = {}


def _declare(lib: ctypes.CDLL) -> None:
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.qt_fake_quantize_tensor.argtypes = [i64, i64, ptr, ptr, f32, f32, f32, f32]
    lib.qt_fake_quantize_tensor.restype = None
    lib.qt_bfp_values.argtypes = [i64] * 7 + [ptr] * 3
    lib.qt_bfp_values.restype = None
    lib.qt_bfp_prime_values.argtypes = [i64] * 9 + [ptr] * 3
    lib.qt_bfp_prime_values.restype = None
    lib.qt_mx_values.argtypes = [i64] * 9 + [f32, i64] + [ptr] * 3
    lib.qt_mx_values.restype = None
    lib.qt_bf16_qdq.argtypes = [i64, i64, ptr, ptr, f32]
    lib.qt_bf16_qdq.restype = None
    lib.qt_fp16_round.argtypes = [i64, i64, ptr, ptr, ptr]
    lib.qt_fp16_round.restype = None
    lib.qt_fp16_available.argtypes = []
    lib.qt_fp16_available.restype = ctypes.c_int


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, built on first use; None when ``QTORCH_ONNX_CPU_KERNELS=0``, there is no C compiler,
    or the build or load fails (warned once, with the reason; fake quantization then runs its torch path)."""
    return native.load(_state, ENV_SWITCH, SOURCE, "qtorch_cpu_kernels", _VERSION, _declare,
                       "qtorch_onnx: the C CPU kernels", "fake quantization runs its torch path (slower on a CPU)")


def available() -> bool:
    """Whether the library loads (see :func:`library`)."""
    return library() is not None


def _check(x: torch.Tensor, what: str):
    """The library, for a contiguous float32 CPU ``x``; else ValueError naming ``what``."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"{what}: needs a contiguous float32 CPU tensor, got {x.dtype} on {x.device}"
                         f"{'' if x.is_contiguous() else ' (not contiguous)'}")
    lib = library()
    if lib is None:
        raise ValueError(f"{what}: the C CPU kernels are unavailable (see cpu_kernels.available())")
    return lib


def fake_quantize_tensor(x: torch.Tensor, scale: float, zero_point: float, qmin: float, qmax: float,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fake_quantize(x, scale, zero_point)`` for one scale and zero point (``formats.integer``, a type of at most
    16 bits with range ``[qmin, qmax]``), in one pass: a new float32 tensor of ``x``'s shape, or ``out`` filled
    with it (``x`` itself is allowed: each element is read before it is written). ``x``: contiguous float32 on the
    CPU; ``scale``: the float32 scale's value; ``zero_point``: the integer zero point as a float. Bit for bit the
    torch path's result (NaN -> ``(qmin - zero_point) * scale``, +-Inf saturate).

    Raises:
        ValueError: ``x`` (or ``out``: contiguous float32 of ``x``'s shape on the CPU) not a contiguous float32 CPU
            tensor, or the library is unavailable (check :func:`available` first).
    """
    lib = _check(x, "fake_quantize_tensor")
    if out is not None and (out.dtype != torch.float32 or out.shape != x.shape or not out.is_contiguous()
                            or out.device.type != "cpu"):
        raise ValueError(f"fake_quantize_tensor: out must be a contiguous float32 CPU tensor of shape "
                         f"{tuple(x.shape)}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    y = torch.empty_like(x) if out is None else out
    args = (x.data_ptr(), y.data_ptr(), float(scale), float(zero_point), float(qmin), float(qmax))
    _run_rows(x, x.numel(), lib.qt_fake_quantize_tensor, lambda i, a, b: (a, b) + args)
    return y


def bf16_fake_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scaled_bf16(x, scale, form="qdq")`` (``formats.floating``: Quark's ExtendedQuantizeLinear /
    ExtendedDequantizeLinear to bfloat16 with zero point +0.0, one scale) in one pass: a new float32 tensor of
    ``x``'s shape, bit for bit the torch function's (-0.0 -> +0.0, overflow to +-Inf, subnormals kept, every NaN
    -> 0x7FC00000). ``x``: contiguous float32 on the CPU; ``scale``: the float32 scale's value.

    Raises:
        ValueError: ``x`` not a contiguous float32 CPU tensor, or the library is unavailable.
    """
    lib = _check(x, "bf16_fake_quantize")
    y = torch.empty_like(x)
    args = (x.data_ptr(), y.data_ptr(), float(scale))
    _run_rows(x, x.numel(), lib.qt_bf16_qdq, lambda i, a, b: (a, b) + args)
    return y


def fp16_available() -> bool:
    """Whether :func:`fp16_round` can run: the library loads and its compiler has ``_Float16``."""
    lib = library()
    return lib is not None and bool(lib.qt_fp16_available())


def fp16_round(x: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``formats.floating.fp16_round(x)`` in one pass: clip to +-65504, round to float16 (to nearest even,
    subnormals kept), widen back to float32; a new tensor of ``x``'s shape, bit for bit the torch function's for
    every value but NaN (a NaN stays NaN; its payload is the conversion's, as torch's is). ``keep``: a contiguous
    float32 tensor of ``x``'s shape to receive the straight-through mask (1.0 where ``|x| <= 65504`` or ``x`` is
    not finite, else 0.0). ``x``: contiguous float32 on the CPU.

    Raises:
        ValueError: ``x`` / ``keep`` not contiguous float32 CPU tensors of one shape, or no ``_Float16`` here
            (check :func:`fp16_available` first).
    """
    lib = _check(x, "fp16_round")
    if not lib.qt_fp16_available():
        raise ValueError("fp16_round: the C kernels were built without _Float16 (see cpu_kernels.fp16_available())")
    if keep is not None:
        _check(keep, "fp16_round keep")
        if keep.shape != x.shape:
            raise ValueError(f"fp16_round: keep has shape {tuple(keep.shape)}, x {tuple(x.shape)}")
    y = torch.empty_like(x)
    args = (x.data_ptr(), y.data_ptr(), keep.data_ptr() if keep is not None else None)
    _run_rows(x, x.numel(), lib.qt_fp16_round, lambda i, a, b: (a, b) + args)
    return y


def _block_layout(x: torch.Tensor, axis: int, what: str):
    """``(lib, outer, n, inner)``: ``x`` (checked: contiguous float32 CPU, two elements or more, ``axis`` in
    ``0 .. rank - 1``) seen as ``[outer, n, inner]`` around its block axis (rank 1: its one dimension)."""
    lib = _check(x, what)
    if x.numel() < 2 or not 0 <= axis < max(x.dim(), 1):
        raise ValueError(f"{what}: {x.numel()} elements, axis {axis} of a rank-{x.dim()} tensor; needs at least two "
                         "elements and an axis in 0 .. rank - 1")
    shape = tuple(x.shape) if x.dim() > 1 else (x.numel(),)
    axis = axis if x.dim() > 1 else 0
    return lib, math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def _run_rows(x: torch.Tensor, rows: int, fn, args_of) -> None:
    """``fn`` over ``rows`` ranges of ``x`` (native.split), on torch's intra-op threads from ``PARALLEL_MIN``
    elements."""
    pool = native.thread_pool(_state, "qtorch_cpu_kernels") if rows > 1 and x.numel() >= PARALLEL_MIN else None
    native.split(fn, rows, pool, args_of)


def bfp_fake_quantize(x: torch.Tensor, axis: int, block_size: int, bit_width: int, rounding_mode: int,
                      keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """BFP (``to_bfp``) quantize-dequantize of ``x`` along ``axis`` in blocks of ``block_size`` with
    ``bit_width - 9`` magnitude bits and ``rounding_mode`` 0 / 1 / 2 (docs/numerics.md sections 4 and 5), bit for
    bit :func:`qtorch_onnx.formats.bfp.bfp_reference`'s result: a new float32 tensor of ``x``'s shape. With
    ``keep`` (contiguous float32 of ``x``'s shape) its straight-through mask is written there too: 1.0 where the
    gradient passes (not clipped, or Inf / NaN), else 0.0 (section 8); a buffer kept between calls (two fresh
    buffers of a large tensor freed together are returned to the system by glibc, and every call then pays their
    page faults: 0.34 -> 1.9 ms on 655k elements).

    Args:
        x: contiguous float32 CPU tensor of at least two elements (the format returns a one-element tensor as it
            is: not handled here). axis: the block axis, ``0 .. rank - 1`` (rank 1: its one dimension).
        block_size (>= 1), bit_width (10 .. 32), rounding_mode: as ``BFPQuantizeDequantize``'s attributes,
            validated by the caller.

    Raises:
        ValueError: ``x`` not a contiguous float32 CPU tensor, fewer than two elements, an axis out of range, or the
            library unavailable (check :func:`available` first).
    """
    lib, outer, n, inner = _block_layout(x, axis, "bfp_fake_quantize")
    y = torch.empty_like(x)
    kp = None if keep is None else keep.data_ptr()
    _run_rows(x, outer, lib.qt_bfp_values,
              lambda i, a, b: (a, b, n, inner, int(block_size), int(bit_width) - 9, int(rounding_mode), x.data_ptr(),
                               y.data_ptr(), kp))
    return y


def bfp_prime_fake_quantize(x: torch.Tensor, axis: int, block_size: int, bit_width: int, rounding_mode: int,
                            sub_block_size: int, sub_block_shift_bits: int,
                            keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """BFP-prime (``to_bfp_prime``: MX4 / MX6 / MX9 and other widths; docs/numerics.md sections 4 and 6) of ``x``
    along ``axis``, bit for bit :func:`qtorch_onnx.formats.bfp.bfp_reference`'s result (a new float32 tensor of
    ``x``'s shape), its straight-through mask into ``keep`` when given (1.0 where not saturated or Inf / NaN), as
    :func:`bfp_fake_quantize`. ``block_size`` at most ``PRIME_MAX_BLOCK`` and a multiple of ``sub_block_size``
    (validated by the caller: ``validate_bfp_attributes``).

    Raises:
        ValueError: as :func:`bfp_fake_quantize`, or a block larger than ``PRIME_MAX_BLOCK``.
    """
    lib, outer, n, inner = _block_layout(x, axis, "bfp_prime_fake_quantize")
    if not 1 <= block_size <= PRIME_MAX_BLOCK:
        raise ValueError(f"bfp_prime_fake_quantize: block_size {block_size}; the C kernel takes 1 .. {PRIME_MAX_BLOCK}")
    y = torch.empty_like(x)
    kp = None if keep is None else keep.data_ptr()
    _run_rows(x, outer, lib.qt_bfp_prime_values,
              lambda i, a, b: (a, b, n, inner, int(block_size), int(sub_block_size), int(bit_width) - 9,
                               int(sub_block_shift_bits), int(rounding_mode), x.data_ptr(), y.data_ptr(), kp))
    return y


def mx_fake_quantize(x: torch.Tensor, axis: int, element_dtype: str, block_size: int, rounding_mode: int,
                     keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """OCP MX quantize-dequantize (MXINT8, MXFP8 E4M3 / E5M2, MXFP6 E3M2 / E2M3, MXFP4; docs/numerics.md sections 4
    and 7) of ``x`` along ``axis`` in blocks of ``block_size``, bit for bit
    :func:`qtorch_onnx.formats.mx.mx_reference`'s result (a new float32 tensor of ``x``'s shape), its
    straight-through mask into ``keep`` when given (1.0 where the element did not saturate, or is Inf / NaN), as
    :func:`bfp_fake_quantize`. ``rounding_mode``: int8 elements only (values other than 0 / 1 / 2 behave as 0).

    Raises:
        ValueError: as :func:`bfp_fake_quantize`, or an unknown ``element_dtype``.
    """
    from .formats.mx import MX_ELEMENTS

    if element_dtype not in MX_ELEMENTS:
        raise ValueError(f"mx_fake_quantize: element_dtype {element_dtype!r}; valid: {', '.join(MX_ELEMENTS)}")
    el = MX_ELEMENTS[element_dtype]
    lib, outer, n, inner = _block_layout(x, axis, "mx_fake_quantize")
    y = torch.empty_like(x)
    kp = None if keep is None else keep.data_ptr()
    _run_rows(x, outer, lib.qt_mx_values,
              lambda i, a, b: (a, b, n, inner, int(block_size), int(el.is_int), el.mbits, el.bias, el.emax,
                               float(el.max_norm), int(rounding_mode), x.data_ptr(), y.data_ptr(), kp))
    return y


def block_format_covered(fmt) -> bool:
    """Whether a kernel here computes the block format ``fmt`` (a ``BFPFormat`` or ``MXFormat``): OCP MX, BFP
    (``to_bfp``) and BFP-prime with blocks of at most ``PRIME_MAX_BLOCK``, none with the bfloat16 conversion."""
    if getattr(fmt, "element_dtype", None) is not None:
        return True
    if getattr(fmt, "bfp_method", None) is None or fmt.convert_to_bfloat_before_bfp:
        return False
    return fmt.bfp_method == "to_bfp" or fmt.block_size <= PRIME_MAX_BLOCK


def block_fake_quantize(x: torch.Tensor, fmt, axis: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` fake-quantized in the block format ``fmt`` along ``axis`` (``0 .. rank - 1``) by the kernel for it
    (:func:`mx_fake_quantize`, :func:`bfp_fake_quantize` or :func:`bfp_prime_fake_quantize`, with ``fmt``'s
    attributes), its straight-through mask into ``keep`` when given.

    Raises:
        ValueError: ``fmt`` not covered (:func:`block_format_covered`), or as the kernel.
    """
    if not block_format_covered(fmt):
        raise ValueError(f"block_fake_quantize: format {getattr(fmt, 'name', fmt)!r} is not covered by the C kernels "
                         "(the bfloat16 conversion, or a BFP-prime block past PRIME_MAX_BLOCK)")
    if getattr(fmt, "element_dtype", None) is not None:
        return mx_fake_quantize(x, axis, fmt.element_dtype, fmt.block_size, fmt.rounding_mode, keep=keep)
    if fmt.bfp_method == "to_bfp":
        return bfp_fake_quantize(x, axis, fmt.block_size, fmt.bit_width, fmt.rounding_mode, keep=keep)
    return bfp_prime_fake_quantize(x, axis, fmt.block_size, fmt.bit_width, fmt.rounding_mode, fmt.sub_block_size,
                                   fmt.sub_block_shift_bits, keep=keep)
