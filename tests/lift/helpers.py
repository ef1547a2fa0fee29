"""Small-model builders and runners shared by the lift tests."""
from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper


def make_model(nodes, inputs, outputs, initializers=(), opset=17, name="g", ir_version=None):
    """Build a checked ModelProto from helper nodes / (name, elem_type, shape) triples / numpy inits."""
    vi = lambda n, t, s: helper.make_tensor_value_info(n, t, s)  # noqa: E731
    graph = helper.make_graph(
        list(nodes), name, [vi(*i) for i in inputs], [vi(*o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(initializers).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version or min(onnx.IR_VERSION, 10)
    return model


def run_ort(model: onnx.ModelProto, feeds: dict, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_gm(gm, feeds: dict):
    with torch.no_grad():
        out = gm(*[torch.from_numpy(np.asarray(feeds[n])) for n in gm.input_names])
    out = out if isinstance(out, tuple) else (out,)
    return [o.numpy() for o in out]


def rel_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    den = np.linalg.norm(a)
    return float(np.linalg.norm(a - b) / den) if den else float(np.linalg.norm(a - b))


def tensor_names(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    names = {v.name for v in g.input} | {t.name for t in g.initializer}
    for n in g.node:
        names.update(o for o in n.output if o)
    return names


F = TensorProto.FLOAT
I64 = TensorProto.INT64


@functools.lru_cache(maxsize=None)
def ort_u8s8_saturates() -> bool:
    """Whether ONNX Runtime's uint8 x int8 integer products saturate on this CPU: MLAS's u8s8 kernel for AVX2
    without VNNI sums pairs of products into int16 (``vpmaddubsw``), so 255 x 127 + 255 x 127 gives 32767 instead of
    64770 (measured on an AMD EPYC Zen 3: MatMulInteger of 4 x 255 by 4 x 127 gives 65534, not 129540). The
    emulation computes the exact products, ONNX Runtime's result on AVX-512 VNNI / AVX-VNNI CPUs, so its
    comparisons with ONNX Runtime's DynamicQuantizeLSTM hold there only."""
    node = helper.make_node("MatMulInteger", ["A", "B"], ["Y"])
    graph = helper.make_graph([node], "u8s8", [helper.make_tensor_value_info("A", TensorProto.UINT8, [1, 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, [1, 1])],
                              [helper.make_tensor("B", TensorProto.INT8, [4, 1], [127] * 4)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    y = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"A": np.full((1, 4), 255, np.uint8)})[0]
    return int(y.reshape(-1)[0]) != 255 * 127 * 4


#: for tests comparing an int8 computation with ONNX Runtime's on the CPU (see :func:`ort_u8s8_saturates`)
requires_exact_ort_u8s8 = pytest.mark.skipif(
    ort_u8s8_saturates(), reason="ONNX Runtime's u8s8 integer products saturate to int16 pairs on this CPU "
                                   "(MLAS on AVX2 without VNNI); the emulation computes them exactly")
