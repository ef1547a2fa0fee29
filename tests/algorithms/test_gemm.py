"""gemm.matmul_nt: oneDNN's product where it helps, torch.matmul elsewhere, the same values to float rounding."""
import pytest
import torch

from qtorch_onnx.algorithms import gemm


@pytest.mark.parametrize("m,n,k,view", [
    (256, 256, 256, False),   # 16.8M MACs: oneDNN when available
    (96, 49, 256, True),      # b a transposed view (the direct loss's [C, P] plane as [P, C])
    (1280, 4, 512, False),    # few rows of b
    (8, 8, 8, False),         # below ONEDNN_MIN_MACS: torch.matmul
])
def test_matmul_nt_is_the_product(m, n, k, view):
    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen).t() if view else torch.randn(n, k, generator=gen)
    a0, b0 = a.clone(), b.clone()
    want = (a.double() @ b.double().t()).float()
    got = gemm.matmul_nt(a, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    out = torch.full((m, n), float("nan"))
    assert gemm.matmul_nt(a, b, out=out) is out
    assert torch.equal(out, got)  # the same backend, the same bits
    assert torch.equal(gemm.matmul_nt(a, b), got)  # deterministic
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs untouched


def test_matmul_nt_switch_and_probe(monkeypatch):
    """QTORCH_ONNX_GEMM=torch keeps every product on torch.matmul (bit for bit); a probe that fails does too."""
    a, b = torch.randn(300, 200), torch.randn(250, 200)
    monkeypatch.setenv(gemm.ENV_SWITCH, "torch")
    monkeypatch.setattr(gemm, "_state", {})
    assert not gemm.onednn_available()
    assert torch.equal(gemm.matmul_nt(a, b), torch.matmul(a, b.t()))
    monkeypatch.delenv(gemm.ENV_SWITCH)
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not gemm.onednn_available()
    assert torch.equal(gemm.matmul_nt(a, b), torch.matmul(a, b.t()))


def test_matmul_nt_uses_onednn_where_it_can():
    """On a torch with oneDNN (the x86-64 and aarch64 wheels) the probe passes, and a large product is oneDNN's
    where the policy picks it (every CPU for a long inner dimension; on AVX-512 CPUs for a square one), else
    torch.matmul's, bit for bit."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    assert gemm.onednn_available()
    op = torch.ops.mkldnn._linear_pointwise
    for m, n, k in [(256, 256, 256), (96, 16, 12544)]:
        a, b = torch.randn(m, k), torch.randn(n, k)
        want = op(a, b, None, "none", [], "") if gemm.uses_onednn(m, n, k) else torch.matmul(a, b.t())
        assert torch.equal(gemm.matmul_nt(a, b), want)
    assert gemm.uses_onednn(96, 16, 12544)  # K >= LONG_K_RATIO max(M, N): oneDNN on any CPU
    assert not gemm.uses_onednn(8, 8, 8)  # below ONEDNN_MIN_MACS


@pytest.mark.parametrize("capability,policy,square,long_k", [
    ("AVX2", "auto", False, True),     # no AVX-512: MKL's product, oneDNN's for a long inner dimension
    ("AVX512", "auto", True, True),    # AVX-512: oneDNN's (MKL runs AVX2 on AMD CPUs)
    ("AVX2", "onednn", True, True),    # QTORCH_ONNX_GEMM=onednn: oneDNN whatever the CPU
    ("AVX512", "torch", False, False),  # QTORCH_ONNX_GEMM=torch: never
])
def test_uses_onednn_policy(monkeypatch, capability, policy, square, long_k):
    """The backend follows the CPU's capability and QTORCH_ONNX_GEMM, read once per process."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv(gemm.ENV_SWITCH, policy)
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert gemm.uses_onednn(256, 256, 256) is square
    assert gemm.uses_onednn(96, 16, 96 * gemm.LONG_K_RATIO) is long_k
    assert gemm.uses_onednn(96, 16, 96 * gemm.LONG_K_RATIO - 1) is (square and long_k)
    monkeypatch.setenv(gemm.ENV_SWITCH, "auto" if policy != "auto" else "torch")  # read once: no change
    assert gemm.uses_onednn(256, 256, 256) is square


def test_matmul_nt_bad_shapes():
    with pytest.raises(ValueError, match=r"\(3, 4\) and \(5, 6\)"):
        gemm.matmul_nt(torch.zeros(3, 4), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="a \\[M, K\\] and b \\[N, K\\]"):
        gemm.matmul_nt(torch.zeros(2, 3, 4), torch.zeros(5, 4))
