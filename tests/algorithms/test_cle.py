"""Cross-layer equalization (include_cle, Quark's CLE keys) and ReplaceClip6Relu on small models."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import qtorch_onnx as qo
from qtorch_onnx import CalibrationMethod, Config, QuantizationConfig, QuantType
from qtorch_onnx.algorithms.cle import cross_layer_equalization, equalization_pairs
from qtorch_onnx.config.internal import CLESettings
from qtorch_onnx.data import to_samples
from qtorch_onnx.runtime import check_parity

from ..quant.small_models import cnn


def dw_separable(clip6: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x [N,4,8,8] -> Conv 3x3 (8, channel scales spread over 100x) -> Relu|Clip6 -> Pad(zero) -> depthwise
    Conv 3x3 -> Relu|Clip6 -> pointwise Conv (6) -> GlobalAveragePool -> Flatten -> Gemm (5)."""
    rng = np.random.default_rng(seed)
    spread = np.logspace(-1, 1, 8).astype(np.float32)  # per-channel magnitudes 0.1 .. 10
    w1 = (rng.normal(0, 1, (8, 4, 3, 3)) * spread[:, None, None, None]).astype(np.float32)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("w1", w1), ("b1", rng.normal(0, 0.1, 8) * spread), ("wd", rng.normal(0, 1, (8, 1, 3, 3)) / spread[:, None, None, None]),
        ("bd", rng.normal(0, 0.1, 8)), ("wp", rng.normal(0, 0.3, (6, 8, 1, 1))), ("bp", rng.normal(0, 0.1, 6)),
        ("fw", rng.normal(0, 0.3, (5, 6))), ("fb", rng.normal(0, 0.1, 5)))]
    inits += [numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"),
              numpy_helper.from_array(np.array(0.0, np.float32), "lo"), numpy_helper.from_array(np.array(6.0, np.float32), "hi")]

    def act(x, y, name):
        return helper.make_node("Clip", [x, "lo", "hi"], [y], name=name) if clip6 else \
            helper.make_node("Relu", [x], [y], name=name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             act("c1", "a1", "act1"),
             helper.make_node("Pad", ["a1", "pads"], ["p1"], name="pad1"),
             helper.make_node("Conv", ["p1", "wd", "bd"], ["c2"], name="dw", group=8),
             act("c2", "a2", "act2"),
             helper.make_node("Conv", ["a2", "wp", "bp"], ["c3"], name="pw"),
             helper.make_node("GlobalAveragePool", ["c3"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat", axis=1),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "dws", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def data(n=4, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(0, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(n)]


def _lifted(model):
    from qtorch_onnx.training import make_trainable

    gm = qo.lift(model, fold_batchnorm=True).eval()
    make_trainable(gm)
    return gm


def test_pairs_and_float_equivalence():
    gm = _lifted(dw_separable())
    pairs = equalization_pairs(gm)
    assert [(a, b) for a, b, _ in pairs] == [("conv1", "dw"), ("dw", "pw"), ("pw", "fc")]
    assert pairs[0][2] == ["act1", "pad1"]  # through Relu and the zero Pad
    assert pairs[2][2] == ["gap", "flat"]  # a pooled [N, C, 1, 1] flattened keeps channel i as feature i
    x = torch.from_numpy(np.concatenate([d["x"] for d in data()]))
    with torch.no_grad():
        before = gm(x).clone()
    w1 = gm.get_submodule(gm.tensor_map.graph.nodes["conv1"].module).weight
    r = w1.detach().abs().reshape(8, -1).amax(1)
    ratio = float(r.max() / r.min())
    rep = cross_layer_equalization(gm, CLESettings(steps=-1, use_threshold=False, append_bias=False))
    with torch.no_grad():
        after = gm(x)
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-5)  # the float function is unchanged
    assert rep.sweeps >= 2 and rep.range_ratio_after["conv1"] < ratio / 5
    # after convergence each channel's two ranges agree (the definition of equalized)
    wd = gm.get_submodule(gm.tensor_map.graph.nodes["dw"].module).weight
    r1 = w1.detach().abs().reshape(8, -1).amax(1)
    r2 = wd.detach().abs().reshape(8, -1).amax(1)  # depthwise: input channel i is weight row i
    assert torch.allclose(r1, r2, rtol=1e-3)


def test_include_cle_lowers_per_tensor_error_and_exports_bit_exact():
    def quantized_error(cle, **extra):
        cfg = Config(global_quant_config=QuantizationConfig(
            calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8, per_channel=False, include_cle=cle, extra_options=extra))
        qm = qo.prepare(dw_separable(), cfg)
        qo.calibrate(qm, data(8), progress=False)
        s = to_samples(data(8, seed=3), qm.input_specs)
        with torch.no_grad(), qo.fake_quant_disabled(qm):
            f = torch.cat([qm(*x) for x in s])
        with torch.no_grad():
            q = torch.cat([qm(*x) for x in s])
        return float((q - f).norm() / f.norm()), qm

    plain, _ = quantized_error(False)
    equalized, qm = quantized_error(True, CLESteps=-1)
    assert qm.cle_report is not None and len(qm.cle_report.pairs) == 3
    assert equalized < 0.7 * plain, (plain, equalized)
    exported, qmap = qo.export(qm, None, return_map=True)
    rep = check_parity(qm, exported, qmap, to_samples(data(2), qm.input_specs), opt_levels=("ORT_DISABLE_ALL",))
    assert rep.nodes and all(n.exact for n in rep.nodes)
    # the exported float initializers are the equalized ones
    w1 = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    assert not any(np.array_equal(v, numpy_helper.to_array(dw_separable().graph.initializer[0]))
                   for v in w1.values() if v.shape == (8, 4, 3, 3))


def _scales(qm):
    return {k: fq.scale.detach().clone() for k, fq in qm.quantizers().items() if fq.role in ("weight", "bias")}


@pytest.mark.parametrize("builder", [False, True], ids=["prepare", "mixed_precision_build"])
def test_equalized_weights_get_their_own_scales_before_any_forward(builder):
    """CLE scales the torch parameters, not the ONNX initializers the quantizers are first set from: a prepared
    model's weight scales (and the INT32 bias scales derived from them) must be the equalized weights' already,
    not only after a forward refreshes them, or whatever reads a bias before its weight sees a stale scale
    (fast finetune's direct loss did, EfficientNet-Lite0's /_blocks.0/_project_conv: 0.0652 for 0.0124)."""
    from qtorch_onnx.algorithms import mixed_precision as mp

    cfg = Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
        per_channel=False, include_cle=True, extra_options={"CLESteps": -1}))
    qm = qo.prepare(dw_separable(), cfg)
    report = qm.cle_report
    if builder:
        b = mp._Builder(dw_separable(), qm.config, to_samples(data(2), qm.input_specs), None, False)
        qm, report = b.build(b.cfg), b.cle_report
    assert report is not None and len(report.pairs) == 3
    before = _scales(qm)
    dw = {layer.name: layer for layer in qm.layers()}["dw"]
    assert float(dw.weight_quantizer.scale) == pytest.approx(float(dw.weight.detach().abs().max()) / 127, rel=1e-6)
    qm.sync_qparams()  # what the first forward would make of them
    after = _scales(qm)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), \
        [k for k in before if not torch.equal(before[k], after[k])]


