"""Small-model builders and runners shared by the lift tests."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
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
