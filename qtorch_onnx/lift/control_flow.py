"""Converters for ONNX control flow: ``If`` (runtime condition), ``Loop`` and ``Scan`` (8 and 9+).

Each subgraph attribute (``then_branch`` / ``else_branch`` / ``body``) is turned into a stand-alone ONNX
model and lifted like a model (:func:`qtorch_onnx.lift.lifter.lift_subgraph`: onnx2torch plus the
lifter's fix-ups, recursively for nested control flow) into a ``torch.fx.GraphModule`` held by the
control-flow module, so its parameters are parameters of the lifted model (trainable, quantizable,
moved by ``.to(device)``):

* **Outer-scope references** (names a subgraph reads but does not define, at any nesting depth) are
  resolved in the enclosing graph: an enclosing *initializer* is copied into the subgraph model as an
  initializer (so e.g. LSTM weights declared outside an If branch still become parameters of the LSTM
  inside it); any other enclosing value becomes an extra input of the subgraph model after its formal
  inputs, and an extra argument of the control-flow node's fx call (in first-use order).
* The subgraph model keeps the parent's opset imports, IR version and functions; its nodes are named
  uniquely (``<op_type>_<index>`` where unnamed), trailing empty optional inputs are dropped, and ONNX
  shape inference types it (the enclosing value types are copied onto the extra inputs).

Semantics (ONNX operator spec; where it is silent, ONNX Runtime's CPU kernels ``if.cc``, ``loop.cc``,
``scan_8.cc``, ``scan_9.cc``):

* ``If``: the condition is a one-element bool tensor read at run time; only the taken branch runs.
* ``Loop``: ``M`` (optional max trip count) and ``cond`` (optional); ``iteration_num`` (int64) and the
  condition are fed with the rank the body declares for them (0 or 1); loop-carried values are passed
  on; the body's condition output decides whether another iteration runs (also when the ``cond``
  input is omitted: ONNX Runtime and ``onnx.reference`` read it); scan outputs are stacked along a new
  axis 0. With zero iterations, scan outputs are empty with the body output's declared shape
  (unknown dims as 0), rank 1 when that shape is unknown.
* ``Scan`` (9+): ``num_scan_inputs``, ``scan_input_axes`` / ``scan_output_axes`` (negative allowed),
  ``scan_input_directions`` / ``scan_output_directions`` (1 = reverse); all scan inputs must have the
  same length along their scan axis. ``Scan-8``: batch axis 0 and scan axis 1 for every scan input,
  optional ``sequence_lens`` (per batch entry; outputs past a sequence's length are zero),
  ``directions``.

Also registers, unless another converter is already there, ``Size`` (missing from the registry) and
``Pad``-11/13 with ``converters``' general Pad module (onnx2torch's rejects reflect padding of a rank-2
tensor): the silero-vad model needs both inside its If branches.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import onnx
import torch
from onnx import helper
from torch import fx, nn

from onnx2torch.node_converters.registry import add_converter, get_converter
from onnx2torch.onnx_graph import OnnxGraph, ValueType
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OnnxToTorchModule, OperationConverterResult

from ..errors import DataError, ModelError
from . import converters as _conv
from .converters import ConversionNotSupported, register_converter

__all__ = ["OnnxIf", "OnnxLoop", "OnnxScan", "OnnxScan8", "Subgraph", "free_variables", "subgraph_models",
           "is_control_flow", "converting", "CONTROL_FLOW_OPS"]

#: op type -> its graph attributes, in the order the module holds them.
CONTROL_FLOW_OPS = {"If": ("then_branch", "else_branch"), "Loop": ("body",), "Scan": ("body",)}
_MODULE_ATTR = {"then_branch": "then_branch", "else_branch": "else_branch", "body": "body"}

# the model whose graph onnx2torch is converting right now (set by the lifter): converters only get a
# node and a graph, but a subgraph needs the model's opset imports, IR version and functions
_MODEL_STACK: list[onnx.ModelProto] = []


@contextlib.contextmanager
def converting(model: onnx.ModelProto) -> Iterator[None]:
    """Context in which onnx2torch converts ``model``'s graph (control-flow converters read it)."""
    _MODEL_STACK.append(model)
    try:
        yield
    finally:
        _MODEL_STACK.pop()


