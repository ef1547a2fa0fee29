"""Converters added to onnx2torch's registry, and the overrides of the ones it gets wrong.

onnx2torch 1.5.15 registers converters per ``(domain, op_type, since_version)``; ``get_converter`` maps a
model's opset to the op schema's ``since_version`` and looks that key up, and ``add_converter`` raises
``ValueError`` on a key that is already registered. So this package extends it in two ways, both through
public API only (``onnx2torch.node_converters.registry.add_converter`` / ``get_converter``; the helpers
live in :mod:`~qtorch_onnx.lift.ops_common`):

* **New keys** (ops or opset versions onnx2torch lacks) are registered with ``add_converter``: the
  hand-written converters below (Reduce*-18/20, Split-18, Pad-18+, Gelu-20, NonZero-9) and those of the
  ``ops_*`` modules imported at the end (attention, normalization, losses, convolution and pooling,
  resampling, quantization and casts, element-wise math, indexing, shape, signal processing); then,
  found automatically from the ONNX schemas, a delegation for every newer version whose schema differs
  from an already supported one only in type constraints (Identity-19/..., Transpose-21/..., ...).
* **Overrides** of registered but wrong or too narrow converters (e.g. CumSum-11/14: ONNX's ``reverse``
  default is 0, not 1; NonZero-13: ONNX's output is ``[rank, N]``; Add/Div/... on uint16-64; Flatten
  axis 0; LayerNormalization's Mean/InvStdDev outputs; Clip-11/12/13 with runtime min/max) cannot be
  re-registered; they live in :data:`OVERRIDES`. onnx2torch's ``convert`` looks converters up by the
  node's ``(domain, op_type, opset)`` only, so :func:`qtorch_onnx.lift.lift` chooses the converter per
  node *before* conversion: on the copy it hands to onnx2torch it re-spells the domain of every node
  whose key is overridden to an alias domain, for which a converter calling the override is registered
  through ``add_converter`` (:func:`qtorch_onnx.lift.lifter._route_domains`), and renames the modules
  back afterwards. onnx2torch's own converter is therefore never called on such a node (it may reject
  it, as Clip-13's rejects a runtime ``min``), and the override may map the inputs as it likes. This
  uses only the public registry; the alternatives were worse: a normalization step rewriting such nodes
  into a custom domain would leak into the normalized model that the TensorMap, placement and export
  read, and replacing onnx2torch's registry entry is impossible (``add_converter`` refuses existing keys).
* **Constant** (all versions) and **ConstantOfShape** (9/20+): onnx2torch's read tensor attributes
  through numpy and fail on bfloat16 / float8 / int4 values; ours use
  :func:`~qtorch_onnx.lift.ops_common.tensor_from_proto`.

Use :func:`converter_for` to get the converter the lifter will use for a node, :func:`dry_run` to check
a node, and :func:`workaround` for the hint :class:`~qtorch_onnx.errors.UnsupportedOpsError` shows.
"""
from __future__ import annotations

import math
from typing import Callable

import onnx
from onnx import defs
import torch
import torch.nn.functional as F
from torch import nn

from onnx2torch.node_converters.registry import add_converter, get_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OnnxToTorchModule, OperationConverterResult, onnx_mapping_from_node

from .ops_common import (  # noqa: F401  (re-exported: the registry API lives in ops_common)
    _OURS, OVERRIDES, ConversionNotSupported, Converter, attr, const_ints, const_tensor, converter_for,
    onnx2torch_converter, register_converter, register_versions, registered, since_version,
)

