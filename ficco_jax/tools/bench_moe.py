"""`bench` for the expert-parallel ops (a2a_matmul, matmul_a2a): a MoE layer's dispatch and combine.

A MoE shape is (T tokens per device, d model, f expert hidden, E experts, k experts per token).
With n devices holding E/n experts each and capacity factor 1, every (peer, local expert) block
holds C = T*k/E tokens, so per device:

    dispatch  a2a_matmul:  x [n, E/n, C, d] @ w [E/n, d, f] after all_to_all -> [n, E/n, C, f]
    combine   matmul_a2a:  y [n, E/n, C, f] @ w [E/n, f, d] then all_to_all -> [n, E/n, C, d]

Variants side by side, as in bench.py: JAX sequential (`lax.all_to_all` + einsum), the listed
ficco_jax schedules, the expert matmuls alone, the all-to-all alone and the ideal bound.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..ops import measure
from ..ops import resolve_schedule
from ..ops.measure import op_body, sharded
from ..tuning import timing
from .harness import Row, listed_schedules, verify_then_time

#: Mixtral-8x7B-like layer on 4 GPUs: hidden 4096, ffn 14336, 8 experts, top-2, 8192 tokens per GPU.
GPU_SHAPES = {"mixtral_8x7b_T8k": (8192, 4096, 14336, 8, 2)}
CPU_SHAPES = {"tiny_moe_T64": (64, 32, 48, 8, 2)}


def local_shapes(op, T, d, f, E, k, n):
    """Per-device (input, weight) shapes of the dispatch or combine of a MoE layer."""
    if E % n or (T * k) % E:
        raise ValueError(f"bench: E={E} experts must divide over {n} devices and T*k={T * k} over E")
    e_local, c = E // n, T * k // E
    if op == "a2a_matmul":
        return (n, e_local, c, d), (e_local, d, f)
    return (n, e_local, c, f), (e_local, f, d)


def make_inputs(op, T, d, f, E, k, dtype, mesh, seed=0):
    """Random global operands (never zeros) of a MoE layer's dispatch or combine, sharded over "tp"."""
    return measure.make_inputs(op, local_shapes(op, T, d, f, E, k, mesh.shape["tp"]), dtype, mesh, seed=seed)


def bench_shape(op, name, dims, dtype, mesh, schedules, progress) -> list[Row]:
    T, d, f, E, k = dims
    n = mesh.shape["tp"]
    shapes = local_shapes(op, *dims, n)
    args = make_inputs(op, *dims, dtype, mesh)
    want = sharded(mesh, op, op_body(op, "ref"))(*[a.astype(jnp.float32) for a in args])
    selected = resolve_schedule(op, "auto", shapes, dtype, n)
    variants = [("jax_seq", "ref")] + [(f"ficco:{s}", s) for s in schedules]
    if selected not in schedules:
        variants.append((f"ficco:{selected}", selected))
    rows = []
    for label, sched in variants:
        progress(f"{op} {name} {label}")
        row = Row(op, name, T, d, f, label, selected=(sched == selected), extra={"experts": E, "top_k": k})
        rows.append(verify_then_time(row, lambda r, sched=sched: sharded(mesh, op, op_body(op, sched), r),
                                     args, want, dtype))
    return rows + _bounds(op, name, dims, shapes, dtype, mesh, progress)


def _bounds(op, name, dims, shapes, dtype, mesh, progress) -> list[Row]:
    """The expert matmuls alone (one device), the all-to-all alone, and the ideal max of the two."""
    T, d, f, E, k = dims
    (a_shape, w_shape) = shapes
    dev = mesh.devices.flat[0]
    key = jax.random.PRNGKey(1)
    a = jax.device_put(jax.random.normal(key, a_shape, jnp.float32).astype(dtype), dev)
    w = jax.device_put(jax.random.normal(key, w_shape, jnp.float32).astype(dtype), dev)
    progress(f"{op} {name} gemm_alone")
    gemm = timing.device_time(lambda r: jax.jit(timing.chain(lambda a, w: jnp.einsum("pecd,edf->pecf", a, w), r)), (a, w))
    moved = a_shape if op == "a2a_matmul" else (*a_shape[:3], w_shape[2])  # combine moves its result
    n = mesh.shape["tp"]
    x = jax.device_put(jnp.ones((n * moved[0], *moved[1:]), dtype) * 0.5, NamedSharding(mesh, P("tp")))
    body = lambda v: jax.lax.all_to_all(v, "tp", 0, 0, tiled=True)
    progress(f"{op} {name} collective_alone")
    make = lambda r: jax.jit(jax.shard_map(timing.chain(body, r), mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp")))
    coll = timing.device_time(make, (x,))
    extra = {"experts": E, "top_k": k}
    rows = [Row(op, name, T, d, f, "gemm_alone", gemm["median_s"] * 1e3, gemm["spread_s"] * 1e3, extra=extra),
            Row(op, name, T, d, f, "collective_alone", coll["median_s"] * 1e3, coll["spread_s"] * 1e3, extra=extra)]
    rows.append(Row(op, name, T, d, f, "ideal", max(r.median_ms for r in rows),
                    note="max(gemm_alone, collective_alone)", extra=extra))
    return rows


def plan(op, shapes, schedules_arg, n, comms):
    """[(op, name, dims, schedules)] for `bench.run`, without the schedules that do not fit a shape."""
    out = []
    for name, dims in shapes.items():
        fits = []
        for s in listed_schedules(op, schedules_arg, n, comms):
            try:
                s.validate(op, local_shapes(op, *dims, n), n)
                fits.append(s)
            except ValueError:
                pass
        out.append((op, name, dims, [s for s in fits if s.comm != "none"]))
    return out
