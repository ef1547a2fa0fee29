"""Resampling converters: Resize-18/19 (every mode and attribute), Upsample, GridSample, AffineGrid, Col2Im,
CenterCropPad, DeformConv. Semantics: the ONNX operator documentation of each op.

Resize is computed separably, one axis at a time: for each output index the source coordinate follows
``coordinate_transformation_mode``; the taps and weights follow ``mode`` (nearest with
``nearest_mode``, linear: 2 taps, cubic: 4 taps with ``cubic_coeff_a``; ``antialias`` stretches the
linear/cubic kernel by 1/scale when downsampling and normalizes it), ``exclude_outside`` zeroes and
renormalizes taps outside the input, other taps are clamped to the edge, and ``tf_crop_and_resize``
writes ``extrapolation_value`` where the source coordinate leaves the input. Taps of an axis are cached
per (input length, output length, scale, roi) so a model with constant shapes computes them once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .ops_common import (
    ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, onnx2torch_converter, register_versions,
    result,
)
from .ops_conv_pool import _torch_pad, windows

_CTM = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
        "tf_crop_and_resize", "tf_half_pixel_for_nn")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _cubic(x: torch.Tensor, a: float) -> torch.Tensor:
    """Keys cubic convolution kernel with parameter ``a`` (ONNX Resize ``cubic_coeff_a``)."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


class _AxisTaps:
    """Source indices ``[out, n]``, weights ``[out, n]`` (float64) and the extrapolation mask of one axis."""

    def __init__(self, idx, w, extrapolated):
        self.idx, self.w, self.extrapolated = idx, w, extrapolated


