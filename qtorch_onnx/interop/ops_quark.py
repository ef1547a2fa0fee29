"""AMD Quark's custom quantization operators as plain torch modules (docs/operators.md, "Custom operators").

Domain ``com.amd.quark`` version 1 and the legacy alias domain ``com.vai.quantize``:

* ``BFPQuantizeDequantize`` (alias ``BFPFixNeuron``) and ``MXQuantizeDequantize`` (alias ``MXFixNeuron``):
  the :mod:`qtorch_onnx.ops` functions with the node's attributes (docs/operators.md defaults for the missing ones);
* ``ExtendedQuantizeLinear`` / ``ExtendedDequantizeLinear`` (aliases ``VitisQuantizeLinear`` /
  ``VitisDequantizeLinear``): integer Q/DQ with any of the six integer zero-point types, and Quark's
  bfloat16 / float16 Q/DQ (the zero point's dtype selects the target), per tensor or along ``axis``.

The numerics are the project's reference functions (:mod:`qtorch_onnx.formats`), bit-exact with the operator
library and with Quark's compiled operators (tests/export). These converters make a Quark-quantized model
*run* in torch; :func:`qtorch_onnx.load_quantized` goes further and turns the same nodes into FakeQuantize
modules holding the model's parameters, so the model can be finetuned and exported again.
"""
from __future__ import annotations

import onnx
import torch
from torch import nn

from ..formats import floating as _floating
from ..formats import integer as _integer
from ..formats.spec import INT_FORMAT_BY_ONNX_TYPE
from ..lift.ops_common import TP, ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, elem_type, \
    register_converter, result

DOMAINS = ("com.amd.quark", "com.vai.quantize")
#: integer zero-point element type -> IntFormat
INT_TYPES = {t: f for t, f in INT_FORMAT_BY_ONNX_TYPE.items() if f.bits >= 8}  # 4-bit: not a Quark target type
#: torch dtype that carries each integer type in the lifted module (ops_quant's convention)
_CARRIER = {TP.INT8: torch.int8, TP.UINT8: torch.uint8, TP.INT16: torch.int16, TP.UINT16: torch.uint16,
            TP.INT32: torch.int32, TP.UINT32: torch.uint32}


class QuarkBlockQuantizeDequantize(nn.Module, OnnxToTorchModule):
    """``BFPQuantizeDequantize`` (``kind="bfp"``: :func:`qtorch_onnx.ops.bfp_quantize_dequantize`, docs/numerics.md
    sections 4-6) or ``MXQuantizeDequantize`` (``kind="mx"``: :func:`qtorch_onnx.ops.mx_quantize_dequantize`,
    section 7) with the node's attributes: x float32/float16 ``[...]`` -> same dtype and shape."""

    def __init__(self, kind: str, **attrs):
        super().__init__()
        self.kind, self.attrs = kind, attrs

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        from .. import ops

        fn = ops.bfp_quantize_dequantize if self.kind == "bfp" else ops.mx_quantize_dequantize
        return fn(x, **self.attrs)


class QuarkExtendedQuantizeLinear(nn.Module, OnnxToTorchModule):
    """``ExtendedQuantizeLinear(x, scale, zero_point)``: integer ``saturate(round_half_even(x / scale) + zp)``
    in the zero point's type; bfloat16 ``bf16(x / scale + zp)``; float16 ``float16(clip(x, +-65504))`` (scale
    and zero point ignored, as Quark's operator). x float ``[...]``, scale float32 scalar or ``[C]`` along
    ``axis``."""

    def __init__(self, target: int, axis: int):
        super().__init__()
        self.target, self.axis = target, axis

    def forward(self, x, scale, zero_point):  # noqa: D102
        axis = self.axis if scale.dim() > 0 and scale.numel() > 1 else None
        if self.target == TP.BFLOAT16:
            return _floating.bf16_quantize(x, scale, zero_point, axis)
        if self.target == TP.FLOAT16:
            return _floating.fp16_quantize(x)
        q = _integer.quantize(x, scale, zero_point.to(torch.int64), INT_TYPES[self.target], axis)
        return q.to(_CARRIER[self.target])


