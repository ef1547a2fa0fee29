"""BF16 and FP16 reference functions (docs/numerics.md section 3).

Pure torch, vectorized, any device. Inputs of any float dtype are converted to float32 first; outputs are
float32 tensors holding exactly representable BF16 / FP16 values (the "fake" form), except for the storage
functions :func:`bf16_quantize` / :func:`fp16_quantize` that return real ``torch.bfloat16`` / ``torch.float16``.

NaN conventions (measured on ONNX Runtime 1.31 and recorded in the golden vectors, bit for bit):

* ONNX Runtime ``Cast(to=BFLOAT16)``: round to nearest even on the float32 bit pattern; every NaN becomes
  the canonical quiet NaN *with its sign kept* (0x7FC0 / 0xFFC0). :func:`bf16_round` does exactly this.
  (torch's own ``.to(torch.bfloat16)`` turns NaN into 0xFFFF on CPU in torch 2.x, so it is not used.)
* Quark's ExtendedQuantizeLinear to bfloat16 computes ``bf16(x / scale + zero_point)`` in float32 and writes
  NaN as 0x7FC1; its ExtendedDequantizeLinear computes ``(float(q) - float(zp)) * scale`` and writes every
  NaN as 0x7FC00000 (golden README item 5). :func:`bf16_quantize` / :func:`bf16_dequantize` follow it.
* FP16: ``Clip(-65504, 65504)`` then IEEE round to nearest even (float32 -> float16); NaN stays NaN (its
  payload after ONNX Runtime's Cast depends on buffer position, golden README item 4, so only NaN-ness is
  part of the contract). Quark's float16 Q/DQ path ignores scale and zero point.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..errors import ConfigError

__all__ = [
    "bf16_round",
    "bf16_round_ste",
    "bf16_quantize",
    "bf16_dequantize",
    "fp16_round",
    "fp16_round_ste",
    "fp16_quantize",
    "fp16_dequantize",
    "scaled_bf16",
    "scaled_bf16_ste",
    "FP16_MAX",
]

FP16_MAX = 65504.0

TensorLike = Union[torch.Tensor, float, int]


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _bf16_bits_rne(x: torch.Tensor, nan_bits: Optional[int]) -> torch.Tensor:
    """float32 -> int32 holding the 16 bits of the BF16 result (round to nearest even on the bit pattern).

    ``nan_bits=None``: NaN -> sign | 0x7FC0 (ONNX Runtime Cast). Otherwise NaN -> ``nan_bits``.
    torch's own float32 -> bfloat16 conversion is RNE with overflow to Inf and kept subnormals (checked bit
    for bit against :func:`_bf16_bits_oracle` and ONNX Runtime in the tests) and about 9x faster than the
    integer formulation on CPU; only its NaN encoding differs, so NaNs are patched afterwards.
    """
    xf = _f32(x)
    r = xf.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    nan = torch.isnan(xf)
    if nan_bits is None:
        nb = ((xf.view(torch.int32) >> 16) & 0x8000) | 0x7FC0
    else:
        nb = torch.full_like(r, nan_bits)
    return torch.where(nan, nb, r)


def _bf16_bits_oracle(x: torch.Tensor) -> torch.Tensor:
    """Integer reference of :func:`_bf16_bits_rne` (``nan_bits=None``): ``(u + 0x7FFF + lsb) >> 16``."""
    u = _f32(x).contiguous().view(torch.int32)
    # int32 arithmetic wraps modulo 2^32; only NaN patterns could carry past the sign bit and they are replaced.
    lsb = (u >> 16) & 1
    r = ((u + (0x7FFF + lsb)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, ((u >> 16) & 0x8000) | 0x7FC0, r)


def _bits_to_f32(b: torch.Tensor) -> torch.Tensor:
    return (b << 16).view(torch.float32)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to BF16, returned as float32 (docs/numerics.md section 3; ONNX Runtime Cast, bit exact).

    Round to nearest even on the float32 bit pattern; overflow rounds to +-Inf; subnormals are kept
    (rounded, not flushed); NaN -> quiet NaN with the input's sign (0x7FC00000 / 0xFFC00000).

    Args:
        x: float tensor of any shape (not modified).
    Returns:
        float32 tensor of the same shape.
    """
    xf = _f32(x)
    y = xf.to(torch.bfloat16).to(torch.float32)
    nan = torch.isnan(xf)
    if bool(nan.any()):  # torch writes NaN as 0xFFFF: restore ONNX Runtime's sign | 0x7FC0
        nb = (xf.view(torch.int32) & torch.tensor(-0x80000000, dtype=torch.int32, device=xf.device)) | 0x7FC00000
        y = torch.where(nan, nb.view(torch.float32), y)
    return y


