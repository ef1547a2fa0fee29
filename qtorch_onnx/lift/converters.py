"""Converters added to onnx2torch's registry, and the overrides of the ones it gets wrong.

onnx2torch 1.5.15 registers converters per ``(domain, op_type, since_version)``; ``get_converter`` maps a
model's opset to the op schema's ``since_version`` and looks that key up, and ``add_converter`` raises
``ValueError`` on a key that is already registered. So this module extends it in two ways, both through
public API only (``onnx2torch.node_converters.registry.add_converter`` / ``get_converter``):

* **New keys** (ops at opset versions onnx2torch lacks) are registered with ``add_converter``:
  hand-written converters for Reduce*-18/20, Split-18, Pad-18+, Gelu-20, NonZero-9; guarded
  delegations to the older onnx2torch converter for Resize-18/19, AveragePool-19, Cast-19+; and, found
  automatically from the ONNX schemas, a delegation for every newer version whose schema differs from
  an already supported one only in type constraints (same inputs, outputs and attributes:
  Shape-19/21/..., Reshape-19/21/..., Identity-19/..., MaxPool-22, Conv-22, ...).
* **Overrides** of registered but wrong converters (CumSum-11/14: ONNX's ``reverse`` default is 0, not
  1; NonZero-13: ONNX's output is ``[rank, N]``, torch.nonzero's is ``[N, rank]``) cannot be
  re-registered; they live in :data:`OVERRIDES` and :func:`qtorch_onnx.lift.lift` swaps the converted
  module for ours after ``onnx2torch.convert`` (same ONNX input mapping, so the fx node is unchanged).

Use :func:`converter_for` to get the converter the lifter will use for a node.
"""
from __future__ import annotations

import math
from typing import Callable

import onnx
import torch
import torch.nn.functional as F
from onnx import defs
from torch import nn

from onnx2torch.node_converters.registry import add_converter, get_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OnnxToTorchModule, OperationConverterResult, onnx_mapping_from_node

Converter = Callable[[OnnxNode, OnnxGraph], OperationConverterResult]

#: ``(domain, op_type, since_version) -> converter`` replacing onnx2torch's registered (wrong) one.
OVERRIDES: dict[tuple[str, str, int], Converter] = {}


class ConversionNotSupported(NotImplementedError):
    """A node of a supported op uses an attribute value or input form no converter handles."""


def since_version(op_type: str, opset: int, domain: str = "") -> int | None:
    """The ``since_version`` of ``op_type``'s schema in effect at ``opset``, or ``None`` if none exists."""
    try:
        return defs.get_schema(op_type, max_inclusive_version=opset, domain=domain).since_version
    except Exception:  # onnx raises SchemaError (a RuntimeError subclass) for unknown ops
        return None


def _registered(op_type: str, version: int, domain: str = "") -> Converter | None:
    try:
        return get_converter(operation_type=op_type, version=version, domain=domain)
    except NotImplementedError:
        return None


def converter_for(op_type: str, opset: int, domain: str = "") -> Converter | None:
    """The converter used for ``op_type`` at model opset ``opset`` (override first), or ``None``."""
    v = since_version(op_type, opset, domain)
    key = (domain, op_type, v if v is not None else opset)
    if key in OVERRIDES:
        return OVERRIDES[key]
    return _registered(op_type, opset, domain)


def register_converter(op_type: str, versions, domain: str = ""):
    """Decorator: use ``converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult`` for
    ``op_type`` at each of ``versions`` (schema since-versions; for a custom domain, its opset version).

    Versions onnx2torch does not know are added with its public ``add_converter``; versions it already
    has go to :data:`OVERRIDES`, which :func:`~qtorch_onnx.lift.lift` applies after conversion (the
    override must map the same ONNX inputs to module arguments as the converter it replaces, and
    onnx2torch's own converter must not fail on the node).
    """

    def deco(converter: Converter) -> Converter:
        for v in versions:
            if _registered(op_type, v, domain) is not None and since_version(op_type, v, domain) == v:
                OVERRIDES[(domain, op_type, v)] = converter
            else:
                add_converter(operation_type=op_type, version=v, domain=domain)(converter)
        return converter

    return deco