class QuarkExtendedDequantizeLinear(nn.Module, OnnxToTorchModule):
    """``ExtendedDequantizeLinear(q, scale, zero_point)``: ``(q - zp) * scale`` in float32 (bfloat16 NaN
    rule of :func:`~qtorch_onnx.formats.floating.bf16_dequantize`; float16: a widening Cast)."""

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis

    def forward(self, q, scale, zero_point):  # noqa: D102
        axis = self.axis if scale.dim() > 0 and scale.numel() > 1 else None
        if q.dtype == torch.bfloat16:
            return _floating.bf16_dequantize(q, scale, zero_point, axis)
        if q.dtype == torch.float16:
            return _floating.fp16_dequantize(q)
        return _integer.dequantize(q, scale, zero_point.to(torch.int64), axis)


def _bfp(node: OnnxNode, graph: OnnxGraph):
    method = attr(node, "bfp_method", "to_bfp")
    kw = dict(bfp_method=method, axis=int(attr(node, "axis", 1)), bit_width=int(attr(node, "bit_width", 16)),
              block_size=int(attr(node, "block_size", 8)), rounding_mode=int(attr(node, "rounding_mode", 0)),
              sub_block_size=int(attr(node, "sub_block_size", 2)),
              sub_block_shift_bits=int(attr(node, "sub_block_shift_bits", 1)),
              convert_to_bfloat_before_bfp=int(attr(node, "convert_to_bfloat_before_bfp", 0)))
    if method not in ("to_bfp", "to_bfp_prime", "to_bfp_prime_shared"):
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: attribute bfp_method={method!r}; "
                                     "valid: 'to_bfp', 'to_bfp_prime'")
    return result(QuarkBlockQuantizeDequantize("bfp", **kw), node)


def _mx(node: OnnxNode, graph: OnnxGraph):
    kw = dict(element_dtype=attr(node, "element_dtype", "int8"), axis=int(attr(node, "axis", 1)),
              block_size=int(attr(node, "block_size", 32)), rounding_mode=int(attr(node, "rounding_mode", 0)))
    valid = ("int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1")
    if kw["element_dtype"] not in valid:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: attribute element_dtype="
                                     f"{kw['element_dtype']!r}; valid: {valid}")
    return result(QuarkBlockQuantizeDequantize("mx", **kw), node)


def _zero_point_type(node: OnnxNode, graph: OnnxGraph) -> int:
    zp = node.input_values[2] if len(node.input_values) > 2 else ""
    t = elem_type(graph, zp)
    if t is None:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: the zero point (input 2) is needed "
                                     "and must have a known type (it selects the target type)")
    if t not in INT_TYPES and t not in (TP.BFLOAT16, TP.FLOAT16):
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: zero point type "
                                     f"{TP.DataType.Name(t)}; valid: int8, uint8, int16, uint16, int32, uint32, "
                                     "bfloat16, float16")
    return t


def _extended_q(node: OnnxNode, graph: OnnxGraph):
    return result(QuarkExtendedQuantizeLinear(_zero_point_type(node, graph), int(attr(node, "axis", 0))), node)


def _extended_dq(node: OnnxNode, graph: OnnxGraph):
    _zero_point_type(node, graph)
    return result(QuarkExtendedDequantizeLinear(int(attr(node, "axis", 0))), node)


for _domain, (_bfp_name, _mx_name, _q_name, _dq_name) in (
        ("com.amd.quark", ("BFPQuantizeDequantize", "MXQuantizeDequantize", "ExtendedQuantizeLinear",
                           "ExtendedDequantizeLinear")),
        ("com.vai.quantize", ("BFPFixNeuron", "MXFixNeuron", "VitisQuantizeLinear", "VitisDequantizeLinear"))):
    register_converter(_bfp_name, [1], domain=_domain)(_bfp)
    register_converter(_mx_name, [1], domain=_domain)(_mx)
    register_converter(_q_name, [1], domain=_domain)(_extended_q)
    register_converter(_dq_name, [1], domain=_domain)(_extended_dq)


