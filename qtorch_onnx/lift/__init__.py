"""ONNX -> torch.fx lifting: normalization passes, onnx2torch converters, and the TensorMap.

Public API:
    normalize(model, *, fold_batchnorm=False) -> onnx.ModelProto
    normalize_with_aliases(model, *, fold_batchnorm=False) -> (onnx.ModelProto, {removed name: survivor})
    lift(model_or_path, *, fold_batchnorm=False, optimize=False) -> torch.fx.GraphModule
        (gm.onnx_model, gm.tensor_map, gm.input_names, gm.output_names, gm.fusion_report)
    fuse_for_quantization(model) -> (fused model, FusionReport): graph optimization before quantization
    normalize_and_fuse(model, *, fold_batchnorm=False, optimize=False) -> (model, aliases, FusionReport | None)
    check_supported(model) -> None (raises UnsupportedOpsError), load_model(model_or_path)
    register_converter(op_type, versions, domain="") -> decorator adding/overriding an onnx2torch converter
    optimize_for_inference(gm, example_inputs, *, compile="none"|"jit"|"inductor") -> a faster copy (inference)
    TensorMap, TensorRef, ModelInfo, NodeInfo, TensorInfo

Recurrent ops (LSTM, GRU, RNN, com.microsoft::DynamicQuantizeLSTM: :mod:`.recurrent`) and control flow
(If with a runtime condition, Loop, Scan: :mod:`.control_flow`, subgraphs lifted recursively, their
tensors in ``tensor_map.subgraphs``) and the operator domains plugged in from outside this package
(:mod:`.plugins`) register their converters when the converters are first needed (see below).

This package knows ONNX and torch, nothing about quantization.

onnx2torch (which imports torchvision and torch._dynamo, about two seconds) is imported only when a name
that needs it is first used: ``lift``, ``check_supported``, ``load_model``, ``register_converter`` and
``optimize_for_inference`` are looked up in :data:`_LAZY` (PEP 562) and their module (which registers the
converters) is imported then; ``normalize`` and the TensorMap types are imported with the package.
"""
from __future__ import annotations

import importlib

from .fusion import FusionReport, fuse_for_quantization, normalize_and_fuse
from .normalize import normalize, normalize_with_aliases, same_pads
from .tensor_map import ModelInfo, NodeInfo, TensorInfo, TensorMap, TensorRef

#: public name -> the submodule defining it, imported on first access (these import onnx2torch)
_LAZY = {"lift": "lifter", "check_supported": "lifter", "load_model": "lifter",
         "register_converter": "converters", "optimize_for_inference": "optimize"}

__all__ = [
    "normalize", "normalize_with_aliases", "same_pads", "fuse_for_quantization", "normalize_and_fuse", "FusionReport", "lift", "check_supported", "load_model",
    "TensorMap", "TensorRef", "ModelInfo", "NodeInfo", "TensorInfo", "register_converter", "optimize_for_inference",
]


def __getattr__(name: str):
    """PEP 562 hook: import the submodule defining ``name`` (see :data:`_LAZY`) and cache the value.

    Raises:
        AttributeError: ``name`` is neither public API of this package nor one of its submodules.
    """
    short = _LAZY.get(name)
    if short is None:
        try:  # a submodule by attribute (``qtorch_onnx.lift.lifter`` before anything imported it)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{short}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
