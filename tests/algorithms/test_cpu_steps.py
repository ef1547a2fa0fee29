"""Fast finetune's fused CPU loops (qtorch_onnx/algorithms/cpu_steps.c) against the torch steps they copy:
AdaQuant's weight bit for bit (NaN, infinities, signed zeros, saturation), AdaRound's values and gradient to
float32 rounding, the row split between threads, the build cache and the switch that turns them off."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from qtorch_onnx.algorithms import cpu_steps
from qtorch_onnx.algorithms.adaround import GAMMA, ZETA

pytestmark = pytest.mark.skipif(not cpu_steps.available(), reason="no C compiler: the fused CPU steps are not built")


def _torch_adaquant(w, scale, zp, lo, hi):
    """AdaQuantStep's torch arithmetic (the quantizer's fused path)."""
    v = torch.round(w / scale) + zp
    c = v.clamp(lo, hi)
    outside = (v - c).abs().sign()
    return (torch.nan_to_num(c, nan=lo) - zp) * scale, outside


@pytest.mark.parametrize("per_channel,asymmetric", [(False, False), (True, False), (True, True)])
def test_adaquant_values_bit_exact(per_channel, asymmetric):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 5, 3, 3, generator=gen) * 0.3
    flat = w.view(-1)
    flat[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e30, -1e30, 4.5e-3])
    if per_channel:
        scale = (w.nan_to_num(0, 0, 0).abs().amax(dim=(1, 2, 3)) / 127 + 1e-4).reshape(-1, 1, 1, 1)
        scale[3] = 2.0 ** -12  # a power of two: w / scale exact, ties to even on the grid
    else:
        scale = torch.tensor(0.0123)
    zp = torch.randint(0, 40, scale.shape, generator=gen).float() if asymmetric else torch.zeros(scale.shape)
    lo, hi = (0.0, 255.0) if asymmetric else (-128.0, 127.0)
    ref, ref_out = _torch_adaquant(w, scale, zp, lo, hi)
    layout = cpu_steps.RowLayout.of(w, scale, zp if asymmetric else None, 0 if per_channel else None)
    got, out = cpu_steps.adaquant_values(layout, w, lo, hi)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # -0.0 vs +0.0 included
    assert torch.equal(out, ref_out) and float(out.view(-1)[0]) == 0.0 and float(out.view(-1)[1]) == 1.0
    assert float(got.view(-1)[0]) == (lo - float(zp.reshape(-1)[0])) * float(scale.reshape(-1)[0])


def _torch_adaround(alpha, floor, scale, zp, lo, hi, gwq, beta, reg):
    s = torch.sigmoid(alpha.double())
    hr = s * (ZETA - GAMMA) + GAMMA
    h = hr.clamp(0, 1)
    c = floor.double() + h + zp.double()
    wq = (c.clamp(lo, hi) - zp.double()) * scale.double()
    g = gwq.double() * scale.double() * (ZETA - GAMMA) * ((c >= lo) & (c <= hi))
    if beta is not None:
        d = 2 * h - 1
        g = g - 2 * beta * reg * (ZETA - GAMMA) * d.abs().pow(beta - 1) * d.sign()
    return wq, g * s * (1 - s) * ((hr >= 0) & (hr <= 1))


@pytest.mark.parametrize("beta", [None, 2.0, 7.37, 19.0])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_adaround_values_and_gradient_match_float64(beta, axis):
    """Against float64 arithmetic: the weight to a few float32 roundings of floor + h, the gradient to 2e-5 of
    its largest element (the regulariser's power by our exp2 / log2 polynomials)."""
    gen = torch.Generator().manual_seed(1)
    shape = (6, 20, 3, 3)
    alpha = torch.randn(shape, generator=gen) * 4
    floor = torch.floor(torch.randn(shape, generator=gen) * 60)
    if axis is None:
        scale, zp, lo, hi = torch.tensor(0.02), torch.tensor(0.0), -128.0, 127.0
    else:
        n = shape[axis]
        bshape = [1] * 4
        bshape[axis] = n
        scale = (torch.rand(n, generator=gen) * 0.05 + 1e-3).reshape(bshape)
        zp, lo, hi = torch.randint(100, 140, (n,), generator=gen).float().reshape(bshape), 0.0, 255.0
    gwq = torch.randn(shape, generator=gen)
    layout = cpu_steps.RowLayout.of(alpha, scale, zp if axis is not None else None, axis)
    wq = cpu_steps.adaround_values(layout, alpha, floor, lo, hi)
    g = cpu_steps.adaround_grad(layout, alpha, floor, lo, hi, gwq, beta, 0.01)
    ref_wq, ref_g = _torch_adaround(alpha, floor, scale, zp, lo, hi, gwq, beta, 0.01)
    assert ((ref_wq >= lo * scale) | (ref_wq <= hi * scale)).all()
    bound = scale.double() * (2e-6 + 2.5e-7 * ((floor.abs() + zp.abs()).double() + 1))  # h, then roundings
    assert bool(((wq.double() - ref_wq).abs() <= bound).all())
    torch.testing.assert_close(g.double(), ref_g, rtol=1e-4, atol=2e-5 * float(ref_g.abs().max()))
    assert (g == 0).any() and (g != 0).any()  # clamped integers and saturated rectifiers have gradient 0


def test_rows_split_between_threads_give_the_same_bits():
    gen = torch.Generator().manual_seed(2)
    n_out = 2 * cpu_steps.PARALLEL_MIN // 64 + 3
    w = torch.randn(n_out, 64, generator=gen)
    scale = (w.abs().amax(dim=1) / 127).reshape(-1, 1)
    alpha, floor, gwq = torch.randn(w.shape, generator=gen), torch.floor(w / scale), torch.randn(w.shape, generator=gen)
    layout = cpu_steps.RowLayout.of(w, scale, None, 0)
    xp = torch.randn(2, 7, 102, 102, generator=gen)  # depthwise 3x3 planes, past PARALLEL_MIN elements
    r = torch.randn(2, 7, 1, 100 * 100, generator=gen)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            h, g, s = torch.empty(2, 7, 9, 9), torch.empty(2, 7, 1, 9), torch.empty(2, 7, 9)
            cpu_steps.depthwise_gram(xp, (3, 3), (1, 1), (100, 100), r, h, g, s)
            results.append((cpu_steps.adaquant_values(layout, w, -128, 127),
                            cpu_steps.adaround_values(layout, alpha, floor, -128, 127),
                            cpu_steps.adaround_grad(layout, alpha, floor, -128, 127, gwq, 5.5, 0.01), (h, g, s)))
    finally:
        torch.set_num_threads(before)
    (a1, b1, c1, d1), (a3, b3, c3, d3) = results
    assert torch.equal(a1[0], a3[0]) and torch.equal(a1[1], a3[1]) and torch.equal(b1, b3) and torch.equal(c1, c3)
    assert all(torch.equal(x, y) for x, y in zip(d1, d3))


def test_layout_refuses_what_the_loops_do_not_cover():
    w = torch.randn(8, 4)
    s = torch.rand(8, 1)
    assert cpu_steps.RowLayout.of(w.t().contiguous().t(), s, None, 0) is None  # strided (a MatMul's transpose)
    assert cpu_steps.RowLayout.of(w.double(), s, None, 0) is None
    assert cpu_steps.RowLayout.of(w, torch.rand(3, 1), None, 0) is None      # scale does not match the axis
    assert cpu_steps.RowLayout.of(w, s, None, None) is None                   # per channel without an axis
    lay = cpu_steps.RowLayout.of(w, torch.rand(4), torch.zeros(()), 1)      # per channel on the last axis
    assert (lay.rows, lay.channels, lay.inner) == (32, 4, 1) and lay.zero_point.shape == (4,)


def test_switch_off_and_cached_build(tmp_path):
    """QTORCH_ONNX_CPU_STEPS=0 leaves the steps in torch; a second process finds the cached library."""
    code = ("import os, torch; from qtorch_onnx.algorithms import cpu_steps as c; "
            "print(c.available(), c.RowLayout.of(torch.ones(4, 4), torch.ones(()), None, None) is not None)")
    env_off = {"QTORCH_ONNX_CPU_STEPS": "0", "QTORCH_ONNX_CACHE": str(tmp_path), "PATH": os.environ.get("PATH", ""),
               **({"CC": os.environ["CC"]} if os.environ.get("CC") else {})}
    out = subprocess.run([sys.executable, "-c", code], env=env_off, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    env_on = dict(env_off, QTORCH_ONNX_CPU_STEPS="1")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env_on, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["True", "True"], out.stderr
    assert len(list((tmp_path / "cpu_steps").glob("*/libqtorch_cpu_steps.so"))) == 1
    env_bad = dict(env_on, CC="/nonexistent/cc", QTORCH_ONNX_CACHE=str(tmp_path / "other"), PATH="")
    out = subprocess.run([sys.executable, "-c", code], env=env_bad, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"] and "fused CPU steps are unavailable" in out.stderr


@pytest.mark.parametrize("channels,size,kernel,stride,padding,multiplier", [
    (6, 14, 5, 1, 2, 1), (4, 21, 3, 2, 1, 2), (5, 20, 3, 1, 0, 1), (3, 33, (3, 5), (2, 3), (1, 2), 1),
    (2, 16, (1, 3), 1, (0, 1), 3),
    (20, 12, 3, 1, 1, 1), (37, 15, 5, 2, 2, 1), (16, 9, (5, 3), (1, 2), (2, 0), 1),  # blocks of 16 channels, a tail
])
def test_depthwise_gram_equals_im2col(channels, size, kernel, stride, padding, multiplier):
    """The sliding-sum Gram matrices of a depthwise convolution equal im2col's ``X X^T``, ``R X^T``, ``X 1`` (float64
    references) to float32 rounding, strides, rectangular kernels and several outputs per channel included."""
    from qtorch_onnx.algorithms.reconstruction import _columns

    gen = torch.Generator().manual_seed(4)
    conv = torch.nn.Conv2d(channels, channels * multiplier, kernel, stride=stride, padding=padding, groups=channels)
    x = torch.randn(3, channels, size, size + 3, generator=gen)
    with torch.no_grad():
        y = conv(x)
    ho, wo = y.shape[-2:]
    r = torch.randn(y.shape, generator=gen)
    cols = _columns(conv, x).double()  # [n, C, k, L]
    ref_h = cols @ cols.transpose(-1, -2)
    ref_g = r.double().reshape(3, channels, multiplier, -1) @ cols.transpose(-1, -2)
    ref_s = cols.sum(-1)
    k = cols.shape[2]
    ph, pw = conv.padding
    xp = torch.nn.functional.pad(x, (pw, pw, ph, ph)).contiguous()
    h, g, s = torch.empty(3, channels, k, k), torch.empty(3, channels, multiplier, k), torch.empty(3, channels, k)
    cpu_steps.depthwise_gram(xp, conv.kernel_size, conv.stride, (ho, wo),
                             r.reshape(3, channels, multiplier, -1).contiguous(), h, g, s)
    for got, ref in ((h, ref_h), (g, ref_g), (s, ref_s)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
    assert torch.equal(h, h.transpose(-1, -2))
    if multiplier == 1:  # the 16-channel blocks (float32 runs, float64 sums) against the plane-major sliding sums
        (kh, kw), (sh, sw) = conv.kernel_size, conv.stride
        hp, wp = xp.shape[-2:]
        h1, g1, s1 = torch.empty_like(h), torch.empty_like(g), torch.empty_like(s)
        table = torch.empty(sh * (wp + 1) + wp + sw, dtype=torch.float64)
        spread = torch.empty(hp * wp)
        cpu_steps.library().qt_depthwise_gram(0, 3 * channels, hp, wp, kh, kw, sh, sw, ho, wo, 1, xp.data_ptr(),
                                              r.contiguous().data_ptr(), h1.data_ptr(), g1.data_ptr(),
                                              s1.data_ptr(), table.data_ptr(), spread.data_ptr())
        assert torch.equal(s, s1)  # the same sliding sums
        torch.testing.assert_close(h, h1, rtol=1e-6, atol=1e-6 * float(h1.abs().max()))
        torch.testing.assert_close(g, g1, rtol=1e-6, atol=1e-6 * float(g1.abs().max()))


def test_depthwise_gram_long_sums_stay_float64_accurate():
    """The blocked Gram matrices sum their float32 products in float32 over runs of about GRAM_RUN positions only,
    then in float64: on a 112 x 112 plane of positive values (12,544 products per entry, all of one sign, where a
    float32 sum of them all drifts by 7e-7, torch's float32 product by 1.4e-6) every entry of H and G is within
    1.5e-7 of the float64 im2col reference (float32's own rounding: 6e-8)."""
    from qtorch_onnx.algorithms.reconstruction import _columns

    gen = torch.Generator().manual_seed(8)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
    x = 10.0 + torch.rand(2, 16, 112, 112, generator=gen)
    r = 5.0 + torch.rand(2, 16, 1, 112 * 112, generator=gen)
    cols = _columns(conv, x).double()
    ref_h, ref_g = cols @ cols.transpose(-1, -2), r.double() @ cols.transpose(-1, -2)
    xp = torch.nn.functional.pad(x, (1, 1, 1, 1)).contiguous()
    h, g = torch.empty(2, 16, 9, 9), torch.empty(2, 16, 1, 9)
    cpu_steps.depthwise_gram(xp, (3, 3), (1, 1), (112, 112), r, h, g, None)
    assert float(((h.double() - ref_h).abs() / ref_h.abs()).max()) < 1.5e-7
    assert float(((g.double() - ref_g).abs() / ref_g.abs()).max()) < 1.5e-7


@pytest.mark.parametrize("channels,size,kernel,stride", [(8, 16, 3, 1), (20, 7, 5, 1), (18, 9, 5, 2), (16, 4, 3, 1)])
def test_quadratic_loss_uses_the_depthwise_sums_and_agrees_with_im2col(monkeypatch, channels, size, kernel, stride):
    """QuadraticLayerLoss builds a depthwise layer's matrices with the sliding sums at every plane size (down to
    4x4, where the plane is smaller than the padded kernel's reach), and its loss and gradient agree with the
    im2col build's."""
    from qtorch_onnx.algorithms import reconstruction as rc

    gen = torch.Generator().manual_seed(6)
    pad = kernel // 2
    conv = torch.nn.Conv2d(channels, channels, kernel, padding=pad, stride=stride, groups=channels)
    x = torch.randn(6, channels, size, size, generator=gen)
    with torch.no_grad():
        y = conv(x)
        target = y + 0.1 * torch.randn(y.shape, generator=gen)
    out = y.shape[-1]
    assert rc._fused_depthwise(conv, x, out * out) == (pad, pad, pad, pad, out, out)
    quads = [rc.QuadraticLayerLoss(conv, x, target, train_bias=True)]
    monkeypatch.setattr(rc, "_fused_depthwise", lambda *a: None)
    quads.append(rc.QuadraticLayerLoss(conv, x, target, train_bias=True))
    idx = torch.tensor([0, 3, 3, 5])
    w = conv.weight.detach() + 0.01 * torch.randn(conv.weight.shape, generator=gen)
    b = conv.bias.detach() + 0.01
    (gw0, gb0, l0), (gw1, gb1, l1) = (q.gradient(idx, w, bias=b) for q in quads)
    torch.testing.assert_close(gw0, gw1, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gb0, gb1, rtol=1e-4, atol=1e-6)
    assert abs(float(l0) - float(l1)) <= 1e-5 * abs(float(l1))
    assert abs(quads[0].start_value() - quads[1].start_value()) == 0.0


@pytest.mark.parametrize("kind", ["depthwise", "pointwise"])
def test_quadratic_loss_fast_conv_residual(monkeypatch, kind):
    """fast_conv=True takes the layer's own output from the staged pass's faster convolution (a depthwise or a 1x1
    one on a large plane): the residual that pass gives the next layers, the module's to float rounding; the matrices
    of X are the same bits; without fast_conv the route is not taken."""
    from qtorch_onnx.algorithms import reconstruction as rc

    monkeypatch.setattr(rc, "STAGED_DEPTHWISE_MIN_PLANE", 4)
    monkeypatch.setattr(rc, "STAGED_POINTWISE_MIN_PLANE", 4)
    gen = torch.Generator().manual_seed(9)
    conv = torch.nn.Conv2d(12, 12, 3, padding=1, groups=12) if kind == "depthwise" else torch.nn.Conv2d(12, 20, 1)
    x = torch.randn(6, 12, 9, 9, generator=gen)
    with torch.no_grad():
        y = conv(x)
        target = y + 0.1 * torch.randn(y.shape, generator=gen)
    calls = []
    real = rc._staged_conv
    monkeypatch.setattr(rc, "_staged_conv", lambda m, xs: calls.append(xs.shape[0]) or real(m, xs))
    slow = rc.QuadraticLayerLoss(conv, x, target, train_bias=True)
    assert calls == []
    fast = rc.QuadraticLayerLoss(conv, x, target, train_bias=True, fast_conv=True)
    assert sum(calls) == 6
    assert torch.equal(fast.H, slow.H)
    if kind == "pointwise":
        assert torch.equal(fast.S, slow.S)
    own = torch.stack([real(conv, x[i:i + 2])[j] for i in range(0, 6, 2) for j in range(2)])
    with torch.no_grad():
        r_fast = (target - own).reshape(6, conv.out_channels, -1).pow(2).sum((1, 2), dtype=torch.float64)
    torch.testing.assert_close(fast.C, r_fast, rtol=1e-6, atol=0)
    torch.testing.assert_close(fast.G, slow.G, rtol=1e-4, atol=1e-5 * float(slow.G.abs().max()))
    assert abs(fast.start_value() - slow.start_value()) <= 1e-5 * abs(slow.start_value())


def test_fused_adam_step_matches_torch_adam():
    """The gradient passes that take Adam's step themselves (AdaRound's alpha, AdaQuant's weight) move the
    parameter as torch's Adam does on the same gradients, step after step, to float32 rounding."""
    from qtorch_onnx.algorithms.fast_finetune import _FusedAdam

    gen = torch.Generator().manual_seed(7)
    shape = (12, 40)
    w = torch.randn(shape, generator=gen)
    scale = (w.abs().amax(dim=1) / 127).reshape(-1, 1)
    layout = cpu_steps.RowLayout.of(w, scale, None, 0)
    alpha0, floor = torch.randn(shape, generator=gen), torch.floor(w / scale)
    fused, plain = alpha0.clone(), alpha0.clone()
    opt_f, opt_p = _FusedAdam([fused], 0.01), torch.optim.Adam([plain], lr=0.01)
    wf, wp = w.clone(), w.clone()
    opt_wf, opt_wp = _FusedAdam([wf], 1e-3), torch.optim.Adam([wp], lr=1e-3)
    for it in range(6):
        gwq = torch.randn(shape, generator=gen)
        beta = None if it < 2 else 10.0 - it
        cpu_steps.adaround_grad(layout, fused, floor, -128, 127, gwq, beta, 0.01, adam=opt_f.fused_moments(fused))
        plain.grad = cpu_steps.adaround_grad(layout, plain, floor, -128, 127, gwq, beta, 0.01)
        opt_p.step()
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
        wq, outside = cpu_steps.adaquant_values(layout, wf, -128, 127)
        cpu_steps.adaquant_adam(layout, wf, gwq, outside, opt_wf.fused_moments(wf))
        wp.grad = gwq * (1 - cpu_steps.adaquant_values(layout, wp, -128, 127)[1])
        opt_wp.step()
        torch.testing.assert_close(wf, wp, rtol=1e-5, atol=1e-7)
    assert not torch.equal(fused, alpha0) and opt_f.counts[id(fused)] == 6
    fused.grad = torch.zeros(shape)  # a plain step after fused ones: the step-count tensor catches up first
    opt_f.step()
    assert float(opt_f.state[id(fused)][2]) == 7.0 and opt_f.counts[id(fused)] == 7


@pytest.mark.parametrize("lo,hi,wlo,whi", [
    (-float("inf"), float("inf"), 1.0, 1.0), (0.0, 6.0, 0.0, 0.0), (0.0, float("inf"), 0.0, 1.0), (-1.0, 1.0, 1.0, 1.0),
    (0.0, 6.0, 0.5, 0.5),
])
def test_act_residual_is_the_torch_expression(monkeypatch, lo, hi, wlo, whi):
    """The direct loss's fused pass gives ``(gscale r) m`` bit for bit (``r = clamp(p, lo, hi) - y[idx]``, ``m`` 1
    inside, ``wlo`` / ``whi`` at the bounds, 0 outside), NaN and infinities included, and ``sum r^2`` per row to
    float64 rounding; rows split between threads give the same bits."""
    gen = torch.Generator().manual_seed(8)
    pre = torch.randn(3, 5, 37, generator=gen) * 4
    flat = pre.view(-1)
    flat[::7] = lo if lo > -float("inf") else 0.0
    flat[3::11] = hi if hi < float("inf") else 2.0
    flat[5], flat[6], flat[8] = float("nan"), float("inf"), -float("inf")
    target = torch.randn(4, 5, 37, generator=gen)
    idx = torch.tensor([2, 0, 2])
    gscale = 0.37
    ref_r = pre.clamp(lo, hi) - target[idx]
    m = ((pre > lo) & (pre < hi)).float() + wlo * (pre == lo).float() + whi * (pre == hi).float()
    ref = (ref_r * gscale) * m
    monkeypatch.setattr(cpu_steps, "PARALLEL_MIN", 1)
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            got = pre.clone()
            sse = cpu_steps.act_residual(got, target, idx, lo, hi, wlo, whi, gscale)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
        nosums = pre.clone()  # without the sums (an iteration whose loss nobody reads): the same gradient
        torch.set_num_threads(threads)
        try:
            assert cpu_steps.act_residual(nosums, target, idx, lo, hi, wlo, whi, gscale, want_sse=False) is None
        finally:
            torch.set_num_threads(before)
        assert torch.equal(nosums.view(torch.int32), ref.view(torch.int32))
        ref_sse = (ref_r.double() ** 2).reshape(3, -1).sum(1)
        finite = torch.isfinite(ref_sse)
        assert torch.equal(torch.isfinite(sse), finite) and not bool(finite.all())
        torch.testing.assert_close(sse[finite], ref_sse[finite], rtol=1e-12, atol=0.0)
        # the sums alone (act_sse: a finished layer's loss): act_residual's to the bit, its input left as it was
        kept = pre.clone()
        torch.set_num_threads(threads)
        try:
            alone = cpu_steps.act_sse(kept, target, idx, lo, hi)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(kept.view(torch.int32), pre.view(torch.int32))
        assert torch.equal(torch.isfinite(alone), finite)
        assert torch.equal(alone[finite].view(torch.int64), sse[finite].view(torch.int64))


@pytest.mark.parametrize("channels,size,kernel,stride,padding,bias", [
    (5, 12, 3, 1, 1, True), (4, 21, 5, 2, 2, False), (3, 9, (3, 5), (2, 3), (1, 2), True), (2, 40, 3, 2, 0, True),
    (6, 7, 5, 1, 2, True), (3, 10, (2, 4), 1, (0, 1), False),
])
def test_depthwise_forward_and_weight_gradient_equal_torch(channels, size, kernel, stride, padding, bias):
    """The depthwise forward equals torch's convolution on the selected rows (strides, rectangular kernels, padding,
    rows narrower and wider than a register block, tap counts with and without an unrolled kernel) to float32
    rounding, and the weight gradient equals convolution_backward's; threads give the same bits."""
    gen = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv2d(channels, channels, kernel, stride=stride, padding=padding, groups=channels, bias=bias)
    x = torch.randn(4, channels, size, size + 5, generator=gen)
    idx = torch.tensor([3, 1, 3])
    w = conv.weight.detach().contiguous()
    b = conv.bias.detach() if bias else None
    ref = torch.nn.functional.conv2d(x[idx], w, b, conv.stride, conv.padding, groups=channels)
    g = torch.randn(ref.shape, generator=gen)
    ref_w = torch.ops.aten.convolution_backward(g, x[idx], w, None, list(conv.stride), list(conv.padding), [1, 1],
                                                False, [0, 0], channels, [False, True, False])[1]
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.full(ref.shape, float("nan"))
            y = cpu_steps.depthwise_forward(x, idx, w, b, conv.kernel_size, conv.stride, conv.padding, out=out)
            assert y is out
            got.append((y, cpu_steps.depthwise_wgrad(x, idx, g, conv.kernel_size, conv.stride, conv.padding)))
    finally:
        torch.set_num_threads(before)
    (y1, gw1), (y2, gw2) = got
    assert torch.equal(y1, y2) and torch.equal(gw1, gw2)
    torch.testing.assert_close(y1, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw1, ref_w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("blocked", [False, True], ids=["planes", "channel_blocks"])
@pytest.mark.parametrize("channels,size,kernel,stride,padding,clamp", [
    (5, 12, 3, 1, 1, (0.0, 6.0, 0.0, 0.0)), (4, 21, 5, 2, 2, (-math.inf, math.inf, 1.0, 1.0)),
    (3, 9, (3, 5), (2, 3), (1, 2), (0.0, math.inf, 0.0, 1.0)), (6, 40, 3, 2, 1, (0.0, 6.0, 0.0, 0.0)),
    (3, 10, (2, 4), 1, (0, 1), (-1.0, 1.0, 0.5, 0.5)),
    (37, 7, 5, 1, 2, (0.0, 6.0, 0.0, 0.0)), (20, 11, 3, 2, 1, (0.0, 6.0, 0.0, 0.0)),  # several blocks, a partial one
])
def test_depthwise_direct_equals_forward_residual_wgrad(monkeypatch, channels, size, kernel, stride, padding, clamp,
                                                        blocked):
    """The one-pass depthwise direct loss gives the three-call composition's results, plane by plane and channel-
    blocked (16 channels per vector): the weight gradient to the bit plane by plane (depthwise_forward, act_residual,
    depthwise_wgrad) and to float rounding channel-blocked (float32 sums over the plane in another order), the bias
    gradient and the loss to float rounding (their sums in float64 per channel; the loss to 1e-12, which only the
    forward's and the residual's own floats give); the same bits on two threads; no bias gradient when none is
    asked for."""
    monkeypatch.setattr(cpu_steps, "PARALLEL_MIN", 1)  # the threads split even these small layers
    gen = torch.Generator().manual_seed(6)
    conv = torch.nn.Conv2d(channels, channels, kernel, stride=stride, padding=padding, groups=channels)
    x = torch.randn(4, channels, size, size + 5, generator=gen)
    w, b = conv.weight.detach().contiguous(), conv.bias.detach()
    with torch.no_grad():
        target = (conv(x) + 0.3 * torch.randn(conv(x).shape, generator=gen)).contiguous()
    idx = torch.tensor([3, 1, 3])
    lo, hi, wlo, whi = clamp
    pre = cpu_steps.depthwise_forward(x, idx, w, b, conv.kernel_size, conv.stride, conv.padding)
    ref_sse = cpu_steps.act_residual(pre, target, idx, lo, hi, wlo, whi, 0.25).sum()
    ref_w = cpu_steps.depthwise_wgrad(x, idx, pre, conv.kernel_size, conv.stride, conv.padding)
    ref_b = pre.double().sum([0, 2, 3]).float()
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got.append(cpu_steps.depthwise_direct(x, idx, w, b, conv.kernel_size, conv.stride, conv.padding, target,
                                                  lo, hi, wlo, whi, 0.25, True, blocked=blocked))
    finally:
        torch.set_num_threads(before)
    (gw, gb, sse), (gw2, gb2, sse2) = got
    if blocked:
        torch.testing.assert_close(gw, ref_w, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(gw.view(torch.int32), ref_w.view(torch.int32))
    assert torch.equal(gw, gw2) and torch.equal(gb, gb2) and float(sse) == float(sse2)
    torch.testing.assert_close(gb, ref_b, rtol=1e-6, atol=1e-6)
    assert abs(float(sse) - float(ref_sse)) <= 1e-12 * float(ref_sse)
    gw3, gb3, _ = cpu_steps.depthwise_direct(x, idx, w, None, conv.kernel_size, conv.stride, conv.padding, target,
                                             lo, hi, wlo, whi, 0.25, False, blocked=blocked)
    assert gb3 is None and gw3.shape == gw.shape
    # without the loss (the iterations nobody reads it on: its sums skipped in C): the same gradients, bit for bit
    gw4, gb4, none = cpu_steps.depthwise_direct(x, idx, w, b, conv.kernel_size, conv.stride, conv.padding, target,
                                                lo, hi, wlo, whi, 0.25, True, blocked=blocked, want_sse=False)
    assert none is None and torch.equal(gw4.view(torch.int32), gw.view(torch.int32))
    assert torch.equal(gb4.view(torch.int32), gb.view(torch.int32))
    none_w, none_b, alone = cpu_steps.depthwise_direct(x, idx, w, b, conv.kernel_size, conv.stride, conv.padding,
                                                       target, lo, hi, wlo, whi, 0.0, True, grads=False,
                                                       blocked=blocked)
    assert none_w is None and none_b is None and float(alone) == float(sse)  # the loss alone: the same sums
    # every sample's planes arranged once (depthwise_prepare): the same bits, on one thread and two
    prep = cpu_steps.depthwise_prepare(x, target, conv.kernel_size, conv.stride, conv.padding, blocked=blocked)
    assert prep.blocked == blocked and prep.nbytes == cpu_steps.depthwise_prepared_bytes(
        x, conv.kernel_size, conv.stride, conv.padding, blocked=blocked)
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pw_, pb_, ps_ = cpu_steps.depthwise_direct(x, idx, w, b, conv.kernel_size, conv.stride, conv.padding,
                                                       target, lo, hi, wlo, whi, 0.25, True, prepared=prep)
            assert torch.equal(pw_.view(torch.int32), gw.view(torch.int32)) and torch.equal(pb_, gb)
            assert float(ps_) == float(sse)
        # scratch kept in a workspace between calls (as a layer's steps keep it), other mini-batches in between and a
        # thread count that changes: the same bits as fresh buffers
        for use_prep in (None, prep):
            ws: dict = {}
            for threads in (1, 2, 1):
                torch.set_num_threads(threads)
                for other in (torch.tensor([0, 2]), idx):
                    fresh = cpu_steps.depthwise_direct(x, other, w, b, conv.kernel_size, conv.stride, conv.padding,
                                                       target, lo, hi, wlo, whi, 0.25, True, blocked=blocked,
                                                       prepared=use_prep)
                    kept = cpu_steps.depthwise_direct(x, other, w, b, conv.kernel_size, conv.stride, conv.padding,
                                                      target, lo, hi, wlo, whi, 0.25, True, blocked=blocked,
                                                      prepared=use_prep, workspace=ws)
                    assert torch.equal(kept[0].view(torch.int32), fresh[0].view(torch.int32))
                    assert torch.equal(kept[1], fresh[1]) and float(kept[2]) == float(fresh[2])
            assert ws  # the buffers were kept
            assert cpu_steps.depthwise_direct(x, idx, w, b, conv.kernel_size, conv.stride, conv.padding, target, lo, hi,
                                              wlo, whi, 0.25, True, blocked=blocked, prepared=use_prep, workspace=ws,
                                              want_sse=False)[2] is None
    finally:
        torch.set_num_threads(before)



@pytest.mark.parametrize("blocked", [False, True], ids=["planes", "channel_blocks"])
def test_depthwise_forward_adds_the_bias_last(blocked):
    """DW_BIAS_LAST: the depthwise forward with bias_last (plane by plane and channel-blocked, 3x3 / 5x5 / other tap
    counts) is its bias-free output plus (0 + bias), bit for bit: the property the kept planes stand on (a -0.0 bias
    acts as +0); the default forward starts from the bias (to float rounding the same)."""
    gen = torch.Generator().manual_seed(11)
    for kernel, stride, padding in [((3, 3), (1, 1), (1, 1)), ((5, 5), (2, 2), (2, 2)), ((3, 5), (1, 2), (1, 2))]:
        c = 19  # a full block of 16 channels and a partial one
        x = torch.randn(3, c, 9, 13, generator=gen)
        w = torch.randn(c, 1, *kernel, generator=gen).contiguous()
        b = torch.randn(c, generator=gen)
        b[2], b[5] = -0.0, 0.0
        idx = torch.tensor([2, 0])
        y = cpu_steps.depthwise_forward(x, idx, w, b, kernel, stride, padding, bias_last=True)
        y0 = cpu_steps.depthwise_forward(x, idx, w, None, kernel, stride, padding, bias_last=True)
        want = y0 + (0.0 + b).view(1, -1, 1, 1)
        assert torch.equal(y.view(torch.int32), want.view(torch.int32)), kernel
        first = cpu_steps.depthwise_forward(x, idx, w, b, kernel, stride, padding)
        torch.testing.assert_close(first, y, rtol=1e-6, atol=1e-6)
        assert torch.equal(cpu_steps.depthwise_forward(x, idx, w, None, kernel, stride, padding).view(torch.int32),
                           y0.view(torch.int32))  # (no bias: the two orders are one)
        # the kept planes plus the bias: the same floats
        kept = cpu_steps.depthwise_kept(x, kernel, stride, padding, blocked=blocked)
        out = cpu_steps.depthwise_kept_output(x, w, b, kernel, stride, padding, kept)
        assert torch.equal(out[idx].view(torch.int32), y.view(torch.int32)), kernel


@pytest.mark.parametrize("prepare", [False, True], ids=["per_call", "prepared"])
@pytest.mark.parametrize("blocked", [False, True], ids=["planes", "channel_blocks"])
@pytest.mark.parametrize("kernel,stride,padding,clamp", [
    ((3, 3), (1, 1), (1, 1), (0.0, 6.0, 0.0, 0.0)), ((5, 5), (2, 2), (2, 2), (-math.inf, math.inf, 1.0, 1.0)),
    ((3, 5), (2, 1), (0, 2), (0.0, math.inf, 0.0, 1.0)),
])
def test_depthwise_kept_planes_give_the_fresh_bits(monkeypatch, kernel, stride, padding, clamp, blocked, prepare):
    """AdaQuant's kept depthwise planes (cpu_steps.depthwise_kept): over steps whose weights change in a few channels
    (one in each block, the bias every step, a sample drawn twice in a mini-batch, the loss alone over every
    sample), depthwise_direct with the kept planes gives the fresh forward's gradients and loss bit for bit, on one
    thread and two; only the planes (blocks) whose taps changed are computed again; depthwise_kept_output is
    depthwise_forward's output (both with the bias last), into the kept planes' memory on the plane layout."""
    monkeypatch.setattr(cpu_steps, "PARALLEL_MIN", 1)
    gen = torch.Generator().manual_seed(12)
    c = 21
    conv = torch.nn.Conv2d(c, c, kernel, stride=stride, padding=padding, groups=c)
    x = torch.randn(5, c, 11, 14, generator=gen)
    with torch.no_grad():
        target = (conv(x) + 0.3 * torch.randn(conv(x).shape, generator=gen)).contiguous()
    w, b = conv.weight.detach().clone().contiguous(), conv.bias.detach().clone()
    args = (conv.kernel_size, conv.stride, conv.padding)
    lo, hi, wlo, whi = clamp
    prep = cpu_steps.depthwise_prepare(x, target, *args, blocked=blocked) if prepare else None
    kept = cpu_steps.depthwise_kept(x, *args, blocked=blocked)
    assert kept.blocked == blocked and not bool(kept.valid.any())
    computed = []
    before = torch.get_num_threads()
    try:
        for step, ids in enumerate([[3, 1], [1, 3], [4, 4], [0, 1, 2, 3, 4], [2, 0]]):
            torch.set_num_threads(1 + step % 2)
            if step:  # a few taps move (one channel in each block) and the bias moves everywhere, as AdaQuant's do
                w[step, 0, 0, 0] += 0.01
                w[16 + step % 5, 0, -1, -1] -= 0.02
                b += 1e-3
            idx = torch.tensor(ids)
            grads = step != 3  # (the loss alone over every sample: the loss before / value)
            valid_before = kept.valid.clone()
            fresh = cpu_steps.depthwise_direct(x, idx, w, b, *args, target, lo, hi, wlo, whi, 0.25, True,
                                               blocked=blocked, prepared=prep, grads=grads, bias_last=True)
            got = cpu_steps.depthwise_direct(x, idx, w, b, *args, target, lo, hi, wlo, whi, 0.25, True,
                                             blocked=blocked, prepared=prep, grads=grads, kept=kept, bias_last=True)
            for f, g in zip(fresh[:2], got[:2]):
                assert (f is None) == (g is None)
                if f is not None:
                    assert torch.equal(f.view(torch.int32), g.view(torch.int32)), step
            assert float(fresh[2]) == float(got[2]), step
            assert bool(kept.valid[idx].all())
            computed.append(int((~valid_before.bool()[sorted(set(ids))]).sum()))
        unit = kept.valid.shape[1]
        assert computed[:3] == [2 * unit, 0, unit]  # samples 3 and 1 new, then seen, then 4 (twice in one batch)
        # the kept planes are what is read where the taps did not change: spoilt, the result moves; marked not
        # valid, they are computed again and the fresh bits come back
        idx = torch.tensor([0])
        fresh = cpu_steps.depthwise_direct(x, idx, w, b, *args, target, lo, hi, wlo, whi, 0.25, True,
                                           blocked=blocked, prepared=prep, bias_last=True)
        kept.kept[0] += 1.0
        spoilt = cpu_steps.depthwise_direct(x, idx, w, b, *args, target, lo, hi, wlo, whi, 0.25, True,
                                            blocked=blocked, prepared=prep, kept=kept, bias_last=True)
        assert not torch.equal(spoilt[0], fresh[0])
        kept.valid[0] = 0
        again = cpu_steps.depthwise_direct(x, idx, w, b, *args, target, lo, hi, wlo, whi, 0.25, True,
                                           blocked=blocked, prepared=prep, kept=kept, bias_last=True)
        assert torch.equal(again[0].view(torch.int32), fresh[0].view(torch.int32))
        w[7, 0, 0, 0] += 0.5
        y = cpu_steps.depthwise_forward(x, torch.arange(5), w, b, *args, bias_last=True)
        out = cpu_steps.depthwise_kept_output(x, w, b, *args, kept, prepared=prep)
        assert torch.equal(out.view(torch.int32), y.view(torch.int32))
        if not blocked:  # into the kept planes themselves
            mem = kept.kept.view(out.shape)
            got = cpu_steps.depthwise_kept_output(x, w, b, *args, kept, prepared=prep, out=mem)
            assert got.data_ptr() == kept.kept.data_ptr() and torch.equal(got.view(torch.int32), y.view(torch.int32))
            assert not bool(kept.valid.any())  # (they hold the outputs now)
        else:
            with pytest.raises(ValueError, match="only on the plane layout"):
                cpu_steps.depthwise_kept_output(x, w, b, *args, kept, out=kept.kept.view(-1))
    finally:
        torch.set_num_threads(before)
    other = cpu_steps.depthwise_prepare(x, target, *args, blocked=not blocked)
    with pytest.raises(ValueError, match="blocked"):
        cpu_steps.depthwise_direct(x, torch.tensor([0]), w, b, *args, target, lo, hi, wlo, whi, 0.25, True,
                                   prepared=other, kept=kept, bias_last=True)
    with pytest.raises(ValueError, match="bias_last=True"):
        cpu_steps.depthwise_direct(x, torch.tensor([0]), w, b, *args, target, lo, hi, wlo, whi, 0.25, True, kept=kept)

def test_direct_loss_value_of_a_depthwise_layer_equals_the_forward_path():
    """DirectLayerLoss.value of a depthwise layer (one C call, no output written out) is the loss of its forward
    through the clamp over the samples, as _rec_loss computes it."""
    from qtorch_onnx.algorithms.reconstruction import DirectLayerLoss

    gen = torch.Generator().manual_seed(7)
    conv = torch.nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6)
    x = torch.randn(5, 6, 17, 17, generator=gen)
    with torch.no_grad():
        target = (conv(x) + 0.2 * torch.randn(conv(x).shape, generator=gen)).clamp(0.0, 6.0)
        d = DirectLayerLoss(conv, x, target, (0.0, 6.0, 0.0, 0.0), conv.bias.detach())
        assert d.depthwise
        ref = ((conv(x).clamp(0.0, 6.0) - target).double() ** 2).sum(1).mean()
        assert abs(d.value() - float(ref)) <= 1e-5 * float(ref)
        part = ((conv(x[[4, 1]]).clamp(0.0, 6.0) - target[[4, 1]]).double() ** 2).sum(1).mean()
        assert abs(d.value([4, 1]) - float(part)) <= 1e-5 * float(part)


@pytest.mark.parametrize("shape,axis,asymmetric", [((300, 37), 0, True), ((6, 1000), 0, False), ((50, 9), None, False)])
def test_adaround_step_with_next_values(shape, axis, asymmetric):
    """The gradient pass with Adam's step gives the same alpha and moments with or without the next values (and with
    the sigmoids kept from step to step), and the next values are the values call's bits for the updated alpha: rows
    shorter and longer than a chunk, rows that straddle chunks, per channel (with zero points) and per tensor."""
    from qtorch_onnx.algorithms.fast_finetune import _FusedAdam

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=gen)
    scale = (w.abs().amax(dim=1) / 127).reshape(-1, 1) if axis is not None else w.abs().max() / 127
    zp = torch.randint(-3, 4, (shape[0], 1), generator=gen).float() if asymmetric else None
    alpha, gwq = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    floor = torch.floor(w / scale)
    layout = cpu_steps.RowLayout.of(alpha, scale, zp, axis)
    results = []
    # without the next values; with them; with them and the sigmoids kept between steps (read from the second on)
    for with_next, keep in ((False, False), (True, False), (True, True)):
        a = alpha.clone()
        opt = _FusedAdam([a], 1e-2)
        nxt = torch.full(shape, float("nan")) if with_next else None
        sig = torch.full((a.numel(),), float("nan")) if keep else None
        for i, beta in enumerate((None, 7.5, 7.5)):
            cpu_steps.adaround_grad(layout, a, floor, -128, 127, gwq, beta, 0.01, adam=opt.fused_moments(a),
                                    next_values=nxt, sig=sig, sig_valid=keep and i > 0)
            if with_next:
                ref = cpu_steps.adaround_values(layout, a, floor, -128, 127)
                assert torch.equal(nxt.view(torch.int32), ref.view(torch.int32))
            if keep:  # the updated alpha's sigmoids, as the values pass computes them
                assert bool(torch.isfinite(sig).all())
        results.append((a, *opt.state[id(a)][:2]))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))


@pytest.mark.parametrize("shape,axis,asymmetric", [((300, 37), 0, True), ((50, 9), None, False)])
def test_adaquant_adam_with_next_values(shape, axis, asymmetric):
    """AdaQuant's fused Adam step gives the same weight and moments with or without the next values, and the next
    values are adaquant_values' bits (the weight and its saturation mask) for the updated weight."""
    from qtorch_onnx.algorithms.fast_finetune import _FusedAdam

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(shape, generator=gen)
    scale = (w.abs().amax(dim=1) / 150).reshape(-1, 1) if axis is not None else w.abs().max() / 150
    zp = torch.randint(-3, 4, (shape[0], 1), generator=gen).float() if asymmetric else None
    layout = cpu_steps.RowLayout.of(w, scale, zp, axis)
    gwq = torch.randn(shape, generator=gen)
    w.view(-1)[7] = float("nan")  # a NaN weight: outside 0 (its gradient passes), recomputed or read alike
    results = []
    # without the next values; with them; with them and the mask recomputed in the pass (outside None, the next mask
    # not written), as fast finetune's loop runs it
    for with_next, recompute in ((False, False), (True, False), (True, True)):
        p = w.clone()
        opt = _FusedAdam([p], 1e-1)
        for _ in range(3):
            _, outside = cpu_steps.adaquant_values(layout, p, -128, 127)
            nxt = cpu_steps.adaquant_adam(layout, p, gwq, None if recompute else outside, opt.fused_moments(p),
                                          next_range=(-128, 127) if with_next else None, next_mask=not recompute)
            if with_next:
                ref = cpu_steps.adaquant_values(layout, p, -128, 127)
                assert torch.equal(nxt[0].view(torch.int32), ref[0].view(torch.int32))
                assert nxt[1] is None if recompute else torch.equal(nxt[1].view(torch.int32), ref[1].view(torch.int32))
                assert bool(ref[1].any())  # some weights saturate
            else:
                assert nxt is None
        results.append((p, *opt.state[id(p)][:2]))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    with pytest.raises(ValueError, match="next_range"):
        cpu_steps.adaquant_adam(layout, w.clone(), gwq, None, _FusedAdam([w], 1e-1).fused_moments(w))


@pytest.mark.parametrize("per_channel", [False, True])
def test_bias_values_bit_exact(per_channel):
    """AdaQuant's INT32 bias in one call: the bias quantizer's bits (round_bias in float64, then the float32
    product), half-way cases, saturation at the INT32 range, NaN, infinities and signed zeros included; the
    gradient mask is 1 strictly inside the range."""
    from qtorch_onnx.formats import integer as _integer

    gen = torch.Generator().manual_seed(5)
    n = 40
    s = (torch.rand(n, generator=gen) * 1e-3 + 1e-5) if per_channel else torch.tensor([3e-4])
    b = torch.randn(n, generator=gen) * 0.1
    b[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e9, -1e9])
    b[6:10] = (torch.tensor([0.5, 1.5, -2.5, 3.5]) * (s[6:10] if per_channel else s).double()).float()
    lo, hi = -(2.0 ** 31), 2.0 ** 31 - 1
    bq, keep = cpu_steps.bias_values(b, s.double(), s, lo, hi)
    q = _integer.round_bias(b.double(), s.double())
    ref = q.to(torch.float32) * s
    assert torch.equal(bq.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(keep, ((q > lo) & (q < hi)).float())
    assert keep[4] == 0 and keep[0] == 0 and keep[10:].all()


@pytest.mark.parametrize("make,shape", [
    (lambda: torch.nn.Conv2d(6, 8, 3, stride=2, padding=1, groups=2), (5, 6, 9, 9)),
    (lambda: torch.nn.Conv2d(4, 4, 3, padding=1, groups=4), (5, 4, 8, 8)),
    (lambda: torch.nn.Linear(7, 3), (5, 4, 7)),
])
@pytest.mark.parametrize("train_bias", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_small_gram_gradient_equals_the_torch_path(make, shape, train_bias, sparse):
    """A small Gram-matrix layer's gradient and loss in one C call equal QuadraticLayerLoss's torch path (groups, a
    depthwise and a token-wise layer; mini-batches of one, two and three samples with a repeat; with and without the
    bias) to float32 rounding, with a dense weight change and with a sparse one (AdaQuant's: most of dw zero, whole
    columns of H unused, which the C products skip)."""
    from qtorch_onnx.algorithms.reconstruction import QuadraticLayerLoss

    torch.manual_seed(0)
    m = make()
    x = torch.randn(shape)
    with torch.no_grad():
        target = m(x) + 0.1 * torch.randn_like(m(x))
    quad = QuadraticLayerLoss(m, x, target, train_bias=train_bias)
    assert quad._small is not None
    delta = 0.01 * torch.randn(m.weight.shape)
    if sparse:
        keep = torch.zeros(delta.numel())
        keep[::5] = 1.0
        delta = delta * keep.reshape(delta.shape)
    w = m.weight.detach() + delta
    b = m.bias.detach() + 0.01 if train_bias else None
    for idx in ([0, 3], [2, 2, 4], [1]):
        for want_loss in (False, True):
            gw, gb, loss = quad.gradient(idx, w, 0.5, bias=b, want_loss=want_loss)
            small, quad._small = quad._small, None
            try:
                rw, rb, rl = quad.gradient(idx, w, 0.5, bias=b, want_loss=want_loss)
            finally:
                quad._small = small
            torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-6 * float(rw.abs().max()))
            if train_bias:
                torch.testing.assert_close(gb, rb, rtol=1e-4, atol=1e-6 * float(rb.abs().max()))
            else:
                assert gb is None and rb is None
            if want_loss:
                assert loss.dtype == torch.float64 and loss.dim() == 0
                assert abs(float(loss) - float(rl)) <= 1e-5 * abs(float(rl))
            else:
                assert loss is None and rl is None


def test_gram_gradient_skips_zeros_with_the_dense_bits():
    """The C product skips the zeros of dw (and the rows of H no nonzero multiplies) and gives the bits of the same
    product with every row added: checked against the same call where the skipped rows of H hold other finite values
    (they cannot matter); a non-finite Gram matrix keeps the layer off the C path."""
    from qtorch_onnx.algorithms import cpu_steps
    from qtorch_onnx.algorithms.reconstruction import QuadraticLayerLoss

    torch.manual_seed(1)
    m = torch.nn.Conv2d(16, 12, 1)
    x = torch.randn(6, 16, 5, 5)
    with torch.no_grad():
        target = m(x) + 0.1 * torch.randn(6, 12, 5, 5)
    quad = QuadraticLayerLoss(m, x, target, train_bias=True, sparse=True)
    w0 = quad.w0
    dw = torch.zeros_like(w0)
    dw[0, 3, 2], dw[0, 7, 2], dw[0, 1, 9] = 1e-3, -2e-3, 5e-4  # columns 2 and 9 of H used
    w, b = (w0 + dw).contiguous(), (m.bias.detach() + 1e-3).contiguous()
    args = (quad._flat, [1, 4], 1, 12, 16, w, w0, b, quad.b0, 50.0, 0.1, quad._small, True)
    r, gb, sse = cpu_steps.gram_gradient(*args)
    flat = quad._flat.clone()
    h = flat[:, :16 * 16].view(6, 16, 16)
    unused = [c for c in range(16) if c not in (2, 9)]
    h[:, unused, :] = 7.0  # rows no nonzero of dw multiplies
    r2, gb2, sse2 = cpu_steps.gram_gradient(flat, *args[1:])
    assert torch.equal(r.view(torch.int32), r2.view(torch.int32)) and torch.equal(gb.view(torch.int32),
                                                                                  gb2.view(torch.int32))
    assert sse == sse2
    bad = QuadraticLayerLoss(m, x.clone().index_fill_(0, torch.tensor([2]), float("inf")), target, train_bias=False,
                             sparse=True)
    assert bad._small is None


@pytest.mark.parametrize("kind", ["pointwise", "depthwise", "depthwise strided", "other"])
def test_staged_convolution_routes_equal_the_module(kind):
    """The staged forward passes' faster routes (a 1x1 convolution on a large plane as one product per sample, a
    depthwise one by the C kernel) give the module's output to float rounding; other convolutions, small planes and
    a module with its own forward are left to the module (None)."""
    from qtorch_onnx.algorithms import reconstruction as rc

    gen = torch.Generator().manual_seed(8)
    if kind == "pointwise":
        conv, x = torch.nn.Conv2d(16, 24, 1), torch.randn(3, 16, 56, 57, generator=gen)
    elif kind == "depthwise":
        conv, x = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.randn(3, 8, 30, 29, generator=gen)
    elif kind == "depthwise strided":
        conv, x = torch.nn.Conv2d(8, 8, 5, stride=2, padding=2, groups=8, bias=False), \
            torch.randn(2, 8, 61, 60, generator=gen)
    else:
        conv, x = torch.nn.Conv2d(8, 8, 3, padding=1), torch.randn(2, 8, 40, 40, generator=gen)
    with torch.no_grad():
        got = rc._staged_conv(conv, x)
        if kind == "other":
            assert got is None
            return
        ref = conv(x)
        assert got is not None and got.shape == ref.shape and got.is_contiguous()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert rc._staged_conv(conv, x[:, :, :8, :8].contiguous()) is None  # a small plane: the module's
        assert rc._staged_conv(conv, x.double()) is None

        class Own(torch.nn.Conv2d):
            def forward(self, inp):
                return super().forward(inp) * 2

        own = Own(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                  groups=conv.groups)
        assert rc._staged_conv(own, x) is None


def test_lazy_depthwise_gram_rows_equal_the_eager_ones():
    """A sparse dw on a depthwise layer (AdaQuant's integer weights) builds no H up front: the rows a nonzero of dw
    needs are filled when first needed (the C gradient asks for them, the torch path fills them), with the eager
    build's values to float rounding; gradients and losses agree, the rows no nonzero needs stay unfilled."""
    from qtorch_onnx.algorithms.reconstruction import QuadraticLayerLoss

    torch.manual_seed(0)
    m = torch.nn.Conv2d(32, 32, 5, padding=2, groups=32)
    x = torch.randn(6, 32, 14, 14)
    with torch.no_grad():
        target = m(x) + 0.1 * torch.randn(6, 32, 14, 14)
    eager = QuadraticLayerLoss(m, x, target, True, sparse=False)
    lazy = QuadraticLayerLoss(m, x, target, True, sparse=True)
    assert eager._filled is None and lazy._filled is not None and lazy._small is not None
    assert lazy.rows_filled == 0 and float(lazy.H.abs().sum()) == 0.0
    w = m.weight.detach().clone()
    w.view(-1)[[5, 77, 300, 301]] += torch.tensor([1e-2, -2e-2, 3e-2, 1e-2])  # channels 0, 3, 12; 4 taps
    b = m.bias.detach().clone()
    for idx in ([0, 3], [2, 2, 4]):
        for want_loss in (False, True):
            ge, be, le = eager.gradient(idx, w, 1.0, bias=b, want_loss=want_loss)
            gl, bl, ll = lazy.gradient(idx, w, 1.0, bias=b, want_loss=want_loss)
            torch.testing.assert_close(gl, ge, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(bl, be, rtol=1e-5, atol=1e-7)
            if want_loss:
                assert abs(float(ll) - float(le)) <= 1e-9 * abs(float(le))
    assert lazy.rows_filled == 4 and int(lazy._filled.sum()) == 4
    filled = lazy._filled.bool()
    torch.testing.assert_close(lazy.H[:, filled], eager.H[:, filled], rtol=1e-6,
                               atol=1e-6 * float(eager.H[:, filled].abs().max()))
    assert float(lazy.H[:, 1].abs().sum()) == 0.0  # channel 1: no nonzero, no row
    with torch.no_grad():
        m.weight.copy_(w)
    assert abs(lazy.value([0, 1, 2]) - eager.value([0, 1, 2])) <= 1e-6 * abs(eager.value([0, 1, 2]))


def test_sparse_depthwise_builds_h_up_front_when_most_rows_will_be_needed():
    """QuadraticLayerLoss(sparse=True)'s ``needed``: where the expected fraction of dw's nonzeros by the end makes
    the lazy fills (LAZY_ROW_COST each) dearer than the eager build (N K L per row), H is built up front, with the
    same gradients; a small fraction, or none given, keeps the lazy build."""
    from qtorch_onnx.algorithms import reconstruction as rc

    torch.manual_seed(0)
    m = torch.nn.Conv2d(32, 32, 5, padding=2, groups=32)
    x = torch.randn(6, 32, 14, 14)
    with torch.no_grad():
        target = m(x) + 0.1 * torch.randn(6, 32, 14, 14)
    per_row = 6 * 25 * 14 * 14  # N K L
    at = per_row / rc.LAZY_ROW_COST  # the break-even fraction
    lazy = rc.QuadraticLayerLoss(m, x, target, True, sparse=True, needed=0.5 * at)
    eager = rc.QuadraticLayerLoss(m, x, target, True, sparse=True, needed=min(1.0, 2.0 * at))
    assert rc.QuadraticLayerLoss(m, x, target, True, sparse=True)._filled is not None
    assert lazy._filled is not None and eager._filled is None and eager._small is not None
    w = m.weight.detach().clone()
    w.view(-1)[[5, 77, 300]] += torch.tensor([1e-2, -2e-2, 3e-2])
    b = m.bias.detach().clone()
    gl, bl, ll = lazy.gradient([0, 3], w, 1.0, bias=b)
    ge, be, le = eager.gradient([0, 3], w, 1.0, bias=b)
    torch.testing.assert_close(ge, gl, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(be, bl, rtol=1e-5, atol=1e-7)
    assert abs(float(ll) - float(le)) <= 1e-9 * abs(float(le))


def test_plan_counts_the_products_a_sparse_dw_skips():
    """QuadraticLayerLoss.plan's density: a [512, 512] 1x1 layer on a 7x7 plane trains by forward passes when every
    weight moves (AdaRound), on its Gram matrices when few flip (AdaQuant on its grid, the C products skipping the
    zeros of dw)."""
    from qtorch_onnx.algorithms.reconstruction import QuadraticLayerLoss

    m = torch.nn.Conv2d(512, 512, 1)
    x, t = torch.zeros(16, 512, 7, 7), torch.zeros(16, 512, 7, 7)
    assert QuadraticLayerLoss.plan(m, x, t, 50, 2) is None
    assert QuadraticLayerLoss.plan(m, x, t, 50, 2, density=0.002) is not None


def test_plan_counts_the_reads_of_a_gram_matrix_that_outgrows_the_caches(monkeypatch):
    """QuadraticLayerLoss.plan on a CPU: an iteration reads each mini-batch sample's H, memory-bound once H exceeds
    GRAM_CACHE_BYTES (GRAM_READ_COST multiply-adds a float). EfficientNet-Lite0's 1152 -> 320 1x1 on 7x7 under
    AdaQuant (few weights flip) trains by forward passes for it (measured faster), and counted as one multiply-add a
    float it would not; a layer whose H fits the caches is unaffected."""
    from qtorch_onnx.algorithms import reconstruction as rc

    big = torch.nn.Conv2d(1152, 320, 1)
    x, t = torch.zeros(16, 1152, 7, 7), torch.zeros(16, 320, 7, 7)
    assert rc.QuadraticLayerLoss.plan(big, x, t, 50, 2, density=0.003) is None
    small = torch.nn.Conv2d(96, 24, 1)
    xs, ts = torch.zeros(16, 96, 56, 56), torch.zeros(16, 24, 56, 56)
    assert rc.QuadraticLayerLoss.plan(small, xs, ts, 50, 2, density=0.003) is not None
    monkeypatch.setattr(rc, "GRAM_READ_COST", 1.0)
    assert rc.QuadraticLayerLoss.plan(big, x, t, 50, 2, density=0.003) is not None


def test_kept_diff_finds_exactly_the_entries_that_differ_as_floats():
    """qt_kept_diff (the incremental 1x1 loss's scan of the weight): the entries where w != w0 as floats, in order,
    with their differences, w0 updated there; a -0.0 against 0.0 is no change, a NaN always is (it never equals
    itself); changes in the 16-entry blocks and in the tail alike; more than ``cap``: the count, nothing changed."""
    import ctypes

    lib = cpu_steps.library()
    gen = torch.Generator().manual_seed(9)
    m = 16 * 40 + 7
    w0 = torch.randn(m, generator=gen)
    w0[100] = 0.0
    w = w0.clone()
    w[[3, 17, 18, 300, m - 1]] += torch.tensor([0.5, -0.25, 1.0, 2.0, -1.0])
    w[100] = -0.0                          # equal as floats
    w[200] = float("nan")                  # a change
    w0[400] = w[400] = float("nan")        # NaN on both sides: a change
    ref = [q for q in range(m) if not bool(w[q] == w0[q])]
    at, d = torch.empty(16, dtype=torch.int64), torch.empty(16)
    w0c = w0.clone()
    k = lib.qt_kept_diff(m, ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(w0c.data_ptr()), 16,
                         ctypes.c_void_p(at.data_ptr()), ctypes.c_void_p(d.data_ptr()))
    assert k == len(ref) == 7 and at[:k].tolist() == ref
    assert torch.equal(d[:k][[0, 1, 2, 4, 6]], (w - w0)[[3, 17, 18, 300, m - 1]])
    assert torch.equal(w0c[[3, 17, 18, 300, m - 1]], w[[3, 17, 18, 300, m - 1]]) and float(w0c[100]) == 0.0
    w0c = w0.clone()
    k = lib.qt_kept_diff(m, ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(w0c.data_ptr()), 4,
                         ctypes.c_void_p(at.data_ptr()), ctypes.c_void_p(d.data_ptr()))
    assert k == 7 and torch.equal(w0c.view(torch.int32), w0.view(torch.int32))  # over cap: w0 left as it was


@pytest.mark.parametrize("threads", [1, 2])
def test_kept_replay_lazily_gives_the_bits_of_every_change_applied_at_once(threads):
    """kept_replay (the incremental 1x1 loss's change log): samples brought up to date only when read, with the
    backlog of steps each has missed, end with the same bits as every step's changes applied to every sample when
    they happen (the same additions per element in the same order); repeated output channels within a step, samples
    split between threads."""
    gen = torch.Generator().manual_seed(11)
    n, o, c, p = 6, 40, 24, 400  # from the 3rd step on, every sample's step is past PARALLEL_MIN; 20 rows a block
    x = torch.randn(n, c, p, generator=gen)
    eager = torch.randn(n, o, p, generator=gen)
    lazy = eager.clone()
    w0 = torch.randn(o, c, generator=gen)
    w0_lazy = w0.clone()
    at = torch.empty(4096, dtype=torch.int64)
    d = torch.empty(4096)
    length, seen, runs = 0, [0] * n, []
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(12):
            w = w0.clone()
            hit = torch.randperm(o * c, generator=gen)[:30 + 7 * step]
            w.view(-1)[hit] += 0.01 * torch.randn(hit.numel(), generator=gen)
            w.view(-1)[5 * c + 3] += 0.5  # the same entry every step
            # eager: every sample, now
            a1, d1 = torch.empty(o * c, dtype=torch.int64), torch.empty(o * c)
            k = cpu_steps.kept_diff(w, w0, a1, d1)
            cpu_steps.kept_replay(eager, x, list(range(n)), [0] * n, k, a1, d1)
            # lazy: logged, and only the step's mini-batch brought up to date
            k2 = cpu_steps.kept_diff(w, w0_lazy, at[length:], d[length:])
            assert k2 == k and torch.equal(w0, w0_lazy)
            runs.append(length)
            length += k2
            batch = sorted({step % n, (3 * step + 1) % n})
            # the backlog by blocks of output rows (runs: each step's first entry) on even steps, in order on odd ones
            cpu_steps.kept_replay(lazy, x, batch, [seen[i] for i in batch], length, at, d,
                                  runs=runs if step % 2 == 0 else None)
            for i in batch:
                seen[i] = length
                assert torch.equal(lazy[i].view(torch.int32), eager[i].view(torch.int32))
        rest = [i for i in range(n) if seen[i] < length]
        cpu_steps.kept_replay(lazy, x, rest, [seen[i] for i in rest], length, at, d, runs=runs)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(lazy.view(torch.int32), eager.view(torch.int32))


def test_act_residual_kept_by_channel_is_the_same_gradient_transposed():
    """act_residual_kept(by_channel=True) writes the mini-batch's output gradients as [O, B, P] (each channel's rows
    side by side, for one weight-gradient product): the [B, O, P] layout's values transposed, bit for bit, with the
    same sums of squares and channel sums."""
    gen = torch.Generator().manual_seed(12)
    n, o, p = 5, 7, 37
    p0 = torch.randn(n, o, p, generator=gen)
    target = torch.randn(n, o, p, generator=gen).clamp(0.0, 1.0)
    bias = torch.randn(o, generator=gen)
    idx = torch.tensor([4, 1, 4])
    g1, g2 = torch.empty(3, o, p), torch.empty(o, 3, p)
    s1, c1 = cpu_steps.act_residual_kept(p0, idx, bias, g1, target, 0.0, 1.0, 0.0, 0.0, 0.3, True)
    s2, c2 = cpu_steps.act_residual_kept(p0, idx, bias, g2, target, 0.0, 1.0, 0.0, 0.0, 0.3, True, by_channel=True)
    assert torch.equal(g2.transpose(0, 1).view(torch.int32), g1.view(torch.int32))
    assert torch.equal(s1, s2) and torch.equal(c1, c2)


@pytest.mark.parametrize("bounds", [(0.0, 0.0), (0.5, 1.0)])
def test_act_residual_kept_without_the_loss_is_the_same_gradient(bounds):
    """act_residual_kept(want_sse=False), the iterations whose loss nobody reads: no sums of squares (None), the
    gradient and the channel sums bit for bit as with them, the clamp's bounds with and without their own gradient
    (wlo / whi: a loop of its own without them), outputs exactly at a bound, NaN and a plane with a tail (37 % 16)
    included; against the torch expression of the gradient."""
    gen = torch.Generator().manual_seed(14)
    n, o, p = 4, 6, 37
    p0 = torch.randn(n, o, p, generator=gen)
    p0[1, 0, :4] = torch.tensor([0.0, 1.0, float("nan"), -0.0])  # at lo / hi, NaN, -0 (the bias added: none below)
    target = torch.randn(n, o, p, generator=gen).clamp(0.0, 1.0)
    idx = torch.tensor([1, 3, 1])
    wlo, whi = bounds
    for bias in (None, torch.randn(o, generator=gen)):
        for by_channel in (False, True):
            shape = (o, 3, p) if by_channel else (3, o, p)
            g1, g2 = torch.empty(shape), torch.empty(shape)
            s1, c1 = cpu_steps.act_residual_kept(p0, idx, bias, g1, target, 0.0, 1.0, wlo, whi, 0.3, True,
                                                 by_channel=by_channel)
            s2, c2 = cpu_steps.act_residual_kept(p0, idx, bias, g2, target, 0.0, 1.0, wlo, whi, 0.3, True,
                                                 by_channel=by_channel, want_sse=False)
            assert s2 is None and s1 is not None
            assert torch.equal(g1.view(torch.int32), g2.view(torch.int32))
            assert torch.equal(c1.view(torch.int64), c2.view(torch.int64))  # (a NaN channel included)
            _, c3 = cpu_steps.act_residual_kept(p0, idx, bias, g2, target, 0.0, 1.0, wlo, whi, 0.3, False,
                                                by_channel=by_channel, want_sse=False)
            assert c3 is None and torch.equal(g1.view(torch.int32), g2.view(torch.int32))
            pre = p0[idx] + (0.0 if bias is None else bias.view(1, -1, 1))
            m = ((pre > 0.0) & (pre < 1.0)).float() + wlo * (pre == 0.0).float() + whi * (pre == 1.0).float()
            ref = (0.3 * (pre.clamp(0.0, 1.0) - target[idx])) * m
            got = g1.transpose(0, 1) if by_channel else g1
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("threads", [1, 2])
def test_act_residual_kept_gathers_the_inputs_side_by_side(threads):
    """act_residual_kept(by_channel=True, x=, xg=) also gathers the mini-batch's input rows as [C, B, P] in the same
    pass (the weight gradient's other operand): x[idx] transposed, bit for bit, repeated samples included, the rows
    split between threads; the gradient and sums as without the gather."""
    gen = torch.Generator().manual_seed(13)
    n, o, c, p = 6, 40, 24, 1000  # a mini-batch's gradient of 2 x 40 x 1000 floats: past PARALLEL_MIN
    p0 = torch.randn(n, o, p, generator=gen)
    target = torch.randn(n, o, p, generator=gen).clamp(0.0, 1.0)
    x = torch.randn(n, c, p, generator=gen)
    x0 = x.clone()
    idx = torch.tensor([5, 2, 5])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g1, g2 = torch.empty(o, 3, p), torch.empty(o, 3, p)
        xg = torch.full((c, 3, p), float("nan"))
        s1, c1 = cpu_steps.act_residual_kept(p0, idx, None, g1, target, 0.0, 1.0, 0.0, 0.0, 0.3, True, by_channel=True)
        s2, c2 = cpu_steps.act_residual_kept(p0, idx, None, g2, target, 0.0, 1.0, 0.0, 0.0, 0.3, True, by_channel=True,
                                             x=x, xg=xg)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(xg.view(torch.int32), x.index_select(0, idx).transpose(0, 1).contiguous().view(torch.int32))
    assert torch.equal(g1.view(torch.int32), g2.view(torch.int32)) and torch.equal(s1, s2) and torch.equal(c1, c2)
    assert torch.equal(x, x0)


def test_all_finite_reads_every_element_and_the_tail():
    """qt_all_finite (fast finetune's divergence check): NaN, +Inf and -Inf are found in the 16-element blocks and in
    the tail, the largest finite floats, subnormals and signed zeros are finite."""
    m = 16 * 5 + 3
    x = torch.zeros(m)
    x[1], x[2], x[3], x[4] = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 1e-45, -0.0
    assert cpu_steps.all_finite(x)
    for pos in (0, 17, 63, 79, 80, m - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[pos] = bad
            assert not cpu_steps.all_finite(y), (pos, bad)
    assert cpu_steps.all_finite(torch.empty(0))


@pytest.mark.parametrize("axis", [0, None])
def test_adaquant_adam_outer_folds_a_rank_b_gradient_into_the_step(axis):
    """adaquant_adam_outer (a Linear layer's rank-B weight gradient gy^T x folded into AdaQuant's Adam pass): with
    one row the product is a single rounding, so the weight, the moments and the next values are adaquant_adam's on
    the written-out outer product bit for bit; with three rows (sums as fmaf in row order) they agree with the
    written-out product to float rounding; row splits between threads give the same bits."""
    from qtorch_onnx.algorithms.fast_finetune import _FusedAdam

    gen = torch.Generator().manual_seed(21)
    out, inp = 70, 300
    w = torch.randn(out, inp, generator=gen)
    scale = (w.abs().amax(dim=1) / 100).reshape(-1, 1) if axis == 0 else w.abs().max() / 100
    layout = cpu_steps.RowLayout.of(w, scale, None, axis)
    for rows in (1, 3):
        gy = torch.randn(rows, out, generator=gen)
        x = torch.randn(rows, inp, generator=gen)
        grad = cpu_steps.OuterGradient(gy, x)
        assert grad.shape == w.shape
        results = []
        for mode in ("dense", "outer1", "outer2"):
            p = w.clone()
            opt = _FusedAdam([p], 1e-1)
            before = torch.get_num_threads()
            torch.set_num_threads(2 if mode == "outer2" else 1)
            old_min = cpu_steps.PARALLEL_MIN
            cpu_steps.PARALLEL_MIN = 1  # rows split between the threads even here
            try:
                for _ in range(3):
                    if mode == "dense":
                        _, outside = cpu_steps.adaquant_values(layout, p, -128, 127)
                        nxt = cpu_steps.adaquant_adam(layout, p, grad.dense(), outside, opt.fused_moments(p),
                                                      next_range=(-128, 127))
                    else:
                        nxt = cpu_steps.adaquant_adam_outer(layout, p, grad, opt.fused_moments(p), (-128, 127),
                                                            next_mask=True)
            finally:
                cpu_steps.PARALLEL_MIN = old_min
                torch.set_num_threads(before)
            results.append((p, *opt.state[id(p)][:2], *nxt))
        dense, outer1, outer2 = results
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(outer1, outer2))
        if rows == 1:
            assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(dense, outer1))
        else:
            torch.testing.assert_close(outer1[0], dense[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(outer1[1], dense[1], rtol=1e-4, atol=1e-6)


def test_direct_linear_gradient_factored_is_the_written_out_one():
    """DirectLayerLoss.gradient(factored=True) of a Linear layer gives its weight gradient as gy^T x
    (cpu_steps.OuterGradient), whose written-out product is the unfactored gradient; the bias gradient and the loss
    are the same; a mini-batch of more than OUTER_MAX_RANK rows stays written out."""
    from qtorch_onnx.algorithms import reconstruction as rc

    gen = torch.Generator().manual_seed(22)
    lin = torch.nn.Linear(40, 30)
    x = torch.randn(12, 40, generator=gen)
    with torch.no_grad():
        target = lin(x).clamp(0.0, 6.0) + 0.1 * torch.randn(12, 30, generator=gen)
    clamp = (0.0, 6.0, 0.0, 0.0)
    loss = rc.DirectLayerLoss(lin, x, target, clamp, lin.bias.detach().clone())
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    gw, gb, lv = loss.gradient([3, 7], w, 1.0, bias=b)
    fw, fb, fv = loss.gradient([3, 7], w, 1.0, bias=b, factored=True)
    assert isinstance(fw, cpu_steps.OuterGradient) and fw.shape == w.shape
    torch.testing.assert_close(fw.dense(), gw, rtol=1e-6, atol=1e-7)
    assert torch.equal(fb, gb) and float(fv) == float(lv)
    many = list(range(rc.OUTER_MAX_RANK + 1))
    assert isinstance(loss.gradient(many, w, 1.0, bias=b, factored=True)[0], torch.Tensor)


@pytest.mark.parametrize("axis", [None, 0])
def test_adaquant_adam_finds_the_kept_diff_in_its_pass(axis):
    """adaquant_adam with a KeptDiff: the weight, moments and next values of the plain step, and the kept
    outputs' change log (entries, differences, w0 updated, count) kept_diff finds on those next values, at an
    offset into the log; over the cap: the count, w0 left as it was. Learning rates that move a few entries to most
    of them."""
    from qtorch_onnx.algorithms.fast_finetune import _FusedAdam

    gen = torch.Generator().manual_seed(31)
    out, inp = 40, 75  # 3000 entries: chunks of ACH and a tail
    w = torch.randn(out, inp, generator=gen)
    scale = (w.abs().amax(dim=1) / 100).reshape(-1, 1) if axis == 0 else w.abs().max() / 100
    layout = cpu_steps.RowLayout.of(w, scale, None, axis)
    gwq = torch.randn(out, inp, generator=gen)
    for lr, cap in ((1e-4, 600), (3e-3, 600), (3e-2, 60)):
        p_ref, p_new = w.clone(), w.clone()
        o_ref, o_new = _FusedAdam([p_ref], lr), _FusedAdam([p_new], lr)
        w0_ref = cpu_steps.adaquant_values(layout, w, -128, 127)[0]
        w0_new = w0_ref.clone()
        at_ref, d_ref = torch.zeros(cap + 9, dtype=torch.int64), torch.zeros(cap + 9)
        at_new, d_new = torch.zeros(cap + 9, dtype=torch.int64), torch.zeros(cap + 9)
        nxt_ref = cpu_steps.adaquant_adam(layout, p_ref, gwq, None, o_ref.fused_moments(p_ref), (-128, 127), False)
        k_ref = cpu_steps.kept_diff(nxt_ref[0], w0_ref, at_ref, d_ref, 9, cap)
        diff = cpu_steps.KeptDiff(w0_new, at_new, d_new, 9, cap)
        nxt_new = cpu_steps.adaquant_adam(layout, p_new, gwq, None, o_new.fused_moments(p_new), (-128, 127), False,
                                          diff=diff)
        assert torch.equal(p_new.view(torch.int32), p_ref.view(torch.int32))
        assert torch.equal(nxt_new[0].view(torch.int32), nxt_ref[0].view(torch.int32))
        assert all(torch.equal(a, b) for a, b in zip(o_new.state[id(p_new)][:2], o_ref.state[id(p_ref)][:2]))
        assert diff.found == k_ref > 0 and diff.values is nxt_new[0]
        n = min(k_ref, cap)
        assert torch.equal(at_new[9:9 + n], at_ref[9:9 + n]) and torch.equal(d_new[9:9 + n], d_ref[9:9 + n])
        assert torch.equal(w0_new.view(torch.int32), w0_ref.view(torch.int32))
        if lr == 3e-2:
            assert k_ref > cap  # over the cap: w0 untouched on both
    with pytest.raises(ValueError, match="diff needs next_range"):
        cpu_steps.adaquant_adam(layout, w.clone(), gwq, torch.zeros_like(w), o_ref.fused_moments(p_ref),
                                diff=cpu_steps.KeptDiff(w0_ref, at_ref, d_ref, 0, 4))


@pytest.mark.parametrize("kernel,stride", [((3, 3), (2, 2)), ((5, 5), (1, 1)), ((3, 5), (2, 1))])
@pytest.mark.parametrize("pads", [(0, 0, 1, 1), (1, 1, 1, 1), (0, 2, 1, 0), (2, 0, 0, 3)])
def test_depthwise_forward_reads_asymmetric_padding(kernel, stride, pads):
    """depthwise_forward with (top, left, bottom, right) pads on the unpadded planes: the bits of depthwise_forward
    on the zero-padded tensor (what an ONNX Pad before the convolution writes out), and torch's convolution to
    float rounding."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(sum(pads) + kernel[1] + stride[1])
    x = torch.randn(3, 5, 17, 19, generator=g)
    w = torch.randn(5, 1, *kernel, generator=g)
    bias = torch.randn(5, generator=g)
    idx = torch.tensor([2, 0], dtype=torch.int64)
    t, l, b, r = pads
    padded = F.pad(x, (l, r, t, b)).contiguous()
    want = cpu_steps.depthwise_forward(padded, idx, w, bias, kernel, stride, (0, 0))
    got = cpu_steps.depthwise_forward(x, idx, w, bias, kernel, stride, pads)
    assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))
    ref = F.conv2d(padded[idx], w, bias, stride, 0, 1, 5)
    assert (got - ref).abs().max() < 1e-4
