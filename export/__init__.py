"""Export: write a QuantizedModel's quantizers and weights back into its ONNX graph (docs/operators.md).

Installed as ``qtorch_onnx.export``. The exported model is the normalized input model with quantizer nodes
on the quantized tensors and the current (possibly finetuned) weights:

* integer activations: ``QuantizeLinear -> DequantizeLinear`` (default domain; ``com.microsoft`` when the
  model's opset is below 21 and a 4- or 16-bit type is used, or below 13 and an axis is needed);
* integer weights: quantized initializer -> ``DequantizeLinear`` (per tensor or per channel);
* INT32 bias: int32 initializer -> ``DequantizeLinear``;
* INT32 / UINT32 activations: ``com.amd.quark::ExtendedQuantizeLinear -> ExtendedDequantizeLinear`` (the
  zero point's dtype selects the type);
* BF16 / FP16, Q/DQ form (``FakeQuantize.float_form == "qdq"``, Quark's default): ExtendedQuantizeLinear ->
  ExtendedDequantizeLinear with a bfloat16 / float16 zero point (weights: the 16-bit initializer ->
  ExtendedDequantizeLinear);
* BF16 / FP16, Cast form (``BF16QDQToCast``, and scaled FP16): ``[Mul(1/scale)] -> [Clip] ->
  Cast(to=BFLOAT16|FLOAT16) -> Cast(to=FLOAT) -> [Mul(scale)]``; weights are stored in the 16-bit type and
  Cast back to float;
* BFP / BFP-prime (BFP16, MX4/MX6/MX9): ``com.amd.quark::BFPQuantizeDequantize``; OCP MX (MXINT8, MXFP8/6/4):
  ``com.amd.quark::MXQuantizeDequantize``; on weights the float initializer stays and feeds the node (the
  formats have no storage type in ONNX), as Quark writes them.

The ``com.amd.quark`` nodes run in ONNX Runtime with the project's operator library
(:func:`qtorch_onnx.get_library_path`) or Quark's.

The producer's output of a quantized activation ``T`` is renamed ``T_QuantizeInput``; the DequantizeLinear
(or last node of the Cast form) writes ``T`` again, so consumers, graph outputs and value_info keep their
names.

Two quantizer kinds on one tensor (precision boundaries of layer-wise mixed precision,
``placement.QuantSpec.consumer``): a consumer-side quantizer of ``T`` for node ``N`` is written right before
``N`` and only ``N`` reads its output ``<T>_<N>_Output``; its input is ``T`` after ``T``'s own quantizer
(``DualQuantNodes``: e.g. ``ExtendedQuantizeLinear -> ExtendedDequantizeLinear -> BFPQuantizeDequantize ->
Conv``) or the float ``T`` (``T_QuantizeInput``) beside it.
"""
from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from qtorch_onnx.errors import ExportError
from qtorch_onnx.fakequant import FakeQuantize
from qtorch_onnx.formats import floating as _floating
from qtorch_onnx.formats import integer as _integer
from qtorch_onnx.formats.spec import FloatFormat, IntFormat, check_family_table
from qtorch_onnx.lift.normalize import (external_span, is_unloaded, large_initializers, read_external_bytes,
                                       read_initializer)

__all__ = ["export", "QuantizerNodes", "quantizer_submodel", "save_model_atomic", "save_bytes_atomic", "safe_name",
           "QUARK_DOMAIN"]

#: custom operator domain of Quark 0.13 and of this project's operator library (docs/operators.md)
QUARK_DOMAIN = "com.amd.quark"

@dataclass
class QuantizerNodes:
    """Where one quantizer lives in the exported graph: its float input, its output, and its nodes."""

    tensor: str
    role: str
    input: str
    output: str
    nodes: List[str] = field(default_factory=list)
    initializers: List[str] = field(default_factory=list)


def _opset(model: onnx.ModelProto, domain: str = "") -> int:
    for o in model.opset_import:
        if o.domain in (domain, "ai.onnx" if domain == "" else domain):
            return o.version
    return 0


_PROTO_LIMIT = 2_000_000_000  # protobuf cannot serialize a message of 2 GiB: larger models need external data


