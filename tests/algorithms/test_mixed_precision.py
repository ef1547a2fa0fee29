"""Sensitivity analysis and automatic mixed precision (issue 13) on small models."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import qtorch_onnx as qo
from qtorch_onnx.algorithms import MixedPrecisionPlan, auto_mixed_precision, sensitivity
from qtorch_onnx.algorithms.mixed_precision import resolve_metric, run_outputs
from qtorch_onnx.data import to_samples
from qtorch_onnx.runtime import check_parity

from qtorch_onnx.quantizer import resolve

from ..quant.small_models import calib_data, cnn, token_block, token_data


#: the named A16W8 without its BiasCorrection: the search tests below check properties of the search (bisection
#: against exhaustive search, probes in ONNX Runtime, fill, calibration reuse) on a landscape that does not move
#: with the correction; test_bias_correction_in_every_build covers the search with it
A16W8 = dataclasses.replace(resolve("A16W8"), bias_correction=False)


def _wide(config="A16W8", model=None, data=None):
    qm = qo.prepare(model if model is not None else cnn(), config)
    qo.calibrate(qm, data if data is not None else calib_data(8), progress=False)
    return qm


def _bit_exact(qm, data):
    exported, qmap = qo.export(qm, None, return_map=True)
    rep = check_parity(qm, exported, qmap, to_samples(data, qm.input_specs), opt_levels=("ORT_DISABLE_ALL",))
    assert not [n for n in rep.nodes if not n.exact]
    return exported


def test_sensitivity_per_layer_and_candidate():
    qm = _wide()
    rep = sensitivity(qm, calib_data(8), ["INT8", ("INT8", "INT4")], progress=False)
    assert [l.name for l in rep.layers] == ["conv1", "conv2", "conv3", "fc"]
    assert rep.candidates == ["INT8", "INT8/INT4"]
    for l in rep.layers:
        assert set(l.measured) == {"INT8", "INT8/INT4"} and all(np.isfinite(v) for v in l.measured.values())
        assert l.measured["INT8/INT4"] >= l.measured["INT8"] * 0.9  # 4-bit weights cost more
        assert l.weight_bytes["INT8/INT4"] == l.weight_bytes["wide"] / 2
    assert set(rep.spearman) == {"INT8", "INT8/INT4"}
    assert rep.forward_passes == 1 + 2 * (4 + 1)  # float pass; per candidate: 4 layers (the sweep) + gradient
    s8 = to_samples(calib_data(8), qm.input_specs)
    with qo.fake_quant_disabled(qm):
        f8 = run_outputs(qm, s8, 0)
    assert rep.baseline == resolve_metric("l2")[1](f8, run_outputs(qm, s8, 0))  # the all-wide value, from the sweep
    # the wide model is left as it was
    before = run_outputs(qm, to_samples(calib_data(4), qm.input_specs), 0)
    sensitivity(qm, calib_data(4), ["INT8"], progress=False, gradient=False)
    after = run_outputs(qm, to_samples(calib_data(4), qm.input_specs), 0)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(before, after))


def test_bisection_agrees_with_exhaustive_and_target_holds(tmp_path):
    _, fn = resolve_metric("l2")
    _, _, res_all = auto_mixed_precision(cnn(), calib_data(8), wide=A16W8, narrow=("INT8", "INT4"), target=1e9,
                                         progress=False, search="exhaustive")
    wide_v, narrow_v = res_all.wide_value, res_all.narrow_value
    assert narrow_v > wide_v
    for frac in (0.25, 0.6):
        target = wide_v + frac * (narrow_v - wide_v)
        plans = {}
        for search in ("bisect", "exhaustive"):
            plan, qm, res = auto_mixed_precision(cnn(), calib_data(8), wide=A16W8, narrow=("INT8", "INT4"),
                                                 target=target, progress=False, search=search,
                                                 report_dir=str(tmp_path / f"{search}{frac}"))
            assert res.plan.value <= target
            # the target really holds on the evaluation data, for the returned model
            s = to_samples(calib_data(8), qm.input_specs)
            with qo.fake_quant_disabled(qm):
                f = run_outputs(qm, s, 0)
            assert fn(f, run_outputs(qm, s, 0)) <= target
            plans[search] = plan.promoted_nodes
            assert 0 < len(plan.promoted_nodes) < 4
        assert plans["bisect"] == plans["exhaustive"]
    assert res.builds <= 2 + 4 + 1
    assert set(res.stage_seconds) == {"prepare", "sensitivity", "search", "fill", "verify"}
    assert all(v >= 0 for v in res.stage_seconds.values()) and res.stage_seconds["sensitivity"] > 0
    assert sum(res.stage_seconds.values()) <= res.seconds * 1.5
    for f in ("auto_mp.json", "plan.json", "sensitivity.png", "accuracy_vs_size.png"):
        assert (tmp_path / "bisect0.6" / f).stat().st_size > 100


def test_plan_is_reusable_and_exports_bit_exact(tmp_path):
    target = 0.0
    plan, qm, res = auto_mixed_precision(cnn(), calib_data(8), wide=A16W8, narrow="INT8", target=1.0,
                                         progress=False)
    assert len(plan.promoted_nodes) == 4
    _bit_exact(qm, calib_data(3, seed=4))
    plan.save(str(tmp_path / "plan.json"))
    again = MixedPrecisionPlan.load(str(tmp_path / "plan.json"))
    assert again.promoted_nodes == plan.promoted_nodes and again.act_format == plan.act_format
    from qtorch_onnx.quantizer import resolve

    qm2 = qo.prepare(cnn(), again.apply(resolve("A16W8")))
    qo.calibrate(qm2, calib_data(8), progress=False)
    assert {k: f.fmt for k, f in qm2.quantizers().items()} == {k: f.fmt for k, f in qm.quantizers().items()}
    assert again.tensor_precision(qm2)["INT8"]
    with pytest.raises(qo.ConfigError, match="not a mixed-precision plan"):
        (tmp_path / "bad.json").write_text("{}")
        MixedPrecisionPlan.load(str(tmp_path / "bad.json"))
    del target


@pytest.mark.parametrize("narrow", ["BFP16", "MXINT8"])
@pytest.mark.parametrize("dual", [False, True])
def test_bf16_to_block_formats_export_bit_exact(narrow, dual):
    plan, qm, res = auto_mixed_precision(cnn(), calib_data(8), wide="BF16", narrow=narrow, target=0.01,
                                         dual_quant_nodes=dual, progress=False)
    assert plan.promoted_nodes
    fmts = {f.fmt.name for f in qm.quantizers().values()}
    assert narrow in fmts and "BF16" in fmts
    if dual:
        assert any(f.chained for f in qm.quantizers().values())
    _bit_exact(qm, calib_data(3, seed=4))


def _seed_config(**amp):
    return qo.Config(global_quant_config=qo.QuantizationConfig(
        calibrate_method=qo.CalibrationMethod.MinMax, quant_format=qo.ExtendedQuantFormat.QDQ,
        activation_type=qo.ExtendedQuantType.QInt16, weight_type=qo.QuantType.QInt8, include_auto_mp=True,
        extra_options={"AutoMixprecision": amp}))


def test_seed_snippets_l2_and_top1(tmp_path):
    q = qo.ModelQuantizer(_seed_config(TargetOpType=["Conv", "ConvTranspose", "Gemm", "MatMul"],
                                       ActTargetQuantType=qo.QuantType.QInt8, WeightTargetQuantType=qo.QuantType.QInt8,
                                       OutputIndex=0, L2Target=0.1))
    q.quantize_model(cnn(), str(tmp_path / "l2.onnx"), calib_data(8))
    assert (tmp_path / "l2.onnx").exists() and len(q.mixed_precision_plan.promoted_nodes) == 4

    def top1_acc(outputs):  # Quark's form: a list over samples of lists of output arrays
        return float(np.mean([int(np.argmax(o[0])) == 3 for o in outputs]))

    q = qo.ModelQuantizer(_seed_config(ActTargetQuantType=qo.QuantType.QInt8, WeightTargetQuantType=qo.QuantType.QInt8,
                                       OutputIndex=0, Top1AccTarget=0.1, EvaluateFunction=top1_acc))
    q.quantize_model(cnn(), str(tmp_path / "top1.onnx"), calib_data(8))
    assert q.quantized_model.auto_mp_result.sensitivity.metric == "top1"


def test_transformer_matmuls():
    plan, qm, res = auto_mixed_precision(token_block(), token_data(8), wide=A16W8, narrow="INT8", target=1e9,
                                         progress=False)
    assert set(plan.promoted_nodes) == {"attn_scores", "attn_context", "fc1", "fc2"}
    _bit_exact(qm, token_data(3, seed=2))


def test_bad_inputs_are_named():
    with pytest.warns(UserWarning, match="cannot be met even with every layer wide"):
        plan, qm, res = auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", target=0.0,
                                             progress=False)
    assert plan.promoted_nodes == [] and all(f.fmt.name != "INT8" or f.role != "activation"
                                             for f in qm.quantizers().values())

    def raises(outputs):
        raise RuntimeError("boom")

    with pytest.raises(qo.ConfigError, match="EvaluateFunction 'raises' raised RuntimeError: boom"):
        auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", target=0.1, metric="top1",
                             evaluate_function=raises, progress=False)
    with pytest.raises(qo.ConfigError, match="must return a finite number.*'high'"):
        auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", target=0.1, metric="top1",
                             evaluate_function=lambda o: "high", progress=False)
    with pytest.raises(qo.ConfigError, match="OutputIndex 3 is out of range"):
        auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", target=0.1, output_index=3,
                             progress=False)
    with pytest.raises(qo.ConfigError, match="wider than the wide"):
        auto_mixed_precision(cnn(), calib_data(4), wide="A8W8", narrow="INT16", target=0.1, progress=False)
    with pytest.raises(qo.ConfigError, match="TargetOpType"):
        auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", target=0.1,
                             target_op_type=("LSTM",), progress=False)
    with pytest.raises(qo.ConfigError, match="unknown metric"):
        auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", target=0.1, metric="l3",
                             progress=False)


def test_budget_form_and_pareto_front(tmp_path):
    _, _, res = auto_mixed_precision(cnn(), calib_data(8), wide=A16W8, narrow=("INT8", "INT4"), target=1e9,
                                     progress=False)
    sizes = {l.name: l.weight_bytes for l in res.sensitivity.layers}
    full = sum(v["wide"] for v in sizes.values())
    budget = full - 0.5 * sizes["conv2"]["wide"]  # at least one layer must go to 4 bits
    plan, qm, res = auto_mixed_precision(cnn(), calib_data(8), wide=A16W8, narrow=("INT8", "INT4"),
                                         budget_bytes=budget, pareto_points=3, progress=False,
                                         report_dir=str(tmp_path))
    chosen = set(plan.promoted_nodes)
    got = sum(v["INT8/INT4"] if n in chosen else v["wide"] for n, v in sizes.items())
    assert 0 < len(chosen) and got <= budget
    assert {k for k, _, _ in res.evaluated} >= {0, 2, 4}
    with pytest.raises(qo.ConfigError, match="exactly one of target"):
        auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", progress=False)


def test_sensitivity_sweep_is_bit_identical_to_full_passes():
    """The branch-point sweep gives, per layer, exactly the outputs of a full forward pass with that layer
    switched, and executes fewer node evaluations than one full pass per layer."""
    from qtorch_onnx.algorithms import mixed_precision as mp
    from qtorch_onnx.formats.spec import get_format

    qm = _wide()
    samples = to_samples(calib_data(6), qm.input_specs)
    names = [l.name for l in qm.layers(mp.DEFAULT_TARGET_OPS)]
    builder = mp._Builder(qm.onnx_model, qm.config, samples, None, False)
    narrow = builder.promoted(names, get_format("INT8"), get_format("INT4"), mp.DEFAULT_TARGET_OPS, False)
    patches = {n: mp._Patch(qm, narrow, n) for n in names}
    outs, frac = mp._patched_outputs(qm, samples, 0, patches, False, "test", batch_size=4, base_key="wide")
    assert 0 < frac < 1
    for a, b in zip(run_outputs(qm, samples, 0, batch_size=4), outs["wide"]):  # the unpatched outputs too
        assert np.array_equal(a[0].view(np.uint32), b[0].view(np.uint32))
    changed = 0
    for n in names:
        with patches[n]:
            full = run_outputs(qm, samples, 0, batch_size=4)
        assert len(full) == len(outs[n]) == 6
        for a, b in zip(full, outs[n]):
            assert np.array_equal(a[0].view(np.uint32), b[0].view(np.uint32)), n
        changed += not all(np.array_equal(a[0], b[0]) for a, b in zip(full, run_outputs(qm, samples, 0)))
    assert changed == len(names)  # every patch changed the output: the comparison is not vacuous


def test_extremes_need_no_sensitivity_pass():
    _, _, res = auto_mixed_precision(cnn(), calib_data(6), wide=A16W8, narrow="INT8", target=1e9, progress=False)
    assert res.plan.promoted_nodes and len(res.plan.promoted_nodes) == 4
    assert res.sensitivity.forward_passes == 0 and np.isnan(res.sensitivity.baseline)
    assert res.verified and res.verified[-1][0] == 4 and res.verified[-1][1] <= 1e9
    with pytest.warns(UserWarning, match="cannot be met even with every layer wide"):
        _, _, res = auto_mixed_precision(cnn(), calib_data(6), wide=A16W8, narrow="INT8", target=-1.0,
                                         progress=False)
    assert res.plan.promoted_nodes == [] and res.sensitivity.forward_passes == 0 and res.builds == 1


def test_probes_are_measured_in_onnxruntime(monkeypatch):
    """Every probe is exported and measured in ONNX Runtime (where the target is checked): when ONNX Runtime
    disagrees with the emulation near the target, ONNX Runtime decides, and the returned mix meets the target
    there; its reported value is what ONNX Runtime gives for the returned model."""
    import onnx

    from qtorch_onnx.algorithms import mixed_precision as mp

    _, _, res_all = auto_mixed_precision(cnn(), calib_data(6), wide=A16W8, narrow=("INT8", "INT4"), target=1e9,
                                         progress=False)
    target = res_all.wide_value + 0.6 * (res_all.narrow_value - res_all.wide_value)
    plan0, qm0, res0 = auto_mixed_precision(cnn(), calib_data(6), wide=A16W8, narrow=("INT8", "INT4"),
                                            target=target, progress=False)
    k0 = len(plan0.promoted_nodes)
    assert 2 <= k0 < 4 and res0.verified == [(k0, plan0.value)] and plan0.value <= target
    # the reported value is ONNX Runtime's on the returned model, against the float model there
    s = to_samples(calib_data(6), qm0.input_specs)
    _, fn = resolve_metric("l2")
    from qtorch_onnx.lift import load_model

    ort = fn(mp._ort_outputs(load_model(cnn()), s, 0), mp._ort_outputs(qo.export(qm0, None), s, 0))
    assert ort == plan0.value
    real = mp._ort_outputs

    def disagreeing(model, samples, output_index, providers=("CPUExecutionProvider",)):
        out = real(model, samples, output_index, providers)
        narrow = sum(i.data_type == onnx.TensorProto.INT4 for i in model.graph.initializer) // 2
        if narrow >= k0:  # ONNX Runtime misses the target from k0 narrow layers on
            out = [[o + 10.0 * np.abs(o).max() + 1.0 for o in smp] for smp in out]
        return out

    monkeypatch.setattr(mp, "_ort_outputs", disagreeing)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan, qm, res = auto_mixed_precision(cnn(), calib_data(6), wide=A16W8, narrow=("INT8", "INT4"),
                                             target=target, progress=False)
    assert not [w for w in seen if "AutoMixprecision" in str(w.message)]
    assert 0 < len(plan.promoted_nodes) < k0 and res.verified == [(len(plan.promoted_nodes), plan.value)]
    assert plan.value <= target and all(v > target for j, v, _ in res.evaluated if j >= k0)
    monkeypatch.setattr(mp, "_ort_outputs", real)
    # the emulation alone (verify=None) takes k0 layers: ONNX Runtime's disagreement is what changed the choice
    plan_none, _, res_none = auto_mixed_precision(cnn(), calib_data(6), wide=A16W8, narrow=("INT8", "INT4"),
                                                  target=target, progress=False, verify=None)
    assert res_none.verified == [] and len(plan_none.promoted_nodes) >= k0
    from qtorch_onnx import CalibrationMethod, Config, QuantizationConfig, QuantType

    bad_ep = Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QInt16, weight_type=QuantType.QInt8,
        execution_providers=["NoSuchExecutionProvider"]))
    with pytest.raises(qo.ConfigError, match=r"\['NoSuchExecutionProvider'\] are not available.*CPUExecutionProvider"):
        auto_mixed_precision(cnn(), calib_data(4), wide=bad_ep, narrow="INT8", target=0.1, progress=False)
    with pytest.raises(qo.ConfigError, match="verify"):
        auto_mixed_precision(cnn(), calib_data(4), wide=A16W8, narrow="INT8", target=0.1, verify="tensorrt",
                             progress=False)



def test_fill_adds_the_layers_after_a_misranked_one(monkeypatch):
    """When the sorted order puts a sensitive layer early (here: the measured ranking reversed), bisection stops
    at it; ``fill`` tries each later layer on the chosen mix and keeps those that fit, then builds the set for
    real: more layers narrow, the target still met by the built model."""
    from qtorch_onnx.algorithms import mixed_precision as mp

    real = mp.sensitivity

    def reversed_ranking(*a, **k):
        rep = real(*a, **k)
        c = rep.candidates[0]
        vals = sorted(l.measured[c] for l in rep.layers)
        ranked = sorted(rep.layers, key=lambda l: l.measured[c])
        for l, v in zip(ranked, reversed(vals)):
            l.measured[c] = v
        return rep

    monkeypatch.setattr(mp, "sensitivity", reversed_ranking)
    _, _, res_all = auto_mixed_precision(cnn(), calib_data(8), wide=A16W8, narrow=("INT8", "INT4"), target=1e9,
                                         progress=False, verify=None)
    target = res_all.wide_value + 0.7 * (res_all.narrow_value - res_all.wide_value)
    kw = dict(wide=A16W8, narrow=("INT8", "INT4"), target=target, progress=False, verify=None)
    p0, _, r0 = auto_mixed_precision(cnn(), calib_data(8), fill=False, **kw)
    p1, qm1, r1 = auto_mixed_precision(cnn(), calib_data(8), **kw)
    assert len(p1.promoted_nodes) > len(p0.promoted_nodes) and r1.fill_passes > 0, (r0.message, r1.message)
    assert set(p0.promoted_nodes) < set(p1.promoted_nodes) and "fit one by one" in r1.message
    # the returned model is the built set, and meets the target
    s = to_samples(calib_data(8), qm1.input_specs)
    with qo.fake_quant_disabled(qm1):
        f = run_outputs(qm1, s, 0)
    _, fn = resolve_metric("l2")
    assert fn(f, run_outputs(qm1, s, 0)) <= target and r1.plan.value <= target
    assert sorted(qm1.config.auto_mixprecision.promoted_nodes) == sorted(p1.promoted_nodes)


def _qparams_bits(qm):
    """Every quantizer's scale and zero point, as raw integer views (bit-exact comparison)."""
    import torch

    out = {}
    for k, fq in qm.quantizers().items():
        sc = fq.scale.detach().float().contiguous()
        out[k] = (str(fq.fmt.name), fq.calibrated, tuple(sc.view(torch.int32).reshape(-1).tolist()),
                  tuple(fq.zero_point.detach().reshape(-1).tolist()))
    return out


