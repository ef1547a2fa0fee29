"""Calibration / evaluation data: every accepted form turned into validated samples.

Accepted (docs/configuration.md "Calibration data"): an object with ``get_next()`` returning ``{input_name: ndarray}``
or None (ONNX Runtime's ``CalibrationDataReader``); an iterable of such dicts, of arrays/tensors (single-input
models) or of tuples in input order; a torch ``DataLoader`` (batches of tensors, tuples, or dicts); a folder of
``.npy`` / ``.npz`` files (sorted by name; ``.npz`` keys are input names, ``.npy`` a single-input model's input).

User arrays are never modified: samples are copied into new torch tensors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import onnx
import torch

from .errors import DataError

_ONNX_TO_NP = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.BOOL: np.bool_, onnx.TensorProto.INT16: np.int16,
}


@dataclass(frozen=True)
class InputSpec:
    """One graph input: ``name``, numpy ``dtype``, ``shape`` (None for a symbolic dimension)."""

    name: str
    dtype: Any
    shape: Tuple[Optional[int], ...]

    @property
    def batch_dynamic(self) -> bool:
        return len(self.shape) > 0 and self.shape[0] is None


def input_specs(model: onnx.ModelProto) -> List[InputSpec]:
    """The graph inputs (initializers excluded) of ``model`` in ONNX order. A dimension without a value, or
    with a negative ``dim_value`` (paddle2onnx writes -1 for a dynamic batch), is dynamic (``None``)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in tt.shape.dim)
        specs.append(InputSpec(vi.name, np.dtype(_ONNX_TO_NP.get(tt.elem_type, np.float32)), shape))
    return specs


def _iter_raw(data: Any) -> Iterator[Any]:
    if data is None:
        return
    if isinstance(data, (str, os.PathLike)):
        folder = os.fspath(data)
        if not os.path.isdir(folder):
            raise DataError(f"calibration data folder {folder!r} does not exist or is not a folder")
        files = sorted(f for f in os.listdir(folder) if f.endswith((".npy", ".npz")))
        if not files:
            raise DataError(f"calibration data folder {folder!r} holds no .npy or .npz files")
        for f in files:
            path = os.path.join(folder, f)
            if f.endswith(".npy"):
                yield np.load(path, allow_pickle=False)
            else:
                with np.load(path, allow_pickle=False) as z:
                    yield {k: z[k] for k in z.files}
        return
    if hasattr(data, "get_next") and callable(data.get_next):
        while True:
            item = data.get_next()
            if item is None:
                return
            yield item
        return
    if isinstance(data, (np.ndarray, torch.Tensor, dict)):
        yield data
        return
    if isinstance(data, Iterable):
        yield from data
        return
    raise DataError(
        f"unsupported calibration data of type {type(data).__name__}: give a CalibrationDataReader (get_next), "
        "an iterable of dicts/arrays/tuples, a torch DataLoader, or a folder of .npy/.npz files"
    )


def _to_tensor(value: Any, spec: InputSpec, index: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().clone()
        arr_dtype = np.dtype(str(t.dtype).replace("torch.", "")) if t.dtype != torch.bool else np.dtype(np.bool_)
    else:
        arr = np.asarray(value)
        arr_dtype = arr.dtype
        t = torch.from_numpy(np.array(arr, copy=True))
    if arr_dtype != spec.dtype:
        raise DataError(
            f"sample {index}, input {spec.name!r}: dtype {arr_dtype} but the model expects {spec.dtype}"
        )
    if len(t.shape) != len(spec.shape) or any(
        d is not None and d != s for d, s in zip(spec.shape, t.shape)
    ):
        raise DataError(
            f"sample {index}, input {spec.name!r}: shape {tuple(t.shape)} does not match the model's "
            f"{tuple('?' if d is None else d for d in spec.shape)}"
        )
    return t


def to_samples(data: Any, specs: Sequence[InputSpec], *, what: str = "calibration data") -> List[Tuple[torch.Tensor, ...]]:
    """Read ``data`` completely into a list of samples, each a tuple of tensors in input order.

    Raises:
        DataError: empty data; wrong input names (lists the expected ones); wrong shape or dtype (names the
            input and the sample index); more or fewer inputs than the model has.
    """
    names = [s.name for s in specs]
    samples: List[Tuple[torch.Tensor, ...]] = []
    for index, item in enumerate(_iter_raw(data)):
        if isinstance(item, dict):
            got = set(item)
            if got != set(names):
                missing = sorted(set(names) - got)
                extra = sorted(got - set(names))
                raise DataError(
                    f"{what} sample {index}: input names {sorted(got)} do not match the model's inputs {names}"
                    + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else "")
                )
            values = [item[n] for n in names]
        elif isinstance(item, (tuple, list)) and len(specs) > 1:
            values = list(item)
        elif isinstance(item, (tuple, list)) and len(item) == 1:
            values = list(item)
        else:
            values = [item]
        if len(values) != len(specs):
            raise DataError(f"{what} sample {index}: {len(values)} inputs given, the model has {len(specs)}: {names}")
        samples.append(tuple(_to_tensor(v, s, index) for v, s in zip(values, specs)))
    if not samples:
        raise DataError(f"{what} is empty: the data reader returned no samples")
    return samples


def batches(samples: Sequence[Tuple[torch.Tensor, ...]], specs: Sequence[InputSpec], batch_size: int
            ) -> Iterator[Tuple[torch.Tensor, ...]]:
    """Concatenate consecutive samples along dim 0 when every input's batch dimension is dynamic.

    Samples whose shapes differ (beyond dim 0) are never concatenated together.
    """
    can_batch = batch_size > 1 and all(s.batch_dynamic for s in specs)
    if not can_batch:
        yield from samples
        return
    group: List[Tuple[torch.Tensor, ...]] = []
    for s in samples:
        if group and (len(group) >= batch_size or any(a.shape[1:] != b.shape[1:] for a, b in zip(group[0], s))):
            yield tuple(torch.cat(parts, 0) for parts in zip(*group))
            group = []
        group.append(s)
    if group:
        yield tuple(torch.cat(parts, 0) for parts in zip(*group))


def check_finite(samples: Sequence[Tuple[torch.Tensor, ...]], specs: Sequence[InputSpec]) -> None:
    """Raise DataError naming the input and sample when a float input holds NaN or Inf."""
    for index, sample in enumerate(samples):
        for t, spec in zip(sample, specs):
            if t.is_floating_point() and not torch.isfinite(t).all():
                bad = int((~torch.isfinite(t)).sum())
                raise DataError(
                    f"calibration sample {index}, input {spec.name!r}: {bad} NaN/Inf values; calibration ranges "
                    "would be meaningless. Clean the data (e.g. np.nan_to_num) or drop the sample."
                )
