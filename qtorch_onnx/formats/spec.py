"""Frozen descriptions of numeric formats, and the registry of named formats.

A ``Format`` says *what* numbers a quantizer produces; *where* it sits (tensor, axis) and its state
(scale, zero point) live in :class:`qtorch_onnx.fakequant.FakeQuantize`. This module imports torch only
(rule of the house for ``formats/``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch


@dataclass(frozen=True)
class IntFormat:
    """Integer Q/DQ format (docs/numerics.md section 1).

    Attributes:
        bits: 4, 8, 16 or 32.
        signed: True for INT*, False for UINT*.
    """

    bits: int
    signed: bool

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

    kind: str  # "BF16" | "FP16"

    @property
    def name(self) -> str:
        return self.kind


@dataclass(frozen=True)
class BFPFormat:
    """Block floating point (docs/numerics.md sections 4-6), attributes as the BFPQuantizeDequantize operator."""

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


@dataclass(frozen=True)
class MXFormat:
    """OCP microscaling (docs/numerics.md section 7), attributes as the MXQuantizeDequantize operator."""

    element_dtype: str = "int8"
    block_size: int = 32
    rounding_mode: int = 2

    @property
    def name(self) -> str:
        return {
            "int8": "MXINT8", "fp8_e4m3": "MXFP8_E4M3", "fp8_e5m2": "MXFP8_E5M2", "fp6_e3m2": "MXFP6_E3M2",
            "fp6_e2m3": "MXFP6_E2M3", "fp4_e2m1": "MXFP4",
        }.get(self.element_dtype, f"MX_{self.element_dtype}")


Format = Union[IntFormat, FloatFormat, BFPFormat, MXFormat]

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
