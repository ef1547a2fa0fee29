"""BF16 / FP16 reference functions (qtorch_onnx.formats.floating): golden vectors, ONNX Runtime Cast models on
random bit patterns, and a scalar oracle written from docs/numerics.md section 3. Bit-exact (uint32 views) except
float16 NaN payloads (golden README item 4)."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from qtorch_onnx.errors import ConfigError
from qtorch_onnx.formats import floating as F

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "golden")


def _cases():
    with open(os.path.join(GOLDEN, "cases.json")) as f:
        cases = json.load(f)["cases"]
    out = []
    for c in cases:
        if c["file"] != "extended_qdq.npz":
            continue
        dts = {i["dtype"] for i in c["inputs"] if i} | {c["outputs"][0]["dtype"]}
        if dts & {"bfloat16", "float16"}:
            out.append(c)
    return out


CASES = _cases()
ARR = np.load(os.path.join(GOLDEN, "extended_qdq.npz"))


def test_golden_case_count():
    assert len(CASES) == 53  # 27 bfloat16 + 26 float16


def _bf16_tensor(u16: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(u16.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_golden(case):
    ins = [ARR[i["key"]] for i in case["inputs"]]
    x, scale, zp = ins
    axis = case["attributes"].get("axis", 0)
    use_axis = None if scale.size == 1 else axis
    out = ARR[case["outputs"][0]["key"]]
    is_bf16 = "bfloat16" in {i["dtype"] for i in case["inputs"]} | {case["outputs"][0]["dtype"]}
    quant = not case["op_type"].endswith("DequantizeLinear")
    if is_bf16:
        s, z = torch.from_numpy(scale.copy()), _bf16_tensor(zp)
        if quant:
            q = F.bf16_quantize(torch.from_numpy(x), s, z, use_axis)
            assert q.dtype == torch.bfloat16
            got = q.view(torch.int16).numpy().view(np.uint16)
            np.testing.assert_array_equal(got, out)
        else:
            y = F.bf16_dequantize(_bf16_tensor(x), s, z, use_axis).numpy()
            np.testing.assert_array_equal(y.view(np.uint32), out.view(np.uint32))
        return
    if quant:
        got = F.fp16_quantize(torch.from_numpy(x)).numpy()
        assert got.dtype == np.float16
        nan = np.isnan(out)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], out.view(np.uint16)[~nan])
        fr = F.fp16_round(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(fr.view(np.uint32)[~nan], out.astype(np.float32).view(np.uint32)[~nan])
    else:
        y = F.fp16_dequantize(torch.from_numpy(x)).numpy()
        nan = np.isnan(out)
        np.testing.assert_array_equal(np.isnan(y), nan)
        np.testing.assert_array_equal(y.view(np.uint32)[~nan], out.view(np.uint32)[~nan])


# --------------------------------------------------------------------------------------- random bit patterns
def _patterns(n: int = 1 << 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    hi = rng.integers(0, 2 ** 16, n // 4, dtype=np.uint64).astype(np.uint32) << 16
    ties = hi | 0x8000  # exact bf16 ties, both parities
    near = hi | rng.choice(np.array([0x7FFF, 0x8001, 0x0001, 0xFFFF], dtype=np.uint32), n // 4)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
                        0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                        0x00000001, 0x807FFFFF, 0x00008000, 0x00018000, 0x477FEFFF, 0x477FF000, 0x477FF001,
                        0x33000000, 0x33000001, 0xB3000000, 0x387FC000, 0x38800000], dtype=np.uint32)
    # float16 boundaries: around 65504/65520, subnormal halves
    f16 = (rng.integers(0, 2 ** 16, n // 4, dtype=np.uint64).astype(np.uint16).view(np.float16)
           .astype(np.float32).view(np.uint32))
    f16_ties = f16 + np.uint32(0x1000)  # half way between two float16 normals (13 dropped bits)
    return np.concatenate([u, ties, near, special, f16, f16_ties]).astype(np.uint32)


def _ort_session(nodes, inits=()):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto as T, helper

    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, None)],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)], initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(sess, x: np.ndarray) -> np.ndarray:
    return sess.run(None, {"x": x})[0]


def bf16_oracle_bits(u: int) -> int:
    """Scalar oracle (docs/numerics.md 3 + ONNX Runtime's observed NaN rule) on a float32 bit pattern."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u & 0x80000000) | 0x7FC00000)
    lower = u & 0xFFFF
    upper = u >> 16
    if lower > 0x8000 or (lower == 0x8000 and (upper & 1)):
        upper += 1  # carries into the exponent: rounds up to the next binade or to Inf
    return (upper << 16) & 0xFFFFFFFF


def test_bf16_round_vs_onnxruntime_cast():
    from onnx import TensorProto as T, helper

    sess = _ort_session([helper.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16),
                         helper.make_node("Cast", ["b"], ["y"], to=T.FLOAT)])
    u = _patterns()
    x = u.view(np.float32)
    ref = _run(sess, x).view(np.uint32)
    got = F.bf16_round(torch.from_numpy(x)).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, ref)
    oracle = np.array([bf16_oracle_bits(int(v)) for v in u[:5000]], dtype=np.uint32)
    np.testing.assert_array_equal(got[:5000], oracle)
    # the integer formulation (kept as a second reference) agrees everywhere too
    ints = (F._bf16_bits_oracle(torch.from_numpy(x)) << 16).numpy().view(np.uint32)
    np.testing.assert_array_equal(ints, ref)