class OnnxResize(nn.Module, OnnxToTorchModule):
    """ONNX Resize-18/19. X ``[*]`` -> Y (X's dtype); inputs roi, scales, sizes (any may be absent,
    exactly one of scales/sizes is used); scales/sizes/roi refer to ``axes`` (default all axes).

    Output length: ``floor(in * scale)`` from scales; from sizes directly, or with
    ``keep_aspect_ratio_policy`` not_larger/not_smaller one common scale (min/max of sizes/in) and
    ``round_half_up(scale * in)``. Integer inputs are interpolated in float64, rounded half to even and
    saturated (as ONNX's reference implementation does); float inputs in float32 (float64 for double).
    """

    def __init__(self, mode: str, ctm: str, nearest_mode: str, cubic_a: float, exclude_outside: bool,
                 extrapolation_value: float, antialias: bool, axes, policy: str):
        super().__init__()
        self.mode, self.ctm, self.nearest_mode, self.cubic_a = mode, ctm, nearest_mode, cubic_a
        self.exclude_outside, self.extrapolation_value, self.antialias = exclude_outside, extrapolation_value, antialias
        self.axes, self.policy = axes, policy
        self._cache: dict = {}

    # ------------------------------------------------------------------ geometry
    def _plan(self, shape, roi, scales, sizes):
        r = len(shape)
        axes = [a % r for a in self.axes] if self.axes is not None else list(range(r))
        scale = [1.0] * r
        out = list(shape)
        roi_full = None
        if roi is not None and roi.numel():
            vals = [float(v) for v in roi.reshape(-1).tolist()]
            roi_full = [0.0] * r + [1.0] * r
            k = len(axes)
            for i, a in enumerate(axes):
                roi_full[a], roi_full[r + a] = vals[i], vals[k + i]
        if sizes is not None and sizes.numel():
            sz = [int(v) for v in sizes.reshape(-1).tolist()]
            for i, a in enumerate(axes):
                out[a] = sz[i]
                scale[a] = sz[i] / shape[a]
            if self.policy != "stretch":
                common = (min if self.policy == "not_larger" else max)(scale[a] for a in axes)
                for a in axes:
                    scale[a] = common
                    out[a] = int(common * shape[a] + 0.5)
        elif scales is not None and scales.numel():
            sc = [float(v) for v in scales.reshape(-1).tolist()]
            for i, a in enumerate(axes):
                scale[a] = sc[i]
                out[a] = int(sc[i] * shape[a])
        else:
            raise ValueError("Resize: one of scales / sizes must be given")
        return axes, scale, out, roi_full

    def _source(self, y: torch.Tensor, s: float, n_in: int, n_out: int, roi):
        ctm = self.ctm
        if ctm == "align_corners":
            return (torch.zeros_like(y) if n_out == 1 else y * (n_in - 1) / (n_out - 1)), None
        if ctm == "asymmetric":
            return y / s, None
        if ctm == "pytorch_half_pixel":
            return (torch.full_like(y, -0.5) if n_out == 1 else (y + 0.5) / s - 0.5), None
        if ctm == "half_pixel":
            return (y + 0.5) / s - 0.5, None
        if ctm == "tf_half_pixel_for_nn":  # Resize-11 only
            return (y + 0.5) / s, None
        if ctm == "half_pixel_symmetric":
            adjustment = n_out / (s * n_in)
            offset = n_in / 2 * (1 - adjustment)
            return offset + (y + 0.5) / s - 0.5, None
        start, end = roi
        if n_out == 1:
            x = torch.full_like(y, (end - start) * (n_in - 1) / 2)
        else:
            x = y * (end - start) * (n_in - 1) / (n_out - 1)
        x = x + start * (n_in - 1)
        return x, (x < 0) | (x > n_in - 1)

    def _taps(self, n_in: int, n_out: int, s: float, roi, device) -> _AxisTaps:
        key = (n_in, n_out, s, None if roi is None else tuple(roi), str(device))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        y = torch.arange(n_out, dtype=torch.float64)
        x, extra = self._source(y, s, n_in, n_out, roi)
        if self.mode == "nearest":
            nm = self.nearest_mode
            if nm == "round_prefer_floor":
                i = torch.ceil(x - 0.5)
            elif nm == "round_prefer_ceil":
                i = torch.floor(x + 0.5)
            elif nm == "floor":
                i = torch.floor(x)
            else:
                i = torch.ceil(x)
            idx = i.to(torch.int64).clamp(0, n_in - 1).unsqueeze(1)
            w = torch.ones_like(idx, dtype=torch.float64)
        else:
            x0 = torch.floor(x)
            ratio = x - x0
            integer = ratio == 0
            x0 = torch.where(integer, x0 - 1, x0)  # the reference prefers the pixel left of an integer x
            ratio = torch.where(integer, torch.ones_like(ratio), ratio)
            sa = min(s, 1.0) if self.antialias else 1.0
            if self.mode == "linear":
                start = math.floor(-1 / sa) + 1 if self.antialias else 0
                offs = torch.arange(start, 2 - start, dtype=torch.float64)
                w = torch.clamp(1 - ((offs.unsqueeze(0) - ratio.unsqueeze(1)) * sa).abs(), 0, 1)
            else:
                start = math.floor(-2 / sa) + 1 if self.antialias else -1
                offs = torch.arange(start, 2 - start, dtype=torch.float64)
                w = _cubic((offs.unsqueeze(0) - ratio.unsqueeze(1)) * sa, self.cubic_a)
            if self.antialias:
                w = w / w.sum(dim=1, keepdim=True)
            idx = x0.to(torch.int64).unsqueeze(1) + offs.to(torch.int64).unsqueeze(0)
            if self.exclude_outside:
                w = torch.where((idx < 0) | (idx >= n_in), torch.zeros_like(w), w)
                tot = w.sum(dim=1, keepdim=True)
                w = w / torch.where(tot == 0, torch.ones_like(tot), tot)
            idx = idx.clamp(0, n_in - 1)
        taps = _AxisTaps(idx.to(device), w.to(device), None if extra is None else extra.to(device))
        if len(self._cache) < 64:
            self._cache[key] = taps
        return taps

    def forward(self, x: torch.Tensor, roi=None, scales=None, sizes=None) -> torch.Tensor:  # noqa: D102
        axes, scale, out, roi_full = self._plan(list(x.shape), roi, scales, sizes)
        if self.ctm == "tf_crop_and_resize" and roi_full is None:
            raise ValueError("Resize: coordinate_transformation_mode='tf_crop_and_resize' needs the roi input")
        r = x.dim()
        integer = not x.is_floating_point()
        y = x.to(torch.float64 if x.dtype == torch.float64 or integer else torch.float32)
        for a in axes:
            n_in, n_out = y.shape[a], out[a]
            roi_a = None if roi_full is None else (roi_full[a], roi_full[r + a])
            if n_out == n_in and math.isclose(scale[a], 1.0) and (roi_a is None or roi_a == (0.0, 1.0)):
                continue
            t = self._taps(n_in, n_out, scale[a], roi_a, y.device)
            k = t.idx.shape[1]
            g = torch.index_select(y, a, t.idx.reshape(-1))
            if k > 1:
                g = g.reshape(y.shape[:a] + (n_out, k) + y.shape[a + 1:])
                wshape = [1] * a + [n_out, k] + [1] * (r - a - 1)
                g = (g * t.w.to(g.dtype).reshape(wshape)).sum(dim=a + 1)
            if t.extrapolated is not None:
                mshape = [1] * a + [n_out] + [1] * (r - a - 1)
                g = torch.where(t.extrapolated.reshape(mshape), torch.full_like(g, self.extrapolation_value), g)
            y = g
        if integer:
            info = torch.iinfo(x.dtype)
            return torch.round(y).clamp(info.min, info.max).to(x.dtype)
        return y.to(x.dtype)


