"""QuantizationConfig / Config validation: unknown keys with did-you-mean at every level, types, ranges,
ONNX Runtime enum acceptance, non-mutation, and the resolved defaults."""
import copy

import pytest
import onnxruntime.quantization as ortq

from qtorch_onnx.config import (CalibrationMethod, Config, ExtendedQuantFormat, ExtendedQuantType, PowerOfTwoMethod,
                                QuantFormat, QuantizationConfig, QuantType, resolve_config)
from qtorch_onnx.errors import ConfigError, UnsupportedFeatureError
from qtorch_onnx.formats import spec as F


def _qc(**extra):
    return QuantizationConfig(extra_options=extra)


def _raises(exc, match_all, fn, *a, **kw):
    with pytest.raises(exc) as e:
        fn(*a, **kw)
    for m in match_all:
        assert m in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------- defaults
def test_quark_defaults_resolve():
    r = resolve_config(QuantizationConfig())
    assert r.activation == F.INT8 and r.weight == F.INT8
    assert (r.calibration.method, r.calibration.power_of_two, r.graph.quant_format) == ("MinMax", False, "QDQ")
    assert r.placement.activation_symmetric is False and r.placement.weight_symmetric is True
    assert (r.placement.align_concat, r.placement.align_slice, r.placement.fold_relu) == (False, False, False)
    assert (r.placement.int32_bias, r.placement.quantize_bias, r.placement.adjust_bias_scale) == (True, True, True)
    assert (r.calibration.percentile, r.calibration.num_bins, r.calibration.moving_average, r.calibration.moving_average_constant) == (99.999, 2048, False, 0.01)
    assert r.graph.execution_providers == ("CPUExecutionProvider",) and r.graph.optimize_model is True
    assert r.fast_finetune is None and r.auto_mixprecision is None and r.tensor_precision == {}


def test_power_of_two_defaults_and_overrides():
    r = resolve_config(QuantizationConfig(calibrate_method=PowerOfTwoMethod.MinMSE))
    assert (r.calibration.method, r.calibration.power_of_two) == ("MinMSE", True)
    assert r.placement.activation_symmetric and r.placement.align_concat and r.placement.align_slice
    r = resolve_config(QuantizationConfig(calibrate_method=PowerOfTwoMethod.MinMSE,
                                          extra_options={"AlignSlice": False, "ActivationSymmetric": False}))
    assert r.placement.align_slice is False and r.placement.activation_symmetric is False and r.placement.align_concat is True


def test_entropy_num_bins_default():
    assert resolve_config(QuantizationConfig(calibrate_method=CalibrationMethod.Entropy)).calibration.num_bins == 128
    r = resolve_config(QuantizationConfig(calibrate_method=CalibrationMethod.Entropy, extra_options={"NumBins": 512}))
    assert r.calibration.num_bins == 512


def test_every_type_maps_to_its_format():
    expect = {"QInt8": F.INT8, "QUInt8": F.UINT8, "QInt16": F.INT16, "QUInt16": F.UINT16, "QInt32": F.INT32,
              "QUInt32": F.UINT32, "QFloat16": F.FP16, "QBFloat16": F.BF16}
    for name, fmt in expect.items():
        t = ExtendedQuantType[name]
        r = resolve_config(QuantizationConfig(activation_type=t, weight_type=t, quant_format=ExtendedQuantFormat.QDQ))
        assert r.activation == fmt and r.weight == fmt
    assert ExtendedQuantType.QBloat16 is ExtendedQuantType.QBFloat16


def test_plain_fields_mapped():
    qc = QuantizationConfig(input_nodes=["a"], output_nodes=("b",), op_types_to_quantize=["Conv", "MatMul"],
                            nodes_to_quantize=["n1"], nodes_to_exclude=["n2"],
                            subgraphs_to_exclude=[(["s1", "s2"], ["e1"])], per_channel=True, reduce_range=True,
                            optimize_model=False, use_external_data_format=True,
                            execution_providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                            quant_format=ExtendedQuantFormat.QDQ)
    r = resolve_config(qc)
    assert r.placement.input_nodes == ("a",) and r.placement.output_nodes == ("b",) and r.placement.op_types_to_quantize == ("Conv", "MatMul")
    assert r.placement.nodes_to_quantize == ("n1",) and r.placement.nodes_to_exclude == ("n2",)
    assert r.placement.subgraphs_to_exclude == ((("s1", "s2"), ("e1",)),)
    assert r.placement.per_channel and r.placement.reduce_range and not r.graph.optimize_model and r.graph.use_external_data_format
    assert r.graph.execution_providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert r.graph.quant_format == "ExtendedQDQ"