def test_bf16_round_matches_torch_cast_except_nan():
    """torch's own .to(bfloat16) is RNE too, but (torch 2.x CPU) writes NaN as 0xFFFF: not the ORT rule."""
    x = torch.from_numpy(_patterns().view(np.float32))
    mine = F.bf16_round(x).view(torch.int32)
    theirs = x.to(torch.bfloat16).to(torch.float32).view(torch.int32)
    nan = torch.isnan(x)
    assert torch.equal(mine[~nan], theirs[~nan])


def test_fp16_round_vs_onnxruntime_clip_cast():
    from onnx import TensorProto as T, helper, numpy_helper

    lo = numpy_helper.from_array(np.array(-65504, np.float32), "lo")
    hi = numpy_helper.from_array(np.array(65504, np.float32), "hi")
    sess = _ort_session([helper.make_node("Clip", ["x", "lo", "hi"], ["c"]),
                         helper.make_node("Cast", ["c"], ["h"], to=T.FLOAT16),
                         helper.make_node("Cast", ["h"], ["y"], to=T.FLOAT)], [lo, hi])
    x = _patterns(seed=1).view(np.float32)
    ref = _run(sess, x)
    got = F.fp16_round(torch.from_numpy(x)).numpy()
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)  # ORT's Clip propagates NaN, as the spec wants
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    # oracle: numpy's IEEE float16 conversion after the clip
    with np.errstate(invalid="ignore"):
        o = np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], o.view(np.uint32)[~nan])


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0, 1e-3, 3.0e5])
def test_cast_form_vs_onnxruntime(scale):
    from onnx import TensorProto as T, helper, numpy_helper

    s32 = np.float32(scale)
    inv = np.float32(1.0) / s32
    nodes = [helper.make_node("Cast", ["m"], ["b"], to=T.BFLOAT16), helper.make_node("Cast", ["b"], ["f"], to=T.FLOAT)]
    inits = []
    if scale != 1.0:
        nodes = ([helper.make_node("Mul", ["x", "inv"], ["m"])] + nodes + [helper.make_node("Mul", ["f", "s"], ["y"])])
        inits = [numpy_helper.from_array(np.array(inv), "inv"), numpy_helper.from_array(np.array(s32), "s")]
    else:
        nodes[0] = helper.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16)
        nodes[1] = helper.make_node("Cast", ["b"], ["y"], to=T.FLOAT)
    sess = _ort_session(nodes, inits)
    x = _patterns(n=1 << 14, seed=2).view(np.float32)
    ref = _run(sess, x)
    got = F.scaled_bf16(torch.from_numpy(x), torch.tensor(s32), form="cast").numpy()
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    # NaN: ORT keeps the sign through the chain; so do we (exactly, not only NaN-ness)
    np.testing.assert_array_equal(got.view(np.uint32)[nan], ref.view(np.uint32)[nan])


