"""Interoperation with other quantization tools: models they quantized, read into this library.

* :mod:`.ops_quark`: AMD Quark's custom operators (``com.amd.quark``, legacy ``com.vai.quantize``) as torch
  modules and ONNX schemas, plugged into the lifter (:mod:`qtorch_onnx.lift.plugins`), so a Quark model lifts
  and runs;
* :mod:`.importer`: :func:`qtorch_onnx.load_quantized`, a quantized model (Quark, ONNX Runtime's
  quantization tool, this project) whose quantizer nodes become FakeQuantize modules.

Nothing is imported with this package: its modules import torch and onnx2torch.
"""
