"""Convolution and pooling converters (ONNX spec semantics, any spatial rank 1-3, asymmetric pads).

* Conv / ConvTranspose at the versions onnx2torch lacks (22): onnx2torch's converter when the weight
  (and bias) are initializers and it handles the attributes; otherwise a functional module taking W
  and B as inputs (dynamic weights, ConvTranspose with asymmetric pads or ``output_shape``).
* AveragePool-19/22, MaxPool-22 (with the Indices output and ``storage_order``), LpPool-1..22,
  GlobalMaxPool, GlobalLpPool, MaxUnpool: windows are taken with ``Tensor.unfold`` on the explicitly
  padded input, so dilations, asymmetric pads and ``ceil_mode`` follow the spec exactly (ONNX
  ``ceil_mode``: the output size is rounded up, and a last window that would start in the end
  padding is dropped); torch's own pooling is used where its semantics coincide (symmetric pads no
  larger than half the kernel, no dilation for average pooling).

``auto_pad=SAME_UPPER|SAME_LOWER`` reaches a converter only when the input's spatial shape is not static
(normalization resolves it to explicit ``pads`` otherwise): the padding is then computed on every call
from the actual input size (:func:`runtime_pads`, ONNX operator spec formulas) and applied with an
explicit ``F.pad`` when it is asymmetric (zeros for convolutions and average/Lp pooling, ``-inf`` for
MaxPool; the padded cells count in AveragePool's divisor only with ``count_include_pad=1``, as for
explicit pads). Constant-weight Conv nodes become :class:`SameConv1d` / ``2d`` / ``3d``, subclasses of
torch's ``nn.Conv*d`` that keep the weight a parameter of the module; MaxPool-8..12 and AveragePool-7..11
(onnx2torch's keys) are overridden to handle ``auto_pad`` and forms onnx2torch rejects (asymmetric
average-pool pads, ``storage_order``, the Indices output), and delegate everything else to onnx2torch.
The spec's formulas are followed where ONNX Runtime 1.32 departs from them with SAME_*: it rejects Conv with
dilations, pads MaxPool/AveragePool as if the kernel were not dilated, clamps a negative ConvTranspose total
padding (dilated kernel + output_padding < stride) to 0, and rejects pooling whose spec total is clamped to 0
(kernel < stride); an exported model keeping ``auto_pad`` then runs ONNX Runtime's semantics there.

``conv_nd`` / ``conv_transpose_nd`` / ``runtime_pads`` are shared with the integer convolutions in ``ops_quant``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .normalize import same_pads
from .ops_common import (
    ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, get_converter, onnx2torch_converter,
    register_versions, result, tensor_from_proto,
)

_SAME = ("SAME_UPPER", "SAME_LOWER")

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _torch_pad(pads: list[int], n: int) -> list[int]:
    """ONNX ``[b_1..b_n, e_1..e_n]`` -> torch F.pad order (last axis first: ``[b_n, e_n, ..., b_1, e_1]``)."""
    out = []
    for i in reversed(range(n)):
        out += [pads[i], pads[n + i]]
    return out


def runtime_pads(auto_pad: str, pads, sizes, kernel, strides, dilations) -> list[int]:
    """ONNX ``pads`` ``[b_1..b_n, e_1..e_n]`` for one call: ``auto_pad`` SAME_UPPER / SAME_LOWER computed from
    the actual spatial ``sizes`` of the input (:func:`~qtorch_onnx.lift.normalize.same_pads`: total
    ``max(0, (ceil(in / s) - 1) * s + (k - 1) * d + 1 - in)``, the odd cell at the end for SAME_UPPER, at
    the beginning for SAME_LOWER), zeros for VALID, else the explicit ``pads`` (None: zeros)."""
    n = len(kernel)
    if auto_pad in _SAME:
        return same_pads(list(sizes), list(kernel), list(strides), list(dilations), auto_pad)
    if auto_pad == "VALID" or pads is None:
        return [0] * (2 * n)
    return list(pads)


def conv_nd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, strides, pads, dilations, group: int):
    """ONNX Conv on ``x`` ``[N, C, *S]`` with ``w`` ``[M, C/group, *K]``: zero padding ``pads``
    (``[b..., e...]``, negative values crop), then torch's convolution. Returns ``[N, M, *S_out]``."""
    n = w.dim() - 2
    if x.dim() != n + 2:
        raise ValueError(f"Conv: input rank {x.dim()} does not match weight rank {w.dim()}")
    if n not in _CONV:
        raise ValueError(f"Conv: {n} spatial dimensions (supported: 1, 2, 3)")
    if any(pads):
        if all(p == pads[i % n] for i, p in enumerate(pads)) and min(pads) >= 0:
            return _CONV[n](x, w, b, stride=strides, padding=pads[:n], dilation=dilations, groups=group)
        x = F.pad(x, _torch_pad(pads, n))
    return _CONV[n](x, w, b, stride=strides, padding=0, dilation=dilations, groups=group)


