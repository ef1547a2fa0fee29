"""Calibration observers (docs/numerics.md section 2): activation ranges and the quantization parameters from them.

Every observer runs its reductions on the device of the tensors it is fed, accepts batches of any size, and
gives bit-identical results whatever the batching of the same data (docs/numerics.md section 2, last rule):

* exact reductions only (min / max), or integer histogram counts, or int64 fixed-point sums;
* histogram observers use two passes: pass 1 records the exact global min / max, pass 2 (after
  :meth:`Observer.start_second_pass`) histograms the same data over a fixed range derived from pass 1;
* the MinMax moving average is applied per *sample* (dim 0) in a fixed sequential order on the CPU.

Protocol (what the calibrator does)::

    obs = make_observer("Percentile", name="conv1_out")
    for batch in data: obs.update(batch)
    if obs.needs_second_pass:
        obs.start_second_pass()
        for batch in data: obs.update(batch)
    scale, zero_point = obs.compute_qparams(INT8, symmetric=True)

Ranges are returned as float64 CPU tensors (0-d, or 1-D along ``axis`` for per-channel MinMax).
NaN or Inf in a batch raises :class:`~qtorch_onnx.errors.DataError` naming the tensor.

Distributed calibration (:mod:`qtorch_onnx.distributed`): :meth:`Observer.all_reduce_` (or
``sync_observers`` for many at once) merges the statistics of every rank in place, after each pass and before
:meth:`Observer.start_second_pass`, so that every rank then holds what one process would have on the union of
the shards. Every merge is exact (min / max, int64 sums, gathered per-sample ranges), so scales and zero points
are bit-identical to one process (the MinMax moving average: to one process seeing rank 0's samples, then rank
1's, ...).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch

from .errors import ConfigError, DataError, closest
from .formats import integer as qint
from .formats.spec import INT8, IntFormat

__all__ = [
    "Observer",
    "MinMaxObserver",
    "PercentileObserver",
    "EntropyObserver",
    "DistributionObserver",
    "PowerOfTwoObserver",
    "make_observer",
    "OBSERVERS",
]


def _f64(v) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float64).cpu()


def _dist_world_size() -> int:
    """World size of the default process group, 1 when torch.distributed is absent or not initialized."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


@dataclass
class MergeParts:
    """What one observer contributes to a distributed merge (:mod:`qtorch_onnx.distributed` reduces it).

    Attributes:
        mins: tensors reduced elementwise with MIN (any float dtype; sent as float64).
        maxs: tensors reduced elementwise with MAX.
        sums: int64 tensors reduced with SUM (exact, order independent).
        same: tensors that must be equal on every rank (reduced with MIN and MAX, then compared), keyed by a
            description used in the error message (e.g. ``"histogram bin edges"``).
        gather: one float64 1-D tensor of a size every rank agrees on (from the layout), all-gathered.
    """

    mins: List[torch.Tensor] = field(default_factory=list)
    maxs: List[torch.Tensor] = field(default_factory=list)
    sums: List[torch.Tensor] = field(default_factory=list)
    same: Dict[str, torch.Tensor] = field(default_factory=dict)
    gather: Optional[torch.Tensor] = None


