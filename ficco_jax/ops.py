"""The overlapped ops: `ag_matmul` and `matmul_rs`, their plain-JAX references and their VJPs.

Call them inside `jax.shard_map`. Each equals its reference for every schedule:

    ag_matmul(x, w, "tp")  == jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w
    matmul_rs(y, w, "tp")  == jax.lax.psum_scatter(y @ w, "tp", scatter_dimension=0, tiled=True)

The VJPs are overlapped too: the input gradient of `ag_matmul` is a `matmul_rs` (of the output
gradient with w transposed) and its weight gradient a local matmul with the gathered input; the
input gradient of `matmul_rs` is an `ag_matmul` whose gathered output gradient also feeds the
weight gradient.
"""
from __future__ import annotations

import functools
import logging
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import xla_lowering
from .schedule import Schedule, check_shapes

log = logging.getLogger("ficco_jax")

ScheduleArg = Union[str, Schedule]


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------
def ag_matmul_ref(x, w, axis_name):
    """The meaning of `ag_matmul`: `all_gather(x, axis_name, axis=0, tiled=True) @ w`."""
    return lax.all_gather(x, axis_name, axis=0, tiled=True) @ w


def matmul_rs_ref(y, w, axis_name):
    """The meaning of `matmul_rs`: `psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`."""
    return lax.psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)


# ------------------------------------------------------------------------------------------------
# Public ops
# ------------------------------------------------------------------------------------------------
def ag_matmul(x, w, axis_name: str, *, schedule: ScheduleArg = "auto", return_gathered: bool = False):
    """`all_gather(x, axis_name, axis=0, tiled=True) @ w`, overlapped by a FiCCO schedule.

    Per device: x [m, K], w [K, N] -> [n*m, N] (n = size of `axis_name`). With
    `return_gathered=True` also returns the gathered x [n*m, K], so a caller that needs it gathers
    nothing twice. `schedule` is "auto" (the cost model's pick), "autotune" (measured once, then
    cached), a `Schedule`, or its string form ("dma/direct/c4/s2"). Differentiable; the backward
    pass is itself overlapped. dtypes: any float; `comm="dma"` takes bf16, f16 and f32.
    """
    n = _axis_size(axis_name, "ag_matmul")
    _check_operands("ag_matmul", x, w)
    if not isinstance(return_gathered, (bool, np.bool_)):
        raise TypeError(f"ag_matmul: return_gathered must be a bool, found {return_gathered!r}")
    sched = resolve_schedule("ag_matmul", schedule, (x.shape, w.shape), x.dtype, n, axis_name=axis_name)
    if return_gathered:
        return _ag_matmul_gathered(x, w, axis_name, sched)
    return _ag_matmul(x, w, axis_name, sched)


def matmul_rs(y, w, axis_name: str, *, schedule: ScheduleArg = "auto"):
    """`psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`, overlapped by a FiCCO schedule.

    Per device: y [M, N], w [N, K] -> [M/n, K] (n = size of `axis_name`; M must divide by n).
    `schedule` as in `ag_matmul`. Differentiable; the backward pass is itself overlapped.
    """
    n = _axis_size(axis_name, "matmul_rs")
    _check_operands("matmul_rs", y, w)
    sched = resolve_schedule("matmul_rs", schedule, (y.shape, w.shape), y.dtype, n, axis_name=axis_name)
    return _matmul_rs(y, w, axis_name, sched)