def test_graph_flags_mapped():
    keys = {"FoldRelu": "fold_relu", "AlignConcat": "align_concat", "AlignSlice": "align_slice",
            "AlignEltwiseQuantType": "align_eltwise_quant_type",
            "ForceQuantizeNoInputCheck": "force_quantize_no_input_check",
            "QuantizeAllOpTypes": "quantize_all_op_types", "Int32Bias": "int32_bias", "QuantizeBias": "quantize_bias",
            "ActivationSymmetric": "activation_symmetric", "WeightSymmetric": "weight_symmetric"}
    for key, field in keys.items():
        for value in (True, False):
            assert resolve_config(_qc(**{key: value})).setting(field) is value, key
    # AdjustBiasScale: True is what this library always does (bias scale = activation scale x weight scale);
    # False cannot act and is rejected with a message that says so
    assert resolve_config(_qc(AdjustBiasScale=True)).placement.adjust_bias_scale is True
    with pytest.raises(UnsupportedFeatureError, match=r"AdjustBiasScale'\]=False is not supported.*set it to True"):
        resolve_config(_qc(AdjustBiasScale=False))


def test_numpy_scalars_accepted():
    import numpy as np
    r = resolve_config(QuantizationConfig(per_channel=np.bool_(True), extra_options={"FoldRelu": np.True_}))
    assert r.placement.per_channel is True and r.placement.fold_relu is True
    r = resolve_config(QuantizationConfig(calibrate_method=CalibrationMethod.Percentile,
                                          extra_options={"Percentile": np.float32(99.5), "NumBins": np.int64(256)}))
    assert r.calibration.percentile == 99.5 and r.calibration.num_bins == 256 and type(r.calibration.num_bins) is int


def test_calibration_options_mapped():
    r = resolve_config(QuantizationConfig(calibrate_method=CalibrationMethod.Percentile,
                                          extra_options={"Percentile": 99.99, "NumBins": 4096}))
    assert (r.calibration.method, r.calibration.percentile, r.calibration.num_bins) == ("Percentile", 99.99, 4096)
    r = resolve_config(_qc(CalibMovingAverage=True, CalibMovingAverageConstant=0.1))
    assert r.calibration.moving_average and r.calibration.moving_average_constant == 0.1
    r = resolve_config(_qc(WeightCalibrateMethod=CalibrationMethod.Percentile, Percentile=99.9))
    assert r.calibration.weight_method == "Percentile" and r.calibration.percentile == 99.9


def test_options_that_would_be_ignored_are_errors():
    _raises(ConfigError, ["Percentile", "CalibrationMethod.Percentile"], _qc, Percentile=99.9)
    _raises(ConfigError, ["NumBins"], _qc, NumBins=1024)
    _raises(ConfigError, ["CalibMovingAverage", "MinMax"], QuantizationConfig,
            calibrate_method=CalibrationMethod.Percentile, extra_options={"CalibMovingAverage": True})
    _raises(ConfigError, ["CalibMovingAverageConstant"], _qc, CalibMovingAverageConstant=0.1)
    _raises(ConfigError, ["BF16QDQToCast", "BF16"], _qc, BF16QDQToCast=True)
    _raises(ConfigError, ["WeightScaled"], _qc, WeightScaled=True)
    _raises(ConfigError, ["ActivationScaled"], _qc, ActivationScaled=True)


