"""float32_exact: TF32 off while the algorithms run (a finetune on a GPU with torch's default TF32 convolutions
lost to the CPU's: docs/benchmarks.md, "Third GPU run"), the caller's settings back afterwards. The flags are
plain torch settings, so this runs without CUDA."""
from __future__ import annotations

import threading

import pytest
import torch

import qtorch_onnx as qo
from qtorch_onnx import precision

from ..quant.small_models import calib_data, cnn


def _flags():
    return (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
            torch.get_float32_matmul_precision())


@pytest.fixture
def tf32_on():
    """torch's CUDA defaults for convolutions (TF32 allowed) plus TF32 products, restored after the test."""
    saved = _flags()
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")  # allows TF32 products
    yield _flags()
    torch.backends.cudnn.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[2])
    torch.backends.cuda.matmul.allow_tf32 = saved[1]


def test_context_turns_tf32_off_and_restores(tf32_on):
    assert tf32_on == (True, True, "high")
    with qo.float32_exact():
        assert _flags() == (False, False, "highest")
        with qo.float32_exact():  # nested: the inner exit keeps it off
            pass
        assert _flags() == (False, False, "highest")
    assert _flags() == tf32_on


def test_restored_after_an_error(tf32_on):
    @qo.float32_exact()
    def boom():
        assert _flags() == (False, False, "highest")
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        boom()
    assert _flags() == tf32_on
    assert boom.__name__ == "boom"


def test_threads_restore_at_the_outermost_exit(tf32_on):
    inside, release = threading.Event(), threading.Event()

    def worker():
        with qo.float32_exact():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    with qo.float32_exact():
        pass
    assert _flags() == (False, False, "highest")  # the worker is still inside
    release.set()
    t.join()
    assert _flags() == tf32_on and precision._depth == 0


@pytest.mark.parametrize("what", ["calibrate", "fast_finetune", "bias_correction", "sensitivity"])
def test_algorithms_run_without_tf32(monkeypatch, tf32_on, what):
    """Each algorithm's inner work sees TF32 off (recorded at a function it calls), the caller's flags after."""
    seen = []
    qm = qo.prepare(cnn(), "A8W8")
    if what != "calibrate":
        qo.calibrate(qm, calib_data(8), progress=False)
    from qtorch_onnx import data as _data

    orig = _data.to_samples

    def spy(*a, **k):
        seen.append(_flags())
        return orig(*a, **k)

    monkeypatch.setattr(_data, "to_samples", spy)
    if what == "calibrate":
        qo.calibrate(qm, calib_data(8), progress=False)
    elif what == "fast_finetune":
        qo.fast_finetune(qm, calib_data(8), algorithm="adaround", num_iterations=2, batch_size=2, progress=False)
    elif what == "bias_correction":
        qo.bias_correction(qm, calib_data(8), progress=False)
    else:
        qo.sensitivity(qm, calib_data(4), progress=False)
    assert seen and all(f == (False, False, "highest") for f in seen), seen
    assert _flags() == tf32_on
