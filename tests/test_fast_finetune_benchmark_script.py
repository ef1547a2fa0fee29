"""benchmarks/_quark_ft_worker.py and fast_finetune_vs_quark.py: the pieces that run without Quark's venv."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    saved = list(sys.path)  # the scripts import their siblings from benchmarks/
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path[:] = saved


def _model_bytes() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_limit_ort_threads_sets_defaults_only_and_undoes():
    worker = _module("_quark_ft_worker")
    seen = []
    orig = ort.InferenceSession.__init__

    def spy(self, path_or_bytes, sess_options=None, *a, **k):
        seen.append(None if sess_options is None else
                    (sess_options.intra_op_num_threads, sess_options.inter_op_num_threads))
        return orig(self, path_or_bytes, sess_options, *a, **k)

    ort.InferenceSession.__init__ = spy
    try:
        undo = worker.limit_ort_threads(ort, 1)
        try:
            m = _model_bytes()
            s1 = ort.InferenceSession(m, providers=["CPUExecutionProvider"])  # no options: ONNX Runtime's defaults
            so = ort.SessionOptions()  # left at the default (0)
            s2 = ort.InferenceSession(m, so, providers=["CPUExecutionProvider"])
            mine = ort.SessionOptions()
            mine.intra_op_num_threads = 2  # set by the caller: kept
            ort.InferenceSession(m, mine, providers=["CPUExecutionProvider"])
            x = np.array([[-1.0, 0.5, 2.0], [3.0, -4.0, 0.0]], np.float32)
            for s in (s1, s2):  # the sessions still run
                assert np.array_equal(s.run(None, {"x": x})[0], np.maximum(x, 0))
        finally:
            undo()
        assert seen == [(1, 1), (1, 1), (2, 1)]
        assert so.intra_op_num_threads == 1
        ort.InferenceSession(_model_bytes(), providers=["CPUExecutionProvider"])  # undone: no options made
        assert seen[-1] is None
    finally:
        ort.InferenceSession.__init__ = orig


def test_limit_ort_threads_refuses_zero():
    worker = _module("_quark_ft_worker")
    with pytest.raises(ValueError, match="threads must be >= 1"):
        worker.limit_ort_threads(ort, 0)


def test_benchmark_refuses_negative_quark_ort_threads(capsys):
    bench = _module("fast_finetune_vs_quark")
    with pytest.raises(SystemExit):
        bench.main(["--quark-ort-threads", "-1", "--quark-results", "unused.json"])
    assert "--quark-ort-threads must be >= 0" in capsys.readouterr().err


def test_section_names_the_thread_protocol():
    bench = _module("fast_finetune_vs_quark")
    base = {"machine": "m", "versions": {"torch_threads": 1, "torch": "t"}, "batch_size": 2, "date": "d",
            "models": {}, "rows": [], "skipped": []}
    assert "its defaults (one per core)" in bench.section(dict(base))
    assert "finetune: 1;" in bench.section(dict(base, quark_ort_threads=1))

