"""BFP / BFP-prime references against a slow scalar oracle written from docs/numerics.md sections 4-6.

The oracle works element by element in exact rational arithmetic (``fractions.Fraction``) and Python
integers, on float32 values decoded with ``struct`` -- no torch, no shared code with the implementation.
"""
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtorch_onnx.errors import ConfigError, DataError
from qtorch_onnx.formats.bfp import bfp_reference, validate_bfp_attributes

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------- oracle
def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def E(v: float) -> int:
    return (f32_bits(v) >> 23) & 0xFF


def to_f32(q: Fraction, negative: bool) -> float:
    """Exact rational (exact in double here) -> float32 with round to nearest even, explicit zero sign."""
    val = float(np.float32(float(q)))  # q has <= 24 significant bits: float(q) is exact, one rounding
    return -val if negative else val


def round_mode(v: Fraction, mode: int) -> int:
    """docs/numerics.md preamble: 0 half away from zero, 1 half toward +inf, 2 half to even."""
    if mode == 2:
        return round(v)  # Fraction.__round__ rounds half to even
    if mode == 1:
        f = math.floor(v)
        return f + (1 if v - f >= Fraction(1, 2) else 0)
    a = abs(v)
    f = math.floor(a)
    r = f + (1 if a - f >= Fraction(1, 2) else 0)
    return r if v >= 0 else -r


def oracle_bfp_block(block, m, mode):
    """docs/numerics.md section 5 on one block (list of float32 values as Python floats)."""
    finite = [v for v in block if math.isfinite(v)]
    S = max([E(v) for v in finite], default=0)
    s = Fraction(2) ** (S - 127 - (m - 1))
    L = 2 ** m - 1
    out = []
    for v in block:
        if not math.isfinite(v):
            out.append(v)
            continue
        q = Fraction(v) / s
        r = max(-L, min(L, round_mode(q, mode)))
        neg = math.copysign(1.0, v) < 0
        if r == 0:
            if mode == 2:
                # a nonzero quotient rounding to zero gives +0.0; a quotient that is itself a zero in float32
                # (-0.0, or |x/s| <= 2^-150 underflowing) keeps its sign (what Quark's vectors record)
                neg = neg and abs(q) <= Fraction(1, 2 ** 150)
            out.append(to_f32(Fraction(0), neg))
        else:
            out.append(to_f32(abs(r) * s, r < 0))
    return out


def oracle_prime_block(block, m, mode, sub, d):
    """docs/numerics.md section 6 on one block."""
    es = [E(v) for v in block]
    S = max(es)
    if S == 255:
        return [bits_f32(0x7FFFFFFF)] * len(block)
    out = []
    for j in range(0, len(block), sub):
        Sj = max(es[j:j + sub])
        shift = min(S - Sj, 2 ** d - 1)
        for v, e in zip(block[j:j + sub], es[j:j + sub]):
            neg = f32_bits(v) >> 31 == 1
            M = ((f32_bits(v) & 0x7FFFFF) | 0x800000) if e != 0 else 0
            t = (S - shift - e) + 24 - m
            if t > 25:
                q = 0
            else:
                q = M >> t
                rem = M - (q << t)
                half = 1 << (t - 1)
                if mode == 0:
                    up = rem >= half
                elif mode == 1:
                    up = rem > half or (rem == half and not neg)
                else:
                    up = rem > half or (rem == half and q % 2 == 1)
                if up and q != 2 ** m - 1:
                    q += 1
            out.append(to_f32(q * Fraction(2) ** (S - 127 - shift + 1 - m), neg))
    return out


def oracle(x: np.ndarray, bfp_method, axis, bit_width, block_size, rounding_mode, sub_block_size=2,
           sub_block_shift_bits=1):
    """Whole-tensor oracle: explicit Python loops over every block (float32 numpy in and out)."""
    if x.size == 1:
        return x.copy()
    m = bit_width - 9
    ax = 0 if x.ndim == 1 else axis % x.ndim
    moved = np.moveaxis(x, ax, -1)
    out = np.empty_like(moved)
    for idx in np.ndindex(moved.shape[:-1]):
        row = [float(v) for v in moved[idx]]
        res = []
        for b in range(0, len(row), block_size):
            blk = row[b:b + block_size]
            pad = block_size - len(blk)
            blk = blk + [0.0] * pad
            if bfp_method == "to_bfp":
                r = oracle_bfp_block(blk, m, rounding_mode)
            else:
                r = oracle_prime_block(blk, m, rounding_mode, sub_block_size, sub_block_shift_bits)
            res += r[:block_size - pad]
        out[idx] = np.array(res, dtype=np.float32)
    return np.ascontiguousarray(np.moveaxis(out, -1, ax))


