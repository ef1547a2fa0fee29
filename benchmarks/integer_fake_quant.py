"""Integer fake quantization: the in-place path against the reference composition and a memory copy, same run.

Per tensor size and layout (per tensor, per channel), in the three situations a prepared model meets:
  * ``no-grad``: evaluation, calibration, sensitivity passes (``fake_quantize_ste`` under ``torch.no_grad``),
  * ``STE fwd+bwd``: training through the straight-through estimator (gradient mask kept for the backward),
against
  * ``reference``: the reference composition ``_quantize_core`` (round, saturate, NaN rule) then dequantize and
    the gradient mask ``(c == t) | ~isfinite(x)``, which is what every call ran before the in-place path,
  * ``copy``: ``x.clone()`` on the same device (the memory-bandwidth floor of any elementwise pass),
  * ``C kernel``: ``qtorch_onnx/cpu_kernels.c``'s one pass (per-tensor, CPU), what a prepared model's activation
    quantizers run in evaluation on a CPU.
Both paths are checked bit for bit (uint32 view) on every tensor before they are timed.

    python benchmarks/integer_fake_quant.py                       # CPU, 1 thread
    python benchmarks/integer_fake_quant.py --threads 2 --sizes-mb 1 16 64

Prints the device first; results are recorded in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse

import torch
from block_formats import _device_name, _time  # this folder's block-format benchmark: one timing rule

from qtorch_onnx import cpu_kernels
from qtorch_onnx.formats import integer as I
from qtorch_onnx.formats.spec import INT8, INT16


def _reference(x, s, z, fmt, axis):
    sb, zb = I._prepare(x, s, z, axis, None, "bench")
    c, t = I._quantize_core(x, sb, zb, fmt, False, False)
    y = (c - zb.to(c.dtype)).to(torch.float32) * sb
    mask = (c == t) | ~torch.isfinite(x)
    return y, mask


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 4.0, 32.0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device: {device} ({_device_name(device)}), torch {torch.__version__}")
    print(f"{'case':34s} {'reference ms':>13s} {'ours ms':>9s} {'speedup':>8s} {'copy ms':>8s} {'ours/copy':>9s}")
    gen = torch.Generator().manual_seed(0)
    for mb in args.sizes_mb:
        n = int(mb * (1 << 20) / 4)
        ch = 64
        x = (torch.randn(n // ch * ch, generator=gen) * 3).reshape(n // ch // 64, ch, 64).to(device)
        for fmt, layout in ((INT8, "per-tensor"), (INT16, "per-tensor"), (INT8, "per-channel")):
            if layout == "per-tensor":
                s, z, axis = torch.tensor(0.05, device=device), torch.tensor(3, device=device), None
            else:
                s = (torch.rand(ch, generator=gen) * 0.1 + 0.01).to(device)
                z = torch.zeros(ch, dtype=torch.int64, device=device)
                axis = 1
            ref_y, ref_m = _reference(x, s, z, fmt, axis)
            with torch.no_grad():
                y = I.fake_quantize_ste(x, s, z, fmt, axis)
            y2, m2 = I._fake_quantize_with_mask(x, s, z, fmt, axis, None, False, False, need_mask=True)
            assert torch.equal(y.view(torch.int32), ref_y.view(torch.int32)), "no-grad path differs"
            assert torch.equal(y2.view(torch.int32), ref_y.view(torch.int32)) and torch.equal(m2, ref_m)
            copy = _time(lambda: x.clone(), device, args.reps)
            label = f"{mb:g} MB {fmt.name} {layout}"

            def ours_nograd():
                with torch.no_grad():
                    return I.fake_quantize_ste(x, s, z, fmt, axis)

            def ref_nograd():
                with torch.no_grad():
                    return _reference(x, s, z, fmt, axis)

            xg = x.clone().requires_grad_(True)
            gy = torch.ones_like(x)

            def ours_ste():
                I.fake_quantize_ste(xg, s, z, fmt, axis).backward(gy)

            def ref_ste():  # the reference forward (with its mask) and the same masked backward
                y, m = _reference(xg.detach(), s, z, fmt, axis)
                return torch.where(m, gy, torch.zeros_like(gy))

            cases = [("no-grad", ref_nograd, ours_nograd), ("STE fwd+bwd", ref_ste, ours_ste)]
            if device.type == "cpu" and layout == "per-tensor" and cpu_kernels.available():
                lo, hi = I.quant_range(fmt)
                xc = x.contiguous()

                def c_kernel():  # what FakeQuantize runs for a per-tensor quantizer in evaluation on a CPU
                    return cpu_kernels.fake_quantize_tensor(xc, float(s), float(z), lo, hi)

                assert torch.equal(c_kernel().view(torch.int32), ref_y.view(torch.int32)), "C kernel differs"
                cases.append(("C kernel (no-grad)", ref_nograd, c_kernel))
            for case, ref_fn, our_fn in cases:
                r = _time(ref_fn, device, args.reps)
                o = _time(our_fn, device, args.reps)
                print(f"{label + ' ' + case:34s} {r * 1e3:13.3f} {o * 1e3:9.3f} {r / o:7.2f}x {copy * 1e3:8.3f} "
                      f"{o / copy:8.1f}x")


if __name__ == "__main__":
    main()
