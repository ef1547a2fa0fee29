"""Accuracy metrics of a quantized model against its float baseline.

``evaluate(baseline_results_folder, quantized_results_folder)`` compares the files two inference runs wrote
(NPY, PNG, JPG; matched by file name), as the seed's ``evaluate`` tool: cosine similarity, L2 loss and PSNR.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from .errors import DataError

RESULT_EXTENSIONS = (".npy", ".png", ".jpg", ".jpeg")


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of the angle between flattened ``a`` and ``b`` (float64); 1.0 when both are all zero."""
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def l2_loss(a: np.ndarray, b: np.ndarray) -> float:
    """Euclidean distance ``||a - b||_2`` of the flattened arrays (float64)."""
    return float(np.linalg.norm(np.asarray(a, np.float64).ravel() - np.asarray(b, np.float64).ravel()))


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b|| / ||a||`` with ``a`` the reference; 0 when both are zero."""
    na = np.linalg.norm(np.asarray(a, np.float64).ravel())
    d = l2_loss(a, b)
    return d / na if na > 0 else (0.0 if d == 0 else math.inf)


def psnr(a: np.ndarray, b: np.ndarray, peak: float | None = None) -> float:
    """Peak signal-to-noise ratio in dB: ``10 log10(peak^2 / MSE)``; ``peak`` defaults to ``max|a|``
    (255 for 8-bit images). Infinite when identical."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    mse = float(np.mean((a - b) ** 2))
    if mse == 0:
        return math.inf
    if peak is None:
        peak = float(np.max(np.abs(a))) or 1.0
    return 10.0 * math.log10(peak * peak / mse)


@dataclass
class FolderComparison:
    """Mean metrics over the files two result folders share."""

    files: int
    cosine: float
    l2: float
    psnr: float

    def as_dict(self) -> Dict[str, float]:
        return {"files": self.files, "cosine_similarity": self.cosine, "l2_loss": self.l2, "psnr": self.psnr}


def _load(path: str) -> tuple[np.ndarray, float | None]:
    if path.lower().endswith(".npy"):
        return np.load(path, allow_pickle=False), None
    from PIL import Image

    with Image.open(path) as im:
        arr = np.asarray(im)
    return arr, 255.0 if arr.dtype == np.uint8 else None


def evaluate(baseline_results_folder: str, quantized_results_folder: str) -> FolderComparison:
    """Compare two folders of inference results file by file (same names; NPY, PNG, JPG).

    Returns:
        Mean cosine similarity, mean L2 loss and mean PSNR (dB; infinite PSNRs excluded from the mean, +inf
        when every file is identical).

    Raises:
        DataError: a folder is missing, holds no result files, or the two share no file names / shapes differ.
    """
    for folder in (baseline_results_folder, quantized_results_folder):
        if not os.path.isdir(folder):
            raise DataError(f"results folder {folder!r} does not exist")
    base = {f for f in os.listdir(baseline_results_folder) if f.lower().endswith(RESULT_EXTENSIONS)}
    quant = {f for f in os.listdir(quantized_results_folder) if f.lower().endswith(RESULT_EXTENSIONS)}
    if not base:
        raise DataError(f"{baseline_results_folder!r} holds no .npy/.png/.jpg files")
    common = sorted(base & quant)
    if not common:
        raise DataError(f"{baseline_results_folder!r} and {quantized_results_folder!r} share no file names")
    cos: List[float] = []
    l2s: List[float] = []
    ps: List[float] = []
    for f in common:
        a, peak = _load(os.path.join(baseline_results_folder, f))
        b, _ = _load(os.path.join(quantized_results_folder, f))
        if a.shape != b.shape:
            raise DataError(f"{f}: baseline shape {a.shape} differs from quantized shape {b.shape}")
        cos.append(cosine_similarity(a, b))
        l2s.append(l2_loss(a, b))
        ps.append(psnr(a, b, peak))
    finite = [p for p in ps if math.isfinite(p)]
    return FolderComparison(len(common), float(np.mean(cos)), float(np.mean(l2s)),
                            float(np.mean(finite)) if finite else math.inf)
