"""Training contract of a prepared model: trainable initializers, quantizer switches, learnable scales,
the layer view algorithms iterate over, and save / load.

Every float initializer of the ONNX model a user could train (Conv / ConvTranspose / Gemm / MatMul weights
and biases, constant operands of Add / Sub / Mul / Div, normalization scales and biases, Gather tables, PRelu
slopes) is an ``nn.Parameter`` of the prepared module, found by its ONNX name with
:meth:`~qtorch_onnx.model.QuantizedModel.parameter`; export writes the live values (ARCHITECTURE.md,
"Training contract")::

    qm = qo.prepare("model.onnx", "A8W8"); qo.calibrate(qm, data)
    qo.learn_scales(qm)                                   # LSQ / LSQ+ scales and zero points
    opt = torch.optim.Adam(qm.parameters(), 1e-4)
    with qo.observers_disabled(qm): ...                   # model-wide switches, torch.ao names
    for layer in qm.layers(): layer.name, layer.weight, layer.weight_quantizer
    qo.save(qm, "model.qtorch"); qm2 = qo.load("model.qtorch")
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import onnx
import torch
from torch import nn

from .errors import ConfigError, ExportError, ModelError
from .fakequant import FakeQuantize, WeightRounding

if TYPE_CHECKING:  # pragma: no cover
    from .model import QuantizedModel

__all__ = [
    "TRAINABLE_INPUTS", "trainable_initializers", "make_trainable", "QuantLayer", "LAYER_OP_TYPES",
    "learn_scales", "enable_observer", "disable_observer", "enable_fake_quant", "disable_fake_quant",
    "observers_disabled", "fake_quant_disabled", "save", "load",
]

#: op type -> input slots whose float initializers are trainable (None: every input)
TRAINABLE_INPUTS: Dict[str, Optional[Tuple[int, ...]]] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (0, 1, 2), "MatMul": (0, 1),
    "Add": None, "Sub": None, "Mul": None, "Div": None,
    "LayerNormalization": (1, 2), "InstanceNormalization": (1, 2), "BatchNormalization": (1, 2),
    "GroupNormalization": (1, 2), "RMSNormalization": (1,), "SimplifiedLayerNormalization": (1,),
    "SkipLayerNormalization": (2, 3, 4), "Gather": (0,), "PRelu": (1,),
}

#: op types :meth:`QuantizedModel.layers` yields (compute layers and norms)
LAYER_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul", "LayerNormalization", "InstanceNormalization",
                  "BatchNormalization", "GroupNormalization", "RMSNormalization", "Gather")

_ONNX_TORCH_DTYPE = {
    onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.DOUBLE: torch.float64, onnx.TensorProto.BFLOAT16: torch.bfloat16,
}


# ------------------------------------------------------------------------------------------------ parameters
def trainable_initializers(info) -> List[str]:
    """Names of the float initializers a user could train, in graph order.

    Args:
        info: the lifted model's :class:`~qtorch_onnx.lift.tensor_map.ModelInfo` (``gm.tensor_map.graph``).
    """
    out: Dict[str, None] = {}
    for node in info.nodes.values():
        slots = TRAINABLE_INPUTS.get(node.op_type)
        if node.op_type not in TRAINABLE_INPUTS:
            continue
        for k, name in enumerate(node.inputs):
            if not name or (slots is not None and k not in slots):
                continue
            t = info.tensors.get(name)
            if t is not None and t.is_initializer and t.elem_type in _ONNX_TORCH_DTYPE:
                out[name] = None
    return list(out)


def _owner(gm: nn.Module, path: str) -> Tuple[nn.Module, str]:
    mod_path, _, attr = path.rpartition(".")
    return (gm.get_submodule(mod_path) if mod_path else gm), attr


def _as_parameter(module: nn.Module, attr: str) -> Optional[nn.Parameter]:
    """Make ``module.<attr>`` (a float buffer or parameter) an ``nn.Parameter`` that requires grad."""
    if attr in module._parameters and module._parameters[attr] is not None:
        p = module._parameters[attr]
        p.requires_grad_(p.is_floating_point())
        return p
    if attr in module._buffers and module._buffers[attr] is not None and module._buffers[attr].is_floating_point():
        buf = module._buffers.pop(attr)
        p = nn.Parameter(buf.detach().clone(), requires_grad=True)
        module.register_parameter(attr, p)
        return p
    return None


def make_trainable(gm: torch.fx.GraphModule) -> Dict[str, List[Tuple[str, str]]]:
    """Turn every trainable float initializer of a lifted module into an ``nn.Parameter`` (in place).

    Initializers that the lifter keeps as buffers read through ``get_attr`` nodes (MatMul / element-wise
    operands, normalization scales) become parameters under the same attribute name; module parameters
    (Conv, Gemm) get ``requires_grad``. An initializer held by several modules in the same layout is tied:
    they share one Parameter, so training keeps them equal (export writes one tensor).

    Args:
        gm: from :func:`qtorch_onnx.lift.lift` (needs ``gm.tensor_map``).

    Returns:
        ONNX initializer name -> ``[(module path, attribute), ...]`` of the parameter(s) holding it.
    """
    tm = gm.tensor_map
    out: Dict[str, List[Tuple[str, str]]] = {}
    for name in trainable_initializers(tm.graph):
        if name not in tm:
            continue
        locs: List[Tuple[str, str]] = []
        first: Optional[Tuple[nn.Parameter, Any]] = None
        for ref in tm.refs(name):
            if ref.kind == "node" and ref.scope is None:
                node = tm.fx_node(gm, ref.node_name)
                if node.op != "get_attr":
                    continue
                module, attr = _owner(gm, str(node.target))
                path = str(node.target)
                perm = None
            elif ref.kind == "param":
                module, attr = gm.get_submodule(ref.module), ref.attr
                path = f"{ref.module}.{ref.attr}" if ref.module else ref.attr
                perm = ref.perm
            else:
                continue
            p = _as_parameter(module, attr)
            if p is None:
                continue
            if first is not None and first[1] == perm and first[0].shape == p.shape and first[0].dtype == p.dtype \
                    and first[0] is not p and torch.equal(first[0].detach(), p.detach()):
                module._parameters[attr] = first[0]  # tie copies of one initializer
            elif first is None:
                first = (p, perm)
            locs.append((path.rpartition(".")[0], attr))
        if locs:
            out[name] = locs
    return out


def live_value(module: nn.Module, attr: str) -> torch.Tensor:
    """The trainable tensor behind ``module.<attr>``: the original of a parametrized (quantized) parameter,
    else the attribute itself."""
    if hasattr(module, "parametrizations") and attr in module.parametrizations:
        return module.parametrizations[attr].original
    return getattr(module, attr)


def to_onnx_layout(value: torch.Tensor, perm: Optional[Tuple[int, ...]], onnx_shape: Tuple[int, ...]) -> torch.Tensor:
    """A parameter held as ``onnx_value.permute(perm).reshape(param.shape)`` back in the ONNX layout."""
    if perm:
        value = value.reshape([onnx_shape[i] for i in perm]).permute(*np.argsort(perm).tolist())
    return value.reshape(onnx_shape)


def initializer_locations(qm: "QuantizedModel", name: str) -> List[Tuple[nn.Module, str, Optional[Tuple[int, ...]]]]:
    """Where initializer ``name`` lives in ``qm``: ``[(module, attribute, perm), ...]`` (params and get_attr)."""
    tm, gm = qm.tensor_map, qm.gm
    if name not in tm:
        return []
    out = []
    for ref in tm.refs(name):
        if ref.kind == "param":
            out.append((gm.get_submodule(ref.module), ref.attr, ref.perm))
        elif ref.kind == "node" and ref.scope is None:
            node = tm.fx_node(gm, ref.node_name)
            if node.op == "get_attr":
                module, attr = _owner(gm, str(node.target))
                out.append((module, attr, None))
    return out


def live_initializers(qm: "QuantizedModel", *, check: bool = True) -> Dict[str, torch.Tensor]:
    """Every float initializer the torch model holds as a tensor, live (after training), in ONNX layout and
    dtype, detached on the CPU.

    Raises:
        ExportError: (``check``) a parameter whose shape or dtype no longer matches its ONNX initializer
            (names the tensor, the module attribute, expected and found).
    """
    out: Dict[str, torch.Tensor] = {}
    inits = {t.name: t for t in qm.onnx_model.graph.initializer}
    for name, init in inits.items():
        if init.data_type not in _ONNX_TORCH_DTYPE:
            continue
        for module, attr, perm in initializer_locations(qm, name):
            value = live_value(module, attr)
            if not isinstance(value, torch.Tensor):
                continue
            shape = tuple(init.dims)
            want = _ONNX_TORCH_DTYPE[init.data_type]
            if check and (value.dtype != want or value.numel() != int(np.prod(shape, dtype=np.int64))):
                raise ExportError(
                    f"initializer {name!r} (held by {type(module).__name__}.{attr}): the parameter is now "
                    f"{value.dtype} {tuple(value.shape)}, the ONNX initializer is {want} {shape}; a trained "
                    "parameter must keep its ONNX shape and dtype (cast or reshape it back before export)")
            out[name] = to_onnx_layout(value.detach().cpu(), perm, shape).contiguous()
            break
    return out


# ------------------------------------------------------------------------------------------------ layers
@dataclass
class QuantLayer:
    """One quantized compute layer of a prepared model (:meth:`QuantizedModel.layers`).

    Attributes:
        name: ONNX node name. op_type: ONNX op type (``"Conv"``, ``"MatMul"``...).
        module: the torch submodule that runs the node (its fx ``call_module`` target), or None.
        weight / bias: the trainable ``nn.Parameter`` of the node's weight / bias initializer (the float
            value, before quantization), or None (an attention MatMul has two activations and no weight).
        input_quantizers: quantizers the node's activation inputs pass through, in input order (a
            consumer-side quantizer for this node replaces or follows the tensor's own).
        weight_quantizer / bias_quantizer / output_quantizer: the FakeQuantize on the weight, bias and (first)
            output tensor, or None.
        inputs / outputs: the node's ONNX input / output tensor names.
    """

    name: str
    op_type: str
    module: Optional[nn.Module]
    weight: Optional[nn.Parameter]
    bias: Optional[nn.Parameter]
    input_quantizers: List[FakeQuantize] = field(default_factory=list)
    weight_quantizer: Optional[FakeQuantize] = None
    bias_quantizer: Optional[FakeQuantize] = None
    output_quantizer: Optional[FakeQuantize] = None
    inputs: Tuple[str, ...] = ()
    outputs: Tuple[str, ...] = ()


def _weight_slots(op_type: str) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(weight slots, bias slots) of an op type's inputs."""
    if op_type in ("Conv", "ConvTranspose"):
        return (1,), (2,)
    if op_type == "Gemm":
        return (1, 0), (2,)
    if op_type == "MatMul":
        return (1, 0), ()
    if op_type == "Gather":
        return (0,), ()
    return (1,), (2,)  # normalizations: scale, bias