def is_control_flow(node: OnnxNode) -> bool:
    """True for an ai.onnx If / Loop / Scan node."""
    return node.domain in ("", "ai.onnx") and node.operation_type in CONTROL_FLOW_OPS


# ============================================================================ subgraph -> model
def _graph_attr(proto: onnx.NodeProto, name: str) -> onnx.GraphProto | None:
    for a in proto.attribute:
        if a.name == name:
            if a.type != onnx.AttributeProto.GRAPH:
                raise ModelError(f"{proto.op_type} node {proto.name!r}: attribute {name!r} must be a graph")
            return a.g
    return None


def free_variables(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph`` (and, recursively, its nested subgraphs) reads but does not define, first use first.

    Defined: the graph's inputs, initializers (dense and sparse) and node outputs, in node order (ONNX
    graphs are topologically sorted, so a name read before it is produced comes from outside).
    """
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    free: dict[str, None] = {}
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                free[name] = None
        for a in node.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for sub in subs:
                for name in free_variables(sub):
                    if name not in defined:
                        free[name] = None
        defined.update(o for o in node.output if o)
    for o in graph.output:
        if o.name not in defined:
            free[o.name] = None
    return list(free)


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Unique, non-empty node names (kept where already unique), avoiding onnx2torch's reserved keys."""
    reserved = {v.name for v in graph.input} | {t.name for t in graph.initializer}

    def bad(name: str) -> bool:
        mod = name.replace(".", "/")
        return not name or mod in reserved or re.fullmatch(r"onnx_initializer_\d+", mod) is not None

    taken = set(reserved)
    for i, node in enumerate(graph.node):
        base = node.name if not bad(node.name) else (f"{node.name}_node" if node.name else f"{node.op_type}_{i}")
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        node.name = name
        taken.add(name)


def _typed_value_info(name: str, outer: OnnxGraph) -> onnx.ValueInfoProto:
    vi = outer.value_info.get(name)
    out = onnx.ValueInfoProto()
    if vi is not None:
        out.CopyFrom(vi)
    out.name = name
    return out


class Subgraph(NamedTuple):
    """One control-flow subgraph as a stand-alone model (see :func:`subgraph_models`).

    Attributes:
        model: the ONNX model; its inputs are the subgraph's formal inputs then ``outer_inputs``.
        outer_inputs: enclosing values (not initializers) the subgraph reads, in first-use order.
        outer_initializers: enclosing initializers the subgraph reads, copied into ``model``.
    """

    model: onnx.ModelProto
    outer_inputs: list
    outer_initializers: list


def subgraph_models(node: OnnxNode, outer: OnnxGraph, parent: onnx.ModelProto) -> dict[str, Subgraph]:
    """The stand-alone model of each graph attribute of control-flow ``node``.

    Args:
        node: an If / Loop / Scan node of ``outer``.
        outer: the enclosing graph (its initializers, inputs, node outputs and value types resolve the
            subgraphs' outer-scope references).
        parent: the model ``outer`` belongs to (opset imports, IR version, functions).

    Returns:
        attribute name -> :class:`Subgraph`.

    Raises:
        ModelError: a missing graph attribute, a formal-input count that does not fit the node (names
            the node and attribute), or an outer-scope name the enclosing graph does not define.
    """
    op = node.operation_type
    name = node.name or node.unique_name
    result = {}
    for attr in CONTROL_FLOW_OPS[op]:
        g = _graph_attr(node.proto, attr)
        if g is None:
            raise ModelError(f"{op} node {name!r}: required graph attribute {attr!r} is missing")
        sub = onnx.GraphProto()
        sub.CopyFrom(g)
        init_names = {t.name for t in sub.initializer}
        # formal inputs that are also initializers (IR < 4 style) are initializers, not inputs
        formal = [v for v in sub.input if v.name not in init_names]
        del sub.input[:]
        sub.input.extend(formal)
        outer_inputs: list[str] = []
        copied: list[str] = []
        for v in free_variables(sub):
            kind = outer.value_type(v)
            if kind == ValueType.GRAPH_INITIALIZER:
                t = sub.initializer.add()
                t.CopyFrom(outer.initializers[v].proto)
                t.name = v
                copied.append(v)
            elif kind in (ValueType.GRAPH_INPUT, ValueType.NODE_OUTPUT):
                sub.input.append(_typed_value_info(v, outer))
                outer_inputs.append(v)
            else:
                raise ModelError(f"{op} node {name!r}: subgraph {attr!r} reads {v!r}, which no enclosing graph defines")
        for n in sub.node:
            if n.domain == "ai.onnx":
                n.domain = ""
            while len(n.input) and n.input[-1] == "":
                del n.input[-1]
            while len(n.output) > 1 and n.output[-1] == "":
                del n.output[-1]
        _name_nodes(sub)
        model = helper.make_model(sub, opset_imports=list(parent.opset_import))
        model.ir_version = parent.ir_version
        model.functions.extend(parent.functions)
        try:
            model = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
        except Exception:  # shape inference is a help for converters, not a requirement
            pass
        result[attr] = Subgraph(model, outer_inputs, copied)
    _check_signature(node, result, name)
    return result


