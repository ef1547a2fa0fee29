"""Cross-layer equalization (CLE) and the Clip(0, 6) -> Relu rewrite, on the lifted model before placement.

Nagel et al. 2019, "Data-Free Quantization Through Weight Equalization and Bias Correction" (arXiv 1906.04721),
section 4.1: for two layers ``y = W2 f(W1 x + b1)`` with ``f`` positively homogeneous per channel
(``f(c x) = c f(x)`` for ``c > 0``: Relu, LeakyRelu, PRelu, zero padding, pooling, identity), scaling output
channel ``i`` of the first layer by ``c_i`` and input channel ``i`` of the second by ``1 / c_i`` leaves the
float function unchanged. With ``r1_i`` / ``r2_i`` the channel's largest ``|w|`` in each layer (the first
layer's bias included with CLEScaleAppendBias, weighed against the channel's weighted sum: :func:`bias_range`),
``c_i = sqrt(r2_i / r1_i)`` makes both ``sqrt(r1_i r2_i)``: the
per-tensor weight ranges stop being dominated by a few channels, which is what per-tensor INT8 / INT4 weights
of depthwise-separable networks suffer from.

The pairs are found on the normalized ONNX graph (BatchNormalization already folded into its Conv): a Conv or
Gemm whose output reaches exactly one Conv / Gemm (as its data input) through single-reader homogeneous ops
only. Grouped and depthwise convolutions are handled channel by channel. The weights are the lifted model's
parameters, changed in place, so placement, calibration and export see the equalized model.

``ReplaceClip6Relu`` (Quark's key) rewrites ``Clip(0, 6)`` into ``Relu`` first, as the paper does for
MobileNetV2's ReLU6 (which is not homogeneous): the float model changes where activations exceed 6.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ..config.internal import CLESettings

__all__ = ["cross_layer_equalization", "replace_clip6_relu", "equalization_pairs", "bias_range", "CLEReport"]

#: element-wise / per-channel ops with f(c x) = c f(x) for c > 0 (per channel); Pad only with zero padding
HOMOGENEOUS = ("Relu", "LeakyRelu", "PRelu", "Identity", "Pad", "MaxPool", "AveragePool", "GlobalAveragePool",
               "GlobalMaxPool")
LAYERS = ("Conv", "Gemm")
MAX_ADAPTIVE_STEPS = 20


@dataclass
class CLEReport:
    """What :func:`cross_layer_equalization` did: the pairs ``(first, second, [ops between])``, the sweeps run,
    the mean absolute weight change of each sweep, per pair the weight range ratio (largest / smallest
    channel range of the first layer) before and after, and a note when nothing was equalized."""

    pairs: List[Tuple[str, str, List[str]]] = field(default_factory=list)
    sweeps: int = 0
    sweep_changes: List[float] = field(default_factory=list)
    range_ratio_before: Dict[str, float] = field(default_factory=dict)
    range_ratio_after: Dict[str, float] = field(default_factory=dict)
    replaced_clips: List[str] = field(default_factory=list)
    note: str = ""


def _graph_maps(model) -> Tuple[Dict[str, List[Any]], set, Dict[str, np.ndarray]]:
    consumers: Dict[str, List[Any]] = {}
    for n in model.graph.node:
        for t in n.input:
            if t:
                consumers.setdefault(t, []).append(n)
    outputs = {o.name for o in model.graph.output}
    inits = {t.name: t for t in model.graph.initializer}
    return consumers, outputs, inits


def _const(inits, name: str) -> Optional[np.ndarray]:
    """An initializer's value (read from its external data file when a model past 2 GiB left it there), or None."""
    from ..lift.normalize import read_initializer

    return read_initializer(inits[name]) if name in inits else None


def _module_of(gm, node_name: str) -> Optional[nn.Module]:
    info = gm.tensor_map.graph.nodes.get(node_name) if hasattr(gm, "tensor_map") else None
    if info is None or not info.module:
        return None
    try:
        return gm.get_submodule(info.module)
    except AttributeError:
        return None


