"""FakeQuantize: one numeric format on one ONNX tensor, with its state and straight-through gradients.

A :class:`FakeQuantize` is identified by the ONNX tensor it sits on (``tensor_name``) and its ``role``
(activation, weight or bias). It holds a frozen spec (the :mod:`qtorch_onnx.formats` format, axis, symmetry,
range) and mutable state updated in place: the per-tensor or per-channel ``scale`` / ``zero_point`` (buffers,
or parameters once learnable), the calibration observer, an optional weight-rounding hook.

Two independent switches, as in ``torch.ao.quantization.FakeQuantize``:

* ``observer_enabled``: activations feed their observer (calibration statistics); weights and value-derived
  biases recompute their qparams from the tensor they receive (the live parameter) on every call;
* ``fake_quant_enabled``: quantize-dequantize (float32), differentiable with the straight-through estimator of
  docs/numerics.md section 8; an uncalibrated quantizer passes its input through until it has parameters.

The older ``mode`` names map onto them: ``"float"`` (both off), ``"observe"`` (observer only), ``"quantize"``
(fake quantization; weights keep following their live values).

Training hooks: :meth:`FakeQuantize.set_learnable` turns the scale (LSQ, log2 domain for power-of-two
scales) and an asymmetric zero point (LSQ+) into parameters; :meth:`FakeQuantize.set_rounding` replaces the
nearest rounding of an integer weight by a :class:`WeightRounding` (AdaRound plugs in here); INT32 bias
scales are derived from the live input and weight scales (:meth:`FakeQuantize.set_bias_sources`).
Block formats dispatch to the Triton kernels on CUDA when available (see ``backend``).

A third switch is per thread and covers every quantizer at once: inside :func:`quantization_off` each
:class:`FakeQuantize` and :class:`ParamQuantizer` passes its input through and touches no state, so the
quantized model's own modules compute the float model (the layer-wise algorithms' float reference pass).
"""
from __future__ import annotations

import contextlib
import threading

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from . import cpu_kernels as _cpu_kernels
from .errors import ConfigError, UnsupportedFeatureError
from .formats import floating as _floating
from .formats import integer as _integer
from .formats.spec import BFPFormat, Format, check_family_table
from .placement import edge_key

_SWITCH = threading.local()


@contextlib.contextmanager
def _switched_on(name: str):
    """The per-thread switch ``name`` of ``_SWITCH`` on within the context, its previous state back on exit."""
    previous = getattr(_SWITCH, name, False)
    setattr(_SWITCH, name, True)
    try:
        yield
    finally:
        setattr(_SWITCH, name, previous)


@contextlib.contextmanager
def unchanged_reads_reused():
    """Within this context, on the calling thread, a weight observer skips its min / max pass, and a derived INT32
    bias quantizer returns its last output (a copy), when the tensor and the qparams are as they were at the last
    computation by their storage and version counters (:meth:`FakeQuantize._observed_key`,
    :meth:`FakeQuantize._bias_memo_key`). For code that changes parameters only in ways that move their version
    counters (torch's in-place operations under ``no_grad``, optimizers, ``copy_``; the fused CPU steps move them
    explicitly): an in-place change through ``.data`` keeps the counter, so it is not seen here, which is why this is
    off by default. Fast finetune runs inside it (a layer's weight and bias are read several times around its
    training: 0.3-0.5 ms of torch operations a read). Nests; the previous state comes back on exit."""
    with _switched_on("reuse"):
        yield


@contextlib.contextmanager
def quantization_off():
    """Within this context, on the calling thread, every :class:`FakeQuantize` and :class:`ParamQuantizer`
    returns its input unchanged: no observer update, no qparam refresh, no fake quantization, no override. A
    prepared model then computes its float model with its own modules and parameters (the float values the
    quantizers read), which is what :class:`qtorch_onnx.algorithms.reconstruction.StagedExecutor` runs its float
    reference pass with instead of a float copy of the model. Other threads are unaffected; nests; the previous
    state comes back on exit, on errors too."""
    with _switched_on("off"):
        yield


def quantization_is_off() -> bool:
    """Whether the calling thread is inside :func:`quantization_off`."""
    return getattr(_SWITCH, "off", False)

