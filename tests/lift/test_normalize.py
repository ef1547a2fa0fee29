"""Each normalize pass on a small hand-built model, checked against ONNX Runtime on the original."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from qtorch_onnx.errors import ModelError
from qtorch_onnx.lift import normalize, normalize_with_aliases, same_pads

from .helpers import F, make_model, rel_l2, run_ort, tensor_names

RNG = np.random.default_rng(0)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, feeds, tol=0.0):
    for x, y in zip(run_ort(a, feeds), run_ort(b, feeds)):
        assert x.shape == y.shape
        if tol == 0.0:
            np.testing.assert_array_equal(x, y)
        else:
            assert rel_l2(x, y) < tol


def test_constant_nodes_become_named_initializers():
    c = helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", F, [2], [1.5, -2.0]))
    ci = helper.make_node("Constant", [], ["shape"], value_ints=[2, 1])
    m = make_model([c, ci, helper.make_node("Add", ["x", "c"], ["s"]), helper.make_node("Reshape", ["s", "shape"], ["y"])],
                   [("x", F, [2])], [("y", F, [2, 1])])
    n = normalize(m)
    assert not any(node.op_type == "Constant" for node in n.graph.node)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in n.graph.initializer}
    np.testing.assert_array_equal(inits["c"], np.array([1.5, -2.0], np.float32))
    np.testing.assert_array_equal(inits["shape"], np.array([2, 1]))
    _same_outputs(m, n, {"x": _rand(2)})


def test_constant_subexpressions_are_folded_keeping_the_output_name():
    m = make_model([helper.make_node("Mul", ["c1", "c2"], ["prod"], name="mul"),
                    helper.make_node("Add", ["x", "prod"], ["y"], name="add")],
                   [("x", F, [2])], [("y", F, [2])],
                   {"c1": np.array([1, 2], np.float32), "c2": np.array([3, 4], np.float32)})
    n = normalize(m)
    assert [node.op_type for node in n.graph.node] == ["Add"]
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(next(t for t in n.graph.initializer if t.name == "prod")),
                                  np.array([3, 8], np.float32))
    _same_outputs(m, n, {"x": _rand(2)})


def test_constant_of_shape_is_folded():
    m = make_model([helper.make_node("ConstantOfShape", ["shp"], ["z"], value=helper.make_tensor("v", F, [1], [0.5])),
                    helper.make_node("Add", ["x", "z"], ["y"])],
                   [("x", F, [2, 3])], [("y", F, [2, 3])], {"shp": np.array([2, 3], np.int64)})
    n = normalize(m)
    assert [node.op_type for node in n.graph.node] == ["Add"]
    _same_outputs(m, n, {"x": _rand(2, 3)})


def test_quantize_dequantize_are_never_folded():
    m = make_model([helper.make_node("DequantizeLinear", ["wq", "s", "zp"], ["w"]),
                    helper.make_node("MatMul", ["x", "w"], ["y"])],
                   [("x", F, [1, 2])], [("y", F, [1, 2])],
                   {"wq": np.array([[1, 2], [3, 4]], np.int8), "s": np.array(0.5, np.float32), "zp": np.array(0, np.int8)})
    n = normalize(m)
    assert [node.op_type for node in n.graph.node] == ["DequantizeLinear", "MatMul"]


def test_trailing_empty_optional_inputs_are_dropped():
    m = make_model([helper.make_node("Clip", ["x", "lo", ""], ["y"], name="clip")],
                   [("x", F, [4])], [("y", F, [4])], {"lo": np.array(0.0, np.float32)})
    n = normalize(m)
    assert list(n.graph.node[0].input) == ["x", "lo"]
    _same_outputs(m, n, {"x": _rand(4)})


@pytest.mark.parametrize("op", ["Conv", "MaxPool", "AveragePool"])
@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_auto_pad_resolved_to_explicit_pads(op, mode):
    inits = {}
    if op == "Conv":
        inits = {"w": _rand(2, 3, 3, 2)}
        node = helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=mode, strides=[2, 2])
    else:
        node = helper.make_node(op, ["x"], ["y"], auto_pad=mode, kernel_shape=[3, 2], strides=[2, 2])
    m = make_model([node], [("x", F, [1, 3, 7, 8])], [("y", F, None)], inits, opset=13)
    n = normalize(m)
    attrs = {a.name: helper.get_attribute_value(a) for a in n.graph.node[0].attribute}
    assert "auto_pad" not in attrs and len(attrs["pads"]) == 4
    if mode != "VALID":
        assert attrs["pads"] != [0, 0, 0, 0]
    _same_outputs(m, n, {"x": _rand(1, 3, 7, 8)}, tol=1e-6)


def test_auto_pad_conv_transpose_matches_ort():
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])
    m = make_model([node], [("x", F, [1, 2, 5, 5])], [("y", F, None)], {"w": _rand(2, 3, 3, 3)}, opset=13)
    n = normalize(m)
    assert "auto_pad" not in {a.name for a in n.graph.node[0].attribute}
    _same_outputs(m, n, {"x": _rand(1, 2, 5, 5)}, tol=1e-6)


def test_same_pads_formula():
    # in 7, k 3, s 2: out 4, total = 3*2 + 3 - 7 = 2 -> 1/1; in 8, k 2, s 2: total 0
    assert same_pads([7, 8], [3, 2], [2, 2], [1, 1], "SAME_UPPER") == [1, 0, 1, 0]
    # in 6, k 4, s 1: total 3 -> upper 1/2, lower 2/1
    assert same_pads([6], [4], [1], [1], "SAME_UPPER") == [1, 2]
    assert same_pads([6], [4], [1], [1], "SAME_LOWER") == [2, 1]


def test_auto_pad_same_on_dynamic_shape_is_kept():
    # symbolic H/W: the converters pad at run time (tests/lift/test_dynamic_shapes.py); VALID is still resolved
    nodes = [helper.make_node("MaxPool", ["x"], ["y"], auto_pad="SAME_UPPER", kernel_shape=[3, 3], name="pool"),
             helper.make_node("MaxPool", ["x"], ["v"], auto_pad="VALID", kernel_shape=[3, 3], name="valid")]
    m = make_model(nodes, [("x", F, ["N", 3, "H", "W"])], [("y", F, None), ("v", F, None)], opset=13)
    n = normalize(m)
    attrs = [{a.name: helper.get_attribute_value(a) for a in node.attribute} for node in n.graph.node]
    assert attrs[0]["auto_pad"] == b"SAME_UPPER" and "pads" not in attrs[0]
    assert "auto_pad" not in attrs[1] and attrs[1]["pads"] == [0, 0, 0, 0]


def _if_model(cond: bool):
    then_g = helper.make_graph([helper.make_node("Add", ["x", "one"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, [3])])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "one"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, [3])])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g, name="if"),
             helper.make_node("Relu", ["y"], ["z"])]
    return make_model(nodes, [("x", F, [3])], [("z", F, [3])],
                      {"cond": np.array(cond), "one": np.ones(3, np.float32)})


@pytest.mark.parametrize("cond", [True, False])
def test_if_with_constant_condition_is_inlined(cond):
    m = _if_model(cond)
    n = normalize(m)
    ops = [node.op_type for node in n.graph.node]
    assert "If" not in ops and ops[0] == ("Add" if cond else "Sub")
    assert "y" in tensor_names(n)  # the If's output name survives on the inlined node
    _same_outputs(m, n, {"x": _rand(3)})


def test_every_tensor_gets_a_dtype():
    m = make_model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Shape", ["a"], ["s"]),
                    helper.make_node("Cast", ["s"], ["sf"], to=F), helper.make_node("ReduceSum", ["sf"], ["y"])],
                   [("x", F, ["N", 4])], [("y", F, None)], opset=13)
    n = normalize(m)
    typed = {v.name: v.type.tensor_type.elem_type for v in list(n.graph.value_info) + list(n.graph.output)}
    for node in n.graph.node:
        for o in node.output:
            assert typed.get(o, 0) != 0, o
    assert typed["s"] == onnx.TensorProto.INT64 and typed["a"] == F


def test_node_names_unique_non_empty_and_deterministic():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Abs", ["b"], ["c"], name="n"), helper.make_node("Relu", ["c"], ["d"]),
             helper.make_node("Neg", ["d"], ["y"], name="x")]  # same name as the graph input
    m = make_model(nodes, [("x", F, [2])], [("y", F, [2])])
    n1, n2 = normalize(m), normalize(m)
    names = [node.name for node in n1.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert names == [node.name for node in n2.graph.node]
    assert names[1] == "n" and names[2] != "n" and names[4] != "x"
    assert names[0] == "Relu_0" and names[3] == "Relu_3"


def test_surviving_tensor_names_are_preserved_and_identity_aliases_reported():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["r_id"]),
             helper.make_node("Neg", ["r_id"], ["y"])]
    m = make_model(nodes, [("x", F, [2])], [("y", F, [2])])
    n, aliases = normalize_with_aliases(m)
    after = tensor_names(n)
    for name in tensor_names(m) - set(aliases):
        assert name in after
    for gone, survivor in aliases.items():
        assert gone not in after and survivor in after
    assert {"x", "y"} <= after and ("r" in after or "r_id" in after)


def _conv_bn(extra_consumer=False):
    c = 4
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv_out"], name="conv", pads=[1, 1, 1, 1], group=2),
             helper.make_node("BatchNormalization", ["conv_out", "scale", "beta", "mean", "var"], ["bn_out"],
                              name="bn", epsilon=1e-3),
             helper.make_node("Relu", ["bn_out"], ["y"])]
    outputs = [("y", F, None)]
    if extra_consumer:
        nodes.append(helper.make_node("Neg", ["conv_out"], ["y2"]))
        outputs.append(("y2", F, None))
    inits = {"w": _rand(c, 1, 3, 3), "b": _rand(c), "scale": _rand(c), "beta": _rand(c), "mean": _rand(c),
             "var": np.abs(_rand(c)) + 0.1}
    return make_model(nodes, [("x", F, [1, 2, 6, 6])], outputs, inits, opset=13)


def test_batchnorm_folding():
    m = _conv_bn()
    kept = normalize(m)
    assert "BatchNormalization" in [node.op_type for node in kept.graph.node]
    n, aliases = normalize_with_aliases(m, fold_batchnorm=True)
    ops = [node.op_type for node in n.graph.node]
    assert ops == ["Conv", "Relu"]
    conv = n.graph.node[0]
    assert list(conv.output) == ["bn_out"] and list(conv.input) == ["x", "w", "b"]
    assert aliases["conv_out"] == "bn_out"
    assert {t.name for t in n.graph.initializer} == {"w", "b"}
    feeds = {"x": _rand(1, 2, 6, 6)}
    assert rel_l2(run_ort(m, feeds)[0], run_ort(n, feeds)[0]) < 1e-6


def test_batchnorm_not_folded_when_conv_output_has_other_consumers():
    n = normalize(_conv_bn(extra_consumer=True), fold_batchnorm=True)
    assert "BatchNormalization" in [node.op_type for node in n.graph.node]


def test_input_model_is_not_mutated():
    for m in (_conv_bn(), _if_model(True)):
        before = m.SerializeToString()
        normalize(m, fold_batchnorm=True)
        assert m.SerializeToString() == before


def test_normalize_rejects_non_models():
    with pytest.raises(ModelError):
        normalize(b"not a model")  # type: ignore[arg-type]


def test_old_opset_models_are_upgraded_to_opset_7():
    m = make_model([helper.make_node("Not", ["x"], ["y"])], [("x", onnx.TensorProto.BOOL, [2, 3])],
                   [("y", onnx.TensorProto.BOOL, None)], opset=1, ir_version=3)
    n = normalize(m)
    assert n.opset_import[0].version == 7 and m.opset_import[0].version == 1  # the input is not mutated
    x = RNG.integers(0, 2, (2, 3)).astype(bool)
    np.testing.assert_array_equal(run_ort(n, {"x": x})[0], ~x)


def test_castlike_with_saturate_becomes_cast_keeping_it():
    node = helper.make_node("CastLike", ["x", "like"], ["y"], saturate=0)
    m = make_model([node], [("x", F, [4])], [("y", onnx.TensorProto.FLOAT8E5M2, None)], opset=21)
    m.graph.initializer.append(helper.make_tensor("like", onnx.TensorProto.FLOAT8E5M2, [0], []))
    n = normalize(m)
    (cast,) = [x for x in n.graph.node]
    attrs = {a.name: helper.get_attribute_value(a) for a in cast.attribute}
    assert cast.op_type == "Cast" and attrs == {"to": onnx.TensorProto.FLOAT8E5M2, "saturate": 0}


def test_scalar_unsqueeze_axes_become_1d_without_touching_other_readers():
    nodes = [helper.make_node("Unsqueeze", ["x", "ax"], ["u"]), helper.make_node("Add", ["u", "ax_f"], ["y"]),
             helper.make_node("Cast", ["ax"], ["ax_f"], to=F)]
    m = make_model(nodes, [("x", F, [2, 3])], [("y", F, None)], {"ax": np.array(1, np.int64)}, opset=13)
    m.graph.output.append(helper.make_tensor_value_info("ax_f", F, None))
    n = normalize(m)
    inits = {t.name: t for t in n.graph.initializer}
    unsq = next(x for x in n.graph.node if x.op_type == "Unsqueeze")
    assert list(inits[unsq.input[1]].dims) == [1]
    _same_outputs(m, n, {"x": _rand(2, 3)})


def test_remaining_constant_nodes_hold_tensor_values():
    m = make_model([helper.make_node("Shape", ["x"], ["y"], start=2, end=1)], [("x", F, [3, 4, 5])],
                   [("y", onnx.TensorProto.INT64, None)], opset=21)
    n = normalize(m)
    for node in n.graph.node:
        if node.op_type == "Constant":
            assert [a.name for a in node.attribute] == ["value"]
    _same_outputs(m, n, {"x": _rand(3, 4, 5)})