def fp16_round(x: torch.Tensor) -> torch.Tensor:
    """Clip to +-65504 then round to FP16 (IEEE RNE), returned as float32 (docs/numerics.md section 3).

    Float16 subnormals are produced as IEEE specifies (gradual underflow). NaN stays NaN (payload: torch's
    conversion keeps the top mantissa bits; only NaN-ness is contractual). +-Inf clip to +-65504.

    Args:
        x: float tensor of any shape (not modified).
    Returns:
        float32 tensor of the same shape.
    """
    return fp16_quantize(x).to(torch.float32)


def fp16_quantize(x: torch.Tensor) -> torch.Tensor:
    """Quark's ExtendedQuantizeLinear to float16 (scale and zero point ignored): ``float16(clip(x, +-65504))``.

    Returns a ``torch.float16`` tensor. ``torch.clamp`` propagates NaN (as the golden vectors require).
    """
    return _f32(x).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def fp16_dequantize(q: torch.Tensor) -> torch.Tensor:
    """Quark's ExtendedDequantizeLinear from float16: a Cast to float32 (scale and zero point ignored).

    Exact widening. NaN payloads: ONNX Runtime quiets a signalling float16 NaN or not depending on the
    element's position in the buffer (golden README item 4); only NaN-ness is contractual.
    """
    if q.dtype != torch.float16:
        raise ConfigError(f"fp16_dequantize expects a float16 tensor, got {q.dtype}")
    return q.to(torch.float32)


def _param(p: TensorLike, x: torch.Tensor, axis: Optional[int], what: str) -> torch.Tensor:
    t = p if isinstance(p, torch.Tensor) else torch.tensor(p)
    t = t.to(device=x.device)
    if t.numel() == 1 and t.dim() <= 1:
        return t.reshape(())
    if t.dim() != 1 or axis is None:
        raise ConfigError(f"{what}: expected a scalar or a 1-D per-channel tensor with an axis, got shape "
                          f"{tuple(t.shape)} and axis={axis}")
    nd = x.dim()
    if not -nd <= axis < nd:
        raise ConfigError(f"{what}: axis {axis} out of range for rank {nd}")
    ax = axis % nd
    if t.shape[0] != x.shape[ax]:
        raise ConfigError(f"{what}: {t.shape[0]} values but the input has {x.shape[ax]} along axis {axis}")
    shape = [1] * nd
    shape[ax] = t.shape[0]
    return t.reshape(shape)


def _zp_f32(zero_point: Optional[TensorLike], x: torch.Tensor, axis: Optional[int]) -> torch.Tensor:
    if zero_point is None:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    z = _param(zero_point, x, axis, "bf16 zero_point")
    if z.dtype == torch.bfloat16:
        return z.to(torch.float32)
    if z.is_floating_point():
        return z.to(torch.float32)
    raise ConfigError(f"bf16 zero_point must be a bfloat16 (or float) tensor, got {z.dtype}")


def bf16_quantize(x: torch.Tensor, scale: TensorLike = 1.0, zero_point: Optional[TensorLike] = None,
                  axis: Optional[int] = None) -> torch.Tensor:
    """Quark's ExtendedQuantizeLinear to bfloat16: ``bf16(x / scale + zero_point)`` (float32 arithmetic, RNE).

    Args:
        x: float tensor (not modified). scale: float32 scalar or 1-D along ``axis``.
        zero_point: bfloat16 (or float) scalar / 1-D tensor; None for +0.0.
    Returns:
        ``torch.bfloat16`` tensor; NaN is written as 0x7FC1 (Quark / ONNX Runtime ``BFloat16`` NaN).
    Raises:
        ConfigError: malformed scale / zero point.
    """
    s = _param(scale, x, axis, "bf16 scale").to(torch.float32)
    z = _zp_f32(zero_point, x, axis)
    v = _f32(x) / s + z
    return _bf16_bits_rne(v, 0x7FC1).to(torch.int16).view(torch.bfloat16)


def bf16_dequantize(q: torch.Tensor, scale: TensorLike = 1.0, zero_point: Optional[TensorLike] = None,
                    axis: Optional[int] = None) -> torch.Tensor:
    """Quark's ExtendedDequantizeLinear from bfloat16: ``(float(q) - float(zero_point)) * scale`` in float32;
    every NaN result is written as 0x7FC00000 (golden README item 5).

    Args:
        q: ``torch.bfloat16`` tensor. scale / zero_point / axis: as :func:`bf16_quantize`.
    Returns:
        float32 tensor.
    """
    if q.dtype != torch.bfloat16:
        raise ConfigError(f"bf16_dequantize expects a bfloat16 tensor, got {q.dtype}")
    s = _param(scale, q, axis, "bf16 scale").to(torch.float32)
    z = _zp_f32(zero_point, q, axis)
    qf = (q.view(torch.int16).to(torch.int32) & 0xFFFF) << 16
    y = (qf.view(torch.float32) - z) * s
    qnan = torch.tensor(0x7FC00000, dtype=torch.int32, device=y.device).view(torch.float32)
    return torch.where(torch.isnan(y), qnan, y)