def resolve_schedule(op: str, schedule: ScheduleArg, shapes, dtype, axis_size: int, *,
                     axis_name: str | None = None, mesh=None) -> Schedule:
    """Turn the user's `schedule` argument into a valid Schedule for this call (trace time).

    `axis_name` locates the peers (topology.for_axis, in `mesh` if given, else in the
    `jax.set_mesh` context): "auto" avoids comm="dma" where they are not all in this process, and an
    explicit comm="dma" there is an error. Without them, a multi-process program counts the peers
    as remote for "auto"."""
    from . import heuristics  # heuristics imports the cost model; keep ops importable without it
    from . import topology

    check_shapes(op, shapes, axis_size)
    site = topology.for_axis(axis_name, mesh)
    if isinstance(schedule, str) and schedule in ("auto", "autotune"):
        chosen = heuristics.choose(op, shapes, dtype, axis_size, autotune=(schedule == "autotune"), topology=site)
        log.debug("%s %s %s: schedule %s", op, shapes, jnp.dtype(dtype).name, chosen)
        return chosen
    if isinstance(schedule, str):
        schedule = Schedule.parse(schedule)
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"{op}: schedule must be 'auto', 'autotune', a ficco_jax.Schedule or its string form; "
            f"found {type(schedule).__name__}"
        )
    schedule.validate(op, shapes, axis_size)
    if schedule.comm == "dma":
        from . import dma

        dma.check_supported(op, dtype)
        # Unknown sites pass here; dma's lowering checks the real mesh. Groups across processes
        # of one host run through CUDA IPC where the build and platform have it.
        if site.spanning_groups() and not heuristics.dma_reaches(site):
            raise ValueError(topology.dma_refusal(op, site))
    return schedule


# ------------------------------------------------------------------------------------------------
# Private positional ops carrying the custom VJPs
# ------------------------------------------------------------------------------------------------
def _custom_vjp_pair(impl, backward, name: str, name_with_side: str):
    """Two positional custom-VJP forms of an op whose `impl(x, w, axis_name, sched, side_needed=True)`
    returns (out, side); with side_needed=False the side output may be left incomplete. `name`
    returns out only (its primal passes side_needed=False; its forward rule keeps the side as the
    residual), so the common use carries no cotangent for the side output and its backward pass no
    collective for it; `name_with_side` returns both.
    `backward(axis_name, sched, (side, w), g_out, g_side)` gets g_side None for the first."""

    def only_out(x, w, axis_name, sched):  # the primal alone: nobody reads the side output
        return impl(x, w, axis_name, sched, side_needed=False)[0]

    def both(x, w, axis_name, sched):
        return impl(x, w, axis_name, sched)

    only_out.__name__ = only_out.__qualname__ = name
    both.__name__ = both.__qualname__ = name_with_side
    only_out = jax.custom_vjp(only_out, nondiff_argnums=(2, 3))
    both = jax.custom_vjp(both, nondiff_argnums=(2, 3))

    def fwd_only_out(x, w, axis_name, sched):
        out, side = impl(x, w, axis_name, sched)
        return out, (side, w)

    def fwd_both(x, w, axis_name, sched):
        out, side = impl(x, w, axis_name, sched)
        return (out, side), (side, w)

    only_out.defvjp(fwd_only_out, lambda axis_name, sched, res, g_out: backward(axis_name, sched, res, g_out, None))
    both.defvjp(fwd_both, lambda axis_name, sched, res, cotangents: backward(axis_name, sched, res, *cotangents))
    return only_out, both


