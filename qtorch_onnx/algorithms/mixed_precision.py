"""Sensitivity analysis and automatic mixed precision on the torch model.

``sensitivity(qm, data, ...)`` measures, for every quantized layer and candidate (narrow) format, the effect
on the model output of switching that layer alone to the candidate: the layer's weight (and INT32 bias)
quantizers are swapped for the candidate's, its activation inputs pass the candidate's quantizer after their
own (the DualQuantNodes reading). It also gives a one-backward-pass first-order (Taylor / Fisher) estimate
``sum over samples of (g . delta)^2`` (delta: the candidate's change of the layer's inputs and weight, g: the
gradient of the output distance to the float model), and its rank agreement (Spearman) with the measurement.

``auto_mixed_precision(model, data, wide=..., narrow=..., target=...)`` first evaluates all-wide (a target it
misses ends the search: all-wide) and all-narrow (a target it meets ends it: all-narrow), with no sensitivity
pass. Otherwise it sorts the layers by measured sensitivity and searches over how many of the least sensitive
go narrow: the first probes sit where the single-layer effects, added up, put the boundary, then bisection;
then (``fill``) each layer after the first one that broke the target is tried on the chosen mix, one forward
pass each, and the layers that fit are built into the final set.
Every probe is a real mixed model (placed by the layer-wise machinery with exactly those nodes promoted, so
precision boundaries, DualQuantNodes and INT32 biases are as exported), calibrated (from the statistics of the
first build: calibration observes the float model, see ``_Builder``) and evaluated: O(log L) full
evaluations. By default (``verify="onnxruntime"``) each probe is exported and measured in ONNX Runtime against
the float model run there, where the target is checked: the quantizers are bit-exact there but the float
operators between them are not, and near the target that difference decides (the torch emulation of
EfficientNet-Lite0 read 18.113 where ONNX Runtime read 18.051). The emulation serves the sensitivity sweep and
``fill``'s one-by-one screening. Quark 0.13 promotes one node at a time with a full ONNX Runtime pass each:
O(L).

The sensitivity pass is one sweep of the wide model per batch: where a layer's switched quantizers first
change a value, the rest of the graph runs from the live values with that layer switched (bit-identical to a
full pass per layer, about half the node evaluations).

Metrics (lower is better): ``"l2"`` (Quark's: the mean over samples of ``||y_float - y||_2``), ``"cosine"``
(1 - cosine similarity), ``"sqnr"`` (minus the SQNR in dB), ``"kl"`` (KL divergence of softmax outputs),
``"top1"`` with an ``evaluate_function(outputs) -> accuracy`` (the accuracy drop from the float model, as
Quark's ``Top1AccTarget``), or any ``fn(float_outputs, quant_outputs) -> float``. Outputs are given as Quark
gives them: a list over samples of lists of numpy arrays (the output ``OutputIndex``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import data as _data
from ..errors import ConfigError
from ..formats.spec import Format
from ..heap import large_tensor_heap
from ..precision import float32_exact

__all__ = ["sensitivity", "auto_mixed_precision", "SensitivityReport", "MixedPrecisionPlan", "resolve_metric",
           "DEFAULT_TARGET_OPS"]

DEFAULT_TARGET_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
Outputs = List[List[np.ndarray]]


# ------------------------------------------------------------------------------------------------ metrics
def _l2(f: Outputs, q: Outputs) -> float:
    vals = [float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))) for fs, qs in zip(f, q)
            for a, b in zip(fs, qs)]
    return float(np.mean(vals)) if vals else 0.0


def _cosine(f: Outputs, q: Outputs) -> float:
    a = np.concatenate([np.ravel(x).astype(np.float64) for s in f for x in s])
    b = np.concatenate([np.ravel(x).astype(np.float64) for s in q for x in s])
    den = np.linalg.norm(a) * np.linalg.norm(b)
    return float(1.0 - (a @ b) / den) if den > 0 else 0.0


def _sqnr(f: Outputs, q: Outputs) -> float:
    a = np.concatenate([np.ravel(x).astype(np.float64) for s in f for x in s])
    b = np.concatenate([np.ravel(x).astype(np.float64) for s in q for x in s])
    noise = float(np.sum((a - b) ** 2))
    return -10.0 * math.log10(float(np.sum(a ** 2)) / noise) if noise > 0 else -math.inf


def _kl(f: Outputs, q: Outputs) -> float:
    total, n = 0.0, 0
    for fs, qs in zip(f, q):
        for a, b in zip(fs, qs):
            a = np.asarray(a, np.float64).reshape(np.shape(a)[0] if np.ndim(a) > 1 else 1, -1)
            b = np.asarray(b, np.float64).reshape(a.shape)
            pa = np.exp(a - a.max(1, keepdims=True))
            pa /= pa.sum(1, keepdims=True)
            lb = b - b.max(1, keepdims=True)
            lb -= np.log(np.exp(lb).sum(1, keepdims=True))
            la = np.log(np.maximum(pa, 1e-30))
            total += float(np.sum(pa * (la - lb)))
            n += a.shape[0]
    return total / max(1, n)


BUILTIN_METRICS: Dict[str, Callable[[Outputs, Outputs], float]] = {"l2": _l2, "cosine": _cosine, "sqnr": _sqnr,
                                                                   "kl": _kl}


def _call_evaluate(fn: Callable, outputs: Outputs) -> float:
    name = getattr(fn, "__name__", repr(fn))
    try:
        value = fn(outputs)
    except Exception as exc:  # the user's function failed: say which and why
        raise ConfigError(f"AutoMixprecision EvaluateFunction {name!r} raised {type(exc).__name__}: {exc} (it is "
                          "called with the model outputs as Quark passes them: a list over samples of lists of "
                          "numpy arrays)") from exc
    if isinstance(value, (np.ndarray, torch.Tensor)) and np.size(value) == 1:
        value = float(np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value).reshape(()))
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(value)):
        raise ConfigError(f"AutoMixprecision EvaluateFunction {name!r} must return a finite number (the accuracy), "
                          f"returned {value!r}")
    return float(value)


def resolve_metric(metric: Union[str, Callable, None], evaluate_function: Optional[Callable] = None
                   ) -> Tuple[str, Callable[[Outputs, Outputs], float]]:
    """``(name, fn(float_outputs, quant_outputs) -> distance)`` (lower is better).

    Raises:
        ConfigError: an unknown metric name, or ``"top1"`` without ``evaluate_function``.
    """
    if evaluate_function is not None and metric in (None, "top1"):
        def top1_drop(f: Outputs, q: Outputs) -> float:
            return _call_evaluate(evaluate_function, f) - _call_evaluate(evaluate_function, q)

        return "top1", top1_drop
    if metric is None:
        metric = "l2"
    if callable(metric):
        return getattr(metric, "__name__", "user metric"), metric
    if metric == "top1":
        raise ConfigError("metric 'top1' needs evaluate_function (model outputs -> top-1 accuracy)")
    if metric not in BUILTIN_METRICS:
        from ..errors import closest

        raise ConfigError(f"unknown metric {metric!r}{closest(str(metric), BUILTIN_METRICS)}; valid: "
                          f"{', '.join(BUILTIN_METRICS)}, 'top1' (with evaluate_function) or a function")
    return metric, BUILTIN_METRICS[metric]


def _selected(y, output_index: Optional[int]) -> list:
    """The model outputs ``y`` (one, or a tuple / list) that ``output_index`` selects (None: all), as a list.

    Raises:
        ConfigError: ``output_index`` beyond the model's outputs.
    """
    ys = list(y) if isinstance(y, (tuple, list)) else [y]
    if output_index is not None and output_index >= len(ys):
        raise ConfigError(f"AutoMixprecision OutputIndex {output_index} is out of range: the model has "
                          f"{len(ys)} output(s) (valid: 0..{len(ys) - 1})")
    return ys if output_index is None else [ys[output_index]]


def _append_outputs(out: Outputs, y, n: int, sizes: List[int], pos: int, output_index: Optional[int],
                    split: bool) -> int:
    """Append one batch's model output ``y`` to ``out`` as per-sample ``[output]`` numpy lists; returns the index
    of the next sample.

    Raises:
        ConfigError: ``output_index`` beyond the model's outputs.
    """
    sel = _selected(y, output_index)
    if split and n > sizes[pos]:  # split a concatenated batch back into the samples
        start = 0
        while start < n:
            k = sizes[pos]
            out.append([o[start:start + k].float().cpu().numpy() for o in sel])
            start += k
            pos += 1
    else:
        out.append([o.float().cpu().numpy() for o in sel])
        pos += 1
    return pos


def run_outputs(qm, samples, output_index: Optional[int], batch_size: int = 8) -> Outputs:
    """The model's outputs per sample (list over samples of ``[output]`` numpy arrays), in eval mode.

    Raises:
        ConfigError: ``output_index`` beyond the model's outputs.
    """
    specs = qm.input_specs
    out: Outputs = []
    was = qm.training
    qm.eval()
    try:
        with torch.no_grad(), _weights_cached():
            device = qm.device
            dyn = all(s.batch_dynamic for s in specs)
            sizes = [int(s[0].shape[0]) for s in samples]
            pos = 0
            for batch in _data.batches(samples, specs, batch_size if dyn else 1):
                y = qm(*(t.to(device) for t in batch))
                pos = _append_outputs(out, y, int(batch[0].shape[0]), sizes, pos, output_index, dyn)
    finally:
        qm.train(was)
    return out


def _ort_outputs(model, samples, output_index: Optional[int],
                 providers: Sequence[str] = ("CPUExecutionProvider",)) -> Outputs:
    """Per-sample outputs of ONNX model ``model`` (a ModelProto) in ONNX Runtime on ``providers`` (the
    configuration's ``execution_providers``; the project's operator library registered when needed), in the
    form of :func:`run_outputs`."""
    from ..runtime import session

    sess = session(model, providers=providers)
    names = [i.name for i in sess.get_inputs()]
    out: Outputs = []
    for sample in samples:
        ys = sess.run(None, {nm: t.detach().cpu().numpy() for nm, t in zip(names, sample)})
        out.append([np.asarray(y, np.float32) for y in _selected(ys, output_index)])
    return out


def _node_modules(gm, nodes: List[Any]) -> Dict[Any, set]:
    """Per fx node, the ids of the module it calls (or reads an attribute of) and of that module's submodules."""
    out: Dict[Any, set] = {}
    for n in nodes:
        mod = None
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
        elif n.op == "get_attr" and "." in str(n.target):
            mod = gm.get_submodule(str(n.target).rsplit(".", 1)[0])
        out[n] = {id(m) for m in mod.modules()} if mod is not None else set()
    return out


