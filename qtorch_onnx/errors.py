"""The project's exception hierarchy.

Every error names the thing at fault (config key, ONNX node, tensor, op type, opset, attribute) and
what would be valid. Catch :class:`QTorchOnnxError` to catch everything this library raises on purpose.
"""
from __future__ import annotations

import difflib
from typing import Iterable


class QTorchOnnxError(Exception):
    """Base class of every error raised on purpose by qtorch_onnx."""


class ConfigError(QTorchOnnxError, ValueError):
    """A configuration key, value or name is invalid (names the key and what would be valid)."""


class UnsupportedFeatureError(QTorchOnnxError, NotImplementedError):
    """A valid request for a feature this version does not implement yet (names the feature)."""


class ModelError(QTorchOnnxError, ValueError):
    """The ONNX model is unreadable, invalid, or uses something that cannot be lifted."""


class UnsupportedOpsError(ModelError):
    """The model uses ops neither normalization nor lifting supports.

    Attributes:
        ops: list of ``(domain, op_type, opset, [node names])`` tuples, one per unsupported op kind
            (``opset``: the model's opset for that domain; domain ``""`` is ai.onnx).
        reasons: ``{(domain, op_type, opset): reason}`` (the first node's), when known.
        hints: ``{(domain, op_type, opset): suggested workaround}``, when known.

    The message has one line per op kind: domain, op type, opset, every node name (the first 8 and a
    count beyond), the reason and the suggested workaround.
    """

    def __init__(self, ops: list[tuple[str, str, int, list[str]]], reasons: dict | None = None,
                 hints: dict | None = None):
        self.ops = ops
        self.reasons = dict(reasons or {})
        self.hints = dict(hints or {})
        lines = []
        for domain, op_type, opset, nodes in ops:
            shown = ", ".join(repr(n) for n in nodes[:8]) + (f", ... ({len(nodes)} nodes)" if len(nodes) > 8 else "")
            line = f"  {domain or 'ai.onnx'}::{op_type} (opset {opset}): {len(nodes)} node(s) {shown}"
            key = (domain, op_type, opset)
            if key in self.reasons:
                line += f"\n      reason: {self.reasons[key]}"
            if key in self.hints:
                line += f"\n      workaround: {self.hints[key]}"
            lines.append(line)
        super().__init__("the model uses ops that cannot be lifted to torch:\n" + "\n".join(lines))


class UnknownNameError(QTorchOnnxError, KeyError):
    """A name looked up that does not exist (an ONNX initializer without a trainable parameter, ...); the
    message names it and the closest valid one. Also a KeyError, as a failed lookup."""

    def __str__(self) -> str:  # the message as written (KeyError would quote it)
        return str(self.args[0]) if self.args else ""


class DataError(QTorchOnnxError, ValueError):
    """Calibration or evaluation data does not fit the model (names the input, shape or dtype)."""


class ExportError(QTorchOnnxError, RuntimeError):
    """The quantized model cannot be written back to ONNX (names the tensor or quantizer)."""


def closest(name: str, valid: Iterable[str]) -> str:
    """Return ``" (did you mean 'X'?)"`` for the closest valid name, or ``""`` when none is close."""
    valid = list(valid)
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    if not match:
        lowered = {v.lower(): v for v in valid}
        if name.lower() in lowered:
            match = [lowered[name.lower()]]
    return f" (did you mean {match[0]!r}?)" if match else ""
