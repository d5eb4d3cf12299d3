"""One primitive for the tangent maps of the ops, so that both modes of differentiation run them
(and its twin for maps whose evaluation XLA partitions: ops/partitioned.py).

A tangent map is linear in its *linear* operands (the tangents) given its *residual* operands
(the primals it needs), e.g. ``(dx, dw) -> ag_matmul(dx, w) + all_gather(x) @ dw``. What differs
per map is a `LinearMap` record (ops/tangents.py); this module gives every map the rules JAX needs:

  evaluation   map.apply: the map computed with the op's own schedule (forward mode, jvp / jacfwd)
  transpose    map.transpose: the op's overlapped backward (reverse mode: grad, vjp)
  jvp          the map again on the linear operands' tangents, plus map.res_jvp for the
               residuals' tangents (forward over forward, and reverse over forward)
  batching     one equation where the map folds the batch into its operands (a batch of inputs
               against one weight: the op on the batch's rows, the results reordered), else the
               map once per batch element, in a `lax.map` loop (jacfwd vmaps the tangents;
               jax.vmap of an op takes the same path)

The op itself is bilinear, so it is such a map too (linear in its input given its weight); the
positional forms evaluate it as one of these equations (ops/tangents.py; the FP8 forms, linear in
each of their operands and scales given the others, ops/scaled.py).

Each equation carries where the op was written (`site`, read when it is bound: the user's line, or
the line of the collective `overlap()` replaced), because its executor calls are bound only when
the equation is lowered, and the watchdog's report names them by it; the backward and tangent
maps keep their op's site.

A custom_vjp cannot be differentiated in forward mode, and a custom_jvp whose tangent calls a
custom_vjp cannot be transposed: the tangent has to be one equation that carries its own
transpose, which is what this primitive is.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dispatch  # custom_partitioning's own registry of primitives lowered with devices
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..lowering.dma.registry import aval, current_site, site_label
from .core import like_aval


class LinearMap(abc.ABC):
    """The parts of a tangent map that differ per op. `static` is its hashable configuration (axis
    name, schedule, flags); absent operands (zero tangents, unneeded residuals) are None. A map is
    a parameter of its equations: hashable, and equal only to a map with the same rules."""

    name: str
    # Whether its evaluation holds custom-partitioned equations (partitioned_linear_p).
    partitioned: bool = False

    @abc.abstractmethod
    def apply(self, static, res: tuple, lin: tuple) -> tuple:
        """The map's outputs (None: zero)."""

    @abc.abstractmethod
    def transpose(self, static, res: tuple, cts: tuple, wanted: tuple) -> tuple:
        """The cotangent of each linear operand (None: not wanted, or zero)."""

    @abc.abstractmethod
    def res_jvp(self, static, res: tuple, lin: tuple, t_res: tuple, outs: tuple) -> tuple:
        """Per output the tangent contributed by the residuals' tangents (None: zero); linear in
        `t_res` and transposable."""

    def sums_before_cast(self, static) -> bool:
        """Whether a cotangent summed over the mesh axes its primal is replicated on is summed
        before the cast to the primal's dtype (global-view code) or after (a shard_map body)."""
        return False

    def fold_batch(self, static, res: tuple, lin: tuple, batched_res: tuple, batched_lin: tuple) -> Optional[Folded]:
        """The map on operands with a leading batch dimension (`batched_*`: which have one) as one
        equation of this map, or None where it has none (the batch then runs in a loop)."""
        return None


class Folded(NamedTuple):
    """A batch folded into one equation: its operands (absent ones None, as before), the shapes of
    its results, and how one result gets its batch dimension back (leading)."""
    res: tuple
    lin: tuple
    out_shapes: tuple
    unfold: Callable[[jax.Array], jax.Array]


linear_p = Primitive("ficco_linear")
linear_p.multiple_results = True
# The same equation for maps whose evaluation is partitioned by XLA with the concrete devices
# (custom_partitioning: ops/partitioned.py): jax.jit keeps the device assignment while it lowers a
# program holding one, as it does for custom_partitioning's own equations.
partitioned_linear_p = Primitive("ficco_linear_partitioned")
partitioned_linear_p.multiple_results = True


def bind(lmap: LinearMap, static, res, lin, out_avals) -> list:
    """`lmap` on (res, lin) as one equation; `out_avals` are its outputs' abstract values."""
    res_mask = tuple(r is not None for r in res)
    lin_mask = tuple(v is not None for v in lin)
    operands = [r for r in res if r is not None] + [v for v in lin if v is not None]
    return _primitive(lmap).bind(*operands, lmap=lmap, static=static, res_mask=res_mask, lin_mask=lin_mask,
                                 out_avals=tuple(out_avals), site=current_site(),
                                 precision=jax.config.jax_default_matmul_precision)