# ------------------------------------------------------------------------------------ strategies
SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38, 3.4028235e38, -3.4028235e38,
            float("inf"), float("-inf"), float("nan")]


@st.composite
def block_tensors(draw, max_rank=3, allow_special=True):
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    n = int(np.prod(shape))
    base_e = draw(st.integers(-140, 120))
    kind = draw(st.sampled_from(["structured", "structured", "any", "mixed"]))
    vals = []
    for _ in range(n):
        if kind == "any" or (kind == "mixed" and draw(st.booleans())):
            if allow_special:
                v = draw(st.one_of(st.floats(width=32), st.sampled_from(SPECIALS)))
            else:
                v = draw(st.floats(width=32, allow_nan=False, allow_infinity=False))
        else:
            # few significant bits around a shared exponent: lands on rounding ties and sub-block shifts
            k = draw(st.integers(-600, 600))
            e = base_e - draw(st.integers(0, 12))
            v = float(np.float32(k * 2.0 ** e)) if -149 <= e + 10 <= 127 else 0.0
        vals.append(v)
    x = np.array(vals, dtype=np.float32).reshape(shape)
    if allow_special and kind != "any" and draw(st.integers(0, 9)) == 0:
        x.ravel()[draw(st.integers(0, n - 1))] = draw(st.sampled_from(SPECIALS))
    return x