# ------------------------------------------------------------------------------------------- typos
@pytest.mark.parametrize("build,wrong,right", [
    (lambda: QuantizationConfig(per_chanel=True), "per_chanel", "per_channel"),
    (lambda: QuantizationConfig(activation_typ=QuantType.QInt8), "activation_typ", "activation_type"),
    (lambda: QuantizationConfig(extra_option={}), "extra_option", "extra_options"),
    (lambda: Config(global_quant_confg=QuantizationConfig()), "global_quant_confg", "global_quant_config"),
    (lambda: _qc(BFPAtributes={}), "BFPAtributes", "BFPAttributes"),
    (lambda: _qc(ActivationSymetric=True), "ActivationSymetric", "ActivationSymmetric"),
    (lambda: _qc(FoldRelU=True), "FoldRelU", "FoldRelu"),
    (lambda: _qc(BFPAttributes={"block_sise": 8}), "block_sise", "block_size"),
    (lambda: _qc(BFPAttributes={"bfp_methd": "to_bfp"}), "bfp_methd", "bfp_method"),
    (lambda: _qc(MXAttributes={"element_type": "int8"}), "element_type", "element_dtype"),
    (lambda: _qc(MXAttributes={"rounding": 2}), "rounding", "rounding_mode"),
    (lambda: _qc(FastFinetune={"NumIteration": 10}), "NumIteration", "NumIterations"),
    (lambda: _qc(FastFinetune={"OptimAlgorithim": "adaquant"}), "OptimAlgorithim", "OptimAlgorithm"),
    (lambda: _qc(AutoMixprecision={"TargetQuantTyp": QuantType.QInt8}), "TargetQuantTyp", "TargetQuantType"),
    (lambda: _qc(AutoMixprecision={"TargetQuantType": QuantType.QInt8, "L2Targt": 0.1}), "L2Targt", "L2Target"),
    (lambda: _qc(TensorQuantOverrides={"t": [{"quant_typ": QuantType.QInt8}]}), "quant_typ", "quant_type"),
    (lambda: _qc(TensorQuantOverrides={"t": [{"convert": {"quant_type": QuantType.QInt16, "recv_node": ["n"]}}]}),
     "recv_node", "recv_nodes"),
    (lambda: _qc(FastFinetune={"OptimAlgorithm": "adaquantt"}), "adaquantt", "adaquant"),
    (lambda: _qc(MXAttributes={"element_dtype": "fp8e4m3"}), "fp8e4m3", "fp8_e4m3"),
    (lambda: QuantizationConfig(activation_type="QInt16"), "QInt16", "ExtendedQuantType.QInt16"),
])
def test_typos_name_the_key_and_the_closest(build, wrong, right):
    with pytest.raises(ConfigError) as e:
        build()
    msg = str(e.value)
    assert repr(wrong) in msg and (f"did you mean {right!r}" in msg or f"did you mean {right}?" in msg), msg


def test_mixed_precision_tensor_needs_specific_tensor_precision():
    _raises(ConfigError, ["MixedPrecisionTensor", "specific_tensor_precision"], _qc,
            MixedPrecisionTensor={QuantType.QInt16: ["t"]})
    _raises(ConfigError, ["'t'", "two data types"], QuantizationConfig, specific_tensor_precision=True,
            extra_options={"MixedPrecisionTensor": {QuantType.QInt16: ["t"], ExtendedQuantType.QBFloat16: ["t"]}})
    _raises(ConfigError, ["QuantType"], QuantizationConfig, specific_tensor_precision=True,
            extra_options={"MixedPrecisionTensor": {"QInt16": ["t"]}})