def _ema_fold(rmin: Optional[torch.Tensor], rmax: Optional[torch.Tensor], lo: torch.Tensor, hi: torch.Tensor,
              c: float) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Apply ``r <- r + c * (r_sample - r)`` for each row of ``lo`` / ``hi`` (float64 CPU, ``[n]`` or ``[n, C]``)
    in order, the first row initializing ``r`` when it is None. The one implementation of the MinMax moving
    average, used both when observing and when replaying merged ranks (so both give the same bits)."""
    for k in range(lo.shape[0]):  # fixed sequential order: independent of the batching
        if rmin is None:
            rmin, rmax = lo[k].clone(), hi[k].clone()
        else:
            rmin = rmin + c * (lo[k] - rmin)
            rmax = rmax + c * (hi[k] - rmax)
    return rmin, rmax


class Observer:
    """Base class. Subclasses implement ``_observe(x)`` (pass 1) and, for two-pass observers, ``_observe2(x)``.

    Args:
        name: tensor name used in error messages.

    Attributes:
        needs_second_pass: True for histogram observers (feed the data again after :meth:`start_second_pass`).
    """

    needs_second_pass: bool = False

    def __init__(self, name: Optional[str] = None):
        self.name = name
        self.reset()

    # -- public API -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything observed (back to pass 1)."""
        self._pass = 1
        self._min: Optional[torch.Tensor] = None  # float64 on the data's device (per tensor or per channel)
        self._max: Optional[torch.Tensor] = None
        self._count = 0
        self._count2 = 0
        self._merged: Dict[str, Any] = {}  # values of the summed statistics at the last distributed merge

    def update(self, x: torch.Tensor) -> None:
        """Observe one batch (any shape; float16/bfloat16 are widened to float32). Never modifies ``x``.

        Raises:
            DataError: ``x`` contains NaN or Inf (message names the tensor and the count).
        """
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x)
        x = x.detach()
        if not x.is_floating_point():
            x = x.to(torch.float32)
        elif x.dtype != torch.float32 and x.dtype != torch.float64:
            x = x.to(torch.float32)
        if x.numel() == 0:
            return
        if not self._range_checks_finite:
            self._check_finite(x)
        if self._pass == 1:
            self._count += x.numel()
            self._observe(x)
        else:
            self._count2 += x.numel()
            self._observe2(x)

    def _check_finite(self, x: torch.Tensor) -> None:
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            n = int(bad.sum())
            raise DataError(f"calibration data for tensor {self._label()} contains {n} NaN/Inf value(s) "
                            f"(shape {tuple(x.shape)}); observers need finite data")

    def _check_batch_range(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Raise as :meth:`update` does when the batch minima / maxima ``lo`` / ``hi`` of ``x`` are not finite
        (torch's min / max propagate NaN, and an Inf is a minimum or a maximum): the finiteness check without
        a pass of its own over ``x``. Call it before the state changes, so a bad batch leaves no trace."""
        if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
            self._check_finite(x)

    def start_second_pass(self) -> None:
        """Switch to pass 2 (histogram observers). A no-op for single-pass observers.

        Raises:
            DataError: no data was observed in pass 1.
        """
        if not self.needs_second_pass:
            return
        if self._count == 0:
            raise DataError(f"observer for tensor {self._label()}: start_second_pass() before any data")
        self._pass = 2
        self._begin_second_pass()

    def compute_range(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Calibrated ``(rmin, rmax)``, float64 CPU tensors (0-d, or 1-D per channel).

        Raises:
            DataError: no data, or a two-pass observer whose second pass was not run.
        """
        self._check_ready()
        return self._range()

    def compute_qparams(self, fmt: IntFormat, symmetric: bool, reduce_range: bool = False
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(scale float32, zero_point int64)`` from :meth:`compute_range` via
        :func:`qtorch_onnx.formats.integer.qparams_from_range` (docs/numerics.md section 1)."""
        rmin, rmax = self.compute_range()
        return qint.qparams_from_range(rmin, rmax, fmt, symmetric, reduce_range)

    def all_reduce_(self, group: Any = None) -> "Observer":
        """Merge this observer's statistics across the ranks of ``group`` in place (a collective: every rank
        must call it, on observers of the same class, name and options, at the same point of calibration).

        Afterwards every rank holds exactly the statistics one process would have had on the union of the
        ranks' data: min / max are reduced with MIN / MAX, histogram counts and MinMSE error sums (int64) with
        SUM, and the MinMax moving average replays every rank's per-sample ranges in rank order. Call it after
        each pass, before :meth:`start_second_pass` (histogram edges and MinMSE candidates are then derived
        from the global pass-1 range); calling it again merges only what was observed since the last merge.
        A no-op unless torch.distributed is initialized with a world size > 1. Many observers at once:
        :func:`qtorch_onnx.distributed.sync_observers` (a few collectives in all).

        Args:
            group: a ``torch.distributed`` process group (default: the world).

        Returns:
            ``self``.

        Raises:
            DataError: the ranks disagree on the state (different passes, channel counts, histogram edges:
                e.g. no merge after pass 1), or a moving average observed samples before torch.distributed
                was initialized.
            ModelError: the ranks' observers differ (class, name or options).
        """
        from .distributed import sync_observers

        sync_observers([self], group=group)
        return self

    # -- distributed merge hooks (qtorch_onnx.distributed drives them; every rank sees the same metas) ------
    #: int64 tensor attributes summed across ranks (only what was added since the last merge is sent), with
    #: their description for messages.
    _MERGE_SUMS: Dict[str, str] = {}

    def _merge_config(self) -> tuple:
        """Options that must be equal on every rank (part of the identity the ranks compare)."""
        return ()

    def _merge_identity(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self._merge_config()!r})"

    def _merge_same(self) -> Dict[str, Optional[torch.Tensor]]:
        """Derived tensors that must agree on every rank (None when absent), keyed by description."""
        return {}

    def _merge_meta(self) -> List[int]:
        """Small int64 description of the local state; its length depends only on the class and options."""
        nchan = -1 if self._min is None else (0 if self._min.dim() == 0 else int(self._min.shape[0]))
        meta = [self._pass, nchan]
        for a in self._MERGE_SUMS:
            t = getattr(self, a)
            meta.append(-1 if t is None else t.numel())
        for t in self._merge_same().values():
            meta.append(-1 if t is None else t.numel())
        return meta

    def _merge_layout(self, metas: Sequence[Sequence[int]]) -> Dict[str, Any]:
        """Check that the ranks' states can be merged (``metas[r]``: rank r's :meth:`_merge_meta`) and return
        the layout of the merge. Depends only on ``metas``, so every rank takes the same decision.

        Raises:
            DataError: different passes, channel counts or histogram / candidate sizes on different ranks.
        """
        who = f"observer {type(self).__name__} for tensor {self._label()}"
        passes = [int(m[0]) for m in metas]
        if len(set(passes)) > 1:
            raise DataError(f"{who}: the ranks are in different calibration passes ({_per_rank(passes)}); call "
                            f"sync_observers at the same point on every rank")
        chans = [int(m[1]) for m in metas]
        known = sorted({c for c in chans if c >= 0})
        if len(known) > 1:
            raise DataError(f"{who}: the ranks observed different channel counts ({_per_rank(chans)}; 0 = per "
                            f"tensor, -1 = no data)")
        names = list(self._MERGE_SUMS.values()) + list(self._merge_same())
        for j, what in enumerate(names):
            col = [int(m[2 + j]) for m in metas]
            if len(set(col)) > 1:
                raise DataError(f"{who}: {what} has different sizes on the ranks ({_per_rank(col)}; -1 = none); "
                                f"merge the observers after pass 1, before start_second_pass(), and feed every "
                                f"rank the same data in both passes")
        return {"nchan": known[0] if known else -1, "ranks": len(metas)}

    def _merge_minmax(self) -> bool:
        """Whether the merge reduces ``_min`` / ``_max`` with MIN / MAX (False: the subclass merges them)."""
        return True

    def _minmax_parts(self, layout: Dict[str, Any], parts: MergeParts) -> None:
        nchan = layout["nchan"]
        if nchan < 0 or not self._merge_minmax():
            return
        shape = () if nchan == 0 else (nchan,)
        lo = self._min if self._min is not None else torch.full(shape, math.inf, dtype=torch.float64)
        hi = self._max if self._max is not None else torch.full(shape, -math.inf, dtype=torch.float64)
        parts.mins.append(lo)
        parts.maxs.append(hi)

    def _merge_pack(self, layout: Dict[str, Any]) -> MergeParts:
        """This rank's contribution (sizes fixed by ``layout``, hence equal on every rank)."""
        parts = MergeParts()
        self._minmax_parts(layout, parts)
        counts = [self._count - self._merged.get("_count", 0), self._count2 - self._merged.get("_count2", 0)]
        parts.sums.append(torch.tensor(counts, dtype=torch.int64))
        for a in self._MERGE_SUMS:
            t = getattr(self, a)
            if t is not None:
                parts.sums.append(t - _padded_base(self._merged.get(a), t))
        parts.same = {k: v for k, v in self._merge_same().items() if v is not None}
        return parts

    def _merge_unpack(self, layout: Dict[str, Any], mins: List[torch.Tensor], maxs: List[torch.Tensor],
                      sums: List[torch.Tensor], gathered: Optional[List[torch.Tensor]]) -> None:
        """Install the merged statistics (``mins`` / ``maxs`` / ``sums`` in :meth:`_merge_pack`'s order,
        reduced over the ranks; ``gathered``: every rank's ``gather`` tensor, in rank order)."""
        if layout["nchan"] >= 0 and self._merge_minmax():
            dev = self._min.device if self._min is not None else mins[0].device
            self._min = mins[0].to(dev, torch.float64)
            self._max = maxs[0].to(dev, torch.float64)
        counts = sums[0].cpu()
        self._count = self._merged.get("_count", 0) + int(counts[0])
        self._count2 = self._merged.get("_count2", 0) + int(counts[1])
        self._merged["_count"], self._merged["_count2"] = self._count, self._count2
        k = 1
        for a in self._MERGE_SUMS:
            t = getattr(self, a)
            if t is None:
                continue
            new = _padded_base(self._merged.get(a), t) + sums[k].to(t.device, torch.int64)
            setattr(self, a, new)
            self._merged[a] = new.clone()
            k += 1

    # -- internals ------------------------------------------------------------------------------------------
    def _label(self) -> str:
        return repr(self.name) if self.name else "<unnamed>"

    def _check_ready(self) -> None:
        if self._count == 0:
            raise DataError(f"observer {type(self).__name__} for tensor {self._label()} has seen no data")
        if self.needs_second_pass and (self._pass != 2 or self._count2 == 0):
            raise DataError(f"observer {type(self).__name__} for tensor {self._label()} needs a second pass: "
                            f"call start_second_pass() and feed the calibration data again")

    #: True where the observer checks each batch's finiteness from its own min / max (_check_batch_range), so
    #: update() needs no separate pass over the data (a full pass per activation during calibration)
    _range_checks_finite = False

    def _observe_minmax(self, x: torch.Tensor) -> None:
        lo, hi = torch.aminmax(x)  # one pass; exact, so the same values as min() and max()
        if self._range_checks_finite:
            self._check_batch_range(x, lo, hi)
        lo, hi = lo.to(torch.float64), hi.to(torch.float64)
        self._min = lo if self._min is None else torch.minimum(self._min, lo)
        self._max = hi if self._max is None else torch.maximum(self._max, hi)

    def _observe(self, x: torch.Tensor) -> None:
        self._observe_minmax(x)

    def _observe2(self, x: torch.Tensor) -> None:  # pragma: no cover - overridden by two-pass observers
        raise NotImplementedError

    def _begin_second_pass(self) -> None:
        pass

    def _range(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._min.cpu(), self._max.cpu()


def _per_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _padded_base(base: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The value of a summed statistic at the last merge, zero-padded at the end to ``like``'s size (a
    Percentile histogram widened since then), on ``like``'s device; zeros when there was no merge."""
    if base is None:
        return torch.zeros_like(like)
    base = base.to(like.device)
    if base.numel() < like.numel():
        base = torch.cat([base, base.new_zeros(like.numel() - base.numel())])
    return base


# ------------------------------------------------------------------------------------------------------ MinMax
class MinMaxObserver(Observer):
    """Global min / max (docs/numerics.md section 2 "MinMax"; ONNX Runtime MinMaxCalibrater).

    Args:
        axis: None for per tensor; else per channel along ``axis`` (reduce over all other dims).
        moving_average: ``r <- r + c * (r_sample - r)`` applied per SAMPLE along dim 0, in order, float64, the
            first sample initializing ``r`` (ONNX Runtime applies it per batch, which depends on the batch
            size; per sample it does not).
        averaging_constant: ``c`` (default 0.01).
        name: tensor name for messages.

    Distributed (:meth:`~Observer.all_reduce_`): min / max are reduced with MIN / MAX. The moving average
    depends on the order of the samples, so while torch.distributed is initialized with a world size > 1 the
    observer also records each sample's (min, max) (2 float64 per sample, per channel), and the merge
    all-gathers those records and replays them from the last merged state, rank 0's samples first, then rank
    1's, ...: bit-identical to one process fed the concatenation of the shards in rank order (shard the data
    in contiguous blocks, rank 0 first, to match a single process on the original order).

    Raises:
        ConfigError: ``averaging_constant`` outside (0, 1]; moving average with ``axis`` 0 (dim 0 is the
            sample dimension).
    """

    _range_checks_finite = True  # every path below checks its batch minima / maxima

    def __init__(self, axis: Optional[int] = None, moving_average: bool = False, averaging_constant: float = 0.01,
                 name: Optional[str] = None):
        if moving_average and not 0.0 < float(averaging_constant) <= 1.0:
            raise ConfigError(f"MinMax averaging_constant must be in (0, 1], got {averaging_constant}")
        self.axis = axis
        self.moving_average = bool(moving_average)
        self.averaging_constant = float(averaging_constant)
        super().__init__(name)

    def reset(self) -> None:
        super().reset()
        self._ma_log: List[Tuple[torch.Tensor, torch.Tensor]] = []  # per-sample (min, max) since the last merge
        self._ma_rows = 0  # samples observed since the last merge (recorded or not)
        self._ma_logged = 0  # of which recorded in _ma_log
        self._ma_base: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)  # state at the merge

    def _reduce_per_channel(self, x: torch.Tensor, keep_dim0: bool):
        nd = x.dim()
        ax = self.axis % nd if nd else 0
        if not -nd <= self.axis < nd:
            raise ConfigError(f"MinMax observer for tensor {self._label()}: axis {self.axis} out of range for "
                              f"rank {nd}")
        if keep_dim0:
            if ax == 0:
                raise ConfigError(f"MinMax observer for tensor {self._label()}: moving_average works per sample "
                                  f"along dim 0, so the channel axis cannot be 0")
            y = x.movedim(ax, 1).reshape(x.shape[0], x.shape[ax], -1)
            return torch.aminmax(y, dim=2)
        y = x.movedim(ax, 0).reshape(x.shape[ax], -1)
        return torch.aminmax(y, dim=1)

    def _observe(self, x: torch.Tensor) -> None:
        if not self.moving_average:
            if self.axis is None:
                self._observe_minmax(x)
                return
            lo, hi = self._reduce_per_channel(x, False)
            self._check_batch_range(x, lo, hi)
            lo, hi = lo.to(torch.float64), hi.to(torch.float64)
            if self._min is not None and self._min.shape != lo.shape:
                raise DataError(f"tensor {self._label()}: channel count changed from {self._min.shape[0]} to "
                                f"{lo.shape[0]} along axis {self.axis}")
            self._min = lo if self._min is None else torch.minimum(self._min, lo)
            self._max = hi if self._max is None else torch.maximum(self._max, hi)
            return
        xs = x if x.dim() > 0 else x.reshape(1)
        if self.axis is None:
            flat = xs.reshape(xs.shape[0], -1)
            lo, hi = flat.amin(1), flat.amax(1)
        else:
            lo, hi = self._reduce_per_channel(xs, True)
        self._check_batch_range(x, lo, hi)
        lo = lo.to(torch.float64).cpu()
        hi = hi.to(torch.float64).cpu()
        self._ma_rows += lo.shape[0]
        if _dist_world_size() > 1:  # a merge will replay every rank's samples in rank order
            self._ma_log.append((lo, hi))
            self._ma_logged += lo.shape[0]
        self._min, self._max = _ema_fold(self._min, self._max, lo, hi, self.averaging_constant)

    # -- distributed merge --------------------------------------------------------------------------------
    def _merge_config(self) -> tuple:
        return (self.axis, self.moving_average, self.averaging_constant if self.moving_average else None)

    def _merge_minmax(self) -> bool:
        return not self.moving_average  # the moving average is replayed from the gathered per-sample ranges

    def _merge_meta(self) -> List[int]:
        meta = super()._merge_meta()
        if self.moving_average:
            meta += [self._ma_rows, self._ma_logged]
        return meta

    def _merge_layout(self, metas: Sequence[Sequence[int]]) -> Dict[str, Any]:
        layout = super()._merge_layout(metas)
        if self.moving_average:
            rows = [int(m[-2]) for m in metas]
            logged = [int(m[-1]) for m in metas]
            if rows != logged:
                raise DataError(f"MinMax moving average for tensor {self._label()}: the merge replays every "
                                f"sample in rank order, but some were observed while torch.distributed was not "
                                f"initialized with world size > 1 (samples: {_per_rank(rows)}; recorded: "
                                f"{_per_rank(logged)}); initialize the process group before calibrating")
            layout["rows"] = rows
            layout["width"] = max(1, layout["nchan"])
        return layout

    def _merge_pack(self, layout: Dict[str, Any]) -> MergeParts:
        parts = super()._merge_pack(layout)
        if not self.moving_average:
            return parts
        width, n = layout["width"], max(layout["rows"])
        flat = torch.zeros(n, 2, width, dtype=torch.float64)
        if self._ma_log:
            lo = torch.cat([a for a, _ in self._ma_log]).reshape(-1, width)
            hi = torch.cat([b for _, b in self._ma_log]).reshape(-1, width)
            flat[:lo.shape[0], 0] = lo
            flat[:hi.shape[0], 1] = hi
        parts.gather = flat.reshape(-1)
        return parts

    def _merge_unpack(self, layout, mins, maxs, sums, gathered) -> None:
        super()._merge_unpack(layout, mins, maxs, sums, gathered)
        if not self.moving_average:
            return
        nchan = layout["nchan"]
        width, n = layout["width"], max(layout["rows"])
        rmin, rmax = self._ma_base
        for r, rows in enumerate(layout["rows"]):
            if rows == 0:
                continue
            block = gathered[r].reshape(n, 2, width)[:rows].cpu()
            lo, hi = block[:, 0], block[:, 1]
            if nchan == 0:  # per tensor: one value per sample, as _observe folds them
                lo, hi = lo[:, 0], hi[:, 0]
            rmin, rmax = _ema_fold(rmin, rmax, lo.contiguous(), hi.contiguous(), self.averaging_constant)
        self._min, self._max = rmin, rmax
        self._ma_base = (rmin, rmax)
        self._ma_log, self._ma_rows, self._ma_logged = [], 0, 0


# -------------------------------------------------------------------------------------------- histogram helpers
def _uniform_edges32(lo: float, hi: float, n: int) -> torch.Tensor:
    """numpy ``linspace(lo, hi, n + 1)`` in float64 rounded to float32 (the edges ``np.histogram`` uses for
    float32 data): ``lo + j * ((hi - lo) / n)``, last edge exactly ``hi``."""
    step = (hi - lo) / n
    e = torch.arange(n + 1, dtype=torch.float64) * step + lo
    e[-1] = hi
    return e.to(torch.float32)


def _hist_counts(a: torch.Tensor, edges32: torch.Tensor) -> torch.Tensor:
    """Counts of float32 ``a`` in bins ``[e_j, e_j+1)`` (last bin closed), as ``np.histogram`` with these edges.

    Values outside ``[e_0, e_n]`` must not occur (callers check). Returns int64 counts on ``a``'s device.
    """
    e = edges32.to(a.device)
    nb = e.numel() - 1
    idx = torch.bucketize(a.reshape(-1), e, right=True) - 1
    idx = idx.clamp_(0, nb - 1)
    return torch.bincount(idx, minlength=nb)


# ------------------------------------------------------------------------------------------------- Percentile
class PercentileObserver(Observer):
    """Percentile of |x| (docs/numerics.md section 2 "Percentile"; ONNX Runtime HistogramCollector, symmetric).

    Pass 1: exact global min, max and ``A = max|x|``. Pass 2: histogram of |x| with ``num_bins`` equal bins
    on ``[0, A]`` (float32 edges as ``np.histogram`` makes them), integer counts; widened with more bins of
    the same width if a pass-2 batch exceeds ``A``. Threshold ``t`` = left edge of the first bin whose
    cumulative fraction ``cumsum(counts) / total`` (int64 cumsum, then one float64 division) reaches
    ``percentile / 100``. Range ``(-t, t)`` clamped to the observed ``[min, max]``.

    Args:
        percentile: in [0, 100], default 99.999. num_bins: default 2048.

    Raises:
        ConfigError: percentile outside [0, 100] or num_bins < 1.
    """

    needs_second_pass = True

    def __init__(self, percentile: float = 99.999, num_bins: int = 2048, name: Optional[str] = None):
        if not 0.0 <= float(percentile) <= 100.0:
            raise ConfigError(f"Percentile must be in [0, 100], got {percentile}")
        if int(num_bins) < 1:
            raise ConfigError(f"Percentile num_bins must be >= 1, got {num_bins}")
        self.percentile = float(percentile)
        self.num_bins = int(num_bins)
        super().__init__(name)

    def reset(self) -> None:
        super().reset()
        self._edges = None
        self._counts = None

    # distributed merge: counts summed (int64); edges derived from the merged pass-1 range must agree
    _MERGE_SUMS = {"_counts": "the histogram"}

    def _merge_config(self) -> tuple:
        return (self.percentile, self.num_bins)

    def _merge_same(self) -> Dict[str, Optional[torch.Tensor]]:
        return {"histogram bin edges": self._edges}

    def _begin_second_pass(self) -> None:
        amax = float(torch.maximum(self._min.abs(), self._max.abs()))
        self._amax = amax
        if amax > 0:
            self._edges = _uniform_edges32(0.0, amax, self.num_bins)
            self._counts = torch.zeros(self.num_bins, dtype=torch.int64, device=self._min.device)

    def _observe2(self, x: torch.Tensor) -> None:
        if self._amax == 0:
            if bool((x != 0).any()):
                raise DataError(f"tensor {self._label()}: pass-2 data differs from pass 1 (pass 1 was all zeros)")
            return
        a = x.to(torch.float32).abs()
        m = float(a.max())
        last = float(self._edges[-1])
        if m > last:  # widen with bins of the same width (docs/numerics.md section 2)
            width = float(self._edges[1].double() - self._edges[0].double())
            extra = max(1, math.ceil((m - last) / width))
            new = (torch.arange(1, extra + 1, dtype=torch.float64) * width + last).to(torch.float32)
            while float(new[-1]) < m:
                new = torch.cat([new, (new[-1:].double() + width).to(torch.float32)])
            self._edges = torch.cat([self._edges, new])
            self._counts = torch.cat([self._counts, self._counts.new_zeros(new.numel())])
        self._counts += _hist_counts(a, self._edges)

    def _range(self):
        lo, hi = self._min.cpu(), self._max.cpu()
        if self._amax == 0:
            return lo, hi
        counts = self._counts.cpu()
        cum = torch.cumsum(counts, 0)
        total = int(cum[-1])
        frac = cum.to(torch.float64) / float(total)
        idx = int(torch.searchsorted(frac, torch.tensor([self.percentile / 100.0], dtype=torch.float64))[0])
        idx = min(idx, counts.numel() - 1)
        t = self._edges[idx].to(torch.float64)
        return torch.maximum(-t, lo), torch.minimum(t, hi)

    @property
    def histogram(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(counts int64, edges float32)`` of the pass-2 histogram of |x| (CPU)."""
        return self._counts.cpu(), self._edges.clone()


# ------------------------------------------------------------------------------------------ signed histograms
class _SignedHistogramObserver(Observer):
    """Pass 1: exact min / max; pass 2: histogram of x on ``[-T, T]``, ``T = max(|min|, |max|)`` rounded to
    float32, ``num_bins`` float32 edges (as ONNX Runtime's ``HistogramCollector.collect_value`` on one batch)."""

    needs_second_pass = True

    def __init__(self, num_bins: int, name: Optional[str]):
        if int(num_bins) < 2:
            raise ConfigError(f"{type(self).__name__} num_bins must be >= 2, got {num_bins}")
        self.num_bins = int(num_bins)
        super().__init__(name)

    def reset(self) -> None:
        super().reset()
        self._edges = None
        self._counts = None

    # distributed merge: counts summed (int64); edges derived from the merged pass-1 range must agree
    _MERGE_SUMS = {"_counts": "the histogram"}

    def _merge_config(self) -> tuple:
        return (self.num_bins, getattr(self, "num_quantized_bins", None))

    def _merge_same(self) -> Dict[str, Optional[torch.Tensor]]:
        return {"histogram bin edges": self._edges}

    def _begin_second_pass(self) -> None:
        t = float(torch.maximum(self._min.abs(), self._max.abs()).to(torch.float32))
        self._t = t
        if t > 0:
            self._edges = _uniform_edges32(-t, t, self.num_bins)
            self._counts = torch.zeros(self.num_bins, dtype=torch.int64, device=self._min.device)

    def _observe2(self, x: torch.Tensor) -> None:
        xf = x.to(torch.float32)
        if self._t == 0:
            if bool((xf != 0).any()):
                raise DataError(f"tensor {self._label()}: pass-2 data differs from pass 1 (pass 1 was all zeros)")
            return
        if float(xf.min()) < -self._t or float(xf.max()) > self._t:
            raise DataError(f"tensor {self._label()}: pass-2 data exceeds the pass-1 range [-{self._t}, {self._t}]; "
                            f"feed the same calibration data in both passes")
        self._counts += _hist_counts(xf, self._edges)

    @property
    def histogram(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(counts int64, edges float32)`` of the pass-2 histogram (CPU)."""
        return self._counts.cpu(), self._edges.clone()


def entropy_threshold_index(hist: torch.Tensor, num_quantized_bins: int) -> Tuple[int, torch.Tensor]:
    """Vectorized KL search of ONNX Runtime's ``HistogramCollector.get_entropy_threshold`` (calibrate.py).

    For every candidate ``i`` in ``[nq//2, nb//2]`` the reference ``p`` is the slice
    ``hist[nb//2 - i : min(nb//2 + i + 1, nb)]`` with the outlier counts added to its first and last bins;
    the candidate ``q`` merges the slice into ``nq`` bins (``L // nq`` bins each, the remainder into the last),
    spreads each merged count over the positions of its group (integer division by the number of non-zero
    ``p`` bins, truncated, as ORT's int64 array does; positions past ``nq * (L // nq)`` stay 0); both are
    smoothed (eps 1e-4, ``quant_utils.smooth_distribution``) and compared by KL(p || q) after normalization.
    Computed in float64 (ORT: float32), so near-equal divergences may pick a different candidate.

    Args:
        hist: 1-D counts (``nb`` bins, symmetric around 0).
    Returns:
        ``(index of the best candidate i - nq//2, kl divergences float64 [C])``; the threshold is
        ``(edges[nb//2 - i], edges[min(nb//2 + i + 1, nb)])``.
    """
    h = hist.to(torch.float64).cpu()
    nb = h.numel()
    zero = nb // 2
    nhq = num_quantized_bins // 2
    if zero < nhq:
        raise ConfigError(f"Entropy: num_bins ({nb}) must be at least num_quantized_bins ({num_quantized_bins})")
    i = torch.arange(nhq, zero + 1)
    C = i.numel()
    start = zero - i
    end = torch.clamp(zero + i + 1, max=nb)
    L = end - start
    j = torch.arange(nb)
    valid = j[None, :] < L[:, None]
    gidx = torch.clamp(start[:, None] + j[None, :], max=nb - 1)
    sliced = torch.where(valid, h[gidx], torch.zeros((), dtype=torch.float64))
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(h, 0)])
    left = csum[start]
    right = csum[nb] - csum[end]
    p = sliced.clone()
    p[:, 0] += left
    p.scatter_add_(1, (L - 1)[:, None], right[:, None])
    nonzero = (p != 0) & valid
    m = (L // num_quantized_bins)[:, None]  # >= 1 since L >= 2 * nhq + 1 > nq - 1
    qi = torch.clamp(j[None, :] // m, max=num_quantized_bins - 1)
    inmain = j[None, :] < num_quantized_bins * m
    qb = torch.zeros(C, num_quantized_bins, dtype=torch.float64).scatter_add_(1, qi, sliced)
    norm = torch.zeros(C, num_quantized_bins, dtype=torch.float64).scatter_add_(
        1, qi, (nonzero & inmain).to(torch.float64))
    qv = torch.where(norm != 0, torch.floor(qb / torch.where(norm != 0, norm, torch.ones_like(norm))),
                     torch.zeros_like(qb))
    q = torch.where(valid & inmain, qv.gather(1, qi), torch.zeros((), dtype=torch.float64))

    def smooth(d):
        eps = 1e-4
        isz = (d == 0) & valid
        isnz = (d != 0) & valid
        nz = isz.sum(1, keepdim=True).to(torch.float64)
        nnz = isnz.sum(1, keepdim=True).to(torch.float64)
        eps1 = eps * nz / torch.where(nnz > 0, nnz, torch.ones_like(nnz))
        out = d + eps * isz - eps1 * isnz
        ok = (nnz[:, 0] > 0) & ~((out <= 0) & valid).any(1)
        return torch.where(valid, out, torch.zeros((), dtype=torch.float64)), ok

    ps, okp = smooth(p)
    qs, okq = smooth(q)
    pn = ps / ps.sum(1, keepdim=True)
    qn = qs / qs.sum(1, keepdim=True)
    safe_q = torch.where(valid, qn, torch.ones_like(qn))
    safe_p = torch.where(valid, pn, torch.ones_like(pn))
    kl = torch.where(valid, pn * torch.log(safe_p / safe_q), torch.zeros((), dtype=torch.float64)).sum(1)
    kl = torch.where(okp & okq, kl, torch.full_like(kl, math.inf))
    best = int(torch.argmin(kl))  # first minimum, as np.argmin
    return best, kl


class EntropyObserver(_SignedHistogramObserver):
    """KL-divergence threshold (docs/numerics.md section 2 "Entropy"; ONNX Runtime ``HistogramCollector``
    entropy method, TensorRT's calibration, MXNet's ``_get_optimal_threshold``).

    Two passes: pass 1 min / max; pass 2 histogram of x on ``[-T, T]`` (float32 ``T = max(|min|, |max|)``)
    with ``num_bins`` bins; then :func:`entropy_threshold_index`. The range is
    ``(edges[start], edges[end])`` of the best candidate, clamped to the observed ``[min, max]``.

    Defaults: ONNX Runtime's EntropyCalibrater uses ``num_bins=128, num_quantized_bins=128``, but its first
    batch's 128 bins grow with later, wider batches, and with a fixed two-pass histogram 128/128 leaves a
    single candidate (the full range). We therefore default to ``num_bins=2048`` (TensorRT's choice) and keep
    ``num_quantized_bins=128``; pass ``num_bins=128`` for ORT's single-batch behaviour.

    Raises:
        ConfigError: ``num_quantized_bins`` < 2 or larger than ``num_bins``.
    """

    def __init__(self, num_bins: int = 2048, num_quantized_bins: int = 128, name: Optional[str] = None):
        if int(num_quantized_bins) < 2 or int(num_quantized_bins) > int(num_bins):
            raise ConfigError(f"Entropy num_quantized_bins must be in [2, num_bins={num_bins}], got "
                              f"{num_quantized_bins}")
        self.num_quantized_bins = int(num_quantized_bins)
        super().__init__(num_bins, name)

    def _range(self):
        lo, hi = self._min.cpu(), self._max.cpu()
        if self._t == 0:
            return lo, hi
        best, _ = entropy_threshold_index(self._counts, self.num_quantized_bins)
        nb = self.num_bins
        i = self.num_quantized_bins // 2 + best
        a = self._edges[nb // 2 - i].to(torch.float64)
        b = self._edges[min(nb // 2 + i + 1, nb)].to(torch.float64)
        return torch.maximum(a, lo), torch.minimum(b, hi)


class DistributionObserver(_SignedHistogramObserver):
    """ONNX Runtime's "Distribution" method (``HistogramCollector.compute_distribution``, scenario "same").

    Same two-pass histogram as :class:`EntropyObserver`; ``avg`` / ``std`` are the count-weighted mean and
    standard deviation of the bin centres (float64). The range (what ORT's ``TensorData.range_value`` gives
    for integer types) is the histogram span ``(-T, T)``. ``avg`` / ``std`` are available after
    :meth:`compute_range` (ORT uses them for float8 scales).

    Args:
        num_bins: default 2048 (ORT requires >= 512 for this method).
    """

    def __init__(self, num_bins: int = 2048, name: Optional[str] = None):
        if int(num_bins) < 512:
            raise ConfigError(f"Distribution num_bins must be >= 512 (as ONNX Runtime), got {num_bins}")
        super().__init__(num_bins, name)
        self.avg: Optional[torch.Tensor] = None
        self.std: Optional[torch.Tensor] = None

    def _range(self):
        lo, hi = self._min.cpu(), self._max.cpu()
        if self._t == 0:
            self.avg, self.std = _f64(0.0), _f64(0.0)
            return lo, hi
        e = self._edges.to(torch.float64)
        c = self._counts.cpu().to(torch.float64)
        v = (e[:-1] + e[1:]) * 0.5
        n = c.sum()
        self.avg = (c * v).sum() / n
        self.std = torch.sqrt(torch.clamp((c * v * v).sum() / n - self.avg ** 2, min=0.0))
        return e[0].clone(), e[-1].clone()


# ------------------------------------------------------------------------------------------------ power of two
class PowerOfTwoObserver(Observer):
    """Power-of-two scales ``2^-pos`` (docs/numerics.md section 1; Quark's PowerOfTwoMethod).

    * ``"NonOverflow"``: one pass (exact min / max); :func:`~qtorch_onnx.formats.integer.pow2_scale_nonoverflow`.
    * ``"MinMSE"``: two passes. Pass 1 min / max gives the NonOverflow position ``p0``; pass 2 accumulates, for
      each candidate ``pos`` in ``p0 .. p0 + pos_range - 1`` (Quark: 5 candidates), the exact-data squared error
      of fake-quantizing every element with scale ``2^-pos``. Each element's squared error is rounded to an
      int64 fixed-point quantum ``2^(2K - 30)`` with ``K = ceil(log2 max|x|)`` and summed in int64, which
      makes the sums independent of the batching. The first candidate with the smallest error wins (Quark's
      strict ``<``). Quark's "MostCommon" per-batch mode is not provided (batch dependent by design).

    ``fmt`` / ``symmetric`` are needed before pass 2 (the candidates depend on them); :meth:`compute_qparams`
    must be called with the same values. :meth:`compute_range` returns the range covered by the chosen scale,
    ``((qmin - zp) * s, (qmax - zp) * s)``.

    Raises:
        ConfigError: unknown method, non-IntFormat, or compute_qparams with a different format.
    """

    def __init__(self, method: str = "NonOverflow", fmt: IntFormat = INT8, symmetric: bool = True,
                 pos_range: int = 5, name: Optional[str] = None):
        if method not in ("NonOverflow", "MinMSE"):
            raise ConfigError(f"power-of-two method {method!r} unknown; valid: 'NonOverflow', 'MinMSE'"
                              + closest(method, ["NonOverflow", "MinMSE"]))
        if not getattr(getattr(fmt, "family", None), "integer_grid", False):
            raise ConfigError(f"power-of-two observers need an integer format, got {fmt!r}")
        if int(pos_range) < 1:
            raise ConfigError(f"pos_range must be >= 1, got {pos_range}")
        self.method = method
        self.fmt = fmt
        self.symmetric = bool(symmetric)
        self.pos_range = int(pos_range)
        self.needs_second_pass = method == "MinMSE"
        super().__init__(name)

    def reset(self) -> None:
        super().reset()
        self._sse = None
        self._cands = None

    # distributed merge: int64 error sums summed; candidates / quantum (from the merged pass-1 range) must agree
    _MERGE_SUMS = {"_sse": "the MinMSE error sums"}

    def _merge_config(self) -> tuple:
        return (self.method, self.fmt.name, self.symmetric, self.pos_range)

    def _merge_same(self) -> Dict[str, Optional[torch.Tensor]]:
        if self._cands is None:
            return {"MinMSE candidates": None}
        return {"MinMSE candidates": torch.tensor([self._quantum, float(self._zp), *map(float, self._cands)],
                                                  dtype=torch.float64)}

    def _p0(self):
        return qint.pow2_scale_nonoverflow(self._min.cpu(), self._max.cpu(), self.fmt, self.symmetric)

    def _begin_second_pass(self) -> None:
        s0, z0, p0 = self._p0()
        amax = float(torch.maximum(self._min.abs(), self._max.abs()))
        self._zp = int(z0)
        if amax == 0:
            self._cands = None
            return
        self._cands = [int(p0) + k for k in range(self.pos_range) if int(p0) + k <= 126]
        k = math.ceil(math.log2(amax))
        self._quantum = 2.0 ** (2 * k - 30)
        self._sse = torch.zeros(len(self._cands), dtype=torch.int64, device=self._min.device)

    def _observe2(self, x: torch.Tensor) -> None:
        if self._cands is None:
            return
        xf = x.to(torch.float32)
        x64 = xf.to(torch.float64)
        zp = torch.tensor(self._zp)
        for n, pos in enumerate(self._cands):
            y = qint.fake_quantize(xf, torch.tensor(2.0 ** -pos, dtype=torch.float32), zp, self.fmt)
            e2 = (y.to(torch.float64) - x64) ** 2
            self._sse[n] += torch.round(e2 / self._quantum).to(torch.int64).sum()

    def _choose(self) -> Tuple[torch.Tensor, torch.Tensor]:
        s0, z0, p0 = self._p0()
        if self.method == "NonOverflow" or self._cands is None:
            return s0, z0
        sse = self._sse.cpu().tolist()
        best = min(range(len(sse)), key=lambda n: (sse[n], n))
        pos = self._cands[best]
        return torch.tensor(2.0 ** -pos, dtype=torch.float32), z0

    def _range(self):
        s, z = self._choose()
        qmin, qmax = self.fmt.qmin, self.fmt.qmax
        s64 = s.to(torch.float64)
        return (qmin - z).to(torch.float64) * s64, (qmax - z).to(torch.float64) * s64

    def compute_qparams(self, fmt: IntFormat, symmetric: bool, reduce_range: bool = False):
        """``(scale float32 = 2^-pos, zero_point int64)``; ``fmt`` / ``symmetric`` must match the constructor's.

        Raises:
            ConfigError: a different format or symmetry than the observer was built for, or reduce_range.
        """
        if fmt != self.fmt or bool(symmetric) != self.symmetric:
            raise ConfigError(f"power-of-two observer for tensor {self._label()} was built for "
                              f"{self.fmt.name} symmetric={self.symmetric}, asked for {getattr(fmt, 'name', fmt)} "
                              f"symmetric={symmetric}")
        if reduce_range:
            raise ConfigError("reduce_range is not supported with power-of-two scales")
        self._check_ready()
        return self._choose()


# ---------------------------------------------------------------------------------------------------- factory
OBSERVERS: Dict[str, Tuple[Type[Observer], dict]] = {
    "MinMax": (MinMaxObserver, {}),
    "Percentile": (PercentileObserver, {}),
    "Entropy": (EntropyObserver, {}),
    "Distribution": (DistributionObserver, {}),
    "NonOverflow": (PowerOfTwoObserver, {"method": "NonOverflow"}),
    "MinMSE": (PowerOfTwoObserver, {"method": "MinMSE"}),
}


def make_observer(method: str, **options) -> Observer:
    """Build an observer by calibration method name (docs/configuration.md ``calibrate_method``).

    Names: ``"MinMax"``, ``"Percentile"``, ``"Entropy"``, ``"Distribution"``, ``"NonOverflow"``, ``"MinMSE"``
    (case-insensitive; ``CalibrationMethod.X`` / ``PowerOfTwoMethod.X`` enum members are accepted through
    their ``name``). ``options`` are the constructor's keyword arguments (``name``, ``axis``, ``percentile``,
    ``num_bins``, ``fmt``, ...).

    Raises:
        ConfigError: unknown method (lists the valid ones) or an option the observer does not take.
    """
    key = getattr(method, "name", method)
    if not isinstance(key, str):
        raise ConfigError(f"calibration method must be a name, got {method!r}; valid: {', '.join(OBSERVERS)}")
    lookup = {k.lower(): k for k in OBSERVERS}
    if key.lower() not in lookup:
        raise ConfigError(f"unknown calibration method {key!r}; valid: {', '.join(OBSERVERS)}"
                          + closest(key, OBSERVERS))
    cls, fixed = OBSERVERS[lookup[key.lower()]]
    params = set(inspect.signature(cls.__init__).parameters) - {"self"} - set(fixed)
    unknown = sorted(set(options) - params)
    if unknown:
        raise ConfigError(f"calibration method {lookup[key.lower()]!r} does not take option(s) {unknown}; "
                          f"valid: {sorted(params)}")
    return cls(**fixed, **options)