def assert_bits(got: np.ndarray, want: np.ndarray):
    assert got.shape == want.shape
    g, w = got.view(np.uint32), want.view(np.uint32)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{len(bad)} differ; first {tuple(bad[0])}: got {g[tuple(bad[0])]:#x} want {w[tuple(bad[0])]:#x}"


# --------------------------------------------------------------------------------- property tests
@SETTINGS
@given(x=block_tensors(), bit_width=st.sampled_from([10, 11, 12, 16, 20, 32]), block_size=st.sampled_from([1, 2, 3, 8, 16]),
       mode=st.sampled_from([0, 1, 2]), axis_pick=st.integers(-3, 2), bf16=st.sampled_from([0, 0, 1]))
def test_bfp_matches_oracle(x, bit_width, block_size, mode, axis_pick, bf16):
    axis = axis_pick % x.ndim if x.ndim > 1 else axis_pick
    if x.ndim > 1 and axis_pick < 0 and -axis_pick <= x.ndim:
        axis = axis_pick
    xin = x
    if bf16:
        # bfloat16 pre-rounding oracle: Quark's bit arithmetic (u + 0x7FFF + lsb) >> 16 << 16, no NaN special case
        u = x.view(np.uint32).astype(np.uint64)
        xin = ((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    want = oracle(xin, "to_bfp", axis, bit_width, block_size, mode)
    got = bfp_reference(torch.from_numpy(x.copy()), bfp_method="to_bfp", axis=axis, bit_width=bit_width,
                        block_size=block_size, rounding_mode=mode, convert_to_bfloat_before_bfp=bf16)
    assert_bits(got.numpy(), want)


@SETTINGS
@given(x=block_tensors(), bit_width=st.sampled_from([10, 11, 13, 16, 24]),
       sub_cfg=st.sampled_from([(16, 2, 1), (16, 4, 2), (8, 8, 3), (4, 1, 1), (6, 3, 2), (32, 4, 4)]),
       mode=st.sampled_from([0, 1, 2]), axis=st.integers(-1, 0), method=st.sampled_from(["to_bfp_prime", "to_bfp_prime_shared"]))
def test_bfp_prime_matches_oracle(x, bit_width, sub_cfg, mode, axis, method):
    block_size, sub, d = sub_cfg
    want = oracle(x, "to_bfp_prime", axis, bit_width, block_size, mode, sub, d)
    got = bfp_reference(torch.from_numpy(x.copy()), bfp_method=method, axis=axis, bit_width=bit_width,
                        block_size=block_size, rounding_mode=mode, sub_block_size=sub, sub_block_shift_bits=d)
    assert_bits(got.numpy(), want)


@SETTINGS
@given(x=block_tensors(max_rank=2, allow_special=False), method=st.sampled_from(["to_bfp", "to_bfp_prime"]),
       mode=st.sampled_from([0, 1, 2]))
def test_float16_goes_through_float32(x, method, mode):
    """docs/numerics.md section 4: float16 -> float32 -> process -> float16 with round to nearest even."""
    x16 = np.clip(x, -65504, 65504).astype(np.float16)
    want = oracle(x16.astype(np.float32), method, -1, 13, 16, mode, 2, 1).astype(np.float16)
    got = bfp_reference(torch.from_numpy(x16.copy()), bfp_method=method, axis=-1, bit_width=13, block_size=16,
                        rounding_mode=mode)
    assert got.dtype == torch.float16
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got.numpy()), nan)
    assert np.array_equal(got.numpy().view(np.uint16)[~nan], want.view(np.uint16)[~nan])


# ------------------------------------------------------------------------------------ fixed cases
def test_bfp16_worked_example():
    # block max 1.5 (E = 127): step 2^-6; 0.0078125 = 0.5 step ties away (mode 0) / to even (mode 2)
    x = torch.tensor([[1.5, 0.0078125, -0.0078125, 0.0234375, -0.3, -1e-30, 0.0, 1.0]])
    y0 = bfp_reference(x, axis=1, bit_width=16, block_size=8, rounding_mode=0)
    y1 = bfp_reference(x, axis=1, bit_width=16, block_size=8, rounding_mode=1)
    y2 = bfp_reference(x, axis=1, bit_width=16, block_size=8, rounding_mode=2)
    s = 2.0 ** -6
    assert y0.tolist()[0] == [1.5, s, -s, 2 * s, -19 * s, 0.0, 0.0, 1.0]
    assert y1.tolist()[0] == [1.5, s, 0.0, 2 * s, -19 * s, 0.0, 0.0, 1.0]
    assert y2.tolist()[0] == [1.5, 0.0, 0.0, 2 * s, -19 * s, 0.0, 0.0, 1.0]
    # zero signs: modes 0/1 follow the input; mode 2 gives +0.0 for a nonzero quotient
    assert torch.signbit(y0[0, 5]) and torch.signbit(y1[0, 2]) and torch.signbit(y1[0, 5])
    assert not torch.signbit(y2[0, 2]) and not torch.signbit(y2[0, 5])
    assert torch.signbit(bfp_reference(torch.tensor([-0.0, 1.0]), rounding_mode=2)[0])  # -0.0 stays -0.0


def test_bfp_saturation_clips_without_bumping_exponent():
    x = torch.tensor([1.9999999, 1.0])  # 1.9999999 / 2^-6 = 127.99... rounds to 128 -> clamped to 127
    y, mask = bfp_reference(x, bit_width=16, block_size=8, rounding_mode=2, return_mask=True)
    assert y.tolist() == [127 * 2.0 ** -6, 1.0]
    assert mask.tolist() == [False, True]


def test_prime_nan_block_and_subnormal_flush():
    x = torch.tensor([1.0, float("inf"), 2.0, 3.0, -1e-40, 0.5, 1.0, 1.0])
    y = bfp_reference(x, bfp_method="to_bfp_prime", bit_width=13, block_size=2, rounding_mode=2)
    bits = y.view(torch.int32).tolist()
    assert bits[:2] == [0x7FFFFFFF, 0x7FFFFFFF]
    assert bits[4] == -0x80000000  # subnormal flushed, sign kept
    assert y[2:4].tolist() == [2.0, 3.0]


@pytest.mark.parametrize("method", ["to_bfp", "to_bfp_prime"])
def test_nan_and_inf_pass_gradient_whatever_their_payload(method):
    # docs/numerics.md section 8: NaN/Inf inputs pass gradient 1. 0x7FFFFFFF is what a GPU makes of a float16
    # NaN widened to float32; its mantissa bits would round up to a saturation if they were a value
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0x7F800000], dtype=np.uint32)
    for b in nans:
        x = torch.from_numpy(np.array([b, 0x3F800000], dtype=np.uint32).view(np.float32))
        for mode in (0, 1, 2):
            _, mask = bfp_reference(x, bfp_method=method, bit_width=13, block_size=2, rounding_mode=mode,
                                    return_mask=True)
            assert mask.tolist() == [True, True], (hex(int(b)), mode)


