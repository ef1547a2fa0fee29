"""The C++ ONNX Runtime operator library (export/ort_ops, docs/operators.md) through ONNX Runtime.

* every golden case of Quark 0.13's operators (bfp, bfp_prime, mx, extended_qdq), bit for bit, all cases of
  a file batched into one model (one node per case, named by the case id);
* the torch reference (qtorch_onnx.ops / formats) on random tensors of several shapes, axes and dtypes, and a
  tensor large enough to be split over threads (1 thread == 4 threads == torch);
* bad attributes of every operator -> an ONNX Runtime error naming node and attribute, never a crash;
* the input buffer is never written, every output element is; shape/type inference; the com.vai.quantize
  alias domain; registration in a fresh process that never imports torch; the build cache and its errors.

Bit-exact comparisons view float32 as uint32 and float16/bfloat16 as uint16; float16 NaNs are compared as
NaNs (golden README item 4).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper

from qtorch_onnx import get_library_path
from qtorch_onnx.errors import UnsupportedFeatureError
from qtorch_onnx.formats import floating as F
from qtorch_onnx.formats import integer as I
from qtorch_onnx.formats.spec import INT8, INT16, INT32, UINT8, UINT16, UINT32
from qtorch_onnx.ops import bfp_quantize_dequantize, mx_quantize_dequantize

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "golden")
QUARK = "com.amd.quark"
VAI = "com.vai.quantize"

ONNX_TYPE = {"float32": T.FLOAT, "float16": T.FLOAT16, "bfloat16": T.BFLOAT16, "int8": T.INT8, "uint8": T.UINT8,
             "int16": T.INT16, "uint16": T.UINT16, "int32": T.INT32, "uint32": T.UINT32, "int64": T.INT64}
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8, "uint8": np.uint8,
           "int16": np.int16, "uint16": np.uint16, "int32": np.int32, "uint32": np.uint32, "int64": np.int64}
INT_FMT = {"int8": INT8, "uint8": UINT8, "int16": INT16, "uint16": UINT16, "int32": INT32, "uint32": UINT32}


# --------------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="session")
def lib() -> str:
    path = get_library_path()
    assert os.path.isfile(path)
    return path


def make_model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    """inputs/outputs: (name, dtype-string, shape or None). ONNX Runtime checks a declared output type
    against the inferred one (a mismatch fails session creation)."""
    def vi(n, d, s):
        return helper.make_tensor_value_info(n, ONNX_TYPE[d], s)

    g = helper.make_graph(nodes, "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                          initializer=list(initializers))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(QUARK, 1),
                                            helper.make_opsetid(VAI, 1)])
    m.ir_version = 10
    return m


def session(model: onnx.ModelProto, lib: str, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_bound(sess, feeds: dict, outs: dict, fill: int = 0) -> dict:
    """Run with every input and output bound to numpy buffers (bfloat16 held as uint16).

    feeds: name -> (array, dtype-string); outs: name -> (shape, dtype-string). Output buffers are filled with
    the byte ``fill`` first. Returns name -> array (the bound buffers themselves)."""
    b = sess.io_binding()
    keep = []
    for name, (arr, dt) in feeds.items():
        arr = np.ascontiguousarray(arr)
        keep.append(arr)
        b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, ONNX_TYPE[dt]))
    res = {}
    for name, (shape, dt) in outs.items():
        buf = np.empty(shape, STORAGE[dt])
        buf.view(np.uint8)[...] = fill
        res[name] = buf
        b.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buf, ONNX_TYPE[dt]))
    sess.run_with_iobinding(b)
    return res


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def assert_same(got: np.ndarray, want: np.ndarray, what: str, nan_as_nan: bool = False):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype.kind == "f" and (nan_as_nan or got.dtype == np.float16):
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), f"{what}: NaN positions differ"
        g, w = bits(got)[~nan], bits(want)[~nan]
    else:
        g, w = bits(got).ravel(), bits(want).ravel()
    bad = np.nonzero(g != w)[0]
    assert bad.size == 0, f"{what}: {bad.size}/{g.size} elements differ, first: got {g[bad[0]]:#x} want {w[bad[0]]:#x}"


def ort_error(excinfo) -> str:
    assert "onnxruntime" in type(excinfo.value).__module__, f"not an ONNX Runtime error: {excinfo.value!r}"
    return str(excinfo.value)


# ---------------------------------------------------------------------------------------------- golden cases
with open(os.path.join(GOLDEN, "cases.json")) as _fh:
    _ALL = json.load(_fh)["cases"]
BLOCK_FILES = ("bfp.npz", "bfp_prime.npz", "mx.npz")
BLOCK_CASES = [c for c in _ALL if c["file"] in BLOCK_FILES]
QDQ_CASES = [c for c in _ALL if c["file"] == "extended_qdq.npz"]
_ARRAYS: dict = {}


def _arrays(file):
    if file not in _ARRAYS:
        _ARRAYS[file] = np.load(os.path.join(GOLDEN, file))
    return _ARRAYS[file]


def _tensor(name, arr, dt):
    return helper.make_tensor(name, ONNX_TYPE[dt], list(arr.shape),
                              vals=np.ascontiguousarray(arr).astype(STORAGE[dt]).tobytes(), raw=True)


def _golden_batch(cases, lib):
    """One model holding one node per case (named by the case id); returns {case id: output}."""
    nodes, inputs, outputs, inits, feeds, outs = [], [], [], [], {}, {}
    for k, c in enumerate(cases):
        arrays = _arrays(c["file"])
        names = []
        for j, spec in enumerate(c["inputs"]):
            if spec is None:
                names.append("")
                continue
            name = f"c{k}_i{j}"
            arr = arrays[spec["key"]]
            if spec["role"] == "initializer":
                inits.append(_tensor(name, arr, spec["dtype"]))
            else:
                inputs.append((name, spec["dtype"], list(arr.shape)))
                feeds[name] = (arr.astype(STORAGE[spec["dtype"]]), spec["dtype"])
            names.append(name)
        out = c["outputs"][0]
        oname = f"c{k}_y"
        outputs.append((oname, out["dtype"], None))
        outs[oname] = (tuple(out["shape"]), out["dtype"])
        nodes.append(helper.make_node(c["op_type"], names, [oname], domain=c["domain"], name=c["id"],
                                      **c["attributes"]))
    before = {n: a.copy() for n, (a, _) in feeds.items()}
    res = run_bound(session(make_model(nodes, inputs, outputs, inits), lib), feeds, outs)
    for n, (a, _) in feeds.items():  # ONNX Runtime read the bound numpy buffers in place: never written
        assert np.array_equal(bits(a), bits(before[n])), f"input {n} was modified"
    return {c["id"]: res[f"c{k}_y"] for k, c in enumerate(cases)}


@pytest.fixture(scope="module")
def golden_block(lib):
    out = {}
    for f in BLOCK_FILES:
        out.update(_golden_batch([c for c in BLOCK_CASES if c["file"] == f], lib))
    return out


def test_golden_counts():
    assert sum(c["file"] == "bfp.npz" for c in BLOCK_CASES) == 405
    assert sum(c["file"] == "bfp_prime.npz" for c in BLOCK_CASES) == 247
    assert sum(c["file"] == "mx.npz" for c in BLOCK_CASES) == 465
    assert len(QDQ_CASES) == 276


@pytest.mark.parametrize("case", BLOCK_CASES, ids=[c["id"] for c in BLOCK_CASES])
def test_golden_block(case, golden_block):
    want = _arrays(case["file"])[case["outputs"][0]["key"]]
    assert_same(golden_block[case["id"]], want, case["id"])


def _case_axis(case):
    return case["attributes"].get("axis", 0)  # Quark's Extended* default axis is 0


def _scale_zp(case):
    arrays = _arrays(case["file"])
    return arrays[case["inputs"][1]["key"]], arrays[case["inputs"][2]["key"]]


def _quark_ub_mask(case, x, scale):
    """True where Quark's integer result is defined (golden README item 3): finite and |x/scale| < 2^63."""
    if scale.size == 1:
        sb = scale.reshape(())
    else:
        shp = [1] * x.ndim
        shp[_case_axis(case) % x.ndim] = -1
        sb = scale.reshape(shp)
    with np.errstate(all="ignore"):
        v = x / sb
    return np.isfinite(v) & (np.abs(v) < 2.0 ** 63)


