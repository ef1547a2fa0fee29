import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# pytest-xdist runs one worker per core (the README's -n 2): one intra-op thread per worker, as the workers already
# share the cores. With torch's default (a thread per core) two OpenMP pools spin against each other on every small
# operation: tests/algorithms took 267 s instead of 17 s on 2 cores. Tests of threading set their own counts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
