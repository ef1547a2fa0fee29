"""ONNX -> torch.fx: :func:`lift` (normalize, check support, onnx2torch.convert, fix up, map tensors)."""
from __future__ import annotations

import operator
import time
from collections import OrderedDict
from pathlib import Path
from typing import Union

import onnx
import torch
from torch import fx

from onnx2torch import convert as _o2t_convert
from onnx2torch.onnx_graph import OnnxGraph, ValueType

from ..errors import ModelError, UnsupportedOpsError
from . import converters as _conv
from . import recurrent as _recurrent  # noqa: F401  (registers the LSTM/GRU/RNN converters)
from . import control_flow as _control_flow  # noqa: F401  (registers the If/Loop/Scan converters)
from .normalize import _PLAIN_TYPES, is_unloaded, large_initializers, read_external_bytes, read_initializer
from .fusion import normalize_and_fuse
from .ops_common import tensor_from_proto
from .tensor_map import ModelInfo, TensorMap, TensorRef, _same_values, match_parameter

ModelLike = Union[str, Path, onnx.ModelProto]
_PRESERVED = "_user_preserved_attributes"  # torch.fx.graph_module's key for attributes kept by deepcopy


def load_model(model_or_path: ModelLike) -> onnx.ModelProto:
    """Return the ModelProto itself, or load it from a path (external data resolved beside the file).

    Streaming (a path to a model with external data past protobuf's limit): the initializers that
    :func:`~qtorch_onnx.lift.normalize.large_initializers` names and whose data is external stay in their
    file, unloaded (:func:`~qtorch_onnx.lift.normalize.is_unloaded`: their ``location`` is made the file's
    absolute path); normalization, shape inference and fusion run without their bytes, and the lifter reads
    each one once, into its torch tensor (:func:`~qtorch_onnx.lift.normalize.read_initializer`). Every other
    external tensor is loaded. The files are only read.

    Raises:
        ModelError: the path does not exist, the file is not an ONNX model, or an external data file is missing
            or shorter than a tensor needs (names the file and the tensor).
    """
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if not isinstance(model_or_path, (str, Path)):
        raise ModelError(f"expected an onnx.ModelProto or a path to a .onnx file, got {type(model_or_path).__name__}")
    path = Path(model_or_path)
    if not path.is_file():
        raise ModelError(f"ONNX model file {str(path)!r} does not exist")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"file {str(path)!r} is not an ONNX model: {exc}") from exc
    _load_external_data(model, path)
    if model.ir_version == 0 or not model.opset_import or not model.graph.node:
        raise ModelError(f"file {str(path)!r} is not an ONNX model (no IR version, opset import or nodes)")
    return model


