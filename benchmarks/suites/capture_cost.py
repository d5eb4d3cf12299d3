"""What one copy-engine call costs when calls come back to back, with the schedules side by side: K
calls chained in one jitted program (all_gather then reduce_scatter, or ag_matmul then matmul_rs,
pair after pair, each call's input the previous call's result), L launches timed on the host after
warm-ups. Per call: wall microseconds (the call's fixed cost where it is small: host work or device
time, whichever is longer), how many of the program's calls reached their handler (a call that XLA
replays from a command buffer reaches none: transfer="symmetric"), and host meetings. Beside them
the plain path (comm none: XLA's collective, NCCL on GPUs; on one device XLA drops it).

Usage: python benchmarks/suites/capture_cost.py [--pair collectives|matmuls] [--bytes B] [--calls K]
           [--launches L] [--schedules S,...] [--out FILE]

Timing method: wall time of L launches of the K-call program after 3 warm-up launches, each checked
against the plain path's result, / (L K); median of 5 such measurements. On CPU the numbers are the
CPU backend's.
"""
import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from ficco_jax import dma
from ficco_jax.runtime import extension

DEFAULT_SCHEDULES = ("none", "dma/direct/c1", "dma/direct/c1/symmetric")


def chain(pair: str, schedule: str, calls: int, mesh: Mesh, width: int):
    """The jitted K-call program of `pair` under `schedule` ("none": jax.lax's collective and dot)."""
    plain = schedule == "none"
    w = jnp.full((width, width), 1.0 / width, jnp.float32)  # keeps the values bounded along the chain

    def step(v):
        if pair == "collectives":
            g = jax.lax.all_gather(v, "tp", tiled=True) if plain else dma.all_gather(v, "tp", schedule=schedule)
            return jax.lax.psum_scatter(g, "tp", tiled=True) if plain else dma.reduce_scatter(g, "tp", schedule=schedule)
        h = ficco_jax.ag_matmul(v, w, "tp", schedule=schedule)
        return ficco_jax.matmul_rs(h, w, "tp", schedule=schedule)

    def body(v):
        for _ in range(calls // 2):
            v = step(v) * 0.5
        return v

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))


def measure(pair: str, schedule: str, nbytes: int, calls: int, launches: int) -> dict:
    """One schedule's row, after its result was checked against the plain path's. f32 matmuls at full
    precision, as the executor's are: the checked and the timed program are one trace."""
    with jax.default_matmul_precision("highest"):
        return _measure(pair, schedule, nbytes, calls, launches)


def _measure(pair: str, schedule: str, nbytes: int, calls: int, launches: int) -> dict:
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    n = mesh.shape["tp"]
    width = 256
    rows = max(8, nbytes // (4 * width) // 8 * 8)  # f32 rows per device, a multiple of 8 (chunks)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n * rows, width)).astype(np.float32))
    f = chain(pair, schedule, calls, mesh, width)
    want = np.asarray(chain(pair, "none", calls, mesh, width)(x))
    for i in range(3):  # warm-ups, each checked: the later ones replay what the first recorded
        got = np.asarray(f(x * (1 + i)))
        err = float(np.max(np.abs(got - want * (1 + i))) / max(float(np.max(np.abs(want))) * (1 + i), 1e-30))
        if not err < 1e-4:
            raise SystemExit(f"capture_cost: {pair} {schedule} differs from the plain path by {err:.2e} "
                             f"(relative to the largest value) at launch {i}")
    testing = extension.testing()
    handlers0, meetings0 = testing.host_time()["calls"], testing.host_meetings()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(launches):
            out = f(x)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / (launches * calls) * 1e6)
    total = 5 * launches
    return {"pair": pair, "schedule": schedule, "devices": n, "block_bytes": rows * width * 4, "calls": calls,
            "us_per_call": statistics.median(samples), "us_spread": [min(samples), max(samples)],
            "handlers_per_launch": (testing.host_time()["calls"] - handlers0) / total,
            "meetings_per_launch": (testing.host_meetings() - meetings0) / total,
            "device": jax.devices()[0].device_kind,
            "method": f"wall time of {launches} launches of a {calls}-call program, / calls, median of 5"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("collectives", "matmuls"), default="collectives")
    parser.add_argument("--bytes", type=int, default=1 << 20, help="bytes of one device's block (f32)")
    parser.add_argument("--calls", type=int, default=32, help="calls per program (pairs of two)")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES))
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.calls < 2 or args.calls % 2:
        parser.error(f"--calls {args.calls}: give an even number >= 2 (the calls come in pairs)")
    rows = []
    for schedule in args.schedules.split(","):
        row = measure(args.pair, schedule.strip(), args.bytes, args.calls, args.launches)
        rows.append(row)
        print(f"{row['pair']} {row['schedule']:28s} {row['devices']} x {row['device']}, {row['block_bytes']} B per "
              f"block: {row['us_per_call']:8.1f} us per call ({row['us_spread'][0]:.1f}-{row['us_spread'][1]:.1f}), "
              f"{row['handlers_per_launch']:.1f} handler calls and {row['meetings_per_launch']:.1f} meetings per "
              f"launch of {row['calls']} calls", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
