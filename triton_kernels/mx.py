"""Triton kernel for OCP MX quantize-dequantize (docs/numerics.md sections 4, 7, 8).

Bit-for-bit :func:`qtorch_onnx.formats.mx.mx_reference` (value and straight-through mask), any block axis
without a transposed copy (same ``(outer, n_axis, inner)`` tiling as :mod:`.bfp`). Divisions by the
power-of-two shared scale are correctly rounded products (``div_pow2``); element rounding is integer-exact.

Public: :func:`mx_quantize_dequantize_triton` (the backward is :func:`.bfp.ste_backward_triton`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # installed as qtorch_onnx.triton_kernels, or imported from the repository root as triton_kernels
    from .bfp import block_tile, check_input_dtype, row_max, _load_tile, apply_sign, block_view, div_pow2, exp2i, exponent_field, round_magnitude, tile_rows
except ImportError:  # pragma: no cover
    from bfp import block_tile, check_input_dtype, row_max, _load_tile, apply_sign, block_view, div_pow2, exp2i, exponent_field, round_magnitude, tile_rows

__all__ = ["mx_quantize_dequantize_triton"]


@triton.jit
def _mx_kernel(x_ptr, y_ptr, keep_ptr, n_rows, n_axis, inner, n_blk,
               IS_INT: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
               MAX_NORM: tl.constexpr, MODE: tl.constexpr, WRITE_MASK: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    rows, j, a = block_tile(n_blk, BLOCK_SIZE, BS, ROWS)
    x, offs, valid = _load_tile(x_ptr, rows, n_rows, n_axis, inner, a, j < BLOCK_SIZE, False)
    e = exponent_field(x)
    special = e == 255
    shared = row_max(tl.where(special, 0, e))
    ks = shared - 127 - EMAX  # X = 2^ks
    v = div_pow2(x, ks)
    if IS_INT:
        w = v * 64.0  # exact
        mag = round_magnitude(w, MODE)
        r = apply_sign(mag, w, MODE)
        clipped = (r > 127.0) | (r < -128.0)
        q = tl.minimum(tl.maximum(r, -128.0), 127.0) * 0.015625
    else:
        ev = tl.maximum(exponent_field(v) - 127, EMIN) - MBITS  # step = 2^ev
        u = div_pow2(v, ev)  # exact: scaling by a power of two, no underflow
        mag = round_magnitude(u, 2)
        qm = mag * exp2i(ev)
        clipped = qm > MAX_NORM
        qm = tl.minimum(qm, MAX_NORM)
        q = tl.where(u < 0, -qm, qm)
        q = tl.where(qm == 0, 0.0, q)  # every zero result is +0.0
    y = q * exp2i(ks)
    y = tl.where(special, x, y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=valid)  # round to nearest even when narrower
    if WRITE_MASK:
        tl.store(keep_ptr + offs, (~(clipped & ~special)).to(tl.int8), mask=valid)


def mx_quantize_dequantize_triton(x: torch.Tensor, *, element_dtype: str = "int8", axis: int = 1,
                                  block_size: int = 32, rounding_mode: int = 0, return_mask: bool = False,
                                  rows_per_program: int | None = None):
    """Triton OCP MX quantize-dequantize; same contract and result bits as ``mx_reference``.

    Args:
        x: float32 or float16 tensor on a Triton device (or CPU under ``TRITON_INTERPRET=1``).
        element_dtype, axis, block_size, rounding_mode: as :func:`qtorch_onnx.ops.mx_quantize_dequantize`.
        return_mask: also return the straight-through mask (bool, ``x``'s shape).
        rows_per_program: tile height override (power of two), for tests.
    Returns:
        ``y`` (``x``'s shape and dtype) or ``(y, mask)``.
    Raises:
        ConfigError / DataError: as the reference.
    """
    from qtorch_onnx.formats.block import normalize_axis
    from qtorch_onnx.formats.mx import MX_ELEMENTS, mx_reference, validate_mx_attributes

    validate_mx_attributes(element_dtype, block_size, rounding_mode)
    check_input_dtype(x, "MXQuantizeDequantize")
    ax = normalize_axis(axis, x.dim())
    if x.numel() <= 1:
        return mx_reference(x, element_dtype=element_dtype, axis=axis, block_size=block_size,
                            rounding_mode=rounding_mode, return_mask=return_mask, validate=False)
    elem = MX_ELEMENTS[element_dtype]
    xf = x.contiguous()  # float16/bfloat16 are read as they are and widened in the kernel
    outer, n_axis, inner = block_view(xf, ax)
    y = torch.empty_like(xf)
    keep = torch.empty(xf.shape, dtype=torch.int8, device=xf.device) if return_mask else y
    n_rows = outer * inner
    rows = rows_per_program or tile_rows(block_size, n_rows)
    n_blk = triton.cdiv(n_axis, block_size)
    _mx_kernel[(triton.cdiv(n_rows, rows) * n_blk,)](
        xf, y, keep, n_rows, n_axis, inner, n_blk,
        IS_INT=elem.is_int, MBITS=elem.mbits, EMIN=1 - elem.bias, EMAX=elem.emax, MAX_NORM=float(elem.max_norm),
        MODE=rounding_mode if rounding_mode in (0, 1, 2) else 0, WRITE_MASK=return_mask,
        BLOCK_SIZE=block_size, BS=triton.next_power_of_2(block_size), ROWS=rows)
    return (y, keep.bool()) if return_mask else y