def _external_tensors(graph: onnx.GraphProto):
    """Every tensor of ``graph`` (initializers, tensor attributes, subgraphs, recursively) whose data is in an
    external file."""
    from onnx.external_data_helper import uses_external_data

    def all_tensors(g):
        yield from g.initializer
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                for sg in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from all_tensors(sg)

    return [t for t in all_tensors(graph) if uses_external_data(t)]


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read the tensors stored in external data files (ONNX's external data format) beside ``path``, except the
    large initializers of a model past protobuf's limit, which stay in their file (see :func:`load_model`).

    Raises:
        ModelError: an external data file that is missing, or shorter than a tensor's offset + length (names
            the tensor and the file).
    """
    from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor, uses_external_data

    tensors = _external_tensors(model.graph)
    if not tensors:
        return
    base = path.parent
    for t in tensors:
        info = ExternalDataInfo(t)
        f = base / info.location
        if not f.is_file():
            raise ModelError(f"{str(path)!r}: tensor {t.name!r} is stored in the external data file "
                             f"{str(f)!r}, which does not exist (keep the .data file beside the model)")
        size = f.stat().st_size
        end = (info.offset or 0) + (info.length if info.length is not None else 0)
        if end > size:
            raise ModelError(f"{str(path)!r}: tensor {t.name!r} needs bytes {info.offset or 0}..{end} of the external "
                             f"data file {str(f)!r}, which has {size} bytes (truncated?)")
    stay = {t.name for t in large_initializers(model) if uses_external_data(t)
            and (t.data_type in _PLAIN_TYPES or any(e.key == "length" for e in t.external_data))}
    folder = base.resolve()
    for t in model.graph.initializer:
        if t.name in stay:  # streamed: the absolute path makes the stub self-contained (normalize.is_unloaded)
            info = ExternalDataInfo(t)
            where = (base / info.location).resolve()
            if Path(info.location).is_absolute() or not where.is_relative_to(folder):
                # ONNX's rule (onnx.external_data_helper): the data lives in the model's folder
                raise ModelError(f"{str(path)!r}: tensor {t.name!r} names the external data file "
                                 f"{info.location!r}, outside the model's folder {str(folder)!r}")
            for e in t.external_data:
                if e.key == "location":
                    e.value = str(where)
            if not any(e.key == "length" for e in t.external_data):
                t.external_data.add(key="length", value=str(_nbytes(t)))
    for t in tensors:
        if is_unloaded(t):
            continue
        try:
            load_external_data_for_tensor(t, str(base))
        except Exception as exc:
            raise ModelError(f"{str(path)!r}: reading tensor {t.name!r} from its external data file in "
                             f"{str(base)!r} failed: {exc}") from exc


def _nbytes(t: onnx.TensorProto) -> int:
    import math

    return math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def conversion_view(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The model as the lifter hands it to onnx2torch, as far as initializers go: every initializer
    whose element type numpy has no native dtype for (:data:`~qtorch_onnx.lift.converters.NUMPY_LESS_TYPES`:
    bfloat16, float8, int4/uint4, int2/uint2, float4/float6, E8M0) becomes a graph input of the same
    name, element type and shape (appended after the real inputs, initializer order); in a model past
    protobuf's size limit, so do its large initializers (:func:`~qtorch_onnx.lift.normalize.large_initializers`:
    onnx2torch serializes the model it converts, which protobuf cannot do past 2 GiB), and so does every
    initializer still in its external data file (:func:`~qtorch_onnx.lift.normalize.is_unloaded`): the lifter
    reads it once, into the buffer bound to its input.

    Why: onnx2torch turns every initializer a module reads into a buffer through
    ``OnnxTensor.to_torch`` (``torch.from_numpy`` of ``numpy_helper.to_array``), which fails on the
    ml_dtypes arrays those types decode to. As graph inputs they become fx placeholders, which the
    lifter then replaces by ``get_attr`` nodes of buffers decoded by
    :func:`~qtorch_onnx.lift.ops_common.tensor_from_proto` (torch.bfloat16 / torch.float8_*, int4 values
    in int8, uint4 values in uint8). Converters see these tensors as typed runtime values (their ONNX
    element type is in the input's type), so every module computes on them as on any other tensor.

    Returns:
        ``(view, moved)``: ``model`` itself and ``[]`` when there is nothing to move, else a copy and
        the names of the appended inputs, in order (an initializer that the graph also lists as an input,
        IR < 4 style, which :func:`~qtorch_onnx.lift.normalize` removes, stays that input only).
        ``model`` is not mutated.
    """
    moved = [t for t in model.graph.initializer if t.data_type in _conv.NUMPY_LESS_TYPES]
    # onnx2torch sizes (serializes) the model it is given, which protobuf cannot do past 2 GiB: the large
    # initializers of such a model reach it as graph inputs too, bound to their tensors like the others
    moved += [t for t in large_initializers(model) if t.data_type not in _conv.NUMPY_LESS_TYPES]
    # initializers left in their external data file (streaming) too, whatever the model's size now
    seen = {t.name for t in moved}
    moved += [t for t in model.graph.initializer if is_unloaded(t) and t.name not in seen]
    if not moved:
        return model, []
    view = onnx.ModelProto()
    view.CopyFrom(model)
    names = {t.name for t in moved}
    keep = [t for t in view.graph.initializer if t.name not in names]
    declared = {v.name for v in view.graph.input}
    del view.graph.initializer[:]
    view.graph.initializer.extend(keep)
    appended = []
    for t in moved:
        if t.name not in declared:  # an initializer also listed as an input (IR < 4; not after normalize())
            view.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
            appended.append(t.name)
    return view, appended


