"""Casts and the quantized operators' plain-float semantics, exactly as ONNX defines them.

Dtype convention of the lifted module (ONNX element type -> torch tensor carrying it):
  * FLOAT8E4M3FN/E4M3FNUZ/E5M2/E5M2FNUZ/E8M0 -> torch's float8 dtypes of the same name;
  * INT4/INT2 -> torch.int8 holding the value, UINT4/UINT2 -> torch.uint8 (unpacked, one per byte);
  * FLOAT4E2M1, FLOAT6E2M3, FLOAT6E3M2 -> torch.uint8 holding the bit code (sign in the top bit of
    the 4/6-bit code), since torch has no scalar dtype for them.
Converters read the ONNX element type of their inputs from the model's value_info to decode carriers.

Operators: Cast-6..25 and CastLike-15..25 (all numeric types, ``saturate``, ``round_mode``),
QuantizeLinear / DequantizeLinear 10..25 (per-tensor, per-axis, blocked; int2/4/8/16, float8,
float4/6 targets; ``output_dtype``, ``precision``), DynamicQuantizeLinear-11, MatMulInteger-10,
ConvInteger-10, QLinearMatMul-10/21, QLinearConv-10. Each quantized op is a small module whose
forward takes the scale / zero-point tensors as inputs, so a later pass can swap it for a
FakeQuantize-based module. Formulas: the ONNX operator documentation of each op (cited per class).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .ops_common import (
    TP, ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, elem_type, register_converter,
    register_versions, result, torch_dtype,
)
from .ops_conv_pool import conv_nd, runtime_pads

#: float8 element type -> (torch dtype, largest finite value)
FLOAT8 = {TP.FLOAT8E4M3FN: (torch.float8_e4m3fn, 448.0), TP.FLOAT8E4M3FNUZ: (torch.float8_e4m3fnuz, 240.0),
          TP.FLOAT8E5M2: (torch.float8_e5m2, 57344.0), TP.FLOAT8E5M2FNUZ: (torch.float8_e5m2fnuz, 57344.0)}
#: sub-byte integer element type -> (min, max)
SUBBYTE_INT = {TP.INT4: (-8, 7), TP.UINT4: (0, 15), TP.INT2: (-2, 1), TP.UINT2: (0, 3)}
#: quantization ranges of the integer targets of QuantizeLinear (ONNX QuantizeLinear doc)
INT_RANGES = {TP.UINT8: (0, 255), TP.INT8: (-128, 127), TP.UINT16: (0, 65535), TP.INT16: (-32768, 32767),
              **SUBBYTE_INT}
#: small float types without inf/NaN: (exponent bits, mantissa bits, bias)
SMALL_FLOAT = {TP.FLOAT4E2M1: (2, 1, 1), TP.FLOAT6E2M3: (2, 3, 1), TP.FLOAT6E3M2: (3, 2, 3)}


def _small_float_grid(onnx_type: int) -> torch.Tensor:
    """Positive values of a small float type by code (code = exponent << m | mantissa)."""
    e_bits, m_bits, bias = SMALL_FLOAT[onnx_type]
    vals = []
    for code in range(1 << (e_bits + m_bits)):
        e, m = code >> m_bits, code & ((1 << m_bits) - 1)
        vals.append((m / (1 << m_bits)) * 2.0 ** (1 - bias) if e == 0 else (1 + m / (1 << m_bits)) * 2.0 ** (e - bias))
    return torch.tensor(vals, dtype=torch.float64)


def encode_small_float(x: torch.Tensor, onnx_type: int) -> torch.Tensor:
    """float -> uint8 code of FLOAT4E2M1/FLOAT6E2M3/FLOAT6E3M2: round to nearest, ties to the even
    code, saturating at the largest value (these types have no inf); -0 keeps its sign. NaN maps as
    the ONNX reference (ml_dtypes) maps it: to the code with the sign bit flipped relative to the NaN."""
    grid = _small_float_grid(onnx_type).to(x.device)
    bits = int(math.log2(grid.numel())) + 1
    sign_bit = 1 << (bits - 1)
    a = x.to(torch.float64).abs()
    mids = (grid[1:] + grid[:-1]) / 2
    upper_even = (torch.arange(1, grid.numel(), device=x.device) % 2 == 0)
    above = (a.unsqueeze(-1) > mids) | ((a.unsqueeze(-1) == mids) & upper_even)
    code = above.sum(dim=-1)
    neg = torch.signbit(x.to(torch.float32))
    code = torch.where(neg, code + sign_bit, code)
    nan = torch.isnan(x)
    code = torch.where(nan, torch.where(neg, torch.zeros_like(code), torch.full_like(code, sign_bit)), code)
    return code.to(torch.uint8)


def decode_small_float(code: torch.Tensor, onnx_type: int) -> torch.Tensor:
    """uint8 code of FLOAT4E2M1/FLOAT6E2M3/FLOAT6E3M2 -> float32 value."""
    grid = _small_float_grid(onnx_type).to(torch.float32).to(code.device)
    n = grid.numel()
    c = code.to(torch.int64)
    mag = grid[c % n]
    return torch.where(c >= n, -mag, mag)


def encode_e8m0(x: torch.Tensor, saturate: bool, round_mode: str) -> torch.Tensor:
    """float -> FLOAT8E8M0 (value 2^(code-127), code 255 = NaN) per the ONNX Cast spec: ``round_mode``
    ``up`` (default), ``down`` or ``nearest`` (ties up) on the float32 exponent; with ``saturate``
    a round-up never passes code 254; NaN/Inf -> 255."""
    f = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exp = (f >> 23) & 0xFF
    mant = f & 0x7FFFFF
    special = exp == 0xFF
    if round_mode == "up":
        inc = (mant > 0) & ~special
    elif round_mode == "down":
        inc = torch.zeros_like(special)
    elif round_mode == "nearest":
        g, r, s = (f & 0x400000) > 0, (f & 0x200000) > 0, (f & 0x1FFFFF) > 0
        inc = g & (r | s | (exp > 0)) & ~special
    else:
        raise ValueError(f"round_mode {round_mode!r} (valid: up, down, nearest)")
    if saturate:
        inc = inc & (exp != 0xFE)
    code = torch.where(special, torch.full_like(exp, 0xFF), exp + inc.to(torch.int64))
    return code.clamp(0, 255).to(torch.uint8).view(torch.float8_e8m0fnu)


def encode_float8(x: torch.Tensor, onnx_type: int, saturate: bool) -> torch.Tensor:
    """float -> float8 per the ONNX Cast tables: round to nearest even; ``saturate``: out-of-range and
    inf -> +-max; else overflow -> NaN (E4M3FN, both FNUZ) or inf (E5M2)."""
    dtype, fmax = FLOAT8[onnx_type]
    xf = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    if saturate:
        return xf.clamp(-fmax, fmax).to(dtype)
    y = xf.to(dtype)
    if onnx_type == TP.FLOAT8E4M3FN:  # torch saturates this one; the spec wants NaN past the rounding edge
        y = torch.where(xf.abs() > 464.0, torch.full_like(xf, float("nan")).to(dtype), y)
    return y


#: float32 bit patterns of the quiet NaNs ONNX Runtime (and ml_dtypes) widen float8 NaNs to: sign of the code
_QNAN_BITS = (0x7FC00000, -0x00400000)  # 0x7FC00000, 0xFFC00000 as int32


def decode(x: torch.Tensor, onnx_type: int | None) -> torch.Tensor:
    """Carrier tensor of ``onnx_type`` -> a tensor torch arithmetic accepts (small-float codes -> float32;
    float8 -> float32; others unchanged).

    Float8 NaN codes become the quiet float32 NaN with the code's sign bit (0x7FC00000 / 0xFFC00000), as
    ONNX Runtime's Cast and DequantizeLinear give them; torch's own widening keeps payload bits (e.g.
    float8_e4m3fnuz's NaN 0x80 -> 0x7F800001, a signalling NaN of the wrong sign)."""
    if onnx_type in SMALL_FLOAT:
        return decode_small_float(x, onnx_type)
    if onnx_type in FLOAT8:
        y = x.to(torch.float32)
        if x.element_size() != 1:  # not a float8 carrier (already widened): nothing to canonicalize
            return y
        negative = (x.view(torch.uint8) & 0x80) != 0
        qnan = torch.where(negative, torch.tensor(_QNAN_BITS[1], dtype=torch.int32, device=x.device),
                           torch.tensor(_QNAN_BITS[0], dtype=torch.int32, device=x.device)).view(torch.float32)
        return torch.where(torch.isnan(y), qnan, y)
    if onnx_type == TP.FLOAT8E8M0:
        return x.to(torch.float32)
    return x


def cast_to(x: torch.Tensor, src: int | None, to: int, saturate: bool = True, round_mode: str = "up") -> torch.Tensor:
    """ONNX Cast of carrier ``x`` (element type ``src``) to element type ``to`` (carrier of ``to``)."""
    x = decode(x, src)
    if to in FLOAT8:
        return encode_float8(x, to, saturate)
    if to == TP.FLOAT8E8M0:
        return encode_e8m0(x, saturate, round_mode)
    if to in SMALL_FLOAT:
        return encode_small_float(x, to)
    if to in SUBBYTE_INT:
        lo, hi = SUBBYTE_INT[to]
        v = x.to(torch.int64) if x.dtype != torch.bool else x.to(torch.int64)
        v = torch.remainder(v - lo, hi - lo + 1) + lo  # discard higher bits, two's complement
        return v.to(torch_dtype(to))
    target = torch_dtype(to)
    if x.dtype == torch.bool or not x.is_floating_point() or target.is_floating_point or target == torch.bool:
        return x.to(target)
    return x.to(target)


class OnnxCast(nn.Module, OnnxToTorchModule):
    """ONNX Cast / CastLike: x (carrier of ONNX type ``src``) -> carrier of ONNX type ``to``.

    Float -> int truncates toward zero; int -> narrower int wraps; float -> float8 follows the spec's
    saturate tables; -> FLOAT8E8M0 uses ``round_mode``; -> int4/2 wraps to the 4/2-bit range (the
    reference's conversion); -> float4/6 rounds to nearest even and saturates (see
    :func:`encode_small_float`). CastLike takes a second input whose only use is its type.
    """

    def __init__(self, src: int | None, to: int, saturate: bool, round_mode: str):
        super().__init__()
        self.src, self.to, self.saturate, self.round_mode = src, to, saturate, round_mode

    def forward(self, x: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        if self.src == self.to:
            return x
        return cast_to(x, self.src, self.to, self.saturate, self.round_mode)


def _cast_common(node: OnnxNode, graph: OnnxGraph, to: int | None):
    if to is None:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: the target element type is unknown")
    src = elem_type(graph, node.input_values[0])
    for t in (to, src):
        if t == TP.STRING:
            raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: string tensors have no torch dtype")
        if t is not None:
            torch_dtype(t, node)
    rm = attr(node, "round_mode", "up")
    if rm not in ("up", "down", "nearest"):
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: round_mode={rm!r} (valid: up, down, nearest)")
    return result(OnnxCast(src, to, bool(attr(node, "saturate", 1)), rm), node)


register_versions("Cast", 19, lambda node, graph: _cast_common(node, graph, attr(node, "to")))
register_versions("CastLike", 15, lambda node, graph: _cast_common(node, graph, elem_type(graph, node.input_values[1])))


# ============================================================================================ Q / DQ
def broadcast_param(p: torch.Tensor, x_shape, axis: int, block_size: int) -> torch.Tensor:
    """Scale / zero point -> broadcastable to ``x_shape`` (ONNX QuantizeLinear granularities): scalar
    or one element: per tensor; 1-D without block_size: per ``axis``; else blocked along ``axis``
    (each value repeated ``block_size`` times, the last block cut to the axis length)."""
    if p.dim() == 0 or p.numel() == 1 and not block_size:
        return p.reshape(())
    r = len(x_shape)
    axis = axis % r
    if not block_size:
        shape = [1] * r
        shape[axis] = p.numel()
        return p.reshape(shape)
    return p.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x_shape[axis])


class OnnxQuantizeLinear(nn.Module, OnnxToTorchModule):
    """ONNX QuantizeLinear: ``y = saturate(round_half_even(x / y_scale) + y_zero_point)`` for integer
    targets; for float8/4/6 targets ``x / y_scale (+ y_zero_point where nonzero)`` cast with the
    type's rounding (``saturate`` for float8). The division runs in ``precision`` when given, else in
    the promoted dtype of x and y_scale. x: float ``[*]``; y_scale / y_zero_point: scalar, ``[D_axis]``
    or blocked; y: carrier of ONNX type ``out_type``."""

    def __init__(self, out_type: int, axis: int, block_size: int, saturate: bool, precision: torch.dtype | None):
        super().__init__()
        self.out_type, self.axis, self.block_size = out_type, axis, block_size
        self.saturate, self.precision = saturate, precision

    def forward(self, x, y_scale, y_zero_point=None):  # noqa: D102
        s = broadcast_param(y_scale, x.shape, self.axis, self.block_size)
        if self.precision is not None:
            v = x.to(self.precision) / s.to(self.precision)
        else:
            v = x / s
        t = self.out_type
        zp = None
        if y_zero_point is not None:
            zp = broadcast_param(decode(y_zero_point, t), x.shape, self.axis, self.block_size)
        if t in INT_RANGES:
            lo, hi = INT_RANGES[t]
            q = torch.round(v.to(torch.float64) if v.dtype == torch.float64 else v.to(torch.float32))
            if zp is not None:
                q = q + zp.to(q.dtype)
            return q.clamp(lo, hi).to(torch_dtype(t))
        if t in FLOAT8:
            if zp is not None:  # a zero float8 zero point is not added (keeps -0, as the reference does)
                v = torch.where(zp != 0, v + zp.to(v.dtype), v)
            return encode_float8(v, t, self.saturate)
        if t in SMALL_FLOAT:
            if zp is not None:
                v = v + zp.to(v.dtype)
            return encode_small_float(v, t)
        raise ValueError(f"QuantizeLinear: unsupported output type {t}")


def _quantize(node: OnnxNode, graph: OnnxGraph):
    zp_type = elem_type(graph, node.input_values[2]) if len(node.input_values) > 2 and node.input_values[2] else None
    out = zp_type or attr(node, "output_dtype", 0) or TP.UINT8
    if out not in INT_RANGES and out not in FLOAT8 and out not in SMALL_FLOAT:
        raise ConversionNotSupported(f"QuantizeLinear node {node.name!r}: output type {TP.DataType.Name(out)} "
                                     f"(valid: int2/4/8/16, uint2/4/8/16, float8, float4e2m1, float6)")
    prec = attr(node, "precision")
    return result(OnnxQuantizeLinear(out, attr(node, "axis", 1), attr(node, "block_size", 0) or 0,
                                     bool(attr(node, "saturate", 1)), torch_dtype(prec) if prec else None), node)


register_versions("QuantizeLinear", 10, _quantize)


class OnnxDequantizeLinear(nn.Module, OnnxToTorchModule):
    """ONNX DequantizeLinear: ``y = (x - x_zero_point) * x_scale``. The difference is taken in float32
    (float64 for int32 x or double scale), multiplied by the scale there, and rounded once to the output
    dtype (``output_dtype``, else the scale's). x: carrier of ONNX type ``x_type``."""

    def __init__(self, x_type: int | None, axis: int, block_size: int, out_dtype: torch.dtype | None):
        super().__init__()
        self.x_type, self.axis, self.block_size, self.out_dtype = x_type, axis, block_size, out_dtype

    def forward(self, x, x_scale, x_zero_point=None):  # noqa: D102
        wide = x.dtype in (torch.int32, torch.int64, torch.uint32) or x_scale.dtype == torch.float64
        cd = torch.float64 if wide else torch.float32
        dx = decode(x, self.x_type).to(cd)
        if x_zero_point is not None:
            dx = dx - broadcast_param(decode(x_zero_point, self.x_type).to(cd), x.shape, self.axis, self.block_size)
        y = dx * broadcast_param(x_scale.to(cd), x.shape, self.axis, self.block_size)
        return y.to(self.out_dtype or x_scale.dtype)


def _dequantize(node: OnnxNode, graph: OnnxGraph):
    od = attr(node, "output_dtype", 0)
    return result(OnnxDequantizeLinear(elem_type(graph, node.input_values[0]), attr(node, "axis", 1),
                                       attr(node, "block_size", 0) or 0, torch_dtype(od) if od else None), node)


register_versions("DequantizeLinear", 10, _dequantize)


class OnnxDynamicQuantizeLinear(nn.Module, OnnxToTorchModule):
    """ONNX DynamicQuantizeLinear-11 (uint8): ``scale = (max(0, max x) - min(0, min x)) / 255`` (1/255
    when the range is 0), ``zp = round(clip(-min / scale, 0, 255))``,
    ``y = clip(round(x / scale) + zp, 0, 255)``; outputs y uint8, scale (x's dtype, scalar), zp uint8."""

    def forward(self, x):  # noqa: D102
        xf = x.to(torch.float32)
        maxx = torch.clamp(xf.max(), min=0.0)
        minx = torch.clamp(xf.min(), max=0.0)
        rng = torch.where(maxx == minx, torch.ones_like(maxx), maxx - minx)
        scale = rng / 255.0
        zp = torch.round(torch.clamp(0.0 - minx / scale, 0.0, 255.0))
        y = torch.clamp(torch.round(xf / scale) + zp, 0.0, 255.0)
        return y.to(torch.uint8), scale.to(x.dtype), zp.to(torch.uint8)


register_versions("DynamicQuantizeLinear", 11, lambda node, graph: result(OnnxDynamicQuantizeLinear(), node))


def _int_operand(x: torch.Tensor, zp: torch.Tensor | None, zp_shape) -> torch.Tensor:
    v = x.to(torch.int64)
    if zp is not None:
        v = v - (zp.to(torch.int64).reshape(zp_shape) if zp.dim() else zp.to(torch.int64))
    return v


class OnnxMatMulInteger(nn.Module, OnnxToTorchModule):
    """ONNX MatMulInteger-10: ``(A - a_zero_point) @ (B - b_zero_point)`` in int32. A ``[..., M, K]``,
    B ``[..., K, N]`` (u)int8; a_zero_point scalar or ``[M]`` (per row), b_zero_point scalar or ``[N]``."""

    def forward(self, a, b, a_zero_point=None, b_zero_point=None):  # noqa: D102
        av = _int_operand(a, a_zero_point, (-1, 1))
        bv = _int_operand(b, b_zero_point, (1, -1))
        return torch.matmul(av, bv).to(torch.int32)


register_versions("MatMulInteger", 10, lambda node, graph: result(OnnxMatMulInteger(), node))


def _conv_params(node: OnnxNode, w_rank: int):
    """strides, pads, dilations, group, auto_pad of a ConvInteger / QLinearConv node (``auto_pad`` SAME_UPPER /
    SAME_LOWER is kept and resolved per call from the input's size, see
    :func:`~qtorch_onnx.lift.ops_conv_pool.runtime_pads`; VALID means zero pads)."""
    n = w_rank - 2
    auto_pad = attr(node, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: auto_pad={auto_pad!r} (valid: NOTSET, "
                                     f"VALID, SAME_UPPER, SAME_LOWER)")
    pads = [0] * 2 * n if auto_pad == "VALID" else list(attr(node, "pads", [0] * 2 * n))
    return (list(attr(node, "strides", [1] * n)), pads, list(attr(node, "dilations", [1] * n)), attr(node, "group", 1),
            auto_pad)


def _int_conv(x, x_zp, w, w_zp, bias, strides, pads, dilations, group, auto_pad="NOTSET") -> torch.Tensor:
    """Exact integer convolution (float64 carries the int32 accumulation exactly): int64 result. ``auto_pad``
    SAME_UPPER / SAME_LOWER: ``pads`` computed from x's spatial size (ONNX spec formula)."""
    n = w.dim() - 2
    pads = runtime_pads(auto_pad, pads, x.shape[2:], w.shape[2:], strides, dilations)
    xv = _int_operand(x, x_zp, ()).to(torch.float64)
    wv = _int_operand(w, w_zp, (-1,) + (1,) * (n + 1)).to(torch.float64)
    acc = conv_nd(xv, wv, None, strides, pads, dilations, group)
    acc = torch.round(acc).to(torch.int64)
    if bias is not None:
        acc = acc + bias.to(torch.int64).reshape((1, -1) + (1,) * n)
    return acc


class OnnxConvInteger(nn.Module, OnnxToTorchModule):
    """ONNX ConvInteger-10: ``conv(x - x_zero_point, w - w_zero_point)`` in int32 (zero padding after
    the zero-point shift); w_zero_point scalar or ``[M]`` per output channel."""

    def __init__(self, strides, pads, dilations, group, auto_pad="NOTSET"):
        super().__init__()
        self.strides, self.pads, self.dilations, self.group = strides, pads, dilations, group
        self.auto_pad = auto_pad

    def forward(self, x, w, x_zero_point=None, w_zero_point=None):  # noqa: D102
        return _int_conv(x, x_zero_point, w, w_zero_point, None, self.strides, self.pads, self.dilations,
                         self.group, self.auto_pad).to(torch.int32)


def _w_rank(node: OnnxNode, graph: OnnxGraph, index: int) -> int:
    name = node.input_values[index]
    if name in graph.initializers:
        return len(graph.initializers[name].proto.dims)
    vi = graph.value_info.get(name)
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        k = attr(node, "kernel_shape")
        if k is None:
            raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: the rank of {name!r} is unknown")
        return len(k) + 2
    return len(vi.type.tensor_type.shape.dim)


register_versions("ConvInteger", 10, lambda node, graph: result(
    OnnxConvInteger(*_conv_params(node, _w_rank(node, graph, 1))), node))


def _requantize(acc: torch.Tensor, multiplier: torch.Tensor, y_zp: torch.Tensor | None, out_dtype: torch.dtype):
    """``saturate(round_half_even(acc * multiplier) + y_zero_point)`` in float32 (QuantizeLinear's formula)."""
    info = torch.iinfo(out_dtype)
    q = torch.round(acc.to(torch.float32) * multiplier.to(torch.float32))
    if y_zp is not None:
        q = q + y_zp.to(torch.float32)
    return q.clamp(info.min, info.max).to(out_dtype)


class OnnxQLinearMatMul(nn.Module, OnnxToTorchModule):
    """ONNX QLinearMatMul-10/21: ``y = saturate(round((a - a_zp) @ (b - b_zp) * a_scale * b_scale / y_scale)
    + y_zp)``, integer accumulation exact, requantization in float32. Scales/zero points are per
    tensor or per row of a (``[M]``) / per column of b (``[N]``); y has y_zero_point's dtype."""

    def forward(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point=None):  # noqa: D102
        acc = torch.matmul(_int_operand(a, a_zero_point, (-1, 1)), _int_operand(b, b_zero_point, (1, -1)))
        a_s = a_scale.to(torch.float32).reshape(-1, 1) if a_scale.dim() else a_scale.to(torch.float32)
        b_s = b_scale.to(torch.float32).reshape(1, -1) if b_scale.dim() else b_scale.to(torch.float32)
        mult = a_s * b_s / y_scale.to(torch.float32)
        return _requantize(acc, mult, y_zero_point, y_zero_point.dtype if y_zero_point is not None else a.dtype)


def _qlinear_matmul(node: OnnxNode, graph: OnnxGraph):
    for i in (0, 3, 7):
        t = elem_type(graph, node.input_values[i]) if len(node.input_values) > i else None
        if t is not None and t not in (TP.INT8, TP.UINT8):
            raise ConversionNotSupported(f"QLinearMatMul node {node.name!r}: input {i} type {TP.DataType.Name(t)} "
                                         f"(supported: int8, uint8)")
    return result(OnnxQLinearMatMul(), node)


register_versions("QLinearMatMul", 10, _qlinear_matmul)


class OnnxQLinearConv(nn.Module, OnnxToTorchModule):
    """ONNX QLinearConv-10: int32 ``acc = conv(x - x_zp, w - w_zp) + B``, then
    ``y = saturate(round(acc * x_scale * w_scale / y_scale) + y_zp)`` (w_scale / w_zp per tensor or per
    output channel ``[M]``); y has y_zero_point's dtype."""

    def __init__(self, strides, pads, dilations, group, auto_pad="NOTSET"):
        super().__init__()
        self.strides, self.pads, self.dilations, self.group = strides, pads, dilations, group
        self.auto_pad = auto_pad

    def forward(self, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point=None, b=None):  # noqa: D102
        acc = _int_conv(x, x_zero_point, w, w_zero_point, b, self.strides, self.pads, self.dilations, self.group,
                        self.auto_pad)
        n = w.dim() - 2
        ws = w_scale.to(torch.float32)
        ws = ws.reshape((1, -1) + (1,) * n) if ws.dim() and ws.numel() > 1 else ws.reshape(())
        mult = x_scale.to(torch.float32) * ws / y_scale.to(torch.float32)
        return _requantize(acc, mult, y_zero_point, y_zero_point.dtype if y_zero_point is not None else x.dtype)


register_versions("QLinearConv", 10, lambda node, graph: result(
    OnnxQLinearConv(*_conv_params(node, _w_rank(node, graph, 3))), node))

# ONNX Runtime's com.microsoft QuantizeLinear / DequantizeLinear (version 1): the same formulas, with
# 16-bit and 4-bit types before the default domain had them (what Quark's 16-bit Q/DQ export writes).
register_converter("QuantizeLinear", [1], domain="com.microsoft")(_quantize)
register_converter("DequantizeLinear", [1], domain="com.microsoft")(_dequantize)
