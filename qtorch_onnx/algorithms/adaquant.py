"""AdaQuant's iteration without autograd through the quantizers (Hubara et al. 2021, "Accurate Post Training
Quantization With Small Calibration Sets", arXiv 2006.10518): the fake-quantized weight (and bias) with their
straight-through gradients, for fast finetune's loop (:mod:`qtorch_onnx.algorithms.fast_finetune`).
:class:`AdaQuantStep` covers integer weights (INT32 biases), :class:`BlockAdaQuantStep` the block formats (BFP,
BFP-prime, OCP MX); :func:`adaquant_step` picks one.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..formats import integer as _integer
from . import cpu_steps
from .adaround import _fixed_qparams, no_grad_if_needed

__all__ = ["AdaQuantStep", "BlockAdaQuantStep", "FloatAdaQuantStep", "adaquant_step"]


class AdaQuantStep:
    """One layer's AdaQuant quantization and straight-through gradient, written out.

    Weight (integer, 2-16 bits, per-tensor / per-channel scale ``s`` and zero point ``zp`` held fixed, learnable
    ones as the forward sees them; the same
    float32 operations in the same order as the quantizer's fused path, ``formats.integer._fake_quantize_fused``,
    docs/numerics.md section 1)::

        v = round_half_even(w / s) + zp;  wq = (nan_to_num(clamp(v, qmin, qmax), qmin) - zp) * s
        dL/dw = dL/dwq * [clamp(v) == v]                    (docs/numerics.md section 8)

    Bias (when trained; INT32 with the scale ``s_x s_w``, fixed while the weight observer is off):
    ``bq = float32(clamp(round_half_even(float64(b) / float64(s_b)), INT32)) * s_b`` (``quantize_bias`` /
    ``dequantize``'s arithmetic, docs/numerics.md section 1, without their per-call checks: each is a host read,
    a synchronisation on a GPU), gradient ``dL/dbq`` where the integer is inside the INT32 range.

    The weight mask is float arithmetic (``sign(|v - clamp(v)|)``, 1 where saturated), not a boolean tensor (a
    boolean comparison or multiply costs 4-8 float passes on a CPU). An infinite weight saturates, so its gradient
    is 0 here where the quantizer's STE passes 1; a NaN weight's passes (``torch.sign(NaN)`` is 0), as the
    quantizer's does. Either is a divergence, and fast finetune restores the layer.

    Args:
        fq_w: the weight's integer ``FakeQuantize``. weight: the float weight parameter (its ``.grad`` is set).
        fq_b / bias: the bias quantizer and parameter when the bias is trained, else None.

    Raises:
        ValueError: a quantizer / tensor not covered (check :meth:`unsupported` first).
    """

    def __init__(self, fq_w, weight: torch.Tensor, fq_b=None, bias: Optional[torch.Tensor] = None) -> None:
        why = self.unsupported(fq_w, weight, fq_b, bias)
        if why is not None:
            raise ValueError(f"AdaQuantStep: {why}")
        scale, zp = _fixed_qparams(fq_w, weight)
        self.weight, self.bias = weight, bias
        self.scale = scale.clone()
        self.zp = zp.to(torch.float32)  # added even when 0: round() gives -0.0, and -0.0 + 0 is the +0.0 it stores
        lo, hi = _integer.quant_range(fq_w.fmt, fq_w.narrow_range)
        self.lo, self.hi = float(lo), float(hi)
        if bias is not None:
            bs = fq_b.scale.detach()
            if bs.dim() > 0:
                bs = bs.reshape([-1 if d == (fq_b.axis % bias.dim()) else 1 for d in range(bias.dim())])
            self.bias_scale, self.bias_scale64 = bs.to(torch.float32).clone(), bs.to(torch.float64)
            self.bias_range = tuple(float(v) for v in _integer.quant_range(fq_b.fmt))
        self._saved: Optional[List[Optional[torch.Tensor]]] = None
        # (wq, outside) of the weight as the last fused Adam step left it (computed in that pass), or None
        self._next = None
        #: a DirectLayerLoss with kept outputs whose change log the fused Adam step writes in its pass
        #: (:meth:`DirectLayerLoss.diff_slot`), set by fast finetune around its loop; None: not
        self.kept = None
        # the weight by the fused CPU loop (cpu_steps.c) where it applies; :meth:`check` keeps it only if it
        # gives the quantizer's bits
        self.layout = cpu_steps.RowLayout.of(weight.detach(), self.scale, self.zp, getattr(fq_w, "axis", None))
        # the bias by cpu_steps' bias_values / masked_adam with the weight's loops (one call each instead of about
        # nine and four torch operations a step): a contiguous float32 CPU bias with a float32 scale
        self.bias_fused = (self.layout is not None and bias is not None and bias.is_contiguous()
                           and bias.dtype == torch.float32 and fq_b.scale.dtype == torch.float32)
        # bias_values' scales, flattened once (not per step)
        self._bias_scales = (self.bias_scale64.reshape(-1).contiguous(), self.bias_scale.reshape(-1).contiguous()) \
            if self.bias_fused else None

    @staticmethod
    def unsupported(fq_w, weight: torch.Tensor, fq_b=None, bias: Optional[torch.Tensor] = None) -> Optional[str]:
        """Why this layer cannot take the written-out step (a short reason), or None when it can."""
        if fq_w is None or not fq_w.fmt.family.integer_grid or getattr(fq_w.fmt, "bits", 32) > 16:
            return f"weight format {getattr(getattr(fq_w, 'fmt', None), 'name', None)} (the step covers integer " \
                   "weights of 2-16 bits)"
        if fq_w.rounding is not None or (fq_w.observer_enabled and fq_w.tracks_value and not fq_w.learnable):
            return "weight quantizer with a rounding hook or a scale that follows the weight"
        if bias is not None:
            if fq_b is None or fq_b.role != "bias" or getattr(fq_b.fmt, "bits", 0) != 32 or fq_b.learnable:
                return "bias quantizer other than INT32 (scale s_x s_w)"
        return None

    @torch.no_grad()
    def check(self, expected: List[torch.Tensor]) -> bool:
        """Whether :meth:`values` equals ``expected`` (the quantizers' outputs: weight, then the bias when
        trained) bit for bit; the fused CPU loop is dropped if it alone differs."""
        ok = all(torch.equal(v, e) for v, e in zip(self.values(), expected))
        if not ok and self.layout is not None:
            self.layout = None
            ok = all(torch.equal(v, e) for v, e in zip(self.values(), expected))
        self._saved = None
        return ok

    @no_grad_if_needed
    def values(self) -> List[torch.Tensor]:
        """``[wq]`` or ``[wq, bq]``: the quantized weight (float32, the weight's shape) and bias for the current
        parameters; keeps the gradient masks for :meth:`set_grads`."""
        if self.layout is not None:  # one fused CPU loop, the same bits
            nxt, self._next = self._next, None
            wq, outside = nxt if nxt is not None else \
                cpu_steps.adaquant_values(self.layout, self.weight.detach(), self.lo, self.hi)
            out = [wq]
        else:
            v = torch.div(self.weight.detach().to(torch.float32), self.scale)
            torch.round(v, out=v)
            v.add_(self.zp)
            c = v.clamp(self.lo, self.hi)
            outside = v.sub_(c).abs_().sign_()  # 1 where saturated, 0 inside (v's buffer reused)
            torch.nan_to_num(c, nan=self.lo, out=c)
            c.sub_(self.zp)
            out = [c.mul_(self.scale)]
        saved: List[Optional[torch.Tensor]] = [outside, None]
        if self.bias is not None and self.layout is not None and self.bias_fused:
            bq, keep = cpu_steps.bias_values(self.bias, *self._bias_scales, *self.bias_range)
            out.append(bq)
            saved[1] = keep  # 1.0 where the gradient passes: the torch path's mask, as floats
        elif self.bias is not None:
            # quantize_bias / dequantize's arithmetic without their checks' host reads: the scale was checked
            # once (the values' comparison at setup), and a NaN bias is a divergence the loss shows, not an error.
            # Integers held in float64 convert to float32 as int64 ones do.
            lo, hi = self.bias_range
            q = _integer.round_bias(self.bias.detach().to(torch.float64), self.bias_scale64)
            out.append(q.to(torch.float32) * self.bias_scale)
            saved[1] = (q > lo) & (q < hi)
        self._saved = saved
        return out

    def _weight_step(self, gw: torch.Tensor, outside: Optional[torch.Tensor], moments) -> None:
        """:meth:`set_grads`' weight part for a written-out gradient ``gw``: the fused Adam pass (the next values
        without their mask: the next step recomputes it from the weight, 8 bytes a weight less to write and read
        back), else ``weight.grad``."""
        if gw.shape != self.weight.shape:
            gw = gw.reshape(self.weight.shape)
        if self.layout is not None and moments is not None:
            # the kept outputs' change log written in the same pass where one pass over the weight does it (the log
            # is one sequence: not where the threads would split the rows)
            diff = self.kept.diff_slot() if self.kept is not None and cpu_steps.one_pass(self.layout) else None
            self._next = cpu_steps.adaquant_adam(self.layout, self.weight, gw.contiguous(), outside,
                                                 moments(self.weight), next_range=(self.lo, self.hi), next_mask=False,
                                                 diff=diff)
            self.weight.grad = None
            return
        if outside is None:  # values() from a fused step's next values: the mask of the same weight
            outside = cpu_steps.adaquant_values(self.layout, self.weight.detach(), self.lo, self.hi)[1]
        # laid out like the parameter (a transposed MatMul weight's strides), as autograd does: CUDA's fused Adam
        # rejects any other layout
        self.weight.grad = torch.addcmul(gw, gw, outside, value=-1.0, out=torch.empty_like(self.weight))

    def takes_outer(self, fused_optimizer: bool = True) -> bool:
        """Whether :meth:`set_grads` folds a weight gradient given as a :class:`cpu_steps.OuterGradient` into its
        fused Adam pass (a fused CPU layout of a ``[out, in]`` weight, rows along ``out``, and an optimizer with fused
        moments); else it writes the gradient out first."""
        lay = self.layout
        return (fused_optimizer and lay is not None and self.weight.dim() == 2 and lay.rows == self.weight.shape[0]
                and lay.inner == self.weight.shape[1])

    @no_grad_if_needed
    def set_grads(self, grads: List[torch.Tensor], beta: Optional[float] = None, reg_param: float = 0.0,
                  optimizer=None) -> None:
        """Set ``weight.grad`` (and ``bias.grad``) from ``grads = [dL/dwq (, dL/dbq)]`` for the values of the
        last :meth:`values` call (``beta`` / ``reg_param``: unused, AdaQuant has no regulariser). With the fused
        CPU loop and an ``optimizer`` that offers ``fused_moments`` (fast finetune's Adam), Adam's step on the
        weight is taken in the same pass as its straight-through gradient, ``weight.grad`` stays None, and the
        new weight's quantized values are computed there for the next :meth:`values` call (which assumes
        nothing else changes the weight in between, as fast finetune's loop does not); the bias, with the fused
        loops, takes its Adam step in one call too (``bias.grad`` None)."""
        if self._saved is None:
            raise RuntimeError("AdaQuantStep.set_grads before values()")
        outside, bias_mask = self._saved
        gw = grads[0]
        moments = getattr(optimizer, "fused_moments", None)
        if isinstance(gw, cpu_steps.OuterGradient):  # a Linear layer's rank-B gradient, not written out
            if self.takes_outer(moments is not None) and gw.shape == self.weight.shape:
                self._next = cpu_steps.adaquant_adam_outer(self.layout, self.weight, gw, moments(self.weight),
                                                           (self.lo, self.hi))
                self.weight.grad = None
            else:
                self._weight_step(gw.dense(), outside, moments)
        else:
            self._weight_step(gw, outside, moments)
        if self.bias is not None:
            gb = grads[1]
            if gb.shape != self.bias.shape:
                gb = gb.reshape(self.bias.shape)
            if bias_mask.dtype == torch.float32 and moments is not None:  # the fused bias: Adam in one call
                cpu_steps.masked_adam(self.bias, gb.contiguous(), bias_mask, moments(self.bias))
                self.bias.grad = None
            else:
                self.bias.grad = torch.mul(gb, bias_mask, out=torch.empty_like(self.bias))
        self._saved = None


class _BlockTensor:
    """One block-format tensor of :class:`BlockAdaQuantStep`: its quantizer's format, block axis and backend, and how
    its values are computed: one C call on a CPU (``cpu_kernels.block_fake_quantize`` where
    ``block_format_covered``), else the quantizer's own kernel (torch reference, or Triton on CUDA) without
    autograd."""

    def __init__(self, fq, t: torch.Tensor) -> None:
        from .. import cpu_kernels
        from ..formats.block import normalize_axis

        self.t = t
        self.axis = normalize_axis(fq._block_axis(t), t.dim())
        self.fmt = fq.fmt
        self.family = fq.fmt.family.name  # "bfp" or "mx"
        self.backend = fq.backend
        self.fused = (cpu_kernels.block_format_covered(self.fmt) and fq.backend == "auto" and t.device.type == "cpu"
                      and t.dtype == torch.float32 and t.is_contiguous() and t.numel() >= 2
                      and cpu_kernels.available())
        # the C call's mask, kept between calls (a fresh one per call costs its page faults on large weights)
        self._keep = torch.empty_like(t) if self.fused else None

    @torch.no_grad()
    def values(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tq, keep)``: the quantized tensor (float32, the tensor's shape) and where its gradient passes (float
        1.0 / 0.0 from the C call, bool from the quantizer's kernel)."""
        fmt, x = self.fmt, self.t.detach()
        if self.fused:
            from .. import cpu_kernels

            return cpu_kernels.block_fake_quantize(x, fmt, self.axis, keep=self._keep), self._keep
        from .. import ops as _ops

        fn = _ops._kernel(self.family, _ops.resolve_backend(self.backend, x))
        if self.family == "bfp":
            from ..fakequant import _bfp_kwargs

            kw = _bfp_kwargs(fmt)
        else:
            kw = dict(element_dtype=fmt.element_dtype, block_size=fmt.block_size, rounding_mode=fmt.rounding_mode)
        return fn(x.to(torch.float32), return_mask=True, validate=False, axis=self.axis, **kw)


class _FloatTensor:
    """One BF16 / FP16 tensor of :class:`FloatAdaQuantStep` (the Q/DQ form) and how its values and straight-through
    mask are computed (docs/numerics.md sections 3 and 8):

    * BF16: one C call on a CPU with one scale (``cpu_kernels.bf16_fake_quantize``), else
      ``formats.floating.scaled_bf16``; the mask is 1 everywhere (BF16 never saturates: overflow is Inf);
    * FP16 (the Q/DQ form ignores the scale): one C call on a CPU for the values and the mask
      (``cpu_kernels.fp16_round``), else ``formats.floating.fp16_round`` (clip to +-65504, round to float16); the
      mask is 0 where a finite value was clipped.

    No autograd. With the C calls the mask is float32 (``cpu_steps.masked_adam`` takes it), elsewhere bool."""

    def __init__(self, fq, t: torch.Tensor) -> None:
        from .. import cpu_kernels

        self.t = t
        self.kind = fq.fmt.kind
        self.scale = fq.scale.detach()
        self.axis = fq.axis if self.scale.dim() > 0 else None
        cpu = t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
        # the values (FP16: and the mask) by a C call, and Adam in cpu_steps.masked_adam
        if self.kind == "FP16":
            self.fused = cpu and cpu_kernels.fp16_available()
        else:
            self.fused = (cpu and self.scale.dim() == 0 and self.scale.dtype == torch.float32
                          and cpu_kernels.available())
        self._keep = torch.ones_like(t) if self.fused else torch.ones_like(t, dtype=torch.bool)

    @torch.no_grad()
    def values(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tq, keep)``: the quantized tensor (float32, the tensor's shape) and where its gradient passes."""
        from ..formats import floating

        x = self.t.detach()
        if self.fused:
            from .. import cpu_kernels

            if self.kind == "FP16":
                return cpu_kernels.fp16_round(x, keep=self._keep), self._keep
            return cpu_kernels.bf16_fake_quantize(x, float(self.scale)), self._keep
        if self.kind == "FP16":
            xf = x.to(torch.float32)
            return floating.fp16_round(xf), (xf.abs() <= floating.FP16_MAX) | ~torch.isfinite(xf)
        return floating.scaled_bf16(x.to(torch.float32), self.scale, form="qdq", axis=self.axis), self._keep


class BlockAdaQuantStep:
    """One layer's AdaQuant quantization and straight-through gradient for block-format weights (and biases),
    written out: BFP, BFP-prime (MX4 / MX6 / MX9) and the OCP MX formats (MXINT8, MXFP8 / 6 / 4).

    Per block of ``block_size`` elements along the quantizer's block axis, a shared exponent from the block's
    largest finite element and each element rounded on its grid (docs/numerics.md sections 4-7)::

        wq = q(w);  dL/dw = dL/dwq * keep      (keep: 0 where the element saturated, docs/numerics.md section 8)

    The shared exponents follow the weight (nothing is held fixed, as the quantizer does it). On a CPU the values
    and mask in one C call per tensor (``cpu_kernels.bfp_fake_quantize`` / ``bfp_prime_fake_quantize`` /
    ``mx_fake_quantize``, the bits of ``formats.bfp.bfp_reference`` / ``formats.mx.mx_reference``) and, with fast
    finetune's Adam, Adam's update of the masked gradient in one more (``cpu_steps.masked_adam``); the bfloat16
    conversion and other devices: the quantizer's own kernel (torch reference, or Triton on CUDA) with its mask, no
    autograd. :meth:`check` compares
    the values with the quantizers' outputs bit for bit before the first step.

    Args:
        fq_w: the weight's BFP / MX ``FakeQuantize``. weight: the float weight parameter (its ``.grad`` is set).
        fq_b / bias: the bias's block-format quantizer and parameter when the bias is trained, else None.

    Raises:
        ValueError: a quantizer / tensor not covered (check :meth:`unsupported` first).
    """

    #: how one tensor's values and mask are computed (FloatAdaQuantStep: _FloatTensor)
    _tensor_class = _BlockTensor

    def __init__(self, fq_w, weight: torch.Tensor, fq_b=None, bias: Optional[torch.Tensor] = None) -> None:
        why = self.unsupported(fq_w, weight, fq_b, bias)
        if why is not None:
            raise ValueError(f"{type(self).__name__}: {why}")
        self.weight, self.bias = weight, bias
        make = self._tensor_class
        self._tensors = [make(fq_w, weight)] + ([make(fq_b, bias)] if bias is not None else [])
        self._saved: Optional[List[torch.Tensor]] = None

    @classmethod
    def unsupported(cls, fq_w, weight: torch.Tensor, fq_b=None, bias: Optional[torch.Tensor] = None) -> Optional[str]:
        """Why this layer cannot take the written-out step (a short reason), or None when it can."""
        for what, fq, t in (("weight", fq_w, weight), ("bias", fq_b, bias)):
            why = cls._why_not(what, fq, t) if t is not None else None
            if why is not None:
                return why
        return None

    @staticmethod
    def _why_not(what: str, fq, t: torch.Tensor) -> Optional[str]:
        """Why the tensor ``t`` (the layer's ``what``) and its quantizer ``fq`` are not covered, or None."""
        fmt = getattr(fq, "fmt", None)
        if fq is None or getattr(getattr(fmt, "family", None), "name", None) not in ("bfp", "mx"):
            return f"{what} format {getattr(fmt, 'name', None)} (the step covers the block formats: BFP, MX)"
        if fq.rounding is not None or t.dtype != torch.float32:
            return f"{what}: a rounding hook, or not float32"
        return None

    @torch.no_grad()
    def check(self, expected: List[torch.Tensor]) -> bool:
        """Whether :meth:`values` equals ``expected`` (the quantizers' outputs: weight, then the bias when trained)
        bit for bit (as int32: a NaN's payload, the sign of a zero)."""
        ok = all(v.shape == e.shape and torch.equal(v.view(torch.int32), e.to(torch.float32).view(torch.int32))
                 for v, e in zip(self.values(), expected))
        self._saved = None
        return ok

    @torch.no_grad()
    def values(self) -> List[torch.Tensor]:
        """``[wq]`` or ``[wq, bq]`` (float32, the parameters' shapes) for the current parameters; keeps the
        gradient masks for :meth:`set_grads`."""
        pairs = [t.values() for t in self._tensors]
        self._saved = [keep for _, keep in pairs]
        return [v for v, _ in pairs]

    @torch.no_grad()
    def set_grads(self, grads: List[torch.Tensor], beta: Optional[float] = None, reg_param: float = 0.0,
                  optimizer=None) -> None:
        """Set ``weight.grad`` (and ``bias.grad``) to ``grads = [dL/dwq (, dL/dbq)]`` times the masks of the last
        :meth:`values` call (``beta`` / ``reg_param``: unused). With the C values and an ``optimizer`` that offers
        ``fused_moments`` (fast finetune's Adam), Adam's step is taken here in one call per tensor and its
        ``.grad`` stays None."""
        if self._saved is None:
            raise RuntimeError("BlockAdaQuantStep.set_grads before values()")
        moments = getattr(optimizer, "fused_moments", None)
        for bt, keep, g in zip(self._tensors, self._saved, grads):
            p = bt.t
            g = g.reshape(p.shape)
            if bt.fused and moments is not None and cpu_steps.available():
                cpu_steps.masked_adam(p.detach(), g.contiguous(), keep, moments(p))
                p.grad = None
            else:  # laid out like the parameter, as autograd does (CUDA's fused Adam rejects any other layout)
                p.grad = torch.mul(g, keep, out=torch.empty_like(p))
        self._saved = None


class FloatAdaQuantStep(BlockAdaQuantStep):
    """:class:`BlockAdaQuantStep` for BF16 / FP16 weights (and biases) in the Q/DQ form (Quark's
    ExtendedQuantizeLinear / ExtendedDequantizeLinear; docs/numerics.md section 3)::

        BF16: wq = float(bf16(w / scale + 0.0)) scale;  dL/dw = dL/dwq          (never saturates: overflow is Inf)
        FP16: wq = float(fp16(clip(w, +-65504)));       dL/dw = dL/dwq, 0 where a finite w was clipped

    On a CPU the values (FP16: and the mask) in one C call per tensor (``cpu_kernels.bf16_fake_quantize``, BF16
    with one scale; ``cpu_kernels.fp16_round``); per-channel scales and other devices: ``formats.floating``
    without autograd. On a CPU Adam runs in one more C call (``cpu_steps.masked_adam``). :meth:`check` compares the
    values with the quantizers' outputs bit for bit before the first step.

    Raises:
        ValueError: a quantizer / tensor not covered (check :meth:`unsupported` first).
    """

    _tensor_class = _FloatTensor

    @staticmethod
    def _why_not(what: str, fq, t: torch.Tensor) -> Optional[str]:
        """Why the tensor ``t`` (the layer's ``what``) and its quantizer ``fq`` are not covered, or None."""
        fmt = getattr(fq, "fmt", None)
        kind = getattr(fmt, "kind", None)
        if fq is None or kind not in ("BF16", "FP16") or getattr(fq, "float_form", None) != "qdq":
            return f"{what} format {getattr(fmt, 'name', None)} (this step covers BF16 / FP16 in the Q/DQ form)"
        if fq.rounding is not None or fq.learnable or t.dtype != torch.float32:
            return f"{what}: a rounding hook, a learnable scale, or not float32"
        if kind == "FP16" and not (fq.scale.numel() == 1 and float(fq.scale) == 1.0):
            return f"{what}: an FP16 Q/DQ quantizer with a scale (its forward refuses it)"
        return None


def adaquant_step(fq_w, weight: torch.Tensor, fq_b=None, bias: Optional[torch.Tensor] = None):
    """``(step, None)``: the written-out AdaQuant step for this layer's formats (:class:`AdaQuantStep` for integer
    weights, :class:`BlockAdaQuantStep` for BFP / MX ones, :class:`FloatAdaQuantStep` for BF16 / FP16 ones), or
    ``(None, reason)`` when none covers it (fast finetune then trains the layer through autograd: BF16 / FP16 in
    the Cast form, a BFP weight with an integer bias)."""
    family = getattr(getattr(getattr(fq_w, "fmt", None), "family", None), "name", None)
    if family in ("bfp", "mx"):
        why = BlockAdaQuantStep.unsupported(fq_w, weight, fq_b, bias)
        return (None, why) if why is not None else (BlockAdaQuantStep(fq_w, weight, fq_b, bias), None)
    if family == "float":
        why = FloatAdaQuantStep.unsupported(fq_w, weight, fq_b, bias)
        return (None, why) if why is not None else (FloatAdaQuantStep(fq_w, weight, fq_b, bias), None)
    why = AdaQuantStep.unsupported(fq_w, weight, fq_b, bias)
    return (None, why) if why is not None else (AdaQuantStep(fq_w, weight, fq_b, bias), None)
