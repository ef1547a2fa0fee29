"""If (runtime condition), Loop and Scan converters against ONNX Runtime, and the lifted subgraphs'
parameters, TensorMap entries and error reporting."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from qtorch_onnx.errors import DataError, UnsupportedOpsError
from qtorch_onnx.lift import TensorMap, lift
from qtorch_onnx.lift.control_flow import OnnxIf, OnnxLoop, OnnxScan, free_variables

from .helpers import I64, F, make_model, rel_l2, run_gm, run_ort

B = TensorProto.BOOL
RNG = np.random.default_rng(7)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _graph(nodes, name, inputs, outputs, inits=None):
    return helper.make_graph(nodes, name, [_vi(*i) for i in inputs], [_vi(*o) for o in outputs],
                             [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])


def _check(m, feeds, tol=1e-6, gm=None):
    gm = gm or lift(m)
    want, got = run_ort(m, feeds), run_gm(gm, feeds)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.dtype == g.dtype, (w.shape, g.shape, w.dtype, g.dtype)
        assert rel_l2(w, g) < tol
    return gm


# ------------------------------------------------------------------------------------------------ If
def _if_model():
    """y = If(sum(x) > 0): then Relu(x @ W + h) and a nested If on a second condition; else Sigmoid(h * 2).

    The branches read the graph input ``x``, the intermediate ``h`` and the outer initializers ``W``,
    ``two``; the nested If reads ``h`` two levels out. The second output ``z`` is ``t1`` or ``Identity(x)``.
    """
    nested_then = _graph([helper.make_node("Add", ["t1", "h"], ["n1"], name="nadd")], "nested_then", [],
                         [("n1", F, None)])
    nested_else = _graph([helper.make_node("Sub", ["t1", "h"], ["n2"], name="nsub")], "nested_else", [],
                         [("n2", F, None)])
    then_g = _graph([
        helper.make_node("MatMul", ["x", "W"], ["t0"], name="mm"),
        helper.make_node("Relu", ["t0"], ["t1"], name="relu"),
        helper.make_node("If", ["c2"], ["t2"], name="inner_if", then_branch=nested_then, else_branch=nested_else),
        helper.make_node("Mul", ["t2", "two"], ["t3"], name="mul"),
    ], "then", [], [("t3", F, None), ("t1", F, None)])
    else_g = _graph([helper.make_node("Mul", ["h", "two"], ["e0"], name="emul"),
                     helper.make_node("Sigmoid", ["e0"], ["e1"], name="sig"),
                     helper.make_node("Identity", ["x"], ["e2"], name="idx")], "else", [],
                    [("e1", F, None), ("e2", F, None)])
    nodes = [
        helper.make_node("Neg", ["x"], ["h"], name="neg"),
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
        helper.make_node("If", ["c"], ["y", "z"], name="outer_if", then_branch=then_g, else_branch=else_g),
    ]
    inits = {"W": _rand(3, 3), "two": np.array(2.0, np.float32), "zero": np.array(0.0, np.float32)}
    return make_model(nodes, [("x", F, [2, 3]), ("c2", B, [])], [("y", F, None), ("z", F, None)], inits, opset=13)


@pytest.mark.parametrize("sign,c2", [(1.0, True), (1.0, False), (-1.0, True)])
def test_if_runtime_condition_nested_and_outer_scope(sign, c2):
    m = _if_model()
    x = np.abs(_rand(2, 3)) * sign
    gm = _check(m, {"x": x, "c2": np.array(c2)})
    assert isinstance(gm.get_submodule("outer_if"), OnnxIf)
    # the outer initializer W was copied into the branch: a buffer of the MatMul's inputs there, mapped
    tm: TensorMap = gm.tensor_map
    assert set(tm.subgraphs) == {"outer_if.then_branch", "outer_if.else_branch",
                                 "outer_if.then_branch.inner_if.then_branch", "outer_if.then_branch.inner_if.else_branch"}
    # a tensor that only exists in a subgraph: scoped fx node that resolves in that GraphModule
    (ref,) = tm["t1"]
    assert ref.kind == "node" and ref.scope == "outer_if.then_branch"
    node = ref.resolve(gm)
    assert node.graph is gm.get_submodule("outer_if.then_branch").graph
    assert tm.tensor_of_node(ref.node_name, scope=ref.scope) == "t1" and tm.node_name("t1") is None
    # main-graph tensors keep only their top-level refs
    assert all(r.scope is None for r in tm["h"])
    assert set(tm.graph.tensors) >= {"x", "h", "s", "c", "y", "z"} and "t1" not in tm.graph.tensors


def test_if_branch_parameters_train_and_deepcopy():
    """Dynamo-style If whose branches read an outer Gemm weight: parameters in both branches, gradients."""
    then_g = _graph([helper.make_node("Gemm", ["x", "Wt", "b"], ["g"], name="gemm_t", transB=1),
                     helper.make_node("Relu", ["g"], ["yt"], name="relu_t")], "then", [], [("yt", F, None)])
    else_g = _graph([helper.make_node("Gemm", ["x", "Wt", "b"], ["g2"], name="gemm_e", transB=1),
                     helper.make_node("Sigmoid", ["g2"], ["ye"], name="sig_e")], "else", [], [("ye", F, None)])
    nodes = [helper.make_node("If", ["c"], ["y"], name="cond", then_branch=then_g, else_branch=else_g)]
    m = make_model(nodes, [("c", B, []), ("x", F, [2, 4])], [("y", F, None)], {"Wt": _rand(3, 4), "b": _rand(3)},
                   opset=13)
    gm = lift(m)
    for c in (True, False):
        _check(m, {"c": np.array(c), "x": _rand(2, 4)}, gm=gm)
    refs = gm.tensor_map["Wt"]
    assert {r.kind for r in refs} == {"param"} and len(refs) == 2  # one copy per branch
    for r in refs:
        assert r.module.startswith("cond.") and r.resolve(gm).requires_grad
    x = torch.from_numpy(_rand(2, 4))
    gm(torch.tensor(True), x).sum().backward()
    grads = [r.resolve(gm).grad for r in refs]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) == 1  # only the branch that ran
    clone = copy.deepcopy(gm)
    assert torch.equal(clone(torch.tensor(False), x), gm(torch.tensor(False), x))
    assert clone.tensor_map.subgraphs.keys() == gm.tensor_map.subgraphs.keys()


def test_if_branch_returning_outer_values_and_initializers_directly():
    """Legal ONNX that ONNX Runtime refuses (an outer value as a branch output, no node in between)."""
    k = _rand(3)
    then_g = _graph([], "then", [], [("x", F, None), ("k", F, None)], {"k": k})
    else_g = _graph([helper.make_node("Neg", ["x"], ["nx"], name="neg")], "else", [], [("nx", F, None), ("x", F, None)])
    m = make_model([helper.make_node("If", ["c"], ["y", "z"], name="pass_if", then_branch=then_g, else_branch=else_g)],
                   [("c", B, []), ("x", F, [3])], [("y", F, None), ("z", F, None)], opset=13)
    gm = lift(m)
    x = torch.from_numpy(_rand(3))
    y, z = gm(torch.tensor(True), x)
    assert torch.equal(y, x) and np.array_equal(z.numpy(), k)
    y, z = gm(torch.tensor(False), x)
    assert torch.equal(y, -x) and torch.equal(z, x)


def test_overridden_converter_inside_a_branch_keeps_the_node_name():
    """Pad-13 reflect on a rank-2 tensor (onnx2torch's own module fails on it at run time; the lifter routes
    the node to the registered override before conversion) inside an If branch, as silero-vad has it."""
    then_g = _graph([helper.make_node("Pad", ["x", "pads"], ["p"], name="reflect_pad", mode="reflect")], "then", [],
                    [("p", F, None)])
    else_g = _graph([helper.make_node("Pad", ["x", "pads"], ["q"], name="edge_pad", mode="edge")], "else", [],
                    [("q", F, None)])
    m = make_model([helper.make_node("If", ["c"], ["y"], name="pads_if", then_branch=then_g, else_branch=else_g)],
                   [("c", B, []), ("x", F, [2, 5])], [("y", F, None)], {"pads": np.array([0, 2, 0, 3], np.int64)},
                   opset=13)
    gm = lift(m)
    for c in (True, False):
        _check(m, {"c": np.array(c), "x": _rand(2, 5)}, gm=gm)
    assert "reflect_pad" in dict(gm.get_submodule("pads_if.then_branch").named_children())


def test_if_condition_must_have_one_element():
    gm = lift(_if_model())
    with pytest.raises(DataError, match="outer_if.*one element"):
        gm.get_submodule("outer_if")(torch.tensor([True, False]), torch.zeros(2, 3))


def test_unsupported_op_inside_a_branch_is_named():
    then_g = _graph([helper.make_node("MyOp", ["x"], ["a"], name="custom", domain="com.example")], "then", [],
                    [("a", F, None)])
    else_g = _graph([helper.make_node("Relu", ["x"], ["b"], name="ok")], "else", [], [("b", F, None)])
    m = make_model([helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=then_g, else_branch=else_g)],
                   [("c", B, []), ("x", F, [2, 3])], [("y", F, None)], opset=13)
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOpsError) as info:
        lift(m)
    assert info.value.ops == [("com.example", "MyOp", 1, ["branchy/then_branch/custom"])]


def test_free_variables_and_unknown_outer_name():
    g = _graph([helper.make_node("Add", ["a", "outer1"], ["b"]),
                helper.make_node("If", ["cc"], ["d"], then_branch=_graph(
                    [helper.make_node("Mul", ["b", "outer2"], ["e"])], "t", [], [("e", F, None)]),
                    else_branch=_graph([], "e", [], [("outer3", F, None)]))], "g", [("a", F, None)], [("d", F, None)])
    # first use first; a node's graph attributes in their stored order (make_node sorts: else before then)
    assert free_variables(g) == ["outer1", "cc", "outer3", "outer2"]
    then_g = _graph([helper.make_node("Relu", ["nowhere"], ["a"], name="r")], "then", [], [("a", F, None)])
    m = make_model([helper.make_node("If", ["c"], ["y"], name="bad_if", then_branch=then_g, else_branch=then_g)],
                   [("c", B, [])], [("y", F, None)], opset=13)
    with pytest.raises(UnsupportedOpsError, match="nowhere"):
        lift(m)


# ------------------------------------------------------------------------------------------------ Loop
def _loop_model(with_max=True, with_cond=True, iter_rank=0, n_scan=2):
    """Carried (acc [2], k int64 scalar), scan outputs acc*i and a constant-shape slice; the body stops when
    acc's sum exceeds ``limit`` (an outer value) and reads the outer initializer ``step``."""
    body_nodes = [
        helper.make_node("Cast", ["i"], ["fi"], to=F, name="cast"),
        helper.make_node("Mul", ["step", "fi"], ["inc"], name="inc"),
        helper.make_node("Add", ["acc_in", "inc"], ["acc_out"], name="acc"),
        helper.make_node("Add", ["k_in", "one"], ["k_out"], name="k"),
        helper.make_node("ReduceSum", ["acc_out"], ["tot"], keepdims=0, name="tot"),
        helper.make_node("Less", ["tot", "limit"], ["cond_out"], name="less"),
        helper.make_node("Mul", ["acc_out", "fi"], ["scan0"], name="scan0"),
        helper.make_node("Identity", ["inc"], ["scan1"], name="scan1"),
    ]
    body = _graph(body_nodes, "body",
                  [("i", I64, [1] * iter_rank), ("cond_in", B, []), ("acc_in", F, [2]), ("k_in", I64, [])],
                  [("cond_out", B, []), ("acc_out", F, [2]), ("k_out", I64, []), ("scan0", F, [2]),
                   ("scan1", F, [2])][: 3 + n_scan])
    outs = ["acc_final", "k_final", "scans0", "scans1"][: 2 + n_scan]
    node = helper.make_node("Loop", ["M" if with_max else "", "c0" if with_cond else "", "acc0", "k0"], outs,
                            name="loop", body=body)
    inputs = [("M", I64, []), ("c0", B, []), ("acc0", F, [2]), ("limit", F, [])]
    inits = {"step": np.array([0.5, 1.0], np.float32), "one": np.array(1, np.int64), "k0": np.array(0, np.int64)}
    return make_model([node], inputs, [(o, F if "acc" in o or "scans" in o else I64, None) for o in outs], inits,
                      opset=13)


