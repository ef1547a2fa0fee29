"""Small hand-built ONNX models for pipeline tests (random but fixed weights)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def _image_model(nodes, inits, name: str, output: str, opset: int) -> onnx.ModelProto:
    """A checked model of ``nodes``: input ``"input"`` [N,3,16,16] float, output ``output`` [N,10], IR 8."""
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["N", 10])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


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
    return _image_model(nodes, inits, "small_cnn", "prob", opset)


def calib_data(n: int = 8, seed: int = 1, batch: int = 1):
    rng = np.random.default_rng(seed)
    return [{"input": rng.normal(0, 1, (batch, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


def token_block(opset: int = 17, seed: int = 0) -> onnx.ModelProto:
    """ids [N,6] int64 -> Gather(table) -> LayerNormalization -> self-attention-like MatMuls (x @ x^T ->
    Softmax -> @ x) -> MatMul(W1) + b1 -> PRelu -> MatMul(W2) -> Mul(gamma) -> Add(residual) -> Div(const)
    -> Sub(const) -> ReduceMean over tokens: [N,16]. Every trainable initializer kind of the training
    contract in one graph (Gather table, norm scale/bias, MatMul weights, element-wise constants, PRelu slope)."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("table", rng.normal(0, 1.0, (20, 16))),
        _init("ln_scale", rng.uniform(0.5, 1.5, 16)), _init("ln_bias", rng.normal(0, 0.1, 16)),
        _init("w1", rng.normal(0, 0.3, (16, 32))), _init("b1", rng.normal(0, 0.1, 32)),
        _init("slope", rng.uniform(0.05, 0.3, 32)),
        _init("w2", rng.normal(0, 0.2, (32, 16))), _init("gamma", rng.uniform(0.5, 1.5, 16)),
        _init("div_c", np.full(16, 2.0)), _init("sub_c", rng.normal(0, 0.1, 16)),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "mean_axes"),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed", axis=0),
        helper.make_node("LayerNormalization", ["emb", "ln_scale", "ln_bias"], ["ln"], name="ln", axis=-1,
                         epsilon=1e-5),
        helper.make_node("Transpose", ["ln"], ["ln_t"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["ln", "ln_t"], ["scores"], name="attn_scores"),
        helper.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "ln"], ["ctx"], name="attn_context"),
        helper.make_node("MatMul", ["ctx", "w1"], ["h1"], name="fc1"),
        helper.make_node("Add", ["h1", "b1"], ["h1b"], name="fc1_bias"),
        helper.make_node("PRelu", ["h1b", "slope"], ["act"], name="prelu"),
        helper.make_node("MatMul", ["act", "w2"], ["h2"], name="fc2"),
        helper.make_node("Mul", ["h2", "gamma"], ["h2g"], name="layer_scale"),
        helper.make_node("Add", ["h2g", "ln"], ["res"], name="residual"),
        helper.make_node("Div", ["res", "div_c"], ["res_d"], name="div"),
        helper.make_node("Sub", ["res_d", "sub_c"], ["res_s"], name="sub"),
    ]
    if opset >= 18:
        nodes.append(helper.make_node("ReduceMean", ["res_s", "mean_axes"], ["out"], name="mean", keepdims=0))
        inits_used = inits
    else:
        nodes.append(helper.make_node("ReduceMean", ["res_s"], ["out"], name="mean", axes=[1], keepdims=0))
        inits_used = inits[:-1]
    graph = helper.make_graph(
        nodes, "token_block",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 16])], inits_used)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def token_data(n: int = 8, seed: int = 1, batch: int = 2):
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, 20, (batch, 6)).astype(np.int64)} for _ in range(n)]


def residual_cnn(opset: int = 17, seed: int = 0, join: str = "Add") -> onnx.ModelProto:
    """input [N,3,16,16] -> Conv(8) "stem" -> Relu -> [Conv(8) "a" -> Relu -> Conv(8) "b"] -> Add(skip) -> Relu
    -> Conv(8, stride 2) "c" -> GlobalAveragePool -> Flatten -> Gemm(10) "fc": one residual block of two layers
    (a, b) between two single-activation cuts, the other layers alone. ``join="Mul"``: the skip joins by a
    product (a gate, as squeeze-and-excitation). Uses :func:`calib_data`."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w0", rng.normal(0, 0.3, (8, 3, 3, 3))), _init("b0", rng.normal(0, 0.1, 8)),
        _init("wa", rng.normal(0, 0.2, (8, 8, 3, 3))), _init("ba", rng.normal(0, 0.1, 8)),
        _init("wb", rng.normal(0, 0.2, (8, 8, 3, 3))), _init("bb", rng.normal(0, 0.1, 8)),
        _init("wc", rng.normal(0, 0.2, (8, 8, 3, 3))), _init("bc", rng.normal(0, 0.1, 8)),
        _init("fc_w", rng.normal(0, 0.3, (10, 8))), _init("fc_b", rng.normal(0, 0.1, 10)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w0", "b0"], ["c0"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "wa", "ba"], ["ca"], name="a", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["ca"], ["ra"], name="relua"),
        helper.make_node("Conv", ["ra", "wb", "bb"], ["cb"], name="b", pads=[1, 1, 1, 1]),
        helper.make_node(join, ["cb", "r0"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["rs"], name="relus"),
        helper.make_node("Conv", ["rs", "wc", "bc"], ["cc"], name="c", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["cc"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
    ]
    return _image_model(nodes, inits, "residual_cnn", "logits", opset)
