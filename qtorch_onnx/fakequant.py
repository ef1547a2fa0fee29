"""FakeQuantize: one numeric format on one ONNX tensor, with its state and straight-through gradients.

A :class:`FakeQuantize` is identified by the ONNX tensor it sits on (``tensor_name``) and its ``role``
(activation, weight or bias). It holds the :mod:`qtorch_onnx.formats` spec, the per-tensor or
per-channel ``scale`` / ``zero_point`` buffers, and an optional calibration observer. It runs in one of
three modes:

* ``"float"``: pass-through (the float model);
* ``"observe"``: pass-through while its observer records ranges (calibration);
* ``"quantize"``: fake quantization (quantize then dequantize in float32), differentiable with the
  straight-through estimator of NUMERICS.md section 8.

The numerics are the :mod:`qtorch_onnx.formats` reference functions; block formats dispatch to the
Triton kernels on CUDA when available (see ``backend``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .errors import ConfigError, UnsupportedFeatureError
from .formats import floating as _floating
from .formats import integer as _integer
from .formats.spec import BFPFormat, FloatFormat, Format, IntFormat, MXFormat
from .placement import edge_key

ROLES = ("activation", "weight", "bias")
MODES = ("float", "observe", "quantize")


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
            ActivationScaled, NUMERICS.md section 3) instead of 1.0.
        onnx_axis: the same axis in the ONNX tensor's layout (export uses it); defaults to ``axis``.
        power_of_two: integer scales from a range are powers of two (NonOverflow rule, NUMERICS.md section 1).
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
        self.mode = "float"
        #: BF16/FP16 export form (NUMERICS.md section 3): "qdq" (Quark's default: ExtendedQuantizeLinear ->
        #: ExtendedDequantizeLinear, dividing by the scale) or "cast" (BF16QDQToCast: Mul by float32(1/scale)
        #: -> Cast -> Cast -> Mul by the scale). prepare() sets it from the configuration.
        self.float_form = "qdq" if isinstance(fmt, FloatFormat) and not scaled else "cast"
        #: block formats: "auto" (Triton kernels for CUDA tensors, the formats/ reference elsewhere),
        #: "reference" or "triton" (qtorch_onnx.ops.BACKENDS); all give the same bits.
        self.backend = "auto"
        #: export form of integer Q/DQ: the node domain ("" or "com.microsoft"); None = export's rule (OPS.md).
        #: Set when a quantized model is imported (qtorch_onnx.load_quantized), to write it back as it came.
        self.qdq_domain: Optional[str] = None
        #: export form of weights: "quantized" (the integer / 16-bit initializer -> DequantizeLinear) or "float"
        #: (the float initializer -> QuantizeLinear -> DequantizeLinear, as Quark writes BF16 weights). Block
        #: formats always keep the float initializer.
        self.weight_storage = "quantized"
        #: (scale shape, zero-point shape) an imported model stored its parameters in, or None (export's own)
        self.qparam_shapes = None
        self.register_buffer("scale", torch.tensor(1.0, dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor(0, dtype=torch.int64))
        self.calibrated = isinstance(fmt, (BFPFormat, MXFormat)) or (isinstance(fmt, FloatFormat) and not scaled)

    # ------------------------------------------------------------------ state
    @property
    def key(self) -> str:
        """The placement key: ``tensor_name``, or ``"<tensor> -> <consumer>"`` for a consumer-side quantizer."""
        return self.tensor_name if self.consumer is None else edge_key(self.tensor_name, self.consumer)

    @property
    def needs_calibration(self) -> bool:
        """True when the quantizer's parameters come from calibration data (integer and scaled float)."""
        return isinstance(self.fmt, IntFormat) or (isinstance(self.fmt, FloatFormat) and self.scaled)

    def set_mode(self, mode: str) -> "FakeQuantize":
        """Switch between ``"float"``, ``"observe"`` and ``"quantize"`` (see module docstring)."""
        if mode not in MODES:
            raise ConfigError(f"FakeQuantize.set_mode: unknown mode {mode!r}; valid: {MODES}")
        self.mode = mode
        return self

    def set_qparams(self, scale: torch.Tensor, zero_point: Optional[torch.Tensor] = None) -> None:
        """Set the scale (float32) and zero point (integer), per tensor (0-d) or per channel (1-d)."""
        scale = torch.as_tensor(scale).detach().to(device=self.scale.device, dtype=torch.float32).clone()
        if zero_point is None:
            zero_point = torch.zeros_like(scale, dtype=torch.int64)
        zero_point = torch.as_tensor(zero_point).detach().to(device=self.scale.device, dtype=torch.int64).clone()
        if zero_point.shape != scale.shape:
            zero_point = zero_point.expand_as(scale).clone()
        self.scale = scale
        self.zero_point = zero_point
        self.calibrated = True

    def compute_qparams_from_range(self, rmin: torch.Tensor, rmax: torch.Tensor) -> None:
        """Set scale and zero point from a calibrated range (NUMERICS.md sections 1 and 3).

        Integer formats use the symmetric / asymmetric rule of section 1; scaled BF16/FP16 use
        ``scale = float32(max(|rmin|, |rmax|) / 2)`` (section 3).
        """
        if isinstance(self.fmt, IntFormat):
            if self.power_of_two:
                scale, zp, _ = _integer.pow2_scale_nonoverflow(rmin, rmax, self.fmt, self.symmetric)
            else:
                scale, zp = _integer.qparams_from_range(rmin, rmax, self.fmt, self.symmetric)
            self.set_qparams(scale, zp)
        elif isinstance(self.fmt, FloatFormat) and not self.scaled:
            self.calibrated = True  # plain BF16/FP16 rounding: scale 1, nothing to compute
        elif isinstance(self.fmt, FloatFormat):
            a = torch.maximum(torch.as_tensor(rmin, dtype=torch.float64).abs(), torch.as_tensor(rmax, dtype=torch.float64).abs())
            scale = (a / 2).to(torch.float32)
            scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
            self.set_qparams(scale)
        else:
            self.calibrated = True

    def finish_calibration(self) -> None:
        """Turn the observer's statistics into quantization parameters."""
        if self.observer is None:
            raise ConfigError(f"quantizer on tensor {self.tensor_name!r} has no observer to calibrate from")
        if isinstance(self.fmt, IntFormat):
            scale, zp = self.observer.compute_qparams(self.fmt, self.symmetric)
            self.set_qparams(scale, zp)
        else:
            rmin, rmax = self.observer.compute_range()
            self.compute_qparams_from_range(rmin, rmax)

    # ------------------------------------------------------------------ numerics
    def quantize_dequantize(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize ``x`` (float32 tensor of any shape) with the current parameters; differentiable."""
        fmt = self.fmt
        if isinstance(fmt, IntFormat):
            per_channel = self.scale.dim() > 0
            if self.role == "bias" and fmt.bits == 32:
                # INT32 bias: float64 division (NUMERICS.md section 1), straight-through gradient
                with torch.no_grad():
                    q = _integer.quantize_bias(x, self.scale)
                    y = _integer.dequantize(q, self.scale, None, axis=self.axis if per_channel else None)
                    lo, hi = _integer.quant_range(fmt)
                    mask = (q > lo) & (q < hi)  # saturated elements get no gradient
                return _floating.straight_through(x, y, mask)
            return _integer.fake_quantize_ste(
                x, self.scale, self.zero_point, fmt, axis=self.axis if per_channel else None,
                narrow_range=self.narrow_range,
            )
        if isinstance(fmt, FloatFormat):
            unit = self.scale.numel() == 1 and float(self.scale) == 1.0
            if self.float_form == "qdq":
                if fmt.kind == "BF16":  # ExtendedQuantizeLinear/ExtendedDequantizeLinear, zero point +0.0
                    return _floating.scaled_bf16_ste(x, self.scale, form="qdq",
                                                     axis=self.axis if self.scale.dim() > 0 else None)
                if not unit:
                    raise UnsupportedFeatureError(
                        f"quantizer on {self.tensor_name!r}: the FP16 Q/DQ form ignores the scale (Quark's "
                        "ExtendedQuantizeLinear); a scaled FP16 quantizer needs float_form='cast'")
                return _floating.fp16_round_ste(x)
            if self.float_form != "cast":
                raise ConfigError(f"quantizer on {self.tensor_name!r}: float_form {self.float_form!r}; "
                                  "valid: 'qdq', 'cast'")
            rnd = _floating.bf16_round_ste if fmt.kind == "BF16" else _floating.fp16_round_ste
            if unit:
                return rnd(x)
            # Cast form: Mul(x, float32(1/scale)) -> Cast -> Cast -> Mul(scale) (NUMERICS.md section 3)
            inv = torch.ones_like(self.scale) / self.scale if self.scale.dim() == 0 else None
            if inv is None:
                raise UnsupportedFeatureError(f"quantizer on {self.tensor_name!r}: per-channel {fmt.name} scales")
            return rnd(x * inv) * self.scale
        if isinstance(fmt, (BFPFormat, MXFormat)):
            return self._block_fake_quantize(x)
        raise ConfigError(f"quantizer on {self.tensor_name!r}: unsupported format {fmt!r}")

    def _block_fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """BFP / BFP-prime / MX quantize-dequantize along ``self.axis`` (NUMERICS.md sections 4-8)."""
        from . import ops as _ops

        fmt = self.fmt
        axis = self.axis if self.axis is not None else (1 if x.dim() > 1 else 0)
        if isinstance(fmt, BFPFormat):
            return _ops.bfp_quantize_dequantize(x, axis=axis, backend=self.backend, **_bfp_kwargs(fmt))
        return _ops.mx_quantize_dequantize(x, element_dtype=fmt.element_dtype, axis=axis, block_size=fmt.block_size,
                                           rounding_mode=fmt.rounding_mode, backend=self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "quantize":
            if not x.is_floating_point():
                return x
            orig_dtype = x.dtype
            y = self.quantize_dequantize(x if orig_dtype == torch.float32 else x.float())
            return y if orig_dtype == torch.float32 else y.to(orig_dtype)
        if self.mode == "observe" and self.observer is not None and x.is_floating_point():
            self.observer.update(x.detach())
        return x

    def extra_repr(self) -> str:
        s = f"{self.fmt.name}, tensor={self.tensor_name!r}, role={self.role}, mode={self.mode}"
        if self.consumer is not None:
            s += f", consumer={self.consumer!r}"
        if self.axis is not None:
            s += f", axis={self.axis}"
        if isinstance(self.fmt, IntFormat):
            s += f", symmetric={self.symmetric}"
        return s


def _bfp_kwargs(fmt: BFPFormat) -> dict:
    return dict(bfp_method=fmt.bfp_method, bit_width=fmt.bit_width, block_size=fmt.block_size,
                rounding_mode=fmt.rounding_mode, sub_block_size=fmt.sub_block_size,
                sub_block_shift_bits=fmt.sub_block_shift_bits,
                convert_to_bfloat_before_bfp=fmt.convert_to_bfloat_before_bfp)


class ParamQuantizer(nn.Module):
    """Parametrization wrapper: fake-quantizes a module parameter in place of its float value.

    Registered with :func:`torch.nn.utils.parametrize.register_parametrization`, so the float parameter
    stays the trainable leaf (AdaQuant / finetuning update it) while every forward sees the quantized value.
    """

    def __init__(self, fq: FakeQuantize) -> None:
        super().__init__()
        self.fq = fq

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.fq(w)
