"""Algorithms on prepared models: ``fn(qm, data, settings) -> qm`` (ARCHITECTURE.md).

* :func:`fast_finetune` (AdaRound, AdaQuant: layer-wise reconstruction in graph order), :func:`adaround`,
  :func:`adaquant`.
"""
from .adaround import AdaRoundRounding
from .fast_finetune import FinetuneReport, LayerRecord, adaquant, adaround, fast_finetune

__all__ = ["fast_finetune", "adaround", "adaquant", "FinetuneReport", "LayerRecord", "AdaRoundRounding"]