def conv_transpose_nd(x, w, b, strides, pads, dilations, group, output_padding, output_shape=None, auto_pad="NOTSET"):
    """ONNX ConvTranspose: full transposed convolution, ``output_padding`` zeros appended at the end of
    each axis, then ``pads`` cropped (when ``output_shape`` is given the pads come from it: total =
    full + output_padding - output_shape, split as the spec says for ``auto_pad``), then the bias."""
    n = w.dim() - 2
    y = _CONVT[n](x, w, None, stride=strides, padding=0, output_padding=0, groups=group, dilation=dilations)
    full = list(y.shape[2:])
    if any(output_padding):
        y = F.pad(y, _torch_pad([0] * n + list(output_padding), n))
    if output_shape:
        out = list(output_shape)[-n:]
        pads = [0] * (2 * n)
        for i in range(n):
            total = full[i] + output_padding[i] - out[i]
            half = total // 2
            if auto_pad == "SAME_UPPER":
                pads[i], pads[n + i] = half, total - half
            else:
                pads[i], pads[n + i] = total - half, half
    if any(pads):
        y = F.pad(y, _torch_pad([-p for p in pads], n))
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * n)
    return y


def _conv_attrs(node: OnnxNode, n: int | None):
    """strides, pads, dilations, group, auto_pad; with ``n`` None (rank unknown at conversion) the absent
    per-axis attributes stay None and :class:`OnnxConv` fills the ONNX defaults from the weight's rank."""
    def get(name, default):
        v = attr(node, name)
        return list(v) if v is not None else (None if n is None else default)

    pads = get("pads", [0] * 2 * (n or 0))
    auto_pad = attr(node, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID") + _SAME:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: auto_pad={auto_pad!r} (valid: NOTSET, "
                                     f"VALID, SAME_UPPER, SAME_LOWER)")
    if auto_pad == "VALID":
        pads = None if n is None else [0] * 2 * n
    return (get("strides", [1] * (n or 0)), pads, get("dilations", [1] * (n or 0)), attr(node, "group", 1), auto_pad)


class OnnxConv(nn.Module, OnnxToTorchModule):
    """ONNX Conv with W (and B) as inputs: x ``[N, C, *S]``, w ``[M, C/group, *K]``, b ``[M]``. ``strides`` /
    ``pads`` / ``dilations`` None: the ONNX defaults (1 / 0 / 1 per spatial axis of ``w``); ``auto_pad``
    SAME_UPPER / SAME_LOWER: the pads are computed from x's spatial size and w's kernel on every call."""

    def __init__(self, strides, pads, dilations, group, auto_pad: str = "NOTSET"):
        super().__init__()
        self.strides, self.pads, self.dilations, self.group = strides, pads, dilations, group
        self.auto_pad = auto_pad

    def forward(self, x, w, b=None):  # noqa: D102
        n = w.dim() - 2
        strides, dilations = self.strides or [1] * n, self.dilations or [1] * n
        pads = runtime_pads(self.auto_pad, self.pads, x.shape[2:], w.shape[2:], strides, dilations)
        return conv_nd(x, w, b, strides, pads, dilations, self.group)


