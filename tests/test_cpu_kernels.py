"""cpu_kernels.c: the one-pass CPU copy of formats.integer.fake_quantize (per-tensor, <= 16 bits), bit for bit."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qtorch_onnx import cpu_kernels
from qtorch_onnx.fakequant import FakeQuantize
from qtorch_onnx.formats import integer as I
from qtorch_onnx.formats.spec import INT8, INT16, UINT8, UINT16

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the CPU kernels are not built")

SPECIALS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, -1e-45, 3.4e38, -3.4e38]


def _bits(t):
    return t.contiguous().view(torch.int32)


def _check(x, scale, zp, fmt, narrow):
    s = torch.tensor(scale, dtype=torch.float32)
    ref = I.fake_quantize(x, s, torch.tensor(zp), fmt, narrow_range=narrow)
    lo, hi = I.quant_range(fmt, narrow)
    got = cpu_kernels.fake_quantize_tensor(x, float(s), float(zp), lo, hi)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.equal(_bits(got), _bits(ref)), (scale, zp, fmt, narrow)


@pytest.mark.parametrize("fmt,zp", [(INT8, 0), (INT8, -5), (UINT8, 128), (UINT8, 0), (INT16, 0), (INT16, 300),
                                    (UINT16, 32768)])
@pytest.mark.parametrize("narrow", [False, True])
def test_equals_fake_quantize_on_ties_and_specials(fmt, zp, narrow):
    """Exact ties (x / s = k + 0.5, both parities), values past the range, NaN, +-Inf, signed zeros, subnormals."""
    scale = 0.0625  # a power of two: x / s is exact, so the ties are ties
    ties = torch.arange(-300, 300, dtype=torch.float32) * scale + scale / 2
    x = torch.cat([ties, torch.tensor(SPECIALS), torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 40])
    _check(x, scale, zp, fmt, narrow)
    _check(x, 0.0372, zp, fmt, narrow)  # division rounds: x / s in float32, as the torch path


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=300),
       st.floats(min_value=2.0 ** -26, max_value=2.0 ** 13, width=32), st.sampled_from([INT8, UINT8, INT16, UINT16]),
       st.integers(0, 65535), st.booleans())
def test_equals_fake_quantize_property(values, scale, fmt, zp_raw, narrow):
    lo, hi = I.quant_range(fmt)
    zp = lo + zp_raw % (hi - lo + 1)
    _check(torch.tensor(values, dtype=torch.float32), scale, zp, fmt, narrow)


def test_threads_split_gives_the_same_bits():
    x = torch.randn(cpu_kernels.PARALLEL_MIN * 2 + 37, generator=torch.Generator().manual_seed(2)) * 9
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            out.append(cpu_kernels.fake_quantize_tensor(x, 0.04, 3.0, -128, 127))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(out[0]), _bits(out[1]))
    _check(x, 0.04, 3, INT8, False)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="contiguous float32 CPU tensor"):
        cpu_kernels.fake_quantize_tensor(torch.zeros(4, 4).t(), 0.1, 0.0, -128, 127)
    with pytest.raises(ValueError, match="float64"):
        cpu_kernels.fake_quantize_tensor(torch.zeros(4, dtype=torch.float64), 0.1, 0.0, -128, 127)


def _quantizer(fmt=UINT8, zp=128):
    fq = FakeQuantize(fmt, tensor_name="act")
    fq.set_qparams(torch.tensor(0.05), torch.tensor(zp, dtype=torch.int64))
    fq.fake_quant_enabled = True
    return fq


def test_fake_quantize_module_uses_it_in_evaluation_only(monkeypatch):
    """A per-tensor activation quantizer on a CPU gives the torch path's bits through the kernel without
    gradient, and keeps the straight-through path (its saturation mask) when a gradient is wanted."""
    fq = _quantizer()
    x = torch.randn(8, 16, 24, 24, generator=torch.Generator().manual_seed(3)) * 6
    calls = []
    real = cpu_kernels.fake_quantize_tensor
    monkeypatch.setattr(cpu_kernels, "fake_quantize_tensor", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        y = fq(x)
    assert calls == [1]
    assert torch.equal(_bits(y), _bits(I.fake_quantize(x, torch.tensor(0.05), torch.tensor(128), UINT8)))
    xr = x.clone().requires_grad_()
    yr = fq(xr)
    assert calls == [1]  # the gradient path is the torch one
    assert torch.equal(_bits(yr.detach()), _bits(y))
    yr.sum().backward()
    assert (xr.grad == 0).any() and (xr.grad == 1).any()  # saturated elements get no gradient
    small = torch.randn(7, 5)
    with torch.no_grad():
        fq(small)  # below MIN_ELEMENTS: torch
    assert calls == [1]


def test_in_place_fake_quantization_gives_the_same_bits():
    """``out=x`` computes in place (each element read before it is written) to the out-of-place bits; a wrong
    ``out`` is refused; ``FakeQuantize.quantize_into`` overwrites only where its forward is that kernel and
    leaves the tensor alone (returning False) everywhere else."""
    x = torch.randn(4, 16, 20, 20, generator=torch.Generator().manual_seed(5)) * 8
    x.view(-1)[::97] = float("nan")
    ref = cpu_kernels.fake_quantize_tensor(x, 0.05, 3.0, 0, 255)
    y = x.clone()
    assert cpu_kernels.fake_quantize_tensor(y, 0.05, 3.0, 0, 255, out=y) is y
    assert torch.equal(_bits(y), _bits(ref))
    with pytest.raises(ValueError, match="out must be"):
        cpu_kernels.fake_quantize_tensor(x, 0.05, 3.0, 0, 255, out=torch.empty(4, 16, 20, 19))
    fq = _quantizer()
    with torch.no_grad():
        want = fq(x)
    y = x.clone()
    assert fq.quantize_into(y) and torch.equal(_bits(y), _bits(want))
    # not that kernel's forward: the tensor stays as it was
    cases = []
    observing = _quantizer()
    observing._observer_enabled = True
    cases.append((observing, x))
    off = _quantizer()
    off.fake_quant_enabled = False
    cases.append((off, x))
    per_channel = _quantizer()
    per_channel.set_qparams(torch.full((16,), 0.05), torch.full((16,), 128, dtype=torch.int64))
    per_channel.axis = 1
    cases.append((per_channel, x))
    cases.append((_quantizer(), torch.randn(7, 5)))  # below MIN_ELEMENTS
    cases.append((_quantizer(), x.transpose(2, 3)))  # not contiguous
    weight = FakeQuantize(UINT8, tensor_name="w", role="weight")
    cases.append((weight, x))
    for q, t in cases:
        t0 = t.clone()
        assert not q.quantize_into(t) and torch.equal(_bits(t), _bits(t0))


def test_switch_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert not cpu_kernels.available()
    fq = _quantizer(INT8, 0)
    x = torch.randn(64, 64) * 10
    with torch.no_grad():
        y = fq(x)
    assert torch.equal(_bits(y), _bits(I.fake_quantize(x, torch.tensor(0.05), torch.tensor(0), INT8)))


def test_compiled_and_traced_forwards_keep_the_torch_path():
    """Under torch.compile (dynamo's fake tensors have no memory) the kernel is not called; same bits."""
    fq = _quantizer()
    x = torch.randn(8, 16, 24, 24, generator=torch.Generator().manual_seed(4)) * 6
    with torch.no_grad():
        ref = fq(x)
        got = torch.compile(fq, backend="eager", fullgraph=False)(x)
    assert torch.equal(_bits(got), _bits(ref))


# ---------------------------------------------------------------------------------------------- BFP (to_bfp)
def _check_bfp(x, axis, block, bits, mode):
    from qtorch_onnx.formats.bfp import bfp_reference

    ref, ref_keep = bfp_reference(x, axis=axis, bit_width=bits, block_size=block, rounding_mode=mode,
                                  return_mask=True)
    keep = torch.full_like(x, 7.0)
    got = cpu_kernels.bfp_fake_quantize(x.contiguous(), axis % max(x.dim(), 1), block, bits, mode, keep=keep)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.equal(_bits(got), _bits(ref)), (tuple(x.shape), axis, block, bits, mode)
    assert torch.equal(keep, ref_keep.to(torch.float32)), (tuple(x.shape), axis, block, bits, mode)
    assert torch.equal(_bits(cpu_kernels.bfp_fake_quantize(x.contiguous(), axis % max(x.dim(), 1), block, bits,
                                                           mode)), _bits(ref))  # without the mask: same bits


def _wide_range(shape, seed):
    """Values over many binades, with zeros of both signs, +-Inf, NaN and subnormals sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-140, 120, shape, generator=gen).float() / 4)
    flat = x.view(-1)
    for start, step, v in ((0, 97, 0.0), (5, 101, -0.0), (7, 113, math.inf), (8, 109, -math.inf), (9, 127, math.nan),
                           (11, 131, 1e-41), (13, 89, -3e-39), (3, 61, 1e-45)):
        flat[start::step] = v
    return x


@pytest.mark.parametrize("shape,axis", [((96, 64, 1, 1), 1), ((16, 3, 3, 3), 1), ((24, 1, 5, 5), 1), ((4, 1280), 1),
                                        ((37,), 0), ((5, 13, 7), 1), ((6, 20), 0), ((3, 16, 5), -1),
                                        ((2, 40, 9, 11), 1)])
@pytest.mark.parametrize("bits,block,mode", [(16, 8, 2), (16, 8, 0), (16, 8, 1), (12, 4, 2), (10, 3, 0),
                                             (24, 16, 1), (32, 8, 2), (16, 1, 2), (13, 32, 0)])
def test_bfp_equals_reference_on_layouts_and_specials(shape, axis, bits, block, mode):
    """Whole and partial blocks, contiguous (inner 1) and strided block axes, one-element blocks (a depthwise
    weight's axis 1), every rounding mode; values from subnormals to 2^30, signed zeros, +-Inf, NaN."""
    _check_bfp(_wide_range(shape, seed=sum(shape) + bits + block + mode), axis, block, bits, mode)


def test_bfp_ties_and_saturation():
    """Exact ties of every rounding mode (x / step = k + 0.5 of both parities and signs) and the round-up past
    2^m - 1 steps that saturates (the mask's zeros)."""
    m = 7
    k = torch.arange(-127, 127, dtype=torch.float32)
    ties = torch.cat([(k + 0.5) / 64, torch.tensor([127.6, -127.6, 127.4, 0.3, -0.3, -0.5, 0.5]) / 64])
    x = torch.cat([ties, torch.zeros(-ties.numel() % 8)]).reshape(-1, 8)
    x[:, 0] = 1.99  # every block's shared exponent: 1.99 -> step 2^-6, so x / step is the ties above
    for mode in (0, 1, 2):
        _check_bfp(x, 1, 8, 9 + m, mode)
    keep = torch.empty_like(x)
    cpu_kernels.bfp_fake_quantize(x, 1, 8, 16, 2, keep=keep)
    assert (keep == 0).any() and (keep == 1).any()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=2, max_size=240),
       st.integers(1, 20), st.integers(10, 32), st.sampled_from([0, 1, 2]), st.integers(1, 4), st.booleans())
