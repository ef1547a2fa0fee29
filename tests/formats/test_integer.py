"""Integer Q/DQ reference functions (qtorch_onnx.formats.integer) against the golden vectors and a scalar
oracle written from docs/numerics.md section 1. Bit-exact: integer equality, float32 compared as uint32."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from qtorch_onnx.errors import ConfigError
from qtorch_onnx.formats import integer as I
from qtorch_onnx.formats.spec import INT8, INT16, INT32, UINT8, UINT16, UINT32, IntFormat

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "golden")
INT_TYPES = {"int8": INT8, "uint8": UINT8, "int16": INT16, "uint16": UINT16, "int32": INT32, "uint32": UINT32}
FILES = ("onnx_qdq.npz", "ms_qdq.npz", "extended_qdq.npz")


def _load():
    with open(os.path.join(GOLDEN, "cases.json")) as f:
        cases = json.load(f)["cases"]
    arrays = {name: np.load(os.path.join(GOLDEN, name)) for name in FILES}
    out = []
    for c in cases:
        if c["file"] not in arrays:
            continue
        dts = {i["dtype"] for i in c["inputs"] if i} | {c["outputs"][0]["dtype"]}
        if dts & {"bfloat16", "float16"}:
            continue
        out.append(c)
    return out, arrays


CASES, ARRAYS = _load()


def _default_axis(domain: str) -> int:
    # ONNX QuantizeLinear and com.microsoft: axis default 1; Quark's Extended* kernels: 0 (cases.json notes).
    return 0 if domain == "com.amd.quark" else 1


def test_golden_case_count():
    # 287 + 96 + the 223 integer Extended cases (276 minus 53 bf16/fp16 ones)
    assert len(CASES) == 606


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_golden(case):
    d = ARRAYS[case["file"]]
    ins = [(d[i["key"]] if i else None) for i in case["inputs"]] + [None] * 3
    x, scale, zp = ins[0], ins[1], ins[2]
    attrs = case["attributes"]
    axis = attrs.get("axis", _default_axis(case["domain"]))
    block = attrs.get("block_size", 0) or None
    expected = d[case["outputs"][0]["key"]]
    s_t = torch.from_numpy(scale.copy())
    zp_t = None if zp is None else torch.from_numpy(zp.astype(np.int64))
    use_axis = None if scale.size == 1 else axis
    if case["op_type"].endswith("DequantizeLinear"):
        y = I.dequantize(torch.from_numpy(x.astype(np.int64)), s_t, zp_t, use_axis, block).numpy()
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y.view(np.uint32), expected.view(np.uint32))
        return
    fmt = INT_TYPES[case["outputs"][0]["dtype"]]
    x_before = x.copy()
    xt = torch.from_numpy(x)
    q = I.quantize(xt, s_t, zp_t, fmt, use_axis, block, ort_blocked_compat=True).numpy()
    assert np.array_equal(x.view(np.uint32), x_before.view(np.uint32))  # input not mutated
    exp = expected.astype(np.int64)
    mask = np.ones(exp.shape, bool)
    if case["domain"] == "com.amd.quark":
        # golden README item 3: Quark's NaN, +-Inf and |x/scale| >= 2^63 results are C++ UB: not compared.
        if scale.size == 1:
            sb = scale.reshape(())
        else:
            shp = [1] * x.ndim
            shp[axis % x.ndim] = -1
            sb = scale.reshape(shp)
        with np.errstate(all="ignore"):
            v = x / sb
        mask = np.isfinite(v) & (np.abs(v) < 2.0 ** 63)
    np.testing.assert_array_equal(np.where(mask, q, 0), np.where(mask, exp, 0))
    # the fused fake-quant path equals DQ(Q(x)) bit for bit
    fq = I.fake_quantize(xt, s_t, zp_t, fmt, use_axis, block, ort_blocked_compat=True).numpy()
    dq = I.dequantize(torch.from_numpy(q), s_t, zp_t, use_axis, block).numpy()
    np.testing.assert_array_equal(fq.view(np.uint32), dq.view(np.uint32))


def test_ort_blocked_quirk_is_needed_and_off_by_default():
    """The blocked non-last-axis cases with NaN/Inf need the compat flag; the default is the plain rule."""
    hit = 0
    for case in CASES:
        a = case["attributes"]
        if case["op_type"] != "QuantizeLinear" or not a.get("block_size") or a["axis"] in (-1, 2):
            continue
        d = ARRAYS[case["file"]]
        x, s, z = (d[i["key"]] for i in case["inputs"])
        fmt = INT_TYPES[case["outputs"][0]["dtype"]]
        q = I.quantize(torch.from_numpy(x), torch.from_numpy(s), torch.from_numpy(z.astype(np.int64)), fmt,
                       a["axis"], a["block_size"]).numpy()
        if not np.array_equal(q, d[case["outputs"][0]["key"]].astype(np.int64)):
            hit += 1
            bad = q != d[case["outputs"][0]["key"]]
            with np.errstate(all="ignore"):
                sb = np.repeat(s, a["block_size"], axis=a["axis"])[tuple(slice(0, n) for n in x.shape)]
                v = x / sb
            assert (~np.isfinite(v[bad]) | (np.abs(v[bad]) >= 2.0 ** 31)).all()
    assert hit > 0


# ------------------------------------------------------------------------------------------------ oracle
def f32(v: float) -> float:
    """Round a Python float (float64) to float32, RNE, overflow to +-inf."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def f32_div(a: float, b: float) -> float:
    # float32 division is the correctly rounded quotient: float64 division is exact enough (53 >= 2*24+2)
    return f32(a / b) if b != 0 else (math.copysign(math.inf, a) * math.copysign(1, b) if a != 0 and not math.isnan(a) else math.nan)


