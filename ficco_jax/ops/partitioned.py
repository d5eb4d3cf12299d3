"""`dot_general` for Auto-mode (GSPMD / Shardy) programs: ``jax.lax.dot_general``, partitioned by
XLA's partitioner through ``jax.experimental.custom_partitioning``, each partition lowered to the
op its operand shardings imply.

Under ``jax.jit(in_shardings=..., out_shardings=...)``, ``with_sharding_constraint`` and Flax
Linen's logical axes, shardings are not part of the types: the partitioner chooses them after JAX
has traced the program. This op states its sharding rule (the einsum of the dot: batch and
contracting dims shared, contracting dims a reduction) and lets the partitioner decide; its
partition callback then sees the concrete mesh, the operands' shardings and the sharding wanted
of the result, and picks the op they imply (partition_plan.py): ag_matmul, matmul_rs,
matmul_psum over one mesh axis, or the local dot.

The per-device function it returns runs the ficco op over the mesh's axis `a` (the partitioner
lowers it with every mesh axis manual, as a shard_map body), on the local blocks viewed as
matrices: the lhs free dims are rows (the gathered / scattered one first), the contracting dims
columns. Its derivatives (forward and reverse mode) are dots again: the tangent map is one
ops/linear.py equation whose transposes are JAX's transposes of the dot, with each of their dots
this op, so the partitioner places (and this op overlaps) the backward's collectives too.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import config
from .api import ag_matmul, matmul_psum, matmul_rs
from . import linear
from .core import ScheduleArg
from .linear import LinearMap
from .partition_plan import AG, AR, PLAIN, RS, DotDims, Plan, choose_plan, dim_axes, plain_plan, spec_entry

log = logging.getLogger("ficco_jax")


def _dims_of(sharding, ndim: int) -> list:
    """Each dimension's mesh axes in NamedSharding `sharding` (replicated when it is unknown)."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return [dim_axes(e) for e in spec + (None,) * (ndim - len(spec))]


# -- the per-device computation ----------------------------------------------------------------------

def _local_matrix_op(plan: Plan, dims: DotDims, schedule, out_dtype):
    """The per-device function of a ficco plan: blocks -> result block."""
    op = {AG: ag_matmul, RS: matmul_rs, AR: matmul_psum}[plan.op]
    lead = () if plan.row_dim is None else (plan.row_dim,)
    rows = lead + tuple(d for d in dims.lhs_free if d not in lead)

    def local(lhs, rhs):
        x = jnp.transpose(lhs, rows + dims.lhs_contract)
        row_shape = x.shape[:len(rows)]
        x = x.reshape(int(np.prod(row_shape, dtype=np.int64)), -1)
        w = jnp.transpose(rhs, dims.rhs_contract + dims.rhs_free)
        col_shape = w.shape[len(dims.rhs_contract):]
        w = w.reshape(-1, int(np.prod(col_shape, dtype=np.int64)))
        y = op(x, w, plan.axis, schedule=schedule, out_dtype=out_dtype)
        y = y.reshape((-1,) + row_shape[1:] + col_shape)  # the row dim's length changes (gathered / scattered)
        # back to dot_general's order: lhs free dims as they were, then the rhs free dims
        back = [rows.index(d) for d in dims.lhs_free] + [len(rows) + k for k in range(len(col_shape))]
        return jnp.transpose(y, back)

    return local


def _block(shape, dim_axes: tuple, mesh):
    """The per-device block of an array of `shape` sharded as `dim_axes`."""
    dims = [size // int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
            for size, axes in zip(shape.shape, dim_axes)]
    return jax.ShapeDtypeStruct(tuple(dims), shape.dtype)


def _as_manual_body(fn, mesh, blocks):
    """`fn` of per-device blocks as the partitioner lowers it: every mesh axis manual.

    The ops are written for shard_map bodies (their operands typed as varying over their axis),
    while the partitioner traces a custom partition with the mesh's axes bound but no shard_map,
    and lowers it after Shardy has run (a shard_map there would leave Shardy's own custom calls
    unlowered). So `fn` is traced as the body of a shard_map over the mesh whose blocks are the
    whole local arrays (specs P()), and that body, not the shard_map, is the per-device function."""
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(blocks), out_specs=P(), check_vma=False)
    with jax.set_mesh(mesh):  # the ops' schedule resolution finds the axis's devices there
        traced = jax.make_jaxpr(mapped)(*blocks)
    (eqn,) = traced.jaxpr.eqns
    body = eqn.params["jaxpr"]
    body, body_consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())

    def local(*args):
        env = dict(zip(traced.jaxpr.constvars, traced.consts))
        env.update(zip(traced.jaxpr.invars, args))
        inner = [v.val if isinstance(v, jex.Literal) else env[v] for v in eqn.invars]
        (out,) = jax.core.eval_jaxpr(body, body_consts, *inner)
        return out

    return local


