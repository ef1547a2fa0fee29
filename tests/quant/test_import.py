"""load_quantized: already-quantized models (Quark's, ONNX Runtime's, ours) become FakeQuantize modules that run
with the model's bits and export again with the same structure."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

import qtorch_onnx as qo
from qtorch_onnx.data import to_samples
from qtorch_onnx.runtime import check_parity, session

from ..export.test_quark_interop import CONFIGS, _bits, _case
from .small_models import calib_data, cnn

QOPS = {"QuantizeLinear", "DequantizeLinear", "ExtendedQuantizeLinear", "ExtendedDequantizeLinear",
        "BFPQuantizeDequantize", "MXQuantizeDequantize"}


def signature(model: onnx.ModelProto) -> dict:
    """Per input of every non-quantizer node (by node name and slot) and per graph output: the chain of
    quantizer nodes feeding it (domain, op, attributes, scale / zero point dtype, shape and bytes) down to its
    source (a tensor, or an initializer's dtype, shape and bytes). Names of quantizer nodes and of the tensors
    between them are left out: two models with equal signatures have the same quantization structure."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    prod = {o: n for n in g.node for o in n.output}

    def val(name):
        if name not in inits:
            return None
        a = numpy_helper.to_array(inits[name])
        return inits[name].data_type, a.shape, a.tobytes()

    def chain(t):
        out = []
        while t in prod and prod[t].op_type in QOPS:
            n = prod[t]
            attrs = tuple(sorted((a.name, str(helper.get_attribute_value(a))) for a in n.attribute))
            out.append((n.domain or "", n.op_type, attrs) + tuple(val(i) for i in n.input[1:]))
            t = n.input[0]
        out.append(("source", val(t) if t in inits else "tensor"))
        return tuple(out)

    sig = {(n.name, k): chain(i) for n in g.node if n.op_type not in QOPS for k, i in enumerate(n.input) if i}
    sig.update({("output", o.name): chain(o.name) for o in g.output})
    return sig


def _run(qm, inputs):
    with torch.no_grad():
        y = qm(*[torch.from_numpy(v) for v in inputs])
    return (y[0] if isinstance(y, (tuple, list)) else y).numpy()


@pytest.mark.parametrize("config", CONFIGS)
def test_quark_models(config):
    """Quark's own exports: the imported module gives Quark's library's outputs, every com.amd.quark / Q/DQ node
    becomes a FakeQuantize, and export writes the same structure, which ONNX Runtime runs with Quark's bits."""
    _, model, samples = _case(config)
    before = model.SerializeToString()
    qm = qo.load_quantized(model)
    assert model.SerializeToString() == before  # the user's model is not touched
    assert qm.import_report.kept == {}
    n_quant_nodes = sum(n.op_type in QOPS for n in model.graph.node)
    assert sum(len(v.split("(")[1].split(",")) for v in qm.import_report.lifted.values()) == n_quant_nodes
    exported = qo.export(qm, None)
    a, b = signature(model), signature(exported)
    assert a.keys() == b.keys()
    diff = [k for k in a if a[k] != b[k]]
    if config == "A32W8":
        # Quark saturated two INT32 biases at +-2^31; their other values beyond 2^24 are not float32 numbers, so
        # the float emulation holds them to the nearest float32 and the re-exported integers may differ there
        # (by less than one float32 ulp of the value)
        assert all(k[1] == 2 for k in diff), diff
    else:
        assert diff == []
    sess = session(exported, opt_level="ORT_DISABLE_ALL")
    for s in samples:
        inputs = list(s["input"].values())
        want = next(iter(s["output"].values()))
        y_emu = _run(qm, inputs)
        y_ort = sess.run(None, dict(zip([i.name for i in sess.get_inputs()], inputs)))[0]
        if config == "A32W8":  # an INT32 step is finer than a float32 ulp: nothing absorbs float-op differences
            assert np.abs(y_emu - want).max() <= 1e-6 and np.abs(y_ort - want).max() <= 1e-6
        else:
            assert np.array_equal(_bits(y_emu), _bits(want))
            assert np.array_equal(_bits(y_ort), _bits(want))


def _quantized_here(config, opset=17):
    qm = qo.prepare(cnn(opset=opset), config)
    if any(fq.needs_calibration for fq in qm.quantizers().values()):
        qo.calibrate(qm, calib_data(), progress=False)
    else:
        qm.set_mode("quantize")
    return qo.export(qm, None)


def _mixed(dual: bool):
    cfg = qo.get_default_config("BF16_MIXED_BFP16")
    cfg.extra_options["AutoMixprecision"]["DualQuantNodes"] = dual
    return qo.Config(global_quant_config=cfg)


def _per_channel_a16w8():
    cfg = qo.get_default_config("A16W8")
    cfg.per_channel = True
    return qo.Config(global_quant_config=cfg)


@pytest.mark.parametrize("case", ["A8W8", "A16W8-per-channel", "BF16", "MX9_INT8", "MXFP4E2M1",
                                  "BF16_MIXED_BFP16-dual", "BF16_MIXED_BFP16"])
def test_round_trip_of_our_exports(case):
    """export -> load_quantized -> export gives the same structure; the imported module's quantizer nodes are
    bit-exact against the re-export in ONNX Runtime."""
    config = {"A16W8-per-channel": _per_channel_a16w8, "BF16_MIXED_BFP16-dual": lambda: _mixed(True),
              "BF16_MIXED_BFP16": lambda: _mixed(False)}.get(case, lambda: case)()
    first = _quantized_here(config)
    qm = qo.load_quantized(first)
    assert qm.import_report.kept == {}
    second, qmap = qo.export(qm, None, return_map=True)
    assert signature(first) == signature(second)
    if case.startswith("BF16_MIXED"):
        assert any(fq.consumer is not None for fq in qm.quantizers().values())
        assert any(fq.chained for fq in qm.quantizers().values()) == case.endswith("-dual")
    rep = check_parity(qm, second, qmap, to_samples(calib_data(2, seed=5), qm.input_specs),
                       opt_levels=("ORT_DISABLE_ALL",))
    assert [n for n in rep.nodes if not n.exact] == []
    assert all(o.identical_fraction >= 0.99 for o in rep.outputs), rep.outputs


def test_onnxruntime_quantize_static_model(tmp_path):
    """A model from ONNX Runtime's own quantization tool (QDQ, per-channel int8 weights, uint8 activations)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib_data(4))

        def get_next(self):
            return next(self.it, None)

    src, dst = tmp_path / "float.onnx", tmp_path / "int8.onnx"
    onnx.save(cnn(opset=17, batchnorm=False), src)
    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    model = onnx.load(dst)
    qm = qo.load_quantized(model)
    assert qm.import_report.kept == {}
    fqs = qm.quantizers()
    assert any(fq.scale.dim() == 1 and fq.role == "weight" for fq in fqs.values())  # per-channel weights
    assert any(not fq.symmetric for fq in fqs.values() if fq.role == "activation")  # uint8 with zero points
    again = qo.export(qm, None)
    assert signature(model) == signature(again)
    sess = session(model, opt_level="ORT_DISABLE_ALL")
    x = calib_data(3, seed=9)
    same = total = 0
    for s in x:
        want = sess.run(None, s)[0]
        y = _run(qm, [s["input"]])
        same += int((_bits(y) == _bits(want)).sum())
        total += want.size
    assert same / total >= 0.99


def test_finetune_then_export():
    """Imported weights are trainable float parameters; export writes the updated weights, scales unchanged."""
    _, model, samples = _case("BF16_BFP16")
    qm = qo.load_quantized(model)
    params = [p for p in qm.parameters() if p.requires_grad]
    assert params
    x = torch.from_numpy(next(iter(samples[0]["input"].values())))
    qm.train()
    loss = qm(x).square().sum()
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.sign(p.grad) if p.grad is not None else 0.0)
    qm.eval()
    exported = qo.export(qm, None)
    a, b = signature(model), signature(exported)
    assert a.keys() == b.keys() and a != b  # same structure, new weight values
    assert all(x[:-1] == y[:-1] for x, y in ((a[k], b[k]) for k in a))  # only the sources (weights) changed
    y_emu = _run(qm, [x.numpy()])
    y_ort = session(exported, opt_level="ORT_DISABLE_ALL").run(None, {"input": x.numpy()})[0]
    assert np.array_equal(_bits(y_emu), _bits(y_ort))


def test_unsupported_quantizers_stay_operators():
    """An int4 weight DequantizeLinear (no FakeQuantize format) stays an operator, listed with its reason; the rest
    is imported."""
    rng = np.random.default_rng(0)
    w = rng.integers(-8, 8, (4, 3, 3, 3)).astype(np.int8)
    inits = [helper.make_tensor("w_q", onnx.TensorProto.INT4, w.shape, w.flatten().tolist()),
             numpy_helper.from_array(np.array(0.05, np.float32), "w_s"),
             numpy_helper.from_array(np.array(0.1, np.float32), "x_s"),
             numpy_helper.from_array(np.array(3, np.int8), "x_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"], name="q"),
             helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_dq"], name="dq"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], name="w_dq"),
             helper.make_node("Conv", ["x_dq", "w"], ["y"], name="conv")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    qm = qo.load_quantized(model)
    assert list(qm.import_report.kept) == ["w_dq"] and "INT4" in qm.import_report.kept["w_dq"]
    assert list(qm.import_report.lifted) == ["x"]
    x = rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)
    want = session(model, opt_level="ORT_DISABLE_ALL").run(None, {"x": x})[0]
    assert np.abs(_run(qm, [x]) - want).max() <= 1e-5
