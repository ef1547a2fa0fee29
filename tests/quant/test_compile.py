"""torch.compile of a prepared model, forward and backward (issue 11 item 6).

aot_eager keeps eager's kernels, so outputs and gradients must be bit-identical; inductor (CPU, C++ codegen)
may fuse and reorder the float ops around the quantizers, so the model output is compared with a tight
tolerance and the gradients for finiteness and closeness.
"""
from __future__ import annotations

import pytest
import torch

import qtorch_onnx as qo

from .small_models import calib_data, cnn


def _model(config, learn=False):
    qm = qo.prepare(cnn(), config)
    qo.calibrate(qm, calib_data(4), progress=False)
    if learn:
        qo.learn_scales(qm)
    return qm


def _step(m, x):
    y = m(x)
    y.square().sum().backward()
    return y.detach()


@pytest.mark.parametrize("config,learn", [("A8W8", True), ("BF16", False), ("MX9", False)])
def test_aot_eager_forward_backward_bit_exact(config, learn):
    torch._dynamo.reset()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    qm = _model(config, learn)
    y_eager = _step(qm, x)
    g_eager = {n: p.grad.clone() for n, p in qm.named_parameters() if p.grad is not None}
    qm.zero_grad(set_to_none=True)
    y_comp = _step(torch.compile(qm, backend="aot_eager"), x)
    g_comp = {n: p.grad for n, p in qm.named_parameters() if p.grad is not None}
    assert torch.equal(y_eager.view(torch.int32), y_comp.view(torch.int32))
    assert set(g_eager) == set(g_comp)
    for n in g_eager:
        assert torch.equal(g_eager[n], g_comp[n]), n


@pytest.mark.slow
def test_inductor_cpu_forward_backward_with_learnable_scales():
    torch._dynamo.reset()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    qm = _model("A8W8", learn=True)
    y_eager = _step(qm, x)
    g_eager = {n: p.grad.clone() for n, p in qm.named_parameters() if p.grad is not None}
    qm.zero_grad(set_to_none=True)
    y_comp = _step(torch.compile(qm), x)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-6)
    for n, p in qm.named_parameters():
        if n in g_eager:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
    # the quantizers themselves: compiled alone, the same bits as eager
    fq = qm.quantizers()["c2"]
    v = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(2)) * 3
    assert torch.equal(torch.compile(fq)(v).view(torch.int32), fq(v).view(torch.int32))