def _initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def save_model_atomic(model: onnx.ModelProto, path: Union[str, os.PathLike], *,
                      external_data: Optional[bool] = None) -> None:
    """Write ``model`` to ``path`` atomically (temporary file in the same folder, then ``os.replace``), with the
    permissions a plain ``open(path, "wb")`` would give (the user's umask).

    Args:
        external_data: True: the initializers go to one external data file ``<file name>.data`` beside ``path``
            (ONNX's external data format; Quark's ``use_external_data_format``), written and renamed before the
            model file. None: only when the initializers exceed protobuf's 2 GiB limit. ``model`` itself is not
            changed (a copy is converted).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    if external_data is None:
        external_data = _initializer_bytes(model) > _PROTO_LIMIT
    if not external_data:
        save_bytes_atomic(model.SerializeToString(), path)
        return
    umask = os.umask(0)
    os.umask(umask)
    location = os.path.basename(path) + ".data"
    work = tempfile.mkdtemp(prefix=".tmp_", dir=folder)
    try:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save_model(copy, os.path.join(work, "model.onnx"), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=location, size_threshold=1024)
        for name in (location, "model.onnx"):
            if os.path.exists(os.path.join(work, name)):
                os.chmod(os.path.join(work, name), 0o666 & ~umask)
        if os.path.exists(os.path.join(work, location)):
            os.replace(os.path.join(work, location), os.path.join(folder, location))
        os.replace(os.path.join(work, "model.onnx"), path)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


#: tensors of at least this many bytes (raw data plus Python's bytes header, onnx's rule) go to the external data
#: file; smaller ones stay in the model file (onnx.save_model's ``size_threshold=1024``)
_EXTERNAL_THRESHOLD = 1024


class _ExternalDataWriter:
    """Writes initializers one at a time into an external data file (ONNX's external data format) and returns the
    tensors that reference them: the streaming export of models past protobuf's limit, which never holds more
    than one tensor's bytes besides the torch model.

    Args:
        work: folder of the temporary files (in the output's folder). location: the data file's name beside the
            model (``<model file name>.data``), as the written tensors record it.
    """

    def __init__(self, work: str, location: str) -> None:
        self.location = location
        self.path = os.path.join(work, location)
        self._f = open(self.path, "wb")
        self.offset = 0

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def wanted(nbytes: int) -> bool:
        return nbytes + sys.getsizeof(b"") >= _EXTERNAL_THRESHOLD

    def _stub(self, name: str, data_type: int, dims, length: int) -> TensorProto:
        t = TensorProto(name=name, data_type=data_type, dims=list(dims), data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(length))):
            t.external_data.add(key=key, value=value)
        self.offset += length
        return t

    def write_array(self, name: str, value: np.ndarray) -> TensorProto:
        """``value`` (numpy, ONNX layout) as the initializer ``name``: its bytes written once (little-endian),
        without a TensorProto copy for plain numeric dtypes."""
        dtype = value.dtype
        if dtype.kind not in "fiub" or not dtype.isnative or sys.byteorder != "little":
            return self.write_proto(numpy_helper.from_array(value, name))  # ml_dtypes types, big-endian
        data_type = helper.np_dtype_to_tensor_dtype(dtype)
        arr = np.ascontiguousarray(value)
        self._f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        return self._stub(name, data_type, value.shape, arr.nbytes)

    def write_proto(self, t: TensorProto) -> TensorProto:
        """An in-memory initializer with raw data, written out (``t`` is not modified)."""
        self._f.write(t.raw_data)
        out = self._stub(t.name, t.data_type, t.dims, len(t.raw_data))
        if t.doc_string:
            out.doc_string = t.doc_string
        return out

    def copy_unloaded(self, t: TensorProto) -> TensorProto:
        """An initializer still in the input model's external data file (streaming): its bytes copied over in
        slices of 64 MiB (read errors name the tensor and the file)."""
        src, offset, length = external_span(t)
        out = self._stub(t.name, t.data_type, t.dims, length)
        step = 64 << 20
        for start in range(0, length, step):
            n = min(step, length - start)
            part = TensorProto(name=t.name, data_location=TensorProto.EXTERNAL)
            for key, value in (("location", src), ("offset", str(offset + start)), ("length", str(n))):
                part.external_data.add(key=key, value=value)
            self._f.write(memoryview(read_external_bytes(part)))
        return out

    def put(self, t: TensorProto) -> TensorProto:
        """``t`` itself when it stays in the model file (small, or not raw data), else written out."""
        if is_unloaded(t):
            return self.copy_unloaded(t)
        if t.HasField("raw_data") and self.wanted(len(t.raw_data)):
            return self.write_proto(t)
        return t


def _streams(model: onnx.ModelProto) -> bool:
    """Whether export writes ``model`` tensor by tensor (:class:`_ExternalDataWriter`): a model past protobuf's
    limit (:func:`qtorch_onnx.lift.normalize.large_initializers`) or one with initializers still in their
    external data file (lifted from a path, streaming)."""
    return bool(large_initializers(model)) or any(is_unloaded(t) for t in model.graph.initializer)


def _load_unloaded(model: onnx.ModelProto) -> None:
    """Read every initializer of ``model`` still in its external data file into the model (in place)."""
    for t in model.graph.initializer:
        if is_unloaded(t):
            t.CopyFrom(numpy_helper.from_array(read_initializer(t), t.name))


def save_bytes_atomic(data: bytes, path: Union[str, os.PathLike]) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, then ``os.replace``), with the
    permissions a plain ``open(path, "wb")`` would give (the user's umask)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy, bfloat16 as ml_dtypes.bfloat16 (bit-exact)."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def _weight_integers(qm, tensor: str, fq: FakeQuantize) -> Optional[np.ndarray]:
    """The integers an integer weight quantizer stores, computed where the emulation computes them: from the
    live parameter in the torch module's layout (so a rounding hook's hard result is what gets written),
    then put in the ONNX layout."""
    from qtorch_onnx.training import initializer_locations, live_value, to_onnx_layout

    init = next((t for t in qm.onnx_model.graph.initializer if t.name == tensor), None)
    for module, attr, perm in initializer_locations(qm, tensor):
        value = live_value(module, attr)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            q = _quantize_integer_in_slices(fq, value.detach())
            return to_onnx_layout(q.cpu(), perm, tuple(init.dims)).numpy() if init is not None else q.cpu().numpy()
    return None


#: a weight with more elements than this is quantized for export slice by slice (bounded temporaries)
SLICE_ELEMENTS = 1 << 22


def _quantize_integer_in_slices(fq: FakeQuantize, value: torch.Tensor) -> torch.Tensor:
    """``fq.quantize_integer(value)``, computed over slices of at most about :data:`SLICE_ELEMENTS` elements
    along a dimension that is not the quantization axis and stored in the narrowest torch integer dtype holding
    the format (int8 / uint8 / int16 / int32 / int64), so the float temporaries of the quantization formula are
    bounded by a slice instead of several copies of the weight. Element-wise, so the same integers as one call.
    A weight that cannot be sliced (a rounding hook reads the whole tensor, per-channel on its only dimension,
    or a small weight) is quantized in one call."""
    fmt = fq.fmt
    per_channel = fq.scale.dim() > 0
    if value.numel() <= SLICE_ELEMENTS or fq.rounding is not None or fq.role == "bias" or value.dim() == 0 \
            or (per_channel and fq.axis is None):
        return fq.quantize_integer(value)
    dims = [d for d in range(value.dim()) if not (per_channel and d == fq.axis % value.dim())]
    if not dims:
        return fq.quantize_integer(value)
    dim = dims[0]
    if fmt.bits <= 8:
        dtype = torch.int8 if fmt.signed else torch.uint8
    elif fmt.bits <= 16:
        dtype = torch.int16 if fmt.signed else torch.int32
    else:
        dtype = torch.int64
    out = torch.empty(value.shape, dtype=dtype)
    step = max(1, SLICE_ELEMENTS // max(1, value.numel() // value.shape[dim]))
    for start in range(0, value.shape[dim], step):
        part = value.narrow(dim, start, min(step, value.shape[dim] - start))
        out.narrow(dim, start, part.shape[dim]).copy_(fq.quantize_integer(part))
    return out


def export(qm, path: Union[str, os.PathLike, None] = None, *, return_map: bool = False, check: bool = True):
    """Write the quantized model as ONNX.

    Args:
        qm: a calibrated :class:`~qtorch_onnx.model.QuantizedModel`.
        path: output file (written atomically); None to only return the model.
        return_map: also return ``{tensor: QuantizerNodes}`` (used by the per-node parity checks).
        check: run ``onnx.checker.check_model(full_check=True)``.

    Returns:
        The exported ``onnx.ModelProto`` (and the map when ``return_map``).

    Raises:
        ExportError: a quantizer is not calibrated; a scale that training made zero, negative or NaN (names
            the tensor); a quantized graph input that is also a graph output; per-channel BF16/FP16 scales in
            the Cast form; the result fails ``onnx.checker`` (with ``check``). Nothing is written then.
        OSError: ``path`` cannot be written (an existing file is left as it was).

    The ``com.amd.quark`` nodes it may write (BFP/MX formats, INT32 and BF16/FP16 Q/DQ) need the project's
    operator library in ONNX Runtime (:func:`qtorch_onnx.get_library_path`; docs/operators.md).

    Models past protobuf's limit, and models lifted from a path with their large initializers left in the
    external data file (streaming, :func:`qtorch_onnx.lift.load_model`), are written with ``path`` tensor by
    tensor into ``<file name>.data`` (ONNX's external data format, whatever ``use_external_data_format`` says):
    each weight is quantized in slices and its bytes written once, no ModelProto holds the weights, and the
    checker runs on the written files. The returned ModelProto then references that data file (relative
    location, as in the file; ``onnx.load(path)`` reads it with the data). Without ``path``, initializers still
    in their input file are read into the returned model.
    """
    if path is None or not _streams(qm.onnx_model):
        return _export(qm, path, return_map, check, None)
    import shutil

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tmp_", dir=folder)
    try:
        sink = _ExternalDataWriter(work, os.path.basename(path) + ".data")
        try:
            return _export(qm, path, return_map, check, sink)
        finally:
            sink.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _export(qm, path, return_map: bool, check: bool, sink: Optional["_ExternalDataWriter"]):
    """:func:`export`; with ``sink``, large initializers go to its data file as they are made, and the files
    are checked and moved into place at the end (streaming)."""
    from qtorch_onnx.training import live_initializers

    model = onnx.ModelProto()
    model.CopyFrom(qm.onnx_model)
    if sink is None:
        _load_unloaded(model)
    graph = model.graph
    fqs: Dict[str, FakeQuantize] = qm.quantizers()
    qm.sync_qparams()  # derived state (weight qparams, INT32 bias scales) from the live parameters
    for fq in fqs.values():
        if fq.calibrated:
            fq.check_qparams()
    current = {name: _to_numpy(t) for name, t in live_initializers(qm).items()}
    inits = {t.name: t for t in graph.initializer}
    # a weight with its own quantizer is replaced by the quantizer's initializers below (from ``current``):
    # its float value is never written
    replaced = {k for k, fq in fqs.items() if fq.consumer is None and k in inits}
    for name, value in current.items():
        if name in replaced:
            continue
        old = inits[name]
        if sink is not None and sink.wanted(value.nbytes):
            old.CopyFrom(sink.write_array(name, value))
        else:
            old.CopyFrom(numpy_helper.from_array(value, name))

    opset = _opset(model)
    integer = [f for f in fqs.values() if f.fmt.family.integer_grid]
    needs_4 = any(f.fmt.bits == 4 for f in integer)
    if needs_4 and model.ir_version < 10:
        model.ir_version = 10  # INT4/UINT4 tensors need IR version 10
    needs_16 = any(f.fmt.bits in (4, 16) for f in integer)
    needs_axis = any(f.scale.dim() > 0 for f in integer)
    use_ms = (needs_16 and opset < 21) or (needs_axis and opset < 13) or opset < 10
    qdomain = "com.microsoft" if use_ms else ""
    if use_ms and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))

    producer: Dict[str, onnx.NodeProto] = {}
    for n in graph.node:
        for o in n.output:
            producer[o] = n
    graph_inputs = {i.name for i in graph.input}
    new_nodes: Dict[str, List[onnx.NodeProto]] = {}  # inserted after the producer (or at the front)
    front: List[onnx.NodeProto] = []
    qmap: Dict[str, QuantizerNodes] = {}
    consumers_rewire: Dict[str, str] = {}

    edge_fqs = {k: fq for k, fq in fqs.items() if fq.consumer is not None}
    taken = _graph_names(graph)

    def claim(base: str, make):
        """Run ``make(base)`` with the first of ``base``, ``base_1``, ... whose new names collide with no name of
        the graph (a tensor ``ln`` and an initializer ``ln_scale`` must not both give ``ln_scale``)."""
        k = 0
        while True:
            b = base if k == 0 else f"{base}_{k}"
            nodes, new_inits, qn = make(b)
            new = [i.name for i in new_inits] + [n.name for n in nodes] + \
                [o for n in nodes for o in n.output if o != qn.output]
            if not (set(new) & taken) and len(set(new)) == len(new):
                taken.update(new)
                return nodes, new_inits, qn
            k += 1

    for tensor, fq in fqs.items():
        if fq.consumer is not None:
            continue
        fmt = fq.fmt
        if not fq.calibrated:
            raise ExportError(f"quantizer on tensor {tensor!r} is not calibrated: run calibrate() before export")
        base = safe_name(tensor)
        is_init = tensor in inits
        if is_init:
            value = current.get(tensor)
            if value is None:
                value = read_initializer(inits[tensor])  # numpy_helper.to_array, or from its file
            value = np.asarray(value, dtype=np.float32)
            qint = _weight_integers(qm, tensor, fq) if fmt.family.integer_grid else None
            nodes, new_inits, qn = claim(base, lambda b: _weight_nodes(tensor, b, value, fq, qdomain, qint))
            del value, qint
            if sink is not None:
                new_inits = [sink.put(t) for t in new_inits]
            graph.initializer.remove(inits[tensor])
            graph.initializer.extend(new_inits)
            front.extend(nodes)
        else:
            if tensor in producer:
                src = f"{tensor}_QuantizeInput"
                p = producer[tensor]
                for k, o in enumerate(p.output):
                    if o == tensor:
                        p.output[k] = src
                out = tensor
            elif tensor in graph_inputs:
                src, out = tensor, f"{tensor}_DequantizeLinear_Output"
                consumers_rewire[tensor] = out
            else:
                raise ExportError(f"tensor {tensor!r} is neither produced by a node nor a graph input")
            nodes, new_inits, qn = claim(base, lambda b: _activation_nodes(tensor, b, src, out, fq, qdomain))
            graph.initializer.extend(new_inits)
            if tensor in producer:
                new_nodes.setdefault(producer[tensor].name, []).extend(nodes)
            else:
                front.extend(nodes)
        qmap[tensor] = qn

    # consumer-side quantizers (precision boundaries): nodes right before their consumer, which reads their output
    before: Dict[str, List[onnx.NodeProto]] = {}
    edge_rewire: Dict[str, Dict[str, str]] = {}
    for key, fq in edge_fqs.items():
        tensor = fq.tensor_name
        if not fq.calibrated:
            raise ExportError(f"quantizer {key!r} is not calibrated: run calibrate() before export")
        own = qmap.get(tensor)
        read = consumers_rewire.get(tensor, tensor)  # what the consumer reads after the own quantizer
        src = own.input if (own is not None and not fq.chained) else read
        base = safe_name(f"{tensor}_{fq.consumer}")
        out = f"{base}_Output"
        while out in taken:
            out = f"{out}_1"
        taken.add(out)
        nodes, new_inits, qn = claim(base, lambda b: _activation_nodes(key, b, src, out, fq, qdomain))
        graph.initializer.extend(new_inits)
        before.setdefault(fq.consumer, []).extend(nodes)
        edge_rewire.setdefault(fq.consumer, {})[read] = out
        qmap[key] = qn

    # rebuild the node list: inserted nodes right after their producers (keeps topological order)
    ordered: List[onnx.NodeProto] = list(front)
    for n in graph.node:
        if consumers_rewire:
            for k, i in enumerate(n.input):
                if i in consumers_rewire:
                    n.input[k] = consumers_rewire[i]
        if n.name in edge_rewire:
            for k, i in enumerate(n.input):
                n.input[k] = edge_rewire[n.name].get(i, i)
        ordered.extend(before.get(n.name, []))
        ordered.append(n)
        ordered.extend(new_nodes.get(n.name, []))
    for o in graph.output:
        if o.name in consumers_rewire:
            raise ExportError(f"graph input {o.name!r} is also a graph output; quantizing it is not supported")
    del graph.node[:]
    graph.node.extend(ordered)
    for dom in (QUARK_DOMAIN, "com.microsoft"):
        if any(n.domain == dom for n in ordered) and not any(o.domain == dom for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(dom, 1))
    if sink is not None:
        _save_streamed(model, path, sink, check)
        return (model, qmap) if return_map else model
    too_big = _initializer_bytes(model) > _PROTO_LIMIT
    graph_settings = getattr(getattr(qm, "config", None), "graph", None)  # a ResolvedConfig's GraphSettings
    external = bool(getattr(graph_settings, "use_external_data_format", False)) or too_big
    if check and not too_big:  # the checker serializes the model
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as exc:
            raise ExportError(f"exported model fails onnx.checker: {exc}") from exc
    if path is not None:
        save_model_atomic(model, path, external_data=external)
    return (model, qmap) if return_map else model


def _save_streamed(model: onnx.ModelProto, path: str, sink: "_ExternalDataWriter", check: bool) -> None:
    """The end of a streaming export: every initializer still in memory above the size threshold, or still in
    the input's data file, goes to the data file (in place on ``model``); the model file is written beside it
    in the temporary folder, checked there (``onnx.checker`` on the path: it reads no tensor data), then the
    data file and the model file are renamed into place, in that order.

    Raises:
        ExportError: the written model fails ``onnx.checker`` (with ``check``); nothing is moved into place.
    """
    for t in model.graph.initializer:
        out = sink.put(t)
        if out is not t:
            t.CopyFrom(out)
    sink.close()
    umask = os.umask(0)
    os.umask(umask)
    work = os.path.dirname(sink.path)
    tmp_model = os.path.join(work, "model.onnx")
    with open(tmp_model, "wb") as f:
        f.write(model.SerializeToString())
    if check:
        try:
            onnx.checker.check_model(tmp_model, full_check=True)
        except Exception as exc:
            raise ExportError(f"exported model fails onnx.checker: {exc}") from exc
    folder = os.path.dirname(os.path.abspath(path))
    for name in (sink.location, "model.onnx"):
        os.chmod(os.path.join(work, name), 0o666 & ~umask)
    os.replace(sink.path, os.path.join(folder, sink.location))
    os.replace(tmp_model, path)


def _graph_names(graph: onnx.GraphProto) -> set:
    """Every tensor and node name of a graph (to keep the names export adds unique)."""
    names = {t.name for t in graph.initializer} | {v.name for v in graph.input} | {v.name for v in graph.output}
    names |= {v.name for v in graph.value_info}
    for n in graph.node:
        names.add(n.name)
        names.update(i for i in n.input if i)
        names.update(o for o in n.output if o)
    return names


def safe_name(name: str) -> str:
    """ONNX tensor name -> the stem used for names of the nodes and initializers export adds."""
    return name.replace(":", "_").replace("/", "_")


def _as_imported(fq: FakeQuantize, scale: np.ndarray, zp: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Scale and zero point in the shapes an imported model stored them (``fq.qparam_shapes``, e.g. Quark's
    ``[1]`` scale beside a ``[]`` zero point), when the element counts allow it."""
    shapes = fq.qparam_shapes
    if shapes is None:
        return scale, zp
    s_shape, z_shape = shapes
    if int(np.prod(s_shape)) == scale.size:
        scale = scale.reshape(s_shape)
    if int(np.prod(z_shape)) == zp.size:
        zp = zp.reshape(z_shape)
    return scale, zp


def _qparam_inits(base: str, fq: FakeQuantize) -> Tuple[List[TensorProto], str, str]:
    fmt: IntFormat = fq.fmt
    scale = fq.scale.detach().cpu().numpy().astype(np.float32)
    zp = fq.zero_point.detach().cpu().numpy().astype(fmt.numpy_dtype)
    scale, zp = _as_imported(fq, scale, zp)
    s_name, z_name = f"{base}_scale", f"{base}_zero_point"
    return [numpy_helper.from_array(scale, s_name), numpy_helper.from_array(zp, z_name)], s_name, z_name


def _axis_attrs(fq: FakeQuantize) -> dict:
    return {"axis": int(fq.onnx_axis)} if fq.scale.dim() > 0 and fq.onnx_axis is not None else {}


def _block_node(base: str, src: str, out: str, fq: FakeQuantize) -> onnx.NodeProto:
    """``BFPQuantizeDequantize`` / ``MXQuantizeDequantize`` (the family's operator) with every attribute of the
    format written out, the prime-only BFP ones too, as Quark writes them (docs/operators.md)."""
    fmt = fq.fmt
    op = fmt.family.onnx_ops[0]
    attrs = {f.name: (getattr(fmt, f.name) if isinstance(getattr(fmt, f.name), str) else int(getattr(fmt, f.name)))
             for f in fields(fmt)}
    if fq.onnx_axis is not None:
        attrs["axis"] = int(fq.onnx_axis)
    return helper.make_node(op, [src], [out], name=f"{base}_{op}", domain=QUARK_DOMAIN, **attrs)


def _uses_extended(fq: FakeQuantize) -> bool:
    """Formats written as com.amd.quark ExtendedQuantizeLinear/ExtendedDequantizeLinear."""
    fmt = fq.fmt
    if fmt.family.integer_grid:
        return fmt.bits == 32 and fq.role == "activation"
    return fmt.family.name == "float" and fq.float_form == "qdq"


def _extended_qparam_inits(base: str, fq: FakeQuantize) -> Tuple[List[TensorProto], str, str]:
    """Scale (float32) and zero point (the target type: int32/uint32, bfloat16 or float16 +0.0)."""
    fmt = fq.fmt
    if fmt.family.integer_grid:
        return _qparam_inits(base, fq)
    scale = fq.scale.detach().cpu().numpy().astype(np.float32)
    s_name, z_name = f"{base}_scale", f"{base}_zero_point"
    if fmt.kind == "BF16":
        import ml_dtypes

        zp = np.zeros(scale.shape, dtype=ml_dtypes.bfloat16)
    else:
        zp = np.zeros(scale.shape, dtype=np.float16)
    scale, zp = _as_imported(fq, scale, zp)
    return [numpy_helper.from_array(scale, s_name), numpy_helper.from_array(zp, z_name)], s_name, z_name


def _activation_nodes(tensor, base, src, out, fq: FakeQuantize, qdomain):
    """The nodes that quantize-dequantize a tensor computed by the graph (``src`` -> ``out``): the format
    family's writer (:data:`_ACTIVATION_WRITERS`). Returns (nodes, new initializers, QuantizerNodes)."""
    return _ACTIVATION_WRITERS[fq.fmt.family.name](tensor, base, src, out, fq, qdomain)


def _block_activation(tensor, base, src, out, fq: FakeQuantize, qdomain):
    qn = QuantizerNodes(tensor, fq.role, src, out)
    node = _block_node(base, src, out, fq)
    qn.nodes = [node.name]
    return [node], [], qn


def _float_activation(tensor, base, src, out, fq: FakeQuantize, qdomain):
    """BF16/FP16: the Extended Q/DQ pair, or the Cast form (docs/numerics.md section 3)."""
    if _uses_extended(fq):
        return _qdq_pair(tensor, base, src, out, fq, qdomain)
    return _cast_form(tensor, base, src, out, fq, QuantizerNodes(tensor, fq.role, src, out))


def _qdq_pair(tensor, base, src, out, fq: FakeQuantize, qdomain):
    """QuantizeLinear -> DequantizeLinear (ONNX or com.microsoft domain), or the com.amd.quark Extended pair
    for INT32 activations and BF16/FP16 (:func:`_uses_extended`)."""
    qn = QuantizerNodes(tensor, fq.role, src, out)
    ext = _uses_extended(fq)
    inits, s, z = _extended_qparam_inits(base, fq) if ext else _qparam_inits(base, fq)
    q_op, dq_op = ("ExtendedQuantizeLinear", "ExtendedDequantizeLinear") if ext else ("QuantizeLinear", "DequantizeLinear")
    domain = QUARK_DOMAIN if ext else (fq.qdq_domain if fq.qdq_domain is not None else qdomain)
    qname, dqname = f"{base}_{q_op}", f"{base}_{dq_op}"
    nodes = [
        helper.make_node(q_op, [src, s, z], [f"{base}_{q_op}_Output"], name=qname, domain=domain,
                         **_axis_attrs(fq)),
        helper.make_node(dq_op, [f"{base}_{q_op}_Output", s, z], [out], name=dqname, domain=domain,
                         **_axis_attrs(fq)),
    ]
    qn.nodes = [qname, dqname]
    qn.initializers = [s, z]
    return nodes, inits, qn


def _cast_form(tensor, base, src, out, fq: FakeQuantize, qn: QuantizerNodes):
    fmt: FloatFormat = fq.fmt
    to = TensorProto.BFLOAT16 if fmt.kind == "BF16" else TensorProto.FLOAT16
    scale = float(fq.scale.detach().cpu().reshape(-1)[0]) if fq.scale.numel() == 1 else None
    if scale is None:
        raise ExportError(f"tensor {tensor!r}: per-channel BF16/FP16 scales cannot be exported in the Cast form")
    nodes, inits = [], []
    cur = src
    if scale != 1.0:
        inv = np.array(1.0 / np.float32(scale), dtype=np.float32)
        inits.append(numpy_helper.from_array(inv, f"{base}_inv_scale"))
        nodes.append(helper.make_node("Mul", [cur, f"{base}_inv_scale"], [f"{base}_scaled"], name=f"{base}_MulInvScale"))
        cur = f"{base}_scaled"
    if fmt.kind == "FP16":
        lo, hi = np.array(-65504.0, np.float32), np.array(65504.0, np.float32)
        inits += [numpy_helper.from_array(lo, f"{base}_fp16_min"), numpy_helper.from_array(hi, f"{base}_fp16_max")]
        nodes.append(helper.make_node("Clip", [cur, f"{base}_fp16_min", f"{base}_fp16_max"], [f"{base}_clipped"],
                                      name=f"{base}_ClipFP16"))
        cur = f"{base}_clipped"
    last = out if scale == 1.0 else f"{base}_Cast_Output"
    nodes.append(helper.make_node("Cast", [cur], [f"{base}_{fmt.kind}"], to=to, name=f"{base}_Cast{fmt.kind}"))
    nodes.append(helper.make_node("Cast", [f"{base}_{fmt.kind}"], [last], to=TensorProto.FLOAT, name=f"{base}_CastFloat"))
    if scale != 1.0:
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), f"{base}_scale"))
        nodes.append(helper.make_node("Mul", [last, f"{base}_scale"], [out], name=f"{base}_MulScale"))
    qn.nodes = [n.name for n in nodes]
    qn.initializers = [i.name for i in inits]
    return nodes, inits, qn


