"""Every configuration shown in the seed documents (/work/shared/seeds) constructs and validates with names
taken from qtorch_onnx.config; those needing an unimplemented feature fail in resolve_config with
UnsupportedFeatureError naming it, and resolve fully once the feature flag is flipped."""
import pytest
from onnxruntime.quantization.calibrate import CalibrationMethod as OrtCalibrationMethod
from onnxruntime.quantization import QuantType as OrtQuantType

from qtorch_onnx.config import (CalibrationMethod, Config, ExtendedQuantFormat, ExtendedQuantType, PowerOfTwoMethod,
                                QuantizationConfig, QuantType, VitisQuantFormat, VitisQuantType, block_axes,
                                get_default_config, resolve_config)
from qtorch_onnx.errors import UnsupportedFeatureError
from qtorch_onnx.formats import spec as F


def _blocked(config, *words):
    with pytest.raises(UnsupportedFeatureError) as e:
        resolve_config(config)
    for w in words:
        assert w in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------- 000: mixed precision (BF16 / BFP16 / MX)
def _elementwise_bfp_act():
    return QuantizationConfig(calibrate_method=CalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                              activation_type=ExtendedQuantType.QBFP, weight_type=ExtendedQuantType.QBFloat16)


def _elementwise_bfp_weight():
    return QuantizationConfig(calibrate_method=CalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                              activation_type=ExtendedQuantType.QBloat16, weight_type=ExtendedQuantType.QBFP)


def _layerwise(target, dual=False):
    amp = {"TargetOpType": ["Conv", "ConvTranspose", "Gemm", "MatMul"], "TargetQuantType": target}
    if dual:
        amp["DualQuantNodes"] = True
    return QuantizationConfig(calibrate_method=CalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                              activation_type=ExtendedQuantType.QBloat16, weight_type=ExtendedQuantType.QBloat16,
                              include_auto_mp=True, extra_options={"AutoMixprecision": amp})


def _tensorwise(two_types):
    mpt = {ExtendedQuantType.QBFloat16: ["weight_tensor_name1", "activation_tensor_name1"]}
    if two_types:
        mpt[ExtendedQuantType.QInt16] = ["weight_tensor_name2", "activation_tensor_name2"]
    return QuantizationConfig(calibrate_method=CalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                              activation_type=ExtendedQuantType.QBFP, weight_type=ExtendedQuantType.QBFP,
                              specific_tensor_precision=True, extra_options={"MixedPrecisionTensor": mpt})


def _auto_l2():
    return QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
        activation_type=ExtendedQuantType.QInt16, weight_type=QuantType.QInt8, include_auto_mp=True,
        extra_options={"AutoMixprecision": {"TargetOpType": ["Conv", "ConvTranspose", "Gemm", "MatMul"],
                                            "ActTargetQuantType": QuantType.QInt8,
                                            "WeightTargetQuantType": QuantType.QInt8, "OutputIndex": 0,
                                            "L2Target": 0.1}})


def test_seed000_elementwise(all_implemented):
    r = resolve_config(Config(global_quant_config=_elementwise_bfp_act()))
    assert r.activation == F.BFP16 and r.weight == F.BF16 and r.graph.quant_format == "ExtendedQDQ"
    r = resolve_config(_elementwise_bfp_weight())
    assert r.activation == F.BF16 and r.weight == F.BFP16
    assert r.weight.rounding_mode == 2  # never Quark's silent rounding 0


def test_seed000_elementwise_gated():
    _blocked(_elementwise_bfp_act(), "block formats")
    _blocked(_elementwise_bfp_weight(), "block formats")


def test_seed000_layerwise():
    msg = _blocked(_layerwise(ExtendedQuantType.QBFP), "block formats", "layer-wise mixed precision")
    assert "automatic" not in msg
    _blocked(_layerwise(ExtendedQuantType.QBFP, dual=True), "layer-wise")
    _blocked(_layerwise(ExtendedQuantType.QMX), "block formats", "layer-wise")


def test_seed000_layerwise_resolved(all_implemented):
    r = resolve_config(_layerwise(ExtendedQuantType.QBFP, dual=True))
    amp = r.auto_mixprecision
    assert amp.target_quant_type == F.BFP16
    assert amp.act_target_quant_type == F.BFP16 and amp.weight_target_quant_type == F.BFP16
    assert amp.dual_quant_nodes is True and amp.l2_target is None and amp.top1_acc_target is None
    assert amp.target_op_type == ("Conv", "ConvTranspose", "Gemm", "MatMul")
    assert resolve_config(_layerwise(ExtendedQuantType.QMX)).auto_mixprecision.target_quant_type == F.MXINT8
    assert resolve_config(_layerwise(ExtendedQuantType.QMX)).auto_mixprecision.dual_quant_nodes is False


