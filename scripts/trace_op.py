"""Run one op under one schedule in a jitted loop, for a profiler (nsys) to record.

Usage: python scripts/trace_op.py OP SCHEDULE M K N [ITERS]   (SCHEDULE: a Schedule string or "ref")
"""
import sys

import jax
import numpy as np
from jax.sharding import Mesh

from ficco_jax import bench, timing
from ficco_jax.schedule import Schedule

op, sched_text, M, K, N = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
iters = int(sys.argv[6]) if len(sys.argv) > 6 else 20
sched = "ref" if sched_text == "ref" else Schedule.parse(sched_text)
mesh = Mesh(np.array(jax.local_devices()), ("tp",))
args = bench.make_inputs(op, M, K, N, "bfloat16", mesh)
fn = bench.sharded(mesh, op, bench.op_body(op, sched), iters)
jax.block_until_ready(fn(*args))
jax.block_until_ready(fn(*args))
print(f"traced {op} {sched_text} {M},{K},{N} x{iters}")
