"""The FP8 forms of the tensor-parallel ops: FP8 operands with per-tensor f32 scales.

    ag_matmul(x, w, axis, x_scale=sx, w_scale=sw, out_dtype=bf16)
        == ((all_gather(x).astype(f32) * sx) @ (w.astype(f32) * sw)).astype(bf16)
    matmul_rs(y, w, axis, x_scale=sy, w_scale=sw, out_dtype=bf16)
        == psum_scatter(((y.astype(f32) * sy) @ (w.astype(f32) * sw)).astype(bf16))

The all-gather moves FP8 bytes (half of bf16's); matmul_rs moves and sums `out_dtype` partials.
The matmuls are FP8: cuBLASLt's, with the scales as device pointers and Hopper's fast
accumulation (as TransformerEngine's forward GEMMs), on the copy-engine path (`comm="dma"`); on `comm="none"` / `"xla"` XLA's own
FP8 dot with the scales applied to its f32 result (lowering/xla.product).

Differentiation and batching: each FP8 op is one equation of its tangent map (ops/linear.py, the
primitive of the bf16 ops), because the op is linear in each of its four operands given the others:

    d op = op(da, w; sa, sw) + op(a, dw; sa, sw) + (dsa * sw + sa * dsw) * op(a, w; 1, 1)

(a the input, x or y; sa its scale). Forward mode (jax.jvp, jacfwd) evaluates this map: FP8
matmuls of the FP8 tangents (JAX's tangent of an FP8 array is FP8) with the forward's schedule,
summed in f32 and rounded once to `out_dtype`, as JAX's differentiation of the reference rounds.
The map's own derivative in its residuals (second derivatives: jacfwd of grad, jvp of jvp) is
plain f32 products of the FP8 values. jax.vmap of a batch of inputs against one weight and one
pair of scales runs the op once on the batch folded into its rows (ops/table.TensorParallel); a
batch of weights or scales runs one op per element, in a loop.

Reverse mode is the map's transpose, itself overlapped: the gradient matmuls take operands in the
cotangent's dtype (`out_dtype`) — the FP8 values converted exactly (every e4m3 and e5m2 value is a
bf16, f16 and f32 value), the scales applied to their f32 results — and accumulate into f32:

    d x  = sx * sw * matmul_rs(g, w^T)        (ag_matmul; f32 partials reduce-scattered)
    d w  = sx * sw * all_gather(x)^T @ g      (the gathered FP8 x kept from the forward)

and the transposes for matmul_rs (ag_matmul of g, whose gathered g feeds d w); those read w^T
column-major, which is w's own layout (no transpose written). Why not FP8
gradients: an e5m2 gradient needs its own scale, which comes from amax statistics a recipe owns
(delayed or current scaling); with the cotangent's dtype the gradients are those of the
reference up to f32 summation order. The gradients of the FP8 operands are then rounded to their
dtype, exactly as JAX's own differentiation of the reference does; the scales get their true
gradients (summed over the devices that share them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import config
from ..lowering import xla
from ..lowering.dma.registry import aval
from .core import as_out_dtype, axis_size, check_arrays, one_fp8_operand
from .linear import LinearMap, bind
from .resolve import resolve_schedule, transposed_schedule
from .run import run_scheduled
from .table import TENSOR_PARALLEL
from .tangents import Static, fold_input_batch, present, tangent_aval, varying_together, zero_where_none

#: The result dtypes of an FP8 matmul.
OUT_DTYPES = ("bfloat16", "float16", "float32")


def wanted(a, *scales) -> bool:
    """Whether a call is an FP8 one: scales given, or an FP8 first operand (which needs them)."""
    return any(s is not None for s in scales) or (hasattr(a, "dtype") and config.is_fp8(a.dtype))


def check(op: str, a, w, scales, out_dtype):
    """(scales as f32 scalars, out_dtype) of an FP8 call, or a TypeError that names the fix."""
    names = ("x", "w") if op == "ag_matmul" else ("y", "w")
    check_arrays(op, a, w)
    if all(s is None for s in scales) and not config.is_fp8(w.dtype):
        raise TypeError(one_fp8_operand(op, a, w))
    for name, v in zip(names, (a, w)):
        if not config.is_fp8(v.dtype):
            raise TypeError(f"{op}: with scales both operands must be FP8 {config.FP8_DTYPES}, found {name} {v.dtype}; "
                            f"quantize it (e.g. {name}.astype(jnp.float8_e4m3fn)) or drop the scales")
    if any(s is None for s in scales):
        raise TypeError(f"{op}: FP8 operands ({names[0]} {a.dtype}, w {w.dtype}) need x_scale= and w_scale=, the "
                        f"per-tensor dequantization scales (f32 scalars, e.g. x_scale=jnp.float32(1.0))")
    if jnp.dtype(a.dtype).name == jnp.dtype(w.dtype).name == "float8_e5m2":
        raise TypeError(f"{op}: float8_e5m2 x float8_e5m2 matmuls are not supported (cuBLASLt has none); make one "
                        f"operand float8_e4m3fn")
    converted = []
    for name, s in zip(("x_scale", "w_scale"), scales):
        if not hasattr(s, "dtype"):
            if not isinstance(s, (int, float)) or isinstance(s, bool):
                raise TypeError(f"{op}: {name} must be a float32 scalar (an array or a Python number), found "
                                f"{type(s).__name__} {s!r}; pass e.g. jnp.float32(scale)")
            s = jnp.asarray(s, jnp.float32)
        if s.size != 1 or s.dtype != jnp.float32:
            raise TypeError(f"{op}: {name} must be one float32 value, found {s.dtype}{list(s.shape)}; "
                            f"pass e.g. jnp.float32(scale)")
        converted.append(s.reshape(()))
    out = jnp.dtype(jnp.bfloat16) if out_dtype is None else as_out_dtype(op, out_dtype)
    if out.name not in OUT_DTYPES:
        raise TypeError(f"{op}: an FP8 matmul's out_dtype is one of {OUT_DTYPES}, found {out.name}")
    return tuple(converted), out


def call(op: str, a, w, axis_name: str, schedule, scales, out_dtype, *, with_side: bool = False, measure=None):
    """The FP8 `op` as the public functions run it (ops/api.py): checks, schedule, its positional form."""
    n = axis_size(axis_name, op)
    scales, out = check(op, a, w, scales, out_dtype)
    sched = resolve_schedule(op, schedule, (a.shape, w.shape), a.dtype, n, axis_name=axis_name, measure=measure,
                             out_dtype=out)
    if op == "ag_matmul":
        return _ag_matmul(a, w, *scales, axis_name, sched, out, bool(with_side))
    return _matmul_rs(a, w, *scales, axis_name, sched, out)


# ------------------------------------------------------------------------------------------------
# The maps: res (a, w, sa, sw[, side]), lin (da, dw, dsa, dsw)
# ------------------------------------------------------------------------------------------------
class _ScaledMap(LinearMap):
    """The tangent map of an FP8 op, which is linear in each of its four operands given the others:

        d op = op(da, w; sa, sw) + op(a, dw; sa, sw) + (dsa * sw + sa * dsw) * op(a, w; 1, 1)

    Its primal is the map at lin (a, -, -, -), res (-, w, sa, sw): the op itself. Evaluated
    (forward mode), the terms are FP8 matmuls summed in f32; transposed (reverse mode), the
    backward of the module docstring; its cotangents are summed over the mesh axes, then rounded
    to the FP8 dtypes."""

    op: str

    @property
    def name(self) -> str:
        return f"{self.op}_fp8_tangent"

    def sums_before_cast(self, static) -> bool:
        return True

    #: The residuals that hold rows (ops/tangents.fold_input_batch): the input a, and ag_matmul's gathered a.
    rows: dict = {}

    def fold_batch(self, static, res, lin, batched_res, batched_lin):
        return fold_input_batch(TENSOR_PARALLEL, self.op, static, res, lin, batched_res, batched_lin, res[1],
                                self.rows)


class _Gather(_ScaledMap):
    """ag_matmul's: res (x, w, sx, sw, gathered x), lin (dx, dw, dsx, dsw) -> (out,), or (out,
    gathered dx) with `Static.with_side`."""
    op = "ag_matmul"
    rows = {0: "input", 4: "side"}

    def apply(self, static, res, lin):
        (_x, w, sx, sw, side), (dx, dw, dsx, dsw) = res, lin
        acc = _accumulator(static, sum(v is not None for v in (dx, dw)) + (dsx is not None or dsw is not None))
        out = side_t = None
        if dx is not None:
            out, side_t = TENSOR_PARALLEL.gather_impl(dx, w, static.axis_name, static.sched, acc,
                                                      side_needed=static.with_side, scales=(sx, sw))
        if dw is not None:
            out = _add(out, xla.product(side, dw, acc, scales=(sx, sw)))
        if dsx is not None or dsw is not None:
            out = _add(out, xla.product(side, w, acc, scales=(_scale_tangent(sx, sw, dsx, dsw), jnp.float32(1))))
        out = out.astype(static.out_dtype)
        return (out, side_t) if static.with_side else (out,)

    def res_jvp(self, static, res, lin, t_res, outs):
        (_x, w, sx, sw, side), (dx, dw, dsx, dsw), (_tx, tw, tsx, tsw, tside) = res, lin, t_res
        gathered_dx = None
        if dx is not None and (tw is not None or tsx is not None or tsw is not None):
            gathered_dx = outs[1] if static.with_side else lax.all_gather(dx, static.axis_name, axis=0, tiled=True)
        t = _product_tangent(gathered_dx, side, tside, w, dw, tw, (sx, sw), (dsx, dsw), (tsx, tsw))
        t = None if t is None else t.astype(static.out_dtype)
        return (t, None) if static.with_side else (t,)

    def transpose(self, static, res, cts, wanted):
        (x, w, sx, sw, side), g = res, cts[0]
        g_side = cts[1] if static.with_side else None
        dx_deq = dw_deq = None
        if g is not None and (wanted[0] or wanted[2]):  # d (x sx) = sw * matmul_rs(g, w^T)
            gd, w_t = g.dtype, w.astype(g.dtype).T
            n = axis_size(static.axis_name, self.op)
            bwd = transposed_schedule("matmul_rs", static.sched, (g.shape, w_t.shape), gd, n, _f32_if_narrower(gd))
            dx_deq = sw * run_scheduled("matmul_rs", g, w_t, static.axis_name, bwd, out_dtype=_f32_if_narrower(gd),
                                        w_col_major=True)
        if g is not None and (wanted[1] or wanted[3]):  # d (w sw) = sx * gathered^T @ g
            dw_deq = sx * jnp.matmul(side.astype(g.dtype).T, g, preferred_element_type=jnp.float32)
        direct = None
        if g_side is not None and wanted[0]:  # the gathered x itself: its cotangent reduce-scattered onto x
            direct = lax.psum_scatter(g_side.astype(jnp.float32), static.axis_name, scatter_dimension=0, tiled=True)
        return _operand_cts(wanted, x, w, sx, sw, dx_deq, dw_deq, direct)


class _Scatter(_ScaledMap):
    """matmul_rs's: res (y, w, sy, sw), lin (dy, dw, dsy, dsw) -> (out,); the first two terms are
    one call on the operands joined along the contraction, [dy | y] @ [w ; dw] (one scale each)."""
    op = "matmul_rs"
    rows = {0: "input"}

    def apply(self, static, res, lin):
        (y, w, sy, sw), (dy, dw, dsy, dsw) = res, lin
        scale_terms = dsy is not None or dsw is not None
        acc = _accumulator(static, (dy is not None or dw is not None) + scale_terms)
        out = None
        if dy is not None or dw is not None:
            if dy is not None and dw is not None:
                a, b = jnp.concatenate([dy, y], axis=1), jnp.concatenate([w, dw], axis=0)
            else:
                a, b = (dy, w) if dy is not None else (y, dw)
            out = TENSOR_PARALLEL.scatter_impl(a, b, static.axis_name, static.sched, acc, scales=(sy, sw))
        if scale_terms:
            out = _add(out, TENSOR_PARALLEL.scatter_impl(y, w, static.axis_name, static.sched, acc,
                                                         scales=(_scale_tangent(sy, sw, dsy, dsw), jnp.float32(1))))
        return (out.astype(static.out_dtype),)

    def res_jvp(self, static, res, lin, t_res, outs):
        (y, w, sy, sw), (dy, dw, dsy, dsw), (ty, tw, tsy, tsw) = res, lin, t_res
        t = _product_tangent(dy, y, ty, w, dw, tw, (sy, sw), (dsy, dsw), (tsy, tsw))
        if t is None:
            return (None,)
        return (lax.psum_scatter(t, static.axis_name, scatter_dimension=0, tiled=True).astype(static.out_dtype),)

    def transpose(self, static, res, cts, wanted):
        (y, w, sy, sw), g = res, cts[0]
        if g is None:
            return (None,) * 4
        gd, w_t = g.dtype, w.astype(g.dtype).T
        n = axis_size(static.axis_name, self.op)
        bwd = transposed_schedule("ag_matmul", static.sched, (g.shape, w_t.shape), gd, n, _f32_if_narrower(gd))
        dy, g_gathered = run_scheduled("ag_matmul", g, w_t, static.axis_name, bwd, with_side=True,
                                       out_dtype=_f32_if_narrower(gd), w_col_major=True)
        dw_deq = sy * jnp.matmul(y.astype(gd).T, g_gathered, preferred_element_type=jnp.float32) if (
            wanted[1] or wanted[3]) else None
        return _operand_cts(wanted, y, w, sy, sw, sw * dy, dw_deq)


GATHER, SCATTER = _Gather(), _Scatter()


# ------------------------------------------------------------------------------------------------
# The positional forms (a, w, sa, sw, axis_name, sched, out_dtype[, with_side]): one equation each
# ------------------------------------------------------------------------------------------------
def _equation(lmap: _ScaledMap, a, w, sa, sw, axis_name: str, sched, out_dtype, with_side: bool = False):
    """The FP8 op as one equation of its map (a linear, the rest residuals): out, or (out, side)."""
    a, w, sa, sw = varying_together(axis_name, a, w, sa, sw)
    n = axis_size(axis_name, lmap.op)
    like = jax.typeof(a)
    if lmap is GATHER:
        out_shape, side_shape = TENSOR_PARALLEL.gather_shapes(a.shape, w.shape, n)
        avals = [aval(like, out_shape, out_dtype)] + ([aval(like, side_shape)] if with_side else [])
        res = (None, w, sa, sw, None)
    else:
        avals, res = [aval(like, TENSOR_PARALLEL.scatter_shape(a.shape, w.shape, n), out_dtype)], (None, w, sa, sw)
    outs = bind(lmap, Static(axis_name, sched, out_dtype, with_side), res, (a, None, None, None), avals)
    return tuple(outs) if with_side else outs[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7))
def _ag_matmul(x, w, sx, sw, axis_name, sched, out_dtype, with_side):
    return _equation(GATHER, x, w, sx, sw, axis_name, sched, out_dtype, with_side)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _matmul_rs(y, w, sy, sw, axis_name, sched, out_dtype):
    return _equation(SCATTER, y, w, sy, sw, axis_name, sched, out_dtype)


def _ag_jvp(axis_name, sched, out_dtype, with_side, primals, tangents):
    x, w, sx, sw = primals
    lin = tuple(map(present, tangents))
    # Differentiated, the forward delivers the gathered x in full: the tangent and the gradients read it.
    out, side = _equation(GATHER, x, w, sx, sw, axis_name, sched, out_dtype, with_side=True)
    side_out = with_side and lin[0] is not None
    avals = [tangent_aval(out)] + ([tangent_aval(side)] if side_out else [])
    t = bind(GATHER, Static(axis_name, sched, out_dtype, side_out), (x, w, sx, sw, side), lin, avals)
    t_out = zero_where_none(t[0], out)
    if with_side:
        return (out, side), (t_out, zero_where_none(t[1] if side_out else None, side))
    return out, t_out


def _rs_jvp(axis_name, sched, out_dtype, primals, tangents):
    y, w, sy, sw = primals
    out = _equation(SCATTER, y, w, sy, sw, axis_name, sched, out_dtype)
    t = bind(SCATTER, Static(axis_name, sched, out_dtype), (y, w, sy, sw), tuple(map(present, tangents)),
             [tangent_aval(out)])[0]
    return out, zero_where_none(t, out)


_ag_matmul.defjvp(_ag_jvp, symbolic_zeros=True)
_matmul_rs.defjvp(_rs_jvp, symbolic_zeros=True)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _f32_if_narrower(dtype):
    """The gradient matmuls' result dtype: f32 (None where the operands already are f32)."""
    return None if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(jnp.float32)


