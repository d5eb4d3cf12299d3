"""Matmul slowdown beside NCCL (SM-driven) transfers, measured with PyTorch where the two really overlap.

`python -m ficco_jax characterize --parts contention` measures the matmul beside copy-engine pulls
with our executor, but its NCCL probe could not make XLA overlap a matmul with an NCCL all-gather (or
ppermute): XLA ran them one after the other (2026-11-22, 4xH200). This script is the NCCL half of
issue 4's contention measurement: PyTorch runs the same matmul on one stream while NCCL all-gathers
run on another, so NCCL's kernels share the SMs with the GEMM.

  python -m torch.distributed.run --nproc-per-node=4 scripts/contention_torch.py [--out DIR]

Same shapes as characterize's contention probe: [4096, 8192] @ [8192, 7168] bf16 per GPU, 64 MiB
all-gather shards. Timing: CUDA events around R back-to-back matmuls on the compute stream, median
of 5 trials after warm-up; "beside" trials keep the comm stream busy with all-gathers for longer
than the R matmuls take. Rank 0 prints one JSON line and writes DIR/contention_torch.json.
Measurement only: needs torch with NCCL and GPUs; not part of the library.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _events_ms(stream, fn, repeats):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(repeats):
            fn()
        stop.record(stream)
    return start, stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--n", type=int, default=7168)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "out/contention_torch"))
    args = parser.parse_args()

    t0 = time.time()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    # A collective that cannot complete ends the run with NCCL's error instead of hanging it.
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    def progress(what: str) -> None:  # rank 0 says where it is (the first run hung without a word)
        if rank == 0:
            print(f"[rank0 +{time.time() - t0:.1f}s] {what}", file=sys.stderr, flush=True)

    progress(f"process group of {world} up")
    gen = torch.Generator(device="cuda").manual_seed(rank + 1)
    a = torch.randn(args.rows, args.k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(args.k, args.n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(args.rows, args.n, device="cuda", dtype=torch.bfloat16)
    shard = torch.randn(args.shard_mib << 19, device="cuda", dtype=torch.bfloat16, generator=gen)
    gathered = torch.empty(world * shard.numel(), device="cuda", dtype=torch.bfloat16)
    compute, comm = torch.cuda.Stream(), torch.cuda.Stream()

    def matmul():
        torch.matmul(a, w, out=out)

    def all_gather():
        dist.all_gather_into_tensor(gathered, shard)

    progress("inputs ready; first all-gather")
    # Check once that the all-gather is right (the shard of every rank lands in its place).
    with torch.cuda.stream(comm):
        all_gather()
    comm.synchronize()
    first = gathered.view(world, -1)[:, :4].float().cpu()
    mine = first[rank].clone()
    assert torch.equal(mine, shard[:4].float().cpu()), "all-gather placed this rank's shard wrongly"

    def trial(kind: str) -> float:
        dist.barrier()
        torch.cuda.synchronize()
        if kind == "matmul":
            s, e = _events_ms(compute, matmul, args.repeats)
        elif kind == "all_gather":
            s, e = _events_ms(comm, all_gather, args.repeats)
        else:  # matmul beside all-gathers: fill the comm stream for longer than the matmuls take
            with torch.cuda.stream(comm):
                for _ in range(cover):
                    all_gather()
            s, e = _events_ms(compute, matmul, args.repeats)
        torch.cuda.synchronize()
        return s.elapsed_time(e) / args.repeats

    alone = {}
    for kind in ("matmul", "all_gather"):
        progress(f"timing {kind} alone")
        trial(kind)  # warm-up
        alone[kind] = statistics.median(trial(kind) for _ in range(args.trials))
    # Every rank must issue the same number of all-gathers (a rank-local count from its own timings
    # would leave NCCL waiting for a collective the others never start): the largest count wins.
    count = torch.tensor([math.ceil(args.repeats * alone["matmul"] / alone["all_gather"]) + 2], device="cuda")
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    cover = int(count.item())
    progress(f"alone: {alone}; timing the matmul beside {cover} all-gathers")
    trial("beside")
    beside = sorted(trial("beside") for _ in range(args.trials))
    result = {
        "what": "torch matmul on one stream beside NCCL all_gather_into_tensor on another (CUDA events)",
        "world": world, "device": torch.cuda.get_device_name(), "rows": args.rows, "K": args.k, "N": args.n,
        "shard_mib": args.shard_mib, "repeats": args.repeats, "trials": args.trials,
        "matmul_ms": alone["matmul"], "all_gather_ms": alone["all_gather"],
        "matmul_beside_nccl_ms": statistics.median(beside),
        "matmul_beside_nccl_range_ms": [beside[0], beside[-1]],
    }
    result["nccl_slowdown"] = result["matmul_beside_nccl_ms"] / result["matmul_ms"] - 1.0
    gathered_results = [None] * world
    dist.all_gather_object(gathered_results, result)
    if rank == 0:
        result["nccl_slowdown_per_rank"] = [r["nccl_slowdown"] for r in gathered_results]
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "contention_torch.json"), "w") as fh:
            json.dump(result, fh, indent=1)
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