def iter_layers(qm: "QuantizedModel", op_types=None) -> Iterator[QuantLayer]:
    """The layers of ``qm`` in graph order (see :meth:`QuantizedModel.layers`)."""
    ops = tuple(op_types) if op_types is not None else LAYER_OP_TYPES
    info = qm.tensor_map.graph
    fqs = qm.quantizers()
    inits = set(qm.plan.info.initializers) | {t.name for t in qm.onnx_model.graph.initializer}
    for node in info.nodes.values():
        if node.op_type not in ops:
            continue
        wslots, bslots = _weight_slots(node.op_type)
        weight_name = next((node.inputs[k] for k in wslots if k < len(node.inputs) and node.inputs[k] in inits), None)
        bias_name = next((node.inputs[k] for k in bslots if k < len(node.inputs) and node.inputs[k] in inits), None)
        if node.op_type == "Gather" and weight_name is None:
            continue
        in_q: List[FakeQuantize] = []
        for k, t in enumerate(node.inputs):
            if not t or t in inits:
                continue
            edge = fqs.get(f"{t} -> {node.name}")
            own = fqs.get(t)
            if own is not None and (edge is None or edge.chained):
                in_q.append(own)
            if edge is not None:
                in_q.append(edge)
        module = None
        if node.module:
            try:
                module = qm.gm.get_submodule(node.module)
            except AttributeError:
                module = None
        out_q = fqs.get(node.outputs[0]) if node.outputs else None
        yield QuantLayer(
            name=node.name, op_type=node.op_type, module=module,
            weight=qm.parameter(weight_name) if weight_name else None,
            bias=qm.parameter(bias_name) if bias_name else None,
            input_quantizers=in_q,
            weight_quantizer=(fqs.get(f"{weight_name} -> {node.name}") or fqs.get(weight_name)) if weight_name else None,
            bias_quantizer=(fqs.get(f"{bias_name} -> {node.name}") or fqs.get(bias_name)) if bias_name else None,
            output_quantizer=out_q, inputs=tuple(node.inputs), outputs=tuple(node.outputs))


