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
    from .calibration import calibrate
    from .quantizer import prepare

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
    config = args.config
    if args.auto_mp_plan:  # a saved mixed-precision plan: no new search
        from .algorithms import MixedPrecisionPlan
        from .quantizer import resolve

        config = MixedPrecisionPlan.load(args.auto_mp_plan).apply(resolve(args.config))
    if (args.auto_mp_target is not None or args.fast_ft) and calib is None:
        print("error: --auto-mp-target and --fast-ft need data: give --calib-data DIR or --random-calib N",
              file=sys.stderr)
        return 2
    if args.auto_mp_target is not None:
        from .algorithms import auto_mixed_precision

        narrow = tuple(args.auto_mp_narrow.split("/")) if "/" in args.auto_mp_narrow else args.auto_mp_narrow
        plan, qm, result = auto_mixed_precision(
            proto, calib, wide=args.config, narrow=narrow, target=args.auto_mp_target, metric=args.auto_mp_metric,
            dual_quant_nodes=args.auto_mp_dual, eval_data=args.eval_data, device=args.device,
            progress=not args.quiet, report_dir=args.report,
            verify=None if args.auto_mp_no_verify else "onnxruntime")
        print(f"automatic mixed precision: {result.message}; {result.builds} model builds, "
              f"{result.sensitivity.forward_passes} sensitivity passes, {result.seconds:.1f} s")
        if args.auto_mp_plan_out:
            plan.save(args.auto_mp_plan_out)
            print(f"wrote the plan to {args.auto_mp_plan_out} (reuse: --auto-mp-plan)")
    else:
        qm = prepare(proto, config, device=args.device)
        needs = any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation")
        if needs:
            if calib is None:
                print(f"error: config {args.config} calibrates activations: give --calib-data DIR or "
                      "--random-calib N", file=sys.stderr)
                return 2
            calibrate(qm, calib, batch_size=args.batch_size, progress=not args.quiet)
        else:
            qm.set_mode("quantize")
    if args.fast_ft:
        from .algorithms import fast_finetune

        kw = {"num_iterations": args.ft_iterations} if args.ft_iterations else {}
        fast_finetune(qm, calib, algorithm=args.fast_ft, progress=not args.quiet, report_dir=args.report, **kw)
        rep = qm.finetune_report
        print(f"fast finetune ({rep.algorithm}): {len(rep.layers)} layers, loss "
              f"{sum(r.loss_before for r in rep.layers):.4g} -> {sum(r.loss_after for r in rep.layers):.4g}")
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
    q.add_argument("--fast-ft", choices=("adaround", "adaquant"), help="fast finetune after calibration")
    q.add_argument("--ft-iterations", type=int, default=None, help="fast finetune NumIterations (default 1000)")
    q.add_argument("--auto-mp-target", type=float, default=None, metavar="X",
                   help="automatic mixed precision: largest metric value allowed (--config is the wide config)")
    q.add_argument("--auto-mp-narrow", default="INT8", metavar="FMT[/WFMT]",
                   help="narrow format(s) of insensitive layers (activation[/weight]; default INT8)")
    q.add_argument("--auto-mp-metric", default="l2", choices=("l2", "cosine", "sqnr", "kl"))
    q.add_argument("--auto-mp-dual", action="store_true", help="DualQuantNodes at precision boundaries")
    q.add_argument("--auto-mp-no-verify", action="store_true",
                   help="do not measure the chosen mix again in ONNX Runtime (emulation only)")
    q.add_argument("--auto-mp-plan-out", metavar="FILE", help="write the chosen plan (JSON)")
    q.add_argument("--auto-mp-plan", metavar="FILE", help="apply a saved plan (no search)")
    q.add_argument("--report", metavar="DIR", help="write JSON reports and PNG plots here")
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
