"""Triton BFP / BFP-prime / MX kernels against the torch references, bit for bit (value and STE mask).

Runs on CUDA when available, otherwise on CPU under ``TRITON_INTERPRET=1`` (set before the kernels are
imported) with small shapes. Golden vectors are replayed through the kernels too.
"""
import json
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)
    try:  # triton may have been imported (by torch) before the variable was set; its knob can be cached
        triton.knobs.runtime.interpret = True
    except AttributeError:  # older triton reads the environment variable at decoration time
        pass

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qtorch_onnx.formats.bfp import bfp_reference  # noqa: E402
from qtorch_onnx.formats.mx import MX_ELEMENTS, mx_reference  # noqa: E402

try:
    from qtorch_onnx.triton_kernels.bfp import bfp_quantize_dequantize_triton, ste_backward_triton
    from qtorch_onnx.triton_kernels.mx import mx_quantize_dequantize_triton
except ImportError:  # not installed: import from the repository root
    from triton_kernels.bfp import bfp_quantize_dequantize_triton, ste_backward_triton
    from triton_kernels.mx import mx_quantize_dequantize_triton

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter casts of masked NaN lanes
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "golden")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4028235e38, -3.4028235e38, float("inf"), float("-inf"),
            float("nan"), np.uint32(0x7F800001).view(np.float32).item(), np.uint32(0xFFFFFFFF).view(np.float32).item()]


def _same(a: torch.Tensor, b: torch.Tensor):
    assert a.shape == b.shape and a.dtype == b.dtype
    iv = torch.int32 if a.dtype == torch.float32 else torch.int16
    if a.dtype == torch.bool:
        assert torch.equal(a.cpu(), b.cpu())
        return
    av, bv = a.cpu().contiguous().view(iv), b.cpu().contiguous().view(iv)
    if a.dtype in (torch.float16, torch.bfloat16):  # half NaN payloads are not in the contract (numerics.md 9)
        nan = torch.isnan(a.cpu())
        assert torch.equal(nan, torch.isnan(b.cpu()))
        av, bv = av[~nan], bv[~nan]
    bad = (av != bv).nonzero()
    assert bad.numel() == 0, f"{len(bad)} differ, first at {bad[0].tolist()}: {av[tuple(bad[0])]:#x} vs {bv[tuple(bad[0])]:#x}"


@st.composite
def tensors(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank)))
    n = int(np.prod(shape))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    mant = rng.integers(-600, 601, n).astype(np.float64)
    e = draw(st.integers(-150, 110)) - rng.integers(0, 14, n)
    x = (mant * np.exp2(e)).astype(np.float32)
    raw = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    pick = rng.random(n) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    x = np.where(pick, raw, x)
    for _ in range(draw(st.integers(0, 2))):
        x[rng.integers(0, n)] = draw(st.sampled_from(SPECIALS))
    return torch.from_numpy(x.reshape(shape).astype(np.float32))


@SETTINGS
@given(x=tensors(), bw=st.sampled_from([10, 11, 13, 16, 23, 32]), bs=st.sampled_from([2, 3, 8, 16, 32]),
       mode=st.sampled_from([0, 1, 2]), axis=st.integers(-4, 3), bf16=st.sampled_from([0, 1]),
       rows=st.sampled_from([None, 1, 4]))
def test_bfp_kernel_matches_reference(x, bw, bs, mode, axis, bf16, rows):
    axis = axis % x.dim() if x.dim() > 1 else axis
    kw = dict(bfp_method="to_bfp", axis=axis, bit_width=bw, block_size=bs, rounding_mode=mode,
              convert_to_bfloat_before_bfp=bf16)
    y, m = bfp_quantize_dequantize_triton(x.to(DEVICE), return_mask=True, rows_per_program=rows, **kw)
    yr, mr = bfp_reference(x, return_mask=True, **kw)
    _same(y, yr)
    _same(m, mr)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), bw=st.sampled_from([10, 11, 13, 16, 24]),
       cfg=st.sampled_from([(16, 2, 1), (16, 4, 2), (8, 8, 3), (6, 3, 2), (4, 1, 8), (32, 4, 4)]),
       mode=st.sampled_from([0, 1, 2]), axis=st.integers(-4, 3), rows=st.sampled_from([None, 2]))
