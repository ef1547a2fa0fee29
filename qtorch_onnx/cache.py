"""The project's cache root and the checksum its cached downloads are verified with.

One rule for every cache user (model zoo, operator library build, conformance node tests, the Quark interop
benchmark): ``$QTORCH_ONNX_CACHE`` when set to a non-blank value, else ``~/.cache/qtorch_onnx``. Imports
nothing of torch.
"""
from __future__ import annotations

import hashlib
import os
import pathlib

__all__ = ["cache_root", "sha256_file"]

_CHUNK = 1 << 20


def cache_root() -> pathlib.Path:
    """``$QTORCH_ONNX_CACHE`` if set to a non-blank value (``~`` expanded), else ``~/.cache/qtorch_onnx``.

    The folder is not created here.
    """
    env = os.environ.get("QTORCH_ONNX_CACHE", "").strip()
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "qtorch_onnx"


def sha256_file(path: os.PathLike | str) -> str:
    """Lowercase hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()