def _input_independent(reason: str) -> bool:
    """True for reasons that do not depend on the node's inputs (the node is unsupported wherever it is)."""
    return reason == "no converter" or reason.startswith("no opset import")


def _collect_unsupported(model: onnx.ModelProto, opsets: dict[str, int], prefix: str, bad: OrderedDict,
                         tainted: set[str], unchecked: list[str]) -> None:
    """Dry-run every node's converter; record ``(prefix + node name, reason)`` per failing op kind in ``bad``.

    Nodes are dry-run on :func:`conversion_view` ``(model)``, the graph onnx2torch will convert.
    Control-flow nodes (If / Loop / Scan) are not dry-run as a whole: their attributes are checked and
    each subgraph is checked node by node, recursively (as the model the lifter will convert), so an
    unsupported op inside a branch or loop body is reported as itself, named
    ``<node>/<attribute>/<inner node>``.

    ``tainted`` (updated in place): tensors computed, directly or not, from the output of a node found
    unsupported. Such tensors have no shape or type (shape inference stops at an unknown op), so a
    converter reading them may fail for that reason alone: a failing node that reads a tainted tensor
    goes to ``unchecked`` (its name) instead of ``bad``, unless its reason does not depend on its
    inputs (no converter, no opset import).
    """
    from . import control_flow as _cf

    view, _ = conversion_view(model)
    graph = OnnxGraph(view.graph)
    for onode in graph.nodes.values():
        domain = "" if onode.domain == "ai.onnx" else onode.domain
        opset = opsets.get(domain)
        conv = _conv.converter_for(onode.operation_type, opset, domain) if opset is not None else None
        upstream = any(v in tainted for v in onode.input_values if v)
        reason = None
        if conv is None:
            reason = "no converter" if opset is not None else f"no opset import for domain {domain!r}"
        elif _cf.is_control_flow(onode):
            try:
                subs = _cf.subgraph_models(onode, graph, view)
            except Exception as exc:  # invalid attributes or unresolvable outer-scope references
                reason = f"{type(exc).__name__}: {exc}"
            else:
                found = sum(len(v) for v in bad.values()) + len(unchecked)
                for attr, sg in subs.items():
                    upstream = upstream or any(v.name in tainted for v in sg.model.graph.input)
                    _collect_unsupported(sg.model, opsets, f"{prefix}{onode.name}/{attr}/", bad, tainted, unchecked)
                if upstream or sum(len(v) for v in bad.values()) + len(unchecked) > found:
                    tainted.update(v for v in onode.output_values if v)
                continue
        else:
            reason = _conv.dry_run(onode, graph, opset, domain)
        if reason is None:
            if upstream:
                tainted.update(v for v in onode.output_values if v)
            continue
        tainted.update(v for v in onode.output_values if v)
        if upstream and not _input_independent(reason):
            unchecked.append(prefix + onode.name)
            continue
        bad.setdefault((domain, onode.operation_type, opset or 0), []).append((prefix + onode.name, reason))


