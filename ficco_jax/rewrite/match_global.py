"""The tensor-parallel patterns of global-view code under explicit sharding (no shard_map).

With a mesh whose axes are ``AxisType.Explicit`` (the default of ``jax.make_mesh`` in jax
0.10), the shardings are part of the types (``f32[64@tp,32]``) and a program written on global
arrays tells where the partitioner communicates:

- all_gather → matmul: ``reshard`` removes mesh axis A from one dimension g of x and the result
  feeds a ``dot_general`` in which g is a free (row) dimension; or the dot itself reads x sharded
  on A along free dimension g while its result is not (the partitioner gathers x). Becomes
  ``ag_matmul``, with ``return_gathered=True`` where the reshard's result is read elsewhere.
- matmul → reduce-scatter: a ``dot_general`` whose contracted dimensions are sharded on A in
  both operands, with a result sharded on A along a free dimension (its ``out_sharding``, or a
  ``reshard`` of the replicated product right after it). Becomes ``matmul_rs``.
- matmul → all-reduce: the same dot with a result replicated over A and otherwise sharded as its
  operands' free dimensions are, the sum read on by the program. Becomes ``matmul_psum``; a sum
  the program only returns (a data-parallel weight gradient) is a near-miss saying so.
- FP8, as JAX recipes write it: the resharded tensor is FP8 and reaches the matmul as
  ``convert → multiply by a scalar scale`` while the weight is ``convert(w8) * w_scale``; or the
  scattering matmul multiplies two such dequantized tensors. Become the FP8 ops, which gather FP8
  bytes and take the two scales.

Each site runs as its op inside a ``jax.shard_map`` over the mesh, with the operands' own
shardings as in_specs and the results' as out_specs: the other mesh axes (dp) stay manual and
untouched, and every output keeps its type. The local pattern inside that shard_map is the one
match_tp.py recognises, so the site is found by tracing the local body and running that matcher
on it: one canonicalisation to 2-D for both views. An FP8 site's body dequantizes the FP8 blocks
as the program does, so the same FP8 matchers recognise it.

Programs on an ``AxisType.Auto`` mesh carry no shardings in their types (GSPMD decides them at
compile time): their matmuls are match_gspmd.py's, never this module's. A reshard
that moves an axis from one dimension to another before a matmul is an all-to-all; it is reported
too, as expert-parallel layers become the ops only when written in a shard_map.
"""
from __future__ import annotations

from typing import Callable

import jax

from .. import config
from . import dequant, match_tp
from .global_site import GlobalSite, global_site, local_dot
from .jaxpr_util import fmt_shapes, source_line
from .shardings import (axes_of, batched, contracted, free, gathered_axis, is_explicit, mesh_of, out_dim, product_axes,
                        scattered_dim, spec_of, spec_of_axes, typed)
from .site import MatchContext, Site, SiteRecord

AG, RS, AR = match_tp.AG, match_tp.RS, match_tp.AR
_DOT = "dot_general"
# jax 0.10 and 0.11 name the explicit-mode resharding primitive "reshard"; a rename is one more entry.
_RESHARD = ("reshard",)


# --------------------------------------------------------------------------------------------
# FP8 operands: dequantized as convert(v8) * scale (rewrite/dequant.py)
# --------------------------------------------------------------------------------------------
def _operand(deq: dequant.Dequantized | None, value) -> tuple[tuple, Callable]:
    """(the global values a local body reads for one dot operand, how it rebuilds the operand
    from their blocks): `value` itself, or its FP8 tensor and scale, dequantized again."""
    return ((value,), lambda block: block) if deq is None else ((deq.v8, deq.scale), deq.rebuild)


# --------------------------------------------------------------------------------------------
# all_gather → matmul
# --------------------------------------------------------------------------------------------
def _gather_problem(dot, side: int, dim: int, axis: str, gathered_dims) -> str | None:
    """Why `dot`, reading operand `side` with dimension `dim` gathered over `axis`, is no ag_matmul site."""
    contract = contracted(dot)
    if dim in contract[side]:
        return "the matmul contracts over the gathered dimension (a weight-gradient matmul)"
    if dim in batched(dot)[side]:
        return "the gathered dimension is a batch dimension of the matmul"
    w = dot.invars[1 - side].aval
    w_dims = axes_of(w)
    if w_dims is None:
        return "the weight's sharding is not stated in its type"
    if any(gathered_dims[d] for d in contract[side]) or any(w_dims[d] for d in contract[1 - side]):
        return "a contracted dimension is sharded as well; the op contracts whole local rows"
    out_dims = axes_of(dot.outvars[0].aval)
    if out_dims is None:
        return "the result's sharding is not stated in its type"
    expected = product_axes(dot, (side, gathered_dims))
    if expected != out_dims:
        return (f"the result is sharded {spec_of(dot.outvars[0].aval)}, not as its operands' free dimensions "
                f"are ({spec_of_axes(expected)}); a resharding follows the matmul")
    return None


