"""Throughput of the C++ ONNX Runtime operator library (export/ort_ops) on CPU, against the torch reference
and a numpy copy measured in the same run.

    python benchmarks/ort_ops.py --sizes-mb 1 16

For each format one single-node model (Extended Q/DQ: a Q -> DQ pair) runs in ONNX Runtime with
``intra_op_num_threads`` = 1 and = all cores, input and output bound once (io_binding), so the time is the
operator's. GB/s counts the float32 bytes read and written (input + output; the Q/DQ pair's intermediate
tensor is not counted); each time is the best of several runs. "torch" is the reference function
(qtorch_onnx.ops / formats) at 1 thread and at torch's default thread count; "copy" is ``np.copyto`` of the
same array (a bandwidth baseline). Ratios (ORT / torch at equal thread counts, ORT / copy) come from the
same run. Prints the device, the load average, the library's build time and a markdown table.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto as T
from onnx import helper

from qtorch_onnx import ops
from qtorch_onnx.export.ort_ops.build import build
from qtorch_onnx.formats import floating, integer
from qtorch_onnx.formats.spec import INT8

QUARK = "com.amd.quark"
FORMATS = {
    "BFP16": ("bfp", dict(bfp_method="to_bfp", bit_width=16, block_size=8, rounding_mode=2)),
    "MX6": ("bfp", dict(bfp_method="to_bfp_prime", bit_width=13, block_size=16, rounding_mode=2)),
    "MX9": ("bfp", dict(bfp_method="to_bfp_prime", bit_width=16, block_size=16, rounding_mode=2)),
    "MXINT8": ("mx", dict(element_dtype="int8", block_size=32, rounding_mode=2)),
    "MXFP8E4M3": ("mx", dict(element_dtype="fp8_e4m3", block_size=32)),
    "MXFP4": ("mx", dict(element_dtype="fp4_e2m1", block_size=32)),
    "QDQ int8": ("qdq", dict(zp_type=T.INT8)),
    "QDQ bf16": ("qdq", dict(zp_type=T.BFLOAT16)),
}
SCALE = 0.0125


def _device() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores"


def _model(kind: str, kw: dict, shape) -> bytes:
    x = helper.make_tensor_value_info("x", T.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", T.FLOAT, list(shape))
    inits = []
    if kind == "qdq":
        zt = kw["zp_type"]
        inits = [helper.make_tensor("s", T.FLOAT, [], [SCALE]), helper.make_tensor("z", zt, [], [0])]
        nodes = [helper.make_node("ExtendedQuantizeLinear", ["x", "s", "z"], ["q"], domain=QUARK),
                 helper.make_node("ExtendedDequantizeLinear", ["q", "s", "z"], ["y"], domain=QUARK)]
    else:
        op = "BFPQuantizeDequantize" if kind == "bfp" else "MXQuantizeDequantize"
        nodes = [helper.make_node(op, ["x"], ["y"], domain=QUARK, axis=1, **kw)]
    g = helper.make_graph(nodes, "bench", [x], [y], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(QUARK, 1)])
    m.ir_version = 10
    return m.SerializeToString()


def _torch_fn(kind: str, kw: dict):
    if kind == "bfp":
        return lambda t: ops.bfp_quantize_dequantize(t, axis=1, **kw)
    if kind == "mx":
        return lambda t: ops.mx_quantize_dequantize(t, axis=1, **kw)
    if kw["zp_type"] == T.INT8:
        return lambda t: integer.fake_quantize(t, SCALE, 0, INT8)
    zp = torch.zeros((), dtype=torch.bfloat16)
    return lambda t: floating.bf16_dequantize(floating.bf16_quantize(t, SCALE, zp), SCALE, zp)


def _time(fn, min_s: float = 0.25, min_reps: int = 3) -> float:
    fn()  # warm-up
    reps, total = 0, 0.0
    best = float("inf")
    while reps < min_reps or total < min_s:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        reps += 1
    return best


def _ort_runner(model: bytes, lib: str, threads: int, x: np.ndarray, y: np.ndarray):
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    b = sess.io_binding()
    b.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x))
    b.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(y))
    return lambda: sess.run_with_iobinding(b)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    args = p.parse_args(argv)
    res = build()
    lib = res.path
    n_all = os.cpu_count() or 1
    t_all = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device: {_device()}; onnxruntime {ort.__version__}; torch {torch.__version__} "
          f"({t_all} threads); load average {load:.1f}")
    print(f"library: {lib} (build time {res.seconds:.1f} s{'' if res.built else ', cached'})")
    print("GB/s = (input + output bytes) / best time; ratios from this run\n")
    print(f"| format | MB | copy GB/s | ORT 1t GB/s | ORT {n_all}t GB/s | torch 1t GB/s | torch {t_all}t GB/s | "
          f"ORT/torch 1t | ORT/torch {n_all}t | ORT {n_all}t / copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for mb in args.sizes_mb:
        n = max(4096, int(mb * 2**20 / 4) // 4096 * 4096)
        shape = (n // 4096, 4096)
        x = (rng.standard_normal(shape) * np.exp2(rng.integers(-6, 6, shape))).astype(np.float32)
        nbytes = 2 * x.nbytes
        dst = np.empty_like(x)
        t_copy = _time(lambda: np.copyto(dst, x))
        xt = torch.from_numpy(x)
        for name in args.formats:
            kind, kw = FORMATS[name]
            model = _model(kind, kw, shape)
            y = np.empty_like(x)
            t1 = _time(_ort_runner(model, lib, 1, x, y))
            tn = _time(_ort_runner(model, lib, n_all, x, y))
            with torch.no_grad():
                fn = _torch_fn(kind, kw)
                torch.set_num_threads(1)
                t_ref1 = _time(lambda: fn(xt))
                torch.set_num_threads(t_all)
                t_ref = _time(lambda: fn(xt))
                ref = fn(xt).numpy()
            same = np.array_equal(ref.view(np.uint32), y.view(np.uint32))
            gb = lambda t: nbytes / t / 1e9  # noqa: E731
            print(f"| {name} | {mb:g} | {gb(t_copy):.2f} | {gb(t1):.2f} | {gb(tn):.2f} | {gb(t_ref1):.2f} | "
                  f"{gb(t_ref):.2f} | {t_ref1 / t1:.1f}x | {t_ref / tn:.1f}x | {t_copy / tn:.3f} |"
                  + ("" if same else " (OUTPUT DIFFERS FROM TORCH)"))


if __name__ == "__main__":
    main()