# ------------------------------------------------------------------------------------------- types
@pytest.mark.parametrize("build,words", [
    (lambda: QuantizationConfig(per_channel="yes"), ["per_channel", "bool", "'yes'"]),
    (lambda: QuantizationConfig(per_channel=1), ["per_channel", "bool"]),
    (lambda: QuantizationConfig(include_fast_ft="True"), ["include_fast_ft", "bool"]),
    (lambda: QuantizationConfig(nodes_to_exclude="node_1"), ["nodes_to_exclude", "list of strings"]),
    (lambda: QuantizationConfig(nodes_to_exclude=["a", 3]), ["nodes_to_exclude[1]", "string"]),
    (lambda: QuantizationConfig(execution_providers=[]), ["execution_providers", "empty"]),
    (lambda: QuantizationConfig(subgraphs_to_exclude=[["a"]]), ["subgraphs_to_exclude[0]", "pair"]),
    (lambda: QuantizationConfig(calibrate_method="MinMax"), ["calibrate_method", "CalibrationMethod.MinMax"]),
    (lambda: QuantizationConfig(calibrate_method=QuantType.QInt8), ["calibrate_method"]),
    (lambda: QuantizationConfig(quant_format="QDQ"), ["quant_format"]),
    (lambda: QuantizationConfig(weight_type=QuantFormat.QDQ), ["weight_type", "ExtendedQuantType.QInt8"]),
    (lambda: QuantizationConfig(extra_options=[("FoldRelu", True)]), ["extra_options", "dict"]),
    (lambda: _qc(FoldRelu="True"), ["FoldRelu", "bool"]),
    (lambda: _qc(Int32Bias=None), ["Int32Bias", "bool"]),
    (lambda: QuantizationConfig(calibrate_method=CalibrationMethod.Percentile, extra_options={"Percentile": "99"}),
     ["Percentile", "number"]),
    (lambda: QuantizationConfig(calibrate_method=CalibrationMethod.Percentile, extra_options={"Percentile": 120}),
     ["Percentile", "120"]),
    (lambda: QuantizationConfig(calibrate_method=CalibrationMethod.Percentile, extra_options={"Percentile": 0}),
     ["Percentile"]),
    (lambda: QuantizationConfig(calibrate_method=CalibrationMethod.Entropy, extra_options={"NumBins": 1.5}),
     ["NumBins", "int"]),
    (lambda: _qc(CalibMovingAverage=True, CalibMovingAverageConstant=1.5), ["CalibMovingAverageConstant"]),
    (lambda: _qc(WeightCalibrateMethod=CalibrationMethod.Entropy), ["WeightCalibrateMethod"]),
    (lambda: _qc(BFPAttributes={"bfp_method": "to_bfp2"}), ["bfp_method", "to_bfp_prime"]),
    (lambda: _qc(BFPAttributes={"rounding_mode": 3}), ["rounding_mode", "[0, 2]"]),
    (lambda: _qc(BFPAttributes={"block_size": 0}), ["block_size"]),
    (lambda: _qc(BFPAttributes={"bit_width": 9}), ["bit_width"]),
    (lambda: _qc(BFPAttributes={"bit_width": 16.0}), ["bit_width", "int"]),
    (lambda: _qc(BFPAttributes={"bfp_method": "to_bfp_prime", "bit_width": 13, "block_size": 16, "sub_block_size": 2,
                                "sub_block_shift_bits": 0}), ["sub_block_shift_bits", "[1, 8]"]),
    (lambda: _qc(BFPAttributes={"bfp_method": "to_bfp_prime", "block_size": 15}), ["multiple", "sub_block_size"]),
    (lambda: _qc(BFPAttributes={"axis": "1"}), ["axis", "int"]),
    (lambda: _qc(BFPAttributes=[1]), ["BFPAttributes", "dict"]),
    (lambda: _qc(MXAttributes={"block_size": -32}), ["block_size"]),
    (lambda: _qc(FastFinetune={"NumIterations": 10.5}), ["NumIterations", "int"]),
    (lambda: _qc(FastFinetune={"NumIterations": True}), ["NumIterations", "int"]),
    (lambda: _qc(FastFinetune={"NumIterations": 0}), ["NumIterations"]),
    (lambda: _qc(FastFinetune={"LearningRate": -0.1}), ["LearningRate"]),
    (lambda: _qc(FastFinetune={"OptimDevice": "gpu"}), ["OptimDevice", "cuda:N"]),
    (lambda: _qc(FastFinetune={"OptimDevice": "cuda:1,1"}), ["OptimDevice", "twice"]),
    (lambda: _qc(FastFinetune={"InferDevice": "cuda:0,1"}), ["InferDevice", "cuda:N"]),
    (lambda: _qc(FastFinetune={"BetaRange": (20,)}), ["BetaRange", "pair"]),
    (lambda: _qc(FastFinetune={"DropRatio": 1.5}), ["DropRatio"]),
    (lambda: _qc(FastFinetune={"EarlyStop": "yes"}), ["EarlyStop", "bool"]),
    (lambda: _qc(FastFinetune={"UpdateBias": True}), ["UpdateBias", "adaquant"]),
    (lambda: _qc(AutoMixprecision={"TargetOpType": ["Conv"]}), ["TargetQuantType"]),
    (lambda: _qc(AutoMixprecision={"TargetQuantType": QuantType.QInt8, "Top1AccTarget": 0.1}),
     ["EvaluateFunction"]),
    (lambda: _qc(AutoMixprecision={"TargetQuantType": QuantType.QInt8, "Top1AccTarget": 0.1,
                                   "EvaluateFunction": 3}), ["EvaluateFunction", "callable"]),
    (lambda: _qc(AutoMixprecision={"TargetQuantType": QuantType.QInt8, "L2Target": 0.1, "Top1AccTarget": 0.1,
                                   "EvaluateFunction": len}), ["not both"]),
    (lambda: _qc(AutoMixprecision={"TargetQuantType": QuantType.QInt8, "OutputIndex": -1}), ["OutputIndex"]),
    (lambda: _qc(AutoMixprecision={"TargetQuantType": QuantType.QInt8, "DualQuantNodes": 1}),
     ["DualQuantNodes", "bool"]),
    (lambda: QuantizationConfig(include_auto_mp=True), ["include_auto_mp", "AutoMixprecision"]),
    (lambda: _qc(TensorQuantOverrides={"t": {"quant_type": QuantType.QInt8}}), ["'t'", "list"]),
    (lambda: _qc(TensorQuantOverrides={"t": [{"scale": 0.1}]}), ["scale", "zero_point", "together"]),
    (lambda: _qc(TensorQuantOverrides={"t": [{"scale": 0.1, "zero_point": 0, "symmetric": True}]}),
     ["symmetric", "cannot be combined"]),
    (lambda: _qc(TensorQuantOverrides={"t": [{"scale": -1.0, "zero_point": 0}]}), ["scale", "> 0"]),
    (lambda: _qc(TensorQuantOverrides={"t": [{"rmin": 1.0, "rmax": 0.0}]}), ["rmin"]),
    (lambda: _qc(TensorQuantOverrides={"t": [{"scale": 1.0, "zero_point": 0}, {"scale": 1.0, "zero_point": 0}]}),
     ["axis"]),
    (lambda: _qc(TensorQuantOverrides={"t": [{"convert": {"recv_nodes": ["n"]}}]}), ["convert", "quant_type"]),
    (lambda: _qc(TensorQuantOverrides={"t": [{"quant_type": "QInt8"}]}), ["quant_type", "QuantType"]),
])
def test_type_and_range_errors(build, words):
    with pytest.raises(ConfigError) as e:
        build()
    for w in words:
        assert w in str(e.value), str(e.value)