def test_bfp_equals_reference_property(values, block, bits, mode, rows, axis0):
    x = torch.tensor(values, dtype=torch.float32)
    if x.numel() % rows == 0 and rows > 1:
        x = x.reshape(rows, -1)
    _check_bfp(x, 0 if axis0 else x.dim() - 1, block, bits, mode)


def test_bfp_threads_split_gives_the_same_bits():
    x = _wide_range((640, 512), seed=5)
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            out.append(cpu_kernels.bfp_fake_quantize(x, 1, 8, 16, 2))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(out[0]), _bits(out[1]))
    _check_bfp(x, 1, 8, 16, 2)


def test_bfp_bad_input_is_refused():
    with pytest.raises(ValueError, match="contiguous float32 CPU tensor"):
        cpu_kernels.bfp_fake_quantize(torch.zeros(8, 8).t(), 1, 8, 16, 2)
    with pytest.raises(ValueError, match="at least two elements"):
        cpu_kernels.bfp_fake_quantize(torch.zeros(1), 0, 8, 16, 2)
    with pytest.raises(ValueError, match="axis 2 of a rank-2 tensor"):
        cpu_kernels.bfp_fake_quantize(torch.zeros(4, 4), 2, 8, 16, 2)


def test_bfp_quantizer_uses_it_in_evaluation_only(monkeypatch):
    """A BFP16 quantizer on a CPU gives the reference's bits through the kernel without gradient; with a gradient
    wanted, with backend="reference", or with the bfloat16 conversion, the torch path runs."""
    from qtorch_onnx.formats.bfp import bfp_reference
    from qtorch_onnx.formats.spec import BFPFormat

    x = _wide_range((4, 24, 10, 10), seed=6)
    x[~torch.isfinite(x)] = 1.0
    calls = []
    real = cpu_kernels.bfp_fake_quantize
    monkeypatch.setattr(cpu_kernels, "bfp_fake_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    fq = FakeQuantize(BFPFormat(), tensor_name="act", axis=1)
    fq.fake_quant_enabled = True
    ref = bfp_reference(x, axis=1, bit_width=16, block_size=8, rounding_mode=2)
    with torch.no_grad():
        y = fq(x)
    assert calls == [1] and torch.equal(_bits(y), _bits(ref))
    xr = x.clone().requires_grad_()
    yr = fq(xr)
    assert calls == [1] and torch.equal(_bits(yr.detach()), _bits(ref))
    fq.backend = "reference"
    with torch.no_grad():
        assert torch.equal(_bits(fq(x)), _bits(ref))
    converted = FakeQuantize(BFPFormat(convert_to_bfloat_before_bfp=1), tensor_name="act", axis=1)
    converted.fake_quant_enabled = True
    with torch.no_grad():
        converted(x)
    assert calls == [1]  # the bfloat16 conversion: the torch reference
    fq.backend = "auto"
    fq.axis = 4
    from qtorch_onnx.errors import ConfigError

    with pytest.raises(ConfigError, match="axis"), torch.no_grad():
        fq(x)  # an axis out of range is the reference's error, not a wrapped-around axis


# ---------------------------------------------------------------------------------------------- BFP-prime
def _check_prime(x, axis, block, bits, mode, sub, shift):
    from qtorch_onnx.formats.bfp import bfp_reference

    ref, ref_keep = bfp_reference(x, bfp_method="to_bfp_prime", axis=axis, bit_width=bits, block_size=block,
                                  rounding_mode=mode, sub_block_size=sub, sub_block_shift_bits=shift,
                                  return_mask=True)
    keep = torch.full_like(x, 7.0)
    ax = axis % max(x.dim(), 1)
    got = cpu_kernels.bfp_prime_fake_quantize(x.contiguous(), ax, block, bits, mode, sub, shift, keep=keep)
    assert torch.equal(_bits(got), _bits(ref)), (tuple(x.shape), axis, block, bits, mode, sub, shift)
    assert torch.equal(keep, ref_keep.to(torch.float32)), (tuple(x.shape), axis, block, bits, mode, sub, shift)
    assert torch.equal(_bits(cpu_kernels.bfp_prime_fake_quantize(x.contiguous(), ax, block, bits, mode, sub, shift)),
                       _bits(ref))


@pytest.mark.parametrize("shape,axis", [((64, 48, 1, 1), 1), ((16, 3, 3, 3), 1), ((24, 1, 5, 5), 1), ((4, 1280), 1),
                                        ((37,), 0), ((5, 13, 7), 1), ((3, 32, 5), -1), ((2, 40, 9, 11), 1)])
@pytest.mark.parametrize("bits,block,sub,shift,mode", [(11, 16, 2, 1, 2), (13, 16, 2, 1, 2), (16, 16, 2, 1, 2),
                                                       (16, 16, 2, 1, 0), (16, 16, 2, 1, 1), (12, 8, 4, 2, 0),
                                                       (10, 4, 1, 3, 1), (24, 32, 8, 8, 2), (32, 16, 2, 1, 2)])
def test_bfp_prime_equals_reference_on_layouts_and_specials(shape, axis, bits, block, sub, shift, mode):
    """MX4 / MX6 / MX9 and other BFP-prime widths, sub-blocks and shift widths, every rounding mode, partial blocks
    and strided block axes; values from subnormals (which flush) to 2^30, signed zeros, and blocks that +-Inf or NaN
    turn to NaN."""
    _check_prime(_wide_range(shape, seed=sum(shape) + bits + block + mode + shift), axis, block, bits, mode, sub,
                 shift)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=2, max_size=240),
       st.sampled_from([(16, 2), (8, 4), (4, 1), (6, 3), (32, 8)]), st.integers(10, 32), st.sampled_from([0, 1, 2]),
       st.integers(1, 8), st.integers(1, 4), st.booleans())
