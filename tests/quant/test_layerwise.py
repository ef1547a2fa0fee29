"""Layer-wise mixed precision and two quantizer kinds on one tensor (DualQuantNodes): placement, emulation,
export and ONNX Runtime parity on the small CNN.

The CNN's precision boundaries: ``r1`` feeds conv2 (promoted) and add1 (not); ``p1`` feeds conv3 (promoted) and
concat1 (not); ``input`` and ``flat`` feed only a promoted node (conv1, fc).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import qtorch_onnx as qo
from qtorch_onnx.data import to_samples
from qtorch_onnx.formats import spec as F
from qtorch_onnx.placement import edge_key
from qtorch_onnx.runtime import check_parity

from .small_models import calib_data, cnn


def _config(name: str, dual: bool):
    cfg = qo.get_default_config(name)
    cfg.extra_options["AutoMixprecision"]["DualQuantNodes"] = dual
    return qo.Config(global_quant_config=cfg)


def _int_config(dual: bool):
    cfg = qo.get_default_config("A16W8")
    cfg.include_auto_mp = True
    cfg.extra_options["AutoMixprecision"] = {"TargetQuantType": qo.QuantType.QInt8, "DualQuantNodes": dual}
    return qo.Config(global_quant_config=cfg)


def _prepared(config):
    qm = qo.prepare(cnn(), config)
    if any(fq.needs_calibration for fq in qm.quantizers().values()):
        qo.calibrate(qm, calib_data(), progress=False)
    else:
        qm.set_mode("quantize")
    return qm


@pytest.mark.parametrize("name,target", [("BF16_MIXED_BFP16", F.BFP16), ("BF16_MIXED_MXINT8", F.MXINT8)])
def test_placement(name, target):
    specs = qo.prepare(cnn(), _config(name, dual=True)).plan.specs
    # promoted nodes' weights and biases take the target; the other tensors keep BF16
    for w in ("w1", "b1", "w2", "b2", "w3", "b3", "fc_w", "fc_b"):
        assert specs[w].fmt == target and specs[w].role == "weight", w
    for t in ("input", "r1", "p1", "flat", "c2", "add1", "cat", "logits", "prob"):
        assert specs[t].fmt == F.BF16 and specs[t].consumer is None, t
    # DualQuantNodes: every promoted input carries both kinds, the target one on the promoted node's edge only
    edges = {k: s for k, s in specs.items() if s.consumer is not None}
    assert sorted(edges) == sorted(edge_key(t, n) for t, n in
                                   (("input", "conv1"), ("r1", "conv2"), ("p1", "conv3"), ("flat", "fc")))
    assert all(s.fmt == target and s.chained and s.axis == 1 for s in edges.values())

    specs = qo.prepare(cnn(), _config(name, dual=False)).plan.specs
    # without it: inputs read only by promoted nodes take the target; boundaries get a float-side edge
    assert specs["input"].fmt == target and specs["flat"].fmt == target
    assert specs["r1"].fmt == F.BF16 and specs["p1"].fmt == F.BF16
    edges = {k: s for k, s in specs.items() if s.consumer is not None}
    assert sorted(edges) == [edge_key("p1", "conv3"), edge_key("r1", "conv2")]
    assert not any(s.chained for s in edges.values())


def test_emulation_reads_the_right_tensor():
    """A chained edge quantizer sees the own quantizer's output; an unchained one sees the float tensor;
    the non-promoted reader (add1) sees only the own quantizer."""
    x = torch.from_numpy(calib_data(1, seed=3)[0]["input"])
    for dual in (True, False):
        qm = _prepared(_config("BF16_MIXED_BFP16", dual))
        fqs = qm.quantizers()
        seen = {}
        hooks = [fq.register_forward_hook(lambda m, a, o, k=k: seen.__setitem__(k, (a[0].clone(), o.clone())))
                 for k, fq in fqs.items()]
        with torch.no_grad():
            qm(x)
        for h in hooks:
            h.remove()
        own_in, own_out = seen["r1"]
        edge_in, edge_out = seen[edge_key("r1", "conv2")]
        expect = own_out if dual else own_in
        assert torch.equal(edge_in.view(torch.int32), expect.view(torch.int32))
        assert not torch.equal(edge_out, own_out)  # BFP16 of the BF16 values differs from BF16 alone
        # BFP16 after BF16 is the reference BFP16 of the BF16 values, bit for bit
        ref = qo.ops.bfp_quantize_dequantize(expect, axis=1, rounding_mode=2, backend="reference")
        assert torch.equal(edge_out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("case", ["BF16_MIXED_BFP16-dual", "BF16_MIXED_BFP16", "BF16_MIXED_MXINT8-dual",
                                  "A16W8-INT8-dual", "A16W8-INT8"])
def test_export_structure_and_parity(case):
    dual = case.endswith("-dual")
    name = case.removesuffix("-dual")
    config = _int_config(dual) if name == "A16W8-INT8" else _config(name, dual)
    qm = _prepared(config)
    exported, qmap = qo.export(qm, None, return_map=True)
    onnx.checker.check_model(exported, full_check=True)
    nodes = {n.name: n for n in exported.graph.node}
    readers = {}
    for n in exported.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.name)
    # the edge quantizer of r1 feeds conv2 alone; add1 reads r1 (the own quantizer's output)
    qn = qmap[edge_key("r1", "conv2")]
    assert readers[qn.output] == ["conv2"]
    assert "r1" in nodes["add1"].input and "r1" not in nodes["conv2"].input
    assert qn.input == ("r1" if dual else "r1_QuantizeInput")
    first = nodes[qn.nodes[0]]
    if name == "A16W8-INT8":
        assert first.op_type == "QuantizeLinear"
        assert onnx.numpy_helper.to_array(
            next(t for t in exported.graph.initializer if t.name == first.input[2])).dtype == np.int8
        # INT32 bias scale = scale of the INT8 edge quantizer x scale of the weight
        fqs = qm.quantizers()
        assert qm.plan.specs["b2"].bias_of == (edge_key("r1", "conv2"), "w2")
        expect = (fqs[edge_key("r1", "conv2")].scale.double() * fqs["w2"].scale.double()).float()
        assert torch.equal(fqs["b2"].scale, expect)
    else:
        assert first.op_type in ("BFPQuantizeDequantize", "MXQuantizeDequantize")
    rep = check_parity(qm, exported, qmap, to_samples(calib_data(3, seed=7), qm.input_specs))
    assert [n for n in rep.nodes if not n.exact] == []
    assert rep.nodes_exact[1] == len(qm.quantizers())
    for o in rep.outputs:
        assert o.identical_fraction >= 0.99, o
        if o.max_step_diff is not None:
            assert o.max_step_diff <= 1.0, o


def test_weights_of_promoted_nodes_only():
    """TargetOpType restricts the promotion: with only Gemm promoted, the convolutions stay BF16."""
    cfg = qo.get_default_config("BF16_MIXED_BFP16")
    cfg.extra_options["AutoMixprecision"]["TargetOpType"] = ["Gemm"]
    specs = qo.prepare(cnn(), qo.Config(global_quant_config=cfg)).plan.specs
    assert specs["fc_w"].fmt == F.BFP16 and specs["w1"].fmt == F.BF16 and specs["w2"].fmt == F.BF16
    assert [k for k, s in specs.items() if s.consumer] == [edge_key("flat", "fc")]
