"""ONNX Runtime's TensorQuantOverrides on weights (per tensor and per channel), its ``convert`` mixed precision
and ``reduce_range``: every key acts, bad entries are named (issue 14, item 4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import numpy_helper

import qtorch_onnx as qo
from qtorch_onnx import CalibrationMethod, Config, QuantizationConfig, QuantType
from qtorch_onnx.data import to_samples
from qtorch_onnx.formats import integer as I
from qtorch_onnx.formats.spec import INT8
from qtorch_onnx.runtime import check_parity

from .small_models import calib_data, cnn


def _config(overrides, **kw):
    return Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        extra_options={"TensorQuantOverrides": overrides}, **kw))


def _prepared(overrides, **kw):
    qm = qo.prepare(cnn(), _config(overrides, **kw))
    qo.calibrate(qm, calib_data(4), progress=False)
    return qm


def _bit_exact(qm):
    exported, qmap = qo.export(qm, None, return_map=True)
    rep = check_parity(qm, exported, qmap, to_samples(calib_data(3), qm.input_specs), opt_levels=("ORT_DISABLE_ALL",))
    assert rep.nodes and not [n.tensor for n in rep.nodes if not n.exact]
    return exported


def _init(model, name):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}[name]


def _weight_dq_scale(model, weight):
    """The scale initializer of the DequantizeLinear that reads ``weight``'s quantized initializer."""
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0].startswith(weight):
            return _init(model, n.input[1])
    raise AssertionError(f"no DequantizeLinear for {weight}")


def test_weight_overrides_per_tensor_and_per_channel_act_and_export_bit_exact():
    fc_rng = [{"axis": 0, "rmin": -0.1, "rmax": 0.1}] + [{"rmin": -0.2, "rmax": 0.2}] * 4 + \
        [{"scale": np.float32(0.003), "zero_point": np.int8(0)}] + [{}] * 4
    qm = _prepared({"w2": [{"scale": np.float32(0.05), "zero_point": np.int8(0)}], "fc_w": fc_rng,
                    "w3": [{"axis": 0, "rmax": 0.25, "rmin": -0.5}]})
    fq = qm.quantizers()
    assert fq["w2"].scale.item() == np.float32(0.05) and fq["w2"].axis is None
    fc_w = _init(cnn(), "fc_w")
    own = np.abs(fc_w).max(axis=1)  # the channels without an override keep their own range
    expect = [0.1 / 127] + [0.2 / 127] * 4 + [0.003] + list(own[6:] / 127)
    assert np.array_equal(fq["fc_w"].scale.numpy(), np.array(expect, dtype=np.float64).astype(np.float32))
    # one dict with axis: per channel along it, the same range for every channel
    assert fq["w3"].scale.shape == (4,) and torch.all(fq["w3"].scale == np.float32(0.5 / 127))
    exported = _bit_exact(qm)
    assert _weight_dq_scale(exported, "w2").item() == np.float32(0.05)
    assert np.array_equal(_weight_dq_scale(exported, "fc_w").astype(np.float32), fq["fc_w"].scale.numpy())
    # without the overrides the parameters differ: the test would notice an ignored override
    plain = _prepared({})
    assert plain.quantizers()["w2"].scale.item() != np.float32(0.05)


def test_pinned_weight_qparams_survive_training_mode_switches_and_save(tmp_path):
    qm = _prepared({"w2": [{"scale": np.float32(0.05), "zero_point": np.int8(0)}],
                    "w1": [{"axis": 0, "rmin": -1.0, "rmax": 1.0}] + [{}] * 7})
    with torch.no_grad():
        qm.parameter("w2").mul_(3.0)
        qm.parameter("w1").mul_(0.5)
    qm.set_mode("quantize")
    qo.calibrate(qm, calib_data(2), progress=False)
    qm(torch.from_numpy(calib_data(1)[0]["input"]))
    fq = qm.quantizers()
    assert fq["w2"].scale.item() == np.float32(0.05)
    w1 = qm.parameter("w1").detach().double().abs().flatten(1).amax(1)
    assert fq["w1"].scale[0].item() == np.float32(1.0 / 127)  # pinned channel
    assert np.allclose(fq["w1"].scale[1:].numpy(), (w1[1:] / 127).numpy(), rtol=1e-6)  # live channels
    qo.save(qm, str(tmp_path / "m.qtorch"))
    back = qo.load(str(tmp_path / "m.qtorch"))
    with torch.no_grad():
        back.parameter("w2").mul_(2.0)
    back(torch.from_numpy(calib_data(1)[0]["input"]))
    assert back.quantizers()["w2"].scale.item() == np.float32(0.05)
    _bit_exact(back)