def _accumulator(static: Static, terms: int):
    """The dtype the map's terms are computed in: the op's own for one term, f32 to sum several."""
    return static.out_dtype if terms <= 1 else jnp.dtype(jnp.float32)


def _add(a, b):
    return b if a is None else a + b.astype(a.dtype)


def _scale_tangent(sa, sw, dsa, dsw):
    """dsa * sw + sa * dsw: the product's scale differentiated (None: zero)."""
    terms = [u * v for u, v in ((dsa, sw), (sa, dsw)) if u is not None and v is not None]
    return None if not terms else terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _product_tangent(da, a, ta, w, dw, tw, scales, d_scales, t_scales):
    """The tangent in the residuals (ta, tw, t_scales) of the map's local product, in f32:

        map = sa sw (da @ w + a @ dw) + (dsa sw + sa dsw) (a @ w)

    (for ag_matmul: da the gathered dx, a the gathered x; for matmul_rs before its reduce-scatter);
    plain products of the FP8 values converted to f32, linear in the residuals' tangents."""
    f32 = jnp.float32

    def mm(u, v):
        return None if u is None or v is None else jnp.matmul(u.astype(f32), v.astype(f32), preferred_element_type=f32)

    def times(c, v):
        return None if c is None or v is None else c * v

    terms = [times(_scale_tangent(*scales, *t_scales), _sum(mm(da, w), mm(a, dw))),
             times(scales[0] * scales[1], _sum(mm(da, tw), mm(ta, dw))),
             times(_scale_tangent(*t_scales, *d_scales), mm(a, w)),
             times(_scale_tangent(*scales, *d_scales), _sum(mm(ta, w), mm(a, tw)))]
    return _sum(*terms)


def _sum(*terms):
    present_terms = [t for t in terms if t is not None]
    return None if not present_terms else functools.reduce(lambda u, v: u + v, present_terms)


def _operand_cts(wanted, a, w, sa, sw, da_deq, dw_deq, da_direct=None):
    """Cotangents of (a, w, sa, sw), in f32, from those of the dequantized operands a * sa and
    w * sw (and `da_direct`, one of `a` itself); the scales' summed over the local elements
    (linear.py then sums them over the devices that share a scale and rounds the operands' to
    their FP8 dtype, as JAX's differentiation of the reference does)."""
    f32 = jnp.float32
    da = None if da_deq is None else da_deq.astype(f32) * sa
    if da_direct is not None:
        da = da_direct if da is None else da + da_direct
    return (da if wanted[0] else None,
            dw_deq.astype(f32) * sw if wanted[1] and dw_deq is not None else None,
            jnp.sum(da_deq.astype(f32) * a.astype(f32)) if wanted[2] and da_deq is not None else None,
            jnp.sum(dw_deq.astype(f32) * w.astype(f32)) if wanted[3] and dw_deq is not None else None)
