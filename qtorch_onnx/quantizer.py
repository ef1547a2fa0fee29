"""Preparation: a configuration resolved, the float model lifted (normalized, graph-optimized, CLE), and
FakeQuantize modules placed into it (:func:`prepare`, :func:`attach_quantizers`). The rest of the pipeline:
:mod:`qtorch_onnx.model` (the QuantizedModel), :mod:`qtorch_onnx.calibration`, :mod:`qtorch_onnx.export`, and
Quark's :class:`~qtorch_onnx.model_quantizer.ModelQuantizer`.

Native torch API::

    qm = qtorch_onnx.prepare("model.onnx", qtorch_onnx.get_default_config("A8W8"))
    qtorch_onnx.calibrate(qm, samples)          # progress bar, any device
    y = qm(x); y.sum().backward()               # fake quantization with straight-through gradients
    qtorch_onnx.export(qm, "model.a8w8.onnx")

Quark-compatible API::

    ModelQuantizer(Config(global_quant_config=cfg)).quantize_model("in.onnx", "out.onnx", data_reader)
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn
from torch.nn.utils import parametrize

from . import data as _data
from .config.internal import ResolvedConfig
from .errors import ModelError
from .fakequant import FakeQuantize, ParamQuantizer
from .model import QuantizedModel
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


def _refs(tensor_map: Any, tensor: str) -> list:
    """Locations of an ONNX tensor in the lifted module that can carry a quantizer (fx nodes, parameters)."""
    try:
        refs = tensor_map.refs(tensor)
    except KeyError:
        return []
    return [r for r in refs if r.kind in ("node", "param")]


def _observer_for(spec: QuantSpec, cfg: ResolvedConfig):
    from .observers import make_observer

    fam = spec.fmt.family
    if fam.integer_grid and cfg.calibration.power_of_two:
        return make_observer(cfg.calibration.method, name=spec.tensor, fmt=spec.fmt, symmetric=spec.symmetric)
    method = cfg.calibration.method
    opts: Dict[str, Any] = {"name": spec.tensor}
    if method == "MinMax":
        opts.update(moving_average=cfg.calibration.moving_average, averaging_constant=cfg.calibration.moving_average_constant)
    elif method == "Percentile":
        opts.update(percentile=cfg.calibration.percentile, num_bins=cfg.calibration.num_bins)
    elif method in ("Entropy", "Distribution"):
        opts.update(num_bins=cfg.calibration.num_bins)
    if not fam.integer_grid:  # scaled BF16/FP16 take a plain range
        opts = {"name": spec.tensor}
        method = "MinMax"
    return make_observer(method, **opts)


def _weight_method(spec: QuantSpec, cfg: ResolvedConfig) -> Tuple[str, Dict[str, Any]]:
    """``(observer method, options)`` for an integer weight under Quark's WeightCalibrateMethod: Percentile
    with the configuration's Percentile / NumBins; MinMSE and NonOverflow (PowerOfTwoMethod) with the weight's
    format and symmetry (power-of-two scales)."""
    method = cfg.calibration.weight_method
    if method == "Percentile":
        return method, {"percentile": cfg.calibration.percentile, "num_bins": cfg.calibration.num_bins}
    return method, {"fmt": spec.fmt, "symmetric": spec.symmetric}


def _weight_qparams(fq: FakeQuantize, value: torch.Tensor, onnx_axis: Optional[int]) -> None:
    """Quantization parameters of a weight from its own values (ONNX layout), per tensor or per channel: min /
    max, or the quantizer's WeightCalibrateMethod observers when it has one."""
    if fq.weight_method is not None:
        fq.qparams_by_method(value, onnx_axis)
        return
    # min / max in the value's own dtype, then float64: the same numbers (a min is one of the values, and
    # float32 -> float64 is exact) without a float64 copy of the weight
    v = value.detach()
    if onnx_axis is None:
        rmin, rmax = v.min(), v.max()
    else:
        dims = [d for d in range(v.dim()) if d != onnx_axis]
        rmin, rmax = v.amin(dim=dims), v.amax(dim=dims)
    fq.compute_qparams_from_range(rmin.to(torch.float64), rmax.to(torch.float64))


def _initializer_value(info, tensor: str) -> torch.Tensor:
    from .lift.normalize import is_unloaded, read_initializer

    t = info.initializers[tensor]
    if is_unloaded(t):  # still in its external data file (streaming): read into a new array, no copy
        return torch.from_numpy(np.asarray(read_initializer(t), dtype=np.float32))
    return torch.from_numpy(np.array(numpy_helper.to_array(t), dtype=np.float32, copy=True))


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
    plan = plan_quantization(gm.onnx_model, cfg, gm.tensor_map.aliases, info=gm.tensor_map.graph)
    qm = attach_quantizers(gm, plan, cfg)
    sync_after_rewrites(qm, cle_report)
    qm.cle_report = cle_report
    qm.stage_times["lift"] = t_lift
    qm.stage_times["place"] = time.perf_counter() - t0 - t_lift
    if device is not None:
        qm.to(device)
    return qm