@pytest.fixture(scope="module")
def golden_qdq(lib):
    res = _golden_batch(QDQ_CASES, lib)
    # ONNX Runtime's own QuantizeLinear (opset 21) on the 8/16-bit integer Q cases: the NaN/Inf reference
    ql = [c for c in QDQ_CASES if c["op_type"] == "ExtendedQuantizeLinear"
          and c["outputs"][0]["dtype"] in ("int8", "uint8", "int16", "uint16")]
    std = [dict(c, op_type="QuantizeLinear", domain="", attributes={"axis": _case_axis(c)}) for c in ql]
    std_res = _golden_batch(std, lib)
    return res, std_res


@pytest.mark.parametrize("case", QDQ_CASES, ids=[c["id"] for c in QDQ_CASES])
def test_golden_extended_qdq(case, golden_qdq):
    res, std_res = golden_qdq
    got = res[case["id"]]
    arrays = _arrays(case["file"])
    want = arrays[case["outputs"][0]["key"]]
    odt = case["outputs"][0]["dtype"]
    dts = {i["dtype"] for i in case["inputs"] if i} | {odt}
    is_q = case["op_type"] == "ExtendedQuantizeLinear"
    if not (is_q and odt in INT_FMT):
        # dequantize, bfloat16 and float16: every element (float16-family NaNs as NaNs, golden README item 4)
        assert_same(got, want.astype(got.dtype), case["id"], nan_as_nan="float16" in dts)
        return
    x = arrays[case["inputs"][0]["key"]]
    scale, zp = _scale_zp(case)
    ok = _quark_ub_mask(case, x, scale)
    np.testing.assert_array_equal(np.where(ok, got, 0), np.where(ok, want, 0), err_msg=case["id"])
    # the project's rule on every element, NaN/Inf/huge included: the torch reference ...
    axis = None if scale.size == 1 else _case_axis(case)
    ref = I.quantize(torch.from_numpy(x), torch.from_numpy(scale.copy()), torch.from_numpy(zp.astype(np.int64)),
                     INT_FMT[odt], axis).numpy()
    np.testing.assert_array_equal(got.astype(np.int64), ref, err_msg=case["id"])
    # ... which is ONNX Runtime's QuantizeLinear wherever that exists (8/16-bit types)
    if case["id"] in std_res:
        np.testing.assert_array_equal(got, std_res[case["id"]], err_msg=case["id"] + " vs QuantizeLinear")