# ------------------------------------------------------------------------------------------------ switches
def _quantizers(qm: nn.Module, keys=None) -> List[FakeQuantize]:
    fqs = [m for m in qm.modules() if isinstance(m, FakeQuantize)]
    if keys is None:
        return fqs
    keys = set([keys] if isinstance(keys, str) else keys)
    known = {fq.key for fq in fqs}
    missing = keys - known
    if missing:
        from .errors import closest

        m = sorted(missing)[0]
        raise ConfigError(f"no quantizer {m!r} in the model{closest(m, known)}")
    return [fq for fq in fqs if fq.key in keys]


def enable_observer(qm: nn.Module, keys=None) -> None:
    """Switch observers on (activations) / live-value tracking on (weights), for all quantizers or ``keys``
    (quantizer keys as :meth:`QuantizedModel.quantizers`). Raises ConfigError for an unknown key."""
    for fq in _quantizers(qm, keys):
        fq.observer_enabled = True


def disable_observer(qm: nn.Module, keys=None) -> None:
    """Switch observers off (freeze the statistics / qparams); :func:`qtorch_onnx.calibrate` then leaves those
    quantizers as they are. Raises ConfigError for an unknown key."""
    for fq in _quantizers(qm, keys):
        fq.observer_enabled = False


def enable_fake_quant(qm: nn.Module, keys=None) -> None:
    """Switch fake quantization on for all quantizers or ``keys``. Raises ConfigError for an unknown key."""
    for fq in _quantizers(qm, keys):
        fq.fake_quant_enabled = True