def _ficco_local(plan: Plan, dims: DotDims, mesh, blocks, schedule, preferred_element_type):
    """The per-device function of a ficco plan, or None where its op takes no schedule for these
    blocks. A given schedule the op refuses (rows that do not divide by its chunks, comm="dma"
    where copy engines do not reach) is replaced by the one "auto" picks, with a warning: one
    schedule given to a model's dots meets other shapes in their backward."""
    out_dtype = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    tried = [schedule] if isinstance(schedule, str) and schedule in ("auto", "autotune") else [schedule, "auto"]
    for candidate in tried:
        try:
            return _as_manual_body(_local_matrix_op(plan, dims, candidate, out_dtype), mesh, blocks)
        except (ValueError, TypeError) as err:
            log.warning("dot_general: %s over %r takes no schedule %s for blocks %s and %s (%s)", plan.op, plan.axis,
                        candidate, *(b.shape for b in blocks), (str(err).splitlines() or [""])[0])
    return None


def _divides(shapes, dim_axes_of: tuple, mesh) -> bool:
    """Whether every dim of `shapes` divides by the devices of the mesh axes it is sharded over."""
    return all(size % int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64)) == 0
               for shape, per_dim in zip(shapes, dim_axes_of) for size, axes in zip(shape, per_dim))


def _local_dot(plan: Plan, dims: DotDims, precision, preferred_element_type):
    """The per-device function of the local dot (summed over a contraction left sharded)."""
    def local(lhs, rhs):
        out = lax.dot_general(lhs, rhs, dims.dimension_numbers, precision=precision,
                              preferred_element_type=preferred_element_type)
        return lax.psum(out, plan.psum_axes) if plan.psum_axes else out
    return local


def _ficco_applies(lhs_dtype, rhs_dtype) -> bool:
    """The ficco ops take two operands of one non-FP8 floating dtype."""
    return lhs_dtype == rhs_dtype and jnp.issubdtype(lhs_dtype, jnp.floating) and not config.is_fp8(lhs_dtype)


@functools.lru_cache(maxsize=None)
def _partitioned(dims: DotDims, precision, preferred_element_type, schedule):
    """The custom_partitioning dot for one static configuration (cached: one per call signature)."""

    def reference(lhs, rhs):
        return lax.dot_general(lhs, rhs, dims.dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)

    fn = custom_partitioning(reference)

    def plan_of(arg_shapes, result_shape) -> Plan:
        lhs, rhs = arg_shapes
        specs = (_dims_of(lhs.sharding, dims.lhs_ndim), _dims_of(rhs.sharding, dims.rhs_ndim),
                 _dims_of(result_shape.sharding, len(result_shape.shape)))
        ficco = _ficco_applies(lhs.dtype, rhs.dtype)
        return choose_plan(dims, *specs, ficco=ficco)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        lhs, rhs = arg_shapes
        plan = plain_plan(dims, _dims_of(lhs.sharding, dims.lhs_ndim), _dims_of(rhs.sharding, dims.rhs_ndim))
        return NamedSharding(mesh, P(*map(spec_entry, plan.out)))

    def partition(mesh, arg_shapes, result_shape):
        plan, local = plan_of(arg_shapes, result_shape), None
        shapes = (arg_shapes[0].shape, arg_shapes[1].shape, result_shape.shape)
        if plan.op != PLAIN and _divides(shapes, (plan.lhs, plan.rhs, plan.out), mesh):
            blocks = [_block(shape, axes, mesh) for shape, axes in zip(arg_shapes, (plan.lhs, plan.rhs))]
            local = _ficco_local(plan, dims, mesh, blocks, schedule, preferred_element_type)
        if local is None:  # the local dot, on the shardings the operands have (uneven blocks included)
            plan = plain_plan(dims, *(_dims_of(a.sharding, len(a.shape)) for a in arg_shapes))
            local = _local_dot(plan, dims, precision, preferred_element_type)
        log.debug("dot_general %s: %s over %s", dims.dimension_numbers, plan.op, plan.axis)
        named = lambda axes: NamedSharding(mesh, P(*map(spec_entry, axes)))  # noqa: E731
        return mesh, local, named(plan.out), (named(plan.lhs), named(plan.rhs))

    rule, reduction = dims.sharding_rule()
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                     propagate_user_sharding=None, sharding_rule=rule, reduction_factors=reduction)
    return fn


# -- the public op: one equation that carries its own derivatives (ops/linear.py) ------------------------

@dataclasses.dataclass(frozen=True)
class DotStatic:
    """The hashable configuration of a partitioned dot: lax.dot_general's static arguments, the
    schedule, and the operands' shapes and dtypes (a transpose needs the shape of an operand it
    is not given)."""
    dimension_numbers: tuple
    precision: object
    preferred_element_type: object
    schedule: object
    lhs: tuple  # (shape, dtype)
    rhs: tuple

    def partitioned(self, lhs, rhs):
        """The custom-partitioned dot of `lhs` and `rhs`."""
        dims = DotDims.of(self.dimension_numbers, lhs.ndim, rhs.ndim)
        return _partitioned(dims, self.precision, self.preferred_element_type, self.schedule)(lhs, rhs)

    def reference(self, lhs, rhs):
        return lax.dot_general(lhs, rhs, self.dimension_numbers, precision=self.precision,
                               preferred_element_type=self.preferred_element_type)


