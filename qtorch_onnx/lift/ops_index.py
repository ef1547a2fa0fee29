"""Indexing converters (ONNX spec semantics): ScatterElements/Scatter and ScatterND with every reduction,
TensorScatter, GatherElements and GatherND (negative indices, ``batch_dims``), TopK (stable: equal values
keep index order, as the spec requires), NonMaxSuppression, OneHot, Compress, Unique, ReverseSequence,
TfIdfVectorizer (integer pools).

onnx2torch's GatherElements (no negative indices), GatherND (no ``batch_dims``) and NonMaxSuppression
(assumes ``y1 < y2``, ``x1 < x2`` corners) are overridden; torch.topk is not stable, so TopK is ours.
"""
from __future__ import annotations

import torch
from torch import nn

from .ops_common import ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, register_versions, result
from .ops_math import _WIDE_UNSIGNED, _from_ordered_int64, _to_ordered_int64

_REDUCE = {"none": None, "add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _fix_negative(idx: torch.Tensor, size) -> torch.Tensor:
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + size, idx)


def _reduction(node: OnnxNode) -> str:
    r = attr(node, "reduction", "none")
    if r not in _REDUCE:
        raise ConversionNotSupported(f"{node.operation_type} node {node.name!r}: reduction={r!r} "
                                     f"(valid: none, add, mul, max, min)")
    return r


class OnnxScatterElements(nn.Module, OnnxToTorchModule):
    """ONNX ScatterElements-11..18 / Scatter-9..11: ``out = data; out[..., idx[i], ...] (op)= updates[i]``
    along ``axis``; indices may be negative; reduction none/add/mul/max/min (``include_self``)."""

    def __init__(self, axis: int, reduction: str):
        super().__init__()
        self.axis, self.reduction = axis, reduction

    def forward(self, data, indices, updates):  # noqa: D102
        axis = self.axis % data.dim()
        idx = _fix_negative(indices, data.shape[axis])
        if self.reduction == "none":
            return data.scatter(axis, idx, updates)
        return data.scatter_reduce(axis, idx, updates, reduce=_REDUCE[self.reduction], include_self=True)


def _scatter_elements(node: OnnxNode, graph: OnnxGraph):
    return result(OnnxScatterElements(attr(node, "axis", 0), _reduction(node)), node)


register_versions("ScatterElements", 11, _scatter_elements)
register_versions("Scatter", 9, _scatter_elements)


class OnnxScatterND(nn.Module, OnnxToTorchModule):
    """ONNX ScatterND-11..18: ``out[indices[i]] (op)= updates[i]`` for k-tuples ``indices[..., :k]``
    addressing slices of ``data``; negative indices count from the end; reduction none/add/mul/max/min."""

    def __init__(self, reduction: str):
        super().__init__()
        self.reduction = reduction

    def forward(self, data, indices, updates):  # noqa: D102
        k = indices.shape[-1]
        lead = data.shape[:k]
        idx = indices.to(torch.int64).reshape(-1, k)
        sizes = torch.tensor(lead, dtype=torch.int64, device=data.device)
        idx = torch.where(idx < 0, idx + sizes, idx)
        strides = torch.ones(k, dtype=torch.int64, device=data.device)
        for i in range(k - 2, -1, -1):
            strides[i] = strides[i + 1] * lead[i + 1]
        flat_idx = (idx * strides).sum(dim=1)
        n_lead = 1
        for d in lead:
            n_lead *= d
        flat = data.reshape((n_lead,) + tuple(data.shape[k:]))
        upd = updates.reshape((-1,) + tuple(data.shape[k:]))
        if self.reduction == "none":
            out = flat.index_copy(0, flat_idx, upd)
        elif self.reduction == "add":
            out = flat.index_add(0, flat_idx, upd)
        else:
            out = flat.index_reduce(0, flat_idx, upd, {"mul": "prod", "max": "amax", "min": "amin"}[self.reduction],
                                    include_self=True)
        return out.reshape(data.shape)


register_versions("ScatterND", 18, lambda node, graph: result(OnnxScatterND(_reduction(node)), node))


