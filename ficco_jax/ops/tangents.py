"""The tangent maps of a pair of ops (ops/table.py), as `LinearMap`s (ops/linear.py), and the
positional forms that bind them. Each op is bilinear in (a, w), so its tangent is op(da, w) + op(a, dw):

  gather op:  (dx, dw) -> gather(dx, w) + local(side, dw)      side = what the collective delivered
              (and, with the side output, the tangent of side: the collective of dx)
  scatter op: (dy, dw) -> scatter(dy, w) + scatter(y, dw)      = scatter([dy | y], [w ; dw]): one
              collective for both terms, the operands joined along the contraction
  matmul_psum: the same join, one all-reduce for both terms (table.AllReduce); transposed, two local
              products of the cotangent of the sum, which every device holds (below)

Evaluated (forward mode), each runs the op with the forward's schedule. Transposed (reverse mode),
each is the other op of the pair with w transposed, on the forward's schedule where that is valid
for it (ops/resolve.transposed_schedule): the backward of the gather op is the scatter op plus a
local weight-gradient product, the backward of the scatter op the gather op, whose side output
feeds the weight gradient. The transposed w is read in the other layout than w (`w_col_major`
flipped): the bytes of w as they are, so no transpose of the weight is written out.

The op itself is the same map with its input as the linear operand (gather(x, w) is the gather
map at lin (x, -), res (w, -)): the positional forms below evaluate it as such an equation, so the
op keeps its rules wherever JAX inlines the custom JVP around it. The forms are custom JVPs whose
tangent is one equation of the map, so they are differentiable in forward and in reverse mode; a
map's transpose calls the forms of the other op, so the backward is differentiable again.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ..lowering.dma.registry import aval
from ..lowering.xla import narrowing
from ..schedule import Schedule
from .core import axis_size, varying_axes, without_varying
from .linear import Folded, LinearMap, bind
from .resolve import transposed_schedule
from .table import ALL_REDUCE, OpPair, OutDtype


@dataclasses.dataclass(frozen=True)
class Static:
    """The configuration of one tangent equation; `out_dtype` the op's result dtype (None: the
    operands'); `with_side`: a gather map also returns the tangent of the side output;
    `sum_first`: the backward sums before it casts (core.partitioner_numerics); `w_col_major`:
    copy-engine calls read w column-major (lowering/dma/registry.py)."""
    axis_name: str
    sched: Schedule
    out_dtype: object = None
    with_side: bool = False
    sum_first: bool = False
    #: Whether the shard_map where the op was bound checks varying manual axes (check_vma): only
    #: then is a sum typed invariant, and JAX transposes psum to no collective; without it, to psum.
    vma_checked: bool = True
    w_col_major: bool = False


def _present_one(res):
    """A residual that is present: both have the operands' dtype."""
    return res[0] if res[0] is not None else res[1]


def _backward_numerics(static: Static, operand_dtype):
    """(dtype of the gradient matmuls' operands, result dtype of the backward scatter op) as JAX's
    transpose of ``dot_general(a, w, preferred_element_type=out)`` has them: each gradient is
    ``dot_general(ct, other operand, preferred_element_type=out)``, whose operands JAX converts to
    `out` (f32 with mixed precision: the f32 cotangent is never rounded to bf16), then converted to
    its primal's dtype; where that conversion comes before the backward's reduce-scatter, the
    partials that move and are summed are rounded to the primal's dtype (bf16), as JAX's are in a
    shard_map body. The partitioner of global-view code sums the f32 partials and casts the sum
    (`Static.sum_first`): there they move in f32. A narrower `out` (bf16 from f32 operands) is the
    f32 product rounded, ``(a @ w).astype(out)``: its transpose widens the cotangent back, and the
    gradients are f32 matmuls whose partials move in f32."""
    out = static.out_dtype
    if out is None:
        return None, None
    if narrowing(operand_dtype, out):
        return operand_dtype, None
    return out, (None if static.sum_first else operand_dtype)


def _in(v, dtype):
    return v if dtype is None or v is None or v.dtype == dtype else v.astype(dtype)


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _backward_schedule(op: str, static: Static, ct, w_t, out_dtype) -> Schedule:
    n = axis_size(static.axis_name, op)
    return transposed_schedule(op, static.sched, (ct.shape, w_t.shape), ct.dtype, n, out_dtype)


