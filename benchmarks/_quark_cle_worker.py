"""AMD Quark 0.13 worker for benchmarks/cle_effect.py: quantize with and without Quark's cross-layer equalization.

Runs inside Quark's virtual environment (stdlib, numpy, onnx, onnxruntime, torch, quark; never qtorch_onnx)::

    <quark-venv>/bin/python benchmarks/_quark_cle_worker.py job.json

The job (JSON) names the float model, the calibration data (.npz: ``s{i}_{j}`` = input ``j`` of sample ``i``,
``count``), the input names and a list of runs ``{name, config, include_cle, extra_options, out}``: each builds
Quark's named configuration (``get_default_config(config)``, deep-copied), sets ``include_cle`` and updates its
``extra_options``, and times ``ModelQuantizer(config).quantize_model(model, out, reader)``. The result (JSON,
``job["result"]``) gives per run ``ok`` / ``error`` and the wall time.
"""
from __future__ import annotations

import copy
import json
import sys
import time

from _quark_amp_worker import Reader, _load_data  # this folder, stdlib + numpy only at import


def main(job_path: str) -> None:
    from quark.onnx import ModelQuantizer
    from quark.onnx.quantization.config.config import Config
    from quark.onnx.quantization.config.custom_config import get_default_config

    with open(job_path) as fh:
        job = json.load(fh)
    samples, _ = _load_data(job["calib"], job["input_names"])
    results = []
    for run in job["runs"]:
        rec = {"name": run["name"]}
        try:
            qc = copy.deepcopy(get_default_config(run["config"]))
            qc.include_cle = bool(run["include_cle"])
            eo = dict(qc.extra_options or {})
            eo.update(run.get("extra_options", {}))
            qc.extra_options = eo
            t0 = time.perf_counter()
            ModelQuantizer(Config(global_quant_config=qc)).quantize_model(job["model"], run["out"], Reader(samples))
            rec.update(ok=True, seconds=time.perf_counter() - t0)
        except Exception as exc:  # reported, never fatal
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        results.append(rec)
    with open(job["result"], "w") as fh:
        json.dump({"results": results}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
