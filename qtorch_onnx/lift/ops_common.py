"""Registry helpers and small utilities shared by the converter modules (``converters.py``, ``ops_*.py``).

onnx2torch 1.5.15 registers converters per ``(domain, op_type, since_version)``; ``get_converter`` maps
a model's opset to the op schema's ``since_version`` and looks that key up; ``add_converter`` raises
``ValueError`` on a key that is already registered. We use only those two public functions:

* a key onnx2torch lacks is added with ``add_converter``;
* a key onnx2torch already has (its converter being wrong or too narrow) goes to :data:`OVERRIDES`.
  ``onnx2torch.convert`` would call its own converter for that key, so :func:`qtorch_onnx.lift.lift`
  re-spells the domain of every such node (on the copy it converts) to an alias domain for which a
  converter calling the override is registered with ``add_converter``
  (:func:`qtorch_onnx.lift.lifter._route_domains`): the override alone converts the node, before
  onnx2torch's converter could reject it, and may map the node's inputs as it likes.

Dtype convention (:data:`TORCH_DTYPE`, :func:`tensor_from_proto`): bfloat16 and float8 are torch's
dtypes of the same name, int4/int2 are held unpacked in int8, uint4/uint2 in uint8, float4/float6 as
uint8 bit codes.
"""
from __future__ import annotations

from typing import Callable, Iterable

import onnx
import torch
from onnx import defs, helper

from onnx2torch.node_converters.registry import add_converter, get_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OnnxToTorchModule, OperationConverterResult, onnx_mapping_from_node

__all__ = [
    "Converter", "OVERRIDES", "ConversionNotSupported", "since_version", "converter_for", "register_converter",
    "schema_versions", "register_versions", "attr", "const_ints", "const_tensor", "elem_type", "TORCH_DTYPE",
    "torch_dtype", "result", "OnnxMapping", "OnnxToTorchModule", "OperationConverterResult",
    "onnx_mapping_from_node", "OnnxNode", "OnnxGraph", "registered", "add_converter", "get_converter",
    "onnx2torch_converter", "tensor_from_proto",
]

Converter = Callable[[OnnxNode, OnnxGraph], OperationConverterResult]

#: ``(domain, op_type, since_version) -> converter`` replacing onnx2torch's registered (wrong) one.
OVERRIDES: dict[tuple[str, str, int], Converter] = {}
#: keys this package added with ``add_converter`` (so they are ours, not onnx2torch's)
_OURS: set[tuple[str, str, int]] = set()


class ConversionNotSupported(NotImplementedError):
    """A node of a supported op uses an attribute value or input form no converter handles."""


def since_version(op_type: str, opset: int, domain: str = "") -> int | None:
    """The ``since_version`` of ``op_type``'s schema in effect at ``opset``, or ``None`` if none exists."""
    try:
        return defs.get_schema(op_type, max_inclusive_version=opset, domain=domain).since_version
    except Exception:  # onnx raises SchemaError (a RuntimeError subclass) for unknown ops
        return None


def registered(op_type: str, version: int, domain: str = "") -> Converter | None:
    """The converter registered in onnx2torch's registry for ``op_type`` at opset ``version``, or None."""
    try:
        return get_converter(operation_type=op_type, version=version, domain=domain)
    except NotImplementedError:
        return None


def onnx2torch_converter(op_type: str, opset: int, domain: str = "") -> Converter | None:
    """onnx2torch's *own* converter for the key (not one we added), or ``None``."""
    v = since_version(op_type, opset, domain)
    key = (domain, op_type, v if v is not None else opset)
    if key in _OURS:
        return None
    return registered(op_type, opset, domain)


def converter_for(op_type: str, opset: int, domain: str = "") -> Converter | None:
    """The converter used for ``op_type`` at model opset ``opset`` (override first), or ``None``."""
    v = since_version(op_type, opset, domain)
    key = (domain, op_type, v if v is not None else opset)
    if key in OVERRIDES:
        return OVERRIDES[key]
    return registered(op_type, opset, domain)


def register_converter(op_type: str, versions: Iterable[int], domain: str = ""):
    """Decorator: use ``converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult`` for
    ``op_type`` at each of ``versions`` (schema since-versions; for a custom domain, its opset version).

    Versions onnx2torch does not know are added with its public ``add_converter``; versions it already
    has go to :data:`OVERRIDES`, which :func:`~qtorch_onnx.lift.lift` uses *instead of* onnx2torch's
    converter for those nodes (routed before conversion; onnx2torch's converter is never called on them,
    and the override may map the node's inputs differently).

    Raises:
        ValueError: a version was already added by this package (two converters for one key).
    """

    def deco(converter: Converter) -> Converter:
        for v in versions:
            key = (domain, op_type, v)
            if key in _OURS:
                raise ValueError(f"converter for {domain or 'ai.onnx'}::{op_type}-{v} registered twice")
            if registered(op_type, v, domain) is not None and since_version(op_type, v, domain) == v:
                OVERRIDES[key] = converter
            else:
                add_converter(operation_type=op_type, version=v, domain=domain)(converter)
                _OURS.add(key)
        return converter

    return deco


