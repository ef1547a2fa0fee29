"""Peak memory and time of prepare / calibrate / export on a synthetic MatMul model with external data.

    python benchmarks/big_model_memory.py --mib 256 --scale-thresholds        # one model, both paths
    python benchmarks/big_model_memory.py --k 16384 --mib 2063 --paths stream   # [16384, 33008]: past 2 GiB

The model: ``y = MatMul(x[N, K], W[K, M])`` with a float32 weight of about ``--mib`` MiB stored in an external
data file. The model is built, and each measurement runs, in a fresh subprocess of a small parent (``ru_maxrss`` is a
per-process high-water mark, inherited from the parent at fork):

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


def build(folder: str, mib: int, k: int = 4096) -> str:
    """Write ``big.onnx`` + ``big.onnx.data`` (weight [K, M] float32, ~mib MiB) into ``folder``; return the path.
    The data file is written row block by row block (the builder never holds the weight)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    m = max(16, (mib << 20) // (4 * k))
    rng = np.random.default_rng(0)
    data = os.path.join(folder, "big.onnx.data")
    with open(data, "wb") as f:
        for start in range(0, k, 256):
            block = rng.standard_normal((min(256, k - start), m), dtype=np.float32)
            block *= 0.05
            f.write(block.tobytes())
    w = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[k, m], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "big.onnx.data"), ("offset", "0"), ("length", str(4 * k * m))):
        w.external_data.add(key=key, value=value)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "big",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = os.path.join(folder, "big.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
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
    import torch  # imported before the start mark: its RSS is not the model's
    import onnx2torch  # noqa: F401

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
    peaks = {"prepare": _peak()}
    rng = np.random.default_rng(1)
    data = [{"x": rng.standard_normal((1, args.k), dtype=np.float32)} for _ in range(2)]
    qo.calibrate(qm, data, progress=False)
    t2 = time.perf_counter()
    rss["calibrated"] = _rss()
    peaks["calibrate"] = _peak()
    qo.export(qm, args.out)
    t3 = time.perf_counter()
    rss["exported"] = _rss()
    peaks["export"] = _peak()
    weight = os.path.getsize(args.model + ".data")
    ort_ok = None
    if args.ort:  # after the measurement: the written files load and run in ONNX Runtime
        import onnxruntime as ort

        with torch.no_grad():
            want = qm(torch.from_numpy(data[0]["x"])).numpy()
        del qm
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        got = ort.InferenceSession(args.out, so, providers=["CPUExecutionProvider"]).run(None, data[0])[0]
        ort_ok = {"shape": list(got.shape), "max_abs_diff_vs_torch": float(np.abs(got - want).max()),
                  "output_max_abs": float(np.abs(want).max())}
    print(json.dumps({"path": args.path, "weight_bytes": weight, "prepare_s": round(t1 - t0, 2),
                      "calibrate_s": round(t2 - t1, 2), "export_s": round(t3 - t2, 2),
                      "peak_rss_gb": round(_peak() / 1e9, 3), "peak_over_weight": round(_peak() / weight, 2),
                      "peak_above_start_over_weight": round((_peak() - rss["start"]) / weight, 2),
                      "rss_gb": {k: round(v / 1e9, 3) for k, v in rss.items()},
                      "peak_gb_by_stage_end": {k: round(v / 1e9, 3) for k, v in peaks.items()}, "ort": ort_ok}), flush=True)


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
    p.add_argument("--build", default=None)
    p.add_argument("--ort", action="store_true", help="run the export in ONNX Runtime after the measurement")
    p.add_argument("--k", type=int, default=4096, help="rows of the weight (the MatMul's input width)")
    args = p.parse_args()
    if args.build:
        print(build(args.build, args.mib, args.k))
        return
    if args.child:
        args.path = args.child
        child(args)
        return
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        # built in its own process: a child's ru_maxrss starts from its parent's high-water mark (Linux keeps
        # it across fork and exec), so this process must never hold the weight
        path = subprocess.run([sys.executable, os.path.abspath(__file__), "--build", folder, "--mib", str(args.mib),
                               "--k", str(args.k)],
                              check=True, capture_output=True, text=True).stdout.strip()
        outs = {}
        for which in args.paths.split(","):
            out = os.path.join(folder, f"q_{which}.onnx")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--model", path, "--out", out,
                   "--mib", str(args.mib), "--k", str(args.k)] + (["--scale-thresholds"] if args.scale_thresholds else []) + \
                (["--ort"] if args.ort else [])
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
