"""Element-wise math converters (ONNX spec semantics, every ONNX numeric type torch can carry).

* Binary arithmetic and comparisons (Add, Sub, Mul, Div, Pow, Equal, Greater, Less, GreaterOrEqual,
  LessOrEqual) and variadic Max/Min: torch has no CPU kernels for most uint16/uint32/uint64 ops, so
  those run on int64 (uint64 through its bit pattern: exact for add/sub/mul, order-preserving for
  comparisons, max and min by flipping the sign bit, and :func:`udiv64` for division).
  Integer Div truncates toward zero; Pow returns the base's dtype (ONNX: ``T`` of the base).
  These override onnx2torch's converters (same input mapping), which fail on those dtypes; its
  Max/Min also return wrong values for float64 inputs.
* Bitwise ops and BitShift, BitCast (bit reinterpretation), Flatten (onnx2torch's fails for axis 0
  and negative axes), Hardmax, Trilu, CumSum (dtype-preserving) and CumProd, Det, and the unary
  functions onnx2torch lacks (Acosh, Asinh, Atanh, Cosh, Sinh, Mish, Swish, Shrink,
  ThresholdedRelu, Selu with any alpha/gamma, IsInf with detect_positive/negative).
* Clip-11/12/13 with constant *or runtime* ``min``/``max`` and every numeric type (overrides
  onnx2torch's, which rejects runtime bounds and turns integer bounds into floats; uint16/32/64,
  which torch cannot clamp, through the order-preserving int64 image, exact).
* onnx2torch's ArgMax/ArgMin, ReduceMax/ReduceMin (opsets 1-13), Abs and Sign wrapped
  (:class:`OnnxOrderedUnsigned`) so that uint16/uint32/uint64 inputs work too.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from .ops_common import (
    TP, ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, OperationConverterResult, attr, const_tensor,
    register_converter, register_versions, registered, result, torch_dtype,
)

_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_SIGN64 = -(1 << 63)


def _to_ordered_int64(t: torch.Tensor) -> torch.Tensor:
    """Unsigned tensor -> int64 with the same order (uint64: bit pattern with the sign bit flipped)."""
    if t.dtype == torch.uint64:
        return t.view(torch.int64) ^ _SIGN64
    return t.to(torch.int64)


def _from_ordered_int64(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint64:
        return (t ^ _SIGN64).view(torch.uint64)
    return t.to(dtype)


def _as_int64_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64) if t.dtype == torch.uint64 else t.to(torch.int64)


def _back_from_bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(torch.uint64) if dtype == torch.uint64 else t.to(dtype)


def udiv64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Unsigned 64-bit ``a // b`` on int64 bit patterns (both broadcast): for ``b >= 2^63`` the quotient
    is ``a >= b``; otherwise ``q = ((a >>> 1) // b) << 1`` corrected by one when the remainder
    ``a - q b`` (exact modulo 2^64) is still ``>= b`` (the usual halving trick)."""
    a, b = torch.broadcast_tensors(a, b)
    ua, ub = a ^ _SIGN64, b ^ _SIGN64  # order-preserving signed images
    big = b < 0
    half = (a >> 1) & 0x7FFFFFFFFFFFFFFF  # logical shift right by one: non-negative
    safe_b = torch.where(big, torch.ones_like(b), b)
    q = torch.div(half, safe_b, rounding_mode="floor") << 1
    r = a - q * safe_b
    q = q + ((r ^ _SIGN64) >= (safe_b ^ _SIGN64)).to(torch.int64)
    return torch.where(big, (ua >= ub).to(torch.int64), q)


_ARITH = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul}
_COMPARE = {"Equal": torch.eq, "Greater": torch.gt, "Less": torch.lt, "GreaterOrEqual": torch.ge,
            "LessOrEqual": torch.le}


