"""Small hand-built ONNX models for pipeline tests (random but fixed weights)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def cnn(opset: int = 17, seed: int = 0, batchnorm: bool = True) -> onnx.ModelProto:
    """input [N,3,16,16] -> Conv(8) -> BN -> Relu -> Conv(8) -> Add(skip) -> MaxPool -> Concat(with Conv 1x1)
    -> GlobalAveragePool -> Flatten -> Gemm(10) -> Softmax."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.3, (8, 3, 3, 3))), _init("b1", rng.normal(0, 0.1, 8)),
        _init("bn_scale", rng.uniform(0.5, 1.5, 8)), _init("bn_bias", rng.normal(0, 0.1, 8)),
        _init("bn_mean", rng.normal(0, 0.1, 8)), _init("bn_var", rng.uniform(0.5, 1.5, 8)),
        _init("w2", rng.normal(0, 0.2, (8, 8, 3, 3))), _init("b2", rng.normal(0, 0.1, 8)),
        _init("w3", rng.normal(0, 0.2, (4, 8, 1, 1))), _init("b3", rng.normal(0, 0.1, 4)),
        _init("fc_w", rng.normal(0, 0.2, (10, 12))), _init("fc_b", rng.normal(0, 0.1, 10)),
    ]
    nodes = [helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1])]
    if batchnorm:
        nodes.append(helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
                                      ["bn1"], name="bn1", epsilon=1e-3))
        r_in = "bn1"
    else:
        r_in = "c1"
    nodes += [
        helper.make_node("Relu", [r_in], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["add1"], name="add1"),
        helper.make_node("MaxPool", ["add1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w3", "b3"], ["c3"], name="conv3"),
        helper.make_node("Concat", ["p1", "c3"], ["cat"], name="concat1", axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["prob"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "small_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N", 10])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def calib_data(n: int = 8, seed: int = 1, batch: int = 1):
    rng = np.random.default_rng(seed)
    return [{"input": rng.normal(0, 1, (batch, 3, 16, 16)).astype(np.float32)} for _ in range(n)]