def disable_fake_quant(qm: nn.Module, keys=None) -> None:
    """Switch fake quantization off (those tensors stay float) for all quantizers or ``keys``; calibrate()
    does not switch it back on. Raises ConfigError for an unknown key."""
    for fq in _quantizers(qm, keys):
        fq.fake_quant_enabled = False


@contextlib.contextmanager
def observers_disabled(qm: nn.Module, keys=None):
    """Context manager: observers off inside, each quantizer's previous switch restored on exit."""
    fqs = _quantizers(qm, keys)
    saved = [(fq._observer_enabled, fq._observer_auto_off) for fq in fqs]
    try:
        for fq in fqs:
            fq._observer_enabled = False
        yield qm
    finally:
        for fq, (on, auto) in zip(fqs, saved):
            fq._observer_enabled, fq._observer_auto_off = on, auto


@contextlib.contextmanager
def fake_quant_disabled(qm: nn.Module, keys=None):
    """Context manager: the float model inside (fake quantization off), previous switches restored on exit."""
    fqs = _quantizers(qm, keys)
    saved = [fq.fake_quant_enabled for fq in fqs]
    try:
        for fq in fqs:
            fq.fake_quant_enabled = False
        yield qm
    finally:
        for fq, on in zip(fqs, saved):
            fq.fake_quant_enabled = on


