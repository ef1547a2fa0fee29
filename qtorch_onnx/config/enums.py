"""Enumerations of the Quark-compatible configuration vocabulary (docs/configuration.md "Data types").

The member names are those of AMD Quark for ONNX and ONNX Runtime, so a script written for Quark runs after
changing its import lines. Members of ONNX Runtime's own enums (``onnxruntime.quantization.QuantType``,
``QuantFormat``, ``CalibrationMethod``) and of Quark's enums are accepted too: they are recognised by
their class name and mapped by member name (:func:`enum_member_name`), so this module never imports
onnxruntime.
"""
from __future__ import annotations

import enum
from typing import Any, Optional


class QuantType(enum.Enum):
    """ONNX Runtime's integer quantization types (the subset this project supports)."""

    QInt4 = "QInt4"
    QUInt4 = "QUInt4"
    QInt8 = "QInt8"
    QUInt8 = "QUInt8"
    QInt16 = "QInt16"
    QUInt16 = "QUInt16"

    def __str__(self) -> str:
        return self.name


class ExtendedQuantType(enum.Enum):
    """Quark's extended quantization types (docs/configuration.md "Data types").

    ``QBFP`` takes its parameters from ``extra_options["BFPAttributes"]``, ``QMX`` from
    ``extra_options["MXAttributes"]``. ``QBloat16`` is an alias of ``QBFloat16``: the seed documentation
    (mixed precision tutorial) spells it that way in four examples, and those examples must run.
    """

    QInt4 = "QInt4"
    QUInt4 = "QUInt4"
    QInt8 = "QInt8"
    QUInt8 = "QUInt8"
    QInt16 = "QInt16"
    QUInt16 = "QUInt16"
    QInt32 = "QInt32"
    QUInt32 = "QUInt32"
    QFloat16 = "QFloat16"
    QBFloat16 = "QBFloat16"
    QBFP = "QBFP"
    QMX = "QMX"
    QBloat16 = "QBFloat16"  # alias (same value): the seed documents' spelling

    def __str__(self) -> str:
        return self.name


class QuantFormat(enum.Enum):
    """ONNX Runtime's quantization formats. ``QDQ``: standard QuantizeLinear/DequantizeLinear pairs."""

    QOperator = "QOperator"
    QDQ = "QDQ"

    def __str__(self) -> str:
        return self.name


class ExtendedQuantFormat(enum.Enum):
    """Quark's extended format: ``QDQ`` exports Quark's extended (custom-domain) Q/DQ operators."""

    QDQ = "QDQ"
    QOperator = "QOperator"

    def __str__(self) -> str:
        return self.name


class CalibrationMethod(enum.Enum):
    """Float-scale calibration methods (ONNX Runtime's names)."""

    MinMax = "MinMax"
    Entropy = "Entropy"
    Percentile = "Percentile"
    Distribution = "Distribution"

    def __str__(self) -> str:
        return self.name


class PowerOfTwoMethod(enum.Enum):
    """Power-of-two-scale calibration methods (Quark's names; docs/numerics.md section 1, power-of-two scales)."""

    NonOverflow = "NonOverflow"
    MinMSE = "MinMSE"

    def __str__(self) -> str:
        return self.name


#: Legacy aliases (Vitis AI names kept by Quark).
VitisQuantType = ExtendedQuantType
VitisQuantFormat = ExtendedQuantFormat

#: Foreign enum class names accepted, by the role they play. Our own classes are listed as well so that
#: equally named classes from onnxruntime / quark are recognised by :func:`enum_member_name`.
TYPE_ENUM_CLASSES = frozenset({"QuantType", "ExtendedQuantType", "VitisQuantType"})
FORMAT_ENUM_CLASSES = frozenset({"QuantFormat", "ExtendedQuantFormat", "VitisQuantFormat"})
CALIB_ENUM_CLASSES = frozenset({"CalibrationMethod", "PowerOfTwoMethod", "ExtendedCalibrationMethod"})


def enum_member_name(value: Any, class_names: frozenset) -> Optional[tuple[str, str]]:
    """Return ``(class name, member name)`` when ``value`` is an enum member of one of ``class_names``.

    Works for this module's enums and for onnxruntime's / Quark's enums of the same class names without
    importing them (ONNX Runtime's ``QuantType.QInt8`` gives ``("QuantType", "QInt8")``). Aliases resolve
    to their canonical member (``ExtendedQuantType.QBloat16`` gives ``"QBFloat16"``).

    Returns:
        the pair, or None when ``value`` is not such an enum member.
    """
    if isinstance(value, enum.Enum) and type(value).__name__ in class_names:
        return type(value).__name__, value.name
    return None