def _gather_site(ctx: MatchContext, i: int, j: int, side: int, dim: int, axis: str, reshard=None,
                 deq: dequant.Dequantized | None = None, more: tuple = ()):
    """The ag_matmul site of dot `j` reading operand `side` gathered on `dim` over `axis` (by
    equation `reshard`, or by the dot itself when None; through FP8 dequantization `deq`), or why
    it is none; `more`: the other dots reading the reshard's result as `j` does, which the op
    serves too, each with its weight."""
    dots = [ctx.eqns[k] for k in (j, *more)]
    dot = dots[0]
    src = reshard.invars[0] if reshard is not None else dot.invars[side]
    weights = [d.invars[1 - side] for d in dots]
    gathered = reshard.outvars[0] if reshard is not None else None
    served = {j, *more}
    also = gathered is not None and (gathered in ctx.outputs or
                                     any(k not in served for k, _ in ctx.users.get(gathered, [])))
    uses = [k for k, _ in ctx.users.get(gathered, [])] if gathered is not None else [j]
    w_deq = dequant.dequantized(ctx, weights[0]) if deq is not None else None
    if deq is not None:
        problem = dequant.gather_problem(ctx, deq, w_deq, min(uses))
    else:
        problem = next(filter(None, (ctx.weight_problem(w, min(uses), "gathered tensor's") for w in weights)), None) \
            if reshard is not None else None
    if problem:
        return problem
    writes = tuple(d.outvars[0] for d in dots) + ((gathered,) if also else ())
    x_reads, dequantize_x = ((src, deq.scale), deq.rebuild) if deq is not None else ((src,), lambda g: g)
    w_reads, rebuild_w = _operand(w_deq, weights[0])
    w_reads += tuple(weights[1:])

    def local_fn(x, *rest):
        g = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
        x_rest, w_blocks = rest[:len(x_reads) - 1], rest[len(x_reads) - 1:]
        first_w, more_w = w_blocks[:len(w_blocks) - len(more)], w_blocks[len(w_blocks) - len(more):]
        x_local = dequantize_x(g, *x_rest)
        outs = [local_dot(d, x_local, w, side) for d, w in zip(dots, (rebuild_w(*first_w), *more_w))]
        return (*outs, g) if also else tuple(outs)

    skip = {i, *served} | set(deq.eqns if deq is not None else ())
    site = global_site(ctx, local_fn, x_reads + w_reads, writes, op=AG, axis_name=axis, exec_index=min(uses),
                        skip=tuple(sorted(skip)), dot=dot, collective=reshard or dot, returns_collective=also,
                        more_dots=tuple(dots[1:]))
    if isinstance(site, str):
        return site
    n_more = sum(k not in served for k in uses) + (gathered in ctx.outputs)
    also_text = f" (gathered x also used by {n_more} more)" if also else ""
    w_text = f"{typed(w_deq.v8)} (FP8, scaled)" if w_deq is not None else ", ".join(typed(w) for w in weights)
    what = f"w {w_text}" if len(dots) == 1 else f"{len(dots)} weights w {w_text}"
    shapes = (f"x {typed(src)} gathered dim {dim} · {what} -> {', '.join(typed(d.outvars[0]) for d in dots)}"
              f"{also_text}")
    return _found(ctx, site, i, shapes)


def _found(ctx: MatchContext, site: GlobalSite, i: int, shapes: str) -> GlobalSite:
    site.record = SiteRecord(site.op, f"{ctx.where}eqn {i}", site.axis_name, shapes, fmt_shapes(site.op_shapes()),
                             "", source=source_line(ctx.eqns[i]))
    return site


def _miss(ctx: MatchContext, op: str, i: int, axis: str, shapes: str, reason: str) -> SiteRecord:
    return SiteRecord(op, f"{ctx.where}eqn {i}", axis, shapes, "", "", reason, source=source_line(ctx.eqns[i]))