def replace_clip6_relu(gm) -> List[str]:
    """Rewrite every ``Clip(x, 0, 6)`` (bounds constant) of the lifted model into ``Relu(x)``, in its ONNX graph
    and its torch module; returns the node names. Quark's ``ReplaceClip6Relu``: this changes the float model
    wherever an activation exceeds 6."""
    _, _, inits = _graph_maps(gm.onnx_model)
    fx_by_name = {n.name: n for n in gm.graph.nodes}
    done = []
    for n in gm.onnx_model.graph.node:
        if n.op_type != "Clip" or n.domain not in ("", "ai.onnx") or len(n.input) != 3:
            continue
        lo, hi = _const(inits, n.input[1]), _const(inits, n.input[2])
        if lo is None or hi is None or lo.size != 1 or hi.size != 1 or float(lo) != 0.0 or float(hi) != 6.0:
            continue
        info = gm.tensor_map.graph.nodes.get(n.name)
        fxn = fx_by_name.get(info.fx_node) if info is not None else None
        if info is None or fxn is None or fxn.op != "call_module" or len(fxn.args) != 1 or fxn.kwargs:
            continue  # bounds passed at run time: not a plain Clip(0, 6) module
        gm.set_submodule(str(fxn.target), nn.ReLU())
        n.op_type = "Relu"
        del n.input[1:]
        del n.attribute[:]
        nodes = gm.tensor_map.graph.nodes
        try:
            nodes[n.name] = dataclasses.replace(info, op_type="Relu", inputs=(info.inputs[0],))
        except TypeError:  # a read-only mapping: the module and the ONNX node are what matter
            pass
        done.append(n.name)
    return done


def _zero_pad(n, inits) -> bool:
    mode = next((a.s.decode() for a in n.attribute if a.name == "mode"), "constant")
    if mode != "constant":
        return False
    if len(n.input) > 2 and n.input[2]:
        v = _const(inits, n.input[2])
        if v is None or np.any(v != 0):
            return False
    pads = _const(inits, n.input[1]) if len(n.input) > 1 else None
    if pads is None:
        return False
    rank = len(pads) // 2
    return rank >= 2 and all(int(pads[i]) == 0 and int(pads[rank + i]) == 0 for i in (0, 1))


def _layer_weight(mod) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor], int]]:
    """(weight, bias, groups) of a plain Conv / Linear module, else None."""
    if isinstance(mod, nn.modules.conv._ConvNd) and not isinstance(mod, nn.modules.conv._ConvTransposeNd):
        return mod.weight, mod.bias, mod.groups
    if isinstance(mod, nn.Linear):
        return mod.weight, mod.bias, 1
    return None


def equalization_pairs(gm) -> List[Tuple[str, str, List[str]]]:
    """``(first, second, [ops between])`` node names of the equalizable pairs of the lifted model ``gm``
    (module docstring), graph order."""
    model = gm.onnx_model
    consumers, outputs, inits = _graph_maps(model)
    owners: Dict[int, int] = {}
    for m in gm.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    pairs = []
    for a in model.graph.node:
        if a.op_type not in LAYERS or a.domain not in ("", "ai.onnx"):
            continue
        ma = _module_of(gm, a.name)
        wa = _layer_weight(ma) if ma is not None else None
        if wa is None or owners.get(id(wa[0]), 0) != 1:
            continue
        t, between, pooled = a.output[0], [], False
        b = None
        while t not in outputs:
            cons = consumers.get(t, [])
            if len(cons) != 1:
                break
            c = cons[0]
            if c.op_type in LAYERS and c.input[0] == t:
                b = c
                break
            ok = c.op_type in HOMOGENEOUS and (c.op_type != "Pad" or _zero_pad(c, inits))
            if c.op_type == "Flatten" and pooled:  # [N, C, 1, 1] -> [N, C]: channel i stays feature i
                ok = next((a_.i for a_ in c.attribute if a_.name == "axis"), 1) == 1
            if not ok:
                break
            pooled = pooled or c.op_type in ("GlobalAveragePool", "GlobalMaxPool")
            between.append(c.name)
            t = c.output[0]
        if b is None:
            continue
        mb = _module_of(gm, b.name)
        wb = _layer_weight(mb) if mb is not None else None
        if wb is None or owners.get(id(wb[0]), 0) != 1:
            continue
        if wa[0].shape[0] != wb[0].shape[1] * wb[2]:
            continue  # channel counts differ (a reshape the walk did not see)
        pairs.append((a.name, b.name, between))
    return pairs


def _ranges_out(w: torch.Tensor, b: Optional[torch.Tensor], append_bias: bool) -> torch.Tensor:
    """Range of each output channel of the first layer of a pair: its largest ``|w|``; with ``append_bias``
    (CLEScaleAppendBias) the bias counts too, in the weights' units (see :func:`bias_range`)."""
    r = w.detach().abs().reshape(w.shape[0], -1).amax(1)
    if append_bias and b is not None:
        r = torch.maximum(r, bias_range(w, b))
    return r


