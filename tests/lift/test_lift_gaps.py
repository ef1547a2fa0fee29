"""Issue 5 lifting gaps: Clip with runtime bounds (overrides chosen before onnx2torch converts), initializers
and Constants of bfloat16 / float8 / int4 / uint4, and the error for models with unsupported custom nodes.

Every numeric check is bit-exact (compared as raw bytes) against ONNX Runtime, or against ONNX's reference
evaluator where ONNX Runtime has no kernel for the type / op (the source used is asserted per case).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from qtorch_onnx.errors import UnsupportedOpsError
from qtorch_onnx.lift import check_supported, lift, normalize
from qtorch_onnx.lift import converters as conv
from qtorch_onnx.lift import ops_math, ops_shape
from qtorch_onnx.lift.ops_common import onnx2torch_converter

from .helpers import F, I64, make_model, run_gm, run_ort

TP = TensorProto
RNG = np.random.default_rng(5)


def _same_bits(want: np.ndarray, got: np.ndarray) -> None:
    assert want.dtype == got.dtype and want.shape == got.shape, (want.dtype, got.dtype, want.shape, got.shape)
    assert np.array_equal(np.ascontiguousarray(want).view(np.uint8), np.ascontiguousarray(got).view(np.uint8)), \
        (want, got)


def _oracle(model: onnx.ModelProto, feeds: dict) -> tuple[list[np.ndarray], str]:
    """Outputs from ONNX Runtime; from ONNX's reference evaluator when ORT has no kernel for the model."""
    try:
        return run_ort(model, feeds), "ort"
    except (ort.capi.onnxruntime_pybind11_state.NotImplemented, ort.capi.onnxruntime_pybind11_state.Fail):
        return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)], "reference"


def _check(model: onnx.ModelProto, feeds: dict) -> str:
    gm = lift(model)
    want, src = _oracle(model, feeds)
    got = run_gm(gm, feeds)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        _same_bits(w, g)
    return src


# ================================================================================ 1. Clip with runtime min/max
CLIP_TYPES = {"float32": (TP.FLOAT, np.float32), "float64": (TP.DOUBLE, np.float64), "int8": (TP.INT8, np.int8),
              "uint8": (TP.UINT8, np.uint8), "int32": (TP.INT32, np.int32), "int64": (TP.INT64, np.int64),
              "uint64": (TP.UINT64, np.uint64)}


def _clip_model(t: int, opset: int, inputs: tuple[str, str], inits: dict | None = None):
    node = helper.make_node("Clip", ["x", *inputs], ["y"], name="clip")
    runtime = [(n, t, []) for n in inputs if n and n not in (inits or {})]
    return make_model([node], [("x", t, [3, 5])] + runtime, [("y", t, None)], inits or {}, opset=opset)


def _clip_data(np_t):
    if np.dtype(np_t).kind == "f":
        x = (RNG.standard_normal((3, 5)) * 4).astype(np_t)
        x[0, 0] = np.nan
        return x, np.array(-1.5, np_t), np.array(2.25, np_t)
    info = np.iinfo(np_t)
    x = RNG.integers(info.min, info.max, (3, 5), dtype=np_t, endpoint=True)
    lo, hi = (np.array(3, np_t), np.array(info.max - 7, np_t)) if info.min == 0 else \
        (np.array(-20, np_t), np.array(45, np_t))
    return x, lo, hi


@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("dtype", list(CLIP_TYPES))
def test_clip_with_runtime_min_max_matches_ort(dtype, opset):
    """Both, one or no bound at run time; min > max (max everywhere); NaN (sign kept) and +-inf in x (an
    absent bound is the type's finite extreme, as in the spec text and ONNX Runtime)."""
    t, np_t = CLIP_TYPES[dtype]
    if opset == 11 and np.dtype(np_t).kind != "f":
        pytest.skip("Clip-11 is float-only")
    if opset == 11 and np_t == np.float64:
        pytest.skip("ONNX Runtime has no float64 Clip-11 kernel")
    x, lo, hi = _clip_data(np_t)
    if np.dtype(np_t).kind == "f":
        x[0, 1:4] = [-np.nan, np.inf, -np.inf]
    for inputs, feeds in ((("lo", "hi"), {"lo": lo, "hi": hi}), (("lo",), {"lo": lo}), (("", "hi"), {"hi": hi}),
                          ((), {}), (("lo", "hi"), {"lo": hi, "hi": lo})):
        m = _clip_model(t, opset, inputs)
        assert _check(m, {"x": x, **feeds}) == "ort"


