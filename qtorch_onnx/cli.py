"""Command line: ``qtorch-onnx quantize`` and ``qtorch-onnx evaluate``.

numpy, torch and the library are imported inside the commands: ``qtorch-onnx --help`` loads none of them.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional


def _quantize(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from . import data as _data
    from .export import export
    from .metrics import cosine_similarity, relative_l2
    from .lift import load_model
    from .quantizer import calibrate, prepare

    t0 = time.perf_counter()
    proto = load_model(args.input)
    specs = _data.input_specs(proto)
    if args.calib_data:
        calib = args.calib_data
    elif args.random_calib:
        rng = np.random.default_rng(0)
        calib = [{s.name: rng.standard_normal([d or 1 for d in s.shape]).astype(s.dtype) for s in specs}
                 for _ in range(args.random_calib)]
    else:
        calib = None
    qm = prepare(proto, args.config, device=args.device)
    needs = any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation")
    if needs:
        if calib is None:
            print(f"error: config {args.config} calibrates activations: give --calib-data DIR or --random-calib N",
                  file=sys.stderr)
            return 2
        calibrate(qm, calib, batch_size=args.batch_size, progress=not args.quiet)
    else:
        qm.set_mode("quantize")
    t_exp = time.perf_counter()
    export(qm, args.output)
    qm.stage_times["export"] = time.perf_counter() - t_exp
    print(f"wrote {args.output}")
    print("tensors quantized per format:")
    for k, v in sorted(qm.plan.counts().items()):
        print(f"  {k:<24} {v}")
    print("time per stage (s): " + ", ".join(f"{k} {v:.2f}" for k, v in qm.stage_times.items())
          + f", total {time.perf_counter() - t0:.2f}")
    if args.eval_data:
        samples = _data.to_samples(args.eval_data, qm.input_specs, what="evaluation data")
        cos, rl2 = [], []
        with torch.no_grad():
            for s in samples:
                qm.set_mode("quantize")
                yq = qm(*(t.to(qm.device) for t in s))
                qm.set_mode("float")
                yf = qm(*(t.to(qm.device) for t in s))
                yq = yq[0] if isinstance(yq, tuple) else yq
                yf = yf[0] if isinstance(yf, tuple) else yf
                cos.append(cosine_similarity(yf.cpu().numpy(), yq.cpu().numpy()))
                rl2.append(relative_l2(yf.cpu().numpy(), yq.cpu().numpy()))
        qm.set_mode("quantize")
        print(f"against float on {len(samples)} held-out samples: cosine {np.mean(cos):.6f}, "
              f"relative L2 {np.mean(rl2):.6f}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from .metrics import evaluate

    r = evaluate(args.baseline_results_folder, args.quantized_results_folder)
    print(f"files compared: {r.files}")
    print(f"cosine similarity: {r.cosine:.6f}")
    print(f"L2 loss: {r.l2:.6f}")
    print(f"PSNR: {r.psnr:.3f} dB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qtorch-onnx", description="Quantize ONNX models with torch fake quantization.")
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize IN.onnx into OUT.onnx")
    q.add_argument("input", help="float ONNX model")
    q.add_argument("output", help="quantized ONNX model to write")
    q.add_argument("--config", default="A8W8", help="named configuration (A8W8, A16W8, BF16, FP16, ...)")
    q.add_argument("--calib-data", help="folder of .npy/.npz calibration samples")
    q.add_argument("--random-calib", type=int, default=0, metavar="N",
                   help="calibrate on N random-normal samples (smoke runs only)")
    q.add_argument("--eval-data", help="folder of .npy/.npz held-out samples: report metrics against float")
    q.add_argument("--device", default=None, help="torch device for calibration (cpu, cuda, cuda:1)")
    q.add_argument("--batch-size", type=int, default=8)
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    q.set_defaults(func=_quantize)
    e = sub.add_parser("evaluate", help="compare float and quantized inference results (NPY, PNG, JPG)")
    e.add_argument("--baseline_results_folder", "--baseline-results-folder", required=True)
    e.add_argument("--quantized_results_folder", "--quantized-results-folder", required=True)
    e.set_defaults(func=_evaluate)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``qtorch-onnx`` command; returns the exit status."""
    from .errors import QTorchOnnxError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except QTorchOnnxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
