"""Normalization converters: LayerNormalization (all three outputs), RMSNormalization, GroupNormalization,
LpNormalization, MeanVarianceNormalization. Semantics from the ONNX operator spec (opset 17-23)."""
from __future__ import annotations

import torch
from torch import nn

from .ops_common import (
    TP, ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, const_tensor, register_versions, result,
)

_STASH = {TP.FLOAT: torch.float32, TP.DOUBLE: torch.float64, TP.FLOAT16: torch.float16, TP.BFLOAT16: torch.bfloat16}


def _stash_dtype(node: OnnxNode) -> torch.dtype | None:
    """torch dtype of ``stash_type`` (default 1 = float32); ``-1`` or absent on old schemas: input dtype."""
    st = attr(node, "stash_type", 1)
    if st == -1:
        return None
    if st not in _STASH:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: stash_type={st} "
                                     f"(valid: 1 float, 11 double, 10 float16, 16 bfloat16)")
    return _STASH[st]


class OnnxLayerNorm(nn.Module, OnnxToTorchModule):
    """ONNX LayerNormalization-17: ``Y = (X - mean) * InvStdDev * Scale + B`` over axes ``[axis, rank)``.

    Shapes: X ``[d0..d(r-1)]``; Scale/B broadcastable to ``X.shape[axis:]``; outputs Y (X's shape, X's
    dtype), Mean and InvStdDev (``[d0..d(axis-1), 1, ..., 1]``, stash dtype). Stage one (mean,
    variance, normalization) runs in ``stash_type`` precision (default float32), as the spec says.
    Scale/B given as initializers are held as parameters ``weight``/``bias`` (then ``forward`` takes X
    only, the input mapping onnx2torch's converter uses, so this module can replace onnx2torch's: its
    module returns only Y, and ignores ``stash_type``).
    """

    def __init__(self, axis: int, epsilon: float, stash: torch.dtype | None, n_outputs: int,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__()
        self.axis, self.epsilon, self.stash, self.n_outputs = axis, float(epsilon), stash, n_outputs
        self.weight = nn.Parameter(weight) if weight is not None else None
        self.bias = nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None):  # noqa: D102
        if scale is None:
            scale, bias = self.weight, self.bias
        axis = self.axis % x.dim()
        dims = tuple(range(axis, x.dim()))
        xs = x.to(self.stash) if self.stash is not None else x
        mean = xs.mean(dim=dims, keepdim=True)
        d = xs - mean
        var = (d * d).mean(dim=dims, keepdim=True)
        inv = torch.rsqrt(var + self.epsilon)
        y = (d * inv).to(x.dtype) * scale
        if bias is not None:
            y = y + bias
        if self.n_outputs == 1:
            return y
        return y, mean, inv


def _layer_norm(node: OnnxNode, graph: OnnxGraph):
    axis = attr(node, "axis", -1)
    eps = attr(node, "epsilon", 1e-5)
    stash = _stash_dtype(node)
    n_out = len(node.output_values)
    ins = node.input_values
    if all(v in graph.initializers for v in ins[1:] if v):  # onnx2torch's mapping for constant Scale/B
        w = const_tensor(node, graph, 1)
        b = const_tensor(node, graph, 2)
        return result(OnnxLayerNorm(axis, eps, stash, n_out, w, b), node, (ins[0],))
    return result(OnnxLayerNorm(axis, eps, stash, n_out), node)


register_versions("LayerNormalization", 17, _layer_norm, override=[17])


class OnnxRMSNorm(nn.Module, OnnxToTorchModule):
    """ONNX RMSNormalization-23: ``Y = X / sqrt(mean(X^2 over [axis, rank)) + epsilon) * scale``.

    X: float tensor; scale broadcastable to ``X.shape[axis:]``; Y: X's shape and dtype. Stage one in
    ``stash_type`` precision (default float32), normalized value cast back to X's dtype, then scaled.
    """

    def __init__(self, axis: int, epsilon: float, stash: torch.dtype | None):
        super().__init__()
        self.axis, self.epsilon, self.stash = axis, float(epsilon), stash

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # noqa: D102
        dims = tuple(range(self.axis % x.dim(), x.dim()))
        xs = x.to(self.stash) if self.stash is not None else x
        rms = torch.sqrt((xs * xs).mean(dim=dims, keepdim=True) + self.epsilon)
        return (xs / rms).to(x.dtype) * scale