def test_golden_nan_inf_rule_is_exercised(golden_qdq):
    """The NaN/Inf cases exist and our answer there is ONNX Runtime's (NaN -> type min, +-Inf saturate)."""
    res, std_res = golden_qdq
    n_special = 0
    for c in QDQ_CASES:
        if c["id"] not in std_res:
            continue
        x = _arrays(c["file"])[c["inputs"][0]["key"]]
        scale, _ = _scale_zp(c)
        bad = ~_quark_ub_mask(c, x, scale)
        n_special += int(bad.sum())
        info = np.iinfo(res[c["id"]].dtype)
        got = res[c["id"]]
        assert (got[np.isnan(x)] == info.min).all(), c["id"]
        assert (got[np.isposinf(x)] == info.max).all(), c["id"]
        assert (got[np.isneginf(x)] == info.min).all(), c["id"]
    assert n_special > 20


# ------------------------------------------------------------------------------------------ random vs torch
def rand_tensor(rng, shape, dtype=np.float32, specials=True, nan=True) -> np.ndarray:
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-10, 10, shape).astype(np.float64))
    flat = x.reshape(-1)
    if specials and flat.size >= 16:
        idx = rng.choice(flat.size, size=max(8, flat.size // 40), replace=False)
        vals = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -3e-39, 2.5, -2.5, 0.5, 3.0e38])
        if not nan:
            vals = vals[~np.isnan(vals)]
        flat[idx] = vals[rng.integers(0, vals.size, idx.size)]
    x = flat.reshape(shape)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


BLOCK_CONFIGS = [
    ("BFP16", "BFPQuantizeDequantize", dict(bit_width=16, block_size=8, rounding_mode=2)),
    ("BFP12-r0", "BFPQuantizeDequantize", dict(bit_width=12, block_size=16, rounding_mode=0)),
    ("BFP10-r1-bf16", "BFPQuantizeDequantize", dict(bit_width=10, block_size=32, rounding_mode=1,
                                                    convert_to_bfloat_before_bfp=1)),
    ("BFP32", "BFPQuantizeDequantize", dict(bit_width=32, block_size=5, rounding_mode=2)),
    ("MX4", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", bit_width=11, block_size=16, rounding_mode=2)),
    ("MX6-r0", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", bit_width=13, block_size=16, rounding_mode=0)),
    ("MX9-r1-bf16", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", bit_width=16, block_size=16,
                                                  rounding_mode=1, convert_to_bfloat_before_bfp=1)),
    ("prime-sub4-shift3", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime_shared", bit_width=12,
                                                        block_size=12, sub_block_size=4, sub_block_shift_bits=3)),
    ("prime-sub300", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", bit_width=13, block_size=600,
                                                   sub_block_size=300, sub_block_shift_bits=2, rounding_mode=0)),
    ("MXINT8", "MXQuantizeDequantize", dict(element_dtype="int8", block_size=32, rounding_mode=2)),
    ("MXINT8-r7", "MXQuantizeDequantize", dict(element_dtype="int8", block_size=16, rounding_mode=7)),
    ("MXFP8E4M3", "MXQuantizeDequantize", dict(element_dtype="fp8_e4m3")),
    ("MXFP8E5M2", "MXQuantizeDequantize", dict(element_dtype="fp8_e5m2", block_size=16)),
    ("MXFP6E3M2", "MXQuantizeDequantize", dict(element_dtype="fp6_e3m2")),
    ("MXFP6E2M3", "MXQuantizeDequantize", dict(element_dtype="fp6_e2m3", block_size=7)),
    ("MXFP4", "MXQuantizeDequantize", dict(element_dtype="fp4_e2m1")),
]
SHAPES = [((45,), 0), ((6, 37), 1), ((37, 6), 0), ((2, 3, 5, 13), -1), ((2, 44, 3, 5), 1), ((9, 2, 3, 4), 0),
          ((2, 21, 2, 3), -3), ((1, 1), 1)]


def _torch_block(op, attrs, x, axis):
    fn = bfp_quantize_dequantize if op == "BFPQuantizeDequantize" else mx_quantize_dequantize
    return fn(torch.from_numpy(x.copy()), axis=axis, **attrs).numpy()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name,op,attrs", BLOCK_CONFIGS, ids=[c[0] for c in BLOCK_CONFIGS])
