"""qtorch-onnx: PyTorch-native fake quantization of ONNX models.

Public API (and nothing else): the Quark-compatible vocabulary (``ModelQuantizer``, ``Config``,
``QuantizationConfig``, ``get_default_config``, the type enums), the native torch API (``lift``, ``prepare``,
``calibrate``, ``export``, ``load_quantized``), the training contract (``learn_scales``, the observer /
fake-quant switches, ``QuantLayer``, ``save`` / ``load``), algorithms (``fast_finetune``, ``adaround``,
``adaquant``, ``bias_correction``, ``sensitivity``, ``auto_mixed_precision``), metrics (``evaluate``), the
float32-on-CUDA guard the algorithms run under (``float32_exact``) and ONNX Runtime helpers (``get_library_path``).

``import qtorch_onnx`` imports neither torch nor onnx2torch: every public name is looked up in
:data:`_LAZY` (name -> submodule) on first use (PEP 562), and the submodule is imported then. So a
deployment that only needs the operator library (``qtorch_onnx.get_library_path()``) never loads torch;
``from qtorch_onnx import X`` and ``qtorch_onnx.X`` work for every name in ``__all__``.
"""
from __future__ import annotations

import importlib
import sys
import types

from .errors import (
    ConfigError,
    DataError,
    ExportError,
    ModelError,
    QTorchOnnxError,
    UnknownNameError,
    UnsupportedFeatureError,
    UnsupportedOpsError,
)

__version__ = "0.1.0"

#: public name -> submodule of this package that defines it (imported on first access)
_LAZY = {
    **dict.fromkeys(("CalibrationMethod", "Config", "ExtendedQuantFormat", "ExtendedQuantType", "PowerOfTwoMethod",
                     "QuantFormat", "QuantizationConfig", "QuantType", "VitisQuantFormat", "VitisQuantType",
                     "get_default_config"), "config"),
    "FakeQuantize": "fakequant",
    "lift": "lift",
    "evaluate": "metrics",
    "prepare": "quantizer",
    "QuantizedModel": "model",
    "calibrate": "calibration",
    "ModelQuantizer": "model_quantizer",
    "get_library_path": "runtime",
    "float32_exact": "precision",
    "export": "export",
    "load_quantized": "interop.importer",
    **dict.fromkeys(("learn_scales", "save", "load", "enable_observer", "disable_observer", "enable_fake_quant",
                     "disable_fake_quant", "observers_disabled", "fake_quant_disabled", "QuantLayer"), "training"),
    **dict.fromkeys(("fast_finetune", "adaround", "adaquant", "sensitivity", "auto_mixed_precision",
                     "MixedPrecisionPlan", "bias_correction"), "algorithms"),
}

#: submodules reachable as attributes (``qtorch_onnx.formats``...), imported on first access; ``lift`` and
#: ``export`` are also the names of public functions, which win (``qtorch_onnx.lift`` is the function)
_SUBMODULES = ("algorithms", "cache", "calibration", "cli", "config", "data", "distributed", "errors", "fakequant",
               "formats", "interop", "metrics", "model", "model_quantizer", "observers", "ops", "placement", "precision",
               "quantizer", "runtime", "training", "zoo", "triton_kernels")

__all__ = [
    "CalibrationMethod", "Config", "ExtendedQuantFormat", "ExtendedQuantType", "PowerOfTwoMethod", "QuantFormat",
    "QuantizationConfig", "QuantType", "VitisQuantFormat", "VitisQuantType", "get_default_config",
    "ConfigError", "DataError", "ExportError", "ModelError", "QTorchOnnxError", "UnknownNameError",
    "UnsupportedFeatureError",
    "UnsupportedOpsError", "FakeQuantize", "lift", "evaluate", "ModelQuantizer", "QuantizedModel", "calibrate",
    "prepare", "get_library_path", "export", "load_quantized",
    "learn_scales", "save", "load", "enable_observer", "disable_observer", "enable_fake_quant", "disable_fake_quant",
    "observers_disabled", "fake_quant_disabled", "QuantLayer", "fast_finetune", "adaround", "adaquant",
    "sensitivity", "auto_mixed_precision", "MixedPrecisionPlan", "bias_correction", "float32_exact",
    "__version__",
]


def _import_submodule(short: str, wanted: str) -> types.ModuleType:
    full = f"{__name__}.{short}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full:  # a dependency of the submodule is missing: that error is the useful one
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {wanted!r}: it lives in {full}, "
                             f"which this installation lacks") from exc


def __getattr__(name: str):
    """PEP 562 hook: import the submodule that defines public ``name`` and cache the value.

    Raises:
        AttributeError: ``name`` is not public API nor a submodule, its submodule is not installed, or
            the submodule does not define it (the message names the name and the submodule).
    """
    short = _LAZY.get(name)
    if short is not None:
        module = _import_submodule(short, name)
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}: "
                                 f"{module.__name__} does not define it") from None
        globals()[name] = value  # later lookups bypass this hook
        return value
    if name in _SUBMODULES:
        return _import_submodule(name, name)  # the import binds it on this package
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


class _Package(types.ModuleType):
    """This package's module type: importing the submodule ``qtorch_onnx.lift`` or ``qtorch_onnx.export``
    must not rebind the public *function* of the same name on the package (as the eager imports this
    lazy table replaces did, the function wins; the submodules stay importable by their dotted names)."""

    def __setattr__(self, name: str, value) -> None:
        if name in ("lift", "export") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