# ------------------------------------------------------------------------------------------------
# The maps
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _PairMap(LinearMap):
    """The map of one op (`role`: "gather" or "scatter") of `pair`."""
    pair: OpPair
    role: ClassVar[str]

    def sums_before_cast(self, static) -> bool:
        return static.sum_first

    @property
    def name(self) -> str:
        return f"{getattr(self.pair, self.role)}_tangent"

    def fold_batch(self, static, res, lin, batched_res, batched_lin):
        if self.role == "gather":  # res (w, side)
            return fold_input_batch(self.pair, self.pair.gather, static, res, lin, batched_res, batched_lin, res[0],
                                    {1: "side"})
        return fold_input_batch(self.pair, self.pair.scatter, static, res, lin, batched_res, batched_lin, res[1],
                                {0: "input"})


def fold_input_batch(pair: OpPair, op: str, static: Static, res, lin, batched_res, batched_lin, w,
                     rows: dict) -> Optional[Folded]:
    """An equation of `op`'s map on a batch of its input against one weight (the input, lin[0],
    batched; `w` the weight among the residuals) as one equation of the map whose input rows hold
    the batch (pair.fold_batch), valid where the schedule still cuts the folded rows; None
    otherwise (the batch then runs in a loop).

    `rows`: residual index -> "input" or "side", the residuals that hold rows of the input or of
    the gather op's side output (a tangent's primal: the map is row-wise in them). Under grad of
    vmap they are batched with the input while the weight's tangent is not; folded with it, the
    weight's cotangent is one product over the whole batch, rounded once, as JAX's own for the
    reference, instead of one per element summed in the weight's dtype. Every other operand must
    be unbatched: a batched weight or scale gives each element its own matmul."""
    if not batched_lin[0] or any(batched_lin[1:]):
        return None
    if any(b and i not in rows for i, b in enumerate(batched_res)):
        return None
    n = axis_size(static.axis_name, op)
    a, batch = pair.fold_batch(op, lin[0], n), lin[0].shape[0]
    try:
        static.sched.validate(op, (a.shape, w.shape), n)
    except (ValueError, TypeError):
        return None
    # An unbatched row residual is the same rows for every element: broadcast where a term reads
    # it (a weight's or a scale's tangent), else left as it is (jacfwd's tangents of the input alone).
    terms_read_rows = any(v is not None for v in lin[1:])
    folded_res = list(res)
    for i, kind in rows.items():
        r = res[i]
        if r is None or not (batched_res[i] or terms_read_rows):
            continue
        if not batched_res[i]:
            r = jnp.broadcast_to(r[None], (batch, *r.shape))
        folded_res[i] = pair.fold_batch(op, r, n) if kind == "input" else pair.fold_side(r, n)
    if op == pair.gather:
        out_shapes = pair.gather_shapes(a.shape, w.shape, n)[:2 if static.with_side else 1]
    else:
        out_shapes = (pair.scatter_shape(a.shape, w.shape, n),)
    return Folded(tuple(folded_res), (a,) + tuple(lin[1:]), out_shapes,
                  lambda out: pair.unfold_batch(op, out, batch, n))


class GatherMap(_PairMap):
    """res (w, side), lin (dx, dw) -> (out,) or (out, side) with `Static.with_side`."""
    role = "gather"

    def apply(self, static, res, lin):
        (w, side), (dx, dw) = res, lin
        out = side_t = None
        if dx is not None:
            out, side_t = self.pair.gather_impl(dx, w, static.axis_name, static.sched, static.out_dtype,
                                                side_needed=static.with_side, w_col_major=static.w_col_major)
        if dw is not None:
            out = _add(out, self.pair.gather_local(side, dw, static.out_dtype))
        return (out, side_t) if static.with_side else (out,)

    def transpose(self, static, res, cts, wanted):
        pair, (w, side), ct_out = self.pair, res, cts[0]
        compute, partials = _backward_numerics(static, _present_one(res).dtype)
        ct_out = _in(ct_out, compute)
        ct_side = cts[1] if static.with_side else None
        dx = dw = None
        if wanted[0] and ct_out is not None:
            # d x = collective(g_out @ w^T): the scatter op, its collective riding on the matmuls.
            w_t = _in(pair.transpose_w(w), compute)
            dx = scatter_op(pair, ct_out, w_t, static.axis_name,
                            _backward_schedule(pair.scatter, static, ct_out, w_t, partials), partials, static.sum_first,
                            not static.w_col_major)
        if wanted[0] and ct_side is not None:
            dx = _add(dx, pair.scatter_collective(ct_side, static.axis_name))
        if wanted[1] and ct_out is not None:
            dw = pair.gather_dw(_in(side, compute), ct_out, None)
        return dx, dw

    def res_jvp(self, static, res, lin, t_res, outs):
        (dx, dw), (tw, tside) = lin, t_res
        t = None
        if tw is not None and dx is not None:  # gather(dx, tw) = local(collective(dx), tw)
            delivered = outs[1] if static.with_side else self.pair.gather_collective(dx, static.axis_name)
            t = self.pair.gather_local(delivered, tw, static.out_dtype)
        if tside is not None and dw is not None:
            t = _add(t, self.pair.gather_local(tside, dw, static.out_dtype))
        return (t, None) if static.with_side else (t,)