def _weight_nodes(tensor, base, value: np.ndarray, fq: FakeQuantize, qdomain, qint: Optional[np.ndarray] = None):
    """The initializers and nodes that replace a quantized initializer ``tensor`` (float32 ``value``, ONNX
    layout): the format family's writer (:data:`_WEIGHT_WRITERS`); ``qint`` are an integer weight's exported
    integers when a rounding hook or the sliced quantization decided them. Returns (nodes, new initializers,
    QuantizerNodes)."""
    if fq.weight_storage == "float" and not fq.fmt.family.block:
        # the float initializer feeds the quantizer's nodes, as an activation's value would
        nodes, inits, qn = _activation_nodes(tensor, base, f"{base}_float", tensor, fq, qdomain)
        qn.role = fq.role
        qn.initializers = [f"{base}_float"] + qn.initializers
        return nodes, [numpy_helper.from_array(np.ascontiguousarray(value, dtype=np.float32), f"{base}_float")] + inits, qn
    return _WEIGHT_WRITERS[fq.fmt.family.name](tensor, base, value, fq, qdomain, qint)


def _float32_copy(value: np.ndarray) -> torch.Tensor:
    """A float32 torch copy of a weight's value, made only where a writer computes on it (models past 2 GiB)."""
    return torch.from_numpy(np.array(value, dtype=np.float32, copy=True))


