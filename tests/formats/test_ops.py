"""Public functional API (qtorch_onnx.ops): operator defaults, errors, straight-through gradients (docs/numerics.md 8)."""
import pytest
import torch

from qtorch_onnx.errors import ConfigError
from qtorch_onnx.formats.bfp import bfp_reference
from qtorch_onnx.formats.mx import mx_reference
from qtorch_onnx import ops
from qtorch_onnx.ops import bfp_quantize_dequantize, mx_quantize_dequantize


def _bits(t):
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_defaults_mirror_the_onnx_operators():
    x = torch.randn(3, 40, 5) * 7
    assert torch.equal(_bits(bfp_quantize_dequantize(x)),
                       _bits(bfp_reference(x, bfp_method="to_bfp", axis=1, bit_width=16, block_size=8,
                                           rounding_mode=0, sub_block_size=2, sub_block_shift_bits=1,
                                           convert_to_bfloat_before_bfp=0)))
    assert torch.equal(_bits(mx_quantize_dequantize(x)),
                       _bits(mx_reference(x, element_dtype="int8", axis=1, block_size=32, rounding_mode=0)))
    # the default differs from e.g. rounding_mode=2 / axis=-1 on this data (the comparison can fail)
    assert not torch.equal(_bits(bfp_quantize_dequantize(x)), _bits(bfp_quantize_dequantize(x, axis=-1)))


def test_forward_with_grad_equals_forward_without():
    x = (torch.randn(4, 33) * 3).requires_grad_()
    for fn, kw in ((bfp_quantize_dequantize, dict(bfp_method="to_bfp_prime", bit_width=11, block_size=16,
                                                   rounding_mode=2)),
                   (mx_quantize_dequantize, dict(element_dtype="fp4_e2m1", axis=-1))):
        y = fn(x, **kw)
        assert y.requires_grad and y.grad_fn is not None
        with torch.no_grad():
            y0 = fn(x, **kw)
        assert torch.equal(_bits(y), _bits(y0))


def test_bfp_ste_gradient_is_one_except_clipped():
    # block max 1.9999999: 1.9999999/2^-6 rounds to 128 -> clamped to 127 (clipped, grad 0)
    x = torch.tensor([[1.9999999, 1.0, -0.3, float("nan"), 0.0, float("inf"), 1e-3, -1.5]], requires_grad=True)
    y = bfp_quantize_dequantize(x, bit_width=16, block_size=8, rounding_mode=2)
    g = torch.arange(1.0, 9.0).reshape(1, 8)
    y.backward(g)
    assert x.grad.tolist() == [[0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]]


def test_bfp_ste_mode0_negative_clip():
    # -1.99999 / 2^-6 = -127.999 rounds away to -128 -> clipped
    x = torch.tensor([-1.9999, 1.99, 0.5, 0.25], requires_grad=True)
    bfp_quantize_dequantize(x, bit_width=16, block_size=4, rounding_mode=0).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0]


def test_prime_ste_saturated_round_up_has_zero_grad():
    # MX9 (m = 7): 1.9999999 keeps q = 127 = 2^m - 1 and its round-up is suppressed -> saturated
    x = torch.tensor([1.9999999, 1.0, 0.75, -0.5], requires_grad=True)
    bfp_quantize_dequantize(x, bfp_method="to_bfp_prime", bit_width=16, block_size=4, rounding_mode=2).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0]


def test_mx_ste_gradients():
    x = torch.tensor([511.0, 449.0, -500.0, float("nan"), 3.0, 0.0, 1e-9, float("-inf")], requires_grad=True)
    y = mx_quantize_dequantize(x, element_dtype="fp8_e4m3", block_size=8)
    y.sum().backward()
    # 511 and -500 round beyond 448 (clipped); 449 rounds to 448 on the grid (not clipped)
    assert x.grad.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # int8, block max E = 127 so X = 1: 1.999*64 rounds to 128 > 127 (clipped); -1.999*64 -> -128 is allowed
    xi = torch.tensor([1.999, -1.999, 1.0, 0.5], requires_grad=True)
    mx_quantize_dequantize(xi, element_dtype="int8", block_size=4).sum().backward()
    assert xi.grad.tolist() == [0.0, 1.0, 1.0, 1.0]


