"""optimize_for_inference: the faster inference module computes the lifted module's function."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper

from qtorch_onnx.errors import ConfigError, DataError, ModelError
from qtorch_onnx.lift import lift
from qtorch_onnx.lift.optimize import optimize_for_inference

from .helpers import F, make_model

RTOL, ATOL = 1e-4, 1e-5


def _small_cnn():
    """Conv -> BatchNorm -> Relu -> depthwise Conv -> Mul/Add per channel -> Clip(0,6) -> GAP -> Reshape -> MatMul."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = {
        "w0": f32(8, 3, 3, 3), "b0": f32(8), "gamma": f32(8), "beta": f32(8), "mean": f32(8),
        "var": (rng.random(8) + 0.5).astype(np.float32), "w1": f32(8, 1, 3, 3),
        "scale": f32(1, 8, 1, 1), "shift": f32(8, 1, 1), "lo": np.float32(0), "hi": np.float32(6),
        "shape": np.array([0, -1], np.int64), "fc": f32(8, 4),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c0", "gamma", "beta", "mean", "var"], ["bn"], epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["r0"]),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1, 1, 1, 1], group=8, strides=[2, 2]),
        helper.make_node("Mul", ["scale", "c1"], ["m1"]),
        helper.make_node("Add", ["m1", "shift"], ["a1"]),
        helper.make_node("Clip", ["a1", "lo", "hi"], ["r6"]),
        helper.make_node("GlobalAveragePool", ["r6"], ["gap"]),
        helper.make_node("Reshape", ["gap", "shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc"], ["y"]),
    ]
    return make_model(nodes, [("x", F, [2, 3, 16, 16])], [("y", F, [2, 4])], inits)


def _hard_chains(second: bool):
    """Conv, then HardSwish as Div(Mul(x, Clip(Add(x,3),0,6)),6), (``second``) HardSwish as
    Mul(Div(Clip(Add(3,y)),6), y), a HardSigmoid chain Div(Clip(Add(z,3)),6) gating another tensor, and a
    Reshape with a runtime shape."""
    rng = np.random.default_rng(1)
    inits = {"w": (rng.standard_normal((6, 4, 1, 1)) * 3).astype(np.float32), "three": np.float32(3),
             "six": np.float32(6), "zero": np.float32(0), "tail": np.array([-1], np.int64),
             "start": np.array([0], np.int64), "end": np.array([1], np.int64)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Add", ["c", "three"], ["a0"]),
        helper.make_node("Clip", ["a0", "zero", "six"], ["k0"]),
        helper.make_node("Mul", ["c", "k0"], ["m0"]),
        helper.make_node("Div", ["m0", "six"], ["hs0"]),
        helper.make_node("Add", ["three", "hs0"], ["a1"]),
        helper.make_node("Clip", ["a1", "zero", "six"], ["k1"]),
        helper.make_node("Div", ["k1", "six"], ["d1"]),
        helper.make_node("Mul", ["d1", "hs0"], ["hs1"]) if second else helper.make_node("Identity", ["hs0"], ["hs1"]),
        helper.make_node("Add", ["x", "three"], ["a2"]),
        helper.make_node("Clip", ["a2", "zero", "six"], ["k2"]),
        helper.make_node("Div", ["k2", "six"], ["gate"]),
        helper.make_node("ReduceMean", ["gate"], ["g"], axes=[1], keepdims=1),
        helper.make_node("Mul", ["hs1", "g"], ["prod"]),
        helper.make_node("Shape", ["prod"], ["shp"]),
        helper.make_node("Slice", ["shp", "start", "end"], ["n"]),
        helper.make_node("Concat", ["n", "tail"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["prod", "newshape"], ["y"]),
    ]
    if not second:
        nodes = [n for n in nodes if not {"a1", "k1", "d1"} & set(n.output)]
    return make_model(nodes, [("x", F, ["N", 4, 5, 7])], [("y", F, ["N", "M"])], inits)


def _snapshot(gm):
    return gm.code, {k: v.detach().clone() for k, v in gm.state_dict().items()}


def _assert_unchanged(gm, snap):
    code, state = snap
    assert gm.code == code
    now = gm.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(now[k], v) and now[k].is_contiguous() == v.is_contiguous(), k


@pytest.mark.parametrize("compile", ["none", "jit"])
def test_small_cnn_matches_lifted(compile):
    gm = lift(_small_cnn())
    snap = _snapshot(gm)
    x = torch.randn(2, 3, 16, 16)
    om = optimize_for_inference(gm, [x], compile=compile)
    _assert_unchanged(gm, snap)
    assert om.report["conv_bn"] == 1 and om.report["conv_affine"] == 2
    names = {type(m).__name__ for m in om.graph_module.modules()}
    assert not names & {"BatchNorm2d", "OnnxBinaryOp", "OnnxClip"}, names
    for inp in (x, torch.randn(2, 3, 16, 16) * 4):
        with torch.no_grad():
            want = gm(inp)
        got = om(inp)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert not got.requires_grad


@pytest.mark.parametrize("second", [False, True])
def test_hard_activation_chains_fused(second):
    gm = lift(_hard_chains(second))
    snap = _snapshot(gm)
    x = torch.randn(3, 4, 5, 7) * 4  # values on both sides of -3 and 3
    eager = optimize_for_inference(gm, [x], fold=False, channels_last=False)
    fast = optimize_for_inference(gm, [x])
    _assert_unchanged(gm, snap)
    assert (eager.report["hardswish"], eager.report["hardsigmoid"]) == (1 + second, 1)
    targets = [n.target for n in eager.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.nn.functional.hardswish) == 1 + second
    assert torch.nn.functional.hardsigmoid in targets
    for inp in (x, torch.randn(5, 4, 5, 7) * 5):  # another batch size: the runtime Reshape follows it
        with torch.no_grad():
            want = gm(inp)
        got = eager(inp)
        assert got.shape == want.shape
        if not second:
            # torch's kernels evaluate x * min(max(x + 3, 0), 6) / 6 and min(max(x + 3, 0), 6) / 6 in the
            # exported order: bit-identical (y * (clip / 6), the second form, rounds differently)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(fast(inp), want, rtol=RTOL, atol=ATOL)


def test_bad_arguments_name_the_problem():
    gm = lift(_small_cnn())
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ConfigError, match="compile='tensorrt'"):
        optimize_for_inference(gm, [x], compile="tensorrt")
    with pytest.raises(DataError, match="1 tensors"):
        optimize_for_inference(gm, [x, x])
    with pytest.raises(ModelError, match="GraphModule"):
        optimize_for_inference(torch.nn.Identity(), [x])
    with pytest.raises(ModelError, match="fails on the example inputs"):
        optimize_for_inference(gm, [torch.randn(2, 5, 16, 16)])
    om = optimize_for_inference(gm, [x])
    with pytest.raises(DataError, match="'x'.*float64"):
        om(x.double())
    with pytest.raises(DataError, match="takes 1 inputs"):
        om(x, x)
