"""Build and locate the project's ONNX Runtime operator library (``com.amd.quark`` / ``com.vai.quantize``).

The library (C++17, CMake; ``CMakeLists.txt``, ``*.h`` and ``*.cc`` next to this file) is built on first use and cached in
``$QTORCH_ONNX_CACHE/ort_ops/<hash>/`` (default ``~/.cache/qtorch_onnx/ort_ops/<hash>/``), where ``<hash>``
covers the sources, the ONNX Runtime headers, the platform and the compiler. Two processes (pytest-xdist
workers) may ask at the same time: a file lock serializes the build and the result appears with one atomic
rename, so nobody ever loads a half-written library.

ONNX Runtime's Python wheel ships no C/C++ headers (docs/operators.md "The library"). They are taken from the pinned
``amd-quark==0.13`` wheel (``pip download --no-deps``), whose SHA-256 is verified, and only
``quark/onnx/operators/custom_ops/include/onnxruntime-1.17.0/`` is extracted (Microsoft's MIT-licensed
ONNX Runtime 1.17 headers; every file keeps its license notice). ``$QTORCH_ONNX_ORT_INCLUDE`` may point at
an existing header folder instead (either layout: ``onnxruntime/core/session/onnxruntime_cxx_api.h`` or a
release archive's flat ``include/``). Headers are cached, never committed.

This module does not use torch. Command line::

    python -m qtorch_onnx.export.ort_ops.build [--force] [--verbose]

prints the library path and the build time.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from qtorch_onnx.cache import cache_root, file_lock, sha256_file
from qtorch_onnx.errors import UnsupportedFeatureError

__all__ = [
    "LibraryBuildError", "BuildResult", "build", "library_path", "cache_dir", "ort_include_dir",
    "QUARK_REQUIREMENT", "QUARK_WHEEL_SHA256", "HEADER_PREFIX",
]

#: The pinned wheel that carries ONNX Runtime 1.17's C/C++ API headers.
QUARK_REQUIREMENT = "amd-quark==0.13"
QUARK_WHEEL_NAME = "amd_quark-0.13-py3-none-any.whl"
QUARK_WHEEL_SHA256 = "3b3e58a4cbbcff20d27815b641aa4de4d698efde3c782306cb4a6a05bcf55c8c"
#: The only folder extracted from it.
HEADER_PREFIX = "quark/onnx/operators/custom_ops/include/onnxruntime-1.17.0/"
HEADER_DIRNAME = "onnxruntime-1.17.0"
_CXX_API = ("onnxruntime", "core", "session", "onnxruntime_cxx_api.h")

SOURCE_DIR = Path(__file__).resolve().parent
LOCK_TIMEOUT_S = 1800.0

if sys.platform == "win32":
    LIBRARY_NAME = "qtorch_onnx_ort_ops.dll"
elif sys.platform == "darwin":
    LIBRARY_NAME = "libqtorch_onnx_ort_ops.dylib"
else:
    LIBRARY_NAME = "libqtorch_onnx_ort_ops.so"


class LibraryBuildError(UnsupportedFeatureError):
    """The operator library cannot be built here (missing tool, failed download or checksum, compile error).

    The message says which step failed, the command and its last output lines, and what to install or set.
    """


@dataclass(frozen=True)
class BuildResult:
    """Where the library is and how it got there.

    Attributes:
        path: absolute path of the shared library.
        built: True when this call compiled it, False when it came from the cache.
        seconds: wall time of the build in seconds (of this call, or as recorded when it was built).
        source_hash: the cache key (sources + headers + platform + compiler), 16 hex digits.
        include_dir: the ONNX Runtime header folder used.
    """

    path: str
    built: bool
    seconds: float
    source_hash: str
    include_dir: str


# ----------------------------------------------------------------------------------------------------------
# locations
# ----------------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """The library cache: ``$QTORCH_ONNX_CACHE/ort_ops`` if that variable is set and non-empty, else
    ``~/.cache/qtorch_onnx/ort_ops`` (the same root as the model zoo's cache)."""
    return cache_root() / "ort_ops"


def _source_files() -> List[Path]:
    files = [SOURCE_DIR / "CMakeLists.txt"]
    files += sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".h", ".cc"))
    missing = [str(p) for p in files if not p.is_file()]
    if missing or len(files) < 2:
        raise LibraryBuildError(f"the operator library sources are incomplete (missing {missing or '*.cc'}); "
                                "reinstall qtorch-onnx so that qtorch_onnx/export/ort_ops ships its C++ sources")
    return files