def _block_weight(tensor, base, value, fq: FakeQuantize, qdomain, qint):
    """Block formats keep the float initializer, read through the block operator."""
    qn = QuantizerNodes(tensor, fq.role, f"{base}_float", tensor)
    node = _block_node(base, qn.input, tensor, fq)
    qn.nodes = [node.name]
    qn.initializers = [qn.input]
    return [node], [numpy_helper.from_array(np.ascontiguousarray(value, dtype=np.float32), qn.input)], qn


def _integer_weight(tensor, base, value, fq: FakeQuantize, qdomain, qint):
    """The quantized integers (``qint`` when given) -> DequantizeLinear (docs/operators.md)."""
    fmt = fq.fmt
    qn = QuantizerNodes(tensor, fq.role, f"{base}_quantized", tensor)
    axis = fq.onnx_axis if fq.scale.dim() > 0 else None
    scale, zp = fq.scale.detach().cpu(), fq.zero_point.detach().cpu()
    if qint is not None:
        q = torch.from_numpy(np.asarray(qint))
    elif fq.role == "bias" and fmt.bits == 32:
        q = _integer.quantize_bias(_float32_copy(value), scale)
    else:
        q = _integer.quantize(_float32_copy(value), scale, zp, fmt, axis=axis, narrow_range=fq.narrow_range)
    qarr = q.cpu().numpy().astype(fmt.numpy_dtype, copy=False)  # already that dtype when sliced
    inits, s, z = _qparam_inits(base, fq)
    inits.insert(0, numpy_helper.from_array(qarr, f"{base}_quantized"))
    dq = helper.make_node("DequantizeLinear", [f"{base}_quantized", s, z], [tensor], name=f"{base}_DequantizeLinear",
                          domain=fq.qdq_domain if fq.qdq_domain is not None else qdomain, **_axis_attrs(fq))
    qn.nodes = [dq.name]
    qn.initializers = [i.name for i in inits]
    return [dq], inits, qn


