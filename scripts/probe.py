"""Diagnostics for the copy-engine path, printed as one table (run on the GPU host).

1. GEMM efficiency: XLA's dot vs the executor's cuBLASLt chunk matmuls, as ag_matmul runs them on
   a 1-device mesh (no peers; with return_gathered=True its own rows are also copied into the
   gathered output beside the matmul) and alone (the contention probe without pulls).
   FICCO_GEMM_LOG=1 prints each plan. 3. (several devices) ag_matmul with its own rows skipped / copied.
2. Transfers: ficco_jax.dma.all_gather alone vs NCCL's all-gather on all devices.
Usage: python scripts/probe.py [M K N]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax import bench, dma_probe, timing
from ficco_jax.schedule import Schedule

M, K, N = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 8192, 10240)
n = len(jax.local_devices())
rows = []


def record(what, fn, args, per_call=1):
    """Time `fn` (device time per call); `per_call` matmuls per call are reported one by one."""
    try:
        t = timing.device_time(fn, args)
        rows.append((what, t["median_s"] * 1e3 / per_call, t["spread_s"] * 1e3 / per_call))
    except Exception as exc:  # a probe that fails is reported, the others still run
        rows.append((what, float("nan"), str(exc).splitlines()[0][:80]))


# 1. GEMM efficiency on one device: [M, K] @ [K, N/n]
one = Mesh(np.array(jax.local_devices()[:1]), ("tp",))
x1, w1 = bench.make_inputs("ag_matmul", M, K, N // n, "bfloat16", one)
record(f"xla dot [{M},{K}]@[{K},{N // n}]", lambda r: bench.sharded(one, "ag_matmul", bench.op_body("ag_matmul", "ref"), r), (x1, w1))
# With one device there are no peers: the executor runs the own shard as one cuBLASLt matmul.
s1 = Schedule(comm="dma", order="direct")
record("cublasLt via executor, 1 matmul", lambda r: bench.sharded(one, "ag_matmul", bench.op_body("ag_matmul", s1), r), (x1, w1))
# The executor's matmul with nothing beside it: the contention probe's REP matmuls per call with
# pull=False and a tiny x (before e11042a the ag_matmul above also copied x into its gathered output
# on a copy engine while the matmul ran: M*K*2 bytes, 128 MiB at 8192 x 8192, competing for memory).
REP = 8
tiny = lambda a: a[:1, :8]
pure = lambda a, w: dma_probe.matmuls_beside_pulls(a, w, tiny(a), "tp", repeats=REP, pull=False)
record(f"cublasLt alone ({REP} per call, per matmul)", lambda r: bench.sharded(one, "ag_matmul", pure, r), (x1, w1), REP)
# return_gathered=True: the own rows are copied into the gathered output (what every call did before
# skip_own_rows; the forward of a gradient still does, the VJP reads them)
keep = lambda a, w: ficco_jax.ag_matmul(a, w, "tp", schedule=s1, return_gathered=True)[0]
record("cublasLt via executor, own rows copied too", lambda r: bench.sharded(one, "ag_matmul", keep, r), (x1, w1))
for c in (2, 4, 8):
    xs, ws = bench.make_inputs("ag_matmul", M // c, K, N // n, "bfloat16", one)
    s = Schedule(comm="dma", order="direct")
    record(f"cublasLt via executor, 1 matmul of M/{c} rows (x{c} = chunked)",
           lambda r: bench.sharded(one, "ag_matmul", bench.op_body("ag_matmul", s), r), (xs, ws))
    record(f"cublasLt alone, M/{c} rows", lambda r: bench.sharded(one, "ag_matmul", pure, r), (xs, ws), REP)
    record(f"xla dot of M/{c} rows", lambda r: bench.sharded(one, "ag_matmul", bench.op_body("ag_matmul", "ref"), r), (xs, ws))

# 2. all-gather alone, shard [M/n, K]  (PROBE_GEMM_ONLY=1 skips it)
import os
gemm_only = os.environ.get("PROBE_GEMM_ONLY") == "1"
mesh = Mesh(np.array(jax.local_devices()), ("tp",))
x = jax.device_put(jnp.ones((M, K), jnp.bfloat16) * 0.5, NamedSharding(mesh, P("tp", None)))
gather = lambda body: (lambda r: jax.jit(jax.shard_map(timing.chain(body, r), mesh=mesh, in_specs=(P("tp", None),), out_specs=P("tp", None))))
if not gemm_only:
    record("nccl all_gather", gather(lambda v: jax.lax.all_gather(v, "tp", axis=0, tiled=True)), (x,))
for s in () if gemm_only else ("dma/direct/c1", "dma/direct/c2", "dma/direct/c1/s2", "dma/direct/c1/s3", "dma/ring/c1", "dma/direct/c4/s3"):
    sched = Schedule.parse(s)
    record(f"dma all_gather {s}", gather(lambda v, sched=sched: ficco_jax.dma.all_gather(v, "tp", schedule=sched)), (x,))

# 3. ag_matmul on all devices: the own rows of the gathered output skipped (plain call) vs copied
if n > 1:
    xa, wa = bench.make_inputs("ag_matmul", M, K, N, "bfloat16", mesh)
    for s in ("dma/direct/c1", "dma/direct/c4/grouped"):
        sched = Schedule.parse(s)
        skip = lambda a, w, sched=sched: ficco_jax.ag_matmul(a, w, "tp", schedule=sched)
        copy = lambda a, w, sched=sched: ficco_jax.ag_matmul(a, w, "tp", schedule=sched, return_gathered=True)[0]
        record(f"ag_matmul {s} on {n} devices, own rows skipped", lambda r, f=skip: bench.sharded(mesh, "ag_matmul", f, r), (xa, wa))
        record(f"ag_matmul {s} on {n} devices, own rows copied", lambda r, f=copy: bench.sharded(mesh, "ag_matmul", f, r), (xa, wa))
    record(f"ag_matmul JAX seq on {n} devices", lambda r: bench.sharded(mesh, "ag_matmul", bench.op_body("ag_matmul", "ref"), r), (xa, wa))

shard_bytes = (M // n) * K * 2
print(f"\nprobe M,K,N={M},{K},{N} on {n} x {jax.devices()[0].device_kind}; shard {shard_bytes / 2**20:.1f} MiB; {timing.METHOD}")
for what, ms, spread in rows:
    extra = f"  ingress {(n - 1) * shard_bytes / (ms * 1e-3) / 1e9:6.1f} GB/s" if "all_gather" in what and ms == ms else ""
    print(f"{what:<58} {ms:8.3f} ms  ±{spread if isinstance(spread, str) else f'{spread:.3f}'}{extra}")
