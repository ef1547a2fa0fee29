"""Distributed calibration (qtorch_onnx.distributed): 2 CPU processes (gloo, 127.0.0.1), each calibrating an
uneven shard of the data and merging the observers after each pass, give scales and zero points bit-identical
to one process calibrating all the data with ``qo.calibrate``; graph / observer mismatches raise on every rank;
one DDP QAT step leaves both ranks with identical weights.

One pair of processes (``torch.multiprocessing.start_processes``, fork; module fixture shared by the
pytest-xdist workers) runs every scenario with ``qo.calibrate`` and with an explicit harness calling
``sync_observers``; the tests read its results."""
from __future__ import annotations

import datetime
import functools
import os
import socket
import time

import numpy as np
import pytest
import torch

import qtorch_onnx as qo
from qtorch_onnx import data as _data
from qtorch_onnx.distributed import check_same_graph, sync_observers
from qtorch_onnx.errors import DataError, ModelError
from qtorch_onnx.observers import MinMaxObserver, PercentileObserver
from qtorch_onnx.calibration import finalize_qparams

from .small_models import calib_data, cnn

WORLD = 2
N_SAMPLES = 8
SPLIT = 3  # rank 0 takes samples [0, 3), rank 1 [3, 8): uneven, contiguous (the moving average is ordered);
# batches of 3 and 2 on the ranks, 8 in one process: never 1, since CPU convolutions round batches of 1
# differently (an ulp) from larger ones, which changes the activations (not the merge)


def _config(method: str):
    """Named or derived configurations covering every calibration method."""
    named = {"MinMax": "A8W8", "MinMaxMovingAverage": "INT8_TRANSFORMER_DEFAULT", "Percentile": "S8S8_AAWS",
             "MinMSE": "XINT8"}
    if method in named:
        cfg = qo.get_default_config(named[method])
    else:
        cfg = qo.get_default_config("A8W8")
        cfg.calibrate_method = (qo.PowerOfTwoMethod.NonOverflow if method == "NonOverflow"
                                else getattr(qo.CalibrationMethod, method))
    return qo.Config(global_quant_config=cfg)


METHODS = ["MinMax", "MinMaxMovingAverage", "Percentile", "Entropy", "Distribution", "NonOverflow", "MinMSE"]


def _qparams(qm) -> dict:
    """``{key: (scale as int32 bits, zero point)}`` of every quantizer with integer qparams."""
    out = {}
    for k, fq in qm.quantizers().items():
        if getattr(fq, "scale", None) is not None:
            out[k] = (fq.scale.detach().cpu().contiguous().view(torch.int32).numpy().copy(),
                      fq.zero_point.detach().cpu().numpy().copy())
    return out


def _calibrate_sharded(qm, data, batch_size: int = 3):
    """What ``qo.calibrate`` does (switches, passes, finalize), calling ``sync_observers`` itself on a list of
    observers after each pass, before ``start_second_pass``."""
    samples = _data.to_samples(data, qm.input_specs)
    fqs = qm.quantizers()
    observed = [fq for fq in fqs.values() if fq.calibratable]
    for fq in observed:
        fq.observer.reset()
    qm.set_mode("float")
    for fq in observed:
        fq.observer_enabled = True
    passes = 2 if any(fq.observer.needs_second_pass for fq in observed) else 1
    qm.eval()
    with torch.no_grad():
        for p in range(passes):
            if p == 1:
                for fq in observed:
                    if fq.observer.needs_second_pass:
                        fq.observer.start_second_pass()
            for batch in _data.batches(samples, qm.input_specs, batch_size):
                qm(*batch)
            sync_observers([fq.observer for fq in observed])
    finalize_qparams(qm)
    qm.set_mode("quantize")
    return qm


def _shard(rank: int):
    data = calib_data(N_SAMPLES)
    return data[:SPLIT] if rank == 0 else data[SPLIT:]


