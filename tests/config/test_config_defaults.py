"""get_default_config: every name of docs/configuration.md's table, its settings, fresh copies, gating, unknown names."""
import pytest

from qtorch_onnx.config import (DEFAULT_CONFIG_NAMES, Config, ExtendedQuantType, QuantizationConfig, QuantType,
                                get_default_config, required_features, resolve_config)
from qtorch_onnx.config import defaults as D
from qtorch_onnx.config import resolve
from qtorch_onnx.errors import ConfigError, UnsupportedFeatureError
from qtorch_onnx.formats import spec as F

TABLE_NAMES = [
    "A8W8", "A16W8", "A8W8_ADAROUND", "A8W8_ADAQUANT", "A16W8_ADAROUND", "A16W8_ADAQUANT", "S8S8_AAWS", "U8S8_AAWS",
    "S16S8_ASWS", "U16S8_AAWS", "XINT8", "INT8_CNN_DEFAULT", "INT16_CNN_DEFAULT", "INT8_TRANSFORMER_DEFAULT", "FP16",
    "BF16", "BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP8E4M3", "MXFP8E5M2", "MXFP6E3M2", "MXFP6E2M3", "MXFP4E2M1",
    "BF16_BFP16", "BF16_MXINT8", "MX9_INT8", "BF16_MIXED_BFP16", "BF16_MIXED_MXINT8", "S16S16_MIXED_S8S8",
    "BF16_ADAQUANT", "FP16_ADAQUANT", "BFP16_ADAQUANT", "MX9_ADAQUANT", "MXINT8_ADAQUANT",
]


def _resolved(name):
    """Resolve a named configuration without get_default_config's gate (tests use the all_implemented fixture)."""
    return resolve_config(QuantizationConfig(**D._BUILDERS[name]()))


def test_every_table_name_is_known():
    assert set(TABLE_NAMES) <= set(DEFAULT_CONFIG_NAMES)


@pytest.mark.parametrize("name", DEFAULT_CONFIG_NAMES)
def test_each_name_builds_or_names_its_missing_feature(name):
    qc = QuantizationConfig(**D._BUILDERS[name]())  # always a valid configuration
    needed = [f for f, _ in required_features(qc) if not resolve.IMPLEMENTED.get(f, False)]  # "cle" is built in
    if needed:
        with pytest.raises(UnsupportedFeatureError) as e:
            get_default_config(name)
        assert name in str(e.value) and "not implemented in this version" in str(e.value)
    else:
        got = get_default_config(name)
        assert isinstance(got, QuantizationConfig) and got == qc
        resolve_config(Config(global_quant_config=got))


@pytest.mark.parametrize("name", DEFAULT_CONFIG_NAMES)
def test_each_name_resolves_once_features_exist(all_implemented, name):
    r = resolve_config(get_default_config(name))
    assert r.activation is not None and r.weight is not None


def test_gating_messages():
    with pytest.raises(UnsupportedFeatureError, match=r"MX9 needs the block formats \(BFP/MX quantizers\)"):
        get_default_config("MX9")
    with pytest.raises(UnsupportedFeatureError, match="fast finetune"):
        get_default_config("A8W8_ADAROUND")
    with pytest.raises(UnsupportedFeatureError, match="layer-wise mixed precision"):
        get_default_config("BF16_MIXED_BFP16")
    with pytest.raises(UnsupportedFeatureError, match="automatic mixed precision"):
        get_default_config("S16S16_MIXED_S8S8")


def test_fresh_copy_each_call():
    a = get_default_config("A8W8")
    a.extra_options["FoldRelu"] = False
    a.nodes_to_exclude.append("x")
    a.per_channel = True
    b = get_default_config("A8W8")
    assert b.extra_options["FoldRelu"] is True and b.nodes_to_exclude == [] and b.per_channel is False
    assert a is not b and a.extra_options is not b.extra_options


def test_unknown_name_lists_near_names():
    with pytest.raises(ConfigError) as e:
        get_default_config("A8W9")
    assert "nearest: A8W8" in str(e.value)
    with pytest.raises(ConfigError, match="nearest:.*MXINT8"):
        get_default_config("mxint8")
    with pytest.raises(ConfigError):
        get_default_config(None)


def _ints(name):
    r = _resolved(name)
    return r.activation, r.placement.activation_symmetric, r.weight, r.placement.weight_symmetric, r.calibration.method


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize("name,expect", [
    ("A8W8", (F.INT8, True, F.INT8, True, "MinMax")),
    ("A16W8", (F.INT16, True, F.INT8, True, "MinMax")),
    ("S8S8_AAWS", (F.INT8, False, F.INT8, True, "Percentile")),
    ("U8S8_AAWS", (F.UINT8, False, F.INT8, True, "Percentile")),
    ("S16S8_ASWS", (F.INT16, True, F.INT8, True, "Percentile")),
    ("U16S8_AAWS", (F.UINT16, False, F.INT8, True, "Percentile")),
    ("XINT8", (F.UINT8, True, F.INT8, True, "MinMSE")),
    ("INT8_CNN_DEFAULT", (F.UINT8, False, F.INT8, True, "MinMax")),
    ("INT16_CNN_DEFAULT", (F.UINT16, False, F.INT16, True, "MinMax")),
    ("INT8_TRANSFORMER_DEFAULT", (F.UINT8, False, F.INT8, True, "MinMax")),
])
def test_integer_table(name, expect):
    assert _ints(name) == expect


