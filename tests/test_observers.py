"""Calibration observers (qtorch_onnx.observers) vs direct numpy computations and ONNX Runtime's own
HistogramCollector; batch-size independence (bit-identical qparams) for every observer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from qtorch_onnx.errors import ConfigError, DataError
from qtorch_onnx.formats.spec import INT8, INT16, UINT8
from qtorch_onnx.observers import (
    DistributionObserver, EntropyObserver, MinMaxObserver, PercentileObserver, PowerOfTwoObserver, make_observer,
)


def _data(seed=0, n=24, shape=(3, 16, 16), kind="normal"):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal((n, *shape)) * 2.0 + 0.3
    elif kind == "laplace":
        x = rng.laplace(0.0, 1.0, (n, *shape))
    else:
        x = rng.uniform(-1.0, 3.0, (n, *shape))
    x = x.astype(np.float32)
    x[5, 0, 0, 0] = 40.0  # outliers
    x[min(11, n - 1), 1, 2, 3] = -25.0
    return x


def _feed(obs, x: np.ndarray, bs: int):
    t = torch.from_numpy(x)
    for i in range(0, len(t), bs):
        obs.update(t[i:i + bs])
    if obs.needs_second_pass:
        obs.start_second_pass()
        for i in range(0, len(t), bs):
            obs.update(t[i:i + bs])
    return obs


# ------------------------------------------------------------------------------------------------------ MinMax
def test_minmax_per_tensor_and_channel():
    x = _data()
    o = _feed(MinMaxObserver(), x, 5)
    lo, hi = o.compute_range()
    assert lo.dtype == torch.float64 and lo.item() == float(x.min()) and hi.item() == float(x.max())
    o = _feed(MinMaxObserver(axis=1), x, 7)
    lo, hi = o.compute_range()
    assert lo.tolist() == x.min(axis=(0, 2, 3)).astype(np.float64).tolist()
    assert hi.tolist() == x.max(axis=(0, 2, 3)).astype(np.float64).tolist()
    s, z = o.compute_qparams(INT8, symmetric=True)
    a = np.maximum(np.abs(x.min(axis=(0, 2, 3))), x.max(axis=(0, 2, 3))).astype(np.float64)
    assert np.array_equal(s.numpy(), (a / 127).astype(np.float32)) and z.tolist() == [0, 0, 0]


def test_minmax_moving_average_per_sample():
    x = _data(n=10)
    o = _feed(MinMaxObserver(moving_average=True, averaging_constant=0.01), x, 3)
    lo, hi = o.compute_range()
    rmin, rmax = float(x[0].min()), float(x[0].max())
    for k in range(1, len(x)):
        rmin = rmin + 0.01 * (float(x[k].min()) - rmin)
        rmax = rmax + 0.01 * (float(x[k].max()) - rmax)
    assert lo.item() == rmin and hi.item() == rmax
    with pytest.raises(ConfigError, match="dim 0"):
        MinMaxObserver(axis=0, moving_average=True).update(torch.zeros(2, 3))


# --------------------------------------------------------------------------------------------------- Percentile
@pytest.mark.parametrize("p", [99.999, 99.9, 90.0])
def test_percentile_vs_numpy(p):
    x = _data(kind="laplace")
    o = _feed(PercentileObserver(percentile=p), x, 4)
    a = np.abs(x).ravel()
    amax = np.float32(a.max())
    hist, edges = np.histogram(a, bins=2048, range=(np.float32(0), amax))
    counts, my_edges = o.histogram
    assert np.array_equal(counts.numpy(), hist)
    assert np.array_equal(my_edges.numpy(), edges.astype(np.float32))
    cum = np.cumsum(hist)
    idx = int(np.argmax(cum / cum[-1] >= p / 100))
    t = np.float64(edges.astype(np.float32)[idx])
    lo, hi = o.compute_range()
    assert lo.item() == max(-t, float(x.min())) and hi.item() == min(t, float(x.max()))
    assert 0 < hi.item() < float(x.max())


def test_percentile_clamps_to_observed_range():
    x = np.abs(_data(kind="uniform")) + 0.5  # all positive: -t is below the observed min
    o = _feed(PercentileObserver(percentile=100.0), x, 8)
    lo, hi = o.compute_range()
    counts, edges = o.histogram
    assert lo.item() == float(x.min())
    # p = 100: the left edge of the top non-empty bin (docs/numerics.md: left edge of the first bin reaching p)
    top = int(np.nonzero(counts.numpy())[0].max())
    assert hi.item() == float(edges[top]) < float(x.max())


def test_percentile_widens():
    o = PercentileObserver(num_bins=4)
    o.update(torch.tensor([-1.0, 2.0]))
    o.start_second_pass()
    o.update(torch.tensor([-1.0, 2.0, 3.1]))  # larger than pass 1: bins of width 0.5 are added
    counts, edges = o.histogram
    assert edges.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert counts.tolist() == [0, 0, 1, 0, 1, 0, 1]


# ------------------------------------------------------------------------------------------------------ Entropy
@pytest.mark.parametrize("kind,nbins", [("normal", 2048), ("laplace", 2048), ("laplace", 512)])
def test_entropy_vs_onnxruntime(kind, nbins, monkeypatch):
    """Same histogram as np.histogram; per-candidate KL equal to ONNX Runtime's get_entropy_threshold (which
    computes in float32, hence the 1e-4 relative tolerance); the chosen threshold is ORT's, or one whose KL
    ties ORT's minimum within that float32 noise (flat KL regions)."""
    calibrate = pytest.importorskip("onnxruntime.quantization.calibrate")
    pytest.importorskip("scipy")
    from qtorch_onnx.observers import entropy_threshold_index

    x = _data(kind=kind, seed=3)
    o = _feed(EntropyObserver(num_bins=nbins, num_quantized_bins=128), x, 6)
    t = np.float32(max(abs(x.min()), abs(x.max())))
    hist, edges = np.histogram(x.ravel(), nbins, range=(-t, t))
    counts, my_edges = o.histogram
    assert np.array_equal(counts.numpy(), hist)
    assert np.array_equal(my_edges.numpy(), edges)
    captured = {}
    real_argmin = np.argmin

    def spy(a, *args, **kw):
        captured["kl"] = np.array(a, dtype=np.float64)
        return real_argmin(a, *args, **kw)

    monkeypatch.setattr(calibrate.np, "argmin", spy)
    coll = calibrate.HistogramCollector("entropy", True, nbins, 128, 99.999, "same")
    ort_lo, ort_hi = coll.get_entropy_threshold((hist, edges, x.min(), x.max(), t), 128)
    monkeypatch.undo()
    ort_kl = captured["kl"]
    best, kl = entropy_threshold_index(counts, 128)
    kl = kl.numpy()
    assert kl.shape == ort_kl.shape
    np.testing.assert_allclose(kl, ort_kl, rtol=1e-4)
    ort_best = int(real_argmin(ort_kl))
    assert abs(kl[ort_best] - kl[best]) <= 1e-4 * kl[best]
    lo, hi = o.compute_range()
    i = 64 + best
    assert (lo.item(), hi.item()) == (max(float(edges[nbins // 2 - i]), float(x.min())),
                                      min(float(edges[min(nbins // 2 + i + 1, nbins)]), float(x.max())))
    if best == ort_best:
        assert (lo.item(), hi.item()) == (float(ort_lo), float(ort_hi))
    assert hi.item() < float(x.max())  # the outliers are cut


def test_entropy_matches_onnxruntime_exactly_on_a_clear_minimum():
    calibrate = pytest.importorskip("onnxruntime.quantization.calibrate")
    pytest.importorskip("scipy")
    x = _data(kind="uniform", seed=9)
    o = _feed(EntropyObserver(num_bins=512), x, 6)
    t = np.float32(max(abs(x.min()), abs(x.max())))
    hist, edges = np.histogram(x.ravel(), 512, range=(-t, t))
    coll = calibrate.HistogramCollector("entropy", True, 512, 128, 99.999, "same")
    ort_lo, ort_hi = coll.get_entropy_threshold((hist, edges, x.min(), x.max(), t), 128)
    lo, hi = o.compute_range()
    assert (lo.item(), hi.item()) == (float(ort_lo), float(ort_hi))


def test_distribution_vs_numpy():
    x = _data(seed=4)
    o = _feed(DistributionObserver(num_bins=1024), x, 5)
    lo, hi = o.compute_range()
    t = np.float32(max(abs(x.min()), abs(x.max())))
    hist, edges = np.histogram(x.ravel(), 1024, range=(-t, t))
    v = (edges[:-1].astype(np.float64) + edges[1:]) * 0.5
    avg = (hist * v).sum() / hist.sum()
    std = np.sqrt((hist * v ** 2).sum() / hist.sum() - avg ** 2)
    assert lo.item() == -float(t) and hi.item() == float(t)
    assert abs(o.avg.item() - avg) < 1e-12 and abs(o.std.item() - std) < 1e-12
    assert abs(o.avg.item() - float(x.mean())) < 0.01


# ------------------------------------------------------------------------------------------------ power of two
def _quark_pos_overflow(x, bits=8):
    lb, ub = -(2 ** (bits - 1)) - 0.5, 2 ** (bits - 1) - 0.5
    scale = max(float(x.min()) / lb, float(x.max()) / ub)
    return int(np.floor(np.log2(1 / scale)))


def _np_sse(x, pos, bits=8):
    s = np.float32(2.0 ** -pos)
    q = np.clip(np.round(x / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s
    return float(((q.astype(np.float64) - x.astype(np.float64)) ** 2).sum())


@pytest.mark.parametrize("kind", ["normal", "laplace", "uniform"])
def test_pow2_vs_numpy(kind):
    x = _data(kind=kind, seed=5)
    p0 = _quark_pos_overflow(x)
    o = _feed(PowerOfTwoObserver("NonOverflow"), x, 4)
    s, z = o.compute_qparams(INT8, True)
    assert s.item() == 2.0 ** -p0 and z.item() == 0
    sses = [_np_sse(x, p0 + k) for k in range(5)]
    best = p0 + int(np.argmin(sses))
    o = _feed(PowerOfTwoObserver("MinMSE"), x, 4)
    s, z = o.compute_qparams(INT8, True)
    assert s.item() == 2.0 ** -best
    assert best > p0  # outliers: clipping them is cheaper than a coarse scale
    lo, hi = o.compute_range()
    assert lo.item() == -128 * s.item() and hi.item() == 127 * s.item()
    with pytest.raises(ConfigError):
        o.compute_qparams(INT16, True)


# ---------------------------------------------------------------------------------------- batch independence
FACTORIES = {
    "MinMax": lambda: MinMaxObserver(),
    "MinMaxPerChannel": lambda: MinMaxObserver(axis=1),
    "MinMaxMA": lambda: MinMaxObserver(moving_average=True),
    "MinMaxMAPerChannel": lambda: MinMaxObserver(axis=1, moving_average=True),
    "Percentile": lambda: PercentileObserver(),
    "Entropy": lambda: EntropyObserver(num_bins=512),
    "Distribution": lambda: DistributionObserver(),
    "NonOverflow": lambda: PowerOfTwoObserver("NonOverflow"),
    "MinMSE": lambda: PowerOfTwoObserver("MinMSE"),
    "MinMSE_UINT8_asym": lambda: PowerOfTwoObserver("MinMSE", fmt=UINT8, symmetric=False),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_batch_size_independence(name):
    x = _data(seed=7, n=24, shape=(3, 8, 8), kind="laplace")
    results = []
    for bs in (1, 3, 8, len(x)):
        o = _feed(FACTORIES[name](), x, bs)
        if isinstance(o, PowerOfTwoObserver):
            s, z = o.compute_qparams(o.fmt, o.symmetric)
        else:
            s, z = o.compute_qparams(UINT8, symmetric=False)
        lo, hi = o.compute_range()
        results.append((s.numpy().view(np.uint32).tolist(), z.tolist(),
                        lo.numpy().view(np.uint64).tolist(), hi.numpy().view(np.uint64).tolist()))
    assert all(r == results[0] for r in results[1:]), results


# ------------------------------------------------------------------------------------------------ errors, API
@pytest.mark.parametrize("name", list(FACTORIES))
def test_nan_inf_raise_data_error(name):
    o = FACTORIES[name]()
    o.name = "act/relu_3"
    with pytest.raises(DataError, match="act/relu_3"):
        o.update(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(DataError, match="NaN/Inf"):
        o.update(torch.tensor([[1.0, float("inf")], [0.0, 1.0]]))


@pytest.mark.parametrize("kw", [{}, {"axis": 1}, {"axis": 1, "moving_average": True}, {"moving_average": True}])
def test_minmax_bad_batch_raises_with_its_count_and_leaves_no_trace(kw):
    """MinMax checks finiteness from the batch's own minima / maxima (no separate pass): NaN, +Inf, -Inf each
    raise with the count of bad values, and the range observed before the bad batch is kept."""
    o = MinMaxObserver(name="act/x", **kw)
    o.update(torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, 1.0]]))
    before = [t.clone() for t in o.compute_range()]
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.tensor([[1.0, bad, 0.5], [bad, 3.0, 1.0]])
        with pytest.raises(DataError, match=r"'act/x' contains 2 NaN/Inf"):
            o.update(x)
        after = o.compute_range()
        assert all(torch.equal(a, b) for a, b in zip(before, after)), (bad, before, after)


def test_two_pass_protocol_errors():
    o = PercentileObserver(name="t0")
    with pytest.raises(DataError, match="no data"):
        o.compute_range()
    o.update(torch.randn(4, 4))
    with pytest.raises(DataError, match="second pass"):
        o.compute_range()
    e = EntropyObserver(name="t1")
    e.update(torch.tensor([-1.0, 1.0]))
    e.start_second_pass()
    with pytest.raises(DataError, match="exceeds"):
        e.update(torch.tensor([5.0]))


def test_zero_data():
    for name in FACTORIES:
        o = FACTORIES[name]()
        _feed(o, np.zeros((4, 3, 2, 2), np.float32), 2)
        if isinstance(o, PowerOfTwoObserver):
            s, z = o.compute_qparams(o.fmt, o.symmetric)
        else:
            s, z = o.compute_qparams(INT8, symmetric=True)
        assert torch.all(s == 1.0), name


def test_factory():
    assert isinstance(make_observer("MinMax"), MinMaxObserver)
    assert isinstance(make_observer("percentile", percentile=99.9), PercentileObserver)
    assert make_observer("MinMSE", fmt=INT16).method == "MinMSE"
    assert make_observer("NonOverflow").method == "NonOverflow"
    assert isinstance(make_observer("Entropy", num_bins=512), EntropyObserver)
    assert isinstance(make_observer("Distribution"), DistributionObserver)
    with pytest.raises(ConfigError, match="valid: MinMax, Percentile"):
        make_observer("Entrophy")
    with pytest.raises(ConfigError, match="did you mean 'Entropy'"):
        make_observer("Entrophy")
    with pytest.raises(ConfigError, match="num_binz"):
        make_observer("Percentile", num_binz=3)
    with pytest.raises(ConfigError, match="fmt"):
        make_observer("MinMax", fmt=INT8)


def test_input_not_mutated_and_reset():
    x = torch.randn(4, 5)
    before = x.clone()
    o = _feed(PercentileObserver(), x.numpy(), 2)
    o.compute_range()
    assert torch.equal(x, before)
    o.reset()
    with pytest.raises(DataError):
        o.compute_range()


def _all_observers():
    return [MinMaxObserver(name="mm"), MinMaxObserver(axis=1, name="mmc"), MinMaxObserver(moving_average=True),
            PercentileObserver(), EntropyObserver(), DistributionObserver(),
            PowerOfTwoObserver("NonOverflow"), PowerOfTwoObserver("MinMSE")]


def test_all_reduce_is_a_noop_without_a_process_group():
    # qtorch_onnx.distributed merges only when torch.distributed is initialized with world size > 1
    # (2-process merges: tests/quant/test_distributed.py)
    x = _data(n=6)
    for obs in _all_observers():
        _feed(obs, x, 4)
        before = obs.compute_range()
        assert obs.all_reduce_() is obs
        after = obs.compute_range()
        assert all(torch.equal(a, b) for a, b in zip(before, after)), type(obs).__name__
    ma = MinMaxObserver(moving_average=True)
    ma.update(torch.from_numpy(x))
    assert ma._ma_log == [] and ma._ma_rows == 6  # per-sample ranges are only recorded for a merge


def test_merge_layout_rejects_disagreeing_ranks():
    obs = MinMaxObserver(axis=1, name="conv_out")
    with pytest.raises(DataError, match="different calibration passes.*rank 1: 2"):
        obs._merge_layout([[1, 3], [2, 3]])
    with pytest.raises(DataError, match="'conv_out'.*different channel counts"):
        obs._merge_layout([[1, 3], [1, 4]])
    assert obs._merge_layout([[1, -1], [1, 4]])["nchan"] == 4  # a rank without data takes the others' shape
    p = PercentileObserver(name="t")
    with pytest.raises(DataError, match="the histogram has different sizes"):
        p._merge_layout([[2, 0, 2048, 2049], [2, 0, -1, -1]])
