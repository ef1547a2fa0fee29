"""Bit-exact acceptance of the block-format references on every golden case of Quark 0.13's operators.

Data: ``tests/data/golden/{bfp,bfp_prime,mx}.npz`` + ``cases.json`` (README.md there). float32 outputs are
compared as ``uint32`` bit patterns (so -0.0 and NaN payloads count); float16 outputs as ``uint16`` except
NaNs, compared as NaNs (README note 4: ONNX Runtime's float16 Cast NaN payloads depend on buffer position).
"""
import json
import os

import numpy as np
import pytest
import torch

from qtorch_onnx.formats.bfp import bfp_reference
from qtorch_onnx.formats.mx import mx_reference
from qtorch_onnx.ops import bfp_quantize_dequantize, mx_quantize_dequantize

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "golden")
FILES = ("bfp.npz", "bfp_prime.npz", "mx.npz")
EXPECTED_COUNTS = {"bfp.npz": 405, "bfp_prime.npz": 247, "mx.npz": 465}

with open(os.path.join(GOLDEN, "cases.json")) as fh:
    _CASES = [c for c in json.load(fh)["cases"] if c["file"] in FILES]
_NPZ = {}


def _arrays(file):
    if file not in _NPZ:
        _NPZ[file] = np.load(os.path.join(GOLDEN, file))
    return _NPZ[file]


def _attributes(case):
    attrs = dict(case["attributes"])
    attrs.pop("use_compiler_version_cpu_kernel", None)  # selects Quark's CPU kernel flavour, same numerics
    return attrs


def _assert_same_bits(got: np.ndarray, want: np.ndarray, case_id: str):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if want.dtype == np.float16:
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), f"{case_id}: NaN positions differ"
        g, w = got.view(np.uint16)[~nan], want.view(np.uint16)[~nan]
    else:
        g, w = got.view(np.uint32).ravel(), want.view(np.uint32).ravel()
    bad = np.nonzero(g != w)[0]
    assert bad.size == 0, (f"{case_id}: {bad.size}/{g.size} elements differ, first at {bad[0]}: "
                           f"got {g[bad[0]]:#x} want {w[bad[0]]:#x}")


def test_case_counts():
    counts = {f: sum(c["file"] == f for c in _CASES) for f in FILES}
    assert counts == EXPECTED_COUNTS


@pytest.mark.parametrize("case", _CASES, ids=[c["id"] for c in _CASES])
def test_golden_bit_exact(case):
    arrays = _arrays(case["file"])
    x = arrays[case["inputs"][0]["key"]]
    want = arrays[case["outputs"][0]["key"]]
    x_before = x.copy()
    xt = torch.from_numpy(x.copy())
    attrs = _attributes(case)
    if case["op_type"] == "BFPQuantizeDequantize":
        got = bfp_reference(xt, **attrs)
        got_op = bfp_quantize_dequantize(xt, **attrs)
    else:
        assert case["op_type"] == "MXQuantizeDequantize"
        got = mx_reference(xt, **attrs)
        got_op = mx_quantize_dequantize(xt, **attrs)
    _assert_same_bits(got.numpy(), want, case["id"])
    _assert_same_bits(got_op.numpy(), want, case["id"] + " (ops)")
    assert np.array_equal(xt.numpy().view(np.uint8), x_before.view(np.uint8)), "input was modified"
