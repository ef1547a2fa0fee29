"""The CLI (quantize, evaluate) and the metrics behind `evaluate`."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from PIL import Image

from qtorch_onnx import DataError
from qtorch_onnx.cli import main
from qtorch_onnx.metrics import cosine_similarity, evaluate, l2_loss, psnr, relative_l2

from .quant.small_models import calib_data, cnn


def test_metrics_values():
    a = np.array([1.0, 2.0, 3.0])
    assert cosine_similarity(a, 2 * a) == pytest.approx(1.0)
    assert cosine_similarity(a, -a) == pytest.approx(-1.0)
    assert l2_loss(a, a + np.array([3.0, 4.0, 0.0])) == pytest.approx(5.0)
    assert relative_l2(a, a) == 0.0
    assert math.isinf(psnr(a, a))
    # MSE 1 with peak 3 -> 10*log10(9)
    assert psnr(a, a + 1.0) == pytest.approx(10 * math.log10(9.0))


def test_evaluate_folders_npy_png(tmp_path, capsys):
    base, quant = tmp_path / "base", tmp_path / "quant"
    base.mkdir()
    quant.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        x = rng.normal(size=(4, 5)).astype(np.float32)
        np.save(base / f"{i}.npy", x)
        np.save(quant / f"{i}.npy", x + 0.01)
    img = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(img).save(base / "im.png")
    Image.fromarray(np.clip(img.astype(int) + 1, 0, 255).astype(np.uint8)).save(quant / "im.png")
    r = evaluate(str(base), str(quant))
    assert r.files == 4 and 0.99 < r.cosine <= 1.0 and r.psnr > 20
    assert main(["evaluate", "--baseline_results_folder", str(base), "--quantized_results_folder", str(quant)]) == 0
    out = capsys.readouterr().out
    assert "cosine similarity" in out and "PSNR" in out
    with pytest.raises(DataError, match="does not exist"):
        evaluate(str(tmp_path / "nope"), str(quant))


def test_cli_quantize(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(cnn(), src)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, d in enumerate(calib_data(4)):
        np.save(calib / f"{i:03d}.npy", d["input"])
    out = tmp_path / "q.onnx"
    rc = main(["quantize", str(src), str(out), "--config", "A8W8", "--calib-data", str(calib),
               "--eval-data", str(calib), "--quiet"])
    assert rc == 0 and out.exists()
    text = capsys.readouterr().out
    assert "INT8 activation" in text and "time per stage" in text and "cosine" in text
    rc = main(["quantize", str(src), str(tmp_path / "r.onnx"), "--config", "A16W8", "--random-calib", "2", "--quiet"])
    assert rc == 0
    # a missing calibration folder is a clean error, not a traceback
    rc = main(["quantize", str(src), str(tmp_path / "x.onnx"), "--calib-data", str(tmp_path / "none"), "--quiet"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