def _branch_point(nodes: List[Any], const: Dict[Any, bool], node_modules: Dict[Any, set], patch: "_Patch"
                  ) -> Tuple[int, List[int]]:
    """Where ``patch`` first changes a result: ``(start, recompute)``, with ``start`` the index in ``nodes`` of the
    first activation (non-constant) node whose value the patch can change (``len(nodes)`` if none) and
    ``recompute`` the constant nodes before it (a swapped weight quantizer and what it feeds) to evaluate again.

    A node is changed directly when it calls (or reads an attribute of) a module that is, or holds, a swapped
    quantizer or the hooked layer module, and indirectly when one of its inputs is changed.
    """
    hit = {id(owner) for owner, _, _, _ in patch.swaps} | {id(old) for _, _, old, _ in patch.swaps}
    if patch.acts and patch.layer.module is not None:
        hit.add(id(patch.layer.module))
    tainted = set()
    for n in nodes:
        if not hit.isdisjoint(node_modules[n]) or any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
    start = next((i for i, n in enumerate(nodes) if n in tainted and not const[n]), len(nodes))
    return start, [i for i in range(start) if nodes[i] in tainted]


def _patched_outputs(qm, samples, output_index: Optional[int], patches: Dict[str, "_Patch"], progress: bool,
                     desc: str, batch_size: int = 8, base_key: Optional[str] = None
                     ) -> Tuple[Dict[str, Outputs], float]:
    """Outputs of ``qm`` with each patch applied alone, as :func:`run_outputs` gives them, bit for bit.

    One sweep of the unpatched model per batch; where a patch's first affected node comes up, the rest of the
    graph (the suffix) runs from the live values with the patch on. The shared prefix runs once instead of once
    per layer: on a chain of L layers about half the node evaluations of L full passes. Returns the outputs per
    patch name (a patch that changes no value gets the unpatched outputs), plus the unpatched model's under
    ``base_key`` when given (the sweep computes them anyway), and the fraction of full-pass node evaluations
    actually executed.
    """
    from torch import fx
    from tqdm.auto import tqdm

    gm = qm.gm
    nodes = list(gm.graph.nodes)
    last_use: Dict[Any, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    const: Dict[Any, bool] = {}  # constant subtrees (no placeholder among the ancestors): weights, shapes
    for n in nodes:
        const[n] = n.op not in ("placeholder", "output") and all(const[a] for a in n.all_input_nodes)
    starts: Dict[int, List[str]] = {}
    recompute: Dict[str, List[int]] = {}
    node_modules = _node_modules(gm, nodes)
    for name, patch in patches.items():
        start, recompute[name] = _branch_point(nodes, const, node_modules, patch)
        starts.setdefault(start, []).append(name)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    interp = fx.Interpreter(gm, garbage_collect_values=False)

    def run(env: Dict[Any, Any], i: int):
        n = nodes[i]
        interp.env = env
        return interp.run_node(n)

    def suffix(env: Dict[Any, Any], i: int, again: List[int]):
        local = dict(env)
        for j in again:  # constants the patch changes (a swapped weight quantizer), evaluated again
            local[nodes[j]] = run(local, j)
        for j in range(i, len(nodes)):
            n = nodes[j]
            if n.op == "output":
                return run(local, j), j - i + 1
            local[n] = run(local, j)
            for a in n.all_input_nodes:
                if last_use[a] == j:
                    local.pop(a, None)
        raise ConfigError("the model graph has no output node")

    specs = qm.input_specs
    dyn = all(s.batch_dynamic for s in specs)
    sizes = [int(s[0].shape[0]) for s in samples]
    if base_key is not None and base_key in patches:
        raise ConfigError(f"_patched_outputs: base_key {base_key!r} is also a patch name")
    keys = list(patches) + ([base_key] if base_key is not None else [])
    outs: Dict[str, Outputs] = {name: [] for name in keys}
    pos: Dict[str, int] = {name: 0 for name in keys}
    unchanged = list(starts.get(len(nodes), ())) + ([base_key] if base_key is not None else [])
    executed, full = 0, 0
    was = qm.training
    qm.eval()
    batch_list = list(_data.batches(samples, specs, batch_size if dyn else 1))
    bar = tqdm(total=len(batch_list) * len(patches), desc=desc, disable=not progress, leave=False)
    try:
        with torch.no_grad(), _weights_cached():
            for batch in batch_list:
                n_b = int(batch[0].shape[0])
                env: Dict[Any, Any] = {ph: t.to(qm.device) for ph, t in zip(placeholders, batch)}
                for i, n in enumerate(nodes):
                    for name in starts.get(i, ()):
                        with patches[name]:
                            y, count = suffix(env, i, recompute[name])
                        executed += count + len(recompute[name])
                        full += len(nodes)
                        pos[name] = _append_outputs(outs[name], y, n_b, sizes, pos[name], output_index, dyn)
                        bar.update(1)
                    if n.op == "output":
                        if unchanged:
                            y = run(env, i)
                            executed += 1
                            for name in unchanged:
                                pos[name] = _append_outputs(outs[name], y, n_b, sizes, pos[name], output_index, dyn)
                        break
                    if n.op != "placeholder":
                        env[n] = run(env, i)
                    for a in n.all_input_nodes:
                        if last_use[a] == i and not const[a]:  # constants stay: a suffix may evaluate again
                            env.pop(a, None)
    finally:
        bar.close()
        qm.train(was)
    return outs, (executed / full if full else 0.0)


# ------------------------------------------------------------------------------------------------ plan
@dataclass
class MixedPrecisionPlan:
    """A layer-wise mixed-precision assignment: the nodes that take the narrow formats.

    Reusable without a new search: :meth:`save` / :meth:`load` (JSON), :meth:`apply` (a ResolvedConfig whose
    layer-wise promotion is exactly these nodes), :meth:`tensor_precision` (Quark's ``MixedPrecisionTensor``
    form: format name -> tensor names).
    """

    promoted_nodes: List[str]
    act_format: Format
    weight_format: Format
    dual_quant_nodes: bool = False
    target_op_type: Tuple[str, ...] = DEFAULT_TARGET_OPS
    metric: str = "l2"
    value: Optional[float] = None
    target: Optional[float] = None

    def apply(self, cfg):
        """A copy of ResolvedConfig ``cfg`` that places this plan (layer-wise promotion of exactly these nodes)."""
        from ..config.internal import AutoMixprecisionSettings

        amp = AutoMixprecisionSettings(target_op_type=tuple(self.target_op_type), act_target_quant_type=self.act_format,
                                       weight_target_quant_type=self.weight_format,
                                       dual_quant_nodes=self.dual_quant_nodes, promoted_nodes=tuple(self.promoted_nodes))
        return dataclasses.replace(cfg, auto_mixprecision=amp)

    def tensor_precision(self, qm) -> Dict[str, List[str]]:
        """``{format name: [tensor names]}`` of the narrow quantizers of ``qm`` (a model prepared with this plan)."""
        out: Dict[str, List[str]] = {}
        for key, fq in qm.quantizers().items():
            if fq.role == "activation":
                narrow = fq.fmt == self.act_format and fq.fmt != qm.config.activation
            else:
                narrow = fq.fmt == self.weight_format and fq.fmt != qm.config.weight and fq.bias_sources is None
            if narrow:
                out.setdefault(fq.fmt.name, []).append(key)
        return out

    def to_json(self) -> Dict[str, Any]:
        from ..training import _fmt_to_dict

        return {"promoted_nodes": list(self.promoted_nodes), "act_format": _fmt_to_dict(self.act_format),
                "weight_format": _fmt_to_dict(self.weight_format), "dual_quant_nodes": self.dual_quant_nodes,
                "target_op_type": list(self.target_op_type), "metric": self.metric, "value": self.value,
                "target": self.target}

    def save(self, path: str) -> None:
        """Write the plan as JSON."""
        from ..export import save_bytes_atomic

        save_bytes_atomic(json.dumps(self.to_json(), indent=2).encode(), path)

    @classmethod
    def load(cls, path: str) -> "MixedPrecisionPlan":
        """Read a plan written by :meth:`save`.

        Raises:
            ConfigError: not a plan file.
        """
        from ..training import _fmt_from_dict

        try:
            with open(path) as f:
                d = json.load(f)
            return cls(promoted_nodes=list(d["promoted_nodes"]), act_format=_fmt_from_dict(d["act_format"]),
                       weight_format=_fmt_from_dict(d["weight_format"]), dual_quant_nodes=bool(d["dual_quant_nodes"]),
                       target_op_type=tuple(d["target_op_type"]), metric=d.get("metric", "l2"),
                       value=d.get("value"), target=d.get("target"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path!r} is not a mixed-precision plan written by MixedPrecisionPlan.save ({exc})") from exc


# ------------------------------------------------------------------------------------------------ building
def _observer_key(fq) -> Tuple[Any, ...]:
    """What an activation quantizer's calibration statistics depend on: the tensor it observes, the observer's
    class and its options (a fresh observer's public attributes: axis, moving average, bins, the format of a
    power-of-two observer, ...). Calibration runs the float model (every quantizer passes its input through),
    so two quantizers with the same key, in any two builds from the same lifted graph, observe the same values
    in the same batches and end with the same statistics."""
    obs = fq.observer
    opts = tuple(sorted((k, repr(v)) for k, v in vars(obs).items() if not k.startswith("_") and k != "name"))
    return (fq.tensor_name, type(obs).__module__, type(obs).__qualname__, opts)


class _Builder:
    """Lifts the model once; builds calibrated models for any set of promoted nodes.

    Calibration observes the float model, so an observer's statistics depend only on the tensor, the observer's
    kind and options, and the data (:func:`_observer_key`), not on which layers are narrow. The first builds
    (all-wide, all-narrow) calibrate; a later build whose every observer has a calibrated twin takes a copy of
    the twin's statistics and derives its parameters from them (:func:`qtorch_onnx.quantizer.finalize_qparams`:
    ranges, shared and fixed ranges, overrides, INT32 bias scales of *this* placement) without a forward pass.
    ``calibrations`` counts the builds that ran the calibration data.

    With ``cfg.bias_correction`` every build is bias-corrected (:func:`~qtorch_onnx.algorithms.bias_correction`)
    after its calibration. A layer's correction depends on its weight quantizer and, through the mean of its
    quantized input, on its input quantizers' formats; the first build that meets a layer in a given
    (weight format, input formats) state runs the correction pass and every later build takes that layer's
    correction from it: two passes per search (all-wide, all-narrow) instead of one per probe. What a later mix
    gets is its layers' corrections as measured in those two models (the inputs' upstream layers may differ);
    the probes are measured as built, so the target holds for what is exported. ``bias_corrections`` counts
    the passes."""

    def __init__(self, model, cfg, calib_samples, device, progress: bool, reuse_calibration: bool = True):
        from ..quantizer import lift_float

        self.cfg = cfg
        # graph optimization, ReplaceClip6Relu, CLE once: every build starts from the same float model
        self.gm, self.cle_report = lift_float(model, cfg)
        self.calib = calib_samples
        self.device = device
        self.progress = progress
        self.builds = 0
        self.calibrations = 0
        self.reuse_calibration = reuse_calibration
        self._promoted: Dict[Any, Any] = {}
        self._observers: Dict[Tuple[Any, ...], Any] = {}  # _observer_key -> a calibrated observer
        self.bias_corrections = 0
        self._bias_deltas: Dict[Tuple[Any, ...], torch.Tensor] = {}  # _bias_key -> the correction of the bias

    @staticmethod
    def _bias_key(layer) -> Tuple[Any, ...]:
        fq = layer.weight_quantizer
        return (layer.name, fq.fmt, fq.axis, tuple(q.fmt for q in layer.input_quantizers))

    def _bias_correct(self, qm) -> None:
        """Bias correction of a fresh build: cached corrections where every layer has one, else a pass."""
        from .bias_correction import bias_correction, correctable_layers

        layers = [l for l in correctable_layers(qm) if l.bias is not None]
        keys = {l.name: self._bias_key(l) for l in layers}
        if all(k in self._bias_deltas for k in keys.values()):
            applied = qm.applied_bias_corrections  # as bias_correction records it
            with torch.no_grad():
                for l in layers:
                    delta = self._bias_deltas[keys[l.name]].to(l.bias.device)
                    l.bias.add_(delta)
                    applied[l.name] = -delta.double()
            return
        before = {l.name: l.bias.detach().clone() for l in layers}
        bias_correction(qm, self.calib, progress=False)
        self.bias_corrections += 1
        for l in layers:
            self._bias_deltas.setdefault(keys[l.name], l.bias.detach() - before[l.name])

    def build(self, cfg):
        from ..placement import plan_quantization
        from ..calibration import calibrate
        from ..quantizer import attach_quantizers, sync_after_rewrites

        gm = copy.deepcopy(self.gm)
        plan = plan_quantization(gm.onnx_model, cfg)
        qm = attach_quantizers(gm, plan, cfg)
        sync_after_rewrites(qm, self.cle_report)
        if self.device is not None:
            qm.to(self.device)
        if any(fq.needs_calibration for fq in qm.quantizers().values() if fq.role == "activation"):
            observed = [(fq, _observer_key(fq)) for fq in qm.quantizers().values() if fq.calibratable]
            if not (self.reuse_calibration and self._reuse(qm, observed)):
                calibrate(qm, self.calib, progress=False)
                self.calibrations += 1
                for fq, key in observed:
                    self._observers.setdefault(key, fq.observer)
        if cfg.bias_correction:
            self._bias_correct(qm)
        self.builds += 1
        return qm

    def _reuse(self, qm, observed) -> bool:
        """Calibrate ``qm`` from the statistics of earlier builds (as :func:`qtorch_onnx.calibrate` leaves it:
        parameters set, observers frozen); False (``qm`` untouched) when some observer has no twin."""
        from ..calibration import finalize_qparams

        if not observed or any(key not in self._observers for _, key in observed):
            return False
        t0 = time.perf_counter()
        skipped = {k for k, fq in qm.quantizers().items()
                   if fq.role == "activation" and fq.observer is not None and not fq.calibratable}
        for fq, key in observed:
            fq.observer = copy.deepcopy(self._observers[key])
        finalize_qparams(qm, skip=skipped)
        for fq, _ in observed:  # statistics frozen, as calibrate() leaves them
            fq._observer_enabled = False
            fq._observer_auto_off = True
        qm.stage_times["calibrate"] = time.perf_counter() - t0
        return True

    def wide(self):
        return self.build(dataclasses.replace(self.cfg, auto_mixprecision=None))

    def promoted(self, nodes, act_fmt, w_fmt, target_ops, dual):
        from ..config.internal import AutoMixprecisionSettings

        key = (frozenset(nodes), act_fmt, w_fmt, tuple(target_ops), dual)
        if key not in self._promoted:  # the all-narrow model of the sensitivity pass is also the search's
            amp = AutoMixprecisionSettings(target_op_type=tuple(target_ops), act_target_quant_type=act_fmt,
                                           weight_target_quant_type=w_fmt, dual_quant_nodes=dual,
                                           promoted_nodes=tuple(nodes))
            self._promoted[key] = self.build(dataclasses.replace(self.cfg, auto_mixprecision=amp))
        return self._promoted[key]


# ------------------------------------------------------------------------------------------------ sensitivity
@dataclass
class LayerSensitivity:
    """One layer's sensitivity: metric value with the layer alone narrow, per candidate, and the gradient
    estimate; weight bytes wide and per candidate."""

    name: str
    op_type: str
    measured: Dict[str, float] = field(default_factory=dict)
    estimated: Dict[str, float] = field(default_factory=dict)
    weight_bytes: Dict[str, float] = field(default_factory=dict)


@dataclass
class SensitivityReport:
    """:func:`sensitivity`'s result: per layer, the baseline (all-wide) metric, the rank agreement (Spearman)
    of the gradient estimate with the measurement per candidate, the number of forward passes and the time."""

    metric: str
    baseline: float
    layers: List[LayerSensitivity]
    candidates: List[str]
    spearman: Dict[str, Optional[float]] = field(default_factory=dict)
    forward_passes: int = 0
    suffix_fraction: Dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def order(self, candidate: Optional[str] = None) -> List[str]:
        """Layer names, least sensitive first (for ``candidate``, default the first)."""
        c = candidate or self.candidates[0]
        return [l.name for l in sorted(self.layers, key=lambda l: l.measured.get(c, math.inf))]

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _candidate_name(c) -> str:
    a, w = c
    return a.name if a == w else f"{a.name}/{w.name}"


def _as_candidate(c) -> Tuple[Format, Format]:
    from ..formats.spec import get_format

    if isinstance(c, str):
        f = get_format(c)
        return (f, f)
    if isinstance(c, (tuple, list)) and len(c) == 2:
        return tuple(get_format(x) if isinstance(x, str) else x for x in c)  # type: ignore[return-value]
    return (c, c)


class _ModelIndex:
    """What :class:`_Patch` looks up on a model, computed once per model instead of once per patch: its layers
    by name, its quantizers by key, the modules owning each quantizer slot, and the owner of every weight
    parametrization (for the parametrization cache of :func:`_weights_cached`)."""

    def __init__(self, qm):
        from ..fakequant import FakeQuantize, ParamQuantizer

        self.layers = {l.name: l for l in qm.layers()}
        self.quantizers = qm.quantizers()
        self.slots: Dict[int, List[Tuple[Any, str]]] = {}  # id(quantizer) -> [(holder module, attribute)]
        self.param_owner: Dict[int, Tuple[int, str]] = {}  # id(ParamQuantizer) -> (id(owner module), tensor)
        for mod in qm.modules():
            for attr, child in mod._modules.items():
                if isinstance(child, FakeQuantize):
                    self.slots.setdefault(id(child), []).append((mod, attr))
            plists = getattr(mod, "parametrizations", None)
            if plists is not None and isinstance(plists, torch.nn.ModuleDict):
                for tname, plist in plists.items():
                    for pq in plist:
                        if isinstance(pq, ParamQuantizer):
                            self.param_owner[id(pq)] = (id(mod), tname)


def _forget_cached(keys: Sequence[Tuple[int, str]]) -> None:
    """Drop these ``(id(module), tensor)`` entries from torch's parametrization cache (a swapped weight or bias
    quantizer must be evaluated again, see :func:`_weights_cached`)."""
    from torch.nn.utils import parametrize

    cache = getattr(parametrize, "_cache", None)
    if isinstance(cache, dict):
        for k in keys:
            cache.pop(k, None)


def _weights_cached():
    """Context in which each parametrized (fake-quantized) weight and bias is computed once and reused by every
    later read (``torch.nn.utils.parametrize.cached``): evaluation passes without autograd re-quantized every
    weight on every batch and every sensitivity suffix. The cached value is the parametrization's output, so
    results are bit-identical; :class:`_Patch` drops the entries of the quantizers it swaps."""
    from torch.nn.utils import parametrize

    return parametrize.cached()


class _Patch:
    """Switches one layer of the wide model to the narrow model's quantizers, and back.

    ``wide_index`` / ``narrow_index``: :class:`_ModelIndex` of the two models (computed here when not given;
    give them when patching many layers of the same models)."""

    def __init__(self, wide, narrow, name: str, wide_index: Optional[_ModelIndex] = None,
                 narrow_index: Optional[_ModelIndex] = None):
        self.wide, self.narrow, self.name = wide, narrow, name
        wix = wide_index if wide_index is not None else _ModelIndex(wide)
        nix = narrow_index if narrow_index is not None else _ModelIndex(narrow)
        self._wix = wix
        wl = wix.layers[name]
        nl = nix.layers[name]
        self.layer = wl
        self.swaps: List[Tuple[Any, str, Any, Any]] = []  # (owner, attribute, old, new)
        self.acts: List[Tuple[int, Any]] = []
        self.cache_keys: List[Tuple[int, str]] = []  # parametrization cache entries the swaps make stale
        info = wide.tensor_map.graph.nodes[name]
        nfq = nix.quantizers
        wfq = wix.quantizers
        inits = set(wide.plan.info.initializers)
        # weights and biases: swap the module's parametrization, or the own quantizer's slot in the holder
        for wq, nq in ((wl.weight_quantizer, nl.weight_quantizer), (wl.bias_quantizer, nl.bias_quantizer)):
            if wq is None or nq is None or wq.fmt == nq.fmt and nq.bias_sources is None:
                continue
            self._swap_everywhere(wq, nq)
        # activation inputs: the narrow quantizer after the wide one (DualQuantNodes reading)
        node = next(n for n in wide.gm.graph.nodes if n.name == info.fx_node)
        pos = 0
        for a in node.args:
            if not hasattr(a, "op"):
                pos += 1
                continue
            tensor = self._tensor_of(a)
            if tensor is not None and tensor not in inits:
                q = nfq.get(f"{tensor} -> {name}") or nfq.get(tensor)
                if q is not None and (tensor not in wfq or wfq[tensor].fmt != q.fmt):
                    self.acts.append((pos, q))
            pos += 1
        self.handle = None

    def _tensor_of(self, a):
        if a.op == "call_module" and str(a.target).startswith("quantizers."):
            return self.wide.gm.get_submodule(str(a.target)).tensor_name
        return self.wide.tensor_map.tensor_of_node(a.name)

    def _swap_everywhere(self, old_fq, new_fq):
        for mod, attr in self._wix.slots.get(id(old_fq), ()):
            self.swaps.append((mod, attr, old_fq, new_fq))
            if id(mod) in self._wix.param_owner:
                self.cache_keys.append(self._wix.param_owner[id(mod)])

    def __enter__(self):
        for mod, attr, _, new in self.swaps:
            mod._modules[attr] = new
        _forget_cached(self.cache_keys)
        if self.acts and self.layer.module is not None:
            acts = self.acts

            def pre(mod, args):
                args = list(args)
                for i, q in acts:
                    if i < len(args) and isinstance(args[i], torch.Tensor):
                        args[i] = q(args[i])
                return tuple(args)

            self.handle = self.layer.module.register_forward_pre_hook(pre)
        return self

    def __exit__(self, *exc):
        for mod, attr, old, _ in self.swaps:
            mod._modules[attr] = old
        _forget_cached(self.cache_keys)
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _spearman(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    if len(a) < 3:
        return None
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _gradient_estimate(wide, narrow, names, samples, float_outs, output_index) -> Dict[str, float]:
    """First-order estimate per layer of the squared output change ``||J delta||^2``: ``sum_samples (g . delta)^2``
    over the layer's activation inputs and weight (``delta``: narrow minus wide quantized value; ``g``: the
    gradient of ``v . y`` for a random Gaussian ``v``, an unbiased Hutchinson estimate of ``||J delta||^2``;
    one backward pass per sample for all layers)."""
    est = {n: 0.0 for n in names}
    wix, nix = _ModelIndex(wide), _ModelIndex(narrow)
    patches = {n: _Patch(wide, narrow, n, wix, nix) for n in names}
    layers = wix.layers
    narrow_layers = nix.layers
    captured: Dict[str, List[torch.Tensor]] = {}
    handles = []
    for n in names:
        mod = layers[n].module
        if mod is None:
            continue

        def pre(m, args, n=n):
            captured[n] = list(args)

        handles.append(mod.register_forward_pre_hook(pre))
    params = [p for p in wide.parameters()]
    req = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    was = wide.training
    wide.eval()
    try:
        for s, fo in zip(samples, float_outs):
            captured.clear()
            wide.zero_grad(set_to_none=True)
            xs = [t.to(wide.device) for t in s]
            xs = [t.detach().requires_grad_(True) if t.is_floating_point() else t for t in xs]
            y = wide(*xs)
            ys = list(y) if isinstance(y, (tuple, list)) else [y]
            sel = ys if output_index is None else [ys[output_index]]
            # Hutchinson-style projection: with v ~ N(0, I), E[(v.J delta)^2] = ||J delta||^2, the squared output
            # change the candidate causes to first order (the distance to the float output moves by about that)
            gen = torch.Generator().manual_seed(len(est) + int(sum(int(t.numel()) for t in xs)))
            loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in sel)
            acts = {n: dict(patches[n].acts) for n in names}
            ins = {n: [(i, a) for i, a in enumerate(captured.get(n, []))
                       if isinstance(a, torch.Tensor) and a.requires_grad and i in acts[n]] for n in names}
            flat = [t for n in names for _, t in ins[n]]
            grads = torch.autograd.grad(loss, flat, retain_graph=True, allow_unused=True) if flat else []
            loss.backward()
            gi = iter(grads)
            for n in names:
                total = 0.0
                for i, t in ins[n]:
                    g = next(gi)
                    if g is None:
                        continue
                    with torch.no_grad():
                        total += float((g * (acts[n][i](t) - t)).sum())
                lw, wq = layers[n].weight, layers[n].weight_quantizer
                nq = narrow_layers[n].weight_quantizer
                if lw is not None and lw.grad is not None and wq is not None and nq is not None:
                    with torch.no_grad():
                        total += float((lw.grad * (nq.quantize_dequantize(lw.float()) -
                                                   wq.quantize_dequantize(lw.float()))).sum())
                est[n] += total ** 2
    finally:
        for h in handles:
            h.remove()
        for p, r in zip(params, req):
            p.requires_grad_(r)
            p.grad = None
        wide.train(was)
    return est


def _target_layer_names(qm, target_op_type: Sequence[str]) -> List[str]:
    """The quantized layers of ``qm`` of the given op types, graph order.

    Raises:
        ConfigError: no quantized layer of those op types.
    """
    names = [l.name for l in qm.layers(tuple(target_op_type)) if l.weight_quantizer is not None or l.input_quantizers]
    if not names:
        ops = sorted({l.op_type for l in qm.layers() if l.weight_quantizer is not None or l.input_quantizers})
        raise ConfigError(f"AutoMixprecision TargetOpType {list(target_op_type)} matches no quantized layer; the "
                          f"model's quantized layers are {ops}")
    return names


def _layer_entries(qm, names: Sequence[str], cands: Sequence[Tuple[Format, Format]]) -> List[LayerSensitivity]:
    """One :class:`LayerSensitivity` per layer with its weight bytes wide and per candidate, nothing measured."""
    layer_by = {l.name: l for l in qm.layers()}
    out = []
    for n in names:
        ls = LayerSensitivity(n, layer_by[n].op_type)
        w, wq = layer_by[n].weight, layer_by[n].weight_quantizer
        ls.weight_bytes["wide"] = w.numel() * wq.fmt.bits_per_element / 8 if w is not None and wq is not None else 0.0
        for c in cands:
            ls.weight_bytes[_candidate_name(c)] = w.numel() * c[1].bits_per_element / 8 if w is not None else 0.0
        out.append(ls)
    return out


@float32_exact()
@large_tensor_heap()
def sensitivity(qm, data: Any, candidates: Sequence[Any] = ("INT8",), *, metric: Union[str, Callable] = "l2",
                evaluate_function: Optional[Callable] = None, output_index: Optional[int] = 0,
                target_op_type: Sequence[str] = DEFAULT_TARGET_OPS, gradient: bool = True, progress: bool = True,
                calib_data: Any = None, dual_quant_nodes: bool = False, _builder=None,
                _reference: Optional[Tuple[Outputs, float]] = None) -> SensitivityReport:
    """Per-layer sensitivity of a prepared, calibrated (wide) model to switching each layer alone to a narrower
    format.

    Args:
        qm: the wide model (:func:`qtorch_onnx.prepare` + :func:`qtorch_onnx.calibrate`); not modified.
        data: evaluation data (any form :func:`qtorch_onnx.calibrate` accepts); also the calibration data of
            the candidate quantizers unless ``calib_data`` is given.
        candidates: narrow formats: a format name (``"INT8"``, ``"BFP16"``), a Format, or an
            ``(activation, weight)`` pair of them.
        metric / evaluate_function: see the module docstring. output_index: which model output (None: all).
        target_op_type: the op types of the layers considered.
        gradient: also compute the one-backward-pass estimate and its Spearman agreement.

    Returns:
        A :class:`SensitivityReport`.

    On CUDA it runs with TF32 off (:class:`qtorch_onnx.float32_exact`: float32 convolutions and products as
    the CPU emulation and ONNX Runtime compute them); the caller's torch settings come back afterwards. With
    glibc, its heap keeps freed blocks of large tensors for reuse meanwhile
    (:class:`qtorch_onnx.heap.large_tensor_heap`).

    Raises:
        ConfigError: an unknown metric or format, an OutputIndex out of range, TargetOpType matching no layer.
        DataError: empty data.
    """
    t0 = time.perf_counter()
    name, fn = resolve_metric(metric, evaluate_function)
    samples = _data.to_samples(data, qm.input_specs, what="sensitivity data")
    calib = _data.to_samples(calib_data, qm.input_specs) if calib_data is not None else samples
    cands = [_as_candidate(c) for c in candidates]
    names = _target_layer_names(qm, target_op_type)
    from ..training import fake_quant_disabled

    if _reference is not None:  # (float outputs, all-wide metric or None) already measured by the caller
        float_outs, base = _reference
    else:
        with fake_quant_disabled(qm):
            float_outs = run_outputs(qm, samples, output_index)
        base = None  # the all-wide outputs come with the first sweep
    builder = _builder
    if builder is None:
        builder = _Builder(qm.onnx_model, qm.config, calib, qm.device, progress)
    report = SensitivityReport(metric=name, baseline=math.nan if base is None else base,
                               layers=_layer_entries(qm, names, cands), candidates=[_candidate_name(c) for c in cands])
    passes = 0 if _reference is not None else 1  # the float pass (the all-wide outputs come with the sweep)
    for c in cands:
        cname = _candidate_name(c)
        narrow = builder.promoted(names, c[0], c[1], target_op_type, dual_quant_nodes)
        wix, nix = _ModelIndex(qm), _ModelIndex(narrow)
        patches = {ls.name: _Patch(qm, narrow, ls.name, wix, nix) for ls in report.layers}
        base_key = "\0all-wide" if base is None else None
        outs, frac = _patched_outputs(qm, samples, output_index, patches, progress, f"sensitivity {cname}",
                                      base_key=base_key)
        if base is None:
            base = report.baseline = fn(float_outs, outs[base_key])
        for ls in report.layers:
            ls.measured[cname] = fn(float_outs, outs[ls.name])
            passes += 1
        report.suffix_fraction[cname] = frac
        if gradient:
            est = _gradient_estimate(qm, narrow, names, samples, float_outs, output_index)
            for ls in report.layers:
                ls.estimated[cname] = est[ls.name]
            report.spearman[cname] = _spearman([l.measured[cname] for l in report.layers],
                                               [l.estimated[cname] for l in report.layers])
            passes += 1
    report.forward_passes = passes
    report.seconds = time.perf_counter() - t0
    return report


# ------------------------------------------------------------------------------------------------ search
@dataclass
class AutoMixedPrecisionResult:
    """What :func:`auto_mixed_precision` did: the plan, the sensitivity report, every evaluated point
    ``(number of narrow layers, metric, weight bytes)``, the all-wide / all-narrow values, the number of full
    model builds (each: place, calibrate, evaluate; ``calibrations`` of them ran the calibration data, the others
    took the statistics of an earlier build, see :class:`_Builder`; ``bias_corrections``: the bias-correction
    passes when the wide config asks for BiasCorrection), the time (``stage_seconds``: prepare, sensitivity, search,
    fill, verify: the part of the probes spent exporting and running ONNX Runtime, not counted in search), and
    ``verified``: ``[(number of narrow layers, metric in ONNX Runtime)]`` of the returned mix (empty without
    ``verify`` and in the budget form)."""

    plan: MixedPrecisionPlan
    sensitivity: SensitivityReport
    evaluated: List[Tuple[int, float, float]]
    wide_value: float
    narrow_value: Optional[float]
    builds: int
    seconds: float
    message: str = ""
    verified: List[Tuple[int, float]] = field(default_factory=list)
    fill_passes: int = 0
    stage_seconds: Dict[str, float] = field(default_factory=dict)
    calibrations: int = 0
    bias_corrections: int = 0

    def save(self, folder: str) -> Dict[str, str]:
        """Write ``auto_mp.json`` (per layer: sensitivity per candidate, chosen format, bytes), the reusable
        ``plan.json``, and the plots ``sensitivity.png`` and ``accuracy_vs_size.png``."""
        os.makedirs(folder, exist_ok=True)
        cname = self.sensitivity.candidates[0]
        chosen = set(self.plan.promoted_nodes)
        layers = []
        for l in self.sensitivity.layers:
            layers.append({"name": l.name, "op_type": l.op_type, "sensitivity": l.measured,
                           "gradient_estimate": l.estimated, "chosen": cname if l.name in chosen else "wide",
                           "weight_bytes": l.weight_bytes[cname if l.name in chosen else "wide"]})
        doc = {"metric": self.sensitivity.metric, "target": self.plan.target, "value": self.plan.value,
               "wide_value": self.wide_value, "narrow_value": self.narrow_value, "narrow_layers": len(chosen),
               "layers_total": len(layers), "evaluated": self.evaluated, "builds": self.builds,
               "calibrations": self.calibrations, "bias_corrections": self.bias_corrections,
               "sensitivity_forward_passes": self.sensitivity.forward_passes, "spearman": self.sensitivity.spearman,
               "seconds": self.seconds, "message": self.message, "verified_onnxruntime": self.verified,
               "fill_forward_passes": self.fill_passes, "stage_seconds": self.stage_seconds,
               "sensitivity_suffix_fraction": self.sensitivity.suffix_fraction, "layers": layers}
        paths = {"json": os.path.join(folder, "auto_mp.json"), "plan": os.path.join(folder, "plan.json"),
                 "sensitivity": os.path.join(folder, "sensitivity.png"),
                 "pareto": os.path.join(folder, "accuracy_vs_size.png")}
        with open(paths["json"], "w") as f:
            json.dump(doc, f, indent=2, default=float)
        self.plan.save(paths["plan"])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ordered = sorted(self.sensitivity.layers, key=lambda l: l.measured.get(cname, math.inf))
        fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(ordered) + 2), 4.0))
        xs = range(len(ordered))
        ax.bar(xs, [l.measured.get(cname, math.nan) for l in ordered],
               color=["tab:green" if l.name in chosen else "tab:gray" for l in ordered])
        if math.isnan(self.sensitivity.baseline):  # the search ended at all-wide or all-narrow without it
            ax.set_xlabel("not measured: the search needed no sensitivity")
        else:
            ax.axhline(self.sensitivity.baseline, color="k", lw=0.8, ls="--", label="all wide")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([l.name for l in ordered], rotation=90, fontsize=6)
        ax.set_ylabel(f"{self.sensitivity.metric} with the layer alone in {cname}")
        ax.set_title("per-layer sensitivity, sorted (green: chosen narrow)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(paths["sensitivity"], dpi=110)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        pts = sorted(self.evaluated)
        ax.plot([p[2] / 1e6 for p in pts], [p[1] for p in pts], "o-", label="evaluated mixes")
        k = len(chosen)
        mine = [p for p in pts if p[0] == k]
        if mine:
            ax.plot([mine[0][2] / 1e6], [mine[0][1]], "r*", ms=14, label=f"chosen ({k} narrow)")
        if self.plan.target is not None:
            ax.axhline(self.plan.target, color="r", lw=0.8, ls="--", label="target")
        ax.set_xlabel("weight size (MB)")
        ax.set_ylabel(self.sensitivity.metric)
        ax.set_title("accuracy vs model size")
        ax.legend()
        fig.tight_layout()
        fig.savefig(paths["pareto"], dpi=110)
        plt.close(fig)
        return paths


@float32_exact()
@large_tensor_heap()
def auto_mixed_precision(model, data: Any, *, wide: Any = "A16W8", narrow: Any = "INT8", target: Optional[float] = None,
                         metric: Union[str, Callable] = "l2", evaluate_function: Optional[Callable] = None,
                         output_index: Optional[int] = 0, target_op_type: Sequence[str] = DEFAULT_TARGET_OPS,
                         dual_quant_nodes: bool = False, eval_data: Any = None, device=None, progress: bool = True,
                         report_dir: Optional[str] = None, search: str = "bisect",
                         budget_bytes: Optional[float] = None, pareto_points: int = 0,
                         verify: Optional[str] = "onnxruntime", gradient: bool = False, fill: bool = True):
    """Find the largest set of layers that can take the narrow format while ``metric <= target`` holds.

    Args:
        model: ONNX model (path or ModelProto; never modified).
        data: calibration data (and evaluation data unless ``eval_data``).
        wide: the wide configuration (named config, Quark Config/QuantizationConfig or ResolvedConfig).
        narrow: the narrow format(s): a name / Format, or an ``(activation, weight)`` pair (Quark's
            ActTargetQuantType / WeightTargetQuantType).
        target: the largest acceptable metric value (an L2 distance, or for ``metric="top1"`` the largest
            accuracy drop from the float model).
        metric, evaluate_function, output_index, target_op_type, dual_quant_nodes: as :func:`sensitivity`.
        search: ``"bisect"`` (O(log L) full evaluations over the sorted layers) or ``"exhaustive"`` (every
            prefix of the sorted layers evaluated; the largest meeting the target wins: O(L), for checking).
        budget_bytes: instead of ``target``: the weight-size budget in bytes; the fewest least-sensitive layers
            whose narrowing brings the weights within it go narrow (one evaluation). ``target`` and
            ``budget_bytes`` may not both be given.
        pareto_points: also evaluate this many evenly spaced mixes (accuracy vs size, in the report and plot).
        fill: after the bisection (which stops at the first layer, in sensitivity order, that breaks the
            target), try each later layer on the chosen mix (one forward pass each) and keep those that fit;
            the resulting set is then built, calibrated and evaluated like every probe (Quark's one-by-one
            promotion, without its O(L) full builds).
        gradient: also compute the sensitivity's one-backward-pass estimate and its Spearman agreement with
            the measured ranking (reported; the search uses the measurement).
        verify: ``"onnxruntime"`` (default): every probe (all-wide, all-narrow, each mix of the search) is
            exported and its metric measured in ONNX Runtime on ``execution_providers`` against the float model
            run in ONNX Runtime, on the evaluation data: the target holds there for the returned mix by
            construction (the quantizers are bit-exact in ONNX Runtime, the float operators between them are
            not: near the target that difference decides). ``fill`` screens in the emulation, shifted by its
            offset from ONNX Runtime at the chosen mix, and the set it finds is measured in ONNX Runtime like
            every probe (the largest prefix of it that meets the target, by bisection, when the whole set does
            not). None: everything in the torch emulation.

    Returns:
        ``(plan, qm, result)``: the :class:`MixedPrecisionPlan`, the calibrated mixed model (ready to export),
        and the :class:`AutoMixedPrecisionResult`. When even all-wide misses the target, the all-wide model
        is returned (a warning says so, with the all-wide value); when all-narrow meets it, all-narrow.

    Raises:
        ConfigError: a narrow format that is not narrower than the wide one, an unknown metric, an OutputIndex
            out of range, no matching layer, an EvaluateFunction that raises or returns a non-number, an unknown
            ``verify``.
    """
    import warnings

    from ..quantizer import resolve

    t0 = time.perf_counter()
    if search not in ("bisect", "exhaustive"):
        raise ConfigError(f"auto_mixed_precision: search {search!r}; valid: 'bisect', 'exhaustive'")
    if verify not in (None, "onnxruntime"):
        raise ConfigError(f"auto_mixed_precision: verify {verify!r}; valid: 'onnxruntime', None")
    if (target is None) == (budget_bytes is None):
        raise ConfigError("auto_mixed_precision: give exactly one of target (a metric bound) and budget_bytes")
    if target is not None and (not isinstance(target, (int, float)) or isinstance(target, bool)
                               or not math.isfinite(target)):
        raise ConfigError(f"auto_mixed_precision: target must be a finite number, got {target!r}")
    cfg = resolve(wide)
    act_n, w_n = _as_candidate(narrow)
    for kind, wide_f, narrow_f in (("activation", cfg.activation, act_n), ("weight", cfg.weight, w_n)):
        if narrow_f.bits_per_element > wide_f.bits_per_element:
            raise ConfigError(f"AutoMixprecision target type {narrow_f.name} for {kind}s is wider than the wide "
                              f"{kind} type {wide_f.name}: the target must be the narrower format")
    if act_n == cfg.activation and w_n == cfg.weight:
        raise ConfigError(f"AutoMixprecision target types ({act_n.name}, {w_n.name}) equal the wide types: "
                          "nothing to switch")
    mname, fn = resolve_metric(metric, evaluate_function)
    if verify:
        from ..runtime import check_providers

        check_providers(cfg.graph.execution_providers)  # before any work: the check at the end runs on them
    from ..lift import load_model

    proto = load_model(model)
    from ..data import input_specs

    specs = input_specs(proto)
    calib = _data.to_samples(data, specs)
    evals = _data.to_samples(eval_data, specs) if eval_data is not None else calib
    builder = _Builder(proto, cfg, calib, device, progress)
    qm_wide = builder.wide()
    names = _target_layer_names(qm_wide, target_op_type)
    cname = _candidate_name((act_n, w_n))
    from ..training import fake_quant_disabled

    # until the sensitivity is measured (only when the search needs it): graph order, nothing measured
    sens = SensitivityReport(metric=mname, baseline=math.nan, layers=_layer_entries(qm_wide, names, [(act_n, w_n)]),
                             candidates=[cname])
    order = list(names)
    layer_bytes = {l.name: l.weight_bytes for l in sens.layers}
    torch_ref: List[Any] = []  # [float outputs, all-wide metric] of the torch emulation, when first needed
    ort_ref: List[Outputs] = []  # the float model's outputs in ONNX Runtime, when first needed
    eps = tuple(cfg.graph.execution_providers)

    def emulation_reference() -> Outputs:
        if not torch_ref:
            with fake_quant_disabled(qm_wide):
                torch_ref.append(run_outputs(qm_wide, evals, output_index))
        return torch_ref[0]

    def measure_sensitivity() -> None:
        nonlocal sens, order
        if not math.isnan(sens.baseline):
            return
        t_sens = time.perf_counter()
        sens = sensitivity(qm_wide, evals, [(act_n, w_n)], metric=metric, evaluate_function=evaluate_function,
                           output_index=output_index, target_op_type=target_op_type, progress=progress,
                           dual_quant_nodes=dual_quant_nodes, gradient=gradient, _builder=builder,
                           _reference=(emulation_reference(), None))  # all-wide: from the sweep
        order = sens.order()
        stage_seconds["sensitivity"] += time.perf_counter() - t_sens

    def size(k: int) -> float:
        return sum(layer_bytes[n][cname] if i < k else layer_bytes[n]["wide"] for i, n in enumerate(order))

    def plan_for(j: int, value: Optional[float]) -> MixedPrecisionPlan:
        return MixedPrecisionPlan(promoted_nodes=list(order[:j]), act_format=act_n, weight_format=w_n,
                                  dual_quant_nodes=dual_quant_nodes, target_op_type=tuple(target_op_type),
                                  metric=mname, value=value, target=target)

    def measure(qm_k, j: int) -> float:
        """The metric of mix ``qm_k`` (``j`` narrow): in ONNX Runtime (exported; against the float model run
        there) with ``verify``, else in the torch emulation."""
        if not verify:
            return fn(emulation_reference(), run_outputs(qm_k, evals, output_index))
        from ..export import export as _export

        t_ort = time.perf_counter()
        if not ort_ref:
            ort_ref.append(_ort_outputs(proto, evals, output_index, eps))
        if j > 0:
            qm_k.config = plan_for(j, None).apply(cfg)
        v = fn(ort_ref[0], _ort_outputs(_export(qm_k, check=False), evals, output_index, eps))
        stage_seconds["verify"] += time.perf_counter() - t_ort
        return v

    evaluated: List[Tuple[int, float, float]] = []
    cache: Dict[int, Tuple[float, Any]] = {}  # k -> (metric, model): k = 0 and k = n do not depend on the order
    fill_passes = 0
    stage_seconds = {"prepare": time.perf_counter() - t0, "sensitivity": 0.0, "search": 0.0, "fill": 0.0,
                     "verify": 0.0}

    from tqdm.auto import tqdm

    search_bar = tqdm(desc="mixed precision search", unit="build", disable=not progress, leave=False)

    def probe(k: int):
        if k not in cache:
            if 0 < k < n:
                measure_sensitivity()
            t_probe, t_ort = time.perf_counter(), stage_seconds["verify"]
            qm_k = qm_wide if k == 0 else builder.promoted(order[:k], act_n, w_n, target_op_type, dual_quant_nodes)
            v = measure(qm_k, k)
            cache[k] = (v, qm_k)
            evaluated.append((k, v, size(k)))
            stage_seconds["search"] += time.perf_counter() - t_probe - (stage_seconds["verify"] - t_ort)
            search_bar.update(1)
            search_bar.set_postfix_str(f"{k} narrow: {mname} {v:.4g} (target {target if target is not None else '-'})")
        return cache[k]

    def bisect(lo: int, hi: int) -> int:
        """The k in [lo, hi) where k meets the target and k + 1 does not, given that lo meets it and hi not."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if probe(mid)[0] <= target:
                lo = mid
            else:
                hi = mid
        return lo

    n = len(order)
    wide_v, _ = probe(0)
    message = ""
    narrow_v = None
    where = " in ONNX Runtime" if verify else ""
    if budget_bytes is not None:
        measure_sensitivity()
        fits = [j for j in range(n + 1) if size(j) <= budget_bytes]
        if not fits:
            k = n
            message = (f"the budget {budget_bytes:.0f} B cannot be met even with every layer narrow "
                       f"({size(n):.0f} B): returning the all-narrow model")
            warnings.warn(f"AutoMixprecision: {message}", stacklevel=2)
        else:
            k = fits[0]
            message = f"{k} of {n} layers narrow for {size(k):.0f} B <= {budget_bytes:.0f} B"
        probe(k)
    elif wide_v > target:  # checked before any sensitivity pass: nothing to search
        k = 0
        message = (f"the target {mname} <= {target:g} cannot be met even with every layer wide ({mname} = "
                   f"{wide_v:.6g}{where}): returning the all-wide model")
        warnings.warn(f"AutoMixprecision: {message}", stacklevel=2)
        narrow_v = None
    else:
        narrow_v, _ = probe(n)
        if narrow_v <= target:  # no sensitivity pass needed
            k = n
            message = f"every layer narrow meets the target ({mname} = {narrow_v:.6g} <= {target:g}{where})"
        elif search == "exhaustive":
            measure_sensitivity()
            k = max(j for j in range(n + 1) if probe(j)[0] <= target)
            message = f"{k} of {n} layers narrow ({mname} = {cache[k][0]:.6g} <= {target:g}{where}; exhaustive)"
        else:
            measure_sensitivity()
            lo, hi = 0, n
            # the first probes where the single-layer sensitivities, added up, predict the boundary (and its
            # neighbour): when the effects add up the bracket closes after two builds; when they do not, those
            # builds still narrow it and bisection goes on (the result: k meets the target, k + 1 does not)
            base = sens.baseline
            by_name = {l.name: l.measured[cname] for l in sens.layers}
            guess, acc = 0, wide_v
            for j, name in enumerate(order[:-1]):
                acc += max(0.0, by_name[name] - base)
                if acc > target:
                    break
                guess = j + 1
            guess = min(max(guess, 1), n - 1)
            for cand in (guess, guess + 1 if probe(guess)[0] <= target else guess - 1):
                if lo < cand < hi:
                    if probe(cand)[0] <= target:
                        lo = cand
                    else:
                        hi = cand
            k = bisect(lo, hi)
            message = f"{k} of {n} layers narrow ({mname} = {cache[k][0]:.6g} <= {target:g}{where}; {k + 1} gives " \
                      f"{cache[k + 1][0]:.6g})"
            if fill and k + 1 < n:
                # the layers after the first that breaks the target, tried one by one on the chosen mix in the
                # emulation (its quantizers swapped in, one forward pass each, kept while the emulated metric,
                # shifted by the emulation's offset from the measurement at the chosen mix, holds), then the
                # set built, calibrated and measured like every probe: the sorted order stops at the first
                # too-sensitive layer, this does not
                t_fill = time.perf_counter()
                base_qm, narrow_model = cache[k][1], cache[n][1]  # the chosen mix; the all-narrow model
                f_t = emulation_reference()
                offset = (cache[k][0] - fn(f_t, run_outputs(base_qm, evals, output_index))) if verify else 0.0
                fill_passes += 1 if verify else 0
                accepted, active = [], []
                nix = _ModelIndex(narrow_model)
                try:
                    for name in order[k + 1:]:
                        # the base's index afresh: the patches already on have swapped some of its slots
                        patch = _Patch(base_qm, narrow_model, name, _ModelIndex(base_qm), nix).__enter__()
                        fill_passes += 1
                        if fn(f_t, run_outputs(base_qm, evals, output_index)) + offset <= target:
                            accepted.append(name)
                            active.append(patch)
                        else:
                            patch.__exit__(None, None, None)
                finally:
                    for patch in reversed(active):
                        patch.__exit__(None, None, None)
                stage_seconds["fill"] += time.perf_counter() - t_fill
                if accepted:
                    order = order[:k] + accepted + [m for m in order[k:] if m not in accepted]
                    for j in [j for j in cache if k < j < n]:
                        del cache[j]  # prefixes longer than k are other sets in the new order
                    k2 = k + len(accepted)
                    if probe(k2)[0] <= target:
                        message += (f"; {len(accepted)} more layers after it fit one by one: {k2} of {n} narrow "
                                    f"({mname} = {cache[k2][0]:.6g})")
                        k = k2
                    else:  # not all of them together: the largest prefix of them that fits
                        k3 = bisect(k, k2)
                        message += (f"; {len(accepted)} more layers fit one by one, {k3 - k} of them together "
                                    f"({k3} of {n} narrow, {mname} = {cache[k3][0]:.6g}; {k2} gives "
                                    f"{cache[k2][0]:.6g})")
                        k = k3
    verified: List[Tuple[int, float]] = []
    if verify and budget_bytes is None:
        verified.append((k, cache[k][0]))  # every probe was measured in ONNX Runtime: so is the choice
    for j in sorted({round(i * n / (pareto_points - 1)) for i in range(pareto_points)} if pareto_points > 1 else ()):
        probe(int(j))
    value, qm = cache[k]
    plan = plan_for(k, value)
    if k > 0:
        qm.config = plan.apply(cfg)
    result = AutoMixedPrecisionResult(plan=plan, sensitivity=sens, evaluated=evaluated, wide_value=wide_v,
                                      narrow_value=narrow_v, builds=builder.builds, seconds=time.perf_counter() - t0,
                                      message=message, verified=verified, fill_passes=fill_passes,
                                      stage_seconds=stage_seconds, calibrations=builder.calibrations,
                                      bias_corrections=builder.bias_corrections)
    search_bar.close()
    qm.auto_mp_result = result
    if report_dir is not None:
        result.save(report_dir)
    return plan, qm, result