def learn_scales(qm: nn.Module, enabled: bool = True, keys=None) -> List[str]:
    """Make every integer quantizer's scale (and asymmetric zero point) a trainable parameter, or fixed again.

    LSQ gradients with the ``1/sqrt(N * Q_p)`` gradient scale (Esser et al. 2020); zero points LSQ+ (Bhalgat
    et al. 2020); power-of-two scales learned as ``log2_scale`` and rounded in the forward (export writes the
    same power of two). INT32 bias scales stay derived from the live input and weight scales; block formats'
    shared exponents stay derived from the data. See :meth:`FakeQuantize.set_learnable`.

    Call it after :func:`qtorch_onnx.calibrate` (the learned scales start from the calibrated ones), then
    build the optimizer (the new parameters appear in ``qm.parameters()``).

    Args:
        qm: a prepared model. enabled: True to learn, False to freeze (the learned values are kept).
        keys: restrict to these quantizer keys.

    Returns:
        The keys of the quantizers whose state changed.

    Raises:
        ConfigError: an unknown key, or a quantizer asked to learn before it was calibrated.
    """
    changed = []
    for fq in _quantizers(qm, keys):
        if fq.learnable == bool(enabled):
            continue
        before = fq.learnable
        if enabled and not fq.calibrated and fq.bias_sources is None and fq.needs_calibration:
            raise ConfigError(f"learn_scales: quantizer {fq.key!r} is not calibrated yet; run calibrate() first")
        fq.set_learnable(enabled)
        if fq.learnable != before:
            changed.append(fq.key)
    return changed


# ------------------------------------------------------------------------------------------------ save / load
_SAVE_VERSION = 1
_FQ_ATTRS = ("_observer_enabled", "_observer_auto_off", "fake_quant_enabled", "calibrated", "float_form", "backend",
             "qdq_domain", "weight_storage", "qparam_shapes")