def match_reshard(ctx: MatchContext, i: int) -> Site | SiteRecord | None:
    """A reshard that gathers one axis of one dimension, feeding a matmul on the gathered rows."""
    eqn = ctx.eqns[i]
    x, g = eqn.invars[0], eqn.outvars[0]
    before, after, mesh = axes_of(x.aval), axes_of(g.aval), mesh_of(x.aval)
    if before is None or after is None or not is_explicit(mesh) or not hasattr(x.aval, "shape"):
        return None
    change = gathered_axis(before, after)
    fp8 = config.is_fp8(g.aval.dtype)
    dots, fp8_reasons = dequant.fp8_dots(ctx, g) if fp8 else ([], [])
    dots += [(j, pos, None) for j, pos in ctx.users.get(g, []) if ctx.eqns[j].primitive.name == _DOT]
    if change is None or (not dots and not fp8_reasons and not isinstance(change, tuple)):
        return None
    axis = change[1] if isinstance(change, tuple) else "?"
    shapes = f"x {typed(x)} resharded to {typed(g)}"
    if not dots:
        fed = ("feeds no matmul directly" if not fp8 else
               "reaches no matmul as convert → multiply by a scalar scale → dot, as FP8 recipes write it")
        why = f"the gathered tensor {fed} ({ctx.readers_text(g)}); reshard right before the matmul"
        return _miss(ctx, AG, i, axis, shapes, "; ".join(fp8_reasons) or why)
    if isinstance(change, str):
        op = "a2a_matmul" if "all-to-all" in change else AG
        fix = ("; write the expert layer in a jax.shard_map to get a2a_matmul" if op != AG else "")
        return _miss(ctx, op, i, axis, shapes, f"the reshard {change}{fix}")
    dim, axis = change
    problem = ctx.not_enabled(AG)
    if problem:
        return _miss(ctx, AG, i, axis, shapes, problem)
    reasons = list(fp8_reasons)
    for j, pos, deq in dots:
        problem = _gather_problem(ctx.eqns[j], pos, dim, axis, after)
        # The other matmuls reading the gathered tensor as this one does join its op.
        more = () if problem or deq is not None else tuple(
            k for k, side, d in dots if k != j and d is None and not _gather_problem(ctx.eqns[k], side, dim, axis, after)
            and match_tp.same_form(ctx.eqns[j], pos, ctx.eqns[k], side) and k not in ctx.taken_dots)
        found = problem or _gather_site(ctx, i, j, pos, dim, axis, eqn, deq, more)
        if isinstance(found, Site):
            return found
        reasons.append(f"eqn {j}: {found}")
    return _miss(ctx, AG, i, axis, shapes, "; ".join(reasons))


# --------------------------------------------------------------------------------------------
# matmul → reduce-scatter, and the matmuls that gather an operand themselves
# --------------------------------------------------------------------------------------------
def _sharded_contraction(dot) -> str | None:
    """The one mesh axis both operands' contracted dimensions are split over, else None."""
    lhs, rhs = axes_of(dot.invars[0].aval), axes_of(dot.invars[1].aval)
    lc, rc = contracted(dot)
    axes = {a for d in lc for a in lhs[d]} | {a for d in rc for a in rhs[d]}
    if len(axes) != 1:
        return None
    (axis,) = axes
    pairs = [(lhs[a], rhs[b]) for a, b in zip(lc, rc)]
    return axis if all(p == q for p, q in pairs) else None


def _scatter_target(ctx: MatchContext, j: int, axis: str):
    """(the variable holding the scattered result, its dims, the reshard equation or None, the
    convert_element_type between the product and that reshard or None)."""
    dot = ctx.eqns[j]
    y = dot.outvars[0]
    y_dims = axes_of(y.aval)
    if any(axis in d for d in y_dims):
        return y, y_dims, None, None
    after, cast = _sole_reader(ctx, y), None
    if after is not None and after.primitive.name == "convert_element_type":
        # JAX's backward of a mixed-precision matmul casts the summed f32 product to bf16.
        after, cast = _sole_reader(ctx, after.outvars[0]), after
    if after is not None and after.primitive.name in _RESHARD and axes_of(after.outvars[0].aval) is not None:
        return after.outvars[0], axes_of(after.outvars[0].aval), after, cast
    return y, y_dims, None, None


def _sole_reader(ctx: MatchContext, v):
    """The one equation reading `v`, or None where it has several readers or is an output."""
    users = ctx.users.get(v, [])
    return ctx.eqns[users[0][0]] if len(users) == 1 and v not in ctx.outputs else None


