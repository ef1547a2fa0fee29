"""Peak memory and time of prepare / calibrate / export on a synthetic MatMul model with external data.

    python benchmarks/big_model_memory.py --mib 256 --scale-thresholds        # one model, both paths
    python benchmarks/big_model_memory.py --mib 2058 --paths stream          # the real >2 GiB case

The model: ``y = MatMul(x[N, K], W[K, M])`` with a float32 weight of about ``--mib`` MiB stored in an external
data file. Each measurement runs in a fresh subprocess (``ru_maxrss`` is a per-process high-water mark):

* ``memory``: the model loaded into memory first (``onnx.load`` with its external data) and given as a
  ModelProto: the in-memory path;
* ``stream``: the model given by its path: the streaming path (large initializers stay in their file until
  they are lifted; export writes them tensor by tensor).

``--scale-thresholds`` lowers ``normalize.BIG_MODEL_BYTES`` to a quarter of the weight and
``LARGE_INITIALIZER_ELEMENTS`` to 2^16 so a model far below 2 GiB takes the large-model path. Prints one JSON
line per path: seconds per stage, peak RSS (GB), RSS after each stage, peak / weight bytes; and whether the
two exports hold the same bits.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build(folder: str, mib: int) -> str:
    """Write ``big.onnx`` + ``big.onnx.data`` (weight [K, M] float32, ~mib MiB) into ``folder``; return the path."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    k = 4096
    m = max(16, (mib << 20) // (4 * k))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, m), dtype=np.float32)
    w *= 0.05
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "big",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m])],
                          [numpy_helper.from_array(w, "W")])
    del w
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = os.path.join(folder, "big.onnx")
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="big.onnx.data", size_threshold=1024)
    return path


def child(args) -> None:
    """One measurement (in its own process)."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import onnx

    import qtorch_onnx as qo
    from qtorch_onnx import CalibrationMethod, Config, QuantizationConfig, QuantType
    _norm = importlib.import_module("qtorch_onnx.lift.normalize")

    if args.scale_thresholds:
        _norm.BIG_MODEL_BYTES = (args.mib << 20) // 4
        _norm.LARGE_INITIALIZER_ELEMENTS = 1 << 16
    rss = {"start": _rss()}
    t0 = time.perf_counter()
    model = args.model if args.path == "stream" else onnx.load(args.model)
    rss["loaded"] = _rss()
    cfg = Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
        use_external_data_format=True))
    qm = qo.prepare(model, cfg)
    del model
    t1 = time.perf_counter()
    rss["prepared"] = _rss()
    k = qm.input_specs[0].shape[1] if hasattr(qm.input_specs[0], "shape") else 4096
    rng = np.random.default_rng(1)
    data = [{"x": rng.standard_normal((1, 4096), dtype=np.float32)} for _ in range(2)]
    qo.calibrate(qm, data, progress=False)
    t2 = time.perf_counter()
    rss["calibrated"] = _rss()
    qo.export(qm, args.out)
    t3 = time.perf_counter()
    rss["exported"] = _rss()
    weight = os.path.getsize(args.model + ".data")
    print(json.dumps({"path": args.path, "weight_bytes": weight, "prepare_s": round(t1 - t0, 2),
                      "calibrate_s": round(t2 - t1, 2), "export_s": round(t3 - t2, 2),
                      "peak_rss_gb": round(_peak() / 1e9, 3), "peak_over_weight": round(_peak() / weight, 2),
                      "peak_above_start_over_weight": round((_peak() - rss["start"]) / weight, 2),
                      "rss_gb": {k: round(v / 1e9, 3) for k, v in rss.items()}, "k": k}), flush=True)


def _same_export(a: str, b: str) -> bool:
    import numpy as np
    import onnx
    from onnx import numpy_helper

    ma, mb = onnx.load(a), onnx.load(b)
    ia = {t.name: numpy_helper.to_array(t) for t in ma.graph.initializer}
    ib = {t.name: numpy_helper.to_array(t) for t in mb.graph.initializer}
    if ia.keys() != ib.keys() or [n.op_type for n in ma.graph.node] != [n.op_type for n in mb.graph.node]:
        return False
    return all(ia[k].dtype == ib[k].dtype and ia[k].tobytes() == ib[k].tobytes() for k in ia)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--paths", default="memory,stream")
    p.add_argument("--scale-thresholds", action="store_true")
    p.add_argument("--folder", default=None)
    p.add_argument("--child", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.child:
        args.path = args.child
        child(args)
        return
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        path = build(folder, args.mib)
        outs = {}
        for which in args.paths.split(","):
            out = os.path.join(folder, f"q_{which}.onnx")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--model", path, "--out", out,
                   "--mib", str(args.mib)] + (["--scale-thresholds"] if args.scale_thresholds else [])
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            sys.stdout.write(r.stdout)
            if r.returncode:
                sys.stdout.write(r.stderr[-4000:])
                continue
            outs[which] = out
        if len(outs) == 2:
            print(json.dumps({"same_export_bits": _same_export(*outs.values())}))


if __name__ == "__main__":
    main()
