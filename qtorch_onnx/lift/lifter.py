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
from .normalize import normalize_with_aliases
from .tensor_map import ModelInfo, TensorMap, TensorRef, _same_values, match_parameter

ModelLike = Union[str, Path, onnx.ModelProto]
_PRESERVED = "_user_preserved_attributes"  # torch.fx.graph_module's key for attributes kept by deepcopy


def load_model(model_or_path: ModelLike) -> onnx.ModelProto:
    """Return the ModelProto itself, or load it from a path (external data resolved beside the file).

    Raises:
        ModelError: the path does not exist or the file is not an ONNX model (names the file).
    """
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if not isinstance(model_or_path, (str, Path)):
        raise ModelError(f"expected an onnx.ModelProto or a path to a .onnx file, got {type(model_or_path).__name__}")
    path = Path(model_or_path)
    if not path.is_file():
        raise ModelError(f"ONNX model file {str(path)!r} does not exist")
    try:
        model = onnx.load(str(path))
    except Exception as exc:
        raise ModelError(f"file {str(path)!r} is not an ONNX model: {exc}") from exc
    if model.ir_version == 0 or not model.opset_import or not model.graph.node:
        raise ModelError(f"file {str(path)!r} is not an ONNX model (no IR version, opset import or nodes)")
    return model


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def check_supported(model: onnx.ModelProto) -> None:
    """Raise ONE :class:`UnsupportedOpsError` listing every node that cannot be lifted; else return.

    Every node is dry-run through the converter the lifter would use (so attribute-level limits, e.g.
    Resize antialias or a Conv weight that is not an initializer, are found too). Run it on a
    normalized model (Constant nodes and constant-condition Ifs are handled by normalization).

    Raises:
        UnsupportedOpsError: ``.ops`` = ``[(domain, op_type, opset, [node names])]``; the message also
            gives the first reason per op kind.
    """
    graph = OnnxGraph(model.graph)
    opsets = _opsets(model)
    bad: "OrderedDict[tuple[str, str, int], list[tuple[str, str]]]" = OrderedDict()
    for onode in graph.nodes.values():
        domain = "" if onode.domain == "ai.onnx" else onode.domain
        opset = opsets.get(domain)
        conv = _conv.converter_for(onode.operation_type, opset, domain) if opset is not None else None
        reason = None
        if conv is None:
            reason = "no converter" if opset is not None else f"no opset import for domain {domain!r}"
        else:
            try:
                conv(onode, graph)
            except Exception as exc:  # any converter failure means this node cannot be lifted
                reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            bad.setdefault((domain, onode.operation_type, opset or 0), []).append((onode.name, reason))
    if bad:
        err = UnsupportedOpsError([(d, op, v, [n for n, _ in nodes]) for (d, op, v), nodes in bad.items()])
        reasons = "\n".join(f"  {d or 'ai.onnx'}::{op}: {nodes[0][1]}" for (d, op, v), nodes in bad.items())
        err.args = (f"{err.args[0]}\nreasons (first node of each):\n{reasons}",)
        raise err