@pytest.mark.parametrize("with_max,with_cond,M,c0,limit", [
    (True, True, 5, True, 100.0),     # runs M times
    (True, True, 50, True, 6.0),      # stops when the body's condition turns false
    (True, True, 5, False, 100.0),    # cond false: zero iterations, empty scan outputs
    (True, True, 0, True, 100.0),     # M = 0
    (True, False, 4, True, 100.0),    # for loop (cond input omitted)
    (False, True, 0, True, 9.0),      # while loop (M omitted)
])
def test_loop_against_onnxruntime(with_max, with_cond, M, c0, limit):
    m = _loop_model(with_max, with_cond)
    feeds = {"M": np.array(M, np.int64), "c0": np.array(c0), "acc0": _rand(2), "limit": np.array(limit, np.float32)}
    gm = _check(m, feeds)
    assert isinstance(gm.get_submodule("loop"), OnnxLoop)


def test_loop_iteration_number_rank_1_and_no_scan_outputs():
    m = _loop_model(iter_rank=1, n_scan=0)
    _check(m, {"M": np.array(3, np.int64), "c0": np.array(True), "acc0": _rand(2), "limit": np.array(50.0, np.float32)})


def test_loop_body_with_nested_if_on_the_iteration_number():
    """The body's If reads the body's formal inputs (i, acc) and an outer graph input two levels out."""
    even = _graph([helper.make_node("Add", ["acc_in", "delta"], ["e"], name="plus")], "even", [], [("e", F, None)])
    odd = _graph([helper.make_node("Sub", ["acc_in", "delta"], ["o"], name="minus")], "odd", [], [("o", F, None)])
    body = _graph([helper.make_node("Mod", ["i", "two"], ["r"], name="mod"),
                   helper.make_node("Equal", ["r", "zero"], ["is_even"], name="eq"),
                   helper.make_node("If", ["is_even"], ["acc_out"], name="parity", then_branch=even, else_branch=odd),
                   helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep")], "body",
                  [("i", I64, []), ("cond_in", B, []), ("acc_in", F, [3])],
                  [("cond_out", B, []), ("acc_out", F, [3]), ("acc_out", F, [3])])  # carried and scanned
    m = make_model([helper.make_node("Loop", ["M", "", "acc0"], ["acc", "trace"], name="loop", body=body)],
                   [("M", I64, []), ("acc0", F, [3]), ("delta", F, [3])], [("acc", F, None), ("trace", F, None)],
                   {"two": np.array(2, np.int64), "zero": np.array(0, np.int64)}, opset=13)
    gm = _check(m, {"M": np.array(5, np.int64), "acc0": _rand(3), "delta": _rand(3)})
    assert "loop.body.parity.then_branch" in gm.tensor_map.subgraphs


# ------------------------------------------------------------------------------------------------ Scan
def _scan_model(opset=11):
    """State s [2]; scan inputs a [T, 2] (axis 0, forward) and b [2, T] (axis 1, reverse); outputs
    y0 = s + a_t (axis 0, forward), y1 = b_t * w (axis -1, reverse); reads the outer initializer w."""
    body = _graph([helper.make_node("Add", ["s_in", "a_t"], ["s_out"], name="add"),
                   helper.make_node("Mul", ["b_t", "w"], ["p"], name="mul"),
                   helper.make_node("Add", ["s_out", "p"], ["y0"], name="y0"),
                   helper.make_node("Identity", ["p"], ["y1"], name="y1")], "body",
                  [("s_in", F, [2]), ("a_t", F, [2]), ("b_t", F, [2])],
                  [("s_out", F, [2]), ("y0", F, [2]), ("y1", F, [2])])
    node = helper.make_node("Scan", ["s0", "a", "b"], ["s_final", "ys0", "ys1"], name="scan", body=body,
                            num_scan_inputs=2, scan_input_axes=[0, 1], scan_input_directions=[0, 1],
                            scan_output_axes=[0, -1], scan_output_directions=[0, 1])
    return make_model([node], [("s0", F, [2]), ("a", F, [4, 2]), ("b", F, [2, 4])],
                      [("s_final", F, None), ("ys0", F, None), ("ys1", F, None)], {"w": _rand(2)}, opset=opset)


@pytest.mark.parametrize("opset", [11, 16])
def test_scan_axes_and_directions(opset):
    m = _scan_model(opset)
    gm = _check(m, {"s0": _rand(2), "a": _rand(4, 2), "b": _rand(2, 4)})
    assert isinstance(gm.get_submodule("scan"), OnnxScan)


def test_scan_lengths_must_agree():
    gm = lift(_scan_model())
    with pytest.raises(DataError, match="scan.*lengths"):
        gm(torch.zeros(2), torch.zeros(4, 2), torch.zeros(2, 3))


def test_scan8_batched_with_sequence_lens_and_directions():
    body = _graph([helper.make_node("Add", ["s_in", "x_t"], ["s_out"], name="add"),
                   helper.make_node("Mul", ["s_out", "r_t"], ["y"], name="mul")], "body",
                  [("s_in", F, [3]), ("x_t", F, [3]), ("r_t", F, [3])], [("s_out", F, [3]), ("y", F, [3])])
    node = helper.make_node("Scan", ["lens", "s0", "x", "r"], ["s_final", "ys"], name="scan8", body=body,
                            num_scan_inputs=2, directions=[0, 1])
    m = make_model([node], [("lens", I64, [2]), ("s0", F, [2, 3]), ("x", F, [2, 5, 3]), ("r", F, [2, 5, 3])],
                   [("s_final", F, None), ("ys", F, None)], opset=8)
    for lens in ([5, 5], [5, 2], [3, 1]):  # (ONNX Runtime rejects a length of 0)
        _check(m, {"lens": np.array(lens, np.int64), "s0": _rand(2, 3), "x": _rand(2, 5, 3), "r": _rand(2, 5, 3)})