def test_block_ops_match_torch(lib, name, op, attrs, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{dtype}".encode()))
    # float16 NaN inputs with bfloat16 pre-rounding: the result depends on the NaN's float32 payload, which the
    # reference and the library both set as F16C does (formats.block.half_to_float32), NaNs included
    nodes, inputs, outputs, feeds, outs, xs = [], [], [], {}, {}, {}
    for k, (shape, axis) in enumerate(SHAPES):
        x = rand_tensor(rng, shape, STORAGE[dtype], nan=True)
        if dtype == "float16":  # NaN payloads: 0x7FFF widens to 0x7FFFE000, which bfloat16 pre-rounding makes -0.0
            bits = x.reshape(-1).view(np.uint16)
            bits[rng.integers(0, bits.size, 3)] = [0x7FFF, 0xFD01, 0x7C01]
        xs[k] = (x, axis)
        nodes.append(helper.make_node(op, [f"x{k}"], [f"y{k}"], domain=QUARK, name=f"{name}_{k}", axis=axis, **attrs))
        inputs.append((f"x{k}", dtype, list(shape)))
        outputs.append((f"y{k}", dtype, list(shape)))
        feeds[f"x{k}"] = (x, dtype)
        outs[f"y{k}"] = (shape, dtype)
    res = run_bound(session(make_model(nodes, inputs, outputs), lib), feeds, outs, fill=0xA5)
    for k, (x, axis) in xs.items():
        assert_same(res[f"y{k}"], _torch_block(op, attrs, x, axis), f"{name} {dtype} shape {x.shape} axis {axis}")


QDQ_TYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "bfloat16", "float16"]


def _qdq_params(rng, dt, channels):
    scale = (rng.uniform(0.5, 2.0, channels) * np.exp2(rng.integers(-12, 4, channels))).astype(np.float32)
    if dt in INT_FMT:
        info = np.iinfo(STORAGE[dt])
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        zp = rng.integers(lo, hi + 1, channels).astype(STORAGE[dt])
    elif dt == "bfloat16":
        zp = (np.array(rng.uniform(-3, 3, channels), np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        zp = rng.uniform(-3, 3, channels).astype(np.float16)
    return scale, zp


def _torch_q(x, scale, zp, dt, axis):
    s = torch.from_numpy(scale)
    if dt in INT_FMT:
        return I.quantize(torch.from_numpy(x), s, torch.from_numpy(zp.astype(np.int64)), INT_FMT[dt], axis).numpy() \
            .astype(STORAGE[dt])
    if dt == "bfloat16":
        z = torch.from_numpy(zp.view(np.int16).copy()).view(torch.bfloat16)
        return F.bf16_quantize(torch.from_numpy(x), s, z, axis).view(torch.int16).numpy().view(np.uint16)
    return F.fp16_quantize(torch.from_numpy(x)).numpy()


def _torch_dq(q, scale, zp, dt, axis):
    s = torch.from_numpy(scale)
    if dt in INT_FMT:
        return I.dequantize(torch.from_numpy(q.astype(np.int64)), s, torch.from_numpy(zp.astype(np.int64)), axis).numpy()
    if dt == "bfloat16":
        z = torch.from_numpy(zp.view(np.int16).copy()).view(torch.bfloat16)
        qt = torch.from_numpy(q.view(np.int16).copy()).view(torch.bfloat16)
        return F.bf16_dequantize(qt, s, z, axis).numpy()
    return F.fp16_dequantize(torch.from_numpy(q.copy())).numpy()


@pytest.mark.parametrize("dt", QDQ_TYPES)
def test_extended_qdq_match_torch(lib, dt):
    rng = np.random.default_rng(QDQ_TYPES.index(dt))
    layouts = [((4, 6, 5), None, ()), ((4, 6, 5), None, (1,)), ((4, 6, 5), 0, (4,)), ((4, 6, 5), 1, (6,)),
               ((4, 6, 5), -1, (5,)), ((7, 3), 1, (3,)), ((33,), 0, (33,))]
    for k, (shape, axis, pshape) in enumerate(layouts):
        with np.errstate(over="ignore"):
            x = rand_tensor(rng, shape) * np.float32(rng.uniform(1, 3000))
        channels = int(np.prod(pshape)) if pshape else 1
        scale, zp = _qdq_params(rng, dt, channels)
        scale, zp = scale.reshape(pshape), zp.reshape(pshape)
        inits = [_tensor("s", scale, "float32"), _tensor("z", zp, dt)]
        attrs = {} if axis is None else {"axis": axis}
        qm = make_model([helper.make_node("ExtendedQuantizeLinear", ["x", "s", "z"], ["q"], domain=QUARK, name="q",
                                          **attrs)], [("x", "float32", list(shape))], [("q", dt, list(shape))], inits)
        q = run_bound(session(qm, lib), {"x": (x, "float32")}, {"q": (shape, dt)}, fill=0x5A)["q"]
        per_channel = channels > 1
        s_ref, z_ref = (scale.reshape(-1), zp.reshape(-1)) if per_channel else (scale.reshape(()), zp.reshape(()))
        ax = axis if per_channel else None
        assert_same(q, _torch_q(x, s_ref, z_ref, dt, ax), f"Q {dt} {shape} axis={axis} params {pshape}")
        dm = make_model([helper.make_node("ExtendedDequantizeLinear", ["q", "s", "z"], ["y"], domain=QUARK, name="dq",
                                          **attrs)], [("q", dt, list(shape))], [("y", "float32", list(shape))], inits)
        y = run_bound(session(dm, lib), {"q": (q, dt)}, {"y": (shape, "float32")}, fill=0x5A)["y"]
        want_y = _torch_dq(q, s_ref, z_ref, dt, ax)
        assert_same(y, want_y, f"DQ {dt} {shape} axis={axis} params {pshape}", nan_as_nan=dt == "float16")


LARGE = [
    ("BFP16 last axis", "BFPQuantizeDequantize", dict(bit_width=16, block_size=8, rounding_mode=2, axis=1), "float32"),
    ("MX9 axis 0", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", bit_width=16, block_size=16,
                                                 rounding_mode=2, axis=0), "float32"),
    ("MXFP4 last axis", "MXQuantizeDequantize", dict(element_dtype="fp4_e2m1", axis=-1), "float32"),
    ("prime sub300 last axis", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", bit_width=12, block_size=600,
                                                             sub_block_size=300, sub_block_shift_bits=3, axis=-1),
     "float32"),
    ("MXINT8 f16 axis 0", "MXQuantizeDequantize", dict(element_dtype="int8", axis=0, rounding_mode=2), "float16"),
]