class ScatterMap(_PairMap):
    """res (y, w), lin (dy, dw) -> (out,); symmetric: map((y, w), (dy, dw)) = map((dy, dw), (y, w))."""
    role = "scatter"

    def apply(self, static, res, lin):
        (y, w), (dy, dw) = res, lin
        a_axis, w_axis = self.pair.contraction
        if dy is not None and dw is not None:
            a, b = jnp.concatenate([dy, y], axis=a_axis), jnp.concatenate([w, dw], axis=w_axis)
        else:
            a, b = (dy, w) if dy is not None else (y, dw)
        return (self.run(a, b, static),)

    def run(self, a, b, static):
        """The op on operands joined along the contraction."""
        return self.pair.scatter_impl(a, b, static.axis_name, static.sched, static.out_dtype,
                                      w_col_major=static.w_col_major)

    def transpose(self, static, res, cts, wanted):
        pair, (y, w), ct = self.pair, res, cts[0]
        compute, _ = _backward_numerics(static, _present_one(res).dtype)
        ct = _in(ct, compute)
        dy = dw = None
        if ct is None:
            return dy, dw
        if wanted[0]:
            w_t = _in(pair.transpose_w(w), compute)
            bwd = _backward_schedule(pair.gather, static, ct, w_t, None)
            if wanted[1]:  # d y = gather op of g with w^T; its side output (g delivered) feeds d w
                dy, delivered = gather_op_with_side(pair, ct, w_t, static.axis_name, bwd, None, static.sum_first,
                                                    not static.w_col_major)
                dw = pair.scatter_dw(_in(y, compute), delivered, None)
            else:
                dy = gather_op(pair, ct, w_t, static.axis_name, bwd, None, static.sum_first, not static.w_col_major)
        elif wanted[1]:
            dw = pair.scatter_dw(_in(y, compute), pair.gather_collective(ct, static.axis_name), None)
        return dy, dw

    def res_jvp(self, static, res, lin, t_res, outs):
        (dy, dw), (ty, tw) = lin, t_res
        ty = ty if dw is not None else None  # scatter(ty, dw)
        tw = tw if dy is not None else None  # scatter(dy, tw)
        if ty is None and tw is None:
            return (None,)
        swapped = (dy if tw is not None else None, dw if ty is not None else None)
        return tuple(bind(self, static, swapped, (ty, tw), [jax.typeof(o) for o in outs]))


class AllReduceMap(ScatterMap):
    """matmul_psum's map: res (y, w), lin (dy, dw) -> (out,), joined as the scatter map's.

    Its transpose is JAX's transpose of ``psum(y @ w)``: with check_vma the sum is typed invariant
    and psum transposes to no collective (pvary), so dy = ct @ w^T and dw = y^T @ ct on each device;
    without check_vma JAX transposes psum to psum, and so does this map (the cotangent summed first)."""

    @property
    def name(self) -> str:
        return f"{ALL_REDUCE.name}_tangent"

    def run(self, a, b, static):
        return ALL_REDUCE.impl(a, b, static.axis_name, static.sched, static.out_dtype, static.w_col_major)

    def fold_batch(self, static, res, lin, batched_res, batched_lin):
        """A batch of inputs against one weight as the rows of one call (the sum is row-wise); y, a
        tangent's primal, folds with them (fold_input_batch says why)."""
        if not batched_lin[0] or any(batched_lin[1:]) or batched_res[1]:
            return None
        (y, w), (batch, rows, cols) = res, lin[0].shape
        a = lin[0].reshape(batch * rows, cols)
        try:
            static.sched.validate(ALL_REDUCE.name, (a.shape, w.shape), axis_size(static.axis_name, ALL_REDUCE.name))
        except (ValueError, TypeError):
            return None
        if y is not None and (batched_res[0] or lin[1] is not None):  # as fold_input_batch's row residuals
            y = (y if batched_res[0] else jnp.broadcast_to(y[None], lin[0].shape)).reshape(batch * rows, cols)
        return Folded((y, w), (a, lin[1]), ((batch * rows, w.shape[1]),), lambda out: out.reshape(batch, rows, -1))

    def transpose(self, static, res, cts, wanted):
        (y, w), ct = res, cts[0]
        compute, _ = _backward_numerics(static, _present_one(res).dtype)
        ct = _in(ct, compute)
        if ct is None:
            return None, None
        if not static.vma_checked:
            ct = lax.psum(ct, static.axis_name)
        dy = ALL_REDUCE.dy(ct, _in(w, compute), None) if wanted[0] else None
        dw = ALL_REDUCE.dw(_in(y, compute), ct, None) if wanted[1] else None
        return dy, dw