def _ag_matmul_backward(axis_name, sched, res, g_out, g_gathered):
    gathered, w = res
    n = _axis_size(axis_name, "ag_matmul")
    w_t = w.T
    bwd_sched = _transposed_schedule("matmul_rs", sched, (g_out.shape, w_t.shape), g_out.dtype, n)
    # d x = reduce_scatter(g_out @ w.T + g_gathered): the reduce-scatter rides on the matmul.
    dx = _matmul_rs(g_out, w_t, axis_name, bwd_sched)
    if g_gathered is not None:
        dx = dx + lax.psum_scatter(g_gathered, axis_name, scatter_dimension=0, tiled=True)
    dw = gathered.T @ g_out
    return (_like_primal(dx, gathered.dtype, _gathered_input_axes(gathered, axis_name)),
            _like_primal(dw, w.dtype, _varying_axes(w)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_rs(y, w, axis_name, sched):
    return _matmul_rs_impl(y, w, axis_name, sched)


def _matmul_rs_fwd(y, w, axis_name, sched):
    return _matmul_rs_impl(y, w, axis_name, sched), (y, w)


def _matmul_rs_bwd(axis_name, sched, res, g):
    y, w = res
    n = _axis_size(axis_name, "matmul_rs")
    w_t = w.T
    bwd_sched = _transposed_schedule("ag_matmul", sched, (g.shape, w_t.shape), g.dtype, n)
    # d y = all_gather(g) @ w.T; the gathered g is reused for d w = y.T @ all_gather(g).
    dy, g_gathered = _ag_matmul_gathered(g, w_t, axis_name, bwd_sched)
    dw = y.T @ g_gathered
    return _like_primal(dy, y.dtype, _varying_axes(y)), _like_primal(dw, w.dtype, _varying_axes(w))


_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


def _ag_matmul_impl(x, w, axis_name, sched, side_needed=True):
    if sched.comm == "dma":
        from . import dma

        return dma.ag_matmul_dma(x, w, axis_name, sched, gathered_needed=side_needed)
    return xla_lowering.ag_matmul(x, w, axis_name, sched, _axis_size(axis_name, "ag_matmul"))


# ag_matmul returning out, and (out, gathered) when the gathered tensor has other users.
_ag_matmul, _ag_matmul_gathered = _custom_vjp_pair(_ag_matmul_impl, _ag_matmul_backward, "_ag_matmul",
                                                   "_ag_matmul_gathered")


def _matmul_rs_impl(y, w, axis_name, sched):
    if sched.comm == "dma":
        from . import dma

        return dma.matmul_rs_dma(y, w, axis_name, sched)
    return xla_lowering.matmul_rs(y, w, axis_name, sched, _axis_size(axis_name, "matmul_rs"))


def _transposed_schedule(op, sched: Schedule, shapes, dtype, n) -> Schedule:
    """The backward op runs the forward's schedule where that point is valid for it, else auto."""
    try:
        return resolve_schedule(op, sched, shapes, dtype, n)
    except (ValueError, TypeError):
        pass
    if sched.comm == "dma" and op == "matmul_rs":
        try:  # matmul_rs on copy engines is direct-only: keep the copy engines, change the order
            return resolve_schedule(op, sched.replace(order="direct"), shapes, dtype, n)
        except (ValueError, TypeError):
            pass
    return resolve_schedule(op, "auto", shapes, dtype, n)


def _varying_axes(v) -> frozenset:
    """Mesh axes along which `v` varies inside shard_map (empty outside it, or on old JAX)."""
    aval = jax.typeof(v)
    vma = getattr(aval, "vma", None)  # jax < 0.10
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _gathered_input_axes(gathered, axis_name) -> frozenset:
    """x varied along the gather axis and along every axis its gathered form varies on."""
    return _varying_axes(gathered) | {axis_name}


def _like_primal(ct, dtype, primal_axes: frozenset):
    """Cast a cotangent to its primal's dtype and sum it over mesh axes the primal was
    replicated on: what JAX's own AD does when a replicated operand meets a varying one."""
    extra = tuple(sorted(_varying_axes(ct) - primal_axes))
    if extra:
        ct = lax.psum(ct, extra)
    return ct.astype(dtype)



# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------
def _axis_size(axis_name, op: str) -> int:
    if not isinstance(axis_name, str):
        raise TypeError(
            f"{op}: axis_name must be one mesh axis name (a str), found {axis_name!r}; "
            f"ops over several mesh axes are not supported yet"
        )
    try:
        return int(lax.axis_size(axis_name))
    except NameError as exc:
        raise ValueError(
            f"{op}: axis {axis_name!r} is not bound here; call {op} inside jax.shard_map over a mesh "
            f"with that axis ({exc})"
        ) from exc


def _check_operands(op: str, a, w) -> None:
    names = ("x", "w") if op == "ag_matmul" else ("y", "w")
    for name, v in zip(names, (a, w)):
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise TypeError(
                f"{op}: {name} must be a jax or numpy array, found {type(v).__name__}; wrap it in jnp.asarray"
            )
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(
                f"{op}: {name} must be a floating-point array, found dtype {v.dtype}; "
                f"cast it, e.g. {name}.astype(jnp.bfloat16)"
            )
    if a.dtype != w.dtype:
        raise TypeError(
            f"{op}: {names[0]} and w must have the same dtype, found {a.dtype} and {w.dtype}; "
            f"cast one of them (e.g. w.astype({names[0]}.dtype))"
        )
