"""Normalization of an ONNX model before lifting: one clean, fully typed graph.

:func:`normalize` returns a *new* :class:`onnx.ModelProto`; the input is never mutated. The passes, in
order (each one documented at its function):

0. A model below opset 7 is upgraded to opset 7 (``onnx.version_converter``); ``CastLike`` nodes with ``saturate``/``round_mode`` become the equivalent ``Cast`` (the constant
   folder would otherwise drop those attributes).
1. ``Constant`` nodes become initializers (onnx-ir ``LiftConstantsToInitializersPass``); the
   initializer keeps the Constant's output name.
2. Constant folding (onnxscript ``FoldConstantsPass``, which also inlines ``If`` nodes whose condition
   is constant and bypasses ``Identity`` nodes), then dead-node removal (onnx-ir
   ``RemoveUnusedNodesPass``). Quantize/Dequantize nodes and nodes of non-standard domains are never
   folded, so an already quantized model keeps its quantized weights.
3. Initializers listed as graph inputs are removed from the inputs (onnx-ir
   ``RemoveInitializersFromInputsPass``); nodes are topologically sorted (``TopologicalSortPass``).
4. Trailing empty optional inputs are dropped (``Clip(x, "", "")`` -> ``Clip(x)``); domain
   ``"ai.onnx"`` is spelled ``""``; scalar ``axes`` initializers of Unsqueeze/Squeeze become 1-D;
   Constant nodes left (graph outputs) hold a ``value`` tensor attribute.
5. ONNX shape inference (``onnx.shape_inference.infer_shapes``, ``data_prop=True``).
6. ``auto_pad=VALID`` becomes zero ``pads``; ``auto_pad=SAME_UPPER|SAME_LOWER`` becomes explicit ``pads``
   when the spatial input shape is static (ONNX operator spec of Conv / ConvTranspose / MaxPool /
   AveragePool / LpPool) and is kept otherwise (symbolic H/W): the converters then pad from the actual
   input size at run time, and the normalized (and exported) graph accepts any input size.
7. Optional (``fold_batchnorm=True``): ``BatchNormalization`` folded into the single-consumer ``Conv``
   feeding it, in float64 (see :func:`_fold_batchnorm`).
8. Node names are made unique and non-empty (deterministic ``<op_type>_<index>`` for missing ones;
   names that would collide with onnx2torch's internal keys get ``_node``).
9. Shape inference again, so every tensor has a ``value_info`` (dtype, and shape where inferable);
   Conv/ConvTranspose outputs of unknown rank get the weight's rank (dims unknown).

Names of tensors that survive normalization are preserved; tensors that disappear (folded constants,
bypassed ``Identity`` outputs, BatchNormalization-folded convolution outputs) are listed by
:func:`normalize_with_aliases` together with the surviving tensor that carries the same value where
there is one.
"""
from __future__ import annotations

import logging
import math
import os
import re
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError

_LOG = logging.getLogger(__name__)

#: Ops the constant folder must leave alone: folding them would erase quantization already in the model.
_NEVER_FOLD = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
_STANDARD_DOMAINS = ("", "ai.onnx")
_POOL_LIKE = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"})


# --------------------------------------------------------------------------------------------- helpers
def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _all_tensor_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
    return names


def _opset(model: onnx.ModelProto, domain: str = "") -> int:
    for o in model.opset_import:
        if o.domain in ((domain,) if domain not in _STANDARD_DOMAINS else _STANDARD_DOMAINS):
            return o.version
    raise ModelError(f"model {model.graph.name!r} imports no opset for domain {domain or 'ai.onnx'!r}")


def _shape_map(model: onnx.ModelProto) -> dict[str, tuple]:
    """Tensor name -> shape tuple (ints; ``None`` for unknown dims) from value_info/inputs/outputs/inits."""
    shapes: dict[str, tuple] = {}
    g = model.graph
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    for init in g.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


#: shape-preserving ops onnx's shape inference has no schema for: (domain, op_type) -> output type rule
_CONTRIB_QDQ = {("com.microsoft", "QuantizeLinear"): "zero_point", ("com.microsoft", "DequantizeLinear"): "scale"}