def _resize(node: OnnxNode, graph: OnnxGraph):
    mode = attr(node, "mode", "nearest")
    ctm = attr(node, "coordinate_transformation_mode", "half_pixel")
    nm = attr(node, "nearest_mode", "round_prefer_floor")
    policy = attr(node, "keep_aspect_ratio_policy", "stretch")
    for name, v, valid in (("mode", mode, ("nearest", "linear", "cubic")), ("coordinate_transformation_mode", ctm, _CTM),
                           ("nearest_mode", nm, _NEAREST),
                           ("keep_aspect_ratio_policy", policy, ("stretch", "not_larger", "not_smaller"))):
        if v not in valid:
            raise ConversionNotSupported(f"Resize node {node.name!r}: {name}={v!r} (valid: {', '.join(valid)})")
    antialias = bool(attr(node, "antialias", 0)) and mode != "nearest"
    mod = OnnxResize(mode, ctm, nm, float(attr(node, "cubic_coeff_a", -0.75)), bool(attr(node, "exclude_outside", 0)),
                     float(attr(node, "extrapolation_value", 0.0)), antialias, attr(node, "axes"), policy)
    return result(mod, node)


register_versions("Resize", 18, _resize)


def _resize_11_13(node: OnnxNode, graph: OnnxGraph):
    """Resize-11/13 (onnx2torch's keys, overridden): onnx2torch's ``F.interpolate`` module where its result is
    the ONNX one (nearest + asymmetric + floor; linear/cubic + half_pixel/align_corners with the default
    ``cubic_coeff_a`` and ``exclude_outside``), :class:`OnnxResize` otherwise. onnx2torch warns and differs
    from ONNX Runtime for the other coordinate modes / nearest modes, most visibly when ``sizes`` computed
    at run time (a detector resizing a feature map to the size of a skip connection) give a non-integer
    ratio; resizing the batch or channel axis fails in its forward."""
    mode = attr(node, "mode", "nearest")
    ctm = attr(node, "coordinate_transformation_mode", "half_pixel")
    nm = attr(node, "nearest_mode", "round_prefer_floor")
    exact = (mode == "nearest" and ctm == "asymmetric" and nm == "floor") or (
        mode in ("linear", "cubic") and ctm in ("half_pixel", "align_corners")
        and float(attr(node, "cubic_coeff_a", -0.75)) == -0.75 and not attr(node, "exclude_outside", 0))
    if exact:
        try:
            return onnx2torch_converter("Resize", 13)(node, graph)
        except NotImplementedError:
            pass
    return _resize(node, graph)


class OnnxUpsample(nn.Module, OnnxToTorchModule):
    """ONNX Upsample-7/9 (deprecated): Resize with ``asymmetric`` coordinates; ``nearest`` takes
    ``floor(i / scale)``, ``linear`` interpolates (2 taps, edge-clamped). Scales from the attribute
    (opset 7) or the second input (opset 9)."""

    def __init__(self, mode: str, scales):
        super().__init__()
        self.scales = scales
        self.resize = OnnxResize("nearest" if mode == "nearest" else "linear", "asymmetric", "floor", -0.75, False, 0.0,
                                 False, None, "stretch")

    def forward(self, x, scales=None):  # noqa: D102
        sc = scales if scales is not None else torch.tensor(self.scales, dtype=torch.float32)
        return self.resize(x, None, sc)


def _upsample(node: OnnxNode, graph: OnnxGraph):
    mode = attr(node, "mode", "nearest")
    if mode not in ("nearest", "linear", "bilinear"):
        raise ConversionNotSupported(f"Upsample node {node.name!r}: mode={mode!r} (valid: nearest, linear)")
    return result(OnnxUpsample(mode, attr(node, "scales")), node)


