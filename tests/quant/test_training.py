"""The training contract (issue 11): trainable initializers, live export, quantizer switches, learnable scales,
the rounding hook, live INT32 bias scales, qm.layers(), save / load, and the errors of training-time mistakes."""
from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import qtorch_onnx as qo
from qtorch_onnx.data import to_samples
from qtorch_onnx.fakequant import NearestRounding, WeightRounding
from qtorch_onnx.runtime import check_parity

from .small_models import calib_data, cnn, token_block, token_data

TRAINABLE_CNN = {"w1", "b1", "w2", "b2", "w3", "b3", "fc_w", "fc_b"}  # BN folded into conv1 at lift
TRAINABLE_TOKENS = {"table", "ln_scale", "ln_bias", "w1", "b1", "slope", "w2", "gamma", "div_c", "sub_c"}


def _prepared(model, config, data):
    qm = qo.prepare(model, config)
    qo.calibrate(qm, data, progress=False)
    return qm


def _perturb(qm, seed=0, rel=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in qm.onnx_parameters().items():
            p.mul_(1 + rel * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


def _assert_bit_exact(qm, data):
    exported, qmap = qo.export(qm, None, return_map=True)
    samples = to_samples(data, qm.input_specs)
    rep = check_parity(qm, exported, qmap, samples, opt_levels=("ORT_DISABLE_ALL",))
    bad = [n for n in rep.nodes if not n.exact]
    assert not bad, f"quantizer nodes differing from the emulation: {bad[:5]}"
    assert rep.nodes_exact[1] == len(qm.quantizers())
    return exported, rep


def test_every_trainable_initializer_is_a_parameter():
    for model, want in ((cnn(), TRAINABLE_CNN), (token_block(), TRAINABLE_TOKENS)):
        qm = qo.prepare(model, "A8W8")
        params = qm.onnx_parameters()
        assert set(params) == want
        own = {id(p) for p in qm.parameters()}
        for name, p in params.items():
            assert isinstance(p, torch.nn.Parameter) and p.requires_grad, name
            assert id(p) in own, f"{name} is not among qm.parameters()"
            assert qm.parameter(name) is p
    with pytest.raises(KeyError, match="fc_w"):
        qo.prepare(cnn(), "A8W8").parameter("fc_ww")


@pytest.mark.parametrize("config", ["A8W8", "A16W8", "BF16", "BFP16", "MX9", "MXINT8"])
@pytest.mark.parametrize("model_name", ["cnn", "tokens"])
def test_perturbed_parameters_export_live_and_bit_exact(config, model_name):
    model, data = (cnn(), calib_data(4)) if model_name == "cnn" else (token_block(), token_data(4))
    qm = _prepared(model, config, data)
    _perturb(qm)
    exported, _ = _assert_bit_exact(qm, data)
    # float initializers without a quantizer carry the live value; quantized ones were written from it
    inits = {t.name: t for t in exported.graph.initializer}
    fqs = qm.quantizers()
    from qtorch_onnx.training import live_initializers

    live = live_initializers(qm)
    for name, value in live.items():
        if name in fqs:
            continue
        np.testing.assert_array_equal(numpy_helper.to_array(inits[name]), value.numpy(), err_msg=name)
    assert qm.onnx_model.graph.initializer[0].raw_data or qm.onnx_model.graph.initializer[0].float_data


def test_finetuned_matmul_weight_is_not_lost():
    qm = _prepared(token_block(), "A8W8", token_data(4))
    before = qo.export(qm, None)
    init = lambda m, n: numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == n))  # noqa: E731
    with torch.no_grad():
        qm.parameter("w1").mul_(1.5)  # the weight scale follows the live weight: same integers, 1.5x the scale
    after = qo.export(qm, None)
    np.testing.assert_array_equal(init(before, "w1_quantized"), init(after, "w1_quantized"))
    assert init(after, "w1_scale") == np.float32(init(before, "w1_scale") * np.float32(1.5))
    with torch.no_grad():
        qm.parameter("w1").add_(0.05 * torch.randn(16, 32, generator=torch.Generator().manual_seed(0)))
    after = qo.export(qm, None)
    assert not np.array_equal(init(before, "w1_quantized"), init(after, "w1_quantized"))
    _assert_bit_exact(qm, token_data(3))