def schema_versions(op_type: str, domain: str = "", first: int = 1, last: int | None = None) -> list[int]:
    """All ``since_version`` values of ``op_type``'s schemas in ``[first, last]`` (ascending)."""
    out = []
    for s in defs.get_all_schemas_with_history():
        if s.name == op_type and s.domain in ((domain,) if domain else ("", "ai.onnx")):
            if s.since_version >= first and (last is None or s.since_version <= last):
                out.append(s.since_version)
    return sorted(set(out))


def register_versions(op_type: str, first: int, converter: Converter, *, domain: str = "",
                      override: Iterable[int] = (), last: int | None = None) -> list[int]:
    """Register ``converter`` for every schema version of ``op_type`` from ``first`` (to ``last``).

    Versions onnx2torch already owns are skipped unless listed in ``override`` (then they become
    :data:`OVERRIDES`). Returns the versions registered.
    """
    done = []
    override = set(override)
    for v in schema_versions(op_type, domain, first, last):
        key = (domain, op_type, v)
        owned = registered(op_type, v, domain) is not None and since_version(op_type, v, domain) == v
        if owned and key not in _OURS and v not in override:
            continue
        register_converter(op_type, [v], domain)(converter)
        done.append(v)
    return done


# ----------------------------------------------------------------------------------------------- node helpers
def attr(node: OnnxNode, name: str, default=None):
    """Attribute ``name`` of ``node`` decoded with ``onnx.helper.get_attribute_value`` (strings as str,
    tensors as torch tensors in the lifter's dtype convention, see :func:`tensor_from_proto`);
    ``default`` when absent. (onnx2torch's parser returns the raw AttributeProto for an empty list, and
    fails on bfloat16/float8/int4 tensors; this does not.)"""
    for a in node.proto.attribute:
        if a.name == name:
            if a.type == onnx.AttributeProto.TENSOR:
                return tensor_from_proto(a.t)
            v = helper.get_attribute_value(a)
            if isinstance(v, bytes):
                return v.decode("utf-8")
            if isinstance(v, list) and v and isinstance(v[0], bytes):
                return [s.decode("utf-8") for s in v]
            return v
    return default


def _input(node: OnnxNode, index: int) -> str | None:
    vals = node.input_values
    return vals[index] if len(vals) > index and vals[index] else None


_ML_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
              "float8_e5m2": torch.float8_e5m2, "float8_e5m2fnuz": torch.float8_e5m2fnuz,
              "float8_e8m0fnu": torch.float8_e8m0fnu}


def tensor_from_proto(proto: onnx.TensorProto) -> torch.Tensor:
    """TensorProto -> torch tensor (same shape) in the lifter's dtype convention: bfloat16/float8 as
    torch's dtypes of the same name (bit-exact, NaN payloads included), int4/int2 values in int8 and
    uint4/uint2 values in uint8 (one value per byte), float4/float6 as uint8 bit codes, every other
    numeric type as its numpy dtype.

    Decoding (packing, byte order, external data already loaded) is ``onnx.numpy_helper.to_array``'s,
    whose ml_dtypes arrays are reinterpreted or widened here; unlike onnx2torch's
    ``OnnxTensor.to_torch`` (``torch.from_numpy`` of that array) it accepts the ml_dtypes types.

    Raises:
        ConversionNotSupported: STRING tensors (no torch dtype; names the tensor).
    """
    if proto.data_type == onnx.TensorProto.STRING:
        raise ConversionNotSupported(f"tensor {proto.name!r} has element type STRING, which has no torch dtype")
    return array_to_torch(onnx.numpy_helper.to_array(proto))


