"""glibc's heap tuned for large tensors while the algorithms run on a CPU.

torch allocates a CPU tensor with ``malloc``. glibc serves a request above its mmap threshold with a fresh
``mmap`` and returns it to the system on ``free``; below it, from the heap, whose free top is given back once it
exceeds the trim threshold. Both thresholds start at 128 KiB and adapt upwards only as mmapped blocks are freed
(to 32 MiB at most, the trim threshold to twice that). The staged forward passes, Gram matrices and losses of the
layer-wise algorithms allocate and free tensors of 1-80 MB hundreds of times per layer: each fresh mapping is
zero-filled by the kernel page by page on first touch, and the heap's top is trimmed and regrown between layers.
Measured on EfficientNet-Lite0 A8W8 AdaRound 50 (one thread of a Zen 5 core): the staged passes 0.36 + 0.50 s ->
0.23 + 0.31 s and the whole finetune 3.1-3.3 -> 2.65-2.8 s with the settings below (docs/benchmarks.md, "The heap
tuned for large tensors").

:class:`large_tensor_heap` sets, for the duration of a block or a call (``mallopt``): the mmap threshold to
32 MiB (the ceiling glibc's own adaptation climbs to), the trim threshold to 1 GiB and the top pad to 256 MiB, so
that freed blocks are reused from the heap instead of being unmapped and faulted in again. On the outermost exit
the trim threshold goes back to 64 MiB (twice the mmap threshold, glibc's adapted default) and the top pad to
128 KiB, so that glibc hands the free heap beyond that back to the system on its next ``free`` at the top (an
explicit ``malloc_trim(0)`` there cost the next call 0.1 s of page faults to regrow it: EfficientNet-Lite0
AdaRound 50 2.66 -> 2.75 s); the mmap threshold stays at 32 MiB (glibc stops adapting it once it has been set,
and 32 MiB is where its adaptation ends up under large tensors anyway).

What it cannot mend: torch allocates with ``posix_memalign``, which before glibc 2.38 asks the heap for the size
plus the alignment plus 32 bytes, so a block freed by a tensor is too small for the next request of the same size;
the heap then grows past it and the new block's pages fault in (glibc 2.36, a 78 MB tensor allocated and freed five
times: 78 MB higher each time, 19 k faults each; docs/benchmarks.md, "The residual passes without the sums nobody
reads").

It does nothing where the C library is not glibc (macOS, Windows, musl) and when the
environment variable ``QTORCH_ONNX_TUNE_HEAP`` is ``0``. :func:`qtorch_onnx.calibrate`,
:func:`qtorch_onnx.fast_finetune`, :func:`qtorch_onnx.bias_correction`, :func:`qtorch_onnx.sensitivity` and
:func:`qtorch_onnx.auto_mixed_precision` run inside it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Optional

__all__ = ["large_tensor_heap", "heap_tuning_available"]

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  #: glibc's ceiling for the (adaptive) mmap threshold on 64-bit systems
TRIM_THRESHOLD = 1 << 30  #: free heap top kept while tuned
TOP_PAD = 256 << 20  #: extra bytes the heap grows by while tuned
RESTORED_TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  #: glibc's adapted trim threshold for that mmap threshold
RESTORED_TOP_PAD = 128 << 10  #: glibc's default top pad

_lock = threading.Lock()
_depth = 0
_tuned = False  # the outermost enter changed the settings
_libc: Optional[ctypes.CDLL] = None
_probed = False


def _glibc() -> Optional[ctypes.CDLL]:
    """The process's C library when it is glibc (with ``mallopt``), else None (probed once)."""
    global _libc, _probed
    if not _probed:
        _probed = True
        try:
            lib = ctypes.CDLL(None)
            lib.gnu_get_libc_version  # glibc only: musl has mallopt as a stub that ignores the settings
            lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _libc = lib
        except (OSError, AttributeError, TypeError):
            _libc = None
    return _libc


def heap_tuning_available() -> bool:
    """Whether :class:`large_tensor_heap` changes anything here: glibc present and ``QTORCH_ONNX_TUNE_HEAP`` not
    ``0``."""
    return os.environ.get("QTORCH_ONNX_TUNE_HEAP", "1").strip() != "0" and _glibc() is not None


class large_tensor_heap(contextlib.ContextDecorator):
    """Context manager and decorator: glibc's heap keeps and reuses freed blocks of up to 32 MiB while it is
    active (module docstring); the outermost exit, when nested or used from several threads at once, restores the
    trim threshold and top pad. A no-op without glibc or with ``QTORCH_ONNX_TUNE_HEAP=0``.

    Raises nothing of its own.
    """

    def __enter__(self):
        global _depth, _tuned
        with _lock:
            if _depth == 0 and heap_tuning_available():
                lib = _glibc()
                lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                lib.mallopt(M_TOP_PAD, TOP_PAD)
                _tuned = True
            _depth += 1
        return self

    def __exit__(self, *exc):
        global _depth, _tuned
        with _lock:
            _depth -= 1
            if _depth == 0 and _tuned:
                lib = _glibc()
                lib.mallopt(M_TRIM_THRESHOLD, RESTORED_TRIM_THRESHOLD)
                lib.mallopt(M_TOP_PAD, RESTORED_TOP_PAD)
                _tuned = False
        return False