def test_adaround_on_non_integer_weights_suggests_adaquant():
    for wt in (ExtendedQuantType.QBFloat16, ExtendedQuantType.QFloat16, ExtendedQuantType.QBFP):
        _raises(ConfigError, ["AdaRound", "adaquant"], QuantizationConfig, quant_format=ExtendedQuantFormat.QDQ,
                weight_type=wt, include_fast_ft=True)


def test_positional_and_unsupported_quark_fields():
    _raises(ConfigError, ["keyword"], QuantizationConfig, CalibrationMethod.MinMax)
    _raises(ConfigError, ["keyword"], Config, QuantizationConfig())
    _raises(ConfigError, ["required"], Config)
    _raises(ConfigError, ["QuantizationConfig"], Config, global_quant_config={"per_channel": True})
    _raises(UnsupportedFeatureError, ["enable_npu_cnn"], QuantizationConfig, enable_npu_cnn=True)
    _raises(UnsupportedFeatureError, ["SimulateDPU"], _qc, SimulateDPU=True)
    _raises(UnsupportedFeatureError, ["use_compiler_version_cpu_kernel"], _qc,
            BFPAttributes={"use_compiler_version_cpu_kernel": 1})
    qc = QuantizationConfig()
    _raises(ConfigError, ["per_chanel", "per_channel"], setattr, qc, "per_chanel", True)
    qc.per_channel = "no"  # a known field may be assigned; validated again at resolve time
    _raises(ConfigError, ["per_channel", "bool"], resolve_config, qc)


