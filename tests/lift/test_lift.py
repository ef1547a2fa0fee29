"""lift(): the GraphModule contract, the TensorMap, and the error cases (small hand-built models)."""
from __future__ import annotations

import operator

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import fx

from qtorch_onnx.errors import ModelError, UnsupportedOpsError
from qtorch_onnx.lift import ModelInfo, TensorMap, TensorRef, lift

from .helpers import F, make_model, rel_l2, run_gm, run_ort, tensor_names

RNG = np.random.default_rng(2)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _mlp(trans_b: int):
    w = _rand(4, 3) if trans_b else _rand(3, 4)
    nodes = [
        helper.make_node("Gemm", ["x", "w", "c"], ["h"], name="fc", transB=trans_b),
        helper.make_node("Add", ["h", "shared"], ["h2"], name="add1"),
        helper.make_node("Mul", ["h2", "shared"], ["h3"], name="mul"),  # second use of the same initializer
        helper.make_node("Split", ["h3"], ["s0", "s1"], axis=1, name="split"),
        helper.make_node("Relu", ["s1"], ["r1"], name="relu1"),
        helper.make_node("Neg", ["s1"], ["n1"], name="neg1"),  # second use of a multi-output node's output
        helper.make_node("Add", ["r1", "n1"], ["y0"], name="add2"),
        helper.make_node("Add", ["s0", "z"], ["y1"], name="add3"),
    ]
    inits = {"w": w, "c": _rand(4), "shared": _rand(4),}
    return make_model(nodes, [("x", F, ["N", 3]), ("z", F, ["N", 2])], [("y1", F, None), ("s0", F, None), ("y0", F, None)],
                      inits, opset=13)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_forward_contract_and_parity(trans_b):
    m = _mlp(trans_b)
    gm = lift(m)
    assert isinstance(gm, fx.GraphModule) and not gm.training
    assert gm.input_names == ("x", "z") and gm.output_names == ("y1", "s0", "y0")
    feeds = {"x": _rand(5, 3), "z": _rand(5, 2)}
    out = run_gm(gm, feeds)
    for w, g in zip(run_ort(m, feeds), out):
        assert w.shape == g.shape and rel_l2(w, g) < 1e-6


def test_single_output_is_a_tensor_not_a_tuple():
    m = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [2])], [("y", F, [2])])
    out = lift(m)(torch.tensor([-1.0, 2.0]))
    assert isinstance(out, torch.Tensor) and out.tolist() == [0.0, 2.0]


@pytest.mark.parametrize("trans_b", [0, 1])
def test_tensor_map_small_model(trans_b):
    m = _mlp(trans_b)
    gm = lift(m)
    tm: TensorMap = gm.tensor_map
    # every ONNX tensor maps somewhere
    assert set(tm.graph.tensors) == tensor_names(gm.onnx_model) <= set(tm)
    # Gemm B lives in nn.Linear.weight, transposed when transB == 0; C is the bias
    (wref,) = tm["w"]
    assert wref.kind == "param" and wref.attr == "weight" and wref.perm == (None if trans_b else (1, 0))
    w = torch.from_numpy(onnx.numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "w")))
    param = wref.resolve(gm)
    assert torch.equal((w if wref.perm is None else w.permute(wref.perm)).reshape(param.shape), param)
    (cref,) = tm["c"]
    assert cref.kind == "param" and cref.attr == "bias"
    assert tm.tensor_of_param(wref.module, "weight") == "w"
    # an initializer read by two nodes is ONE get_attr node used twice
    (sref,) = tm["shared"]
    node = sref.resolve(gm)
    assert sref.kind == "node" and node.op == "get_attr" and len(node.users) == 2
    # one getitem node per output of a multi-output node, shared by its consumers
    (s1,) = tm["s1"]
    item = TensorMap.fx_node(gm, s1.node_name)
    assert item.target is operator.getitem and len(item.users) == 2
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert len(getitems) == 2
    # reverse lookups
    for name in ("x", "h", "s0", "s1", "y0", "shared"):
        assert tm.tensor_of_node(tm.node_name(name)) == name
    # graph inputs are placeholders in ONNX order
    assert [TensorMap.fx_node(gm, tm.node_name(n)).op for n in ("x", "z")] == ["placeholder"] * 2