def lift_float(model: ModelLike, cfg: ResolvedConfig):
    """The float model every quantized build starts from: loaded, normalized (BatchNormalization folded),
    graph-optimized when ``cfg.graph.optimize_model`` (:mod:`qtorch_onnx.lift.fusion`), lifted, its float
    initializers made parameters, then :func:`float_rewrites`. Returns ``(gm, cle_report)``; the fusion
    report is ``gm.fusion_report``.

    Raises:
        ModelError / UnsupportedOpsError: as :func:`qtorch_onnx.lift.lift`.
    """
    from .lift import lift, load_model
    from .training import make_trainable

    gm = lift(load_model(model), fold_batchnorm=True, optimize=cfg.graph.optimize_model)
    make_trainable(gm)
    return gm, float_rewrites(gm, cfg)


def float_rewrites(gm: torch.fx.GraphModule, cfg: ResolvedConfig):
    """The float-model transforms the configuration asks for before placement, in place on the lifted model:
    ReplaceClip6Relu, then cross-layer equalization (include_cle). Returns the
    :class:`~qtorch_onnx.algorithms.cle.CLEReport` (None without CLE)."""
    if not (cfg.graph.replace_clip6_relu or cfg.cle is not None):
        return None
    from .algorithms.cle import cross_layer_equalization, replace_clip6_relu

    replaced = replace_clip6_relu(gm) if cfg.graph.replace_clip6_relu else []
    if replaced:  # the ONNX graph changed in place: index it again (placement reads the index)
        gm.tensor_map.graph = gm.tensor_map.graph.rebuilt(gm.onnx_model)
    if cfg.cle is None:
        return None
    report = cross_layer_equalization(gm, cfg.cle)
    report.replaced_clips = replaced
    return report


def sync_after_rewrites(qm: QuantizedModel, cle_report) -> None:
    """Weight qparams (and the INT32 bias scales derived from them) from the weights as :func:`float_rewrites` left
    them. :func:`attach_quantizers` reads the ONNX initializers, which cross-layer equalization does not rewrite (it
    scales the torch parameters), so without this every equalized layer keeps its pre-CLE scale until its first
    forward: EfficientNet-Lite0 A8W8, ``/_blocks.0/_project_conv`` 0.0652 where its equalized weight gives 0.0124.
    Everything that ran the layer's forward first was right; a bias read before its weight was not (fast finetune's
    direct loss then failed its gradient check, and the layer trained by autograd, 5x slower). No-op without CLE
    pairs. ``cle_report``: :func:`float_rewrites`' result (or None)."""
    if cle_report is not None and cle_report.pairs:
        qm.sync_qparams()


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
        fam = spec.fmt.family
        if spec.role == "activation" and not spec.overrides and spec.share_with is None \
                and fam.needs_calibration(spec.scaled):
            observer = _observer_for(spec, cfg)
        param_refs = [r for r in refs if r.kind == "param"]
        torch_axis = spec.axis
        if param_refs and spec.axis is not None and getattr(param_refs[0], "perm", None):
            torch_axis = list(param_refs[0].perm).index(spec.axis)
        fq = FakeQuantize(spec.fmt, tensor_name=tensor, role=spec.role, axis=torch_axis, onnx_axis=spec.axis,
                          symmetric=spec.symmetric, narrow_range=spec.narrow_range, observer=observer, scaled=spec.scaled,
                          power_of_two=cfg.calibration.power_of_two and fam.integer_grid, consumer=spec.consumer,
                          chained=spec.chained)
        if fam.name == "float":
            # BF16: Q/DQ form unless BF16QDQToCast; FP16: Q/DQ form unless scaled (Quark's FP16 Q/DQ
            # ignores the scale, so a scaled FP16 quantizer is written in the Cast form)
            cast = cfg.floats.bf16_qdq_to_cast if spec.fmt.kind == "BF16" else spec.scaled
            fq.float_form = "cast" if cast else "qdq"
        if spec.role == "weight" or (spec.role == "bias" and spec.bias_of is None):
            if spec.overrides:  # TensorQuantOverrides on an initializer: pinned into every qparams computation
                fq.qparam_overrides = dict(spec.overrides)
            if spec.role == "weight" and fam.integer_grid and cfg.calibration.weight_method != "MinMax" \
                    and not (cfg.calibration.weight_method == "NonOverflow" and cfg.calibration.power_of_two):  # that is min/max
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
