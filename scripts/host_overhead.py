"""Is a copy-engine call's fixed cost on the GPU, or host time that our timing loop exposes?

Our device times run the op R times inside one jitted `fori_loop` (ficco_jax/timing.py). Every
copy-engine call also spends host time in its handler (three rendezvous of the device threads,
event records, copy launches). If XLA's loop made the host wait for the GPU each iteration, that host time would show as
device time here although a training step (straight-line code, the host running ahead) would hide
it. This script times the same ops both ways, the loop and R copies unrolled in one jit, on every
local GPU:

    python scripts/host_overhead.py [--shape M,K,N ...] [--schedules dma/direct/c1,...]

Prints one table (device time per op, loop vs unrolled) and writes JSON with --out. Needs GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh

from ficco_jax import bench, timing


def unrolled(step, repeats):
    """`timing.chain` without the loop: `repeats` calls in straight-line code."""
    one = timing.chain(step, 1)

    def body(a, *rest):
        for _ in range(repeats):
            a = one(a, *rest)
        return a

    return body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", default=None, help="M,K,N (repeatable)")
    parser.add_argument("--schedules", default="ref,dma/direct/c1,dma/direct/c4/grouped")
    parser.add_argument("--ops", default="ag_matmul,matmul_rs")
    parser.add_argument("--max-repeats", type=int, default=32, help="unrolled copies at most (compile time)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["1024,4096,4096", "8192,8192,10240"])]
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    n = mesh.shape["tp"]
    rows = []
    for op in args.ops.split(","):
        for (M, K, N) in shapes:
            a, w = bench.make_inputs(op, M, K, N, "bfloat16", mesh)
            for sched in args.schedules.split(","):
                body = bench.op_body(op, sched)
                in_specs, _ = bench._specs(op)
                loop = lambda r, body=body: bench.sharded(mesh, op, body, r)
                flat = lambda r, body=body: jax.jit(jax.shard_map(
                    unrolled(body, r), mesh=mesh, in_specs=in_specs, out_specs=in_specs[0]))
                row = {"op": op, "shape": [M, K, N], "schedule": sched}
                for name, make, cap in (("loop", loop, 200), ("unrolled", flat, args.max_repeats)):
                    try:
                        t = timing.device_time(make, (a, w), max_repeats=cap)
                        row[name] = {"ms": t["median_s"] * 1e3, "spread_ms": t["spread_s"] * 1e3, "repeats": t["repeats"]}
                    except Exception as exc:  # a failing variant is reported; the others still run
                        row[name] = {"error": str(exc).splitlines()[0][:160]}
                rows.append(row)
                print("ROW", json.dumps(row), file=sys.stderr, flush=True)
    print(f"\nhost_overhead on {n} x {jax.devices()[0].device_kind}; {timing.METHOD}; 'unrolled': the same "
          f"differencing over R straight-line copies (R <= {args.max_repeats}), no loop")
    print("| op | shape | schedule | loop ms | unrolled ms | unrolled / loop |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lo, un = r["loop"].get("ms"), r["unrolled"].get("ms")
        ratio = f"{un / lo:.2f}" if lo and un else "—"
        fmt = lambda d: f"{d['ms']:.3f} ±{d['spread_ms']:.3f}" if "ms" in d else d["error"][:40]
        print(f"| {r['op']} | {','.join(map(str, r['shape']))} | {r['schedule']} | {fmt(r['loop'])} | {fmt(r['unrolled'])} | {ratio} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "n": n, "method": timing.METHOD, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