def test_float16_nan_widening_does_not_depend_on_the_tensor():
    # torch's cast writes 0x7FFFFFFF for a short tensor and the F16C bits for a long one; the reference widens
    # every float16 NaN as the operator library does, so convert_to_bfloat_before_bfp sees the same bits
    from qtorch_onnx.formats.block import as_float32

    nans = torch.tensor([0x7FFF, 0x7D00, 0xFC01 - 0x10000, 0x7E00], dtype=torch.int16).view(torch.float16)
    want = [0x7FFFE000, 0x7FE00000, 0xFFC02000 - 2 ** 32, 0x7FC00000]
    for n in (4, 64):
        x = torch.ones(n, dtype=torch.float16)
        x[:4] = nans
        assert as_float32(x, "t")[0][:4].view(torch.int32).tolist() == want
        y = bfp_reference(x, bit_width=16, block_size=8, convert_to_bfloat_before_bfp=1)
        assert y[0].view(torch.int16).item() == -0x8000  # Quark's bfloat16 rounding carries 0x7FFFE000 into -0.0
        assert torch.isnan(y[1:4]).all()


def test_one_element_unchanged_and_zero_size():
    for x in (torch.tensor([3.14159]), torch.tensor([[[[-0.3]]]]), torch.tensor(7.25)):
        for method in ("to_bfp", "to_bfp_prime"):
            y = bfp_reference(x, bfp_method=method, bit_width=10, block_size=16)
            assert y.shape == x.shape and torch.equal(y.view(torch.int32), x.view(torch.int32))
    assert bfp_reference(torch.empty(0, 5)).shape == (0, 5)


def test_does_not_mutate_input_and_handles_non_contiguous():
    x = torch.randn(3, 20, 4)
    ref = x.clone()
    xt = x.transpose(0, 2)  # non-contiguous input
    for method in ("to_bfp", "to_bfp_prime"):
        y = bfp_reference(xt, bfp_method=method, axis=1, bit_width=12, block_size=8, convert_to_bfloat_before_bfp=1)
        assert torch.equal(x.view(torch.int32), ref.view(torch.int32)) and y.shape == xt.shape
        y2 = bfp_reference(xt.contiguous(), bfp_method=method, axis=1, bit_width=12, block_size=8,
                           convert_to_bfloat_before_bfp=1)
        assert torch.equal(y.view(torch.int32), y2.view(torch.int32))


def test_axis_variants_agree():
    x = torch.randn(5, 7, 9) * torch.logspace(-3, 3, 9)
    a = bfp_reference(x, axis=2, bit_width=11, block_size=4)
    b = bfp_reference(x, axis=-1, bit_width=11, block_size=4)
    c = bfp_reference(x.permute(2, 0, 1).contiguous(), axis=0, bit_width=11, block_size=4).permute(1, 2, 0)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(a.view(torch.int32), c.contiguous().view(torch.int32))


@pytest.mark.parametrize("kwargs, attribute", [
    (dict(bfp_method="to_bfpp"), "bfp_method"),
    (dict(bfp_method="mx"), "bfp_method"),
    (dict(bit_width=9), "bit_width"),
    (dict(bit_width=33), "bit_width"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=-8), "block_size"),
    (dict(block_size=8.0), "block_size"),
    (dict(rounding_mode=3), "rounding_mode"),
    (dict(rounding_mode=-1), "rounding_mode"),
    (dict(sub_block_size=0), "sub_block_size"),
    (dict(sub_block_shift_bits=0), "sub_block_shift_bits"),
    (dict(convert_to_bfloat_before_bfp=2), "convert_to_bfloat_before_bfp"),
    (dict(bfp_method="to_bfp_prime", block_size=16, sub_block_size=3), "sub_block_size"),
    (dict(bfp_method="to_bfp_prime_shared", block_size=10, sub_block_size=4), "sub_block_size"),
])
def test_invalid_attributes_raise(kwargs, attribute):
    with pytest.raises(ConfigError, match=attribute):
        validate_bfp_attributes(**kwargs)
    with pytest.raises(ConfigError, match=attribute):
        bfp_reference(torch.zeros(2, 16), **kwargs)


def test_valid_attributes_return_format():
    fmt = validate_bfp_attributes("to_bfp_prime_shared", 13, 16, 2, 2, 1)
    assert fmt.bfp_method == "to_bfp_prime" and fmt.name == "MX6"
    # a block size that is not a multiple of the sub-block size is fine for plain BFP (sub-blocks unused)
    assert validate_bfp_attributes("to_bfp", block_size=10, sub_block_size=4).block_size == 10


def test_axis_out_of_range_and_bad_dtype():
    with pytest.raises(ConfigError, match="axis"):
        bfp_reference(torch.zeros(2, 3), axis=2)
    with pytest.raises(ConfigError, match="axis"):
        bfp_reference(torch.zeros(2, 3), axis=-3)
    bfp_reference(torch.zeros(5), axis=7)  # rank 1 ignores axis
    with pytest.raises(DataError, match="float32"):
        bfp_reference(torch.zeros(4, 4, dtype=torch.float64))