def _graph_digest(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def save(qm: "QuantizedModel", path: Union[str, os.PathLike]) -> None:
    """Save a prepared, calibrated or trained model: its ONNX graph, plan and configuration (the spec), each
    quantizer's switches, learnable state and rounding hook, and the ``state_dict`` (weights, scales, zero
    points, learned parameters). Written atomically; :func:`load` restores bit-identical outputs.

    The file is a ``torch.save`` archive readable with ``weights_only=True`` (only tensors, plain values and
    this project's frozen config / format dataclasses).

    Raises:
        ConfigError: a rounding hook whose class is not importable by its qualified name.
    """
    from .export import save_bytes_atomic

    quantizers = {}
    for key, fq in qm.quantizers().items():
        entry: Dict[str, Any] = {a: getattr(fq, a) for a in _FQ_ATTRS}
        entry["learnable"] = fq.learnable
        if fq.rounding is not None:
            cls = type(fq.rounding)
            entry["rounding"] = {"class": f"{cls.__module__}:{cls.__qualname__}", "config": fq.rounding.config(),
                                 "training": fq.rounding.training}
        quantizers[key] = entry
    specs = {k: _spec_to_dict(s) for k, s in qm.plan.specs.items()}
    config = _config_to_dict(qm.config)
    blob = {
        "format": "qtorch-onnx prepared model", "version": _SAVE_VERSION,
        "onnx": qm.onnx_model.SerializeToString(), "digest": _graph_digest(qm.onnx_model),
        "specs": specs, "config": config, "quantizers": quantizers,
        "state_dict": {k: v.detach().cpu() for k, v in qm.state_dict().items()},
        # what bias_correction subtracted per layer, so that correcting the loaded model again replaces it
        "bias_corrections": {k: v.detach().cpu() for k, v in qm.applied_bias_corrections.items()},
    }
    buf = io.BytesIO()
    torch.save(blob, buf)
    save_bytes_atomic(buf.getvalue(), path)


def load(path: Union[str, os.PathLike], model: Union[str, os.PathLike, onnx.ModelProto, None] = None, *,
         device: Union[str, torch.device, None] = None) -> "QuantizedModel":
    """Load a model written by :func:`save`.

    Args:
        path: the saved file.
        model: optionally, the ONNX model the saved state belongs to (path or ModelProto): it must be the graph
            that was saved (checked after normalization), else ModelError.
        device: move the loaded model there.

    Raises:
        ModelError: not a saved qtorch-onnx model, an unknown version, or ``model`` is a different graph.
        ConfigError: a rounding hook class outside ``qtorch_onnx`` or one that cannot be imported.
    """
    from .config.internal import ResolvedConfig  # noqa: F401  (allow-listed below)
    from .lift import lift
    from .placement import Plan
    from .quantizer import attach_quantizers

    with open(os.fspath(path), "rb") as f:
        data = f.read()
    try:
        blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelError(f"{os.fspath(path)!r} is not a model saved by qtorch_onnx.save ({exc})") from exc
    if not isinstance(blob, dict) or blob.get("format") != "qtorch-onnx prepared model":
        raise ModelError(f"{os.fspath(path)!r} is not a model saved by qtorch_onnx.save")
    if blob.get("version") != _SAVE_VERSION:
        raise ModelError(f"{os.fspath(path)!r}: saved with format version {blob.get('version')}, this qtorch_onnx "
                         f"reads version {_SAVE_VERSION}")
    proto = onnx.ModelProto()
    proto.ParseFromString(blob["onnx"])
    cfg = _config_from_dict(blob["config"])
    if model is not None:
        from .lift import load_model, normalize_and_fuse

        given = load_model(model)
        normalized, _, _ = normalize_and_fuse(given, fold_batchnorm=True, optimize=cfg.graph.optimize_model)
        if _graph_digest(normalized) != blob["digest"] and _graph_digest(given) != blob["digest"]:
            raise ModelError(f"{os.fspath(path)!r} holds the state of a different ONNX graph than the model given "
                             f"(graph {given.graph.name!r}); load it without `model`, or save this model's own state")
    gm = lift(proto, fold_batchnorm=True)
    make_trainable(gm)
    specs = {k: _spec_from_dict(d) for k, d in blob["specs"].items()}
    plan = Plan(specs=specs, info=gm.tensor_map.graph)
    qm = attach_quantizers(gm, plan, cfg)
    fqs = qm.quantizers()
    missing = set(blob["quantizers"]) - set(fqs)
    if missing:
        raise ModelError(f"{os.fspath(path)!r}: saved quantizers {sorted(missing)[:3]} have no place in the rebuilt "
                         "model (saved by an incompatible qtorch_onnx version?)")
    for key, entry in blob["quantizers"].items():
        fq = fqs[key]
        if entry["learnable"]:
            fq.set_learnable(True)
        if "rounding" in entry:
            fq.set_rounding(_rounding_from_saved(entry["rounding"], blob["state_dict"], key, qm))
        for a in _FQ_ATTRS:
            setattr(fq, a, entry[a]) if not a.startswith("_") else fq.__dict__.__setitem__(a, entry[a])
    _wire_bias_sources(qm)
    qm.load_state_dict(blob["state_dict"], strict=True)
    if blob.get("bias_corrections"):  # absent in files saved before bias correction existed
        qm.applied_bias_corrections.update(blob["bias_corrections"])
    if device is not None:
        qm.to(device)
    return qm


def _wire_bias_sources(qm: "QuantizedModel") -> None:
    fqs = qm.quantizers()
    for key, spec in qm.plan.specs.items():
        if spec.bias_of is not None and key in fqs:
            x, w = spec.bias_of
            if x in fqs and w in fqs:
                fqs[key].set_bias_sources(fqs[x], fqs[w])


def _rounding_from_saved(entry, state_dict, key, qm) -> WeightRounding:
    mod_name, _, qual = entry["class"].partition(":")
    if not (mod_name == "qtorch_onnx" or mod_name.startswith("qtorch_onnx.")):
        raise ConfigError(f"saved quantizer {key!r} uses rounding hook {entry['class']!r}, outside qtorch_onnx; "
                          "rebuild it yourself and call FakeQuantize.set_rounding after loading")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"saved quantizer {key!r}: rounding hook class {entry['class']!r} not found ({exc})") from exc
    fq_prefix = None
    for name, m in qm.named_modules():
        if isinstance(m, FakeQuantize) and m.key == key:
            fq_prefix = name + ".rounding."
            break
    state = {k[len(fq_prefix):]: v for k, v in state_dict.items() if fq_prefix and k.startswith(fq_prefix)}
    hook = obj.from_saved(entry["config"], state)
    hook.train(entry.get("training", False))
    return hook


