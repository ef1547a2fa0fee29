"""AMD Quark 0.13 worker for benchmarks/real_models_table.py: named configs on one model, run under Quark's runtime.

Runs inside Quark's virtual environment (stdlib, numpy, onnx, onnxruntime, torch, quark; never qtorch_onnx)::

    <quark-venv>/bin/python benchmarks/_quark_table_worker.py job.json

The job (JSON) names the float model, the input names, the calibration and evaluation data (.npz written by
``auto_mp_vs_quark.save_data``: ``s{i}_{j}`` = input ``j`` of sample ``i``, ``count``), ``float_outputs`` (an
.npz path: the float model's first output per evaluation sample under this runtime, a cross-check of the two
ONNX Runtimes) and a list of runs ``{config, overrides, out, outputs}``. Each run builds Quark's named
configuration (``Config(global_quant_config=get_default_config(config))``, deep-copied, the fields of
``overrides`` set on it: a diagnostic such as ``include_cle=False``), times
``ModelQuantizer(config).quantize_model(model, out, reader)``, counts the exported model's nodes by
``domain::op_type``, and writes the first output per evaluation sample under ONNX Runtime of this venv with
Quark's operator library to ``outputs`` (``y{i}``). The result (JSON, ``job["result"]``) gives per run ``ok`` /
``error`` (the stage that failed: quantize or run), the wall and CPU time of ``quantize_model``, the op
counts, the configuration's fields, and the versions. Reuses ``_quark_amp_worker``'s data loader, reader and
runner (same folder).
"""
from __future__ import annotations

import copy
import enum
import json
import os
import sys
import time
import traceback
from typing import Any, Dict

import numpy as np

from _quark_amp_worker import Reader, _load_data, _run_model  # this folder, stdlib + numpy only at import


def _norm(v):
    """A config field as JSON (enums by name), so ours' and Quark's named configs compare field by field."""
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, dict):
        return {str(k): _norm(x) for k, x in sorted(v.items())}
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def config_fields(qc) -> Dict[str, Any]:
    """A QuantizationConfig's fields, normalized (also used by the main side for ours)."""
    return {k: _norm(v) for k, v in sorted(vars(qc).items())}


def _save_outputs(path: str, ys) -> None:
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, **{f"y{i}": np.asarray(y) for i, y in enumerate(ys)})
    os.replace(tmp, path)


def main(job_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    import torch  # noqa: F401  (Quark's operator library links libtorch)
    import onnx
    import onnxruntime as ort
    import quark
    from quark.onnx import ModelQuantizer
    from quark.onnx.operators.custom_ops import get_library_path
    from quark.onnx.quantization.config import Config, get_default_config

    lib = get_library_path("CPU")
    calib, _ = _load_data(job["calib_data"], job["input_names"])
    evals, _ = _load_data(job["eval_data"], job["input_names"])
    res: Dict[str, Any] = {"versions": {"quark": getattr(quark, "__version__", "?"), "onnxruntime": ort.__version__,
                                        "onnx": onnx.__version__, "torch": torch.__version__,
                                        "torch_threads": torch.get_num_threads()}, "results": []}
    if job.get("float_outputs"):
        try:
            _save_outputs(job["float_outputs"], _run_model(ort, job["model"], evals, lib))
            res["float_ok"] = True
        except Exception as exc:  # a cross-check only
            res["float_ok"] = False
            res["float_error"] = f"{type(exc).__name__}: {exc}"[:600]
    for run in job["runs"]:
        rec: Dict[str, Any] = {"config": run["config"], "stage": "config"}
        try:
            qc = copy.deepcopy(get_default_config(run["config"]))  # never change Quark's shared defaults
            for k, v in (run.get("overrides") or {}).items():  # e.g. include_cle=False (a diagnostic run)
                setattr(qc, k, v)
            rec["config_fields"] = config_fields(qc)
            rec["stage"] = "quantize"
            load0 = os.getloadavg()
            c0 = time.process_time()
            t0 = time.perf_counter()
            ModelQuantizer(Config(global_quant_config=qc)).quantize_model(job["model"], run["out"], Reader(calib))
            rec["seconds"] = time.perf_counter() - t0
            rec["cpu_seconds"] = time.process_time() - c0
            rec["loadavg"] = [load0, os.getloadavg()]
            ops: Dict[str, int] = {}
            for n in onnx.load(run["out"]).graph.node:
                key = f"{n.domain or 'ai.onnx'}::{n.op_type}"
                ops[key] = ops.get(key, 0) + 1
            rec["ops"] = ops
            rec["stage"] = "run"
            t1 = time.perf_counter()
            _save_outputs(run["outputs"], _run_model(ort, run["out"], evals, lib))
            rec["run_seconds"] = time.perf_counter() - t1
            rec["ok"] = True
        except Exception as exc:  # reported per run: one failing config must not hide the others
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            rec["traceback"] = traceback.format_exc()[-3000:]
        results = res["results"]
        results.append(rec)
        print(f"[quark table worker] {run['config']}: {'ok' if rec['ok'] else 'failed: ' + rec['error'][:200]} "
              f"({rec.get('seconds', 0):.1f} s)", file=sys.stderr, flush=True)
    tmp = job["result"] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(res, fh, default=str)
    os.replace(tmp, job["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