def scaled_bf16(x: torch.Tensor, scale: TensorLike = 1.0, form: str = "qdq", axis: Optional[int] = None,
                inv_scale: Optional[TensorLike] = None) -> torch.Tensor:
    """Scaled BF16 fake quantization (docs/numerics.md section 3), float32 in, float32 out.

    * ``form="qdq"`` (Quark ExtendedQuantizeLinear/ExtendedDequantizeLinear, zero point +0.0):
      ``y = float(bf16(x / scale + 0.0)) * scale``, NaN -> 0x7FC00000. With scale 1.0 this is :func:`bf16_round`
      except that NaN loses its sign and -0.0 becomes +0.0 (the ``+ 0.0`` of the zero point).
    * ``form="cast"`` (what ``BF16QDQToCast`` exports: ``Mul(x, 1/scale) -> Cast(BFLOAT16) -> Cast(FLOAT) ->
      Mul(scale)``, the Muls only when the scale is not 1): ``y = bf16_round(x * inv_scale) * scale`` with
      ``inv_scale = float32(1 / scale)`` (float32 division) unless given explicitly (pass the exact constant
      the exporter writes). May differ from the qdq form in the last bit when the scale is not a power of two.

    Args:
        x: float tensor. scale: positive float32 scalar or 1-D along ``axis``.
    Raises:
        ConfigError: unknown ``form`` or malformed scale.
    """
    if form == "qdq":
        return bf16_dequantize(bf16_quantize(x, scale, None, axis), scale, None, axis)
    if form == "cast":
        s = _param(scale, x, axis, "scaled_bf16 scale").to(torch.float32)
        if inv_scale is None:
            if bool((s == 1.0).all()):
                return bf16_round(x)
            inv = 1.0 / s
        else:
            inv = _param(inv_scale, x, axis, "scaled_bf16 inv_scale").to(torch.float32)
        return bf16_round(_f32(x) * inv) * s
    raise ConfigError(f"scaled_bf16: unknown form {form!r}; valid: 'qdq', 'cast'")


class _PassThrough(torch.autograd.Function):
    """Forward: a precomputed value; backward: gradient times a mask (1 where not saturated)."""

    @staticmethod
    def forward(ctx, x, y, mask):
        ctx.save_for_backward(mask)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        (mask,) = ctx.saved_tensors
        return torch.where(mask, gy, torch.zeros_like(gy)).to(ctx.in_dtype), None, None


def straight_through(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return ``y`` exactly (same bits, unlike ``x + (y - x).detach()``, which rounds) with the straight-through
    gradient ``dL/dx = dL/dy`` where ``mask`` (bool, ``x``'s shape) and 0 elsewhere (docs/numerics.md section 8)."""
    return _PassThrough.apply(x, y, mask)


def bf16_round_ste(x: torch.Tensor) -> torch.Tensor:
    """:func:`bf16_round` with a straight-through gradient of 1 everywhere (BF16 never saturates: overflow is
    Inf; docs/numerics.md section 8)."""
    with torch.no_grad():
        y = bf16_round(x)
        mask = torch.ones_like(y, dtype=torch.bool)
    return _PassThrough.apply(x, y, mask)


def fp16_round_ste(x: torch.Tensor) -> torch.Tensor:
    """:func:`fp16_round` with the STE: gradient 1, 0 where ``|x| > 65504`` was clipped (NaN/Inf pass 1)."""
    with torch.no_grad():
        y = fp16_round(x)
        xf = _f32(x)
        mask = (xf.abs() <= FP16_MAX) | ~torch.isfinite(xf)
    return _PassThrough.apply(x, y, mask)


def scaled_bf16_ste(x: torch.Tensor, scale: TensorLike = 1.0, form: str = "qdq", axis: Optional[int] = None,
                    inv_scale: Optional[TensorLike] = None) -> torch.Tensor:
    """:func:`scaled_bf16` with a straight-through gradient of 1 with respect to ``x`` (no saturation)."""
    with torch.no_grad():
        y = scaled_bf16(x, scale, form, axis, inv_scale)
        mask = torch.ones_like(y, dtype=torch.bool)
    return _PassThrough.apply(x, y, mask)