class _SameConv:
    """``forward`` of :class:`SameConv1d` / ``2d`` / ``3d``: ONNX Conv with ``auto_pad`` SAME_UPPER / SAME_LOWER
    on ``[N, C, *S]``; the pads follow from the actual ``S`` (:func:`runtime_pads`); symmetric ones go to
    torch's convolution (as the explicit pads of a static shape would), asymmetric ones to ``F.pad`` first."""

    auto_pad: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        pads = runtime_pads(self.auto_pad, None, x.shape[2:], self.kernel_size, self.stride, self.dilation)
        return conv_nd(x, self.weight, self.bias, list(self.stride), pads, list(self.dilation), self.groups)

    def extra_repr(self) -> str:  # noqa: D102
        return super().extra_repr() + f", auto_pad={self.auto_pad!r}"


class SameConv1d(_SameConv, nn.Conv1d):
    """``nn.Conv1d`` (``padding=0``) whose zero padding is ONNX ``auto_pad`` SAME_UPPER / SAME_LOWER, computed
    from the input's length on every call. x ``[N, C, L]`` -> ``[N, M, ceil(L / stride)]``."""


class SameConv2d(_SameConv, nn.Conv2d):
    """``nn.Conv2d`` (``padding=0``) whose zero padding is ONNX ``auto_pad`` SAME_UPPER / SAME_LOWER, computed
    from the input's spatial size on every call. x ``[N, C, H, W]`` -> ``[N, M, ceil(H / s_h), ceil(W / s_w)]``."""


class SameConv3d(_SameConv, nn.Conv3d):
    """``nn.Conv3d`` (``padding=0``) whose zero padding is ONNX ``auto_pad`` SAME_UPPER / SAME_LOWER, computed
    from the input's spatial size on every call. x ``[N, C, D, H, W]`` -> ``[N, M, ceil(D / s), ...]``."""


_SAME_CONV = {1: SameConv1d, 2: SameConv2d, 3: SameConv3d}


def _same_conv(node: OnnxNode, graph: OnnxGraph, strides, dilations, group, auto_pad):
    """Constant-weight Conv with auto_pad SAME_*: a :class:`SameConv2d` (etc.) holding W (and B) as parameters
    in the initializers' dtype; only x is an fx input (the lifter maps the initializers to the parameters)."""
    w = tensor_from_proto(graph.initializers[node.input_values[1]].proto)
    b_name = node.input_values[2] if len(node.input_values) > 2 and node.input_values[2] else None
    b = tensor_from_proto(graph.initializers[b_name].proto) if b_name else None
    n = w.dim() - 2
    mod = _SAME_CONV[n](w.shape[1] * group, w.shape[0], tuple(w.shape[2:]), stride=strides, padding=0,
                        dilation=dilations, groups=group, bias=b is not None, dtype=w.dtype)
    mod.auto_pad = auto_pad
    with torch.no_grad():
        mod.weight.data = w
        if b is not None:
            mod.bias.data = b
    return result(mod, node, inputs=(node.input_values[0],))


class OnnxConvTranspose(nn.Module, OnnxToTorchModule):
    """ONNX ConvTranspose with W (and B) as inputs: x ``[N, C, *S]``, w ``[C, M/group, *K]``, b ``[M]``;
    ``output_padding``, ``output_shape``, asymmetric ``pads`` as :func:`conv_transpose_nd`."""

    def __init__(self, strides, pads, dilations, group, output_padding, output_shape, auto_pad):
        super().__init__()
        self.strides, self.pads, self.dilations, self.group = strides, pads, dilations, group
        self.output_padding, self.output_shape, self.auto_pad = output_padding, output_shape, auto_pad

    def forward(self, x, w, b=None):  # noqa: D102
        pads = self.pads
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER") and not self.output_shape:
            n = w.dim() - 2
            out = [x.shape[2 + i] * self.strides[i] for i in range(n)]
            return conv_transpose_nd(x, w, b, self.strides, pads, self.dilations, self.group, self.output_padding,
                                     out, self.auto_pad)
        return conv_transpose_nd(x, w, b, self.strides, pads, self.dilations, self.group, self.output_padding,
                                 self.output_shape, self.auto_pad)


