"""Fast finetune's float32 matrix products on a CPU through oneDNN, which torch ships, instead of torch's BLAS.

``torch.matmul`` on a float32 CPU tensor calls the BLAS torch was built with: MKL in the x86-64 wheels. MKL picks
its kernels by CPU vendor, and on AMD processors it runs its AVX2 kernels even where the CPU has AVX-512: 59
GMAC/s on one thread of the development machine (AMD EPYC, Zen 5), which is AVX2's peak there (2 FMA x 8 lanes
x 3.7 GHz). oneDNN (``torch.ops.mkldnn``, the library torch's CPU convolutions use) dispatches on the instruction
sets the CPU reports and runs AVX-512 there: 102-129 GMAC/s on the same thread (``[256, 256] x [256, 256]`` 0.29
-> 0.14 ms, ``[1280, 512] x [512, 512]`` 5.6 -> 2.5 ms; ``benchmarks/gemm_backends.py`` measures it on any
machine). Small products stay with torch: below ``ONEDNN_MIN_MACS`` multiply-adds oneDNN's per-call cost wins
(``64^3``: 0.006 against 0.012 ms).

Only the fast finetune's training loops and the Gram matrices they are built from use this (their products are
float32 sums in another order, the same to rounding; nothing exported is a product of this module's, and the
exported integers are the trained weights' own quantization). The first call probes the operator once on a small
product against ``torch.matmul``; a missing operator, a failed probe, a non-CPU tensor or ``QTORCH_ONNX_GEMM=torch``
runs ``torch.matmul``.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import torch

__all__ = ["matmul_nt", "onednn_available", "ENV_SWITCH", "ONEDNN_MIN_MACS"]

#: ``QTORCH_ONNX_GEMM=torch`` keeps every product on ``torch.matmul`` (``onednn``, the default: oneDNN where it helps)
ENV_SWITCH = "QTORCH_ONNX_GEMM"
#: products of at least this many multiply-adds (``M N K``) go to oneDNN
ONEDNN_MIN_MACS = 1 << 20

_lock = threading.Lock()
_state: dict = {}


def onednn_available() -> bool:
    """Whether :func:`matmul_nt` may use oneDNN: the environment allows it (``QTORCH_ONNX_GEMM`` is not
    ``torch``), torch has its oneDNN linear operator, and that operator's product of a ``[48, 40]`` and a
    ``[24, 40]`` matrix (one of them a transposed view) agrees with ``torch.matmul``'s to ``1e-5`` of its largest
    entry. Probed once per process (thread-safe); never raises."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _probe()
    return _state["ok"]


def _probe() -> bool:
    if os.environ.get(ENV_SWITCH, "onednn").strip().lower() == "torch":
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        op = torch.ops.mkldnn._linear_pointwise
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(48, 40, generator=gen)
        b = torch.randn(40, 24, generator=gen)
        got = op(a, b.t(), None, "none", [], "")
        want = torch.matmul(a, b)
        if got.shape != want.shape or got.dtype != torch.float32:
            return False
        return bool((got - want).abs().max() <= 1e-5 * want.abs().max())
    except Exception:  # an operator that is absent or refuses: torch.matmul serves
        return False


def matmul_nt(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b^T`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (float32; strided views allowed, e.g. a transposed
    ``[K, N]``): a new ``[M, N]`` float32 tensor, or ``out`` (``[M, N]``, float32) filled with it.

    On a CPU, from ``ONEDNN_MIN_MACS`` multiply-adds up and when :func:`onednn_available`, oneDNN's product
    (AVX-512 where the CPU has it; MKL's kernels behind ``torch.matmul`` run AVX2 on AMD processors); otherwise
    ``torch.matmul``. The two differ by float rounding only (another summation order); each is deterministic for a
    given shape and thread count.

    Raises:
        ValueError: ``a`` / ``b`` not 2-D or their inner sizes differ (the tensors' shapes in the message).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_nt: needs a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if (a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 and b.device.type == "cpu"
            and a.shape[0] * a.shape[1] * b.shape[0] >= ONEDNN_MIN_MACS and onednn_available()):
        y = torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
        if out is None:
            return y
        return out.copy_(y)
    if out is None:
        return torch.matmul(a, b.t())
    return torch.matmul(a, b.t(), out=out)
