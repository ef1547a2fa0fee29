"""Models quantized by AMD Quark 0.13 itself run under this project's operator library with Quark's bits.

The data in ``tests/data/quark_interop/`` (see its README) was made by ``benchmarks/quark_interop.py
--save-ci-data`` in a separate virtual environment holding Quark: the small test cnn quantized by Quark's
``ModelQuantizer`` with its default configs (BFP16, MX4/6/9, MXINT8, MXFP8/6/4, BF16, FP16, mixes) and an
INT32-activation config, its inputs, Quark's whole-model outputs and, for every ``com.amd.quark`` node, the
inputs it saw and the outputs it gave under Quark's compiled operator library (ONNX Runtime 1.28,
``ORT_DISABLE_ALL``, one thread). Quark is not needed here.

Checks, per model: ``onnx.checker`` (full) accepts it; every library node, fed Quark's input for it, gives
Quark's output bit for bit (float32 compared as uint32; bfloat16 codes via a lossless Cast to float); the
whole model under this environment's ONNX Runtime gives Quark's outputs bit for bit (the float operators
between the quantizers are ONNX Runtime's own, on one thread, in both runs); and the lifter's verdict.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

from qtorch_onnx import get_library_path

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quark_interop")
MANIFEST = os.path.join(DATA, "manifest.json")
CUSTOM = ("com.amd.quark", "com.vai.quantize")


def _manifest() -> dict:
    with open(MANIFEST) as fh:
        return json.load(fh)


CONFIGS = sorted(_manifest()["models"])


@pytest.fixture(scope="module")
def lib() -> str:
    path = get_library_path()
    assert os.path.isfile(path)
    return path


def _load_packed(path: str) -> dict:
    """The data's npz layout (benchmarks/quark_interop.py ``save_packed``): ``data``, the arrays' bytes back to
    back, and ``index``, a JSON list of ``{name, dtype, shape, offset}``."""
    with np.load(path, allow_pickle=False) as z:
        blob = z["data"].tobytes()
        index = json.loads(str(z["index"]))
    out = {}
    for e in index:
        dt = np.dtype(e["dtype"])
        n = int(np.prod(e["shape"], dtype=np.int64))
        out[e["name"]] = np.frombuffer(blob, dtype=dt, count=n, offset=e["offset"]).reshape(e["shape"]).copy()
    return out


def _case(config: str):
    entry = _manifest()["models"][config]
    path = os.path.join(DATA, entry["model"])
    with open(path, "rb") as fh:
        raw = fh.read()
    assert hashlib.sha256(raw).hexdigest() == entry["sha256"], f"{entry['model']} differs from the manifest"
    arrays = _load_packed(os.path.join(DATA, entry["arrays"]))
    samples = {}
    for key, v in arrays.items():
        kind, i, name = key.split("\t", 2)
        samples.setdefault(int(i), {}).setdefault(kind, {})[name] = v
    return entry, onnx.load_from_string(raw), [samples[i] for i in sorted(samples)]


def _session(model: onnx.ModelProto, lib: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    so.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint16) if a.dtype == np.float16 else a


def _node_types(model: onnx.ModelProto) -> dict:
    """Element type of every library node output: block ops keep the input type (float32 here), Extended Q
    gives its zero point's type, Extended DQ float32."""
    inits = {t.name: t for t in model.graph.initializer}
    types = {}
    for n in model.graph.node:
        if n.domain not in CUSTOM:
            continue
        if "QuantizeLinear" in n.op_type and "Dequantize" not in n.op_type:
            types[n.output[0]] = inits[n.input[2]].data_type
        else:
            types[n.output[0]] = T.FLOAT
    return types