def check_supported(model: onnx.ModelProto) -> None:
    """Raise ONE :class:`UnsupportedOpsError` listing every node that cannot be lifted; else return.

    Every node is dry-run through the converter the lifter would use (so attribute-level limits, e.g.
    Resize antialias or a Conv weight that is not an initializer, are found too); the nodes inside the
    subgraphs of If / Loop / Scan nodes are checked the same way, recursively, and named
    ``<control-flow node>/<attribute>/<node>``. Run it on a normalized model (Constant nodes and
    constant-condition Ifs are handled by normalization).

    Only genuinely unsupported nodes are listed: a node downstream of an unsupported one whose
    converter fails may fail only because its input has no shape or type (shape inference cannot see
    through an unknown op), so it is not listed but counted in one line, "N downstream node(s) not
    checked"; a downstream node with no converter at all is listed.

    Raises:
        UnsupportedOpsError: ``.ops`` = ``[(domain, op_type, opset, [node names])]``; ``.reasons`` and
            ``.hints`` per op kind (the first node's reason, a suggested workaround), both also in the
            message; ``.unchecked``: names of the downstream nodes not checked (also counted in the
            message).
    """
    opsets = _opsets(model)
    bad: "OrderedDict[tuple[str, str, int], list[tuple[str, str]]]" = OrderedDict()
    unchecked: list[str] = []
    _collect_unsupported(model, opsets, "", bad, set(), unchecked)
    if bad:
        reasons = {key: nodes[0][1] for key, nodes in bad.items()}
        hints = {key: _conv.workaround(key[0], key[1], reason) for key, reason in reasons.items()}
        err = UnsupportedOpsError([(d, op, v, [n for n, _ in nodes]) for (d, op, v), nodes in bad.items()],
                                  reasons, hints)
        err.unchecked = list(unchecked)
        if unchecked:
            shown = ", ".join(repr(n) for n in unchecked[:8]) + (", ..." if len(unchecked) > 8 else "")
            err.args = (f"{err.args[0]}\n  {len(unchecked)} downstream node(s) not checked (they read outputs of the "
                        f"unsupported nodes above; lift again once those are supported): {shown}",)
        raise err


def lift(model_or_path: ModelLike, *, fold_batchnorm: bool = False, optimize: bool = False) -> fx.GraphModule:
    """Lift an ONNX model to a ``torch.fx.GraphModule`` in eval mode.

    Steps: :func:`~qtorch_onnx.lift.normalize` (the input model is not mutated), :func:`check_supported`,
    ``onnx2torch.convert`` with the converters of :mod:`qtorch_onnx.lift.converters` (plus
    :mod:`~qtorch_onnx.lift.recurrent` and :mod:`~qtorch_onnx.lift.control_flow`) on a copy in which
    (a) nodes whose key has an override (:data:`~qtorch_onnx.lift.converters.OVERRIDES`) are routed to
    it, so onnx2torch's own converter never sees them (:func:`_route_domains`), and (b) initializers of
    types numpy cannot hold (bfloat16, float8, int4/uint4, ...) are graph inputs (:func:`conversion_view`);
    then fix-ups: those inputs bound to buffers of the right torch dtype, routed modules renamed back to
    their node names, one fx node per ONNX tensor (onnx2torch makes one get_attr node and buffer per
    *use* of an initializer and one getitem per use of a multi-output node; duplicates are merged), and
    the fx output rebuilt to return exactly the ONNX graph outputs.

    Control flow: the subgraphs of If / Loop / Scan nodes are lifted the same way, recursively, into
    GraphModules held by the control-flow module (``<node>.then_branch`` / ``.else_branch`` / ``.body``);
    their tensors are in the TensorMap too (see :class:`TensorRef` ``scope``) and their
    :class:`TensorMap` s are in ``gm.tensor_map.subgraphs``.

    Args:
        model_or_path: ``onnx.ModelProto`` or path of a ``.onnx`` file.
        fold_batchnorm: fold Conv -> BatchNormalization pairs during normalization.
        optimize: fuse constant affine steps into their layers (Conv/ConvTranspose + Mul/Add, MatMul + Add ->
            Gemm, HardSwish chains; :mod:`~qtorch_onnx.lift.fusion`) after normalization: Quark's
            ``optimize_model``. Tensor names that disappear are in ``gm.tensor_map.aliases``.

    Returns:
        GraphModule whose ``forward`` takes the ONNX graph inputs positionally (ONNX order) and returns
        one tensor, or a tuple in ONNX output order. Attached: ``gm.onnx_model`` (normalized
        ModelProto), ``gm.tensor_map`` (:class:`TensorMap`, with ``.graph`` the :class:`ModelInfo`),
        ``gm.input_names``, ``gm.output_names`` (tuples of ONNX names), ``gm.lift_seconds``,
        ``gm.fusion_report`` (:class:`~qtorch_onnx.lift.fusion.FusionReport`, ``None`` without ``optimize``).

    Raises:
        ModelError: unreadable file (names it), invalid model.
        UnsupportedOpsError: nodes no converter handles (all of them, subgraphs included, in one error).
    """
    t0 = time.perf_counter()
    original = load_model(model_or_path)
    normalized, aliases, fusion = normalize_and_fuse(original, fold_batchnorm=fold_batchnorm, optimize=optimize)
    check_supported(normalized)
    gm, refs, modules = _lift_graph(normalized, subgraph=False)
    info = ModelInfo.from_model(normalized, modules)
    own = set(refs)
    subgraphs: dict[str, TensorMap] = {}
    # tensors of the subgraphs (any depth): parameters / constants always (an initializer copied into
    # several subgraphs has one parameter per copy), fx nodes (scoped to their GraphModule) only in the
    # subgraph that defines the tensor (outer values seen inside a subgraph are the outer tensors)
    for path, sub in gm.named_modules():
        if sub is gm or not isinstance(sub, fx.GraphModule) or not isinstance(getattr(sub, "tensor_map", None), TensorMap):
            continue
        subgraphs[path] = sub.tensor_map
        outer_names = set(getattr(sub, "outer_names", ()))
        for name, rs in sub.tensor_map.items():
            for r in rs:
                if r.scope is not None:
                    continue  # nested deeper: that GraphModule is visited itself
                if r.kind == "node":
                    if name in own or name in outer_names:
                        continue
                    ref = TensorRef("node", node_name=r.node_name, scope=path)
                else:
                    ref = TensorRef(r.kind, module=f"{path}.{r.module}", attr=r.attr, perm=r.perm)
                lst = refs.setdefault(name, [])
                if ref not in lst:
                    lst.append(ref)
    attached = {
        "onnx_model": normalized,
        "tensor_map": TensorMap({k: tuple(v) for k, v in refs.items()}, info, aliases, subgraphs),
        "input_names": tuple(v.name for v in normalized.graph.input),
        "output_names": tuple(o.name for o in normalized.graph.output),
        "lift_seconds": time.perf_counter() - t0,
        "fusion_report": fusion,
    }
    for key, value in attached.items():
        setattr(gm, key, value)
    # GraphModule.__deepcopy__ re-creates the module; it re-attaches what this meta entry lists
    gm.meta.setdefault(_PRESERVED, {}).update(attached)
    return gm


