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