def test_tensor_map_values_are_the_onnx_tensors():
    """Every fx node the TensorMap names carries the value ONNX Runtime computes for that tensor."""
    m = _mlp(0)
    gm = lift(m)
    g = onnx.ModelProto()
    g.CopyFrom(gm.onnx_model)
    inner = [n for n in gm.tensor_map.graph.tensors if gm.tensor_map.graph.tensors[n].producer]
    del g.graph.output[:]
    g.graph.output.extend([helper.make_tensor_value_info(n, F, None) for n in inner])
    feeds = {"x": _rand(5, 3), "z": _rand(5, 2)}
    want = dict(zip(inner, run_ort(g, feeds)))
    env = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            env[n.name] = super().run_node(n)
            return env[n.name]

    with torch.no_grad():
        Recorder(gm).run(*[torch.from_numpy(feeds[k]) for k in gm.input_names])
    for name in inner:
        got = env[gm.tensor_map.node_name(name)].numpy()
        assert got.shape == want[name].shape and rel_l2(want[name], got) < 1e-6, name


def test_model_info():
    gm = lift(_mlp(1))
    info: ModelInfo = gm.tensor_map.graph
    fc = info.nodes["fc"]
    assert (fc.op_type, fc.domain, fc.inputs, fc.outputs) == ("Gemm", "", ("x", "w", "c"), ("h",))
    assert fc.attributes["transB"] == 1 and fc.module and fc.fx_node
    assert gm.get_submodule(fc.module) is not None
    t = info.tensors["s1"]
    assert t.producer == "split" and t.consumers == ("relu1", "neg1") and t.is_float and not t.is_initializer
    assert info.tensors["w"].is_initializer and info.tensors["w"].shape == (4, 3)
    assert info.tensors["x"].is_graph_input and info.tensors["y0"].is_graph_output
    assert info.tensors["x"].shape == (None, 3)
    assert info.input_names == ("x", "z") and info.output_names == ("y1", "s0", "y0")


def test_initializer_in_several_modules_maps_to_all():
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["a", "w"], ["y"], name="c2", pads=[1, 1, 1, 1])]
    m = make_model(nodes, [("x", F, [1, 2, 5, 5])], [("y", F, None)], {"w": _rand(2, 2, 3, 3)}, opset=13)
    gm = lift(m)
    refs = gm.tensor_map["w"]
    assert len(refs) == 2 and {r.kind for r in refs} == {"param"} and len({r.module for r in refs}) == 2
    feeds = {"x": _rand(1, 2, 5, 5)}
    assert rel_l2(run_ort(m, feeds)[0], run_gm(gm, feeds)[0]) < 1e-6


def test_tensor_map_key_error_names_aliases():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["r_id"]),
             helper.make_node("Neg", ["r_id"], ["y"])]
    gm = lift(make_model(nodes, [("x", F, [2])], [("y", F, [2])]))
    gone = [n for n in ("r", "r_id") if n not in gm.tensor_map]
    assert len(gone) == 1
    with pytest.raises(KeyError, match="replaced"):
        gm.tensor_map[gone[0]]


def test_fold_batchnorm_through_lift():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"], name="bn")]
    inits = {"w": _rand(3, 2, 1, 1), "s": _rand(3), "b": _rand(3), "m": _rand(3), "v": np.abs(_rand(3)) + 0.5}
    m = make_model(nodes, [("x", F, [1, 2, 4, 4])], [("y", F, None)], inits, opset=13)
    gm = lift(m, fold_batchnorm=True)
    assert [n.op_type for n in gm.onnx_model.graph.node] == ["Conv"]
    conv = gm.onnx_model.graph.node[0]
    assert conv.input[2] == "conv_bias_bnfold" and gm.tensor_map[conv.input[2]][0].attr == "bias"
    assert gm.tensor_map.aliases["c"] == "y" and gm.tensor_map.aliases["b"] is None
    feeds = {"x": _rand(1, 2, 4, 4)}
    assert rel_l2(run_ort(m, feeds)[0], run_gm(gm, feeds)[0]) < 1e-6


def test_input_model_not_mutated_by_lift():
    m = _mlp(0)
    before = m.SerializeToString()
    gm = lift(m, fold_batchnorm=True)
    assert m.SerializeToString() == before and gm.onnx_model is not m