class OnnxTensorScatter(nn.Module, OnnxToTorchModule):
    """ONNX TensorScatter-24: ``present = past; present[b, ..., (w[b] + s) (mod L if circular), ...] =
    update[b, ..., s, ...]`` along the sequence ``axis`` (write_indices ``w`` default 0)."""

    def __init__(self, axis: int, circular: bool):
        super().__init__()
        self.axis, self.circular = axis, circular

    def forward(self, past, update, write_indices=None):  # noqa: D102
        axis = self.axis % past.dim()
        length, s = past.shape[axis], update.shape[axis]
        b = past.shape[0]
        w = write_indices.to(torch.int64) if write_indices is not None else torch.zeros(b, dtype=torch.int64,
                                                                                          device=past.device)
        pos = w.reshape(-1, 1) + torch.arange(s, device=past.device).reshape(1, -1)  # [B, S]
        if self.circular:
            pos = pos % length
        shape = [1] * past.dim()
        shape[0], shape[axis] = b, s
        idx = pos.reshape(shape).expand(update.shape)
        return past.scatter(axis, idx, update)


def _tensor_scatter(node: OnnxNode, graph: OnnxGraph):
    mode = attr(node, "mode", "linear")
    if mode not in ("linear", "circular"):
        raise ConversionNotSupported(f"TensorScatter node {node.name!r}: mode={mode!r} (valid: linear, circular)")
    return result(OnnxTensorScatter(attr(node, "axis", -2), mode == "circular"), node)


register_versions("TensorScatter", 24, _tensor_scatter)


class OnnxGatherElements(nn.Module, OnnxToTorchModule):
    """ONNX GatherElements-11/13: ``out[i] = data[..., indices[i], ...]`` along ``axis``, negative indices allowed."""

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis

    def forward(self, data, indices):  # noqa: D102
        axis = self.axis % data.dim()
        return torch.gather(data, axis, _fix_negative(indices, data.shape[axis]))


register_versions("GatherElements", 11, lambda node, graph: result(OnnxGatherElements(attr(node, "axis", 0)), node),
                  override=[11, 13])


class OnnxGatherND(nn.Module, OnnxToTorchModule):
    """ONNX GatherND-11/12/13: the first ``batch_dims`` axes of data and indices are batch axes; the
    last axis of indices holds k-tuples (negative allowed) addressing slices of data's next k axes."""

    def __init__(self, batch_dims: int):
        super().__init__()
        self.batch_dims = batch_dims

    def forward(self, data, indices):  # noqa: D102
        b = self.batch_dims
        k = indices.shape[-1]
        bshape = data.shape[:b]
        nb = 1
        for d in bshape:
            nb *= d
        lead = data.shape[b:b + k]
        d = data.reshape((nb,) + tuple(data.shape[b:]))
        idx = indices.to(torch.int64).reshape(nb, -1, k)
        sizes = torch.tensor(lead, dtype=torch.int64, device=data.device)
        idx = torch.where(idx < 0, idx + sizes, idx)
        batch = torch.arange(nb, device=data.device).reshape(nb, 1).expand(nb, idx.shape[1])
        picked = d[(batch,) + tuple(idx[..., j] for j in range(k))]  # [nb, m, *rest]
        return picked.reshape(tuple(indices.shape[:-1]) + tuple(data.shape[b + k:]))


register_versions("GatherND", 11, lambda node, graph: result(OnnxGatherND(attr(node, "batch_dims", 0)), node),
                  override=[11, 12, 13])


class OnnxTopK(nn.Module, OnnxToTorchModule):
    """ONNX TopK-1/10/11/24: the k largest (``largest=1``) or smallest values along ``axis`` and their
    int64 indices, sorted; equal values keep ascending index order (a stable sort, as the spec says)."""

    def __init__(self, axis: int, largest: bool, k: int | None = None):
        super().__init__()
        self.axis, self.largest, self.k = axis, largest, k

    def forward(self, x, k=None):  # noqa: D102
        kk = self.k if k is None else int(k.reshape(-1)[0])
        dtype = x.dtype
        v = _to_ordered_int64(x) if dtype in _WIDE_UNSIGNED else x
        vals, idx = torch.sort(v, dim=self.axis, descending=self.largest, stable=True)
        vals, idx = vals.narrow(self.axis, 0, kk), idx.narrow(self.axis, 0, kk)
        if dtype in _WIDE_UNSIGNED:
            vals = _from_ordered_int64(vals, dtype)
        return vals, idx


register_versions("TopK", 1, lambda node, graph: result(
    OnnxTopK(attr(node, "axis", -1), bool(attr(node, "largest", 1)), attr(node, "k")), node), override=[1, 10, 11])