def test_bfp_prime_equals_reference_property(values, blocks, bits, mode, shift, rows, axis0):
    x = torch.tensor(values, dtype=torch.float32)
    if x.numel() % rows == 0 and rows > 1:
        x = x.reshape(rows, -1)
    _check_prime(x, 0 if axis0 else x.dim() - 1, blocks[0], bits, mode, blocks[1], shift)


def test_bfp_prime_quantizer_and_bad_input(monkeypatch):
    """An MX9 quantizer on a CPU takes the prime kernel in evaluation (the reference's bits); a block past
    PRIME_MAX_BLOCK is refused by the kernel, and such a quantizer keeps the torch reference."""
    from qtorch_onnx.formats.bfp import bfp_reference
    from qtorch_onnx.formats.spec import BFPFormat

    x = _wide_range((4, 32, 9, 9), seed=7)
    calls = []
    real = cpu_kernels.bfp_prime_fake_quantize
    monkeypatch.setattr(cpu_kernels, "bfp_prime_fake_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    fq = FakeQuantize(BFPFormat("to_bfp_prime", 16, 16), tensor_name="act", axis=1)
    fq.fake_quant_enabled = True
    with torch.no_grad():
        y = fq(x)
    assert calls == [1]
    assert torch.equal(_bits(y), _bits(bfp_reference(x, bfp_method="to_bfp_prime", axis=1, bit_width=16,
                                                     block_size=16, rounding_mode=2)))
    big = FakeQuantize(BFPFormat("to_bfp_prime", 16, 2 * cpu_kernels.PRIME_MAX_BLOCK), tensor_name="act", axis=0)
    big.fake_quant_enabled = True
    with torch.no_grad():
        big(torch.randn(3 * cpu_kernels.PRIME_MAX_BLOCK))
    assert calls == [1]
    with pytest.raises(ValueError, match="block_size"):
        real(torch.randn(4, 4096), 1, 2048, 16, 2, 2, 1)


# ---------------------------------------------------------------------------------------------- OCP MX
def _check_mx(x, axis, element, block, mode):
    from qtorch_onnx.formats.mx import mx_reference

    ref, ref_keep = mx_reference(x, element_dtype=element, axis=axis, block_size=block, rounding_mode=mode,
                                 return_mask=True)
    keep = torch.full_like(x, 7.0)
    ax = axis % max(x.dim(), 1)
    got = cpu_kernels.mx_fake_quantize(x.contiguous(), ax, element, block, mode, keep=keep)
    assert torch.equal(_bits(got), _bits(ref)), (tuple(x.shape), axis, element, block, mode)
    assert torch.equal(keep, ref_keep.to(torch.float32)), (tuple(x.shape), axis, element, block, mode)
    assert torch.equal(_bits(cpu_kernels.mx_fake_quantize(x.contiguous(), ax, element, block, mode)), _bits(ref))


MX_NAMES = ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1"]


@pytest.mark.parametrize("shape,axis", [((64, 48, 1, 1), 1), ((16, 3, 3, 3), 1), ((4, 1280), 1), ((37,), 0),
                                        ((5, 13, 7), 1), ((3, 32, 5), -1), ((2, 40, 9, 11), 1)])
@pytest.mark.parametrize("element", MX_NAMES)
@pytest.mark.parametrize("block,mode", [(32, 0), (32, 2), (16, 1), (8, 5), (3, 2)])
def test_mx_equals_reference_on_layouts_and_specials(shape, axis, element, block, mode):
    """Every MX element type, whole and partial blocks, contiguous and strided block axes, int8's rounding modes (5
    behaves as 0); values from subnormals to 2^30 with signed zeros, +-Inf and NaN (which pass through)."""
    _check_mx(_wide_range(shape, seed=sum(shape) + block + mode + MX_NAMES.index(element)), axis, element, block,
              mode)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=2, max_size=240),
       st.sampled_from(MX_NAMES), st.integers(1, 40), st.integers(0, 3), st.integers(1, 4), st.booleans())