def test_reduce_range_on_a_weight():
    qm = _prepared({"w2": [{"reduce_range": True}]})
    w2 = torch.tensor(_init(cnn(), "w2"), dtype=torch.float64)
    s, z = I.qparams_from_range(w2.min(), w2.max(), INT8, True, reduce_range=True)
    assert qm.quantizers()["w2"].scale.item() == s.item()
    assert qm.quantizers()["w2"].scale.item() != _prepared({}).quantizers()["w2"].scale.item()
    _bit_exact(qm)
    # reduce_range=True in the configuration: every integer weight (ONNX Runtime's meaning), overrides included
    cfg_wide = _prepared({"w2": [{"scale": np.float32(0.05), "zero_point": np.int8(0)}]}, reduce_range=True)
    fq = cfg_wide.quantizers()
    assert fq["w2"].scale.item() == np.float32(0.05)
    assert fq["w1"].scale.flatten()[0].item() != _prepared({}).quantizers()["w1"].scale.flatten()[0].item()
    assert all(dict(cfg_wide.plan.specs[w].overrides).get("reduce_range") for w in ("w1", "w3", "fc_w"))
    _bit_exact(cfg_wide)


def test_convert_gives_the_recv_node_a_second_quantizer():
    qm = _prepared({"r1": [{"convert": {"quant_type": QuantType.QUInt16, "recv_nodes": ["conv2"]}}]})
    fq = qm.quantizers()
    assert fq["r1"].fmt.name == "UINT8" and fq["r1 -> conv2"].fmt.name == "UINT16" and fq["r1 -> conv2"].chained
    assert "r1 -> add1" not in fq
    exported = _bit_exact(qm)
    conv2 = next(n for n in exported.graph.node if n.name == "conv2")
    chain, t = [], conv2.input[0]
    producers = {o: n for n in exported.graph.node for o in n.output}
    while t in producers and producers[t].op_type in ("QuantizeLinear", "DequantizeLinear"):
        chain.append(producers[t].op_type)
        t = producers[t].input[0]
    assert chain == ["DequantizeLinear", "QuantizeLinear"] * 2  # UINT16 Q/DQ after the UINT8 Q/DQ
    # every reader when recv_nodes is absent
    qm2 = _prepared({"r1": [{"convert": {"quant_type": QuantType.QUInt16}}]})
    assert {"r1 -> conv2", "r1 -> add1"} <= set(qm2.quantizers())


@pytest.mark.parametrize("overrides, words", [
    ({"fc_w": [{"axis": 0, "scale": np.float32(0.1), "zero_point": np.int8(0)}] * 3},
     ["'fc_w'", "3 per-channel", "10 channels", "axis 0"]),
    ({"fc_w": [{"axis": 2}]}, ["'fc_w'", "axis 2", "out of range"]),
    ({"r1": [{"axis": 1}, {}]}, ["'r1'", "initializers", "activation"]),
    ({"r1": [{"reduce_range": True}]}, ["'r1'", "reduce_range", "activation"]),
    ({"w2": [{"convert": {"quant_type": QuantType.QInt16}}]}, ["'w2'", "convert", "initializer"]),
    ({"fc_w": [{"axis": 0, "quant_type": QuantType.QInt8}] + [{"quant_type": QuantType.QInt16}] * 9},
     ["'fc_w'", "channel 1", "quant_type", "first dict"]),
    ({"r1": [{"convert": {"quant_type": QuantType.QUInt16, "recv_nodes": ["fc"]}}]}, ["'r1'", "['fc']", "readers"]),
])
def test_bad_overrides_are_named(overrides, words):
    with pytest.raises(qo.ConfigError) as e:
        qo.prepare(cnn(), _config(overrides))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("method", ["Percentile", "MinMSE"])
def test_weight_calibrate_method_acts(method):
    """Quark's WeightCalibrateMethod: the weights' range (Percentile) or power-of-two scale (MinMSE) comes from
    the observer of that method, per channel; recomputed when the weight changes; export bit-exact."""
    from qtorch_onnx.config.enums import CalibrationMethod as CM, PowerOfTwoMethod
    from qtorch_onnx.observers import make_observer

    wcm = CM.Percentile if method == "Percentile" else PowerOfTwoMethod.MinMSE
    extra = {"WeightCalibrateMethod": wcm}
    if method == "Percentile":
        extra["Percentile"] = 99.0
    cfg = Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        per_channel=True, extra_options=extra))
    qm = qo.prepare(cnn(), cfg)
    qo.calibrate(qm, calib_data(4), progress=False)
    fq = qm.quantizers()["w2"]
    w2 = torch.tensor(_init(cnn(), "w2"))
    for c in (0, 5):
        opts = {"percentile": 99.0} if method == "Percentile" else {"fmt": INT8, "symmetric": True}
        obs = make_observer(method, **opts)
        obs.update(w2[c])
        if obs.needs_second_pass:
            obs.start_second_pass()
            obs.update(w2[c])
        if method == "Percentile":
            s, _ = I.qparams_from_range(*obs.compute_range(), INT8, True)
        else:
            s, _ = obs.compute_qparams(INT8, True)
        assert fq.scale[c].item() == s.item()
    minmax = qo.prepare(cnn(), Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        per_channel=True))).quantizers()["w2"].scale
    assert not torch.equal(fq.scale, minmax)  # the method changed the parameters
    if method == "MinMSE":
        assert torch.equal(torch.exp2(torch.round(torch.log2(fq.scale))), fq.scale)
    before = fq.scale.clone()
    with torch.no_grad():
        qm.parameter("w2").mul_(4.0)
    qm(torch.from_numpy(calib_data(1)[0]["input"]))
    assert not torch.equal(fq.scale, before)  # the live weight changed, so did its parameters
    _bit_exact(qm)