_registered = registered
_const_ints = const_ints


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
        if op in ("ReduceMax", "ReduceMin") and any(x.shape[d] == 0 for d in dims):
            # reduction over an empty set: the identity element (ONNX: -inf / +inf, or the type's extreme)
            shape = [1 if d in dims else n for d, n in enumerate(x.shape)] if kd else \
                [n for d, n in enumerate(x.shape) if d not in dims]
            if x.dtype == torch.bool:
                fill = op == "ReduceMin"
            elif x.is_floating_point():
                fill = float("-inf") if op == "ReduceMax" else float("inf")
            else:
                info = torch.iinfo(x.dtype)
                fill = info.min if op == "ReduceMax" else info.max
            return torch.full(shape, fill, dtype=x.dtype, device=x.device)
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
    Non-constant modes gather with per-axis index maps, so any axis may be padded. When pads,
    constant_value and axes are initializers they are given to the constructor (``baked``) and the
    torch padding list is computed once per input rank instead of on every call.
    """

    def __init__(self, mode: str = "constant", baked: tuple | None = None):
        super().__init__()
        self.mode = mode
        self.baked = baked  # (pads, constant_value, axes) as Python values, or None
        self._flat: dict[int, tuple] = {}

    def _plan(self, r: int, pads: list[int], axes: list[int] | None):
        axes_l = list(range(r)) if axes is None else [a % r for a in axes]
        k = len(axes_l)
        begin, end = dict(zip(axes_l, pads[:k])), dict(zip(axes_l, pads[k:]))
        flat = []
        for d in reversed(range(r)):
            flat += [begin.get(d, 0), end.get(d, 0)]
        return axes_l, begin, end, flat

    def forward(self, x, pads=None, constant_value=None, axes=None):  # noqa: D102
        r = x.dim()
        if self.baked is not None:
            plan = self._flat.get(r)
            if plan is None:
                plan = self._flat[r] = self._plan(r, self.baked[0], self.baked[2])
            value = self.baked[1]
        else:
            plan = self._plan(r, [int(p) for p in pads.reshape(-1).tolist()],
                              None if axes is None else [int(a) for a in axes.reshape(-1).tolist()])
            value = 0.0 if constant_value is None or constant_value.numel() == 0 else constant_value.reshape(-1)[0].item()
        axes_l, begin, end, flat = plan
        if self.mode == "constant":
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
    ins = node.input_values
    if all(v in graph.initializers for v in ins[1:] if v):
        pads = [int(v) for v in const_tensor(node, graph, 1).reshape(-1).tolist()]
        cv = const_tensor(node, graph, 2)
        value = 0.0 if cv is None or cv.numel() == 0 else cv.reshape(-1)[0].item()
        ax = const_tensor(node, graph, 3)
        axes = [int(a) for a in ax.reshape(-1).tolist()] if ax is not None else None
        return OperationConverterResult(torch_module=OnnxPad18(mode, (pads, value, axes)),
                                        onnx_mapping=OnnxMapping(inputs=(ins[0],), outputs=node.output_values))
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


# ============================================================================ Constant, ConstantOfShape
class OnnxConstantValue(nn.Module, OnnxToTorchModule):
    """ONNX Constant: returns the buffer ``value`` (any shape; dtype per the lifter's convention, see
    :func:`~qtorch_onnx.lift.ops_common.tensor_from_proto`: bfloat16 / float8 as torch's dtypes, int4 in
    int8, uint4 in uint8). The buffer itself is returned (no copy), as onnx2torch's Constant does."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.register_buffer("value", value)

    def forward(self) -> torch.Tensor:  # noqa: D102
        return self.value


_CONSTANT_LISTS = {"value_float": torch.float32, "value_floats": torch.float32, "value_int": torch.int64,
                   "value_ints": torch.int64}