def test_gradient_reaches_every_parameter():
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    x = torch.from_numpy(calib_data(1)[0]["input"])
    qm(x).square().sum().backward()
    for name, p in qm.onnx_parameters().items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert qm.parameter("w2").grad.abs().sum() > 0


def test_switches_and_calibrate_respects_them():
    qm = qo.prepare(cnn(), "A8W8")
    fqs = qm.quantizers()
    assert all(fq.fake_quant_enabled for fq in fqs.values())
    assert fqs["w1"].observer_enabled and fqs["r1"].observer_enabled
    # the user freezes one activation with a chosen scale and keeps another float
    fqs["r1"].set_qparams(torch.tensor(0.5))
    fqs["r1"].observer_enabled = False
    qo.disable_fake_quant(qm, ["add1"])
    qo.calibrate(qm, calib_data(), progress=False)
    assert float(fqs["r1"].scale) == 0.5
    assert not fqs["add1"].fake_quant_enabled and fqs["add1"].calibrated
    assert fqs["c2"].fake_quant_enabled and fqs["c2"].calibrated
    assert not fqs["c2"].observer_enabled  # frozen after calibration ...
    s_before = fqs["c2"].scale.clone()
    qo.calibrate(qm, calib_data(4, seed=5), progress=False)  # ... but a second calibrate() uses it again
    assert not torch.equal(s_before, fqs["c2"].scale)
    with qo.fake_quant_disabled(qm):
        assert not any(fq.fake_quant_enabled for fq in fqs.values())
    assert fqs["c2"].fake_quant_enabled and not fqs["add1"].fake_quant_enabled
    with qo.observers_disabled(qm):
        assert not fqs["w1"].observer_enabled
    assert fqs["w1"].observer_enabled
    with pytest.raises(qo.ConfigError, match="no quantizer 'w11'"):
        qo.enable_observer(qm, ["w11"])
    x = torch.from_numpy(calib_data(1)[0]["input"])
    with qo.fake_quant_disabled(qm):
        y_float = qm(x)
    float_model = qo.lift(cnn(), fold_batchnorm=True)
    assert torch.equal(y_float, float_model(x))


def test_quantization_off_passes_every_quantizer_through():
    """fakequant.quantization_off: inside it, on its thread only, the prepared model computes its float model
    (every FakeQuantize and ParamQuantizer returns its input, an override included), feeds no observer and changes
    no state; it nests and comes back on errors."""
    import threading

    from qtorch_onnx.fakequant import ParamQuantizer, quantization_is_off, quantization_off

    qm = _prepared(cnn(), "A8W8", calib_data(8))
    x = to_samples(calib_data(2, seed=5), qm.input_specs)[0][0]
    with torch.no_grad():
        quantized = qm(x)
        with qo.fake_quant_disabled(qm):
            floating = qm(x)
        assert not torch.equal(quantized, floating)
        for fq in qm.quantizers().values():  # observers on: nothing may reach them inside the switch
            fq.set_mode("observe")
        updates = []
        for fq in qm.quantizers().values():
            if fq.observer is not None:
                fq.observer.update = lambda v, _u=updates: _u.append(v)
        state = {k: v.clone() for k, v in qm.state_dict().items()}
        pq = next(m for m in qm.modules() if isinstance(m, ParamQuantizer))
        pq.override = torch.zeros(1)  # an override is not applied either
        with quantization_off():
            assert quantization_is_off() and torch.equal(qm(x), floating)
            other = []
            worker = threading.Thread(target=lambda: other.append(quantization_is_off()))
            worker.start()
            worker.join()
            assert other == [False]  # the switch is the calling thread's
        pq.override = None
        assert not updates and all(torch.equal(v, state[k]) for k, v in qm.state_dict().items())
        with pytest.raises(RuntimeError, match="inner"):
            with quantization_off():
                with quantization_off():
                    pass
                assert quantization_is_off()
                raise RuntimeError("inner")
        assert not quantization_is_off()
        for fq in qm.quantizers().values():
            fq.set_mode("quantize")
        assert torch.equal(qm(x), quantized)