def _scatter(ctx: MatchContext, j: int, axis: str) -> Site | SiteRecord:
    dot = ctx.eqns[j]
    target, target_dims, reshard, cast = _scatter_target(ctx, j, axis)
    shapes = f"{typed(dot.invars[0])} · {typed(dot.invars[1])} -> {typed(target)}"
    scattered = scattered_dim(product_axes(dot), target_dims, axis)
    if isinstance(scattered, str):
        if mesh_of(dot.invars[0].aval).shape[axis] == 1:
            return None  # an axis of one device reduces nothing
        if reshard is None and target_dims == product_axes(dot):
            return _all_reduce(ctx, j, axis, shapes)
        return _miss(ctx, RS, j, axis, shapes, scattered)
    problem = ctx.not_enabled(RS)
    if problem:
        return _miss(ctx, RS, j, axis, shapes, problem)
    # FP8 operands are read as FP8 and dequantized in the body, where the FP8 matcher finds them.
    fp8 = bool(dequant.scaled_operands(ctx, *dot.invars))
    (lhs_reads, lhs), (rhs_reads, rhs) = (_operand(dequant.dequantized(ctx, v) if fp8 else None, v) for v in dot.invars)

    def local_fn(*blocks):
        y = local_dot(dot, lhs(*blocks[:len(lhs_reads)]), rhs(*blocks[len(lhs_reads):]), 0)
        return (jax.lax.psum_scatter(y, axis, scatter_dimension=scattered, tiled=True),)

    skip = (j,) if reshard is None else tuple(ctx.eqns.index(e) for e in (dot, cast, reshard) if e is not None)
    site = global_site(ctx, local_fn, lhs_reads + rhs_reads, (target,), op=RS, axis_name=axis, exec_index=j,
                        skip=skip, dot=dot, collective=reshard or dot,
                        cast_after=None if cast is None else target.aval.dtype)
    if isinstance(site, str):
        return _miss(ctx, RS, j, axis, shapes, site)
    if fp8:
        y8, w8 = site.fp8_act, site.fp8_weight
        shapes = f"{typed(y8)} · {typed(w8)} (FP8, scaled) -> {typed(target)}"
    return _found(ctx, site, j, shapes)


def _all_reduce(ctx: MatchContext, j: int, axis: str, shapes: str) -> Site | SiteRecord:
    """The matmul_psum site of dot `j`, whose contraction is split over `axis` and whose result is
    replicated over it (an all-reduce), or why it is none."""
    dot = ctx.eqns[j]
    y = dot.outvars[0]
    if not ctx.users.get(y):
        return _miss(ctx, AR, j, axis, shapes,
                     f"an all-reduce over {axis!r} of a sum the program only returns (e.g. a data-parallel weight "
                     f"gradient): nothing reads it here to overlap it with; an out_sharding= with {axis!r} on a row "
                     f"dimension makes it matmul_rs")
    problem = ctx.not_enabled(AR)
    if problem:
        return _miss(ctx, AR, j, axis, shapes, problem)

    def local_fn(lhs, rhs):
        return (jax.lax.psum(local_dot(dot, lhs, rhs, 0), axis),)

    site = global_site(ctx, local_fn, tuple(dot.invars), (y,), op=AR, axis_name=axis, exec_index=j, skip=(j,),
                        dot=dot, collective=dot)
    if isinstance(site, str):
        return _miss(ctx, AR, j, axis, shapes, site)
    return _found(ctx, site, j, shapes)


def _implicit_gather(dot) -> tuple[int, int, str] | None:
    """(side, dimension, axis) of an operand the partitioner gathers for `dot`: sharded on a free
    dimension whose result dimension is not."""
    out_dims = axes_of(dot.outvars[0].aval)
    for side in (0, 1):
        dims = axes_of(dot.invars[side].aval)
        for d in free(dot, side):
            lost = [a for a in dims[d] if a not in out_dims[out_dim(dot, side, d)]]
            if lost:
                return side, d, lost[0]
    return None


def match_dot(ctx: MatchContext, j: int) -> Site | SiteRecord | None:
    """A matmul that reduce-scatters its product or gathers an operand itself."""
    dot = ctx.eqns[j]
    if j in ctx.taken_dots:
        return None
    meshes = [mesh_of(v.aval) for v in (*dot.invars, *dot.outvars) if hasattr(v.aval, "shape")]
    if not all(is_explicit(m) for m in meshes) or any(axes_of(v.aval) is None for v in (*dot.invars, *dot.outvars)):
        return None
    axis = _sharded_contraction(dot)
    if axis is not None:
        return _scatter(ctx, j, axis)
    gather = _implicit_gather(dot)
    if gather is None:
        return None
    side, dim, axis = gather
    shapes = f"x {typed(dot.invars[side])} gathered dim {dim} · w {typed(dot.invars[1 - side])} -> {typed(dot.outvars[0])}"
    dims = list(axes_of(dot.invars[side].aval))
    dims[dim] = tuple(a for a in dims[dim] if a != axis)
    problem = ctx.not_enabled(AG) or _gather_problem(dot, side, dim, axis, tuple(dims))
    if problem is None and axes_of(dot.invars[side].aval)[dim] != (axis,):
        problem = f"dimension {dim} is split over several axes {axes_of(dot.invars[side].aval)[dim]}"
    found = problem or _gather_site(ctx, j, j, side, dim, axis)
    return found if isinstance(found, Site) else _miss(ctx, AG, j, axis, shapes, found)


# The matchers of global-view code, in the order they run: reshards claim their matmuls first.
FAMILIES = ({name: match_reshard for name in _RESHARD}, {_DOT: match_dot})