def _rank_of_weight(node: OnnxNode, graph: OnnxGraph, index: int = 1) -> int:
    name = node.input_values[index]
    if name in graph.initializers:
        return len(graph.initializers[name].proto.dims) - 2
    for value in (name, node.input_values[0]):  # the weight's rank, else the data input's (same rank)
        vi = graph.value_info.get(value)
        if vi is not None and vi.type.tensor_type.HasField("shape"):
            return len(vi.type.tensor_type.shape.dim) - 2
    k = attr(node, "kernel_shape")
    if k is None:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: the rank of weight {name!r} is unknown")
    return len(k)


def _conv(node: OnnxNode, graph: OnnxGraph):
    try:
        n = _rank_of_weight(node, graph)
    except ConversionNotSupported:
        n = None  # a run-time weight behind an op shape inference does not know: OnnxConv fills the defaults
    strides, pads, dil, group, auto_pad = _conv_attrs(node, n)
    consts = all(v in graph.initializers for v in node.input_values[1:] if v)
    if consts and auto_pad == "NOTSET" and n in (1, 2, 3):
        return get_converter(operation_type="Conv", version=11)(node, graph)
    if consts and auto_pad in _SAME and n in (1, 2, 3):
        return _same_conv(node, graph, strides, dil, group, auto_pad)
    return result(OnnxConv(strides, pads, dil, group, auto_pad), node)


def _conv_transpose(node: OnnxNode, graph: OnnxGraph):
    n = _rank_of_weight(node, graph)
    strides, pads, dil, group, auto_pad = _conv_attrs(node, n)
    out_pad = list(attr(node, "output_padding", [0] * n))
    out_shape = attr(node, "output_shape")
    consts = all(v in graph.initializers for v in node.input_values[1:] if v)
    symmetric = pads[:n] == pads[n:]
    if consts and symmetric and out_shape is None and auto_pad == "NOTSET" and \
            all(o < max(s, d) for o, s, d in zip(out_pad, strides, dil)):
        return get_converter(operation_type="ConvTranspose", version=11)(node, graph)
    return result(OnnxConvTranspose(strides, pads, dil, group, out_pad, out_shape, auto_pad), node)


# Conv-1/11 and ConvTranspose-1/11 are onnx2torch's, which needs the weight as an initializer: overridden so a
# weight computed at run time (a quantized model's DequantizeLinear / BFPQuantizeDequantize output) lifts too;
# constant weights still go to onnx2torch's converter (nn.Conv2d etc.).
register_versions("Conv", 1, _conv, override=(1, 11))
register_versions("ConvTranspose", 1, _conv_transpose, override=(1, 11))


# ============================================================================================ pooling
def pool_geometry(in_sizes, kernel, strides, pads, dilations, ceil_mode: bool):
    """ONNX pooling output sizes and the end padding actually needed (``ceil_mode`` extra).

    ``out = floor_or_ceil((in + b + e - ((k - 1) d + 1)) / s) + 1``; with ``ceil_mode`` a last window
    starting at or after ``in + b`` is dropped. Returns ``(out_sizes, extra_end)``.
    """
    outs, extra = [], []
    n = len(in_sizes)
    for i in range(n):
        eff = (kernel[i] - 1) * dilations[i] + 1
        span = in_sizes[i] + pads[i] + pads[n + i] - eff
        o = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (o - 1) * strides[i] >= in_sizes[i] + pads[i]:
            o -= 1
        outs.append(max(o, 0))
        need = (o - 1) * strides[i] + eff
        extra.append(max(0, need - (in_sizes[i] + pads[i] + pads[n + i])))
    return outs, extra


