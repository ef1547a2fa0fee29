"""Graph optimization before quantization (qtorch_onnx.lift.fusion; Quark's optimize_model)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtorch_onnx as qo
from qtorch_onnx.data import to_samples
from qtorch_onnx.lift import fuse_for_quantization, normalize, normalize_and_fuse
from qtorch_onnx.runtime import check_parity, session

RNG = np.random.default_rng(0)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def _model(nodes, inits, out_shape, opset=17, in_shape=(1, 4, 8, 8)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *in_shape[1:]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return m


def _run(model, x):
    return session(model, opt_level="ORT_DISABLE_ALL").run(None, {"x": x})[0]


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _conv_bn_affine(bias=False, shared_add=False):
    """Conv (optionally without bias) -> Mul([1,C,1,1]) -> Add([1,C,1,1]) -> Relu: paddle2onnx's BatchNorm."""
    c = 6
    inits = [_init("w", RNG.normal(size=(c, 4, 3, 3))), _init("s", RNG.uniform(0.5, 2, (1, c, 1, 1))),
             _init("t", RNG.normal(size=(1, c, 1, 1)))]
    conv_in = ["x", "w"] + (["b"] if bias else [])
    if bias:
        inits.append(_init("b", RNG.normal(size=(c,))))
    nodes = [helper.make_node("Conv", conv_in, ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "s"], ["m"], name="mul"),
             helper.make_node("Add", ["t", "m"], ["a"], name="add"),  # constant first: commuted pattern
             helper.make_node("Relu", ["a"], ["r"], name="relu")]
    if shared_add:  # the added constant is also read by another node: it must keep its value
        nodes.append(helper.make_node("Add", ["r", "t"], ["y"], name="add2"))
    else:
        nodes.append(helper.make_node("Identity", ["r"], ["y"], name="out"))
    return _model(nodes, inits, None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shared_add", [False, True])
def test_conv_mul_add_becomes_one_biased_conv(bias, shared_add):
    model = _conv_bn_affine(bias, shared_add)
    before = model.SerializeToString()
    fused, aliases, report = normalize_and_fuse(model, optimize=True)
    assert model.SerializeToString() == before  # the user's model is untouched
    assert report.applied == {"Conv+Mul": 1, "Conv+Add": 1}, report.applied
    convs = [n for n in fused.graph.node if n.op_type == "Conv"]
    assert len(convs) == 1 and len(convs[0].input) == 3 and "Mul" not in _ops(fused)
    assert convs[0].output[0] == "a"  # the fused conv writes the last tensor of the pattern
    assert convs[0].name == "conv"  # and keeps the layer's node name (nodes_to_exclude etc. still find it)
    assert convs[0].input[1] == "w"  # the weight keeps its initializer name
    bias_name = convs[0].input[2]
    if bias:
        assert bias_name == "b"
    elif shared_add:
        assert bias_name not in ("t", "b") and "t" in {t.name for t in fused.graph.initializer}
    else:
        assert bias_name == "t"
    assert aliases["c"] == "a" and aliases["m"] == "a"
    x = RNG.normal(size=(2, 4, 8, 8)).astype(np.float32)
    want, got = _run(normalize(model), x), _run(fused, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_conv_transpose_group_mul_add_and_batchnorm():
    cin, cout, g = 4, 6, 2
    inits = [_init("w", RNG.normal(size=(cin, cout // g, 3, 3))), _init("s", RNG.uniform(0.5, 2, (cout, 1, 1))),
             _init("t", RNG.normal(size=(cout, 1, 1))),
             _init("gamma", RNG.uniform(0.5, 2, cout)), _init("beta", RNG.normal(size=cout)),
             _init("mean", RNG.normal(size=cout)), _init("var", RNG.uniform(0.5, 2, cout))]
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["c"], name="ct", group=g, strides=[2, 2]),
             helper.make_node("Mul", ["c", "s"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "t"], ["a"], name="add"),
             helper.make_node("BatchNormalization", ["a", "gamma", "beta", "mean", "var"], ["y"], name="bn")]
    model = _model(nodes, inits, None, in_shape=(1, 4, 5, 5))
    fused, _, report = normalize_and_fuse(model, optimize=True)
    assert _ops(fused) == ["ConvTranspose"], report.applied
    assert report.applied == {"ConvTranspose+Mul": 1, "ConvTranspose+Add": 1, "BatchNormalization->ConvTranspose": 1}
    x = RNG.normal(size=(1, 4, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(fused, x), _run(normalize(model), x), rtol=1e-5, atol=1e-5)


def test_what_must_not_fuse():
    c = 4
    inits = [_init("w", RNG.normal(size=(c, 4, 1, 1))), _init("pos", RNG.normal(size=(1, c, 8, 8))),
             _init("fc", RNG.normal(size=(4, 4))), _init("fb", RNG.normal(size=(4,)))]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
        helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2"),  # the weight is shared: no rewrite of w
        helper.make_node("Mul", ["c1", "pos"], ["m1"], name="m1"),  # varies along H, W: not per channel
        helper.make_node("Add", ["c2", "x"], ["a2"], name="a2"),  # an activation, not a constant
        helper.make_node("Add", ["m1", "a2"], ["s"], name="sum"),
        helper.make_node("ReduceMean", ["s"], ["r"], name="rm", axes=[2, 3], keepdims=0),
        helper.make_node("MatMul", ["r", "fc"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "r"], ["y"], name="residual"),  # MatMul + activation: not a Gemm
    ]
    model = _model(nodes, inits, None, opset=17)
    fused, report = fuse_for_quantization(normalize(model))
    assert report.applied == {} and sorted(_ops(fused)) == sorted(_ops(normalize(model)))


def test_matmul_add_to_gemm_with_constants_only():
    inits = [_init("fc", RNG.normal(size=(4, 5))), _init("fb", RNG.normal(size=(5,)))]
    nodes = [helper.make_node("Flatten", ["x"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "fc"], ["mm"], name="mm"),
             helper.make_node("Add", ["fb", "mm"], ["y"], name="add")]
    model = _model(nodes, inits, None, in_shape=(1, 4))
    fused, aliases, report = normalize_and_fuse(model, optimize=True)
    assert report.applied == {"MatMul+Add->Gemm": 1} and "Gemm" in _ops(fused) and aliases["mm"] == "y"
    assert next(n for n in fused.graph.node if n.op_type == "Gemm").name == "mm"
    x = RNG.normal(size=(3, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(fused, x), _run(normalize(model), x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("opset", [13, 14])
def test_hardswish_chain_fuses_where_the_opset_has_hardswish(opset):
    inits = [_init("three", 3.0), _init("zero", 0.0), _init("six", 6.0)]
    nodes = [helper.make_node("Add", ["x", "three"], ["p"], name="p3"),
             helper.make_node("Clip", ["p", "zero", "six"], ["cl"], name="clip"),
             helper.make_node("Mul", ["x", "cl"], ["xm"], name="mul"),
             helper.make_node("Div", ["xm", "six"], ["y"], name="div")]
    model = _model(nodes, inits, None, opset=opset)
    fused, report = fuse_for_quantization(normalize(model))
    if opset >= 14:
        assert _ops(fused) == ["HardSwish"] and report.applied == {"HardSwish": 1}
    else:  # HardSwish does not exist before opset 14: the chain stays
        assert report.applied == {} and "HardSwish" not in _ops(fused)
    x = RNG.normal(scale=4, size=(1, 4, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(fused, x), _run(normalize(model), x), rtol=1e-6, atol=1e-6)


def test_a_failing_rule_falls_back_to_the_unoptimized_graph(monkeypatch):
    from qtorch_onnx.lift import fusion

    class Boom:  # not a rewrite rule: onnxscript fails on it
        pass

    rules = fusion._rule_list()
    monkeypatch.setattr(fusion, "_rule_list", lambda: [("Conv+Mul", Boom(), False, 1)] + rules)
    model = _conv_bn_affine()
    with pytest.warns(UserWarning, match="rule 'Conv\\+Mul' failed: .*unoptimized graph is used"):
        fused, _, report = normalize_and_fuse(model, optimize=True)
    assert report.error and report.applied == {} and "Mul" in _ops(fused)


def test_prepare_follows_optimize_model_and_exports_bit_exact():
    model = _conv_bn_affine()
    data = [RNG.normal(size=(1, 4, 8, 8)).astype(np.float32) for _ in range(4)]
    counts = {}
    for optimize in (False, True):
        cfg = qo.get_default_config("A8W8")
        cfg.optimize_model = optimize
        qm = qo.prepare(model, cfg)
        qo.calibrate(qm, data, progress=False)
        fqs = qm.quantizers()
        counts[optimize] = len(fqs)
        exported, qmap = qo.export(qm, None, return_map=True)
        rep = check_parity(qm, exported, qmap, to_samples(data[:2], qm.input_specs), opt_levels=("ORT_DISABLE_ALL",))
        assert all(n.exact for n in rep.nodes), [n for n in rep.nodes if not n.exact]
        if optimize:
            assert qm.gm.fusion_report.applied == {"Conv+Mul": 1, "Conv+Add": 1}
            assert "t" in fqs and fqs["t"].role != "activation"  # the fused bias: quantized as a bias
            assert {"c", "m"}.isdisjoint(fqs)
        else:
            assert qm.gm.fusion_report is None
    assert counts[True] < counts[False]


def test_nodes_to_exclude_finds_a_fused_layer_by_its_name():
    model = _conv_bn_affine()
    cfg = qo.get_default_config("A8W8")
    cfg.nodes_to_exclude = ["conv"]
    qm = qo.prepare(model, cfg)
    assert qm.gm.fusion_report.applied and "w" not in qm.quantizers()  # the excluded Conv's weight stays float


def test_an_override_on_a_fused_tensor_says_what_happened():
    model = _conv_bn_affine()
    cfg = qo.get_default_config("A8W8")
    cfg.extra_options = {**cfg.extra_options, "TensorQuantOverrides": {"c": [{"scale": np.float32(0.1),
                                                                             "zero_point": np.int8(0)}]}}
    with pytest.raises(qo.ConfigError, match=r"tensor 'c' of the model does not exist after .*flows through 'a'.*"
                                             r"optimize_model=False"):
        qo.prepare(model, cfg)
    cfg.optimize_model = False  # the graph as given: the Conv output exists and takes the override
    assert "c" in qo.prepare(model, cfg).quantizers()
