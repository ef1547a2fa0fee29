"""LSTM / GRU / RNN / com.microsoft::DynamicQuantizeLSTM converters against ONNX Runtime.

Every attribute of the ONNX spec (direction, layout, activations with alpha/beta, clip, input_forget,
linear_before_reset, hidden_size) and every optional input/output, on small random inputs. ONNX
Runtime's CPU kernels reject ``layout=1``, so layout-1 models are checked against ONNX Runtime running
the equivalent layout-0 model on transposed inputs.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from qtorch_onnx.errors import DataError, UnsupportedOpsError
from qtorch_onnx.lift import lift
from qtorch_onnx.lift.recurrent import OnnxRecurrent, dynamic_quantize_uint8, parse_activations

from .helpers import make_model, rel_l2, requires_exact_ort_u8s8, run_gm, run_ort

F = TensorProto.FLOAT
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
PER_DIR = {"LSTM": 3, "GRU": 2, "RNN": 1}
TOL = 1e-5


def _rnn_model(op, attrs=None, *, T=5, N=3, I=4, H=3, direction="forward", layout=0, lens=None, h0=False,
               c0=False, peep=False, outputs=("Y", "Y_h", "Y_c"), weights_as_inputs=False, bias=True,
               dtype=np.float32, seed=0, hidden_attr=True):
    """One-node model (+ feeds) with X, sequence_lens, initial_h/c as graph inputs, W/R/B/P initializers."""
    rng = np.random.default_rng(seed)
    D = 2 if direction == "bidirectional" else 1
    G = GATES[op]
    elem = F if dtype == np.float32 else TensorProto.DOUBLE
    w = {"W": rng.standard_normal((D, G * H, I)) * 0.5, "R": rng.standard_normal((D, G * H, H)) * 0.5}
    if bias:
        w["B"] = rng.standard_normal((D, 2 * G * H)) * 0.5
    if peep:
        w["P"] = rng.standard_normal((D, 3 * H)) * 0.5
    w = {k: v.astype(dtype) for k, v in w.items()}
    xs = (T, N, I) if layout == 0 else (N, T, I)
    hs = (D, N, H) if layout == 0 else (N, D, H)
    feeds = {"X": rng.standard_normal(xs).astype(dtype)}
    inputs = [("X", elem, list(xs))]
    names = ["X", "W", "R", "B" if bias else ""]
    if lens is not None:
        feeds["L"] = np.array(lens, np.int32)
        inputs.append(("L", TensorProto.INT32, [N]))
    names.append("L" if lens is not None else "")
    for flag, key in ((h0, "h0"), (c0, "c0")):
        if key == "c0" and op != "LSTM":
            continue
        if flag:
            feeds[key] = rng.standard_normal(hs).astype(dtype)
            inputs.append((key, elem, list(hs)))
        names.append(key if flag else "")
    if op == "LSTM":
        names.append("P" if peep else "")
    while names[-1] == "":
        names.pop()
    inits = dict(w)
    if weights_as_inputs:
        for k in ("W", "R"):
            feeds[k] = inits.pop(k)
            inputs.append((k, elem, list(feeds[k].shape)))
    outs = [o for o in outputs if o != "Y_c" or op == "LSTM"]
    node_outs = ["Y" if "Y" in outs else "", "Y_h" if "Y_h" in outs else ""] + (["Y_c"] if "Y_c" in outs else [])
    while node_outs[-1] == "":
        node_outs.pop()
    kw = dict(attrs or {})
    kw["direction"] = direction
    if hidden_attr:
        kw["hidden_size"] = H
    if layout:
        kw["layout"] = 1
    node = helper.make_node(op, names, node_outs, name="rnn", **kw)
    return make_model([node], inputs, [(o, elem, None) for o in outs], inits, opset=14), feeds


def _transposed_reference(op, attrs, kwargs):
    """ONNX Runtime outputs for a layout-1 model: run the layout-0 twin on transposed inputs."""
    m1, feeds1 = _rnn_model(op, attrs, layout=1, **kwargs)
    m0, _ = _rnn_model(op, attrs, layout=0, **kwargs)
    feeds0 = dict(feeds1)
    feeds0["X"] = np.ascontiguousarray(feeds1["X"].transpose(1, 0, 2))
    for k in ("h0", "c0"):
        if k in feeds1:
            feeds0[k] = np.ascontiguousarray(feeds1[k].transpose(1, 0, 2))
    outs0 = run_ort(m0, feeds0)
    names = [o.name for o in m0.graph.output]
    want = []
    for name, o in zip(names, outs0):
        want.append(o.transpose(2, 0, 1, 3) if name == "Y" else o.transpose(1, 0, 2))
    return m1, feeds1, want


def _compare(m, feeds, want=None, tol=TOL):
    want = run_ort(m, feeds) if want is None else want
    gm = lift(m)
    got = run_gm(gm, feeds)
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.dtype == g.dtype
        assert rel_l2(w, g) < tol, rel_l2(w, g)
    return gm


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("variant", ["plain", "lens_states", "clip"])
def test_directions_lens_states_clip(op, direction, variant):
    kw = {"direction": direction}
    attrs = {}
    if variant == "lens_states":
        kw.update(lens=[5, 2, 0], h0=True, c0=True)  # a full, a short and an empty sequence
    elif variant == "clip":
        attrs["clip"] = 0.7
        kw.update(h0=True)
    _compare(*_rnn_model(op, attrs, **kw))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_layout_1(op, direction):
    kwargs = dict(direction=direction, lens=[4, 5, 1], h0=True, c0=True)
    m1, feeds1, want = _transposed_reference(op, {}, kwargs)
    _compare(m1, feeds1, want)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_lstm_peepholes_and_input_forget(direction):
    _compare(*_rnn_model("LSTM", {}, direction=direction, peep=True, h0=True, c0=True))
    _compare(*_rnn_model("LSTM", {"input_forget": 1, "clip": 0.5}, direction=direction, peep=True, h0=True, c0=True,
                         lens=[3, 5, 1]))


@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("direction", ["reverse", "bidirectional"])
def test_gru_linear_before_reset(lbr, direction):
    _compare(*_rnn_model("GRU", {"linear_before_reset": lbr}, direction=direction, h0=True, lens=[4, 5, 2]))


ACTS = ["Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid", "Elu",
        "Softsign", "Softplus"]


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_every_activation(op):
    """Each spec activation in the first slot (alpha/beta given: ONNX Runtime's defaults for some differ)."""
    for act in ACTS:
        names = [act] + ["Tanh"] * (PER_DIR[op] - 1)
        _compare(*_rnn_model(op, {"activations": names, "activation_alpha": [0.6], "activation_beta": [0.3]}))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_bidirectional_activation_lists_consume_alpha_beta_in_order(op):
    n = 2 * PER_DIR[op]
    names = [ACTS[(3 + 2 * i) % len(ACTS)] for i in range(n)]  # Affine, ThresholdedRelu, HardSigmoid, ...
    attrs = {"activations": names, "activation_alpha": [0.6, 0.2, 0.9, 0.4], "activation_beta": [0.3, 0.1, 0.2]}
    _compare(*_rnn_model(op, attrs, direction="bidirectional"))


def test_output_subsets_no_bias_no_hidden_attr_and_weights_as_inputs():
    # only Y_h (Y omitted as ""), no B, hidden_size inferred from R
    # (ONNX Runtime insists on hidden_size: the reference runs the same model with it)
    m, feeds = _rnn_model("LSTM", {}, outputs=("Y_h",), bias=False, hidden_attr=False, direction="bidirectional")
    with_attr, _ = _rnn_model("LSTM", {}, outputs=("Y_h",), bias=False, direction="bidirectional")
    assert list(m.graph.node[0].output) == ["", "Y_h"]
    assert not any(a.name == "hidden_size" for a in m.graph.node[0].attribute)
    _compare(m, feeds, run_ort(with_attr, feeds))
    # only Y; W and R as graph inputs (module arguments, not parameters)
    m, feeds = _rnn_model("GRU", {"linear_before_reset": 1}, outputs=("Y",), weights_as_inputs=True)
    gm = _compare(m, feeds)
    mod = next(x for x in gm.modules() if isinstance(x, OnnxRecurrent))
    assert [n for n, _ in mod.named_parameters()] == ["B"]


def test_float64_against_onnx_reference():
    """ONNX Runtime's LSTM is float32-only; onnx.reference computes in float64."""
    from onnx.reference import ReferenceEvaluator

    m, feeds = _rnn_model("LSTM", {}, direction="bidirectional", dtype=np.float64, h0=True, c0=True, peep=True)
    want = ReferenceEvaluator(m).run(None, feeds)
    got = run_gm(lift(m), feeds)
    for w, g in zip(want, got):
        assert g.dtype == np.float64 and rel_l2(w, g) < 1e-12


@pytest.mark.parametrize("op,attrs", [("LSTM", {}), ("GRU", {"linear_before_reset": 1}), ("RNN", {}),
                                      ("RNN", {"activations": ["Relu"]})])
def test_fused_path_equals_the_step_loop(op, attrs):
    """torch's fused kernel (used where it is exactly the ONNX computation) vs the explicit loop."""
    m, feeds = _rnn_model(op, attrs, direction="bidirectional", h0=True, c0=True, T=7)
    gm = lift(m)
    mod = next(x for x in gm.modules() if isinstance(x, OnnxRecurrent))
    assert mod._fusable
    fused = run_gm(gm, feeds)
    mod._fusable = False
    looped = run_gm(gm, feeds)
    for a, b in zip(fused, looped):
        assert rel_l2(a, b) < 1e-6
    # not fusable: GRU with linear_before_reset=0, clip, peepholes
    for op2, attrs2, kw in (("GRU", {}, {}), ("LSTM", {"clip": 1.0}, {}), ("LSTM", {}, {"peep": True})):
        gm2 = lift(_rnn_model(op2, attrs2, **kw)[0])
        assert not next(x for x in gm2.modules() if isinstance(x, OnnxRecurrent))._fusable


@pytest.mark.parametrize("fused", [True, False])
def test_weights_are_parameters_mapped_by_tensor_map_and_get_gradients(fused):
    m, feeds = _rnn_model("LSTM", {} if fused else {"clip": 3.0}, direction="bidirectional", peep=not fused,
                          h0=True, c0=True)
    gm = lift(m)
    tm = gm.tensor_map
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    for name in inits:
        (ref,) = tm[name]
        assert ref.kind == "param" and ref.attr == name and ref.perm is None
        param = ref.resolve(gm)
        assert isinstance(param, torch.nn.Parameter) and param.requires_grad
        assert torch.equal(param.detach(), torch.from_numpy(inits[name].copy()))
        assert tm.tensor_of_param(ref.module, ref.attr) == name
    args = [torch.from_numpy(feeds[n]) for n in gm.input_names]
    y, yh, yc = gm(*args)
    (y.square().sum() + yh.sum() + yc.sum()).backward()
    for name in inits:
        grad = tm[name][0].resolve(gm).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_gradient_matches_finite_difference():
    m, feeds = _rnn_model("GRU", {}, T=3, N=2, I=2, H=2, dtype=np.float64)
    gm = lift(m)
    w = gm.tensor_map["W"][0].resolve(gm)
    x = torch.from_numpy(feeds["X"])
    y, _ = gm(x)
    y.sum().backward()
    eps = 1e-6
    with torch.no_grad():
        w[0, 1, 0] += eps
        up = gm(x)[0].sum()
        w[0, 1, 0] -= 2 * eps
        down = gm(x)[0].sum()
        w[0, 1, 0] += eps
    assert abs(float((up - down) / (2 * eps)) - float(w.grad[0, 1, 0])) < 1e-6


def test_bad_sequence_lens_is_a_data_error():
    m, feeds = _rnn_model("RNN", {}, lens=[1, 2, 3])
    gm = lift(m)
    feeds["L"] = np.array([1, 9, 3], np.int32)
    with pytest.raises(DataError, match="rnn.*sequence_lens"):
        run_gm(gm, feeds)


@pytest.mark.parametrize("attrs,match", [({"direction": "sideways"}, "direction"),
                                         ({"activations": ["Sigmoid", "Tanh", "Swish"]}, "Swish"),
                                         ({"activations": ["Sigmoid", "Tanh"]}, "activations"),
                                         ({"clip": -1.0}, "clip")])
def test_invalid_attributes_are_reported(attrs, match):
    m, _ = _rnn_model("LSTM", {})
    for a in list(m.graph.node[0].attribute):
        if a.name in attrs:
            m.graph.node[0].attribute.remove(a)
    m.graph.node[0].attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    with pytest.raises(UnsupportedOpsError, match=match) as info:
        lift(m)
    assert info.value.ops[0][1] == "LSTM" and info.value.ops[0][3] == ["rnn"]


def test_parse_activations_alpha_beta_consumption():
    acts = parse_activations(["LeakyRelu", "Tanh", "Affine", "elu", "Sigmoid", "HardSigmoid"], [0.1, 2.0], [0.5],
                             "LSTM", 2, "n")
    # alphas go to LeakyRelu and Affine only; Elu then HardSigmoid take defaults; beta to Affine
    assert acts == [("leakyrelu", 0.1, 0.0), ("tanh", 0.0, 0.0), ("affine", 2.0, 0.5), ("elu", 1.0, 0.0),
                    ("sigmoid", 0.0, 0.0), ("hardsigmoid", 0.2, 0.5)]


# ---------------------------------------------------------------------------------- DynamicQuantizeLSTM
def _dq_lstm_model(D=2, T=6, N=1, I=5, H=4, per_column=False, signed=True, lens=None, seed=0):
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((D, I, 4 * H)).astype(np.float32) * 0.5
    rf = rng.standard_normal((D, H, 4 * H)).astype(np.float32) * 0.5

    def quantize(w):
        amax = np.abs(w).max(axis=1) if per_column else np.abs(w).reshape(D, -1).max(axis=1)
        s = (amax / 127.0).astype(np.float32)
        q = np.round(w / (s[:, None, :] if per_column else s[:, None, None]))
        if signed:
            return q.astype(np.int8), s, np.zeros(s.shape, np.int8)
        return (q + 128).astype(np.uint8), s, np.full(s.shape, 128, np.uint8)

    wq, ws, wz = quantize(wf)
    rq, rs, rz = quantize(rf)
    inits = {"W": wq, "R": rq, "B": (rng.standard_normal((D, 8 * H)) * 0.3).astype(np.float32),
             "ws": ws, "wz": wz, "rs": rs, "rz": rz}
    feeds = {"X": rng.standard_normal((T, N, I)).astype(np.float32)}
    inputs = [("X", F, [T, N, I])]
    if lens is not None:
        feeds["L"] = np.array(lens, np.int32)
        inputs.append(("L", TensorProto.INT32, [N]))
    node = helper.make_node("DynamicQuantizeLSTM", ["X", "W", "R", "B", "L" if lens else "", "", "", "", "ws", "wz",
                                                    "rs", "rz"], ["Y", "Y_h", "Y_c"], domain="com.microsoft",
                            hidden_size=H, direction="bidirectional" if D == 2 else "forward", name="dq_lstm")
    m = make_model([node], inputs, [(o, F, None) for o in ("Y", "Y_h", "Y_c")], inits, opset=14)
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m, feeds, (wf, rf, inits)


def _ort_one_thread(m, feeds):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # ONNX Runtime's batch split across threads changes its H quantization groups
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


@requires_exact_ort_u8s8
@pytest.mark.parametrize("kw", [dict(), dict(per_column=True), dict(signed=False), dict(D=1, N=3, lens=[6, 3, 1]),
                                dict(N=3, lens=[6, 0, 2]), dict(N=4, T=12, H=16, I=24)])
def test_dynamic_quantize_lstm_matches_onnxruntime(kw):
    m, feeds, (wf, rf, inits) = _dq_lstm_model(**kw)
    want = _ort_one_thread(m, feeds)
    gm = lift(m)
    got = run_gm(gm, feeds)
    for w, g in zip(want, got):
        assert w.shape == g.shape and rel_l2(w, g) < 1e-6, rel_l2(w, g)
    # the int8 weights and their scales stay buffers, mapped by the TensorMap
    for name in ("W", "R", "ws", "wz", "rs", "rz"):
        (ref,) = gm.tensor_map[name]
        assert ref.kind == "param" and torch.equal(ref.resolve(gm), torch.from_numpy(np.array(inits[name])))


@requires_exact_ort_u8s8
def test_dynamic_quantize_lstm_emulates_activation_quantization():
    """A float LSTM on the dequantized weights differs from ONNX Runtime by far more than the emulation does."""
    m, feeds, (wf, rf, inits) = _dq_lstm_model(N=2, T=10, H=8, I=6, seed=3)
    want = _ort_one_thread(m, feeds)
    got = run_gm(lift(m), feeds)
    deq_w = (inits["W"].astype(np.float32) * inits["ws"][:, None, None]).transpose(0, 2, 1)
    deq_r = (inits["R"].astype(np.float32) * inits["rs"][:, None, None]).transpose(0, 2, 1)
    node = helper.make_node("LSTM", ["X", "W", "R", "B"], ["Y", "Y_h", "Y_c"], hidden_size=8,
                            direction="bidirectional")
    fm = make_model([node], [("X", F, list(feeds["X"].shape))], [(o, F, None) for o in ("Y", "Y_h", "Y_c")],
                    {"W": np.ascontiguousarray(deq_w), "R": np.ascontiguousarray(deq_r), "B": inits["B"]}, opset=14)
    float_out = run_ort(fm, feeds)
    assert rel_l2(want[0], got[0]) < 1e-6
    assert rel_l2(want[0], float_out[0]) > 100 * max(rel_l2(want[0], got[0]), 1e-8)


def test_dynamic_quantize_uint8_formula():
    a = torch.tensor([-1.0, 0.0, 0.5, 3.0])
    q, scale, zp = dynamic_quantize_uint8(a)
    assert float(scale) == pytest.approx(4.0 / 255.0) and float(zp) == round(1.0 / (4.0 / 255.0))
    assert q.tolist() == [0.0, float(zp), float(torch.round(0.5 / scale + zp)), 255.0]
    q0, s0, z0 = dynamic_quantize_uint8(torch.zeros(3))  # empty range: scale 1, zero point 0
    assert float(s0) == 1.0 and float(z0) == 0.0 and q0.tolist() == [0.0, 0.0, 0.0]
