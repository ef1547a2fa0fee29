"""Models past protobuf's 2 GiB: the paths that avoid serializing the whole model, exercised at small scale
by lowering their thresholds (a real 2 GiB model was run by hand: see docs/benchmarks.md, "Models past 2 GiB")."""
from __future__ import annotations

import hashlib
import importlib

import numpy as np
import onnx
import onnx.external_data_helper
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

import qtorch_onnx as qo
from qtorch_onnx.data import to_samples
from qtorch_onnx.runtime import check_parity, session

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


# ------------------------------------------------------------------------------------ streaming (path input)
def _save_external(model, path):
    """``model`` saved with every initializer in ``<path>.data`` (ONNX external data format)."""
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)
    return path


def _stream_thresholds(monkeypatch):
    """Every initializer of more than 64 elements is large, whatever the model's size (cnn(): w1, w2, fc_w)."""
    monkeypatch.setattr(normalize, "LARGE_INITIALIZER_ELEMENTS", 64)
    monkeypatch.setattr(normalize, "BIG_MODEL_BYTES", 0)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_streaming_path_reads_each_weight_once_and_gives_the_same_bits(tmp_path, monkeypatch):
    model = cnn()
    ref_qm, ref = _quantized_outputs(model)  # the ordinary in-memory path, default thresholds
    ref_export = qo.export(ref_qm, None)
    src = _save_external(model, tmp_path / "float.onnx")
    before = {p.name: _digest(p) for p in tmp_path.iterdir()}

    _stream_thresholds(monkeypatch)
    reads: dict = {}
    real_read = lifter._InitializerValues._read

    def counting_read(t):
        reads[t.name] = reads.get(t.name, 0) + 1
        return real_read(t)

    loaded = []
    real_load = onnx.external_data_helper.load_external_data_for_tensor
    monkeypatch.setattr(lifter._InitializerValues, "_read", staticmethod(counting_read))
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor",
                        lambda t, base: (loaded.append(t.name), real_load(t, base))[1])

    qm = qo.prepare(str(src), "A8W8").eval()
    # the normalized graph holds no data for the large initializers: they stay in the user's file, and the
    # lifter read each one once (w1 is rewritten by BatchNormalization folding, from one read of its file)
    unloaded = {t.name for t in qm.onnx_model.graph.initializer if normalize.is_unloaded(t)}
    assert unloaded == {"w2", "fc_w"}
    assert all(not t.raw_data for t in qm.onnx_model.graph.initializer if t.name in unloaded)
    assert reads == {"w2": 1, "fc_w": 1}
    assert not {"w1", "w2", "fc_w"} & set(loaded)  # onnx's loader read only the small ones
    qo.calibrate(qm, calib_data(2), progress=False)
    x = [torch.from_numpy(d["input"]) for d in calib_data(2, seed=5)]
    with torch.no_grad():
        got = [qm(t) for t in x]
    for a, b in zip(ref, got):  # the same model, bit for bit
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert {k: fq.scale.tolist() for k, fq in qm.quantizers().items()} == \
        {k: fq.scale.tolist() for k, fq in ref_qm.quantizers().items()}

    out = tmp_path / "q.onnx"
    # tensors from 128 bytes go to the data file (1024 by default: this model's quantized weights are smaller)
    export_module = importlib.import_module("qtorch_onnx.export")
    monkeypatch.setattr(export_module, "_EXTERNAL_THRESHOLD", 128)
    # weights quantized in slices of 64 elements (per channel on axis 0: w2 is sliced along axis 1)
    monkeypatch.setattr(export_module, "SLICE_ELEMENTS", 64)
    sliced = []
    real_slices = export_module._quantize_integer_in_slices
    monkeypatch.setattr(export_module, "_quantize_integer_in_slices",
                        lambda fq, v: (sliced.append(fq.tensor_name), real_slices(fq, v))[1])
    returned = qo.export(qm, str(out))
    assert (tmp_path / "q.onnx.data").is_file()
    assert {"w1", "w2", "fc_w"} <= set(sliced)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]  # the temporary folder is gone
    raw = onnx.load(str(out), load_external_data=False)
    external = {t.name for t in raw.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert external == {t.name for t in returned.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert {"w2_quantized", "fc_w_quantized"} <= external and "b2_quantized" not in external
    written = onnx.load(str(out))
    # the same nodes (the large-initializer path lists the weights' DequantizeLinear nodes in another order)
    assert sorted(map(str, written.graph.node)) == sorted(map(str, ref_export.graph.node))
    want = {t.name: numpy_helper.to_array(t) for t in ref_export.graph.initializer}
    have = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer}
    assert want.keys() == have.keys()
    for name, arr in want.items():
        assert arr.dtype == have[name].dtype and arr.tobytes() == have[name].tobytes(), name
    # ONNX Runtime reads the written files and computes what the in-memory export computes
    feed = calib_data(1, seed=7)[0]
    a = session(ref_export).run(None, feed)[0]
    b = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert {p.name: _digest(p) for p in tmp_path.iterdir() if p.name in before} == before  # inputs untouched


def test_streaming_missing_or_truncated_external_data_is_named(tmp_path, monkeypatch):
    src = _save_external(cnn(), tmp_path / "float.onnx")
    data = tmp_path / "float.onnx.data"
    blob = data.read_bytes()
    _stream_thresholds(monkeypatch)
    # a large initializer whose data file is outside the model's folder (ONNX forbids it) is refused
    sub = tmp_path / "sub"
    sub.mkdir()
    outside = onnx.load(str(src), load_external_data=False)
    for t in outside.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../float.onnx.data"
    onnx.save_model(outside, str(sub / "outside.onnx"))
    with pytest.raises(qo.ModelError, match=r"tensor '(w1|w2|fc_w)' names the external data file "
                                            r"'\.\./float\.onnx\.data', outside the model's folder"):
        lifter.load_model(str(sub / "outside.onnx"))
    model = lifter.load_model(str(src))  # the large initializers stay in the file
    stubs = [t for t in model.graph.initializer if normalize.is_unloaded(t)]
    assert sorted(t.name for t in stubs) == ["fc_w", "w1", "w2"]
    cut = min(normalize.external_span(t)[1] for t in stubs) + 4
    data.write_bytes(blob[:cut])  # the file shrinks after loading: the first read names the tensor and file
    with pytest.raises(qo.ModelError, match=r"tensor '(w1|w2|fc_w)' needs bytes \d+\.\.\d+ of the external data "
                                            r"file .*float\.onnx\.data.*truncated"):
        qo.prepare(model, "A8W8")
    data.unlink()
    with pytest.raises(qo.ModelError, match=r"tensor '(w1|w2|fc_w)' is stored in the external data file "
                                            r".*float\.onnx\.data.*cannot be read"):
        qo.prepare(model, "A8W8")
    with pytest.raises(qo.ModelError, match=r"tensor '.*' is stored in the external data file .*float\.onnx\.data"
                                            r".* does not exist"):
        lifter.load_model(str(src))
    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(qo.ModelError, match=r"tensor '.*' needs bytes .*float\.onnx\.data.*truncated"):
        lifter.load_model(str(src))