def test_seed000_tensorwise(all_implemented):
    r = resolve_config(_tensorwise(False))
    assert r.tensor_precision == {"weight_tensor_name1": F.BF16, "activation_tensor_name1": F.BF16}
    r = resolve_config(_tensorwise(True))
    assert r.tensor_precision["weight_tensor_name2"] == F.INT16
    assert r.tensor_precision["activation_tensor_name1"] == F.BF16


def test_seed000_tensorwise_gated():
    _blocked(_tensorwise(True), "block formats")


def test_seed000_auto_l2():
    msg = _blocked(_auto_l2(), "automatic mixed precision")
    assert "block formats" not in msg


def test_seed000_auto_l2_resolved(all_implemented):
    r = resolve_config(_auto_l2())
    amp = r.auto_mixprecision
    assert r.activation == F.INT16 and r.weight == F.INT8
    assert amp.act_target_quant_type == F.INT8 and amp.weight_target_quant_type == F.INT8
    assert amp.target_quant_type is None and amp.l2_target == 0.1 and amp.output_index == 0


# ---------------------------------------------------------------- 001: BF16
def _bf16(extra):
    return QuantizationConfig(calibrate_method=OrtCalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                              activation_type=ExtendedQuantType.QBFloat16, weight_type=ExtendedQuantType.QBFloat16,
                              extra_options=extra)


def test_seed001_bf16_qdq_to_cast():
    r = resolve_config(Config(global_quant_config=_bf16({"BF16QDQToCast": True})))
    assert r.activation == F.BF16 and r.weight == F.BF16 and r.floats.bf16_qdq_to_cast is True
    assert r.calibration.method == "MinMax" and r.calibration.power_of_two is False


def test_seed001_scaled():
    r = resolve_config(_bf16({"WeightScaled": True, "ActivationScaled": True}))
    assert r.floats.weight_scaled is True and r.floats.activation_scaled is True and r.floats.bf16_qdq_to_cast is False


def _bf16_ft():
    return _bf16({"FastFinetune": {"NumIterations": 1000, "LearningRate": 1e-6, "OptimAlgorithm": "adaquant",
                                   "OptimDevice": "cpu", "InferDevice": "cpu"}})


def test_seed001_fast_finetune_gated():
    # FastFinetune given without include_fast_ft: requested (not silently ignored), so gated.
    _blocked(_bf16_ft(), "fast finetune")


def test_seed001_fast_finetune_resolved(all_implemented):
    ft = resolve_config(_bf16_ft()).fast_finetune
    assert ft.optim_algorithm == "adaquant" and ft.learning_rate == 1e-6 and ft.num_iterations == 1000
    assert ft.optim_device == "cpu" and ft.infer_device == "cpu"


# ---------------------------------------------------------------- 002: MX9 (BFP prime)
_MX9_ATTRS = {"bfp_method": "to_bfp_prime", "axis": 1, "bit_width": 16, "block_size": 16, "sub_block_size": 2,
              "sub_block_shift_bits": 1, "rounding_mode": 2}


def _mx9(fast_ft=False):
    extra = {"BFPAttributes": dict(_MX9_ATTRS)}
    kw = {}
    if fast_ft:
        kw["include_fast_ft"] = True
        extra["FastFinetune"] = {"DataSize": 100, "FixedSeed": 1705472343, "BatchSize": 2, "NumIterations": 1000,
                                 "LearningRate": 0.00001, "OptimAlgorithm": "adaquant", "OptimDevice": "cpu",
                                 "InferDevice": "cpu", "EarlyStop": True}
    return QuantizationConfig(calibrate_method=OrtCalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                              activation_type=ExtendedQuantType.QBFP, weight_type=ExtendedQuantType.QBFP,
                              extra_options=extra, **kw)


def test_seed002_mx9_gated():
    msg = _blocked(Config(global_quant_config=_mx9()), "block formats")
    assert "fast finetune" not in msg
    _blocked(_mx9(fast_ft=True), "block formats", "fast finetune")


def test_seed002_mx9_resolved(all_implemented):
    r = resolve_config(_mx9())
    assert r.activation == F.MX9 and r.weight == F.MX9 and r.activation.name == "MX9"
    assert block_axes(_mx9()) == {"BFPAttributes": 1}
    ft = resolve_config(_mx9(fast_ft=True)).fast_finetune
    assert (ft.data_size, ft.batch_size, ft.early_stop, ft.learning_rate) == (100, 2, True, 1e-5)