def oracle_quantize(x: float, s: float, zp: int, fmt: IntFormat, narrow: bool = False) -> int:
    qmin, qmax = fmt.qmin + (1 if narrow else 0), fmt.qmax
    if math.isnan(x):
        return qmin
    v = f32_div(x, s)
    if math.isnan(v):
        return qmin
    if math.isinf(v):
        return qmax if v > 0 else qmin
    r = round(v)  # Python round: half to even, exact on floats
    return max(qmin, min(qmax, r + zp))


def oracle_dequantize(q: int, s: float, zp: int) -> float:
    return f32(f32(float(q - zp)) * s)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
pos_scale = st.floats(min_value=2.0 ** -100, max_value=2.0 ** 33, width=32, allow_subnormal=False)
fmts = st.sampled_from([INT8, UINT8, INT16, UINT16, INT32, UINT32])


@settings(max_examples=300, deadline=None)
@given(xs=st.lists(any_f32, min_size=1, max_size=16), s=pos_scale, fmt=fmts, zfrac=st.floats(0, 1),
       narrow=st.booleans())
def test_quantize_matches_scalar_oracle(xs, s, fmt, zfrac, narrow):
    zp = int(fmt.qmin + round(zfrac * (fmt.qmax - fmt.qmin)))
    x = torch.tensor(xs, dtype=torch.float32)
    q = I.quantize(x, torch.tensor(s, dtype=torch.float32), torch.tensor(zp), fmt, narrow_range=narrow)
    xs32 = x.tolist()
    s32 = f32(s)
    exp = [oracle_quantize(v, s32, zp, fmt, narrow) for v in xs32]
    assert q.tolist() == exp
    y = I.fake_quantize(x, torch.tensor(s), torch.tensor(zp), fmt, narrow_range=narrow)
    ey = np.array([oracle_dequantize(e, s32, zp) for e in exp], dtype=np.float32)
    assert np.array_equal(y.numpy().view(np.uint32), ey.view(np.uint32))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), fmt=fmts, axis=st.integers(0, 2), block=st.sampled_from([None, 1, 2, 3, 4]))