def test_fast_finetune_on_an_equalized_model_keeps_the_direct_loss():
    """Every layer of an equalized model trains on the written-out direct loss: its gradient check passes because
    the biases it captures carry the equalized weights' scales (with the pre-CLE ones, conv1 and dw failed the
    check and trained by autograd)."""
    cfg = Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
        per_channel=False, include_cle=True, extra_options={"CLESteps": -1}))
    qm = qo.prepare(dw_separable(), cfg)
    qo.calibrate(qm, data(8), progress=False)
    qo.fast_finetune(qm, data(8), algorithm="adaquant", num_iterations=4, batch_size=2, progress=False,
                     quadratic_loss=False)
    notes = {r.name: r.note for r in qm.finetune_report.layers}
    assert sorted(notes) == ["conv1", "dw", "fc", "pw"]
    assert all("direct loss" in n for n in notes.values()), notes


def test_replace_clip6_relu_opens_the_pairs():
    gm = _lifted(dw_separable(clip6=True))
    assert [(a, b) for a, b, _ in equalization_pairs(gm)] == [("pw", "fc")]  # ReLU6 is not homogeneous
    cfg = Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        include_cle=True, extra_options={"ReplaceClip6Relu": True}))
    qm = qo.prepare(dw_separable(clip6=True), cfg)
    assert qm.cle_report.replaced_clips == ["act1", "act2"] and len(qm.cle_report.pairs) == 3
    assert [n.op_type for n in qm.onnx_model.graph.node if n.name in ("act1", "act2")] == ["Relu", "Relu"]
    qo.calibrate(qm, data(4), progress=False)
    _ = qo.export(qm, None)


def test_no_pair_is_noted_and_keys_need_include_cle(caplog):
    qm_cfg = Config(global_quant_config=QuantizationConfig(include_cle=True))
    with caplog.at_level("INFO", logger="qtorch_onnx.algorithms.cle"):
        qm = qo.prepare(_single_conv(), qm_cfg)
    assert qm.cle_report.pairs == [] and "no Conv/Gemm pair" in qm.cle_report.note
    assert any("no Conv/Gemm pair" in r.getMessage() for r in caplog.records)
    with pytest.raises(qo.ConfigError, match="CLESteps.*include_cle=True"):
        qo.prepare(cnn(), Config(global_quant_config=QuantizationConfig(extra_options={"CLESteps": 2})))
    with pytest.raises(qo.ConfigError, match="CLESteps.*-1"):
        qo.prepare(cnn(), Config(global_quant_config=QuantizationConfig(include_cle=True,
                                                                        extra_options={"CLESteps": 0})))
    with pytest.raises(qo.ConfigError, match="CLEBalanceMethod.*'max'"):
        qo.prepare(cnn(), Config(global_quant_config=QuantizationConfig(
            include_cle=True, extra_options={"CLEBalanceMethod": "avg"})))


