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

import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from ..errors import ConfigError, DataError

__all__ = ["StagedExecutor", "LayerData"]


class _Spill:
    """Where the cached per-chunk values of one fx node live: the compute device, host memory, or a file."""

    def __init__(self, level: int, device: torch.device, folder: Optional[str]) -> None:
        self.level, self.device, self.folder = level, device, folder
        self.count = 0

    def put(self, value):
        if not isinstance(value, torch.Tensor) or self.level == 0:
            return value
        if self.level == 1:
            return value.to("cpu")
        self.count += 1
        path = os.path.join(self.folder, f"act_{self.count}.pt")
        torch.save(value.detach().cpu(), path)
        return ("__spilled__", path)

    def get(self, value):
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "__spilled__":
            return torch.load(value[1], map_location=self.device, weights_only=True)
        if isinstance(value, torch.Tensor) and value.device != self.device:
            return value.to(self.device)
        return value


def _nbytes(v) -> int:
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


class StagedExecutor:
    """Runs a quantized GraphModule and its float twin node by node over chunks of samples.

    Args:
        q_gm / f_gm: the quantized module's graph (changed by the algorithm) and the float reference (same
            graph structure, same node names).
        chunks: input batches, each a tuple of tensors in placeholder order (already on ``device``).
        device: compute device. mem_opt_level: 0 keep cached values on ``device`` (moved to the host past
            ``budget_bytes``), 1 keep them in host memory, 2 on disk (a temporary folder).
        budget_bytes: level 0: cached bytes on the device before spilling to the host.

    Raises:
        DataError: the samples do not stack along dim 0 for a target layer (inputs of varying shapes).
    """

    def __init__(self, q_gm: fx.GraphModule, f_gm: fx.GraphModule, chunks: Sequence[Tuple[torch.Tensor, ...]],
                 device: torch.device, mem_opt_level: int = 0, budget_bytes: int = 4 << 30) -> None:
        self.q_gm, self.f_gm = q_gm, f_gm
        self.q_nodes = list(q_gm.graph.nodes)
        self.f_by_name = {n.name: n for n in f_gm.graph.nodes}
        self.chunks = list(chunks)
        self.device = device
        self._tmp = tempfile.TemporaryDirectory(prefix="qtorch_ft_") if mem_opt_level >= 2 else None
        self.spill = _Spill(mem_opt_level, device, self._tmp.name if self._tmp else None)
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
        self._q_interp = fx.Interpreter(q_gm)
        self._f_interp = fx.Interpreter(f_gm)

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

    def _run(self, interp: fx.Interpreter, env: Dict[str, List[Any]], node: fx.Node, chunk: int):
        if node.op == "placeholder":
            idx = [n for n in interp.module.graph.nodes if n.op == "placeholder"].index(node)
            return self.chunks[chunk][idx]
        interp.env = {a: self.spill.get(env[a.name][0 if self.const[a.name] else chunk]) for a in node.all_input_nodes}
        return interp.run_node(node)

    def step(self, node: fx.Node, *, quantized: bool = True, float_too: bool = True) -> None:
        """Compute ``node`` for every chunk in both models (constants once) and free inputs used for the last
        time."""
        with torch.no_grad():
            n_chunks = 1 if self.const[node.name] else len(self.chunks)
            if quantized:
                self._store(self.q_env, node.name, [self._run(self._q_interp, self.q_env, node, c)
                                                    for c in range(n_chunks)])
            if float_too:
                fnode = self.f_by_name[node.name]
                self._store(self.f_env, node.name, [self._run(self._f_interp, self.f_env, fnode, c)
                                                    for c in range(n_chunks)])

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
            raise DataError(f"fast finetune: fx node {name!r} does not carry a tensor")
        try:
            return torch.cat(vals, 0) if len(vals) > 1 else vals[0]
        except RuntimeError as exc:
            raise DataError(f"fast finetune: the cached values of {name!r} do not stack along the batch dimension "
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

    def layer_fn(self, node: fx.Node) -> Callable[[Dict[fx.Node, torch.Tensor]], Any]:
        """``fn(inputs) -> output`` running ``node`` of the quantized graph on given activation inputs, its
        constant inputs (weights through their quantizers) recomputed each call, with autograd."""
        interp = fx.Interpreter(self.q_gm)

        def const_value(n: fx.Node, memo: Dict[fx.Node, Any]):
            if n in memo:
                return memo[n]
            interp.env = {a: const_value(a, memo) for a in n.all_input_nodes}
            memo[n] = interp.run_node(n)
            return memo[n]

        def fn(inputs: Dict[fx.Node, torch.Tensor]):
            memo: Dict[fx.Node, Any] = {}
            env = {}
            for a in node.all_input_nodes:
                env[a] = inputs[a] if a in inputs else const_value(a, memo)
            interp.env = env
            return interp.run_node(node)

        return fn

    def finish_layer(self, node: fx.Node) -> None:
        """Recompute the quantized output of ``node`` with its finetuned weights and move past it."""
        self.step(node, quantized=True, float_too=False)
        self.release_inputs(node, self.pos)
        self.pos += 1
