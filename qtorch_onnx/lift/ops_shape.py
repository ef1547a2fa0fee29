"""Shape-manipulation converters at the versions onnx2torch lacks or gets wrong (ONNX spec semantics):
Reshape-19+ (``allowzero``), Unsqueeze/Squeeze-21+ (scalar or dynamic axes), DepthToSpace (DCR and CRD
modes) and SpaceToDepth, Range-27, Mod (``fmod``, unsigned types)."""
from __future__ import annotations

import torch
from torch import nn

from .ops_common import ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, register_versions, result
from .ops_math import _WIDE_UNSIGNED, _as_int64_bits, _back_from_bits, udiv64


class OnnxReshape(nn.Module, OnnxToTorchModule):
    """ONNX Reshape-5..25: ``shape`` entries 0 copy the input dim (unless ``allowzero=1``: a real 0),
    -1 is inferred."""

    def __init__(self, allowzero: bool):
        super().__init__()
        self.allowzero = allowzero

    def forward(self, x, shape):  # noqa: D102
        dims = [int(v) for v in shape.tolist()]
        if not self.allowzero:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return torch.reshape(x, dims)


register_versions("Reshape", 19, lambda node, graph: result(OnnxReshape(bool(attr(node, "allowzero", 0))), node))


class OnnxUnsqueeze(nn.Module, OnnxToTorchModule):
    """ONNX Unsqueeze-13+: insert size-1 axes at ``axes`` (a scalar or 1-D int64 input; negative axes
    count in the output rank)."""

    def forward(self, x, axes):  # noqa: D102
        ax = [int(a) for a in axes.reshape(-1).tolist()]
        r = x.dim() + len(ax)
        for a in sorted(a % r for a in ax):
            x = torch.unsqueeze(x, a)
        return x


class OnnxSqueeze(nn.Module, OnnxToTorchModule):
    """ONNX Squeeze-13+: remove the size-1 axes in ``axes`` (all size-1 axes when absent)."""

    def forward(self, x, axes=None):  # noqa: D102
        if axes is None:
            return torch.squeeze(x)
        ax = sorted({int(a) % x.dim() for a in axes.reshape(-1).tolist()}, reverse=True)
        for a in ax:
            x = torch.squeeze(x, a)
        return x


register_versions("Unsqueeze", 21, lambda node, graph: result(OnnxUnsqueeze(), node))
register_versions("Squeeze", 21, lambda node, graph: result(OnnxSqueeze(), node))


class OnnxDepthToSpace(nn.Module, OnnxToTorchModule):
    """ONNX DepthToSpace: ``[N, C, H, W] -> [N, C/b^2, H*b, W*b]``; mode DCR (depth-column-row, default)
    or CRD (column-row-depth), the spec's reshape/transpose sequences."""

    def __init__(self, blocksize: int, mode: str):
        super().__init__()
        self.b, self.mode = blocksize, mode

    def forward(self, x):  # noqa: D102
        n, c, h, w = x.shape
        b = self.b
        if self.mode == "DCR":
            t = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
        else:
            t = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
        return t.reshape(n, c // (b * b), h * b, w * b)


def _depth_to_space(node: OnnxNode, graph: OnnxGraph):
    mode = attr(node, "mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise ConversionNotSupported(f"DepthToSpace node {node.name!r}: mode={mode!r} (valid: DCR, CRD)")
    return result(OnnxDepthToSpace(attr(node, "blocksize"), mode), node)


# onnx2torch's DepthToSpace-11/13 raise for DCR at conversion time, so they cannot be overridden
# after conversion; the versions it lacks (28) are ours.
register_versions("DepthToSpace", 11, _depth_to_space)


class OnnxSpaceToDepth(nn.Module, OnnxToTorchModule):
    """ONNX SpaceToDepth: ``[N, C, H, W] -> [N, C*b^2, H/b, W/b]``, the inverse of DepthToSpace in the
    same ``mode`` (opset 28; DCR before)."""

    def __init__(self, blocksize: int, mode: str = "DCR"):
        super().__init__()
        self.b, self.mode = blocksize, mode

    def forward(self, x):  # noqa: D102
        n, c, h, w = x.shape
        b = self.b
        t = x.reshape(n, c, h // b, b, w // b, b)
        t = t.permute(0, 3, 5, 1, 2, 4) if self.mode == "DCR" else t.permute(0, 1, 3, 5, 2, 4)
        return t.reshape(n, c * b * b, h // b, w // b)


def _space_to_depth(node: OnnxNode, graph: OnnxGraph):
    mode = attr(node, "mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise ConversionNotSupported(f"SpaceToDepth node {node.name!r}: mode={mode!r} (valid: DCR, CRD)")
    return result(OnnxSpaceToDepth(attr(node, "blocksize"), mode), node)


register_versions("SpaceToDepth", 1, _space_to_depth)


class OnnxRange(nn.Module, OnnxToTorchModule):
    """ONNX Range-11/27: ``start + i * delta`` for ``i < max(ceil((limit - start) / delta), 0)``, in the
    inputs' dtype (the count and values are computed in float64 / int64, then cast)."""

    def forward(self, start, limit, delta):  # noqa: D102
        dtype = start.dtype
        if dtype.is_floating_point:
            s, l, d = (float(t) for t in (start, limit, delta))
            n = max(int(torch.ceil(torch.tensor((l - s) / d, dtype=torch.float64))), 0)
            vals = torch.tensor(s, dtype=torch.float64) + torch.arange(n, dtype=torch.float64) * d
            return vals.to(dtype)
        s, l, d = (int(t) for t in (start, limit, delta))
        n = max(-((s - l) // d), 0)
        return (s + torch.arange(n, dtype=torch.int64) * d).to(dtype)


register_versions("Range", 27, lambda node, graph: result(OnnxRange(), node))


class OnnxMod(nn.Module, OnnxToTorchModule):
    """ONNX Mod-10/13/28: ``fmod=0``: integer remainder with the divisor's sign (Python ``%``);
    ``fmod=1``: C ``fmod`` (dividend's sign; required for floats). Unsigned 16/32/64-bit via int64."""

    def __init__(self, fmod: bool):
        super().__init__()
        self.fmod = fmod

    def forward(self, a, b):  # noqa: D102
        fn = torch.fmod if self.fmod else torch.remainder
        if a.dtype == torch.uint64:  # unsigned: both remainders agree, a - (a // b) * b
            ai, bi = _as_int64_bits(a), _as_int64_bits(b)
            return (ai - udiv64(ai, bi) * bi).view(torch.uint64)
        if a.dtype in _WIDE_UNSIGNED:
            return _back_from_bits(fn(_as_int64_bits(a), _as_int64_bits(b)), a.dtype)
        return fn(a, b)


register_versions("Mod", 10, lambda node, graph: result(OnnxMod(bool(attr(node, "fmod", 0))), node), override=[10, 13])