def test_mx_equals_reference_property(values, element, block, mode, rows, axis0):
    x = torch.tensor(values, dtype=torch.float32)
    if x.numel() % rows == 0 and rows > 1:
        x = x.reshape(rows, -1)
    _check_mx(x, 0 if axis0 else x.dim() - 1, element, block, mode)


def test_mx_quantizer_uses_it_in_evaluation_only(monkeypatch):
    """An MXFP4 quantizer on a CPU takes the kernel without gradient (the reference's bits), the straight-through
    path with a gradient wanted; an unknown element type is refused by the kernel."""
    from qtorch_onnx.formats.mx import mx_reference
    from qtorch_onnx.formats.spec import MXFormat

    x = _wide_range((4, 64, 6, 6), seed=9)
    x[~torch.isfinite(x)] = 2.0
    calls = []
    real = cpu_kernels.mx_fake_quantize
    monkeypatch.setattr(cpu_kernels, "mx_fake_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    fq = FakeQuantize(MXFormat("fp4_e2m1", 32, 2), tensor_name="act", axis=1)
    fq.fake_quant_enabled = True
    ref = mx_reference(x, element_dtype="fp4_e2m1", axis=1, block_size=32, rounding_mode=2)
    with torch.no_grad():
        assert torch.equal(_bits(fq(x)), _bits(ref))
    assert calls == [1]
    xr = x.clone().requires_grad_()
    assert torch.equal(_bits(fq(xr).detach()), _bits(ref)) and calls == [1]
    with pytest.raises(ValueError, match="element_dtype"):
        real(x, 1, "fp3", 32, 2)


# ---------------------------------------------------------------------------------------------------------- BF16
def _check_bf16(x, scale):
    from qtorch_onnx.formats.floating import scaled_bf16

    s = torch.tensor(scale, dtype=torch.float32)
    ref = scaled_bf16(x, s, form="qdq")
    got = cpu_kernels.bf16_fake_quantize(x.contiguous(), float(s))
    assert got.shape == x.shape and torch.equal(_bits(got), _bits(ref)), scale


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0 ** -3, 7.5, 3e-39, 1e30])
def test_bf16_equals_scaled_bf16_on_ties_specials_and_bit_patterns(scale):
    """Every rounding case of the bit pattern: exact ties (even and odd bfloat16 lsb), the largest finite values
    rounding up to +-Inf, subnormals, signed zeros, NaN payloads of both signs, and 100k arbitrary bit patterns."""
    g = torch.Generator().manual_seed(11)
    hi = torch.randint(0, 1 << 16, (4096,), generator=g, dtype=torch.int32) << 16
    ties = (hi | 0x8000).view(torch.float32)           # exactly half-way: ties to even
    near = (hi | 0x7FFF).view(torch.float32)           # just below half-way
    nans = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, -0x007EDCBB, 0x7FFFFFFF], dtype=torch.int32)
    patterns = torch.randint(-2 ** 31, 2 ** 31 - 1, (100_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([torch.tensor(SPECIALS + [3.3895314e38, -3.3895314e38, 1e-40, -1e-40], dtype=torch.float32),
                   nans.view(torch.float32), ties, near, patterns.view(torch.float32)])
    _check_bf16(x, scale)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=300),
       st.floats(min_value=2.0 ** -40, max_value=2.0 ** 40, width=32))
