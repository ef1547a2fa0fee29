"""The one typed, validated, frozen configuration the library works from.

The Quark-compatible vocabulary (:mod:`qtorch_onnx.config.quark`) and the native API both build a
:class:`ResolvedConfig`; nothing inside the library reads raw ``extra_options`` dicts (ARCHITECTURE.md).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from ..formats.spec import Format


class _StrEnum(str, enum.Enum):
    """A string-valued enum: compares equal to its value (``CalibMethod.MINMAX == "MinMax"``), prints and
    formats as its value, and is saved as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def coerce(cls, value: Any, where: str):
        """``value`` (a member or its value) as a member.

        Raises:
            ConfigError: not a member or a member's value (names ``where`` and the valid values).
        """
        from ..errors import ConfigError

        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not one of {[m.value for m in cls]}") from None


class CalibMethod(_StrEnum):
    """Calibration method of activations (and weights under WeightCalibrateMethod), docs/configuration.md.
    ``NONOVERFLOW`` and ``MINMSE`` give power-of-two scales."""

    MINMAX = "MinMax"
    ENTROPY = "Entropy"
    PERCENTILE = "Percentile"
    DISTRIBUTION = "Distribution"
    NONOVERFLOW = "NonOverflow"
    MINMSE = "MinMSE"


class ExportFormat(_StrEnum):
    """quant_format: ONNX Runtime's ``QDQ``, Quark's ``ExtendedQDQ`` (both written as Q/DQ nodes), or
    ``QOperator`` (quantized operators; gated: not implemented in this version)."""

    QDQ = "QDQ"
    EXTENDED_QDQ = "ExtendedQDQ"
    QOPERATOR = "QOperator"


class OptimAlgorithm(_StrEnum):
    """Fast finetune algorithm (FastFinetune OptimAlgorithm)."""

    ADAROUND = "adaround"
    ADAQUANT = "adaquant"


class FrozenDict(dict):
    """A read-only dict (the configuration's mappings): mutation raises TypeError; copy, pickle and
    ``dict(...)`` work."""

    def _readonly(self, *args, **kwargs):
        raise TypeError("the resolved configuration is frozen: build a new one (dataclasses.replace)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __reduce__(self):
        return (FrozenDict, (dict(self),))

    def __copy__(self) -> "FrozenDict":
        return self

    def __deepcopy__(self, memo) -> "FrozenDict":
        import copy

        return FrozenDict({copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()})


@dataclass(frozen=True)
class FastFinetuneSettings:
    """``FastFinetune`` options (docs/configuration.md), defaults as Quark's."""

    optim_algorithm: OptimAlgorithm = OptimAlgorithm.ADAROUND
    num_iterations: int = 1000
    learning_rate: float = 0.1
    batch_size: int = 1  # distinct samples per mini-batch (drawn afresh each mini-batch: minibatch_indices)
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
    block_recon: bool = False  # BlockRecon: residual blocks trained together (BRECQ); Quark 0.13 stores it, unused
    ref_model_path: Optional[str] = None  # RefModelPath: the reconstruction targets' model (default: the float model)
    cache_dir: Optional[str] = None  # CacheDir: where MemOptLevel 2 spills the cached activations (default: temp)
    pin_memory: bool = True  # PinMemory: MemOptLevel 1 on CUDA caches in page-locked host memory (Quark: False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "optim_algorithm",
                           OptimAlgorithm.coerce(self.optim_algorithm, "FastFinetune OptimAlgorithm"))


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
class CalibrationSettings:
    """How ranges are found (docs/configuration.md "Calibration").

    Attributes:
        method: activations' calibration method; NonOverflow / MinMSE give power-of-two scales.
        power_of_two: integer scales are powers of two (PowerOfTwoMethod, XINT8).
        percentile: Percentile's percentile, in percent (0, 100].
        num_bins: histogram bins of Percentile / Entropy / Distribution.
        moving_average / moving_average_constant: MinMax with an exponential moving average of batch ranges.
        weight_method: WeightCalibrateMethod of integer weights (MinMax: their min / max).
    """

    method: CalibMethod = CalibMethod.MINMAX
    power_of_two: bool = False
    percentile: float = 99.999
    num_bins: int = 2048
    moving_average: bool = False
    moving_average_constant: float = 0.01
    weight_method: CalibMethod = CalibMethod.MINMAX

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", CalibMethod.coerce(self.method, "calibrate_method"))
        object.__setattr__(self, "weight_method", CalibMethod.coerce(self.weight_method, "WeightCalibrateMethod"))


@dataclass(frozen=True)
class PlacementSettings:
    """Where quantizers go and how integer ranges are shaped (docs/configuration.md "What gets quantized").

    Tuple-of-names fields are ONNX node names; ``subgraphs_to_exclude`` holds ``((start names), (end names))``
    pairs; ``op_types_to_quantize`` empty means the default op set, ``nodes_to_quantize`` empty every node of
    those op types.
    """

    activation_symmetric: bool = True
    weight_symmetric: bool = True
    per_channel: bool = False
    reduce_range: bool = False
    op_types_to_quantize: tuple = ()
    quantize_all_op_types: bool = False
    nodes_to_quantize: tuple = ()
    nodes_to_exclude: tuple = ()
    subgraphs_to_exclude: tuple = ()
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


@dataclass(frozen=True)
class FloatSettings:
    """BF16 / FP16 options (docs/numerics.md section 3): the Cast export form, calibrated scales."""

    bf16_qdq_to_cast: bool = False
    weight_scaled: bool = False
    activation_scaled: bool = False


