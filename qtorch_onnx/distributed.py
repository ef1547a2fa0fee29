"""Distributed calibration and training (``torchrun`` / ``torch.distributed``).

Calibration on shards. Each rank feeds its shard of the calibration data through its copy of the prepared
model; after each pass (and before :meth:`~qtorch_onnx.observers.Observer.start_second_pass`) the observers
are merged with :func:`sync_observers`, so that every rank then holds exactly the statistics one process
would have had on the union of the shards, and computes the same scales and zero points, bit for bit::

    import torch.distributed as dist
    import qtorch_onnx as qo
    from qtorch_onnx.distributed import check_same_graph

    dist.init_process_group("gloo")                  # "nccl" on GPUs (torchrun sets rank and world size)
    qm = qo.prepare("model.onnx", "A8W8")
    check_same_graph(qm)                             # every rank prepared the same model and quantizers
    r, w, n = dist.get_rank(), dist.get_world_size(), len(samples)
    shard = samples[r * n // w:(r + 1) * n // w]     # contiguous blocks, rank 0 first
    qo.calibrate(qm, shard)                          # calibrate() merges the observers after each pass

What is exact (bit-identical to one process on all the data, whatever the sharding):

* min / max (MinMax, NonOverflow power-of-two, and pass 1 of every two-pass method): all-reduce MIN / MAX;
* histograms (Percentile, Entropy, Distribution): int64 counts all-reduced with SUM over bin edges that every
  rank derives from the merged pass-1 range (checked equal on every rank);
* MinMSE power-of-two: its per-candidate squared errors are int64 fixed-point sums (see
  :class:`~qtorch_onnx.observers.PowerOfTwoObserver`), all-reduced with SUM; candidates from the merged range;
* observation counts: int64 SUM.

What depends on the order of the data: the MinMax moving average (``CalibMovingAverage``). Its merge
all-gathers every rank's per-sample (min, max), recorded while torch.distributed is initialized, and replays
them rank 0 first: the result is bit-identical to one process fed rank 0's shard, then rank 1's, ... So
shard such data in contiguous blocks (rank r takes ``samples[r * n // W:(r + 1) * n // W]``) to reproduce a
single process on the original order; strided shards give a (deterministic, identical on every rank) result
for the reordered data. No statistic is a floating-point sum over ranks, so nothing depends on the reduction
order of the backend.

What the merge cannot make exact: the activations themselves. The observers see what each rank's forward
pass computes, so the scales equal one process's when every rank computes the same values for a sample as
that process would. Convolution kernels (CPU and cuDNN) may round differently (an ulp) with another batch
size, thread count or algorithm: for bit-identical scales use the same device kind and number of CPU
threads, batches the kernels treat alike (on CPU, a batch of 1 takes another path than larger ones: avoid
trailing batches of one sample), and on GPUs ``torch.backends.cudnn.benchmark = False`` and
``torch.backends.cudnn.deterministic = True``. Otherwise the scales still agree on every rank (they come from
the same merged statistics) but may differ from a single process's in the last bit.

Quantization-aware training. Gradients and parameters are DDP's job: wrap the calibrated model in
:class:`torch.nn.parallel.DistributedDataParallel`. The weights are ``nn.Parameter``\\ s (parametrized by
their weight quantizers); scales and zero points are buffers (parameters once learnable), which DDP
broadcasts from rank 0 (buffers) or averages (gradients)::

    qm = qo.calibrate(qo.prepare("model.onnx", "A8W8"), shard)   # merged: the same scales on every rank
    ddp = torch.nn.parallel.DistributedDataParallel(qm)           # device_ids=[local_rank] on GPUs
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    loss = criterion(ddp(x), y); loss.backward(); opt.step()     # gradients averaged over the ranks
    if dist.get_rank() == 0:
        qo.export(qm, "model.a8w8.onnx")                          # export the module, not the DDP wrapper

Every function here is a no-op when torch.distributed is unavailable, not initialized, or the group has a
single rank; otherwise it is a collective that every rank of the group must call, in the same order.
Backends: gloo (CPU tensors) and nccl (the statistics travel on the current CUDA device).
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .errors import ConfigError, DataError, ModelError
from .observers import MergeParts, Observer

__all__ = ["sync_observers", "check_same_graph", "is_distributed"]

ObserversLike = Union[Mapping[str, Observer], Iterable[Observer], torch.nn.Module]


def is_distributed(group: Any = None) -> bool:
    """True when torch.distributed is available and initialized and ``group`` (default: the world) has more
    than one rank: the condition under which the functions of this module communicate."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _comm_device(group: Any) -> torch.device:
    """Where the collectives' tensors live: the current CUDA device for nccl, the CPU otherwise (gloo)."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest_words(data: bytes) -> List[int]:
    """SHA-256 of ``data`` as 4 signed int64 words (what the ranks all-gather)."""
    d = hashlib.sha256(data).digest()
    return [int.from_bytes(d[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _all_gather_rows(values: Sequence[int], group: Any, device: torch.device) -> torch.Tensor:
    """All-gather one int64 vector per rank (same length everywhere) -> CPU tensor ``[world, len]``."""
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(out, t, group=group)
    return torch.stack(out).cpu()


def _observer_list(observers: ObserversLike) -> Tuple[List[str], List[Observer]]:
    if isinstance(observers, torch.nn.Module) and hasattr(observers, "quantizers"):
        observers = {k: fq.observer for k, fq in observers.quantizers().items() if fq.observer is not None}
    if isinstance(observers, Observer):
        observers = [observers]
    if isinstance(observers, Mapping):
        items = list(observers.items())
    else:
        items = [(None, o) for o in observers]
    keys, obs = [], []
    for i, (k, o) in enumerate(items):
        if not isinstance(o, Observer):
            what = f"entry {k!r}" if k is not None else f"item {i}"
            raise ConfigError(f"sync_observers: {what} is a {type(o).__name__}, not a qtorch_onnx.observers.Observer")
        keys.append(f"{k}={o._merge_identity()}" if k is not None else o._merge_identity())
        obs.append(o)
    return keys, obs


def _check_same_observers(keys: List[str], group: Any, device: torch.device) -> None:
    """All-gather a hash of the observer identities; on a mismatch, gather the lists and name the first
    differing observer (on every rank: the decision only uses gathered data).

    Raises:
        ModelError: the ranks' observer lists differ (count, order, class, name or options).
    """
    dist = torch.distributed
    h = _digest_words("\n".join(keys).encode("utf-8"))[:1] + [len(keys)]
    rows = _all_gather_rows(h, group, device)
    if bool((rows == rows[0]).all()):
        return
    lists: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, keys, group=group)
    ref = lists[0]
    for r, other in enumerate(lists[1:], start=1):
        if other == ref:
            continue
        n = min(len(ref), len(other))
        i = next((j for j in range(n) if ref[j] != other[j]), n)
        a = ref[i] if i < len(ref) else "<none>"
        b = other[i] if i < len(other) else "<none>"
        raise ModelError(f"sync_observers: the ranks have different observers; first difference at position {i}: "
                         f"rank 0 has {a}, rank {r} has {b} (rank 0: {len(ref)} observers, rank {r}: {len(other)}). "
                         f"Every rank must prepare the same model with the same configuration (check_same_graph) "
                         f"and pass its observers in the same order")
    raise ModelError("sync_observers: the ranks' observer lists hash differently")  # pragma: no cover


def _reduce(tensors: List[torch.Tensor], dtype: torch.dtype, op: Any, group: Any, device: torch.device
            ) -> List[torch.Tensor]:
    """One all-reduce over the concatenation of ``tensors`` (sizes equal on every rank); returns CPU or
    ``device`` tensors of the original shapes, in ``dtype``."""
    if not tensors:
        return []
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])
    if flat.numel():
        torch.distributed.all_reduce(flat, op=op, group=group)
    return [p.reshape(t.shape) for p, t in zip(flat.split(sizes), tensors)]


def sync_observers(observers: ObserversLike, *, group: Any = None) -> None:
    """Merge calibration observers across the ranks of ``group`` in place (collective).

    Afterwards every rank holds exactly the statistics one process would have had on the union of the ranks'
    data (see the module docstring for what is exact). Call it on every rank after each calibration pass,
    before :meth:`~qtorch_onnx.observers.Observer.start_second_pass`; a later call merges only what was
    observed since. A handful of collectives in all, whatever the number of observers: an all-gather of a
    hash of the observer identities (class, name, options) and of a small state description per observer,
    then one all-reduce each for MIN, MAX and SUM, and one all-gather for moving averages (when present).

    A no-op unless torch.distributed is available and initialized and ``group`` has more than one rank.

    Args:
        observers: a list of :class:`~qtorch_onnx.observers.Observer` (merged in this order, which must be the
            same on every rank), a ``{name: observer}`` mapping (its order; the names are compared too), or a
            prepared :class:`~qtorch_onnx.model.QuantizedModel` (the observers of ``qm.quantizers()``).
        group: a ``torch.distributed`` process group (default: the world).

    Raises:
        ModelError: the ranks' observers differ (the first differing one is named, with both ranks' versions).
        DataError: the ranks' states cannot be merged: different passes, channel counts, histogram sizes or
            edges (e.g. no merge after pass 1 before ``start_second_pass``), a moving average that observed
            samples before torch.distributed was initialized. Raised on every rank alike.
        ConfigError: an entry is not an Observer.
    """
    if not is_distributed(group):
        return
    dist = torch.distributed
    keys, obs = _observer_list(observers)
    device = _comm_device(group)
    _check_same_observers(keys, group, device)
    if not obs:
        return
    world = dist.get_world_size(group)
    metas = [o._merge_meta() for o in obs]
    rows = _all_gather_rows([v for m in metas for v in m], group, device).tolist()
    layouts, start = [], 0
    for o, m in zip(obs, metas):
        layouts.append(o._merge_layout([row[start:start + len(m)] for row in rows]))
        start += len(m)
    parts: List[MergeParts] = [o._merge_pack(lay) for o, lay in zip(obs, layouts)]

    same = [t for p in parts for t in p.same.values()]
    mins = _reduce([t for p in parts for t in p.mins] + same, torch.float64, dist.ReduceOp.MIN, group, device)
    maxs = _reduce([t for p in parts for t in p.maxs] + same, torch.float64, dist.ReduceOp.MAX, group, device)
    sums = _reduce([t for p in parts for t in p.sums], torch.int64, dist.ReduceOp.SUM, group, device)
    gathers = [p.gather for p in parts if p.gather is not None]
    gathered_all: Optional[List[torch.Tensor]] = None
    if gathers:
        flat = torch.cat([g.reshape(-1).to(device=device, dtype=torch.float64) for g in gathers])
        gathered_all = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered_all, flat, group=group)
        gathered_all = [g.cpu() for g in gathered_all]

    # tensors that must agree (histogram edges, MinMSE candidates): checked before anything is installed
    n_min = sum(len(p.mins) for p in parts)
    n_max = sum(len(p.maxs) for p in parts)
    k = 0
    for o, p in zip(obs, parts):
        for what in p.same:
            lo, hi = mins[n_min + k], maxs[n_max + k]
            if not bool(torch.equal(lo, hi)):
                raise DataError(f"observer {type(o).__name__} for tensor {o._label()}: the {what} differ across "
                                f"ranks; merge the observers (sync_observers) after pass 1 and before "
                                f"start_second_pass() on every rank, so that they derive from the global range")
            k += 1

    i_min = i_max = i_sum = i_gather = 0
    for o, lay, p in zip(obs, layouts, parts):
        mn, mx, sm = (mins[i_min:i_min + len(p.mins)], maxs[i_max:i_max + len(p.maxs)],
                      sums[i_sum:i_sum + len(p.sums)])
        i_min, i_max, i_sum = i_min + len(p.mins), i_max + len(p.maxs), i_sum + len(p.sums)
        g = None
        if p.gather is not None:
            n = p.gather.numel()
            g = [row[i_gather:i_gather + n] for row in gathered_all]
            i_gather += n
        o._merge_unpack(lay, mn, mx, sm, g)


def check_same_graph(qm: Any, *, group: Any = None) -> None:
    """Check that every rank of ``group`` prepared the same model (collective).

    All-gathers a SHA-256 of ``qm.onnx_model.SerializeToString()`` (the normalized graph that export writes
    into) and one of the sorted quantizer keys with their formats (``qm.quantizers()``), and compares them
    with rank 0's. A no-op unless torch.distributed is initialized and ``group`` has more than one rank.

    Args:
        qm: a prepared :class:`~qtorch_onnx.model.QuantizedModel`.
        group: a ``torch.distributed`` process group (default: the world).

    Raises:
        ModelError: the ranks differ; names the ranks whose graph and / or quantizers differ from rank 0's.
    """
    if not is_distributed(group):
        return
    onnx_model = getattr(qm, "onnx_model", None)
    if onnx_model is None or not hasattr(qm, "quantizers"):
        raise ModelError(f"check_same_graph needs a prepared QuantizedModel, got {type(qm).__name__}")
    graph = _digest_words(onnx_model.SerializeToString())
    quantizers = qm.quantizers()
    keys = "\n".join(f"{k}\t{getattr(quantizers[k].fmt, 'name', quantizers[k].fmt)!s}" for k in sorted(quantizers))
    words = graph + _digest_words(keys.encode("utf-8"))
    rows = _all_gather_rows(words, group, _comm_device(group))
    bad_graph = [r for r in range(rows.shape[0]) if not torch.equal(rows[r, :4], rows[0, :4])]
    bad_keys = [r for r in range(rows.shape[0]) if not torch.equal(rows[r, 4:], rows[0, 4:])]
    if not bad_graph and not bad_keys:
        return

    def hexd(r: int, a: int) -> str:
        return b"".join(int(v).to_bytes(8, "little", signed=True) for v in rows[r, a:a + 4].tolist()).hex()[:12]

    parts = []
    if bad_graph:
        parts.append("the ONNX graph of rank(s) " + ", ".join(f"{r} (sha256 {hexd(r, 0)}...)" for r in bad_graph)
                     + f" differs from rank 0's (sha256 {hexd(0, 0)}...)")
    if bad_keys:
        parts.append("the quantizers (keys and formats) of rank(s) " + ", ".join(map(str, bad_keys))
                     + " differ from rank 0's")
    raise ModelError("check_same_graph: the ranks prepared different models: " + "; ".join(parts)
                     + ". Every rank must prepare the same ONNX model with the same configuration")