def _constant(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Constant-1..25: ``value`` (any tensor type) and ``value_float(s)`` / ``value_int(s)``; string
    values go to onnx2torch's own converter (a Python list, as before); ``sparse_value`` is refused."""
    names = [a.name for a in node.proto.attribute]
    if len(names) != 1:
        raise ConversionNotSupported(f"Constant node {node.name!r}: exactly one value attribute expected, got {names}")
    name = names[0]
    if name == "value":
        value = attr(node, "value")
    elif name in _CONSTANT_LISTS:
        value = torch.tensor(attr(node, name), dtype=_CONSTANT_LISTS[name])
    elif name in ("value_string", "value_strings"):
        own = onnx2torch_converter("Constant", 13)
        if own is None:
            raise ConversionNotSupported(f"Constant node {node.name!r}: string values have no torch dtype")
        return own(node, graph)
    else:
        raise ConversionNotSupported(f"Constant node {node.name!r}: attribute {name!r} (valid: value, value_float, "
                                     f"value_floats, value_int, value_ints, value_string, value_strings)")
    return OperationConverterResult(torch_module=OnnxConstantValue(value), onnx_mapping=onnx_mapping_from_node(node))


class OnnxConstantOfShape(nn.Module, OnnxToTorchModule):
    """ONNX ConstantOfShape: a tensor of shape ``shape`` (1-D int64 input) filled with the one-element
    ``value`` (any type the lifter carries; float32 0 by default), built by expanding the value, so
    bfloat16 / float8 / int4 fills need no fill kernel."""

    def __init__(self, value: torch.Tensor | None):
        super().__init__()
        if value is None:
            value = torch.zeros((), dtype=torch.float32)
        self.register_buffer("value", value.reshape(()))

    def forward(self, shape: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.value.expand([int(d) for d in shape.reshape(-1).tolist()]).clone()


def _constant_of_shape(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    value = attr(node, "value")
    if value is not None and value.numel() != 1:
        raise ConversionNotSupported(f"ConstantOfShape node {node.name!r}: attribute 'value' must have one element, "
                                     f"got shape {list(value.shape)}")
    return OperationConverterResult(torch_module=OnnxConstantOfShape(value), onnx_mapping=onnx_mapping_from_node(node))


# onnx2torch's Constant-9/11/12/13 and ConstantOfShape-9 go through OnnxTensor.to_torch (numpy): overridden
register_versions("Constant", 1, _constant, override=[9, 11, 12, 13])
register_versions("ConstantOfShape", 9, _constant_of_shape, override=[9])


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


# ============================================================================ support checks and hints
#: element types numpy has no native dtype for (numpy_helper gives ml_dtypes arrays, which onnx2torch's
#: ``OnnxTensor.to_torch`` cannot turn into buffers): the lifter hands initializers of these types to
#: onnx2torch as graph inputs and binds them to buffers of the right torch dtype afterwards
#: (:func:`qtorch_onnx.lift.lifter.conversion_view`)
NUMPY_LESS_TYPES = frozenset({
    onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ,
    onnx.TensorProto.FLOAT8E5M2, onnx.TensorProto.FLOAT8E5M2FNUZ, onnx.TensorProto.FLOAT8E8M0,
    onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.INT2, onnx.TensorProto.UINT2,
    onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.FLOAT6E2M3, onnx.TensorProto.FLOAT6E3M2,
})


def dry_run(node: OnnxNode, graph: OnnxGraph, opset: int | None, domain: str = "") -> str | None:
    """Why ``node`` cannot be converted (``None`` when it can): no opset import, no converter, or the
    converter the lifter uses (:func:`converter_for`: the override where there is one, which the lifter
    calls *instead of* onnx2torch's own) raising on the node.

    ``graph`` should be the graph the lifter hands to onnx2torch (see
    :func:`qtorch_onnx.lift.lifter.conversion_view`), so that converters see the node as they will.
    """
    if opset is None:
        return f"no opset import for domain {domain or 'ai.onnx'!r}"
    conv = converter_for(node.operation_type, opset, domain)
    if conv is None:
        return "no converter"
    try:
        conv(node, graph)
    except Exception as exc:  # any converter failure means this node cannot be lifted
        missing = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
        if isinstance(missing, str) and missing in node.input_values and missing not in graph.value_info:
            # onnx2torch's converters look the input's value_info up (rank, shape) and raise KeyError
            return (f"input {missing!r} has no shape or type information (ONNX shape inference could not infer it, "
                    f"e.g. behind an op of a custom domain), which the {node.operation_type} converter needs "
                    f"(KeyError: {missing!r})")
        return f"{type(exc).__name__}: {exc}"
    return None


_SEQUENCE_OPS = {"SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert",
                 "SequenceLength", "SequenceMap", "SplitToSequence", "ConcatFromSequence", "Optional",
                 "OptionalGetElement", "OptionalHasElement"}
_STRING_OPS = {"StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "ImageDecoder"}
_TRAINING_OPS = {"Gradient", "Adagrad", "Momentum", "Adam"}
_RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}


def workaround(domain: str, op_type: str, reason: str) -> str:
    """A suggested way around an unsupported op (used in :class:`~qtorch_onnx.errors.UnsupportedOpsError`)."""
    register = (f"register a converter: @qtorch_onnx.lift.register_converter({op_type!r}, [<since_version>]"
                + (f", domain={domain!r}" if domain else "") + ")")
    if domain == "com.microsoft":
        return ("this is an ONNX Runtime contrib op (a graph-optimizer fusion or a quantized kernel): re-export the "
                "model without ORT optimizations (SessionOptions.graph_optimization_level=ORT_DISABLE_ALL, no "
                f"optimized_model_filepath), or {register}")
    if domain not in ("", "ai.onnx"):
        return f"ops of custom domain {domain!r} have no converter: {register}"
    if op_type in _SEQUENCE_OPS:
        return "tensor sequences / optionals have no torch.fx tensor form: rewrite the graph with tensors (Split, Concat)"
    if op_type in _STRING_OPS:
        return "string tensors have no torch dtype: do the string processing outside the model"
    if op_type in _TRAINING_OPS or "training_mode" in reason:
        return "training ops are not lifted: export the inference graph (training_mode=0, no optimizer ops)"
    if op_type in _RANDOM_OPS:
        return "random ops are not lifted (their values cannot match ONNX Runtime's): feed the random tensor as an input"
    if "has no shape or type information" in reason:
        return ("give that tensor a value_info with its element type and rank (e.g. run onnx.shape_inference with "
                "the producing op's schema registered, or add the value_info by hand)")
    if "must be a constant" in reason or "Dynamic value" in reason or "initializer" in reason:
        return "make that input a constant (an initializer), e.g. by fixing the input shapes and re-running normalize()"
    if "needs a static" in reason or "needs static" in reason:
        return ("give the model static input shapes (python -m onnxruntime.tools.make_dynamic_shape_fixed) so "
                "normalization can resolve it")
    if reason == "no converter":
        return register
    return "check the attribute named in the reason against the values listed there, or " + register


# ============================================================================ converter modules
# Imported here, before the automatic delegations below, so that their hand-written converters take the
# newer versions they register and the delegations only fill the gaps.
from . import (  # noqa: E402,F401
    ops_attention, ops_conv_pool, ops_index, ops_loss, ops_math, ops_norm, ops_quant, ops_resample, ops_shape,
    ops_signal,
)

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
                _OURS.add(("", op, v))
                done.append((op, v, supported[0]))
            else:
                supported = None  # a real change: older converters do not apply to later versions
    return done


TYPE_ONLY_DELEGATIONS = _register_type_only_versions()

# Converters of the other modules and of the plugins (after the delegations above, which must not fill in their
# versions): importing this module registers every converter of the lifter, whichever lift module a caller imported
# first.
from . import control_flow, recurrent  # noqa: E402,F401
from .plugins import load_plugins  # noqa: E402

load_plugins()
