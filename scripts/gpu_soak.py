"""GPU acceptance checks of the copy-engine executor (run on the GPU host).

1. correctness: every dma schedule of ag_matmul and matmul_rs on the anchor shapes, fresh random
   bf16 inputs per check, the gathered output compared exactly and the matmul within bf16
   rounding of an f32 reference;
2. soak: CALLS back-to-back calls (async dispatch) of an ag_matmul -> matmul_rs pair, no hang,
   the same result at the end as at the start, and device memory in use before and after.
Usage: python scripts/gpu_soak.py [CALLS] [SECONDS_FOR_CORRECTNESS]
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from ficco_jax import bench
from ficco_jax.schedule import Schedule

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 240
n = len(jax.local_devices())
mesh = Mesh(np.array(jax.local_devices()), ("tp",))
t_end = time.time() + budget_s
checked = failed = 0
for name, (M, K, N) in bench.ANCHOR_SHAPES.items():
    for op in ("ag_matmul", "matmul_rs"):
        for sched in Schedule.enumerate(op, n, ("dma",)):
            if time.time() > t_end:
                break
            args = bench.make_inputs(op, M, K, N, "bfloat16", mesh, seed=checked)
            want = bench.sharded(mesh, op, bench.op_body(op, "ref"))(*[a.astype(jnp.float32) for a in args])
            if op == "ag_matmul":
                body = lambda x, w, s=sched: ficco_jax.ag_matmul(x, w, "tp", schedule=s, return_gathered=True)
                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                          out_specs=(P(None, "tp"), P("tp", None))))
                got, gathered = f(*args)
                exact = bool(jnp.array_equal(gathered.reshape(n, M, K)[0], args[0]))
            else:
                got, exact = bench.sharded(mesh, op, bench.op_body(op, sched))(*args), True
            err = bench._rel_err(got, want)
            ok = exact and err < bench.TOLERANCE["bfloat16"]
            checked += 1
            failed += not ok
            if not ok:
                print(f"FAIL {op} {name} {sched}: rel err {err:.3g}, gathered exact {exact}")
print(f"correctness: {checked} (op, shape, schedule) checks, {failed} failed")

M, K, N = bench.ANCHOR_SHAPES["llama70b_qkv_M8k"]
x, w = bench.make_inputs("ag_matmul", M, K, N, "bfloat16", mesh)
w2 = jax.device_put(w.T, jax.sharding.NamedSharding(mesh, P("tp", None)))


def pair(x, w, w2):
    h = ficco_jax.ag_matmul(x, w, "tp", schedule="dma/direct/c2")
    return ficco_jax.matmul_rs(h, w2, "tp", schedule="dma/direct/c2/grouped")


f = jax.jit(jax.shard_map(pair, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
first = f(x, w, w2).block_until_ready()
mem = lambda: [(d.memory_stats() or {}).get("bytes_in_use", -1) for d in jax.local_devices()]
out = f(x, w, w2).block_until_ready()  # from here on two results are alive: `first` and `out`
samples = [mem()]
t0 = time.time()
for quarter in range(4):
    for _ in range(calls // 4):
        out = f(x, w, w2)
    out.block_until_ready()
    samples.append(mem())
dt = time.time() - t0
same = bool(jnp.array_equal(out, first))
print(f"soak: {calls} back-to-back ag_matmul+matmul_rs calls in {dt:.1f} s ({dt / calls * 1e3:.3f} ms/pair), "
      f"last result identical to first: {same}")
print("device bytes in use after 0, 1/4, 1/2, 3/4, all of the calls:")
for k, row in enumerate(samples):
    print(f"  {k}/4: {row}")