def test_bf16_equals_scaled_bf16_property(values, scale):
    _check_bf16(torch.tensor(values, dtype=torch.float32), scale)


def _evaluation_takes_the_kernel(monkeypatch, kernel: str, fq, x, ref):
    """``fq(x)`` without gradient calls ``cpu_kernels.<kernel>`` and gives ``ref``'s bits on one thread and on
    three (the split); with a gradient wanted it keeps the torch path (same bits, no call). Returns the gradient of
    ``fq(x).sum()`` and the unpatched kernel."""
    calls = []
    real = getattr(cpu_kernels, kernel)
    monkeypatch.setattr(cpu_kernels, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            with torch.no_grad():
                assert torch.equal(_bits(fq(x)), _bits(ref))
    finally:
        torch.set_num_threads(before)
    assert calls == [1, 1]
    xr = x.clone().requires_grad_()
    y = fq(xr)
    assert torch.equal(_bits(y.detach()), _bits(ref)) and calls == [1, 1]
    y.sum().backward()
    return xr.grad, real


def test_bf16_quantizer_uses_it_in_evaluation_only(monkeypatch):
    """A BF16 Q/DQ quantizer on a CPU takes the kernel without gradient (scaled_bf16's bits), the straight-through
    path with a gradient wanted, and the threads split gives the same bits."""
    from qtorch_onnx.formats.floating import scaled_bf16
    from qtorch_onnx.formats.spec import BF16

    x = torch.randn(cpu_kernels.PARALLEL_MIN + 4099, generator=torch.Generator().manual_seed(12)) * 1e3
    fq = FakeQuantize(BF16, tensor_name="act")
    fq.fake_quant_enabled = True
    grad, real = _evaluation_takes_the_kernel(monkeypatch, "bf16_fake_quantize", fq, x,
                                              scaled_bf16(x, fq.scale, form="qdq"))
    assert bool((grad == 1).all())  # BF16 never saturates: the gradient passes everywhere
    with pytest.raises(ValueError, match="contiguous float32 CPU tensor"):
        real(torch.zeros(4, 4).t(), 1.0)


# ---------------------------------------------------------------------------------------------------------- FP16
@pytest.mark.skipif(not cpu_kernels.fp16_available(), reason="the compiler has no _Float16")
def test_fp16_round_equals_fp16_round_on_bit_patterns_and_its_mask():
    """Every non-NaN value gives fp16_round's bits (ties, the clip at +-65504 and the values that round past it,
    float16 subnormals and underflow, signed zeros, 1M arbitrary bit patterns); a NaN stays a NaN (its payload is
    not contractual); the mask is 1 where |x| <= 65504 or x is not finite."""
    from qtorch_onnx.formats.floating import FP16_MAX, fp16_round

    g = torch.Generator().manual_seed(13)
    patterns = torch.randint(-2 ** 31, 2 ** 31 - 1, (1_000_003,), generator=g, dtype=torch.int64).to(torch.int32)
    hi = torch.randint(0, 1 << 19, (4096,), generator=g, dtype=torch.int32) << 13
    ties = (hi | 0x1000).view(torch.float32)  # half-way between two float16 values (normal range)
    x = torch.cat([torch.tensor(SPECIALS + [65504.0, 65519.0, 65520.0, -65520.0, 6e-8, 3e-8, 2.98e-8, -5.96e-8]),
                   ties, torch.randn(10_000, generator=g) * 3e4, patterns.view(torch.float32)])
    keep = torch.empty_like(x)
    got = cpu_kernels.fp16_round(x, keep=keep)
    ref = fp16_round(x)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got[~nan]), _bits(ref[~nan]))
    assert torch.equal(keep.bool(), (x.abs() <= FP16_MAX) | ~torch.isfinite(x))
    with pytest.raises(ValueError, match="keep has shape"):
        cpu_kernels.fp16_round(x, keep=torch.empty(3))


@pytest.mark.skipif(not cpu_kernels.fp16_available(), reason="the compiler has no _Float16")
def test_fp16_quantizer_uses_it_in_evaluation_only(monkeypatch):
    """An FP16 Q/DQ quantizer on a CPU takes the kernel without gradient (fp16_round's values), the
    straight-through path with a gradient wanted; the threads split gives the same bits."""
    from qtorch_onnx.formats.floating import fp16_round
    from qtorch_onnx.formats.spec import FP16

    x = torch.randn(cpu_kernels.PARALLEL_MIN + 4099, generator=torch.Generator().manual_seed(14)) * 3e4
    fq = FakeQuantize(FP16, tensor_name="act")
    fq.fake_quant_enabled = True
    grad, _ = _evaluation_takes_the_kernel(monkeypatch, "fp16_round", fq, x, fp16_round(x))
    assert (grad == 0).any() and (grad == 1).any()  # clipped values get no gradient
