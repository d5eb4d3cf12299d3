"""Whether device time (the bench's method) holds on this machine: for one op and shape, its GEMM alone,
JAX sequential and one ficco schedule, each timed by `harness.device_time` (as `bench` times it) and over
one long loop, t(L) / L, in turn, three times (the GEMM alone as `bench` builds it: bench.gemm_alone,
harness.gemm_program); then a profiler trace of a 10-op loop of each, for its kernels.

Usage: python benchmarks/suites/timing_check.py OP SCHEDULE M K N [--dtype DTYPE] [--long L] [--out DIR]

One long loop spreads a launch's fixed cost over L ops, so it bounds the op from above by that cost / L
(on large ops well under a percent) and runs at the clock a long run of the op settles to. Where device
time is far below it, the differenced loops are timing something a long run does not see: before the
method took loops of R and 2R ops, loops of 1 and 5 timed XLA's FP8 dots in a launch's first
milliseconds, at the GPU's boost clock (BENCHMARKS.md, "Timing methods"). Prints one line per program and
writes DIR/timing_check.json (with provenance) and DIR/trace_<program>/ (perfetto_timeline.py reads them).
"""
from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import numpy as np
from jax.sharding import Mesh

from ficco_jax.ops import measure
from ficco_jax.schedule import Schedule, local_shapes
from ficco_jax.tools import bench, harness
from ficco_jax.tools.bench import add_case_arguments
from ficco_jax.tools.harness import DTYPES
from ficco_jax.tuning import timing


def op_program(mesh, schedule, op, M, K, N, dtype):
    """`op` under `schedule` ("ref": JAX sequential) as the bench times it."""
    args, body_of = bench.case_inputs(op, local_shapes(op, M, K, N, mesh.shape["tp"]), dtype, mesh)
    body = body_of(op, "ref" if schedule == "ref" else Schedule.parse(schedule))
    return functools.cache(lambda r: measure.sharded(mesh, op, body, r)), args


def long_loop_ms(make, args, length: int) -> float:
    """ms per op over one launch of `length` ops: device time's own wall timing of a loop (the median of
    timing.LAUNCHES launches after a warm-up)."""
    return timing.wall_time(make(length), args, timing.LAUNCHES) / length * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_arguments(parser)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="operand dtype (default bf16)")
    parser.add_argument("--long", type=harness.at_least(2), default=40, help="ops in the long loop (default 40)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out/timing_check", help="results dir")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    case = (args.op, args.M, args.K, args.N)
    gemm = bench.gemm_alone(*case, dtype, mesh.shape["tp"])
    programs = {"gemm_alone": lambda: harness.gemm_program(mesh, dtype, *gemm),
                "jax_seq": lambda: op_program(mesh, "ref", *case, dtype),
                f"ficco:{args.schedule}": lambda: op_program(mesh, args.schedule, *case, dtype)}
    result = {**bench.provenance(mesh.shape["tp"], dtype), "op": args.op, "shape": [args.M, args.K, args.N],
              "long_loop": args.long, "programs": {}}
    result["method"] = f"{result['method']}; beside it one loop of {args.long} ops, the median of {timing.LAUNCHES} launches"
    for name, build in programs.items():
        make, operands = build()
        device, long = [], []
        for _ in range(3):
            device.append(harness.device_time(make, operands)["median_s"] * 1e3)
            long.append(long_loop_ms(make, operands, args.long))
        result["programs"][name] = {"device_time_ms": device, "long_loop_ms": long}
        print(f"{name}: device time {' '.join(f'{t:.3f}' for t in device)} ms, one loop of {args.long} "
              f"{' '.join(f'{t:.3f}' for t in long)} ms, ratio {np.median(device) / np.median(long):.3f}", flush=True)
        traced = make(10)
        jax.block_until_ready(traced(*operands))
        with jax.profiler.trace(os.path.join(args.out, f"trace_{name.replace(':', '_').replace('/', '_')}"),
                                create_perfetto_trace=True):
            jax.block_until_ready(traced(*operands))
    with open(os.path.join(args.out, "timing_check.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