def _attr_ints(node: OnnxNode, key: str, n: int, default: int) -> list[int]:
    v = node.attributes.get(key)
    if v is None:
        return [default] * n
    v = [int(x) for x in v]
    if len(v) != n:
        raise ModelError(f"{node.operation_type} node {node.name!r}: {key} has {len(v)} entries, expected {n}")
    return v


def _check_signature(node: OnnxNode, subs: dict[str, Subgraph], name: str) -> None:
    """Formal input/output counts of each subgraph against the node (ONNX spec of If / Loop / Scan)."""
    op = node.operation_type
    n_in = [i for i in node.input_values]
    n_out = len(node.output_values)
    models = {a: sg.model for a, sg in subs.items()}
    formal_of = {a: len(sg.model.graph.input) - len(sg.outer_inputs) for a, sg in subs.items()}
    for attr, m in models.items():
        for kind, values in (("input", m.graph.input), ("output", m.graph.output)):
            for v in values:
                which = v.type.WhichOneof("value")
                if which not in (None, "tensor_type"):
                    raise ConversionNotSupported(
                        f"{op} node {name!r}: subgraph {attr!r} {kind} {v.name!r} is a {which.replace('_type', '')}; "
                        f"only tensor values are supported in lifted control flow")
    if op == "If":
        for attr, m in models.items():
            if len(m.graph.output) != n_out:
                raise ModelError(f"If node {name!r}: {attr} has {len(m.graph.output)} outputs, the node {n_out}")
    elif op == "Loop":
        body = models["body"].graph
        formal = formal_of["body"]
        n_carried = max(0, len(n_in) - 2)
        if formal != 2 + n_carried:
            raise ModelError(f"Loop node {name!r}: body has {formal} formal inputs; expected 2 + {n_carried} "
                             f"loop-carried values (iteration_num, cond, v...)")
        if len(body.output) < 1 + n_carried or len(body.output) - 1 != n_out:
            raise ModelError(f"Loop node {name!r}: body has {len(body.output)} outputs; expected 1 (cond) + "
                             f"{n_carried} loop-carried + scan outputs = 1 + {n_out} node outputs")
    elif op == "Scan":
        body = models["body"].graph
        formal = formal_of["body"]
        m = node.attributes.get("num_scan_inputs")
        if m is None:
            raise ModelError(f"Scan node {name!r}: required attribute num_scan_inputs is missing")
        m = int(m)
        n_states = formal - m
        if n_states < 0 or m < 1:
            raise ModelError(f"Scan node {name!r}: num_scan_inputs={m} with a body of {formal} formal inputs")
        if len(body.output) != n_out or n_out < n_states:
            raise ModelError(f"Scan node {name!r}: body has {len(body.output)} outputs, the node {n_out} "
                             f"({n_states} states + scan outputs)")


