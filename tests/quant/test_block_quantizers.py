"""Block formats (BFP16, MX4/6/9, OCP MX) as quantizers in the pipeline: emulation, gradients, export to
BFPQuantizeDequantize / MXQuantizeDequantize nodes bit-exact in ONNX Runtime with the operator library."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import qtorch_onnx as qo
from qtorch_onnx import ops

from .small_models import calib_data, cnn

NAMES = ["BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP8E4M3", "MXFP8E5M2", "MXFP6E3M2", "MXFP6E2M3", "MXFP4E2M1",
         "BF16_BFP16", "BF16_MXINT8", "MX9_INT8"]


def _calibrate_or_quantize(qm):
    """Calibrate where an activation quantizer needs it (integer parts), else switch quantization on."""
    if any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation"):
        qo.calibrate(qm, calib_data(2), progress=False)
    else:
        qm.set_mode("quantize")


@pytest.mark.parametrize("name", NAMES)
def test_named_block_configs_emulate(name):
    qm = qo.prepare(cnn(), name)
    _calibrate_or_quantize(qm)
    x = torch.from_numpy(calib_data(1, seed=9)[0]["input"])
    y = qm(x)
    qm.set_mode("float")
    yf = qm(x)
    assert torch.isfinite(y).all()
    cos = torch.nn.functional.cosine_similarity(y.flatten(), yf.flatten(), dim=0)
    assert cos > 0.5, (name, float(cos))
    if name == "MX9":
        assert cos > 0.999


@pytest.mark.parametrize("name", NAMES)
def test_named_block_configs_export_bit_exact(name):
    """Every quantizer node gives the emulation's bits in ONNX Runtime (operator library), and the outputs
    agree: >= 99% identical, the rest within one step of the last quantizer."""
    import onnx

    from qtorch_onnx.data import to_samples
    from qtorch_onnx.runtime import check_parity

    qm = qo.prepare(cnn(), name)
    _calibrate_or_quantize(qm)
    exported, qmap = qo.export(qm, None, return_map=True)
    onnx.checker.check_model(exported, full_check=True)
    ops_used = {(n.domain, n.op_type) for n in exported.graph.node}
    fmts = {fq.fmt.name for fq in qm.quantizers().values()}
    if any(f.startswith(("BFP", "MX4", "MX6", "MX9")) for f in fmts):
        assert ("com.amd.quark", "BFPQuantizeDequantize") in ops_used
    if any(f.startswith(("MXINT", "MXFP")) for f in fmts):
        assert ("com.amd.quark", "MXQuantizeDequantize") in ops_used
    samples = to_samples(calib_data(3, seed=7), qm.input_specs)
    rep = check_parity(qm, exported, qmap, samples, opt_levels=("ORT_DISABLE_ALL",))
    bad = [n for n in rep.nodes if not n.exact]
    assert not bad, bad
    assert rep.nodes_exact[1] == len(qm.quantizers())
    for o in rep.outputs:
        assert o.identical_fraction >= 0.99, o
        assert o.max_step_diff is None or o.max_step_diff <= 1.0, o


def test_block_axis_follows_reduction_axis():
    qm = qo.prepare(cnn(), "MX9")
    specs = qm.plan.specs
    assert specs["w2"].axis == 1  # Conv weight: axis 1 (input channels)
    assert specs["fc_w"].axis == 1  # Gemm B with transB=1: axis 1
    assert specs["flat"].axis == 1  # Gemm A: axis 1


def test_block_quantizer_matches_ops_bit_for_bit():
    qm = qo.prepare(cnn(), "MX6").set_mode("quantize")
    fq = qm.quantizers()["r1"]
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    ref = ops.bfp_quantize_dequantize(x, bfp_method="to_bfp_prime", axis=1, bit_width=13, block_size=16,
                                      rounding_mode=2, sub_block_size=2, sub_block_shift_bits=1)
    assert torch.equal(fq(x).view(torch.int32), ref.view(torch.int32))
    w = x.clone().requires_grad_(True)
    fq(w).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("attrs,kind", [("BFPAttributes", "BFP16"), ("MXAttributes", "MXINT8")])
def test_user_block_axis_acts_where_the_reader_does_not_decide(attrs, kind):
    """``axis`` in BFPAttributes / MXAttributes (Quark's named BFP16 sets 1) is the block axis of the tensors whose
    readers do not decide one (Conv inputs and weights); MatMul/Gemm inputs keep their reduction axis; the export
    is bit-exact in ONNX Runtime; an axis the tensor lacks is an error naming the key and the tensor."""
    import onnx

    from qtorch_onnx.data import to_samples
    from qtorch_onnx.runtime import check_parity

    cfg = qo.get_default_config(kind)
    base = dict(cfg.extra_options[attrs])
    default_specs = qo.prepare(cnn(), cfg).plan.specs
    cfg.extra_options[attrs] = {**base, "axis": 1}  # Quark's named config: the same as ours without it
    assert {t: s.axis for t, s in qo.prepare(cnn(), cfg).plan.specs.items()} == \
        {t: s.axis for t, s in default_specs.items()}
    cfg.extra_options[attrs] = {**base, "axis": -1}
    qm = qo.prepare(cnn(), cfg)
    specs = qm.plan.specs
    assert specs["input"].axis == 3 and specs["w2"].axis == 3  # Conv input and weight: the user's axis (W)
    assert specs["fc_w"].axis == 1 and specs["flat"].axis == 1  # Gemm: still the reduction axis
    _calibrate_or_quantize(qm)
    exported, qmap = qo.export(qm, None, return_map=True)
    onnx.checker.check_model(exported, full_check=True)
    rep = check_parity(qm, exported, qmap, to_samples(calib_data(2, seed=7), qm.input_specs),
                       opt_levels=("ORT_DISABLE_ALL",))
    assert all(n.exact for n in rep.nodes), [n for n in rep.nodes if not n.exact]
    cfg.extra_options[attrs] = {**base, "axis": 4}
    with pytest.raises(qo.ConfigError, match=rf"{attrs}'\]\['axis'\]=4 is not an axis of tensor .*rank 4"):
        qo.prepare(cnn(), cfg)