def infer_shapes_through_contrib_qdq(model: onnx.ModelProto, infer) -> onnx.ModelProto:
    """Run ``infer(model)`` (ONNX shape inference) and carry types and shapes through ONNX Runtime's
    ``com.microsoft`` QuantizeLinear / DequantizeLinear, which onnx has no schema for (their output has the
    input's shape; Q: the zero point's type, uint8 without one; DQ: the scale's type), repeating until
    inference reaches past all of them. Registering schemas for them is not an option: ``onnx.reference``
    requires op names unique across domains. Returns a new model; ``model`` is not modified.
    """
    out = infer(model)
    for _ in range(len(out.graph.node)):
        known = {v.name: v for v in list(out.graph.input) + list(out.graph.value_info) + list(out.graph.output)
                 if v.type.tensor_type.HasField("shape")}
        elem = {t.name: t.data_type for t in out.graph.initializer}
        for v in list(out.graph.input) + list(out.graph.value_info) + list(out.graph.output):
            elem.setdefault(v.name, v.type.tensor_type.elem_type)
        shapes = {t.name: list(t.dims) for t in out.graph.initializer}
        added = []
        for n in out.graph.node:
            rule = _CONTRIB_QDQ.get((n.domain, n.op_type))
            if rule is None or not n.output or n.output[0] in known:
                continue
            src = n.input[0]
            if src in known:
                dims = known[src].type.tensor_type.shape.dim
                shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]
            elif src in shapes:
                shape = shapes[src]
            else:
                continue
            if rule == "zero_point":
                t = elem.get(n.input[2]) if len(n.input) > 2 and n.input[2] else onnx.TensorProto.UINT8
            else:
                t = elem.get(n.input[1]) or onnx.TensorProto.FLOAT
            if not t:
                continue
            added.append(onnx.helper.make_tensor_value_info(n.output[0], t, shape))
        if not added:
            break
        out.graph.value_info.extend(added)
        out = infer(out)
    return out


#: a model whose initializers hold more than this (bytes) is past what protobuf can serialize (2 GiB, margin kept)
BIG_MODEL_BYTES = 3 << 29
#: in such a model, initializers with more elements than this are "large": their values are never shapes
LARGE_INITIALIZER_ELEMENTS = 1 << 18


def large_initializers(model: onnx.ModelProto) -> list:
    """The initializers of ``model`` with more than :data:`LARGE_INITIALIZER_ELEMENTS` elements when its
    initializers hold more than :data:`BIG_MODEL_BYTES`, else ``[]``. Sizes come from dims and element types:
    protobuf cannot serialize, nor even size (``ByteSize``), a message past 2 GiB. Shape inference runs
    without their data and onnx2torch gets them as graph inputs."""
    total = 0
    for t in model.graph.initializer:
        try:
            item = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        except (KeyError, TypeError, ValueError):
            item = 4
        total += math.prod(t.dims) * item
    if total <= BIG_MODEL_BYTES:
        return []
    return [t for t in model.graph.initializer if math.prod(t.dims) > LARGE_INITIALIZER_ELEMENTS]


