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
import ctypes
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from .cache import cache_root, file_lock

__all__ = ["compiler", "cpu_id", "cpu_model", "build", "load", "thread_pool", "split", "FLAGS", "NATIVE"]

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


def _cpuinfo(*keys: str) -> Optional[List[str]]:
    """The distinct ``/proc/cpuinfo`` lines starting with one of ``keys``, sorted; None where there is no such file
    (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return sorted({ln for ln in f.read().splitlines() if ln.startswith(keys)})
    except OSError:
        return None


def cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU model and feature flags (Linux), else the platform."""
    lines = _cpuinfo("model name", "flags")
    return "\n".join(lines) if lines is not None else (platform.processor() or platform.machine())


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; the alphabetically first where the cores differ),
    else the platform's processor or machine."""
    lines = _cpuinfo("model name")
    return lines[0].split(":", 1)[1].strip() if lines else (platform.processor() or platform.machine())


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


def thread_pool(state: dict, prefix: str):
    """``(executor, workers)`` with torch's intra-op thread count of workers, kept in ``state["pool"]`` (replaced
    when the count changes), or None at one thread: for C calls split between threads (ctypes releases the GIL)."""
    threads = torch.get_num_threads()
    if threads <= 1:
        return None
    pool = state.get("pool")
    if pool is None or pool[1] != threads:
        if pool is not None:
            pool[0].shutdown(wait=False)
        pool = state["pool"] = (ThreadPoolExecutor(threads, thread_name_prefix=prefix), threads)
    return pool


def split(fn: Callable, count: int, pool, args_of: Callable) -> None:
    """``fn(*args_of(i, a, b))`` over ``count`` items cut into ``[a, b)`` ranges (``i``: the range's index): one call
    without ``pool`` (:func:`thread_pool`'s result), else one range per worker, waited for."""
    if pool is None:  # one range: no cut lists (this runs on every C call of the finetune loops)
        if count > 0:
            fn(*args_of(0, 0, count))
        return
    parts = min(pool[1], count)
    cuts = [count * i // parts for i in range(parts + 1)]
    ranges = [(i, a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if b > a]
    for f in [pool[0].submit(fn, *args_of(i, a, b)) for i, a, b in ranges]:
        f.result()


_load_lock = threading.Lock()
# the environment's bytes on POSIX (os.environ's own store, which os.environ / putenv keep current): a switch read
# there costs a dictionary lookup instead of os.environ.get's encoding and decoding (load runs on every C call of the
# finetune loops, ten-odd a step)
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEYS: dict = {}


def _switch(name: str) -> str:
    """The environment variable ``name``'s value, ``"1"`` when unset."""
    if _ENV_DATA is not None:
        key = _ENV_KEYS.get(name)
        if key is None:
            key = _ENV_KEYS[name] = os.fsencode(name)
        v = _ENV_DATA.get(key)
        return "1" if v is None else os.fsdecode(v)
    return os.environ.get(name, "1")


def load(state: dict, env_switch: str, source: Path, name: str, version: int, declare: Callable[[ctypes.CDLL], None],
         what: str, fallback: str, flags: Sequence[str] = FLAGS, native: Sequence[str] = NATIVE
         ) -> Optional[ctypes.CDLL]:
    """The library built from ``source`` (:func:`build`), loaded once per process and kept in ``state["lib"]``:
    its ``qt_<source stem>_version()`` must return ``version``, then ``declare(lib)`` sets its functions' argument
    types. None when ``$<env_switch>`` is ``0`` (not kept: the switch is read on every call), there is no C
    compiler, or the build, load or version check fails: then a RuntimeWarning ``"<what> are unavailable (<why>);
    <fallback>"`` is issued once. Thread-safe; without a lock once loaded."""
    if _switch(env_switch).strip() == "0":
        return None
    if "lib" in state:  # loaded (or failed) once: no lock on the hot path
        return state["lib"]
    with _load_lock:
        if "lib" in state:
            return state["lib"]
        lib, why = None, None
        cc = compiler()
        if cc is None:
            why = "no C compiler found ($CC, cc, gcc, clang)"
        else:
            try:
                lib = ctypes.CDLL(str(build(cc, source, name, flags, native)))
                got = getattr(lib, f"qt_{source.stem}_version")()
                if got != version:
                    why, lib = f"library version {got} != {version}", None
            except (OSError, RuntimeError, AttributeError) as exc:
                why = str(exc)
        if lib is not None:
            declare(lib)
        else:
            warnings.warn(f"{what} are unavailable ({why}); {fallback} ({env_switch}=0 chooses that without this "
                          "warning)", RuntimeWarning, stacklevel=4)
        state["lib"] = lib
        return lib