def test_clip_mixed_constant_and_runtime_bounds_and_baked_constants():
    x, lo, hi = _clip_data(np.float32)
    m = _clip_model(F, 13, ("lo", "hi"), {"lo": lo})  # min an initializer, max a graph input
    assert _check(m, {"x": x, "hi": hi}) == "ort"
    gm = lift(m)
    assert isinstance(gm.get_submodule("clip"), ops_math.OnnxClip) and not gm.get_submodule("clip").baked

    # both bounds constant: baked into the module as numbers of x's type (onnx2torch made integer bounds float)
    xi, loi, hii = _clip_data(np.int8)
    m = _clip_model(TP.INT8, 13, ("lo", "hi"), {"lo": loi, "hi": hii})
    assert _check(m, {"x": xi}) == "ort"
    mod = lift(m).get_submodule("clip")
    assert mod.baked and (mod.lo, mod.hi) == (-20, 45) and isinstance(mod.lo, int)
    assert [r.kind for r in lift(m).tensor_map["lo"]] == ["const"]


def test_clip_with_runtime_bounds_is_not_reported_by_the_support_check():
    m = normalize(_clip_model(F, 13, ("lo", "hi")))
    from onnx2torch.onnx_graph import OnnxGraph

    graph = OnnxGraph(m.graph)
    node = next(iter(graph.nodes.values()))
    with pytest.raises(NotImplementedError, match="Dynamic value"):  # onnx2torch's own converter rejects it ...
        onnx2torch_converter("Clip", 13)(node, graph)
    assert conv.dry_run(node, graph, 13) is None  # ... ours is the one the lifter uses, before onnx2torch runs
    check_supported(m)


def test_any_override_whose_onnx2torch_converter_rejects_the_node_is_used_directly(monkeypatch):
    """DepthToSpace-13 DCR: onnx2torch's converter raises at conversion time; with an override registered
    for the key, the lifter routes the node to it and onnx2torch's converter is never called."""
    m = make_model([helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="DCR", name="d2s")],
                   [("x", F, [1, 8, 2, 3])], [("y", F, None)], opset=13)
    monkeypatch.setitem(conv.OVERRIDES, ("", "DepthToSpace", 13), ops_shape._depth_to_space)
    gm = lift(m)
    assert isinstance(gm.get_submodule("d2s"), ops_shape.OnnxDepthToSpace)  # plain node name kept
    assert _check(m, {"x": RNG.standard_normal((1, 8, 2, 3)).astype(np.float32)}) == "ort"


def test_an_override_that_rejects_the_node_is_reported_with_its_own_reason(monkeypatch):
    def refuse(node, graph):
        raise conv.ConversionNotSupported(f"Clip node {node.name!r}: refused for the test")

    monkeypatch.setitem(conv.OVERRIDES, ("", "Clip", 13), refuse)
    with pytest.raises(UnsupportedOpsError, match="refused for the test") as info:
        lift(_clip_model(F, 13, ("lo", "hi")))
    assert info.value.ops == [("", "Clip", 13, ["clip"])] and "Dynamic value" not in str(info.value)


WIDE_INT_TYPES = {"uint16": (TP.UINT16, np.uint16), "uint32": (TP.UINT32, np.uint32), "uint64": (TP.UINT64, np.uint64),
                  "int16": (TP.INT16, np.int16)}


def _wide_values(np_t, shape=(3, 5)) -> np.ndarray:
    """Random values over the whole range of ``np_t`` plus both extremes (uint64: values of 2^63 and above)."""
    info = np.iinfo(np_t)
    x = RNG.integers(info.min, info.max, shape, dtype=np_t, endpoint=True)
    x.flat[:2] = [info.min, info.max]
    return x


