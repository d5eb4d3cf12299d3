"""One schedule resolution for every op: the user's `schedule` argument ("auto", "autotune", a
`Schedule` or its string form) becomes a valid Schedule for this call, at trace time."""
from __future__ import annotations

import logging
from typing import Callable

import jax.numpy as jnp

from ..lowering import dma
from ..runtime import topology
from ..schedule import Schedule, as_schedule, check_shapes
from ..tuning import policy, select
from .core import ScheduleArg

log = logging.getLogger("ficco_jax")


def resolve_schedule(op: str, schedule: ScheduleArg, shapes, dtype, axis_size: int, *,
                     axis_name: str | None = None, mesh=None, measure: Callable | None = None,
                     out_dtype=None) -> Schedule:
    """Turn the user's `schedule` argument into a valid Schedule for this call (trace time).

    `axis_name` locates the peers (topology.for_axis, in `mesh` if given, else in the
    `jax.set_mesh` context): "auto" avoids comm="dma" where they are not all in this process, and an
    explicit comm="dma" there is an error. Without them, a multi-process program counts the peers
    as remote for "auto". `measure` times a candidate for "autotune" (ops.measure.time_op).
    `dtype` is the operands' dtype, `out_dtype` the matmuls' result dtype (None: the same)."""
    check_shapes(op, shapes, axis_size)
    site = topology.for_axis(axis_name, mesh)
    if isinstance(schedule, str) and schedule in ("auto", "autotune"):
        chosen = policy.choose(op, shapes, dtype, axis_size, autotune=(schedule == "autotune"), topology=site,
                               measure=measure, out_dtype=out_dtype)
        log.debug("%s %s %s: schedule %s", op, shapes, jnp.dtype(dtype).name, chosen)
        return chosen
    schedule = as_schedule(op, schedule, "'auto', 'autotune', a ficco_jax.Schedule or its string form")
    schedule.validate(op, shapes, axis_size)
    if schedule.comm == "dma":
        dma.check_supported(op, dtype, out_dtype)
        # Unknown sites pass here; dma's lowering checks the real mesh. Groups across processes
        # of one host run through CUDA IPC where the build and platform have it.
        if site.spanning_groups() and not select.dma_reaches(site):
            raise ValueError(topology.dma_refusal(op, site))
    return schedule


def on_xla(sched: Schedule) -> Schedule:
    """The steps of copy-engine schedule `sched` as XLA's collectives run them (comm="xla"): for a
    call whose numerics the executor lacks (f32 products rounded to bf16 partials). XLA's
    collectives move row chunks, so column chunks (gemm="columns") become as many row chunks."""
    gemm = "per_chunk" if sched.gemm == "columns" else sched.gemm
    return sched.replace(comm="xla", copy_streams=1, transfer="pull", gemm=gemm)


def transposed_schedule(op: str, sched: Schedule, shapes, dtype, n: int, out_dtype=None) -> Schedule:
    """The schedule of a backward op: the forward's where that point is valid for it (both ops of a
    pair share one design space), else auto. matmul_rs on copy engines is direct-only: there a
    ring schedule keeps its copy engines and changes its order. A backward whose numerics copy
    engines lack (the bf16 partials of a mixed-precision backward) runs the same steps on XLA's
    collectives. Column chunks are a reduce-scatter's (Schedule.for_op): the gather op's backward
    keeps the chunk count, cutting rows."""
    sched = sched.for_op(op)
    candidates = [sched]
    if sched.comm == "dma" and op == "matmul_rs":
        candidates.append(sched.replace(order="direct"))
    if sched.comm == "dma":
        candidates.append(on_xla(sched))
    for candidate in candidates:
        try:
            return resolve_schedule(op, candidate, shapes, dtype, n, out_dtype=out_dtype)
        except (ValueError, TypeError):
            pass
    return resolve_schedule(op, "auto", shapes, dtype, n, out_dtype=out_dtype)
