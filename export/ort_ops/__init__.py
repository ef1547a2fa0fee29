"""The project's C++ ONNX Runtime operator library (installed as ``qtorch_onnx.export.ort_ops``).

Sources: ``CMakeLists.txt``, ``*.h``, ``*.cc`` (C++17 against ONNX Runtime's C/C++ API, docs/operators.md):
``numerics.h`` (the bit-level numerics), ``block_kernels.*`` (runs of blocks, per-ISA clones), ``kernels.h``
(layout and threading), ``ort_ops.cc`` (the operators, attribute checks, registration). The library is
built on first use into a cache folder by :mod:`qtorch_onnx.export.ort_ops.build`; register it with::

    so = onnxruntime.SessionOptions()
    so.register_custom_ops_library(qtorch_onnx.get_library_path())

This package imports nothing at import time (no torch): use ``qtorch_onnx.export.ort_ops.build``.
"""