@dataclass(frozen=True)
class GraphSettings:
    """The float graph and the runs around quantization: graph optimization before it (optimize_model),
    ReplaceClip6Relu, external data, the execution providers of float reference runs, the Q/DQ form."""

    optimize_model: bool = True
    replace_clip6_relu: bool = False
    use_external_data_format: bool = False
    execution_providers: tuple = ("CPUExecutionProvider",)
    quant_format: ExportFormat = ExportFormat.QDQ

    def __post_init__(self) -> None:
        object.__setattr__(self, "quant_format", ExportFormat.coerce(self.quant_format, "quant_format"))


#: flat configuration name (the front end's) -> (group attribute, field) of :class:`ResolvedConfig`
FLAT_NAMES: dict = {
    **{f.name: ("placement", f.name) for f in fields(PlacementSettings)},
    **{f.name: ("floats", f.name) for f in fields(FloatSettings)},
    **{f.name: ("graph", f.name) for f in fields(GraphSettings)},
    "calibrate_method": ("calibration", "method"), "weight_calibrate_method": ("calibration", "weight_method"),
    **{n: ("calibration", n) for n in ("power_of_two", "percentile", "num_bins", "moving_average",
                                       "moving_average_constant")},
}
_GROUPS = {"calibration": CalibrationSettings, "placement": PlacementSettings, "floats": FloatSettings,
           "graph": GraphSettings}


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything placement, calibration, the algorithms and export need: parsed once from the Quark
    vocabulary (:func:`qtorch_onnx.config.resolve_config`), typed and frozen, one object per concern.

    Attributes:
        activation / weight: the formats (:mod:`qtorch_onnx.formats.spec` objects).
        calibration / placement / floats / graph: the settings of each concern (their classes' docs).
        tensor_quant_overrides: ONNX Runtime's TensorQuantOverrides, validated (tensor name -> list of dicts).
        tensor_precision: tensor-wise mixed precision, tensor name -> Format.
        block_axes: the user's block axis (``"BFPAttributes"`` / ``"MXAttributes"`` -> axis) for the tensors
            whose readers do not decide one (``placement.block_axis``).
        cle / fast_finetune / auto_mixprecision: the algorithms' settings, None when not asked for.
        bias_correction: empirical bias correction after calibration (Quark's ``BiasCorrection``;
            :func:`qtorch_onnx.algorithms.bias_correction`).

    The mappings are read-only (:class:`FrozenDict`); enums stay enums (:class:`CalibMethod`,
    :class:`ExportFormat`, :class:`OptimAlgorithm`, string-valued so they compare equal to Quark's names).
    """

    activation: Format
    weight: Format
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    floats: FloatSettings = field(default_factory=FloatSettings)
    graph: GraphSettings = field(default_factory=GraphSettings)
    tensor_quant_overrides: Mapping[str, Any] = field(default_factory=FrozenDict)
    tensor_precision: Mapping[str, Format] = field(default_factory=FrozenDict)
    block_axes: Mapping[str, int] = field(default_factory=FrozenDict)
    cle: Optional[CLESettings] = None
    fast_finetune: Optional[FastFinetuneSettings] = None
    auto_mixprecision: Optional[AutoMixprecisionSettings] = None
    bias_correction: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_quant_overrides", "tensor_precision", "block_axes"):
            value = getattr(self, name)
            if not isinstance(value, FrozenDict):
                object.__setattr__(self, name, FrozenDict(value or {}))

    @property
    def include_cle(self) -> bool:
        """True when cross-layer equalization runs (``cle`` is set)."""
        return self.cle is not None

    def setting(self, name: str) -> Any:
        """The value of a setting by its flat name (``"calibrate_method"``, ``"per_channel"``, ...;
        :data:`FLAT_NAMES`) or a top-level field name.

        Raises:
            ConfigError: an unknown name (lists the valid ones).
        """
        if name in FLAT_NAMES:
            group, f = FLAT_NAMES[name]
            return getattr(getattr(self, group), f)
        if name in {f.name for f in fields(self)} or name == "include_cle":
            return getattr(self, name)
        raise self._unknown(name)

    @classmethod
    def _unknown(cls, name: str):
        """The ConfigError for a setting name that is neither flat nor top-level (lists the valid ones)."""
        from ..errors import ConfigError, closest

        valid = sorted(set(FLAT_NAMES) | {f.name for f in fields(cls)})
        return ConfigError(f"ResolvedConfig: unknown setting {name!r}{closest(name, valid)}; valid: {valid}")

    @classmethod
    def from_flat(cls, **kwargs: Any) -> "ResolvedConfig":
        """Build from the flat names of the configuration vocabulary (``calibrate_method``, ``per_channel``,
        ``optimize_model``, ...; :data:`FLAT_NAMES`) and the top-level fields; how the Quark front end builds
        it, and how a model saved by an earlier version (flat fields) is loaded.

        Raises:
            ConfigError: an unknown name (lists the valid ones).
        """
        from ..errors import ConfigError

        groups: dict = {g: {} for g in _GROUPS}
        top: dict = {}
        tops = {f.name for f in fields(cls)}
        for name, value in kwargs.items():
            if name in FLAT_NAMES:
                g, f = FLAT_NAMES[name]
                groups[g][f] = value
            elif name in tops:
                top[name] = value
            elif name == "include_cle":
                continue  # implied by ``cle``
            else:
                raise cls._unknown(name)
        for g, cls_g in _GROUPS.items():
            if g not in top:
                top[g] = cls_g(**groups[g])
            elif groups[g]:
                raise ConfigError(f"ResolvedConfig: {g} given both as a group and as {sorted(groups[g])}")
        return cls(**top)
