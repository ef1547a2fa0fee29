"""Algorithms on prepared models: ``fn(qm, data, settings) -> qm`` (ARCHITECTURE.md).

* :func:`fast_finetune` (AdaRound, AdaQuant: layer-wise reconstruction in graph order), :func:`adaround`,
  :func:`adaquant`;
* :func:`sensitivity` and :func:`auto_mixed_precision` (sensitivity-sorted bisection toward a target).
"""
from .adaround import AdaRoundRounding
from .fast_finetune import FinetuneReport, LayerRecord, adaquant, adaround, fast_finetune
from .mixed_precision import MixedPrecisionPlan, SensitivityReport, auto_mixed_precision, sensitivity

__all__ = ["fast_finetune", "adaround", "adaquant", "FinetuneReport", "LayerRecord", "AdaRoundRounding",
           "sensitivity", "auto_mixed_precision", "MixedPrecisionPlan", "SensitivityReport"]
