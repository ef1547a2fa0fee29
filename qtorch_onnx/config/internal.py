"""The one typed, validated, frozen configuration the library works from.

The Quark-compatible vocabulary (:mod:`qtorch_onnx.config.quark`) and the native API both build a
:class:`ResolvedConfig`; nothing inside the library reads raw ``extra_options`` dicts (ARCHITECTURE.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ..formats.spec import Format


@dataclass(frozen=True)
class FastFinetuneSettings:
    """``FastFinetune`` options (docs/configuration.md), defaults as Quark's."""

    optim_algorithm: str = "adaround"
    num_iterations: int = 1000
    learning_rate: float = 0.1
    batch_size: int = 1
    data_size: Optional[int] = None
    fixed_seed: int = 1705472343
    early_stop: bool = False
    optim_device: str = "cpu"
    infer_device: str = "cpu"
    update_bias: bool = False
    reg_param: float = 0.01
    beta_range: tuple = (20, 2)
    warm_start: float = 0.2
    drop_ratio: float = 1.0
    target_op_type: tuple = ("Conv", "ConvTranspose", "Gemm", "MatMul", "InstanceNormalization", "LayerNormalization")
    selective_update: bool = False
    num_batches: int = 1  # mini-batches of BatchSize whose gradients one iteration accumulates
    lr_adjust: Optional[tuple] = None  # (error threshold, lr): layers whose initial loss exceeds it train with lr
    output_qdq: bool = False  # include the layer's output quantizer in the reconstruction
    log_period: int = 100  # show the loss every this many iterations
    mem_opt_level: int = 1  # cached activations: 0 on the device (host past a budget), 1 host memory, 2 disk
    output_index: int = 0  # model output the before/after report measures


@dataclass(frozen=True)
class AutoMixprecisionSettings:
    """``AutoMixprecision`` options (docs/configuration.md): layer-wise or automatic mixed precision."""

    target_op_type: tuple = ("Conv", "ConvTranspose", "Gemm", "MatMul")
    target_quant_type: Optional[Format] = None
    act_target_quant_type: Optional[Format] = None
    weight_target_quant_type: Optional[Format] = None
    output_index: int = 0
    l2_target: Optional[float] = None
    top1_acc_target: Optional[float] = None
    evaluate_function: Any = None
    dual_quant_nodes: bool = False
    #: layer-wise promotion restricted to these node names (an automatic mixed-precision plan); None: every
    #: node of ``target_op_type``
    promoted_nodes: Optional[tuple] = None


@dataclass(frozen=True)
class CLESettings:
    """Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization Through Weight Equalization and Bias
    Correction", arXiv 1906.04721), Quark's keys and defaults.

    Attributes:
        steps: sweeps over all pairs (CLESteps, default 1); -1 sweeps until the mean absolute weight change of
            a sweep stops changing by more than ``total_layer_diff_threshold`` (at most 20 sweeps).
        balance_method: per-channel range, ``"max"`` (of |w|) (CLEBalanceMethod).
        weight_threshold / use_threshold: a channel whose two ranges sum to less than ``weight_threshold`` keeps
            scale 1 when ``use_threshold`` (CLEWeightThreshold 0.5, CLEScaleUseThreshold True).
        append_bias: the first layer's bias counts in its channel range (CLEScaleAppendBias True).
        total_layer_diff_threshold: convergence threshold of ``steps = -1`` (CLETotalLayerDiffThreshold 1.9e-7).
    """

    steps: int = 1
    balance_method: str = "max"
    weight_threshold: float = 0.5
    use_threshold: bool = True
    append_bias: bool = True
    total_layer_diff_threshold: float = 1.9e-7


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything placement, calibration and export need, typed.

    Format fields hold :mod:`qtorch_onnx.formats.spec` objects. Tuple-of-names fields are ONNX node or
    tensor names. ``calibrate_method`` is one of ``"MinMax" | "Entropy" | "Percentile" | "Distribution" |
    "NonOverflow" | "MinMSE"``; the last two give power-of-two scales (``power_of_two`` is True).
    """

    activation: Format
    weight: Format
    activation_symmetric: bool = True
    weight_symmetric: bool = True
    per_channel: bool = False
    reduce_range: bool = False
    calibrate_method: str = "MinMax"
    power_of_two: bool = False
    percentile: float = 99.999
    num_bins: int = 2048
    moving_average: bool = False
    moving_average_constant: float = 0.01
    weight_calibrate_method: str = "MinMax"
    # placement
    op_types_to_quantize: tuple = ()  # empty: the default op set
    quantize_all_op_types: bool = False
    nodes_to_quantize: tuple = ()  # empty: all nodes of the op types
    nodes_to_exclude: tuple = ()
    subgraphs_to_exclude: tuple = ()  # ((start names...), (end names...)) pairs
    input_nodes: tuple = ()
    output_nodes: tuple = ()
    fold_relu: bool = False
    align_concat: bool = False
    align_slice: bool = False
    align_eltwise_quant_type: bool = False
    force_quantize_no_input_check: bool = False
    int32_bias: bool = True
    quantize_bias: bool = True
    adjust_bias_scale: bool = False
    # BF16 / FP16
    bf16_qdq_to_cast: bool = False
    weight_scaled: bool = False
    activation_scaled: bool = False
    # overrides: ONNX Runtime's TensorQuantOverrides format, validated, frozen as tuple of items
    tensor_quant_overrides: Mapping[str, Any] = field(default_factory=dict)
    # tensor-wise mixed precision: tensor name -> Format
    tensor_precision: Mapping[str, Format] = field(default_factory=dict)
    # the user's block axis ("BFPAttributes" / "MXAttributes" -> axis) for the tensors whose readers do not
    # decide one (placement.block_axis)
    block_axes: Mapping[str, int] = field(default_factory=dict)
    # pipeline extras
    optimize_model: bool = True
    use_external_data_format: bool = False
    execution_providers: tuple = ("CPUExecutionProvider",)
    include_cle: bool = False
    cle: Optional[CLESettings] = None  # set when include_cle
    replace_clip6_relu: bool = False  # ReplaceClip6Relu: Clip(0, 6) nodes become Relu before quantization
    fast_finetune: Optional[FastFinetuneSettings] = None
    auto_mixprecision: Optional[AutoMixprecisionSettings] = None
    # quant format for export of integer Q/DQ: "QDQ" (ONNX Runtime's) or "ExtendedQDQ" (Quark's)
    quant_format: str = "QDQ"