def test_per_channel_and_blocked_match_oracle(data, fmt, axis, block):
    shape = [3, 5, 4]
    n = int(np.prod(shape))
    xs = data.draw(st.lists(finite_f32, min_size=n, max_size=n))
    x = torch.tensor(xs, dtype=torch.float32).reshape(shape)
    if block:
        pshape = list(shape)
        pshape[axis] = -(-shape[axis] // block)
    else:
        pshape = [shape[axis]]
    m = int(np.prod(pshape))
    ss = data.draw(st.lists(pos_scale, min_size=m, max_size=m))
    zs = data.draw(st.lists(st.integers(fmt.qmin, fmt.qmax), min_size=m, max_size=m))
    s = torch.tensor(ss, dtype=torch.float32).reshape(pshape)
    z = torch.tensor(zs, dtype=torch.int64).reshape(pshape)
    q = I.quantize(x, s, z, fmt, axis, block)
    y = I.dequantize(q, s, z, axis, block)
    for idx in np.ndindex(*shape):
        pidx = list(idx)
        if block:
            pidx[axis] //= block
            pi = tuple(pidx)
        else:
            pi = (idx[axis],)
        sv, zv = s[pi].item(), int(z[pi])
        e = oracle_quantize(x[idx].item(), sv, zv, fmt)
        assert q[idx].item() == e, (idx, x[idx].item(), sv, zv)
        assert np.float32(y[idx].item()).view(np.uint32) == np.float32(oracle_dequantize(e, sv, zv)).view(np.uint32)


def test_division_not_reciprocal():
    # values near (k + 0.5) * 0.1: float32 division and multiplying by the float32 reciprocal round differently
    s = torch.tensor(0.1, dtype=torch.float32)
    base = (torch.arange(0, 20000, dtype=torch.float32) + 0.5) * s
    x = torch.cat([base, torch.nextafter(base, torch.tensor(1e9)), torch.nextafter(base, torch.tensor(-1e9))])
    q = I.quantize(x, s, None, INT32)
    div = torch.round(x / s).to(torch.int64)
    recip = torch.round(x * (1 / s)).to(torch.int64)
    assert not torch.equal(div, recip)  # the probe discriminates
    assert torch.equal(q, div)


def test_nan_inf_rule():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38])
    for fmt in (INT8, UINT8, INT16, UINT16, INT32, UINT32):
        q = I.quantize(x, 0.5, 3 if fmt.signed else 7, fmt).tolist()
        assert q == [fmt.qmin, fmt.qmax, fmt.qmin, fmt.qmax, fmt.qmin]


def test_narrow_range_weights():
    x = torch.tensor([-1000.0, -127.4, 0.0, 1000.0])
    assert I.quantize(x, 1.0, 0, INT8, narrow_range=True).tolist() == [-127, -127, 0, 127]
    assert I.quantize(x, 1.0, 0, INT8).tolist() == [-128, -127, 0, 127]


def test_layout_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match="axis"):
        I.quantize(x, torch.ones(3), torch.zeros(3, dtype=torch.int64), INT8)
    with pytest.raises(ConfigError, match="3 along axis"):
        I.quantize(x, torch.ones(2), None, INT8, axis=1)
    with pytest.raises(ConfigError, match="out of range"):
        I.quantize(x, torch.ones(2), None, INT8, axis=2)
    with pytest.raises(ConfigError, match="expected"):
        I.quantize(x, torch.ones(2, 3), None, INT8, axis=1, block_size=2)
    with pytest.raises(ConfigError, match="integer"):
        I.quantize(x, 1.0, torch.zeros(()), INT8)