register_versions("RMSNormalization", 23, lambda node, graph: result(
    OnnxRMSNorm(attr(node, "axis", -1), attr(node, "epsilon", 1e-5), _stash_dtype(node)), node))


class OnnxGroupNorm(nn.Module, OnnxToTorchModule):
    """ONNX GroupNormalization-18/21: per instance and group of channels, ``(x - mean) / sqrt(var + eps)``
    then ``* scale + bias``. X: ``[N, C, ...]``. Opset 18: scale/bias ``[num_groups]`` (one per group);
    opset 21: ``[C]`` and stage one in ``stash_type`` precision."""

    def __init__(self, num_groups: int, epsilon: float, per_group: bool, stash: torch.dtype | None):
        super().__init__()
        self.num_groups, self.epsilon, self.per_group, self.stash = num_groups, float(epsilon), per_group, stash

    def forward(self, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # noqa: D102
        n, c = x.shape[0], x.shape[1]
        g = self.num_groups
        xs = x.to(self.stash) if self.stash is not None else x
        xg = xs.reshape(n, g, -1)
        mean = xg.mean(dim=2, keepdim=True)
        d = xg - mean
        var = (d * d).mean(dim=2, keepdim=True)
        y = (d / torch.sqrt(var + self.epsilon)).reshape(x.shape).to(x.dtype)
        shape = (1, c) + (1,) * (x.dim() - 2)
        if self.per_group:
            scale = scale.repeat_interleave(c // g)
            bias = bias.repeat_interleave(c // g)
        return y * scale.reshape(shape) + bias.reshape(shape)


def _group_norm_converter(per_group: bool):
    """Converter for GroupNormalization-18 (``per_group``: scale/bias per group) or -21 (per channel)."""

    def convert(node: OnnxNode, graph: OnnxGraph):
        g = attr(node, "num_groups")
        if g is None:
            raise ConversionNotSupported(f"GroupNormalization node {node.name!r}: the num_groups attribute is required")
        stash = None if per_group else _stash_dtype(node)
        return result(OnnxGroupNorm(g, attr(node, "epsilon", 1e-5), per_group, stash), node)

    return convert


register_versions("GroupNormalization", 18, _group_norm_converter(True), last=18)
register_versions("GroupNormalization", 21, _group_norm_converter(False))


class OnnxLpNorm(nn.Module, OnnxToTorchModule):
    """ONNX LpNormalization-1/22: ``x / ||x||_p`` along ``axis`` (p in {1, 2}); zero where the norm is 0."""

    def __init__(self, p: int, axis: int):
        super().__init__()
        self.p, self.axis = p, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self.p == 1:
            norm = x.abs().sum(dim=self.axis, keepdim=True)
        else:
            norm = torch.sqrt((x * x).sum(dim=self.axis, keepdim=True))
        return torch.where(norm == 0, torch.zeros_like(x), x / norm)


def _lp_norm(node: OnnxNode, graph: OnnxGraph):
    p = attr(node, "p", 2)
    if p not in (1, 2):
        raise ConversionNotSupported(f"LpNormalization node {node.name!r}: p={p} (valid: 1, 2)")
    return result(OnnxLpNorm(p, attr(node, "axis", -1)), node)


register_versions("LpNormalization", 1, _lp_norm)


class OnnxMeanVarianceNorm(nn.Module, OnnxToTorchModule):
    """ONNX MeanVarianceNormalization-9/13 (its function body): ``(X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9)``
    over ``axes`` (default ``[0, 2, 3]``)."""

    def __init__(self, axes):
        super().__init__()
        self.axes = tuple(axes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        mean = x.mean(dim=self.axes, keepdim=True)
        ex2 = (x * x).mean(dim=self.axes, keepdim=True)
        return (x - mean) / (torch.sqrt(ex2 - mean * mean) + 1e-9)


register_versions("MeanVarianceNormalization", 9, lambda node, graph: result(
    OnnxMeanVarianceNorm(attr(node, "axes", [0, 2, 3])), node))

__all__ = ["OnnxLayerNorm", "OnnxRMSNorm", "OnnxGroupNorm", "OnnxLpNorm", "OnnxMeanVarianceNorm"]
