"""Loss converters: NegativeLogLikelihoodLoss-12/13/22 and SoftmaxCrossEntropyLoss-12/13 (ONNX spec)."""
from __future__ import annotations

import torch
from torch import nn

from .ops_common import ConversionNotSupported, OnnxNode, OnnxToTorchModule, attr, register_versions, result

_REDUCTIONS = ("none", "sum", "mean")


def nll_loss(log_prob: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: str,
             ignore_index: int | None) -> torch.Tensor:
    """ONNX NegativeLogLikelihoodLoss: ``loss[n, d...] = -input[n, target[n, d...], d...] * w[target]``.

    log_prob: ``[N, C, d1..dk]`` float; target: ``[N, d1..dk]`` int (entries equal to ``ignore_index``
    contribute 0 and weigh 0); weight: ``[C]`` or None (all ones). ``reduction``: ``none`` (loss of
    target's shape), ``sum``, or ``mean`` = ``sum(loss) / sum(w[target] of non-ignored entries)``.
    """
    t = target.to(torch.int64)
    keep = torch.ones_like(t, dtype=torch.bool) if ignore_index is None else t != ignore_index
    safe = torch.where(keep, t, torch.zeros_like(t))
    picked = -torch.gather(log_prob, 1, safe.unsqueeze(1)).squeeze(1)
    w = weight[safe] if weight is not None else torch.ones_like(picked)
    w = torch.where(keep, w, torch.zeros_like(w))
    loss = picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w.sum()


class OnnxNLLLoss(nn.Module, OnnxToTorchModule):
    """ONNX NegativeLogLikelihoodLoss (see :func:`nll_loss`); output in input's dtype."""

    def __init__(self, reduction: str, ignore_index: int | None):
        super().__init__()
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None):  # noqa: D102
        return nll_loss(x, target, weight, self.reduction, self.ignore_index)


class OnnxSoftmaxCrossEntropyLoss(nn.Module, OnnxToTorchModule):
    """ONNX SoftmaxCrossEntropyLoss: ``log_prob = log_softmax(scores, axis=1)`` then :func:`nll_loss`.

    scores: ``[N, C, d1..dk]``; labels ``[N, d1..dk]``; weights ``[C]`` optional. Outputs: loss and,
    when the node asks for it, log_prob (scores' shape).
    """

    def __init__(self, reduction: str, ignore_index: int | None, with_log_prob: bool):
        super().__init__()
        self.reduction, self.ignore_index, self.with_log_prob = reduction, ignore_index, with_log_prob

    def forward(self, scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None):  # noqa: D102
        log_prob = torch.log_softmax(scores, dim=1)
        loss = nll_loss(log_prob, labels, weights, self.reduction, self.ignore_index)
        return (loss, log_prob) if self.with_log_prob else loss


def _reduction(node: OnnxNode) -> str:
    r = attr(node, "reduction", "mean")
    if r not in _REDUCTIONS:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: reduction={r!r} (valid: {_REDUCTIONS})")
    return r


register_versions("NegativeLogLikelihoodLoss", 12, lambda node, graph: result(
    OnnxNLLLoss(_reduction(node), attr(node, "ignore_index")), node))
register_versions("SoftmaxCrossEntropyLoss", 12, lambda node, graph: result(
    OnnxSoftmaxCrossEntropyLoss(_reduction(node), attr(node, "ignore_index"), len(node.output_values) > 1), node))
