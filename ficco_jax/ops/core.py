"""What every op shares: its axis, its operand checks, the generic custom-JVP forms (with an
optional side output), and how cotangents are made to look like their primals under shard_map."""
from __future__ import annotations

from typing import Callable, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .. import config
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


def check_out_dtype(op: str, out_dtype, operand_dtype):
    """`out_dtype` as a numpy dtype: None means the operands' dtype; else a floating-point dtype."""
    if out_dtype is None:
        return None
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError as exc:
        raise TypeError(f"{op}: out_dtype must be a dtype such as jnp.float32, found {out_dtype!r}") from exc
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: out_dtype must be a floating-point dtype (e.g. jnp.float32), found {dtype}")
    return None if dtype == jnp.dtype(operand_dtype) else dtype


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
        if config.is_fp8(v.dtype):  # ag_matmul / matmul_rs route FP8 to ops/scaled.py
            raise TypeError(
                f"{op}: FP8 operands are taken by ag_matmul and matmul_rs (with x_scale= and w_scale=); {op} takes "
                f"bf16, f16 or f32: dequantize {name} first, e.g. {name}.astype(jnp.bfloat16) * scale"
            )
    if a.dtype != w.dtype:
        raise TypeError(
            f"{op}: {names[0]} and w must have the same dtype, found {a.dtype} and {w.dtype}; "
            f"cast one of them (e.g. w.astype({names[0]}.dtype))"
        )


def _present(t):
    """A tangent, or None where it is a symbolic zero."""
    return None if isinstance(t, SymbolicZero) else t


def _zero_where_none(t, like):
    return SymbolicZero(jax.typeof(like).to_tangent_aval()) if t is None else t


def custom_jvp_pair(impl: Callable, tangent: Callable, name: str, name_with_side: str):
    """Two positional forms (x, w, axis_name, sched, out_dtype) of a gather op whose
    `impl(x, w, axis_name, sched, out_dtype, side_needed=True)` returns (out, side); with
    side_needed=False the side output may be left incomplete. `name` returns out only (its primal
    passes side_needed=False; differentiated, its forward computes the side in full, the weight's
    tangent and gradient read it); `name_with_side` returns both.

    Both are custom JVPs: `tangent(static, (x, w), (out, side), (dx, dw), with_side)` returns the
    tangent of out (and of side when with_side; None = zero) as one transposable equation
    (ops/linear.py), so the forms are differentiable in forward and in reverse mode; dx or dw is
    None where it is zero; `static` is (axis_name, sched, out_dtype)."""

    def only_out(x, w, axis_name, sched, out_dtype):  # the primal alone: nobody reads the side output
        return impl(x, w, axis_name, sched, out_dtype, side_needed=False)[0]

    def both(x, w, axis_name, sched, out_dtype):
        return impl(x, w, axis_name, sched, out_dtype)

    only_out.__name__ = only_out.__qualname__ = name
    both.__name__ = both.__qualname__ = name_with_side
    only_out = jax.custom_jvp(only_out, nondiff_argnums=_STATIC)
    both = jax.custom_jvp(both, nondiff_argnums=_STATIC)

    def rule(with_side: bool):
        def jvp(axis_name, sched, out_dtype, primals, tangents):
            x, w = primals
            dx, dw = map(_present, tangents)
            # Differentiated, the forward delivers the side output in full, as a residual would be.
            out, side = both(x, w, axis_name, sched, out_dtype)
            t_out, t_side = tangent((axis_name, sched, out_dtype), (x, w), (out, side), (dx, dw), with_side)
            if with_side:
                return (out, side), (_zero_where_none(t_out, out), _zero_where_none(t_side, side))
            return out, _zero_where_none(t_out, out)
        return jvp

    only_out.defjvp(rule(False), symbolic_zeros=True)
    both.defjvp(rule(True), symbolic_zeros=True)
    return only_out, both


def custom_jvp_plain(impl: Callable, tangent: Callable, name: str):
    """The positional form (y, w, axis_name, sched, out_dtype) of an op without a side output:
    `impl(y, w, axis_name, sched, out_dtype)` -> out, `tangent(static, (y, w), out, (dy, dw))` ->
    the tangent of out as one transposable equation (dy or dw None where it is zero)."""

    def primal(y, w, axis_name, sched, out_dtype):
        return impl(y, w, axis_name, sched, out_dtype)

    primal.__name__ = primal.__qualname__ = name
    primal = jax.custom_jvp(primal, nondiff_argnums=_STATIC)

    def jvp(axis_name, sched, out_dtype, primals, tangents):
        out = primal(*primals, axis_name, sched, out_dtype)
        t_out = tangent((axis_name, sched, out_dtype), primals, out, tuple(map(_present, tangents)))
        return out, _zero_where_none(t_out, out)

    primal.defjvp(jvp, symbolic_zeros=True)
    return primal


# The static arguments of every positional form: axis_name, sched, out_dtype.
_STATIC = (2, 3, 4)


def varying_axes(v) -> frozenset:
    """Mesh axes along which `v` varies inside shard_map (empty outside it, or on old JAX)."""
    return _aval_axes(jax.typeof(v))


def _aval_axes(aval) -> frozenset:
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


def like_aval(ct, aval):
    """`like_primal` for an operand known by its abstract value (a transpose rule's view)."""
    return like_primal(ct, aval.dtype, _aval_axes(aval))