def lift_subgraph(model: onnx.ModelProto, outer_names=()) -> fx.GraphModule:
    """Lift the model :mod:`~qtorch_onnx.lift.control_flow` builds from an If / Loop / Scan subgraph.

    ``model`` is already normalized the way the subgraph's enclosing model was (unique node names,
    shape-inferred); no normalization or support check is run again. The GraphModule takes the
    subgraph's formal inputs, then its outer-scope inputs, and returns its outputs (a tensor when there
    is one output, else a tuple). Attached like :func:`lift`: ``onnx_model``, ``tensor_map`` (this
    subgraph's tensors only; :func:`lift` merges all of them into the top-level map), ``input_names``,
    ``output_names``, and ``outer_names`` (the enclosing values and initializers it reads: ``outer_names``).

    Raises:
        ModelError: a subgraph output that no node, input or initializer defines.
    """
    gm, refs, modules = _lift_graph(model, subgraph=True)
    attached = {
        "onnx_model": model,
        "tensor_map": TensorMap({k: tuple(v) for k, v in refs.items()}, ModelInfo.from_model(model, modules)),
        "input_names": tuple(v.name for v in model.graph.input),
        "output_names": tuple(o.name for o in model.graph.output),
        "outer_names": tuple(outer_names),
    }
    for key, value in attached.items():
        setattr(gm, key, value)
    gm.meta.setdefault(_PRESERVED, {}).update(attached)
    return gm


#: domain the lifter gives (on the copy it converts) to nodes whose converter is an override, so that
#: onnx2torch calls the override itself (registered for that domain) instead of its own converter
OVERRIDE_DOMAIN = "qtorch_override"