def test_bfp_prime_kernel_matches_reference(x, bw, cfg, mode, axis, rows):
    axis = axis % x.dim() if x.dim() > 1 else axis
    bs, sub, d = cfg
    kw = dict(bfp_method="to_bfp_prime", axis=axis, bit_width=bw, block_size=bs, rounding_mode=mode,
              sub_block_size=sub, sub_block_shift_bits=d)
    y, m = bfp_quantize_dequantize_triton(x.to(DEVICE), return_mask=True, rows_per_program=rows, **kw)
    yr, mr = bfp_reference(x, return_mask=True, **kw)
    _same(y, yr)
    _same(m, mr)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), el=st.sampled_from(list(MX_ELEMENTS)), bs=st.sampled_from([2, 5, 16, 32]),
       mode=st.sampled_from([0, 1, 2, 7]), axis=st.integers(-4, 3), rows=st.sampled_from([None, 1, 8]))
def test_mx_kernel_matches_reference(x, el, bs, mode, axis, rows):
    axis = axis % x.dim() if x.dim() > 1 else axis
    kw = dict(element_dtype=el, axis=axis, block_size=bs, rounding_mode=mode)
    y, m = mx_quantize_dequantize_triton(x.to(DEVICE), return_mask=True, rows_per_program=rows, **kw)
    yr, mr = mx_reference(x, return_mask=True, **kw)
    _same(y, yr)
    _same(m, mr)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_read_natively(dtype):
    """float16/bfloat16 are widened in the kernel and the result rounded back: same bits as the reference."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 40, generator=g) * torch.logspace(-6, 4, 40)).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    if dtype == torch.float16:  # NaN payloads: 0x7FFF widens to 0x7FFFE000, which bfloat16 pre-rounding makes -0.0
        x[0, 3:6] = torch.tensor([0x7FFF, 0x7D00, 0xFC01 - 0x10000], dtype=torch.int16).view(torch.float16)
    for kw in (dict(bfp_method="to_bfp_prime", bit_width=13, block_size=16, rounding_mode=2),
               dict(bit_width=12, block_size=8, rounding_mode=0),
               dict(bit_width=16, block_size=8, rounding_mode=1, convert_to_bfloat_before_bfp=1)):
        y, m = bfp_quantize_dequantize_triton(x.to(DEVICE), axis=1, return_mask=True, **kw)
        yr, mr = bfp_reference(x, axis=1, return_mask=True, **kw)
        assert y.dtype == dtype
        _same(y, yr)
        _same(m, mr)
    for el in ("fp8_e5m2", "int8", "fp4_e2m1"):
        y, m = mx_quantize_dequantize_triton(x.to(DEVICE), element_dtype=el, axis=-1, block_size=16, return_mask=True)
        yr, mr = mx_reference(x, element_dtype=el, axis=-1, block_size=16, return_mask=True)
        _same(y, yr)
        _same(m, mr)


def test_one_element():
    one = torch.tensor([[1.0039062]])
    _same(bfp_quantize_dequantize_triton(one.to(DEVICE), convert_to_bfloat_before_bfp=1),
          bfp_reference(one, convert_to_bfloat_before_bfp=1))


def test_ste_backward_kernel():
    torch.manual_seed(1)
    x = torch.randn(5, 40) * 4
    g = torch.randn(5, 40)
    g[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    _, m = bfp_quantize_dequantize_triton(x.to(DEVICE), bit_width=10, block_size=8, return_mask=True)
    assert 0 < int((~m).sum()) < m.numel()
    # the contract is grad_y * mask on the same device: a CUDA product of a NaN is the canonical 0x7FFFFFFF,
    # a CPU one keeps the payload
    _same(ste_backward_triton(g.to(DEVICE), m), g.to(DEVICE) * m.float())


def test_ops_backend_triton_matches_reference_with_gradient():
    """The public ops with backend="triton" give the reference's values and straight-through gradients."""
    from qtorch_onnx import ops

    torch.manual_seed(2)
    x = torch.randn(6, 48) * 3
    g = torch.randn(6, 48)
    for fn, kw in ((ops.bfp_quantize_dequantize, dict(bit_width=10, block_size=8, rounding_mode=2)),
                   (ops.bfp_quantize_dequantize, dict(bfp_method="to_bfp_prime", bit_width=11, block_size=16)),
                   (ops.mx_quantize_dequantize, dict(element_dtype="fp4_e2m1", block_size=16))):
        outs = []
        for backend, dev in (("triton", DEVICE), ("reference", "cpu")):
            xr = x.clone().to(dev).requires_grad_(True)
            y = fn(xr, axis=1, backend=backend, **kw)
            y.backward(g.to(dev))
            outs.append((y.detach().cpu(), xr.grad.cpu()))
        _same(outs[0][0], outs[1][0])
        _same(outs[0][1], outs[1][1])
        assert (outs[1][1] == 0).any() or fn is ops.bfp_quantize_dequantize


