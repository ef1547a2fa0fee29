"""Signal-processing converters (ONNX spec semantics): DFT-17/20, STFT-17, HannWindow, HammingWindow,
BlackmanWindow and MelWeightMatrix (all opset 17). Transforms run in complex128 (float64 inputs) or
complex64 and return the real ``[..., 2]`` (real, imaginary) layout ONNX uses."""
from __future__ import annotations

import math

import torch
from torch import nn

from .ops_common import TP, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, register_versions, result, torch_dtype


def _complex(x: torch.Tensor) -> torch.Tensor:
    """``[..., 1]`` real or ``[..., 2]`` (re, im) -> complex tensor ``[...]``."""
    xd = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if x.shape[-1] == 1:
        return torch.complex(xd[..., 0], torch.zeros_like(xd[..., 0]))
    return torch.complex(xd[..., 0], xd[..., 1])


def _split(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([c.real, c.imag], dim=-1).to(dtype)


class OnnxDFT(nn.Module, OnnxToTorchModule):
    """ONNX DFT-17 (axis attribute) / DFT-20 (axis input, default -2): forward ``y[k] = sum x[n] e^{-2 pi j kn/N}``
    or inverse (``1/N``, conjugate kernel) along ``axis`` of ``[..., 1|2]`` input; ``dft_length``
    zero-pads or truncates the signal; ``onesided``: RFFT (forward, real input, ``N//2 + 1`` bins) or
    IRFFT (inverse, one-sided input, real ``[..., 1]`` output, default length ``2 (n - 1)``)."""

    def __init__(self, inverse: bool, onesided: bool, axis: int | None):
        super().__init__()
        self.inverse, self.onesided, self.axis = inverse, onesided, axis

    def forward(self, x, dft_length=None, axis=None):  # noqa: D102
        ax = self.axis if self.axis is not None else (int(axis.reshape(-1)[0]) if axis is not None else -2)
        ax = ax % x.dim()
        c = _complex(x)
        if dft_length is not None and dft_length.numel():
            n = int(dft_length.reshape(-1)[0])
        else:
            n = 2 * (x.shape[ax] - 1) if self.inverse and self.onesided else x.shape[ax]
        if self.inverse:
            if self.onesided:
                return torch.fft.irfft(c, n=n, dim=ax).unsqueeze(-1).to(x.dtype)
            return _split(torch.fft.ifft(c, n=n, dim=ax), x.dtype)
        y = torch.fft.fft(c, n=n, dim=ax)
        if self.onesided:
            y = y.narrow(ax, 0, n // 2 + 1)
        return _split(y, x.dtype)


register_versions("DFT", 17, lambda node, graph: result(
    OnnxDFT(bool(attr(node, "inverse", 0)), bool(attr(node, "onesided", 0)), attr(node, "axis", 1)), node), last=19)
register_versions("DFT", 20, lambda node, graph: result(
    OnnxDFT(bool(attr(node, "inverse", 0)), bool(attr(node, "onesided", 0)), None), node))


class OnnxSTFT(nn.Module, OnnxToTorchModule):
    """ONNX STFT-17: signal ``[B, L, 1|2]``, frames of ``frame_length`` every ``frame_step`` samples
    (``floor((L - frame_length) / frame_step) + 1`` frames), each multiplied by ``window`` (default
    ones) and DFT-ed; output ``[B, frames, bins, 2]`` with ``bins = frame_length // 2 + 1`` when
    ``onesided`` (default 1, real input only)."""

    def __init__(self, onesided: bool):
        super().__init__()
        self.onesided = onesided

    def forward(self, signal, frame_step, window=None, frame_length=None):  # noqa: D102
        step = int(frame_step.reshape(-1)[0])
        if frame_length is not None and frame_length.numel():
            n = int(frame_length.reshape(-1)[0])
        elif window is not None:
            n = window.shape[0]
        else:
            n = signal.shape[1]
        c = _complex(signal)  # [B, L]
        frames = c.unfold(1, n, step)  # [B, F, n]
        if window is not None:
            frames = frames * window.to(frames.real.dtype)
        y = torch.fft.fft(frames, n=n, dim=-1)
        if self.onesided:
            y = y[..., : n // 2 + 1]
        return _split(y, signal.dtype)


register_versions("STFT", 17, lambda node, graph: result(OnnxSTFT(bool(attr(node, "onesided", 1))), node))

_WINDOWS = {
    "HannWindow": lambda n, N: torch.sin(n * math.pi / N) ** 2,
    "HammingWindow": lambda n, N: 25.0 / 46.0 - torch.cos(n * math.pi * 2 / N) * (21.0 / 46.0),
    "BlackmanWindow": lambda n, N: 0.42 - 0.5 * torch.cos(n * math.pi * 2 / N) + 0.08 * torch.cos(n * math.pi * 4 / N),
}


class OnnxWindow(nn.Module, OnnxToTorchModule):
    """ONNX Hann/Hamming/BlackmanWindow-17: ``size`` points of the window over ``N = size`` (periodic,
    default) or ``size - 1`` (symmetric): Hann ``sin^2(pi n / N)``, Hamming ``25/46 - 21/46 cos(2 pi n / N)``,
    Blackman ``0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)``; output dtype ``output_datatype``."""

    def __init__(self, op: str, periodic: bool, dtype: torch.dtype):
        super().__init__()
        self.op, self.periodic, self.dtype = op, periodic, dtype

    def forward(self, size):  # noqa: D102
        s = int(size.reshape(-1)[0])
        big = self.dtype == torch.float64
        n = torch.arange(s, dtype=torch.float64 if big else torch.float32)
        return _WINDOWS[self.op](n, s if self.periodic else s - 1).to(self.dtype)


def _window(node: OnnxNode, graph: OnnxGraph):
    return result(OnnxWindow(node.operation_type, bool(attr(node, "periodic", 1)),
                             torch_dtype(attr(node, "output_datatype", TP.FLOAT), node)), node)


for _op in _WINDOWS:
    register_versions(_op, 17, _window)


class OnnxMelWeightMatrix(nn.Module, OnnxToTorchModule):
    """ONNX MelWeightMatrix-17: ``[dft_length // 2 + 1, num_mel_bins]`` triangular filters with peak 1,
    edges equally spaced on ``mel(f) = 2595 log10(1 + f / 700)`` between the lower and upper edge
    frequencies and mapped to DFT bins as ``floor((dft_length + 1) f / sample_rate)``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz):  # noqa: D102
        m, n_fft = int(num_mel_bins.reshape(-1)[0]), int(dft_length.reshape(-1)[0])
        sr = float(sample_rate.reshape(-1)[0])
        lo, hi = float(lower_edge_hertz.reshape(-1)[0]), float(upper_edge_hertz.reshape(-1)[0])
        bins = n_fft // 2 + 1
        lo_mel = 2595 * math.log1p(lo / 700) / math.log(10)
        hi_mel = 2595 * math.log1p(hi / 700) / math.log(10)
        step = (hi_mel - lo_mel) / (m + 2)
        mel = torch.arange(m + 2, dtype=torch.float64) * step + lo_mel
        hz = 700 * torch.expm1(mel / 2595 * math.log(10))
        edges = torch.floor((n_fft + 1) * hz / sr).to(torch.int64).tolist()
        out = torch.zeros(bins, m, dtype=torch.float64)
        for i in range(m):
            left, center, right = edges[i], edges[i + 1], edges[i + 2]
            if center == left:
                out[center, i] = 1.0
            else:
                for j in range(left, center + 1):
                    out[j, i] = (j - left) / (center - left)
            for j in range(center, right):
                out[j, i] = (right - j) / (right - center)
        return out.to(self.dtype)


register_versions("MelWeightMatrix", 17, lambda node, graph: result(
    OnnxMelWeightMatrix(torch_dtype(attr(node, "output_datatype", TP.FLOAT), node)), node))
__all__ = ["OnnxDFT", "OnnxSTFT", "OnnxWindow", "OnnxMelWeightMatrix"]