@pytest.mark.parametrize("model, data, wide, narrow, dual", [
    ("cnn", "calib", "A16W8", ("INT8", "INT4"), False),
    ("cnn", "calib", "BF16", "BFP16", True),
    ("token", "token", "A16W8", "INT8", False),
])
def test_mixes_reuse_calibration_bit_for_bit(model, data, wide, narrow, dual):
    """Calibration observes the float model, so a mix built from the all-wide and all-narrow statistics (no
    calibration pass) gets exactly the scales, zero points (INT32 bias scales and DualQuantNodes boundaries
    included) and outputs of the same mix calibrated on the data."""
    from qtorch_onnx.algorithms import mixed_precision as mp
    from qtorch_onnx.formats.spec import get_format
    from qtorch_onnx.quantizer import resolve

    from qtorch_onnx.data import input_specs
    from qtorch_onnx.lift import load_model

    m = cnn() if model == "cnn" else token_block()
    samples = to_samples(calib_data(8) if data == "calib" else token_data(8), input_specs(load_model(m)))
    cfg = dataclasses.replace(resolve(wide), bias_correction=False)
    a, w = (narrow, narrow) if isinstance(narrow, str) else narrow
    a, w = get_format(a), get_format(w)
    reuse = mp._Builder(m, cfg, samples, None, False)
    fresh = mp._Builder(m, cfg, samples, None, False, reuse_calibration=False)
    wide_qm = reuse.wide()
    names = [l.name for l in wide_qm.layers(mp.DEFAULT_TARGET_OPS)]
    first = reuse.calibrations  # 1 (BF16 with BFP16: nothing to calibrate, 0)
    assert first <= 1
    checked = 0
    for subset in [names] + [names[:k] for k in range(1, len(names))] + [names[k:] for k in range(1, len(names))]:
        got = reuse.promoted(subset, a, w, mp.DEFAULT_TARGET_OPS, dual)
        want = fresh.promoted(subset, a, w, mp.DEFAULT_TARGET_OPS, dual)
        assert _qparams_bits(got) == _qparams_bits(want), subset
        s = samples[:3]
        for x, y in zip(run_outputs(got, s, 0), run_outputs(want, s, 0)):
            assert np.array_equal(x[0].view(np.uint32), y[0].view(np.uint32))
        checked += 1
    # the mixes ran no calibration pass; the fresh builder calibrated each one it had to
    assert reuse.calibrations == first and fresh.calibrations == (checked if first else 0)
    # not vacuous: a mix differs from the all-wide model
    assert _qparams_bits(reuse.promoted(names[:1], a, w, mp.DEFAULT_TARGET_OPS, dual)) != _qparams_bits(wide_qm)


