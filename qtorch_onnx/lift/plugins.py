"""Operator domains beyond ONNX's own, plugged into the lifter from outside lift/.

A plugin is a module that, when imported, adds onnx2torch converters for its domain's operators
(:func:`~qtorch_onnx.lift.register_converter`) and their ONNX schemas (``onnx.defs.register_schema``, so that
shape inference types the tensors behind them). lift/ knows plugins by module name only and imports them
before its first shape inference or conversion, so every way into the lifter (``lift``, ``normalize``,
``qtorch_onnx.lift.converters``) sees the same operators; what a plugin converts is its own business.
"""
from __future__ import annotations

import importlib

#: module names of the plugins, imported by :func:`load_plugins` in this order
PLUGINS: list[str] = [
    "qtorch_onnx.interop.ops_quark",  # com.amd.quark / com.vai.quantize (AMD Quark's custom operators)
]

_loaded: set[str] = set()


def load_plugins() -> None:
    """Import every module of :data:`PLUGINS` not imported yet (their import registers them); cheap once done."""
    for name in PLUGINS:
        if name not in _loaded:
            importlib.import_module(name)
            _loaded.add(name)
