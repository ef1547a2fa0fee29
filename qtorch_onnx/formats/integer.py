"""Integer quantize / dequantize reference functions (docs/numerics.md section 1).

Pure torch, vectorized, on whatever device the input lives on. These functions are the bit-level reference
that the Triton kernels and the C++ operators must reproduce; every choice below is taken from docs/numerics.md
section 1 and from the golden vectors in ``tests/data/golden`` (ONNX Runtime's QuantizeLinear /
DequantizeLinear and Quark's ExtendedQuantizeLinear / ExtendedDequantizeLinear).

Layouts of ``scale`` / ``zero_point`` (the same three layouts as ONNX QuantizeLinear at opset 21):

* per tensor: a 0-d or one-element tensor (or a Python number);
* per channel: a 1-D tensor of length ``x.shape[axis]``;
* blocked: a tensor of the same rank as ``x`` whose ``axis`` dimension is ``ceil(x.shape[axis] / block_size)``
  and whose other dimensions equal ``x``'s; one scale per ``block_size`` consecutive elements along ``axis``.

NaN / Inf rule (the project's contract, that of ONNX Runtime's QuantizeLinear): NaN -> the type minimum,
+Inf -> the type maximum, -Inf -> the type minimum (both through saturation). ONNX Runtime's blocked path on a
non-last axis differs (golden README item 2); ``ort_blocked_compat=True`` replicates it for tests.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ..errors import ConfigError
from .spec import IntFormat

__all__ = [
    "quantize",
    "dequantize",
    "fake_quantize",
    "fake_quantize_ste",
    "fake_quantize_lsq",
    "qparams_from_range",
    "pow2_scale_nonoverflow",
    "bias_scale",
    "quantize_bias",
    "round_bias",
    "quant_range",
]

TensorLike = Union[torch.Tensor, float, int]

_FLT_TINY = 1.1754943508222875e-38  # smallest normal float32, 2**-126


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
def quant_range(fmt: IntFormat, narrow_range: bool = False) -> Tuple[int, int]:
    """Integer range ``(qmin, qmax)`` used for saturation.

    ``narrow_range=True`` raises ``qmin`` by one: the symmetric range of signed types (INT8 -> [-127, 127],
    weights quantized offline, docs/numerics.md section 1 "INT8 weights never take -128"); for unsigned types the
    range becomes ``[1, qmax]`` (the symmetric range around the UINT zero point ``2^(bits-1)``).
    """
    if not isinstance(fmt, IntFormat):
        raise ConfigError(f"integer quantization needs an IntFormat, got {fmt!r}")
    qmin, qmax = fmt.qmin, fmt.qmax
    return (qmin + 1 if narrow_range else qmin), qmax


def _as_tensor(v: TensorLike, device, dtype=None) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=dtype) if dtype is not None else v.to(device=device)
    return torch.tensor(v, device=device, dtype=dtype)


def _norm_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ConfigError(f"{what}: axis {axis} is out of range for a tensor of rank {ndim} (valid: {-ndim}..{ndim - 1})")
    return axis % ndim


def _broadcast_param(p: torch.Tensor, x_shape: torch.Size, axis: Optional[int], block_size: Optional[int],
                     what: str) -> torch.Tensor:
    """Return ``p`` reshaped / expanded so that it broadcasts against a tensor of shape ``x_shape``."""
    ndim = len(x_shape)
    if block_size:
        if block_size < 0:
            raise ConfigError(f"{what}: block_size must be positive, got {block_size}")
        if axis is None:
            raise ConfigError(f"{what}: blocked quantization (block_size={block_size}) needs an axis")
        ax = _norm_axis(axis, ndim, what)
        n = x_shape[ax]
        nb = -(-n // block_size)
        expect = list(x_shape)
        expect[ax] = nb
        if list(p.shape) != expect:
            raise ConfigError(f"{what}: blocked parameter shape {tuple(p.shape)} does not match input shape "
                              f"{tuple(x_shape)} with axis={axis}, block_size={block_size} (expected {tuple(expect)})")
        return p.repeat_interleave(block_size, dim=ax).narrow(ax, 0, n)
    if p.numel() == 1 and p.dim() <= 1:
        return p.reshape(())
    if p.dim() != 1:
        raise ConfigError(f"{what}: a per-channel parameter must be 1-D, got shape {tuple(p.shape)} "
                          f"(per tensor: a scalar; blocked: pass block_size)")
    if axis is None:
        raise ConfigError(f"{what}: a per-channel parameter of shape {tuple(p.shape)} needs an axis")
    ax = _norm_axis(axis, ndim, what)
    if p.shape[0] != x_shape[ax]:
        raise ConfigError(f"{what}: per-channel parameter has {p.shape[0]} elements but the input has "
                          f"{x_shape[ax]} along axis {axis}")
    shape = [1] * ndim
    shape[ax] = p.shape[0]
    return p.reshape(shape)


def _prepare(x: torch.Tensor, scale: TensorLike, zero_point: Optional[TensorLike], axis, block_size, what):
    s = _as_tensor(scale, x.device, torch.float32)
    s = _broadcast_param(s, x.shape, axis, block_size, what + " scale")
    if zero_point is None:
        zp = torch.zeros((), dtype=torch.int64, device=x.device)
    else:
        zp = _as_tensor(zero_point, x.device)
        if zp.is_floating_point():
            raise ConfigError(f"{what}: zero_point must be an integer tensor, got dtype {zp.dtype}")
        zp = _broadcast_param(zp.to(torch.int64), x.shape, axis, block_size, what + " zero_point")
    return s, zp


def _compute_dtype(fmt: IntFormat) -> torch.dtype:
    # |round(x/s)| < 2^24 is exact in float32; beyond that every 8/16-bit result saturates whatever the
    # rounding of the zero-point addition, so float32 is exact for bits <= 16. 32-bit types need float64.
    return torch.float32 if fmt.bits <= 16 else torch.float64


def _quantize_core(x: torch.Tensor, s: torch.Tensor, zp: torch.Tensor, fmt: IntFormat, narrow_range: bool,
                   ort_quirk: bool, rounding=None):
    """Shared core: returns (c, t) in the compute dtype: c the saturated integer values (NaN -> qmin),
    t the unsaturated ``round(x/s) + zp`` (for the STE mask). ``rounding`` replaces ``torch.round`` (round
    half to even) when given: a function of ``v = float32(x / s)`` returning integer-valued floats."""
    qmin, qmax = quant_range(fmt, narrow_range)
    cd = _compute_dtype(fmt)
    v = x.to(torch.float32) / s  # float32 division (golden README item 1)
    r = torch.round(v) if rounding is None else rounding(v)  # round half to even by default
    t = r.to(cd) + zp.to(cd)
    c = t.clamp(qmin, qmax)
    nan = torch.isnan(c)
    c = torch.where(nan, torch.full_like(c, qmin), c)
    if ort_quirk:
        # ONNX Runtime's blocked non-last-axis kernel converts to int32 before adding the zero point:
        # NaN, +-Inf and |x/s| >= 2^31 become INT32_MIN, then + zp saturates to qmin (zp >= 0) or wraps to qmax.
        bad = torch.isnan(v) | (v.abs() >= 2.0 ** 31)
        zp_b = torch.broadcast_to(zp, c.shape)
        alt = torch.where(zp_b >= 0, torch.full_like(c, qmin), torch.full_like(c, qmax))
        c = torch.where(bad, alt, c)
    return c, t


def quantize(x: torch.Tensor, scale: TensorLike, zero_point: Optional[TensorLike], fmt: IntFormat,
             axis: Optional[int] = None, block_size: Optional[int] = None, *, narrow_range: bool = False,
             ort_blocked_compat: bool = False, rounding=None) -> torch.Tensor:
    """Quantize: ``q = saturate(round_half_even(x / scale) + zero_point)`` (docs/numerics.md section 1).

    Args:
        x: float tensor, any shape (float16/bfloat16 are converted to float32 first); not modified.
        scale: float32 scale, per tensor / per channel / blocked (module docstring).
        zero_point: integer zero point with the same layout as ``scale``, or None for 0.
        fmt: the integer format (its full range is used for saturation).
        axis: channel / block axis (negative counts from the end); needed for per-channel and blocked.
        block_size: opset-21 block size along ``axis``; None or 0 for per-tensor / per-channel.
        narrow_range: saturate to ``[qmin + 1, qmax]`` (symmetric weight range, see :func:`quant_range`).
        ort_blocked_compat: replicate ONNX Runtime's blocked non-last-axis NaN/Inf/overflow quirk
            (golden README item 2): elements with NaN, +-Inf or ``|x/scale| >= 2^31`` give ``qmin`` when the
            zero point is >= 0 and ``qmax`` otherwise. Off by default (the project's rule is the plain one).
        rounding: replaces round-half-to-even: a function mapping ``v = float32(x / scale)`` to integer-valued
            float32 values of the same shape (the weight-rounding hook's hard result, e.g. AdaRound's
            ``floor(v) + (alpha >= 0)``). None: ``torch.round``.

    Returns:
        int64 tensor of ``x``'s shape holding the quantized values (int64 holds every type incl. UINT32).

    Raises:
        ConfigError: malformed scale / zero point layout, axis out of range, non-IntFormat ``fmt``.
    """
    s, zp = _prepare(x, scale, zero_point, axis, block_size, "quantize")
    quirk = bool(ort_blocked_compat and block_size and axis is not None
                 and _norm_axis(axis, x.dim(), "quantize") != x.dim() - 1)
    c, _ = _quantize_core(x, s, zp, fmt, narrow_range, quirk, rounding)
    return c.to(torch.int64)


def dequantize(q: torch.Tensor, scale: TensorLike, zero_point: Optional[TensorLike] = None,
               axis: Optional[int] = None, block_size: Optional[int] = None) -> torch.Tensor:
    """Dequantize: ``y = float32(q - zero_point) * scale`` (docs/numerics.md section 1).

    ``q - zero_point`` is computed exactly in int64, converted to float32 (round to nearest even, which only
    matters for 32-bit types) and multiplied by the float32 scale.

    Args:
        q: integer tensor, any shape. scale / zero_point / axis / block_size: as :func:`quantize`.

    Returns:
        float32 tensor of ``q``'s shape.

    Raises:
        ConfigError: malformed scale / zero point layout.
    """
    if q.is_floating_point():
        raise ConfigError(f"dequantize: q must be an integer tensor, got dtype {q.dtype}")
    s, zp = _prepare(q, scale, zero_point, axis, block_size, "dequantize")
    return (q.to(torch.int64) - zp).to(torch.float32) * s


def fake_quantize(x: torch.Tensor, scale: TensorLike, zero_point: Optional[TensorLike], fmt: IntFormat,
                  axis: Optional[int] = None, block_size: Optional[int] = None, *, narrow_range: bool = False,
                  ort_blocked_compat: bool = False) -> torch.Tensor:
    """``dequantize(quantize(x))`` computed without materializing integers; bit-identical to the composition.

    Returns a float32 tensor of ``x``'s shape. Arguments and errors as :func:`quantize`. No gradient flows
    (rounding); use :func:`fake_quantize_ste` or :func:`fake_quantize_lsq` for training.
    """
    y, _ = _fake_quantize_with_mask(x, scale, zero_point, fmt, axis, block_size, narrow_range, ort_blocked_compat,
                                    need_mask=False)
    return y


def _fake_quantize_fused(x: torch.Tensor, s: torch.Tensor, zp: torch.Tensor, fmt: IntFormat, narrow_range: bool,
                         need_mask: bool):
    """The fake-quantization path of :func:`_quantize_core` for types of at most 16 bits, in-place on one
    float32 buffer: 7 elementwise passes instead of 12, and the gradient mask only when ``need_mask``.

    Bit-identical to ``(_quantize_core(...)[0] - zp) * s`` (tested against it): the same float32 operations in
    the same order (``x / s``, round half to even, ``+ float32(zp)``, clamp, NaN -> qmin, ``- float32(zp)``,
    ``* s``); only the buffers differ. The mask ``c == t`` is computed as ``clamp(t) == t`` (False for NaN and
    +-Inf ``t``, as there ``c != t``), then NaN/Inf inputs pass (docs/numerics.md section 8).
    """
    qmin, qmax = quant_range(fmt, narrow_range)
    xf = x.to(torch.float32)
    v = torch.div(xf, s)  # float32 division (golden README item 1); v is our own buffer from here on
    torch.round(v, out=v)  # round half to even
    zpf = zp.to(torch.float32)
    v.add_(zpf)
    mask = None
    if need_mask:
        c = v.clamp(qmin, qmax)
        mask = torch.eq(c, v)
        mask.logical_or_(torch.logical_not(torch.abs(xf) < math.inf))  # |x| < inf is False for NaN and +-Inf
    else:
        c = v.clamp_(qmin, qmax)  # no mask: one buffer throughout
    torch.nan_to_num(c, nan=float(qmin), out=c)  # NaN -> qmin (no +-Inf is left after the clamp)
    c.sub_(zpf).mul_(s)
    return c, mask


def _fake_quantize_with_mask(x, scale, zero_point, fmt, axis, block_size, narrow_range, ort_blocked_compat,
                             need_mask: bool = True):
    s, zp = _prepare(x, scale, zero_point, axis, block_size, "fake_quantize")
    quirk = bool(ort_blocked_compat and block_size and axis is not None
                 and _norm_axis(axis, x.dim(), "fake_quantize") != x.dim() - 1)
    if not quirk and fmt.bits <= 16:
        return _fake_quantize_fused(x, s, zp, fmt, narrow_range, need_mask)
    c, t = _quantize_core(x, s, zp, fmt, narrow_range, quirk)
    y = (c - zp.to(c.dtype)).to(torch.float32) * s
    # gradient mask (docs/numerics.md section 8): 1 where not saturated, NaN/Inf inputs pass 1.
    xf = x.to(torch.float32)
    mask = (c == t) | ~torch.isfinite(xf)
    return y, mask


class _FakeQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, fmt, axis, block_size, narrow_range):
        with torch.no_grad():
            y, mask = _fake_quantize_with_mask(x, scale, zero_point, fmt, axis, block_size, narrow_range, False)
        ctx.save_for_backward(mask)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        (mask,) = ctx.saved_tensors
        gx = torch.where(mask, gy, torch.zeros_like(gy)).to(ctx.in_dtype)
        return gx, None, None, None, None, None, None


def fake_quantize_ste(x: torch.Tensor, scale: TensorLike, zero_point: Optional[TensorLike], fmt: IntFormat,
                      axis: Optional[int] = None, block_size: Optional[int] = None, *,
                      narrow_range: bool = False) -> torch.Tensor:
    """:func:`fake_quantize` with the straight-through estimator (docs/numerics.md section 8).

    Forward equals :func:`fake_quantize` bit for bit. Backward: ``dx = dy`` where ``round(x/s) + zp`` lies
    inside the (narrow) range, 0 where it was saturated; NaN and +-Inf inputs pass the gradient (1).
    Scale and zero point receive no gradient (see :func:`fake_quantize_lsq`).
    """
    if not torch.is_grad_enabled() or not (x.requires_grad or getattr(scale, "requires_grad", False)
                                           or getattr(zero_point, "requires_grad", False)):
        with torch.no_grad():  # nothing to differentiate: no gradient mask to compute and keep
            y, _ = _fake_quantize_with_mask(x, scale, zero_point, fmt, axis, block_size, narrow_range, False,
                                            need_mask=False)
        return y
    return _FakeQuantizeSTE.apply(x, scale, zero_point, fmt, axis, block_size, narrow_range)


def _round_zero_point(zero_point: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """A learnable (float) zero point as the integer ONNX stores: round half to even, clamped to the type."""
    lo, hi = quant_range(fmt)
    return torch.round(zero_point.detach().to(torch.float64)).clamp(lo, hi).to(torch.int64)


class _FakeQuantizeLSQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, fmt, axis, block_size, narrow_range, grad_factor):
        learn_zp = isinstance(zero_point, torch.Tensor) and zero_point.is_floating_point()
        with torch.no_grad():
            zp_in = _round_zero_point(zero_point, fmt) if learn_zp else zero_point
            s, zp = _prepare(x, scale, zp_in, axis, block_size, "fake_quantize_lsq")
            c, t = _quantize_core(x, s, zp, fmt, narrow_range, False)
            qi = c - zp.to(c.dtype)  # integer value relative to the zero point
            y = qi.to(torch.float32) * s
            xf = x.to(torch.float32)
            finite = torch.isfinite(xf)
            inside = (c == t) | ~finite
            v = xf / s
            # LSQ (Esser et al. 2019, eq. 3): dy/ds = round(v) - v inside the range, qi (= qmin-zp or qmax-zp)
            # where saturated; non-finite elements contribute 0.
            ds = torch.where(c == t, qi.to(torch.float32) - v, qi.to(torch.float32))
            ds = torch.where(finite, ds, torch.zeros_like(ds))
            # LSQ+ (Bhalgat et al. 2020): with a straight-through round of the zero point, dy/dzp = 0 inside the
            # range and -s where saturated (the clamp holds q constant while - zp * s moves)
            dz = torch.where((c != t) & finite, -s.expand_as(ds), torch.zeros_like(ds)) if learn_zp else None
        ctx.save_for_backward(inside, ds, dz)
        ctx.meta = (x.dtype, scale.shape, axis, block_size, grad_factor, x.shape,
                    zero_point.shape if learn_zp else None)
        return y

    @staticmethod
    def _reduce(g, s_shape, axis, block_size, x_shape):
        nd = len(x_shape)
        if len(s_shape) == 0 or (len(s_shape) == 1 and s_shape[0] == 1 and not block_size and axis is None):
            return g.sum().reshape(s_shape)
        if block_size:
            ax = axis % nd
            n = x_shape[ax]
            nb = -(-n // block_size)
            pad = nb * block_size - n
            if pad:
                padshape = list(g.shape)
                padshape[ax] = pad
                g = torch.cat([g, g.new_zeros(padshape)], dim=ax)
            shp = list(g.shape)
            shp[ax:ax + 1] = [nb, block_size]
            return g.reshape(shp).sum(dim=ax + 1).reshape(s_shape)
        ax = axis % nd
        dims = [d for d in range(nd) if d != ax]
        return (g.sum(dim=dims) if dims else g).reshape(s_shape)

    @staticmethod
    def backward(ctx, gy):
        inside, ds, dz = ctx.saved_tensors
        in_dtype, s_shape, axis, block_size, grad_factor, x_shape, z_shape = ctx.meta
        gx = torch.where(inside, gy, torch.zeros_like(gy)).to(in_dtype)
        gz = None
        if z_shape is not None:
            gz = _FakeQuantizeLSQ._reduce(gy.to(torch.float32) * dz, z_shape, axis, block_size, x_shape) * grad_factor
        g = (gy.to(torch.float32) * ds)
        return gx, _FakeQuantizeLSQ._reduce(g, s_shape, axis, block_size, x_shape) * grad_factor, gz, \
            None, None, None, None, None


def fake_quantize_lsq(x: torch.Tensor, scale: torch.Tensor, zero_point: Optional[TensorLike], fmt: IntFormat,
                      axis: Optional[int] = None, block_size: Optional[int] = None, *, narrow_range: bool = False,
                      grad_factor: Optional[float] = None) -> torch.Tensor:
    """Fake quantization with a learnable scale: LSQ (Esser et al. 2019, "Learned Step Size Quantization",
    arXiv 1902.08153).

    Forward equals :func:`fake_quantize`. Backward: ``dx`` as the STE (:func:`fake_quantize_ste`);
    ``dscale = sum(dy * (round(x/s) - x/s))`` over unsaturated elements plus ``dy * (q - zp)`` over saturated
    ones, multiplied by ``grad_factor`` (default ``1 / sqrt(N_per_scale * qmax)``, the paper's ``g``),
    summed per scale element (per tensor, per channel or per block).

    A floating-point ``zero_point`` (LSQ+, Bhalgat et al. 2020, "LSQ+: Improving low-bit quantization through
    learnable offsets", arXiv 2004.09576) is learned too: the forward uses ``round_half_even(zero_point)``
    clamped to the type's range (the integer ONNX stores), the backward passes ``dzp = -s * dy`` summed over
    saturated elements (0 inside the range), times ``grad_factor``. An integer ``zero_point`` is fixed.

    Args:
        scale: float32 tensor (usually an ``nn.Parameter``), layout as :func:`quantize`.
        zero_point: integer tensor (fixed), float tensor (learned), or None (0).
    """
    if not isinstance(scale, torch.Tensor):
        raise ConfigError("fake_quantize_lsq: scale must be a tensor (the learnable parameter)")
    if grad_factor is None:
        n_per = max(1.0, x.numel() / max(1, scale.numel()))
        grad_factor = 1.0 / math.sqrt(n_per * quant_range(fmt, narrow_range)[1])
    return _FakeQuantizeLSQ.apply(x, scale, zero_point, fmt, axis, block_size, narrow_range, float(grad_factor))


# ----------------------------------------------------------------------------------------------------------
# parameters from ranges
# ----------------------------------------------------------------------------------------------------------
def _range_qmin_qmax(fmt: IntFormat, symmetric: bool, reduce_range: bool) -> Tuple[int, int]:
    if reduce_range:
        if fmt.bits > 16:
            raise ConfigError(f"reduce_range is defined for 8- and 16-bit types only, not {fmt.name}")
        # ONNX Runtime's reduced ranges: INT8 [-64, 64], UINT8 [0, 127], INT16 [-16384, 16384], UINT16 [0, 32767]
        if fmt.signed:
            h = 1 << (fmt.bits - 2)
            return -h, h
        return 0, (1 << (fmt.bits - 1)) - 1
    if symmetric and fmt.signed:
        return -fmt.qmax, fmt.qmax
    return fmt.qmin, fmt.qmax


def qparams_from_range(rmin: TensorLike, rmax: TensorLike, fmt: IntFormat, symmetric: bool,
                       reduce_range: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point from a calibrated range (docs/numerics.md section 1; ONNX Runtime ``compute_scale_zp``).

    Elementwise, so per-channel ranges (1-D) give per-channel parameters. All math in float64:

    * ``rmin = min(rmin, 0)``, ``rmax = max(rmax, 0)``;
    * symmetric: ``a = max(|rmin|, |rmax|)``, range ``[-a, a]`` over the symmetric integer range of signed
      types (INT8 -> ``scale = a / 127``) or the full range of unsigned ones (UINT8 -> ``2a / 255``),
      ``zero_point = round_half_even((qmin + qmax) / 2)`` (0 for signed, 128 for UINT8, 32768 for UINT16);
    * asymmetric: ``scale = (rmax - rmin) / (qmax - qmin)``, ``zero_point = round_half_even(qmin - rmin/scale)``
      (float64 scale);
    * ``reduce_range``: ONNX Runtime's reduced ranges (INT8 [-64, 64], UINT8 [0, 127], 16-bit alike);
    * a float64 scale below the smallest normal float32 becomes 1.0 with zero point 0.

    Returns:
        ``(scale, zero_point)``: float32 and int64 tensors of the broadcast shape of ``rmin``/``rmax``.

    Raises:
        ConfigError: NaN in the range, non-IntFormat, reduce_range with a 32-bit type.
    """
    if not isinstance(fmt, IntFormat):
        raise ConfigError(f"qparams_from_range needs an IntFormat, got {fmt!r}")
    lo = torch.as_tensor(rmin).to(torch.float64)
    hi = torch.as_tensor(rmax).to(torch.float64)
    lo, hi = torch.broadcast_tensors(lo, hi)
    if torch.isnan(lo).any() or torch.isnan(hi).any():
        raise ConfigError(f"qparams_from_range: the range contains NaN (rmin={lo.tolist()}, rmax={hi.tolist()})")
    qmin, qmax = _range_qmin_qmax(fmt, symmetric, reduce_range)
    lo = torch.clamp(lo, max=0.0)
    hi = torch.clamp(hi, min=0.0)
    if symmetric:
        a = torch.maximum(lo.abs(), hi.abs())
        lo, hi = -a, a
    scale = (hi - lo) / float(qmax - qmin)
    if symmetric:
        zp = torch.full_like(scale, float(round((qmin + qmax) / 2.0)))  # Python round: half to even
    else:
        zp = torch.round(qmin - lo / scale)
    tiny = ~(scale >= _FLT_TINY)  # also catches inf/inf = NaN from infinite ranges
    scale = torch.where(tiny, torch.ones_like(scale), scale)
    zp = torch.where(tiny, torch.zeros_like(zp), zp)
    return scale.to(torch.float32), zp.to(torch.int64)


def pow2_scale_nonoverflow(rmin: TensorLike, rmax: TensorLike, fmt: IntFormat, symmetric: bool = True,
                           narrow_range: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Power-of-two scale ``2^-pos`` that does not clip ``[rmin, rmax]`` (docs/numerics.md section 1, NonOverflow).

    ``pos`` is the largest integer such that quantizing ``rmin`` and ``rmax`` with scale ``2^-pos`` and the zero
    point below does not saturate (round half to even included: a value landing on ``qmax + 0.5`` with odd
    ``qmax`` would round up and clip, so it forces a larger scale). Quark's ``get_pos_overflow`` computes
    ``floor(log2(1 / max(rmin/(qmin-0.5), rmax/(qmax+0.5))))``; that is the same except on that exact tie.

    * symmetric: zero point 0 for signed types, ``2^(bits-1)`` for unsigned ones;
    * asymmetric: ``pos`` such that ``(rmax - rmin) / 2^-pos <= qmax - qmin``, zero point
      ``clamp(round_half_even(qmin - rmin / scale), qmin, qmax)``, then ``pos`` decreased while clipping remains.
    * an all-zero range gives scale 1.0 (pos 0), zero point as above (docs/numerics.md: scales below the smallest
      normal float32 become 1.0). ``pos`` is limited to [-127, 126] so the scale is a normal float32.

    Elementwise over per-channel ranges. Returns ``(scale float32, zero_point int64, pos int64)``.
    """
    if not isinstance(fmt, IntFormat):
        raise ConfigError(f"pow2_scale_nonoverflow needs an IntFormat, got {fmt!r}")
    lo = torch.as_tensor(rmin).to(torch.float64)
    hi = torch.as_tensor(rmax).to(torch.float64)
    lo, hi = torch.broadcast_tensors(lo, hi)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ConfigError(f"pow2_scale_nonoverflow: the range must be finite (rmin={lo.tolist()}, rmax={hi.tolist()})")
    lo = torch.clamp(lo, max=0.0)
    hi = torch.clamp(hi, min=0.0)
    qmin, qmax = quant_range(fmt, narrow_range)
    if symmetric:
        zp = torch.full_like(lo, 0.0 if fmt.signed else float(1 << (fmt.bits - 1)))
        cand = torch.maximum(lo / (qmin - zp - 0.5), hi / (qmax - zp + 0.5))
    else:
        zp = None
        cand = (hi - lo) / float(qmax - qmin)
    zero = cand <= 0
    pos = torch.floor(-torch.log2(torch.where(zero, torch.ones_like(cand), cand)))
    pos = torch.where(zero, torch.zeros_like(pos), pos).clamp(-127, 126)

    def clips(p):
        s = torch.exp2(-p)
        z = zp if zp is not None else torch.clamp(torch.round(qmin - lo / s), qmin, qmax)
        ql = torch.round((lo.to(torch.float32).to(torch.float64) / s)) + z
        qh = torch.round((hi.to(torch.float32).to(torch.float64) / s)) + z
        return ((ql < qmin) | (qh > qmax)) & ~zero & (p > -127)

    for _ in range(3):  # log2 rounding can be off by one either way; the tie case needs one step
        c = clips(pos)
        if not c.any():
            break
        pos = torch.where(c, pos - 1, pos)
    for _ in range(2):  # asymmetric: rounding slack may allow a smaller scale than the span bound
        nxt = torch.clamp(pos + 1, max=126)
        grow = (nxt > pos) & ~zero & ~clips(nxt)
        if not grow.any():
            break
        pos = torch.where(grow, nxt, pos)
    scale = torch.exp2(-pos)
    if zp is None:
        zp = torch.clamp(torch.round(qmin - lo / scale), qmin, qmax)
    return scale.to(torch.float32), zp.to(torch.int64), pos.to(torch.int64)


# ----------------------------------------------------------------------------------------------------------
# bias
# ----------------------------------------------------------------------------------------------------------
def bias_scale(scale_x: TensorLike, scale_w: TensorLike) -> torch.Tensor:
    """Bias scale ``float32(scale_x * scale_w)`` (docs/numerics.md section 1; per channel when ``scale_w`` is 1-D).

    The float64 product of two float32 values is exact, so this equals the float32 product.
    """
    sx = torch.as_tensor(scale_x).to(torch.float64)
    sw = torch.as_tensor(scale_w).to(torch.float64)
    return (sx * sw).to(torch.float32)


def quantize_bias(b: torch.Tensor, scale_b: TensorLike) -> torch.Tensor:
    """INT32 bias: ``clip(round_half_even(float64(b) / float64(scale_b)), INT32 range)``, zero point 0.

    Args:
        b: float bias, shape ``[C]`` (or any shape broadcastable with ``scale_b``).
        scale_b: float32 scalar or ``[C]`` (see :func:`bias_scale`).

    Returns:
        int32 tensor of ``b``'s shape.

    Raises:
        ConfigError: a bias scale that is not positive and finite. NaN biases map to 0 is *not* done:
            a NaN bias raises ConfigError as well (it would silently become INT32_MIN).
    """
    bs = torch.as_tensor(scale_b).to(device=b.device, dtype=torch.float64)
    bd = b.to(torch.float64)
    # one host read for both checks (a GPU synchronisation each; a training step quantizes the bias every time)
    bad_scale = ~(torch.isfinite(bs) & (bs > 0)).all()
    if bool(bad_scale | torch.isnan(bd).any()):
        if bool(bad_scale):
            raise ConfigError(f"quantize_bias: bias scale must be positive and finite, got {bs.flatten()[:8].tolist()}")
        raise ConfigError("quantize_bias: the bias contains NaN")
    return round_bias(bd, bs).to(torch.int32)


def round_bias(b: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_bias`'s arithmetic without its checks: ``clip(round_half_even(b / scale_b), INT32
    range)`` for float64 ``b`` and ``scale_b`` (broadcastable), as float64 integers (NaN stays NaN). For callers
    that checked the scale once and quantize every training step (fast finetune's AdaQuant step: each check is
    a host read, a synchronisation on a GPU)."""
    return torch.round(b / scale_b).clamp_(-(2 ** 31), 2 ** 31 - 1)
