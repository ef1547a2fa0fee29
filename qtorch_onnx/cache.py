"""The project's cache root, the checksum its cached downloads are verified with, and the file lock of its
on-first-use builds.

One rule for every cache user (model zoo, operator library build, conformance node tests, the Quark interop
benchmark): ``$QTORCH_ONNX_CACHE`` when set to a non-blank value, else ``~/.cache/qtorch_onnx``. Imports
nothing of torch.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import time
from typing import Iterator

__all__ = ["cache_root", "sha256_file", "file_lock"]

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


@contextlib.contextmanager
def file_lock(path: os.PathLike | str, timeout: float = 1800.0, error: type = TimeoutError) -> Iterator[None]:
    """Exclusive inter-process lock on the file ``path`` (created, with its folder, if needed), held for the
    ``with`` block: how the on-first-use builds (the operator library, fast finetune's CPU steps) keep two
    processes from building the same thing at once.

    Raises:
        error: (the exception class given, with a message naming the lock file) after waiting ``timeout``
            seconds."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o644)
    if os.name == "nt":  # pragma: no cover - Windows
        import msvcrt

        def try_lock() -> bool:
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                return True
            except OSError:
                return False

        def unlock() -> None:
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    else:
        import fcntl

        def try_lock() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

        def unlock() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
    try:
        deadline = time.monotonic() + timeout
        while not try_lock():
            if time.monotonic() > deadline:
                raise error(f"timed out after {timeout:.0f} s waiting for the lock {path}; another build may be "
                            "stuck: delete the file and retry")
            time.sleep(0.2)
        try:
            yield
        finally:
            unlock()
    finally:
        os.close(fd)