class OnnxNonMaxSuppression(nn.Module, OnnxToTorchModule):
    """ONNX NonMaxSuppression-10/11: per batch and class, boxes with score > score_threshold taken in
    descending score order (ties: lower index first) unless their IoU with a kept box exceeds
    iou_threshold; at most max_output_boxes_per_class (default 0: none) per class. Boxes are
    ``[y1, x1, y2, x2]`` with either diagonal (``center_point_box=0``) or ``[xc, yc, w, h]``. Output
    int64 ``[num_selected, 3]`` of (batch, class, box)."""

    def __init__(self, center_point_box: int):
        super().__init__()
        self.center = center_point_box

    def forward(self, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None):  # noqa: D102
        max_out = int(max_output_boxes_per_class.reshape(-1)[0]) if max_output_boxes_per_class is not None and \
            max_output_boxes_per_class.numel() else 0
        iou_t = float(iou_threshold.reshape(-1)[0]) if iou_threshold is not None and iou_threshold.numel() else 0.0
        b = boxes.to(torch.float64)
        if self.center:
            xc, yc, w, h = b.unbind(-1)
            y1, x1, y2, x2 = yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2
        else:
            ya, xa, yb, xb = b.unbind(-1)
            y1, y2, x1, x2 = torch.minimum(ya, yb), torch.maximum(ya, yb), torch.minimum(xa, xb), torch.maximum(xa, xb)
        area = (y2 - y1) * (x2 - x1)
        iy = (torch.minimum(y2.unsqueeze(-1), y2.unsqueeze(-2)) - torch.maximum(y1.unsqueeze(-1), y1.unsqueeze(-2))).clamp(min=0)
        ix = (torch.minimum(x2.unsqueeze(-1), x2.unsqueeze(-2)) - torch.maximum(x1.unsqueeze(-1), x1.unsqueeze(-2))).clamp(min=0)
        inter = iy * ix
        union = area.unsqueeze(-1) + area.unsqueeze(-2) - inter
        valid = (inter > 0) & (area.unsqueeze(-1) > 0) & (area.unsqueeze(-2) > 0) & (union > 0)
        suppress = valid & (inter / torch.where(union > 0, union, torch.ones_like(union)) > iou_t)  # [N, S, S]
        out = []
        for n in range(scores.shape[0]):
            for c in range(scores.shape[1]):
                s = scores[n, c]
                order = torch.sort(-s.to(torch.float64), stable=True).indices.tolist()
                if score_threshold is not None and score_threshold.numel():
                    st = float(score_threshold.reshape(-1)[0])
                    order = [i for i in order if float(s[i]) > st]
                kept: list[int] = []
                sup = suppress[n]
                for i in order:
                    if len(kept) >= max_out:
                        break
                    if not any(bool(sup[i, j]) for j in kept):
                        kept.append(i)
                        out.append((n, c, i))
        return torch.tensor(out, dtype=torch.int64, device=boxes.device).reshape(-1, 3)


register_versions("NonMaxSuppression", 10, lambda node, graph: result(
    OnnxNonMaxSuppression(attr(node, "center_point_box", 0)), node), override=[10, 11])


class OnnxOneHot(nn.Module, OnnxToTorchModule):
    """ONNX OneHot-9/11: ``out[..., j, ...] = values[1] if j == indices (negative: + depth) else values[0]``,
    new axis of length depth at ``axis``; out-of-range indices give an all-off row."""

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis

    def forward(self, indices, depth, values):  # noqa: D102
        d = int(depth.reshape(-1)[0])
        idx = indices.to(torch.int64)
        idx = torch.where(idx < 0, idx + d, idx)
        axis = self.axis % (indices.dim() + 1)
        shape = [1] * (indices.dim() + 1)
        shape[axis] = d
        rng = torch.arange(d, device=indices.device).reshape(shape)
        hot = idx.unsqueeze(axis) == rng
        return torch.where(hot, values[1], values[0])


register_versions("OneHot", 9, lambda node, graph: result(OnnxOneHot(attr(node, "axis", -1)), node))


class OnnxCompress(nn.Module, OnnxToTorchModule):
    """ONNX Compress-9/11: keep the slices along ``axis`` (flattened input if none) where the 1-D bool
    condition is true (a shorter condition keeps only its length)."""

    def __init__(self, axis: int | None):
        super().__init__()
        self.axis = axis

    def forward(self, x, condition):  # noqa: D102
        cond = condition.to(torch.bool).reshape(-1)
        if self.axis is None:
            x, axis = x.reshape(-1), 0
        else:
            axis = self.axis % x.dim()
        keep = torch.nonzero(cond[: x.shape[axis]]).reshape(-1)
        return torch.index_select(x, axis, keep)