def test_scale_state_updated_in_place():
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    fq = qm.quantizers()["c2"]
    ref = fq.scale
    opt_ids = {id(b) for b in qm.buffers()}
    qo.calibrate(qm, calib_data(4, seed=3), progress=False)
    assert fq.scale is ref and id(ref) in opt_ids
    w = qm.quantizers()["w2"]
    wref = w.scale
    with torch.no_grad():
        qm.parameter("w2").mul_(2.0)
    qm(torch.from_numpy(calib_data(1)[0]["input"]))
    assert w.scale is wref
    # weight observers read the live parameter
    p = qm.parameter("w2").detach().double()
    expect = (p.abs().amax() / 127).float() if w.scale.dim() == 0 else None
    assert torch.equal(w.scale, expect)


def test_weight_observer_skips_an_unchanged_weight_only():
    """Inside unchanged_reads_reused a weight read again unchanged keeps its qparams without an observer pass; a
    weight changed in place or replaced, and qparams written by hand, are observed again. Outside it (the default)
    every read observes, so a change through ``.data`` (which keeps the version counter) is seen too."""
    from qtorch_onnx.fakequant import unchanged_reads_reused

    qm = _prepared(cnn(), "A8W8", calib_data(4))
    fq = qm.quantizers()["w2"]
    assert fq.tracks_value and fq.observer_enabled
    calls = []
    orig = fq.compute_qparams_from_range
    fq.compute_qparams_from_range = lambda *a: (calls.append(1), orig(*a))[1]
    w = qm.parameter("w2")
    fq(w)
    n = len(calls)
    fq(w)
    assert len(calls) == n + 1  # the default: every read observes
    w.data.mul_(1.5)  # no version counter moves
    fq(w)
    assert torch.equal(fq.scale, (w.detach().double().abs().amax() / 127).float())
    with unchanged_reads_reused():
        _check_observer_reuse(fq, w, calls)


def _check_observer_reuse(fq, w, calls):
    fq(w)
    n = len(calls)
    fq(w)
    fq(w)
    assert len(calls) == n  # unchanged: no pass
    with torch.no_grad():
        w.mul_(2.0)
    fq(w)
    assert len(calls) == n + 1
    assert torch.equal(fq.scale, (w.detach().double().abs().amax() / 127).float())
    fq.set_qparams(torch.tensor(0.5))  # by hand: the next read observes again (the observer is on)
    fq(w)
    assert len(calls) == n + 2 and torch.equal(fq.scale, (w.detach().double().abs().amax() / 127).float())
    other = w.detach().clone() * 3.0  # another tensor of the same shape
    fq(other)
    assert len(calls) == n + 3 and torch.equal(fq.scale, (other.double().abs().amax() / 127).float())


def test_int32_bias_scale_is_derived_live():
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    fqs = qm.quantizers()
    b = fqs["b2"]
    x_q, w_q = b.bias_sources
    assert torch.equal(b.scale, (x_q.scale.double() * w_q.scale.double()).float())
    x_q.set_qparams(x_q.scale * 2)
    with torch.no_grad():
        qm.parameter("w2").mul_(1.7)
    qm(torch.from_numpy(calib_data(1)[0]["input"]))
    assert torch.equal(b.scale, (x_q.scale.double() * w_q.scale.double()).float())
    _assert_bit_exact(qm, calib_data(3))


def test_derived_bias_read_again_follows_every_change():
    """Inside unchanged_reads_reused a derived INT32 bias read again unchanged gives its output from a memo (a copy:
    the caller may write it); a bias changed in place (torch, or the C Adam step through its pointer), a source scale
    changed, or a gradient wanted computes it again. Outside it no memo is kept (a change through ``.data`` is seen)."""
    from qtorch_onnx.algorithms import cpu_steps
    from qtorch_onnx.fakequant import unchanged_reads_reused

    qm = _prepared(cnn(), "A8W8", calib_data(4))
    b = qm.quantizers()["b2"]
    bias = qm.parameter("b2")
    with torch.no_grad():
        before = b(bias)
        bias.data.add_(0.5)  # no version counter moves
        assert not torch.equal(b(bias), before) and "_bias_memo" not in b.__dict__
        bias.data.sub_(0.5)
    with unchanged_reads_reused():
        _check_bias_memo(b, bias, cpu_steps)