def test_quark_013_aliases():
    def acc(outputs):
        return 1.0

    from qtorch_onnx.config import resolve
    qc = _qc(AutoMixprecision={"TargetQuantType": QuantType.QInt8, "MetricOutputIndex": 2,
                               "MetricEvaluateFn": acc, "Top1AccTarget": 0.05})
    parsed = resolve._parse(qc).kwargs["auto_mixprecision"]
    assert parsed.output_index == 2 and parsed.evaluate_function is acc
    _raises(ConfigError, ["OutputIndex", "twice"], _qc,
            AutoMixprecision={"TargetQuantType": QuantType.QInt8, "OutputIndex": 0, "MetricOutputIndex": 1})
    _raises(UnsupportedFeatureError, ["MetricThreshold"], _qc,
            AutoMixprecision={"TargetQuantType": QuantType.QInt8, "MetricThreshold": 0.1})


def test_tensor_quant_overrides_resolved():
    import numpy as np
    ov = {"w": [{"axis": 0, "quant_type": QuantType.QInt8}, {"scale": np.float32(0.5), "zero_point": np.int8(0)}],
          "a": [{"quant_type": ortq.QuantType.QUInt16, "symmetric": True, "rmin": -1, "rmax": 2.5}],
          "b": [{"convert": {"quant_type": QuantType.QInt16, "recv_nodes": {"n2", "n1"}}}]}
    before = copy.deepcopy(ov)
    r = resolve_config(_qc(TensorQuantOverrides=ov))
    tqo = r.tensor_quant_overrides
    assert tqo["w"][0] == {"axis": 0, "quant_type": F.INT8} and tqo["w"][1] == {"scale": 0.5, "zero_point": 0}
    assert tqo["a"][0] == {"quant_type": F.UINT16, "symmetric": True, "rmin": -1.0, "rmax": 2.5}
    assert tqo["b"][0] == {"convert": {"quant_type": F.INT16, "recv_nodes": ("n1", "n2")}}
    assert ov.keys() == before.keys() and ov["a"] == before["a"] and ov["b"] == before["b"]
    assert ov["w"][0] == before["w"][0]


# ------------------------------------------------------------------------------------------- ORT enums
def test_onnxruntime_enums_accepted():
    qc = QuantizationConfig(calibrate_method=ortq.CalibrationMethod.Percentile, quant_format=ortq.QuantFormat.QDQ,
                            activation_type=ortq.QuantType.QUInt16, weight_type=ortq.QuantType.QInt8,
                            extra_options={"Percentile": 99.9})
    r = resolve_config(qc)
    assert (r.calibration.method, r.graph.quant_format, r.calibration.percentile) == ("Percentile", "QDQ", 99.9)
    assert r.activation == F.UINT16 and r.weight == F.INT8
    for m in ortq.CalibrationMethod:
        assert resolve_config(QuantizationConfig(calibrate_method=m)).calibration.method == m.name
    for name in ("QInt8", "QUInt8", "QInt16", "QUInt16"):
        assert resolve_config(QuantizationConfig(activation_type=ortq.QuantType[name])).activation == \
            resolve_config(QuantizationConfig(activation_type=QuantType[name])).activation


@pytest.mark.parametrize("name", ["QFLOAT8E4M3FN"])
def test_onnxruntime_types_not_supported(name):
    _raises(UnsupportedFeatureError, [name], QuantizationConfig, weight_type=ortq.QuantType[name])


@pytest.mark.parametrize("name,fmt", [("QInt4", F.INT4), ("QUInt4", F.UINT4)])
def test_onnxruntime_int4_types(name, fmt):
    # ONNX Runtime's and our own spellings of the 4-bit types both resolve
    assert resolve_config(QuantizationConfig(weight_type=ortq.QuantType[name])).weight == fmt
    assert resolve_config(QuantizationConfig(weight_type=getattr(QuantType, name))).weight == fmt


def test_qoperator_is_gated():
    for f in (QuantFormat.QOperator, ortq.QuantFormat.QOperator):
        qc = QuantizationConfig(quant_format=f)
        _raises(UnsupportedFeatureError, ["QOperator", "not implemented"], resolve_config, qc)