def test_bias_correction_in_every_build(tmp_path):
    """A wide config with BiasCorrection (the named A16W8): every probe is a corrected model, two correction passes
    per search (all-wide, all-narrow), the other mixes take each layer's correction from them; export bit-exact."""
    from qtorch_onnx.quantizer import resolve

    cfg = resolve("A16W8")
    assert cfg.bias_correction
    _, _, ext = auto_mixed_precision(cnn(), calib_data(8), wide=cfg, narrow="INT8", target=1e9, progress=False,
                                     search="exhaustive")
    target = ext.wide_value + 0.5 * (ext.narrow_value - ext.wide_value)
    plan, qm, res = auto_mixed_precision(cnn(), calib_data(8), wide=cfg, narrow="INT8", target=target,
                                         progress=False, report_dir=str(tmp_path))
    assert res.bias_corrections == 2 and res.builds > 2
    assert res.plan.value <= target
    assert 0 < len(plan.promoted_nodes) < 4
    # the returned model's biases are corrected: each conv bias moved from the float model's
    float_qm = qo.prepare(cnn(), "A16W8")
    assert not np.array_equal(qm.parameter("b2").detach().numpy(), float_qm.parameter("b2").detach().numpy())
    # and the same search without the correction gives different numbers (it is applied, not ignored)
    _, _, plain = auto_mixed_precision(cnn(), calib_data(8), wide=dataclasses.replace(cfg, bias_correction=False),
                                       narrow="INT8", target=1e9, progress=False, search="exhaustive")
    assert plain.bias_corrections == 0 and plain.wide_value != ext.wide_value
    _bit_exact(qm, calib_data(3, seed=4))
