"""The quantized model: a lifted ONNX model with FakeQuantize modules on its ONNX tensors (what
:func:`qtorch_onnx.prepare` returns; :mod:`qtorch_onnx.quantizer` builds it, :mod:`qtorch_onnx.calibration`
calibrates it, :mod:`qtorch_onnx.export` writes it)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import onnx
import torch
from torch import nn

from . import data as _data
from .config.internal import ResolvedConfig
from .fakequant import FakeQuantize
from .placement import Plan


class QuantizedModel(nn.Module):
    """A lifted ONNX model with FakeQuantize modules on its ONNX tensors.

    Call it like the float model: positional inputs in ONNX order; returns a tensor or a tuple in ONNX output
    order. Attributes: ``gm`` (the torch.fx GraphModule), ``onnx_model`` (the normalized ONNX graph that
    export writes into), ``tensor_map``, ``plan`` (:class:`~qtorch_onnx.placement.Plan`), ``config``
    (:class:`~qtorch_onnx.config.internal.ResolvedConfig`), ``input_specs``.
    """

    def __init__(self, gm: torch.fx.GraphModule, plan: Plan, config: ResolvedConfig, onnx_model: onnx.ModelProto,
                 tensor_map: Any, input_specs: List[_data.InputSpec]) -> None:
        super().__init__()
        self.gm = gm
        self.plan = plan
        self.config = config
        self.onnx_model = onnx_model
        self.tensor_map = tensor_map
        self.input_specs = input_specs
        self.stage_times: Dict[str, float] = {}
        #: :class:`~qtorch_onnx.algorithms.cle.CLEReport` when the configuration asked for cross-layer equalization
        self.cle_report = None
        #: what :func:`~qtorch_onnx.algorithms.bias_correction` subtracted from each layer's bias (layer name ->
        #: float64 ``[channels]``), so that a later correction replaces it instead of adding to it
        self.applied_bias_corrections: Dict[str, torch.Tensor] = {}

    def forward(self, *inputs: torch.Tensor):
        return self.gm(*inputs)

    # ------------------------------------------------------------------ training view
    def parameter(self, name: str) -> nn.Parameter:
        """The trainable ``nn.Parameter`` holding ONNX initializer ``name`` (its float value, before any
        quantizer; in the torch module's layout, e.g. a Gemm ``B`` with ``transB=0`` is stored transposed).

        Raises:
            UnknownNameError: (a KeyError) no trainable parameter of that name (the message names the closest one).
        """
        from .training import initializer_locations, live_value

        for module, attr, _ in initializer_locations(self, name) if name in self.tensor_map else ():
            value = live_value(module, attr)
            if isinstance(value, nn.Parameter):
                return value
        from .errors import UnknownNameError, closest

        raise UnknownNameError(f"no trainable parameter for ONNX initializer {name!r}"
                               f"{closest(name, self.onnx_parameters())}")

    def onnx_parameters(self) -> Dict[str, nn.Parameter]:
        """Every trainable parameter keyed by its ONNX initializer name, graph order."""
        from .training import initializer_locations, live_value

        out: Dict[str, nn.Parameter] = {}
        for t in self.onnx_model.graph.initializer:
            for module, attr, _ in initializer_locations(self, t.name):
                value = live_value(module, attr)
                if isinstance(value, nn.Parameter):
                    out[t.name] = value
                    break
        return out

    def layers(self, op_types: Optional[Sequence[str]] = None) -> List[Any]:
        """The quantized compute layers in graph order, as :class:`~qtorch_onnx.training.QuantLayer` (``name``,
        ``op_type``, ``module``, ``weight``, ``bias``, ``input_quantizers``, ``weight_quantizer``,
        ``bias_quantizer``, ``output_quantizer``).

        Args:
            op_types: restrict to these ONNX op types (default
                :data:`~qtorch_onnx.training.LAYER_OP_TYPES`: Conv, ConvTranspose, Gemm, MatMul incl. attention
                MatMuls, normalizations, Gather tables).
        """
        from .training import iter_layers

        return list(iter_layers(self, op_types))

    def sync_qparams(self) -> None:
        """Bring every derived quantity up to date with the live parameters, as the next forward would: weight
        qparams of quantizers whose observer is on, learned power-of-two scales and zero points, INT32 bias
        scales (``scale_x * scale_w``). Export calls it first."""
        from .training import initializer_locations, live_value

        fqs = self.quantizers()
        for fq in fqs.values():
            if fq.tracks_value and fq.observer_enabled and not fq.learnable:
                for module, attr, _ in initializer_locations(self, fq.tensor_name):
                    value = live_value(module, attr)
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        fq.refresh_qparams(value)
                        break
            elif fq.learnable:
                fq.refresh_qparams()
        for fq in fqs.values():
            if fq.bias_sources is not None:
                fq.refresh_qparams()

    def quantizers(self) -> Dict[str, FakeQuantize]:
        """All quantizers, keyed like ``plan.specs``: the ONNX tensor name, or ``"<tensor> -> <node>"`` for a
        consumer-side quantizer (:attr:`FakeQuantize.key`)."""
        out: Dict[str, FakeQuantize] = {}
        for m in self.modules():
            if isinstance(m, FakeQuantize):
                out.setdefault(m.key, m)
        return out

    def set_mode(self, mode: str) -> "QuantizedModel":
        """Set every quantizer to ``"float"``, ``"observe"`` or ``"quantize"``."""
        for fq in self.quantizers().values():
            fq.set_mode(mode)
        return self

    @property
    def device(self) -> torch.device:
        for t in list(self.parameters()) + list(self.buffers()):
            return t.device
        return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------- prepare