@pytest.mark.parametrize("name,op,attrs,dtype", LARGE, ids=[c[0] for c in LARGE])
def test_large_tensor_threads(lib, name, op, attrs, dtype):
    """512K elements: split into many tasks on ONNX Runtime's thread pool; 1 thread == 4 threads == torch."""
    shape = (96, 5461)  # odd inner size: partial blocks and uneven task boundaries
    x = rand_tensor(np.random.default_rng(7), shape, STORAGE[dtype])
    m = make_model([helper.make_node(op, ["x"], ["y"], domain=QUARK, name="big", **attrs)],
                   [("x", dtype, list(shape))], [("y", dtype, list(shape))])
    y1 = run_bound(session(m, lib, threads=1), {"x": (x, dtype)}, {"y": (shape, dtype)})["y"]
    y4 = run_bound(session(m, lib, threads=4), {"x": (x, dtype)}, {"y": (shape, dtype)})["y"]
    assert np.array_equal(bits(y1), bits(y4)), f"{name}: results depend on the thread count"
    kw = dict(attrs)
    axis = kw.pop("axis")
    assert_same(y4, _torch_block(op, kw, x, axis), name)


def test_large_qdq_threads(lib):
    shape = (64, 3, 4099)
    rng = np.random.default_rng(3)
    with np.errstate(over="ignore"):
        x = rand_tensor(rng, shape) * np.float32(50)
    scale, zp = _qdq_params(rng, "int8", 3)
    inits = [_tensor("s", scale, "float32"), _tensor("z", zp, "int8")]
    m = make_model([helper.make_node("ExtendedQuantizeLinear", ["x", "s", "z"], ["q"], domain=QUARK, axis=1),
                    helper.make_node("ExtendedDequantizeLinear", ["q", "s", "z"], ["y"], domain=QUARK, axis=1)],
                   [("x", "float32", list(shape))], [("y", "float32", list(shape))], inits)
    y1 = run_bound(session(m, lib, threads=1), {"x": (x, "float32")}, {"y": (shape, "float32")})["y"]
    y4 = run_bound(session(m, lib, threads=4), {"x": (x, "float32")}, {"y": (shape, "float32")})["y"]
    assert np.array_equal(bits(y1), bits(y4))
    want = I.fake_quantize(torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zp.astype(np.int64)), INT8,
                           1).numpy()
    assert_same(y4, want, "int8 per-channel Q->DQ")


# ------------------------------------------------------------------------------------------------ bad input
BAD_ATTRS = [
    ("BFPQuantizeDequantize", dict(bfp_method="to_bpf"), "bfp_method"),
    ("BFPQuantizeDequantize", dict(bit_width=9), "bit_width"),
    ("BFPQuantizeDequantize", dict(bit_width=33), "bit_width"),
    ("BFPQuantizeDequantize", dict(block_size=0), "block_size"),
    ("BFPQuantizeDequantize", dict(rounding_mode=3), "rounding_mode"),
    ("BFPQuantizeDequantize", dict(sub_block_size=0), "sub_block_size"),
    ("BFPQuantizeDequantize", dict(sub_block_shift_bits=0), "sub_block_shift_bits"),
    ("BFPQuantizeDequantize", dict(sub_block_shift_bits=9), "sub_block_shift_bits"),
    ("BFPQuantizeDequantize", dict(convert_to_bfloat_before_bfp=2), "convert_to_bfloat_before_bfp"),
    ("BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", block_size=10, sub_block_size=4), "block_size"),
    ("BFPQuantizeDequantize", dict(axis=2), "axis"),
    ("BFPQuantizeDequantize", dict(axis=-3), "axis"),
    ("BFPQuantizeDequantize", dict(block_size="8"), "block_size"),
    ("BFPQuantizeDequantize", dict(bfp_method=1), "bfp_method"),
    ("MXQuantizeDequantize", dict(element_dtype="fp8_e4m4"), "element_dtype"),
    ("MXQuantizeDequantize", dict(block_size=0), "block_size"),
    ("MXQuantizeDequantize", dict(block_size=-32), "block_size"),
    ("MXQuantizeDequantize", dict(axis=5), "axis"),
    ("MXQuantizeDequantize", dict(rounding_mode=0.5), "rounding_mode"),
    ("BFPFixNeuron", dict(bit_width=8), "bit_width"),
    ("MXFixNeuron", dict(element_dtype="int4"), "element_dtype"),
]


