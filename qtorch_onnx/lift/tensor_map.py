"""Where every ONNX tensor lives in a lifted GraphModule, and what the ONNX graph looks like.

* :class:`ModelInfo` (``gm.tensor_map.graph``): the one graph index of the project (issue 15 item 3): per
  ONNX node (op type, domain, inputs, outputs, the fx module that runs it, its NodeProto) and per ONNX
  tensor (elem type, shape, initializer?, producer, consumers, reads per input slot) of the normalized
  model. Pure ONNX; built once by the lifter (:meth:`ModelInfo.from_model`) and read by placement
  (``Plan.info``), ``qm.layers()`` / ``qm.quantizers()``, the algorithms and the importer.
* :class:`TensorMap`: ONNX tensor name -> tuple of :class:`TensorRef` (an fx node, or a parameter/buffer
  inside a converted module), with the reverse lookups. Everything is stored by *name* (fx node names,
  qualified module paths), so fx nodes inserted later (fake quantizers) do not invalidate it; resolve
  with :meth:`TensorMap.fx_node`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import onnx
import torch
from torch import fx

from ..errors import ModelError

_FLOAT_TYPES = frozenset({
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
})


@dataclass(frozen=True)
class TensorRef:
    """Where one ONNX tensor lives in the GraphModule.

    Attributes:
        kind: ``"node"``: the value of fx node ``node_name`` (graph inputs -> placeholders, op outputs ->
            call_module / getitem nodes, initializers passed as arguments -> get_attr nodes);
            ``"param"``: parameter or buffer ``attr`` of submodule ``module`` (qualified path, resolve with
            ``gm.get_submodule``), holding ``onnx_value.permute(perm).reshape(param.shape)`` (``perm``
            ``None`` = identity; e.g. ``(1, 0)`` for a Gemm B stored transposed in ``nn.Linear.weight``);
            ``"const"``: an initializer the converter read at conversion time and baked into module
            ``module`` as a plain Python value (shapes, axes, pads, clip bounds): not a tensor of the gm.
        node_name: fx node name (kind "node").
        module: qualified submodule path (kinds "param" and "const").
        attr: parameter/buffer name inside ``module`` (kind "param").
        perm: permutation from the ONNX layout to the parameter's layout (kind "param").
        scope: kind "node" only: ``None`` for a node of the top-level graph; for a tensor that exists
            only inside an If / Loop / Scan subgraph, the qualified path of the subgraph's GraphModule
            (e.g. ``"If_0.then_branch"``) whose graph holds node ``node_name``. Parameters and
            constants inside subgraphs need no scope: their ``module`` path is already qualified.
    """

    kind: str
    node_name: str | None = None
    module: str | None = None
    attr: str | None = None
    perm: tuple[int, ...] | None = None
    scope: str | None = None

    def resolve(self, gm: fx.GraphModule):
        """The fx.Node (kind "node"; in ``gm.get_submodule(scope).graph`` when scoped), the tensor
        (kind "param") or the module (kind "const")."""
        if self.kind == "node":
            return TensorMap.fx_node(gm.get_submodule(self.scope) if self.scope else gm, self.node_name)
        mod = gm.get_submodule(self.module)
        return getattr(mod, self.attr) if self.kind == "param" else mod


@dataclass(frozen=True)
class TensorInfo:
    """One ONNX tensor of the normalized model.

    Attributes:
        name: tensor name.
        elem_type: ``onnx.TensorProto`` element type (0 when shape inference could not type it).
        shape: tuple of ints, with ``None`` for symbolic/unknown dims; ``None`` if the rank is unknown.
        is_initializer / is_graph_input / is_graph_output: where it comes from / goes.
        producer: name of the ONNX node writing it (``None`` for inputs and initializers).
        consumers: names of the ONNX nodes reading it, in graph order (a node reading it twice: once).
    """

    name: str
    elem_type: int
    shape: tuple | None
    is_initializer: bool
    is_graph_input: bool
    is_graph_output: bool
    producer: str | None
    consumers: tuple[str, ...]

    @property
    def is_float(self) -> bool:
        """True for float32/float64/float16/bfloat16 tensors (the ones quantizers can sit on)."""
        return self.elem_type in _FLOAT_TYPES


@dataclass(frozen=True)
class NodeInfo:
    """One ONNX node of the normalized model.

    Attributes:
        name: unique node name (normalization guarantees it).
        op_type, domain: the op (domain ``""`` = ai.onnx).
        opset: the model's opset import for ``domain``.
        inputs / outputs: tensor names in ONNX order (``""`` for an omitted optional input in the middle).
        attributes: attribute name -> Python value (``onnx.helper.get_attribute_value``; strings decoded).
        module: qualified path of the fx submodule that runs the node (set by the lifter; ``None`` in a
            ModelInfo built from a model alone).
        fx_node: name of that call_module fx node (set by the lifter).
    """

    name: str
    op_type: str
    domain: str
    opset: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: Mapping[str, object] = field(default_factory=dict, compare=False)
    module: str | None = None
    fx_node: str | None = None


class ModelInfo:
    """Structure of a (normalized) ONNX model: nodes and tensors by name, in graph order; the one graph index
    lift, placement, the algorithms and the importer share (main graph only; subgraphs have their own).

    Attributes:
        nodes: ordered mapping node name -> :class:`NodeInfo` (topological order).
        tensors: mapping tensor name -> :class:`TensorInfo` (graph inputs, initializers, node outputs).
        input_names / output_names: graph inputs (initializers excluded) and outputs, ONNX order.
        opsets: domain -> version of the model's opset imports (``""`` = ai.onnx).
        model: the indexed ``onnx.ModelProto`` (referenced, never mutated here), or None.
        node_protos: node name -> its ``onnx.NodeProto`` in ``model`` (placement reads attributes from it).
        initializers: initializer name -> its ``onnx.TensorProto`` in ``model``.
        producer: tensor name -> name of the node writing it (node outputs only).
        reads: tensor name -> reader node names, one entry per input slot (a node reading a tensor at two
            slots appears twice; ``TensorInfo.consumers`` lists it once). Placement's "only reader" rules
            count reads.
        elem_types / shapes: tensor name -> ``onnx.TensorProto`` element type / shape (``None`` for unknown
            dims) wherever value info, inputs, outputs or initializers give one.
    """

    def __init__(self, nodes, tensors, input_names, output_names, opsets, *, model: onnx.ModelProto | None = None,
                 node_protos=None, initializers=None, producer=None, reads=None, elem_types=None, shapes=None):
        self.nodes: dict[str, NodeInfo] = dict(nodes)
        self.tensors: dict[str, TensorInfo] = dict(tensors)
        self.input_names: tuple[str, ...] = tuple(input_names)
        self.output_names: tuple[str, ...] = tuple(output_names)
        self.opsets: dict[str, int] = dict(opsets)
        self.model = model
        self.node_protos: dict[str, onnx.NodeProto] = dict(node_protos or {})
        self.initializers: dict[str, onnx.TensorProto] = dict(initializers or {})
        self.producer: dict[str, str] = dict(producer or {})
        self.reads: dict[str, list[str]] = {k: list(v) for k, v in (reads or {}).items()}
        self.elem_types: dict[str, int] = dict(elem_types or {})
        self.shapes: dict[str, tuple | None] = dict(shapes or {})

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        """Graph inputs, initializers excluded (= ``input_names``)."""
        return self.input_names

    @property
    def graph_outputs(self) -> tuple[str, ...]:
        """Graph outputs (= ``output_names``)."""
        return self.output_names

    def is_float32(self, tensor: str) -> bool:
        """True when ``tensor`` is float32 (the tensors placement puts quantizers on)."""
        return self.elem_types.get(tensor) == onnx.TensorProto.FLOAT

    def all_tensors(self) -> list[str]:
        """Graph inputs, initializers and node outputs, in that order (graph order within each)."""
        names = list(self.input_names) + list(self.initializers)
        for n in self.nodes.values():
            names.extend(o for o in n.outputs if o)
        return names

    def rebuilt(self, model: onnx.ModelProto | None = None) -> "ModelInfo":
        """A fresh index of ``model`` (default: the indexed one, after an in-place rewrite), keeping the fx
        module of every node that still exists."""
        modules = {n: (i.module, i.fx_node) for n, i in self.nodes.items() if i.module is not None}
        return ModelInfo.from_model(self.model if model is None else model, modules)

    @classmethod
    def from_model(cls, model: onnx.ModelProto, modules: Mapping[str, tuple[str, str]] | None = None) -> "ModelInfo":
        """Build from a model whose node names are unique (e.g. :func:`normalize`'s output).

        Args:
            model: the ONNX model (not mutated).
            modules: optional node name -> ``(module path, fx node name)`` from the lifter.

        Raises:
            ModelError: duplicate or empty node names.
        """
        g = model.graph
        opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
        init_names = {t.name for t in g.initializer}
        input_names = [v.name for v in g.input if v.name not in init_names]
        output_names = [v.name for v in g.output]
        types: dict[str, tuple[int, tuple | None]] = {}
        elem_types: dict[str, int] = {}
        shapes: dict[str, tuple | None] = {}
        for vi in list(g.input) + list(g.output) + list(g.value_info):  # the last one given wins
            if vi.type.HasField("tensor_type"):
                tt = vi.type.tensor_type
                elem_types[vi.name] = tt.elem_type
                if tt.HasField("shape"):
                    shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
        for vi in list(g.value_info) + list(g.input) + list(g.output):
            tt = vi.type.tensor_type
            shape = (tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
                     if tt.HasField("shape") else None)
            old = types.get(vi.name)
            if old is None or (old[0] == 0 and tt.elem_type) or (old[1] is None and shape is not None):
                types[vi.name] = (tt.elem_type, shape)
        for t in g.initializer:
            types[t.name] = (t.data_type, tuple(t.dims))
            elem_types[t.name] = t.data_type
            shapes[t.name] = tuple(t.dims)
        producer: dict[str, str] = {}
        consumers: dict[str, list[str]] = {}
        reads: dict[str, list[str]] = {}
        node_protos: dict[str, onnx.NodeProto] = {}
        nodes: dict[str, NodeInfo] = {}
        modules = modules or {}
        for node in g.node:
            if not node.name or node.name in nodes:
                raise ModelError(f"node names must be unique and non-empty (got {node.name!r}); run normalize() first")
            attrs = {}
            for a in node.attribute:
                v = onnx.helper.get_attribute_value(a)
                attrs[a.name] = v.decode() if isinstance(v, bytes) else v
            mod, fxn = modules.get(node.name, (None, None))
            domain = "" if node.domain == "ai.onnx" else node.domain
            nodes[node.name] = NodeInfo(node.name, node.op_type, domain, opsets.get(domain, 0), tuple(node.input),
                                        tuple(node.output), attrs, mod, fxn)
            node_protos[node.name] = node
            for i in dict.fromkeys(node.input):
                if i:
                    consumers.setdefault(i, []).append(node.name)
            for i in node.input:
                if i:
                    reads.setdefault(i, []).append(node.name)
            for o in node.output:
                if o:
                    producer[o] = node.name
        names = list(input_names) + [t.name for t in g.initializer] + list(producer)
        outs = set(output_names)
        tensors = {}
        for n in dict.fromkeys(names):
            et, shape = types.get(n, (0, None))
            tensors[n] = TensorInfo(n, et, shape, n in init_names, n in input_names, n in outs, producer.get(n),
                                    tuple(consumers.get(n, ())))
        return cls(nodes, tensors, input_names, output_names, opsets, model=model, node_protos=node_protos,
                   initializers={t.name: t for t in g.initializer}, producer=producer, reads=reads,
                   elem_types=elem_types, shapes=shapes)

    def float_tensors(self) -> list[str]:
        """Names of all float-typed tensors (activations and initializers), graph order."""
        return [n for n, t in self.tensors.items() if t.is_float]


class TensorMap:
    """ONNX tensor name <-> location in a lifted GraphModule (see module docstring).

    Attributes:
        graph: the :class:`ModelInfo` of the normalized ONNX model.
        aliases: tensor names of the *original* model that normalization removed -> surviving tensor
            with the same value, or ``None`` (folded/dead).
        subgraphs: qualified path of each If / Loop / Scan subgraph GraphModule (any depth, e.g.
            ``"If_0.then_branch"``) -> that subgraph's own :class:`TensorMap` (refs relative to it, its
            :class:`ModelInfo` in ``.graph``). The top-level map also holds the subgraphs' tensors:
            their parameters/constants under qualified module paths, and fx nodes of tensors the main
            graph does not have as scoped refs (:attr:`TensorRef.scope`). :attr:`graph` describes the
            main graph only.
    """

    def __init__(self, refs: Mapping[str, tuple[TensorRef, ...]], graph: ModelInfo,
                 aliases: Mapping[str, str | None] | None = None,
                 subgraphs: Mapping[str, "TensorMap"] | None = None):
        self._refs = {k: tuple(v) for k, v in refs.items()}
        self.graph = graph
        self.aliases: dict[str, str | None] = dict(aliases or {})
        self.subgraphs: dict[str, TensorMap] = dict(subgraphs or {})
        self._by_fx: dict[tuple[str | None, str], str] = {}
        self._by_param: dict[tuple[str, str], str] = {}
        for name, rs in self._refs.items():
            for r in rs:
                if r.kind == "node":
                    self._by_fx.setdefault((r.scope, r.node_name), name)
                elif r.kind == "param":
                    self._by_param.setdefault((r.module, r.attr), name)

    def __setstate__(self, state):  # maps pickled before ``subgraphs`` existed
        self.__dict__.update(state)
        self.__dict__.setdefault("subgraphs", {})

    # --- forward lookups
    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def __iter__(self):
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, name: str) -> tuple[TensorRef, ...]:
        """All locations of ONNX tensor ``name`` (several for an initializer copied into several modules).

        Raises:
            KeyError: unknown tensor (the message names the closest known one, or the alias it became).
        """
        try:
            return self._refs[name]
        except KeyError:
            from ..errors import closest

            if name in self.aliases:
                hint = (f"; normalization replaced it by {self.aliases[name]!r}" if self.aliases[name]
                        else "; normalization folded it away")
            else:
                hint = closest(name, self._refs)
            raise KeyError(f"no ONNX tensor {name!r} in the lifted model{hint}") from None

    def refs(self, name: str) -> tuple[TensorRef, ...]:
        """Same as ``tensor_map[name]``."""
        return self[name]

    def node_name(self, name: str) -> str | None:
        """The top-level fx node name carrying ONNX tensor ``name`` (``None`` if it only lives as a
        parameter/const, or only inside a subgraph)."""
        return next((r.node_name for r in self[name] if r.kind == "node" and r.scope is None), None)

    # --- reverse lookups
    def tensor_of_node(self, fx_node_name: str, scope: str | None = None) -> str | None:
        """ONNX tensor name carried by fx node ``fx_node_name`` of the top-level graph, or of the subgraph
        GraphModule at path ``scope`` (``None`` for fx-only nodes)."""
        return self._by_fx.get((scope, fx_node_name))

    def tensor_of_param(self, module: str, attr: str) -> str | None:
        """ONNX initializer name stored as parameter/buffer ``attr`` of submodule ``module``."""
        return self._by_param.get((module, attr))

    def items(self):
        """``(tensor name, refs)`` pairs."""
        return self._refs.items()

    @staticmethod
    def fx_node(gm: fx.GraphModule, node_name: str) -> fx.Node:
        """The fx.Node called ``node_name`` in ``gm.graph``.

        Raises:
            KeyError: no such node (e.g. it was erased).
        """
        for n in gm.graph.nodes:
            if n.name == node_name:
                return n
        raise KeyError(f"fx graph has no node {node_name!r}")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two tensors of equal dtype and shape (NaN-safe: compares the raw bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True


def match_parameter(value: torch.Tensor, param: torch.Tensor) -> tuple[bool, tuple[int, ...] | None]:
    """Does ``param`` hold ``value`` exactly (bit for bit), up to a permutation and a reshape?

    Tries the identity, then (2-D values) the transpose. Returns ``(matched, perm)``.
    """
    if value.numel() != param.numel() or value.dtype != param.dtype:
        return False, None
    if _same_values(value.reshape(param.shape), param):
        return True, None
    if value.dim() == 2 and _same_values(value.permute(1, 0).contiguous().reshape(param.shape), param):
        return True, (1, 0)
    return False, None
