"""The pipeline: prepare (normalize, lift, place) -> calibrate -> export; and Quark's ModelQuantizer.

Native torch API::

    qm = qtorch_onnx.prepare("model.onnx", qtorch_onnx.get_default_config("A8W8"))
    qtorch_onnx.calibrate(qm, samples)          # progress bar, any device
    y = qm(x); y.sum().backward()               # fake quantization with straight-through gradients
    qtorch_onnx.export(qm, "model.a8w8.onnx")

Quark-compatible API::

    ModelQuantizer(Config(global_quant_config=cfg)).quantize_model("in.onnx", "out.onnx", data_reader)
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn
from torch.nn.utils import parametrize

from . import data as _data
from .config.internal import ResolvedConfig
from .errors import ConfigError, DataError, ModelError
from .fakequant import FakeQuantize, ParamQuantizer
from .formats.spec import FloatFormat, IntFormat
from .placement import Plan, QuantSpec, plan_quantization

ModelLike = Union[str, os.PathLike, onnx.ModelProto]


def resolve(config: Any) -> ResolvedConfig:
    """Accept a ResolvedConfig, a Quark ``Config`` / ``QuantizationConfig``, or a named config string."""
    if isinstance(config, ResolvedConfig):
        return config
    from .config import get_default_config, resolve_config

    if isinstance(config, str):
        config = get_default_config(config)
    return resolve_config(config)


def _safe(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else "t_" + out


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

    def forward(self, *inputs: torch.Tensor):
        return self.gm(*inputs)

    # ------------------------------------------------------------------ training view
    def parameter(self, name: str) -> nn.Parameter:
        """The trainable ``nn.Parameter`` holding ONNX initializer ``name`` (its float value, before any
        quantizer; in the torch module's layout, e.g. a Gemm ``B`` with ``transB=0`` is stored transposed).

        Raises:
            KeyError: no trainable parameter of that name (the message names the closest one).
        """
        from .training import initializer_locations, live_value

        for module, attr, _ in initializer_locations(self, name) if name in self.tensor_map else ():
            value = live_value(module, attr)
            if isinstance(value, nn.Parameter):
                return value
        from .errors import closest

        raise KeyError(f"no trainable parameter for ONNX initializer {name!r}{closest(name, self.onnx_parameters())}")

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
def _refs(tensor_map: Any, tensor: str) -> list:
    """Locations of an ONNX tensor in the lifted module that can carry a quantizer (fx nodes, parameters)."""
    try:
        refs = tensor_map.refs(tensor)
    except KeyError:
        return []
    return [r for r in refs if r.kind in ("node", "param")]


def _observer_for(spec: QuantSpec, cfg: ResolvedConfig):
    from .observers import make_observer

    if isinstance(spec.fmt, IntFormat) and cfg.power_of_two:
        return make_observer(cfg.calibrate_method, name=spec.tensor, fmt=spec.fmt, symmetric=spec.symmetric)
    method = cfg.calibrate_method
    opts: Dict[str, Any] = {"name": spec.tensor}
    if method == "MinMax":
        opts.update(moving_average=cfg.moving_average, averaging_constant=cfg.moving_average_constant)
    elif method == "Percentile":
        opts.update(percentile=cfg.percentile, num_bins=cfg.num_bins)
    elif method in ("Entropy", "Distribution"):
        opts.update(num_bins=cfg.num_bins)
    if isinstance(spec.fmt, FloatFormat):  # scaled BF16/FP16 take a plain range
        opts = {"name": spec.tensor}
        method = "MinMax"
    return make_observer(method, **opts)


def _weight_method(spec: QuantSpec, cfg: ResolvedConfig) -> Tuple[str, Dict[str, Any]]:
    """``(observer method, options)`` for an integer weight under Quark's WeightCalibrateMethod: Percentile
    with the configuration's Percentile / NumBins; MinMSE and NonOverflow (PowerOfTwoMethod) with the weight's
    format and symmetry (power-of-two scales)."""
    method = cfg.weight_calibrate_method
    if method == "Percentile":
        return method, {"percentile": cfg.percentile, "num_bins": cfg.num_bins}
    return method, {"fmt": spec.fmt, "symmetric": spec.symmetric}


def _weight_qparams(fq: FakeQuantize, value: torch.Tensor, onnx_axis: Optional[int]) -> None:
    """Quantization parameters of a weight from its own values (ONNX layout), per tensor or per channel: min /
    max, or the quantizer's WeightCalibrateMethod observers when it has one."""
    if fq.weight_method is not None:
        fq.qparams_by_method(value, onnx_axis)
        return
    v = value.detach().to(torch.float64)
    if onnx_axis is None:
        rmin, rmax = v.min(), v.max()
    else:
        dims = [d for d in range(v.dim()) if d != onnx_axis]
        rmin, rmax = v.amin(dim=dims), v.amax(dim=dims)
    fq.compute_qparams_from_range(rmin, rmax)


def _initializer_value(info, tensor: str) -> torch.Tensor:
    return torch.from_numpy(np.array(numpy_helper.to_array(info.initializers[tensor]), dtype=np.float32, copy=True))


def prepare(model: ModelLike, config: Any = "A8W8", *, device: Union[str, torch.device, None] = None) -> QuantizedModel:
    """Normalize and lift an ONNX model and place FakeQuantize modules per ``config``.

    Args:
        model: path or ``onnx.ModelProto`` (never modified).
        config: a named config (``"A8W8"``, ``"A16W8"``, ``"BF16"``, ``"BFP16"``, ``"MX9"``, ``"MXINT8"``, ...:
            :func:`qtorch_onnx.get_default_config` lists all and names the closest to a wrong one), a Quark
            ``Config``/``QuantizationConfig``, or a ResolvedConfig.
        device: move the module there (``"cuda"``, ``"cpu"``); default CPU.

    Returns:
        A :class:`QuantizedModel` (training mode as onnx2torch leaves it: call ``.eval()`` for inference).
        Every trainable float initializer is an ``nn.Parameter`` (:meth:`QuantizedModel.parameter`). Every
        quantizer has ``fake_quant_enabled``; weights are quantized from the start and follow their live
        values (``observer_enabled``); activation quantizers that need calibration observe and pass their
        input through until :func:`calibrate` gives them parameters.

    Raises:
        ModelError / UnsupportedOpsError: unreadable model or ops that cannot be lifted.
        ConfigError / UnsupportedFeatureError: invalid configuration, or a feature not implemented yet.
    """
    t0 = time.perf_counter()
    cfg = resolve(config)
    gm, cle_report = lift_float(model, cfg)
    t_lift = time.perf_counter() - t0
    plan = plan_quantization(gm.onnx_model, cfg, gm.tensor_map.aliases)
    qm = attach_quantizers(gm, plan, cfg)
    qm.cle_report = cle_report
    qm.stage_times["lift"] = t_lift
    qm.stage_times["place"] = time.perf_counter() - t0 - t_lift
    if device is not None:
        qm.to(device)
    return qm


def lift_float(model: ModelLike, cfg: ResolvedConfig):
    """The float model every quantized build starts from: loaded, normalized (BatchNormalization folded),
    graph-optimized when ``cfg.optimize_model`` (:mod:`qtorch_onnx.lift.fusion`), lifted, its float
    initializers made parameters, then :func:`float_rewrites`. Returns ``(gm, cle_report)``; the fusion
    report is ``gm.fusion_report``.

    Raises:
        ModelError / UnsupportedOpsError: as :func:`qtorch_onnx.lift.lift`.
    """
    from .lift import lift, load_model
    from .training import make_trainable

    gm = lift(load_model(model), fold_batchnorm=True, optimize=cfg.optimize_model)
    make_trainable(gm)
    return gm, float_rewrites(gm, cfg)


def float_rewrites(gm: torch.fx.GraphModule, cfg: ResolvedConfig):
    """The float-model transforms the configuration asks for before placement, in place on the lifted model:
    ReplaceClip6Relu, then cross-layer equalization (include_cle). Returns the
    :class:`~qtorch_onnx.algorithms.cle.CLEReport` (None without CLE)."""
    if not (cfg.replace_clip6_relu or cfg.cle is not None):
        return None
    from .algorithms.cle import cross_layer_equalization, replace_clip6_relu

    replaced = replace_clip6_relu(gm) if cfg.replace_clip6_relu else []
    if cfg.cle is None:
        return None
    report = cross_layer_equalization(gm, cfg.cle)
    report.replaced_clips = replaced
    return report


def attach_quantizers(gm: torch.fx.GraphModule, plan: Plan, cfg: ResolvedConfig, setup: Any = None) -> QuantizedModel:
    """Put one FakeQuantize per ``plan.specs`` entry into the lifted module ``gm`` (modified in place) and wrap it.

    Own quantizers go after the fx node of their tensor (every reader sees them) or parametrize the module
    parameter holding it (weights); consumer-side ones go on their one reader's edge. Weights get per-tensor /
    per-channel qparams from their values. Specs of initializers that a converter baked in as constants
    (shapes, bounds) are dropped from the plan.

    Args:
        gm: from :func:`qtorch_onnx.lift.lift` (``gm.onnx_model``, ``gm.tensor_map``).
        plan: placement of ``gm.onnx_model``. cfg: the resolved configuration (observers, BF16 form).
        setup: optional ``setup(fq, spec)`` called on each new quantizer before it is inserted.

    Returns:
        A :class:`QuantizedModel`: fake quantization on everywhere (uncalibrated quantizers pass through),
        observers on for activations, live-value tracking on for weights; INT32 biases derive their scale.

    Raises:
        ModelError: a planned tensor has no counterpart in the lifted graph (a lifting bug).
    """
    onnx_model = gm.onnx_model
    tm = gm.tensor_map
    holder = nn.Module()
    gm.add_module("quantizers", holder)
    graph = gm.graph
    nodes_by_name = {n.name: n for n in graph.nodes}
    own_node: Dict[str, torch.fx.Node] = {}  # tensor -> fx node of its own quantizer
    ordered = [k for k, s in plan.specs.items() if s.consumer is None] + \
        [k for k, s in plan.specs.items() if s.consumer is not None]
    for key in ordered:
        spec = plan.specs[key]
        tensor = spec.tensor
        refs = _refs(tm, tensor)
        if not refs:
            if tensor in plan.info.initializers:
                # baked into a converted module as a constant (e.g. a shape or bound): nothing to emulate
                del plan.specs[tensor]
                continue
            raise ModelError(f"tensor {tensor!r} has no counterpart in the lifted torch graph (lifting bug)")
        observer = None
        if spec.role == "activation" and not spec.overrides and spec.share_with is None and (
            isinstance(spec.fmt, IntFormat) or (isinstance(spec.fmt, FloatFormat) and spec.scaled)
        ):
            observer = _observer_for(spec, cfg)
        param_refs = [r for r in refs if r.kind == "param"]
        torch_axis = spec.axis
        if param_refs and spec.axis is not None and getattr(param_refs[0], "perm", None):
            torch_axis = list(param_refs[0].perm).index(spec.axis)
        fq = FakeQuantize(spec.fmt, tensor_name=tensor, role=spec.role, axis=torch_axis, onnx_axis=spec.axis,
                          symmetric=spec.symmetric, narrow_range=spec.narrow_range, observer=observer, scaled=spec.scaled,
                          power_of_two=cfg.power_of_two and isinstance(spec.fmt, IntFormat), consumer=spec.consumer,
                          chained=spec.chained)
        if isinstance(spec.fmt, FloatFormat):
            # BF16: Q/DQ form unless BF16QDQToCast; FP16: Q/DQ form unless scaled (Quark's FP16 Q/DQ
            # ignores the scale, so a scaled FP16 quantizer is written in the Cast form)
            cast = cfg.bf16_qdq_to_cast if spec.fmt.kind == "BF16" else spec.scaled
            fq.float_form = "cast" if cast else "qdq"
        if spec.role == "weight" or (spec.role == "bias" and spec.bias_of is None):
            if spec.overrides:  # TensorQuantOverrides on an initializer: pinned into every qparams computation
                fq.qparam_overrides = dict(spec.overrides)
            if spec.role == "weight" and isinstance(spec.fmt, IntFormat) and cfg.weight_calibrate_method != "MinMax" \
                    and not (cfg.weight_calibrate_method == "NonOverflow" and cfg.power_of_two):  # that is min/max
                fq.weight_method = _weight_method(spec, cfg)
            if tensor in plan.info.initializers:
                _weight_qparams(fq, _initializer_value(plan.info, tensor), spec.axis)
        fq.set_mode("quantize")
        if spec.role == "activation" and observer is not None:
            fq._observer_enabled = True  # observes until calibrate() freezes it
        if setup is not None:
            setup(fq, spec)
        holder.add_module(_safe(key), fq)
        target = f"quantizers.{_safe(key)}"
        if spec.consumer is not None:
            _insert_consumer_side(gm, tm, spec, target, refs, own_node, nodes_by_name)
            continue
        for ref in refs:
            if ref.kind == "param":
                module = gm.get_submodule(ref.module)
                parametrize.register_parametrization(module, ref.attr, ParamQuantizer(fq), unsafe=True)
            else:
                node = nodes_by_name[ref.node_name]
                with graph.inserting_after(node):
                    q = graph.call_module(target, (node,))
                node.replace_all_uses_with(q, delete_user_cb=lambda user, q=q: user is not q)
                own_node[tensor] = q
    graph.lint()
    gm.recompile()
    qm = QuantizedModel(gm, plan, cfg, onnx_model, tm, _data.input_specs(onnx_model))
    fqs = qm.quantizers()
    for key, spec in plan.specs.items():
        if spec.bias_of is not None and key in fqs and all(t in fqs for t in spec.bias_of):
            fqs[key].set_bias_sources(fqs[spec.bias_of[0]], fqs[spec.bias_of[1]])
            fqs[key].refresh_qparams()
    return qm


def _insert_consumer_side(gm: torch.fx.GraphModule, tm: Any, spec: QuantSpec, target: str, refs: list,
                          own_node: Dict[str, torch.fx.Node], nodes_by_name: Dict[str, torch.fx.Node]) -> None:
    """Put consumer-side quantizer ``target`` on the reads of ``spec.tensor`` by ONNX node ``spec.consumer``
    only: ``consumer(own_q(x))`` becomes ``consumer(edge_q(own_q(x)))`` when ``spec.chained``, else
    ``consumer(edge_q(x))``.

    Raises:
        ModelError: the consumer node or its reading of the tensor cannot be found in the lifted graph.
    """
    node_refs = [r for r in refs if r.kind == "node" and r.scope is None]
    info = tm.graph.nodes.get(spec.consumer)
    user = nodes_by_name.get(info.fx_node) if info is not None and info.fx_node else None
    if not node_refs or user is None:
        raise ModelError(f"consumer-side quantizer {spec.key!r}: node {spec.consumer!r} or its input {spec.tensor!r} "
                         "has no counterpart in the lifted torch graph (lifting bug)")
    raw = nodes_by_name[node_refs[0].node_name]
    own = own_node.get(spec.tensor)
    current = own if own is not None else raw
    if current not in user.all_input_nodes:
        raise ModelError(f"consumer-side quantizer {spec.key!r}: the lifted module of node {spec.consumer!r} does not "
                         f"read tensor {spec.tensor!r} directly")
    source = own if (own is not None and spec.chained) else raw
    with gm.graph.inserting_before(user):
        q = gm.graph.call_module(target, (source,))
    user.replace_input_with(current, q)


# ---------------------------------------------------------------------------------------------------------- calibrate
def calibrate(qm: QuantizedModel, data: Any, *, batch_size: int = 8, progress: bool = True,
              check_finite: bool = True) -> QuantizedModel:
    """Calibrate the activation quantizers of ``qm`` on ``data``.

    Runs the float model (all quantizers pass-through, observers recording), in batches of ``batch_size``
    samples on ``qm``'s device, one pass (two for histogram methods). The observers' statistics do not depend
    on ``batch_size``; the float ops before a quantizer may (CPU convolution kernels round a batch of one
    differently from larger batches), which can move a scale by an ulp. Then applies the range adjustments and alignments of the plan and the INT32 bias scales.
    Under ``torch.distributed`` (world size > 1) the observers' statistics are reduced across ranks after
    each pass (:func:`qtorch_onnx.distributed.sync_observers`), so every rank gets the scales one process
    would get on the union of the data.

    The user's switches are respected: a quantizer whose observer the user switched off
    (``fq.observer_enabled = False``, :func:`qtorch_onnx.disable_observer`) keeps its parameters; one whose
    fake quantization is off stays off. Afterwards the calibrated observers are frozen (off) and every
    switch is as before.

    Args:
        qm: the prepared model.
        data: any form accepted by :func:`qtorch_onnx.data.to_samples`.
        batch_size: samples per forward pass (only where the model's batch dimension is dynamic).
        progress: show a tqdm progress bar.
        check_finite: raise DataError when a calibration input holds NaN/Inf.

    Returns:
        ``qm`` (modified in place).

    Raises:
        DataError: empty data, wrong input names/shapes/dtypes, NaN/Inf in inputs or in an activation.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    samples = _data.to_samples(data, qm.input_specs)
    if check_finite:
        _data.check_finite(samples, qm.input_specs)
    fqs = qm.quantizers()
    observed = [fq for fq in fqs.values() if fq.calibratable]
    skipped = {k for k, fq in fqs.items() if fq.role == "activation" and fq.observer is not None and not fq.calibratable}
    for fq in observed:
        fq.observer.reset()
    device = qm.device
    previous = {name: (fq.fake_quant_enabled, fq._observer_enabled, fq._observer_auto_off) for name, fq in fqs.items()}
    for fq in fqs.values():  # the float model, observers of the calibrated quantizers on
        fq.fake_quant_enabled = False
        fq._observer_enabled = False
    for fq in observed:
        fq._observer_enabled = True
    passes = 2 if any(getattr(fq.observer, "needs_second_pass", False) for fq in observed) else 1
    was_training = qm.training
    qm.eval()
    from .distributed import check_same_graph, is_distributed, sync_observers

    if is_distributed():
        check_same_graph(qm)  # every rank must calibrate the same graph and quantizers
    try:
        with torch.no_grad():
            for p in range(passes):
                if p == 1:
                    for fq in observed:
                        if getattr(fq.observer, "needs_second_pass", False):
                            fq.observer.start_second_pass()
                batch_list = list(_data.batches(samples, qm.input_specs, batch_size))
                desc = "calibrate" if passes == 1 else f"calibrate pass {p + 1}/{passes}"
                for batch in tqdm(batch_list, desc=desc, disable=not progress, leave=False):
                    qm(*(t.to(device) for t in batch))
                if sync_observers is not None:  # a no-op unless torch.distributed runs with world size > 1
                    sync_observers({k: fq.observer for k, fq in fqs.items() if fq.calibratable and fq._observer_enabled})
    finally:
        qm.train(was_training)
        for name, fq in fqs.items():
            fq.fake_quant_enabled, fq._observer_enabled, fq._observer_auto_off = previous[name]
    finalize_qparams(qm, skip=skipped)
    for fq in observed:  # statistics frozen; a later calibrate() may use them again
        fq._observer_enabled = False
        fq._observer_auto_off = True
    qm.stage_times["calibrate"] = time.perf_counter() - t0
    return qm


def finalize_qparams(qm: QuantizedModel, skip=()) -> None:
    """Compute activation qparams from observers, then apply range_from, fixed ranges, overrides, sharing and
    INT32 bias scales (docs/numerics.md sections 1-2). Quantizers in ``skip`` (keys) keep their parameters."""
    fqs = qm.quantizers()
    specs = qm.plan.specs
    skip = set(skip)
    ranges: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for name, fq in fqs.items():
        if fq.observer is not None and fq.role == "activation" and name not in skip:
            ranges[name] = fq.observer.compute_range()
    for name, fq in fqs.items():
        spec = specs[name]
        if fq.role != "activation" or not fq.needs_calibration or name in skip:
            continue
        if spec.fixed_range is not None:
            fq.compute_qparams_from_range(torch.tensor(spec.fixed_range[0], dtype=torch.float64),
                                          torch.tensor(spec.fixed_range[1], dtype=torch.float64))
        elif spec.range_from is not None and spec.range_from in ranges and not qm.config.power_of_two:
            fq.compute_qparams_from_range(*ranges[spec.range_from])
        elif fq.observer is not None:
            fq.finish_calibration()
        _apply_overrides(fq, spec)
    for name, fq in fqs.items():
        spec = specs[name]
        if spec.share_with is not None and spec.share_with in fqs:
            src = fqs[spec.share_with]
            fq.set_qparams(src.scale, src.zero_point)
    for name, fq in fqs.items():
        spec = specs[name]
        if spec.bias_of is not None:
            x, w = spec.bias_of
            if fq.bias_sources is None:
                fq.set_bias_sources(fqs[x], fqs[w])
            fq.refresh_qparams()
    for name, fq in fqs.items():
        if fq.needs_calibration and not fq.calibrated and name not in skip:
            raise DataError(f"quantizer on tensor {name!r} was never calibrated (the calibration data did not reach it)")


def _apply_overrides(fq: FakeQuantize, spec: QuantSpec) -> None:
    ov = dict(spec.overrides)
    if "scale" in ov:
        fq.set_qparams(torch.as_tensor(ov["scale"], dtype=torch.float32),
                       torch.as_tensor(ov.get("zero_point", 0), dtype=torch.int64))
    elif "rmin" in ov or "rmax" in ov:
        fq.compute_qparams_from_range(torch.as_tensor(ov.get("rmin", 0.0), dtype=torch.float64),
                                      torch.as_tensor(ov.get("rmax", 0.0), dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------- Quark API
class ModelQuantizer:
    """Quark-compatible entry point: ``ModelQuantizer(config).quantize_model(input, output, data_reader)``.

    Args:
        config: a ``Config`` (``global_quant_config=QuantizationConfig(...)``), a ``QuantizationConfig``, or a
            named configuration string. Validated here; never mutated.
    """

    def __init__(self, config: Any) -> None:
        self.config = copy.deepcopy(config) if not isinstance(config, str) else config
        self.resolved = resolve(self.config)
        self.quantized_model: Optional[QuantizedModel] = None

    def quantize_model(self, model_input: ModelLike, model_output: Optional[Union[str, os.PathLike]] = None,
                       calibration_data_reader: Any = None, calibration_data_path: Optional[str] = None,
                       *, device: Union[str, torch.device, None] = None, progress: bool = True
                       ) -> Optional[onnx.ModelProto]:
        """Quantize ``model_input`` and write ``model_output`` (atomically), or return the ModelProto.

        The pipeline of this quantizer's configuration: prepare (normalize, graph optimization with
        ``optimize_model``, CLE with ``include_cle``, lift, placement), calibration, fast finetune
        (``include_fast_ft``) or automatic mixed precision (``include_auto_mp`` with a target), export.
        The quantized module stays available as ``self.quantized_model``.

        Args:
            model_input: path of the float ONNX model, or an ``onnx.ModelProto`` (never modified).
            model_output: path to write (atomically; ``<file>.data`` beside it with
                ``use_external_data_format``), or None to only return the model.
            calibration_data_reader: an ONNX Runtime ``CalibrationDataReader`` (``get_next()``; read once, for
                calibration and fast finetune), an iterable of ``{input name: array}`` dicts (or arrays for a
                single-input model), or a torch ``DataLoader``.
            calibration_data_path: a folder of ``.npy`` / ``.npz`` samples, used when no reader is given.
            device: torch device for calibration and the algorithms (``"cuda"``, ``"cpu"``); default CPU.
            progress: progress bars for calibration and the algorithms.

        Returns:
            The exported ``onnx.ModelProto`` when ``model_output`` is None, else None.

        Raises:
            DataError: calibration (or fast finetune, automatic mixed precision) is needed and no data was
                given, or the data does not match the model's inputs (names the input and the shapes).
            ModelError / UnsupportedOpsError: the model cannot be read or lifted.
            ExportError: as :func:`qtorch_onnx.export`.
        """
        from .export import export

        amp = self.resolved.auto_mixprecision
        if amp is not None and (amp.l2_target is not None or amp.top1_acc_target is not None):
            return self._quantize_auto_mp(model_input, model_output, calibration_data_reader, calibration_data_path,
                                          device=device, progress=progress)
        qm = prepare(model_input, self.resolved, device=device)
        data = calibration_data_reader if calibration_data_reader is not None else calibration_data_path
        if data is not None:  # a data reader is an iterator: read it once, for calibration and fast finetune
            data = _data.to_samples(data, qm.input_specs)
        if any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation"):
            if data is None:
                raise DataError("this configuration calibrates activations: give calibration_data_reader "
                                "or calibration_data_path")
            calibrate(qm, data, progress=progress)
        else:
            qm.set_mode("quantize")
        if self.resolved.fast_finetune is not None:
            if data is None:
                raise DataError("fast finetune (include_fast_ft / FastFinetune) needs data: give "
                                "calibration_data_reader or calibration_data_path")
            from .algorithms import fast_finetune

            fast_finetune(qm, data, self.resolved.fast_finetune, progress=progress)
        self.quantized_model = qm
        proto = export(qm, model_output)
        return None if model_output is not None else proto

    def _quantize_auto_mp(self, model_input, model_output, reader, path, *, device, progress):
        """Automatic mixed precision (AutoMixprecision with L2Target or Top1AccTarget): the wide configuration
        is this one; insensitive layers of TargetOpType move to Act/WeightTargetQuantType while the target
        holds (:func:`qtorch_onnx.algorithms.auto_mixed_precision`), then fast finetune if configured."""
        from .algorithms import auto_mixed_precision, fast_finetune
        from .export import export
        from .lift import load_model

        amp = self.resolved.auto_mixprecision
        data = reader if reader is not None else path
        if data is None:
            raise DataError("automatic mixed precision (AutoMixprecision with L2Target/Top1AccTarget) needs data: "
                            "give calibration_data_reader or calibration_data_path")
        proto = load_model(model_input)
        samples = _data.to_samples(data, _data.input_specs(proto))
        wide = dataclasses.replace(self.resolved, auto_mixprecision=None)
        top1 = amp.top1_acc_target is not None
        plan, qm, result = auto_mixed_precision(
            proto, samples, wide=wide, narrow=(amp.act_target_quant_type, amp.weight_target_quant_type),
            target=amp.top1_acc_target if top1 else amp.l2_target, metric="top1" if top1 else "l2",
            evaluate_function=amp.evaluate_function if top1 else None, output_index=amp.output_index,
            target_op_type=amp.target_op_type, dual_quant_nodes=amp.dual_quant_nodes, device=device,
            progress=progress)
        if self.resolved.fast_finetune is not None:
            fast_finetune(qm, samples, self.resolved.fast_finetune, progress=progress)
        self.quantized_model = qm
        self.mixed_precision_plan = plan
        out = export(qm, model_output)
        return None if model_output is not None else out
