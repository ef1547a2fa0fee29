"""Block formats (BFP16, MX4/6/9, OCP MX) as quantizers in the pipeline: emulation, gradients, export error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import qtorch_onnx as qo
from qtorch_onnx import ops

from .small_models import calib_data, cnn

NAMES = ["BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP8E4M3", "MXFP8E5M2", "MXFP6E3M2", "MXFP6E2M3", "MXFP4E2M1",
         "BF16_BFP16", "BF16_MXINT8", "MX9_INT8"]


@pytest.mark.parametrize("name", NAMES)
def test_named_block_configs_emulate(name):
    qm = qo.prepare(cnn(), name)
    if any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation"):
        qo.calibrate(qm, calib_data(2), progress=False)
    else:
        qm.set_mode("quantize")
    x = torch.from_numpy(calib_data(1, seed=9)[0]["input"])
    y = qm(x)
    qm.set_mode("float")
    yf = qm(x)
    assert torch.isfinite(y).all()
    cos = torch.nn.functional.cosine_similarity(y.flatten(), yf.flatten(), dim=0)
    assert cos > 0.5, (name, float(cos))
    if name == "MX9":
        assert cos > 0.999
    with pytest.raises(qo.ExportError, match="operator library"):
        qo.export(qm.set_mode("quantize"), None)


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