# ---------------------------------------------------------------- 003: mixed precision tutorial
def test_seed003_layerwise_tensor_precision():
    qc = QuantizationConfig(calibrate_method=PowerOfTwoMethod.NonOverflow, quant_format=VitisQuantFormat.QDQ,
                            activation_type=VitisQuantType.QInt16, weight_type=QuantType.QInt8,
                            specific_tensor_precision=True,
                            extra_options={"MixedPrecisionTensor": {
                                ExtendedQuantType.QInt8: ["tensor_0", "tensor_1"],
                                VitisQuantType.QInt16: ["tensor_2"]}})
    r = resolve_config(Config(global_quant_config=qc))
    assert r.calibration.method == "NonOverflow" and r.calibration.power_of_two is True
    assert r.activation == F.INT16 and r.graph.quant_format == "ExtendedQDQ"
    assert r.tensor_precision == {"tensor_0": F.INT8, "tensor_1": F.INT8, "tensor_2": F.INT16}


def _top1(fn):
    return QuantizationConfig(
        calibrate_method=CalibrationMethod.Percentile, quant_format=VitisQuantFormat.QDQ,
        activation_type=VitisQuantType.QInt16, weight_type=QuantType.QInt8, include_auto_mp=True,
        extra_options={"AutoMixprecision": {"ActTargetQuantType": QuantType.QInt8,
                                            "WeightTargetQuantType": QuantType.QInt8, "OutputIndex": 0,
                                            "Top1AccTarget": 0.1, "EvaluateFunction": fn}})


def _top1_acc(outputs):
    return 0.5


def test_seed003_auto_top1(all_implemented):
    r = resolve_config(_top1(_top1_acc))
    amp = r.auto_mixprecision
    assert amp.top1_acc_target == 0.1 and amp.evaluate_function is _top1_acc and amp.l2_target is None
    assert r.calibration.method == "Percentile" and r.calibration.percentile == 99.999


def test_seed003_auto_top1_gated():
    _blocked(_top1(_top1_acc), "automatic mixed precision")


# ---------------------------------------------------------------- 004: A8W8 / A16W8
@pytest.mark.parametrize("name,act", [("A8W8", F.INT8), ("A16W8", F.INT16)])
def test_seed004_defaults(name, act):
    r = resolve_config(Config(global_quant_config=get_default_config(name)))
    assert r.activation == act and r.weight == F.INT8
    assert r.placement.activation_symmetric and r.placement.weight_symmetric and r.placement.int32_bias
    assert r.calibration.method == "MinMax" and not r.calibration.power_of_two
    assert (r.placement.fold_relu, r.placement.align_concat, r.placement.align_slice) == (True, True, False)
    assert r.placement.align_eltwise_quant_type is (name == "A16W8")
    assert r.fast_finetune is None


def _seed004_ft(act, algo, lr):
    return QuantizationConfig(calibrate_method=OrtCalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                              activation_type=act, weight_type=OrtQuantType.QInt8, include_fast_ft=True,
                              extra_options={"ActivationSymmetric": True, "AlignSlice": False, "FoldRelu": True,
                                             "AlignConcat": True, "AlignEltwiseQuantType": True,
                                             "FastFinetune": {"NumIterations": 1000, "LearningRate": lr,
                                                              "OptimAlgorithm": algo}})


_FT_CASES = [(OrtQuantType.QInt8, "adaround", 0.1), (OrtQuantType.QInt8, "adaquant", 1e-6),
             (ExtendedQuantType.QInt16, "adaround", 0.1), (ExtendedQuantType.QInt16, "adaquant", 1e-6)]


@pytest.mark.parametrize("act,algo,lr", _FT_CASES)
def test_seed004_fast_finetune_gated(act, algo, lr):
    _blocked(_seed004_ft(act, algo, lr), "fast finetune")


@pytest.mark.parametrize("act,algo,lr", _FT_CASES)
def test_seed004_fast_finetune_resolved(all_implemented, act, algo, lr):
    r = resolve_config(_seed004_ft(act, algo, lr))
    assert r.fast_finetune.optim_algorithm == algo and r.fast_finetune.learning_rate == lr
    assert r.placement.activation_symmetric and r.placement.fold_relu and r.placement.align_concat and not r.placement.align_slice
    assert r.activation == (F.INT8 if act is OrtQuantType.QInt8 else F.INT16)
