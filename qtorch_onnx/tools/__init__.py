"""Developer tooling run from the command line, not imported by the library: measurements and reports about it.

* :mod:`.conformance`: the lifter on ONNX's backend node tests and the zoo models against ONNX Runtime
  (``python -m qtorch_onnx.tools.conformance``), which writes ``docs/conformance.md``.
"""