@pytest.mark.parametrize("op,attrs,attr", BAD_ATTRS, ids=[f"{o}-{a}-{i}" for i, (o, _, a) in enumerate(BAD_ATTRS)])
def test_bad_attribute_fails_session_creation(lib, op, attrs, attr):
    domain = VAI if op.endswith("FixNeuron") else QUARK
    node = helper.make_node(op, ["x"], ["y"], domain=domain, name="my_node_7", **attrs)
    m = make_model([node], [("x", "float32", [4, 16])], [("y", "float32", None)])
    with pytest.raises(Exception) as ei:
        session(m, lib)
    msg = ort_error(ei)
    assert "my_node_7" in msg and f"'{attr}'" in msg and op in msg and "valid" in msg, msg


def _qdq_model(op, x_dt, z_dt, x_shape, s, z, node_name="qdq_node", **attrs):
    domain = VAI if op.startswith("Vitis") else QUARK
    out_dt = "float32" if "Dequantize" in op else z_dt
    return make_model([helper.make_node(op, ["x", "s", "z"], ["y"], domain=domain, name=node_name, **attrs)],
                      [("x", x_dt, list(x_shape))], [("y", out_dt, None)],
                      [_tensor("s", s, "float32"), _tensor("z", z, z_dt)])


def test_extended_qdq_bad_inputs(lib):
    one = np.array(0.5, np.float32)
    # a zero point of an unsupported type: rejected when the kernel is created
    m = _qdq_model("ExtendedQuantizeLinear", "float32", "int64", [3, 4], one, np.array(0, np.int64))
    with pytest.raises(Exception) as ei:
        session(m, lib)
    msg = ort_error(ei)
    assert "qdq_node" in msg and "zero_point" in msg and "int64" in msg and "valid" in msg, msg
    # dequantize: x and zero point of different types
    m = _qdq_model("ExtendedDequantizeLinear", "int16", "int8", [3, 4], one, np.array(0, np.int8))
    with pytest.raises(Exception) as ei:
        session(m, lib)
    msg = ort_error(ei)
    assert "qdq_node" in msg and "int16" in msg and "int8" in msg, msg
    # per-channel parameters: axis out of range, and a length that does not match -> errors at run time
    x = np.ones((3, 4), np.float32)
    for attrs, words in ((dict(axis=2), ("'axis'=2", "[-2, 1]")), (dict(axis=1), ("'scale'", "4"))):
        m = _qdq_model("ExtendedQuantizeLinear", "float32", "uint8", [3, 4], np.ones(3, np.float32),
                       np.zeros(3, np.uint8), **attrs)
        sess = session(m, lib)
        with pytest.raises(Exception) as ei:
            sess.run(None, {"x": x})
        msg = ort_error(ei)
        assert "qdq_node" in msg and all(w in msg for w in words), msg
    # a 2-D scale
    m = _qdq_model("VitisQuantizeLinear", "float32", "int8", [3, 4], np.ones((3, 1), np.float32),
                   np.zeros(3, np.int8))
    with pytest.raises(Exception) as ei:
        session(m, lib).run(None, {"x": x})
    msg = ort_error(ei)
    assert "qdq_node" in msg and "'scale'" in msg and "[3, 1]" in msg, msg


def test_block_op_rejects_integer_input(lib):
    m = make_model([helper.make_node("MXQuantizeDequantize", ["x"], ["y"], domain=QUARK, name="int_in")],
                   [("x", "int32", [2, 8])], [("y", "int32", None)])
    with pytest.raises(Exception) as ei:
        session(m, lib)
    msg = ort_error(ei)
    assert "int_in" in msg and "int32" in msg and "float32, float16" in msg, msg


def test_default_attributes_and_axis_ignored_for_rank1(lib):
    """No attributes set -> docs/operators.md defaults; on a rank-1 tensor any axis is accepted and ignored."""
    rng = np.random.default_rng(11)
    x2 = rand_tensor(rng, (5, 70), specials=False)
    x1 = rand_tensor(rng, (70,), specials=False)
    for op, ref in (("BFPQuantizeDequantize", bfp_quantize_dequantize), ("MXQuantizeDequantize", mx_quantize_dequantize)):
        m = make_model([helper.make_node(op, ["x"], ["y"], domain=QUARK)], [("x", "float32", [5, 70])],
                       [("y", "float32", None)])
        assert_same(session(m, lib).run(None, {"x": x2})[0], ref(torch.from_numpy(x2)).numpy(), op + " defaults")
        m = make_model([helper.make_node(op, ["x"], ["y"], domain=QUARK, axis=9)], [("x", "float32", [70])],
                       [("y", "float32", None)])
        assert_same(session(m, lib).run(None, {"x": x1})[0], ref(torch.from_numpy(x1)).numpy(), op + " rank 1")


