"""Inference-only speed-ups for a lifted module: :func:`optimize_for_inference`.

The lifted :class:`torch.fx.GraphModule` keeps one fx node per ONNX node on purpose (every ONNX tensor
stays addressable for a quantizer), which costs CPU time: BatchNormalization runs apart from its Conv,
exported HardSwish / HardSigmoid are four element-wise nodes (one memory pass each), every node pays a
``Module.__call__``, and oneDNN's NCHW convolutions are slower than its channels_last ones. This module
builds a *separate*, faster module computing the same function (up to float rounding) for inference;
the lifted module itself is never modified (quantization works on it).

Passes (on a deep copy, in this order; each is exact up to float rounding, see each helper):

1. Conv -> BatchNormalization folding (``torch.nn.utils.fusion.fuse_conv_bn_eval``), and folding of a
   Conv's following Mul / Div / Add / Sub by a per-output-channel (or scalar) constant into the Conv's
   weight and bias (what ONNX Runtime's ConvBNFusion / ConvMulFusion / ConvAddFusion do).
2. Element-wise pattern fusion: ``x * clip(x + 3, 0, 6) / 6`` -> ``F.hardswish`` and
   ``clip(x + 3, 0, 6) / 6`` -> ``F.hardsigmoid`` (torch's CPU kernels evaluate the same expression in
   the same order, so the result is bit-identical; checked in tests/lift/test_optimize.py); the other
   association ``x * (clip(x + 3, 0, 6) / 6)`` -> ``F.hardswish`` too (equal up to one rounding).
3. Module calls replaced by direct function calls where the module is a thin wrapper on float data
   (Add/Sub/Mul/Div -> ``torch.add``...; baked Clip -> ``torch.clamp``; HardSigmoid; Reshape with a
   constant shape -> ``torch.reshape`` with a Python shape), removing the per-node module overhead.
4. ``channels_last`` memory format for 4-D weights and inputs (oneDNN's fast convolution layout).
5. Optionally ``torch.compile`` (inductor, weight freezing) or ``torch.jit.freeze`` of a trace.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn.utils.fusion import fuse_conv_bn_eval

from ..errors import ConfigError, DataError, ModelError

__all__ = ["optimize_for_inference", "OptimizedModule", "COMPILE_MODES"]

#: Accepted values of ``compile``: no compilation, TorchInductor (needs a C++ compiler on CPU), TorchScript.
COMPILE_MODES = ("none", "inductor", "jit")

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_ARITH_FN = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}


# ============================================================================================ helpers
def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_module(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)


def _module(gm: fx.GraphModule, node) -> nn.Module | None:
    if isinstance(node, fx.Node) and node.op == "call_module":
        return gm.get_submodule(node.target)
    return None


def _binary_op(gm: fx.GraphModule, node) -> str | None:
    """The ONNX op of an ``OnnxBinaryOp`` call (``"Add"``...), else None."""
    m = _module(gm, node)
    if m is not None and type(m).__name__ == "OnnxBinaryOp":
        return m.op
    if isinstance(node, fx.Node) and node.op == "call_function" and node.meta.get("qtorch_binary"):
        return node.meta["qtorch_binary"]
    return None


def _const(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = _fetch(gm, node.target)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _scalar(gm: fx.GraphModule, node) -> float | None:
    c = _const(gm, node)
    if c is not None and c.numel() == 1 and c.is_floating_point():
        return float(c.reshape(()))
    return None


def _dtype(node) -> torch.dtype | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return getattr(meta, "dtype", None)


def _shape(node) -> tuple | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    shape = getattr(meta, "shape", None)
    return None if shape is None else tuple(shape)


def _single_user(node) -> bool:
    return isinstance(node, fx.Node) and len(node.users) == 1


def _calls_of(graph: fx.Graph, target: str) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_module" and n.target == target)


def _is_float(*nodes) -> bool:
    return all(_dtype(n) in _FLOATS for n in nodes)


# ============================================================================================ pass 1: folding
def _fold_conv_bn(gm: fx.GraphModule) -> int:
    """Conv{1,2,3}d -> BatchNorm{1,2,3}d (eval statistics, the conv's only user) -> one Conv whose weight
    ``W * gamma / sqrt(var + eps)`` and bias ``(b - mean) * gamma / sqrt(var + eps) + beta`` come from
    ``torch.nn.utils.fusion.fuse_conv_bn_eval`` (Ioffe & Szegedy 2015, eq. of the BN transform)."""
    count = 0
    for bn_node in list(gm.graph.nodes):
        bn = _module(gm, bn_node)
        if not isinstance(bn, _BNS) or len(bn_node.args) != 1 or bn_node.kwargs:
            continue
        conv_node = bn_node.args[0]
        conv = _module(gm, conv_node)
        if (not isinstance(conv, _CONVS) or not _single_user(conv_node) or bn.running_mean is None
                or _calls_of(gm.graph, conv_node.target) != 1 or conv.weight.shape[0] != bn.num_features):
            continue
        _set_module(gm, conv_node.target, fuse_conv_bn_eval(conv.eval(), bn.eval()))
        bn_node.replace_all_uses_with(conv_node)
        gm.graph.erase_node(bn_node)
        count += 1
    return count


def _channel_vector(c: torch.Tensor, out_shape: tuple | None, channels: int) -> torch.Tensor | None:
    """``c`` as a per-output-channel vector ``[channels]`` when broadcasting it against a conv output of
    shape ``out_shape`` (N, C, spatial...) only scales/shifts channels, else None."""
    if c.numel() == 1:
        return c.reshape(1).expand(channels)
    if out_shape is None or c.dim() > len(out_shape):
        return None
    full = (1,) * (len(out_shape) - c.dim()) + tuple(c.shape)
    if any(d != 1 for i, d in enumerate(full) if i != 1) or full[1] != channels:
        return None
    return c.reshape(channels)


def _fold_conv_affine(gm: fx.GraphModule) -> int:
    """Conv -> Mul/Div/Add/Sub by a per-channel constant (the conv's only user) -> one Conv.

    With ``v`` the constant per output channel: Mul gives ``W*v, b*v``; Div ``W/v, b/v``; Add ``b+v``;
    Sub (conv - v) ``b-v``. Exact in real arithmetic, equal up to float rounding (the scaling moves before
    the accumulation). Repeats until no pattern is left (PP-OCRv4's Conv -> Mul -> Add "affine" blocks).
    """
    count = 0
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            op = _binary_op(gm, node)
            if op not in _ARITH_FN or len(node.args) != 2:
                continue
            a, b = node.args
            conv_node, const_node = (a, b) if isinstance(_module(gm, a), _CONVS) else (b, a)
            if op in ("Div", "Sub") and conv_node is not a:
                continue
            conv = _module(gm, conv_node)
            c = _const(gm, const_node)
            if (not isinstance(conv, _CONVS) or c is None or not _single_user(conv_node)
                    or _calls_of(gm.graph, conv_node.target) != 1 or c.dtype != conv.weight.dtype
                    or _shape(node) != _shape(conv_node)):
                continue
            out_ch = conv.weight.shape[0]
            v = _channel_vector(c.detach(), _shape(conv_node), out_ch)
            if v is None or (op == "Div" and bool((v == 0).any())):
                continue
            new = copy.deepcopy(conv)
            w = new.weight.detach()
            bias = new.bias.detach() if new.bias is not None else torch.zeros(out_ch, dtype=w.dtype)
            vw = v.reshape((-1,) + (1,) * (w.dim() - 1))
            if op == "Mul":
                w, bias = w * vw, bias * v
            elif op == "Div":
                w, bias = w / vw, bias / v
            elif op == "Add":
                bias = bias + v
            else:
                bias = bias - v
            new.weight = nn.Parameter(w.contiguous(), requires_grad=False)
            new.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
            _set_module(gm, conv_node.target, new)
            node.replace_all_uses_with(conv_node)
            gm.graph.erase_node(node)
            count += 1
            changed = True
    return count


# ============================================================================================ pass 2: patterns
def _is_clip(gm: fx.GraphModule, node, lo: float, hi: float) -> bool:
    m = _module(gm, node)
    if m is not None and type(m).__name__ == "OnnxClip":
        return bool(m.baked) and m.lo == lo and m.hi == hi and len(node.args) == 1
    return False


def _plus_three_input(gm: fx.GraphModule, node):
    """``x`` when ``node`` is ``x + 3`` (Add with a scalar constant 3, single user), else None."""
    if _binary_op(gm, node) != "Add" or not _single_user(node):
        return None
    a, b = node.args
    if _scalar(gm, b) == 3.0 and _const(gm, a) is None:
        return a
    if _scalar(gm, a) == 3.0 and _const(gm, b) is None:
        return b
    return None


def _relu6_of_plus_three(gm: fx.GraphModule, node):
    """``x`` when ``node`` is ``clip(x + 3, 0, 6)`` with single-user intermediates, else None."""
    if not _is_clip(gm, node, 0.0, 6.0) or not _single_user(node):
        return None
    return _plus_three_input(gm, node.args[0])


def _div_by_six(gm: fx.GraphModule, node):
    """The numerator when ``node`` is ``n / 6``, else None."""
    if _binary_op(gm, node) == "Div" and _scalar(gm, node.args[1]) == 6.0:
        return node.args[0]
    return None


def _fuse_hard_activations(gm: fx.GraphModule) -> tuple[int, int]:
    """Rewrite exported HardSwish / HardSigmoid chains on float tensors into torch's fused kernels.

    HardSwish (Howard et al. 2019, "Searching for MobileNetV3", eq. 2): ``x * relu6(x + 3) / 6`` as
    ``Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)`` or ``Mul(x, Div(Clip(Add(x, 3), 0, 6), 6))``;
    HardSigmoid: ``Div(Clip(Add(x, 3), 0, 6), 6)``. Returns ``(hardswish count, hardsigmoid count)``.
    """
    n_swish = n_sig = 0
    # two sweeps: HardSwish first, so that its inner Div(Clip(Add(x, 3)), 6) is not taken for a HardSigmoid
    for sweep in ("hardswish", "hardsigmoid"):
        for node in list(gm.graph.nodes):
            if node.graph is not None and _is_float(node):
                n_swish, n_sig = _fuse_one(gm, node, sweep, n_swish, n_sig)
    return n_swish, n_sig


def _fuse_one(gm: fx.GraphModule, node, sweep: str, n_swish: int, n_sig: int) -> tuple[int, int]:
    x = None
    num = _div_by_six(gm, node)
    if sweep == "hardswish":
        if num is not None and _binary_op(gm, num) == "Mul" and _single_user(num):
            p, q = num.args
            for lhs, rhs in ((p, q), (q, p)):
                if _relu6_of_plus_three(gm, rhs) is lhs:
                    x, dead = lhs, [num, rhs, rhs.args[0]]
                    break
        elif _binary_op(gm, node) == "Mul":
            p, q = node.args
            for lhs, rhs in ((p, q), (q, p)):
                inner = _div_by_six(gm, rhs)
                if inner is not None and _single_user(rhs) and _relu6_of_plus_three(gm, inner) is lhs:
                    x, dead = lhs, [rhs, inner, inner.args[0]]
                    break
        if x is None:
            return n_swish, n_sig
        fn = F.hardswish
        n_swish += 1
    else:
        if num is None or not _single_user(num) or _relu6_of_plus_three(gm, num) is None:
            return n_swish, n_sig
        x, dead, fn = _relu6_of_plus_three(gm, num), [num, num.args[0]], F.hardsigmoid
        n_sig += 1
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(fn, (x,))
    fused.meta = dict(node.meta)
    node.replace_all_uses_with(fused)
    gm.graph.erase_node(node)
    for d in dead:  # producers first consumed by the erased node, now unused
        if not d.users:
            gm.graph.erase_node(d)
    return n_swish, n_sig


# ============================================================================================ pass 3: calls
def _hard_sigmoid(x: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """ONNX HardSigmoid ``clip(alpha * x + beta, 0, 1)`` (as onnx2torch's module computes it)."""
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


def _reshape_static(x: torch.Tensor, dims: tuple, allowzero: bool) -> torch.Tensor:
    """ONNX Reshape with a constant shape: 0 copies the input dim unless ``allowzero``; -1 is inferred."""
    if not allowzero and 0 in dims:
        dims = tuple(x.shape[i] if d == 0 else d for i, d in enumerate(dims))
    return torch.reshape(x, dims)


def _reshape_dynamic(x: torch.Tensor, shape: torch.Tensor, allowzero: bool) -> torch.Tensor:
    """ONNX Reshape with a runtime int64 ``shape`` tensor (same rules as :func:`_reshape_static`)."""
    return _reshape_static(x, tuple(int(v) for v in shape.tolist()), allowzero)


def _inline_calls(gm: fx.GraphModule) -> int:
    """Replace thin wrapper modules on float data by direct calls of the same torch function."""
    count = 0
    for node in list(gm.graph.nodes):
        m = _module(gm, node)
        if m is None:
            continue
        kind = type(m).__name__
        new = None
        if kind == "OnnxBinaryOp" and m.op in _ARITH_FN and len(node.args) == 2 and _is_float(node, *node.args):
            new = (_ARITH_FN[m.op], tuple(node.args))
        elif kind == "OnnxClip" and m.baked and m.lo is not None and m.hi is not None and _is_float(node):
            new = (torch.clamp, (node.args[0], float(m.lo), float(m.hi)))
        elif kind == "OnnxHardSigmoid" and _is_float(node):
            new = (_hard_sigmoid, (node.args[0], float(m.alpha), float(m.beta)))
        elif kind == "OnnxReshape" and len(node.args) == 2 and not node.kwargs:
            allowzero = bool(getattr(m, "allowzero", False))  # onnx2torch's module: ONNX Reshape-5/13 (no allowzero)
            shape = _const(gm, node.args[1])
            if shape is not None:
                new = (_reshape_static, (node.args[0], tuple(int(v) for v in shape.tolist()), allowzero))
            else:
                new = (_reshape_dynamic, (node.args[0], node.args[1], allowzero))
        elif isinstance(m, nn.ReLU) and len(node.args) == 1:
            new = (torch.relu, (node.args[0],))
        if new is None:
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(new[0], new[1])
        call.meta = dict(node.meta)
        if kind == "OnnxBinaryOp":
            call.meta["qtorch_binary"] = m.op
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        count += 1
    return count


# ============================================================================================ layout
def _to_channels_last(module: nn.Module) -> None:
    for mod in module.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None and p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
        for key, b in list(mod._buffers.items()):
            if b is not None and b.dim() == 4:
                mod._buffers[key] = b.contiguous(memory_format=torch.channels_last)


class OptimizedModule(nn.Module):
    """The module :func:`optimize_for_inference` returns: runs ``inner`` under ``torch.no_grad`` on the
    inputs (4-D floating inputs converted to channels_last first when ``channels_last``).

    Attributes: ``inner`` (the rewritten GraphModule, possibly compiled), ``input_names``,
    ``output_names``, ``report`` (``{pass name: rewrites}``, ``compile``, ``compile_s``).

    Raises:
        DataError: a call with a different number of inputs, or dtypes other than the example's.
    """

    def __init__(self, inner: nn.Module, graph_module: fx.GraphModule, dtypes: Sequence[torch.dtype | None],
                 channels_last: bool, report: dict):
        super().__init__()
        self.inner = inner
        self.graph_module = graph_module
        self.input_names = list(getattr(graph_module, "input_names", []))
        self.output_names = list(getattr(graph_module, "output_names", []))
        self._dtypes = tuple(dtypes)
        self.channels_last = bool(channels_last)
        self.report = report

    def forward(self, *args):  # noqa: D102
        if len(args) != len(self._dtypes):
            raise DataError(f"the optimized module takes {len(self._dtypes)} inputs {self.input_names}, "
                            f"got {len(args)}")
        for i, (a, want) in enumerate(zip(args, self._dtypes)):
            got = a.dtype if isinstance(a, torch.Tensor) else None
            if got != want:
                name = self.input_names[i] if i < len(self.input_names) else f"#{i}"
                raise DataError(f"input {name!r}: dtype {got} but the module was optimized for {want} "
                                f"(call optimize_for_inference again with such example inputs)")
        if self.channels_last:
            args = tuple(a.contiguous(memory_format=torch.channels_last)
                         if a.dim() == 4 and a.is_floating_point() else a for a in args)
        with torch.no_grad():
            return self.inner(*args)


# ============================================================================================ entry point
def optimize_for_inference(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], *,
                           compile: str = "none", channels_last: bool = True, fold: bool = True,
                           fuse: bool = True, inline: bool = True) -> OptimizedModule:
    """A faster module computing the same function as the lifted ``gm``, for inference only.

    ``gm`` is not modified (it is deep-copied): quantization keeps working on it. The returned module
    has no autograd (runs under ``torch.no_grad``), its parameters are frozen copies, and it expects
    inputs of the example's dtypes (shapes may change; the rewrites do not depend on them, except that
    ``compile="inductor"`` recompiles for new shapes and ``"jit"`` traces at the example's shapes).
    Outputs equal ``gm``'s up to float rounding (folding moves per-channel scales into conv weights;
    fused activations are bit-identical); output memory format may be channels_last.

    Args:
        gm: a GraphModule from :func:`qtorch_onnx.lift.lift` (any ``fx.GraphModule`` works).
        example_inputs: one tensor per graph input, in ``gm``'s placeholder order (e.g. float32
            ``[N, C, H, W]`` images), used to learn each node's dtype and shape (``ShapeProp``) and to
            trigger compilation.
        compile: ``"none"`` (eager, fx rewrites only), ``"inductor"`` (``torch.compile`` with weight
            freezing; on CPU it needs a C++ compiler and takes tens of seconds), or ``"jit"``
            (``torch.jit.trace`` + ``torch.jit.freeze`` + ``torch.jit.optimize_for_inference``).
        channels_last: convert 4-D weights and inputs to ``torch.channels_last``.
        fold: fold Conv -> BatchNorm and Conv -> Mul/Div/Add/Sub(per-channel constant) into the Conv.
        fuse: rewrite HardSwish / HardSigmoid element-wise chains into torch's fused functions.
        inline: replace thin wrapper modules by direct torch function calls.

    Returns:
        :class:`OptimizedModule`; ``.report`` counts the rewrites per pass and the compile time (s).

    Raises:
        ConfigError: ``compile`` is not one of :data:`COMPILE_MODES`.
        ModelError: ``gm`` is not an ``fx.GraphModule``, or it fails on ``example_inputs``.
        DataError: ``example_inputs`` does not have one tensor per graph input.
    """
    import time

    if compile not in COMPILE_MODES:
        raise ConfigError(f"compile={compile!r} is not valid; expected one of {COMPILE_MODES}")
    if not isinstance(gm, fx.GraphModule):
        raise ModelError(f"optimize_for_inference expects a torch.fx.GraphModule (from qtorch_onnx.lift), "
                         f"got {type(gm).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    n_in = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if len(example_inputs) != n_in or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        raise DataError(f"example_inputs must be {n_in} tensors (one per graph input "
                        f"{list(getattr(gm, 'input_names', []))}), got "
                        f"{[type(t).__name__ for t in example_inputs]}")
    opt = copy.deepcopy(gm).eval()
    for p in opt.parameters():
        p.requires_grad_(False)
    try:
        with torch.no_grad():
            ShapeProp(opt).propagate(*example_inputs)
    except Exception as exc:
        raise ModelError(f"the lifted module fails on the example inputs "
                         f"{[(tuple(t.shape), t.dtype) for t in example_inputs]}: {exc}") from exc
    report: dict = {}
    if fold:
        report["conv_bn"] = _fold_conv_bn(opt)
        report["conv_affine"] = _fold_conv_affine(opt)
    if fuse:
        report["hardswish"], report["hardsigmoid"] = _fuse_hard_activations(opt)
    if inline:
        report["inlined"] = _inline_calls(opt)
    opt.graph.eliminate_dead_code()
    opt.graph.lint()
    opt.recompile()
    opt.delete_all_unused_submodules()
    if channels_last:
        _to_channels_last(opt)
    args = tuple(a.contiguous(memory_format=torch.channels_last) if channels_last and a.dim() == 4
                 and a.is_floating_point() else a for a in example_inputs)
    t0 = time.perf_counter()
    inner: nn.Module = opt
    with torch.no_grad():
        if compile == "inductor":
            inner = torch.compile(opt, backend="inductor", options={"freezing": True})
            inner(*args)  # compiles now rather than on the user's first call
        elif compile == "jit":
            traced = torch.jit.trace(opt, args, check_trace=False)
            inner = torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))
            inner(*args)
    report["compile"] = compile
    report["compile_s"] = time.perf_counter() - t0
    return OptimizedModule(inner, opt, [t.dtype for t in example_inputs], channels_last, report)