def _fmt_to_dict(fmt) -> Dict[str, Any]:
    import dataclasses

    return {"class": type(fmt).__name__, **dataclasses.asdict(fmt)}


def _fmt_from_dict(d: Dict[str, Any]):
    from .formats import spec as fspec

    d = dict(d)
    cls = fspec.FORMAT_CLASSES[d.pop("class")]
    return cls(**d)


def _spec_to_dict(spec) -> Dict[str, Any]:
    import dataclasses

    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    d["fmt"] = _fmt_to_dict(spec.fmt)
    d["overrides"] = [list(kv) for kv in spec.overrides]
    return d


def _spec_from_dict(d: Dict[str, Any]):
    from .placement import QuantSpec

    d = dict(d)
    d["fmt"] = _fmt_from_dict(d["fmt"])
    d["overrides"] = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in d["overrides"])
    for k in ("bias_of", "fixed_range"):
        if d.get(k) is not None:
            d[k] = tuple(d[k])
    return QuantSpec(**d)


def _plain(v):
    import dataclasses
    import enum

    from .formats.spec import is_format

    if is_format(v):
        return {"__format__": _fmt_to_dict(v)}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"__dataclass__": type(v).__name__,
                "fields": {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, enum.Enum):
        return _plain(v.value)
    if isinstance(v, dict) or hasattr(v, "items") and not isinstance(v, (str, bytes)):
        return {"__dict__": [[_plain(k), _plain(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return {"__tuple__": [_plain(x) for x in v]} if isinstance(v, tuple) else [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if callable(v):
        return None  # EvaluateFunction and other callables are not saved
    raise ConfigError(f"save: configuration value of type {type(v).__name__} cannot be saved")


def _unplain(v):
    from .config import internal

    if isinstance(v, dict):
        if "__format__" in v:
            return _fmt_from_dict(v["__format__"])
        if "__dataclass__" in v:
            cls = getattr(internal, v["__dataclass__"])
            kw = {k: _unplain(x) for k, x in v["fields"].items()}
            # ResolvedConfig: saved flat (before the per-concern groups) or grouped; from_flat takes both
            return cls.from_flat(**kw) if cls is internal.ResolvedConfig else cls(**kw)
        if "__dict__" in v:
            return {_unplain(k): _unplain(x) for k, x in v["__dict__"]}
        if "__tuple__" in v:
            return tuple(_unplain(x) for x in v["__tuple__"])
    if isinstance(v, list):
        return [_unplain(x) for x in v]
    return v


def _config_to_dict(cfg) -> Dict[str, Any]:
    return _plain(cfg)


def _config_from_dict(d) -> Any:
    return _unplain(d)
