"""The public ops. Inside `jax.shard_map`, each equals its plain-JAX reference for every schedule:

    ag_matmul(x, w, "tp")   == all_gather(x, "tp", axis=0, tiled=True) @ w
    ag_matmul(x, [w1, w2], "tp") == [all_gather(x, "tp", axis=0, tiled=True) @ w for w in (w1, w2)]
    matmul_rs(y, w, "tp")   == psum_scatter(y @ w, "tp", scatter_dimension=0, tiled=True)
    matmul_psum(y, w, "tp") == psum(y @ w, "tp")
    a2a_matmul(x, w, "ep")  == einsum("pecd,edf->pecf", all_to_all(x, "ep", 0, 0, tiled=True), w)
    matmul_a2a(y, w, "ep")  == all_to_all(einsum("pecf,efd->pecd", y, w), "ep", 0, 0, tiled=True)

Each checks its operands, resolves its `schedule` (ops/resolve.py; "autotune" times candidates with
ops/measure.py) and runs the positional form of its pair of the op table (ops/run.py, ops/table.py).
Every op is differentiable in both modes: forward mode (jax.jvp, jax.jacfwd) runs the op itself on the
tangents with the same schedule, reverse mode (jax.grad, jax.vjp) runs the other op of its pair,
so the backward pass is overlapped too (matmul_psum's backward is two local matmuls: the
cotangent of a sum is every device's); the two compose (Hessian-vector products, grad of grad).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import scaled
from .core import ScheduleArg, check_arrays
from .measure import time_op
from .run import call
from .table import reference


def ag_matmul_ref(x, w, axis_name, *, out_dtype=None, x_scale=None, w_scale=None):
    """The meaning of `ag_matmul`: `all_gather(x, axis_name, axis=0, tiled=True) @ w` (result in
    `out_dtype`); with scales, of FP8 operands dequantized in f32 (ops/scaled.py). With a list of
    weights, the list of products."""
    if isinstance(w, (list, tuple)):
        return [ag_matmul_ref(x, v, axis_name, out_dtype=out_dtype) for v in w]
    if x_scale is not None or w_scale is not None:
        return _dequantized_dot(lax.all_gather(x, axis_name, axis=0, tiled=True), w, x_scale, w_scale, out_dtype)
    return reference("ag_matmul")(x, w, axis_name, out_dtype)


def matmul_rs_ref(y, w, axis_name, *, out_dtype=None, x_scale=None, w_scale=None):
    """The meaning of `matmul_rs`: `psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`;
    with scales, of FP8 operands dequantized in f32, the partials in `out_dtype`."""
    if x_scale is not None or w_scale is not None:
        return lax.psum_scatter(_dequantized_dot(y, w, x_scale, w_scale, out_dtype), axis_name, scatter_dimension=0,
                                tiled=True)
    return reference("matmul_rs")(y, w, axis_name, out_dtype)


def matmul_psum_ref(y, w, axis_name, *, out_dtype=None):
    """The meaning of `matmul_psum`: ``psum(y @ w, axis_name)`` (result in `out_dtype`)."""
    return reference("matmul_psum")(y, w, axis_name, out_dtype)


def _dequantized_dot(a, w, a_scale, w_scale, out_dtype):
    """``((a.astype(f32) * a_scale) @ (w.astype(f32) * w_scale)).astype(out_dtype)``, out_dtype bf16 by default."""
    f32 = jnp.float32
    out = jnp.matmul(a.astype(f32) * a_scale, w.astype(f32) * w_scale, preferred_element_type=f32)
    return out.astype(out_dtype or jnp.bfloat16)


def a2a_matmul_ref(x, w, axis_name, *, out_dtype=None):
    """The meaning of `a2a_matmul`: ``einsum("pecd,edf->pecf", all_to_all(x, axis_name, 0, 0, tiled), w)``."""
    return reference("a2a_matmul")(x, w, axis_name, out_dtype)


def matmul_a2a_ref(y, w, axis_name, *, out_dtype=None):
    """The meaning of `matmul_a2a`: ``all_to_all(einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled)``."""
    return reference("matmul_a2a")(y, w, axis_name, out_dtype)


def ag_matmul(x, w, axis_name: str, *, schedule: ScheduleArg = "auto", return_gathered: bool = False,
              out_dtype=None, x_scale=None, w_scale=None, w_col_major: bool = False):
    """`all_gather(x, axis_name, axis=0, tiled=True) @ w`, overlapped by a FiCCO schedule.

    Per device: x [m, K], w [K, N] -> [n*m, N] (n = size of `axis_name`). With
    `return_gathered=True` also returns the gathered x [n*m, K], so a caller that needs it gathers
    nothing twice. `schedule` is "auto" (the cost model's pick), "autotune" (measured once, then
    cached), a `Schedule`, or its string form ("dma/direct/c4/s2"). Differentiable in both modes;
    the backward pass is itself overlapped. dtypes: any float; `comm="dma"` takes bf16, f16, f32.

    `out_dtype` is the matmul's result dtype, as `preferred_element_type` of `jnp.matmul`: None
    (the operands'), or f32 for bf16/f16 operands (mixed precision: f32 accumulation and result).
    With mixed precision the backward is JAX's: the gradient matmuls take the f32 cotangent and the
    bf16 operand widened to f32, and each gradient is rounded to bf16 once, so the input gradient's
    reduce-scatter moves and sums bf16 partials (that op runs on XLA's collectives: copy engines do
    not round f32 products to bf16). A narrower `out_dtype` than the operands' (bf16 from f32)
    rounds the f32 product, ``(a @ w).astype(out_dtype)``; comm="xla" or "none" only.

    FP8: x and w ``float8_e4m3fn`` / ``float8_e5m2`` (not both e5m2) with per-tensor f32 scales
    `x_scale`, `w_scale` compute ``((all_gather(x).astype(f32) * x_scale) @ (w.astype(f32) *
    w_scale)).astype(out_dtype)`` (out_dtype bf16 by default, or f16, f32): the gather moves FP8
    bytes, the matmuls are FP8. Differentiable in both modes, with an overlapped backward whose
    precision ops/scaled.py states; scales may be traced (delayed scaling updates them).

    `w_col_major=True` has the copy-engine matmuls (`comm="dma"`) read w column-major: pass it where
    w is the transpose of a stored array (``v.T``, as in ``x @ v.T``), whose buffer XLA then hands
    over as it is instead of writing the transpose out first. The result is the same either way;
    XLA's own dots (`comm="xla"`, `"none"`) read any layout, and FP8 matmuls always read w so.
    The backward reads w^T in the other layout, which is w's own.

    Several weights, ``ag_matmul(x, [w1, w2, w3], axis_name)`` (q/k/v or gate/up projections of
    one gathered x), return one product per weight, as a list, from one op: the weights' columns
    side by side ([K, N1 + N2 + N3], one copy of them per call), so each chunk of x is moved once
    and feeds every weight's chunk matmul. The backward is then one reduce-scatter of the summed
    input gradients.
    """
    if isinstance(w, (list, tuple)):
        return _ag_matmul_weights(x, w, axis_name, schedule=schedule, return_gathered=return_gathered,
                                  out_dtype=out_dtype, x_scale=x_scale, w_scale=w_scale, w_col_major=w_col_major)
    if scaled.wanted(x, x_scale, w_scale):
        return scaled.call("ag_matmul", x, w, axis_name, schedule, (x_scale, w_scale), out_dtype,
                           with_side=return_gathered, measure=time_op)
    return call("ag_matmul", x, w, axis_name, schedule, with_side=return_gathered, side_flag="return_gathered",
                measure=time_op, out_dtype=out_dtype, w_col_major=w_col_major)


def _ag_matmul_weights(x, weights, axis_name, *, schedule, return_gathered, out_dtype, x_scale, w_scale, w_col_major):
    """`ag_matmul` of `x` with each of `weights`, as one op on their columns side by side."""
    weights = list(weights)
    if not weights:
        raise ValueError("ag_matmul: w is an empty list; give one weight or a list of them")
    if x_scale is not None or w_scale is not None or w_col_major:
        raise TypeError("ag_matmul: a list of weights takes neither x_scale/w_scale (one scale per weight would "
                        "be needed) nor w_col_major; call ag_matmul once per weight for those")
    for k, v in enumerate(weights):
        check_arrays("ag_matmul", x, v)
        if v.ndim != 2 or v.shape[0] != weights[0].shape[0] or v.dtype != weights[0].dtype:
            raise ValueError(f"ag_matmul: every weight of the list must be [K, N_i] of one K and dtype; w[0] is "
                             f"{weights[0].dtype}{list(weights[0].shape)}, w[{k}] is {v.dtype}{list(v.shape)}")
    result = ag_matmul(x, jnp.concatenate(weights, axis=1), axis_name, schedule=schedule,
                       return_gathered=return_gathered, out_dtype=out_dtype)
    out, gathered = result if return_gathered else (result, None)
    # lax.split, whose transpose concatenates the products' cotangents into the op's, with no padding.
    products = list(lax.split(out, [v.shape[1] for v in weights], axis=1))
    return (products, gathered) if return_gathered else products


def matmul_rs(y, w, axis_name: str, *, schedule: ScheduleArg = "auto", out_dtype=None, x_scale=None, w_scale=None,
              w_col_major: bool = False):
    """`psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`, overlapped by a FiCCO schedule.

    Per device: y [M, N], w [N, K] -> [M/n, K] (n = size of `axis_name`; M must divide by n).
    `schedule` as in `ag_matmul`. Differentiable in both modes; the backward pass is itself overlapped.
    `out_dtype` as in `ag_matmul`: with f32 for bf16 operands the partial sums that move and are
    summed are f32, and so is the result. FP8 y and w take `x_scale` (y's scale) and `w_scale` as
    in `ag_matmul`; the partials that move and are summed have `out_dtype` (bf16 by default).
    `w_col_major` as in `ag_matmul`.
    """
    if scaled.wanted(y, x_scale, w_scale):
        return scaled.call("matmul_rs", y, w, axis_name, schedule, (x_scale, w_scale), out_dtype, measure=time_op)
    return call("matmul_rs", y, w, axis_name, schedule, measure=time_op, out_dtype=out_dtype, w_col_major=w_col_major)


def matmul_psum(y, w, axis_name: str, *, schedule: ScheduleArg = "auto", out_dtype=None, w_col_major: bool = False):
    """`psum(y @ w, axis_name)`, the row-parallel matmul's all-reduce, overlapped by a FiCCO schedule.

    Per device: y [M, N], w [N, K] -> [M, K], the same on every device (n = size of `axis_name`).
    A schedule runs as `matmul_rs` with that schedule (the partial products reduce-scattered
    behind the chunk matmuls) followed by the all-gather of the reduced [M/n, K] rows on the same
    comm (copy engines for "dma", XLA's all-gather for "xla"); "none" is the plain psum of the
    product. `schedule` takes what `matmul_rs` takes. The overlapped schedules need M to divide by
    n (a ValueError says so and how to pad; "auto" keeps the plain path for such M).

    Differentiable in both modes, with JAX's transpose of psum: the cotangent of the sum is every
    device's, so the backward is dy = ct @ w^T and dw = y^T @ ct on each device, no collective
    (under ``shard_map(check_vma=False)`` JAX sums the cotangent first, and so does this op).
    `out_dtype` as in `ag_matmul`: with f32 for bf16 operands the partials that move are f32.
    `w_col_major` as in `ag_matmul`.
    """
    return call("matmul_psum", y, w, axis_name, schedule, measure=time_op, out_dtype=out_dtype,
                w_col_major=w_col_major)


def a2a_matmul(x, w, axis_name: str, *, schedule: ScheduleArg = "auto", return_received: bool = False,
               out_dtype=None, w_col_major: bool = False):
    """``einsum("pecd,edf->pecf", all_to_all(x, axis_name, 0, 0, tiled=True), w)``, overlapped.

    Per device: x [n, E_local, C, d], w [E_local, d, f] -> [n, E_local, C, f] (n = size of
    `axis_name`). With `return_received=True` also returns ``all_to_all(x)`` [n, E_local, C, d]
    (the tokens this device's experts received), so a caller that needs it moves nothing twice.
    `schedule`: "auto", a `Schedule` or its string ("xla/direct/c2", "dma/ring/c4/grouped").
    Differentiable in both modes; the backward pass is itself overlapped. `comm="dma"` takes bf16,
    f16, f32. `out_dtype` as in `ag_matmul`. `w_col_major` as in `ag_matmul`, per expert: each
    [d, f] matrix of w column-major, as ``jnp.swapaxes(v, 1, 2)`` of a stored [E, f, d] array is.
    """
    return call("a2a_matmul", x, w, axis_name, schedule, with_side=return_received, side_flag="return_received",
                measure=time_op, out_dtype=out_dtype, w_col_major=w_col_major)


def matmul_a2a(y, w, axis_name: str, *, schedule: ScheduleArg = "auto", out_dtype=None, w_col_major: bool = False):
    """``all_to_all(einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled=True)``, overlapped.

    Per device: y [n, E_local, C, f], w [E_local, f, d] -> [n, E_local, C, d]. `schedule` as in
    `a2a_matmul`. Differentiable in both modes; the backward pass is itself overlapped. `out_dtype`
    as in `ag_matmul` (the results that move have it). `w_col_major` as in `a2a_matmul`.
    """
    return call("matmul_a2a", y, w, axis_name, schedule, measure=time_op, out_dtype=out_dtype, w_col_major=w_col_major)
