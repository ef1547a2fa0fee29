"""Block floating point reference functions: BFP (``to_bfp``) and BFP-prime / microexponents (``to_bfp_prime``).

Bit-exact torch references of Quark 0.13's ``BFPQuantizeDequantize`` operator, written from
``docs/numerics.md`` sections 4 (layout), 5 (BFP) and 6 (BFP-prime: MX4/MX6/MX9, arXiv 2302.08007). Pure torch,
any device, fully vectorized (no Python loop over blocks). Imports torch only.

Public:
    :func:`validate_bfp_attributes` -- build-time attribute check, returns a :class:`BFPFormat`.
    :func:`bfp_reference` -- forward quantize-dequantize, optionally with the straight-through mask.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError, closest
from .block import as_float32, bfloat16_round, exp2_int, exponent_field, normalize_axis, round_with_mode, to_blocks
from .spec import BFPFormat

__all__ = ["BFP_METHODS", "validate_bfp_attributes", "bfp_reference", "MIN_BIT_WIDTH", "MAX_BIT_WIDTH"]

#: Accepted ``bfp_method`` values; ``to_bfp_prime_shared`` is Quark's alias of ``to_bfp_prime``.
BFP_METHODS = ("to_bfp", "to_bfp_prime", "to_bfp_prime_shared")
#: ``bit_width`` includes the 8-bit shared exponent and the sign: m = bit_width - 9 magnitude bits, 1..23.
MIN_BIT_WIDTH = 10
MAX_BIT_WIDTH = 32


def _check_int(name: str, value, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"attribute {name!r}={value!r} must be an integer")
    if value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"attribute {name!r}={value!r} is out of range; valid: integers {rng}")
    return value


def validate_bfp_attributes(bfp_method: str = "to_bfp", bit_width: int = 16, block_size: int = 8,
                            rounding_mode: int = 0, sub_block_size: int = 2, sub_block_shift_bits: int = 1,
                            convert_to_bfloat_before_bfp: int = 0) -> BFPFormat:
    """Check the attributes of a BFP / BFP-prime quantizer (docs/numerics.md section 4, docs/operators.md) at build time.

    Defaults mirror the ``BFPQuantizeDequantize`` operator. ``axis`` is checked at call time (it needs the
    rank): see :func:`qtorch_onnx.formats.block.normalize_axis`.

    Returns:
        The frozen :class:`~qtorch_onnx.formats.spec.BFPFormat`, with ``to_bfp_prime_shared`` normalized
        to ``to_bfp_prime`` (identical numerics, checked against Quark's golden vectors).
    Raises:
        ConfigError: naming the attribute and the valid values: unknown ``bfp_method``; ``bit_width``
            outside [10, 32] (at least one magnitude bit, at most a float32 significand);
            ``block_size``/``sub_block_size`` not positive; ``rounding_mode`` not 0/1/2;
            ``sub_block_shift_bits`` outside [1, 8]; for prime, ``block_size`` not a multiple of
            ``sub_block_size``; ``convert_to_bfloat_before_bfp`` not 0/1.
    """
    if not isinstance(bfp_method, str) or bfp_method not in BFP_METHODS:
        hint = closest(bfp_method, BFP_METHODS) if isinstance(bfp_method, str) else ""
        raise ConfigError(f"attribute 'bfp_method'={bfp_method!r} is unknown{hint}; valid: {', '.join(BFP_METHODS)}")
    method = "to_bfp_prime" if bfp_method == "to_bfp_prime_shared" else bfp_method
    _check_int("bit_width", bit_width, MIN_BIT_WIDTH, MAX_BIT_WIDTH)
    _check_int("block_size", block_size, 1)
    if isinstance(rounding_mode, bool) or rounding_mode not in (0, 1, 2):
        raise ConfigError(f"attribute 'rounding_mode'={rounding_mode!r} is invalid; valid: 0 (half away from zero), "
                          f"1 (half toward +infinity), 2 (half to even)")
    _check_int("sub_block_size", sub_block_size, 1)
    _check_int("sub_block_shift_bits", sub_block_shift_bits, 1, 8)
    if isinstance(convert_to_bfloat_before_bfp, bool) or convert_to_bfloat_before_bfp not in (0, 1):
        raise ConfigError(f"attribute 'convert_to_bfloat_before_bfp'={convert_to_bfloat_before_bfp!r} is invalid; "
                          f"valid: 0, 1")
    if method == "to_bfp_prime" and block_size % sub_block_size:
        raise ConfigError(f"attribute 'block_size'={block_size} is not a multiple of 'sub_block_size'="
                          f"{sub_block_size} (required by bfp_method {bfp_method!r}); valid: block sizes "
                          f"{sub_block_size}, {2 * sub_block_size}, {3 * sub_block_size}, ...")
    return BFPFormat(method, bit_width, block_size, rounding_mode, sub_block_size, sub_block_shift_bits,
                     convert_to_bfloat_before_bfp)


def _bfp_blocks(xb: torch.Tensor, m: int, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/numerics.md section 5 on ``xb`` float32 ``(..., n_blocks, block_size)``; returns (y, not-clipped mask)."""
    e = exponent_field(xb)
    special = e == 255
    shared = torch.where(special, torch.zeros_like(e), e).amax(dim=-1, keepdim=True)
    step = exp2_int(shared - 127 - (m - 1))  # float32, possibly subnormal, exact
    r = round_with_mode(xb / step, mode)  # division by a power of two: exact
    lim = float((1 << m) - 1)
    clipped = r.abs() > lim
    y = torch.clamp(r, -lim, lim) * step  # |k| < 2^23: exact product
    y = torch.where(special, xb, y)
    return y, ~(clipped & ~special)


def _bfp_prime_blocks(xb: torch.Tensor, m: int, mode: int, sub_block_size: int,
                      shift_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/numerics.md section 6 on ``xb`` float32 ``(..., n_blocks, block_size)``; returns (y, not-saturated mask)."""
    bits = xb.view(torch.int32)
    e = exponent_field(xb)
    shared = e.amax(dim=-1, keepdim=True)  # Inf/NaN included (E = 255)
    lead = e.shape[:-1]
    n_sub = e.shape[-1] // sub_block_size
    e_sub = e.reshape(*lead, n_sub, sub_block_size).amax(dim=-1, keepdim=True)
    shift = torch.clamp(shared.unsqueeze(-1) - e_sub, max=(1 << shift_bits) - 1)
    shift = shift.expand(*lead, n_sub, sub_block_size).reshape(e.shape)
    # int32 throughout: mant < 2^24 and shifts are clamped to 31 (a shift above 25 leaves q = 0, rem = mant
    # and half = 2^(t-1) > mant either way), so nothing overflows
    mant = torch.where(e != 0, (bits & 0x7FFFFF) | 0x800000, torch.zeros_like(e))
    t = torch.clamp(shared - shift - e + (24 - m), max=31)  # >= 24 - m >= 1
    q = torch.bitwise_right_shift(mant, t)
    rem = mant - torch.bitwise_left_shift(q, t)
    half = torch.bitwise_left_shift(torch.ones_like(t), t - 1)
    if mode == 0:
        up = rem >= half
    elif mode == 1:
        up = (rem > half) | ((rem == half) & (bits >= 0))
    else:
        up = (rem > half) | ((rem == half) & (torch.bitwise_and(q, 1) == 1))
    qmax = (1 << m) - 1
    saturated = up & (q == qmax)
    q = q + (up & ~saturated).to(torch.int32)
    # y = q * 2^k, k = S - 127 - shift + 1 - m >= -155: an exact product by 2^max(k, -126) then one
    # correctly rounded product by 2^(k - max(k, -126)) (float32 round to nearest even into subnormals).
    k = shared - 127 - shift + 1 - m
    k_hi = torch.clamp(k, min=-126)
    mag = (q.to(torch.float32) * exp2_int(k_hi)) * exp2_int(k - k_hi)
    y = torch.copysign(mag, xb)
    nan_bits = torch.full_like(bits, 0x7FFFFFFF).view(torch.float32)
    y = torch.where(shared == 255, nan_bits, y)
    # NaN/Inf inputs pass gradient 1 (docs/numerics.md section 8): their mantissa bits are a payload, and a
    # payload is not a saturation (a GPU widening float16 NaN to float32 sets every mantissa bit)
    return y, ~saturated | (e == 255)


def bfp_reference(x: torch.Tensor, *, bfp_method: str = "to_bfp", axis: int = 1, bit_width: int = 16,
                  block_size: int = 8, rounding_mode: int = 0, sub_block_size: int = 2,
                  sub_block_shift_bits: int = 1, convert_to_bfloat_before_bfp: int = 0,
                  return_mask: bool = False, validate: bool = True):
    """BFP / BFP-prime quantize-dequantize, bit-exact with Quark 0.13 ``BFPQuantizeDequantize``.

    Formulas: docs/numerics.md sections 4 (layout, one-element rule, float16), 5 (``to_bfp``: shared exponent
    = max E over finite elements, step ``2^(S-127-(m-1))``, clamp to ``(2^m-1)*step``, Inf/NaN pass
    through) and 6 (``to_bfp_prime``: sub-block micro-exponent shifts, integer rounding of the 24-bit
    significand, subnormals flush to signed zero, any Inf/NaN makes the whole block 0x7FFFFFFF NaN).
    ``m = bit_width - 9`` magnitude bits.

    Args:
        x: float32, float16 or bfloat16 (torch only) tensor, any shape, any device. Never modified; the result is detached (the
            differentiable straight-through version is in :mod:`qtorch_onnx.ops`).
        bfp_method: ``"to_bfp"``, ``"to_bfp_prime"`` or its alias ``"to_bfp_prime_shared"``.
        axis: block axis, negative allowed; ignored for rank <= 1.
        bit_width, block_size, rounding_mode, sub_block_size, sub_block_shift_bits,
        convert_to_bfloat_before_bfp: as the ONNX operator (docs/operators.md); see :func:`validate_bfp_attributes`.
        return_mask: also return the straight-through mask (docs/numerics.md section 8).
        validate: check the attributes (skip only when already validated).
    Returns:
        ``y`` with ``x``'s shape and dtype (float16 results rounded to nearest even from float32), or
        ``(y, mask)`` where ``mask`` (bool, ``x``'s shape) is False exactly where saturation clipped the
        element (BFP clamp to ``(2^m-1)*step``; prime: a round-up suppressed at ``q = 2^m-1``).
    Raises:
        ConfigError: invalid attribute (see :func:`validate_bfp_attributes`) or ``axis`` out of range.
        DataError: ``x`` not a float32/float16/bfloat16 tensor.
    """
    if validate:
        fmt = validate_bfp_attributes(bfp_method, bit_width, block_size, rounding_mode, sub_block_size,
                                      sub_block_shift_bits, convert_to_bfloat_before_bfp)
        bfp_method = fmt.bfp_method
    elif bfp_method == "to_bfp_prime_shared":
        bfp_method = "to_bfp_prime"
    x = x.detach() if isinstance(x, torch.Tensor) else x  # a reference, not differentiable: see qtorch_onnx.ops
    xf, dtype = as_float32(x, "BFPQuantizeDequantize")
    ax = normalize_axis(axis, x.dim())
    if convert_to_bfloat_before_bfp:  # before the one-element rule (Quark golden: [1.0039062] -> [1.0])
        xf = bfloat16_round(xf)
    if x.numel() <= 1:  # docs/numerics.md section 4: a one-element tensor is returned unchanged
        y = xf.to(dtype) if convert_to_bfloat_before_bfp else x.clone()
        return (y, torch.ones_like(x, dtype=torch.bool)) if return_mask else y
    xf = xf.contiguous()
    m = bit_width - 9
    if x.dim() == 0:
        xf = xf.reshape(1)
    blocks, restore = to_blocks(xf, ax, block_size)
    if bfp_method == "to_bfp":
        yb, keep = _bfp_blocks(blocks, m, rounding_mode)
    else:
        yb, keep = _bfp_prime_blocks(blocks, m, rounding_mode, sub_block_size, sub_block_shift_bits)
    y = restore(yb).reshape(x.shape)
    if dtype != torch.float32:
        y = y.to(dtype)
    if return_mask:
        return y, restore(keep).reshape(x.shape)
    return y