# ============================================================================ modules
def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _torch_dtype(elem_type: int) -> torch.dtype:
    try:
        return torch.from_numpy(np.empty(0, dtype=helper.tensor_dtype_to_np_dtype(elem_type))).dtype
    except Exception:
        return torch.float32


def _empty_like_output(vi: onnx.ValueInfoProto, lead: int = 0) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape ``(0, *declared dims with unknown as 0)`` (``(0,)`` if the rank is unknown) and dtype."""
    tt = vi.type.tensor_type
    dims: tuple[int, ...] = ()
    if tt.HasField("shape"):
        dims = tuple(d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim)
    return (lead,) + dims, _torch_dtype(tt.elem_type)


class OnnxIf(nn.Module, OnnxToTorchModule):
    """ONNX If with a condition known only at run time.

    forward(cond, *outer): ``cond`` is a one-element bool tensor; ``outer`` the enclosing values the two
    branches read (the node's fx arguments after ``cond``). Runs ``then_branch`` or ``else_branch``
    (GraphModules) and returns its outputs (one tensor, or a tuple in ONNX order).

    Raises:
        DataError: ``cond`` does not have exactly one element.
    """

    def __init__(self, node_name: str, then_branch: fx.GraphModule, else_branch: fx.GraphModule,
                 then_args: Sequence[int], else_args: Sequence[int]):
        super().__init__()
        self.node_name = node_name
        self.then_branch = then_branch
        self.else_branch = else_branch
        self.then_args = tuple(then_args)
        self.else_args = tuple(else_args)

    def forward(self, cond: torch.Tensor, *outer):  # noqa: D102
        if cond.numel() != 1:
            raise DataError(f"If node {self.node_name!r}: the condition must have one element, got shape {tuple(cond.shape)}")
        if bool(cond.reshape(-1)[0]):
            return self.then_branch(*[outer[i] for i in self.then_args])
        return self.else_branch(*[outer[i] for i in self.else_args])


class OnnxLoop(nn.Module, OnnxToTorchModule):
    """ONNX Loop (see the module docstring for the semantics).

    forward(*args): ``[M] [cond] v_initial... outer...`` -- ``M`` (int64, one element) and ``cond`` (bool,
    one element) only when the node gives them; ``v_initial`` the N loop-carried values; ``outer`` the
    enclosing values the body reads. Returns the N final loop-carried values then the K scan outputs
    (each ``[iterations, *per-iteration shape]``); a tensor when the node has one output.

    Raises:
        DataError: ``M`` or ``cond`` without exactly one element; scan outputs whose shape changes
            between iterations.
    """

    def __init__(self, node_name: str, body: fx.GraphModule, has_max: bool, has_cond: bool, n_carried: int,
                 n_scan: int, iter_rank: int, cond_rank: int, empty_scan: Sequence[tuple[tuple[int, ...], torch.dtype]]):
        super().__init__()
        self.node_name = node_name
        self.body = body
        self.has_max, self.has_cond = bool(has_max), bool(has_cond)
        self.n_carried, self.n_scan = int(n_carried), int(n_scan)
        self.iter_rank, self.cond_rank = int(iter_rank), int(cond_rank)
        self.empty_scan = tuple(empty_scan)

    def _one(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if t.numel() != 1:
            raise DataError(f"Loop node {self.node_name!r}: {what} must have one element, got shape {tuple(t.shape)}")
        return t.reshape(-1)[0]

    def forward(self, *args):  # noqa: D102
        args = list(args)
        max_trip = int(self._one(args.pop(0), "M")) if self.has_max else None
        cond = bool(self._one(args.pop(0), "cond")) if self.has_cond else True
        carried = args[: self.n_carried]
        outer = args[self.n_carried:]
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        scans: list[list[torch.Tensor]] = [[] for _ in range(self.n_scan)]
        i = 0
        cond_t = torch.tensor(cond, dtype=torch.bool, device=device)
        while (max_trip is None or i < max_trip) and cond:
            it = torch.tensor(i, dtype=torch.int64, device=device).reshape((1,) * self.iter_rank)
            cin = cond_t.reshape((1,) * self.cond_rank)
            outs = _as_tuple(self.body(it, cin, *carried, *outer))
            cond_t = outs[0]
            cond = bool(self._one(cond_t, "the body's condition output"))
            carried = list(outs[1:1 + self.n_carried])
            for k in range(self.n_scan):
                scans[k].append(outs[1 + self.n_carried + k])
            i += 1
        results = list(carried)
        for k in range(self.n_scan):
            if scans[k]:
                shapes = {tuple(s.shape) for s in scans[k]}
                if len(shapes) > 1:
                    raise DataError(f"Loop node {self.node_name!r}: scan output {k} changes shape across iterations "
                                    f"({sorted(shapes)})")
                results.append(torch.stack(scans[k], 0))
            else:
                shape, dtype = self.empty_scan[k]
                results.append(torch.zeros(shape, dtype=dtype, device=device))
        return results[0] if len(results) == 1 else tuple(results)


def _scan_core(body, states: list, xs: list, outer: list, in_axes, in_dirs, out_axes, out_dirs, n_out_scan: int,
               empty_scan, node_name: str, op: str = "Scan"):
    """Run the Scan-9 recurrence; returns ``(final states, scan outputs)``."""
    lengths = {int(x.shape[a]) for x, a in zip(xs, in_axes)}
    if len(lengths) != 1:
        raise DataError(f"{op} node {node_name!r}: scan inputs have different lengths along their scan axes "
                        f"({[tuple(x.shape) for x in xs]}, axes {list(in_axes)})")
    (length,) = lengths
    per_iter: list[list[torch.Tensor]] = [[] for _ in range(n_out_scan)]
    n_states = len(states)
    for t in range(length):
        slices = [x.select(a, length - 1 - t if d else t) for x, a, d in zip(xs, in_axes, in_dirs)]
        outs = _as_tuple(body(*states, *slices, *outer))
        states = list(outs[:n_states])
        for k in range(n_out_scan):
            per_iter[k].append(outs[n_states + k])
    results = []
    for k in range(n_out_scan):
        vals = per_iter[k]
        if not vals:
            shape, dtype = empty_scan[k]
            device = xs[0].device if xs else torch.device("cpu")
            vals_t = torch.zeros(shape, dtype=dtype, device=device)
            axis = out_axes[k] % len(shape)
            results.append(vals_t.movedim(0, axis))
            continue
        if out_dirs[k]:
            vals = vals[::-1]
        shapes = {tuple(v.shape) for v in vals}
        if len(shapes) > 1:
            raise DataError(f"{op} node {node_name!r}: scan output {k} changes shape across iterations ({sorted(shapes)})")
        rank = vals[0].dim() + 1
        axis = out_axes[k]
        if not -rank <= axis < rank:
            raise DataError(f"{op} node {node_name!r}: scan_output_axes[{k}]={axis} out of range for rank {rank}")
        results.append(torch.stack(vals, axis % rank))
    return states, results


class OnnxScan(nn.Module, OnnxToTorchModule):
    """ONNX Scan-9+ (see the module docstring for the semantics).

    forward(*args): ``initial states (N)... scan inputs (M)... outer...``. Returns the N final states then
    the K scan outputs; a tensor when the node has one output.

    Raises:
        DataError: scan inputs of different lengths, axes out of range, or per-iteration outputs whose
            shape changes.
    """

    def __init__(self, node_name: str, body: fx.GraphModule, n_states: int, n_scan_in: int, in_axes, in_dirs,
                 out_axes, out_dirs, empty_scan):
        super().__init__()
        self.node_name = node_name
        self.body = body
        self.n_states, self.n_scan_in = int(n_states), int(n_scan_in)
        self.in_axes, self.in_dirs = tuple(in_axes), tuple(in_dirs)
        self.out_axes, self.out_dirs = tuple(out_axes), tuple(out_dirs)
        self.empty_scan = tuple(empty_scan)

    def forward(self, *args):  # noqa: D102
        states = list(args[: self.n_states])
        xs = list(args[self.n_states:self.n_states + self.n_scan_in])
        outer = list(args[self.n_states + self.n_scan_in:])
        axes = []
        for j, (x, a) in enumerate(zip(xs, self.in_axes)):
            if not -x.dim() <= a < x.dim():
                raise DataError(f"Scan node {self.node_name!r}: scan_input_axes[{j}]={a} out of range for rank {x.dim()}")
            axes.append(a % x.dim())
        states, scans = _scan_core(self.body, states, xs, outer, axes, self.in_dirs, self.out_axes, self.out_dirs,
                                   len(self.out_axes), self.empty_scan, self.node_name)
        results = states + scans
        return results[0] if len(results) == 1 else tuple(results)


class OnnxScan8(nn.Module, OnnxToTorchModule):
    """ONNX Scan-8: every state and scan input has a batch axis 0; scan inputs are scanned along axis 1.

    forward(*args): ``[sequence_lens] states (N)... scan inputs (M)... outer...``; ``sequence_lens``
    int64 ``[batch]`` (default: all full length). Each batch entry runs its own recurrence over its
    first ``sequence_lens[b]`` steps (``directions[j] = 1``: backwards from step ``sequence_lens[b] - 1``);
    returns the final states ``[batch, ...]`` then the scan outputs ``[batch, seq, ...]`` (iteration
    order, zero past a sequence's length).

    Raises:
        DataError: inconsistent batch sizes or lengths, sequence_lens out of range.
    """

    def __init__(self, node_name: str, body: fx.GraphModule, has_lens: bool, n_states: int, n_scan_in: int,
                 directions, n_scan_out: int, empty_scan):
        super().__init__()
        self.node_name = node_name
        self.body = body
        self.has_lens = bool(has_lens)
        self.n_states, self.n_scan_in, self.n_scan_out = int(n_states), int(n_scan_in), int(n_scan_out)
        self.directions = tuple(directions)
        self.empty_scan = tuple(empty_scan)

    def forward(self, *args):  # noqa: D102
        args = list(args)
        lens = args.pop(0) if self.has_lens else None
        states = args[: self.n_states]
        xs = args[self.n_states:self.n_states + self.n_scan_in]
        outer = args[self.n_states + self.n_scan_in:]
        batch = int(xs[0].shape[0])
        seq = int(xs[0].shape[1])
        for x in list(states) + list(xs):
            if int(x.shape[0]) != batch:
                raise DataError(f"Scan node {self.node_name!r}: batch sizes differ ({[tuple(t.shape) for t in states + xs]})")
        for x in xs:
            if int(x.shape[1]) != seq:
                raise DataError(f"Scan node {self.node_name!r}: scan inputs have different lengths along axis 1")
        if lens is None:
            lens_l = [seq] * batch
        else:
            lens_l = [int(v) for v in lens.reshape(-1).tolist()]
            if len(lens_l) != batch or any(v < 0 or v > seq for v in lens_l):
                raise DataError(f"Scan node {self.node_name!r}: sequence_lens {lens_l} invalid for batch {batch}, "
                                f"max length {seq}")
        finals, outs = [], []
        for b in range(batch):
            n = lens_l[b]
            st, sc = _scan_core(self.body, [s[b] for s in states], [x[b, :n] for x in xs], outer,
                                [0] * self.n_scan_in, self.directions, [0] * self.n_scan_out,
                                [0] * self.n_scan_out, self.n_scan_out, self.empty_scan, self.node_name)
            finals.append(st)
            outs.append(sc)
        results = [torch.stack([finals[b][i] for b in range(batch)], 0) for i in range(self.n_states)]
        for k in range(self.n_scan_out):
            per_shape = next((tuple(outs[b][k].shape[1:]) for b in range(batch) if outs[b][k].shape[0] > 0),
                             tuple(self.empty_scan[k][0][1:]))
            per_b = []
            for b in range(batch):
                v = outs[b][k]
                if v.shape[0] == 0:
                    v = v.new_zeros((0,) + per_shape)
                if v.shape[0] < seq:  # past this sequence's length: zeros
                    v = torch.cat([v, v.new_zeros((seq - v.shape[0],) + per_shape)], 0)
                per_b.append(v)
            results.append(torch.stack(per_b, 0))
        return results[0] if len(results) == 1 else tuple(results)


# ============================================================================ converters
def _current_model(node: OnnxNode) -> onnx.ModelProto:
    if not _MODEL_STACK:
        raise ConversionNotSupported(
            f"{node.operation_type} node {node.name!r}: subgraphs are lifted through qtorch_onnx.lift.lift(), "
            f"not by calling onnx2torch.convert directly")
    return _MODEL_STACK[-1]


def _lift(sg: Subgraph) -> fx.GraphModule:
    from .lifter import lift_subgraph

    return lift_subgraph(sg.model, outer_names=list(sg.outer_inputs) + list(sg.outer_initializers))


def _outer_union(subs: dict[str, Subgraph]) -> tuple[list[str], dict[str, list[int]]]:
    union: dict[str, int] = {}
    for sg in subs.values():
        for v in sg.outer_inputs:
            union.setdefault(v, len(union))
    return list(union), {attr: [union[v] for v in sg.outer_inputs] for attr, sg in subs.items()}


def _input_rank(model: onnx.ModelProto, index: int) -> int:
    vi = model.graph.input[index]
    tt = vi.type.tensor_type
    return len(tt.shape.dim) if tt.HasField("shape") else 0


def _if_converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    subs = subgraph_models(node, graph, _current_model(node))
    outer, idx = _outer_union(subs)
    name = node.name or node.unique_name
    module = OnnxIf(name, _lift(subs["then_branch"]), _lift(subs["else_branch"]), idx["then_branch"],
                    idx["else_branch"])
    return OperationConverterResult(
        torch_module=module,
        onnx_mapping=OnnxMapping(inputs=(node.input_values[0], *outer), outputs=node.output_values))


def _loop_converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    subs = subgraph_models(node, graph, _current_model(node))
    sg = subs["body"]
    body, outer = sg.model, sg.outer_inputs
    name = node.name or node.unique_name
    ins = list(node.input_values)
    has_max = len(ins) > 0 and bool(ins[0])
    has_cond = len(ins) > 1 and bool(ins[1])
    carried = ins[2:]
    if any(not v for v in carried):
        raise ModelError(f"Loop node {name!r}: loop-carried initial values cannot be omitted")
    n_carried = len(carried)
    n_scan = len(node.output_values) - n_carried
    body_outs = list(body.graph.output)
    empty = [_empty_like_output(body_outs[1 + n_carried + k]) for k in range(n_scan)]
    module = OnnxLoop(name, _lift(sg), has_max, has_cond, n_carried, n_scan, _input_rank(body, 0),
                      _input_rank(body, 1), empty)
    inputs = ([ins[0]] if has_max else []) + ([ins[1]] if has_cond else []) + carried + list(outer)
    return OperationConverterResult(torch_module=module,
                                    onnx_mapping=OnnxMapping(inputs=tuple(inputs), outputs=node.output_values))


def _scan_converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    model = _current_model(node)
    subs = subgraph_models(node, graph, model)
    sg = subs["body"]
    body, outer = sg.model, sg.outer_inputs
    name = node.name or node.unique_name
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    m = int(node.attributes["num_scan_inputs"])
    formal = len(body.graph.input) - len(outer)
    n_states = formal - m
    ins = list(node.input_values)
    n_out = len(node.output_values)
    n_scan_out = n_out - n_states
    body_outs = list(body.graph.output)
    empty = [_empty_like_output(body_outs[n_states + k]) for k in range(n_scan_out)]
    if opset < 9:  # Scan-8
        has_lens = bool(ins[0]) if ins else False
        data = ins[1:]
        if len(data) != n_states + m or any(not v for v in data):
            raise ModelError(f"Scan node {name!r}: {len(data)} state/scan inputs, the body takes {n_states} + {m}")
        dirs = _attr_ints(node, "directions", m, 0)
        if any(d not in (0, 1) for d in dirs):
            raise ModelError(f"Scan node {name!r}: directions {dirs}; valid values 0, 1")
        module = OnnxScan8(name, _lift(sg), has_lens, n_states, m, dirs, n_scan_out, empty)
        inputs = ([ins[0]] if has_lens else []) + data + list(outer)
    else:
        if len(ins) != n_states + m or any(not v for v in ins):
            raise ModelError(f"Scan node {name!r}: {len(ins)} inputs, the body takes {n_states} states + {m} scan inputs")
        in_axes = _attr_ints(node, "scan_input_axes", m, 0)
        in_dirs = _attr_ints(node, "scan_input_directions", m, 0)
        out_axes = _attr_ints(node, "scan_output_axes", n_scan_out, 0)
        out_dirs = _attr_ints(node, "scan_output_directions", n_scan_out, 0)
        for key, vals in (("scan_input_directions", in_dirs), ("scan_output_directions", out_dirs)):
            if any(d not in (0, 1) for d in vals):
                raise ModelError(f"Scan node {name!r}: {key} {vals}; valid values 0, 1")
        module = OnnxScan(name, _lift(sg), n_states, m, in_axes, in_dirs, out_axes, out_dirs, empty)
        inputs = ins + list(outer)
    return OperationConverterResult(torch_module=module,
                                    onnx_mapping=OnnxMapping(inputs=tuple(inputs), outputs=node.output_values))


def _since_versions(op_type: str) -> list[int]:
    return sorted({s.since_version for s in onnx.defs.get_all_schemas_with_history()
                   if s.name == op_type and s.domain == "" and s.since_version >= 7})


register_converter("If", _since_versions("If"))(_if_converter)
register_converter("Loop", _since_versions("Loop"))(_loop_converter)
register_converter("Scan", _since_versions("Scan"))(_scan_converter)


# ============================================================================ ops the real models need
# (silero-vad's If branches): Size, which the registry lacks, and Pad-11/13, whose onnx2torch converter
# rejects reflect/edge padding of the last axis of a rank-2 tensor. Both only when no other converter
# has been provided yet; they belong with the general converters (converters.py).
class OnnxSize(nn.Module, OnnxToTorchModule):
    """ONNX Size: int64 scalar, the number of elements of the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.tensor(x.numel(), dtype=torch.int64, device=x.device)


def _size_converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return OperationConverterResult(torch_module=OnnxSize(),
                                    onnx_mapping=OnnxMapping(inputs=(node.input_values[0],), outputs=node.output_values))


for _v in _since_versions("Size"):
    try:
        get_converter(operation_type="Size", version=_v)
    except NotImplementedError:
        add_converter(operation_type="Size", version=_v)(_size_converter)

class _LeadingArgs(nn.Module, OnnxToTorchModule):
    """Runs ``inner`` on the first ``n`` arguments (the others were baked into it as constants)."""

    def __init__(self, inner: nn.Module, n: int):
        super().__init__()
        self.inner, self.n = inner, int(n)

    def forward(self, *args):  # noqa: D102
        return self.inner(*args[: self.n])


try:
    _pad_general = get_converter(operation_type="Pad", version=18)
except NotImplementedError:
    _pad_general = None


def _pad_11_13(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """The registry's Pad-18 module (any axis; constant/reflect/edge) with onnx2torch's Pad-11/13 input
    mapping (data, pads, constant_value), as an override must keep it."""
    res = _pad_general(node, graph)
    full = tuple(v for v in node.input_values)
    got = tuple(res.onnx_mapping.inputs)
    if got == full:
        return res
    if full[: len(got)] != got:
        raise ConversionNotSupported(f"Pad node {node.name!r}: unexpected input mapping {got}")
    return OperationConverterResult(torch_module=_LeadingArgs(res.torch_module, len(got)),
                                    onnx_mapping=OnnxMapping(inputs=full, outputs=res.onnx_mapping.outputs))


for _v in (11, 13):
    if _pad_general is not None and ("", "Pad", _v) not in _conv.OVERRIDES:
        register_converter("Pad", [_v])(_pad_11_13)