def windows(x: torch.Tensor, kernel, strides, dilations) -> torch.Tensor:
    """``[N, C, *S]`` (already padded) -> ``[N, C, *out, K]`` sliding windows, K = prod(kernel)."""
    n = len(kernel)
    for i in range(n):
        eff = (kernel[i] - 1) * dilations[i] + 1
        x = x.unfold(2 + i, eff, strides[i])
        if dilations[i] > 1:
            x = x[..., :: dilations[i]]
    return x.flatten(start_dim=2 + n)


def _padded(x, pads, extra, value, n):
    full = list(pads[:n]) + [pads[n + i] + extra[i] for i in range(n)]
    return F.pad(x, _torch_pad(full, n), value=value) if any(full) else x


class OnnxPool(nn.Module, OnnxToTorchModule):
    """ONNX AveragePool / MaxPool / LpPool on ``[N, C, *S]`` (see the module docstring).

    ``kind``: ``avg`` (``count_include_pad``: explicit pads count in the divisor, the ceil-mode extra
    does not), ``max`` (optionally returning int64 Indices into the flattened input, row-major or,
    with ``storage_order=1``, column-major spatial order), ``lp`` (``(sum |x|^p)^(1/p)``).
    ``auto_pad`` SAME_UPPER / SAME_LOWER: ``pads`` is ignored and computed from ``S`` on every call
    (:func:`runtime_pads`); the output then has ``ceil(S / strides)`` cells, ``ceil_mode`` or not.
    """

    def __init__(self, kind, kernel, strides, pads, dilations, ceil_mode, count_include_pad=0, p=2,
                 storage_order=0, n_outputs=1, auto_pad: str = "NOTSET"):
        super().__init__()
        self.kind, self.kernel, self.strides, self.pads = kind, list(kernel), list(strides), list(pads)
        self.dilations, self.ceil_mode, self.count_include_pad = list(dilations), bool(ceil_mode), bool(count_include_pad)
        self.p, self.storage_order, self.n_outputs, self.auto_pad = p, storage_order, n_outputs, auto_pad

    def _fast(self, x, pads):
        n = len(self.kernel)
        sym = pads[:n] == pads[n:] and all(2 * p <= k for p, k in zip(pads[:n], self.kernel))
        if not sym or n not in (1, 2, 3) or self.n_outputs > 1:
            return None
        if self.kind == "max":
            fn = getattr(F, f"max_pool{n}d")
            return fn(x, self.kernel, self.strides, pads[:n], self.dilations, ceil_mode=self.ceil_mode)
        if self.kind == "avg" and all(d == 1 for d in self.dilations):
            fn = getattr(F, f"avg_pool{n}d")
            return fn(x, self.kernel, self.strides, pads[:n], ceil_mode=self.ceil_mode,
                      count_include_pad=self.count_include_pad)
        return None

    def forward(self, x: torch.Tensor):  # noqa: D102
        pads = runtime_pads(self.auto_pad, self.pads, x.shape[2:], self.kernel, self.strides, self.dilations)
        y = self._fast(x, pads) if x.is_floating_point() else None
        if y is not None:
            return y
        n = len(self.kernel)
        sizes = list(x.shape[2:])
        outs, extra = pool_geometry(sizes, self.kernel, self.strides, pads, self.dilations, self.ceil_mode)
        if self.kind == "max":
            low = torch.finfo(x.dtype).min if x.is_floating_point() else torch.iinfo(x.dtype).min
            xp = _padded(x, pads, extra, float("-inf") if x.is_floating_point() else low, n)
            w = windows(xp, self.kernel, self.strides, self.dilations)
            val, arg = w.max(dim=-1)
            if self.n_outputs == 1:
                return val
            idx = torch.arange(math.prod(sizes), device=x.device).reshape([1, 1] + sizes)
            if self.storage_order == 1:
                idx = torch.arange(math.prod(sizes), device=x.device).reshape(list(reversed(sizes)))
                idx = idx.permute(list(reversed(range(n)))).reshape([1, 1] + sizes)
            idx = _padded(idx, pads, extra, -1, n)
            iw = windows(idx.expand(x.shape[0], x.shape[1], *idx.shape[2:]), self.kernel, self.strides, self.dilations)
            ind = torch.gather(iw, -1, arg.unsqueeze(-1)).squeeze(-1)
            base = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1], *([1] * n))
            return val, ind + base * math.prod(sizes)
        xp = _padded(x, pads, extra, 0.0, n)
        w = windows(xp, self.kernel, self.strides, self.dilations)
        if self.kind == "lp":
            return w.abs().pow(self.p).sum(dim=-1).pow(1.0 / self.p)
        ones = torch.ones([1, 1] + sizes, dtype=x.dtype, device=x.device)
        mask = F.pad(ones, _torch_pad(list(pads[:n]) + list(pads[n:]), n),
                     value=1.0 if self.count_include_pad else 0.0)
        mask = F.pad(mask, _torch_pad([0] * n + extra, n), value=0.0)
        cnt = windows(mask, self.kernel, self.strides, self.dilations).sum(dim=-1)
        return w.sum(dim=-1) / cnt