def _trampoline(op_type: str, opset: int, domain: str):
    """A converter that looks up, when called, the converter the lifter uses for ``domain::op_type`` at
    ``opset`` (so later registrations and overrides take effect)."""

    def converter(node, graph):
        conv = _conv.converter_for(op_type, opset, domain)
        if conv is None:
            raise NotImplementedError(f"no converter for {domain or 'ai.onnx'}::{op_type} at opset {opset}")
        return conv(node, graph)

    converter.__name__ = f"lifter_route_{domain or 'onnx'}_{op_type}_{opset}"
    return converter


def _route_domains(model: onnx.ModelProto) -> dict[str, str]:
    """Re-spell node domains on the copy onnx2torch converts (in place); returns ``{module name
    onnx2torch will use: module name to give it afterwards}``.

    * Nodes whose converter is an override (:data:`~qtorch_onnx.lift.converters.OVERRIDES`: a key
      onnx2torch already has) get domain :data:`OVERRIDE_DOMAIN`, for which the override is registered
      through onnx2torch's public ``add_converter``: onnx2torch then converts them with the override
      directly (its own converter is never called, so it may reject the node, as Clip-13's rejects a
      runtime ``min``, and the override may map the inputs differently). Their modules are renamed back
      to the plain node name afterwards. The converter is thus chosen per node before conversion, with
      the public registry only: a normalization step re-spelling the domains instead would leak into the
      normalized model (``gm.onnx_model``) that the TensorMap, placement and export read.
    * Domains containing '.' (``com.microsoft``) are spelled with '_': onnx2torch names a module
      ``<domain>/<node name>`` and torch module names cannot contain '.'.

    Each alias domain gets the original domain's opset version.
    """
    from onnx2torch.node_converters.registry import add_converter, get_converter

    versions = _opsets(model)
    before = list(OnnxGraph(model.graph).nodes)
    aliases: dict[str, str] = {}
    routed: list[int] = []
    for i, node in enumerate(model.graph.node):
        domain = "" if node.domain == "ai.onnx" else node.domain
        version = versions.get(domain)
        if version is None:
            continue
        if domain == "":
            key = ("", node.op_type, _conv.since_version(node.op_type, version, ""))
            if key not in _conv.OVERRIDES:
                continue
            alias = OVERRIDE_DOMAIN
            routed.append(i)
        elif "." in domain:
            alias = domain.replace(".", "_")
        else:
            continue
        try:
            get_converter(operation_type=node.op_type, version=version, domain=alias)
        except NotImplementedError:
            add_converter(operation_type=node.op_type, version=version, domain=alias)(
                _trampoline(node.op_type, version, domain))
        aliases[alias] = domain
        node.domain = alias
    for alias, domain in aliases.items():
        if alias not in versions:
            model.opset_import.append(onnx.helper.make_opsetid(alias, versions[domain]))
    after = list(OnnxGraph(model.graph).nodes)
    return {after[i]: before[i] for i in routed}


class _InitializerValues:
    """``name -> torch tensor`` of a graph's initializers in the lifter's dtype convention
    (:func:`~qtorch_onnx.lift.ops_common.tensor_from_proto`), decoded up front, except the initializers still in
    their external data file (streaming): each is read from it (:func:`~qtorch_onnx.lift.normalize.read_initializer`)
    when first needed."""

    def __init__(self, initializers) -> None:
        self._protos = {t.name: t for t in initializers}
        self._values: dict = {name: tensor_from_proto(t) for name, t in self._protos.items() if not is_unloaded(t)}

    def __contains__(self, name) -> bool:
        return name in self._protos

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._values.get(name)
        if value is None:
            value = self._values[name] = self._read(self._protos[name])
        return value

    @staticmethod
    def _read(t: onnx.TensorProto) -> torch.Tensor:
        if t.data_type in _PLAIN_TYPES:
            return torch.from_numpy(read_initializer(t))  # straight from the file into the tensor's memory
        loaded = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
        loaded.raw_data = read_external_bytes(t).tobytes()
        return tensor_from_proto(loaded)

    def take(self, name: str) -> torch.Tensor:
        """A tensor of its own for a buffer: a copy of the decoded value, or, for an initializer still in its
        file, the value read from it (not kept: the weight is held once, by the buffer)."""
        t = self._protos[name]
        if is_unloaded(t):
            value = self._values.pop(name, None)
            return value if value is not None else self._read(t)
        return self[name].clone()


