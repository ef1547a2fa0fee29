"""AMD Quark 0.13 AutoMixprecision worker for benchmarks/auto_mp_vs_quark.py.

Runs inside Quark's virtual environment (stdlib, numpy, onnx, onnxruntime, torch, quark; never qtorch_onnx)::

    <quark-venv>/bin/python benchmarks/_quark_amp_worker.py job.json

The job (JSON) names the float model, the data (an .npz written by the main side: ``s{i}_{j}`` = input ``j`` of
sample ``i``, ``labels``), and a list of runs. Each run quantizes the float model with Quark's
``ModelQuantizer`` on the search data (Quark calibrates and searches on the same data reader) and writes the
quantized model; the result (JSON) gives per run: the wall time of ``quantize_model``, the number and time of
Quark's full-model ONNX Runtime passes by phase (counted by wrapping ``inference_model`` in the modules of
``quark.onnx.algorithm.mprecision``: baseline, sensitivity, mixing), the candidate nodes, Quark's sensitivity
ranking and the promoted (narrow) nodes, and Quark's own log lines about AutoMixprecision. The outputs of the
quantized model on the search and evaluation data under Quark's runtime (ONNX Runtime of the venv + Quark's
operator library) are written to an .npz for a cross-check.

Quark 0.13's AutoMixprecision keys (quark/onnx/quantization/config/algorithm.py, AutoMixprecisionConfig
._from_extra_options): TargetLayerConfig (a QLayerConfig: the narrow specs), TargetOpType, MetricDefault
("l2", "kl", "cosine", "sqnr", "psnr"), MetricEvaluateFn (outputs -> accuracy, higher is better; the metric is
evaluate(float) - evaluate(quant)), MetricDistanceFn, MetricThreshold (0 = no threshold: every candidate
promoted; None = sensitivity only), MetricOutputIndex, MetricOptimizeObject ("speed": wide baseline, narrow
layers mixed in), DataSize, DualQuantNodes, SensitivityCacheFile, ... The seed keys (L2Target, Top1AccTarget,
EvaluateFunction, ActTargetQuantType, WeightTargetQuantType, OutputIndex) are not read by 0.13.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import re
import sys
import time
from typing import Any, Dict, List

import numpy as np


def _load_data(path: str, input_names: List[str]):
    with np.load(path, allow_pickle=False) as z:
        n = int(z["count"])
        samples = [{name: z[f"s{i}_{j}"] for j, name in enumerate(input_names)} for i in range(n)]
        labels = [int(v) for v in z["labels"]] if "labels" in z.files else None
    return samples, labels


class Reader:
    """An ONNX Runtime CalibrationDataReader over a list of samples."""

    def __init__(self, samples):
        self._samples = samples
        self._it = iter(samples)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        self._it = iter(self._samples)


def _narrow_layer_config(narrow: str):
    from quark.onnx.quantization.config.spec import BFP16Spec, CalibMethod, Int8Spec, Int32Spec, QLayerConfig

    if narrow == "INT8":
        # A8W8 on the promoted layers: their activation inputs and weights INT8 (symmetric, MinMax ranges from
        # the calibration Quark already ran), the bias re-derived as INT32 with scale = s_x * s_w
        return QLayerConfig(input_tensors=Int8Spec(calibration_method=CalibMethod.MinMax),
                            weight=Int8Spec(calibration_method=CalibMethod.MinMax), bias=Int32Spec())
    if narrow == "BFP16":  # as Quark's BF16_MIXED_BFP16_CONFIG
        return QLayerConfig(input_tensors=BFP16Spec(), weight=BFP16Spec(), bias=BFP16Spec())
    raise SystemExit(f"unknown narrow {narrow!r}")


def _config(run: dict, labels):
    from quark.onnx.quantization.config import Config, get_default_config

    base = get_default_config(run["wide"])  # Quark's named QuantizationConfig (A16W8_CONFIG, BF16_CONFIG)
    qc = copy.deepcopy(getattr(base, "global_quant_config", base))  # never change Quark's shared defaults
    eo = dict(qc.extra_options or {})
    kind = run["kind"]
    if kind == "wide":
        qc.include_auto_mp = False
    else:
        qc.include_auto_mp = True
        if kind == "seed_l2":  # the seeds' keys, as the seed snippet writes them
            from quark.onnx import QuantType

            amp: Dict[str, Any] = {"TargetOpType": ["Conv", "ConvTranspose", "Gemm", "MatMul"],
                                   "ActTargetQuantType": QuantType.QInt8, "WeightTargetQuantType": QuantType.QInt8,
                                   "OutputIndex": 0, "L2Target": float(run["threshold"])}
        else:
            amp = {"TargetLayerConfig": _narrow_layer_config(run["narrow"]),
                   "TargetOpType": ["Conv", "ConvTranspose", "Gemm", "MatMul"],
                   "MetricOutputIndex": 0, "MetricOptimizeObject": "speed",
                   "MetricThreshold": float(run["threshold"]), "DataSize": int(run["data_size"]),
                   "DualQuantNodes": bool(run.get("dual", False))}
            if kind == "top1":
                def top1_acc(outputs):
                    """Quark's MetricEvaluateFn: outputs is a list over samples of lists of arrays."""
                    return float(np.mean([int(np.argmax(o[0])) == lab for o, lab in zip(outputs, labels)]))

                amp["MetricEvaluateFn"] = top1_acc
            else:
                amp["MetricDefault"] = "l2"
        eo["AutoMixprecision"] = amp
    qc.extra_options = eo
    return Config(global_quant_config=qc)