def _primitive(lmap: LinearMap) -> Primitive:
    return partitioned_linear_p if lmap.partitioned else linear_p


def _matmul_precision(precision):
    """The `jax.default_matmul_precision` in force where the equation was bound: its matmuls are
    traced again when it is lowered (or transposed), outside the user's `with` block."""
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def _split(args, res_mask, lin_mask):
    """(res, lin) with None at absent positions."""
    it = iter(args)
    res = tuple(next(it) if present else None for present in res_mask)
    lin = tuple(next(it) if present else None for present in lin_mask)
    return res, lin


def _apply(*args, lmap, static, res_mask, lin_mask, out_avals, site, precision):
    res, lin = _split(args, res_mask, lin_mask)
    with site_label(site), _matmul_precision(precision):
        outs = lmap.apply(static, res, lin)
    return [jnp.zeros(a.shape, a.dtype) if o is None else o for o, a in zip(outs, out_avals)]


def _abstract_eval(*args, out_avals, **_):
    return list(out_avals)


def _nonzero(t):
    return None if t is None or type(t) is ad.Zero else t


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _jvp(primals, tangents, *, lmap, static, res_mask, lin_mask, out_avals, site, precision):
    """d map(res, lin) = map(res, d lin) + (d/d res) map(res, lin) [d res]: linear in both."""
    params = dict(lmap=lmap, static=static, res_mask=res_mask, lin_mask=lin_mask, out_avals=out_avals, site=site,
                  precision=precision)
    outs = _primitive(lmap).bind(*primals, **params)
    res, lin = _split(primals, res_mask, lin_mask)
    t_res, t_lin = _split([_nonzero(t) for t in tangents], res_mask, lin_mask)
    total = [None] * len(outs)
    with site_label(site), _matmul_precision(precision):
        if any(t is not None for t in t_lin):
            total = list(bind(lmap, static, res, t_lin, out_avals))
        if any(t is not None for t in t_res):
            total = [_add(a, b) for a, b in zip(total, lmap.res_jvp(static, res, lin, t_res, outs))]
    return outs, [ad.Zero(a.to_tangent_aval()) if t is None else t for t, a in zip(total, out_avals)]


def _transpose(cts, *args, lmap, static, res_mask, lin_mask, out_avals, site, precision):
    """The op's overlapped backward; residuals are always known here (the primals of a tangent)."""
    res, lin = _split(args, res_mask, lin_mask)
    if any(ad.is_undefined_primal(r) for r in res if r is not None):
        raise NotImplementedError(f"{lmap.name}: transposing with respect to a residual operand")
    wanted = tuple(v is not None and ad.is_undefined_primal(v) for v in lin)
    with site_label(site), _matmul_precision(precision):
        lin_cts = lmap.transpose(static, res, tuple(_nonzero(c) for c in cts), wanted)
    out = [None] * sum(res_mask)
    for v, want, ct in zip(lin, wanted, lin_cts):
        if v is not None:
            out.append(like_aval(ct, v.aval, sum_first=lmap.sums_before_cast(static)) if want and ct is not None
                       else None)
    return out


def _batch(args, dims, **params):
    """One equation where the map folds the batch into its operands (a batch of inputs against one
    weight joins the rows), else one equation per batch element, in a loop: the op's schedules take
    no batch dimension of their own."""
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    res, lin = _split(moved, params["res_mask"], params["lin_mask"])
    batched_res, batched_lin = _split([d is not None for d in dims], params["res_mask"], params["lin_mask"])
    folded = params["lmap"].fold_batch(params["static"], res, lin, batched_res, batched_lin)
    if folded is not None:
        out_avals = tuple(aval(a, shape) for a, shape in zip(params["out_avals"], folded.out_shapes))
        operands = [r for r in folded.res if r is not None] + [v for v in folded.lin if v is not None]
        outs = _primitive(params["lmap"]).bind(*operands, **{**params, "out_avals": out_avals})
        return [folded.unfold(o) for o in outs], [0] * len(outs)
    batched = [i for i, d in enumerate(dims) if d is not None]

    def one(sliced):
        full = list(moved)
        for i, v in zip(batched, sliced):
            full[i] = v
        return _primitive(params["lmap"]).bind(*full, **params)

    outs = lax.map(one, [moved[i] for i in batched])
    return outs, [0] * len(outs)


for _p in (linear_p, partitioned_linear_p):
    _p.def_impl(_apply)
    _p.def_abstract_eval(_abstract_eval)
    mlir.register_lowering(_p, mlir.lower_fun(_apply, multiple_results=True))
    ad.primitive_jvps[_p] = _jvp
    ad.primitive_transposes[_p] = _transpose
    batching.primitive_batchers[_p] = _batch
getattr(dispatch, "prim_requires_devices_during_lowering", set()).add(partitioned_linear_p)