@pytest.mark.parametrize("dtype", list(WIDE_INT_TYPES))
def test_clip_on_16_32_64_bit_integers_without_torch_kernels(dtype):
    """Clip-13 on uint16/uint32/uint64 (torch has no clamp kernel for them) and int16, bounds at run time
    and baked, min > max; uint64 bounds and values above 2^63 stay exact. ORT has no uint16/int16 Clip
    kernel (with bounds): those cases are checked against ONNX's reference evaluator."""
    t, np_t = WIDE_INT_TYPES[dtype]
    info = np.iinfo(np_t)
    x = _wide_values(np_t)
    if info.min == 0:
        lo, hi = np.array(info.max // 3, np_t), np.array(info.max - info.max // 5, np_t)  # uint64: both >= 2^63 / 3
    else:
        lo, hi = np.array(-1000, np_t), np.array(20000, np_t)
    srcs = set()
    for inputs, feeds in ((("lo", "hi"), {"lo": lo, "hi": hi}), (("lo",), {"lo": lo}), (("", "hi"), {"hi": hi}),
                          ((), {}), (("lo", "hi"), {"lo": hi, "hi": lo})):
        srcs.add(_check(_clip_model(t, 13, inputs), {"x": x, **feeds}))
        consts = {k: v for k, v in (("lo", feeds.get("lo")), ("hi", feeds.get("hi"))) if v is not None}
        srcs.add(_check(_clip_model(t, 13, inputs, consts), {"x": x}))  # baked bounds
    if dtype in ("uint32", "uint64"):
        assert srcs == {"ort"}
    if dtype == "uint64":  # the exact answer, independent of any oracle
        got = run_gm(lift(_clip_model(t, 13, ("lo", "hi"))), {"x": x, "lo": lo, "hi": hi})[0]
        assert np.array_equal(got, np.clip(x, lo, hi)) and got.max() >= np.uint64(1 << 63)


def _order_op_model(op: str, t: int, opset: int, **attrs):
    out_t = TP.INT64 if op.startswith("Arg") else t
    node = helper.make_node(op, ["x"], ["y"], name="n", **attrs)
    return make_model([node], [("x", t, [3, 5])], [("y", out_t, None)], opset=opset)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
@pytest.mark.parametrize("op,opset,attrs", [
    ("ArgMax", 13, {"axis": 1}), ("ArgMax", 13, {"axis": 0, "keepdims": 0, "select_last_index": 1}),
    ("ArgMin", 13, {"axis": 1}), ("ArgMin", 11, {"axis": 0}),
    ("ReduceMax", 13, {"axes": [1]}), ("ReduceMin", 13, {"axes": [0], "keepdims": 0}), ("ReduceMax", 11, {}),
    ("Abs", 13, {}), ("Sign", 13, {}),
])
def test_order_ops_on_unsigned_16_32_64_bit_integers(dtype, op, opset, attrs):
    """ArgMax/ArgMin, ReduceMax/ReduceMin (opsets up to 13), Abs and Sign on the unsigned types torch has no
    max/argmax/abs/sign kernel for: exact (uint64 above 2^63 included), ties as in the spec (repeated
    values), against ORT or ONNX's reference evaluator."""
    if op.startswith("Reduce") and dtype == "uint16":
        pytest.skip("ONNX ReduceMax/ReduceMin have no uint16")
    t, np_t = WIDE_INT_TYPES[dtype]
    x = _wide_values(np_t)
    x[1, 2] = x[1, 3] = x[0, 1]  # ties with the maximum
    x[2, 0] = 0
    _check(_order_op_model(op, t, opset, **attrs), {"x": x})


# ================================================================================ 2. bfloat16 / float8 / int4 tensors
TYPED = {"bfloat16": TP.BFLOAT16, "float8e4m3fn": TP.FLOAT8E4M3FN, "float8e4m3fnuz": TP.FLOAT8E4M3FNUZ,
         "float8e5m2": TP.FLOAT8E5M2, "float8e5m2fnuz": TP.FLOAT8E5M2FNUZ, "int4": TP.INT4, "uint4": TP.UINT4}
CARRIER = {TP.BFLOAT16: torch.bfloat16, TP.FLOAT8E4M3FN: torch.float8_e4m3fn,
           TP.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz, TP.FLOAT8E5M2: torch.float8_e5m2,
           TP.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz, TP.INT4: torch.int8, TP.UINT4: torch.uint8}


def _typed_values(t: int, shape=(2, 4)) -> np.ndarray:
    """Values of ONNX type ``t`` (numpy / ml_dtypes array): negatives, zero, extremes, and for the float
    types subnormals, a rounding case and (where the type has one) a NaN."""
    if t == TP.INT4:
        v = np.array([-8, -3, 0, 1, 7, 5, -1, 2])
    elif t == TP.UINT4:
        v = np.array([0, 15, 3, 7, 8, 1, 12, 9])
    else:
        v = np.array([0.5, -1.75, 3.1, 240.0, -0.0, 2.0 ** -9, 1e-3, np.nan if t != TP.BFLOAT16 else 1e30])
    np_t = helper.tensor_dtype_to_np_dtype(t)
    return v.astype(np_t).reshape(shape)


@pytest.mark.parametrize("name", list(TYPED))
def test_typed_initializer_through_reshape_identity_cast(name):
    """The initializer survives normalization (a runtime-shaped Reshape cannot be folded) and reaches Cast."""
    t = TYPED[name]
    w = numpy_helper.from_array(_typed_values(t), "w")
    nodes = [helper.make_node("Reshape", ["w", "shape"], ["r"], name="reshape"),
             helper.make_node("Identity", ["r"], ["i"], name="ident"),
             helper.make_node("Cast", ["i"], ["y"], to=TP.FLOAT, name="cast")]
    m = make_model(nodes, [("shape", I64, [2])], [("y", F, None)], opset=21)
    m.graph.initializer.append(w)
    before = m.SerializeToString()
    gm = lift(m)
    assert m.SerializeToString() == before  # the user's model is not mutated
    assert [i.data_type for i in gm.onnx_model.graph.initializer if i.name == "w"] == [t]
    (buf,) = [b for n, b in gm.named_buffers() if "typed_initializer" in n]
    assert buf.dtype == CARRIER[t]
    src = _check(m, {"shape": np.array([4, 2], np.int64)})
    assert src == ("reference" if t in (TP.INT4, TP.UINT4) else "ort")  # ORT has no int4 Reshape


@pytest.mark.parametrize("name", [n for n in TYPED if n != "bfloat16"])
def test_typed_initializer_through_dequantize_linear(name):
    t = TYPED[name]
    w = _typed_values(t)
    if t in (TP.INT4, TP.UINT4):  # per-axis scale and zero point along axis 0
        scale = np.array([0.5, 0.125], np.float32)
        zp = _typed_values(t, (8,))[[2, 3]]
        attrs = {"axis": 0}
    else:
        scale, zp, attrs = np.array(0.25, np.float32), np.array(0).astype(w.dtype), {}
    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["d"], name="dq", **attrs),
             helper.make_node("Add", ["d", "x"], ["y"], name="add")]
    m = make_model(nodes, [("x", F, [2, 4])], [("y", F, None)], {"s": scale}, opset=21)
    m.graph.initializer.extend([numpy_helper.from_array(w, "w"), numpy_helper.from_array(zp, "zp")])
    assert _check(m, {"x": RNG.standard_normal((2, 4)).astype(np.float32)}) == "ort"