def _expect(exc_type, fn) -> str:
    try:
        fn()
    except exc_type as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores; the reference uses 1 thread too (see _one_process)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    res: dict = {"calibrate": {}, "harness": {}, "seconds": {}}
    try:
        shard = _shard(rank)
        for method in METHODS:
            t0 = time.perf_counter()
            qm = qo.prepare(cnn(), _config(method))
            check_same_graph(qm)
            # qo.calibrate on the shard: it merges the observers after each pass itself
            res["calibrate"][method] = _qparams(qo.calibrate(qm, shard, batch_size=3, progress=False))
            if method == "MinMax":
                qat = qm
            if method != "Entropy":  # the same through the explicit harness (Entropy's KL search costs ~4 s)
                res["harness"][method] = _qparams(_calibrate_sharded(qo.prepare(cnn(), _config(method)), shard))
            res["seconds"][method] = time.perf_counter() - t0
        t0 = time.perf_counter()

        # ranks with different models: different weights; same model, different quantizers
        res["graph_error"] = _expect(ModelError, lambda: check_same_graph(qo.prepare(cnn(seed=rank), "A8W8")))
        res["keys_error"] = _expect(ModelError, lambda: check_same_graph(
            qo.prepare(cnn(), "A8W8" if rank == 0 else "A16W8")))

        # different observer lists: the first differing one is named
        obs = [MinMaxObserver(name="a"), MinMaxObserver(name="b" if rank == 0 else "c")]
        res["names_error"] = _expect(ModelError, lambda: sync_observers(obs))

        # second pass started from the local (unmerged) pass-1 range: the edges differ across ranks
        p = PercentileObserver(name="t")
        x = torch.full((4,), 1.0 + rank)
        p.update(x)
        p.start_second_pass()
        p.update(x)
        res["edges_error"] = _expect(DataError, lambda: p.all_reduce_())

        # one DDP QAT step on rank-specific data, from the A8W8 model calibrated above
        qm = qat
        qm.train()
        ddp = torch.nn.parallel.DistributedDataParallel(qm)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        x = torch.from_numpy(np.concatenate([d["input"] for d in shard[:2]]))
        loss = -torch.log(ddp(x)[:, rank] + 1e-6).mean()
        opt.zero_grad()
        loss.backward()
        res["grads"] = {n: p.grad.detach().clone() for n, p in qm.named_parameters() if p.grad is not None}
        before = {n: p.detach().clone() for n, p in qm.named_parameters()}
        opt.step()
        res["params"] = {n: p.detach().clone() for n, p in qm.named_parameters()}
        res["changed"] = sorted(n for n, p in res["params"].items() if not torch.equal(p, before[n]))
        res["seconds"]["errors+ddp"] = time.perf_counter() - t0
    finally:
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out) -> None:
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the children inherit it: 127.0.0.1 only
    try:
        # fork: the children start with torch and qtorch_onnx already imported (spawn costs ~5 s more here)
        torch.multiprocessing.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True,
                                              start_method="fork")
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every scenario on 2 gloo ranks once per test session (under pytest-xdist the first worker runs
    them and the others wait for its results); returns ``[rank 0 results, rank 1 results]``."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    from filelock import FileLock  # a torch dependency

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by this session's xdist workers
    out = base / "qtorch_onnx_distributed"
    with FileLock(str(out) + ".lock"):
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            _run_workers(out)
            (out / "done").write_text("ok")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@functools.lru_cache(maxsize=None)
def _one_process(method: str, n_first: int = N_SAMPLES) -> dict:
    """``qo.calibrate`` in this process, with the workers' thread count: CPU kernels (convolutions) may
    round differently with another number of threads, which changes the activations, not the merge."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        qm = qo.prepare(cnn(), _config(method))
        qo.calibrate(qm, calib_data(N_SAMPLES)[:n_first], batch_size=8, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert any(fq.observer is not None for fq in qm.quantizers().values())
    return _qparams(qm)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", ["calibrate", "harness"])
def test_sharded_calibration_matches_one_process_bit_for_bit(runs, method, path):
    if method not in runs[0][path]:
        pytest.skip(f"{method} runs through qo.calibrate only (test time)")
    ref = _one_process(method)
    for rank, res in enumerate(runs):
        got = res[path][method]
        assert sorted(got) == sorted(ref)
        for k in ref:
            assert np.array_equal(got[k][0], ref[k][0]), (method, rank, k, got[k][0], ref[k][0])
            assert np.array_equal(got[k][1], ref[k][1]), (method, rank, k, got[k][1], ref[k][1])


def test_shards_differ_from_each_other(runs):
    # the merge matters: a rank on its shard alone would give other scales
    alone, merged = _one_process("MinMax", SPLIT), runs[0]["calibrate"]["MinMax"]
    assert any(not np.array_equal(alone[k][0], merged[k][0]) for k in merged)


def test_check_same_graph_names_the_differing_ranks(runs):
    for res in runs:  # raised on every rank alike
        assert res["graph_error"].startswith("ModelError"), res["graph_error"]
        assert "ONNX graph of rank(s) 1" in res["graph_error"]
        assert res["keys_error"].startswith("ModelError"), res["keys_error"]
        assert "quantizers (keys and formats) of rank(s) 1" in res["keys_error"]


def test_sync_observers_names_the_first_differing_observer(runs):
    for res in runs:
        msg = res["names_error"]
        assert msg.startswith("ModelError") and "position 1" in msg, msg
        assert "'b'" in msg and "'c'" in msg, msg


def test_second_pass_without_merging_pass_one_raises(runs):
    for res in runs:
        msg = res["edges_error"]
        assert msg.startswith("DataError") and "histogram bin edges differ across ranks" in msg, msg
        assert "'t'" in msg, msg


def test_ddp_qat_step_leaves_ranks_identical(runs):
    r0, r1 = runs
    assert r0["changed"] and r0["changed"] == r1["changed"]
    assert sorted(r0["grads"]) == sorted(r1["grads"]) and r0["grads"]
    for n in r0["grads"]:  # DDP averaged the different local gradients
        assert torch.equal(r0["grads"][n], r1["grads"][n]), n
    for n in r0["params"]:
        assert torch.equal(r0["params"][n], r1["params"][n]), n
