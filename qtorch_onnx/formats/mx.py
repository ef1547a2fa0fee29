"""OCP Microscaling (MX) reference function, bit-exact with Quark 0.13's ``MXQuantizeDequantize``.

Written from ``docs/numerics.md`` sections 4 (layout) and 7 (OCP MX v1.0 shared scale
``X = 2^(floor(log2 amax) - emax)``, element quantization to int8 / fp8_e4m3 / fp8_e5m2 / fp6_e3m2 /
fp6_e2m3 / fp4_e2m1 with saturation to max_norm). Pure torch, any device, fully vectorized. Imports torch
only.

Public:
    :data:`MX_ELEMENTS` -- element type table (layout, bias, emax, max_norm).
    :func:`validate_mx_attributes` -- build-time attribute check, returns an :class:`MXFormat`.
    :func:`mx_reference` -- forward quantize-dequantize, optionally with the straight-through mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError, closest
from .block import as_float32, exp2_int, exponent_field, normalize_axis, round_with_mode, to_blocks
from .spec import MXFormat

__all__ = ["MXElement", "MX_ELEMENTS", "validate_mx_attributes", "mx_reference", "quantize_mx_element"]


@dataclass(frozen=True)
class MXElement:
    """One MX element type (docs/numerics.md section 7 table; OCP MX v1.0 section 5.3).

    Attributes:
        name: the ``element_dtype`` attribute value.
        ebits, mbits: exponent and mantissa field widths (``ebits = 0`` for int8).
        bias: exponent bias (0 for int8).
        emax: exponent of the largest normal, used in the shared scale ``2^(S - 127 - emax)``.
        max_norm: largest finite magnitude (int8: 127/64 with the implicit scale 2^-6).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int
    max_norm: float

    @property
    def is_int(self) -> bool:
        return self.ebits == 0


MX_ELEMENTS: dict[str, MXElement] = {
    "int8": MXElement("int8", 0, 6, 0, 0, 127.0 / 64.0),
    "fp8_e4m3": MXElement("fp8_e4m3", 4, 3, 7, 8, 448.0),
    "fp8_e5m2": MXElement("fp8_e5m2", 5, 2, 15, 15, 57344.0),
    "fp6_e3m2": MXElement("fp6_e3m2", 3, 2, 3, 4, 28.0),
    "fp6_e2m3": MXElement("fp6_e2m3", 2, 3, 1, 2, 7.5),
    "fp4_e2m1": MXElement("fp4_e2m1", 2, 1, 1, 2, 6.0),
}


