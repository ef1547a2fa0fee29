"""Import an already-quantized ONNX model: its quantizer nodes become FakeQuantize modules.

:func:`load_quantized` takes a model quantized by AMD Quark, by ONNX Runtime's quantization tool or by this
project, and returns a :class:`~qtorch_onnx.model.QuantizedModel` whose FakeQuantize modules hold the
model's own formats, scales, zero points, axes and block attributes. It runs like the model (bit for bit per
quantizer, docs/numerics.md), can be finetuned (weights are float parameters, straight-through gradients), and
:func:`qtorch_onnx.export` writes it back with the same structure: the same quantizer op types, domains,
attributes, parameters and weight storage, in the same places.

Recognised structures (main graph; scales and zero points must be initializers):

* ``QuantizeLinear -> DequantizeLinear`` (default domain, ``com.microsoft``) and ``ExtendedQuantizeLinear ->
  ExtendedDequantizeLinear`` (``com.amd.quark``; ``VitisQuantizeLinear``/``VitisDequantizeLinear`` of
  ``com.vai.quantize``): 8/16/32-bit integers per tensor or per axis; Quark's bfloat16 / float16 pairs. On an
  activation, or on a float initializer (a weight Quark stores in float and quantizes in the graph).
* ``DequantizeLinear`` of a quantized initializer (weights, INT32 biases, Quark's bfloat16 weights).
* ``BFPQuantizeDequantize`` / ``MXQuantizeDequantize`` (``BFPFixNeuron`` / ``MXFixNeuron``) on an activation or
  a float initializer.

Placement in the float graph: a quantizer whose input no other node reads directly becomes that tensor's own
quantizer; one beside a direct float reader, or a second one on the same tensor, becomes a consumer-side
quantizer of each node reading it; one reading another quantizer's output (Quark's ``DualQuantNodes``)
becomes a chained consumer-side quantizer (``placement.QuantSpec``). Everything else stays in the model as
an operator (lifted by the converters of :mod:`qtorch_onnx.lift.ops_quant` / :mod:`~qtorch_onnx.interop.ops_quark`,
runs, but holds no FakeQuantize) and is listed in ``qm.import_report`` with the reason: sub-byte and float8
types (no FakeQuantize format), blocked Q/DQ, run-time scales, a Q output read by other ops (QOperator
models), layouts the placement cannot express.

Known differences on re-export: node and intermediate tensor names are the exporter's (``<t>_QuantizeLinear``
...), not the original's; a quantize node shared by several dequantize nodes (Quark's ``DedicateDQNode``) comes
back as one pair; ``com.vai.quantize`` nodes come back in ``com.amd.quark``; Quark's FP16 Q/DQ ignores its scale,
so it comes back with scale 1.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import onnx
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from ..errors import ModelError
from ..formats import floating as _floating
from ..formats import integer as _integer
from ..formats.spec import BF16, FP16, INT_FORMAT_BY_ONNX_TYPE, BFPFormat, Format, MXFormat
from ..placement import Plan, QuantSpec

__all__ = ["load_quantized", "ImportReport"]

#: quantize op -> its dequantize partner, as (domain, op_type)
_PAIRS = {("", "QuantizeLinear"): ("", "DequantizeLinear"),
          ("com.microsoft", "QuantizeLinear"): ("com.microsoft", "DequantizeLinear"),
          ("com.amd.quark", "ExtendedQuantizeLinear"): ("com.amd.quark", "ExtendedDequantizeLinear"),
          ("com.vai.quantize", "VitisQuantizeLinear"): ("com.vai.quantize", "VitisDequantizeLinear")}
_DEQUANT = set(_PAIRS.values())
_BLOCK = {("com.amd.quark", "BFPQuantizeDequantize"): "bfp", ("com.vai.quantize", "BFPFixNeuron"): "bfp",
          ("com.amd.quark", "MXQuantizeDequantize"): "mx", ("com.vai.quantize", "MXFixNeuron"): "mx"}
#: integer Q/DQ types an imported model may use (4-bit Q/DQ is not imported yet: left as lifted ONNX ops)
_INT = {t: f for t, f in INT_FORMAT_BY_ONNX_TYPE.items() if f.bits >= 8}
_BIAS_SLOT = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}


def _dom(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


@dataclass
class ImportReport:
    """What :func:`load_quantized` did. ``lifted``: quantizer key -> ``"<format> <role> (<ONNX nodes>)"``;
    ``kept``: ONNX node name -> why it stays an operator (no FakeQuantize)."""

    lifted: Dict[str, str] = field(default_factory=dict)
    kept: Dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{len(self.lifted)} quantizers imported as FakeQuantize, {len(self.kept)} quantizer nodes kept "
                 "as operators"]
        lines += [f"  kept {n}: {why}" for n, why in self.kept.items()]
        return "\n".join(lines)


@dataclass
class _Found:
    """One quantizer structure of the input model."""

    kind: str                       # "pair" | "dq" (DequantizeLinear of a quantized initializer) | "block"
    nodes: List[onnx.NodeProto]     # removed from the float model
    input: str                      # float input tensor (kind "dq": the quantized initializer)
    outputs: List[str]              # tensors holding the fake-quantized value
    fmt: Format
    axis: Optional[int] = None
    scale: Optional[np.ndarray] = None
    zero_point: Optional[np.ndarray] = None
    scaled: bool = False
    domain: str = ""
    role: str = "activation"
    weight_value: Optional[np.ndarray] = None  # kind "dq": the dequantized float weight


def _array(init: onnx.TensorProto) -> np.ndarray:
    from ..lift.normalize import read_initializer  # numpy_helper.to_array, or from its file (streaming)

    return read_initializer(init)


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _rank(model: onnx.ModelProto, inits: Dict[str, onnx.TensorProto], name: str) -> Optional[int]:
    if name in inits:
        return len(inits[name].dims)
    for v in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if v.name == name and v.type.tensor_type.HasField("shape"):
            return len(v.type.tensor_type.shape.dim)
    return None


def _block_format(node: onnx.NodeProto, kind: str) -> Format:
    a = _attrs(node)
    if kind == "bfp":
        method = a.get("bfp_method", "to_bfp")
        method = "to_bfp_prime" if method == "to_bfp_prime_shared" else method
        if method not in ("to_bfp", "to_bfp_prime"):
            raise ValueError(f"bfp_method={method!r}")
        return BFPFormat(method, int(a.get("bit_width", 16)), int(a.get("block_size", 8)), int(a.get("rounding_mode", 0)),
                         int(a.get("sub_block_size", 2)), int(a.get("sub_block_shift_bits", 1)),
                         int(a.get("convert_to_bfloat_before_bfp", 0)))
    return MXFormat(str(a.get("element_dtype", "int8")), int(a.get("block_size", 32)), int(a.get("rounding_mode", 0)))


class _Finder:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        g = model.graph
        self.inits = {t.name: t for t in g.initializer}
        self.consumers: Dict[str, List[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.graph_outputs = {o.name for o in g.output}
        self.kept: Dict[str, str] = {}

    def qparams(self, node: onnx.NodeProto) -> Optional[Tuple[np.ndarray, Optional[np.ndarray], int]]:
        """(scale, zero point, zero point element type) of a Q/DQ node when both are initializers."""
        if len(node.input) < 2 or node.input[1] not in self.inits:
            self.kept[node.name] = "its scale is not an initializer (a run-time scale)"
            return None
        scale = _array(self.inits[node.input[1]]).astype(np.float32)
        if len(node.input) > 2 and node.input[2]:
            if node.input[2] not in self.inits:
                self.kept[node.name] = "its zero point is not an initializer"
                return None
            zp_init = self.inits[node.input[2]]
            return scale, _array(zp_init), zp_init.data_type
        a = _attrs(node)
        if "output_dtype" in a and a["output_dtype"]:
            return scale, None, int(a["output_dtype"])
        if node.op_type == "DequantizeLinear" and node.input[0] in self.inits:
            return scale, None, self.inits[node.input[0]].data_type
        return scale, None, TP.UINT8

    def fmt_of(self, node: onnx.NodeProto, zp_type: int, scale: np.ndarray, zp) -> Optional[Tuple[Format, bool]]:
        extended = _dom(node) in ("com.amd.quark", "com.vai.quantize")
        if zp_type in _INT:
            return _INT[zp_type], False
        if extended and zp_type in (TP.BFLOAT16, TP.FLOAT16):
            if zp is not None and np.any(np.asarray(zp, dtype=np.float32) != 0):
                self.kept[node.name] = "a bfloat16/float16 quantizer with a non-zero zero point"
                return None
            if zp_type == TP.FLOAT16:
                return FP16, False  # Quark's FP16 Q/DQ ignores the scale
            return BF16, bool(np.any(scale != 1.0))
        self.kept[node.name] = (f"element type {TP.DataType.Name(zp_type)} has no FakeQuantize format (sub-byte, "
                                "float8 and float4 quantizers stay operators)")
        return None

    def axis_of(self, node: onnx.NodeProto, scale: np.ndarray, tensor: str, default: int) -> Optional[int]:
        a = _attrs(node)
        if a.get("block_size"):
            self.kept[node.name] = "blocked quantization (block_size attribute)"
            return -1
        if scale.size == 1 and (scale.ndim != 1 or "axis" not in a):
            return None  # per tensor (a [1] scale with an axis attribute stays per channel)
        axis = int(a.get("axis", default))
        if axis < 0:
            r = _rank(self.model, self.inits, tensor)
            if r is None:
                self.kept[node.name] = f"negative axis {axis} on {tensor!r}, whose rank is unknown"
                return -1
            axis += r
        return axis

    def find(self) -> List[_Found]:
        found: List[_Found] = []
        for n in self.model.graph.node:
            key = (_dom(n), n.op_type)
            if key in _BLOCK:
                f = self.block(n, _BLOCK[key])
            elif key in _PAIRS:
                f = self.pair(n, _PAIRS[key])
            elif key in _DEQUANT and n.input and n.input[0] in self.inits:
                f = self.dequant(n)
            else:
                continue
            if f is not None:
                found.append(f)
        return found

    def block(self, n: onnx.NodeProto, kind: str) -> Optional[_Found]:
        try:
            fmt = _block_format(n, kind)
        except ValueError as exc:
            self.kept[n.name] = str(exc)
            return None
        axis = int(_attrs(n).get("axis", 1))
        if axis < 0:
            r = _rank(self.model, self.inits, n.input[0])
            if r is None:
                self.kept[n.name] = "negative block axis on a tensor of unknown rank"
                return None
            axis += r
        return _Found("block", [n], n.input[0], [n.output[0]], fmt, axis=axis, domain="com.amd.quark")

    def pair(self, q: onnx.NodeProto, dq_key) -> Optional[_Found]:
        out = q.output[0]
        readers = self.consumers.get(out, [])
        if not readers or out in self.graph_outputs or any((_dom(r), r.op_type) != dq_key for r in readers):
            self.kept[q.name] = "its quantized output is read by other operators (a QOperator / integer model)"
            return None
        qp = self.qparams(q)
        if qp is None:
            return None
        scale, zp, zp_type = qp
        for dq in readers:
            if list(dq.input[1:]) != list(q.input[1:]) and not self._same_params(q, dq):
                self.kept[q.name] = f"dequantize node {dq.name!r} uses other parameters than its quantize node"
                return None
        ff = self.fmt_of(q, zp_type, scale, zp)
        if ff is None:
            return None
        axis = self.axis_of(q, scale, q.input[0], 1 if _dom(q) in ("", "com.microsoft") else 0)
        if axis == -1:
            return None
        fmt, scaled = ff
        return _Found("pair", [q] + readers, q.input[0], [r.output[0] for r in readers], fmt, axis=axis, scale=scale,
                      zero_point=zp, scaled=scaled, domain=_dom(q))

    def _same_params(self, a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
        pa, pb = self.qparams(a), self.qparams(b)
        return pa is not None and pb is not None and np.array_equal(pa[0], pb[0]) and \
            (pa[1] is None) == (pb[1] is None) and (pa[1] is None or np.array_equal(pa[1], pb[1])) and \
            _attrs(a).get("axis") == _attrs(b).get("axis")

    def dequant(self, dq: onnx.NodeProto) -> Optional[_Found]:
        qp = self.qparams(dq)
        if qp is None:
            return None
        scale, zp, zp_type = qp
        q_init = self.inits[dq.input[0]]
        ff = self.fmt_of(dq, zp_type if zp is not None else q_init.data_type, scale, zp)
        if ff is None:
            return None
        fmt, scaled = ff
        axis = self.axis_of(dq, scale, dq.input[0], 1 if _dom(dq) in ("", "com.microsoft") else 0)
        if axis == -1:
            return None
        q = _array(q_init)
        if fmt.family.integer_grid:
            value = _integer.dequantize(torch.from_numpy(np.asarray(q).astype(np.int64)), torch.from_numpy(scale),
                                        None if zp is None else torch.from_numpy(np.asarray(zp).astype(np.int64)),
                                        axis).numpy()
        elif fmt == BF16:
            bits = torch.from_numpy(np.ascontiguousarray(q).view(np.int16).copy()).view(torch.bfloat16)
            value = _floating.bf16_dequantize(bits, torch.from_numpy(scale), None, axis).numpy()
        else:
            value = np.asarray(q, dtype=np.float16).astype(np.float32)
        return _Found("dq", [dq], dq.input[0], [dq.output[0]], fmt, axis=axis, scale=scale, zero_point=zp,
                      scaled=scaled, domain=_dom(dq), weight_value=value)


def load_quantized(model: Union[str, os.PathLike, onnx.ModelProto], *, device=None):
    """Import a quantized ONNX model as a :class:`~qtorch_onnx.model.QuantizedModel` (module docstring).

    Args:
        model: path or ``onnx.ModelProto`` (never modified), quantized in Q/DQ form (Quark, ONNX Runtime's
            ``quantize_static``, this project's :func:`qtorch_onnx.export`).
        device: move the module there.

    Returns:
        The model with every recognised quantizer as a FakeQuantize in ``"quantize"`` mode, calibrated (the
        model's parameters), ``qm.import_report`` (:class:`ImportReport`) listing what was imported and
        which quantizer nodes stayed operators and why. ``qm(*inputs)`` runs it; ``qtorch_onnx.export(qm)``
        writes it back.

    Raises:
        ModelError / UnsupportedOpsError: unreadable model, or ops that cannot be lifted.
    """
    from ..lift import lift, load_model
    from ..quantizer import attach_quantizers, resolve

    original = load_model(model)
    work = onnx.ModelProto()
    work.CopyFrom(original)
    taken = {n.name for n in work.graph.node if n.name}
    for k, n in enumerate(work.graph.node):  # consumers are identified by node name: every node needs one
        if not n.name:
            name = f"{n.op_type}_{k}"
            while name in taken:
                name += "_"
            n.name = name
            taken.add(name)
    finder = _Finder(work)
    found = finder.find()
    report = ImportReport(kept=dict(finder.kept))
    float_model, specs, params = _float_model(work, found, finder, report)
    t0 = time.perf_counter()
    gm = lift(float_model, fold_batchnorm=False)
    t_lift = time.perf_counter() - t0
    tm = gm.tensor_map
    info = gm.tensor_map.graph
    plan_specs: Dict[str, QuantSpec] = {}
    by_key: Dict[str, _Found] = {}
    for spec in specs:
        t = spec.tensor
        if t not in tm and t in tm.aliases and tm.aliases[t]:
            spec = dataclasses.replace(spec, tensor=tm.aliases[t])
        if spec.tensor not in tm:
            raise ModelError(f"imported quantizer on tensor {t!r}: the tensor is not in the lifted model (lifting bug)")
        plan_specs[spec.key] = spec
        by_key[spec.key] = params[(t, spec.consumer)]
    plan = Plan(specs=plan_specs, info=info)
    acts = Counter(s.fmt for s in plan_specs.values() if s.role == "activation")
    weights = Counter(s.fmt for s in plan_specs.values() if s.role == "weight")
    cfg = resolve("A8W8")
    cfg = dataclasses.replace(cfg, activation=acts.most_common(1)[0][0] if acts else cfg.activation,
                              weight=weights.most_common(1)[0][0] if weights else cfg.weight)

    def setup(fq, spec):
        f = by_key[spec.key]
        if f.scale is not None and (f.fmt.family.integer_grid or f.scaled):
            zp = None if f.zero_point is None else torch.from_numpy(np.asarray(f.zero_point).astype(np.int64))
            fq.set_qparams(torch.from_numpy(np.asarray(f.scale, dtype=np.float32)), zp)
        fq.calibrated = True
        if fq.fmt in (BF16, FP16):
            fq.float_form = "qdq"
        if f.fmt.family.integer_grid and f.domain in ("", "com.microsoft"):
            fq.qdq_domain = f.domain
        fq.weight_storage = "float" if f.kind == "pair" else "quantized"
        if f.scale is not None:
            fq.qparam_shapes = (tuple(np.shape(f.scale)),
                                tuple(np.shape(f.zero_point)) if f.zero_point is not None else tuple(np.shape(f.scale)))
        report.lifted[spec.key] = f"{f.fmt.name} {spec.role} ({', '.join(n.name for n in f.nodes)})"

    from ..training import make_trainable

    make_trainable(gm)
    qm = attach_quantizers(gm, plan, cfg, setup)
    qm.set_mode("quantize")
    for fq in qm.quantizers().values():  # the model's own scales stay: weights do not re-derive theirs
        if fq.tracks_value:
            fq.observer_enabled = False
    qm.import_report = report
    qm.stage_times["lift"] = t_lift
    if device is not None:
        qm.to(device)
    return qm


def _float_model(model: onnx.ModelProto, found: List[_Found], finder: _Finder, report: ImportReport):
    """The model without the imported quantizer nodes, plus their QuantSpecs (keyed later) and parameters."""
    g = model.graph
    inits = finder.inits
    graph_inputs = {i.name for i in g.input}
    graph_outputs = finder.graph_outputs
    out_of = {o: f for f in found for o in f.outputs}  # quantized tensor -> structure writing it
    struct_nodes = {id(n) for f in found for n in f.nodes}
    # direct readers: nodes (outside the structures) reading a tensor
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for n in g.node:
        if id(n) in struct_nodes:
            continue
        for i in n.input:
            if i:
                readers.setdefault(i, []).append(n)
    on_input: Dict[str, List[_Found]] = {}
    for f in found:
        on_input.setdefault(f.input, []).append(f)

    accepted: List[Tuple[_Found, Optional[List[str]], bool]] = []  # (structure, consumers or None = own, chained)
    own_of: Dict[str, _Found] = {}
    rename: Dict[str, str] = {}  # tensor -> tensor it becomes in the float model

    def keep(f: _Found, why: str) -> None:
        for n in f.nodes:
            report.kept[n.name] = why

    def out_readers(f: _Found) -> List[onnx.NodeProto]:
        return [r for o in f.outputs for r in readers.get(o, [])]

    for f in found:
        if f.kind == "dq":
            accepted.append((f, None, False))
            continue
        base = out_of.get(f.input)
        chained = base is not None
        src = base.input if chained else f.input
        if f.input in inits and (readers.get(f.input) or len(on_input[f.input]) > 1):
            keep(f, "a float initializer also read by other nodes")
            continue
        rs = out_readers(f)
        if any(o in graph_outputs for o in f.outputs):
            if chained or readers.get(f.input) or on_input[f.input][0] is not f or f.input in graph_inputs \
                    or f.input in graph_outputs or f.input in inits:
                keep(f, "its output is a graph output and its input cannot be renamed to it")
                continue
        if any(id(s) in struct_nodes for s in rs):
            keep(f, "its output feeds another quantizer that is not a chain this placement can express")
            continue
        if chained:
            if own_of.get(src) is not base:
                keep(f, "it reads a quantizer that is not its tensor's own")
                continue
            accepted.append((f, [r.name for r in rs], True))
            continue
        direct = readers.get(f.input, []) + ([None] if f.input in graph_outputs else [])
        first = on_input[f.input][0] is f
        if not direct and first:
            own_of[f.input] = f
            accepted.append((f, None, False))
        else:
            if any(f.input in r.input for r in rs):
                keep(f, "a node reads both the float tensor and its quantized value")
                continue
            if not rs:
                keep(f, "nothing reads its output")
                continue
            accepted.append((f, [r.name for r in rs], False))

    # chained structures whose base was kept as an operator cannot be imported either
    kept_nodes = set(report.kept)
    final = []
    for f, consumers, chained in accepted:
        if chained and any(n.name in kept_nodes for n in out_of[f.input].nodes):
            keep(f, "it reads a quantizer that stays an operator")
            continue
        final.append((f, consumers, chained))
    removed = {id(n) for f, _, _ in final for n in f.nodes}

    specs: List[QuantSpec] = []
    params: Dict[Tuple[str, Optional[str]], _Found] = {}
    new_inits: List[onnx.TensorProto] = []
    drop_inits = set()
    for f, consumers, chained in final:
        if f.kind == "dq":
            t = f.outputs[0]
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(f.weight_value, dtype=np.float32), t))
            drop_inits.add(f.input)
            role = "bias" if _is_bias(t, readers) and f.fmt.family.integer_grid and f.fmt.bits == 32 else "weight"
            specs.append(_spec(t, f, role))
            params[(t, None)] = f
            continue
        src = out_of[f.input].input if chained else f.input
        role = "weight" if src in inits else "activation"
        if role == "weight" and _is_bias(f.outputs[0], readers) and f.fmt.family.integer_grid and f.fmt.bits == 32:
            role = "bias"
        if consumers is None:
            target = src
            if any(o in graph_outputs for o in f.outputs):
                target = next(o for o in f.outputs if o in graph_outputs)
                rename[src] = target
            for o in f.outputs:
                if o != target:
                    rename[o] = target
            specs.append(_spec(target, f, role))
            params[(target, None)] = f
        else:
            for o in f.outputs:
                rename[o] = src
            for c in consumers:
                specs.append(dataclasses.replace(_spec(src, f, role), consumer=c, chained=chained))
                params[(src, c)] = f
    # resolve rename chains (a chained structure's outputs -> its base's outputs -> the float tensor)
    def final_name(t: str) -> str:
        seen = set()
        while t in rename and t not in seen:
            seen.add(t)
            t = rename[t]
        return t

    out = onnx.ModelProto()
    out.CopyFrom(model)
    og = out.graph
    kept_nodes = [n for n, orig in zip(og.node, g.node) if id(orig) not in removed]
    for n in kept_nodes:
        for k, i in enumerate(n.input):
            if i:
                n.input[k] = final_name(i)
        for k, o in enumerate(n.output):
            if o:
                n.output[k] = final_name(o)
    del og.node[:]
    og.node.extend(kept_nodes)
    for o in og.output:
        o.name = final_name(o.name)
    og.initializer.extend(new_inits)
    used = {i for n in og.node for i in n.input}
    keep_inits = [t for t in og.initializer if t.name in used or t.name in {i.name for i in new_inits}]
    keep_inits = [t for t in keep_inits if t.name not in drop_inits or t.name in used]
    del og.initializer[:]
    og.initializer.extend(keep_inits)
    live = used | {o.name for o in og.output}
    vi = [v for v in og.value_info if v.name in live]
    del og.value_info[:]
    og.value_info.extend(vi)
    specs = [dataclasses.replace(s, tensor=final_name(s.tensor)) for s in specs]
    params = {(final_name(t), c): f for (t, c), f in params.items()}
    return out, specs, params


def _is_bias(tensor: str, readers: Dict[str, List[onnx.NodeProto]]) -> bool:
    rs = readers.get(tensor, [])
    return bool(rs) and all(_BIAS_SLOT.get(r.op_type) is not None and len(r.input) > 2 and r.input[2] == tensor
                            for r in rs)


def _spec(tensor: str, f: _Found, role: str) -> QuantSpec:
    symmetric = f.zero_point is None or not np.any(np.asarray(f.zero_point) != 0)
    return QuantSpec(tensor, f.fmt, role, axis=f.axis, symmetric=symmetric, scaled=f.scaled)