def test_not_onnx_file_is_a_model_error(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_text("this is not a protobuf, just some text\n" * 10)
    with pytest.raises(ModelError, match="model.onnx"):
        lift(bad)
    with pytest.raises(ModelError, match="missing.onnx"):
        lift(tmp_path / "missing.onnx")


def test_lift_from_path(tmp_path):
    m = _mlp(1)
    p = tmp_path / "mlp.onnx"
    onnx.save(m, str(p))
    gm = lift(p)
    feeds = {"x": _rand(2, 3), "z": _rand(2, 2)}
    for w, g in zip(run_ort(m, feeds), run_gm(gm, feeds)):
        assert rel_l2(w, g) < 1e-6


def test_all_unsupported_ops_in_one_error():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("MyOp", ["a"], ["b"], name="custom1", domain="com.example"),
        helper.make_node("MyOp", ["b"], ["c"], name="custom2", domain="com.example"),
        helper.make_node("Bernoulli", ["c"], ["d"], name="bern"),
        helper.make_node("RandomUniformLike", ["d"], ["y"], name="rul"),
    ]
    m = make_model(nodes, [("x", F, [1, 1, 4, 4])], [("y", F, None)], {"sc": np.array([1, 1, 2, 2], np.float32)},
                   opset=18)
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOpsError) as info:
        lift(m)
    ops = {(d, op, v): nodes for d, op, v, nodes in info.value.ops}
    assert ops == {("com.example", "MyOp", 1): ["custom1", "custom2"], ("", "Bernoulli", 18): ["bern"],
                   ("", "RandomUniformLike", 18): ["rul"]}
    msg = str(info.value)
    assert "custom2" in msg and "Bernoulli" in msg and "RandomUniformLike" in msg and "com.example" in msg


def test_tensor_ref_is_frozen_and_named():
    r = TensorRef("param", module="fc", attr="weight", perm=(1, 0))
    with pytest.raises(Exception):
        r.kind = "node"  # type: ignore[misc]


def test_initializer_listed_as_input_and_output_passthrough():
    nodes = [helper.make_node("Add", ["x", "bias"], ["y"], name="add")]
    m = make_model(nodes, [("x", F, [2])], [("y", F, [2]), ("x", F, [2])], {"bias": np.array([1, 2], np.float32)})
    m.graph.input.append(helper.make_tensor_value_info("bias", F, [2]))  # IR < 4 style overridable input
    gm = lift(m)
    assert gm.input_names == ("x",) and gm.output_names == ("y", "x")
    y, x = gm(torch.tensor([1.0, 1.0]))
    assert y.tolist() == [2.0, 3.0] and x.tolist() == [1.0, 1.0]


def test_lifted_module_deepcopies_and_pickles(tmp_path):
    import copy
    import pickle

    gm = lift(_mlp(0))
    clone = copy.deepcopy(gm)
    assert clone.tensor_map["w"] == gm.tensor_map["w"] and clone.output_names == gm.output_names
    assert clone.tensor_map.graph.nodes["fc"].attributes["transB"] == 0
    feeds = {"x": _rand(2, 3), "z": _rand(2, 2)}
    for a, b in zip(run_gm(gm, feeds), run_gm(clone.double().float(), feeds)):
        np.testing.assert_array_equal(a, b)
    pickle.loads(pickle.dumps(gm.tensor_map))


def test_conv_after_unknown_rank_reshape_gets_its_rank():
    from .helpers import I64

    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]),
             helper.make_node("Conv", ["r", "w"], ["c"], name="conv"),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn")]
    inits = {"w": _rand(3, 2, 1, 1), "g": _rand(3), "b": _rand(3), "m": _rand(3), "v": np.abs(_rand(3)) + 0.5}
    m = make_model(nodes, [("x", F, [8, 4]), ("s", I64, ["k"])], [("y", F, None)], inits, opset=13)
    gm = lift(m)
    assert len(gm.tensor_map.graph.tensors["c"].shape) == 4
    feeds = {"x": _rand(8, 4), "s": np.array([1, 2, 4, 4], np.int64)}
    assert rel_l2(run_ort(m, feeds)[0], run_gm(gm, feeds)[0]) < 1e-6


def test_one_graph_index_shared_by_lift_and_placement():
    """The lifter's ModelInfo is the index placement, qm.plan and the importer read (issue 15 item 3): built
    once, reads counted per input slot, producer / initializer / NodeProto views of the lifted ONNX model."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    import qtorch_onnx as qo

    w = numpy_helper.from_array(np.ones((3, 3, 1, 1), np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
         helper.make_node("Mul", ["c", "c"], ["y"], name="square")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    qm = qo.prepare(model, "A8W8")
    info: ModelInfo = qm.tensor_map.graph
    assert qm.plan.info is info and info.model is qm.onnx_model
    assert info.reads["c"] == ["square", "square"] and info.tensors["c"].consumers == ("square",)
    assert info.producer["y"] == "square" and info.node_protos["conv"].op_type == "Conv"
    assert set(info.initializers) == {"w"} and info.is_float32("x") and info.shapes["w"] == (3, 3, 1, 1)
    assert info.all_tensors()[:2] == ["x", "w"]
    assert isinstance(info.rebuilt(), ModelInfo) and info.rebuilt().reads == info.reads
    onnx.checker.check_model(model)  # the user's model is untouched
