"""The op table: one record per pair of ops that are each other's transpose, and the positional
forms (x, w, axis_name, schedule) built from it, differentiable in forward and reverse mode.

A pair is a *gather* op (collective -> matmul; its side output is what the collective delivered)
and a *scatter* op (matmul -> collective):

    tensor parallel:  ag_matmul(x, w)  == all_gather(x) @ w                     (side: gathered x)
                      matmul_rs(y, w)  == psum_scatter(y @ w)
    expert parallel:  a2a_matmul(x, w) == einsum("pecd,edf->pecf", all_to_all(x), w)  (side: received x)
                      matmul_a2a(y, w) == all_to_all(einsum("pecf,efd->pecd", y, w))

with all_gather / psum_scatter / all_to_all tiled along dimension 0 (all_to_all split 0, concat 0).
Each is the other's transpose, so both backward passes are overlapped: the input gradient of the
gather op is the scatter op of the output gradient with w transposed, and its weight gradient a
local product with the side output; the input gradient of the scatter op is the gather op of the
output gradient, whose side output also feeds the weight gradient. Forward mode (jvp, jacfwd)
runs the op itself on the tangents; the tangent maps and their rules are in ops/tangents.py and
ops/linear.py.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..lowering import dma, xla
from .core import ScheduleArg, axis_size, check_operands, check_out_dtype, custom_jvp_pair, custom_jvp_plain
from .resolve import resolve_schedule
from .tangents import gather_map, gather_primal, gather_tangent, scatter_map, scatter_primal, scatter_tangent


@dataclasses.dataclass(frozen=True)
class OpPair:
    gather: str
    scatter: str
    # `out_dtype` below is the matmuls' result dtype, None for the operands' (ops/core.py).
    gather_ref: Callable          # (x, w, axis_name, out_dtype=None) -> out: the meaning of the gather op
    scatter_ref: Callable         # (y, w, axis_name, out_dtype=None) -> out
    # The four below take scales=(x_scale, w_scale) too where the pair has FP8 forms (ops/scaled.py).
    gather_dma: Callable          # (x, w, axis_name, sched, side_needed, out_dtype) -> (out, side)
    scatter_dma: Callable         # (y, w, axis_name, sched, out_dtype) -> out
    gather_xla: Callable          # (x, w, axis_name, sched, n, out_dtype) -> (out, side)   comm none / xla
    scatter_xla: Callable         # (y, w, axis_name, sched, n, out_dtype) -> out
    transpose_w: Callable         # w -> the weight of the transposed op
    side_collective: Callable     # (g_side, axis_name) -> its cotangent on the gather op's input
    gather_dw: Callable           # (side, g_out, out_dtype) -> the gather op's weight gradient
    scatter_dw: Callable          # (y, g_side, out_dtype) -> the scatter op's weight gradient
    gather_collective: Callable   # (x, axis_name) -> the gather op's side output, plain JAX
    gather_local: Callable        # (side, w, out_dtype) -> the gather op's output from its side output
    contraction: tuple            # (axis of the scatter op's y, axis of its w) contracted


def _all_to_all(v, axis_name):
    return lax.all_to_all(v, axis_name, 0, 0, tiled=True)


def _mm(a, b, out_dtype=None):
    return xla.product(a, b, out_dtype)


def _einsum(spec: str):
    def product(a, b, out_dtype=None):
        return xla.einsum(spec, a, b, out_dtype)
    return product


TENSOR_PARALLEL = OpPair(
    gather="ag_matmul", scatter="matmul_rs",
    gather_ref=lambda x, w, axis_name, out_dtype=None: _mm(lax.all_gather(x, axis_name, axis=0, tiled=True), w,
                                                          out_dtype),
    scatter_ref=lambda y, w, axis_name, out_dtype=None: lax.psum_scatter(_mm(y, w, out_dtype), axis_name,
                                                                        scatter_dimension=0, tiled=True),
    gather_dma=lambda x, w, a, s, side_needed, out_dtype, **fp8: dma.ag_matmul_dma(
        x, w, a, s, gathered_needed=side_needed, out_dtype=out_dtype, **fp8),
    scatter_dma=lambda y, w, a, s, out_dtype, **fp8: dma.matmul_rs_dma(y, w, a, s, out_dtype=out_dtype, **fp8),
    gather_xla=xla.ag_matmul, scatter_xla=xla.matmul_rs,
    transpose_w=lambda w: w.T,
    side_collective=lambda g, axis_name: lax.psum_scatter(g, axis_name, scatter_dimension=0, tiled=True),
    gather_dw=lambda gathered, g_out, out_dtype: _mm(gathered.T, g_out, out_dtype),
    scatter_dw=lambda y, g_gathered, out_dtype: _mm(y.T, g_gathered, out_dtype),
    gather_collective=lambda x, axis_name: lax.all_gather(x, axis_name, axis=0, tiled=True),
    gather_local=_mm,
    contraction=(1, 0),
)

EXPERT_PARALLEL = OpPair(
    gather="a2a_matmul", scatter="matmul_a2a",
    gather_ref=lambda x, w, axis_name, out_dtype=None: _einsum("pecd,edf->pecf")(_all_to_all(x, axis_name), w,
                                                                                out_dtype),
    scatter_ref=lambda y, w, axis_name, out_dtype=None: _all_to_all(_einsum("pecf,efd->pecd")(y, w, out_dtype),
                                                                   axis_name),
    gather_dma=lambda x, w, a, s, side_needed, out_dtype: dma.a2a_matmul_dma(x, w, a, s, received_needed=side_needed,
                                                                             out_dtype=out_dtype),
    scatter_dma=lambda y, w, a, s, out_dtype: dma.matmul_a2a_dma(y, w, a, s, out_dtype=out_dtype),
    gather_xla=xla.a2a_matmul, scatter_xla=xla.matmul_a2a,
    transpose_w=lambda w: jnp.swapaxes(w, 1, 2),
    side_collective=_all_to_all,
    gather_dw=_einsum("pecd,pecf->edf"),
    scatter_dw=_einsum("pecf,pecd->efd"),
    gather_collective=_all_to_all,
    gather_local=_einsum("pecd,edf->pecf"),
    contraction=(3, 1),
)


@dataclasses.dataclass(frozen=True)
class ScheduledForms:
    """The positional forms of one pair: the gather op returning out, or (out, side) when the side
    output has other users; the scatter op."""
    gather: Callable
    gather_with_side: Callable
    scatter: Callable


def gather_impl(pair: OpPair, x, w, axis_name, sched, out_dtype, side_needed=True, **fp8):
    """The gather op of `pair` run by `sched`, on copy engines or in plain JAX: (out, side). `fp8`:
    scales=(x_scale, w_scale) for FP8 operands (ops/scaled.py)."""
    if sched.comm == "dma":
        return pair.gather_dma(x, w, axis_name, sched, side_needed, out_dtype, **fp8)
    return pair.gather_xla(x, w, axis_name, sched, axis_size(axis_name, pair.gather), out_dtype, **fp8)


def scatter_impl(pair: OpPair, y, w, axis_name, sched, out_dtype, **fp8):
    """The scatter op of `pair` run by `sched`, as `gather_impl`: out."""
    if sched.comm == "dma":
        return pair.scatter_dma(y, w, axis_name, sched, out_dtype, **fp8)
    return pair.scatter_xla(y, w, axis_name, sched, axis_size(axis_name, pair.scatter), out_dtype, **fp8)


def _scheduled_forms(pair: OpPair) -> ScheduledForms:
    gather_run, scatter_run = functools.partial(gather_impl, pair), functools.partial(scatter_impl, pair)

    # The tangent maps call the forms (their transposes are the other op), the forms the maps.
    def get_forms():
        return forms

    gmap, smap = gather_map(pair, gather_run, get_forms), scatter_map(pair, scatter_run, get_forms)
    gather, gather_with_side = custom_jvp_pair(gather_primal(gmap, gather_run), gather_tangent(gmap), pair.gather,
                                               f"{pair.gather}_with_side")
    scatter = custom_jvp_plain(scatter_primal(smap, scatter_run), scatter_tangent(smap), pair.scatter)
    forms = ScheduledForms(gather, gather_with_side, scatter)
    return forms


#: op name -> (its pair, its positional forms).
PAIRS = {pair.gather: pair for pair in (TENSOR_PARALLEL, EXPERT_PARALLEL)}
PAIRS.update({pair.scatter: pair for pair in (TENSOR_PARALLEL, EXPERT_PARALLEL)})
FORMS = {pair.gather: _scheduled_forms(pair) for pair in (TENSOR_PARALLEL, EXPERT_PARALLEL)}
FORMS.update({pair.scatter: FORMS[pair.gather] for pair in (TENSOR_PARALLEL, EXPERT_PARALLEL)})


def run_scheduled(op: str, a, w, axis_name: str, sched, *, with_side: bool = False, out_dtype=None):
    """`op` (a name of the table) with a resolved schedule: out, or (out, side) for a gather op
    with `with_side`; the matmuls' results in `out_dtype` (None: the operands' dtype)."""
    pair, forms = PAIRS[op], FORMS[op]
    if op == pair.scatter:
        return forms.scatter(a, w, axis_name, sched, out_dtype)
    return (forms.gather_with_side if with_side else forms.gather)(a, w, axis_name, sched, out_dtype)


def reference(op: str):
    """The plain-JAX meaning of `op`: a function (a, w, axis_name, out_dtype=None) -> out."""
    pair = PAIRS[op]
    return pair.gather_ref if op == pair.gather else pair.scatter_ref


def call(op: str, a, w, axis_name: str, schedule: ScheduleArg, *, with_side=False, side_flag: str = "",
         measure: Callable | None = None, out_dtype=None):
    """`op` as the public functions run it: check the operands, resolve `schedule` for this call
    (`measure` times candidates for "autotune"), run the positional form."""
    n = axis_size(axis_name, op)
    check_operands(op, a, w)
    out_dtype = check_out_dtype(op, out_dtype, a.dtype)
    if not isinstance(with_side, (bool, np.bool_)):
        raise TypeError(f"{op}: {side_flag} must be a bool, found {with_side!r}")
    sched = resolve_schedule(op, schedule, (a.shape, w.shape), a.dtype, n, axis_name=axis_name, measure=measure,
                             out_dtype=out_dtype)
    return run_scheduled(op, a, w, axis_name, sched, with_side=bool(with_side), out_dtype=out_dtype)