def array_to_torch(arr) -> torch.Tensor:
    """A numeric numpy array (ml_dtypes included) -> a new torch tensor in the lifter's dtype convention
    (:func:`tensor_from_proto`): bfloat16/float8 reinterpreted bit for bit, int4/int2 widened to int8,
    uint4/uint2 to uint8, float4/float6 as uint8 bit codes, other dtypes as they are (copied)."""
    import numpy as np

    name = arr.dtype.name
    if name in _ML_DTYPES:
        bits = np.ascontiguousarray(arr).view(np.uint16 if arr.dtype.itemsize == 2 else np.uint8).copy()
        return torch.from_numpy(bits).view(_ML_DTYPES[name])
    if name in ("int4", "int2"):
        return torch.from_numpy(arr.astype(np.int8))
    if name in ("uint4", "uint2"):
        return torch.from_numpy(arr.astype(np.uint8))
    if name in ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"):
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8).copy())
    return torch.from_numpy(np.array(arr, copy=True))


def const_tensor(node: OnnxNode, graph: OnnxGraph, index: int) -> torch.Tensor | None:
    """Input ``index`` as a tensor when it is an initializer; ``None`` when absent or dynamic."""
    name = _input(node, index)
    if name is None or name not in graph.initializers:
        return None
    return tensor_from_proto(graph.initializers[name].proto)


def const_ints(node: OnnxNode, graph: OnnxGraph, index: int) -> list[int] | None:
    """Integer list of input ``index`` if it is an initializer; ``None`` if absent; raises if dynamic."""
    name = _input(node, index)
    if name is None:
        return None
    if name in graph.initializers:
        return [int(v) for v in tensor_from_proto(graph.initializers[name].proto).reshape(-1).tolist()]
    raise ConversionNotSupported(
        f"{node.operation_type} node {node.name!r}: input {index} ({name!r}) must be a constant (initializer)"
    )


def elem_type(graph: OnnxGraph, value: str) -> int | None:
    """ONNX element type of tensor ``value`` (value_info, graph input/output or initializer), or None."""
    if not value:
        return None
    if value in graph.initializers:
        return graph.initializers[value].proto.data_type
    vi = graph.value_info.get(value) if hasattr(graph, "value_info") else None
    if vi is None:
        for v in list(graph.proto.input) + list(graph.proto.output) + list(graph.proto.value_info):
            if v.name == value:
                vi = v
                break
    if vi is None or not vi.type.HasField("tensor_type"):
        return None
    t = vi.type.tensor_type.elem_type
    return t or None


TP = onnx.TensorProto
#: ONNX element type -> torch dtype carrying it (sub-byte types unpacked one value per byte; float4/6
#: as uint8 bit codes: see :mod:`qtorch_onnx.lift.ops_quant`).
TORCH_DTYPE: dict[int, torch.dtype] = {
    TP.FLOAT: torch.float32, TP.DOUBLE: torch.float64, TP.FLOAT16: torch.float16, TP.BFLOAT16: torch.bfloat16,
    TP.INT8: torch.int8, TP.UINT8: torch.uint8, TP.INT16: torch.int16, TP.UINT16: torch.uint16,
    TP.INT32: torch.int32, TP.UINT32: torch.uint32, TP.INT64: torch.int64, TP.UINT64: torch.uint64,
    TP.BOOL: torch.bool, TP.COMPLEX64: torch.complex64, TP.COMPLEX128: torch.complex128,
    TP.FLOAT8E4M3FN: torch.float8_e4m3fn, TP.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    TP.FLOAT8E5M2: torch.float8_e5m2, TP.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
    TP.FLOAT8E8M0: torch.float8_e8m0fnu,
    TP.INT4: torch.int8, TP.UINT4: torch.uint8, TP.INT2: torch.int8, TP.UINT2: torch.uint8,
    TP.FLOAT4E2M1: torch.uint8, TP.FLOAT6E2M3: torch.uint8, TP.FLOAT6E3M2: torch.uint8,
}


def torch_dtype(onnx_type: int, node: OnnxNode | None = None) -> torch.dtype:
    """torch dtype carrying ONNX element type ``onnx_type``.

    Raises:
        ConversionNotSupported: STRING or an unknown type (names the node).
    """
    if onnx_type not in TORCH_DTYPE:
        name = TP.DataType.Name(onnx_type) if onnx_type in TP.DataType.values() else str(onnx_type)
        where = f"{node.operation_type} node {node.name!r}: " if node is not None else ""
        raise ConversionNotSupported(f"{where}element type {name} has no torch dtype")
    return TORCH_DTYPE[onnx_type]


def result(module, node: OnnxNode, inputs: tuple[str, ...] | None = None) -> OperationConverterResult:
    """``OperationConverterResult`` mapping ``inputs`` (default: all node inputs) and all outputs."""
    mapping = onnx_mapping_from_node(node) if inputs is None else OnnxMapping(inputs=tuple(inputs),
                                                                              outputs=node.output_values)
    return OperationConverterResult(torch_module=module, onnx_mapping=mapping)
