"""Throughput of the block-format quantize-dequantize, against a plain memory copy measured in the same run.

Per family (BFP, BFP-prime/MX, MX integer, MX float elements) and tensor size, forward and forward+backward:
  * the torch reference (``qtorch_onnx.formats``, ``backend="reference"``),
  * ``torch.compile`` of the same reference (``--compile``),
  * the Triton kernels (``backend="triton"``; CUDA only),
in GB/s (bytes read + written by the forward: 2 x tensor bytes; forward+backward counts 4 x tensor bytes plus
the one-byte mask written and read) and as a fraction of ``x.clone()`` bandwidth on the same device.

    python benchmarks/block_formats.py                                   # CPU: reference (+compile) vs copy
    python benchmarks/block_formats.py --device cuda --sizes-mb 1 64 256 1024 --compile --plot gpu.png

Prints the device first. Results are recorded in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from qtorch_onnx import ops

FAMILIES = {
    "BFP16": (ops.bfp_quantize_dequantize, dict(bfp_method="to_bfp", bit_width=16, block_size=8, rounding_mode=2)),
    "MX6": (ops.bfp_quantize_dequantize, dict(bfp_method="to_bfp_prime", bit_width=13, block_size=16, rounding_mode=2)),
    "MXINT8": (ops.mx_quantize_dequantize, dict(element_dtype="int8", block_size=32, rounding_mode=2)),
    "MXFP4": (ops.mx_quantize_dequantize, dict(element_dtype="fp4_e2m1", block_size=32)),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps):
    """Seconds per call (median of ``reps`` after one warm-up call)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def _fwd_bwd(fn, x, kw, backend):
    xr = x.detach().requires_grad_(True)
    g = torch.ones_like(x)

    def run():
        y = fn(xr, axis=1, backend=backend, **kw)
        y.backward(g)
        xr.grad = None

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the reference")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernels on CUDA")
    p.add_argument("--plot", help="write a PNG of forward GB/s against size")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    triton_on = device.type == "cuda" and not args.no_triton
    print(f"device: {_device_name(device)}; torch {torch.__version__}; dtype {args.dtype}")
    cols = ["family", "MB", "copy GB/s", "ref fwd", "ref/copy", "ref f+b"]
    if args.compile:
        cols += ["compiled fwd", "compiled/copy"]
    if triton_on:
        cols += ["triton fwd", "triton/copy", "triton f+b", "f+b/copy"]
    print(" | ".join(cols))
    rows = []
    esize = torch.finfo(dtype).bits // 8
    for mb in args.sizes_mb:
        n = max(4096, int(mb * 2**20 / esize) // 4096 * 4096)
        x = torch.randn(n // 4096, 4096, device=device).to(dtype)
        fwd_bytes = 2 * x.numel() * esize
        fb_bytes = 4 * x.numel() * esize + 2 * x.numel()
        t_copy = _time(lambda: x.clone(), device, args.reps)
        copy_bw = fwd_bytes / t_copy / 1e9
        for fam in args.families:
            fn, kw = FAMILIES[fam]
            rec = dict(family=fam, mb=mb, copy=copy_bw)
            t = _time(lambda: fn(x, axis=1, backend="reference", **kw), device, args.reps)
            rec["ref"] = fwd_bytes / t / 1e9
            rec["ref_fb"] = fb_bytes / _time(_fwd_bwd(fn, x, kw, "reference"), device, args.reps) / 1e9
            line = [fam, f"{mb:g}", f"{copy_bw:.1f}", f"{rec['ref']:.2f}", f"{rec['ref'] / copy_bw:.3f}",
                    f"{rec['ref_fb']:.2f}"]
            if args.compile:
                torch._dynamo.reset()
                cfn = torch.compile(lambda x_: fn(x_, axis=1, backend="reference", **kw), dynamic=False)
                rec["compiled"] = fwd_bytes / _time(lambda: cfn(x), device, args.reps) / 1e9
                line += [f"{rec['compiled']:.2f}", f"{rec['compiled'] / copy_bw:.3f}"]
            if triton_on:
                rec["triton"] = fwd_bytes / _time(lambda: fn(x, axis=1, backend="triton", **kw), device, args.reps) / 1e9
                rec["triton_fb"] = fb_bytes / _time(_fwd_bwd(fn, x, kw, "triton"), device, args.reps) / 1e9
                line += [f"{rec['triton']:.1f}", f"{rec['triton'] / copy_bw:.3f}", f"{rec['triton_fb']:.1f}",
                         f"{rec['triton_fb'] / copy_bw:.3f}"]
            rows.append(rec)
            print(" | ".join(line), flush=True)
        del x
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        sizes = sorted({r["mb"] for r in rows})
        ax.plot(sizes, [next(r["copy"] for r in rows if r["mb"] == s) for s in sizes], "k--", label="copy")
        for fam in args.families:
            rs = [r for r in rows if r["family"] == fam]
            for key, style in (("ref", ":"), ("compiled", "-."), ("triton", "-")):
                if key in rs[0]:
                    ax.plot([r["mb"] for r in rs], [r[key] for r in rs], style, marker="o", label=f"{fam} {key}")
        ax.set_xscale("log")
        ax.set_xlabel("tensor size (MB)")
        ax.set_ylabel("forward GB/s")
        ax.set_title(f"block quantize-dequantize, {_device_name(device)}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