class OnnxResize10(OnnxUpsample):
    """ONNX Resize-10: X ``[*]``, scales ``[rank]`` -> ``floor(in * scale)`` per axis, ``asymmetric``
    coordinates (``i / scale``) as Upsample-9; ``linear`` with 2 edge-clamped taps, ``nearest`` takes the
    floor of the source coordinate on enlarged axes and its ceiling (clamped to the last index) on
    shrunk ones (ONNX Runtime's opset-10 rounding)."""

    def __init__(self, mode: str):
        super().__init__(mode, None)
        self.shrink = OnnxResize("nearest", "asymmetric", "ceil", -0.75, False, 0.0, False, None, "stretch") \
            if mode == "nearest" else None

    def forward(self, x, scales=None):  # noqa: D102
        if self.shrink is None or not bool((scales < 1).any()):
            return self.resize(x, None, scales)
        one = torch.ones_like(scales)
        y = self.resize(x, None, torch.where(scales < 1, one, scales))
        return self.shrink(y, None, torch.where(scales < 1, scales, one))


def _resize_10(node: OnnxNode, graph: OnnxGraph):
    """Resize-10 (onnx2torch's key, overridden: its ``F.interpolate`` took half-pixel linear coordinates and
    rounded shrunk nearest indices down, unlike ONNX Runtime): :class:`OnnxResize10`."""
    mode = attr(node, "mode", "nearest")
    if mode not in ("nearest", "linear"):
        raise ConversionNotSupported(f"Resize node {node.name!r}: mode={mode!r} (valid at opset 10: nearest, linear)")
    return result(OnnxResize10(mode), node)


register_versions("Upsample", 7, _upsample)
register_versions("Resize", 10, _resize_10, override=(10,), last=10)
register_versions("Resize", 11, _resize_11_13, override=(11, 13), last=13)


class OnnxGridSample(nn.Module, OnnxToTorchModule):
    """ONNX GridSample-16/20/22 for 2-D and 3-D spatial inputs through ``torch.nn.functional.grid_sample``
    (which ONNX's definition follows): X ``[N, C, *S]``, grid ``[N, *S_out, r]`` (x first) -> ``[N, C, *S_out]``."""

    def __init__(self, mode: str, padding_mode: str, align_corners: bool):
        super().__init__()
        self.mode, self.padding_mode, self.align_corners = mode, padding_mode, align_corners

    def forward(self, x, grid):  # noqa: D102
        return F.grid_sample(x, grid.to(x.dtype), mode=self.mode, padding_mode=self.padding_mode,
                             align_corners=self.align_corners)


def _grid_sample(node: OnnxNode, graph: OnnxGraph):
    mode = {"linear": "bilinear", "cubic": "bicubic"}.get(attr(node, "mode", "linear"), attr(node, "mode", "linear"))
    if mode not in ("bilinear", "nearest", "bicubic"):
        raise ConversionNotSupported(f"GridSample node {node.name!r}: mode={mode!r} (valid: linear/bilinear, nearest, "
                                     f"cubic/bicubic)")
    pm = attr(node, "padding_mode", "zeros")
    if pm not in ("zeros", "border", "reflection"):
        raise ConversionNotSupported(f"GridSample node {node.name!r}: padding_mode={pm!r} (valid: zeros, border, reflection)")
    vi = graph.value_info.get(node.input_values[0])
    rank = len(vi.type.tensor_type.shape.dim) if vi is not None and vi.type.tensor_type.HasField("shape") else None
    if rank is not None and rank not in (4, 5) or rank == 5 and mode == "bicubic":
        raise ConversionNotSupported(f"GridSample node {node.name!r}: input rank {rank} with mode {mode!r} (supported: "
                                     f"rank 4 any mode, rank 5 linear/nearest)")
    return result(OnnxGridSample(mode, pm, bool(attr(node, "align_corners", 0))), node)


register_versions("GridSample", 16, _grid_sample)


class OnnxAffineGrid(nn.Module, OnnxToTorchModule):
    """ONNX AffineGrid-20: theta ``[N, 2, 3]`` / ``[N, 3, 4]`` and size ``[N, C, H, W]`` / ``[N, C, D, H, W]``
    -> grid ``[N, H, W, 2]`` / ``[N, D, H, W, 3]`` (``torch.nn.functional.affine_grid``, which the spec follows)."""

    def __init__(self, align_corners: bool):
        super().__init__()
        self.align_corners = align_corners

    def forward(self, theta, size):  # noqa: D102
        return F.affine_grid(theta, [int(v) for v in size.tolist()], align_corners=self.align_corners)


register_versions("AffineGrid", 20, lambda node, graph: result(OnnxAffineGrid(bool(attr(node, "align_corners", 0))), node))


