"""Quark-compatible configuration objects: :class:`QuantizationConfig` and :class:`Config` (docs/configuration.md).

They accept exactly the vocabulary of AMD Quark for ONNX (same field names, same defaults) with two rules
Quark does not keep (docs/configuration.md): every key and value is validated when the object is built (an unknown key
is a :class:`~qtorch_onnx.errors.ConfigError` naming the closest valid one), and an object handed in is
never mutated (the constructor deep-copies its arguments; :func:`~qtorch_onnx.config.resolve.resolve_config`
reads, never writes).

Both classes are plain mutable records like Quark's dataclasses: assigning a known field later is allowed
(it is validated again by ``resolve_config``); assigning an unknown one is a ConfigError.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

from ..errors import ConfigError, UnsupportedFeatureError, closest
from .enums import CalibrationMethod, QuantFormat, QuantType

#: Field name -> factory of Quark's default (a factory so every instance gets fresh lists/dicts).
#: Defaults as Quark for ONNX >= 0.8 (``quark.onnx.quantization.config.config.QuantizationConfig``).
_FIELD_DEFAULTS: dict[str, Any] = {
    "calibrate_method": lambda: CalibrationMethod.MinMax,
    "quant_format": lambda: QuantFormat.QDQ,
    "activation_type": lambda: QuantType.QInt8,
    "weight_type": lambda: QuantType.QInt8,
    "input_nodes": list,
    "output_nodes": list,
    "op_types_to_quantize": list,
    "nodes_to_quantize": list,
    "nodes_to_exclude": list,
    "subgraphs_to_exclude": list,
    "specific_tensor_precision": lambda: False,
    "execution_providers": lambda: ["CPUExecutionProvider"],
    "per_channel": lambda: False,
    "reduce_range": lambda: False,
    "optimize_model": lambda: True,
    "use_external_data_format": lambda: False,
    "include_cle": lambda: False,
    "include_auto_mp": lambda: False,
    "include_fast_ft": lambda: False,
    "extra_options": dict,
}

#: Quark ``QuantizationConfig`` fields this project does not offer: naming one is an
#: UnsupportedFeatureError (a valid Quark request), not a typo.
QUARK_FIELDS_NOT_SUPPORTED = frozenset({
    "use_dynamic_quant", "enable_npu_cnn", "enable_npu_transformer", "enable_dpu", "convert_fp16_to_fp32",
    "convert_nchw_to_nhwc", "include_sq", "include_rotation", "include_gptq", "log_severity_level",
    "extra_op_types_to_quantize", "random_data_reader_input_shape", "debug_mode", "crypto_mode",
    "print_summary", "ignore_warnings", "use_matmul_nbits",
})


def _check_keywords(cls_name: str, given: dict, valid: list[str], unsupported=frozenset()) -> None:
    for key in given:
        if key in valid:
            continue
        if key in unsupported:
            raise UnsupportedFeatureError(
                f"{cls_name}: {key!r} is a Quark option this version does not support; supported fields: "
                f"{', '.join(valid)}")
        raise ConfigError(f"{cls_name}: unknown keyword {key!r}{closest(key, valid)}; valid: {', '.join(valid)}")


class QuantizationConfig:
    """Quark's ``QuantizationConfig``: the global quantization settings (docs/configuration.md "QuantizationConfig fields").

    Keyword arguments only; each defaults to Quark's default:

    - ``calibrate_method`` = ``CalibrationMethod.MinMax`` (also Entropy, Percentile, Distribution, or
      ``PowerOfTwoMethod.NonOverflow | MinMSE`` for power-of-two scales; onnxruntime's enum accepted).
    - ``quant_format`` = ``QuantFormat.QDQ`` (standard Q/DQ) or ``ExtendedQuantFormat.QDQ`` (Quark's).
    - ``activation_type`` / ``weight_type`` = ``QuantType.QInt8`` (any ``QuantType`` or
      ``ExtendedQuantType`` member, onnxruntime's ``QuantType`` accepted).
    - ``input_nodes``, ``output_nodes``, ``op_types_to_quantize``, ``nodes_to_quantize``,
      ``nodes_to_exclude``: lists of ONNX node names / op types, default ``[]``.
    - ``subgraphs_to_exclude``: list of ``([start node names], [end node names])`` pairs, default ``[]``.
    - ``specific_tensor_precision`` = False (enables ``extra_options["MixedPrecisionTensor"]``).
    - ``execution_providers`` = ``["CPUExecutionProvider"]``.
    - ``per_channel`` = False, ``reduce_range`` = False, ``optimize_model`` = True,
      ``use_external_data_format`` = False, ``include_cle`` = False, ``include_auto_mp`` = False,
      ``include_fast_ft`` = False.
    - ``extra_options`` = ``{}`` (keys listed in docs/configuration.md "extra_options"; see ``resolve.py``).

    The arguments are deep-copied (the caller's lists and dicts are never referenced or changed), then
    validated completely: the same checks :func:`resolve_config` runs, except feature availability (a
    configuration asking for a feature not implemented yet constructs fine and fails in ``resolve_config``
    with :class:`UnsupportedFeatureError`).

    Raises:
        ConfigError: positional arguments; an unknown keyword (names it and the closest valid one); a
            value of the wrong type or out of range; an unknown or misspelled ``extra_options`` key at any
            nesting level.
        UnsupportedFeatureError: a Quark field or option this project does not offer (e.g.
            ``enable_npu_cnn``).
    """

    FIELDS: tuple = tuple(_FIELD_DEFAULTS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError(
                "QuantizationConfig takes keyword arguments only (e.g. QuantizationConfig(activation_type="
                "QuantType.QInt8)); got positional arguments")
        _check_keywords("QuantizationConfig", kwargs, list(self.FIELDS), QUARK_FIELDS_NOT_SUPPORTED)
        for name, factory in _FIELD_DEFAULTS.items():
            value = copy.deepcopy(kwargs[name]) if name in kwargs else factory()
            object.__setattr__(self, name, value)
        from .resolve import validate_quantization_config

        validate_quantization_config(self)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELD_DEFAULTS:
            if name in QUARK_FIELDS_NOT_SUPPORTED:
                raise UnsupportedFeatureError(f"QuantizationConfig: {name!r} is a Quark option this version "
                                              "does not support")
            raise ConfigError(f"QuantizationConfig has no field {name!r}{closest(name, self.FIELDS)}; "
                              f"valid: {', '.join(self.FIELDS)}")
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of every field as ``{field name: value}`` (for printing, comparison, rebuilding)."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self.FIELDS}

    def copy(self) -> "QuantizationConfig":
        """An independent deep copy (``copy.deepcopy`` works as well)."""
        return copy.deepcopy(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuantizationConfig):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.FIELDS)

    __hash__ = None  # mutable, like Quark's dataclass

    def __repr__(self) -> str:
        changed = []
        for name, factory in _FIELD_DEFAULTS.items():
            value = getattr(self, name)
            if value != factory():
                changed.append(f"{name}={value!r}")
        return f"QuantizationConfig({', '.join(changed)})"


QuantizationConfig.__signature__ = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=f()) for n, f in _FIELD_DEFAULTS.items()])


class Config:
    """Quark's top-level ``Config(global_quant_config=QuantizationConfig(...))``.

    Args:
        global_quant_config: the :class:`QuantizationConfig` applied to the whole model (required,
            keyword only). It is deep-copied: later changes to the caller's object do not leak in.

    Raises:
        ConfigError: positional arguments, an unknown keyword (with the closest valid one), a missing
            ``global_quant_config`` or one that is not a :class:`QuantizationConfig`.
    """

    FIELDS: tuple = ("global_quant_config",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError("Config takes keyword arguments only: Config(global_quant_config=...)")
        _check_keywords("Config", kwargs, list(self.FIELDS))
        if "global_quant_config" not in kwargs:
            raise ConfigError("Config: 'global_quant_config' is required (a QuantizationConfig, e.g. "
                              "get_default_config('A8W8'))")
        gqc = kwargs["global_quant_config"]
        if not isinstance(gqc, QuantizationConfig):
            raise ConfigError(f"Config: 'global_quant_config' must be a QuantizationConfig, got "
                              f"{type(gqc).__name__}")
        object.__setattr__(self, "global_quant_config", copy.deepcopy(gqc))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.FIELDS:
            raise ConfigError(f"Config has no field {name!r}{closest(name, self.FIELDS)}; valid: "
                              f"{', '.join(self.FIELDS)}")
        if not isinstance(value, QuantizationConfig):
            raise ConfigError(f"Config: 'global_quant_config' must be a QuantizationConfig, got "
                              f"{type(value).__name__}")
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return self.global_quant_config == other.global_quant_config

    __hash__ = None

    def __repr__(self) -> str:
        return f"Config(global_quant_config={self.global_quant_config!r})"


Config.__signature__ = inspect.Signature(
    [inspect.Parameter("global_quant_config", inspect.Parameter.KEYWORD_ONLY)])
