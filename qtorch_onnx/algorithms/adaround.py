"""AdaRound's learned rounding as a weight-rounding hook (Nagel et al. 2020, "Up or Down? Adaptive Rounding
for Post-Training Quantization", arXiv 2004.10568).

The hook plugs into :meth:`qtorch_onnx.fakequant.FakeQuantize.set_rounding`: for ``v = w / scale`` it rounds
``floor(v) + h(alpha)`` with the rectified sigmoid ``h(alpha) = clamp(sigmoid(alpha) * (zeta - gamma) + gamma,
0, 1)`` (eq. 23 of the paper, zeta = 1.1, gamma = -0.1) while training, and ``floor(v) + (alpha >= 0)`` when
hard (eval mode or ``hard_mode``); export writes the hard result.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..fakequant import WeightRounding

__all__ = ["AdaRoundRounding", "AdaRoundStep", "ZETA", "GAMMA"]

ZETA = 1.1
GAMMA = -0.1


def no_grad_if_needed(fn: Callable) -> Callable:
    """``torch.no_grad()`` for ``fn``, entered only where autograd is on: the written-out steps' methods run every
    iteration of every layer, fast finetune's loop already runs them without autograd, and a ``torch.no_grad()``
    decorator builds and enters a context on each call regardless (5-8 us of Python a call on the reference CPU)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