def bias_range(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What the bias of each output channel counts in that channel's weight range under CLEScaleAppendBias.

    A bias is a weight on a constant input of 1, while a weight meets an activation, so ``|b_i|`` and
    ``max |w_i|`` are not in the same units: comparing them directly (``max(max |w_i|, |b_i|)``) lets a large
    bias drive the scale of a channel whose weights are small, and unbalances the weights CLE is meant to
    balance (EfficientNet-Lite0: biases up to 46 against weights up to 8). Here the bias is weighed against what
    the weights can contribute to the channel's output: for inputs bounded by 1, at most ``||w_i||_1``. The bias
    counts as the range ``max |w_i| * |b_i| / ||w_i||_1``: it raises the channel's range above its weights' only
    where the bias outweighs the whole weighted sum. It scales with the channel (``c w_i, c b_i`` -> ``c`` times),
    so the equalization stays a fixed point after one sweep. A channel with all-zero weights counts ``0``."""
    wa = w.detach().abs().reshape(w.shape[0], -1)
    l1 = wa.sum(1)
    r = wa.amax(1)
    return torch.where(l1 > 0, b.detach().abs().to(r.dtype) * r / l1.clamp_min(torch.finfo(r.dtype).tiny),
                       torch.zeros_like(r))


def _ranges_in(w: torch.Tensor, groups: int) -> torch.Tensor:
    """Largest |w| per input channel of a Conv (``[O, I/g, ...]``, grouped) or Linear (``[O, I]``)."""
    o, i_g = w.shape[0], w.shape[1]
    r = w.detach().abs().reshape(groups, o // groups, i_g, -1).amax(dim=(1, 3))  # [g, I/g]
    return r.reshape(-1)


def _scale_in(w: torch.Tensor, groups: int, inv: torch.Tensor) -> None:
    o, i_g = w.shape[0], w.shape[1]
    view = w.data.view(groups, o // groups, i_g, -1)
    view.mul_(inv.to(w.dtype).reshape(groups, 1, i_g, 1))


def _ratio(r: torch.Tensor) -> float:
    pos = r[r > 0]
    return float(pos.max() / pos.min()) if pos.numel() else 1.0


def cross_layer_equalization(gm, settings: Optional[CLESettings] = None) -> CLEReport:
    """Equalize every pair of the lifted model ``gm`` in place (module docstring).

    Args:
        gm: the lifted GraphModule (``qtorch_onnx.lift``), with its parameters; before placement.
        settings: :class:`~qtorch_onnx.config.internal.CLESettings` (Quark's CLE keys); default its defaults.

    Returns:
        A :class:`CLEReport`. No pair is not an error: the model is left as it is, ``report.note`` says why
        (logged at INFO).
    """
    s = settings or CLESettings()
    report = CLEReport(pairs=equalization_pairs(gm))
    if not report.pairs:  # a log line, not a warning: the named configs A8W8 / A16W8 / BF16 turn CLE on
        report.note = ("no Conv/Gemm pair joined by Relu / LeakyRelu / PRelu / zero Pad / pooling only (Clip(0, 6) "
                       "needs ReplaceClip6Relu; HardSwish, Sigmoid and residual Adds stop a pair): nothing equalized")
        logging.getLogger(__name__).info("cross-layer equalization: %s", report.note)
        return report
    weights = {}
    for a, b, _ in report.pairs:
        for name in (a, b):
            weights[name] = _layer_weight(_module_of(gm, name))
        report.range_ratio_before[a] = _ratio(_ranges_out(weights[a][0], weights[a][1], False))
    sweeps = s.steps if s.steps > 0 else MAX_ADAPTIVE_STEPS
    previous = math.inf
    with torch.no_grad():
        for _ in range(sweeps):
            change, count = 0.0, 0
            for a, b, _ in report.pairs:
                wa, ba, _ = weights[a]
                wb, _, gb = weights[b]
                before_a, before_b = wa.detach().clone(), wb.detach().clone()
                r1 = _ranges_out(wa, ba, s.append_bias).double()
                r2 = _ranges_in(wb, gb).double()
                c = torch.ones_like(r1)
                ok = (r1 > 0) & (r2 > 0)
                if s.use_threshold:
                    ok &= (r1 + r2) >= s.weight_threshold
                c[ok] = torch.sqrt(r2[ok] / r1[ok])
                shape = [-1] + [1] * (wa.dim() - 1)
                wa.data.mul_(c.to(wa.dtype).reshape(shape))
                if ba is not None:
                    ba.data.mul_(c.to(ba.dtype))
                _scale_in(wb, gb, 1.0 / c)
                change += float((wa - before_a).abs().mean()) + float((wb - before_b).abs().mean())
                count += 2
            report.sweeps += 1
            report.sweep_changes.append(change)
            if s.steps < 0 and abs(previous - change) <= s.total_layer_diff_threshold:
                break
            previous = change
    for a, _, _ in report.pairs:
        report.range_ratio_after[a] = _ratio(_ranges_out(weights[a][0], weights[a][1], False))
    return report