def test_bfloat16_initializers_as_scale_and_operand():
    """DequantizeLinear with a bfloat16 scale (output bfloat16), and a bfloat16 Mul / Clip operand."""
    nodes = [helper.make_node("DequantizeLinear", ["q", "sb"], ["db"], name="dq"),
             helper.make_node("Cast", ["x"], ["xb"], to=TP.BFLOAT16),
             helper.make_node("Mul", ["xb", "wb"], ["m"], name="mul"),
             helper.make_node("Clip", ["m", "lo", "hi"], ["c"], name="clip"),
             helper.make_node("Cast", ["db"], ["y1"], to=TP.FLOAT),
             helper.make_node("Cast", ["c"], ["y2"], to=TP.FLOAT)]
    m = make_model(nodes, [("x", F, [2, 4])], [("y1", F, None), ("y2", F, None)],
                   {"q": np.array([[-3, 5, 127, -128], [0, 1, 2, 3]], np.int8)}, opset=21)
    bf = ml_dtypes.bfloat16
    m.graph.initializer.extend([numpy_helper.from_array(np.array(0.375).astype(bf), "sb"),
                                numpy_helper.from_array(_typed_values(TP.BFLOAT16)[:, :4] / 3, "wb"),
                                numpy_helper.from_array(np.array(-2.5).astype(bf), "lo"),
                                numpy_helper.from_array(np.array(1.5).astype(bf), "hi")])
    _check(m, {"x": RNG.standard_normal((2, 4)).astype(np.float32)})


