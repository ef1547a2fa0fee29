"""Algorithms on prepared models: ``fn(qm, data, settings) -> qm`` (ARCHITECTURE.md).

* :func:`fast_finetune` (AdaRound, AdaQuant: layer-wise reconstruction in graph order), :func:`adaround`,
  :func:`adaquant`;
* :func:`bias_correction` (empirical bias correction after calibration);
* :func:`sensitivity` and :func:`auto_mixed_precision` (sensitivity-sorted bisection toward a target).
"""
from .adaround import AdaRoundRounding
from .bias_correction import BiasCorrectionReport, bias_correction
from .fast_finetune import FinetuneReport, LayerRecord, adaquant, adaround, fast_finetune
from .mixed_precision import MixedPrecisionPlan, SensitivityReport, auto_mixed_precision, sensitivity

__all__ = ["fast_finetune", "adaround", "adaquant", "FinetuneReport", "LayerRecord", "AdaRoundRounding",
           "sensitivity", "auto_mixed_precision", "MixedPrecisionPlan", "SensitivityReport", "bias_correction",
           "BiasCorrectionReport"]