def test_ste_matches_reference_mask_on_random_data():
    torch.manual_seed(0)
    x = (torch.randn(6, 50) * torch.logspace(-2, 2, 50)).requires_grad_()
    for fn, ref, kw in ((bfp_quantize_dequantize, bfp_reference, dict(bit_width=10, block_size=8, rounding_mode=0)),
                        (mx_quantize_dequantize, mx_reference, dict(element_dtype="fp8_e4m3", block_size=16))):
        x.grad = None
        fn(x, **kw).backward(torch.ones_like(x))
        _, mask = ref(x.detach(), return_mask=True, **kw)
        assert torch.equal(x.grad, mask.float())
        assert 0 < int((~mask).sum()) < mask.numel()  # some elements clipped, most not


def test_float16_gradients_and_dtype():
    x = (torch.randn(2, 32) * 10).half().requires_grad_()
    y = mx_quantize_dequantize(x, element_dtype="fp6_e3m2", axis=-1)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float16 and set(x.grad.unique().tolist()) <= {0.0, 1.0}


def test_gradcheck_style_ste_is_identity_on_representable_values():
    # values already on the BFP grid are fixed points: forward is identity and gradient is 1
    x = (torch.randint(-127, 128, (4, 8)).float() * 2.0 ** -6).requires_grad_()
    x.data[:, 0] = 127 * 2.0 ** -6  # every block has E = 126 at its max
    y = bfp_quantize_dequantize(x, bit_width=16, block_size=8, rounding_mode=2)
    assert torch.equal(y.detach(), x.detach())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("fn, kwargs, attribute", [
    (bfp_quantize_dequantize, dict(bfp_method="to_bfq"), "bfp_method"),
    (bfp_quantize_dequantize, dict(rounding_mode=4), "rounding_mode"),
    (bfp_quantize_dequantize, dict(bit_width=8), "bit_width"),
    (bfp_quantize_dequantize, dict(bfp_method="to_bfp_prime", block_size=16, sub_block_size=5), "sub_block_size"),
    (bfp_quantize_dequantize, dict(axis=3), "axis"),
    (mx_quantize_dequantize, dict(element_dtype="fp8_e4m4"), "element_dtype"),
    (mx_quantize_dequantize, dict(block_size=0), "block_size"),
    (mx_quantize_dequantize, dict(axis=-4), "axis"),
])
def test_errors_at_call_time(fn, kwargs, attribute):
    with pytest.raises(ConfigError, match=attribute):
        fn(torch.zeros(2, 3, 4, requires_grad=True), **kwargs)


def test_references_are_detached_and_ops_are_not():
    x = torch.randn(2, 16, requires_grad=True)
    assert not bfp_reference(x).requires_grad and not mx_reference(x).requires_grad
    assert bfp_quantize_dequantize(x).requires_grad and mx_quantize_dequantize(x).requires_grad
    assert x.grad is None


def test_backend_argument_is_validated(monkeypatch):
    from qtorch_onnx.errors import ConfigError, UnsupportedFeatureError

    x = torch.randn(2, 16)
    with pytest.raises(ConfigError, match="backend 'cuda'.*valid"):
        ops.bfp_quantize_dequantize(x, backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnsupportedFeatureError, match="CUDA tensor"):
        ops.mx_quantize_dequantize(x, backend="triton")
    # "auto" on a CPU tensor is the reference, bit for bit
    assert torch.equal(ops.mx_quantize_dequantize(x, backend="auto").view(torch.int32),
                       ops.mx_quantize_dequantize(x, backend="reference").view(torch.int32))
