"""The expert-parallel ops: `a2a_matmul` (dispatch) and `matmul_a2a` (combine), their plain-JAX
references and their VJPs.

Call them inside `jax.shard_map` over a mesh axis of n devices that holds the experts (E_local
per device, n * E_local in all). Tokens are capacity-bucketed per expert, as in a MoE layer with
a fixed capacity C. Per device, with ``all_to_all = lax.all_to_all(., axis, 0, 0, tiled=True)``:

    a2a_matmul(x, w, axis)  == einsum("pecd,edf->pecf", all_to_all(x), w)
        x [n, E_local, C, d]: block p = the tokens this device routes to rank p's experts;
        w [E_local, d, f]: this device's experts. all_to_all(x)[p] = the tokens rank p routed to
        this device's experts, so out[p, e] = (tokens of rank p for my expert e) @ w[e].
    matmul_a2a(y, w, axis)  == all_to_all(einsum("pecf,efd->pecd", y, w))
        y [n, E_local, C, f]: block p = my experts' activations for rank p's tokens;
        w [E_local, f, d]. Each result block goes back to the rank its tokens came from:
        out[p, e] = rank p's expert e applied to the tokens this device routed to it.

The schedules cut the capacity C of each per-peer block into chunks and run each local expert's
matmul as its chunks land (dispatch), or send each finished chunk at once (combine); see
schedule.py for the design space, a2a_lowering.py for the xla steps and dma_a2a.py for the copy
engines.

The VJPs are overlapped too: the input gradient of the dispatch is a combine
(``matmul_a2a(g, w^T)``; all_to_all is its own inverse) and its weight gradient an einsum with
the received tokens; the input gradient of the combine is a dispatch of g whose received
tensor also feeds the combine's weight gradient.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax

from . import a2a_lowering, config
from .ops import ScheduleArg, _axis_size, _custom_vjp_pair, _like_primal, _varying_axes
from .ops import resolve_schedule as _resolve_explicit
from .schedule import Schedule, check_shapes

log = logging.getLogger("ficco_jax")

__all__ = ["a2a_matmul", "matmul_a2a", "a2a_matmul_ref", "matmul_a2a_ref", "resolve_schedule"]


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------
def a2a_matmul_ref(x, w, axis_name):
    """The meaning of `a2a_matmul`: ``einsum("pecd,edf->pecf", all_to_all(x, axis_name, 0, 0, tiled), w)``."""
    return jnp.einsum("pecd,edf->pecf", lax.all_to_all(x, axis_name, 0, 0, tiled=True), w)


def matmul_a2a_ref(y, w, axis_name):
    """The meaning of `matmul_a2a`: ``all_to_all(einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled)``."""
    return lax.all_to_all(jnp.einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled=True)


# ------------------------------------------------------------------------------------------------
# Public ops
# ------------------------------------------------------------------------------------------------
def a2a_matmul(x, w, axis_name: str, *, schedule: ScheduleArg = "auto", return_received: bool = False):
    """``einsum("pecd,edf->pecf", all_to_all(x, axis_name, 0, 0, tiled=True), w)``, overlapped.

    Per device: x [n, E_local, C, d], w [E_local, d, f] -> [n, E_local, C, f] (n = size of
    `axis_name`). With `return_received=True` also returns ``all_to_all(x)`` [n, E_local, C, d]
    (the tokens this device's experts received), so a caller that needs it moves nothing twice.
    `schedule`: "auto", a `Schedule` or its string ("xla/direct/c2", "dma/ring/c4/grouped").
    Differentiable; the backward pass is itself overlapped. `comm="dma"` takes bf16, f16, f32.
    """
    n = _axis_size(axis_name, "a2a_matmul")
    _check_operands("a2a_matmul", x, w)
    sched = resolve_schedule("a2a_matmul", schedule, (x.shape, w.shape), x.dtype, n)
    if return_received:
        return _a2a_matmul_received(x, w, axis_name, sched)
    return _a2a_matmul(x, w, axis_name, sched)


def matmul_a2a(y, w, axis_name: str, *, schedule: ScheduleArg = "auto"):
    """``all_to_all(einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled=True)``, overlapped.

    Per device: y [n, E_local, C, f], w [E_local, f, d] -> [n, E_local, C, d]. `schedule` as in
    `a2a_matmul`. Differentiable; the backward pass is itself overlapped.
    """
    n = _axis_size(axis_name, "matmul_a2a")
    _check_operands("matmul_a2a", y, w)
    sched = resolve_schedule("matmul_a2a", schedule, (y.shape, w.shape), y.dtype, n)
    return _matmul_a2a(y, w, axis_name, sched)


#: What ``schedule="auto"`` runs on GPUs until the cost model covers the expert-parallel ops:
#: every peer block at once (the per-peer blocks of a MoE layer are small, so one chunk), on
#: copy engines where the extension is built, else as XLA ppermutes.
AUTO_DMA = Schedule(comm="dma", order="direct", chunks=1, copy_streams=1)
AUTO_XLA = Schedule(comm="xla", order="direct", chunks=1)


def resolve_schedule(op: str, schedule: ScheduleArg, shapes, dtype, axis_size: int) -> Schedule:
    """Turn the user's `schedule` argument into a valid Schedule for `op` (trace time)."""
    check_shapes(op, shapes, axis_size)
    if isinstance(schedule, str) and schedule in ("auto", "autotune"):
        return _auto(op, shapes, dtype, axis_size, schedule)
    chosen = _resolve_explicit(op, schedule, shapes, dtype, axis_size)
    if chosen.comm == "dma":
        _check_dma_dtype(op, dtype)
    return chosen


def _auto(op, shapes, dtype, axis_size, how) -> Schedule:
    from . import heuristics

    if how == "autotune":
        log.info("%s: schedule='autotune' is not implemented for the expert-parallel ops; using 'auto'", op)
    if jax.default_backend() == "cpu" or axis_size == 1:
        return Schedule(comm="none")  # host "collectives" block the host thread: nothing to overlap
    if "dma" in heuristics.available_comms() and jnp.dtype(dtype).name in config.DMA_DTYPES:
        streams = max(s for s in config.COPY_STREAM_CHOICES if s <= axis_size - 1)
        return AUTO_DMA.replace(copy_streams=streams)
    return AUTO_XLA


def _check_dma_dtype(op, dtype):
    name = jnp.dtype(dtype).name
    if name not in config.DMA_DTYPES:
        raise TypeError(f"{op}: comm='dma' handles dtypes {config.DMA_DTYPES}, found {name}; "
                        f"cast the operands or use comm='xla'")


def _check_operands(op: str, a, w) -> None:
    names = ("x", "w") if op == "a2a_matmul" else ("y", "w")
    for name, v in zip(names, (a, w)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must be a floating-point array, found dtype {v.dtype}")
    if a.dtype != w.dtype:
        raise TypeError(f"{op}: {names[0]} and w must have the same dtype, found {a.dtype} and {w.dtype}; "
                        f"cast one of them (e.g. w.astype({names[0]}.dtype))")


# ------------------------------------------------------------------------------------------------
# Private positional ops carrying the custom VJPs
# ------------------------------------------------------------------------------------------------
def _a2a_matmul_backward(axis_name, sched, res, g_out, g_received):
    received, w = res
    n = _axis_size(axis_name, "a2a_matmul")
    w_t = jnp.swapaxes(w, 1, 2)  # [E, f, d]
    bwd = _transposed_schedule("matmul_a2a", sched, (g_out.shape, w_t.shape), g_out.dtype, n)
    # d x = all_to_all(g @ w^T (+ g_received)): the all_to_all rides on the expert matmuls.
    dx = _matmul_a2a(g_out, w_t, axis_name, bwd)
    if g_received is not None:
        dx = dx + lax.all_to_all(g_received, axis_name, 0, 0, tiled=True)
    dw = jnp.einsum("pecd,pecf->edf", received, g_out)
    x_axes = _varying_axes(received) | {axis_name}
    return _like_primal(dx, received.dtype, x_axes), _like_primal(dw, w.dtype, _varying_axes(w))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_a2a(y, w, axis_name, sched):
    return _matmul_a2a_impl(y, w, axis_name, sched)


def _matmul_a2a_fwd(y, w, axis_name, sched):
    return _matmul_a2a_impl(y, w, axis_name, sched), (y, w)


def _matmul_a2a_bwd(axis_name, sched, res, g):
    y, w = res
    n = _axis_size(axis_name, "matmul_a2a")
    w_t = jnp.swapaxes(w, 1, 2)  # [E, d, f]
    bwd = _transposed_schedule("a2a_matmul", sched, (g.shape, w_t.shape), g.dtype, n)
    # d y = all_to_all(g) @ w^T; the received g is reused for d w = y^T @ all_to_all(g).
    dy, g_received = _a2a_matmul_received(g, w_t, axis_name, bwd)
    dw = jnp.einsum("pecf,pecd->efd", y, g_received)
    return _like_primal(dy, y.dtype, _varying_axes(y)), _like_primal(dw, w.dtype, _varying_axes(w))


_matmul_a2a.defvjp(_matmul_a2a_fwd, _matmul_a2a_bwd)


def _a2a_matmul_impl(x, w, axis_name, sched, side_needed=True):
    if sched.comm == "dma":
        from . import dma_a2a

        return dma_a2a.a2a_matmul_dma(x, w, axis_name, sched, received_needed=side_needed)
    return a2a_lowering.a2a_matmul(x, w, axis_name, sched, _axis_size(axis_name, "a2a_matmul"))


# a2a_matmul returning out, and (out, received) when the received tokens have other users.
_a2a_matmul, _a2a_matmul_received = _custom_vjp_pair(_a2a_matmul_impl, _a2a_matmul_backward, "_a2a_matmul",
                                                      "_a2a_matmul_received")


def _matmul_a2a_impl(y, w, axis_name, sched):
    if sched.comm == "dma":
        from . import dma_a2a

        return dma_a2a.matmul_a2a_dma(y, w, axis_name, sched)
    return a2a_lowering.matmul_a2a(y, w, axis_name, sched, _axis_size(axis_name, "matmul_a2a"))


def _transposed_schedule(op, sched: Schedule, shapes, dtype, n) -> Schedule:
    """The backward op runs the forward's schedule (both ops share one design space), else auto."""
    try:
        return resolve_schedule(op, sched, shapes, dtype, n)
    except (ValueError, TypeError):
        return resolve_schedule(op, "auto", shapes, dtype, n)
