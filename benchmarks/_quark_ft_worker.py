"""AMD Quark 0.13 FastFinetune worker for benchmarks/fast_finetune_vs_quark.py.

Runs inside Quark's virtual environment (stdlib, numpy, onnx, onnxruntime, torch, quark; never qtorch_onnx)::

    <quark-venv>/bin/python benchmarks/_quark_ft_worker.py job.json

The job (JSON) names the float model, the calibration and evaluation data (.npz files written by the main side:
``s{i}_{j}`` = input ``j`` of sample ``i``, ``count``) and a list of runs. Each run builds Quark's named
configuration (``get_default_config(name)``, deep-copied), optionally changes the weight type (``"QInt4"``:
onnxruntime's ``QuantType.QInt4``) and ``per_channel``, sets ``include_fast_ft`` and
``extra_options["FastFinetune"]`` to the run's dict (or neither, for the no-finetune run), and times
``ModelQuantizer(config).quantize_model(model, out, reader)``.

Timing inside the call, by wrapping names in Quark's modules (Quark's code is neither copied nor changed):

* ``finetune``: ``quark.onnx.algorithm.interface.fast_finetune`` (everything Quark's FastFinetune does,
  subgraph extraction, ONNX Runtime passes for the layer data and torch training);
* ``training``: ``optimize_module`` as called by ``quark.onnx.algorithm.finetuning.fast_finetune`` (per layer:
  the ONNX -> torch conversion of the layer and the training loop; its count is the number of finetuned layers);
* ``layer_data``: ``Subgraph.get_training_data`` (the ONNX Runtime passes that produce each layer's inputs and
  float targets).

The outputs of each quantized model on the evaluation data under Quark's runtime (this venv's ONNX Runtime with
Quark's operator library registered, which BFP16 needs; graph optimizations off) are saved to an .npz; the result (JSON) gives per run the
wall and CPU times, the load average before/after, the instrumented times and the node types of the model.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any, Dict, List

import numpy as np

from _quark_amp_worker import Reader, _load_data  # this folder, stdlib + numpy only at import


class _Timer:
    def __init__(self):
        self.reset()

    def reset(self):
        self.t = {"finetune": 0.0, "finetune_cpu": 0.0, "training": 0.0, "layer_data": 0.0, "iterations": 0.0}
        self.layers = 0
        self.layer_seconds: List[float] = []

    def wrap(self, owner: Any, attr: str, key: str, count: bool = False, cpu_key: str = ""):
        orig = getattr(owner, attr)
        timer = self

        def wrapped(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return orig(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                timer.t[key] += dt
                if cpu_key:
                    timer.t[cpu_key] += time.process_time() - c0
                if count:
                    timer.layers += 1
                    timer.layer_seconds.append(dt)

        setattr(owner, attr, wrapped)


def _config(run: dict):
    from onnxruntime.quantization import QuantType
    from quark.onnx.quantization.config import Config, get_default_config

    base = get_default_config(run["config"])
    qc = copy.deepcopy(getattr(base, "global_quant_config", base))  # never change Quark's shared defaults
    eo = dict(qc.extra_options or {})
    eo.pop("FastFinetune", None)
    if run.get("weight_type"):
        qc.weight_type = getattr(QuantType, run["weight_type"])
    if run.get("per_channel") is not None:
        qc.per_channel = bool(run["per_channel"])
    if run.get("fast_ft"):
        qc.include_fast_ft = True
        ft = dict(run["fast_ft"])
        if "LRAdjust" in ft and ft["LRAdjust"] is not None:
            ft["LRAdjust"] = tuple(ft["LRAdjust"])
        eo["FastFinetune"] = ft
    else:
        qc.include_fast_ft = False
    qc.extra_options = eo
    return Config(global_quant_config=qc)


def _outputs(ort, path: str, samples, lib: str, threads: int) -> List[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as the main side's sessions
    if threads:
        so.intra_op_num_threads = threads
    so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return [sess.run(None, s)[0] for s in samples]


def limit_ort_threads(ort: Any, threads: int):
    """Make every ONNX Runtime session this process creates from now on (Quark's own, inside its fast finetune,
    which build their ``SessionOptions`` with ONNX Runtime's default of one intra-op thread per core) run on at most
    ``threads`` intra-op and inter-op threads: ``InferenceSession.__init__`` wrapped so that options left at the
    default (0) get ``threads``, and a session given no options gets options with ``threads``. Options the caller
    set to a positive count keep it. Returns a function that undoes the wrapping.

    Quark's code is not changed or copied: its sessions are ONNX Runtime's class, whose constructor is wrapped.

    Raises:
        ValueError: ``threads`` below 1.
    """
    if threads < 1:
        raise ValueError(f"limit_ort_threads: threads must be >= 1, got {threads}")
    cls = ort.InferenceSession
    orig = cls.__init__

    def init(self, path_or_bytes, sess_options=None, *a, **k):
        if sess_options is None:
            sess_options = ort.SessionOptions()
        if sess_options.intra_op_num_threads <= 0:
            sess_options.intra_op_num_threads = threads
        if sess_options.inter_op_num_threads <= 0:
            sess_options.inter_op_num_threads = threads
        return orig(self, path_or_bytes, sess_options, *a, **k)

    cls.__init__ = init

    def undo() -> None:
        cls.__init__ = orig

    return undo


def main(job_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    import torch

    if job.get("torch_threads"):
        torch.set_num_threads(int(job["torch_threads"]))
    import onnx
    import onnxruntime as ort

    if int(job.get("quark_ort_threads") or 0) > 0:  # Quark's own sessions on that many threads (else its defaults)
        limit_ort_threads(ort, int(job["quark_ort_threads"]))
    import quark
    import quark.onnx  # noqa: F401  (builds / loads Quark's operator library before any timing)
    from quark.onnx import ModelQuantizer
    from quark.onnx.operators.custom_ops import get_library_path

    import importlib

    itf = importlib.import_module("quark.onnx.algorithm.interface")
    ffm = importlib.import_module("quark.onnx.algorithm.finetuning.fast_finetune")
    sgm = importlib.import_module("quark.onnx.algorithm.finetuning.onnx_subgraph")
    timer = _Timer()
    timer.wrap(itf, "fast_finetune", "finetune", cpu_key="finetune_cpu")
    timer.wrap(ffm, "optimize_module", "training", count=True)
    timer.wrap(sgm.Subgraph, "get_training_data", "layer_data")
    # the iterations alone: the Adam loop over mini-batches of one layer (its optimizer set-up included), without
    # the torch module's conversion, the reconstruction metrics before / after and the layer data
    tmm = importlib.import_module("quark.onnx.algorithm.finetuning.train_torch.train_model")
    timer.wrap(tmm.ModelOptimizer, "_optimize_kernel", "iterations")
    timer.wrap(tmm.ModelOptimizer, "_optimize_kernel_with_dataset", "iterations")

    lib = get_library_path("CPU")
    calib, _ = _load_data(job["calib"], job["input_names"])
    evals, _ = _load_data(job["eval"], job["input_names"])
    results = []
    for run in job["runs"]:
        timer.reset()
        rec: Dict[str, Any] = {"name": run["name"]}
        try:
            cfg = _config(run)
            load0 = os.getloadavg()
            t0, c0 = time.perf_counter(), time.process_time()
            ModelQuantizer(cfg).quantize_model(job["model"], run["out"], Reader(calib))
            rec["seconds"] = time.perf_counter() - t0
            rec["cpu_seconds"] = time.process_time() - c0
            rec["loadavg"] = [load0, os.getloadavg()]
            rec["ok"] = True
        except Exception as exc:  # reported per run
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        rec.update({f"{k}_seconds": v for k, v in timer.t.items()})
        rec["finetuned_layers"] = timer.layers
        rec["layer_training_seconds"] = timer.layer_seconds
        if rec["ok"]:
            m = onnx.load(run["out"])
            ops: Dict[str, int] = {}
            for n in m.graph.node:
                key = f"{n.domain or 'ai.onnx'}::{n.op_type}"
                ops[key] = ops.get(key, 0) + 1
            rec["ops"] = ops
            try:
                ys = _outputs(ort, run["out"], evals, lib, int(job.get("ort_threads") or 0))
                np.savez(run["outputs"], **{f"y{i}": y for i, y in enumerate(ys)})
            except Exception as exc:  # noqa: BLE001
                rec["runtime_error"] = f"{type(exc).__name__}: {exc}"[:1000]
        results.append(rec)
        print(f"[quark worker] {run['name']}: {rec.get('seconds', 0):.1f} s (finetune {rec['finetune_seconds']:.1f} s, "
              f"{rec['finetuned_layers']} layers) ok={rec['ok']}", file=sys.stderr, flush=True)
    res = {"results": results, "versions": {"quark": getattr(quark, "__version__", "?"), "torch": torch.__version__,
                                            "torch_threads": torch.get_num_threads(),
                                            "quark_ort_threads": int(job.get("quark_ort_threads") or 0) or "default",
                                            "onnxruntime": ort.__version__, "onnx": onnx.__version__}}
    tmp = job["result"] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(res, fh, default=float)
    os.replace(tmp, job["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
