"""CLI: automatic mixed precision (search, saved plan) and fast finetune flags."""
from __future__ import annotations

import json

import onnx

from qtorch_onnx.cli import main

from ..quant.small_models import cnn


def test_cli_auto_mp_plan_and_fast_ft(tmp_path, capsys):
    model = tmp_path / "cnn.onnx"
    onnx.save(cnn(), model)
    out, plan, rep = tmp_path / "amp.onnx", tmp_path / "plan.json", tmp_path / "report"
    rc = main(["quantize", str(model), str(out), "--config", "A16W8", "--random-calib", "6", "--quiet",
               "--auto-mp-target", "1.0", "--auto-mp-plan-out", str(plan), "--report", str(rep),
               "--fast-ft", "adaround", "--ft-iterations", "10"])
    assert rc == 0 and out.exists() and plan.exists()
    text = capsys.readouterr().out
    assert "automatic mixed precision: every layer narrow" in text and "fast finetune (adaround)" in text
    doc = json.loads((rep / "auto_mp.json").read_text())
    assert doc["narrow_layers"] == 4 and (rep / "fast_finetune.json").exists()
    out2 = tmp_path / "again.onnx"
    assert main(["quantize", str(model), str(out2), "--config", "A16W8", "--random-calib", "6", "--quiet",
                 "--auto-mp-plan", str(plan)]) == 0
    ops = lambda m: sorted((n.op_type, n.domain) for n in onnx.load(m).graph.node)  # noqa: E731
    assert ops(out) == ops(out2)
    assert main(["quantize", str(model), str(out2), "--config", "A16W8", "--auto-mp-target", "1.0"]) == 2
