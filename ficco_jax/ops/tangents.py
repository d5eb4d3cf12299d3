"""The tangent maps of one pair of ops, as `LinearMap`s (ops/linear.py). Each op is bilinear in
(a, w), so its tangent is op(da, w) + op(a, dw):

  gather op:  (dx, dw) -> gather(dx, w) + local(side, dw)      side = what the collective delivered
              (and, with the side output, the tangent of side: the collective of dx)
  scatter op: (dy, dw) -> scatter(dy, w) + scatter(y, dw)      = scatter([dy | y], [w ; dw]): one
              collective for both terms, the operands joined along the contraction

Evaluated (forward mode), each runs the op with the forward's schedule. Transposed (reverse mode),
each is the other op of the pair with w transposed, on the forward's schedule where that is valid
for it (ops/resolve.transposed_schedule): the backward of the gather op is the scatter op plus a
local weight-gradient product, the backward of the scatter op the gather op, whose side output
feeds the weight gradient.

The op itself is the same map with its input as the linear operand (gather(x, w) is the gather
map at lin (x, -), res (w, -)): the forms evaluate it as such an equation, so the op keeps its
rules wherever JAX inlines the custom JVP around it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ..schedule import Schedule
from .core import axis_size
from .linear import LinearMap, bind
from .resolve import transposed_schedule


@dataclasses.dataclass(frozen=True)
class Static:
    """The configuration of one tangent equation; `out_dtype` the op's result dtype (None: the
    operands'); `with_side`: a gather map also returns the tangent of the side output."""
    axis_name: str
    sched: Schedule
    out_dtype: object = None
    with_side: bool = False


def _present_one(res):
    """A residual that is present: both have the operands' dtype."""
    return res[0] if res[0] is not None else res[1]


def _operand_dtype(ct, w):
    """A cotangent of the op's result, in the operands' dtype: with mixed precision (f32 results of
    bf16 operands) the gradient matmuls take bf16 operands and accumulate into f32, as the forward
    does, and the collective still moves f32 partials."""
    return ct if ct is None or ct.dtype == w.dtype else ct.astype(w.dtype)


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _backward_schedule(op: str, static: Static, ct, w_t) -> Schedule:
    n = axis_size(static.axis_name, op)
    return transposed_schedule(op, static.sched, (ct.shape, w_t.shape), ct.dtype, n, static.out_dtype)


def gather_map(pair, gather_impl: Callable, forms: Callable) -> LinearMap:
    """res (w, side), lin (dx, dw). `gather_impl` is the op's schedule runner, `forms()` the pair's
    differentiable positional forms (the backward calls them, so it is differentiable again)."""

    def apply(static, res, lin):
        (w, side), (dx, dw) = res, lin
        out = side_t = None
        if dx is not None:
            out, side_t = gather_impl(dx, w, static.axis_name, static.sched, static.out_dtype,
                                      side_needed=static.with_side)
        if dw is not None:
            out = _add(out, pair.gather_local(side, dw, static.out_dtype))
        return (out, side_t) if static.with_side else (out,)

    def transpose(static, res, cts, wanted):
        (w, side), ct_out = res, _operand_dtype(cts[0], _present_one(res))
        ct_side = cts[1] if static.with_side else None
        dx = dw = None
        if wanted[0] and ct_out is not None:
            # d x = collective(g_out @ w^T): the scatter op, its collective riding on the matmuls.
            w_t = pair.transpose_w(w)
            dx = forms().scatter(ct_out, w_t, static.axis_name, _backward_schedule(pair.scatter, static, ct_out, w_t),
                                 static.out_dtype)
        if wanted[0] and ct_side is not None:
            dx = _add(dx, pair.side_collective(ct_side, static.axis_name))
        if wanted[1] and ct_out is not None:
            dw = pair.gather_dw(side, ct_out, static.out_dtype)
        return dx, dw

    def res_jvp(static, res, lin, t_res, outs):
        (dx, dw), (tw, tside) = lin, t_res
        t = None
        if tw is not None and dx is not None:  # gather(dx, tw) = local(collective(dx), tw)
            delivered = outs[1] if static.with_side else pair.gather_collective(dx, static.axis_name)
            t = pair.gather_local(delivered, tw, static.out_dtype)
        if tside is not None and dw is not None:
            t = _add(t, pair.gather_local(tside, dw, static.out_dtype))
        return (t, None) if static.with_side else (t,)

    return LinearMap(f"{pair.gather}_tangent", apply, transpose, res_jvp)


