"""Converters added for newer opsets and the overrides, each checked against ONNX Runtime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from qtorch_onnx.errors import UnsupportedOpsError
from qtorch_onnx.lift import lift
from qtorch_onnx.lift import converters as conv

from .helpers import F, I64, make_model, rel_l2, run_gm, run_ort

RNG = np.random.default_rng(1)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _check(model, feeds, exact=False, tol=1e-6):
    gm = lift(model)
    want, got = run_ort(model, feeds), run_gm(gm, feeds)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.dtype == g.dtype, (w.shape, g.shape, w.dtype, g.dtype)
        if exact or w.dtype.kind != "f":
            np.testing.assert_array_equal(w, g)
        else:
            assert rel_l2(w, g) < tol
    return gm


X = _rand(2, 3, 5, 6)


@pytest.mark.parametrize("opset", [19, 21, 23])
def test_shape_new_versions(opset):
    m = make_model([helper.make_node("Shape", ["x"], ["s"], start=1, end=-1), helper.make_node("Shape", ["x"], ["t"])],
                   [("x", F, ["N", 3, 5, 6])], [("s", I64, None), ("t", I64, None)], opset=opset)
    _check(m, {"x": X})


@pytest.mark.parametrize("opset", [19, 21])
def test_reshape_new_versions(opset):
    m = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"])], [("x", F, ["N", 3, 5, 6])],
                   [("y", F, None)], {"shape": np.array([0, -1, 6], np.int64)}, opset=opset)
    _check(m, {"x": X}, exact=True)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceSumSquare", "ReduceProd",
                                "ReduceLogSumExp", "ReduceL1"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_18_axes_input(op, keepdims):
    m = make_model([helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)], [("x", F, [2, 3, 5, 6])],
                   [("y", F, None)], {"axes": np.array([1, -1], np.int64)}, opset=18)
    _check(m, {"x": X})


def test_reduce_18_no_axes_and_noop():
    nodes = [helper.make_node("ReduceMax", ["x"], ["all"]),
             helper.make_node("ReduceMean", ["x", "empty"], ["same"], noop_with_empty_axes=1)]
    m = make_model(nodes, [("x", F, [2, 3, 5, 6])], [("all", F, None), ("same", F, None)],
                   {"empty": np.array([], np.int64)}, opset=18)
    _check(m, {"x": X})


def test_split_18_num_outputs_uneven_and_split_input():
    nodes = [helper.make_node("Split", ["x"], ["a", "b", "c"], axis=3, num_outputs=3, name="by_count"),
             helper.make_node("Split", ["x", "sizes"], ["d", "e"], axis=1, name="by_sizes")]
    m = make_model(nodes, [("x", F, [2, 3, 5, 7])], [(o, F, None) for o in "abcde"],
                   {"sizes": np.array([1, 2], np.int64)}, opset=18)
    gm = _check(m, {"x": _rand(2, 3, 5, 7)}, exact=True)
    assert gm.output_names == tuple("abcde")


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("opset", [19, 21])
def test_pad_new_versions_with_axes(mode, opset):
    nodes = [helper.make_node("Pad", ["x", "pads", "cv", "axes"], ["y"], mode=mode)]
    inits = {"pads": np.array([1, 2, 2, -1], np.int64), "cv": np.array(1.5, np.float32),
             "axes": np.array([1, -1], np.int64)}
    if mode != "constant":
        inits["pads"] = np.array([1, 2, 2, 0], np.int64)
    m = make_model(nodes, [("x", F, [2, 3, 5, 6])], [("y", F, None)], inits, opset=opset)
    _check(m, {"x": X}, exact=True)


def test_pad_18_all_axes_default():
    m = make_model([helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")], [("x", F, [2, 3, 5, 6])],
                   [("y", F, None)], {"pads": np.array([0, 1, 1, 2, 0, 2, 3, 1], np.int64)}, opset=18)
    _check(m, {"x": X}, exact=True)


@pytest.mark.parametrize("opset", [18, 19])
@pytest.mark.parametrize("mode,ctm", [("nearest", "asymmetric"), ("linear", "half_pixel"),
                                      ("linear", "pytorch_half_pixel")])
def test_resize_new_versions(opset, mode, ctm):
    extra = {"nearest_mode": "floor"} if mode == "nearest" else {}
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode, coordinate_transformation_mode=ctm,
                            **extra)
    m = make_model([node], [("x", F, [2, 3, 5, 6])], [("y", F, None)],
                   {"scales": np.array([1, 1, 2, 2], np.float32)}, opset=opset)
    _check(m, {"x": X}, tol=1e-5)


def test_resize_antialias_is_reported_unsupported():
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear", antialias=1, name="rs")
    m = make_model([node], [("x", F, [2, 3, 5, 6])], [("y", F, None)],
                   {"scales": np.array([1, 1, 0.5, 0.5], np.float32)}, opset=18)
    with pytest.raises(UnsupportedOpsError, match="antialias") as info:
        lift(m)
    assert info.value.ops == [("", "Resize", 18, ["rs"])]


@pytest.mark.parametrize("opset", [19, 21])
@pytest.mark.parametrize("to", [TensorProto.INT32, TensorProto.FLOAT16, TensorProto.INT64])
def test_cast_new_versions(opset, to):
    m = make_model([helper.make_node("Cast", ["x"], ["y"], to=to)], [("x", F, [2, 3, 5, 6])], [("y", to, None)],
                   opset=opset)
    _check(m, {"x": X * 10}, exact=True)


@pytest.mark.parametrize("opset", [19, 22])
def test_average_pool_new_versions(opset):
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                            count_include_pad=0)
    m = make_model([node], [("x", F, [2, 3, 5, 6])], [("y", F, None)], opset=opset)
    _check(m, {"x": X})


def test_max_pool_22():
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1])
    m = make_model([node], [("x", F, [2, 3, 5, 6])], [("y", F, None)], opset=22)
    _check(m, {"x": X}, exact=True)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_20(approximate):
    m = make_model([helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)], [("x", F, [2, 3, 5, 6])],
                   [("y", F, None)], opset=20)
    _check(m, {"x": X})


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [None, 0, 1])
@pytest.mark.parametrize("opset", [11, 14])
def test_cumsum_override(exclusive, reverse, opset):
    attrs = {"exclusive": exclusive} | ({} if reverse is None else {"reverse": reverse})
    m = make_model([helper.make_node("CumSum", ["x", "axis"], ["y"], **attrs)], [("x", F, [2, 3, 5, 6])],
                   [("y", F, None)], {"axis": np.array(2, np.int64)}, opset=opset)
    xi = RNG.integers(-4, 5, size=(2, 3, 5, 6)).astype(np.float32)  # integers: sums are exact in any order
    _check(m, {"x": xi}, exact=True)


@pytest.mark.parametrize("opset", [9, 13])
def test_nonzero_override(opset):
    m = make_model([helper.make_node("NonZero", ["x"], ["y"])], [("x", F, [3, 4])], [("y", I64, None)], opset=opset)
    x = np.array([[0, 1, 0, 2], [3, 0, 0, 0], [0, 0, 5, 6]], np.float32)
    _check(m, {"x": x}, exact=True)


def test_registry_extension_is_public_only():
    # type-only newer versions are delegated to the supported older converter
    triples = {(op, v) for op, v, _ in conv.TYPE_ONLY_DELEGATIONS}
    assert {("Identity", 19), ("Identity", 21), ("MaxPool", 22), ("Conv", 22), ("Transpose", 21)} <= triples
    # onnx2torch's wrong converters are overridden, not re-registered
    assert ("", "CumSum", 14) in conv.OVERRIDES and ("", "NonZero", 13) in conv.OVERRIDES
    assert conv.converter_for("CumSum", 17) is conv.OVERRIDES[("", "CumSum", 14)]