def is_unloaded(t: onnx.TensorProto) -> bool:
    """True for an initializer left in its external data file by :func:`~qtorch_onnx.lift.lifter.load_model`
    (streaming: ONNX external data whose ``location`` is an absolute path, set by the loader). Such a tensor
    has dims and element type but no data in memory; :func:`read_initializer` reads it."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return False
    loc = next((e.value for e in t.external_data if e.key == "location"), "")
    return os.path.isabs(loc)


def external_span(t: onnx.TensorProto) -> tuple[str, int, int]:
    """``(file, offset, length)`` of an unloaded initializer's bytes (length from dims and element type when
    the tensor does not record it)."""
    info = {e.key: e.value for e in t.external_data}
    offset = int(info.get("offset", 0) or 0)
    if "length" in info:
        length = int(info["length"])
    else:
        length = math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return info["location"], offset, length


#: element types read straight from an external data file into a numpy array (little-endian, ONNX's layout)
_PLAIN_TYPES = frozenset({
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.INT32,
    onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64, onnx.TensorProto.BOOL,
})


def read_external_bytes(t: onnx.TensorProto, into=None):
    """Read the bytes of an unloaded initializer (see :func:`is_unloaded`) from its file, once.

    Args:
        t: the tensor (not modified).
        into: optional writable contiguous numpy array of exactly ``length`` bytes to read into.

    Returns:
        ``into`` (filled), or a new ``uint8`` array of ``length`` bytes.

    Raises:
        ModelError: the file is missing, or shorter than offset + length (names the tensor and the file).
    """
    path, offset, length = external_span(t)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise ModelError(f"tensor {t.name!r} is stored in the external data file {path!r}, which cannot be read "
                         f"({exc.strerror or exc})") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if offset + length > size:
            raise ModelError(f"tensor {t.name!r} needs bytes {offset}..{offset + length} of the external data file "
                             f"{path!r}, which has {size} bytes (truncated?)")
        buf = np.empty(length, np.uint8) if into is None else into.reshape(-1).view(np.uint8)
        if buf.nbytes != length:
            raise ModelError(f"internal: reading tensor {t.name!r} into {buf.nbytes} bytes, it has {length}")
        f.seek(offset)
        view, done = memoryview(buf), 0
        while done < length:
            n = f.readinto(view[done:])
            if not n:
                raise ModelError(f"tensor {t.name!r}: the external data file {path!r} ended at byte {offset + done}, "
                                 f"the tensor needs {offset + length} (truncated while reading?)")
            done += n
    return buf


def read_initializer(t: onnx.TensorProto) -> np.ndarray:
    """The value of an initializer as numpy (``onnx.numpy_helper.to_array``'s dtypes), its data read from the
    external data file when it is unloaded (:func:`is_unloaded`; one read, straight into the array for plain
    numeric types); ``t`` is never modified. The array of an unloaded tensor is new and writable.

    Raises:
        ModelError: the external data file is missing or too short (names the tensor and the file).
    """
    if not is_unloaded(t):
        return numpy_helper.to_array(t)
    if t.data_type in _PLAIN_TYPES:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).newbyteorder("<")
        arr = np.empty(tuple(t.dims), dtype)
        read_external_bytes(t, into=arr)
        return arr if dtype.isnative else arr.astype(dtype.newbyteorder("="))
    tmp = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
    tmp.raw_data = read_external_bytes(t).tobytes()
    return numpy_helper.to_array(tmp)


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    from .plugins import load_plugins

    load_plugins()  # their ONNX schemas type the tensors behind their domains' nodes

    def infer(m: onnx.ModelProto) -> onnx.ModelProto:
        # ONNX's shape inference serializes the model: past protobuf's 2 GiB it cannot. It needs the values of
        # small constants only (shapes, axes), so the data of the large initializers is set aside for the call
        # (each tensor marked external, which inference reads as "no value") and put back afterwards.
        big = large_initializers(m)
        if not big:
            return onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True)
        held = {}
        for t in big:
            kept = onnx.TensorProto()
            kept.CopyFrom(t)
            held[t.name] = kept
            stub = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims,
                                    data_location=onnx.TensorProto.EXTERNAL)
            stub.external_data.add(key="location", value="qtorch-onnx-set-aside")
            t.CopyFrom(stub)
        try:
            out = onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True)
        finally:
            for t in m.graph.initializer:
                if t.name in held:
                    t.CopyFrom(held[t.name])
        for t in out.graph.initializer:
            if t.name in held:
                t.CopyFrom(held[t.name])
        return out

    try:
        return infer_shapes_through_contrib_qdq(model, infer)
    except Exception as exc:  # shape inference of an inconsistent model
        raise ModelError(f"ONNX shape inference failed on model {model.graph.name!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------- IR passes
def _should_fold(node) -> bool | None:
    if node.domain not in _STANDARD_DOMAINS or node.op_type in _NEVER_FOLD:
        return False
    if node.op_type == "ConstantOfShape":  # onnxscript keeps these by default (model size); we fold them
        return True
    return None


def _ir_passes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Passes 1-3 on onnx-ir: lift Constants, fold constants (and constant-condition Ifs), clean up."""
    import onnx_ir as ir
    from onnx_ir.passes import common as irp
    from onnxscript.optimizer import _constant_folding as cf  # FoldConstantsPass lives here (public name)

    fold_pass = getattr(cf, "FoldConstantsPass")
    irmodel = ir.serde.deserialize_model(model)
    irp.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(irmodel)
    fold_pass(
        shape_inference=True, input_size_limit=1 << 40, output_size_limit=1 << 40, should_fold=_should_fold
    )(irmodel)
    # the folder emits Constant nodes for what it folded: lift those too
    irp.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(irmodel)
    irp.RemoveUnusedNodesPass()(irmodel)
    irp.RemoveInitializersFromInputsPass()(irmodel)
    irp.TopologicalSortPass()(irmodel)
    return ir.serde.serialize_model(irmodel)


# --------------------------------------------------------------------------------------------- proto passes
def _upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Pass 0a: a model below ai.onnx opset 7 is converted to opset 7 with ONNX's version converter
    (``onnx.version_converter.convert_version``), whose adapters rewrite the ops whose semantics changed
    (e.g. the legacy ``broadcast``/``axis`` attributes of binary ops).

    Raises:
        ModelError: the version converter cannot convert the model (names the opset and its message).
    """
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, 7)
    except Exception as exc:  # the converter raises RuntimeError/ValidationError for missing adapters
        raise ModelError(f"model {model.graph.name!r} uses ai.onnx opset {opset}; converting it to opset 7 "
                         f"(the oldest the lifter handles) failed: {exc}") from exc


def _castlike_to_cast(model: onnx.ModelProto) -> onnx.ModelProto:
    """Pass 0: ``CastLike`` with a ``saturate`` or ``round_mode`` attribute -> ``Cast(to=<type of the
    second input>)`` with the same attributes (same semantics by the ONNX spec).

    Needed because onnxscript's constant folder rewrites ``CastLike`` into a ``Cast`` that drops those
    attributes (onnxscript ``_constant_folding.cast_like``), which changes float8 results.
    Returns the model (a copy when something changed).
    """
    nodes = [n for n in model.graph.node if n.op_type == "CastLike" and n.domain in _STANDARD_DOMAINS
             and any(a.name in ("saturate", "round_mode") for a in n.attribute)]
    if not nodes:
        return model
    types = {}
    typed = _infer(model)
    for vi in list(typed.graph.input) + list(typed.graph.value_info) + list(typed.graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in model.graph.initializer:
        types[t.name] = t.data_type
    out = _copy(model)
    for node in out.graph.node:
        if node.op_type != "CastLike" or node.domain not in _STANDARD_DOMAINS or len(node.input) < 2:
            continue
        if not any(a.name in ("saturate", "round_mode") for a in node.attribute) or node.input[1] not in types:
            continue
        node.op_type = "Cast"
        _set_attr(node, "to", int(types[node.input[1]]))
        del node.input[1:]
    return out


def _drop_trailing_empty_inputs(graph: onnx.GraphProto) -> None:
    """Pass 4: ``Op(x, "", "")`` -> ``Op(x)`` (empty trailing optional inputs and outputs carry no
    information: an omitted optional output is one nobody asked for)."""
    for node in graph.node:
        if node.domain == "ai.onnx":
            node.domain = ""
        while len(node.input) and node.input[-1] == "":
            del node.input[-1]
        while len(node.output) > 1 and node.output[-1] == "":
            del node.output[-1]


#: op type -> input index of an ``axes`` tensor that ONNX Runtime also accepts as a scalar
_AXES_INPUT = {"Unsqueeze": 1, "Squeeze": 1}


def _scalar_axes_to_1d(graph: onnx.GraphProto) -> None:
    """Pass 4b: an ``axes`` initializer of rank 0 (Unsqueeze/Squeeze) is replaced, for those nodes, by a
    rank-1 copy ``<name>_1d`` (the form the spec documents); the scalar is dropped when nothing else
    reads it."""
    inits = {t.name: t for t in graph.initializer}
    taken = _all_tensor_names(graph)
    made: dict[str, str] = {}
    for node in graph.node:
        k = _AXES_INPUT.get(node.op_type)
        if k is None or node.domain not in _STANDARD_DOMAINS or len(node.input) <= k:
            continue
        t = inits.get(node.input[k])
        if t is None or len(t.dims) != 0:
            continue
        if t.name not in made:
            name, j = f"{t.name}_1d", 1
            while name in taken:
                name, j = f"{t.name}_1d{j}", j + 1
            taken.add(name)
            graph.initializer.append(numpy_helper.from_array(read_initializer(t).reshape(1), name))
            made[t.name] = name
        node.input[k] = made[t.name]
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for old in made:
        if old not in used:
            graph.initializer.remove(inits[old])
            keep = [v for v in graph.value_info if v.name != old]
            del graph.value_info[:]
            graph.value_info.extend(keep)


_CONSTANT_ATTRS = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
                   "value_ints": np.int64}


def _constants_as_tensors(graph: onnx.GraphProto) -> None:
    """Pass 4c: the Constant nodes left (those producing graph outputs) carry their value as a ``value``
    tensor attribute (``value_int(s)``/``value_float(s)`` rewritten; same value and type by the spec),
    the one form onnx2torch's Constant converter reads for every shape, the empty one included."""
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in _STANDARD_DOMAINS or len(node.attribute) != 1:
            continue
        a = node.attribute[0]
        if a.name not in _CONSTANT_ATTRS:
            continue
        arr = np.asarray(helper.get_attribute_value(a), dtype=_CONSTANT_ATTRS[a.name])
        _del_attr(node, a.name)
        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(arr)))


