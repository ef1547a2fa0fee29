"""qtorch_onnx.heap: glibc's heap tuned for large tensors while the algorithms run, restored afterwards."""
from __future__ import annotations

import threading

import pytest

from qtorch_onnx import heap


class _FakeLibc:
    """Records mallopt calls instead of changing the process's heap."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


@pytest.fixture
def fake(monkeypatch):
    lib = _FakeLibc()
    monkeypatch.setattr(heap, "_glibc", lambda: lib)
    monkeypatch.delenv("QTORCH_ONNX_TUNE_HEAP", raising=False)
    return lib


TUNED = [(heap.M_MMAP_THRESHOLD, 32 << 20), (heap.M_TRIM_THRESHOLD, 1 << 30), (heap.M_TOP_PAD, 256 << 20)]
RESTORED = [(heap.M_TRIM_THRESHOLD, 64 << 20), (heap.M_TOP_PAD, 128 << 10)]


def test_outermost_block_tunes_and_restores(fake):
    with heap.large_tensor_heap():
        assert fake.calls == TUNED
        with heap.large_tensor_heap():  # nested: nothing more
            pass
        assert fake.calls == TUNED
    assert fake.calls == TUNED + RESTORED
    with pytest.raises(KeyError):  # restored on errors too
        with heap.large_tensor_heap():
            raise KeyError("x")
    assert fake.calls == (TUNED + RESTORED) * 2 and heap._depth == 0


def test_threads_share_one_tuning(fake):
    inside, leave = threading.Barrier(3), threading.Event()

    def work():
        with heap.large_tensor_heap():
            inside.wait()
            leave.wait()

    workers = [threading.Thread(target=work) for _ in range(2)]
    for w in workers:
        w.start()
    inside.wait()
    assert fake.calls == TUNED  # both threads inside: tuned once
    leave.set()
    for w in workers:
        w.join()
    assert fake.calls == TUNED + RESTORED


def test_switched_off_by_the_environment(fake, monkeypatch):
    monkeypatch.setenv("QTORCH_ONNX_TUNE_HEAP", "0")
    assert not heap.heap_tuning_available()
    with heap.large_tensor_heap():
        pass
    assert fake.calls == []


def test_without_glibc_nothing_happens(monkeypatch):
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    assert not heap.heap_tuning_available()
    with heap.large_tensor_heap():
        assert heap._depth == 1 and not heap._tuned
    assert heap._depth == 0


def test_the_algorithms_run_inside_it(fake):
    """calibrate and fast_finetune tune the heap while they run (the mallopt calls happen inside them)."""
    import qtorch_onnx as qo

    from .quant.small_models import calib_data, cnn

    qm = qo.prepare(cnn(), "A8W8")
    qo.calibrate(qm, calib_data(4), progress=False)
    assert fake.calls == TUNED + RESTORED
    qo.fast_finetune(qm, calib_data(4), algorithm="adaround", num_iterations=2, batch_size=2, progress=False)
    assert fake.calls == (TUNED + RESTORED) * 2


def test_real_glibc_probe_is_harmless():
    """On this machine: the probe answers, and a real tuned block leaves the depth at zero."""
    available = heap.heap_tuning_available()
    assert isinstance(available, bool)
    with heap.large_tensor_heap():
        assert heap._tuned == available
    assert heap._depth == 0 and not heap._tuned