class _DotMap(LinearMap):
    """The dot as a map linear in its operands given the others: res (lhs, rhs), lin (d lhs, d rhs),
    ``map = dot(d lhs, rhs) + dot(lhs, d rhs)``; the op itself is ``res (None, rhs), lin (lhs, None)``.
    Each dot is the custom-partitioned one; the transposes are JAX's transposes of lax.dot_general
    (its dtype rules included) with their dots this map again, so every order of differentiation
    stays partitioned, and overlapped where the partitioner's shardings call for it."""

    name = "dot_general_tangent"
    partitioned = True

    def sums_before_cast(self, static) -> bool:
        return True  # the partitioner's order (ops/core.like_primal)

    def apply(self, static: DotStatic, res, lin):
        terms = [static.partitioned(lin[0], res[1]) if lin[0] is not None else None,
                 static.partitioned(res[0], lin[1]) if lin[1] is not None else None]
        present = [t for t in terms if t is not None]
        return (functools.reduce(jnp.add, present) if present else None,)

    def transpose(self, static: DotStatic, res, cts, wanted):
        (ct,) = cts
        if ct is None:
            return (None, None)
        lhs_t = (lambda a: static.reference(a, res[1]), static.lhs) if wanted[0] else None
        rhs_t = (lambda b: static.reference(res[0], b), static.rhs) if wanted[1] else None
        return tuple(None if t is None else _transposed(t[0], t[1], ct, static.schedule) for t in (lhs_t, rhs_t))

    def res_jvp(self, static: DotStatic, res, lin, t_res, outs):
        terms = [_bind_dot(static, (lin[0], None), (None, t_res[1])) if lin[0] is not None and t_res[1] is not None
                 else None,
                 _bind_dot(static, (None, lin[1]), (t_res[0], None)) if lin[1] is not None and t_res[0] is not None
                 else None]
        present = [t for t in terms if t is not None]
        return (functools.reduce(jnp.add, present) if present else None,)


_DOT_MAP = _DotMap()


def _bind_dot(static: DotStatic, res, lin):
    """One equation of the dot map (its operands' absent positions None)."""
    out = jax.make_jaxpr(static.reference)(*_operand_pair(res, lin)).out_avals[0]
    (result,) = linear.bind(_DOT_MAP, static, res, lin, [out])
    return result


def _operand_pair(res, lin):
    """(lhs, rhs) of a map equation: each from the residual or the linear operand, whichever is there."""
    return tuple(r if r is not None else v for r, v in zip(res, lin))


def _transposed(fn, operand: tuple, ct, schedule):
    """The transpose of linear `fn` (of an operand of shape and dtype `operand`) applied to `ct`,
    JAX's transpose with each of its dots bound as this op."""
    shape, dtype = operand
    transpose = jax.linear_transpose(fn, jax.ShapeDtypeStruct(shape, dtype))
    closed = jax.make_jaxpr(transpose)(ct)
    (out,) = eval_with_partitioned_dots(closed.jaxpr, closed.consts, schedule, ct)
    return out


def eval_with_partitioned_dots(jaxpr, consts, schedule, *args):
    """Evaluate `jaxpr` with each of its (top-level) dot_generals bound as this module's dot."""
    env = {}
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
    for var, value in (*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive is lax.dot_general_p:
            outs = [dot_general(*invals, eqn.params["dimension_numbers"], eqn.params["precision"],
                                eqn.params["preferred_element_type"], schedule=schedule)]
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                schedule: ScheduleArg = "auto", out_sharding=None):
    """``jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)``,
    partitioned by XLA's partitioner and, where the shardings it chooses call for communication,
    run as the ficco op they imply (module docstring): all-gather -> matmul, matmul ->
    reduce-scatter or matmul -> all-reduce, overlapped by `schedule` ("auto", "autotune", a
    `Schedule` or its string form; "none": the plain collective, then the matmul).

    For Auto-mode programs (``jax.jit`` with in/out shardings, ``with_sharding_constraint``, Flax
    Linen's logical axes): ``nn.Dense(..., dot_general=ficco_jax.dot_general)``, or
    ``functools.partial(ficco_jax.dot_general, schedule="dma/direct/c2")``. Outside jit, on one
    device or inside ``jax.shard_map`` it is the plain dot. Differentiable in both modes, to any
    order (one ops/linear.py equation, `_DotMap`): the tangent and the transposes are dots
    partitioned the same way, so the partitioner places the backward's collectives and this op
    overlaps them. ``out_sharding=`` (explicit mode) is lax.dot_general's.
    The ficco ops run at the default matmul precision; `precision` applies to the local dots.
    """
    if out_sharding is not None:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)
    if isinstance(precision, list):
        precision = tuple(precision)
    pet = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    (lc, rc), (lb, rb) = dimension_numbers
    dimension_numbers = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    static = DotStatic(dimension_numbers, precision, pet, schedule, (tuple(lhs.shape), jnp.dtype(lhs.dtype)),
                       (tuple(rhs.shape), jnp.dtype(rhs.dtype)))
    return _bind_dot(static, (None, rhs), (lhs, None))
