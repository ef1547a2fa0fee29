"""Models past protobuf's 2 GiB: the paths that avoid serializing the whole model, exercised at small scale
by lowering their thresholds (a real 2 GiB model was run by hand: see docs/benchmarks.md, "Models past 2 GiB")."""
from __future__ import annotations

import importlib

import torch

import qtorch_onnx as qo
from qtorch_onnx.data import to_samples
from qtorch_onnx.runtime import check_parity

from .small_models import calib_data, cnn

normalize = importlib.import_module("qtorch_onnx.lift.normalize")
lifter = importlib.import_module("qtorch_onnx.lift.lifter")


def _quantized_outputs(model):
    qm = qo.prepare(model, "A8W8").eval()
    qo.calibrate(qm, calib_data(2), progress=False)
    x = [torch.from_numpy(d["input"]) for d in calib_data(2, seed=5)]
    with torch.no_grad():
        return qm, [qm(t) for t in x]


def test_large_initializer_paths_give_the_same_model(monkeypatch):
    model = cnn()
    ref_qm, ref = _quantized_outputs(model)
    want = {t.name: t.SerializeToString() for t in normalize.normalize(model, fold_batchnorm=True).graph.initializer}
    # every initializer counts as large: set aside during shape inference, handed to onnx2torch as a graph input
    monkeypatch.setattr(normalize, "LARGE_INITIALIZER_ELEMENTS", 0)
    monkeypatch.setattr(normalize, "BIG_MODEL_BYTES", 0)
    norm = normalize.normalize(model, fold_batchnorm=True)
    # the normalized model still holds every initializer's data (set aside for inference and put back)
    assert {t.name: t.SerializeToString() for t in norm.graph.initializer} == want
    view, moved = lifter.conversion_view(norm)
    assert moved and not view.graph.initializer  # the path under test really runs
    qm, got = _quantized_outputs(model)
    for a, b in zip(ref, got):  # the same model, bit for bit
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert {k: fq.scale.tolist() for k, fq in qm.quantizers().items()} == \
        {k: fq.scale.tolist() for k, fq in ref_qm.quantizers().items()}
    exported, qmap = qo.export(qm, None, return_map=True)
    rep = check_parity(qm, exported, qmap, to_samples(calib_data(2), qm.input_specs),
                       opt_levels=("ORT_DISABLE_ALL",))
    assert all(n.exact for n in rep.nodes), [n for n in rep.nodes if not n.exact]
