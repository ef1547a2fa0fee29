"""Throughput of the block-format quantize-dequantize: torch reference (and Triton on CUDA) against a plain
memory copy measured in the same run.

    python benchmarks/block_formats.py --sizes-mb 1 16 64           # CPU: reference vs copy
    python benchmarks/block_formats.py --device cuda --sizes-mb 64 1024 --triton

Prints GB/s (bytes read + written) and the fraction of copy bandwidth, per family, forward and
forward+backward, plus the device.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from qtorch_onnx import ops

FAMILIES = {
    "BFP16": dict(kind="bfp", kw=dict(bfp_method="to_bfp", bit_width=16, block_size=8, rounding_mode=2)),
    "MX6": dict(kind="bfp", kw=dict(bfp_method="to_bfp_prime", bit_width=13, block_size=16, rounding_mode=2)),
    "MXINT8": dict(kind="mx", kw=dict(element_dtype="int8", block_size=32, rounding_mode=2)),
    "MXFP4": dict(kind="mx", kw=dict(element_dtype="fp4_e2m1", block_size=32)),
}


def _time(fn, device, reps):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--triton", action="store_true", help="also time the Triton kernels (CUDA only)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'} x{torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}")
    print(f"{'family':<8} {'MB':>6} {'copy GB/s':>10} {'ref fwd GB/s':>13} {'ref/copy':>9} {'ref fwd+bwd GB/s':>17}"
          + (f" {'triton GB/s':>12} {'triton/copy':>12}" if args.triton else ""))
    for mb in args.sizes_mb:
        n = int(mb * 2**20 / 4) // 4096 * 4096
        x = torch.randn(n // 4096, 4096, device=device)
        nbytes = 2 * x.numel() * 4
        t_copy = _time(lambda: x.clone(), device, args.reps)
        for fam, spec in FAMILIES.items():
            fn = ops.bfp_quantize_dequantize if spec["kind"] == "bfp" else ops.mx_quantize_dequantize
            t_f = _time(lambda: fn(x, axis=1, **spec["kw"]), device, args.reps)
            xr = x.clone().requires_grad_(True)
            t_fb = _time(lambda: fn(xr, axis=1, **spec["kw"]).backward(torch.ones_like(xr)), device, args.reps)
            line = (f"{fam:<8} {mb:>6.0f} {nbytes / t_copy / 1e9:>10.2f} {nbytes / t_f / 1e9:>13.2f} "
                    f"{t_copy / t_f:>9.3f} {nbytes / t_fb / 1e9:>17.2f}")
            if args.triton and device.type == "cuda":
                from qtorch_onnx.triton_kernels import bfp as tb, mx as tm

                tfn = tb.bfp_quantize_dequantize_triton if spec["kind"] == "bfp" else tm.mx_quantize_dequantize_triton
                t_t = _time(lambda: tfn(x, axis=1, **spec["kw"]), device, args.reps)
                line += f" {nbytes / t_t / 1e9:>12.2f} {t_copy / t_t:>12.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
