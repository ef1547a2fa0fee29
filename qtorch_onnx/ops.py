"""Public functional API of the block formats: differentiable BFP / BFP-prime / OCP MX quantize-dequantize.

Each function mirrors one ONNX operator of Quark 0.13 (docs/operators.md: ``com.amd.quark::BFPQuantizeDequantize`` and
``com.amd.quark::MXQuantizeDequantize``), with the same attribute names and defaults, and the numerics of
docs/numerics.md sections 4-7 (bit-exact with Quark's operators). Gradients follow the straight-through
estimator of docs/numerics.md section 8.

Example::

    y = bfp_quantize_dequantize(x, bit_width=16, block_size=8, rounding_mode=2)       # BFP16
    y = bfp_quantize_dequantize(x, bfp_method="to_bfp_prime", bit_width=13,
                                block_size=16, rounding_mode=2)                      # MX6
    y = mx_quantize_dequantize(x, element_dtype="fp4_e2m1", axis=-1)                 # MXFP4
"""
from __future__ import annotations

import torch

import os

from .errors import ConfigError, UnsupportedFeatureError
from .formats.bfp import bfp_reference, validate_bfp_attributes
from .formats.mx import mx_reference, validate_mx_attributes

__all__ = ["bfp_quantize_dequantize", "mx_quantize_dequantize", "validate_bfp_attributes", "validate_mx_attributes",
           "BACKENDS", "resolve_backend"]