@pytest.mark.parametrize("name", list(TYPED))
def test_typed_constant_nodes(name):
    t = TYPED[name]
    arr = _typed_values(t)
    value = numpy_helper.from_array(arr, "v")
    fill = helper.make_tensor("f", t, [1], [float(_typed_values(t).reshape(-1)[1])])
    nodes = [helper.make_node("Constant", [], ["k"], value=value, name="const"),
             helper.make_node("Reshape", ["k", "shape"], ["r"]), helper.make_node("Cast", ["r"], ["y1"], to=TP.FLOAT),
             helper.make_node("ConstantOfShape", ["shape"], ["f"], value=fill, name="cos"),
             helper.make_node("Cast", ["f"], ["y2"], to=TP.FLOAT)]
    m = make_model(nodes, [("shape", I64, [2])], [("y1", F, None), ("y2", F, None)], opset=21)
    _check(m, {"shape": np.array([4, 2], np.int64)})
    # a Constant that is itself the graph output stays a Constant node: its value, bit for bit
    m = make_model([helper.make_node("Constant", [], ["k"], value=value, name="const")], [], [("k", t, None)], opset=21)
    gm = lift(m)
    assert [n.op_type for n in gm.onnx_model.graph.node] == ["Constant"]
    out = gm()
    assert out.dtype == CARRIER[t]
    want = ReferenceEvaluator(m).run(None, {})[0]
    if t in (TP.INT4, TP.UINT4):
        np.testing.assert_array_equal(out.numpy(), want.astype(np.int8 if t == TP.INT4 else np.uint8))
    else:
        bits = torch.int16 if out.element_size() == 2 else torch.uint8
        assert np.array_equal(out.view(bits).numpy(), want.view(np.int16 if want.itemsize == 2 else np.uint8))


# ================================================================================ 3. unsupported custom nodes
def _custom_model(custom_op: str = "MyCustomOp"):
    """x -> com.example::MyCustomOp -> MaxPool -> Conv -> (second custom op) -> Relu; weights an initializer."""
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node(custom_op, ["x"], ["c"], name="custom", domain="com.example"),
             helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2]),
             helper.make_node("Conv", ["p", "w"], ["v"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("OtherCustomOp", ["v"], ["o"], name="other", domain="com.example"),
             helper.make_node("Relu", ["o"], ["y"], name="relu")]
    m = make_model(nodes, [("x", F, [1, 3, 8, 8])], [("y", F, None)], {"w": w}, opset=17)
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    return m


def test_unsupported_custom_node_error_lists_only_the_unsupported_nodes():
    with pytest.raises(UnsupportedOpsError) as info:
        lift(_custom_model())
    err = info.value
    # both custom ops are genuinely unsupported (no converter, wherever they are); nothing else is listed
    assert err.ops == [("com.example", "MyCustomOp", 1, ["custom"]), ("com.example", "OtherCustomOp", 1, ["other"])]
    assert err.reasons[("com.example", "MyCustomOp", 1)] == "no converter"
    assert "register_converter('MyCustomOp'" in err.hints[("com.example", "MyCustomOp", 1)]
    text = str(err)
    assert "KeyError" not in text and "check the attribute" not in text and "ai.onnx::" not in text
    # the MaxPool fails only for want of its input's shape: summarized, not listed
    assert err.unchecked == ["pool"]
    assert "1 downstream node(s) not checked" in text and "'pool'" in text


def test_node_without_shape_information_behind_a_supported_custom_op_is_explained(monkeypatch):
    """When the custom op has a converter but ONNX shape inference cannot type its output, the consumer
    that needs the rank is reported with that reason (not a bare KeyError) and a way out."""
    monkeypatch.setitem(conv.OVERRIDES, ("com.example", "MyCustomOp", 1), lambda node, graph: None)
    m = _custom_model()
    m.graph.node[3].op_type = "Neg"  # the second custom op becomes a standard one
    m.graph.node[3].domain = ""
    with pytest.raises(UnsupportedOpsError) as info:
        check_supported(normalize(m))
    err = info.value
    assert err.ops == [("", "MaxPool", 17, ["pool"])]
    reason = err.reasons[("", "MaxPool", 17)]
    assert "input 'c' has no shape or type information" in reason
    assert "value_info" in err.hints[("", "MaxPool", 17)]