def validate_mx_attributes(element_dtype: str = "int8", block_size: int = 32, rounding_mode: int = 0) -> MXFormat:
    """Check the attributes of an MX quantizer (docs/numerics.md sections 4 and 7, docs/operators.md) at build time.

    Defaults mirror the ``MXQuantizeDequantize`` operator. ``rounding_mode`` only matters for int8
    elements; like Quark, any integer is accepted and values other than 0/1/2 behave as 0 (docs/numerics.md
    section 7). ``axis`` is checked at call time (it needs the rank).

    Returns:
        The frozen :class:`~qtorch_onnx.formats.spec.MXFormat`.
    Raises:
        ConfigError: unknown ``element_dtype`` (lists the valid ones), ``block_size`` not a positive
            integer, ``rounding_mode`` not an integer.
    """
    if not isinstance(element_dtype, str) or element_dtype not in MX_ELEMENTS:
        hint = closest(element_dtype, MX_ELEMENTS) if isinstance(element_dtype, str) else ""
        raise ConfigError(f"attribute 'element_dtype'={element_dtype!r} is unknown{hint}; valid: "
                          f"{', '.join(MX_ELEMENTS)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"attribute 'block_size'={block_size!r} is invalid; valid: integers >= 1")
    if isinstance(rounding_mode, bool) or not isinstance(rounding_mode, int):
        raise ConfigError(f"attribute 'rounding_mode'={rounding_mode!r} is invalid; valid: 0 (half away from zero), "
                          f"1 (half toward +infinity), 2 (half to even); other integers behave as 0")
    return MXFormat(element_dtype, block_size, rounding_mode)


def quantize_mx_element(v: torch.Tensor, elem: MXElement, rounding_mode: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize scaled values ``v = x / X`` to an MX element grid (docs/numerics.md section 7), in float32.

    FP elements: ``e = floor(log2|v|)``, ``step = 2^(max(e, 1 - bias) - mbits)``,
    ``q = round_half_even(v / step) * step`` (element subnormals kept), ``|q|`` clamped to ``max_norm``
    (never Inf/NaN), every zero result is +0.0 (also for ``v = -0.0``, as Quark's vectors record). int8: ``k = R(64 v)`` with the rounding
    mode, clamped to [-128, 127], ``q = k / 64``.

    Args:
        v: float32 tensor of finite values, any shape.
        elem: the element type.
        rounding_mode: int8 only (0/1/2, others behave as 0).
    Returns:
        ``(q, clipped)``: float32 values on the element grid, and a bool tensor True where the clamp
        changed the rounded value.
    """
    if elem.is_int:
        k = round_with_mode(v * 64.0, rounding_mode if rounding_mode in (0, 1, 2) else 0)
        clipped = (k > 127) | (k < -128)
        return torch.clamp(k, -128.0, 127.0) * (1.0 / 64.0), clipped
    e = exponent_field(v) - 127
    step = exp2_int(torch.clamp(e, min=1 - elem.bias) - elem.mbits)
    r = torch.round(v / step)  # round half to even; v / step is exact (power of two)
    q = torch.where(r == 0, torch.zeros_like(r), r) * step  # every zero result is +0.0 (-0.0 too)
    clipped = q.abs() > elem.max_norm
    q = torch.clamp(q, -elem.max_norm, elem.max_norm)
    return q, clipped


def _mx_blocks(xb: torch.Tensor, elem: MXElement, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/numerics.md section 7 on ``xb`` float32 ``(..., n_blocks, block_size)``; returns (y, not-clipped mask)."""
    e = exponent_field(xb)
    special = e == 255
    shared = torch.where(special, torch.zeros_like(e), e).amax(dim=-1, keepdim=True)
    scale = exp2_int(shared - 127 - elem.emax)  # >= 2^-142: exact float32 power of two
    q, clipped = quantize_mx_element(xb / scale, elem, mode)
    y = q * scale
    y = torch.where(special, xb, y)
    return y, ~(clipped & ~special)


def mx_reference(x: torch.Tensor, *, element_dtype: str = "int8", axis: int = 1, block_size: int = 32,
                 rounding_mode: int = 0, return_mask: bool = False, validate: bool = True):
    """OCP MX quantize-dequantize, bit-exact with Quark 0.13 ``MXQuantizeDequantize``.

    Formulas: docs/numerics.md section 4 (layout, one-element rule, float16 via float32) and 7: per block
    ``S = max E(x_i)`` over finite elements, ``X = 2^(S - 127 - emax)`` (float32, not clamped to E8M0),
    ``y = X * q(x / X)`` with float32 division and product; Inf/NaN elements pass through unchanged.

    Args:
        x: float32, float16 or bfloat16 (torch only) tensor, any shape, any device. Never modified; the result is detached (the
            differentiable straight-through version is in :mod:`qtorch_onnx.ops`).
        element_dtype: one of :data:`MX_ELEMENTS`.
        axis: block axis, negative allowed; ignored for rank <= 1.
        block_size: elements per block.
        rounding_mode: int8 elements only.
        return_mask: also return the straight-through mask (docs/numerics.md section 8).
        validate: check the attributes (skip only when already validated).
    Returns:
        ``y`` with ``x``'s shape and dtype, or ``(y, mask)`` with ``mask`` (bool, ``x``'s shape) False where
        the element saturated (clamp to max_norm / int8 range changed the rounded value).
    Raises:
        ConfigError: invalid attribute or ``axis`` out of range.
        DataError: ``x`` not a float32/float16/bfloat16 tensor.
    """
    if validate:
        validate_mx_attributes(element_dtype, block_size, rounding_mode)
    x = x.detach() if isinstance(x, torch.Tensor) else x  # a reference, not differentiable: see qtorch_onnx.ops
    xf, dtype = as_float32(x, "MXQuantizeDequantize")
    ax = normalize_axis(axis, x.dim())
    if x.numel() <= 1:  # docs/numerics.md section 4: a one-element tensor is returned unchanged
        y = x.clone()
        return (y, torch.ones_like(x, dtype=torch.bool)) if return_mask else y
    elem = MX_ELEMENTS[element_dtype]
    xf = xf.contiguous()
    blocks, restore = to_blocks(xf, ax, block_size)
    yb, keep = _mx_blocks(blocks, elem, rounding_mode)
    y = restore(yb).reshape(x.shape)
    if dtype != torch.float32:
        y = y.to(dtype)
    if return_mask:
        return y, restore(keep).reshape(x.shape)
    return y
