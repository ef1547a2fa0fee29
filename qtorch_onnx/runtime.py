"""ONNX Runtime side: sessions, the custom-operator library path, and emulation-vs-deployment checks.

Importing this module (and calling :func:`get_library_path`) loads neither torch nor onnx: a deployment
that only registers the operator library stays light. numpy, onnx and torch are imported by the functions
that use them.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from .errors import UnsupportedFeatureError

if TYPE_CHECKING:  # annotations only
    import numpy as np
    import onnx
    import torch

    from .fakequant import FakeQuantize

OPT_LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")


def get_library_path(device: str = "CPU") -> str:
    """Path of the project's ONNX Runtime custom-operator library (docs/operators.md: ``com.amd.quark`` operators
    BFPQuantizeDequantize, MXQuantizeDequantize, ExtendedQuantizeLinear, ExtendedDequantizeLinear, and the
    ``com.vai.quantize`` aliases), built from its C++ sources on first use and cached
    (``$QTORCH_ONNX_CACHE/ort_ops/<hash>/``, default ``~/.cache/qtorch_onnx/ort_ops/<hash>/``; see
    :mod:`qtorch_onnx.export.ort_ops.build`).

    Register it with ``so = onnxruntime.SessionOptions(); so.register_custom_ops_library(get_library_path())``;
    the library itself needs neither torch nor Python.

    Args:
        device: ``"CPU"`` (case-insensitive), the only kernels this version builds.
    Returns:
        Absolute path of the shared library (``.so`` / ``.dylib`` / ``.dll``).
    Raises:
        UnsupportedFeatureError: ``device`` is not ``"CPU"``; or (as its subclass
            ``qtorch_onnx.export.ort_ops.build.LibraryBuildError``) the library cannot be built here: CMake or
            a C++17 compiler is missing, the ONNX Runtime headers cannot be downloaded or fail their checksum,
            or compilation fails. The message names the step and what to install.
    """
    if not isinstance(device, str) or device.upper() != "CPU":
        raise UnsupportedFeatureError(
            f"get_library_path({device!r}): this version builds CPU kernels only; valid: device='CPU'")
    return _build_module().library_path()


_BUILD = "qtorch_onnx.export.ort_ops.build"


def _build_module():
    """The module :mod:`qtorch_onnx.export.ort_ops.build` (standard library only).

    Importing it by name would first run ``qtorch_onnx.export``'s ``__init__``, which imports torch; while
    that package is not imported yet, the module is loaded from its file under its own dotted name instead
    (one module object either way: ``from qtorch_onnx.export.ort_ops.build import X`` later finds it in
    ``sys.modules``).
    """
    module = sys.modules.get(_BUILD)
    if module is not None:
        return module
    package = "qtorch_onnx.export"
    if package in sys.modules:
        return importlib.import_module(_BUILD)
    spec = importlib.util.find_spec(package)  # locates the package without executing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((os.path.join(d, "ort_ops", "build.py") for d in locations
                 if os.path.isfile(os.path.join(d, "ort_ops", "build.py"))), None)
    if path is None:  # an unusual installation (zip, frozen): the ordinary import
        return importlib.import_module(_BUILD)
    build_spec = importlib.util.spec_from_file_location(_BUILD, path)
    module = importlib.util.module_from_spec(build_spec)
    sys.modules[_BUILD] = module
    try:
        build_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_BUILD, None)
        raise
    return module


#: custom domains served by the operator library (docs/operators.md)
CUSTOM_DOMAINS = ("com.amd.quark", "com.vai.quantize")


def uses_custom_ops(model: onnx.ModelProto) -> bool:
    """True when ``model``'s main graph has a node of a domain the operator library serves."""
    return any(n.domain in CUSTOM_DOMAINS for n in model.graph.node)