def _lift_graph(normalized: onnx.ModelProto, *, subgraph: bool):
    """onnx2torch conversion plus the lifter's fix-ups; returns ``(gm, refs, modules)``.

    ``refs``: ONNX tensor name -> list of :class:`TensorRef` (this graph's level only); ``modules``: ONNX
    node name -> ``(module path, fx node name)``.
    """
    g = normalized.graph
    produced = {o for n in g.node for o in n.output if o}
    # onnx2torch can only output node outputs; the real outputs are rebuilt below
    to_convert, moved = conversion_view(normalized)
    if to_convert is normalized:
        to_convert = onnx.ModelProto()
        to_convert.CopyFrom(normalized)
    renames = _route_domains(to_convert)
    keep = [o for o in to_convert.graph.output if o.name in produced]
    if not keep and not subgraph:
        raise ModelError(f"model {g.name!r}: no graph output is computed by a node (outputs {[o.name for o in g.output]})")
    del to_convert.graph.output[:]
    to_convert.graph.output.extend(keep)
    with _control_flow.converting(normalized):
        gm = _o2t_convert(to_convert, attach_onnx_mapping=True)

    ograph = OnnxGraph(to_convert.graph)  # the graph onnx2torch converted (module names derive from it)
    onnx_nodes = {renames.get(uname, uname): onode for uname, onode in ograph.nodes.items()}
    # every initializer of the normalized graph, in the lifter's dtype convention (the moved ones included);
    # decoded when first needed, and an unloaded one (streaming) read from its file then, once
    init_values = _InitializerValues(g.initializer)

    # ---- modules of overridden nodes: back to the plain node name
    graph = gm.graph
    for routed_name, plain in renames.items():
        if plain in dict(gm.named_children()):
            raise ModelError(f"internal: module name {plain!r} is taken")
        gm.add_module(plain, gm.get_submodule(routed_name))
        delattr(gm, routed_name)
        for n in graph.nodes:
            if n.op == "call_module" and n.target == routed_name:
                n.target = plain

    refs: dict[str, list[TensorRef]] = {}

    def add(name: str, ref: TensorRef) -> None:
        lst = refs.setdefault(name, [])
        if ref not in lst:
            lst.append(ref)

    # ---- placeholders <-> graph inputs; the moved initializers' placeholders -> get_attr of typed buffers
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    input_names = [v.name for v in g.input]
    if len(placeholders) != len(input_names) + len(moved):
        raise ModelError(f"internal: {len(placeholders)} placeholders for {len(input_names)} graph inputs and "
                         f"{len(moved)} initializers fed as inputs")
    fx_of: dict[str, fx.Node] = {}
    for name, ph in zip(input_names, placeholders):
        fx_of[name] = ph
    first_op = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for i, (name, ph) in enumerate(zip(moved, placeholders[len(input_names):])):
        if ph.users:
            attr = f"onnx_typed_initializer_{i}"
            if not hasattr(gm, "initializers"):  # GraphModule keeps onnx2torch's container only when used
                gm.add_module("initializers", torch.nn.Module())
            gm.initializers.register_buffer(attr, init_values.take(name))
            with graph.inserting_before(first_op):
                node = graph.get_attr(f"initializers.{attr}")
            ph.replace_all_uses_with(node)
            fx_of[name] = node
        graph.erase_node(ph)

    # ---- call_module nodes, get_attr replay, getitem dedupe
    buffer_of: dict[int, str] = {}
    counter = 0
    module_nodes: dict[str, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "call_module" and n.target in onnx_nodes:
            module_nodes[n.target] = n
            for value in gm.get_submodule(n.target).onnx_mapping.inputs:
                if ograph.value_type(value) == ValueType.GRAPH_INITIALIZER:
                    buffer_of[counter] = value
                    counter += 1
    first_attr: dict[str, fx.Node] = {}
    first_item: dict[tuple[str, int], fx.Node] = {}
    for n in list(graph.nodes):
        if n.op == "get_attr" and str(n.target).startswith("initializers.onnx_initializer_"):
            k = int(str(n.target).rsplit("_", 1)[1])
            name = buffer_of[k]
            buf = gm.get_buffer(str(n.target))
            if not _same_values(buf, init_values[name].to(buf.dtype)) or buf.dtype != init_values[name].dtype:
                raise ModelError(f"internal: buffer {n.target} does not hold initializer {name!r}")
            if name in first_attr:
                n.replace_all_uses_with(first_attr[name])
                graph.erase_node(n)
                delattr(gm.initializers, str(n.target).split(".", 1)[1])
            else:
                first_attr[name] = n
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0].op == "call_module":
            key = (n.args[0].target, n.args[1])
            if key in first_item:
                n.replace_all_uses_with(first_item[key])
                graph.erase_node(n)
            else:
                first_item[key] = n
    fx_of.update(first_attr)

    # ---- node outputs
    modules: dict[str, tuple[str, str]] = {}
    for uname, onode in onnx_nodes.items():
        mnode = module_nodes.get(uname)
        if mnode is None:
            raise ModelError(f"internal: no fx node for ONNX node {onode.name!r}")
        modules[onode.name] = (uname, mnode.name)
        outs = onode.output_values
        if len(outs) == 1:
            fx_of[outs[0]] = mnode
            continue
        for i, out in enumerate(outs):
            if not out:
                continue
            item = first_item.get((uname, i))
            if item is None:  # an output nobody reads in torch: give it a node anyway
                with graph.inserting_after(mnode):
                    item = graph.call_function(operator.getitem, (mnode, i))
                first_item[(uname, i)] = item
            fx_of[out] = item

    # ---- output node: exactly the ONNX outputs, ONNX order
    output_names = [o.name for o in g.output]
    old_out = next(n for n in graph.nodes if n.op == "output")
    for o in output_names:  # an initializer returned as is (a subgraph may do that): one get_attr for it
        if o not in fx_of and o in init_values:
            attr = f"onnx_initializer_output_{len(fx_of)}"
            gm.register_buffer(attr, init_values[o].clone())
            with graph.inserting_before(old_out):
                fx_of[o] = graph.get_attr(attr)
    missing = [o for o in output_names if o not in fx_of]
    if missing:
        raise ModelError(f"model {g.name!r}: graph outputs {missing} have no torch value")
    vals = [fx_of[o] for o in output_names]
    with graph.inserting_before(old_out):
        graph.output(vals[0] if len(vals) == 1 else tuple(vals))
    graph.erase_node(old_out)

    for name, node in fx_of.items():
        add(name, TensorRef("node", node_name=node.name))

    # ---- initializers baked into modules: parameters/buffers or constants
    for uname, onode in onnx_nodes.items():
        mod = gm.get_submodule(uname)
        passed = set(mod.onnx_mapping.inputs)
        baked = [v for v in onode.input_values if v and v in init_values and v not in passed]
        if not baked:
            continue
        # a module may say where it keeps each initializer (ONNX name -> parameter/buffer attribute name,
        # or a tuple of them, same layout); the others are found by exact value match
        declared = {k: ((v,) if isinstance(v, str) else tuple(v))
                    for k, v in (getattr(mod, "onnx_initializer_attrs", None) or {}).items()}
        tensors = list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False))
        used: set[str] = {a for attrs in declared.values() for a in attrs}
        for value in baked:
            if value in declared:
                for a in declared[value]:
                    add(value, TensorRef("param", module=uname, attr=a))
                continue
            found = None
            for pname, p in tensors:
                if pname in used:
                    continue
                ok, perm = match_parameter(init_values[value], p.detach())
                if ok:
                    found = (pname, perm)
                    break
            if found is None:
                add(value, TensorRef("const", module=uname))
                continue
            used.add(found[0])
            sub, _, attr = found[0].rpartition(".")
            add(value, TensorRef("param", module=f"{uname}.{sub}" if sub else uname, attr=attr, perm=found[1]))

    del to_convert
    graph.lint()
    gm.recompile()
    gm.eval()
    return gm, refs, modules