#: ``"auto"``: the Triton kernels for CUDA tensors when triton imports, the torch reference otherwise;
#: ``"reference"``: always the torch reference; ``"triton"``: always the kernels (CUDA, or CPU under
#: ``TRITON_INTERPRET=1``). All give the same bits (tests/triton).
BACKENDS = ("auto", "reference", "triton")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
        return False
    return True


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """``"reference"`` or ``"triton"`` for tensor ``x`` under the requested ``backend`` (see ``BACKENDS``).

    Raises:
        ConfigError: ``backend`` is not one of ``BACKENDS``.
        UnsupportedFeatureError: ``"triton"`` requested but triton is not installed, or ``x`` is on the CPU
            without ``TRITON_INTERPRET=1``.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"block quantize-dequantize: unknown backend {backend!r}; valid: {BACKENDS}")
    if backend == "reference":
        return backend
    if backend == "auto":
        return "triton" if isinstance(x, torch.Tensor) and x.is_cuda and _triton_available() else "reference"
    if not _triton_available():
        raise UnsupportedFeatureError("backend='triton' needs the triton package (pip install triton)")
    if not (isinstance(x, torch.Tensor) and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")):
        raise UnsupportedFeatureError(f"backend='triton' needs a CUDA tensor (got one on {x.device}) or "
                                      "TRITON_INTERPRET=1 for the CPU interpreter; use backend='reference'")
    return backend


def _kernel(family: str, backend: str):
    """The forward function of ``family`` ("bfp"/"mx") for a resolved backend, with the reference's call
    signature (``x, *, return_mask, validate, **attributes``)."""
    if backend == "reference":
        return bfp_reference if family == "bfp" else mx_reference
    from .triton_kernels import bfp as _tbfp, mx as _tmx

    fn = _tbfp.bfp_quantize_dequantize_triton if family == "bfp" else _tmx.mx_quantize_dequantize_triton

    def call(x, *, return_mask=False, validate=True, **kw):  # attributes were validated by the caller
        return fn(x, return_mask=return_mask, **kw)

    return call


class _StraightThrough(torch.autograd.Function):
    """``y = f(x)`` with ``dy/dx = mask`` (1 where representable without saturation, else 0)."""

    @staticmethod
    def forward(ctx, x, fn, kwargs):  # noqa: D401 - autograd hook
        y, mask = fn(x.detach(), return_mask=True, validate=False, **kwargs)
        ctx.save_for_backward(mask)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (mask,) = ctx.saved_tensors
        return grad_y * mask.to(grad_y.dtype), None, None


def _apply(x: torch.Tensor, fn, kwargs: dict) -> torch.Tensor:
    if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
        return _StraightThrough.apply(x, fn, kwargs)
    return fn(x, validate=False, **kwargs)


def bfp_quantize_dequantize(x: torch.Tensor, *, bfp_method: str = "to_bfp", axis: int = 1, bit_width: int = 16,
                            block_size: int = 8, rounding_mode: int = 0, sub_block_size: int = 2,
                            sub_block_shift_bits: int = 1, convert_to_bfloat_before_bfp: int = 0,
                            backend: str = "auto") -> torch.Tensor:
    """Block floating point fake quantization (BFP, or BFP-prime = MX4/MX6/MX9), differentiable.

    Numerics: docs/numerics.md sections 4-6, bit-exact with Quark 0.13 ``BFPQuantizeDequantize`` (defaults are
    the operator's: BFP16 is ``bit_width=16, block_size=8, rounding_mode=2``; MX4/MX6/MX9 are
    ``bfp_method="to_bfp_prime", bit_width=11/13/16, block_size=16, rounding_mode=2``).

    Args:
        x: float32, float16 or bfloat16 (torch only) tensor, any shape and device. Not modified.
        bfp_method: ``"to_bfp"``, ``"to_bfp_prime"`` (alias ``"to_bfp_prime_shared"``).
        axis: block axis (negative allowed; ignored for rank 1).
        bit_width: shared 8-bit exponent + sign + ``bit_width - 9`` magnitude bits, 10..32.
        block_size: elements per block along ``axis`` (the last block is zero-padded).
        rounding_mode: 0 half away from zero, 1 half toward +inf, 2 half to even.
        sub_block_size, sub_block_shift_bits: prime only (micro-exponent sub-blocks and shift width).
        convert_to_bfloat_before_bfp: 1 rounds the input to bfloat16 first (on a copy).
        backend: ``"auto"`` (Triton on CUDA, else the torch reference), ``"reference"`` or ``"triton"``;
            every backend gives the same bits (see :func:`resolve_backend`).
    Returns:
        Tensor of ``x``'s shape and dtype. Gradient (docs/numerics.md section 8): 1 where the value was
        representable without saturation (NaN/Inf elements included), 0 where saturation clipped it.
    Raises:
        qtorch_onnx.errors.ConfigError: an invalid attribute, named with its valid values.
        qtorch_onnx.errors.DataError: ``x`` is not a float32/float16/bfloat16 tensor.
        qtorch_onnx.errors.UnsupportedFeatureError: ``backend="triton"`` where Triton cannot run.
    """
    fmt = validate_bfp_attributes(bfp_method, bit_width, block_size, rounding_mode, sub_block_size,
                                  sub_block_shift_bits, convert_to_bfloat_before_bfp)
    kwargs = dict(bfp_method=fmt.bfp_method, axis=axis, bit_width=bit_width, block_size=block_size,
                  rounding_mode=rounding_mode, sub_block_size=sub_block_size,
                  sub_block_shift_bits=sub_block_shift_bits, convert_to_bfloat_before_bfp=convert_to_bfloat_before_bfp)
    return _apply(x, _kernel("bfp", resolve_backend(backend, x)), kwargs)


def mx_quantize_dequantize(x: torch.Tensor, *, element_dtype: str = "int8", axis: int = 1, block_size: int = 32,
                           rounding_mode: int = 0, backend: str = "auto") -> torch.Tensor:
    """OCP microscaling fake quantization (MXINT8, MXFP8 E4M3/E5M2, MXFP6 E3M2/E2M3, MXFP4), differentiable.

    Numerics: docs/numerics.md sections 4 and 7, bit-exact with Quark 0.13 ``MXQuantizeDequantize`` (shared
    scale ``2^(floor(log2 amax) - emax)`` not clamped to E8M0; Inf/NaN pass through; elements saturate).

    Args:
        x: float32, float16 or bfloat16 (torch only) tensor, any shape and device. Not modified.
        element_dtype: ``int8``, ``fp8_e4m3``, ``fp8_e5m2``, ``fp6_e3m2``, ``fp6_e2m3``, ``fp4_e2m1``.
        axis: block axis (negative allowed; ignored for rank 1).
        block_size: elements per block along ``axis`` (the last block is zero-padded).
        rounding_mode: int8 elements only (0/1/2; other integers behave as 0); FP elements round half to even.
        backend: as :func:`bfp_quantize_dequantize`.
    Returns:
        Tensor of ``x``'s shape and dtype. Gradient: 1 except where the element saturated (0).
    Raises:
        qtorch_onnx.errors.ConfigError: an invalid attribute, named with its valid values.
        qtorch_onnx.errors.DataError: ``x`` is not a float32/float16/bfloat16 tensor.
        qtorch_onnx.errors.UnsupportedFeatureError: ``backend="triton"`` where Triton cannot run.
    """
    validate_mx_attributes(element_dtype, block_size, rounding_mode)
    kwargs = dict(element_dtype=element_dtype, axis=axis, block_size=block_size, rounding_mode=rounding_mode)
    return _apply(x, _kernel("mx", resolve_backend(backend, x)), kwargs)