class OnnxBinaryOp(nn.Module, OnnxToTorchModule):
    """ONNX Add/Sub/Mul/Div/Pow/Equal/Greater/Less/GreaterOrEqual/LessOrEqual with numpy broadcasting.

    a, b: tensors of one ONNX type (Pow: any numeric exponent); output a's dtype (bool for
    comparisons). Integer Div truncates toward zero (C semantics, as the ONNX reference). The torch
    function is chosen once at construction; the per-call work for float inputs is one call.
    """

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self._fn = _ARITH.get(op) or _COMPARE.get(op)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # noqa: D102
        fn = self._fn
        if fn is not None and a.dtype not in _WIDE_UNSIGNED and b.dtype not in _WIDE_UNSIGNED:
            return fn(a, b)
        return self._general(a, b)

    def _general(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        op = self.op
        if op == "Pow":
            return torch.pow(a, b).to(a.dtype)
        wide = a.dtype in _WIDE_UNSIGNED
        if op in _ARITH:
            return _back_from_bits(_ARITH[op](_as_int64_bits(a), _as_int64_bits(b)), a.dtype)
        if op == "Div":
            if a.is_floating_point() or a.is_complex():
                return torch.div(a, b)
            if a.dtype == torch.uint64:
                return udiv64(_as_int64_bits(a), _as_int64_bits(b)).view(torch.uint64)
            if wide:
                return _back_from_bits(torch.div(_as_int64_bits(a), _as_int64_bits(b), rounding_mode="trunc"), a.dtype)
            return torch.div(a, b, rounding_mode="trunc")
        return _COMPARE[op](_to_ordered_int64(a), _to_ordered_int64(b))


def _binary(node: OnnxNode, graph: OnnxGraph):
    if attr(node, "broadcast") is not None or attr(node, "axis") is not None:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: legacy broadcast/axis attributes "
                                     f"(opset < 7)")
    return result(OnnxBinaryOp(node.operation_type), node)


for _op in ("Add", "Sub", "Mul", "Div"):
    register_versions(_op, 7, _binary, override=[7, 13, 14])
register_versions("Pow", 7, _binary, override=[7, 12, 13, 15])
for _op in ("Equal", "Greater", "Less"):
    register_versions(_op, 7, _binary, override=[7, 9, 11, 13])
for _op in ("GreaterOrEqual", "LessOrEqual"):
    register_versions(_op, 12, _binary, override=[12])