# ------------------------------------------------------------------------------------------- parameters
def np_qparams(rmin, rmax, qmin, qmax, symmetric):
    """Direct numpy transcription of docs/numerics.md section 1 for one range."""
    rmin, rmax = min(np.float64(rmin), 0.0), max(np.float64(rmax), 0.0)
    if symmetric:
        a = max(abs(rmin), abs(rmax))
        rmin, rmax = -a, a
    scale = (rmax - rmin) / (qmax - qmin)
    if scale < np.finfo(np.float32).tiny:
        return np.float32(1.0), 0
    zp = np.round((qmin + qmax) / 2.0) if symmetric else np.round(qmin - rmin / scale)
    return np.float32(scale), int(zp)


@settings(max_examples=300, deadline=None)
@given(a=finite_f32, b=finite_f32, fmt=fmts, sym=st.booleans())
def test_qparams_from_range_oracle(a, b, fmt, sym):
    lo, hi = min(a, b), max(a, b)
    s, z = I.qparams_from_range(torch.tensor(lo), torch.tensor(hi), fmt, sym)
    qmin, qmax = (-fmt.qmax, fmt.qmax) if (sym and fmt.signed) else (fmt.qmin, fmt.qmax)
    es, ez = np_qparams(lo, hi, qmin, qmax, sym)
    assert s.dtype == torch.float32 and s.numpy().view(np.uint32) == es.view(np.uint32)
    assert int(z) == ez


def test_qparams_known_values():
    s, z = I.qparams_from_range(torch.tensor(-2.0), torch.tensor(1.0), INT8, True)
    assert s.item() == np.float32(2.0 / 127) and z.item() == 0
    s, z = I.qparams_from_range(torch.tensor(-2.0), torch.tensor(1.0), UINT8, True)
    assert s.item() == np.float32(4.0 / 255) and z.item() == 128
    s, z = I.qparams_from_range(torch.tensor(-2.0), torch.tensor(1.0), UINT16, True)
    assert z.item() == 32768
    s, z = I.qparams_from_range(torch.tensor(-1.0), torch.tensor(3.0), INT32, True)
    assert s.item() == np.float32(3.0 / (2 ** 31 - 1))
    s, z = I.qparams_from_range(torch.tensor(0.5), torch.tensor(3.0), UINT8, False)  # rmin clamped to 0
    assert s.item() == np.float32(3.0 / 255) and z.item() == 0
    s, z = I.qparams_from_range(torch.tensor(0.0), torch.tensor(1e-39), INT8, True)  # tiny rule
    assert s.item() == 1.0 and z.item() == 0
    s, z = I.qparams_from_range(torch.tensor([-1.0, -4.0]), torch.tensor([1.0, 2.0]), INT8, False)
    assert s.shape == (2,) and z.tolist() == [0, 42]  # -128 + 4 / (6/255) = 42
    s, z = I.qparams_from_range(torch.tensor(-1.0), torch.tensor(1.0), INT8, True, reduce_range=True)
    assert s.item() == np.float32(2.0 / 128)
    with pytest.raises(ConfigError):
        I.qparams_from_range(torch.tensor(-1.0), torch.tensor(1.0), INT32, True, reduce_range=True)


@settings(max_examples=300, deadline=None)
@given(a=finite_f32, b=finite_f32, fmt=st.sampled_from([INT8, UINT8, INT16]), sym=st.booleans())
def test_pow2_nonoverflow_is_smallest_non_clipping(a, b, fmt, sym):
    lo, hi = min(a, b, 0.0), max(a, b, 0.0)
    s, z, pos = I.pow2_scale_nonoverflow(torch.tensor(lo), torch.tensor(hi), fmt, sym)
    assert s.item() == 2.0 ** (-pos.item())
    if lo == 0 and hi == 0:
        assert s.item() == 1.0
        return
    if pos.item() == -127:
        return

    def ok(scale, zp):
        q = I.quantize(torch.tensor([lo, hi], dtype=torch.float32), scale, zp, fmt)
        v = torch.tensor([lo, hi], dtype=torch.float32) / scale
        return bool(((torch.round(v) + zp >= fmt.qmin) & (torch.round(v) + zp <= fmt.qmax)).all()) and q is not None

    assert ok(s.item(), int(z))
    if pos.item() < 126:
        s2 = 2.0 ** (-(pos.item() + 1))
        z2 = int(z) if sym else int(np.clip(np.round(fmt.qmin - lo / s2), fmt.qmin, fmt.qmax))
        assert not ok(s2, z2)