def test_one_element_and_empty_tensors(lib):
    for op, attrs in (("BFPQuantizeDequantize", dict(convert_to_bfloat_before_bfp=1)), ("MXQuantizeDequantize", {})):
        for shape in ((1,), (1, 1, 1, 1), (0, 8)):
            x = np.full(shape, 1.0039062, np.float32)
            m = make_model([helper.make_node(op, ["x"], ["y"], domain=QUARK, **attrs)], [("x", "float32", list(shape))],
                           [("y", "float32", None)])
            y = session(m, lib).run(None, {"x": x})[0]
            fn = bfp_quantize_dequantize if op.startswith("BFP") else mx_quantize_dequantize
            assert_same(y, fn(torch.from_numpy(x), **attrs).numpy(), f"{op} {shape}")


# ------------------------------------------------------------------------- buffers, shapes, alias, process
def test_input_never_written_output_fully_written(lib):
    rng = np.random.default_rng(5)
    shape = (8, 3, 40)
    x = rand_tensor(rng, shape)
    x_before = x.copy()
    for op, attrs in (("BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", bit_width=13, block_size=16,
                                                     convert_to_bfloat_before_bfp=1, axis=0)),
                      ("MXQuantizeDequantize", dict(element_dtype="fp6_e2m3", axis=2))):
        m = make_model([helper.make_node(op, ["x"], ["y"], domain=QUARK, **attrs)], [("x", "float32", list(shape))],
                       [("y", "float32", list(shape))])
        sess = session(m, lib)
        outs = [run_bound(sess, {"x": (x, "float32")}, {"y": (shape, "float32")}, fill=f)["y"] for f in (0x00, 0xFF)]
        assert np.array_equal(bits(x), bits(x_before)), "the input buffer was written"
        assert np.array_equal(bits(outs[0]), bits(outs[1])), "some output elements were not written"
        kw = dict(attrs)
        assert_same(outs[0], _torch_block(op, kw, x, kw.pop("axis")), op)