register_versions("Compress", 9, lambda node, graph: result(OnnxCompress(attr(node, "axis")), node))


class OnnxUnique(nn.Module, OnnxToTorchModule):
    """ONNX Unique-11: unique values (or slices along ``axis``), sorted ascending (``sorted=1``) or in
    order of first occurrence; outputs Y, indices (first occurrence), inverse_indices, counts (int64)."""

    def __init__(self, axis: int | None, sorted_: bool, n_outputs: int):
        super().__init__()
        self.axis, self.sorted, self.n_outputs = axis, sorted_, n_outputs

    def forward(self, x):  # noqa: D102
        if self.axis is None:
            flat, dim = x.reshape(-1), 0
            uniq, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        else:
            dim = self.axis % x.dim()
            flat = x
            uniq, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True, dim=dim)
        n = flat.shape[dim]
        pos = torch.arange(n, device=x.device)
        first = torch.full((uniq.shape[dim],), n, dtype=torch.int64, device=x.device).scatter_reduce(
            0, inverse, pos, reduce="amin", include_self=True)
        if not self.sorted:
            perm = torch.argsort(first)
            rank = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=x.device))
            uniq = torch.index_select(uniq, dim, perm)
            first, counts, inverse = first[perm], counts[perm], rank[inverse]
        outs = (uniq, first, inverse, counts)
        return outs[0] if self.n_outputs == 1 else outs[: self.n_outputs]


register_versions("Unique", 11, lambda node, graph: result(
    OnnxUnique(attr(node, "axis"), bool(attr(node, "sorted", 1)), len(node.output_values)), node))


class OnnxReverseSequence(nn.Module, OnnxToTorchModule):
    """ONNX ReverseSequence-10: for batch b reverse the first ``sequence_lens[b]`` elements along
    ``time_axis`` (batch along ``batch_axis``); the rest is copied."""

    def __init__(self, batch_axis: int, time_axis: int):
        super().__init__()
        self.batch_axis, self.time_axis = batch_axis, time_axis

    def forward(self, x, sequence_lens):  # noqa: D102
        ba, ta = self.batch_axis % x.dim(), self.time_axis % x.dim()
        t = torch.arange(x.shape[ta], device=x.device).reshape(1, -1)
        lens = sequence_lens.to(torch.int64).reshape(-1, 1)
        src = torch.where(t < lens, lens - 1 - t, t)  # [B, T]
        shape = [1] * x.dim()
        shape[ba], shape[ta] = x.shape[ba], x.shape[ta]
        if ba > ta:
            src = src.t()
            shape[ta], shape[ba] = x.shape[ta], x.shape[ba]
        idx = src.reshape(shape).expand(x.shape)
        return torch.gather(x, ta, idx)


register_versions("ReverseSequence", 10, lambda node, graph: result(
    OnnxReverseSequence(attr(node, "batch_axis", 1), attr(node, "time_axis", 0)), node))