def _every_node_alone(model: onnx.ModelProto):
    """One model holding every library node, each input that is not an initializer replaced by a graph input
    (float32; bfloat16 codes arrive as float32 and pass a lossless Cast), each output exposed as float
    or as its integer type. Returns ``(model, {graph input: original tensor}, {graph output: original tensor})``."""
    inits = {t.name: t for t in model.graph.initializer}
    types = _node_types(model)
    nodes, g_in, g_out, used = [], [], [], set()
    feeds, outs = {}, {}
    for j, src in enumerate(n for n in model.graph.node if n.domain in CUSTOM):
        n = onnx.NodeProto()
        n.CopyFrom(src)
        for p, name in enumerate(src.input):
            if not name:
                continue
            if name in inits:
                used.add(name)
                continue
            new = f"n{j}_in{p}"
            feeds[new] = name
            et = types.get(name, T.FLOAT)
            g_in.append(helper.make_tensor_value_info(new, T.FLOAT if et == T.BFLOAT16 else et, None))
            if et == T.BFLOAT16:
                nodes.append(helper.make_node("Cast", [new], [f"{new}_bf16"], to=T.BFLOAT16))
                new = f"{new}_bf16"
            n.input[p] = new
        out = f"n{j}_out"
        n.output[0] = out
        nodes.append(n)
        et = types[src.output[0]]
        if et == T.BFLOAT16:
            nodes.append(helper.make_node("Cast", [out], [f"{out}_f32"], to=T.FLOAT))
            out, et = f"{out}_f32", T.FLOAT
        g_out.append(helper.make_tensor_value_info(out, et, None))
        outs[out] = src.output[0]
    graph = helper.make_graph(nodes, "quark_nodes", g_in, g_out, [inits[u] for u in sorted(used)])
    m = helper.make_model(graph, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    return m, feeds, outs


def test_data_covers_every_quark_operator():
    """The saved models exercise both block operators and the Extended Q/DQ pair (bfloat16, float16, int32
    zero points), so the replay below cannot silently shrink."""
    ops, zp_types = set(), set()
    for config in CONFIGS:
        _, model, _ = _case(config)
        inits = {t.name: t for t in model.graph.initializer}
        for n in model.graph.node:
            if n.domain in CUSTOM:
                ops.add(n.op_type)
                if n.op_type == "ExtendedQuantizeLinear":
                    zp_types.add(inits[n.input[2]].data_type)
    assert {"BFPQuantizeDequantize", "MXQuantizeDequantize", "ExtendedQuantizeLinear",
            "ExtendedDequantizeLinear"} <= ops
    assert {T.BFLOAT16, T.FLOAT16, T.INT32} <= zp_types
    assert {"BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP4E2M1", "BF16", "A32W8"} <= set(CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_quark_nodes_bit_identical(config, lib):
    """Every com.amd.quark node, fed the input it saw under Quark's library, gives Quark's output bits."""
    entry, model, samples = _case(config)
    onnx.checker.check_model(model, full_check=True)
    n_nodes = sum(1 for n in model.graph.node if n.domain in CUSTOM)
    assert n_nodes == sum(entry["library_nodes"].values()) and n_nodes > 0
    alone, feeds, outs = _every_node_alone(model)
    sess = _session(alone, lib)
    names = [o.name for o in sess.get_outputs()]
    for s in samples:
        known = {**s["node_in"], **s["node_out"]}
        got = sess.run(names, {g: known[orig] for g, orig in feeds.items()})
        for name, y in zip(names, got):
            want = s["node_out"][outs[name]]
            assert y.dtype == want.dtype and y.shape == want.shape, (config, outs[name])
            diff = np.count_nonzero(_bits(y) != _bits(want))
            assert diff == 0, f"{config}: node output {outs[name]!r}: {diff}/{y.size} elements differ from Quark"


@pytest.mark.parametrize("config", CONFIGS)
def test_quark_model_outputs_bit_identical(config, lib):
    """The whole Quark-quantized model under our library gives Quark's outputs bit for bit."""
    _, model, samples = _case(config)
    sess = _session(model, lib)
    names = [o.name for o in sess.get_outputs()]
    for s in samples:
        got = sess.run(names, s["input"])
        for name, y in zip(names, got):
            want = s["output"][name]
            assert np.array_equal(_bits(y), _bits(want)), (config, name, float(np.abs(y - want).max()))


@pytest.mark.parametrize("config", CONFIGS)
def test_lifter_on_quark_models(config):
    """This project's lifter on a Quark model (com.amd.quark nodes lifted by qtorch_onnx/interop/ops_quark.py, com.microsoft
    Q/DQ weights, run-time Conv weights): the torch module gives Quark's library's outputs bit for bit. The float
    ops between quantizers may differ in the last bit, but every quantizer absorbs that here, except with
    INT32 activations (A32W8), whose step is finer than a float32 ulp: compared to 1e-6 there."""
    import torch

    import qtorch_onnx as qo

    _, model, samples = _case(config)
    gm = qo.lift(model)
    for s in samples:
        with torch.no_grad():
            y = gm(*[torch.from_numpy(v) for v in s["input"].values()])
        y = (y[0] if isinstance(y, (tuple, list)) else y).numpy()
        want = next(iter(s["output"].values()))
        if config == "A32W8":
            assert np.abs(y - want).max() <= 1e-6
        else:
            assert np.array_equal(_bits(y), _bits(want)), (config, float(np.abs(y - want).max()))