def test_pow2_nonoverflow_known():
    s, z, p = I.pow2_scale_nonoverflow(torch.tensor(-1.0), torch.tensor(1.0), INT8, True)
    assert p.item() == 6  # at pos 7, +1.0 -> 128 > 127 clips (-1.0 -> -128 would fit)
    s, z, p = I.pow2_scale_nonoverflow(torch.tensor(-1.0), torch.tensor(0.99), INT8, True)
    assert p.item() == 7
    s, z, p = I.pow2_scale_nonoverflow(torch.tensor(0.0), torch.tensor(127.5 / 128), INT8, True)
    assert p.item() == 6  # 127.5 ties to even 128: clips at pos 7 (Quark's guard would say 7)


def test_bias():
    b = torch.tensor([0.5, -0.25, 1e10, -1e10, 0.375], dtype=torch.float32)
    sb = I.bias_scale(torch.tensor(0.25, dtype=torch.float32), torch.tensor(1.0, dtype=torch.float32))
    assert sb.dtype == torch.float32 and sb.item() == 0.25
    q = I.quantize_bias(b, sb)
    assert q.dtype == torch.int32
    assert q.tolist() == [2, -1, 2 ** 31 - 1, -(2 ** 31), 2]  # 1.5 -> 2 (even), -1 exact, saturation
    sx, sw = np.float32(0.1), np.array([0.3, 0.7], dtype=np.float32)
    sb = I.bias_scale(torch.tensor(sx), torch.from_numpy(sw))
    assert np.array_equal(sb.numpy().view(np.uint32), (sx * sw).view(np.uint32))
    bb = torch.tensor([1.0, -2.0])
    exp = [int(np.round(np.float64(np.float32(v)) / np.float64(s))) for v, s in zip(bb.tolist(), sb.tolist())]
    assert I.quantize_bias(bb, sb).tolist() == exp
    with pytest.raises(ConfigError):
        I.quantize_bias(bb, torch.tensor([0.0, 1.0]))


# ------------------------------------------------------------------------------------------------ gradients
def test_ste_gradient():
    x = torch.tensor([-300.0, -1.0, 0.2, 126.9, 127.6, 500.0, float("nan"), float("inf")], requires_grad=True)
    y = I.fake_quantize_ste(x, 1.0, 0, INT8)
    ref = I.fake_quantize(x.detach(), 1.0, 0, INT8)
    assert np.array_equal(y.detach().numpy().view(np.uint32), ref.numpy().view(np.uint32))
    y.backward(torch.full_like(y, 2.0))
    assert x.grad.tolist() == [0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 2.0, 2.0]


def test_ste_gradient_narrow_and_per_channel():
    x = torch.tensor([[-128.0, 1.0], [-126.6, 5.0]], requires_grad=True)
    y = I.fake_quantize_ste(x, torch.tensor([1.0, 0.01]), torch.tensor([0, 0]), INT8, axis=1, narrow_range=True)
    y.sum().backward()
    # -128 clips to -127 (narrow); -126.6 -> -127 inside; 1/0.01 = 100 inside; 5/0.01 = 500 saturates
    assert x.grad.tolist() == [[0.0, 1.0], [1.0, 0.0]]