_CASES = []
with open(os.path.join(GOLDEN, "cases.json")) as fh:
    for c in json.load(fh)["cases"]:
        if c["file"] in ("bfp.npz", "bfp_prime.npz", "mx.npz") and c["inputs"][0]["dtype"] == "float32":
            _CASES.append(c)
# every attribute combination of the golden set on a few value kinds, plus every tie / max_norm / bf16 case
# (interpreter time; the references themselves pass all cases in tests/formats/test_block_golden.py)
_KINDS = {"rand4d_axm1", "nan", "zero_subnormal"}
if not torch.cuda.is_available():  # on a GPU every golden case runs
    _CASES = [c for c in _CASES if c["value_kind"] in _KINDS or c["value_kind"].startswith(("ties", "elem_", "bf16pre"))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large tensors only on a GPU (interpreter too slow)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_random_tensors_on_gpu(dtype):
    """64M-element tensors with every exponent, block axis first/middle/last: kernels == reference."""
    g = torch.Generator(device="cuda").manual_seed(5)
    bits = torch.randint(-2**31, 2**31 - 1, (64, 1024, 1024), generator=g, device="cuda", dtype=torch.int32)
    x = bits.view(torch.float32)
    x = x.to(dtype) if dtype != torch.float32 else x
    for axis in (0, 1, 2):
        for kw in (dict(bit_width=16, block_size=8, rounding_mode=2),
                   dict(bfp_method="to_bfp_prime", bit_width=13, block_size=16, rounding_mode=2)):
            _same(bfp_quantize_dequantize_triton(x, axis=axis, **kw), bfp_reference(x, axis=axis, **kw))
        for el in MX_ELEMENTS:
            _same(mx_quantize_dequantize_triton(x, element_dtype=el, axis=axis),
                  mx_reference(x, element_dtype=el, axis=axis))


@pytest.mark.parametrize("case", _CASES, ids=[c["id"] for c in _CASES])
def test_golden_through_kernels(case):
    arrays = np.load(os.path.join(GOLDEN, case["file"]))
    x = torch.from_numpy(arrays[case["inputs"][0]["key"]].copy()).to(DEVICE)
    want = arrays[case["outputs"][0]["key"]]
    attrs = {k: v for k, v in case["attributes"].items() if k != "use_compiler_version_cpu_kernel"}
    if case["op_type"] == "BFPQuantizeDequantize":
        y = bfp_quantize_dequantize_triton(x, **attrs)
    else:
        y = mx_quantize_dequantize_triton(x, **attrs)
    assert np.array_equal(y.cpu().numpy().view(np.uint32), want.view(np.uint32)), case["id"]