# ------------------------------------------------------------------------------------------------
# The positional forms (pair, a, w, axis_name, sched, out_dtype, sum_first, w_col_major): the ops
# bound as equations; `sum_first` and `w_col_major` as in `Static`
# ------------------------------------------------------------------------------------------------
def varying_together(axis_name: str, *values):
    """`values`, each made to vary over every manual axis another varies over and over the op's
    axis: what the op's results vary over, so that their abstract values are the first operand's
    with other shapes (no lowering traced to find them)."""
    axes = frozenset({axis_name}).union(*(varying_axes(v) for v in values))
    return [v if axes <= varying_axes(v) else lax.pcast(v, tuple(sorted(axes - varying_axes(v))), to="varying")
            for v in values]


def _gather_equation(pair: OpPair, x, w, axis_name: str, sched: Schedule, out_dtype: OutDtype, sum_first: bool,
                     w_col_major: bool, side_needed: bool) -> Tuple[jax.Array, Optional[jax.Array]]:
    """The gather op as one equation of its own map (x the linear operand, w the residual)."""
    x, w = varying_together(axis_name, x, w)
    out_shape, side_shape = pair.gather_shapes(x.shape, w.shape, axis_size(axis_name, pair.gather))
    avals = [aval(jax.typeof(x), out_shape, out_dtype)] + ([aval(jax.typeof(x), side_shape)] if side_needed else [])
    outs = bind(GatherMap(pair), Static(axis_name, sched, out_dtype, side_needed, sum_first, w_col_major=w_col_major),
                (w, None), (x, None), avals)
    return outs[0], (outs[1] if side_needed else None)


def _scatter_equation(pair: OpPair, y, w, axis_name: str, sched: Schedule, out_dtype: OutDtype,
                      sum_first: bool, w_col_major: bool) -> jax.Array:
    """The scatter op as one equation of its own map (y linear, w residual)."""
    y, w = varying_together(axis_name, y, w)
    out_shape = pair.scatter_shape(y.shape, w.shape, axis_size(axis_name, pair.scatter))
    static = Static(axis_name, sched, out_dtype, sum_first=sum_first, w_col_major=w_col_major)
    return bind(ScatterMap(pair), static, (None, w), (y, None), [aval(jax.typeof(y), out_shape, out_dtype)])[0]


def _all_reduce_static(y, w, axis_name: str, sched: Schedule, out_dtype: OutDtype, sum_first: bool,
                       w_col_major: bool):
    """(y, w, static) of a matmul_psum equation: the operands made to vary together, and whether
    this shard_map checks varying axes (only then does the cast leave the axis in their types)."""
    y, w = varying_together(axis_name, y, w)
    return y, w, Static(axis_name, sched, out_dtype, sum_first=sum_first, vma_checked=axis_name in varying_axes(y),
                        w_col_major=w_col_major)


def _all_reduce_equation(y, w, axis_name: str, sched: Schedule, out_dtype: OutDtype, sum_first: bool,
                         w_col_major: bool) -> jax.Array:
    """matmul_psum as one equation of its own map (y linear, w residual); its result varies over
    what the operands vary over but the summed axis, as psum's does."""
    y, w, static = _all_reduce_static(y, w, axis_name, sched, out_dtype, sum_first, w_col_major)
    out_shape = ALL_REDUCE.shape(y.shape, w.shape, axis_size(axis_name, ALL_REDUCE.name))
    out_aval = without_varying(aval(jax.typeof(y), out_shape, out_dtype), axis_name)
    return bind(AllReduceMap(ALL_REDUCE.pair), static, (None, w), (y, None), [out_aval])[0]


_STATIC = (0, 3, 4, 5, 6, 7)  # pair, axis_name, sched, out_dtype, sum_first, w_col_major


