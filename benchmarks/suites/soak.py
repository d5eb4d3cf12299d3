"""Soak of the copy-engine executor on the local GPUs.

1. correctness: every dma schedule of ag_matmul and matmul_rs on the anchor shapes, fresh random
   bf16 inputs per check; ag_matmul's gathered operand must equal the inputs exactly and every
   result must be within bf16 rounding of an f32 reference;
2. soak: CALLS back-to-back calls (async dispatch) of an ag_matmul -> matmul_rs pair: no hang,
   the last result identical to the first, and device memory in use sampled at each quarter.

    python benchmarks/suites/soak.py [--calls 2000] [--budget-s 240] [--out DIR]

Writes DIR/soak.json and prints one verdict line last.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax.ops import measure
from ficco_jax.schedule import Schedule, local_shapes
from ficco_jax.tools.bench import ANCHOR_SHAPES

DTYPE = "bfloat16"
TOLERANCE = 2e-2  # relative Frobenius error of bf16 outputs against the f32 reference
SOAK_SHAPE = "llama70b_qkv_M8k"


def rel_err(got, want) -> float:
    g, w = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(g - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30))


def check_one(mesh, op, sched, dims, seed) -> tuple[float, bool]:
    """(relative error, gathered operand exact) of one schedule against the reference."""
    M, K, N = dims
    n = mesh.shape["tp"]
    args = measure.make_inputs(op, local_shapes(op, M, K, N, n), DTYPE, mesh, seed=seed)
    want = measure.sharded(mesh, op, measure.op_body(op, "ref"))(*[a.astype(jnp.float32) for a in args])
    if op != "ag_matmul":
        return rel_err(measure.sharded(mesh, op, measure.op_body(op, sched))(*args), want), True
    body = lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=sched, return_gathered=True)  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                              out_specs=(P(None, "tp"), P("tp", None))))
    got, gathered = f(*args)
    return rel_err(got, want), bool(jnp.array_equal(gathered.reshape(n, M, K)[0], args[0]))


def correctness(mesh, budget_s: float) -> dict:
    n, t_end = mesh.shape["tp"], time.time() + budget_s
    checked, failures = 0, []
    for name, dims in ANCHOR_SHAPES.items():
        for op in ("ag_matmul", "matmul_rs"):
            for sched in Schedule.enumerate(op, n, ("dma",)):
                if time.time() > t_end:
                    return {"checked": checked, "failed": failures, "cut_by_budget": True}
                err, exact = check_one(mesh, op, sched, dims, seed=checked)
                checked += 1
                if not (exact and err < TOLERANCE):
                    failures.append({"op": op, "shape": name, "schedule": str(sched), "rel_err": err, "exact": exact})
                    print(f"FAIL {op} {name} {sched}: rel err {err:.3g}, gathered exact {exact}", flush=True)
    return {"checked": checked, "failed": failures, "cut_by_budget": False}


def soak(mesh, calls: int) -> dict:
    M, K, N = ANCHOR_SHAPES[SOAK_SHAPE]
    x, w = measure.make_inputs("ag_matmul", local_shapes("ag_matmul", M, K, N, mesh.shape["tp"]), DTYPE, mesh)
    w2 = jax.device_put(w.T, NamedSharding(mesh, P("tp", None)))

    def pair(x, w, w2):
        h = ficco_jax.ag_matmul(x, w, "tp", schedule="dma/direct/c2")
        return ficco_jax.matmul_rs(h, w2, "tp", schedule="dma/direct/c2/grouped")

    f = jax.jit(jax.shard_map(pair, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)),
                              out_specs=P("tp", None)))
    first = f(x, w, w2).block_until_ready()
    mem = lambda: [(d.memory_stats() or {}).get("bytes_in_use", -1) for d in jax.local_devices()]  # noqa: E731
    out = f(x, w, w2).block_until_ready()  # from here on two results are alive: `first` and `out`
    samples, t0 = [mem()], time.time()
    for _ in range(4):
        for _ in range(calls // 4):
            out = f(x, w, w2)
        out.block_until_ready()
        samples.append(mem())
    dt = time.time() - t0
    return {"calls": calls, "shape": SOAK_SHAPE, "seconds": dt, "ms_per_pair": dt / max(calls, 1) * 1e3,
            "identical": bool(jnp.array_equal(out, first)), "bytes_in_use_per_quarter": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--budget-s", type=float, default=240.0, help="seconds for the correctness part")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/soak"))
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    checks = correctness(mesh, args.budget_s)
    print(f"correctness: {checks['checked']} (op, shape, schedule) checks, {len(checks['failed'])} failed", flush=True)
    run = soak(mesh, args.calls)
    print(f"soak: {run['calls']} ag_matmul+matmul_rs pairs in {run['seconds']:.1f} s "
          f"({run['ms_per_pair']:.3f} ms/pair); bytes in use per quarter: {run['bytes_in_use_per_quarter']}")
    passed = not checks["failed"] and run["identical"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as fh:
        json.dump({"correctness": checks, "soak": run, "passed": passed, "device": jax.devices()[0].device_kind,
                   "n_devices": mesh.shape["tp"], "commit": os.environ.get("FICCO_COMMIT")}, fh, indent=1)
    print(f"soak {'PASS' if passed else 'FAIL'}: {checks['checked']} checks, {len(checks['failed'])} failed, "
          f"{run['calls']} calls, last result identical to first: {run['identical']}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
