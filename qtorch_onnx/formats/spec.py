"""Frozen descriptions of numeric formats, and the registry of named formats.

A ``Format`` says *what* numbers a quantizer produces; *where* it sits (tensor, axis) and its state
(scale, zero point) live in :class:`qtorch_onnx.fakequant.FakeQuantize`. This module imports torch only
(rule of the house for ``formats/``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Tuple, Union

import torch


@dataclass(frozen=True)
class FormatFamily:
    """What a family of formats is, declared once (issue 15 item 1; in the spirit of microxcaling's formats
    table). Every layer asks the family of ``fmt.family`` instead of testing the format's class: quantizers
    (how it quantizes and what it calibrates), placement (per-channel scales, INT32 bias, block axes), export
    (which ONNX nodes it becomes) and the algorithms (AdaRound, the bits a tensor costs).

    Attributes:
        name: ``"integer"``, ``"float"``, ``"bfp"`` or ``"mx"``; the key of every per-family table
            (:data:`FAMILIES` lists them; each table checks it covers all of them).
        integer_grid: values are ``(q - zero_point) * scale`` with integer ``q``: the format has zero points,
            per-tensor or per-channel scales (float or power-of-two), TensorQuantOverrides, INT32 biases
            derived from input and weight scales, weight rounding hooks (AdaRound) and learnable scales (LSQ).
        scale: where the scale comes from: ``"calibrated"`` (always from a calibrated range or the weight's
            values), ``"optional"`` (1.0 unless WeightScaled / ActivationScaled ask for a calibrated one) or
            ``"derived"`` (shared exponents computed from the data on every call: nothing to calibrate).
        block: a shared exponent per block of ``block_size`` elements along a block axis.
        attributes_key: the configuration key that carries the format's parameters (``"BFPAttributes"``,
            ``"MXAttributes"``), or None.
        onnx_ops: the ONNX nodes export writes for it (docs/operators.md), for documentation and reports.
        numerics: the docs/numerics.md sections that define it bit for bit.
    """

    name: str
    integer_grid: bool
    scale: str
    block: bool
    attributes_key: Optional[str]
    onnx_ops: Tuple[str, ...]
    numerics: str

    def needs_calibration(self, scaled: bool = False) -> bool:
        """True when a quantizer of this family needs a range (calibration data, or a weight's own values):
        always for ``scale="calibrated"``, only when ``scaled`` for ``scale="optional"``, never for block formats."""
        return self.scale == "calibrated" or (self.scale == "optional" and bool(scaled))


INTEGER_FAMILY = FormatFamily(
    "integer", integer_grid=True, scale="calibrated", block=False, attributes_key=None,
    onnx_ops=("QuantizeLinear", "DequantizeLinear", "ExtendedQuantizeLinear", "ExtendedDequantizeLinear"),
    numerics="docs/numerics.md section 1")
FLOAT_FAMILY = FormatFamily(
    "float", integer_grid=False, scale="optional", block=False, attributes_key=None,
    onnx_ops=("ExtendedQuantizeLinear", "ExtendedDequantizeLinear", "Cast", "Mul"),
    numerics="docs/numerics.md section 3")
BFP_FAMILY = FormatFamily(
    "bfp", integer_grid=False, scale="derived", block=True, attributes_key="BFPAttributes",
    onnx_ops=("BFPQuantizeDequantize",), numerics="docs/numerics.md sections 4-6")
MX_FAMILY = FormatFamily(
    "mx", integer_grid=False, scale="derived", block=True, attributes_key="MXAttributes",
    onnx_ops=("MXQuantizeDequantize",), numerics="docs/numerics.md sections 4 and 7")

#: Every family, in the order the docs list them. A per-family table elsewhere is checked against it with
#: :func:`check_family_table`, so a new family cannot be forgotten silently.
FAMILIES: Tuple[FormatFamily, ...] = (INTEGER_FAMILY, FLOAT_FAMILY, BFP_FAMILY, MX_FAMILY)


def check_family_table(table: Dict[str, object], what: str) -> Dict[str, object]:
    """Return ``table`` (keyed by family name) after checking it has exactly one entry per family.

    Raises:
        RuntimeError: a family is missing or an unknown name is present (a programming error, raised at import).
    """
    want = {f.name for f in FAMILIES}
    if set(table) != want:
        raise RuntimeError(f"{what}: per-family table has {sorted(table)}, expected {sorted(want)}")
    return table


#: ``onnx.TensorProto`` element-type codes of the integer formats (numbers, so formats/ needs no onnx import;
#: tests/formats check them against ``onnx.TensorProto``)
_ONNX_INT_CODES: Dict[Tuple[int, bool], int] = {
    (4, True): 22, (4, False): 21, (8, True): 3, (8, False): 2, (16, True): 5, (16, False): 4,
    (32, True): 6, (32, False): 12,
}


@dataclass(frozen=True)
class IntFormat:
    """Integer Q/DQ format (docs/numerics.md section 1).

    Attributes:
        bits: 4, 8, 16 or 32.
        signed: True for INT*, False for UINT*.
    """

    family: ClassVar[FormatFamily] = INTEGER_FAMILY

    bits: int
    signed: bool

    @property
    def bits_per_element(self) -> float:
        """Storage cost in bits per tensor element (scales and zero points not counted)."""
        return float(self.bits)

    @property
    def name(self) -> str:
        return f"{'' if self.signed else 'U'}INT{self.bits}"

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def torch_dtype(self) -> torch.dtype:
        """Storage dtype of the quantized integers (uint16/uint32 are held in the next wider signed type)."""
        return {
            (4, True): torch.int8, (4, False): torch.uint8,
            (8, True): torch.int8, (8, False): torch.uint8, (16, True): torch.int16, (16, False): torch.int32,
            (32, True): torch.int32, (32, False): torch.int64,
        }[(self.bits, self.signed)]

    @property
    def onnx_type(self) -> int:
        """The ONNX element type (``onnx.TensorProto`` code) of the quantized integers."""
        return _ONNX_INT_CODES[(self.bits, self.signed)]

    @property
    def numpy_dtype(self):
        """numpy dtype of the ONNX storage type (``ml_dtypes.int4`` / ``uint4`` for 4-bit types)."""
        import numpy as np

        if self.bits == 4:
            import ml_dtypes

            return np.dtype(ml_dtypes.int4 if self.signed else ml_dtypes.uint4)
        return np.dtype(f"{'' if self.signed else 'u'}int{self.bits}")


@dataclass(frozen=True)
class FloatFormat:
    """Low-precision float formats emulated in float32 (docs/numerics.md section 3): ``"BF16"`` or ``"FP16"``."""

    family: ClassVar[FormatFamily] = FLOAT_FAMILY

    kind: str  # "BF16" | "FP16"

    @property
    def name(self) -> str:
        return self.kind

    @property
    def bits_per_element(self) -> float:
        """Storage cost in bits per tensor element: 16."""
        return 16.0

    @property
    def mantissa_bits(self) -> int:
        """Explicit mantissa bits: 7 (BF16) or 10 (FP16)."""
        return 7 if self.kind == "BF16" else 10


@dataclass(frozen=True)
class BFPFormat:
    """Block floating point (docs/numerics.md sections 4-6), attributes as the BFPQuantizeDequantize operator."""

    family: ClassVar[FormatFamily] = BFP_FAMILY

    bfp_method: str = "to_bfp"
    bit_width: int = 16
    block_size: int = 8
    rounding_mode: int = 2
    sub_block_size: int = 2
    sub_block_shift_bits: int = 1
    convert_to_bfloat_before_bfp: int = 0

    @property
    def name(self) -> str:
        if self.bfp_method == "to_bfp_prime":
            known = {11: "MX4", 13: "MX6", 16: "MX9"}
            if (self.block_size, self.sub_block_size, self.sub_block_shift_bits) == (16, 2, 1) and self.bit_width in known:
                return known[self.bit_width]
            return f"BFPPRIME{self.bit_width}"
        return f"BFP{self.bit_width}"

    @property
    def bits_per_element(self) -> float:
        """Storage cost in bits per element as the mixed-precision reports count it: ``bit_width / 2`` for
        ``to_bfp`` (BFP16: 8, sign and mantissa; its 8-bit exponent shared by 8 elements is not counted), and
        the name's figure for ``to_bfp_prime`` (MX4 4, MX6 6, MX9 9; docs/numerics.md section 6)."""
        if self.bfp_method == "to_bfp":
            return self.bit_width / 2.0
        return {11: 4.0, 13: 6.0, 16: 9.0}.get(self.bit_width, 9.0)


@dataclass(frozen=True)
class MXFormat:
    """OCP microscaling (docs/numerics.md section 7), attributes as the MXQuantizeDequantize operator."""

    family: ClassVar[FormatFamily] = MX_FAMILY

    element_dtype: str = "int8"
    block_size: int = 32
    rounding_mode: int = 2

    @property
    def name(self) -> str:
        return {
            "int8": "MXINT8", "fp8_e4m3": "MXFP8_E4M3", "fp8_e5m2": "MXFP8_E5M2", "fp6_e3m2": "MXFP6_E3M2",
            "fp6_e2m3": "MXFP6_E2M3", "fp4_e2m1": "MXFP4",
        }.get(self.element_dtype, f"MX_{self.element_dtype}")

    @property
    def bits_per_element(self) -> float:
        """Storage cost in bits per element: the element width plus the 8-bit E8M0 scale shared by 32
        elements (8.25 for MXINT8 / MXFP8, 6.25 for MXFP6, 4.25 for MXFP4; docs/numerics.md section 7)."""
        return {"int8": 8.25, "fp8_e4m3": 8.25, "fp8_e5m2": 8.25, "fp6_e3m2": 6.25, "fp6_e2m3": 6.25,
                "fp4_e2m1": 4.25}.get(self.element_dtype, 8.25)


Format = Union[IntFormat, FloatFormat, BFPFormat, MXFormat]

#: ONNX element type (``onnx.TensorProto`` code) -> integer format: the one table of integer types that the
#: exporter, the importer of quantized models and the Quark operators read.
INT_FORMAT_BY_ONNX_TYPE: Dict[int, IntFormat] = {
    code: IntFormat(bits, signed) for (bits, signed), code in _ONNX_INT_CODES.items()}

#: The format classes by name (serialized plans and checkpoints store the class name).
FORMAT_CLASSES: Dict[str, type] = {c.__name__: c for c in (IntFormat, FloatFormat, BFPFormat, MXFormat)}


def is_format(value: object) -> bool:
    """True for a format object of any family."""
    return isinstance(value, tuple(FORMAT_CLASSES.values()))

INT4 = IntFormat(4, True)
UINT4 = IntFormat(4, False)
INT8 = IntFormat(8, True)
UINT8 = IntFormat(8, False)
INT16 = IntFormat(16, True)
UINT16 = IntFormat(16, False)
INT32 = IntFormat(32, True)
UINT32 = IntFormat(32, False)
BF16 = FloatFormat("BF16")
FP16 = FloatFormat("FP16")
BFP16 = BFPFormat()
MX4 = BFPFormat("to_bfp_prime", 11, 16, 2, 2, 1)
MX6 = BFPFormat("to_bfp_prime", 13, 16, 2, 2, 1)
MX9 = BFPFormat("to_bfp_prime", 16, 16, 2, 2, 1)
MXINT8 = MXFormat("int8")
MXFP8_E4M3 = MXFormat("fp8_e4m3")
MXFP8_E5M2 = MXFormat("fp8_e5m2")
MXFP6_E3M2 = MXFormat("fp6_e3m2")
MXFP6_E2M3 = MXFormat("fp6_e2m3")
MXFP4 = MXFormat("fp4_e2m1")

#: Named formats a user can refer to (docs/configuration.md "Data types").
REGISTRY: dict[str, Format] = {
    f.name: f
    for f in (INT4, UINT4, INT8, UINT8, INT16, UINT16, INT32, UINT32, BF16, FP16, BFP16, MX4, MX6, MX9, MXINT8, MXFP8_E4M3,
              MXFP8_E5M2, MXFP6_E3M2, MXFP6_E2M3, MXFP4)
}
REGISTRY["MXFP4_E2M1"] = MXFP4


def get_format(name: str) -> Format:
    """Look a format up by name (``"INT8"``, ``"BF16"``, ``"MX9"``, ...); case-insensitive.

    Raises:
        KeyError: unknown name; the message lists the valid names.
    """
    key = name.upper().replace("-", "_")
    if key not in REGISTRY:
        raise KeyError(f"unknown format {name!r}; valid: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[key]