def test_gated_features_hand_built():
    # cross-layer equalization is implemented (tests/algorithms/test_cle.py): Quark's keys and defaults
    r = resolve_config(QuantizationConfig(include_cle=True))
    assert r.include_cle and r.cle.steps == 1 and r.cle.append_bias and r.cle.weight_threshold == 0.5
    _raises(UnsupportedFeatureError, ["fast finetune"], resolve_config, QuantizationConfig(include_fast_ft=True))
    _raises(UnsupportedFeatureError, ["block formats"], resolve_config,
            QuantizationConfig(activation_type=ExtendedQuantType.QMX, quant_format=ExtendedQuantFormat.QDQ))
    _raises(UnsupportedFeatureError, ["block formats"], resolve_config,
            _qc(TensorQuantOverrides={"t": [{"quant_type": ExtendedQuantType.QBFP}]}))


def test_gate_flip_is_all_it_takes(all_implemented):
    r = resolve_config(QuantizationConfig(include_cle=True, include_fast_ft=True))
    assert r.include_cle and r.fast_finetune.optim_algorithm == "adaround" and r.fast_finetune.learning_rate == 0.1
    r = resolve_config(_qc(FastFinetune={"OptimAlgorithm": "adaquant"}))
    assert r.fast_finetune.learning_rate == 1e-5
    r = resolve_config(QuantizationConfig(activation_type=ExtendedQuantType.QMX, weight_type=ExtendedQuantType.QMX,
                                          quant_format=ExtendedQuantFormat.QDQ,
                                          extra_options={"MXAttributes": {"element_dtype": "fp4_e2m1", "axis": 0}}))
    assert r.activation == F.MXFormat("fp4_e2m1", 32, 2) and r.activation.name == "MXFP4"
    r = resolve_config(QuantizationConfig(activation_type=ExtendedQuantType.QBFP,
                                          quant_format=ExtendedQuantFormat.QDQ))
    assert r.activation == F.BFP16 and r.activation.rounding_mode == 2 and r.activation.block_size == 8
    assert resolve_config(QuantizationConfig(quant_format=QuantFormat.QOperator)).graph.quant_format == "QOperator"


# ------------------------------------------------------------------------------------------- non-mutation
def _rich_kwargs():
    return dict(calibrate_method=CalibrationMethod.Percentile, quant_format=ExtendedQuantFormat.QDQ,
                activation_type=ExtendedQuantType.QInt16, weight_type=QuantType.QInt8, nodes_to_exclude=["n"],
                subgraphs_to_exclude=[(["a"], ["b"])], specific_tensor_precision=True, include_fast_ft=True,
                extra_options={"Percentile": 99.99, "MixedPrecisionTensor": {QuantType.QInt8: ["t1", "t2"]},
                               "FastFinetune": {"OptimAlgorithm": "adaquant", "TargetOpType": ["Conv"],
                                                "BetaRange": [20, 2]},
                               "TensorQuantOverrides": {"x": [{"quant_type": QuantType.QInt16}]},
                               "BFPAttributes": {"axis": 1}})


def test_inputs_never_mutated(all_implemented):
    kwargs = _rich_kwargs()
    snapshot = copy.deepcopy(kwargs)
    qc = QuantizationConfig(**kwargs)
    assert kwargs == snapshot
    qc_snapshot = copy.deepcopy(qc)
    cfg = Config(global_quant_config=qc)
    r1 = resolve_config(cfg)
    r2 = resolve_config(qc)
    assert r1 == r2
    assert qc == qc_snapshot and qc.to_dict() == qc_snapshot.to_dict() and cfg.global_quant_config == qc_snapshot
    # the caller's objects are copied, not referenced
    kwargs["extra_options"]["FastFinetune"]["OptimAlgorithm"] = "adaround"
    kwargs["nodes_to_exclude"].append("m")
    assert qc.extra_options["FastFinetune"]["OptimAlgorithm"] == "adaquant" and qc.nodes_to_exclude == ["n"]
    qc.extra_options["Percentile"] = 50.0
    assert cfg.global_quant_config.extra_options["Percentile"] == 99.99
    assert r1.fast_finetune.target_op_type == ("Conv",) and r1.fast_finetune.beta_range == (20.0, 2.0)


def test_repr_and_equality():
    a = QuantizationConfig(per_channel=True)
    assert "per_channel=True" in repr(a) and "optimize_model" not in repr(a)
    assert a == QuantizationConfig(per_channel=True) and a != QuantizationConfig()
    assert a.copy() == a and a.copy() is not a