def lift(model_or_path: ModelLike, *, fold_batchnorm: bool = False) -> fx.GraphModule:
    """Lift an ONNX model to a ``torch.fx.GraphModule`` in eval mode.

    Steps: :func:`~qtorch_onnx.lift.normalize` (the input model is not mutated), :func:`check_supported`,
    ``onnx2torch.convert`` with the converters of :mod:`qtorch_onnx.lift.converters`, then fix-ups:
    overridden modules swapped in, one fx node per ONNX tensor (onnx2torch makes one get_attr node and
    buffer per *use* of an initializer and one getitem per use of a multi-output node; duplicates are
    merged), and the fx output rebuilt to return exactly the ONNX graph outputs.

    Args:
        model_or_path: ``onnx.ModelProto`` or path of a ``.onnx`` file.
        fold_batchnorm: fold Conv -> BatchNormalization pairs during normalization.

    Returns:
        GraphModule whose ``forward`` takes the ONNX graph inputs positionally (ONNX order) and returns
        one tensor, or a tuple in ONNX output order. Attached: ``gm.onnx_model`` (normalized
        ModelProto), ``gm.tensor_map`` (:class:`TensorMap`, with ``.graph`` the :class:`ModelInfo`),
        ``gm.input_names``, ``gm.output_names`` (tuples of ONNX names), ``gm.lift_seconds``.

    Raises:
        ModelError: unreadable file (names it), invalid model.
        UnsupportedOpsError: nodes no converter handles (all of them, in one error).
    """
    t0 = time.perf_counter()
    original = load_model(model_or_path)
    normalized, aliases = normalize_with_aliases(original, fold_batchnorm=fold_batchnorm)
    check_supported(normalized)

    g = normalized.graph
    produced = {o for n in g.node for o in n.output if o}
    # onnx2torch can only output node outputs; the real outputs are rebuilt below
    to_convert = onnx.ModelProto()
    to_convert.CopyFrom(normalized)
    keep = [o for o in to_convert.graph.output if o.name in produced]
    if not keep:
        raise ModelError(f"model {g.name!r}: no graph output is computed by a node (outputs {[o.name for o in g.output]})")
    del to_convert.graph.output[:]
    to_convert.graph.output.extend(keep)
    gm = _o2t_convert(to_convert, attach_onnx_mapping=True)
    del to_convert

    ograph = OnnxGraph(g)
    opsets = _opsets(normalized)
    onnx_nodes = {uname: onode for uname, onode in ograph.nodes.items()}
    init_values = {name: t.to_torch() for name, t in ograph.initializers.items()}

    # ---- overrides (same input mapping, so the fx call_module node stays as it is)
    for uname, onode in onnx_nodes.items():
        domain = "" if onode.domain == "ai.onnx" else onode.domain
        key = (domain, onode.operation_type, _conv.since_version(onode.operation_type, opsets[domain], domain))
        if key in _conv.OVERRIDES:
            res = _conv.OVERRIDES[key](onode, ograph)
            old = gm.get_submodule(uname)
            if tuple(res.onnx_mapping.inputs) != tuple(old.onnx_mapping.inputs):
                raise ModelError(f"internal: override of {key} changes the input mapping of node {onode.name!r}")
            res.torch_module.onnx_mapping = res.onnx_mapping
            setattr(gm, uname, res.torch_module)

    graph = gm.graph
    refs: dict[str, list[TensorRef]] = {}

    def add(name: str, ref: TensorRef) -> None:
        lst = refs.setdefault(name, [])
        if ref not in lst:
            lst.append(ref)

    # ---- placeholders <-> graph inputs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    input_names = [v.name for v in g.input]
    if len(placeholders) != len(input_names):
        raise ModelError(f"internal: {len(placeholders)} placeholders for {len(input_names)} graph inputs")
    fx_of: dict[str, fx.Node] = {}
    for name, ph in zip(input_names, placeholders):
        fx_of[name] = ph

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
    missing = [o for o in output_names if o not in fx_of]
    if missing:
        raise ModelError(f"model {g.name!r}: graph outputs {missing} have no torch value")
    vals = [fx_of[o] for o in output_names]
    with graph.inserting_before(old_out):
        graph.output(vals[0] if len(vals) == 1 else tuple(vals))
    graph.erase_node(old_out)

    for name, node in fx_of.items():
        add(name, TensorRef("node", node_name=node.name))

    # ---- initializers baked into modules: parameters/buffers (exact value match) or constants
    for uname, onode in onnx_nodes.items():
        mod = gm.get_submodule(uname)
        passed = set(mod.onnx_mapping.inputs)
        baked = [v for v in onode.input_values if v and v in init_values and v not in passed]
        if not baked:
            continue
        tensors = list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False))
        used: set[str] = set()
        for value in baked:
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

    graph.lint()
    gm.recompile()
    gm.eval()
    info = ModelInfo.from_model(normalized, modules)
    attached = {
        "onnx_model": normalized,
        "tensor_map": TensorMap({k: tuple(v) for k, v in refs.items()}, info, aliases),
        "input_names": tuple(input_names),
        "output_names": tuple(output_names),
        "lift_seconds": time.perf_counter() - t0,
    }
    for key, value in attached.items():
        setattr(gm, key, value)
    # GraphModule.__deepcopy__ re-creates the module; it re-attaches what this meta entry lists
    gm.meta.setdefault(_PRESERVED, {}).update(attached)
    return gm