class OnnxCol2Im(nn.Module, OnnxToTorchModule):
    """ONNX Col2Im-18: input ``[N, C*prod(block), L]`` summed back into ``[N, C, *image_shape]`` (blocks
    in lexicographic order over the padded image with ``strides``/``dilations``; pads cropped)."""

    def __init__(self, strides, pads, dilations):
        super().__init__()
        self.strides, self.pads, self.dilations = strides, pads, dilations

    def forward(self, x, image_shape, block_shape):  # noqa: D102
        image = [int(v) for v in image_shape.tolist()]
        block = [int(v) for v in block_shape.tolist()]
        n = len(image)
        strides = self.strides or [1] * n
        dil = self.dilations or [1] * n
        pads = self.pads or [0] * (2 * n)
        padded = [image[i] + pads[i] + pads[n + i] for i in range(n)]
        k = math.prod(block)
        idx = torch.arange(math.prod(padded), device=x.device).reshape([1, 1] + padded)
        pos = windows(idx, block, strides, dil).reshape(-1, k)  # [L, K]
        nb, ck, length = x.shape
        c = ck // k
        src = x.reshape(nb, c, k, length).permute(0, 1, 3, 2).reshape(nb, c, -1)
        out = torch.zeros(nb, c, math.prod(padded), dtype=x.dtype, device=x.device)
        out = out.index_add(2, pos.reshape(-1), src).reshape([nb, c] + padded)
        return F.pad(out, _torch_pad([-p for p in pads], n)) if any(pads) else out


register_versions("Col2Im", 18, lambda node, graph: result(
    OnnxCol2Im(attr(node, "strides"), attr(node, "pads"), attr(node, "dilations")), node))


class OnnxCenterCropPad(nn.Module, OnnxToTorchModule):
    """ONNX CenterCropPad-18: per axis in ``axes`` crop (centered, the odd element dropped at the end)
    or zero-pad (centered, the odd element added at the end) to ``shape``."""

    def __init__(self, axes):
        super().__init__()
        self.axes = axes

    def forward(self, x, shape):  # noqa: D102
        r = x.dim()
        axes = [a % r for a in self.axes] if self.axes is not None else list(range(r))
        for a, target in zip(axes, [int(v) for v in shape.tolist()]):
            dim = x.shape[a]
            if target < dim:
                x = x.narrow(a, (dim - target) // 2, target)
            elif target > dim:
                d = target - dim
                pad = [0] * (2 * r)
                pad[2 * (r - 1 - a)], pad[2 * (r - 1 - a) + 1] = d // 2, d - d // 2
                x = F.pad(x, pad)
        return x


register_versions("CenterCropPad", 18, lambda node, graph: result(OnnxCenterCropPad(attr(node, "axes")), node))


class OnnxDeformConv(nn.Module, OnnxToTorchModule):
    """ONNX DeformConv-19/22 for 2-D inputs via ``torchvision.ops.deform_conv2d``: X ``[N, C, H, W]``,
    W ``[oC, C/group, kH, kW]``, offset ``[N, offset_group*kH*kW*2, oH, oW]`` ((y, x) pairs), optional
    B ``[oC]`` and mask ``[N, offset_group*kH*kW, oH, oW]``; pads may be asymmetric (zero padding)."""

    def __init__(self, strides, pads, dilations, group):
        super().__init__()
        self.strides, self.pads, self.dilations, self.group = strides, pads, dilations, group

    def forward(self, x, w, offset, b=None, mask=None):  # noqa: D102
        from torchvision.ops import deform_conv2d

        if any(self.pads):
            x = F.pad(x, _torch_pad(self.pads, 2))
        # groups and offset groups follow from the shapes of w and offset (torchvision infers both)
        return deform_conv2d(x, offset, w, b, stride=self.strides, dilation=self.dilations, mask=mask)


def _deform_conv(node: OnnxNode, graph: OnnxGraph):
    k = attr(node, "kernel_shape")
    vi = graph.value_info.get(node.input_values[0])
    rank = len(vi.type.tensor_type.shape.dim) if vi is not None and vi.type.tensor_type.HasField("shape") else 4
    if rank != 4 or (k is not None and len(k) != 2):
        raise ConversionNotSupported(f"DeformConv node {node.name!r}: only 2-D inputs are supported (rank {rank})")
    return result(OnnxDeformConv(attr(node, "strides", [1, 1]), attr(node, "pads", [0, 0, 0, 0]),
                                 attr(node, "dilations", [1, 1]), attr(node, "group", 1)), node)


register_versions("DeformConv", 19, _deform_conv)
__all__ = ["OnnxResize", "OnnxUpsample", "OnnxGridSample", "OnnxAffineGrid", "OnnxCol2Im", "OnnxCenterCropPad",
           "OnnxDeformConv"]
