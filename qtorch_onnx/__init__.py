"""qtorch-onnx: PyTorch-native fake quantization of ONNX models.

Public API (and nothing else): the Quark-compatible vocabulary (``ModelQuantizer``, ``Config``,
``QuantizationConfig``, ``get_default_config``, the type enums), the native torch API (``lift``, ``prepare``,
``calibrate``, ``export``), metrics (``evaluate``) and ONNX Runtime helpers (``get_library_path``).
"""
from .config import (
    CalibrationMethod,
    Config,
    ExtendedQuantFormat,
    ExtendedQuantType,
    PowerOfTwoMethod,
    QuantFormat,
    QuantizationConfig,
    QuantType,
    VitisQuantFormat,
    VitisQuantType,
    get_default_config,
)
from .errors import (
    ConfigError,
    DataError,
    ExportError,
    ModelError,
    QTorchOnnxError,
    UnsupportedFeatureError,
    UnsupportedOpsError,
)
from .fakequant import FakeQuantize
from .lift import lift
from .metrics import evaluate
from .quantizer import ModelQuantizer, QuantizedModel, calibrate, prepare
from .runtime import get_library_path
from .export import export
from .importer import load_quantized

__version__ = "0.1.0"

__all__ = [
    "CalibrationMethod", "Config", "ExtendedQuantFormat", "ExtendedQuantType", "PowerOfTwoMethod", "QuantFormat",
    "QuantizationConfig", "QuantType", "VitisQuantFormat", "VitisQuantType", "get_default_config",
    "ConfigError", "DataError", "ExportError", "ModelError", "QTorchOnnxError", "UnsupportedFeatureError",
    "UnsupportedOpsError", "FakeQuantize", "lift", "evaluate", "ModelQuantizer", "QuantizedModel", "calibrate",
    "prepare", "get_library_path", "export", "load_quantized", "__version__",
]