def _const_ints(node: OnnxNode, graph: OnnxGraph, index: int) -> list[int] | None:
    """Integer list of input ``index`` if it is an initializer; ``None`` if absent; raises if dynamic."""
    if len(node.input_values) <= index or not node.input_values[index]:
        return None
    name = node.input_values[index]
    if name in graph.initializers:
        return [int(v) for v in graph.initializers[name].to_torch().reshape(-1).tolist()]
    raise ConversionNotSupported(
        f"{node.operation_type} node {node.name!r}: input {index} ({name!r}) must be a constant (initializer)"
    )


# ============================================================================ hand-written modules
class OnnxReduce18(nn.Module, OnnxToTorchModule):
    """ONNX Reduce* (opset 18+: axes as an optional input). x: any float/int tensor -> reduced tensor.

    Semantics per the ONNX spec: no/empty ``axes`` reduces all axes unless ``noop_with_empty_axes``.
    """

    def __init__(self, op: str, keepdims: int = 1, noop_with_empty_axes: int = 0):
        super().__init__()
        self.op, self.keepdims, self.noop = op, bool(keepdims), bool(noop_with_empty_axes)

    def forward(self, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        dims = [] if axes is None else [int(a) for a in axes.reshape(-1).tolist()]
        if not dims:
            if self.noop:
                return x
            dims = list(range(x.dim()))
        dims = sorted(d % x.dim() for d in dims) if x.dim() else []
        kd = self.keepdims
        op = self.op
        if op == "ReduceMax":
            return torch.amax(x, dim=dims, keepdim=kd) if dims else x
        if op == "ReduceMin":
            return torch.amin(x, dim=dims, keepdim=kd) if dims else x
        if op == "ReduceMean":
            return torch.mean(x, dim=dims, keepdim=kd)
        if op == "ReduceSum":
            return torch.sum(x, dim=dims, keepdim=kd)
        if op == "ReduceSumSquare":
            return torch.sum(x * x, dim=dims, keepdim=kd)
        if op == "ReduceL1":
            return torch.sum(torch.abs(x), dim=dims, keepdim=kd)
        if op == "ReduceL2":
            return torch.sqrt(torch.sum(x * x, dim=dims, keepdim=kd))
        if op == "ReduceLogSum":
            return torch.log(torch.sum(x, dim=dims, keepdim=kd))
        if op == "ReduceLogSumExp":
            return torch.logsumexp(x, dim=dims, keepdim=kd)
        if op == "ReduceProd":
            for d in sorted(dims, reverse=True):
                x = torch.prod(x, dim=d, keepdim=kd)
            return x
        raise ConversionNotSupported(op)


_REDUCE_18 = ("ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp")


def _reduce18(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    a = node.attributes
    return OperationConverterResult(
        torch_module=OnnxReduce18(node.operation_type, a.get("keepdims", 1), a.get("noop_with_empty_axes", 0)),
        onnx_mapping=onnx_mapping_from_node(node),
    )


for _op in _REDUCE_18:
    register_converter(_op, [18] + ([20] if _op in ("ReduceMax", "ReduceMin") else []))(_reduce18)


class OnnxSplit18(nn.Module, OnnxToTorchModule):
    """ONNX Split-13/18: ``split`` input (sizes) or ``num_outputs`` (chunks of ceil(n / num_outputs))."""

    def __init__(self, axis: int, num_outputs: int):
        super().__init__()
        self.axis, self.num_outputs = axis, num_outputs

    def forward(self, x: torch.Tensor, split: torch.Tensor | None = None):  # noqa: D102
        if split is not None:
            parts = torch.split(x, [int(s) for s in split.tolist()], dim=self.axis)
        else:
            n = x.shape[self.axis]
            parts = torch.split(x, int(math.ceil(n / self.num_outputs)), dim=self.axis)
        return parts if self.num_outputs > 1 else parts[0]


@register_converter("Split", [18])
def _split18(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    n = node.attributes.get("num_outputs", len(node.output_values))
    return OperationConverterResult(
        torch_module=OnnxSplit18(node.attributes.get("axis", 0), int(n)),
        onnx_mapping=onnx_mapping_from_node(node),
    )


def _pad_index(n: int, begin: int, end: int, mode: str, device) -> torch.Tensor:
    idx = torch.arange(-begin, n + end, device=device)
    if mode == "edge":
        return idx.clamp(0, n - 1)
    if mode == "wrap":
        return torch.remainder(idx, n)
    # reflect (mirror without repeating the edge): period 2(n-1)
    if n == 1:
        return torch.zeros_like(idx)
    m = torch.remainder(idx, 2 * (n - 1))
    return torch.where(m < n, m, 2 * (n - 1) - m)


class OnnxPad18(nn.Module, OnnxToTorchModule):
    """ONNX Pad-18+ (``axes`` input; modes constant, reflect, edge, wrap; negative pads crop).

    x: tensor of rank r; pads: int64 [2 * len(axes)] as ``[begin..., end...]`` (ONNX Pad spec).
    Non-constant modes gather with per-axis index maps, so any axis may be padded.
    """

    def __init__(self, mode: str = "constant"):
        super().__init__()
        self.mode = mode

    def forward(self, x, pads, constant_value=None, axes=None):  # noqa: D102
        r = x.dim()
        pads = [int(p) for p in pads.reshape(-1).tolist()]
        axes_l = list(range(r)) if axes is None else [int(a) % r for a in axes.reshape(-1).tolist()]
        k = len(axes_l)
        begin = dict(zip(axes_l, pads[:k]))
        end = dict(zip(axes_l, pads[k:]))
        if self.mode == "constant":
            flat = []
            for d in reversed(range(r)):
                flat += [begin.get(d, 0), end.get(d, 0)]
            value = 0.0 if constant_value is None or constant_value.numel() == 0 else constant_value.reshape(-1)[0].item()
            return F.pad(x, flat, mode="constant", value=value)
        for d in axes_l:
            if begin[d] or end[d]:
                x = torch.index_select(x, d, _pad_index(x.shape[d], begin[d], end[d], self.mode, x.device))
        return x


@register_converter("Pad", [18, 19, 21, 23, 24, 25])
def _pad18(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    mode = node.attributes.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise ConversionNotSupported(f"Pad node {node.name!r}: mode {mode!r} (valid: constant, reflect, edge, wrap)")
    return OperationConverterResult(torch_module=OnnxPad18(mode), onnx_mapping=onnx_mapping_from_node(node))


class OnnxGelu(nn.Module, OnnxToTorchModule):
    """ONNX Gelu-20: ``approximate`` "none" (erf form) or "tanh" (same names as torch)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return F.gelu(x, approximate=self.approximate)


@register_converter("Gelu", [20])
def _gelu(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    approximate = node.attributes.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ConversionNotSupported(f"Gelu node {node.name!r}: approximate={approximate!r} (valid: none, tanh)")
    return OperationConverterResult(torch_module=OnnxGelu(approximate), onnx_mapping=onnx_mapping_from_node(node))


class OnnxCumSum(nn.Module, OnnxToTorchModule):
    """ONNX CumSum-11/14 with the spec's defaults (``exclusive=0``, ``reverse=0``).

    The exclusive form shifts the input by one along ``axis`` (zero first) before the inclusive sum,
    so element i is the sum of elements before i (not ``cumsum - x``, which rounds differently).
    """

    def __init__(self, exclusive: bool = False, reverse: bool = False):
        super().__init__()
        self.exclusive, self.reverse = exclusive, reverse

    def forward(self, x: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:  # noqa: D102
        dim = int(axis.reshape(-1)[0].item()) % x.dim()
        if self.reverse:
            x = torch.flip(x, dims=(dim,))
        if self.exclusive:
            zero = torch.zeros_like(x.narrow(dim, 0, 1))
            x = torch.cat([zero, x.narrow(dim, 0, x.shape[dim] - 1)], dim=dim)
        y = torch.cumsum(x, dim=dim)
        if self.reverse:
            y = torch.flip(y, dims=(dim,))
        return y


@register_converter("CumSum", [11, 14])
def _cumsum(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    a = node.attributes
    return OperationConverterResult(
        torch_module=OnnxCumSum(bool(a.get("exclusive", 0)), bool(a.get("reverse", 0))),
        onnx_mapping=onnx_mapping_from_node(node),
    )


class OnnxNonZero(nn.Module, OnnxToTorchModule):
    """ONNX NonZero: int64 ``[rank, N]`` indices of the non-zero elements, row-major order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.nonzero(x).t().contiguous()


@register_converter("NonZero", [9, 13])
def _nonzero(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return OperationConverterResult(
        torch_module=OnnxNonZero(),
        onnx_mapping=OnnxMapping(inputs=(node.input_values[0],), outputs=node.output_values),
    )


# ============================================================================ guarded delegations
def _delegate(op_type: str, to_version: int, guard: Callable[[OnnxNode, OnnxGraph], str | None]):
    """A converter for a newer version that checks ``guard`` and then calls onnx2torch's ``to_version``."""

    def converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        problem = guard(node, graph)
        if problem:
            raise ConversionNotSupported(f"{op_type} node {node.name!r}: {problem}")
        return get_converter(operation_type=op_type, version=to_version)(node, graph)

    converter.__name__ = f"{op_type}_delegate_to_{to_version}"
    return converter


def _resize_guard(node: OnnxNode, graph: OnnxGraph) -> str | None:
    a = node.attributes
    if a.get("antialias", 0):
        return "antialias=1 is not supported"
    if "axes" in a:
        return "the axes attribute is not supported"
    if a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return f"keep_aspect_ratio_policy={a['keep_aspect_ratio_policy']!r} (valid: 'stretch')"
    if a.get("coordinate_transformation_mode") == "half_pixel_symmetric":
        return "coordinate_transformation_mode='half_pixel_symmetric' is not supported"
    return None


for _v in (18, 19):
    register_converter("Resize", [_v])(_delegate("Resize", 13, _resize_guard))


def _avgpool_guard(node: OnnxNode, graph: OnnxGraph) -> str | None:
    dil = node.attributes.get("dilations")
    return f"dilations={dil} (only 1 is supported)" if dil and any(d != 1 for d in dil) else None


register_converter("AveragePool", [19])(_delegate("AveragePool", 11, _avgpool_guard))

_TORCH_CASTABLE = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32,
    onnx.TensorProto.INT64, onnx.TensorProto.BOOL,
}


def _cast_guard(node: OnnxNode, graph: OnnxGraph) -> str | None:
    to = node.attributes.get("to")
    if to not in _TORCH_CASTABLE:
        name = onnx.TensorProto.DataType.Name(to) if to is not None else None
        return f"to={name} (float8/4, int4, string casts are not supported)"
    return None


for _v in (19, 21, 23, 24, 25):
    register_converter("Cast", [_v])(_delegate("Cast", 13, _cast_guard))


# ============================================================================ automatic type-only delegations
def _signature(schema) -> tuple:
    attrs = tuple(sorted((n, int(a.type), a.default_value.SerializeToString()) for n, a in schema.attributes.items()))
    ins = tuple((i.name, int(i.option)) for i in schema.inputs)
    outs = tuple((o.name, int(o.option)) for o in schema.outputs)
    return ins, outs, attrs


def _register_type_only_versions() -> list[tuple[str, int, int]]:
    """For every default-domain op: register newer versions whose schema signature equals a supported one.

    Returns the ``(op_type, new_version, delegate_version)`` triples registered.
    """
    history: dict[str, list] = {}
    for s in defs.get_all_schemas_with_history():
        if s.domain in ("", "ai.onnx") and not s.deprecated:
            history.setdefault(s.name, []).append(s)
    done = []
    for op, schemas in history.items():
        schemas.sort(key=lambda s: s.since_version)
        supported: tuple[int, tuple] | None = None
        for s in schemas:
            v = s.since_version
            if _registered(op, v) is not None and since_version(op, v) == v:
                supported = (v, _signature(s))
                continue
            if supported is not None and _signature(s) == supported[1]:
                base = OVERRIDES.get(("", op, supported[0])) or get_converter(operation_type=op, version=supported[0])
                add_converter(operation_type=op, version=v)(base)
                done.append((op, v, supported[0]))
            else:
                supported = None  # a real change: older converters do not apply to later versions
    return done


TYPE_ONLY_DELEGATIONS = _register_type_only_versions()