class AdaRoundRounding(WeightRounding):
    """Learned up/down rounding of one integer weight tensor.

    Args:
        v: ``float32(w / scale)`` in the layout the quantizer receives (the weight's torch layout), used to
            initialise ``alpha`` so that ``h(alpha)`` equals the fractional part of ``v`` (the paper's
            initialisation: the soft rounding starts at the float value).
        shape: instead of ``v``: the weight shape (``alpha`` zeros, e.g. when rebuilding a saved hook).

    Parameters:
        alpha: float32, the weight's shape.

    Raises:
        ConfigError: neither ``v`` nor ``shape`` given.
    """

    def __init__(self, v: torch.Tensor | None = None, shape=None) -> None:
        super().__init__()
        if v is None and shape is None:
            from ..errors import ConfigError

            raise ConfigError("AdaRoundRounding needs v (w / scale) or shape")
        if v is None:
            self.alpha = nn.Parameter(torch.zeros(tuple(shape), dtype=torch.float32))
        else:
            rest = (v.detach().float() - torch.floor(v.detach().float())).clamp(1e-6, 1 - 1e-6)
            # invert h: sigmoid(alpha) = (rest - gamma) / (zeta - gamma)
            p = ((rest - GAMMA) / (ZETA - GAMMA)).clamp(1e-6, 1 - 1e-6)
            self.alpha = nn.Parameter(torch.log(p / (1 - p)))

    def h(self) -> torch.Tensor:
        """The rectified sigmoid of ``alpha`` in [0, 1] (differentiable)."""
        return torch.clamp(torch.sigmoid(self.alpha) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return torch.floor(v.detach()) + self.h()

    def hard(self, v: torch.Tensor) -> torch.Tensor:
        return torch.floor(v) + (self.alpha.detach() >= 0).to(v.dtype)

    def regularizer(self, beta: float) -> torch.Tensor:
        """``sum(1 - |2 h(alpha) - 1| ** beta)`` (eq. 24): pushes every ``h`` to 0 or 1 as ``beta`` falls."""
        return (1 - (2 * self.h() - 1).abs().pow(beta)).sum()

    def config(self) -> Dict[str, Any]:
        return {"shape": list(self.alpha.shape)}

    def extra_repr(self) -> str:
        return f"shape={tuple(self.alpha.shape)}, hard_mode={self.hard_mode}"


class AdaRoundStep:
    """One weight's AdaRound iteration without autograd: the soft-quantized weight from ``alpha`` and the
    gradient with respect to ``alpha``, by the chain rule written out.

    The same function as the quantizer's hooked path (``FakeQuantize._fake_quantize_hooked`` with
    :class:`AdaRoundRounding`) and the regulariser, differentiated by hand (paper eqs. 22-24)::

        h   = clamp(sigmoid(alpha) * (zeta - gamma) + gamma, 0, 1)
        wq  = (clamp(floor(w / scale) + h + zp, qmin, qmax) - zp) * scale
        dL/dalpha = (dL/dwq * scale * [qmin <= floor(w / scale) + h + zp <= qmax]
                     - 2 beta reg_param |2h - 1|^(beta - 1) sign(2h - 1))
                    * (zeta - gamma) sigmoid(alpha) (1 - sigmoid(alpha))
                    * [0 <= sigmoid(alpha) (zeta - gamma) + gamma <= 1]

    (the clamps pass the gradient on their closed interval, as ``torch.clamp``'s backward does). The weight
    and its scale are fixed while AdaRound trains, so ``floor(w / scale)`` is computed once. An iteration is
    about 20 elementwise passes over the weight instead of about 50 for autograd's graph (forward, backward,
    the regulariser's own forward and backward), no graph is built, and nothing is read on the host (a CUDA
    graph can capture it).

    Args:
        fq: the weight's integer ``FakeQuantize`` (2-16 bits; its scale, calibrated or learned, held fixed).
        hook: its :class:`AdaRoundRounding` (``alpha``, float32, the weight's shape).
        weight: the float weight (the quantizer's input layout), finite.

    Raises:
        ValueError: the quantizer / weight is not covered (check :meth:`unsupported` first).
    """

    def __init__(self, fq, hook: AdaRoundRounding, weight: torch.Tensor) -> None:
        why = self.unsupported(fq, hook, weight)
        if why is not None:
            raise ValueError(f"AdaRoundStep: {why}")
        from ..formats.integer import quant_range

        w = weight.detach().to(torch.float32)
        scale, zp = _fixed_qparams(fq, w)
        self.alpha = hook.alpha
        self.scale = scale
        self.scale_dh = scale * (ZETA - GAMMA)  # d wq / dh times dh / dsigmoid's constant factor
        self.floor = torch.floor(w / scale)
        self.zp = zp.to(torch.float32) if bool((zp != 0).any()) else None  # all-zero: + 0 changes no value
        lo, hi = quant_range(fq.fmt, fq.narrow_range)
        self.lo, self.hi = float(lo), float(hi)
        # floor + h + zp lies in [floor + zp, floor + zp + 1]: only elements near the ends of the integer range
        # can ever be clamped (typically the channel's largest magnitudes); their indices, or None
        base = self.floor + zp.to(torch.float32)
        edge = ((base < self.lo) | (base + 1.0 > self.hi)).reshape(-1).nonzero().reshape(-1)
        self.edge = edge if edge.numel() else None
        self._saved: Optional[Tuple[torch.Tensor, ...]] = None
        # the soft-quantized weight of alpha as the last fused Adam step left it (computed in that pass), or None
        self._next: Optional[torch.Tensor] = None
        # the fused CPU loops: the sigmoids of alpha that the step computing _next kept (valid while _next was the
        # weight of this iteration: nothing else changes alpha in between)
        self._sig: Optional[torch.Tensor] = None
        self._sig_valid = False
        # the fused CPU loops (cpu_steps.c) where they apply; :meth:`check` keeps them only if they agree with
        # the torch step
        self.layout = None
        if self.alpha.is_contiguous() and self.floor.is_contiguous():
            from . import cpu_steps

            self.layout = cpu_steps.RowLayout.of(self.alpha, scale, self.zp, getattr(fq, "axis", None))

    @staticmethod
    def unsupported(fq, hook, weight: torch.Tensor) -> Optional[str]:
        """Why this weight cannot take the hand-written step (a short reason), or None when it can."""
        if not isinstance(hook, AdaRoundRounding):
            return f"rounding hook {type(hook).__name__} is not AdaRoundRounding"
        if not fq.fmt.family.integer_grid or getattr(fq.fmt, "bits", 32) > 16:
            return f"weight format {fq.fmt.name} (the step covers integer weights of 2-16 bits)"
        if not bool(torch.isfinite(weight.detach()).all()):
            return "non-finite weight values (the hooked path maps NaN to qmin)"
        if hook.alpha.shape != weight.shape:
            return f"alpha shape {tuple(hook.alpha.shape)} != weight shape {tuple(weight.shape)}"
        return None

    @torch.no_grad()
    def check(self, expected: List[torch.Tensor]) -> bool:
        """Whether the step computes the quantizer's function: its torch code's weight equals ``expected[0]``
        (the hooked quantizer's output for the same ``alpha``) bit for bit. The fused CPU loops are kept only
        when their weight also agrees with it to float32 rounding (``|diff| <= scale (2e-6 + 2.5e-7 (|floor| + |zp| +
        1))``: our sigmoid's error, then float32 roundings of ``floor + zp + h`` and ``- zp``); else the torch code runs."""
        fused, self.layout = self.layout, None
        reference = self.weight()
        self._saved = None
        if not torch.equal(reference, expected[0]):
            return False
        if fused is not None:
            from . import cpu_steps

            got = cpu_steps.adaround_values(fused, self.alpha.detach(), self.floor, self.lo, self.hi)
            base = self.floor.abs() if self.zp is None else self.floor.abs() + self.zp.abs()
            bound = self.scale * (2e-6 + 2.5e-7 * (base + 1.0))  # h's error, then roundings of size |floor| + |zp|
            if bool(((got - reference).abs() <= bound).all()):
                self.layout = fused
        return True

    def sigmoids(self) -> torch.Tensor:
        """The fused CPU loops' buffer for the sigmoids of ``alpha`` (float32, contiguous, ``alpha``'s size): a
        step that computes the next weight keeps them there, and the next step reads them instead of computing
        them again (:func:`~qtorch_onnx.algorithms.cpu_steps.adaround_grad`)."""
        if self._sig is None:
            self._sig = torch.empty(self.alpha.numel(), dtype=torch.float32)
        return self._sig

    @no_grad_if_needed
    def weight(self) -> torch.Tensor:
        """The soft-quantized weight for the current ``alpha`` (float32, the weight's shape); keeps what
        :meth:`backward` needs."""
        if self.layout is not None:  # the fused CPU loop: backward recomputes what it needs from alpha
            from . import cpu_steps

            self._saved = ()
            nxt, self._next = self._next, None
            self._sig_valid = nxt is not None
            if nxt is not None:  # the fused step's: the same bits, no pass
                return nxt
            return cpu_steps.adaround_values(self.layout, self.alpha.detach(), self.floor, self.lo, self.hi)
        s = torch.sigmoid(self.alpha)
        hr = s * (ZETA - GAMMA) + GAMMA
        h = hr.clamp(0.0, 1.0)
        c = self.floor + h
        if self.zp is not None:
            c = c + self.zp
        cc = c.clamp(self.lo, self.hi) if self.edge is not None else c
        self._saved = (s, hr, h, c)
        if self.zp is not None:
            cc = cc - self.zp
        return cc * self.scale

    def values(self) -> List[torch.Tensor]:
        """``[wq]``: :meth:`weight` as fast finetune's loop takes the quantized tensors of a step."""
        return [self.weight()]

    def set_grads(self, grads: List[torch.Tensor], beta: Optional[float] = None, reg_param: float = 0.0,
                  optimizer=None) -> None:
        """:meth:`backward` with ``grads = [dL/dwq]``. With the fused CPU loops and an ``optimizer`` that offers
        ``fused_moments`` (fast finetune's Adam), Adam's step on ``alpha`` is taken in the same pass and
        ``alpha.grad`` stays None (the optimizer's own step then skips it)."""
        moments = getattr(optimizer, "fused_moments", None)
        fuse = self.layout is not None and moments is not None and self._saved is not None
        self.backward(grads[0], beta, reg_param, adam=moments(self.alpha) if fuse else None)

    @no_grad_if_needed
    def backward(self, grad_wq: torch.Tensor, beta: Optional[float] = None, reg_param: float = 0.0,
                 adam=None) -> None:
        """Set ``alpha.grad`` to the gradient of ``loss + reg_param * regulariser(beta)`` (the regulariser left
        out when ``beta`` is None: the warm start), given ``grad_wq = dloss/dwq`` (float32, the weight's
        shape) for the weight of the last :meth:`weight` call. With ``adam`` (a
        :class:`~qtorch_onnx.algorithms.cpu_steps.AdamMoments`, the fused CPU loops only): Adam's step on
        ``alpha`` in the same passes instead, ``alpha.grad`` None, and the new ``alpha``'s soft-quantized
        weight computed there for the next :meth:`weight` call (which assumes nothing else changes ``alpha`` in
        between, as fast finetune's loop does not).

        The masks are float arithmetic (``1 - sign(|hr - h|)``) and an index list of the elements that can be
        clamped, not boolean tensors: on a CPU a boolean comparison or a multiply by one costs 4-8 float
        passes."""
        if self._saved is None:
            raise RuntimeError("AdaRoundStep.backward before weight()")
        if self.layout is not None:
            from . import cpu_steps

            nxt = torch.empty_like(self.alpha) if adam is not None else None
            self.alpha.grad = cpu_steps.adaround_grad(self.layout, self.alpha.detach(), self.floor, self.lo,
                                                      self.hi, grad_wq.contiguous(), beta, reg_param, adam=adam,
                                                      next_values=nxt, sig=self.sigmoids(),
                                                      sig_valid=self._sig_valid)
            self._saved, self._next, self._sig_valid = None, nxt, False
            return
        s, hr, h, c = self._saved
        # alpha's strides (a transposed MatMul weight's): optimizers expect a gradient laid out like its parameter
        # (CUDA's fused Adam rejects any other), as autograd lays it out
        g = torch.mul(grad_wq, self.scale_dh, out=torch.empty_like(self.alpha))
        if self.edge is not None:  # the clamp to [qmin, qmax] passes the gradient on its closed interval
            ce = c.take(self.edge)  # take / put_ index in row-major order whatever the strides
            g.put_(self.edge, g.take(self.edge) * ((ce >= self.lo) & (ce <= self.hi)))
        if beta is not None and reg_param:
            d = h * 2.0 - 1.0  # d/dh of reg_param * (1 - |d|^beta) = -2 beta reg_param |d|^(beta - 1) sign(d)
            g.add_(d.abs().pow_(beta - 1.0).mul_(d.sign()), alpha=-2.0 * beta * reg_param * (ZETA - GAMMA))
        t = torch.addcmul(s, s, s, value=-1.0)  # sigmoid' = s (1 - s), zero where the rectifier clamps h:
        t.addcmul_(t, (hr - h).abs_().sign_(), value=-1.0)  # 1 - sign(|hr - h|) is 1 inside [0, 1], else 0
        self.alpha.grad = g.mul_(t)
        self._saved = None


def _fixed_qparams(fq, weight: torch.Tensor):
    """The scale and zero point a weight quantizer's forward uses, as constants (AdaRound and AdaQuant train no
    qparams), shaped to broadcast against ``weight`` (per channel: along the quantizer's axis, as the forward
    does): a learnable scale as the forward sees it (``2**round(log2_scale)`` for power-of-two scales), a
    learnable zero point rounded as the forward rounds it (``zp + (round(zp) - zp)``, float32); int64 zero
    points as they are."""
    with torch.no_grad():
        scale, zp = fq._effective_qparams()
        if zp.is_floating_point():
            from ..formats.integer import _round_zero_point

            zp = zp + (_round_zero_point(zp, fq.fmt).to(zp.dtype) - zp)
        scale, zp = scale.detach(), zp.detach()
        if scale.dim() > 0:
            shape = [1] * weight.dim()
            shape[fq.axis % weight.dim()] = scale.numel()
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        return scale, zp


def beta_schedule(step: int, total: int, warm_start: float, beta_range) -> float:
    """AdaRound's annealed ``beta`` (paper section 4.1, "we anneal beta from a higher to a lower value"):
    ``beta_range[0]`` during the warm start (the first ``warm_start`` fraction of the iterations, where the
    regulariser is off), then a linear decay to ``beta_range[1]`` at the last iteration."""
    start, end = float(beta_range[0]), float(beta_range[1])
    w = int(math.ceil(warm_start * total))
    if step < w or total <= w:
        return start
    frac = (step - w) / max(1, total - w)
    return start + (end - start) * frac