class _Instrument:
    """Counts and times Quark's full-model passes (``inference_model``) per phase; records the ranking and
    the promoted nodes. Wraps names in Quark's modules; Quark's code itself is not copied or changed."""

    def __init__(self):
        import importlib

        # import_module: the package re-exports the function auto_mixprecision under its module's name
        amp_mod = importlib.import_module("quark.onnx.algorithm.mprecision.auto_mixprecision")
        mx_mod = importlib.import_module("quark.onnx.algorithm.mprecision.mixing_executor")
        sa_mod = importlib.import_module("quark.onnx.algorithm.mprecision.sensitivity_analyzer")

        self.mods = {"baseline": amp_mod, "sensitivity": sa_mod, "mixing": mx_mod}
        self.orig = {k: m.inference_model for k, m in self.mods.items()}
        self.exec_orig = mx_mod.MixingExecutor.execute
        self.analyze_orig = sa_mod.SensitivityAnalyzer.analyze
        self.reset()
        inst = self

        for phase, mod in self.mods.items():
            def wrapped(*a, _phase=phase, **k):
                t0 = time.perf_counter()
                r = inst.orig[_phase](*a, **k)
                st = inst.stats[_phase]
                st["passes"] += 1
                st["seconds"] += time.perf_counter() - t0
                st["samples"] += len(r)
                return r

            mod.inference_model = wrapped

        def execute(self_, *a, **k):
            r = inst.exec_orig(self_, *a, **k)
            inst.promoted = sorted(self_.promoted_nodes)
            return r

        def analyze(self_, *a, **k):
            t0 = time.perf_counter()
            r = inst.analyze_orig(self_, *a, **k)
            inst.ranked = [{"name": x.name, "score": float(x.score)} for x in r]
            inst.candidates = sum(len(x.candidate_nodes) for x in r)
            inst.sensitivity_seconds = time.perf_counter() - t0
            return r

        mx_mod.MixingExecutor.execute = execute
        sa_mod.SensitivityAnalyzer.analyze = analyze

    def reset(self):
        self.stats = {k: {"passes": 0, "seconds": 0.0, "samples": 0} for k in self.mods}
        self.promoted = None
        self.ranked = None
        self.candidates = None
        self.sensitivity_seconds = None


def _run_model(ort, path: str, samples, lib: str):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return [sess.run(None, s)[0] for s in samples]


def main(job_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    import torch  # noqa: F401  (Quark's operator library links libtorch)
    import onnx
    import onnxruntime as ort
    import quark
    from quark.onnx import ModelQuantizer
    from quark.onnx.operators.custom_ops import get_library_path

    lib = get_library_path("CPU")
    search, labels = _load_data(job["search_data"], job["input_names"])
    evals, _ = _load_data(job["eval_data"], job["input_names"])
    inst = _Instrument()
    # Quark logs through the logging module (ScreenLogger) and prints tables: keep both, per run
    results = []
    for run in job["runs"]:
        inst.reset()
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)
        handler.setLevel(logging.INFO)
        screens = [lg for name, lg in logging.Logger.manager.loggerDict.items()
                   if name.endswith("_screen") and isinstance(lg, logging.Logger)]  # Quark's ScreenLoggers
        for lg in screens:
            lg.addHandler(handler)
        out = run["out"]
        rec: Dict[str, Any] = {"name": run["name"]}
        try:
            cfg = _config(run, labels)
            load0 = os.getloadavg()
            t0 = time.perf_counter()
            c0 = time.process_time()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                ModelQuantizer(cfg).quantize_model(job["model"], out, Reader(search))
            rec["seconds"] = time.perf_counter() - t0
            rec["cpu_seconds"] = time.process_time() - c0
            rec["loadavg"] = [load0, os.getloadavg()]
            rec["ok"] = True
        except Exception as exc:  # reported per run
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        finally:
            for lg in screens:
                lg.removeHandler(handler)
        rec["passes"] = inst.stats
        rec["promoted"] = inst.promoted
        rec["ranked"] = inst.ranked
        rec["candidates"] = inst.candidates
        rec["sensitivity_seconds"] = inst.sensitivity_seconds
        text = buf.getvalue()
        rec["amp_log"] = [ln for ln in text.splitlines()
                          if any(k in ln for k in ("target_layer_config", "baseline score", "Mixing precision stopped",
                                                   "Automatic Mixed Precision has promoted", "Returning original",
                                                   "threshold is", "AMP metric", "Error", "error"))][:40]
        # the promotion loop's trajectory: "Mixing precision promoted <name>. Score <v>" (and "stopped at")
        rec["trajectory"] = [[m.group(2), m.group(1), float(m.group(3))] for m in re.finditer(
            r"Mixing precision (promoted|stopped at) (\S+?)\. Score (-?[0-9.eE+-]+)", text)]
        if rec["ok"]:
            m = onnx.load(out)
            ops: Dict[str, int] = {}
            for n in m.graph.node:
                key = f"{n.domain or 'ai.onnx'}::{n.op_type}"
                ops[key] = ops.get(key, 0) + 1
            rec["ops"] = ops
            outs = {}
            for split, samples in (("search", search), ("eval", evals)):
                for i, y in enumerate(_run_model(ort, out, samples, lib)):
                    outs[f"{split}_{i}"] = y
            np.savez(run["outputs"], **outs)
        results.append(rec)
        print(f"[quark worker] {run['name']}: {rec.get('seconds', 0):.1f} s, promoted "
              f"{None if rec['promoted'] is None else len(rec['promoted'])}", file=sys.stderr, flush=True)
    res = {"results": results, "versions": {"quark": getattr(quark, "__version__", "?"),
                                            "onnxruntime": ort.__version__, "onnx": onnx.__version__}}
    tmp = job["result"] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(res, fh, default=float)
    os.replace(tmp, job["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