@pytest.mark.usefixtures("all_implemented")
def test_integer_table_details():
    a8 = _resolved("A8W8")
    assert (a8.placement.int32_bias, a8.placement.fold_relu, a8.placement.align_concat, a8.placement.align_slice, a8.placement.align_eltwise_quant_type) == \
        (True, True, True, False, False)
    assert a8.graph.quant_format == "QDQ" and not a8.calibration.power_of_two
    a16 = _resolved("A16W8")
    assert a16.placement.align_eltwise_quant_type and a16.placement.fold_relu and a16.placement.align_concat and not a16.placement.align_slice
    assert a16.graph.quant_format == "ExtendedQDQ"
    assert _resolved("S8S8_AAWS").calibration.percentile == 99.9999
    assert _resolved("U8S8_AAWS").calibration.percentile == 99.999
    x = _resolved("XINT8")
    assert x.calibration.power_of_two and x.placement.align_concat and x.placement.align_slice
    assert _resolved("INT8_TRANSFORMER_DEFAULT").calibration.moving_average
    assert not _resolved("INT8_CNN_DEFAULT").calibration.moving_average


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize("name,algo,lr", [("A8W8_ADAROUND", "adaround", 0.1), ("A8W8_ADAQUANT", "adaquant", 1e-5),
                                          ("A16W8_ADAROUND", "adaround", 0.1), ("A16W8_ADAQUANT", "adaquant", 1e-5)])
def test_fast_finetune_variants(name, algo, lr):
    r = _resolved(name)
    base = _resolved(name.rsplit("_", 1)[0])
    ft = r.fast_finetune
    assert (ft.optim_algorithm, ft.learning_rate, ft.num_iterations, ft.early_stop) == (algo, lr, 1000, True)
    assert (r.activation, r.weight, r.placement.fold_relu, r.placement.align_concat) == (base.activation, base.weight, base.placement.fold_relu,
                                                                      base.placement.align_concat)


@pytest.mark.usefixtures("all_implemented")
def test_float_and_block_table():
    assert (_resolved("FP16").activation, _resolved("FP16").weight) == (F.FP16, F.FP16)
    bf = _resolved("BF16")
    assert (bf.activation, bf.weight, bf.placement.quantize_all_op_types) == (F.BF16, F.BF16, True)
    assert _resolved("BFP16").activation == F.BFPFormat("to_bfp", 16, 8, 2)
    for name, fmt in (("MX4", F.MX4), ("MX6", F.MX6), ("MX9", F.MX9)):
        r = _resolved(name)
        assert r.activation == fmt == r.weight and r.activation.name == name
        assert (fmt.block_size, fmt.sub_block_size, fmt.sub_block_shift_bits, fmt.rounding_mode) == (16, 2, 1, 2)
    for name, element in (("MXINT8", "int8"), ("MXFP8E4M3", "fp8_e4m3"), ("MXFP8E5M2", "fp8_e5m2"),
                          ("MXFP6E3M2", "fp6_e3m2"), ("MXFP6E2M3", "fp6_e2m3"), ("MXFP4E2M1", "fp4_e2m1")):
        r = _resolved(name)
        assert r.activation == F.MXFormat(element, 32, 2) == r.weight
    assert (_resolved("BF16_BFP16").activation, _resolved("BF16_BFP16").weight) == (F.BF16, F.BFP16)
    assert (_resolved("BF16_MXINT8").activation, _resolved("BF16_MXINT8").weight) == (F.BF16, F.MXINT8)
    assert (_resolved("MX9_INT8").activation, _resolved("MX9_INT8").weight) == (F.MX9, F.INT8)
    for name in ("BF16_ADAQUANT", "MX9_ADAQUANT"):
        assert _resolved(name).fast_finetune.optim_algorithm == "adaquant"
    assert "BF16_ADAROUND" not in DEFAULT_CONFIG_NAMES  # AdaRound needs integer weights


@pytest.mark.usefixtures("all_implemented")
def test_mixed_table():
    for name, target in (("BF16_MIXED_BFP16", F.BFP16), ("BF16_MIXED_MXINT8", F.MXINT8)):
        r = _resolved(name)
        amp = r.auto_mixprecision
        assert (r.activation, r.weight) == (F.BF16, F.BF16)
        assert amp.target_quant_type == target and amp.dual_quant_nodes
        assert amp.target_op_type == ("Conv", "ConvTranspose", "Gemm", "MatMul")
        assert amp.l2_target is None and amp.top1_acc_target is None
    r = _resolved("S16S16_MIXED_S8S8")
    assert (r.activation, r.weight, r.calibration.method) == (F.INT16, F.INT16, "Percentile")
    amp = r.auto_mixprecision
    assert (amp.act_target_quant_type, amp.weight_target_quant_type, amp.l2_target) == (F.INT8, F.INT8, 0.1)


def test_required_features_lists_all():
    feats = [f for f, _ in required_features(QuantizationConfig(**D._BUILDERS["BF16_MIXED_MXINT8"]()))]
    assert feats == ["block_formats", "layerwise_mixprecision"]
    assert required_features(get_default_config("A8W8")) == [("cle", "include_cle=True")]
    assert required_features(get_default_config("INT8_CNN_DEFAULT")) == []
    assert [f for f, _ in required_features(QuantizationConfig(weight_type=ExtendedQuantType.QBFP,
                                                               activation_type=QuantType.QInt8))] == ["block_formats"]