@pytest.mark.parametrize("op,dt_in,zdt,dt_out", [
    ("BFPQuantizeDequantize", "float16", None, "float16"), ("MXQuantizeDequantize", "float32", None, "float32"),
    ("BFPFixNeuron", "float32", None, "float32"), ("ExtendedQuantizeLinear", "float32", "int8", "int8"),
    ("ExtendedQuantizeLinear", "float32", "bfloat16", "bfloat16"), ("VitisQuantizeLinear", "float32", "uint16", "uint16"),
    ("ExtendedDequantizeLinear", "uint32", "uint32", "float32"), ("ExtendedDequantizeLinear", "float16", "float16", "float32"),
])
def test_shape_and_type_inference(lib, op, dt_in, zdt, dt_out):
    """The output's shape (symbolic dims included) and type come from the operator, and flow downstream."""
    domain = VAI if op in ("BFPFixNeuron", "VitisQuantizeLinear") else QUARK
    shape = [2, "batch", 8]
    inputs, inits = ["x"], []
    if zdt:
        inputs += ["s", "z"]
        inits = [_tensor("s", np.array(0.25, np.float32), "float32"), _tensor("z", np.zeros((), STORAGE[zdt]), zdt)]
    nodes = [helper.make_node(op, inputs, ["y"], domain=domain, name="n"),
             helper.make_node("Identity", ["y"], ["z_out"], name="id")]
    # the outputs' declared type must equal the inferred one (else session creation fails); no declared shape
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", ONNX_TYPE[dt_in], shape)],
                          [helper.make_tensor_value_info("z_out", ONNX_TYPE[dt_out], None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    m.ir_version = 10
    out = session(m, lib).get_outputs()[0]
    assert out.shape == shape, out.shape
    assert out.type == f"tensor({ {'float32': 'float', 'float16': 'float16'}.get(dt_out, dt_out) })", out.type


def test_alias_domain_runs_the_same_kernels(lib):
    rng = np.random.default_rng(9)
    x = rand_tensor(rng, (4, 48))
    s, z = np.array(0.05, np.float32), np.array(3, np.int8)
    inits = [_tensor("s", s, "float32"), _tensor("z", z, "int8")]

    def graph(domain, names):
        bfp, mx, q, dq = names
        return make_model([helper.make_node(bfp, ["x"], ["a"], domain=domain, bfp_method="to_bfp_prime", bit_width=13,
                                            block_size=16),
                           helper.make_node(mx, ["a"], ["b"], domain=domain, element_dtype="fp8_e5m2", axis=0),
                           helper.make_node(q, ["b", "s", "z"], ["c"], domain=domain),
                           helper.make_node(dq, ["c", "s", "z"], ["y"], domain=domain)],
                          [("x", "float32", [4, 48])], [("y", "float32", None), ("b", "float32", None)], inits)

    quark = session(graph(QUARK, ["BFPQuantizeDequantize", "MXQuantizeDequantize", "ExtendedQuantizeLinear",
                                  "ExtendedDequantizeLinear"]), lib).run(None, {"x": x})
    vai = session(graph(VAI, ["BFPFixNeuron", "MXFixNeuron", "VitisQuantizeLinear", "VitisDequantizeLinear"]),
                  lib).run(None, {"x": x})
    for a, b in zip(quark, vai):
        assert np.array_equal(bits(a), bits(b))
    b_ref = mx_quantize_dequantize(bfp_quantize_dequantize(torch.from_numpy(x), bfp_method="to_bfp_prime", bit_width=13,
                                                           block_size=16), element_dtype="fp8_e5m2", axis=0)
    assert_same(quark[1], b_ref.numpy(), "BFP-prime -> MX chain")
    y_ref = I.fake_quantize(b_ref, torch.from_numpy(s), torch.from_numpy(z.astype(np.int64)), INT8).numpy()
    assert_same(quark[0], y_ref, "chain -> Q/DQ")


def test_registration_in_a_torch_free_process(lib, tmp_path):
    x = rand_tensor(np.random.default_rng(2), (3, 64))
    m = make_model([helper.make_node("MXQuantizeDequantize", ["x"], ["y"], domain=QUARK, element_dtype="fp4_e2m1")],
                   [("x", "float32", [3, 64])], [("y", "float32", None)])
    mp, xp, yp = tmp_path / "m.onnx", tmp_path / "x.npy", tmp_path / "y.npy"
    mp.write_bytes(m.SerializeToString())
    np.save(xp, x)
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import onnxruntime as ort
        lib, model, xin, yout = sys.argv[1:5]
        so = ort.SessionOptions()
        so.register_custom_ops_library(lib)
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        np.save(yout, sess.run(None, {"x": np.load(xin)})[0])
        assert "torch" not in sys.modules, sorted(k for k in sys.modules if k.startswith("torch"))
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code, lib, str(mp), str(xp), str(yp)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
    assert_same(np.load(yp), mx_quantize_dequantize(torch.from_numpy(x), element_dtype="fp4_e2m1").numpy(), "subprocess")


# ------------------------------------------------------------------------------------------------ the build
def test_get_library_path_rejects_other_devices():
    with pytest.raises(UnsupportedFeatureError, match="CPU"):
        get_library_path("CUDA")


def test_bad_header_folder_is_a_clear_error(tmp_path, monkeypatch):
    from qtorch_onnx.export.ort_ops import build as B

    monkeypatch.setenv("QTORCH_ONNX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QTORCH_ONNX_ORT_INCLUDE", str(tmp_path))
    with pytest.raises(B.LibraryBuildError, match="QTORCH_ONNX_ORT_INCLUDE.*onnxruntime_cxx_api.h"):
        B.build()
    assert issubclass(B.LibraryBuildError, UnsupportedFeatureError)


def test_wheel_checksum_is_verified(tmp_path, monkeypatch):
    """A downloaded wheel whose SHA-256 differs is refused (the download itself is simulated)."""
    from qtorch_onnx.export.ort_ops import build as B

    monkeypatch.setenv("QTORCH_ONNX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QTORCH_ONNX_ORT_INCLUDE", raising=False)

    def fake_pip(cmd, step, hint, cwd=None, verbose=False):
        dest = cmd[cmd.index("-d") + 1]
        with open(os.path.join(dest, B.QUARK_WHEEL_NAME), "wb") as fh:
            fh.write(b"not the wheel")
        return ""

    monkeypatch.setattr(B, "_run", fake_pip)
    with pytest.raises(B.LibraryBuildError, match="checksum mismatch"):
        B.ort_include_dir()
    assert not (tmp_path / "cache" / "ort_ops" / "include" / B.HEADER_DIRNAME).exists()


def test_concurrent_builds_share_one_cache_entry(lib, tmp_path, monkeypatch):
    """Two builds into an empty cache at once: one compiles, the other waits on the lock and reuses it.

    Threads of this process stand in for pytest-xdist workers: each build opens the lock file itself, and
    flock() locks belong to the open file description, so the two contend exactly as two processes do."""
    import threading

    from qtorch_onnx.export.ort_ops import build as B

    headers = B.ort_include_dir()  # already fetched by the `lib` fixture
    monkeypatch.setenv("QTORCH_ONNX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QTORCH_ONNX_ORT_INCLUDE", str(headers))
    results, errors = [], []

    def work():
        try:
            results.append(B.build())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert results[0].path == results[1].path
    assert sorted(r.built for r in results) == [False, True]
    entries = [p.name for p in (tmp_path / "cache" / "ort_ops").iterdir() if not p.name.endswith(".lock")]
    assert entries == [results[0].source_hash], entries  # no temporary folders left behind
    info = json.loads((tmp_path / "cache" / "ort_ops" / results[0].source_hash / "build.json").read_text())
    assert info["seconds"] > 0
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    m = make_model([helper.make_node("BFPQuantizeDequantize", ["x"], ["y"], domain=QUARK)], [("x", "float32", [2, 16])],
                   [("y", "float32", None)])
    assert_same(session(m, results[0].path).run(None, {"x": x})[0],
                bfp_quantize_dequantize(torch.from_numpy(x)).numpy(), "freshly built library")


def test_build_command_prints_path_and_time(lib, capsys):
    from qtorch_onnx.export.ort_ops import build as B

    assert B.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == lib and os.path.isfile(out[0])
    assert "built" in out[1] and " s" in out[1]