def _float_weight(tensor, base, value, fq: FakeQuantize, qdomain, qint):
    """BF16/FP16 weights stored in the 16-bit type: ExtendedDequantizeLinear (Q/DQ form), or Cast back to
    float times the scale (Cast form; docs/numerics.md section 3)."""
    fmt: FloatFormat = fq.fmt
    qn = QuantizerNodes(tensor, fq.role, f"{base}_quantized", tensor)
    if fq.float_form == "qdq":
        inits, s, z = _extended_qparam_inits(base, fq)
        axis = fq.onnx_axis if fq.scale.dim() > 0 else None  # the initializer is in ONNX layout
        if fmt.kind == "BF16":
            import ml_dtypes

            q = _floating.bf16_quantize(_float32_copy(value), fq.scale.detach().cpu(), None, axis)
            stored = q.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            stored = _floating.fp16_quantize(_float32_copy(value)).numpy()
        inits.insert(0, numpy_helper.from_array(np.ascontiguousarray(stored), f"{base}_quantized"))
        dq = helper.make_node("ExtendedDequantizeLinear", [f"{base}_quantized", s, z], [tensor],
                              name=f"{base}_ExtendedDequantizeLinear", domain=QUARK_DOMAIN, **_axis_attrs(fq))
        qn.nodes = [dq.name]
        qn.initializers = [i.name for i in inits]
        return [dq], inits, qn
    scale = float(fq.scale.detach().cpu().reshape(-1)[0])
    x = _float32_copy(value)
    v = x if scale == 1.0 else x * torch.tensor(np.float32(1.0) / np.float32(scale))
    if fmt.kind == "BF16":
        import ml_dtypes

        stored = _floating.bf16_round(v).numpy().astype(ml_dtypes.bfloat16)
        t = numpy_helper.from_array(stored, f"{base}_quantized")
    else:
        stored = _floating.fp16_round(v).numpy().astype(np.float16)
        t = numpy_helper.from_array(stored, f"{base}_quantized")
    inits = [t]
    nodes = []
    last = tensor if scale == 1.0 else f"{base}_Cast_Output"
    nodes.append(helper.make_node("Cast", [f"{base}_quantized"], [last], to=TensorProto.FLOAT, name=f"{base}_CastFloat"))
    if scale != 1.0:
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), f"{base}_scale"))
        nodes.append(helper.make_node("Mul", [last, f"{base}_scale"], [tensor], name=f"{base}_MulScale"))
    qn.nodes = [n.name for n in nodes]
    qn.initializers = [i.name for i in inits]
    return nodes, inits, qn