def _check_bias_memo(b, bias, cpu_steps):

    def fresh():
        b.__dict__.pop("_bias_memo", None)
        with torch.no_grad():
            return b(bias)

    with torch.no_grad():
        first = b(bias)
        first.add_(1.0)  # the caller's copy
        assert torch.equal(b(bias), fresh())
        assert b(bias) is not b(bias)
        bias.add_(0.01)
        assert torch.equal(b(bias), fresh()) and not torch.equal(b(bias), first - 1.0)
    if cpu_steps.available():
        before = b(bias).clone()
        g = torch.randn_like(bias)
        mom = cpu_steps.AdamMoments(torch.zeros_like(bias), torch.zeros_like(bias), 0.9, 0.999, 1e-8, 0.05, 1.0)
        cpu_steps.masked_adam(bias, g, torch.ones_like(bias), mom)  # written through the pointer
        with torch.no_grad():
            after = b(bias)
        assert not torch.equal(after, before) and torch.equal(after, fresh())
    x_q, _ = b.bias_sources
    with torch.no_grad():
        old = b(bias)
    x_q.set_qparams(x_q.scale * 2)
    with torch.no_grad():
        assert not torch.equal(b(bias), old) and torch.equal(b(bias), fresh())
    y = b(bias)  # a gradient wanted: the graph reaches the parameter
    y.sum().backward()
    assert bias.grad is not None


@pytest.mark.parametrize("config", ["A8W8", "A16W8", "U8S8_AAWS"])
def test_learn_scales_lsq_step_and_export(config):
    qm = _prepared(cnn(), config, calib_data(4))
    changed = qo.learn_scales(qm)
    fqs = qm.quantizers()
    assert changed and all(fqs[k].learnable for k in changed)
    assert not any(fqs[k].learnable for k in fqs if fqs[k].bias_sources is not None)
    names = {n for n, _ in qm.named_parameters()}
    assert any(n.endswith(".scale") for n in names)
    asym = [fq for fq in fqs.values() if fq.learnable and not fq.symmetric]
    if config == "U8S8_AAWS":
        assert asym and all("zero_point_float" in dict(fq.named_parameters()) for fq in asym)
    opt = torch.optim.Adam(qm.parameters(), lr=1e-6)
    x = torch.from_numpy(np.concatenate([d["input"] for d in calib_data(4)]))
    scales = {k: fqs[k].scale.detach().clone() for k in changed}
    loss = qm(x).square().sum()
    loss.backward()
    grads = [fqs[k].scale.grad for k in changed if isinstance(fqs[k].scale, torch.nn.Parameter)]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    opt.step()
    assert any(not torch.equal(scales[k], fqs[k].scale.detach()) for k in changed)
    _assert_bit_exact(qm, calib_data(3))


def test_power_of_two_scales_learned_in_log2_domain():
    cfg = qo.QuantizationConfig(calibrate_method=qo.PowerOfTwoMethod.NonOverflow,
                                activation_type=qo.QuantType.QInt8, weight_type=qo.QuantType.QInt8)
    qm = _prepared(cnn(), qo.Config(global_quant_config=cfg), calib_data(4))
    qo.learn_scales(qm)
    fq = next(fq for fq in qm.quantizers().values() if fq.learnable and fq.role == "activation")
    assert "log2_scale" in dict(fq.named_parameters())
    with torch.no_grad():
        fq.log2_scale.add_(0.7)  # not an integer any more: the forward and export round it
    x = torch.from_numpy(calib_data(1)[0]["input"])
    qm(x).sum().backward()
    assert fq.log2_scale.grad is not None
    m, e = np.frexp(float(fq.scale))
    assert m == 0.5  # a power of two
    _assert_bit_exact(qm, calib_data(3))


class _RoundDown(WeightRounding):
    """Test hook: floor, with a tiny learnable offset to show the hook's own parameters train."""

    def __init__(self, n: int = 1):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.zeros(n))

    def forward(self, v):
        return torch.floor(v) + self.offset.sum() * 0

    def hard(self, v):
        return torch.floor(v)

    def config(self):
        return {"n": int(self.offset.numel())}


