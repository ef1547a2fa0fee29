"""Import time of qtorch_onnx in fresh interpreters, against ``import torch`` and AMD Quark's ``import quark.onnx``.

::

    python benchmarks/import_time.py                 # 15 runs per case; Quark when its venv exists or can be made
    python benchmarks/import_time.py --runs 30 --no-quark

Every case is a fresh ``python -c CODE`` subprocess (stdout and stderr discarded); the cases are run round-robin
(one warm-up round first, not counted) so that drifting machine load touches them alike. Reported: min and
median wall time per case, and each of our cases as a ratio to ``import torch`` measured in the same run (and
to ``import quark.onnx`` when measured).

Cases (this environment's Python):

* ``python -c pass``: interpreter start-up, the floor under every other figure;
* ``import torch``: the baseline;
* ``import qtorch_onnx``: imports neither torch nor onnx2torch (public names resolve lazily, PEP 562);
* ``import qtorch_onnx; qtorch_onnx.get_library_path()``: all a deployment needs (the operator library is
  built once beforehand, so this is the cached lookup);
* ``qtorch-onnx --help``: the console script's entry point (``qtorch_onnx.cli:main``) run with ``--help``;
* ``import qtorch_onnx.quantizer``: the quantization pipeline's module (torch, no onnx2torch);
* ``from qtorch_onnx import lift``: what lifting a model first costs (onnx2torch, torchvision, torch._dynamo);
* ``from qtorch_onnx import *``: every public name, i.e. what ``import qtorch_onnx`` cost before the imports
  became lazy.

Quark: ``import quark.onnx`` in Quark 0.13's own virtual environment, the one
``benchmarks/quark_interop.py`` uses (``$QTORCH_ONNX_CACHE/quark-venv`` or ``~/.cache/qtorch_onnx/quark-venv``;
``--quark-venv`` to choose). When it does not exist it is created the way quark_interop.py creates it
(``python -m venv``, torch CPU, the pinned ``amd-quark==0.13`` wheel, ONNX Runtime; Quark's operator library
is compiled then, since ``import quark.onnx`` would otherwise compile it inside the timed import); when that
fails, or with ``--no-quark``, the report says Quark was not measured. ``import torch`` in that venv is timed
too (its torch is not this environment's).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: (label, code) run by this environment's Python
OUR_CASES: List[Tuple[str, str]] = [
    ("python -c pass", "pass"),
    ("import torch", "import torch"),
    ("import qtorch_onnx", "import qtorch_onnx"),
    ("import qtorch_onnx; get_library_path()", "import qtorch_onnx; qtorch_onnx.get_library_path()"),
    ("qtorch-onnx --help", "import sys; sys.argv = ['qtorch-onnx', '--help']\n"
                           "from qtorch_onnx.cli import main\nsys.exit(main())"),
    ("import qtorch_onnx.quantizer", "import qtorch_onnx.quantizer"),
    ("from qtorch_onnx import lift", "from qtorch_onnx import lift"),
    ("from qtorch_onnx import *", "from qtorch_onnx import *"),
]
BASELINE = "import torch"
QUARK_CASES: List[Tuple[str, str]] = [("Quark venv: import torch", "import torch"),
                                      ("Quark venv: import quark.onnx", "import quark.onnx")]
QUARK = "Quark venv: import quark.onnx"


def device() -> str:
    """CPU model, logical cores, OS and machine (from /proc/cpuinfo where there is one)."""
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    return f"{model}, {os.cpu_count()} logical cores, {platform.system()} {platform.machine()}"


def _version(dist: str, python: str = sys.executable) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return r.stdout.strip() if r.returncode == 0 else "absent"


def _time_once(python: str, code: str, env: Optional[dict]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([python, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, env=env, cwd=str(REPO))
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{python} -c {code!r} failed ({r.returncode}): {r.stderr.decode(errors='replace')[-2000:]}")
    return dt


def measure(cases: Sequence[Tuple[str, str, str, Optional[dict]]], runs: int) -> Dict[str, List[float]]:
    """Time every ``(label, python, code, env)`` ``runs`` times, round-robin after one uncounted warm-up round.

    Raises:
        RuntimeError: a case's subprocess exited non-zero (names the code and shows its stderr).
    """
    for _, python, code, env in cases:
        _time_once(python, code, env)
    times: Dict[str, List[float]] = {label: [] for label, *_ in cases}
    for _ in range(runs):
        for label, python, code, env in cases:
            times[label].append(_time_once(python, code, env))
    return times


def _quark_env(venv: Path, setup: bool):
    """quark_interop.QuarkEnv for ``venv`` when Quark is (or could be made) usable there, else a reason (str)."""
    sys.path.insert(0, str(HERE))
    try:
        import quark_interop  # this folder's interop benchmark: one definition of Quark's venv
    finally:
        sys.path.pop(0)
    env = quark_interop.QuarkEnv(venv)
    if not env.python.is_file() and not setup:
        return f"no Quark venv at {venv} (--no-quark-setup)"
    try:
        env.ensure()  # creates the venv when absent; builds (or finds) Quark's operator library
    except Exception as exc:  # noqa: BLE001  (pip, compiler, network: reported, not fatal)
        if not env._installed():
            return f"setting up Quark's venv at {venv} failed: {type(exc).__name__}: {str(exc)[-500:]}"
        # installed, but the interop benchmark's library-build step failed: the untimed warm-up
        # `import quark.onnx` of measure() compiles the library instead
        print(f"note: Quark is installed in {venv}; its library build step failed ({type(exc).__name__}), "
              "the warm-up import builds it", file=sys.stderr)
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark and print the report; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=15, help="timed runs per case (after one warm-up round)")
    p.add_argument("--no-quark", action="store_true", help="do not measure Quark")
    p.add_argument("--no-quark-setup", action="store_true", help="measure Quark only if its venv already exists")
    p.add_argument("--quark-venv", type=Path, default=None,
                   help="Quark's venv (default: $QTORCH_ONNX_CACHE/quark-venv or ~/.cache/qtorch_onnx/quark-venv)")
    args = p.parse_args(argv)

    from qtorch_onnx.cache import cache_root  # no torch

    # the operator library is built once before timing (the timed call is the cached lookup)
    subprocess.run([sys.executable, "-c", "import qtorch_onnx; qtorch_onnx.get_library_path()"], check=True,
                   stdin=subprocess.DEVNULL)
    cases = [(label, sys.executable, code, None) for label, code in OUR_CASES]
    quark_note = "not measured (--no-quark)"
    quark_torch = None
    if not args.no_quark:
        venv = args.quark_venv or cache_root() / "quark-venv"
        env = _quark_env(venv, setup=not args.no_quark_setup)
        if isinstance(env, str):
            quark_note = f"not measured: {env}"
        else:
            quark_note = f"measured in {venv} (amd-quark {_version('amd-quark', str(env.python))})"
            quark_torch = _version("torch", str(env.python))
            cases += [(label, str(env.python), code, env._env()) for label, code in QUARK_CASES]
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.time()
    times = measure(cases, args.runs)
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else None

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"date: {time.strftime('%Y-%m-%d %H:%M', time.localtime(t0))}")
    print(f"device: {device()}")
    print(f"python {platform.python_version()}, torch {_version('torch')}, onnx2torch {_version('onnx2torch')}, "
          f"torchvision {_version('torchvision')}; Quark venv torch {quark_torch or '-'}")
    if load0 and load1:
        print(f"load average (1 min) before / after: {load0[0]:.2f} / {load1[0]:.2f}")
    print(f"Quark: {quark_note}")
    print(f"{args.runs} runs per case, fresh `python -c` subprocesses, round-robin after a warm-up round\n")
    header = "| case | min (s) | median (s) | median / `import torch` |" + (
        " median / `import quark.onnx` |" if QUARK in med else "")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for label, *_ in cases:
        row = f"| `{label}` | {min(times[label]):.3f} | {med[label]:.3f} | {med[label] / med[BASELINE]:.2f} |"
        if QUARK in med:
            row += f" {med[label] / med[QUARK]:.2f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