ROLES = ("activation", "weight", "bias")
MODES = ("float", "observe", "quantize")


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round half to even with a straight-through (identity) gradient."""
    return x + (torch.round(x) - x).detach()


class WeightRounding(nn.Module):
    """How an integer weight quantizer rounds ``v = float32(w / scale)`` (the weight-rounding hook).

    Subclasses define :meth:`forward` (the value used while training: may be soft and differentiable with
    respect to the hook's own parameters) and :meth:`hard` (the integer-valued result used in eval mode and
    written by export). With ``module.eval()`` (or ``hard_mode=True``) the quantizer's forward uses :meth:`hard`,
    so emulation and export give the same bits.

    Saving: :func:`qtorch_onnx.save` records ``type(hook)`` (a class importable from ``qtorch_onnx``),
    :meth:`config` and the state dict; :meth:`from_saved` rebuilds it.
    """

    hard_mode: bool = False

    def forward(self, v: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def hard(self, v: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def config(self) -> Dict[str, Any]:
        """Constructor keyword arguments (plain Python values) that :meth:`from_saved` needs."""
        return {}

    @classmethod
    def from_saved(cls, config: Dict[str, Any], state: Dict[str, torch.Tensor]) -> "WeightRounding":
        """Rebuild a hook from :meth:`config` and its state dict."""
        hook = cls(**config)
        hook.load_state_dict(state)
        return hook


class NearestRounding(WeightRounding):
    """Round half to even (ONNX QuantizeLinear's rounding) with a straight-through gradient: the default
    behaviour, as a hook object (useful to restore after another hook)."""

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return _round_ste(v)

    def hard(self, v: torch.Tensor) -> torch.Tensor:
        return torch.round(v)


class FakeQuantize(nn.Module):
    """Fake quantizer for one ONNX tensor.

    Args:
        fmt: the numeric format (``formats.spec`` object).
        tensor_name: the ONNX tensor this quantizer sits on (the key used by placement and export).
        role: ``"activation"``, ``"weight"`` or ``"bias"``.
        axis: channel axis (per-channel integer scales) or block axis (block formats), in the layout of
            the torch tensor this module receives; ``None`` for per-tensor.
        symmetric: symmetric integer range (zero point 0, or 128 for UINT8).
        narrow_range: clip to ``[-qmax, qmax]`` (symmetric weights: INT8 never takes -128).
        observer: a :mod:`qtorch_onnx.observers` observer used in ``"observe"`` mode, or None.
        scaled: BF16/FP16 only: use a calibrated scale ``max(|rmin|, |rmax|) / 2`` (WeightScaled /
            ActivationScaled, docs/numerics.md section 3) instead of 1.0.
        onnx_axis: the same axis in the ONNX tensor's layout (export uses it); defaults to ``axis``.
        power_of_two: integer scales from a range are powers of two (NonOverflow rule, docs/numerics.md section 1).
        consumer: None for a tensor's own quantizer; the ONNX node name for a consumer-side quantizer that
            only that node's reads pass through (layer-wise mixed precision, ``placement.QuantSpec``).
        chained: consumer-side only: it reads the output of the tensor's own quantizer (``DualQuantNodes``)
            rather than the float tensor.

    Buffers:
        scale: float32, shape ``[]`` (per tensor) or ``[C]`` (per channel).
        zero_point: int64, same shape as ``scale``.

    Raises:
        ConfigError: unknown role, or an axis given for a format that takes none.
    """

    def __init__(
        self,
        fmt: Format,
        *,
        tensor_name: str,
        role: str = "activation",
        axis: Optional[int] = None,
        symmetric: bool = True,
        narrow_range: bool = False,
        observer: Optional[nn.Module] = None,
        scaled: bool = False,
        onnx_axis: Optional[int] = None,
        power_of_two: bool = False,
        consumer: Optional[str] = None,
        chained: bool = False,
    ) -> None:
        super().__init__()
        if role not in ROLES:
            raise ConfigError(f"FakeQuantize for tensor {tensor_name!r}: unknown role {role!r}; valid: {ROLES}")
        self.fmt = fmt
        self.tensor_name = tensor_name
        self.role = role
        self.axis = axis
        self.onnx_axis = axis if onnx_axis is None else onnx_axis
        self.symmetric = symmetric
        self.narrow_range = narrow_range
        self.observer = observer
        self.scaled = scaled
        self.power_of_two = power_of_two
        self.consumer = consumer
        self.chained = chained
        #: torch.ao-style switches (module docstring); ``observer_enabled`` is a property: setting it is the
        #: user's explicit choice, which calibrate() respects
        self._observer_enabled = False
        self._observer_auto_off = True  # off by set_mode()/calibrate(), not by the user: calibrate() may use it
        self.fake_quant_enabled = False
        #: learnable scale / zero point (:meth:`set_learnable`); weight-rounding hook (:meth:`set_rounding`)
        self.learnable = False
        self.rounding: Optional[WeightRounding] = None
        self.__dict__["_bias_sources"] = None
        #: BF16/FP16 export form (docs/numerics.md section 3): "qdq" (Quark's default: ExtendedQuantizeLinear ->
        #: ExtendedDequantizeLinear, dividing by the scale) or "cast" (BF16QDQToCast: Mul by float32(1/scale)
        #: -> Cast -> Cast -> Mul by the scale). prepare() sets it from the configuration.
        self.float_form = "qdq" if fmt.family.name == "float" and not scaled else "cast"
        #: block formats: "auto" (Triton kernels for CUDA tensors, the formats/ reference elsewhere),
        #: "reference" or "triton" (qtorch_onnx.ops.BACKENDS); all give the same bits.
        self.backend = "auto"
        #: export form of integer Q/DQ: the node domain ("" or "com.microsoft"); None = export's rule (docs/operators.md).
        #: Set when a quantized model is imported (qtorch_onnx.load_quantized), to write it back as it came.
        self.qdq_domain: Optional[str] = None
        #: export form of weights: "quantized" (the integer / 16-bit initializer -> DequantizeLinear) or "float"
        #: (the float initializer -> QuantizeLinear -> DequantizeLinear, as Quark writes BF16 weights). Block
        #: formats always keep the float initializer.
        self.weight_storage = "quantized"
        #: (scale shape, zero-point shape) an imported model stored its parameters in, or None (export's own)
        self.qparam_shapes = None
        #: weights: ONNX Runtime's TensorQuantOverrides pinned into every qparams computation from the live value
        #: (placement.QuantSpec.overrides: ``scale`` / ``zero_point`` / ``rmin`` / ``rmax``, a number, or per
        #: channel a tuple with None where the channel's own range decides; ``reduce_range``). None: no override.
        self.qparam_overrides: Optional[Dict[str, Any]] = None
        #: weights: how their range is found (Quark's WeightCalibrateMethod): None = min / max; or (method name,
        #: observer options) with "Percentile" (float scales) or "MinMSE" / "NonOverflow" (power-of-two scales
        #: chosen by :class:`~qtorch_onnx.observers.PowerOfTwoObserver`); recomputed only when the value changes
        self.weight_method: Optional[Tuple[str, Dict[str, Any]]] = None
        self._weight_method_key: Optional[tuple] = None
        self._observed: Optional[tuple] = None  # observe_value's last key (_observed_key) after it computed
        self.register_buffer("scale", torch.tensor(1.0, dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor(0, dtype=torch.int64))
        self.calibrated = not fmt.family.needs_calibration(scaled)

    # ------------------------------------------------------------------ state
    @property
    def key(self) -> str:
        """The placement key: ``tensor_name``, or ``"<tensor> -> <consumer>"`` for a consumer-side quantizer."""
        return self.tensor_name if self.consumer is None else edge_key(self.tensor_name, self.consumer)

    @property
    def needs_calibration(self) -> bool:
        """True when the quantizer's parameters come from calibration data (integer and scaled float)."""
        return self.fmt.family.needs_calibration(self.scaled)

    @property
    def tracks_value(self) -> bool:
        """True for a weight's (or value-derived bias's) own quantizer whose qparams come from the tensor's
        values (integer, scaled BF16/FP16): with the observer on they follow the live parameter."""
        return (self.role != "activation" and self._bias_sources is None and self.consumer is None
                and self.needs_calibration)

    @property
    def observer_enabled(self) -> bool:
        """Observer (activations) / live-value tracking (weights) switch. Setting it records the user's
        choice: :func:`qtorch_onnx.calibrate` leaves a quantizer whose observer the user switched off alone."""
        return self._observer_enabled

    @observer_enabled.setter
    def observer_enabled(self, enabled: bool) -> None:
        self._observer_enabled = bool(enabled)
        self._observer_auto_off = False

    @property
    def calibratable(self) -> bool:
        """True when :func:`qtorch_onnx.calibrate` should feed this quantizer's observer: an activation
        quantizer with an observer that is on, or that only set_mode()/calibrate() switched off."""
        return (self.role == "activation" and self.observer is not None
                and (self._observer_enabled or self._observer_auto_off))

    @property
    def mode(self) -> str:
        """``"quantize"`` when fake quantization is on, else ``"observe"`` when the observer is, else ``"float"``."""
        if self.fake_quant_enabled:
            return "quantize"
        return "observe" if self.observer_enabled else "float"

    def set_mode(self, mode: str) -> "FakeQuantize":
        """Set both switches from a mode name: ``"float"`` (both off), ``"observe"`` (observer only) or
        ``"quantize"`` (fake quantization on; activations stop observing, weights keep following their live
        value unless the scale is learnable).

        Raises:
            ConfigError: unknown mode.
        """
        if mode not in MODES:
            raise ConfigError(f"FakeQuantize.set_mode: unknown mode {mode!r}; valid: {MODES}")
        self.fake_quant_enabled = mode == "quantize"
        if mode == "quantize":
            on = self.tracks_value and not self.learnable
        else:
            on = mode == "observe"
        self._observer_enabled = on
        self._observer_auto_off = not on
        return self

    def enable_observer(self, enabled: bool = True) -> "FakeQuantize":
        """Switch the observer (activations) / live-value tracking (weights) on or off."""
        self.observer_enabled = bool(enabled)
        return self

    def enable_fake_quant(self, enabled: bool = True) -> "FakeQuantize":
        """Switch fake quantization on or off (off: the module passes its input through)."""
        self.fake_quant_enabled = bool(enabled)
        return self

    def set_qparams(self, scale: torch.Tensor, zero_point: Optional[torch.Tensor] = None) -> None:
        """Set the scale (float32) and zero point (integer), per tensor (0-d) or per channel (1-d), in place.

        The existing tensors are updated in place when the shapes agree (optimizers, ``state_dict`` and DDP
        keep referring to them); a change of shape (per tensor -> per channel) replaces them. A learnable
        scale (:meth:`set_learnable`) is overwritten with the new value, its log2 / zero-point parameters too.
        """
        scale = torch.as_tensor(scale).detach().to(device=self.scale.device, dtype=torch.float32)
        if zero_point is None:
            zero_point = torch.zeros_like(scale, dtype=torch.int64)
        zero_point = torch.as_tensor(zero_point).detach().to(device=self.scale.device, dtype=torch.int64)
        if zero_point.shape != scale.shape:
            zero_point = zero_point.expand_as(scale)
        with torch.no_grad():
            if self.scale.shape == scale.shape:
                self.scale.copy_(scale)
            elif isinstance(self.scale, nn.Parameter):
                self.scale = nn.Parameter(scale.clone(), requires_grad=self.scale.requires_grad)
            else:
                self.scale = scale.clone()
            if self.zero_point.shape == zero_point.shape:
                self.zero_point.copy_(zero_point)
            else:
                self.zero_point = zero_point.clone()
            self._sync_learned_from_state()
        self.calibrated = True

    # ------------------------------------------------------------------ training hooks
    def set_learnable(self, enabled: bool = True) -> "FakeQuantize":
        """Make the scale (and an asymmetric zero point) trainable parameters, or fixed buffers again.

        Integer formats only (other formats keep their derived scales: BF16/FP16 rounding needs none, block
        formats derive shared exponents from the data). Learnable:

        * ``scale``: an ``nn.Parameter`` trained with the LSQ gradient and its ``1/sqrt(N * Q_p)`` gradient
          scale (Esser et al. 2020, :func:`qtorch_onnx.formats.integer.fake_quantize_lsq`);
        * power-of-two scales: ``log2_scale`` (parameter); the forward uses ``2**round(log2_scale)`` with a
          straight-through round, so emulation and export (which writes the rounded power of two) agree;
        * asymmetric zero points: ``zero_point_float`` (parameter, LSQ+); ``zero_point`` stays the integer
          buffer export writes, updated from it on every forward.

        INT32 biases (scale = input scale x weight scale) stay derived. Turning a quantizer learnable disables
        its observer (the scale no longer follows calibration or the live weight).

        Returns ``self``; a no-op for formats without a learnable scale.
        """
        if not self.fmt.family.integer_grid or self._bias_sources is not None:
            return self
        if enabled == self.learnable:
            return self
        scale = self.scale.detach().clone()
        del self.scale
        if enabled:
            if self.power_of_two:
                self.register_buffer("scale", scale)
                self.log2_scale = nn.Parameter(torch.log2(scale))
            else:
                self.scale = nn.Parameter(scale)
            if not self.symmetric:
                self.zero_point_float = nn.Parameter(self.zero_point.detach().to(torch.float32).clone())
            self.observer_enabled = False
        else:
            self.register_buffer("scale", scale)
            for name in ("log2_scale", "zero_point_float"):
                if name in self._parameters:
                    del self._parameters[name]
        self.learnable = bool(enabled)
        return self

    def _sync_learned_from_state(self) -> None:
        """After ``scale`` / ``zero_point`` were set: carry them into ``log2_scale`` / ``zero_point_float``."""
        if "log2_scale" in self._parameters:
            self.log2_scale.data = torch.log2(self.scale.detach()).clone()
        if "zero_point_float" in self._parameters:
            self.zero_point_float.data = self.zero_point.detach().to(torch.float32).clone()

    def set_rounding(self, hook: Optional[WeightRounding]) -> "FakeQuantize":
        """Replace the rounding of an integer weight (``None``: round half to even, the default).

        The hook maps ``v = float32(w / scale)`` (the weight's shape, torch layout of the parameter) to rounded
        values; export writes ``clamp(hook.hard(v) + zero_point)`` as the quantized initializer.

        Raises:
            ConfigError: the quantizer is not an integer weight quantizer, or ``hook`` is no WeightRounding.
        """
        if hook is not None:
            if not self.fmt.family.integer_grid or self.role != "weight":
                raise ConfigError(f"quantizer on {self.tensor_name!r} ({self.fmt.name} {self.role}): a rounding hook "
                                  "applies to integer weight quantizers only")
            if not isinstance(hook, WeightRounding):
                raise ConfigError(f"quantizer on {self.tensor_name!r}: rounding hook must be a WeightRounding, "
                                  f"got {type(hook).__name__}")
        self.rounding = hook
        return self

    def set_bias_sources(self, input_quantizer: "FakeQuantize", weight_quantizer: "FakeQuantize") -> None:
        """Derive this INT32 bias quantizer's scale live: ``float32(scale_x * scale_w)`` (docs/numerics.md section 1)
        from the two quantizers' current scales, on every forward and at export (never a stale copy)."""
        self.__dict__["_bias_sources"] = (input_quantizer, weight_quantizer)
        self.observer_enabled = False

    @property
    def bias_sources(self) -> Optional[Tuple["FakeQuantize", "FakeQuantize"]]:
        """(input quantizer, weight quantizer) of a derived INT32 bias scale, or None."""
        return self._bias_sources

    def refresh_qparams(self, value: Optional[torch.Tensor] = None) -> None:
        """Bring derived state up to date: an INT32 bias scale from its sources; a weight's (or value-derived
        bias's) qparams from ``value`` (the live tensor in this module's layout) when its observer is on;
        a learnable power-of-two scale / zero point into the ``scale`` / ``zero_point`` buffers."""
        with torch.no_grad():
            if self._bias_sources is not None:
                sx, sw = self._bias_sources[0].scale, self._bias_sources[1].scale
                derived = _integer.bias_scale(sx.detach(), sw.detach()).to(self.scale.device)
                if derived.shape == self.scale.shape:
                    self.scale.copy_(derived)
                else:
                    self.scale = derived.clone()
                    self.zero_point = torch.zeros_like(derived, dtype=torch.int64)
                self.calibrated = bool(self._bias_sources[0].calibrated and self._bias_sources[1].calibrated)
            elif value is not None and self.tracks_value and self.observer_enabled and not self.learnable:
                self.observe_value(value)
            if self.learnable:
                if "log2_scale" in self._parameters:
                    self.scale.copy_(torch.exp2(torch.round(self.log2_scale.detach())))
                if "zero_point_float" in self._parameters:
                    from .formats.integer import _round_zero_point

                    self.zero_point.copy_(_round_zero_point(self.zero_point_float, self.fmt))

    def observe_value(self, value: torch.Tensor) -> None:
        """qparams from a tensor's own values (weights): min/max per tensor, or per channel along ``axis``
        (this module's layout). A no-op for formats whose parameters need no range (BF16/FP16, BFP/MX)."""
        if not self.needs_calibration:
            return
        v = value.detach()  # min / max are elements of the tensor: exact in its own dtype, widened after
        if self.weight_method is not None:
            key = (v.data_ptr(), v._version, tuple(v.shape), v.device)
            if key != self._weight_method_key:  # an observer pass per channel: only when the value changed
                self.qparams_by_method(v, self.axis)
                self._weight_method_key = key
            return
        key = self._observed_key(v) if getattr(_SWITCH, "reuse", False) else None
        if key is not None and key == self._observed:  # the same value into the same qparams: nothing to redo
            return
        if self.axis is None:
            rmin, rmax = v.min(), v.max()
        else:
            dims = [d for d in range(v.dim()) if d != self.axis % v.dim()]
            rmin, rmax = v.amin(dim=dims), v.amax(dim=dims)
        self.compute_qparams_from_range(rmin.to(torch.float64), rmax.to(torch.float64))
        self._observed = self._observed_key(v) if key is not None else None

    def _observed_key(self, v: torch.Tensor) -> Optional[tuple]:
        """What the qparams :meth:`observe_value` computes from ``v`` depend on, and the qparams as they stand: the
        value's storage, version counter, shape, dtype and device, the scale's and zero point's storage and version
        counters (anything that writes them, :meth:`set_qparams` or an in-place op, moves a counter), the overrides,
        format and rule. Equal keys before and after a computation mean it would give what is there (a weight read
        again unchanged: fast finetune reads each layer's weight several times before it trains it, 0.3 ms of
        observer a read on a small layer). Used inside :func:`unchanged_reads_reused` only. None where a tensor keeps no
        version counter (an inference tensor)."""
        s, z = self.scale, self.zero_point
        try:
            return (v.data_ptr(), v._version, tuple(v.shape), v.dtype, v.device, s.data_ptr(), s._version,
                    z.data_ptr(), z._version, id(self.qparam_overrides), id(self.fmt), self.symmetric,
                    self.power_of_two, self.axis, self.narrow_range, self.calibrated)
        except RuntimeError:
            return None

    def qparams_by_method(self, value: torch.Tensor, axis: Optional[int]) -> None:
        """Weight qparams with :attr:`weight_method` (Quark's WeightCalibrateMethod): one observer per tensor,
        or per channel along ``axis`` of ``value``'s layout, fed the values (both passes for histogram
        observers). Percentile gives a range (then :meth:`compute_qparams_from_range`, overrides included);
        MinMSE / NonOverflow give the power-of-two scale directly.

        Raises:
            ConfigError: :attr:`weight_method` is not set, or names an unknown method.
        """
        from .observers import make_observer

        if self.weight_method is None:
            raise ConfigError(f"quantizer on {self.tensor_name!r} has no weight calibration method")
        method, opts = self.weight_method
        v = value.detach().to(torch.float32)
        parts = [v] if axis is None else list(v.movedim(axis % v.dim(), 0))
        observers = []
        for part in parts:
            obs = make_observer(method, name=self.tensor_name, **opts)
            obs.update(part)
            if obs.needs_second_pass:
                obs.start_second_pass()
                obs.update(part)
            observers.append(obs)
        if method in ("MinMSE", "NonOverflow"):
            pairs = [o.compute_qparams(self.fmt, self.symmetric) for o in observers]
            scale = torch.stack([p[0].reshape(()) for p in pairs])
            zp = torch.stack([p[1].reshape(()) for p in pairs])
            self.set_qparams(scale[0] if axis is None else scale, zp[0] if axis is None else zp)
        else:
            ranges = [o.compute_range() for o in observers]
            rmin = torch.stack([r[0].reshape(()) for r in ranges])
            rmax = torch.stack([r[1].reshape(()) for r in ranges])
            self.compute_qparams_from_range(rmin[0] if axis is None else rmin, rmax[0] if axis is None else rmax)

    def _effective_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero point) the forward uses: the learnable ones (differentiable) when learnable."""
        if not self.learnable:
            return self.scale, self.zero_point
        if "log2_scale" in self._parameters:
            scale = torch.exp2(_round_ste(self.log2_scale))
        else:
            scale = self.scale
        zp = self.zero_point_float if "zero_point_float" in self._parameters else self.zero_point
        return scale, zp

    def check_qparams(self) -> None:
        """Raise ExportError unless every scale is positive and finite (a training step can break that)."""
        from .errors import ExportError

        s = self.scale.detach()
        if self.learnable and "log2_scale" in self._parameters:
            s = torch.exp2(torch.round(self.log2_scale.detach()))
        if s.numel() and not bool(torch.isfinite(s).all() and (s > 0).all()):
            bad = s.flatten()[~(torch.isfinite(s.flatten()) & (s.flatten() > 0))][:4].tolist()
            raise ExportError(f"quantizer on tensor {self.key!r}: scale must be positive and finite, got {bad} "
                              "(did training push it there? lower the learning rate of the scales or re-calibrate)")

    def quantize_integer(self, x: torch.Tensor) -> torch.Tensor:
        """The integers an integer quantizer stores for ``x`` (this module's layout; export uses it): the
        rounding hook's hard result when one is set, round half to even otherwise. int64 tensor."""
        fmt = self.fmt
        if not fmt.family.integer_grid:
            raise ConfigError(f"quantizer on {self.tensor_name!r}: {fmt.name} has no integer representation")
        with torch.no_grad():
            x = x.detach().float()
            per_channel = self.scale.dim() > 0
            if self.role == "bias" and fmt.bits == 32:
                return _integer.quantize_bias(x, self.scale.detach()).to(torch.int64)
            rounding = self.rounding.hard if self.rounding is not None else None
            return _integer.quantize(x, self.scale.detach(), self.zero_point.detach(), fmt,
                                     axis=self.axis if per_channel else None, narrow_range=self.narrow_range,
                                     rounding=rounding)

    def compute_qparams_from_range(self, rmin: torch.Tensor, rmax: torch.Tensor) -> None:
        """Set scale and zero point from a calibrated range (docs/numerics.md sections 1 and 3).

        Integer formats use the symmetric / asymmetric rule of section 1; scaled BF16/FP16 use
        ``scale = float32(max(|rmin|, |rmax|) / 2)`` (section 3).
        """
        if self.fmt.family.integer_grid:
            ov = self.qparam_overrides or {}
            if ov:  # TensorQuantOverrides rmin / rmax replace the observed range (per channel where given)
                rmin = _overridden(torch.as_tensor(rmin, dtype=torch.float64), ov.get("rmin"), torch.float64)
                rmax = _overridden(torch.as_tensor(rmax, dtype=torch.float64), ov.get("rmax"), torch.float64)
            if self.power_of_two:
                scale, zp, _ = _integer.pow2_scale_nonoverflow(rmin, rmax, self.fmt, self.symmetric)
            else:
                scale, zp = _integer.qparams_from_range(rmin, rmax, self.fmt, self.symmetric,
                                                        reduce_range=bool(ov.get("reduce_range", False)))
            if "scale" in ov:  # fixed scale / zero point (per channel where given)
                scale = _overridden(torch.as_tensor(scale, dtype=torch.float32), ov["scale"], torch.float32)
                zp = _overridden(torch.as_tensor(zp, dtype=torch.int64), ov["zero_point"], torch.int64)
            self.set_qparams(scale, zp)
        elif self.needs_calibration:  # scaled BF16/FP16
            a = torch.maximum(torch.as_tensor(rmin, dtype=torch.float64).abs(), torch.as_tensor(rmax, dtype=torch.float64).abs())
            scale = (a / 2).to(torch.float32)
            scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
            self.set_qparams(scale)
        else:  # plain BF16/FP16 (scale 1), block formats (shared exponents from the data): nothing to compute
            self.calibrated = True

    def finish_calibration(self) -> None:
        """Turn the observer's statistics into quantization parameters."""
        if self.observer is None:
            raise ConfigError(f"quantizer on tensor {self.tensor_name!r} has no observer to calibrate from")
        if self.fmt.family.integer_grid:
            scale, zp = self.observer.compute_qparams(self.fmt, self.symmetric)
            self.set_qparams(scale, zp)
        else:
            rmin, rmax = self.observer.compute_range()
            self.compute_qparams_from_range(rmin, rmax)

    # ------------------------------------------------------------------ numerics
    def quantize_dequantize(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize ``x`` (float32 tensor of any shape) with the current parameters; differentiable.

        Dispatches on ``self.fmt.family`` (:data:`_QUANTIZE_DEQUANTIZE`, one entry per format family)."""
        return _QUANTIZE_DEQUANTIZE[self.fmt.family.name](self, x)

    def _qdq_integer(self, x: torch.Tensor) -> torch.Tensor:
        """Integer Q/DQ (docs/numerics.md section 1): STE, LSQ (learnable scale), a rounding hook, INT32 bias."""
        fmt = self.fmt
        per_channel = self.scale.dim() > 0
        axis = self.axis if per_channel else None
        if self.role == "bias" and fmt.bits == 32:
            # INT32 bias: float64 division (docs/numerics.md section 1), straight-through gradient
            with torch.no_grad():
                q = _integer.quantize_bias(x, self.scale)
                y = _integer.dequantize(q, self.scale, None, axis=axis)
                lo, hi = _integer.quant_range(fmt)
                mask = (q > lo) & (q < hi)  # saturated elements get no gradient
            return _floating.straight_through(x, y, mask)
        scale, zp = self._effective_qparams()
        if self.rounding is not None:
            return self._fake_quantize_hooked(x, scale, zp, axis)
        if self.learnable:
            return _integer.fake_quantize_lsq(x, scale, zp, fmt, axis=axis, narrow_range=self.narrow_range)
        if (not per_channel and fmt.bits <= 16 and scale.dtype == torch.float32 and not zp.is_floating_point()
                and _cpu_kernel_applies(x, _cpu_kernels.MIN_ELEMENTS, scale)):
            # evaluation on a CPU: the same bits in one pass (cpu_kernels.c) instead of the torch path's seven
            lo, hi = _integer.quant_range(fmt, self.narrow_range)
            return _cpu_kernels.fake_quantize_tensor(x, float(scale), float(zp), lo, hi)
        return _integer.fake_quantize_ste(x, scale, zp, fmt, axis=axis, narrow_range=self.narrow_range)

    def quantize_into(self, x: torch.Tensor) -> bool:
        """Fake-quantize ``x`` in place (overwriting it) when this quantizer's :meth:`forward` would give exactly
        the one-pass CPU kernel's result of :meth:`_qdq_integer` (an activation quantizer, per tensor, an integer
        type of at most 16 bits, calibrated, observer off, no learnable qparams or rounding hook, ``x`` a contiguous
        float32 CPU tensor that wants no gradient); returns whether it did (False: ``x`` untouched, call the
        module). For a caller that owns ``x`` and discards it (the staged passes' tensors read for the last time):
        the same bits without a new tensor."""
        if (self.role != "activation" or not x.is_floating_point() or getattr(_SWITCH, "off", False)
                or self.observer_enabled or self._bias_sources is not None or self.learnable
                or not self.fake_quant_enabled or not self.calibrated or self.rounding is not None
                or self.fmt.family.name != "integer" or self.scale.dim() > 0 or self.fmt.bits > 16
                or self.scale.dtype != torch.float32 or self.zero_point.is_floating_point()
                or not _cpu_kernel_applies(x, _cpu_kernels.MIN_ELEMENTS, self.scale)):
            return False
        lo, hi = _integer.quant_range(self.fmt, self.narrow_range)
        _cpu_kernels.fake_quantize_tensor(x, float(self.scale), float(self.zero_point), lo, hi, out=x)
        return True

    def _qdq_float(self, x: torch.Tensor) -> torch.Tensor:
        """BF16 / FP16 rounding in its export form (docs/numerics.md section 3): Q/DQ or Cast, scaled or not."""
        fmt = self.fmt
        unit = self.scale.numel() == 1 and float(self.scale) == 1.0
        if self.float_form == "qdq":
            if fmt.kind == "BF16":  # ExtendedQuantizeLinear/ExtendedDequantizeLinear, zero point +0.0
                if (self.scale.dim() == 0 and self.scale.dtype == torch.float32
                        and _cpu_kernel_applies(x, _cpu_kernels.MIN_ELEMENTS, self.scale)):
                    # evaluation on a CPU: the same bits in one pass (cpu_kernels.c) instead of about ten
                    return _cpu_kernels.bf16_fake_quantize(x, float(self.scale))
                return _floating.scaled_bf16_ste(x, self.scale, form="qdq",
                                                 axis=self.axis if self.scale.dim() > 0 else None)
            if not unit:
                raise UnsupportedFeatureError(
                    f"quantizer on {self.tensor_name!r}: the FP16 Q/DQ form ignores the scale (Quark's "
                    "ExtendedQuantizeLinear); a scaled FP16 quantizer needs float_form='cast'")
            if _cpu_kernel_applies(x, _cpu_kernels.MIN_ELEMENTS) and _cpu_kernels.fp16_available():
                # evaluation on a CPU: clip and both conversions in one pass (cpu_kernels.c)
                return _cpu_kernels.fp16_round(x)
            return _floating.fp16_round_ste(x)
        if self.float_form != "cast":
            raise ConfigError(f"quantizer on {self.tensor_name!r}: float_form {self.float_form!r}; "
                              "valid: 'qdq', 'cast'")
        rnd = _floating.bf16_round_ste if fmt.kind == "BF16" else _floating.fp16_round_ste
        if unit:
            return rnd(x)
        # Cast form: Mul(x, float32(1/scale)) -> Cast -> Cast -> Mul(scale) (docs/numerics.md section 3)
        inv = torch.ones_like(self.scale) / self.scale if self.scale.dim() == 0 else None
        if inv is None:
            raise UnsupportedFeatureError(f"quantizer on {self.tensor_name!r}: per-channel {fmt.name} scales")
        return rnd(x * inv) * self.scale

    def _block_axis(self, x: torch.Tensor) -> int:
        """The block axis of this module's layout: ``axis``, or 1 (0 for 1-d tensors) when none was placed."""
        return self.axis if self.axis is not None else (1 if x.dim() > 1 else 0)

    def _block_c_kernel(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Evaluation on a CPU: the block format's torch reference bits in one C call (cpu_kernels.c) instead of
        about thirty torch operations, where the format and ``x`` allow it (``backend="auto"``); else None."""
        if self.backend != "auto" or not _cpu_kernels.block_format_covered(self.fmt) or not _cpu_kernel_applies(x, 2):
            return None
        from .formats.block import normalize_axis

        return _cpu_kernels.block_fake_quantize(x, self.fmt, normalize_axis(self._block_axis(x), x.dim()))

    def _qdq_bfp(self, x: torch.Tensor) -> torch.Tensor:
        """BFP / BFP-prime (MX4/6/9) quantize-dequantize along the block axis (docs/numerics.md sections 4-6)."""
        from . import ops as _ops

        y = self._block_c_kernel(x)
        if y is not None:
            return y
        return _ops.bfp_quantize_dequantize(x, axis=self._block_axis(x), backend=self.backend,
                                            **_bfp_kwargs(self.fmt))

    def _qdq_mx(self, x: torch.Tensor) -> torch.Tensor:
        """OCP MX quantize-dequantize along the block axis (docs/numerics.md sections 4 and 7)."""
        from . import ops as _ops

        y = self._block_c_kernel(x)
        if y is not None:
            return y
        fmt = self.fmt
        return _ops.mx_quantize_dequantize(x, element_dtype=fmt.element_dtype, axis=self._block_axis(x),
                                           block_size=fmt.block_size, rounding_mode=fmt.rounding_mode,
                                           backend=self.backend)

    def _fake_quantize_hooked(self, x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, axis) -> torch.Tensor:
        """Integer fake quantization through the rounding hook, differentiable by autograd (the hook's
        parameters, the scale when learnable). In eval mode (or ``hook.hard_mode``) the hard rounding gives
        exactly the bits :meth:`quantize_integer` exports."""
        fmt = self.fmt
        hook = self.rounding
        qmin, qmax = _integer.quant_range(fmt, self.narrow_range)
        if zp.is_floating_point():
            from .formats.integer import _round_zero_point

            zp = zp + (_round_zero_point(zp, fmt).to(zp.dtype) - zp).detach()
        if scale.dim() > 0:
            shape = [1] * x.dim()
            shape[axis % x.dim()] = scale.numel()
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        v = x.to(torch.float32) / scale
        r = hook.hard(v) if (hook.hard_mode or not hook.training) else hook(v)
        cd = torch.float32 if fmt.bits <= 16 else torch.float64
        zpc = zp.to(cd)
        c = (r.to(cd) + zpc).clamp(qmin, qmax)
        # NaN -> qmin; no +-Inf is left after the clamp, so this is where(isnan(c), qmin, c) in one pass, and
        # its gradient (grad where c is finite) is the same
        c = torch.nan_to_num(c, nan=float(qmin))
        return (c - zpc).to(torch.float32) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Observe (when enabled) and fake-quantize (when enabled and calibrated) ``x``; any shape and float
        dtype (float16/bfloat16 are computed in float32 and cast back); integer tensors pass through, and every
        tensor inside :func:`quantization_off`."""
        if not x.is_floating_point() or getattr(_SWITCH, "off", False):
            return x
        if self.observer_enabled:
            if self.role == "activation":
                if self.observer is not None:
                    self.observer.update(x.detach())
            elif self.tracks_value and not self.learnable:
                self.observe_value(x)
        memo = None
        if self._bias_sources is not None and not self.learnable and x.dtype == torch.float32 \
                and getattr(_SWITCH, "reuse", False) and not (torch.is_grad_enabled() and x.requires_grad):
            memo = self._bias_memo_key(x)
            if memo is not None and memo == self.__dict__.get("_bias_memo", (None,))[0]:
                return self.__dict__["_bias_memo"][1].clone()
        if self._bias_sources is not None or self.learnable:
            self.refresh_qparams()
        if not self.fake_quant_enabled or not self.calibrated:
            return x
        orig_dtype = x.dtype
        y = self.quantize_dequantize(x if orig_dtype == torch.float32 else x.float())
        if memo is not None:
            self.__dict__["_bias_memo"] = (self._bias_memo_key(x), y.detach().clone())
        return y if orig_dtype == torch.float32 else y.to(orig_dtype)

    def _bias_memo_key(self, x: torch.Tensor) -> Optional[tuple]:
        """What a derived INT32 bias's output depends on (:meth:`set_bias_sources`): the bias's storage, version
        counter and shape, the two source scales' and this module's qparams' storage and version counters, the
        switches. The same key as at the last output computed without a gradient means the same output (a bias read
        again unchanged: fast finetune reads each layer's bias several times around training it, 0.35-0.5 ms of
        torch operations a read). Used inside :func:`unchanged_reads_reused` only. None where a tensor keeps no version
        counter (an inference tensor)."""
        sx, sw = self._bias_sources[0].scale, self._bias_sources[1].scale
        s, z = self.scale, self.zero_point
        try:
            return (x.data_ptr(), x._version, tuple(x.shape), x.device, sx.data_ptr(), sx._version, sw.data_ptr(),
                    sw._version, s.data_ptr(), s._version, z.data_ptr(), z._version, id(self.fmt), self.axis,
                    self.fake_quant_enabled, self.calibrated, self._bias_sources[0].calibrated,
                    self._bias_sources[1].calibrated)
        except RuntimeError:
            return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # qparams saved per channel load into a module created per tensor (and back): take the saved shape
        for name in ("scale", "zero_point"):
            key = prefix + name
            cur = getattr(self, name)
            if key in state_dict and state_dict[key].shape != cur.shape:
                new = torch.empty_like(state_dict[key], device=cur.device, dtype=cur.dtype)
                if isinstance(cur, nn.Parameter):
                    setattr(self, name, nn.Parameter(new, requires_grad=cur.requires_grad))
                else:
                    setattr(self, name, new)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        s = (f"{self.fmt.name}, tensor={self.tensor_name!r}, role={self.role}, "
             f"fake_quant_enabled={self.fake_quant_enabled}, observer_enabled={self.observer_enabled}")
        if self.learnable:
            s += ", learnable"
        if self.consumer is not None:
            s += f", consumer={self.consumer!r}"
        if self.axis is not None:
            s += f", axis={self.axis}"
        if self.fmt.family.integer_grid:
            s += f", symmetric={self.symmetric}"
        return s


def _overridden(base: torch.Tensor, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``base`` (0-d, or 1-d per channel) with a TensorQuantOverrides value put in: a number replaces every
    element; a per-channel tuple replaces the channels whose entry is not None."""
    if value is None:
        return base
    if not isinstance(value, (tuple, list)):
        return torch.full_like(base, float(value) if dtype.is_floating_point else int(value), dtype=dtype)
    out = base.to(dtype).clone().reshape(-1)
    if out.numel() != len(value):
        raise ConfigError(f"TensorQuantOverrides: {len(value)} per-channel values for {out.numel()} channels")
    for i, v in enumerate(value):
        if v is not None:
            out[i] = float(v) if dtype.is_floating_point else int(v)
    return out.reshape(base.shape)


def _cpu_kernel_applies(x: torch.Tensor, min_elements: int, *params: torch.Tensor) -> bool:
    """Whether a fake quantization of ``x`` may run cpu_kernels.c's one-pass copy of its formats/ function: a
    contiguous float32 CPU tensor of at least ``min_elements`` elements, no gradient wanted (for ``x`` or the
    ``params``), not under torch.compile or jit tracing (dynamo's fake tensors have no memory), the library loaded."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() >= min_elements and x.is_contiguous()
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))
            and _cpu_kernels.available())


def _bfp_kwargs(fmt: BFPFormat) -> dict:
    return dict(bfp_method=fmt.bfp_method, bit_width=fmt.bit_width, block_size=fmt.block_size,
                rounding_mode=fmt.rounding_mode, sub_block_size=fmt.sub_block_size,
                sub_block_shift_bits=fmt.sub_block_shift_bits,
                convert_to_bfloat_before_bfp=fmt.convert_to_bfloat_before_bfp)


#: How each format family fake-quantizes (the numerics half of the family table, qtorch_onnx.formats.spec.FAMILIES).
_QUANTIZE_DEQUANTIZE = check_family_table({
    "integer": FakeQuantize._qdq_integer,
    "float": FakeQuantize._qdq_float,
    "bfp": FakeQuantize._qdq_bfp,
    "mx": FakeQuantize._qdq_mx,
}, "FakeQuantize.quantize_dequantize")


class ParamQuantizer(nn.Module):
    """Parametrization wrapper: fake-quantizes a module parameter in place of its float value.

    Registered with :func:`torch.nn.utils.parametrize.register_parametrization`, so the float parameter
    stays the trainable leaf (AdaQuant / finetuning update it) while every forward sees the quantized value.
    """

    def __init__(self, fq: FakeQuantize) -> None:
        super().__init__()
        self.fq = fq
        #: a precomputed quantized value returned instead of ``fq(w)`` while set (fast finetune's hand-written
        #: AdaRound step supplies the soft-rounded weight as an autograd leaf); None in normal use
        self.override: Optional[torch.Tensor] = None

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if getattr(_SWITCH, "off", False):  # quantization_off: the float parameter itself
            return w
        if self.override is not None:
            return self.override
        return self.fq(w)