class OnnxVariadic(nn.Module, OnnxToTorchModule):
    """ONNX Max / Min (variadic, broadcasting; NaN propagates as in torch.maximum/minimum)."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:  # noqa: D102
        fn = torch.maximum if self.op == "Max" else torch.minimum
        dtype = xs[0].dtype
        wide = dtype in _WIDE_UNSIGNED
        vals = [_to_ordered_int64(x) if wide else x for x in xs]
        out = vals[0]
        for v in vals[1:]:
            out = fn(out, v)
        if len(vals) == 1:
            out = out.clone()
        return _from_ordered_int64(out, dtype) if wide else out


for _op in ("Max", "Min"):
    register_versions(_op, 8, lambda node, graph: result(OnnxVariadic(node.operation_type), node), override=[8, 12, 13])


# ============================================================================================ Clip
class OnnxClip(nn.Module, OnnxToTorchModule):
    """ONNX Clip-11/12/13: ``y = min(max(x, min), max)`` element-wise.

    An absent bound is the type's ``numeric_limits::lowest()`` / ``max()``, as the ONNX Clip spec text
    says and ONNX Runtime does: for float types +-inf are clipped to the largest finite values even
    when no bound is given (ONNX's reference evaluator, ``np.clip`` with ``None``, leaves them; we follow
    the spec and ONNX Runtime). ``min > max`` gives ``max`` everywhere; NaN in x stays NaN, its bits
    kept (torch's two-sided ``clamp`` keeps them; the one-sided forms would not).

    x: tensor of any ONNX numeric type (its carrier dtype; uint16/32/64, for which torch has no clamp
    kernel, are clipped exactly on their order-preserving int64 image); min / max: scalar tensors of x's
    dtype, or absent. Bounds that are initializers are baked into the module as Python numbers (``lo`` / ``hi``;
    ``forward`` then takes x alone); runtime bounds are ``forward`` arguments.
    """

    def __init__(self, lo: int | float | None = None, hi: int | float | None = None, baked: bool = False):
        super().__init__()
        self.lo, self.hi, self.baked = lo, hi, bool(baked)

    def forward(self, x: torch.Tensor, min: torch.Tensor | None = None,  # noqa: A002  (ONNX input names)
                max: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002, D102
        if self.baked:
            lo, hi = self.lo, self.hi
        else:
            lo = None if min is None else min.reshape(()).to(x.dtype)
            hi = None if max is None else max.reshape(()).to(x.dtype)
        if x.is_floating_point():
            if lo is None or hi is None:
                fi = torch.finfo(x.dtype)
                as_tensor = isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor)
                if lo is None:
                    lo = torch.tensor(fi.min, dtype=x.dtype, device=x.device) if as_tensor else fi.min
                if hi is None:
                    hi = torch.tensor(fi.max, dtype=x.dtype, device=x.device) if as_tensor else fi.max
        elif lo is None and hi is None:  # an integer type's own limits clip nothing
            return x
        elif x.dtype in _WIDE_UNSIGNED:
            return _clamp_unsigned(x, lo, hi)
        return torch.clamp(x, lo, hi)


def _ordered_bound(v: torch.Tensor | int | None, dtype: torch.dtype) -> torch.Tensor | int | None:
    """A uint16/32/64 bound (tensor of ``dtype`` or Python int) in :func:`_to_ordered_int64`'s image."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return _to_ordered_int64(v.to(dtype))
    v = int(v)
    return v - (1 << 63) if dtype == torch.uint64 else v


def _clamp_unsigned(x: torch.Tensor, lo, hi) -> torch.Tensor:
    """``clamp(x, lo, hi)`` for uint16/uint32/uint64 ``x``, for which torch has no clamp/min/max/compare
    kernels: computed exactly on the order-preserving int64 image (uint64: the bit pattern with its sign
    bit flipped, so values of 2^63 and above stay exact) and mapped back. ``lo > hi`` gives ``hi``."""
    y = torch.clamp(_to_ordered_int64(x), _ordered_bound(lo, x.dtype), _ordered_bound(hi, x.dtype))
    return _from_ordered_int64(y, x.dtype)


def _clip(node: OnnxNode, graph: OnnxGraph):
    ins = node.input_values
    bounds = [v for v in ins[1:3] if v]
    if all(v in graph.initializers for v in bounds):
        vals = []
        for i in (1, 2):
            t = const_tensor(node, graph, i)
            if t is not None and t.numel() != 1:
                raise ConversionNotSupported(f"Clip node {node.name!r}: input {i} ({ins[i]!r}) must be a scalar, "
                                             f"got shape {list(t.shape)}")
            vals.append(None if t is None else t.reshape(()).item())
        return result(OnnxClip(vals[0], vals[1], baked=True), node, (ins[0],))
    return result(OnnxClip(), node)


# onnx2torch registers Clip-11/12/13 (constant bounds only, cast to float): overridden; Clip-6 (attributes)
# stays onnx2torch's
register_versions("Clip", 11, _clip, override=[11, 12, 13])


# ============================================================================ order-only ops on uint16/32/64
class OnnxOrderedUnsigned(nn.Module, OnnxToTorchModule):
    """onnx2torch's ArgMax/ArgMin, ReduceMax/ReduceMin (opsets 1-13), Abs and Sign made total on
    uint16/uint32/uint64, for which torch has no max/min/argmax/abs/sign kernels.

    ``kind``: ``"index"`` (ArgMax/ArgMin: ``inner`` runs on the order-preserving int64 image of x,
    :func:`_to_ordered_int64`, so ties and ``select_last_index`` behave as on the original values),
    ``"value"`` (ReduceMax/ReduceMin: the same, the result mapped back to x's dtype; exact, uint64 values
    of 2^63 and above included), ``"abs"`` (unsigned: x itself) or ``"sign"`` (unsigned: 1 where x != 0,
    else 0, in x's dtype). Other dtypes call ``inner`` (onnx2torch's module) unchanged.
    """

    def __init__(self, inner: nn.Module, kind: str):
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dtype not in _WIDE_UNSIGNED:
            return self.inner(x, *rest)
        if self.kind == "abs":
            return x.clone()
        if self.kind == "sign":
            return (x != 0).to(x.dtype)
        y = self.inner(_to_ordered_int64(x), *rest)
        return _from_ordered_int64(y, x.dtype) if self.kind == "value" else y


def _ordered_unsigned(op_type: str, version: int, kind: str):
    def convert(node: OnnxNode, graph: OnnxGraph):
        res = registered(op_type, version)(node, graph)  # onnx2torch's own converter for this version
        return OperationConverterResult(torch_module=OnnxOrderedUnsigned(res.torch_module, kind),
                                        onnx_mapping=res.onnx_mapping)
    return convert


for _op, _kind, _versions in (("ArgMax", "index", (11, 12, 13)), ("ArgMin", "index", (11, 12, 13)),
                              ("ReduceMax", "value", (1, 11, 12, 13)), ("ReduceMin", "value", (1, 11, 12, 13)),
                              ("Abs", "abs", (6, 13)), ("Sign", "sign", (9, 13))):
    for _v in _versions:
        if registered(_op, _v) is not None:  # onnx2torch's key: overridden by a wrapper around it
            register_converter(_op, [_v])(_ordered_unsigned(_op, _v, _kind))


# ============================================================================================ bit ops
_BITWISE = {"BitwiseAnd": operator.and_, "BitwiseOr": operator.or_, "BitwiseXor": operator.xor}


class OnnxBitwise(nn.Module, OnnxToTorchModule):
    """ONNX BitwiseAnd/Or/Xor/Not-18 on integer tensors (uint16/32/64 through their int64 bit pattern)."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        dtype = a.dtype
        wide = dtype in _WIDE_UNSIGNED
        x = _as_int64_bits(a) if wide else a
        if self.op == "BitwiseNot":
            y = torch.bitwise_not(x)
        else:
            y = _BITWISE[self.op](x, _as_int64_bits(b) if wide else b)
        return _back_from_bits(y, dtype) if wide else y


for _op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot"):
    register_versions(_op, 18, lambda node, graph: result(OnnxBitwise(node.operation_type), node))


class OnnxBitShift(nn.Module, OnnxToTorchModule):
    """ONNX BitShift-11/28: ``x << y`` or ``x >> y``. Unsigned: logical shift; signed (opset 28):
    arithmetic right shift (sign fill), left shift discarding bits past the sign bit. A shift amount
    below 0 or at least the type width yields the sign fill alone (-1 for a right shift of a negative
    x, else 0), as the spec says."""

    def __init__(self, left: bool):
        super().__init__()
        self.left = left

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: D102
        dtype = x.dtype
        bits = torch.iinfo(dtype).bits
        signed = torch.iinfo(dtype).min < 0
        if dtype == torch.uint64:
            xv, sv = x.view(torch.int64), y.view(torch.int64)
            big = (sv < 0) | (sv >= 64)
            s = sv.clamp(0, 63)
            if self.left:
                out = xv << s
            else:  # logical shift of the bit pattern
                out = torch.where(s == 0, xv, (xv >> s) & ~((_SIGN64 >> s) << 1))
            return torch.where(big, torch.zeros_like(out), out).view(torch.uint64)
        xv, sv = x.to(torch.int64), y.to(torch.int64)
        big = (sv < 0) | (sv >= bits)
        s = sv.clamp(0, bits - 1)
        if self.left:
            out = xv << s
            fill = torch.zeros_like(out)
        else:
            out = xv >> s  # arithmetic for negative x; unsigned values are non-negative here
            fill = torch.where(xv < 0, torch.full_like(out, -1), torch.zeros_like(out)) if signed else torch.zeros_like(out)
        out = torch.where(big, fill, out)
        if not signed:
            out = out & ((1 << bits) - 1)
        return out.to(dtype)  # int64 -> narrower integer wraps (bits past the sign bit are discarded)


def _bitshift(node: OnnxNode, graph: OnnxGraph):
    d = attr(node, "direction")
    if d not in ("LEFT", "RIGHT"):
        raise ConversionNotSupported(f"BitShift node {node.name!r}: direction={d!r} (valid: LEFT, RIGHT)")
    return result(OnnxBitShift(d == "LEFT"), node)


register_versions("BitShift", 11, _bitshift)


class OnnxBitCast(nn.Module, OnnxToTorchModule):
    """ONNX BitCast-26: reinterpret the bits of x as ONNX type ``to`` (same bit width, little endian)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dtype == torch.bool:
            return x.view(torch.uint8).view(self.dtype)
        if self.dtype == torch.bool:
            return x.view(torch.uint8).to(torch.bool)
        return x.contiguous().view(self.dtype)


def _bitcast(node: OnnxNode, graph: OnnxGraph):
    to = attr(node, "to")
    if to in (TP.INT4, TP.UINT4, TP.INT2, TP.UINT2, TP.FLOAT4E2M1, TP.FLOAT6E2M3, TP.FLOAT6E3M2, TP.STRING):
        raise ConversionNotSupported(f"BitCast node {node.name!r}: to={TP.DataType.Name(to)} (sub-byte and string "
                                     f"types are not supported)")
    return result(OnnxBitCast(torch_dtype(to, node)), node)


register_versions("BitCast", 26, _bitcast)


# ============================================================================================ unary
def _selu(x, alpha, gamma):
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


_UNARY = {
    "Acosh": lambda x, a: torch.acosh(x), "Asinh": lambda x, a: torch.asinh(x),
    "Atanh": lambda x, a: torch.atanh(x), "Cosh": lambda x, a: torch.cosh(x), "Sinh": lambda x, a: torch.sinh(x),
    "Mish": lambda x, a: x * torch.tanh(F.softplus(x)),
    "Swish": lambda x, a: x * torch.sigmoid(a["alpha"] * x),
    "Shrink": lambda x, a: torch.where(x < -a["lambd"], x + a["bias"],
                                       torch.where(x > a["lambd"], x - a["bias"], torch.zeros_like(x))),
    "ThresholdedRelu": lambda x, a: torch.where(x > a["alpha"], x, torch.zeros_like(x)),
    "Selu": lambda x, a: _selu(x, a["alpha"], a["gamma"]),
    "IsInf": lambda x, a: (torch.isposinf(x) & a["detect_positive"]) | (torch.isneginf(x) & a["detect_negative"]),
}
_UNARY_ATTRS = {
    "Swish": {"alpha": 1.0}, "Shrink": {"bias": 0.0, "lambd": 0.5}, "ThresholdedRelu": {"alpha": 1.0},
    "Selu": {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
    "IsInf": {"detect_positive": 1, "detect_negative": 1},
}


class OnnxUnary(nn.Module, OnnxToTorchModule):
    """ONNX element-wise unary function ``op`` with its attributes (formulas: the ONNX op docs, e.g.
    Mish ``x tanh(softplus(x))``, Shrink, Selu ``gamma (x > 0 ? x : alpha (e^x - 1))``). Shape and
    dtype preserved (IsInf: bool)."""

    def __init__(self, op: str, attrs: dict):
        super().__init__()
        self.op, self.attrs = op, dict(attrs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        y = _UNARY[self.op](x, self.attrs)
        return y if self.op == "IsInf" or y.dtype == x.dtype else y.to(x.dtype)


def _unary(node: OnnxNode, graph: OnnxGraph):
    op = node.operation_type
    attrs = {k: attr(node, k, v) for k, v in _UNARY_ATTRS.get(op, {}).items()}
    if op == "IsInf":
        attrs = {k: bool(v) for k, v in attrs.items()}
    return result(OnnxUnary(op, attrs), node)


for _op in ("Acosh", "Asinh", "Atanh", "Cosh", "Sinh"):
    register_versions(_op, 9, _unary)
register_versions("Mish", 18, _unary)
register_versions("Swish", 24, _unary)
register_versions("Shrink", 9, _unary)
register_versions("ThresholdedRelu", 10, _unary)
register_versions("Selu", 22, _unary)
register_versions("IsInf", 10, _unary, override=[10])


class OnnxSwiGLU(nn.Module, OnnxToTorchModule):
    """ONNX SwiGLU-28: ``Y = A * sigmoid(alpha * A) * B`` (Swish of the gate times the value input)."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return a * torch.sigmoid(self.alpha * a) * b


register_versions("SwiGLU", 28, lambda node, graph: result(OnnxSwiGLU(float(attr(node, "alpha", 1.0))), node))


# ============================================================================================ shape-ish math
class OnnxFlatten(nn.Module, OnnxToTorchModule):
    """ONNX Flatten: ``[d0..d(r-1)] -> [prod(d0..d(axis-1)), prod(d(axis)..)]``, axis in ``[-r, r]``."""

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        axis = self.axis + x.dim() if self.axis < 0 else self.axis
        lead = 1
        for d in x.shape[:axis]:
            lead *= d
        return x.reshape(lead, -1) if x.numel() else x.reshape(lead, int(torch.tensor(x.shape[axis:]).prod()))


register_versions("Flatten", 9, lambda node, graph: result(OnnxFlatten(attr(node, "axis", 1)), node),
                  override=[9, 11, 13])


class OnnxHardmax(nn.Module, OnnxToTorchModule):
    """ONNX Hardmax: 1 at the first maximum along ``axis`` (opset 13; opsets 1/11 flatten the input to
    2-D at ``axis`` first), 0 elsewhere; x's dtype and shape."""

    def __init__(self, axis: int, coerce_2d: bool):
        super().__init__()
        self.axis, self.coerce_2d = axis, coerce_2d

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        shape = x.shape
        axis = self.axis % x.dim()
        if self.coerce_2d:
            x = x.reshape(int(torch.tensor(shape[:axis]).prod()) if axis else 1, -1)
            axis = 1
        idx = torch.argmax(x, dim=axis, keepdim=True)
        return torch.zeros_like(x).scatter(axis, idx, 1).reshape(shape)


register_versions("Hardmax", 1, lambda node, graph: result(OnnxHardmax(attr(node, "axis", 1), True), node), last=11)
register_versions("Hardmax", 13, lambda node, graph: result(OnnxHardmax(attr(node, "axis", -1), False), node))


class OnnxTrilu(nn.Module, OnnxToTorchModule):
    """ONNX Trilu-14: keep the upper (``upper=1``) or lower triangle of the last two axes, offset by the
    optional scalar input k (diagonal index as torch.triu/tril)."""

    def __init__(self, upper: bool):
        super().__init__()
        self.upper = upper

    def forward(self, x: torch.Tensor, k: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        kk = int(k.reshape(-1)[0]) if k is not None else 0
        if x.dtype == torch.bool or x.dtype in _WIDE_UNSIGNED:
            rows = torch.arange(x.shape[-2], device=x.device).unsqueeze(-1)
            cols = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
            keep = (cols - rows >= kk) if self.upper else (cols - rows <= kk)
            return torch.where(keep, x, torch.zeros_like(x))
        return torch.triu(x, kk) if self.upper else torch.tril(x, kk)


register_versions("Trilu", 14, lambda node, graph: result(OnnxTrilu(bool(attr(node, "upper", 1))), node))


class OnnxCumulative(nn.Module, OnnxToTorchModule):
    """ONNX CumSum-11/14 and CumProd-26 with the spec's defaults (``exclusive=0``, ``reverse=0``).

    The exclusive form shifts the input by one along ``axis`` (identity element first) before the
    inclusive scan. The output keeps x's dtype (torch promotes integer scans to int64).
    """

    def __init__(self, op: str, exclusive: bool = False, reverse: bool = False):
        super().__init__()
        self.op, self.exclusive, self.reverse = op, exclusive, reverse

    def forward(self, x: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:  # noqa: D102
        dim = int(axis.reshape(-1)[0].item()) % x.dim()
        dtype = x.dtype
        if self.reverse:
            x = torch.flip(x, dims=(dim,))
        if self.exclusive:
            first = (torch.zeros_like if self.op == "CumSum" else torch.ones_like)(x.narrow(dim, 0, 1))
            x = torch.cat([first, x.narrow(dim, 0, x.shape[dim] - 1)], dim=dim)
        y = torch.cumsum(x, dim=dim) if self.op == "CumSum" else torch.cumprod(x, dim=dim)
        if self.reverse:
            y = torch.flip(y, dims=(dim,))
        return y.to(dtype)


def _cumulative(node: OnnxNode, graph: OnnxGraph):
    return result(OnnxCumulative(node.operation_type, bool(attr(node, "exclusive", 0)), bool(attr(node, "reverse", 0))),
                  node)


register_versions("CumSum", 11, _cumulative, override=[11, 14])
register_versions("CumProd", 26, _cumulative)


class OnnxDet(nn.Module, OnnxToTorchModule):
    """ONNX Det: determinant of the square matrices in the last two axes ``[*, M, M] -> [*]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.linalg.det(x)


register_versions("Det", 11, lambda node, graph: result(OnnxDet(), node))