#: How each format family is written into the ONNX graph (the export half of the family table,
#: qtorch_onnx.formats.spec.FAMILIES): tensors computed by the graph, and initializers.
_ACTIVATION_WRITERS = check_family_table(
    {"integer": _qdq_pair, "float": _float_activation, "bfp": _block_activation, "mx": _block_activation},
    "export activation writers")
_WEIGHT_WRITERS = check_family_table(
    {"integer": _integer_weight, "float": _float_weight, "bfp": _block_weight, "mx": _block_weight},
    "export weight writers")


def quantizer_submodel(exported: onnx.ModelProto, qmap: Dict[str, QuantizerNodes], tensors: List[str]) -> onnx.ModelProto:
    """A model holding only the quantizer nodes of ``tensors``: inputs are their float inputs (named
    ``<tensor>__in``), outputs their quantized outputs (``<tensor>__out``). Used to check, node by node, that
    ONNX Runtime gives the emulation's bits for the emulation's input."""
    nodes_by_name = {n.name: n for n in exported.graph.node}
    inits_by_name = {t.name: t for t in exported.graph.initializer}
    g_nodes, g_inits, g_in, g_out = [], [], [], []
    for t in tensors:
        qn = qmap[t]
        has_input = qn.role == "activation"
        rename = {qn.output: f"{safe_name(t)}__out"}
        if has_input:
            rename[qn.input] = f"{safe_name(t)}__in"
        for nn_ in qn.nodes:
            n = onnx.NodeProto()
            n.CopyFrom(nodes_by_name[nn_])
            for k, i in enumerate(n.input):
                n.input[k] = rename.get(i, i)
            for k, o in enumerate(n.output):
                n.output[k] = rename.get(o, o)
            g_nodes.append(n)
        g_inits.extend(inits_by_name[i] for i in qn.initializers if i != qn.input or not has_input)
        if has_input:
            g_in.append(helper.make_tensor_value_info(f"{safe_name(t)}__in", TensorProto.FLOAT, None))
        g_out.append(helper.make_tensor_value_info(f"{safe_name(t)}__out", TensorProto.FLOAT, None))
    graph = helper.make_graph(g_nodes, "quantizers", g_in, g_out, g_inits)
    m = helper.make_model(graph, opset_imports=list(exported.opset_import))
    m.ir_version = exported.ir_version
    return m
