"""AdaRound's learned rounding as a weight-rounding hook (Nagel et al. 2020, "Up or Down? Adaptive Rounding
for Post-Training Quantization", arXiv 2004.10568).

The hook plugs into :meth:`qtorch_onnx.fakequant.FakeQuantize.set_rounding`: for ``v = w / scale`` it rounds
``floor(v) + h(alpha)`` with the rectified sigmoid ``h(alpha) = clamp(sigmoid(alpha) * (zeta - gamma) + gamma,
0, 1)`` (eq. 23 of the paper, zeta = 1.1, gamma = -0.1) while training, and ``floor(v) + (alpha >= 0)`` when
hard (eval mode or ``hard_mode``); export writes the hard result.
"""
from __future__ import annotations

import math
from typing import Any, Dict

import torch
from torch import nn

from ..fakequant import WeightRounding

__all__ = ["AdaRoundRounding", "ZETA", "GAMMA"]

ZETA = 1.1
GAMMA = -0.1


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
