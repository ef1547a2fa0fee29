"""Graph optimization before quantization: the fusions that change *what* gets quantized.

A float layer followed by a constant affine step (``Conv -> Mul(s) -> Add(c)``, the form paddle2onnx and
other exporters give an inference BatchNormalization; ``ConvTranspose -> Add(bias)``; ``MatMul -> Add(bias)``)
is one layer with a bias to a deployed integer kernel: fused, its bias is quantized to INT32 with the
layer's own scale and no activation quantizer sits between the steps. Likewise an exporter's
``x * Clip(x + 3, 0, 6) / 6`` is one ``HardSwish`` (one output quantizer instead of four). This is what
Quark's ``optimize_model=True`` (its default; ONNX Runtime's basic level run offline) achieves; here the
rewriting is done by onnxscript's pattern rewriter (``onnxscript.rewriter``), with its own rules where it
has them and rules of ours, written against its public ``RewriteRuleClassBase`` extension point, where
it does not (per-channel Mul/Add into Conv/ConvTranspose, and MatMul + Add -> Gemm only with constant
operands: onnxscript's rule would also turn a residual ``MatMul + Add(activation)`` into a Gemm whose C
is an activation, which a quantized Gemm would wrongly treat as a bias).

The rules (:data:`RULES`, applied in this order until nothing changes):

=============================== =============================================================================
rule                            rewrite
=============================== =============================================================================
``ConvMul``                     ``Mul(Conv(x, W, b), s)`` -> ``Conv(x, W * s, b * s)``, s a per-output-channel
                                or scalar constant; also ConvTranspose (groups included)
``ConvAdd``                     ``Add(Conv(x, W, b), c)`` -> ``Conv(x, W, b + c)``; also ConvTranspose
``FuseBatchNormIntoConvTranspose`` / ``...Gemm``  onnxscript's (``BatchNormalization`` into a preceding
                                ConvTranspose or Gemm; BN into Conv is :func:`normalize`'s ``fold_batchnorm``)
``MatMulAddToGemm`` (+ Transpose variants)  ``Add(MatMul(a, B), c)`` -> ``Gemm(a, B, c)`` for rank-2 ``a``
                                and constant ``B`` and ``c`` (onnxscript's rule, constants required here)
``HardSwishFusion*``            onnxscript's: ``x * Clip(x + 3, 0, 6) / 6`` and ``x * HardSigmoid(x)`` ->
                                ``HardSwish(x)`` (opset >= 14, where HardSwish exists);
                                ``Clip(x + 3, 0, 6) / 6`` -> ``HardSigmoid(x)``
=============================== =============================================================================

Every rule needs its weight / bias / constant operands to be initializers read by nothing else (so no
other reader sees a changed value) and the intermediate tensor to have no other reader and not be a graph
output (onnxscript's matcher checks that). Folded values are computed in float64 and stored in the
weight's dtype. The fused node writes the name of the last tensor of its pattern, so graph inputs and
outputs, and every tensor name that survives, keep their names; the fused node takes the name of the first node
it replaced (the Conv of ``Conv -> Mul -> Add``, the MatMul of ``MatMul + Add``); weights keep their initializer names
(their values change); a bias created by ``ConvAdd`` takes the added constant's name. The float function
changes only by rounding (a few ulps of float32), as with ONNX Runtime's own fusions.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Dict, List, Optional, Tuple

import numpy as np
import onnx

from ..errors import ModelError
from .normalize import _all_tensor_names, normalize_with_aliases

__all__ = ["FusionReport", "fuse_for_quantization", "normalize_and_fuse", "rule_names"]


@dataclasses.dataclass
class FusionReport:
    """What :func:`fuse_for_quantization` did.

    Attributes:
        applied: rule name -> number of rewrites (rules that never fired are absent).
        nodes_before / nodes_after: node counts of the top-level graph.
        removed: tensor names of the input model that no longer exist -> the surviving tensor that now
            carries the value of the fused pattern (e.g. a Conv output fused with the Add after it -> the
            Add's output), or ``None``.
        error: when a pass failed and the unoptimized model was returned: the pass and the failure.
    """
    applied: Dict[str, int] = dataclasses.field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    removed: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)
    error: Optional[str] = None

    def summary(self) -> str:
        """One line: ``"Conv+Add 28, HardSwish 24 (412 -> 312 nodes)"``."""
        if self.error:
            return f"graph optimization skipped: {self.error}"
        if not self.applied:
            return f"graph optimization: nothing to fuse ({self.nodes_before} nodes)"
        parts = ", ".join(f"{k} {v}" for k, v in self.applied.items())
        return f"graph optimization: {parts} ({self.nodes_before} -> {self.nodes_after} nodes)"


# ------------------------------------------------------------------------------------------- rules
def _rules():
    """The rule objects (built on first use: onnxscript is imported lazily)."""
    from onnxscript import ir
    from onnxscript.rewriter import _ir_utils
    from onnxscript.rewriter._basics import MatchResult
    from onnxscript.rewriter._rewrite_rule import RewriteRuleClassBase
    from onnxscript.rewriter.rules.common import _fuse_batchnorm, _fuse_hardswish, _matmul_add_to_gemm

    def _only_reader(value: "ir.Value", nodes) -> bool:
        return all(user in nodes for user, _ in value.uses()) and not value.is_graph_output()

    def _const(value: "ir.Value") -> Optional[np.ndarray]:
        if value is None or not value.is_initializer() or value.const_value is None or value.is_graph_input():
            return None
        return value.const_value.numpy()

    def _per_channel(c: np.ndarray, rank: int, channels: int) -> Optional[np.ndarray]:
        """``c`` (broadcast against a [N, C, ...] tensor of rank ``rank``) as a float64 vector [C], or None
        when it varies along any other axis or would broadcast the output to a larger shape."""
        if c.ndim > rank or c.dtype.kind != "f":
            return None
        shape = (1,) * (rank - c.ndim) + tuple(c.shape)
        if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
            return None
        return np.broadcast_to(c.reshape(-1).astype(np.float64), (channels,)).copy()

    def k_reader(layer_out: "ir.Value") -> "ir.Node":
        """The Mul/Add node reading the layer output (its only reader, as the matcher checked)."""
        return next(iter(user for user, _ in layer_out.uses()))

    def _fresh(graph: "ir.Graph", base: str) -> str:
        taken = set(graph.initializers) | {v.name for v in graph.inputs}
        taken.update(o.name for n in graph for o in n.outputs)
        name, i = base, 1
        while name in taken:
            name, i = f"{base}{i}", i + 1
        return name

    class _LayerAffine(RewriteRuleClassBase):
        """Base of ConvMul / ConvAdd: ``Op(layer(x, W, [b]), k)`` with a per-output-channel constant k."""
        layer: ClassVar[str] = "Conv"
        affine: ClassVar[str] = "Mul"

        def pattern(self, op, x, k):
            out = getattr(op, self.layer)(x, _allow_other_inputs=True, _outputs=["layer_out"])
            return getattr(op, self.affine)(out, k)

        def _operands(self, layer_out):
            node = layer_out.producer()
            w_val = node.inputs[1] if len(node.inputs) > 1 else None
            b_val = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] is not None else None
            return node, w_val, b_val

        def _channels(self, node, w: np.ndarray) -> int:
            if self.layer == "Conv":
                return w.shape[0]
            group = node.attributes.get_int("group", 1)
            return w.shape[1] * group

        def check(self, context, x, k, layer_out) -> "MatchResult":
            result = MatchResult()
            node, w_val, b_val = self._operands(layer_out)
            w = _const(w_val)
            if w is None or w.dtype.kind != "f":
                return result.fail(f"{self.layer} weight is not a float initializer")
            nodes = {node}
            if not _only_reader(w_val, nodes) or (b_val is not None and (_const(b_val) is None
                                                                          or not _only_reader(b_val, nodes))):
                return result.fail("weight/bias shared with another node or not constant")
            kv = _const(k)
            if kv is None:
                return result.fail(f"{self.affine} operand is not a constant initializer")
            if _per_channel(kv, w.ndim, self._channels(node, w)) is None:
                return result.fail(f"{self.affine} operand {list(kv.shape)} is not per output channel")
            return result

        def rewrite(self, op, x, k, layer_out):
            node, w_val, b_val = self._operands(layer_out)
            w = w_val.const_value.numpy()
            channels = self._channels(node, w)
            kv = _per_channel(k.const_value.numpy(), w.ndim, channels)
            b = b_val.const_value.numpy().astype(np.float64) if b_val is not None else np.zeros(channels)
            if self.affine == "Mul":
                if self.layer == "Conv":
                    w_new = w.astype(np.float64) * kv.reshape((-1,) + (1,) * (w.ndim - 1))
                else:  # ConvTranspose: W [C_in, C_out/group, k...], output channel g*(C_out/group) + j
                    group = node.attributes.get_int("group", 1)
                    wg = w.astype(np.float64).reshape((group, w.shape[0] // group) + w.shape[1:])
                    wg = wg * kv.reshape((group, 1, w.shape[1]) + (1,) * (w.ndim - 2))
                    w_new = wg.reshape(w.shape)
                b_new = b * kv
                w_init = op.initializer(ir.tensor(w_new.astype(w.dtype)), name=w_val.name)
            else:
                b_new = b + kv
                w_init = w_val
            if b_val is None and self.affine == "Mul":
                return getattr(op, self.layer)(node.inputs[0], w_init, **node.attributes)
            if b_val is not None:
                b_name = b_val.name
            elif _only_reader(k, {k_reader(layer_out)}):
                b_name = k.name
            else:
                b_name = _fresh(node.graph, f"{w_val.name}_bias")
            b_init = op.initializer(ir.tensor(b_new.astype(w.dtype)), name=b_name)
            return getattr(op, self.layer)(node.inputs[0], w_init, b_init, **node.attributes)

    class ConvMul(_LayerAffine):
        affine = "Mul"

    class ConvAdd(_LayerAffine):
        affine = "Add"

    class ConvTransposeMul(_LayerAffine):
        layer, affine = "ConvTranspose", "Mul"

    class ConvTransposeAdd(_LayerAffine):
        layer, affine = "ConvTranspose", "Add"

    def _const_gemm(base):
        class _Const(base):
            def check(self, context, input_a, input_b, input_c, **kw) -> "MatchResult":
                result = super().check(context, input_a, input_b, **kw)
                if not result:
                    return result
                b, c = _const(input_b), _const(input_c)
                if b is None or c is None or b.dtype.kind != "f":
                    return MatchResult().fail("MatMul weight or Add operand is not a constant initializer")
                n = b.shape[0] if self.trans_b else b.shape[1]
                if c.ndim > 2 or (c.ndim >= 1 and c.shape[-1] not in (1, n)) or (c.ndim == 2 and c.shape[0] != 1):
                    return MatchResult().fail(f"Add operand {list(c.shape)} is not a bias over {n} columns")
                return result
        _Const.__name__ = base.__name__
        return _Const

    hs = _fuse_hardswish
    return [
        ("Conv+Mul", ConvMul().rule(), True, 1),
        ("ConvTranspose+Mul", ConvTransposeMul().rule(), True, 1),
        ("Conv+Add", ConvAdd().rule(), True, 1),
        ("ConvTranspose+Add", ConvTransposeAdd().rule(), True, 1),
        ("BatchNormalization->ConvTranspose", _fuse_batchnorm.FuseBatchNormIntoConvTranspose().rule(), False, 1),
        ("BatchNormalization->Gemm", _fuse_batchnorm.FuseBatchNormIntoGemm().rule(), False, 1),
        ("MatMul+Add->Gemm", _const_gemm(_matmul_add_to_gemm.MatMulAddToGemm)().rule(), True, 1),
        ("MatMul+Add->Gemm", _const_gemm(_matmul_add_to_gemm.TransBMatMulAddToGemm)().rule(), True, 1),
        ("HardSwish", hs.HardSwishFusion().rule(), True, 14),
        ("HardSwish", hs.HardSwishFusionFromHardSigmoid().rule(), True, 14),
        ("HardSigmoid", hs.HardSigmoidFusion().rule(), False, 1),
    ]


_RULES_CACHE: List[Tuple[str, object, bool, int]] = []  # (name, rule, commute, minimum ai.onnx opset)


def _rule_list():
    if not _RULES_CACHE:
        _RULES_CACHE.extend(_rules())
    return _RULES_CACHE


def rule_names() -> Tuple[str, ...]:
    """The names :attr:`FusionReport.applied` uses, in application order."""
    return tuple(dict.fromkeys(name for name, _, _, _ in _rule_list()))


def _keep_node_names(before: onnx.GraphProto, after: onnx.GraphProto) -> None:
    """Give each node the rewriter created the name of the first original node it replaced (in place on
    ``after``): a fused ``Conv -> Mul -> Add`` keeps the Conv's name, ``MatMul + Add -> Gemm`` the MatMul's, so
    ``nodes_to_exclude`` / ``nodes_to_quantize`` naming the layer still find it. The replaced nodes of a new
    node are the original nodes whose outputs no longer exist and lie upstream of its output, up to its
    inputs, plus the original producer of its output."""
    old_names = {n.name for n in before.node}
    producer = {o: n for n in before.node for o in n.output if o}
    position = {id(n): i for i, n in enumerate(before.node)}
    surviving = {o for n in after.node for o in n.output if o} | {t.name for t in after.initializer}
    surviving |= {v.name for v in after.input}
    taken = {n.name for n in after.node}
    for node in after.node:
        if node.name in old_names or not node.output or node.output[0] not in producer:
            continue
        stop = set(node.input)
        replaced, todo, seen = [], [node.output[0]], set()
        while todo:  # walk the original graph upstream from the fused output to the fused node's inputs
            t = todo.pop()
            src = producer.get(t)
            if src is None or id(src) in seen or t in stop:
                continue
            if t != node.output[0] and t in surviving:
                continue
            seen.add(id(src))
            replaced.append(src)
            todo.extend(i for i in src.input if i)
        for src in sorted(replaced, key=lambda n: position[id(n)]):
            if src.name and src.name not in taken:
                taken.discard(node.name)
                node.name = src.name
                taken.add(src.name)
                break


def fuse_for_quantization(model: onnx.ModelProto, *, max_rounds: int = 8) -> Tuple[onnx.ModelProto, FusionReport]:
    """Apply the fusions of this module's table to a copy of ``model``.

    Args:
        model: a normalized float model (:func:`~qtorch_onnx.lift.normalize`: constants are initializers,
            shapes inferred); never modified.
        max_rounds: passes over the rule list at most (each pass applies every rule to every node; a
            pass that changes nothing ends the loop).

    Returns:
        ``(fused, report)``: ``fused`` is a new ModelProto without ``value_info`` (normalize it again for
        shapes); when a pass fails, ``fused`` is an unmodified copy of ``model`` and ``report.error`` names
        the rule and the failure (the caller decides whether to warn; nothing is lost).

    Raises:
        ModelError: ``model`` is not a ModelProto.
    """
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"fuse_for_quantization() takes an onnx.ModelProto, got {type(model).__name__}")
    from onnxscript import ir
    from onnxscript.rewriter._rewrite_rule import RewriteRuleSet

    report = FusionReport(nodes_before=len(model.graph.node))
    before = _all_tensor_names(model.graph)
    ir_model = ir.serde.deserialize_model(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    last_rule = ""
    try:
        for _ in range(max_rounds):
            changed = 0
            for name, rule, commute, min_opset in _rule_list():
                if opset < min_opset:
                    continue
                last_rule = name
                n = RewriteRuleSet([rule], commute=commute).apply_to_model(ir_model)
                if n:
                    report.applied[name] = report.applied.get(name, 0) + n
                    changed += n
            if not changed:
                break
        ir.passes.common.RemoveUnusedNodesPass()(ir_model)
        fused = ir.serde.serialize_model(ir_model)
    except Exception as exc:  # a rewrite that fails must not lose the user's model: report and fall back
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        report.applied = {}
        report.error = f"rule {last_rule!r} failed: {type(exc).__name__}: {exc}"
        report.nodes_after = report.nodes_before
        return copy, report
    del fused.graph.value_info[:]
    report.nodes_after = len(fused.graph.node)
    after = _all_tensor_names(fused.graph)
    _keep_node_names(model.graph, fused.graph)
    # a vanished intermediate of a fused pattern: the surviving output of the node that replaced it is
    # the first surviving downstream tensor of the original graph reading it (one reader, by construction)
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    initializers = {t.name for t in model.graph.initializer}
    for name in sorted(before - after):
        if name in initializers:  # a folded constant (its value now lives in a weight or bias)
            report.removed[name] = None
            continue
        cur, found, seen = name, None, set()
        while cur not in seen:
            seen.add(cur)
            nxt = [o for n in readers.get(cur, ()) for o in n.output if o]
            if not nxt:
                break
            hit = [o for o in nxt if o in after]
            if hit:
                found = hit[0]
                break
            cur = nxt[0]
        report.removed[name] = found
    return fused, report


def normalize_and_fuse(model: onnx.ModelProto, *, fold_batchnorm: bool = False, optimize: bool = False
                       ) -> Tuple[onnx.ModelProto, Dict[str, Optional[str]], Optional[FusionReport]]:
    """:func:`~qtorch_onnx.lift.normalize_with_aliases`, then (``optimize=True``) :func:`fuse_for_quantization`
    and normalization of its result: the graph :func:`~qtorch_onnx.lift.lift` lifts.

    Args:
        model: the ONNX model (never modified).
        fold_batchnorm: as in :func:`~qtorch_onnx.lift.normalize`.
        optimize: apply the fusions of this module (Quark's ``optimize_model``).

    Returns:
        ``(normalized, aliases, report)``: ``aliases`` maps every tensor name of ``model`` that no longer
        exists to the surviving tensor carrying its value (or the fused pattern's value), or ``None``;
        ``report`` is the :class:`FusionReport` (``None`` without ``optimize``). A fusion pass that fails
        is reported in ``report.error`` with a :class:`UserWarning`, and the unfused graph is returned.

    Raises:
        ModelError: as :func:`~qtorch_onnx.lift.normalize_with_aliases`.
    """
    normalized, aliases = normalize_with_aliases(model, fold_batchnorm=fold_batchnorm)
    if not optimize:
        return normalized, aliases, None
    fused, report = fuse_for_quantization(normalized)
    if report.error:
        import warnings

        warnings.warn(f"model {model.graph.name!r}: {report.summary()}; the unoptimized graph is used",
                      stacklevel=2)
        return normalized, aliases, report
    if not report.applied:
        return normalized, aliases, report
    renormalized, more = normalize_with_aliases(fused)
    removed = {**report.removed, **more}

    def survivor(name: Optional[str]) -> Optional[str]:
        seen = set()
        while name is not None and name in removed and name not in seen:
            seen.add(name)
            name = removed[name]
        return name

    combined = {k: survivor(v) for k, v in aliases.items()}
    combined.update({k: survivor(k) for k in removed if k not in combined})
    return renormalized, combined, report