def test_lsq_gradient():
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 3
    s = torch.tensor([0.05, 0.1, 0.2, 0.4], requires_grad=True)
    y = I.fake_quantize_lsq(x, s, None, INT8, axis=0, grad_factor=1.0)
    ref = I.fake_quantize(x, s.detach(), None, INT8, axis=0)
    assert torch.equal(y.detach(), ref)
    y.sum().backward()
    # expected: sum over each row of (round(v) - v) inside, q at saturation
    v = x / s.detach()[:, None]
    r = torch.round(v)
    inside = (r >= -128) & (r <= 127)
    exp = torch.where(inside, r - v, r.clamp(-128, 127)).sum(1)
    assert torch.allclose(s.grad, exp, rtol=1e-5, atol=1e-5)
    # blocked scales: gradient per block
    s2 = torch.full((4, 3), 0.1, requires_grad=True)
    I.fake_quantize_lsq(x, s2, None, INT8, axis=1, block_size=3).sum().backward()  # default g
    assert s2.grad.shape == (4, 3)
    v2 = x / 0.1
    r2 = torch.round(v2)
    g2 = torch.where((r2 >= -128) & (r2 <= 127), r2 - v2, r2.clamp(-128, 127))
    exp2 = torch.stack([g2[:, 0:3].sum(1), g2[:, 3:6].sum(1), g2[:, 6:8].sum(1)], 1) / math.sqrt(32 / 12 * 127)
    assert torch.allclose(s2.grad, exp2, rtol=1e-4, atol=1e-5)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), fmt=st.sampled_from([INT8, UINT8, INT16, UINT16, IntFormat(4, True), IntFormat(4, False)]),
       layout=st.sampled_from(["tensor", "channel", "block"]), narrow=st.booleans())
def test_fused_fake_quantize_equals_reference_core(data, fmt, layout, narrow):
    """The in-place fake-quantization path (no-grad forward and STE forward) gives the reference core's bits
    and its gradient mask, for NaN, +-Inf, -0.0, saturating and subnormal inputs."""
    shape = [2, 6, 3]
    n = int(np.prod(shape))
    special = st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e38, -1e38, 1e-45])
    xs = data.draw(st.lists(st.one_of(any_f32, special), min_size=n, max_size=n))
    x = torch.tensor(xs, dtype=torch.float32).reshape(shape)
    axis, block = (None, None) if layout == "tensor" else (1, None if layout == "channel" else 4)
    pshape = [] if layout == "tensor" else ([6] if layout == "channel" else [2, 2, 3])
    m = int(np.prod(pshape)) if pshape else 1
    s = torch.tensor(data.draw(st.lists(pos_scale, min_size=m, max_size=m)), dtype=torch.float32).reshape(pshape)
    z = torch.tensor(data.draw(st.lists(st.integers(fmt.qmin, fmt.qmax), min_size=m, max_size=m))).reshape(pshape)
    sb, zb = I._prepare(x, s, z, axis, block, "test")
    c, t = I._quantize_core(x, sb, zb, fmt, narrow, False)
    ref = (c - zb.to(c.dtype)).to(torch.float32) * sb
    ref_mask = (c == t) | ~torch.isfinite(x)
    y = I.fake_quantize(x, s, z, fmt, axis, block, narrow_range=narrow)
    assert np.array_equal(y.numpy().view(np.uint32), ref.numpy().view(np.uint32))
    y2, mask = I._fake_quantize_with_mask(x, s, z, fmt, axis, block, narrow, False, need_mask=True)
    assert np.array_equal(y2.numpy().view(np.uint32), ref.numpy().view(np.uint32))
    assert torch.equal(mask, ref_mask)
    xg = x.clone().requires_grad_(True)
    y3 = I.fake_quantize_ste(xg, s, z, fmt, axis, block, narrow_range=narrow)
    assert np.array_equal(y3.detach().numpy().view(np.uint32), ref.numpy().view(np.uint32))
    y3.backward(torch.ones_like(y3))
    assert torch.equal(xg.grad, ref_mask.to(torch.float32))
    x0 = torch.tensor(xs, dtype=torch.float32).reshape(shape)
    assert np.array_equal(x.numpy().view(np.uint32), x0.numpy().view(np.uint32))  # the input is not mutated
