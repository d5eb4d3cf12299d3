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
from jax.sharding import PartitionSpec as P

from ..ops import measure, resolve_schedule
from ..ops.measure import op_body
from . import harness
from .harness import Row, bound_rows, fitting_schedules, listed_schedules, verify_then_time_each

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


def variants(op, shapes, dtype, n, schedules) -> tuple[list, object]:
    """([(label, schedule)], auto's pick) of one (op, per-device shapes): JAX sequential, the listed
    schedules and the schedule "auto" resolves to, each once."""
    selected = resolve_schedule(op, "auto", shapes, dtype, n)
    out = [("jax_seq", "ref")] + [(f"ficco:{s}", s) for s in schedules]
    if selected not in schedules:
        out.append((f"ficco:{selected}", selected))
    return out, selected


def bench_shape(op, name, dims, dtype, mesh, schedules, progress, rounds: int = 1, unfit=()) -> list[Row]:
    """The rows of one (op, MoE shape): JAX sequential, the listed schedules and auto's pick, each
    verified then timed, and the bounds; with `rounds` > 1 every one of them timed that many times
    in all, interleaved (`harness.retime_case`); then a row saying why for each listed schedule that
    does not fit the shape (`unfit`: `harness.fitting_schedules`)."""
    T, d, f, E, k = dims
    n = mesh.shape["tp"]
    shapes = local_shapes(op, *dims, n)
    args = measure.make_inputs(op, shapes, dtype, mesh)
    listed, selected = variants(op, shapes, dtype, n, schedules)
    extra = {"experts": E, "top_k": k}
    rows = [(Row(op, name, T, d, f, label, selected=(sched == selected), extra=dict(extra)), sched)
            for label, sched in listed]
    timers = harness.variant_timers(verify_then_time_each(rows, mesh, args, dtype, progress, body_of=op_body), args)
    case = [row for row, _ in rows] + _bounds(op, name, dims, shapes, dtype, mesh, progress, timers)
    if rounds > 1:
        harness.retime_case(case, timers, rounds - 1, progress)
    return case + harness.unfit_rows(Row(op, name, T, d, f, "", extra=dict(extra)), unfit)


def _bounds(op, name, dims, shapes, dtype, mesh, progress, timers=None) -> list[Row]:
    """The expert matmuls alone (every device at once), the all-to-all alone, and the ideal max of the two."""
    T, d, f, E, k = dims
    a_shape, w_shape = shapes
    moved = a_shape if op == "a2a_matmul" else (*a_shape[:3], w_shape[2])  # combine moves its result
    n = mesh.shape["tp"]
    return bound_rows(Row(op, name, T, d, f, "", extra={"experts": E, "top_k": k}), mesh, dtype, progress,
                      gemm=lambda a, w: jnp.einsum("pecd,edf->pecf", a, w), gemm_shapes=shapes,
                      collective=lambda v: jax.lax.all_to_all(v, "tp", 0, 0, tiled=True),
                      collective_shape=(n * moved[0], *moved[1:]), spec=P("tp"), timers=timers)


def plan(op, shapes, schedules_arg, n, comms):
    """[(op, name, dims, schedules, unfit)] for `bench.run`: the listed schedules that fit each shape,
    and (schedule, why not) for those that do not (`harness.fitting_schedules`)."""
    listed = listed_schedules(op, schedules_arg, n, comms)
    return [(op, name, dims, *fitting_schedules(op, listed, local_shapes(op, *dims, n), n))
            for name, dims in shapes.items()]
