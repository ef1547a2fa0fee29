"""Placement: which ONNX tensors get which quantizer.

Placement reads the normalized ONNX graph and a :class:`~qtorch_onnx.config.internal.ResolvedConfig`
and returns a :class:`Plan`: one :class:`QuantSpec` per quantized tensor, keyed by ONNX tensor name.
It knows nothing about torch modules; :mod:`qtorch_onnx.quantizer` turns the plan into FakeQuantize
modules through the lifter's TensorMap, and :mod:`qtorch_onnx.export` writes the same plan into ONNX.

Rules (ONNX Runtime's QDQ placement as extended by Quark; README "What gets quantized"):

* A node is *in scope* when its op type is quantizable (``op_types_to_quantize``, or the default set,
  or every op for ``QuantizeAllOpTypes`` and the float formats BF16/FP16), it is listed in
  ``nodes_to_quantize`` (when given), not in ``nodes_to_exclude`` or an excluded subgraph, and lies
  between ``input_nodes`` and ``output_nodes`` (when given).
* In-scope nodes get quantizers on their float inputs and outputs. Initializer inputs in a weight slot
  (Conv/ConvTranspose/Gemm/MatMul input 1, any other float initializer input) use the weight format;
  the bias slot (Conv/ConvTranspose input 2, Gemm input 2) uses INT32 with ``scale_x * scale_w`` when
  activations and weights are integer (``Int32Bias``), else the weight format.
* Data-movement ops (MaxPool, Reshape, Transpose, ...) get an output quantizer only when their data
  input is quantized, unless ``ForceQuantizeNoInputCheck``.
* ``FoldRelu``: no quantizer between a Conv/ConvTranspose/Gemm/MatMul/Add and a Relu that is the only
  consumer of its output (the Relu output carries the quantizer: the pair is one fused op on hardware).
* ``AlignConcat`` / ``AlignSlice``: the inputs of a Concat (the output of a Slice) share the output's
  (input's) scale after calibration (``share_with``).
* ``AlignEltwiseQuantType``: initializer inputs of element-wise ops take the activation format.
* Range adjustments after calibration (docs/numerics.md section 2): the input of a Relu/Clip with a single
  consumer takes the Relu/Clip output range (``range_from``); Softmax outputs take [0, 1].
* Layer-wise mixed precision (``AutoMixprecision`` with ``TargetQuantType`` and no accuracy target): the
  in-scope nodes of ``TargetOpType`` (Conv, ConvTranspose, Gemm, MatMul by default) are *promoted*: their
  weights take ``WeightTargetQuantType`` (default ``TargetQuantType``), their biases too when biases are
  quantized (INT32 when both targets are integer), and their activation inputs ``ActTargetQuantType``.
  Outputs keep the global activation format. An activation input read only by promoted nodes (and not a
  graph output) simply takes the target format. An input on a *precision boundary* (also read by nodes
  that keep the global format) keeps its own quantizer for those readers, and each promoted reader gets a
  second, consumer-side quantizer on its edge (``QuantSpec.consumer``): applied to the float tensor
  without ``DualQuantNodes``, or after the tensor's own quantizer with ``DualQuantNodes``, which then also
  puts both kinds on the inputs read only by promoted nodes (``x -> Q/DQ(BF16) -> BFP -> Conv``: the
  layout some backend compilers require, Quark's ``DualQuantNodes``).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import onnx

from .config.internal import ResolvedConfig
from .errors import ConfigError
from .formats.spec import INT32, Format
from .lift.tensor_map import ModelInfo

#: Op types quantized by default (ONNX Runtime's QDQ registry plus Quark's additions).
DEFAULT_OP_TYPES = frozenset(
    """Conv ConvTranspose Gemm MatMul Add Sub Mul Div Relu Clip LeakyRelu PRelu Sigmoid HardSigmoid HardSwish
    Tanh Softmax MaxPool AveragePool GlobalAveragePool GlobalMaxPool Concat Resize Reshape Transpose Flatten
    Squeeze Unsqueeze Slice Split Gather Pad ReduceMean InstanceNormalization LayerNormalization Erf Gelu
    Where Mean Max Min Neg Abs Sqrt Pow Exp Log DepthToSpace SpaceToDepth Expand Tile Identity""".split()
)
#: Data-movement ops: their output is quantized only when their data input is.
DIRECT_OP_TYPES = frozenset(
    """MaxPool GlobalMaxPool Reshape Transpose Flatten Squeeze Unsqueeze Slice Split Gather Resize Pad
    Identity DepthToSpace SpaceToDepth Expand Tile""".split()
)
#: Ops whose input 1 is a weight and input 2 a bias.
WEIGHT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
ELEMENTWISE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Mean", "Where", "PRelu", "Pow"})
FOLD_RELU_PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "Add"})
#: Which inputs of an op carry data that may be quantized (others are parameters: shapes, indices...).
DATA_INPUTS = {
    "Clip": (0,), "Resize": (0,), "Pad": (0,), "Gather": (0,), "Slice": (0,), "Split": (0,), "Reshape": (0,),
    "Expand": (0,), "Tile": (0,), "Squeeze": (0,), "Unsqueeze": (0,), "Where": (1, 2),
    "BatchNormalization": (0, 1, 2), "ReduceMean": (0,), "Dropout": (0,), "TopK": (0,),
}
FLOAT = onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class QuantSpec:
    """How one ONNX tensor is quantized.

    Attributes:
        tensor: ONNX tensor name.
        fmt: numeric format.
        role: "activation", "weight" or "bias".
        axis: per-channel / block axis in the ONNX layout, or None (per tensor).
        symmetric: symmetric integer range.
        narrow_range: integer weights clip to [-qmax, qmax].
        scaled: BF16/FP16 with a calibrated scale (WeightScaled / ActivationScaled).
        bias_of: for INT32 biases, (activation tensor, weight tensor) whose scales multiply.
        share_with: after calibration copy scale/zero point from this tensor (AlignConcat/AlignSlice).
        range_from: after calibration take the calibrated range of this tensor (Relu/Clip adjustment).
        fixed_range: a range known a priori, e.g. (0.0, 1.0) for Softmax outputs.
        overrides: ONNX Runtime TensorQuantOverrides entries applied to this tensor (scale, zero_point).
        consumer: None for the tensor's own quantizer (all readers see it). A node name for a
            consumer-side quantizer that only that node's reads of ``tensor`` pass through (precision
            boundaries of layer-wise mixed precision); such specs are keyed by :func:`edge_key`.
        chained: consumer-side only: applied to the output of the tensor's own quantizer (True,
            ``DualQuantNodes``) or to the float tensor (False).
    """

    tensor: str
    fmt: Format
    role: str
    axis: Optional[int] = None
    symmetric: bool = True
    narrow_range: bool = False
    scaled: bool = False
    bias_of: Optional[Tuple[str, str]] = None
    share_with: Optional[str] = None
    range_from: Optional[str] = None
    fixed_range: Optional[Tuple[float, float]] = None
    overrides: Tuple[Tuple[str, object], ...] = ()
    consumer: Optional[str] = None
    chained: bool = False

    @property
    def key(self) -> str:
        """The plan / quantizer key: the tensor name, or :func:`edge_key` for a consumer-side quantizer."""
        return self.tensor if self.consumer is None else edge_key(self.tensor, self.consumer)


def _override_error(tensor: str, msg: str) -> ConfigError:
    return ConfigError(f"extra_options['TensorQuantOverrides'][{tensor!r}]: {msg}")


def _activation_overrides(t: str, entries: list) -> Tuple[Tuple[str, object], ...]:
    """The fixed qparams / range of an activation's (per-tensor) override.

    Raises:
        ConfigError: a per-channel list or ``reduce_range`` on an activation (ONNX Runtime allows both only
            for initializers).
    """
    entry = dict(entries[0])
    if "axis" in entry or len(entries) > 1:
        raise _override_error(t, "per-channel overrides (a list of dicts with 'axis') apply to initializers "
                                 "(weights) only, as in ONNX Runtime; this tensor is an activation")
    if entry.get("reduce_range"):
        raise _override_error(t, "'reduce_range' applies to initializers (weights) only, as in ONNX Runtime; "
                                 "this tensor is an activation")
    return tuple((k, entry[k]) for k in ("scale", "zero_point", "rmin", "rmax") if k in entry)


def _weight_overrides(t: str, entries: list, info: ModelInfo, cfg: ResolvedConfig
                      ) -> Tuple[Optional[int], Tuple[Tuple[str, object], ...]]:
    """``(axis, overrides)`` of an initializer's TensorQuantOverrides (ONNX Runtime's semantics): one dict without
    ``axis`` is per tensor; a list whose first dict has ``axis`` is per channel along it, with one dict applied
    to every channel or one dict per channel. Per channel, each value (``scale``, ``zero_point``, ``rmin``,
    ``rmax``) is a tuple over the channels with None where that channel's dict does not give it (the channel's
    own data then decides); one dict gives plain values. ``reduce_range`` is kept as a flag.

    Raises:
        ConfigError: an axis out of range, a channel count other than 1 or the tensor's, channel dicts whose
            quant_type / symmetric / axis / reduce_range differ from the first, ``convert`` on an initializer,
            ``reduce_range`` with power-of-two scales.
    """
    first = dict(entries[0])
    if any("convert" in e for e in entries):
        raise _override_error(t, "'convert' applies to activations only, as in ONNX Runtime; this tensor is an "
                                 "initializer")
    reduce = bool(first.get("reduce_range", cfg.placement.reduce_range))
    if reduce and cfg.calibration.power_of_two:
        raise _override_error(t, "'reduce_range' cannot be combined with power-of-two scales (XINT8 / "
                                 "enable_npu_cnn): there is no reduced power-of-two rule")
    flags: Tuple[Tuple[str, object], ...] = (("reduce_range", True),) if reduce else ()
    if "axis" not in first:
        return None, tuple((k, first[k]) for k in ("scale", "zero_point", "rmin", "rmax") if k in first) + flags
    dims = list(info.initializers[t].dims)
    axis = int(first["axis"])
    if not -len(dims) <= axis < len(dims):
        raise _override_error(t, f"axis {axis} is out of range for a weight of shape {dims} (valid: "
                                 f"{-len(dims)}..{len(dims) - 1})")
    axis %= len(dims)
    channels = dims[axis]
    if len(entries) not in (1, channels):
        raise _override_error(t, f"{len(entries)} per-channel override dicts for {channels} channels along axis "
                                 f"{axis} (weight shape {dims}): give {channels}, or 1 applied to every channel")
    for i, e in enumerate(entries[1:], 1):
        for key in ("quant_type", "symmetric", "reduce_range"):
            if key in e and e[key] != first.get(key):
                raise _override_error(t, f"channel {i} sets {key}={e[key]!r} but the first dict "
                                         f"{'sets ' + repr(first[key]) if key in first else 'does not'}: "
                                         f"{key} is per tensor and given in the first dict only")
        if "axis" in e and int(e["axis"]) % len(dims) != axis:
            raise _override_error(t, f"channel {i} gives axis {e['axis']}, the first dict {first['axis']}")
    fixed = []
    for key in ("scale", "zero_point", "rmin", "rmax"):
        if len(entries) == 1:
            if key in first:
                fixed.append((key, first[key]))
        elif any(key in e for e in entries):
            fixed.append((key, tuple(e.get(key) for e in entries)))
    return axis, tuple(fixed) + flags


def _convert_specs(t: str, conv: dict, own: "QuantSpec", info: ModelInfo) -> Dict[str, "QuantSpec"]:
    """Consumer-side quantizers for ONNX Runtime's ``convert`` override: each node of ``recv_nodes`` (default:
    every reader of ``t``) reads ``t`` quantized with its own type, then with ``convert['quant_type']``
    (Q/DQ of the first type, then Q/DQ of the second, before that node only).

    Raises:
        ConfigError: a recv node that does not read ``t``.
    """
    readers = info.reads.get(t, [])
    recv = list(conv.get("recv_nodes") or readers)
    bad = [n for n in recv if n not in readers]
    if bad:
        raise _override_error(t, f"convert recv_nodes {bad} do not read this tensor; its readers are {readers}")
    fixed = tuple((k, conv[k]) for k in ("scale", "zero_point", "rmin", "rmax") if k in conv)
    out = {}
    for node in recv:
        spec = QuantSpec(t, conv["quant_type"], "activation", symmetric=bool(conv.get("symmetric", own.symmetric)),
                         overrides=fixed, consumer=node, chained=True)
        out[spec.key] = spec
    return out


def edge_key(tensor: str, consumer: str) -> str:
    """Key of the consumer-side quantizer of ``tensor`` for node ``consumer``: ``"<tensor> -> <consumer>"``."""
    return f"{tensor} -> {consumer}"


@dataclass
class Plan:
    """The quantizers of a model: ``specs[key] -> QuantSpec`` (``QuantSpec.key``: the tensor name for a
    tensor's own quantizer, :func:`edge_key` for a consumer-side one). Own quantizers come first, in graph
    order, then the consumer-side ones."""

    specs: Dict[str, QuantSpec]
    info: ModelInfo

    def counts(self) -> Dict[str, int]:
        """Number of quantizers per ``"<format> <role>"`` (consumer-side ones: ``"<format> <role> (consumer-side)"``)."""
        out: Dict[str, int] = {}
        for s in self.specs.values():
            key = f"{s.fmt.name} {s.role}" + ("" if s.consumer is None else " (consumer-side)")
            out[key] = out.get(key, 0) + 1
        return out


def _weight_axis(node: onnx.NodeProto, slot: int, ndim: int) -> int:
    """Output-channel axis of a weight in its ONNX layout (per-channel quantization)."""
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    if node.op_type == "MatMul":
        return ndim - 1
    return 0


def _reachable(info: ModelInfo, starts: List[str], downstream: bool) -> set:
    seen = set()
    stack = list(starts)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = info.node_protos[name]
        if downstream:
            for o in node.output:
                stack.extend(info.reads.get(o, []))
        else:
            for i in node.input:
                if i in info.producer:
                    stack.append(info.producer[i])
    return seen


def _check_names(kind: str, names, valid, what: str, aliases: Optional[Mapping[str, Optional[str]]] = None) -> None:
    valid = list(valid)
    for name in names:
        if name not in valid:
            if aliases and name in aliases:  # in the user's model, gone from the normalized / optimized graph
                now = aliases[name]
                where = f"its value now flows through {now!r}" if now else "it was folded away"
                raise ConfigError(f"{kind}: tensor {name!r} of the model does not exist after normalization and "
                                  f"graph optimization ({where}: a BatchNormalization fold or an optimize_model "
                                  f"fusion); name the surviving tensor, or set optimize_model=False to quantize "
                                  f"the graph as given")
            near = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
            hint = f"; near matches: {near}" if near else ""
            raise ConfigError(f"{kind}: {name!r} is not {what} of the model{hint}")


def plan_quantization(model: onnx.ModelProto, cfg: ResolvedConfig,
                      aliases: Optional[Mapping[str, Optional[str]]] = None, info: Optional[ModelInfo] = None) -> Plan:
    """Decide the quantizer of every tensor.

    Args:
        model: the normalized, shape-inferred ONNX model (not modified).
        cfg: the resolved configuration.
        aliases: tensor names of the user's model that normalization / graph optimization removed -> the
            surviving tensor (``tensor_map.aliases``), for the error naming such a tensor in the config.
        info: the graph index of ``model`` when the caller has one (the lifter's ``gm.tensor_map.graph``,
            shared so the graph is indexed once); built here when None or when it indexes another model.

    Returns:
        A :class:`Plan`.

    Raises:
        ConfigError: a node or tensor name in the configuration is not in the model (lists near matches).
    """
    if info is None or info.model is not model:
        info = ModelInfo.from_model(model)
    node_names = list(info.nodes)
    for key, names in (("nodes_to_quantize", cfg.placement.nodes_to_quantize), ("nodes_to_exclude", cfg.placement.nodes_to_exclude),
                       ("input_nodes", cfg.placement.input_nodes), ("output_nodes", cfg.placement.output_nodes)):
        _check_names(key, names, node_names, "a node")
    tensor_names = info.all_tensors()
    _check_names("MixedPrecisionTensor", list(cfg.tensor_precision), tensor_names, "a tensor", aliases)
    _check_names("TensorQuantOverrides", list(cfg.tensor_quant_overrides), tensor_names, "a tensor", aliases)

    act_fmt, w_fmt = cfg.activation, cfg.weight
    float_formats = "float" in (act_fmt.family.name, w_fmt.family.name)  # BF16/FP16 quantize every op type
    all_ops = cfg.placement.quantize_all_op_types or float_formats
    op_types = set(cfg.placement.op_types_to_quantize) if cfg.placement.op_types_to_quantize else set(DEFAULT_OP_TYPES)

    excluded = set(cfg.placement.nodes_to_exclude)
    for starts, ends in cfg.placement.subgraphs_to_exclude:
        _check_names("subgraphs_to_exclude", list(starts) + list(ends), node_names, "a node")
        excluded |= _reachable(info, list(starts), True) & _reachable(info, list(ends), False)
    if cfg.placement.input_nodes:
        excluded |= set(node_names) - _reachable(info, list(cfg.placement.input_nodes), True)
    if cfg.placement.output_nodes:
        excluded |= set(node_names) - _reachable(info, list(cfg.placement.output_nodes), False)

    def in_scope(n: onnx.NodeProto) -> bool:
        if n.name in excluded or n.domain not in ("", "ai.onnx"):
            return False
        if cfg.placement.nodes_to_quantize and n.name not in cfg.placement.nodes_to_quantize:
            return False
        return all_ops or n.op_type in op_types

    integer_bias = cfg.placement.int32_bias and act_fmt.family.integer_grid and w_fmt.family.integer_grid
    specs: Dict[str, QuantSpec] = {}

    def act_spec(t: str) -> QuantSpec:
        return QuantSpec(t, act_fmt, "activation", None, cfg.placement.activation_symmetric, False, cfg.floats.activation_scaled)

    def add(spec: QuantSpec) -> None:
        if spec.tensor not in specs:
            specs[spec.tensor] = spec

    # FoldRelu: tensors between a foldable producer and its only consumer Relu stay float.
    folded = set()
    if cfg.placement.fold_relu:
        for n in info.node_protos.values():
            if n.op_type == "Relu" and in_scope(n):
                t = n.input[0]
                p = info.producer.get(t)
                if p and info.node_protos[p].op_type in FOLD_RELU_PRODUCERS and len(info.reads.get(t, [])) == 1 \
                        and t not in info.graph_outputs:
                    folded.add(t)

    for n in model.graph.node:  # topological order
        if not in_scope(n):
            continue
        data_inputs = DATA_INPUTS.get(n.op_type)
        if n.op_type in DIRECT_OP_TYPES and not cfg.placement.force_quantize_no_input_check and not float_formats:
            src = n.input[0] if n.input else ""
            if src not in specs:
                continue
        for slot, t in enumerate(n.input):
            if not t or not info.is_float32(t) or t in folded:
                continue
            if data_inputs is not None and slot not in data_inputs:
                continue
            if n.op_type == "BatchNormalization" and slot in (3, 4):
                continue
            if t in info.initializers:
                spec = _initializer_spec(n, slot, t, info, cfg, w_fmt, act_fmt, integer_bias)
                if spec is not None:
                    add(spec)
            else:
                add(act_spec(t))
        for t in n.output:
            if t and info.is_float32(t) and t not in folded:
                add(act_spec(t))

    amp = cfg.auto_mixprecision
    if amp is not None and amp.l2_target is None and amp.top1_acc_target is None:
        specs.update(_layerwise(model, info, cfg, specs, in_scope, folded))

    # tensor-wise mixed precision and ONNX Runtime's TensorQuantOverrides
    for t, fmt in cfg.tensor_precision.items():
        if t in specs:
            specs[t] = dataclasses.replace(specs[t], fmt=fmt, bias_of=None) if specs[t].role != "bias" else specs[t]
        elif info.is_float32(t):
            role = "weight" if t in info.initializers else "activation"
            specs[t] = QuantSpec(t, fmt, role, symmetric=cfg.placement.activation_symmetric)
    if cfg.placement.reduce_range:  # ONNX Runtime's reduce_range: integer weights computed for the 7-bit (15-bit) range
        if cfg.calibration.power_of_two:
            raise ConfigError("reduce_range=True cannot be combined with power-of-two scales (XINT8 / "
                              "enable_npu_cnn): there is no reduced power-of-two rule")
        for t, sp in list(specs.items()):
            if sp.role == "weight" and sp.consumer is None and sp.fmt.family.integer_grid and sp.fmt.bits <= 16:
                specs[t] = dataclasses.replace(sp, overrides=sp.overrides + (("reduce_range", True),))
    for t, entries in cfg.tensor_quant_overrides.items():
        entries = list(entries) if isinstance(entries, (list, tuple)) else [entries]
        entry = dict(entries[0])
        is_init = t in info.initializers
        base = specs.get(t) or QuantSpec(t, act_fmt, "weight" if is_init else "activation",
                                         symmetric=cfg.placement.activation_symmetric)
        changes: Dict[str, object] = {}
        if "quant_type" in entry:
            changes["fmt"] = entry["quant_type"]
        if "symmetric" in entry:
            changes["symmetric"] = bool(entry["symmetric"])
        if is_init:
            changes["axis"], fixed = _weight_overrides(t, entries, info, cfg)
        else:
            fixed = _activation_overrides(t, entries)
        specs[t] = dataclasses.replace(base, overrides=fixed, **changes)
        if "convert" in entry:  # ONNX Runtime's mixed precision: the readers in recv_nodes see a second type
            specs.update(_convert_specs(t, entry["convert"], specs[t], info))

    # range adjustments and alignment (applied after calibration)
    for n in model.graph.node:
        if not in_scope(n):
            continue
        if n.op_type in ("Relu", "Clip") and n.input and n.input[0] in specs and n.output[0] in specs:
            src = n.input[0]
            if len(info.reads.get(src, [])) == 1 and specs[src].role == "activation":
                specs[src] = dataclasses.replace(specs[src], range_from=n.output[0])
        if n.op_type == "Softmax" and n.output[0] in specs:
            specs[n.output[0]] = dataclasses.replace(specs[n.output[0]], fixed_range=(0.0, 1.0))
        if cfg.placement.align_concat and n.op_type == "Concat" and n.output[0] in specs:
            for t in n.input:
                if t in specs and specs[t].role == "activation" and specs[t].fmt == specs[n.output[0]].fmt \
                        and len(info.reads.get(t, [])) == 1:
                    specs[t] = dataclasses.replace(specs[t], share_with=n.output[0], range_from=None)
        if cfg.placement.align_slice and n.op_type == "Slice" and n.input[0] in specs and n.output[0] in specs:
            if specs[n.output[0]].fmt == specs[n.input[0]].fmt:
                specs[n.output[0]] = dataclasses.replace(specs[n.output[0]], share_with=n.input[0])
    # a bias whose activation or weight lost its integer quantizer falls back to the weight format
    for t, s in list(specs.items()):
        if s.bias_of is not None:
            x, w = s.bias_of
            if not (x in specs and w in specs and specs[x].fmt.family.integer_grid
                    and specs[w].fmt.family.integer_grid):
                specs[t] = QuantSpec(t, w_fmt, "weight", symmetric=cfg.placement.weight_symmetric,
                                     narrow_range=cfg.placement.weight_symmetric and w_fmt.family.integer_grid)
            else:  # per channel exactly when the weight is (TensorQuantOverrides may change that)
                specs[t] = dataclasses.replace(s, axis=0 if specs[w].axis is not None else None)
    # block formats: the block axis follows the reduction axis (docs/configuration.md)
    for t, s in list(specs.items()):
        if s.fmt.family.block:
            key = s.fmt.family.attributes_key
            axis = block_axis(info, s.tensor, s.consumer, default=cfg.block_axes.get(key), key=key)
            specs[t] = dataclasses.replace(s, axis=axis)
    return Plan(specs=specs, info=info)


def _initializer_spec(n: onnx.NodeProto, slot: int, t: str, info: ModelInfo, cfg: ResolvedConfig, w_fmt: Format,
                      act_fmt: Format, integer_bias: bool) -> Optional[QuantSpec]:
    """Quantizer of float initializer ``t`` read by node ``n`` at input ``slot`` (module docstring): a bias
    (Conv/ConvTranspose/Gemm input 2) is INT32 with ``scale_x * scale_w`` when ``integer_bias``, else in
    ``w_fmt``, or None when biases are not quantized; other initializers are weights in ``w_fmt`` (``act_fmt``
    for element-wise ops under AlignEltwiseQuantType), per output channel when configured."""
    if n.op_type in ("Conv", "ConvTranspose", "Gemm") and slot == 2:
        if not cfg.placement.quantize_bias:
            return None
        if integer_bias:
            return QuantSpec(t, INT32, "bias", axis=None, symmetric=True, bias_of=(n.input[0], n.input[1]))
        return QuantSpec(t, w_fmt, "weight", axis=None, symmetric=cfg.placement.weight_symmetric,
                         narrow_range=cfg.placement.weight_symmetric, scaled=cfg.floats.weight_scaled)
    dims = tuple(info.initializers[t].dims)
    fmt = act_fmt if cfg.placement.align_eltwise_quant_type and n.op_type in ELEMENTWISE_OPS else w_fmt
    axis = None
    if n.op_type in WEIGHT_OPS and slot == 1 and len(dims) >= 2 and cfg.placement.per_channel and fmt.family.integer_grid:
        axis = _weight_axis(n, slot, len(dims))
    sym = cfg.placement.weight_symmetric if fmt == w_fmt else cfg.placement.activation_symmetric
    return QuantSpec(t, fmt, "weight", axis=axis, symmetric=sym,
                     narrow_range=sym and fmt.family.integer_grid and fmt.signed, scaled=cfg.floats.weight_scaled)


def _layerwise(model: onnx.ModelProto, info: ModelInfo, cfg: ResolvedConfig, specs: Dict[str, QuantSpec],
               in_scope, folded: set) -> Dict[str, QuantSpec]:
    """Layer-wise mixed precision (module docstring): updates ``specs`` (weights, biases, inputs read only by
    promoted nodes) in place and returns the consumer-side specs, keyed by :func:`edge_key`."""
    amp = cfg.auto_mixprecision
    act_t = amp.act_target_quant_type or cfg.activation
    w_t = amp.weight_target_quant_type or cfg.weight
    dual = amp.dual_quant_nodes
    target_ops = set(amp.target_op_type)
    chosen = None if amp.promoted_nodes is None else set(amp.promoted_nodes)
    promoted = [n for n in model.graph.node if n.op_type in target_ops and in_scope(n)
                and (chosen is None or n.name in chosen)]
    promoted_names = {n.name for n in promoted}
    int_bias = cfg.placement.int32_bias and act_t.family.integer_grid and w_t.family.integer_grid
    edges: Dict[str, QuantSpec] = {}

    def act(t: str, **kw) -> QuantSpec:
        return QuantSpec(t, act_t, "activation", None, cfg.placement.activation_symmetric, False, cfg.floats.activation_scaled, **kw)

    for n in promoted:
        data_inputs = DATA_INPUTS.get(n.op_type)
        for slot, t in enumerate(n.input):
            if not t or not info.is_float32(t) or t in folded:
                continue
            if data_inputs is not None and slot not in data_inputs:
                continue
            if t in info.initializers:
                spec = _initializer_spec(n, slot, t, info, cfg, w_t, act_t, int_bias)
                if spec is not None:
                    specs[t] = spec
                continue
            own = specs.get(t)
            readers = info.reads.get(t, [])
            boundary = any(r not in promoted_names for r in readers) or t in info.graph_outputs
            if own is not None and own.fmt == act_t:
                continue  # already in the target format: no boundary
            if own is None and boundary:
                edges[edge_key(t, n.name)] = act(t, consumer=n.name, chained=False)
            elif own is None or (not boundary and not dual):
                specs[t] = act(t)
            else:
                edges[edge_key(t, n.name)] = act(t, consumer=n.name, chained=dual)
    # INT32 biases of promoted nodes take the scale of the quantizer their node actually reads
    for n in promoted:
        if len(n.input) > 2 and n.input[2] in specs and specs[n.input[2]].bias_of is not None:
            x, w = specs[n.input[2]].bias_of
            if edge_key(x, n.name) in edges:
                specs[n.input[2]] = dataclasses.replace(specs[n.input[2]], bias_of=(edge_key(x, n.name), w))
    return edges


def block_axis(info: ModelInfo, tensor: str, consumer: Optional[str] = None, default: Optional[int] = None,
               key: str = "BFPAttributes") -> int:
    """Block axis of a tensor for BFP/MX formats (docs/configuration.md extra_options, block formats).

    MatMul A: last axis, B: second to last; Gemm A: 1 (0 when transA), B: 0 (1 when transB); Softmax:
    its axis (the reduction axis decides: a block must not straddle it); Conv and everything else:
    ``default`` (the ``axis`` of ``BFPAttributes`` / ``MXAttributes``, negative counts from the end) or axis 1;
    1-D tensors: axis 0. The first reader that decides wins; with ``consumer`` (a consumer-side quantizer)
    only that reader counts.

    Raises:
        ConfigError: ``default`` is not an axis of the tensor (names ``key``, the tensor and its rank).
    """
    shape = info.shapes.get(tensor)
    ndim = len(shape) if shape is not None else 4
    if ndim <= 1:
        return 0
    readers = [consumer] if consumer is not None else info.reads.get(tensor, [])
    for cname in readers:
        n = info.node_protos[cname]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "MatMul":
            return ndim - 1 if n.input[0] == tensor else ndim - 2
        if n.op_type == "Gemm":
            if n.input[0] == tensor:
                return 0 if attrs.get("transA", 0) else 1
            if n.input[1] == tensor:
                return 1 if attrs.get("transB", 0) else 0
        if n.op_type == "Softmax" and n.input[0] == tensor:
            ax = attrs.get("axis", -1)
            return ax % ndim
    if default is None:
        return 1
    if not -ndim <= default < ndim:
        raise ConfigError(f"extra_options[{key!r}]['axis']={default} is not an axis of "
                          f"tensor {tensor!r} (rank {ndim}); valid: {-ndim}..{ndim - 1}")
    return default % ndim
