"""Run one op under one schedule in a jitted loop, for a profiler to record.

Usage: python benchmarks/suites/trace_op.py OP SCHEDULE M K N [ITERS] [--dtype DTYPE] [--jax-profiler DIR]
(SCHEDULE: a Schedule string or "ref"; DTYPE bf16 by default, fp8: the scaled op on e4m3 operands, as
`bench --dtype fp8` times it). Under nsys, run it as is. With --jax-profiler, JAX's own
profiler (CUPTI on GPUs: every kernel and copy of every stream, ours included) records the second
run and writes DIR/plugins/profile/<time>/perfetto_trace.json.gz, which `benchmarks/suites/perfetto_timeline.py`
prints: the route where the machine has no nsys.
"""
import argparse

import jax
import numpy as np
from jax.sharding import Mesh

from ficco_jax.tools.bench import add_case_arguments, record_timeline
from ficco_jax.tools.harness import DTYPES
from ficco_jax.schedule import Schedule

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
add_case_arguments(parser)
parser.add_argument("iters", type=int, nargs="?", default=20)
parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="operand dtype (default bf16)")
parser.add_argument("--jax-profiler", metavar="DIR", default=None)
args = parser.parse_args()
sched = "ref" if args.schedule == "ref" else Schedule.parse(args.schedule)
mesh = Mesh(np.array(jax.local_devices()), ("tp",))
record_timeline(mesh, args.op, sched, args.M, args.K, args.N, args.iters, args.jax_profiler, dtype=DTYPES[args.dtype])
print(f"traced {args.op} {args.schedule} {args.M},{args.K},{args.N} {DTYPES[args.dtype]} x{args.iters}")