def _single_conv():
    w = numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="c")], "one",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 4, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _biased_pair(seed: int = 0) -> onnx.ModelProto:
    """x [N,4,6,6] -> Conv 3x3 (8; biases 0.5x the channel's ||w||_1 on channels 0-3, 4x on 4-7) -> Relu ->
    Conv 1x1 (5)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.normal(0, 1, (8, 4, 3, 3)) * np.logspace(-1, 1, 8)[:, None, None, None]).astype(np.float32)
    l1 = np.abs(w1).reshape(8, -1).sum(1)
    b1 = (l1 * np.array([0.5] * 4 + [4.0] * 4) * np.array([1, -1] * 4)).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
             numpy_helper.from_array(rng.normal(0, 0.3, (5, 8, 1, 1)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.normal(0, 0.1, 5).astype(np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["a1"], name="act1"),
             helper.make_node("Conv", ["a1", "w2", "b2"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "biased", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, 6, 6])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_append_bias_weighs_the_bias_against_the_weighted_sum():
    """CLEScaleAppendBias: a bias counts in its channel's range as max|w_i| * |b_i| / ||w_i||_1 (bias_range), not
    as |b_i| itself: channels whose bias is below their weighted sum end with both layers' weight ranges equal
    (compared raw, a bias of 0.5 ||w_i||_1 > max|w_i| would have set their scale); the others keep the
    bias' excess as a factor; one sweep is a fixed point; the float function is unchanged."""
    from qtorch_onnx.algorithms.cle import bias_range

    gm = _lifted(_biased_pair())
    x = torch.from_numpy(np.random.default_rng(2).normal(0, 1, (3, 4, 6, 6)).astype(np.float32))
    with torch.no_grad():
        before = gm(x).clone()
    m1 = gm.get_submodule(gm.tensor_map.graph.nodes["conv1"].module)
    m2 = gm.get_submodule(gm.tensor_map.graph.nodes["conv2"].module)
    assert torch.all(m1.bias.detach().abs()[:4] > m1.weight.detach().abs().reshape(8, -1).amax(1)[:4])
    rep = cross_layer_equalization(gm, CLESettings(steps=1, use_threshold=False, append_bias=True))
    assert [(a, b) for a, b, _ in rep.pairs] == [("conv1", "conv2")]
    with torch.no_grad():
        after = gm(x)
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)
    r1 = m1.weight.detach().abs().reshape(8, -1).amax(1)
    r2 = m2.weight.detach().abs().reshape(5, 8).amax(0)
    assert torch.allclose(r1[:4], r2[:4], rtol=1e-5)
    assert torch.allclose(4 * r1[4:], r2[4:], rtol=1e-5)
    assert torch.allclose(bias_range(m1.weight, m1.bias)[4:], r2[4:], rtol=1e-5)
    w1, w2 = m1.weight.detach().clone(), m2.weight.detach().clone()
    cross_layer_equalization(gm, CLESettings(steps=1, use_threshold=False, append_bias=True))
    assert torch.allclose(m1.weight, w1, rtol=1e-5) and torch.allclose(m2.weight, w2, rtol=1e-5)
    # a channel with all-zero weights: its bias counts nothing (no division by zero)
    z = bias_range(torch.zeros(2, 3), torch.tensor([5.0, -1.0]))
    assert torch.equal(z, torch.zeros(2))


def test_named_configs_turn_cle_on_like_quark():
    for name in ("A8W8", "A16W8", "BF16", "A8W8_ADAROUND", "BF16_ADAQUANT"):
        assert qo.get_default_config(name).include_cle is True, name
    for name in ("BFP16", "MX9", "XINT8"):  # BFP16: no equalization rule beat none on the zoo (docs/benchmarks.md)
        assert qo.get_default_config(name).include_cle is False, name


def test_quantize_model_with_named_a8w8_equalizes(tmp_path):
    q = qo.ModelQuantizer(Config(global_quant_config=qo.get_default_config("A8W8")))
    q.quantize_model(dw_separable(), str(tmp_path / "a8w8.onnx"), data(4), progress=False)
    rep = q.quantized_model.cle_report
    assert [(a, b) for a, b, _ in rep.pairs] == [("conv1", "dw"), ("dw", "pw"), ("pw", "fc")]
    assert rep.range_ratio_after["conv1"] < rep.range_ratio_before["conv1"] / 5 and rep.note == ""