def _get_attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    _del_attr(node, name)
    node.attribute.append(helper.make_attribute(name, value))


def _del_attr(node: onnx.NodeProto, name: str) -> None:
    keep = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(keep)


def same_pads(
    in_spatial: Iterable[int],
    kernel: Iterable[int],
    strides: Iterable[int],
    dilations: Iterable[int],
    mode: str,
    transposed: bool = False,
    output_padding: Iterable[int] | None = None,
) -> list[int]:
    """Explicit ONNX ``pads`` ``[b_1..b_n, e_1..e_n]`` for ``auto_pad`` ``mode`` (``SAME_UPPER``/``SAME_LOWER``/``VALID``).

    Formulas from the ONNX operator spec: for Conv and pooling ``out = ceil(in / stride)``,
    ``total = max(0, (out - 1) * stride + (k - 1) * dilation + 1 - in)``; for ConvTranspose
    ``out = in * stride``, ``total = stride * (in - 1) + output_padding + (k - 1) * dilation + 1 - out``.
    ``SAME_UPPER`` puts the odd pixel at the end, ``SAME_LOWER`` at the beginning.

    Used by normalization pass 6 (static shapes) and, at run time with the actual input size, by the
    converters of nodes whose ``auto_pad`` was kept (dynamic shapes); ``in_spatial`` may be a
    ``torch.Size``. Returns Python ints.
    """
    in_spatial, kernel, strides, dilations = map(list, (in_spatial, kernel, strides, dilations))
    n = len(in_spatial)
    if mode == "VALID":
        return [0] * (2 * n)
    output_padding = list(output_padding) if output_padding is not None else [0] * n
    begins, ends = [], []
    for i in range(n):
        eff_k = (kernel[i] - 1) * dilations[i] + 1
        if transposed:
            out = in_spatial[i] * strides[i]
            total = max(0, strides[i] * (in_spatial[i] - 1) + output_padding[i] + eff_k - out)
        else:
            out = -(-in_spatial[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + eff_k - in_spatial[i])
        small, big = total // 2, total - total // 2
        if mode == "SAME_UPPER":
            begins.append(small), ends.append(big)
        else:  # SAME_LOWER
            begins.append(big), ends.append(small)
    return begins + ends


def _resolve_auto_pad(model: onnx.ModelProto) -> None:
    """Pass 6: replace ``auto_pad`` by explicit ``pads`` where the input's spatial shape allows it (in place
    on a copy).

    * ``VALID`` always becomes ``pads`` of zeros (only the spatial rank is needed).
    * ``SAME_UPPER`` / ``SAME_LOWER`` become the explicit ``pads`` of :func:`same_pads` when the spatial
      dimensions of the data input and the kernel shape are statically known. Otherwise (symbolic H/W,
      a run-time weight of unknown shape, or a ConvTranspose with ``output_shape``) the attribute is
      kept: the converters of :mod:`~qtorch_onnx.lift.ops_conv_pool` then compute the same padding from
      the actual input size on every call, and the normalized graph (which export writes) keeps
      accepting any input size. Nodes with ``auto_pad`` kept have no ``pads`` attribute (the ONNX spec
      forbids both at once).

    Raises:
        ModelError: ``auto_pad=VALID`` on a node whose spatial rank is unknown (no kernel shape, no
            input rank); names the node.
    """
    shapes = _shape_map(model)
    for node in model.graph.node:
        if node.op_type not in _POOL_LIKE or node.domain not in _STANDARD_DOMAINS:
            continue
        mode = _get_attr(node, "auto_pad", b"NOTSET")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if mode == "NOTSET":
            continue
        if node.op_type == "ConvTranspose" and _get_attr(node, "output_shape") is not None:
            continue  # the pads then follow from output_shape and the SAME_* mode: the converter does it
        x_shape = shapes.get(node.input[0])
        kernel = _get_attr(node, "kernel_shape")
        if kernel is None and node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
            w_shape = shapes.get(node.input[1])
            kernel = list(w_shape[2:]) if w_shape is not None and None not in w_shape else None
        if mode == "VALID":
            n = len(kernel) if kernel is not None else (len(x_shape) - 2 if x_shape else None)
            if n is None:
                raise ModelError(f"node {node.name!r} ({node.op_type}): auto_pad=VALID but the spatial rank is unknown")
            pads = [0] * (2 * n)
        else:
            if x_shape is None or kernel is None or any(d is None for d in x_shape[2:]):
                _LOG.debug("node %r (%s): auto_pad=%s kept (input %r has spatial shape %s, kernel %s): padding "
                           "computed at run time", node.name, node.op_type, mode, node.input[0], x_shape, kernel)
                _del_attr(node, "pads")
                continue
            n = len(kernel)
            pads = same_pads(
                x_shape[2:],
                kernel,
                _get_attr(node, "strides", [1] * n),
                _get_attr(node, "dilations", [1] * n),
                mode,
                transposed=node.op_type == "ConvTranspose",
                output_padding=_get_attr(node, "output_padding", None),
            )
        _del_attr(node, "auto_pad")
        _set_attr(node, "pads", [int(p) for p in pads])


def _fold_batchnorm(model: onnx.ModelProto, aliases: dict[str, str]) -> None:
    """Pass 7: fold ``BatchNormalization(Conv(x, W, b))`` into ``Conv(x, W', b')`` (in place on a copy).

    Applies when the Conv output has exactly one consumer (the BatchNormalization, inference form: one
    output, ``training_mode`` 0), is not a graph output, and W, b, scale, B, mean, var are initializers.
    With ``s = scale / sqrt(var + epsilon)`` per output channel (BatchNormalization spec), computed in
    float64 and stored in W's dtype: ``W' = W * s[:, None, ...]`` and ``b' = (b - mean) * s + B`` (b = 0
    when the Conv has no bias). The folded Conv writes the BatchNormalization's output tensor name; the
    Conv's former output name is recorded in ``aliases`` (-> the BatchNormalization output). W' / b'
    reuse the names of W / b when no other node reads them, else get fresh names ``<name>_bnfold``.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    outputs = {o.name for o in g.output}
    producer = {o: node for node in g.node for o in node.output}
    taken = _all_tensor_names(g)
    removed: list[onnx.NodeProto] = []

    def fresh(base: str) -> str:
        name, k = f"{base}_bnfold", 1
        while name in taken:
            name, k = f"{base}_bnfold{k}", k + 1
        taken.add(name)
        return name

    for bn in list(g.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in _STANDARD_DOMAINS:
            continue
        if len(bn.output) != 1 or _get_attr(bn, "training_mode", 0) != 0 or len(bn.input) != 5:
            continue
        conv = producer.get(bn.input[0])
        if conv is None or conv.op_type != "Conv" or conv.domain not in _STANDARD_DOMAINS:
            continue
        y = conv.output[0]
        if y in outputs or len(consumers.get(y, [])) != 1:
            continue
        if any(n not in inits for n in list(conv.input[1:]) + list(bn.input[1:])):
            continue
        w_proto = inits[conv.input[1]]
        w = read_initializer(w_proto)
        if w.dtype.kind != "f":
            continue
        scale, beta, mean, var = (read_initializer(inits[n]).astype(np.float64) for n in bn.input[1:])
        eps = float(_get_attr(bn, "epsilon", 1e-5))
        s = scale / np.sqrt(var + eps)
        b = read_initializer(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 else 0.0
        w_new = (w.astype(np.float64) * s.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        b_new = ((b - mean) * s + beta).astype(w.dtype)

        w_name = conv.input[1] if len(consumers[conv.input[1]]) == 1 else fresh(conv.input[1])
        if len(conv.input) > 2 and len(consumers[conv.input[2]]) == 1:
            b_name = conv.input[2]
        else:
            b_name = fresh(conv.input[2] if len(conv.input) > 2 else f"{conv.name or y}_bias")
        for name, arr in ((w_name, w_new), (b_name, b_new)):
            if name in inits:
                g.initializer.remove(inits[name])
            t = numpy_helper.from_array(arr, name)
            g.initializer.append(t)
            inits[name] = t
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        conv.output[0] = bn.output[0]
        aliases[y] = bn.output[0]
        removed.append(bn)
    for bn in removed:
        g.node.remove(bn)
    # initializers nobody reads any more (old W/b/scale/... of folded pairs)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for i in reversed(range(len(g.initializer))):  # in place: re-adding a message copies (serializes) it
        if g.initializer[i].name not in used:
            del g.initializer[i]


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Pass 8: unique, non-empty node names; existing unique names are kept.

    A node without a name becomes ``<op_type>_<index in graph>``; a later duplicate becomes ``<name>_<k>``
    (smallest k >= 1 not taken); a name equal to a graph input or initializer name (after onnx2torch's
    '.' -> '/' mapping) becomes ``<name>_node``. Deterministic for a given graph.
    """
    # onnx2torch keys its conversion table by graph input names, initializer names, its buffer names and
    # its module names ('.' -> '/'): a node whose module name equals one of those is renamed.
    reserved = {v.name for v in graph.input} | {t.name for t in graph.initializer}

    def clashes(name: str) -> bool:
        mod = name.replace(".", "/")
        return mod in reserved or re.fullmatch(r"onnx_initializer_\d+", mod) is not None

    counts: dict[str, int] = {}
    for node in graph.node:
        if node.name and not clashes(node.name):
            counts[node.name] = counts.get(node.name, 0) + 1
    taken = set(counts) | reserved
    seen: set[str] = set()
    for index, node in enumerate(graph.node):
        ok = node.name and not clashes(node.name)
        if ok and node.name not in seen:  # unique, or the first occurrence of a duplicate: keeps its name
            seen.add(node.name)
            continue
        base = (node.name + "_node" if clashes(node.name) else node.name) if node.name else f"{node.op_type}_{index}"
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        node.name = name
        taken.add(name)
        seen.add(name)


def _complete_conv_ranks(model: onnx.ModelProto) -> None:
    """Give Conv/ConvTranspose outputs of unknown rank the rank of their weight (dims unknown).

    ONNX shape inference leaves a Conv output untyped in rank when the input's rank is unknown (e.g.
    behind a Reshape to a computed shape); the rank is still that of W, and converters downstream
    (BatchNormalization picks 1d/2d/3d by rank) need it.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    vis = {v.name: v for v in g.value_info}
    for node in g.node:
        if node.op_type not in ("Conv", "ConvTranspose") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        rank = len(inits[node.input[1]].dims)
        vi = vis.get(node.output[0])
        if vi is None:
            vi = g.value_info.add()
            vi.name = node.output[0]
            vi.type.tensor_type.elem_type = inits[node.input[1]].data_type
            vis[vi.name] = vi
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            for _ in range(rank):
                tt.shape.dim.add()


def _identity_aliases(graph: onnx.GraphProto) -> dict[str, str]:
    """For each standard ``Identity`` node: output -> input and input -> output (value-equal pairs)."""
    pairs: dict[str, set[str]] = {}
    for node in graph.node:
        if node.op_type == "Identity" and node.domain in _STANDARD_DOMAINS and node.input and node.output:
            a, b = node.input[0], node.output[0]
            pairs.setdefault(a, set()).add(b)
            pairs.setdefault(b, set()).add(a)
    return pairs


# --------------------------------------------------------------------------------------------- public
def normalize_with_aliases(
    model: onnx.ModelProto, *, fold_batchnorm: bool = False
) -> tuple[onnx.ModelProto, dict[str, str | None]]:
    """Normalize ``model`` (see :func:`normalize`) and report which tensor names disappeared.

    Returns:
        ``(normalized_model, aliases)``; ``aliases`` maps every tensor name of the input model that no
        longer exists to the name of a surviving tensor holding the same value (an ``Identity`` partner,
        or the BatchNormalization output of a folded Conv), or ``None`` when the tensor was folded away
        (constant subexpressions) or removed as dead code.

    Raises:
        ModelError: ``model`` is not a ModelProto, an opset < 7 model the version converter cannot
            upgrade, or a pass needs information the model lacks.
    """
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"normalize() takes an onnx.ModelProto, got {type(model).__name__}")
    before = _all_tensor_names(model.graph)
    identity_pairs = _identity_aliases(model.graph)
    standard = any(n.domain in _STANDARD_DOMAINS for n in model.graph.node)
    opset = _opset(model) if standard or any(o.domain in _STANDARD_DOMAINS for o in model.opset_import) else None
    work = _copy(model)
    if opset is not None and opset < 7:
        work = _upgrade_opset(work, opset)

    out = _ir_passes(_castlike_to_cast(work))
    _drop_trailing_empty_inputs(out.graph)
    _scalar_axes_to_1d(out.graph)
    _constants_as_tensors(out.graph)
    out = _infer(out)
    _resolve_auto_pad(out)
    aliases: dict[str, str | None] = {}
    if fold_batchnorm:
        _fold_batchnorm(out, aliases)
    _name_nodes(out.graph)
    del out.graph.value_info[:]
    out = _infer(out)
    _complete_conv_ranks(out)
    out = _infer(out)

    after = _all_tensor_names(out.graph)
    for name in sorted(before - after):
        if name in aliases:
            continue
        # follow Identity chains to a survivor
        todo, seen, found = [name], {name}, None
        while todo and found is None:
            cur = todo.pop()
            for nxt in sorted(identity_pairs.get(cur, ())):
                if nxt in after:
                    found = nxt
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        aliases[name] = found
    for name, target in list(aliases.items()):
        while target is not None and target not in after:
            target = aliases.get(target)
        aliases[name] = target
    return out, aliases


def normalize(model: onnx.ModelProto, *, fold_batchnorm: bool = False) -> onnx.ModelProto:
    """Return a normalized copy of ``model``: constants as initializers, folded, typed, uniquely named.

    The passes are listed in this module's docstring. The input model is never mutated. Names of the
    tensors that survive are preserved (quantization configs refer to them); see
    :func:`normalize_with_aliases` for what disappeared.

    Args:
        model: the ONNX model.
        fold_batchnorm: fold inference BatchNormalization into the preceding single-consumer Conv
            (float64 arithmetic, result in the weight's dtype).

    Returns:
        A new ``onnx.ModelProto`` with ``value_info`` for every tensor shape inference can type.

    Raises:
        ModelError: not a ModelProto, an opset < 7 model that cannot be upgraded to 7, failing shape
            inference, or ``auto_pad=VALID`` on a node of unknown spatial rank.
    """
    return normalize_with_aliases(model, fold_batchnorm=fold_batchnorm)[0]