# ------------------------------------------------------------------------------------------- ONNX schemas
def _register_schemas() -> None:
    """Register ONNX schemas for the ``com.amd.quark`` / ``com.vai.quantize`` operators (docs/operators.md), with type and
    shape inference (output shape = input shape; BFP/MX keep the input type, ExtendedQuantizeLinear takes the
    zero point's type, ExtendedDequantizeLinear gives float32), so ``onnx.shape_inference`` types the tensors
    behind these nodes (converters downstream need their ranks) and ``onnx.checker`` validates their
    attributes. A schema some other package registered first is left as it is."""
    from onnx import defs, helper

    OS = defs.OpSchema

    def same_shape(out_type=None):
        def infer(ctx) -> None:
            t = onnx.TypeProto()
            t.CopyFrom(ctx.get_input_type(0))
            if out_type is not None:
                elem = out_type(ctx)
                if elem is None:
                    return
                t.tensor_type.elem_type = elem
            ctx.set_output_type(0, t)
        return infer

    def zp_type(ctx):
        if ctx.get_num_inputs() < 3 or not ctx.has_input(2):
            return None
        return ctx.get_input_type(2).tensor_type.elem_type or None

    float_t = ("T", ["tensor(float)", "tensor(float16)"], "float32 or float16")
    bfp_attrs = [OS.Attribute("bfp_method", helper.make_attribute("bfp_method", "to_bfp"), "'to_bfp' | 'to_bfp_prime'"),
                 OS.Attribute("axis", helper.make_attribute("axis", 1), "block axis")]
    bfp_attrs += [OS.Attribute(n, helper.make_attribute(n, v), n) for n, v in (
        ("bit_width", 16), ("block_size", 8), ("rounding_mode", 0), ("sub_block_size", 2),
        ("sub_block_shift_bits", 1), ("convert_to_bfloat_before_bfp", 0))]
    mx_attrs = [OS.Attribute("element_dtype", helper.make_attribute("element_dtype", "int8"), "element type"),
                OS.Attribute("axis", helper.make_attribute("axis", 1), "block axis"),
                OS.Attribute("block_size", helper.make_attribute("block_size", 32), "block size"),
                OS.Attribute("rounding_mode", helper.make_attribute("rounding_mode", 0), "int8 rounding")]
    axis0 = [OS.Attribute("axis", helper.make_attribute("axis", 0), "per-channel axis")]
    ints = ["tensor(int8)", "tensor(uint8)", "tensor(int16)", "tensor(uint16)", "tensor(int32)", "tensor(uint32)",
            "tensor(bfloat16)", "tensor(float16)"]
    FP = OS.FormalParameter
    for domain, names in (("com.amd.quark", ("BFPQuantizeDequantize", "MXQuantizeDequantize", "ExtendedQuantizeLinear",
                                              "ExtendedDequantizeLinear")),
                          ("com.vai.quantize", ("BFPFixNeuron", "MXFixNeuron", "VitisQuantizeLinear",
                                                "VitisDequantizeLinear"))):
        bfp, mx, q, dq = names
        schemas = [
            OS(bfp, domain, 1, "Block floating point quantize-dequantize (docs/operators.md)", inputs=[FP("x", "T")],
               outputs=[FP("y", "T")], type_constraints=[float_t], attributes=bfp_attrs),
            OS(mx, domain, 1, "OCP microscaling quantize-dequantize (docs/operators.md)", inputs=[FP("x", "T")],
               outputs=[FP("y", "T")], type_constraints=[float_t], attributes=mx_attrs),
            OS(q, domain, 1, "Quark's extended QuantizeLinear (docs/operators.md)",
               inputs=[FP("x", "T1"), FP("y_scale", "tensor(float)"), FP("y_zero_point", "T2")],
               outputs=[FP("y", "T2")],
               type_constraints=[("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "input"),
                                 ("T2", ints, "target")], attributes=axis0),
            OS(dq, domain, 1, "Quark's extended DequantizeLinear (docs/operators.md)",
               inputs=[FP("x", "T1"), FP("x_scale", "tensor(float)"), FP("x_zero_point", "T1")],
               outputs=[FP("y", "tensor(float)")], type_constraints=[("T1", ints, "quantized")], attributes=axis0),
        ]
        inferers = [same_shape(), same_shape(), same_shape(zp_type), same_shape(lambda ctx: onnx.TensorProto.FLOAT)]
        _register(zip(schemas, inferers))


def _register(pairs) -> None:
    from onnx import defs

    for schema, infer in pairs:
        if defs.has(schema.name, schema.domain):
            continue
        schema.set_type_and_shape_inference_function(infer)
        defs.register_schema(schema)


_register_schemas()
