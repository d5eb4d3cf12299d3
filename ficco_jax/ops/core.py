"""What every op shares: its axis, its operand checks, the generic custom-VJP form with an optional
side output, and how cotangents are made to look like their primals under shard_map."""
from __future__ import annotations

from typing import Callable, Union

import jax
import jax.numpy as jnp
from jax import lax

from ..schedule import Schedule

ScheduleArg = Union[str, Schedule]

#: The operand names of each op, as its signature and its error messages say them.
OPERAND_NAMES = {"ag_matmul": ("x", "w"), "matmul_rs": ("y", "w"), "a2a_matmul": ("x", "w"), "matmul_a2a": ("y", "w")}


def axis_size(axis_name, op: str) -> int:
    """The size of mesh axis `axis_name`, which must be bound (inside jax.shard_map)."""
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


def check_operands(op: str, a, w) -> None:
    """Both operands arrays of one floating-point dtype."""
    names = OPERAND_NAMES[op]
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


def custom_vjp_pair(impl: Callable, backward: Callable, name: str, name_with_side: str):
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


def custom_vjp_plain(impl: Callable, backward: Callable, name: str):
    """The positional custom-VJP form of an op without a side output: `impl(y, w, axis_name, sched)`
    -> out, `backward(axis_name, sched, (y, w), g)` -> (dy, dw)."""

    def primal(y, w, axis_name, sched):
        return impl(y, w, axis_name, sched)

    primal.__name__ = primal.__qualname__ = name
    primal = jax.custom_vjp(primal, nondiff_argnums=(2, 3))
    primal.defvjp(lambda y, w, axis_name, sched: (impl(y, w, axis_name, sched), (y, w)), backward)
    return primal


def varying_axes(v) -> frozenset:
    """Mesh axes along which `v` varies inside shard_map (empty outside it, or on old JAX)."""
    aval = jax.typeof(v)
    vma = getattr(aval, "vma", None)  # jax < 0.10
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def like_primal(ct, dtype, primal_axes: frozenset):
    """Cast a cotangent to its primal's dtype and sum it over mesh axes the primal was
    replicated on: what JAX's own AD does when a replicated operand meets a varying one."""
    extra = tuple(sorted(varying_axes(ct) - primal_axes))
    if extra:
        ct = lax.psum(ct, extra)
    return ct.astype(dtype)