def scatter_map(pair, scatter_impl: Callable, forms: Callable) -> LinearMap:
    """res (y, w), lin (dy, dw); the map is symmetric: map((y, w), (dy, dw)) = map((dy, dw), (y, w))."""
    a_axis, w_axis = pair.contraction

    def apply(static, res, lin):
        (y, w), (dy, dw) = res, lin
        if dy is not None and dw is not None:
            a, b = jnp.concatenate([dy, y], axis=a_axis), jnp.concatenate([w, dw], axis=w_axis)
        else:
            a, b = (dy, w) if dy is not None else (y, dw)
        return (scatter_impl(a, b, static.axis_name, static.sched, static.out_dtype),)

    def transpose(static, res, cts, wanted):
        (y, w), ct = res, _operand_dtype(cts[0], _present_one(res))
        dy = dw = None
        if ct is None:
            return dy, dw
        if wanted[0]:
            w_t = pair.transpose_w(w)
            bwd = _backward_schedule(pair.gather, static, ct, w_t)
            if wanted[1]:  # d y = gather op of g with w^T; its side output (g delivered) feeds d w
                dy, delivered = forms().gather_with_side(ct, w_t, static.axis_name, bwd, static.out_dtype)
                dw = pair.scatter_dw(y, delivered, static.out_dtype)
            else:
                dy = forms().gather(ct, w_t, static.axis_name, bwd, static.out_dtype)
        elif wanted[1]:
            dw = pair.scatter_dw(y, pair.gather_collective(ct, static.axis_name), static.out_dtype)
        return dy, dw

    def res_jvp(static, res, lin, t_res, outs):
        (dy, dw), (ty, tw) = lin, t_res
        ty = ty if dw is not None else None  # scatter(ty, dw)
        tw = tw if dy is not None else None  # scatter(dy, tw)
        if ty is None and tw is None:
            return (None,)
        swapped = (dy if tw is not None else None, dw if ty is not None else None)
        return tuple(bind(lmap, static, swapped, (ty, tw), [jax.typeof(o) for o in outs]))

    lmap = LinearMap(f"{pair.scatter}_tangent", apply, transpose, res_jvp)
    return lmap


def _tangent_aval(v):
    return jax.typeof(v).to_tangent_aval()


def gather_tangent(lmap: LinearMap):
    """The `tangent` callable of core.custom_jvp_pair for a gather op's map."""
    def tangent(static, primals, outs, lin, with_side):
        w, (out, side), (dx, dw) = primals[1], outs, lin
        side_out = with_side and dx is not None
        avals = [_tangent_aval(out)] + ([_tangent_aval(side)] if side_out else [])
        res = (w if dx is not None else None, side if dw is not None else None)
        t = bind(lmap, Static(*static, with_side=side_out), res, lin, avals)
        return t[0], (t[1] if side_out else None)
    return tangent


def scatter_tangent(lmap: LinearMap):
    """The `tangent` callable of core.custom_jvp_plain for a scatter op's map."""
    def tangent(static, primals, out, lin):
        (y, w), (dy, dw) = primals, lin
        res = (y if dw is not None else None, w if dy is not None else None)
        return bind(lmap, Static(*static), res, lin, [_tangent_aval(out)])[0]
    return tangent


def _out_avals(impl: Callable, a, w, *static):
    return jax.make_jaxpr(lambda a, w: impl(a, w, *static))(a, w).out_avals


def gather_primal(lmap: LinearMap, gather_impl: Callable):
    """The gather op as one equation of its own map (x the linear operand, w the residual): what
    the forms evaluate, so that where JAX inlines a custom JVP (the known part of a scan's
    linearization) the op stays differentiable."""
    def primal(x, w, axis_name, sched, out_dtype, side_needed=True):
        avals = _out_avals(gather_impl, x, w, axis_name, sched, out_dtype, side_needed)[:2 if side_needed else 1]
        outs = bind(lmap, Static(axis_name, sched, out_dtype, side_needed), (w, None), (x, None), avals)
        return outs[0], (outs[1] if side_needed else None)
    return primal


def scatter_primal(lmap: LinearMap, scatter_impl: Callable):
    """The scatter op as one equation of its own map (y linear, w residual), as `gather_primal`."""
    def primal(y, w, axis_name, sched, out_dtype):
        avals = _out_avals(scatter_impl, y, w, axis_name, sched, out_dtype)
        return bind(lmap, Static(axis_name, sched, out_dtype), (None, w), (y, None), avals)[0]
    return primal