def _pool_converter(kind: str):
    def convert(node: OnnxNode, graph: OnnxGraph):
        kernel = attr(node, "kernel_shape")
        if kernel is None:
            raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: kernel_shape is required")
        n = len(kernel)
        auto_pad = attr(node, "auto_pad", "NOTSET")
        if auto_pad not in ("NOTSET", "VALID") + _SAME:
            raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: auto_pad={auto_pad!r} (valid: "
                                         f"NOTSET, VALID, SAME_UPPER, SAME_LOWER)")
        pads = [0] * (2 * n) if auto_pad != "NOTSET" else list(attr(node, "pads", [0] * 2 * n))
        so = attr(node, "storage_order", 0)
        mod = OnnxPool(kind, kernel, attr(node, "strides", [1] * n), pads, attr(node, "dilations", [1] * n),
                       attr(node, "ceil_mode", 0), attr(node, "count_include_pad", 0), attr(node, "p", 2), so,
                       len(node.output_values), auto_pad if auto_pad in _SAME else "NOTSET")
        return result(mod, node)

    return convert


def _pool_override(kind: str, op_type: str):
    """MaxPool-8..12 / AveragePool-7..11 (onnx2torch's keys): onnx2torch's converter (``nn.MaxPool2d`` etc.,
    so models with static shapes lift as before) unless the node keeps ``auto_pad`` SAME_* (a dynamic
    shape) or onnx2torch rejects it (asymmetric average-pool pads, ``storage_order=1``, the Indices
    output, ``count_include_pad`` with asymmetric pads): then :class:`OnnxPool`."""
    ours = _pool_converter(kind)

    def convert(node: OnnxNode, graph: OnnxGraph):
        if attr(node, "auto_pad", "NOTSET") in _SAME or len(node.output_values) > 1:
            return ours(node, graph)
        theirs = onnx2torch_converter(op_type, _ONNX2TORCH_VERSION[op_type])
        try:
            return theirs(node, graph)
        except NotImplementedError:  # not a KeyError (no value_info for the input): reported as before
            return ours(node, graph)

    return convert


_ONNX2TORCH_VERSION = {"MaxPool": 12, "AveragePool": 11}

register_versions("AveragePool", 1, _pool_override("avg", "AveragePool"), override=(7, 10, 11), last=11)
register_versions("AveragePool", 19, _pool_converter("avg"))
register_versions("MaxPool", 1, _pool_override("max", "MaxPool"), override=(8, 10, 11, 12), last=12)
register_versions("MaxPool", 22, _pool_converter("max"))
register_versions("LpPool", 11, _pool_converter("lp"))


class OnnxGlobalPool(nn.Module, OnnxToTorchModule):
    """ONNX GlobalMaxPool / GlobalAveragePool / GlobalLpPool: reduce all spatial axes, keep them as 1."""

    def __init__(self, kind: str, p: int = 2):
        super().__init__()
        self.kind, self.p = kind, p

    def forward(self, x):  # noqa: D102
        dims = tuple(range(2, x.dim()))
        if self.kind == "max":
            return x.amax(dim=dims, keepdim=True)
        if self.kind == "avg":
            return x.mean(dim=dims, keepdim=True)
        return x.abs().pow(self.p).sum(dim=dims, keepdim=True).pow(1.0 / self.p)


