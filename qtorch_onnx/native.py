"""Build and cache the project's small C libraries (``algorithms/cpu_steps.c``, ``cpu_kernels.c``) with the system C
compiler, loaded with ctypes by their modules.

A library is compiled on first use with ``$CC`` (else ``cc`` / ``gcc`` / ``clang``) into
``$QTORCH_ONNX_CACHE/<name>/<hash>/`` (default ``~/.cache/qtorch_onnx/<name>/<hash>/``), the hash covering the
source, the compiler's version, the flags, the platform and the CPU (``-march=native``; a compiler that refuses it
builds without). A file lock serializes concurrent builds and the result appears by one atomic rename, so other
processes see nothing or the whole folder.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from .cache import cache_root, file_lock

__all__ = ["compiler", "cpu_id", "build", "FLAGS", "NATIVE"]

#: flags of every build: IEEE arithmetic kept (no -ffast-math), errno and traps off so loops vectorize
FLAGS: List[str] = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-std=gnu99", "-shared", "-fPIC"]
#: tried first; a compiler or CPU that refuses it builds with FLAGS alone
NATIVE: List[str] = ["-march=native"]


def compiler() -> Optional[str]:
    """The C compiler's path: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH; None when there is none."""
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build(cc: str, source: Path, name: str, flags: Sequence[str] = FLAGS, native: Sequence[str] = NATIVE) -> Path:
    """Compile ``source`` into the cache as the shared library ``lib<name>.so`` (``<name>.dll`` on Windows), or
    find it there, and return its path; the cache folder is ``cache_root() / <source's stem>``.

    Raises:
        RuntimeError: the compiler cannot run, or fails with and without ``native`` (the message has its output),
            or the cache's lock cannot be taken.
    """
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run the C compiler {cc!r}: {exc}") from exc
    src = source.read_bytes()
    key = hashlib.sha256(b"\0".join([src, version.encode(), " ".join(list(flags) + list(native)).encode(),
                                     f"{sys.platform} {platform.machine()}".encode(), cpu_id().encode()])
                         ).hexdigest()[:20]
    root = cache_root() / source.stem
    filename = f"{name}.dll" if sys.platform == "win32" else f"lib{name}.so"
    lib = root / key / filename
    if lib.is_file():
        return lib
    with file_lock(root / f"{key}.lock", error=RuntimeError):
        if lib.is_file():  # built by another process meanwhile
            return lib
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=root))
        try:
            errors = []
            for fl in (list(flags) + list(native), list(flags)):
                proc = subprocess.run([cc, *fl, str(source), "-o", str(tmp / filename), "-lm"],
                                      capture_output=True, text=True, errors="replace")
                if proc.returncode == 0:
                    break
                errors.append(f"{cc} {' '.join(fl)}: exit {proc.returncode}: "
                              + " ".join((proc.stdout + proc.stderr).split())[-400:])
            else:
                raise RuntimeError(f"compiling {source.name} failed: " + " | ".join(errors))
            stage = tmp / "out"
            stage.mkdir()
            os.replace(tmp / filename, stage / filename)
            if (root / key).exists():  # a broken earlier entry
                shutil.rmtree(root / key, ignore_errors=True)
            os.replace(stage, root / key)  # atomic: others see nothing or the whole folder
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return lib