@functools.partial(jax.custom_jvp, nondiff_argnums=_STATIC)
def gather_op(pair: OpPair, x, w, axis_name: str, sched: Schedule, out_dtype: OutDtype,
              sum_first: bool = False, w_col_major: bool = False) -> jax.Array:
    """The gather op's output alone: nobody reads the side output, so it may be left incomplete
    (differentiated, the forward computes it in full: the weight's tangent and gradient read it)."""
    return _gather_equation(pair, x, w, axis_name, sched, out_dtype, sum_first, w_col_major, side_needed=False)[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=_STATIC)
def gather_op_with_side(pair: OpPair, x, w, axis_name: str, sched: Schedule, out_dtype: OutDtype,
                        sum_first: bool = False, w_col_major: bool = False) -> Tuple[jax.Array, jax.Array]:
    """The gather op's (out, side)."""
    return _gather_equation(pair, x, w, axis_name, sched, out_dtype, sum_first, w_col_major, side_needed=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=_STATIC)
def scatter_op(pair: OpPair, y, w, axis_name: str, sched: Schedule, out_dtype: OutDtype,
               sum_first: bool = False, w_col_major: bool = False) -> jax.Array:
    """The scatter op's output."""
    return _scatter_equation(pair, y, w, axis_name, sched, out_dtype, sum_first, w_col_major)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5, 6))
def all_reduce_op(y, w, axis_name: str, sched: Schedule, out_dtype: OutDtype, sum_first: bool = False,
                  w_col_major: bool = False) -> jax.Array:
    """matmul_psum's output."""
    return _all_reduce_equation(y, w, axis_name, sched, out_dtype, sum_first, w_col_major)


def present(t):
    """A tangent, or None where it is a symbolic zero."""
    return None if isinstance(t, SymbolicZero) else t


def zero_where_none(t, like):
    """A tangent of `like`, a symbolic zero where it is None."""
    return SymbolicZero(jax.typeof(like).to_tangent_aval()) if t is None else t


def tangent_aval(v):
    """The abstract value of a tangent of `v`."""
    return jax.typeof(v).to_tangent_aval()


def _gather_jvp(with_side: bool):
    def jvp(pair, axis_name, sched, out_dtype, sum_first, w_col_major, primals, tangents):
        (x, w), (dx, dw) = primals, tuple(map(present, tangents))
        # Differentiated, the forward delivers the side output in full, as a residual would be.
        out, side = gather_op_with_side(pair, x, w, axis_name, sched, out_dtype, sum_first, w_col_major)
        side_out = with_side and dx is not None
        avals = [tangent_aval(out)] + ([tangent_aval(side)] if side_out else [])
        res = (w if dx is not None else None, side if dw is not None else None)
        static = Static(axis_name, sched, out_dtype, side_out, sum_first, w_col_major=w_col_major)
        t = bind(GatherMap(pair), static, res, (dx, dw), avals)
        t_out, t_side = t[0], (t[1] if side_out else None)
        if with_side:
            return (out, side), (zero_where_none(t_out, out), zero_where_none(t_side, side))
        return out, zero_where_none(t_out, out)
    return jvp


def _scatter_jvp(pair, axis_name, sched, out_dtype, sum_first, w_col_major, primals, tangents):
    (y, w), (dy, dw) = primals, tuple(map(present, tangents))
    out = scatter_op(pair, y, w, axis_name, sched, out_dtype, sum_first, w_col_major)
    res = (y if dw is not None else None, w if dy is not None else None)
    static = Static(axis_name, sched, out_dtype, sum_first=sum_first, w_col_major=w_col_major)
    t_out = bind(ScatterMap(pair), static, res, (dy, dw), [tangent_aval(out)])[0]
    return out, zero_where_none(t_out, out)


def _all_reduce_jvp(axis_name, sched, out_dtype, sum_first, w_col_major, primals, tangents):
    (y, w), (dy, dw) = primals, tuple(map(present, tangents))
    out = all_reduce_op(y, w, axis_name, sched, out_dtype, sum_first, w_col_major)
    y, w, static = _all_reduce_static(y, w, axis_name, sched, out_dtype, sum_first, w_col_major)
    res = (y if dw is not None else None, w if dy is not None else None)
    t_out = bind(AllReduceMap(ALL_REDUCE.pair), static, res, (dy, dw), [tangent_aval(out)])[0]
    return out, zero_where_none(t_out, out)


gather_op.defjvp(_gather_jvp(with_side=False), symbolic_zeros=True)
gather_op_with_side.defjvp(_gather_jvp(with_side=True), symbolic_zeros=True)
scatter_op.defjvp(_scatter_jvp, symbolic_zeros=True)
all_reduce_op.defjvp(_all_reduce_jvp, symbolic_zeros=True)
