"""ONNX -> torch.fx lifting: normalization passes, onnx2torch converters, and the TensorMap.

Public API:
    normalize(model, *, fold_batchnorm=False) -> onnx.ModelProto
    normalize_with_aliases(model, *, fold_batchnorm=False) -> (onnx.ModelProto, {removed name: survivor})
    lift(model_or_path, *, fold_batchnorm=False) -> torch.fx.GraphModule
        (gm.onnx_model, gm.tensor_map, gm.input_names, gm.output_names)
    check_supported(model) -> None (raises UnsupportedOpsError), load_model(model_or_path)
    register_converter(op_type, versions, domain="") -> decorator adding/overriding an onnx2torch converter
    optimize_for_inference(gm, example_inputs, *, compile="none"|"jit"|"inductor") -> a faster copy (inference)
    TensorMap, TensorRef, ModelInfo, NodeInfo, TensorInfo

Recurrent ops (LSTM, GRU, RNN, com.microsoft::DynamicQuantizeLSTM: :mod:`.recurrent`) and control flow
(If with a runtime condition, Loop, Scan: :mod:`.control_flow`, subgraphs lifted recursively, their
tensors in ``tensor_map.subgraphs``) and AMD Quark's custom quantization operators (:mod:`.ops_quark`)
register their converters when this package is imported.

This package knows ONNX and torch, nothing about quantization.
"""
from .normalize import normalize, normalize_with_aliases, same_pads
from .tensor_map import ModelInfo, NodeInfo, TensorInfo, TensorMap, TensorRef
from .lifter import check_supported, lift, load_model
from .converters import register_converter
from . import ops_quark  # noqa: F401,E402  (registers com.amd.quark / com.vai.quantize converters)
from .optimize import optimize_for_inference

__all__ = [
    "normalize", "normalize_with_aliases", "same_pads", "lift", "check_supported", "load_model",
    "TensorMap", "TensorRef", "ModelInfo", "NodeInfo", "TensorInfo", "register_converter", "optimize_for_inference",
]