def test_rounding_hook_is_what_export_writes():
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    fq = qm.quantizers()["w2"]
    hook = _RoundDown()
    fq.set_rounding(hook)
    assert "rounding.offset" in dict(fq.named_parameters())
    exported, _ = _assert_bit_exact(qm.eval(), calib_data(3))
    q = numpy_helper.to_array(next(t for t in exported.graph.initializer if t.name == "w2_quantized"))
    w = qm.parameter("w2").detach()
    scale = fq.scale.reshape(-1, *([1] * (w.dim() - 1))) if fq.scale.dim() else fq.scale
    np.testing.assert_array_equal(q.astype(np.int64), torch.floor(w / scale).clamp(-127, 127).to(torch.int64).numpy())
    fq.set_rounding(NearestRounding())
    exported2, _ = _assert_bit_exact(qm, calib_data(3))
    fq.set_rounding(None)
    exported3 = qo.export(qm, None)
    assert exported2.SerializeToString() == exported3.SerializeToString()
    with pytest.raises(qo.ConfigError, match="integer weight"):
        qm.quantizers()["r1"].set_rounding(_RoundDown())


def test_save_load_round_trip(tmp_path):
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    qo.learn_scales(qm, keys=["c2", "r1"])
    _perturb(qm)
    qm.quantizers()["w3"].set_rounding(NearestRounding())
    qo.disable_fake_quant(qm, ["add1"])
    x = torch.from_numpy(np.concatenate([d["input"] for d in calib_data(3)]))
    qm.eval()
    y = qm(x)
    path = tmp_path / "m.qtorch"
    qo.save(qm, path)
    qm2 = qo.load(path).eval()
    y2 = qm2(x)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))
    fq2 = qm2.quantizers()
    assert fq2["c2"].learnable and not fq2["add1"].fake_quant_enabled
    assert isinstance(fq2["w3"].rounding, NearestRounding)
    a, b = qo.export(qm, None), qo.export(qm2, None)
    assert a.SerializeToString() == b.SerializeToString()
    qm3 = qo.load(path, cnn())  # the same graph is accepted
    assert torch.equal(qm3.eval()(x).view(torch.int32), y.view(torch.int32))
    with pytest.raises(qo.ModelError, match="different ONNX graph"):
        qo.load(path, cnn(seed=3))
    bad = tmp_path / "bad.qtorch"
    bad.write_bytes(b"not a model")
    with pytest.raises(qo.ModelError, match="not a model saved"):
        qo.load(bad)


def test_layers_view():
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    layers = qm.layers()
    assert [(l.name, l.op_type) for l in layers] == [("conv1", "Conv"), ("conv2", "Conv"), ("conv3", "Conv"),
                                                   ("fc", "Gemm")]
    conv2 = layers[1]
    fqs = qm.quantizers()
    assert conv2.weight is qm.parameter("w2") and conv2.bias is qm.parameter("b2")
    assert conv2.weight_quantizer is fqs["w2"] and conv2.bias_quantizer is fqs["b2"]
    assert conv2.input_quantizers == [fqs["r1"]] and conv2.output_quantizer is fqs.get("c2")
    assert conv2.module is not None
    qt = _prepared(token_block(), "A8W8", token_data(4))
    names = [(l.name, l.weight is not None) for l in qt.layers(["MatMul"])]
    assert names == [("attn_scores", False), ("attn_context", False), ("fc1", True), ("fc2", True)]


def test_training_mistakes_are_named(tmp_path):
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    qo.learn_scales(qm)
    with torch.no_grad():
        qm.quantizers()["c2"].scale.fill_(-1.0)
    with pytest.raises(qo.ExportError, match="'c2'.*positive and finite"):
        qo.export(qm, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    module = qm.gm.get_submodule(qm.tensor_map.refs("fc_w")[0].module)
    module.parametrizations.weight.original = torch.nn.Parameter(torch.zeros(10, 13))
    with pytest.raises(qo.ExportError, match="'fc_w'.*shape and dtype"):
        qo.export(qm, None)
    with pytest.raises(qo.ConfigError, match="not calibrated"):
        qo.learn_scales(qo.prepare(cnn(), "A8W8"))


def test_user_model_untouched():
    model = token_block()
    ref = model.SerializeToString()
    qm = _prepared(model, "A8W8", token_data(2))
    _perturb(qm)
    qo.export(qm, None)
    assert model.SerializeToString() == ref
    assert qm.onnx_model.graph.initializer  # the module's own copy keeps its initializers


def test_deepcopy_keeps_bias_links():
    qm = _prepared(cnn(), "A8W8", calib_data(4))
    qm2 = copy.deepcopy(qm)
    b2 = qm2.quantizers()["b2"]
    assert b2.bias_sources[0] is qm2.quantizers()["r1"]
