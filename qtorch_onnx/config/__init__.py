"""The Quark-compatible configuration vocabulary (docs/configuration.md), validated and never mutated.

``QuantizationConfig`` / ``Config`` / ``get_default_config`` accept AMD Quark for ONNX's names;
``resolve_config`` turns them into the one typed :class:`ResolvedConfig` the library works from.
"""
from .defaults import DEFAULT_CONFIG_NAMES, get_default_config
from .enums import (CalibrationMethod, ExtendedQuantFormat, ExtendedQuantType, PowerOfTwoMethod, QuantFormat,
                    QuantType, VitisQuantFormat, VitisQuantType)
from .internal import AutoMixprecisionSettings, FastFinetuneSettings, ResolvedConfig
from .quark import Config, QuantizationConfig
from .resolve import IMPLEMENTED, block_axes, required_features, resolve_config

__all__ = [
    "AutoMixprecisionSettings", "CalibrationMethod", "Config", "DEFAULT_CONFIG_NAMES", "ExtendedQuantFormat",
    "ExtendedQuantType", "FastFinetuneSettings", "IMPLEMENTED", "PowerOfTwoMethod", "QuantFormat", "QuantType",
    "QuantizationConfig", "ResolvedConfig", "VitisQuantFormat", "VitisQuantType", "block_axes",
    "get_default_config", "required_features", "resolve_config",
]
