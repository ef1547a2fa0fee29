"""Numeric formats: frozen descriptions (``spec``) and the torch reference functions of each family.

``integer`` (docs/numerics.md section 1) and ``floating`` (section 3) are imported as submodules; block formats
(``bfp``, ``mx``) add one import line each below.
"""
from .spec import (  # noqa: F401
    BF16, BFP16, FP16, INT8, INT16, INT32, MX4, MX6, MX9, MXFP4, MXFP6_E2M3, MXFP6_E3M2, MXFP8_E4M3, MXFP8_E5M2,
    MXINT8, REGISTRY, UINT8, UINT16, UINT32, BFPFormat, FloatFormat, Format, IntFormat, MXFormat, get_format,
    BFP_FAMILY, FAMILIES, FLOAT_FAMILY, FORMAT_CLASSES, INTEGER_FAMILY, MX_FAMILY, FormatFamily, check_family_table,
    is_format, INT_FORMAT_BY_ONNX_TYPE,
)
from . import integer  # noqa: F401
from . import floating  # noqa: F401
from . import block  # noqa: F401
from . import bfp  # noqa: F401
from . import mx  # noqa: F401