def check_providers(providers: Sequence[str]) -> None:
    """Raise ConfigError naming the execution providers this ONNX Runtime build lacks (and those it has)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        from .errors import ConfigError

        raise ConfigError(f"execution_providers {missing} are not available in this ONNX Runtime build "
                          f"({ort.__version__}); available: {available}")


def session(model: onnx.ModelProto, *, opt_level: str = "ORT_DISABLE_ALL", threads: int = 0,
            providers: Sequence[str] = ("CPUExecutionProvider",)):
    """An ``onnxruntime.InferenceSession`` for ``model`` at the given graph optimization level.

    The project's operator library is registered when the model has ``com.amd.quark`` / ``com.vai.quantize``
    nodes (built on first use, see :func:`get_library_path`).

    Args:
        providers: ONNX Runtime execution providers in order of preference (Quark's ``execution_providers``).

    Raises:
        ConfigError: a provider this ONNX Runtime build does not have (the message lists the available ones).
    """
    import onnxruntime as ort

    check_providers(providers)

    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, opt_level)
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if uses_custom_ops(model):
        so.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so, providers=list(providers))


def run(model_or_session, inputs: Sequence[np.ndarray], **kw) -> List[np.ndarray]:
    """Run with positional inputs in ONNX order; returns outputs in ONNX order."""
    import numpy as np
    import onnx

    sess = model_or_session if not isinstance(model_or_session, onnx.ModelProto) else session(model_or_session, **kw)
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: np.asarray(a) for n, a in zip(names, inputs)})


def _bits(a: np.ndarray) -> np.ndarray:
    import numpy as np

    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@dataclass
class NodeParity:
    """Per-quantizer bit-exactness: elements compared and elements whose bits differ."""

    tensor: str
    fmt: str
    role: str
    elements: int
    mismatches: int

    @property
    def exact(self) -> bool:
        return self.mismatches == 0


@dataclass
class OutputAgreement:
    """Whole-model agreement of ONNX Runtime with the emulation for one output."""

    output: str
    opt_level: str
    elements: int
    identical: int
    max_abs_diff: float
    max_step_diff: Optional[float]  # in steps of the output's quantizer, None when it has none

    @property
    def identical_fraction(self) -> float:
        return self.identical / max(self.elements, 1)


@dataclass
class ParityReport:
    nodes: List[NodeParity] = field(default_factory=list)
    outputs: List[OutputAgreement] = field(default_factory=list)

    @property
    def nodes_exact(self) -> Tuple[int, int]:
        return sum(n.exact for n in self.nodes), len(self.nodes)


def _steps(diff: np.ndarray, ref: np.ndarray, fq: Optional[FakeQuantize]) -> Optional[float]:
    import numpy as np

    if fq is None or diff.size == 0:
        return None
    if fq.fmt.family.integer_grid:
        scale = fq.scale.detach().cpu().numpy().astype(np.float64)
        if scale.ndim:
            return None
        return float(diff.max() / scale)
    if fq.fmt.family.name == "float":
        mant = fq.fmt.mantissa_bits
        mag = np.maximum(np.abs(ref).astype(np.float64), np.finfo(np.float32).tiny)
        ulp = np.exp2(np.floor(np.log2(mag)) - mant)
        return float((diff / ulp).max())
    return None


def check_parity(qm, exported: onnx.ModelProto, qmap: Dict, samples: Sequence[Tuple[torch.Tensor, ...]],
                 opt_levels: Sequence[str] = ("ORT_DISABLE_ALL", "ORT_ENABLE_ALL")) -> ParityReport:
    """Compare ONNX Runtime with the torch emulation.

    Per quantizer: the emulation's input to every quantizer is captured and fed to a model holding only the
    exported quantizer nodes; the outputs must be bit-identical (docs/numerics.md, docs/operators.md). Weights and biases:
    the exported initializer -> DequantizeLinear output against the emulation's fake-quantized value.
    Per model output: the fraction of bit-identical elements and the largest difference in steps of the
    output's quantizer, at each optimization level in ``opt_levels``.

    Args:
        qm: the calibrated QuantizedModel (its quantizers must be in "quantize" mode).
        exported, qmap: ``export(qm, return_map=True)``.
        samples: inputs (tuples of tensors in ONNX input order).
    """
    import numpy as np
    import torch

    from .export import quantizer_submodel, safe_name as _safe

    fqs: Dict[str, FakeQuantize] = qm.quantizers()
    report = ParityReport()
    captured: Dict[str, List[Tuple[np.ndarray, np.ndarray]]] = {t: [] for t in fqs}
    hooks = []
    for t, fq in fqs.items():
        def hook(mod, args, out, t=t):
            captured[t].append((args[0].detach().cpu().float().numpy().copy(), out.detach().cpu().float().numpy().copy()))
        hooks.append(fq.register_forward_hook(hook))
    emu_outputs = []
    qm.eval()
    try:
        with torch.no_grad():
            for s in samples:
                y = qm(*(x.to(qm.device) for x in s))
                ys = y if isinstance(y, (tuple, list)) else (y,)
                emu_outputs.append([o.detach().cpu().numpy() for o in ys])
    finally:
        for h in hooks:
            h.remove()
    acts = [t for t, fq in fqs.items() if fq.role == "activation" and t in qmap]
    consts = [t for t, fq in fqs.items() if fq.role != "activation" and t in qmap]
    if acts:
        sess = session(quantizer_submodel(exported, qmap, acts))
        names = [i.name for i in sess.get_inputs()]
        mism = {t: 0 for t in acts}
        count = {t: 0 for t in acts}
        n_calls = min(len(captured[t]) for t in acts) if acts else 0
        for k in range(n_calls):
            feeds = {}
            for t in acts:
                feeds[f"{_safe(t)}__in"] = captured[t][k][0]
            outs = sess.run(None, {n: feeds[n] for n in names})
            for t, o in zip(acts, outs):
                emu = captured[t][k][1]
                mism[t] += int((_bits(o) != _bits(emu)).sum())
                count[t] += emu.size
        for t in acts:
            report.nodes.append(NodeParity(t, fqs[t].fmt.name, "activation", count[t], mism[t]))
    if consts:
        outs = session(quantizer_submodel(exported, qmap, consts)).run(None, {})
        for t, o in zip(consts, outs):
            fq = fqs[t]
            emu = captured[t][0][1] if captured[t] else None
            if emu is None:
                continue
            perm = _perm_of(qm, t)
            if perm:
                emu = np.transpose(emu, np.argsort(perm))
            report.nodes.append(NodeParity(t, fq.fmt.name, fq.role, emu.size, int((_bits(o) != _bits(emu)).sum())))
    out_names = [o.name for o in exported.graph.output]
    for level in opt_levels:
        sess = session(exported, opt_level=level)
        per_out = {n: [0, 0, 0.0, None] for n in out_names}
        for s, emu in zip(samples, emu_outputs):
            ort_out = sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), s)})
            for n, a, b in zip(out_names, ort_out, emu):
                a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
                d = np.abs(a32.astype(np.float64) - b32.astype(np.float64))
                acc = per_out[n]
                acc[0] += a32.size
                acc[1] += int((_bits(a32) == _bits(b32)).sum())
                acc[2] = max(acc[2], float(d.max()) if d.size else 0.0)
                st = _steps(d, b32, fqs.get(n))
                if st is not None:
                    acc[3] = st if acc[3] is None else max(acc[3], st)
        for n in out_names:
            e, i, m, st = per_out[n]
            report.outputs.append(OutputAgreement(n, level, e, i, m, st))
    return report


def _perm_of(qm, tensor: str):
    for r in qm.tensor_map.refs(tensor):
        if r.kind == "param":
            return getattr(r, "perm", None)
    return None