register_versions("GlobalMaxPool", 1, lambda node, graph: result(OnnxGlobalPool("max"), node))
register_versions("GlobalLpPool", 2, lambda node, graph: result(OnnxGlobalPool("lp", attr(node, "p", 2)), node))


class OnnxMaxUnpool(nn.Module, OnnxToTorchModule):
    """ONNX MaxUnpool-9/11/22: scatter X ``[N, C, *S]`` into zeros at the flat Indices (over the whole
    tensor of the inferred shape ``(S - 1) * stride + kernel - pad_b - pad_e`` per spatial axis, as
    MaxPool writes them). An ``output_shape`` input only enlarges the result: the inferred-shape result
    sits at its start, zeros elsewhere (the behavior of ONNX's reference implementation and backend
    test; ONNX Runtime instead reads the indices in the output_shape layout)."""

    def __init__(self, kernel, strides, pads):
        super().__init__()
        self.kernel, self.strides, self.pads = kernel, strides, pads

    def forward(self, x, indices, output_shape=None):  # noqa: D102
        n = len(self.kernel)
        shape = list(x.shape[:2]) + [(x.shape[2 + i] - 1) * self.strides[i] + self.kernel[i]
                                     - self.pads[i] - self.pads[n + i] for i in range(n)]
        y = torch.zeros(math.prod(shape), dtype=x.dtype, device=x.device)
        y = y.scatter(0, indices.reshape(-1).to(torch.int64), x.reshape(-1)).reshape(shape)
        if output_shape is not None:
            out = [int(v) for v in output_shape.tolist()]
            y = F.pad(y, _torch_pad([0] * len(out) + [o - s for o, s in zip(out, shape)], len(out)))
        return y


def _max_unpool(node: OnnxNode, graph: OnnxGraph):
    kernel = attr(node, "kernel_shape")
    n = len(kernel)
    return result(OnnxMaxUnpool(kernel, attr(node, "strides", [1] * n), attr(node, "pads", [0] * 2 * n)), node)


register_versions("MaxUnpool", 9, _max_unpool)


class OnnxCausalConvWithState(nn.Module, OnnxToTorchModule):
    """ONNX CausalConvWithState-27: depthwise causal 1-D convolution of x ``[B, C, L]`` with w ``[C, 1, k]``
    over ``concat(past_state or zeros [B, C, k-1], x)``; optional bias ``[C]`` and fused SiLU
    (``activation`` silu/swish). Outputs y ``[B, C, L]`` and present_state, the last k-1 positions of the
    concatenated sequence."""

    def __init__(self, activation: str, n_outputs: int):
        super().__init__()
        self.activation, self.n_outputs = activation, n_outputs

    def forward(self, x, w, b=None, past_state=None):  # noqa: D102
        k = w.shape[-1]
        if past_state is None:
            past_state = torch.zeros(x.shape[0], x.shape[1], k - 1, dtype=x.dtype, device=x.device)
        full = torch.cat([past_state, x], dim=2)
        y = F.conv1d(full, w, b, groups=x.shape[1])
        if self.activation in ("silu", "swish"):
            y = F.silu(y)
        present = full[:, :, full.shape[2] - (k - 1):]
        return y if self.n_outputs == 1 else (y, present)


def _causal_conv(node: OnnxNode, graph: OnnxGraph):
    act = attr(node, "activation", "none")
    if act not in ("silu", "swish", "none"):
        raise ConversionNotSupported(f"CausalConvWithState node {node.name!r}: activation={act!r} "
                                     f"(valid: silu, swish, none)")
    return result(OnnxCausalConvWithState(act, len(node.output_values)), node)


register_versions("CausalConvWithState", 27, _causal_conv)
