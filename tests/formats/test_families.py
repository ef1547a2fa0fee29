"""The format-family table (qtorch_onnx.formats.spec.FAMILIES): every format has one family, the per-family
tables of the other layers cover every family, and the ONNX integer type codes are onnx's."""
from __future__ import annotations

import onnx
import pytest

from qtorch_onnx.formats import spec as F


def test_every_registered_format_belongs_to_a_declared_family():
    families = {f.name: f for f in F.FAMILIES}
    assert len(families) == len(F.FAMILIES)
    for name, fmt in F.REGISTRY.items():
        assert fmt.family is families[fmt.family.name], name
        assert F.is_format(fmt)
    assert {type(f).__name__ for f in F.REGISTRY.values()} == set(F.FORMAT_CLASSES)


@pytest.mark.parametrize("fmt, integer_grid, block, calibrated, scaled_calibrated", [
    (F.INT8, True, False, True, True), (F.UINT16, True, False, True, True),
    (F.BF16, False, False, False, True), (F.FP16, False, False, False, True),
    (F.BFP16, False, True, False, False), (F.MX9, False, True, False, False),
    (F.MXINT8, False, True, False, False), (F.MXFP4, False, True, False, False),
])
def test_family_traits(fmt, integer_grid, block, calibrated, scaled_calibrated):
    fam = fmt.family
    assert fam.integer_grid is integer_grid
    assert fam.block is block
    assert fam.needs_calibration(False) is calibrated
    assert fam.needs_calibration(True) is scaled_calibrated
    assert (fam.attributes_key is not None) is block


def test_onnx_integer_codes_are_onnx_tensorproto_codes():
    names = {(4, True): "INT4", (4, False): "UINT4", (8, True): "INT8", (8, False): "UINT8",
             (16, True): "INT16", (16, False): "UINT16", (32, True): "INT32", (32, False): "UINT32"}
    for (bits, signed), name in names.items():
        fmt = F.IntFormat(bits, signed)
        assert fmt.onnx_type == getattr(onnx.TensorProto, name)
        assert F.INT_FORMAT_BY_ONNX_TYPE[fmt.onnx_type] == fmt
        assert onnx.helper.tensor_dtype_to_np_dtype(fmt.onnx_type).itemsize == fmt.numpy_dtype.itemsize


def test_per_family_tables_cover_every_family():
    import importlib

    from qtorch_onnx import fakequant

    export = importlib.import_module("qtorch_onnx.export")  # the package attribute is the export() function

    want = {f.name for f in F.FAMILIES}
    for table in (fakequant._QUANTIZE_DEQUANTIZE, export._ACTIVATION_WRITERS, export._WEIGHT_WRITERS):
        assert set(table) == want
    with pytest.raises(RuntimeError, match="expected"):
        F.check_family_table({"integer": None}, "a table")


def test_bits_per_element():
    assert [F.get_format(n).bits_per_element for n in ("INT8", "INT4", "BF16", "BFP16", "MX4", "MX6", "MX9",
                                                          "MXINT8", "MXFP6_E2M3", "MXFP4")] == \
        [8.0, 4.0, 16.0, 8.0, 4.0, 6.0, 9.0, 8.25, 6.25, 4.25]