class OnnxTfIdfVectorizer(nn.Module, OnnxToTorchModule):
    """ONNX TfIdfVectorizer-9 on integer input ``[C]`` or ``[B, C]`` -> float32 ``[max(ngram_indexes)+1]``
    or ``[B, ...]``. For every skip distance ``d = 1..max_skip_count+1`` and start position, the n-grams
    ``x[s], x[s+d], ..., x[s+(n-1)d]`` with ``min_gram_length <= n <= max_gram_length`` that are in the
    pool (``pool_int64s`` grouped by size via ``ngram_counts``) are counted at ``ngram_indexes[id]``;
    unigrams are counted once (not per skip distance). Mode TF: counts; IDF: ``weight if count > 0``;
    TFIDF: ``count * weight`` (weights default 1)."""

    def __init__(self, mode: str, min_n: int, max_n: int, max_skip: int, ngram_counts, ngram_indexes, pool,
                 weights):
        super().__init__()
        self.mode, self.min_n, self.max_n, self.max_skip = mode, min_n, max_n, max_skip
        self.out_size = max(ngram_indexes) + 1
        self.weights = list(weights) if weights else None
        self.grams: dict[tuple, int] = {}
        gid = 0
        for size, start in enumerate(ngram_counts, start=1):
            end = ngram_counts[size] if size < len(ngram_counts) else len(pool)
            for j in range(start, end, size):
                if min_n <= size <= max_n:
                    self.grams[tuple(pool[j:j + size])] = ngram_indexes[gid]
                gid += 1

    def _row(self, row: list[int]) -> list[int]:
        freq = [0] * self.out_size
        n_items = len(row)
        for d in range(1, self.max_skip + 2):
            lo = self.min_n if d == 1 else max(self.min_n, 2)
            for s in range(n_items):
                for n in range(lo, self.max_n + 1):
                    last = s + (n - 1) * d
                    if last >= n_items:
                        break
                    hit = self.grams.get(tuple(row[s:last + 1:d]))
                    if hit is not None:
                        freq[hit] += 1
        return freq

    def forward(self, x):  # noqa: D102
        rows = x.reshape(1, -1).tolist() if x.dim() <= 1 else x.tolist()
        f = torch.tensor([self._row(r) for r in rows], dtype=torch.float32)
        if self.mode == "IDF":
            w = torch.tensor(self.weights, dtype=torch.float32) if self.weights else torch.ones(self.out_size)
            f = torch.where(f > 0, w.expand_as(f), torch.zeros_like(f))
        elif self.mode == "TFIDF" and self.weights:
            f = f * torch.tensor(self.weights, dtype=torch.float32)
        return f.reshape(-1) if x.dim() <= 1 else f


def _tfidf(node: OnnxNode, graph: OnnxGraph):
    if attr(node, "pool_strings"):
        raise ConversionNotSupported(f"TfIdfVectorizer node {node.name!r}: string pools (pool_strings) have no torch "
                                     f"representation; only pool_int64s is supported")
    mode = attr(node, "mode")
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ConversionNotSupported(f"TfIdfVectorizer node {node.name!r}: mode={mode!r} (valid: TF, IDF, TFIDF)")
    mod = OnnxTfIdfVectorizer(mode, attr(node, "min_gram_length"), attr(node, "max_gram_length"),
                              attr(node, "max_skip_count"), list(attr(node, "ngram_counts")),
                              list(attr(node, "ngram_indexes")), list(attr(node, "pool_int64s", [])),
                              attr(node, "weights"))
    return result(mod, node)


register_versions("TfIdfVectorizer", 9, _tfidf)


# ============================================================================ Slice-10/11/13
def slice_tensor(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, axes=None, steps=None) -> torch.Tensor:
    """ONNX Slice with run-time starts / ends / axes / steps (1-D integer tensors), indexed with a tuple.

    A negative step flips that axis and slices it forward from ``-start - 1`` to ``-end - 1`` (Python slicing
    then clamps out-of-range bounds as ONNX does). onnx2torch's module indexes with a *list* of slices, which
    torch deprecates (a future torch reads it as a tensor index); this is the same computation with a tuple.
    """
    n = int(starts.numel())
    axes_l = list(range(n)) if axes is None else [int(a) for a in axes.reshape(-1).tolist()]
    steps_l = [1] * n if steps is None else [int(s) for s in steps.reshape(-1).tolist()]
    index = [slice(None)] * x.dim()
    flips = []
    for start, end, axis, step in zip(starts.reshape(-1).tolist(), ends.reshape(-1).tolist(), axes_l, steps_l):
        axis %= x.dim()
        if step < 0:
            flips.append(axis)
            start, end, step = -start - 1, -end - 1, -step
        size = int(x.shape[axis])  # bounds clamped as Python slicing would (torch warns on huge ones)
        start, end = (max(-size - 1, min(v, size + 1)) for v in (start, end))
        index[axis] = slice(start, end, min(step, size + 1))
    if flips:
        x = torch.flip(x, dims=flips)
    return x[tuple(index)]


class OnnxSliceTuple(nn.Module, OnnxToTorchModule):
    """ONNX Slice-10/11/13 (inputs: data, starts, ends[, axes[, steps]]): :func:`slice_tensor`."""

    def forward(self, x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, axes=None, steps=None):  # noqa: D102
        return slice_tensor(x, starts, ends, axes, steps)


# onnx2torch registers Slice-10/11/13 with a list index (a torch deprecation warning on every call): overridden
register_versions("Slice", 10, lambda node, graph: result(OnnxSliceTuple(), node), override=[10, 11, 13])
