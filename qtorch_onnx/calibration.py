"""Calibration of a prepared model: run the float model with the observers recording, then turn their
statistics into scales and zero points, with the plan's range adjustments, alignments and INT32 bias scales
(:func:`calibrate`, :func:`finalize_qparams`)."""
from __future__ import annotations

import time
from typing import Any, Dict, Tuple

import torch

from . import data as _data
from .errors import DataError
from .fakequant import FakeQuantize
from .model import QuantizedModel
from .placement import QuantSpec
from .heap import large_tensor_heap
from .precision import float32_exact


@float32_exact()
@large_tensor_heap()
def calibrate(qm: QuantizedModel, data: Any, *, batch_size: int = 8, progress: bool = True,
              check_finite: bool = True) -> QuantizedModel:
    """Calibrate the activation quantizers of ``qm`` on ``data``.

    Runs the float model (all quantizers pass-through, observers recording), in batches of ``batch_size``
    samples on ``qm``'s device, one pass (two for histogram methods). The observers' statistics do not depend
    on ``batch_size``; the float ops before a quantizer may (CPU convolution kernels round a batch of one
    differently from larger batches), which can move a scale by an ulp. Then applies the range adjustments and alignments of the plan and the INT32 bias scales.
    Under ``torch.distributed`` (world size > 1) the observers' statistics are reduced across ranks after
    each pass (:func:`qtorch_onnx.distributed.sync_observers`), so every rank gets the scales one process
    would get on the union of the data.

    The user's switches are respected: a quantizer whose observer the user switched off
    (``fq.observer_enabled = False``, :func:`qtorch_onnx.disable_observer`) keeps its parameters; one whose
    fake quantization is off stays off. Afterwards the calibrated observers are frozen (off) and every
    switch is as before.

    Args:
        qm: the prepared model.
        data: any form accepted by :func:`qtorch_onnx.data.to_samples`.
        batch_size: samples per forward pass (only where the model's batch dimension is dynamic).
        progress: show a tqdm progress bar.
        check_finite: raise DataError when a calibration input holds NaN/Inf.

    Returns:
        ``qm`` (modified in place).

    On CUDA it runs with TF32 off (:class:`qtorch_onnx.float32_exact`: float32 convolutions and products as
    the CPU emulation and ONNX Runtime compute them); the caller's torch settings come back afterwards. With
    glibc, its heap keeps freed blocks of large tensors for reuse meanwhile
    (:class:`qtorch_onnx.heap.large_tensor_heap`).

    Raises:
        DataError: empty data, wrong input names/shapes/dtypes, NaN/Inf in inputs or in an activation.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    samples = _data.to_samples(data, qm.input_specs)
    if check_finite:
        _data.check_finite(samples, qm.input_specs)
    fqs = qm.quantizers()
    observed = [fq for fq in fqs.values() if fq.calibratable]
    skipped = {k for k, fq in fqs.items() if fq.role == "activation" and fq.observer is not None and not fq.calibratable}
    for fq in observed:
        fq.observer.reset()
    device = qm.device
    previous = {name: (fq.fake_quant_enabled, fq._observer_enabled, fq._observer_auto_off) for name, fq in fqs.items()}
    for fq in fqs.values():  # the float model, observers of the calibrated quantizers on
        fq.fake_quant_enabled = False
        fq._observer_enabled = False
    for fq in observed:
        fq._observer_enabled = True
    passes = 2 if any(getattr(fq.observer, "needs_second_pass", False) for fq in observed) else 1
    was_training = qm.training
    qm.eval()
    from .distributed import check_same_graph, is_distributed, sync_observers

    if is_distributed():
        check_same_graph(qm)  # every rank must calibrate the same graph and quantizers
    try:
        with torch.no_grad():
            for p in range(passes):
                if p == 1:
                    for fq in observed:
                        if getattr(fq.observer, "needs_second_pass", False):
                            fq.observer.start_second_pass()
                batch_list = list(_data.batches(samples, qm.input_specs, batch_size))
                desc = "calibrate" if passes == 1 else f"calibrate pass {p + 1}/{passes}"
                for batch in tqdm(batch_list, desc=desc, disable=not progress, leave=False):
                    qm(*(t.to(device) for t in batch))
                if sync_observers is not None:  # a no-op unless torch.distributed runs with world size > 1
                    sync_observers({k: fq.observer for k, fq in fqs.items() if fq.calibratable and fq._observer_enabled})
    finally:
        qm.train(was_training)
        for name, fq in fqs.items():
            fq.fake_quant_enabled, fq._observer_enabled, fq._observer_auto_off = previous[name]
    finalize_qparams(qm, skip=skipped)
    for fq in observed:  # statistics frozen; a later calibrate() may use them again
        fq._observer_enabled = False
        fq._observer_auto_off = True
    qm.stage_times["calibrate"] = time.perf_counter() - t0
    return qm


def finalize_qparams(qm: QuantizedModel, skip=()) -> None:
    """Compute activation qparams from observers, then apply range_from, fixed ranges, overrides, sharing and
    INT32 bias scales (docs/numerics.md sections 1-2). Quantizers in ``skip`` (keys) keep their parameters."""
    fqs = qm.quantizers()
    specs = qm.plan.specs
    skip = set(skip)
    ranges: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for name, fq in fqs.items():
        if fq.observer is not None and fq.role == "activation" and name not in skip:
            ranges[name] = fq.observer.compute_range()
    for name, fq in fqs.items():
        spec = specs[name]
        if fq.role != "activation" or not fq.needs_calibration or name in skip:
            continue
        if spec.fixed_range is not None:
            fq.compute_qparams_from_range(torch.tensor(spec.fixed_range[0], dtype=torch.float64),
                                          torch.tensor(spec.fixed_range[1], dtype=torch.float64))
        elif spec.range_from is not None and spec.range_from in ranges and not qm.config.calibration.power_of_two:
            fq.compute_qparams_from_range(*ranges[spec.range_from])
        elif fq.observer is not None:
            fq.finish_calibration()
        _apply_overrides(fq, spec)
    for name, fq in fqs.items():
        spec = specs[name]
        if spec.share_with is not None and spec.share_with in fqs:
            src = fqs[spec.share_with]
            fq.set_qparams(src.scale, src.zero_point)
    for name, fq in fqs.items():
        spec = specs[name]
        if spec.bias_of is not None:
            x, w = spec.bias_of
            if fq.bias_sources is None:
                fq.set_bias_sources(fqs[x], fqs[w])
            fq.refresh_qparams()
    for name, fq in fqs.items():
        if fq.needs_calibration and not fq.calibrated and name not in skip:
            raise DataError(f"quantizer on tensor {name!r} was never calibrated (the calibration data did not reach it)")


def _apply_overrides(fq: FakeQuantize, spec: QuantSpec) -> None:
    ov = dict(spec.overrides)
    if "scale" in ov:
        fq.set_qparams(torch.as_tensor(ov["scale"], dtype=torch.float32),
                       torch.as_tensor(ov.get("zero_point", 0), dtype=torch.int64))
    elif "rmin" in ov or "rmax" in ov:
        fq.compute_qparams_from_range(torch.as_tensor(ov.get("rmin", 0.0), dtype=torch.float64),
                                      torch.as_tensor(ov.get("rmax", 0.0), dtype=torch.float64))
