"""The FP8 forms of the tensor-parallel ops: FP8 operands with per-tensor f32 scales.

    ag_matmul(x, w, axis, x_scale=sx, w_scale=sw, out_dtype=bf16)
        == ((all_gather(x).astype(f32) * sx) @ (w.astype(f32) * sw)).astype(bf16)
    matmul_rs(y, w, axis, x_scale=sy, w_scale=sw, out_dtype=bf16)
        == psum_scatter(((y.astype(f32) * sy) @ (w.astype(f32) * sw)).astype(bf16))

The all-gather moves FP8 bytes (half of bf16's); matmul_rs moves and sums `out_dtype` partials.
The matmuls are FP8: cuBLASLt's, with the scales as device pointers and Hopper's fast
accumulation (as TransformerEngine's forward GEMMs), on the copy-engine path (`comm="dma"`); on `comm="none"` / `"xla"` XLA's own FP8 dot with the scales applied to its f32
result (lowering/xla.product).

Backward (a custom VJP, itself overlapped): the gradient matmuls take operands in the cotangent's
dtype (`out_dtype`) — the FP8 values converted exactly (every e4m3 and e5m2 value is a bf16, f16
and f32 value), the scales applied to their f32 results — and accumulate into f32:

    d x  = sx * sw * matmul_rs(g, w^T)        (ag_matmul; f32 partials reduce-scattered)
    d w  = sx * sw * all_gather(x)^T @ g      (the gathered FP8 x kept from the forward)

and the transposes for matmul_rs (ag_matmul of g, whose gathered g feeds d w). Why not FP8
gradients: an e5m2 gradient needs its own scale, which comes from amax statistics a recipe owns
(delayed or current scaling); with the cotangent's dtype the gradients are those of the
reference up to f32 summation order. The gradients of the FP8 operands are then rounded to their
dtype, exactly as JAX's own differentiation of the reference does; the scales get their true
gradients (summed over the devices that share them). Forward-mode differentiation of the FP8
forms is not offered (a quantized matmul is a step function of its FP8 inputs).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import config
from .core import axis_size, like_primal, varying_axes
from .resolve import resolve_schedule, transposed_schedule
from .run import run_scheduled
from .table import TENSOR_PARALLEL

#: The result dtypes of an FP8 matmul.
OUT_DTYPES = ("bfloat16", "float16", "float32")


def wanted(a, *scales) -> bool:
    """Whether a call is an FP8 one: scales given, or an FP8 first operand (which needs them)."""
    return any(s is not None for s in scales) or (hasattr(a, "dtype") and config.is_fp8(a.dtype))


def check(op: str, a, w, scales, out_dtype):
    """(scales as f32 scalars, out_dtype) of an FP8 call, or a TypeError that names the fix."""
    names = ("x", "w") if op == "ag_matmul" else ("y", "w")
    if any(s is None for s in scales):
        raise TypeError(f"{op}: FP8 operands ({names[0]} {a.dtype}, w {w.dtype}) need x_scale= and w_scale=, the "
                        f"per-tensor dequantization scales (f32 scalars, e.g. x_scale=jnp.float32(1.0))")
    for name, v in zip(names, (a, w)):
        if not config.is_fp8(v.dtype):
            raise TypeError(f"{op}: with scales both operands must be FP8 {config.FP8_DTYPES}, found {name} {v.dtype}; "
                            f"quantize it (e.g. {name}.astype(jnp.float8_e4m3fn)) or drop the scales")
    if jnp.dtype(a.dtype).name == jnp.dtype(w.dtype).name == "float8_e5m2":
        raise TypeError(f"{op}: float8_e5m2 x float8_e5m2 matmuls are not supported (cuBLASLt has none); make one "
                        f"operand float8_e4m3fn")
    converted = []
    for name, s in zip(("x_scale", "w_scale"), scales):
        s = jnp.asarray(s, jnp.float32) if not hasattr(s, "dtype") else s
        if s.size != 1 or s.dtype != jnp.float32:
            raise TypeError(f"{op}: {name} must be one float32 value, found {s.dtype}{list(s.shape)}; "
                            f"pass e.g. jnp.float32(scale)")
        converted.append(s.reshape(()))
    out = jnp.dtype(out_dtype if out_dtype is not None else jnp.bfloat16)
    if out.name not in OUT_DTYPES:
        raise TypeError(f"{op}: an FP8 matmul's out_dtype is one of {OUT_DTYPES}, found {out.name}")
    return tuple(converted), out


def call(op: str, a, w, axis_name: str, schedule, scales, out_dtype, *, with_side: bool = False, measure=None):
    """The FP8 `op` as the public functions run it (ops/api.py): checks, schedule, the custom VJP."""
    n = axis_size(axis_name, op)
    scales, out = check(op, a, w, scales, out_dtype)
    sched = resolve_schedule(op, schedule, (a.shape, w.shape), a.dtype, n, axis_name=axis_name, measure=measure,
                             out_dtype=out)
    if op == "ag_matmul":
        result = _ag_matmul(a, w, *scales, axis_name, sched, out, bool(with_side))
        return result if with_side else result[0]
    return _matmul_rs(a, w, *scales, axis_name, sched, out)


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------
def _ag_forward(x, w, sx, sw, axis_name, sched, out_dtype, side_needed):
    return TENSOR_PARALLEL.gather_impl(x, w, axis_name, sched, out_dtype, side_needed, scales=(sx, sw))


def _rs_forward(y, w, sy, sw, axis_name, sched, out_dtype):
    return TENSOR_PARALLEL.scatter_impl(y, w, axis_name, sched, out_dtype, scales=(sy, sw))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ag_matmul(x, w, sx, sw, axis_name, sched, out_dtype, with_side):
    return _ag_forward(x, w, sx, sw, axis_name, sched, out_dtype, with_side)


def _ag_fwd(x, w, sx, sw, axis_name, sched, out_dtype, with_side):
    out, gathered = _ag_forward(x, w, sx, sw, axis_name, sched, out_dtype, True)
    return (out, gathered), (x, w, sx, sw, gathered)


def _ag_bwd(axis_name, sched, out_dtype, with_side, res, cts):
    x, w, sx, sw, gathered = res
    g, g_side = cts
    gd = g.dtype
    n = axis_size(axis_name, "ag_matmul")
    w_t = w.astype(gd).T
    bwd = transposed_schedule("matmul_rs", sched, (g.shape, w_t.shape), gd, n, _f32_if_narrower(gd))
    # Gradients of the dequantized operands x * sx and w * sw, in f32.
    dx_deq = sw * run_scheduled("matmul_rs", g, w_t, axis_name, bwd, out_dtype=_f32_if_narrower(gd))
    dw_deq = sx * jnp.matmul(gathered.astype(gd).T, g, preferred_element_type=jnp.float32)
    side = None
    if with_side:  # the gathered FP8 x itself: its cotangent reduce-scattered back onto x
        side = lax.psum_scatter(g_side.astype(jnp.float32), axis_name, scatter_dimension=0, tiled=True)
    return _operand_grads(x, w, sx, sw, dx_deq, dw_deq, side)


_ag_matmul.defvjp(_ag_fwd, _ag_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _matmul_rs(y, w, sy, sw, axis_name, sched, out_dtype):
    return _rs_forward(y, w, sy, sw, axis_name, sched, out_dtype)


def _rs_fwd(y, w, sy, sw, axis_name, sched, out_dtype):
    return _rs_forward(y, w, sy, sw, axis_name, sched, out_dtype), (y, w, sy, sw)


def _rs_bwd(axis_name, sched, out_dtype, res, g):
    y, w, sy, sw = res
    gd = g.dtype
    n = axis_size(axis_name, "matmul_rs")
    w_t = w.astype(gd).T
    bwd = transposed_schedule("ag_matmul", sched, (g.shape, w_t.shape), gd, n, _f32_if_narrower(gd))
    dy, g_gathered = run_scheduled("ag_matmul", g, w_t, axis_name, bwd, with_side=True,
                                   out_dtype=_f32_if_narrower(gd))
    dy_deq = sw * dy
    dw_deq = sy * jnp.matmul(y.astype(gd).T, g_gathered, preferred_element_type=jnp.float32)
    return _operand_grads(y, w, sy, sw, dy_deq, dw_deq)


_matmul_rs.defvjp(_rs_fwd, _rs_bwd)


# ------------------------------------------------------------------------------------------------
# backward helpers
# ------------------------------------------------------------------------------------------------
def _f32_if_narrower(dtype):
    """The gradient matmuls' result dtype: f32 (None where the operands already are f32)."""
    return None if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(jnp.float32)


def _operand_grads(a, w, sa, sw, da_deq, dw_deq, da_direct=None):
    """Cotangents of (a, w, sa, sw) from those of the dequantized operands a * sa and w * sw (and
    `da_direct`, one of `a` itself): the operands' rounded to their FP8 dtype (as JAX's
    differentiation of the reference does), the scales' summed over the local elements and over
    the devices that share the scale."""
    da_deq, dw_deq = da_deq.astype(jnp.float32), dw_deq.astype(jnp.float32)
    d_sa = jnp.sum(da_deq * a.astype(jnp.float32))
    d_sw = jnp.sum(dw_deq * w.astype(jnp.float32))
    da = da_deq * sa if da_direct is None else da_deq * sa + da_direct
    return (like_primal(da, a.dtype, varying_axes(a)), like_primal(dw_deq * sw, w.dtype, varying_axes(w)),
            like_primal(d_sa, jnp.float32, varying_axes(sa)), like_primal(d_sw, jnp.float32, varying_axes(sw)))