def _file_lock(path: Path, timeout: float = LOCK_TIMEOUT_S):
    """:func:`qtorch_onnx.cache.file_lock` raising :class:`LibraryBuildError` on a timeout."""
    return file_lock(path, timeout, LibraryBuildError)


def _run(cmd: Sequence[str], step: str, hint: str, cwd: Optional[Path] = None, verbose: bool = False) -> str:
    """Run ``cmd``; raise LibraryBuildError naming ``step`` with the output's tail when it fails."""
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=None if cwd is None else str(cwd), capture_output=True,
                              text=True, errors="replace")
    except OSError as exc:
        raise LibraryBuildError(f"{step}: cannot run {cmd[0]!r} ({exc}); {hint}") from exc
    out = (proc.stdout or "") + (proc.stderr or "")
    if verbose:
        print(out, file=sys.stderr)
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-40:])
        raise LibraryBuildError(f"{step} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{tail}\n{hint}")
    return out


# ----------------------------------------------------------------------------------------------------------
# headers
# ----------------------------------------------------------------------------------------------------------
def _valid_include(d: Path) -> bool:
    return d.joinpath(*_CXX_API).is_file() or (d / "onnxruntime_cxx_api.h").is_file()


def _download_wheel(downloads: Path, verbose: bool) -> Path:
    wheel = downloads / QUARK_WHEEL_NAME
    if wheel.is_file() and sha256_file(wheel) == QUARK_WHEEL_SHA256:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=downloads))
    try:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
              "--disable-pip-version-check", "-d", str(tmp), QUARK_REQUIREMENT],
             f"downloading the ONNX Runtime headers ({QUARK_REQUIREMENT}, pip download --no-deps)",
             "needs pip and access to a package index; or set QTORCH_ONNX_ORT_INCLUDE to a folder holding ONNX "
             "Runtime's C/C++ API headers (onnxruntime_cxx_api.h)", verbose=verbose)
        got = sorted(tmp.glob("*.whl"))
        if len(got) != 1:
            raise LibraryBuildError(f"pip download {QUARK_REQUIREMENT} produced {[p.name for p in got]}, expected "
                                    f"{QUARK_WHEEL_NAME}")
        digest = sha256_file(got[0])
        if digest != QUARK_WHEEL_SHA256:
            raise LibraryBuildError(f"checksum mismatch for {got[0].name}: SHA-256 {digest}, expected "
                                    f"{QUARK_WHEEL_SHA256}; the file was not used. Check the package index "
                                    "(or set QTORCH_ONNX_ORT_INCLUDE to trusted headers)")
        os.replace(got[0], wheel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return wheel


def _extract_headers(wheel: Path, dest: Path) -> None:
    """Extract HEADER_PREFIX of ``wheel`` into ``dest`` (a fresh folder), refusing unsafe member names."""
    n = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not info.filename.startswith(HEADER_PREFIX) or info.is_dir():
                continue
            rel = Path(info.filename[len(HEADER_PREFIX):])
            if rel.is_absolute() or ".." in rel.parts:
                raise LibraryBuildError(f"unsafe member {info.filename!r} in {wheel.name}; not extracted")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    if n == 0 or not dest.joinpath(*_CXX_API).is_file():
        raise LibraryBuildError(f"{wheel.name} has no {HEADER_PREFIX}onnxruntime/core/session/onnxruntime_cxx_api.h")
    (dest / "PROVENANCE.txt").write_text(
        f"ONNX Runtime 1.17 C/C++ API headers (Copyright (c) Microsoft Corporation, MIT License; see the notice at\n"
        f"the top of each file), extracted from {QUARK_WHEEL_NAME} (SHA-256 {QUARK_WHEEL_SHA256}),\n"
        f"folder {HEADER_PREFIX}, by qtorch_onnx.export.ort_ops.build. Not part of qtorch-onnx's sources.\n")


def ort_include_dir(verbose: bool = False) -> Path:
    """The ONNX Runtime C/C++ API header folder to compile against.

    ``$QTORCH_ONNX_ORT_INCLUDE`` when set; otherwise the 1.17 headers extracted from the verified
    ``amd-quark==0.13`` wheel into ``cache_dir()/include/onnxruntime-1.17.0`` (downloaded on first use).

    Raises:
        LibraryBuildError: ``$QTORCH_ONNX_ORT_INCLUDE`` holds no ``onnxruntime_cxx_api.h``; pip is missing or
            the download fails; the wheel's SHA-256 differs from :data:`QUARK_WHEEL_SHA256`.
    """
    env = os.environ.get("QTORCH_ONNX_ORT_INCLUDE")
    if env:
        d = Path(env).expanduser().resolve()
        if not _valid_include(d):
            raise LibraryBuildError(f"QTORCH_ONNX_ORT_INCLUDE={env!r} holds neither "
                                    f"{'/'.join(_CXX_API)} nor onnxruntime_cxx_api.h; valid: a folder of ONNX "
                                    "Runtime (>= 1.17) C/C++ API headers, or unset it to fetch them automatically")
        return d
    root = cache_dir()
    final = root / "include" / HEADER_DIRNAME
    if final.joinpath(*_CXX_API).is_file():
        return final
    with _file_lock(root / "include.lock"):
        if final.joinpath(*_CXX_API).is_file():
            return final
        wheel = _download_wheel(root / "downloads", verbose)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".headers-", dir=final.parent))
        try:
            _extract_headers(wheel, tmp / HEADER_DIRNAME)
            if final.exists():  # an incomplete earlier extraction
                shutil.rmtree(final)
            os.replace(tmp / HEADER_DIRNAME, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------------------
def _find_cmake() -> str:
    exe = shutil.which("cmake")
    if exe:
        return exe
    try:  # the `cmake` PyPI package ships a binary
        import cmake  # type: ignore

        cand = Path(cmake.CMAKE_BIN_DIR) / ("cmake.exe" if os.name == "nt" else "cmake")
        if cand.is_file():
            return str(cand)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        pass
    raise LibraryBuildError("building the ONNX Runtime operator library needs CMake >= 3.16 and a C++17 compiler: "
                            "install them (apt-get install cmake g++, or pip install cmake)")


def _compiler_id() -> str:
    for cxx in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if not cxx:
            continue
        exe = shutil.which(cxx)
        if exe:
            try:
                out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
                return f"{exe}: {out.splitlines()[0] if out else ''}"
            except (OSError, subprocess.SubprocessError):
                continue
    return "unknown"


def _source_hash(include_dir: Path) -> str:
    h = hashlib.sha256()
    for p in _source_files():
        h.update(p.relative_to(SOURCE_DIR).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    for p in sorted(q for q in include_dir.rglob("*.h") if q.is_file()):
        h.update(p.relative_to(include_dir).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(f"{sys.platform}|{platform.machine()}|{_compiler_id()}".encode())
    return h.hexdigest()[:16]


_MEMO: dict = {}


def build(force: bool = False, verbose: bool = False) -> BuildResult:
    """Return the operator library, building it first when the cache has no copy for these sources.

    Args:
        force: rebuild even when a cached library exists (the new one replaces it atomically).
        verbose: print the CMake / compiler output to stderr.
    Returns:
        :class:`BuildResult` (path, whether this call built it, build seconds, cache key, header folder).
    Raises:
        LibraryBuildError: CMake or the compiler is missing or fails, or the headers cannot be obtained
            (see :func:`ort_include_dir`); the message names the step, the command and what to install.
    """
    include = ort_include_dir(verbose=verbose)
    key = _source_hash(include)
    root = cache_dir()
    target = root / key
    lib = target / LIBRARY_NAME
    info_file = target / "build.json"

    def cached() -> Optional[BuildResult]:
        if lib.is_file():
            try:
                seconds = float(json.loads(info_file.read_text()).get("seconds", 0.0))
            except (OSError, ValueError):
                seconds = 0.0
            return BuildResult(str(lib), False, seconds, key, str(include))
        return None

    if not force and (res := cached()) is not None:
        return res
    cmake = _find_cmake()
    with _file_lock(root / f"{key}.lock"):
        if not force and (res := cached()) is not None:  # built by another process meanwhile
            return res
        for stale in root.glob(f".build-{key}-*"):  # left by a build that was killed (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=root))
        try:
            bdir = tmp / "build"
            hint = "install CMake >= 3.16 and a C++17 compiler (g++ >= 8 or clang++ >= 7), or run with --verbose"
            _run([cmake, "-S", str(SOURCE_DIR), "-B", str(bdir), f"-DORT_INCLUDE_DIR={include}",
                  "-DCMAKE_BUILD_TYPE=Release"], "configuring the operator library (cmake)", hint, verbose=verbose)
            _run([cmake, "--build", str(bdir), "--config", "Release", "--parallel", str(os.cpu_count() or 1)],
                 "compiling the operator library", hint, verbose=verbose)
            found = [p for p in bdir.rglob(LIBRARY_NAME) if p.is_file()]
            if not found:
                raise LibraryBuildError(f"the build finished but produced no {LIBRARY_NAME} under {bdir}")
            seconds = time.perf_counter() - t0
            stage = tmp / "out"
            stage.mkdir()
            shutil.copy2(found[0], stage / LIBRARY_NAME)
            (stage / "build.json").write_text(json.dumps({
                "seconds": round(seconds, 3), "source_hash": key, "include_dir": str(include),
                "compiler": _compiler_id(), "platform": f"{sys.platform} {platform.machine()}",
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }, indent=1))
            if target.exists():  # --force, or a broken earlier entry: replace it
                old = tmp / "old"
                os.replace(target, old)
            os.replace(stage, target)  # atomic: other processes see either nothing or the whole folder
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return BuildResult(str(lib), True, seconds, key, str(include))


def library_path() -> str:
    """Absolute path of the operator library for this machine, built on first use (see :func:`build`).

    Raises:
        LibraryBuildError: as :func:`build`.
    """
    memo_key = (str(cache_dir()), os.environ.get("QTORCH_ONNX_ORT_INCLUDE", ""))
    path = _MEMO.get(memo_key)
    if path and os.path.isfile(path):
        return path
    path = build().path
    _MEMO[memo_key] = path
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m qtorch_onnx.export.ort_ops.build``: build (or find) the library, print path and build time."""
    ap = argparse.ArgumentParser(prog="python -m qtorch_onnx.export.ort_ops.build",
                                 description="Build the qtorch-onnx ONNX Runtime operator library and print its path.")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached library exists")
    ap.add_argument("--verbose", action="store_true", help="show the CMake and compiler output")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        res = build(force=args.force, verbose=args.verbose)
    except LibraryBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = time.perf_counter() - t0
    print(res.path)
    if res.built:
        print(f"built in {res.seconds:.1f} s (cache key {res.source_hash}, headers {res.include_dir})")
    else:
        print(f"cached (built earlier in {res.seconds:.1f} s; lookup {total:.2f} s; cache key {res.source_hash}, "
              f"headers {res.include_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