def test_qdq_form_equals_quark_pair_and_differs_from_cast_form():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal(1 << 16).astype(np.float32) * 5)
    s = torch.tensor(0.37)
    qdq = F.scaled_bf16(x, s, form="qdq")
    ref = F.bf16_dequantize(F.bf16_quantize(x, s), s)
    assert torch.equal(qdq.view(torch.int32), ref.view(torch.int32))
    # explicit formula: bf16(x / s) * s
    exp = F.bf16_round(x / s) * s
    assert torch.equal(qdq.view(torch.int32), exp.view(torch.int32))
    cast = F.scaled_bf16(x, s, form="cast")
    assert not torch.equal(qdq.view(torch.int32), cast.view(torch.int32))  # docs/numerics.md 3: last-bit differences
    # with a power-of-two scale the two forms agree
    s2 = torch.tensor(0.25)
    assert torch.equal(F.scaled_bf16(x, s2, form="qdq").view(torch.int32),
                       F.scaled_bf16(x, s2, form="cast").view(torch.int32))


@settings(max_examples=500, deadline=None)
@given(u=st.integers(0, 2 ** 32 - 1))
def test_bf16_round_scalar_oracle(u):
    x = torch.tensor([u], dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = int(F.bf16_round(x).view(torch.int32).item()) & 0xFFFFFFFF
    assert got == bf16_oracle_bits(u)


@settings(max_examples=500, deadline=None)
@given(v=st.floats(width=32, allow_nan=False))
def test_fp16_round_scalar_oracle(v):
    clipped = min(max(v, -65504.0), 65504.0)
    exp = struct.unpack("<e", struct.pack("<e", clipped))[0]  # Python's IEEE half packing: RNE
    got = F.fp16_round(torch.tensor([v], dtype=torch.float32)).item()
    assert struct.pack("<f", got) == struct.pack("<f", exp)


def test_bf16_dequantize_nan_code_and_zero_point():
    q = _bf16_tensor(np.array([0x7FC1, 0xFFC0, 0x7F81, 0x3F80, 0x8000], dtype=np.uint16))
    y = F.bf16_dequantize(q, 2.0, _bf16_tensor(np.array(0x3F00, dtype=np.uint16)))  # zp 0.5
    assert [hex(v & 0xFFFFFFFF) for v in y.view(torch.int32).tolist()] == \
        ["0x7fc00000", "0x7fc00000", "0x7fc00000", "0x3f800000", "0xbf800000"]


def test_ste():
    x = torch.tensor([1.0, 70000.0, -1e6, 3.0, float("inf"), float("nan")], requires_grad=True)
    F.fp16_round_ste(x).backward(torch.ones(6))
    assert x.grad.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    x2 = torch.tensor([1.0, 3e38, -0.3], requires_grad=True)
    y = F.bf16_round_ste(x2)
    assert torch.equal(y.detach().view(torch.int32), F.bf16_round(x2.detach()).view(torch.int32))
    y.sum().backward()
    assert x2.grad.tolist() == [1.0, 1.0, 1.0]
    x3 = torch.tensor([1.0, 2.0], requires_grad=True)
    y3 = F.scaled_bf16_ste(x3, 0.37, form="cast")
    (y3 * torch.tensor([2.0, 3.0])).sum().backward()
    assert x3.grad.tolist() == [2.0, 3.0]


def test_errors_and_no_mutation():
    x = torch.tensor([1.5, -2.25])
    before = x.clone()
    F.scaled_bf16(x, 0.3)
    F.bf16_round(x)
    F.fp16_round(x)
    assert torch.equal(x, before)
    with pytest.raises(ConfigError, match="form"):
        F.scaled_bf16(x, 0.3, form="bogus")
    with pytest.raises(ConfigError):
        F.bf16_quantize(torch.zeros(2, 3), torch.ones(3))  # per-channel without axis
    with pytest.raises(ConfigError):
        F.bf16_dequantize(torch.zeros(3), 1.0)  # not bfloat16
