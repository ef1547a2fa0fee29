"""Slice-10/11/13 (our tuple-indexed override of onnx2torch's module) against ONNX's reference evaluator."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import qtorch_onnx as qo


def _model(opset: int, with_axes: bool, with_steps: bool) -> onnx.ModelProto:
    ins = ["x", "starts", "ends"] + (["axes"] if with_axes else []) + (["steps"] if with_steps else [])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5, 6])] + \
        [helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in ins[1:]]
    g = helper.make_graph([helper.make_node("Slice", ins, ["y"], name="s")], "slice", inputs,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("opset", [10, 11, 13])
def test_slice_matches_the_reference_without_warnings(opset):
    rng = np.random.default_rng(opset)
    x = rng.normal(size=(4, 5, 6)).astype(np.float32)
    big = np.iinfo(np.int64).max
    checked = 0
    for trial in range(60):
        k = int(rng.integers(1, 4))
        axes = rng.choice([0, 1, 2], size=k, replace=False)
        if opset >= 11 and trial % 3 == 0:
            axes = axes - 3  # negative axes
        steps = rng.choice([-3, -2, -1, 1, 2], size=k)
        # bounds mostly in the direction of the step (non-empty), sometimes out of range or against it
        fwd_s, fwd_e = [-7, -3, 0, 1, 2, -big], [3, 5, 9, big, -1]
        bwd_s, bwd_e = [-1, 4, 9, big, 2], [-7, -big, 0, 1]
        starts = np.array([rng.choice(fwd_s if st > 0 else bwd_s) for st in steps])
        ends = np.array([rng.choice(fwd_e if st > 0 else bwd_e) for st in steps])
        if trial % 7 == 0:
            starts, ends = ends, starts  # against the step: empty slices must match too
        feeds = {"x": x, "starts": starts.astype(np.int64), "ends": ends.astype(np.int64),
                 "axes": np.asarray(axes, np.int64), "steps": steps.astype(np.int64)}
        model = _model(opset, True, True)
        ref = ReferenceEvaluator(model).run(None, feeds)[0]
        gm = qo.lift(model).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # onnx2torch's list index warned on every call
            got = gm(*(torch.from_numpy(feeds[n]) for n in ("x", "starts", "ends", "axes", "steps")))
        assert got.shape == ref.shape and np.array_equal(got.numpy(), ref), (starts, ends, axes, steps)
        checked += int(ref.size > 0)
    assert checked > 20  # most draws select something: the comparison is not of empty tensors
