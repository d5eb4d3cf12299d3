"""Mixed precision (bf16 operands, f32 results) and FP8 (scaled) forms of the ops: every schedule
against the plain-JAX reference computed in f32 from the same values, gradients included."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax.runtime import extension
from ficco_jax.ops import table
from helpers import (TOLERANCE, ag_specs, ffi_calls, global_shapes, mixed_precision_mlp, psum_specs, random, rel_err,
                     rs_specs, run_sharded)

OPS = {
    "ag_matmul": (ficco_jax.ag_matmul, ficco_jax.ag_matmul_ref, ag_specs),
    "matmul_rs": (ficco_jax.matmul_rs, ficco_jax.matmul_rs_ref, rs_specs),
}
M_ROWS, K, N_COLS = 16, 32, 16
F32 = jnp.float32


def _schedules(op, tp=4):
    comms = ("none", "xla", "dma") if extension.available() else ("none", "xla")
    for sched in Schedule.enumerate(op, tp, comms=comms):
        if sched.chunks <= 2 and sched.copy_streams <= 2:  # every comm, order and gemm mode; fewer chunkings
            yield pytest.param(op, str(sched), id=f"{op}-{sched}")


CASES = [c for op in OPS for c in _schedules(op)]


def _scaled_inputs(rng, op, mesh, dtypes=("float8_e4m3fn", "float8_e4m3fn")):
    a_shape, w_shape = global_shapes(op, mesh, M_ROWS, K, N_COLS)
    a = random(rng, a_shape, F32) * 3.0
    w = random(rng, w_shape, F32)
    scales = (jnp.float32(0.37), jnp.float32(1.7))
    return a.astype(dtypes[0]), w.astype(dtypes[1]), scales


def same_bits(got, want) -> float:
    """The fraction of elements of `got` equal to `want`'s (same dtype) bit for bit."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    return float(np.mean(np.asarray(got.astype(F32)) == np.asarray(want.astype(F32))))


def _fp8_specs(op, mesh):
    (a_spec, w_spec), out_spec = OPS[op][2](mesh)
    return (a_spec, w_spec, P(), P()), out_spec


# ------------------------------------------------------------------------------------------------
# mixed precision
# ------------------------------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", CASES)
def test_mixed_precision_matches_f32_reference(mesh2d, rng, op, sched):
    fn, ref, specs = OPS[op]
    a_shape, w_shape = global_shapes(op, mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, jnp.bfloat16), random(rng, w_shape, jnp.bfloat16)
    got = run_sharded(mesh2d, lambda a, w: fn(a, w, "tp", schedule=sched, out_dtype=F32), specs(mesh2d), a, w)
    want = run_sharded(mesh2d, lambda a, w: ref(a, w, "tp"), specs(mesh2d), a.astype(F32), w.astype(F32))
    assert got.dtype == F32
    # bf16 x bf16 products are exact in f32: only the summation order differs.
    assert rel_err(got, want) < TOLERANCE["float32"]


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", [c for c in CASES if "c1" in c.values[1]])
def test_mixed_precision_gradients(mesh2d, rng, op, sched):
    fn, ref, specs = OPS[op]
    a_shape, w_shape = global_shapes(op, mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, jnp.bfloat16), random(rng, w_shape, jnp.bfloat16)

    def loss(body, a, w):
        return jnp.sum(jnp.sin(run_sharded(mesh2d, body, specs(mesh2d), a, w)))

    got = jax.grad(functools.partial(loss, lambda a, w: fn(a, w, "tp", schedule=sched, out_dtype=F32)), (0, 1))(a, w)
    want = jax.grad(functools.partial(loss, lambda a, w: ref(a, w, "tp", out_dtype=F32)), (0, 1))(a, w)
    # As in JAX's backward, the gradient matmuls take the f32 cotangent (the bf16 operand widened)
    # and each gradient is rounded to bf16 once: bit for bit JAX's but where sums run in another
    # order. ag_matmul's input gradient is a reduce-scatter of bf16 partials; a ring sums them hop
    # by hop in bf16 (as NCCL's ring does), XLA's CPU collective in f32.
    ring_sum_of_bf16 = op == "ag_matmul" and "/ring/" in sched
    for name, g, r in zip(("input", "weight"), got, want):
        assert g.dtype == jnp.bfloat16
        if name == "input" and ring_sum_of_bf16:
            assert rel_err(g, r) < TOLERANCE["bfloat16"]
        else:
            assert same_bits(g, r) > 0.99 and rel_err(g, r) < 1e-3, (name, same_bits(g, r), rel_err(g, r))


def test_mixed_precision_forward_mode(mesh2d, rng):
    a_shape, w_shape = global_shapes("matmul_rs", mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, jnp.bfloat16), random(rng, w_shape, jnp.bfloat16)
    specs = rs_specs(mesh2d)
    run = functools.partial(run_sharded, mesh2d)
    f = lambda a, w: run(lambda a, w: ficco_jax.matmul_rs(a, w, "tp", schedule="xla/ring/c2", out_dtype=F32),
                         specs, a, w)
    r = lambda a, w: run(lambda a, w: ficco_jax.matmul_rs_ref(a, w, "tp", out_dtype=F32), specs, a, w)
    tangents = (random(rng, a_shape, jnp.bfloat16), random(rng, w_shape, jnp.bfloat16))  # not the primals: a
    _, got = jax.jvp(f, (a, w), tangents)                                                # swap would show
    _, want = jax.jvp(r, (a, w), tangents)
    assert got.dtype == F32 and rel_err(got, want) < TOLERANCE["float32"]


@pytest.mark.sweep
@pytest.mark.parametrize("op", list(OPS) + ["matmul_psum", "a2a_matmul", "matmul_a2a"])
@pytest.mark.parametrize("sched", ["xla/ring/c2", "none"])
def test_results_rounded_to_fewer_bits_keep_float32_gradients(mesh1d, rng, op, sched):
    """f32 operands into bf16 results are the f32 product rounded, ``(a @ w).astype(bf16)``: JAX's
    gradients of that widen the cotangent and run f32 matmuls, and so must the op's (a bf16
    backward is off by ~3e-3)."""
    fn, ref = getattr(ficco_jax, op), getattr(ficco_jax, f"{op}_ref")
    if op in ("a2a_matmul", "matmul_a2a"):
        n, e, c, d, f = 8, 2, 4, 16, 8
        a, w = random(rng, (n * n, e, c, d), F32), random(rng, (n * e, d, f), F32)
        specs = ((P("tp"), P("tp")), P("tp"))
        sched = sched.replace("ring", "direct")
    else:
        a_shape, w_shape = global_shapes(op, mesh1d, M_ROWS, K, N_COLS)
        a, w = random(rng, a_shape, F32), random(rng, w_shape, F32)
        specs = {"ag_matmul": ag_specs, "matmul_rs": rs_specs, "matmul_psum": psum_specs}[op](mesh1d)

    cotangent = []

    def loss(body, a, w):  # linear in the result: the gradients do not depend on its rounding
        out = run_sharded(mesh1d, body, specs, a, w).astype(F32)
        cotangent.append(cotangent[0] if cotangent else random(rng, out.shape, jnp.bfloat16).astype(F32))
        return jnp.sum(out * cotangent[0])

    got = jax.grad(functools.partial(loss, lambda a, w: fn(a, w, "tp", schedule=sched, out_dtype=jnp.bfloat16)),
                   (0, 1))(a, w)
    want = jax.grad(functools.partial(loss, lambda a, w: ref(a, w, "tp", out_dtype=jnp.bfloat16)), (0, 1))(a, w)
    for g, r in zip(got, want):
        assert g.dtype == F32 and rel_err(g, r) < TOLERANCE["float32"], rel_err(g, r)


@pytest.mark.parametrize("op", ["a2a_matmul", "matmul_a2a"])
def test_mixed_precision_expert_ops(mesh1d, rng, op):
    fn, ref = getattr(ficco_jax, op), getattr(ficco_jax, f"{op}_ref")
    n, e, c, d, f = 8, 2, 4, 16, 8
    x = random(rng, (n * n, e, c, d), jnp.bfloat16)
    w = random(rng, (n * e, d, f), jnp.bfloat16)
    specs = ((P("tp"), P("tp")), P("tp"))
    for sched in ("xla/direct/c2", "none") + (("dma/direct/c1",) if extension.available() else ()):
        got = run_sharded(mesh1d, lambda x, w: fn(x, w, "tp", schedule=sched, out_dtype=F32), specs, x, w)
        want = run_sharded(mesh1d, lambda x, w: ref(x, w, "tp"), specs, x.astype(F32), w.astype(F32))
        assert got.dtype == F32 and rel_err(got, want) < TOLERANCE["float32"], sched


@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
def test_products_rounded_to_fewer_bits_run_on_xla(monkeypatch, mesh2d, rng):
    """f32 operands into bf16 partials (the input gradient of a mixed-precision ag_matmul): 'auto'
    leaves copy engines out, and the result is the f32 product rounded, summed as bf16."""
    from helpers import prefer_copy_engines

    asked = prefer_copy_engines(monkeypatch)
    a_shape, w_shape = global_shapes("matmul_rs", mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, F32), random(rng, w_shape, F32)
    specs = rs_specs(mesh2d)
    got = run_sharded(mesh2d, lambda a, w: ficco_jax.matmul_rs(a, w, "tp", out_dtype=jnp.bfloat16), specs, a, w)
    want = run_sharded(mesh2d, lambda a, w: jax.lax.psum_scatter(
        (a @ w).astype(jnp.bfloat16), "tp", scatter_dimension=0, tiled=True), specs, a, w)
    assert asked and all("dma" not in comms for _, comms in asked), asked
    # The stand-in model picks xla/ring/c1, whose ring sums the bf16 partials hop by hop.
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) < TOLERANCE["bfloat16"]


def test_auto_keeps_float32_matmuls_off_copy_engines_where_xla_uses_tf32(monkeypatch):
    """On GPUs XLA computes float32 dots with TF32 under jax's default matmul precision, the
    executor in full float32: 'auto' leaves copy engines out for float32 operands there, saying
    why and how to allow them, and keeps them where the program asks for float32 dots."""
    from ficco_jax.tuning import policy

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(policy, "available_comms", lambda topology=None: ("none", "xla", "dma"))
    with jax.default_matmul_precision(None):  # jax's default (the test suite runs with "highest")
        comms, why = policy.allowed_comms("float32")
    assert comms == ("none", "xla") and "TF32" in why and "jax_default_matmul_precision" in why, why
    assert policy.allowed_comms("bfloat16") == (("none", "xla", "dma"), "")
    assert policy.allowed_comms("bfloat16", out_dtype=jnp.float32) == (("none", "xla", "dma"), "")
    for precision in ("float32", "highest"):
        with jax.default_matmul_precision(precision):
            assert policy.allowed_comms("float32") == (("none", "xla", "dma"), ""), precision


@pytest.mark.parametrize("out_dtype,match", [(jnp.int32, "floating-point"), ("nonsense", "must be a dtype")])
def test_bad_out_dtype_is_a_clear_error(mesh2d, rng, out_dtype, match):
    a_shape, w_shape = global_shapes("ag_matmul", mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, jnp.bfloat16), random(rng, w_shape, jnp.bfloat16)
    with pytest.raises(TypeError, match=match):
        run_sharded(mesh2d, lambda a, w: ficco_jax.ag_matmul(a, w, "tp", out_dtype=out_dtype), ag_specs(mesh2d), a, w)


@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
def test_dma_result_dtype_outside_the_executor_is_a_clear_error(mesh2d, rng):
    a_shape, w_shape = global_shapes("ag_matmul", mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, jnp.float32), random(rng, w_shape, jnp.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        run_sharded(mesh2d, lambda a, w: ficco_jax.ag_matmul(a, w, "tp", schedule="dma/direct/c1",
                                                             out_dtype=jnp.bfloat16), ag_specs(mesh2d), a, w)


# ------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------
def _fp8_call(op, sched, out_dtype):
    fn = OPS[op][0]
    return lambda a, w, sa, sw: fn(a, w, "tp", schedule=sched, out_dtype=out_dtype, x_scale=sa, w_scale=sw)


def _fp8_reference_f32(op, out_dtype):
    """The reference on the dequantized operands (f32 arrays holding the FP8 values)."""
    ref = OPS[op][1]
    return lambda a, w, sa, sw: ref(a, w, "tp", out_dtype=out_dtype, x_scale=sa, w_scale=sw)


@pytest.mark.sweep
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op,sched", CASES)
def test_fp8_matches_reference(mesh2d, rng, op, sched, out_dtype):
    a, w, scales = _scaled_inputs(rng, op, mesh2d)
    specs = _fp8_specs(op, mesh2d)
    got = run_sharded(mesh2d, _fp8_call(op, sched, out_dtype), specs, a, w, *scales)
    want = run_sharded(mesh2d, _fp8_reference_f32(op, F32), specs, a.astype(F32), w.astype(F32), *scales)
    assert got.dtype == jnp.dtype(out_dtype)
    assert rel_err(got, want) < TOLERANCE[out_dtype]


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", [c for c in CASES if "c1" in c.values[1]])
def test_fp8_gradients(mesh2d, rng, op, sched):
    """Scales' gradients within f32 rounding of the reference's; the FP8 operands' gradients are
    the f32 reference's rounded once to FP8 (JAX's own rounds per device before the sum)."""
    a, w, scales = _scaled_inputs(rng, op, mesh2d, ("float8_e4m3fn", "float8_e5m2"))
    specs = _fp8_specs(op, mesh2d)
    cot_shape = jax.eval_shape(lambda *v: run_sharded(mesh2d, _fp8_reference_f32(op, F32), specs, *v),
                               a.astype(F32), w.astype(F32), *scales).shape
    cot = random(rng, cot_shape, F32)

    def loss(body, *v):
        return jnp.sum(run_sharded(mesh2d, body, specs, *v).astype(F32) * cot)

    got = jax.grad(functools.partial(loss, _fp8_call(op, sched, F32)), (0, 1, 2, 3))(a, w, *scales)
    want = jax.grad(functools.partial(loss, _fp8_reference_f32(op, F32)), (0, 1, 2, 3))(
        a.astype(F32), w.astype(F32), *scales)
    for g, r, v in zip(got[:2], want[:2], (a, w)):
        assert g.dtype == v.dtype
        same = np.mean(np.asarray(g.astype(F32)) == np.asarray(r.astype(v.dtype).astype(F32)))
        assert same > 0.99, same
    for g, r in zip(got[2:], want[2:]):
        assert abs(float(g) - float(r)) <= 1e-5 * abs(float(r)) + 1e-6


def test_fp8_return_gathered_and_its_gradient(mesh2d, rng):
    """The gathered FP8 x is returned as it was gathered (no dequantization), and a second user of
    it sends its cotangent back to x."""
    a, w, scales = _scaled_inputs(rng, "ag_matmul", mesh2d)
    (a_spec, w_spec), out_spec = ag_specs(mesh2d)
    specs = ((a_spec, w_spec, P(), P()), (out_spec, P(("dp", "tp"), None)))  # all_gather output is typed varying

    def both(a, w, sa, sw):
        return ficco_jax.ag_matmul(a, w, "tp", schedule="xla/ring/c2", x_scale=sa, w_scale=sw, out_dtype=F32,
                                   return_gathered=True)

    def ref_both(a, w, sa, sw):
        gathered = jax.lax.all_gather(a, "tp", axis=0, tiled=True)
        return ficco_jax.ag_matmul_ref(a, w, "tp", out_dtype=F32, x_scale=sa, w_scale=sw), gathered

    out, gathered = run_sharded(mesh2d, both, specs, a, w, *scales)
    _, want = run_sharded(mesh2d, ref_both, specs, a, w, *scales)
    assert gathered.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(gathered.astype(F32)), np.asarray(want.astype(F32)))

    def loss(body, a, sa):
        out, g = run_sharded(mesh2d, body, specs, a, w, sa, scales[1])
        return jnp.sum(out) + jnp.sum(g.astype(F32) ** 2)

    got = jax.grad(functools.partial(loss, both), (0, 1))(a, scales[0])
    ref = jax.grad(functools.partial(loss, ref_both), (0, 1))(a.astype(F32), scales[0])
    same = np.mean(np.asarray(got[0].astype(F32)) == np.asarray(ref[0].astype(a.dtype).astype(F32)))
    assert same > 0.99, same
    assert abs(float(got[1]) - float(ref[1])) <= 1e-5 * abs(float(ref[1]))


@pytest.mark.parametrize("dtypes,scales,out_dtype,match", [
    (("float8_e4m3fn", "float8_e4m3fn"), (None, 1.0), None, "need x_scale= and w_scale="),
    (("float8_e5m2", "float8_e5m2"), (1.0, 1.0), None, "e5m2 x float8_e5m2"),
    (("bfloat16", "bfloat16"), (1.0, 1.0), None, "both operands must be FP8"),
    (("float8_e4m3fn", "float8_e4m3fn"), (1.0, 1.0), "float8_e4m3fn", "out_dtype is one of"),
    (("float8_e4m3fn", "float8_e4m3fn"), (np.ones(3, np.float32), 1.0), None, "one float32 value"),
])
def test_fp8_bad_input_is_a_clear_error(mesh2d, rng, dtypes, scales, out_dtype, match):
    a_shape, w_shape = global_shapes("ag_matmul", mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, F32).astype(dtypes[0]), random(rng, w_shape, F32).astype(dtypes[1])
    body = lambda a, w: ficco_jax.ag_matmul(a, w, "tp", x_scale=scales[0], w_scale=scales[1], out_dtype=out_dtype)
    with pytest.raises(TypeError, match=match):
        run_sharded(mesh2d, body, ag_specs(mesh2d), a, w)


# ------------------------------------------------------------------------------------------------
# overlap(): mixed-precision and FP8 sites as users write them
# ------------------------------------------------------------------------------------------------
def _mixed_mlp(x, w1, w2):
    h = jnp.matmul(jax.lax.all_gather(x, "tp", axis=0, tiled=True), w1, preferred_element_type=F32)
    y = jnp.matmul(jax.nn.gelu(h).astype(jnp.bfloat16), w2, preferred_element_type=F32)
    return jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)


def _fp8_mlp(x8, w1, w2, sx, sw):
    """The FP8 recipe: the gathered FP8 activation dequantized in bf16 before the first matmul, the
    second matmul's operands dequantized from FP8 before the reduce-scatter."""
    bf = jnp.bfloat16
    g = jax.lax.all_gather(x8, "tp", axis=0, tiled=True)
    h = (g.astype(bf) * sx.astype(bf)) @ (w1.astype(bf) * sw.astype(bf))
    h8 = jax.nn.relu(h).astype(jnp.float8_e4m3fn)
    y = (h8.astype(F32) * sx) @ (w2.astype(F32) * sw)
    return h, jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)


def _mlp_weights(rng, mesh, dtype):
    tp = mesh.shape["tp"]
    return random(rng, (K, tp * N_COLS), F32).astype(dtype), random(rng, (tp * N_COLS, K), F32).astype(dtype)


@pytest.mark.parametrize("sched", ["xla/ring/c2"] + (["dma/direct/c2"] if extension.available() else []))
def test_overlap_rewrites_mixed_precision_sites(mesh1d, rng, sched):
    x = random(rng, (8 * M_ROWS, K), jnp.bfloat16)
    w1, w2 = _mlp_weights(rng, mesh1d, jnp.bfloat16)
    fn = jax.shard_map(_mixed_mlp, mesh=mesh1d, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))
    report = ficco_jax.explain(ficco_jax.overlap(fn, schedule=sched), x, w1, w2)
    assert [r.op for r in report.sites] == ["ag_matmul", "matmul_rs"] and not report.near_misses, str(report)
    fused = jax.jit(ficco_jax.overlap(fn, schedule=sched))
    got, want = fused(x, w1, w2), jax.jit(fn)(x, w1, w2)
    assert got.dtype == F32 and rel_err(got, want) < TOLERANCE["float32"]
    g = jax.grad(lambda *a: jnp.sum(fused(*a)), (1, 2))(x, w1, w2)
    r = jax.grad(lambda *a: jnp.sum(fn(*a)), (1, 2))(x, w1, w2)
    for a, b in zip(g, r):  # the f32 cotangent reaches the weight-gradient matmuls, as in JAX's backward
        assert a.dtype == jnp.bfloat16 and same_bits(a, b) > 0.99, same_bits(a, b)


@pytest.mark.parametrize("sched", ["xla/ring/c2"] + (["dma/direct/c2"] if extension.available() else []))
def test_overlap_rewrites_fp8_sites(mesh1d, rng, sched):
    x8 = (random(rng, (8 * M_ROWS, K), F32) * 3).astype(jnp.float8_e4m3fn)
    w1, w2 = _mlp_weights(rng, mesh1d, jnp.float8_e4m3fn)
    scales = (jnp.float32(0.37), jnp.float32(1.7))
    fn = jax.shard_map(_fp8_mlp, mesh=mesh1d, in_specs=(P("tp"), P(None, "tp"), P("tp", None), P(), P()),
                       out_specs=(P(None, "tp"), P("tp")))
    fused = ficco_jax.overlap(fn, schedule=sched)
    report = ficco_jax.explain(fused, x8, w1, w2, *scales)
    assert [r.op for r in report.sites] == ["ag_matmul", "matmul_rs"], str(report)
    assert all("FP8, scaled" in r.shapes for r in report.sites), str(report)
    (h, y), (h_ref, y_ref) = jax.jit(fused)(x8, w1, w2, *scales), jax.jit(fn)(x8, w1, w2, *scales)
    assert h.dtype == jnp.bfloat16 and rel_err(h, h_ref) < TOLERANCE["bfloat16"]
    # y reads h requantized to FP8: where bf16 rounding of h differs, an FP8 step may differ too.
    assert y.dtype == F32 and rel_err(y, y_ref) < 0.05
    text = jax.jit(fused).lower(x8, w1, w2, *scales).as_text()
    if sched.startswith("dma"):
        assert text.count("ficco_ag_matmul_scaled") == 1 and text.count("ficco_matmul_rs_scaled") == 1


@pytest.mark.parametrize("sched", ["xla/ring/c2"] + (["dma/direct/c2"] if extension.available() else []))
def test_overlap_keeps_a_scale_rounded_by_its_cast(mesh1d, rng, sched):
    """A recipe that casts its f32 scale to bf16 before multiplying (as flax's dequantize does) scales
    by the rounded value: 1 + 2**-8 is 1.0 in bf16, and the op must scale by 1.0 too (it had taken
    the f32 scale: every result 0.39 % too large)."""
    bf = jnp.bfloat16
    deq = lambda v8, s: v8.astype(bf) * jnp.broadcast_to(s.astype(bf), v8.shape)  # noqa: E731
    scale, one = jnp.float32(1 + 2**-8), jnp.float32(1.0)
    y8 = (random(rng, (8 * M_ROWS, 8 * K), F32) * 3).astype(jnp.float8_e4m3fn)
    w8 = random(rng, (8 * K, N_COLS), F32).astype(jnp.float8_e4m3fn)
    rs = jax.shard_map(lambda y8, w8, sy, sw: jax.lax.psum_scatter(
        jnp.matmul(deq(y8, sy), deq(w8, sw), preferred_element_type=F32), "tp", scatter_dimension=0, tiled=True),
        mesh=mesh1d, in_specs=(P(None, "tp"), P("tp"), P(), P()), out_specs=P("tp"))
    x8 = (random(rng, (8 * M_ROWS, K), F32) * 3).astype(jnp.float8_e4m3fn)
    v8 = random(rng, (K, 8 * N_COLS), F32).astype(jnp.float8_e4m3fn)
    ag = jax.shard_map(lambda x8, v8, sx, sw: jnp.matmul(
        deq(jax.lax.all_gather(x8, "tp", axis=0, tiled=True), sx), deq(v8, sw), preferred_element_type=F32),
        mesh=mesh1d, in_specs=(P("tp"), P(None, "tp"), P(), P()), out_specs=P(None, "tp"), check_vma=False)
    for fn, op, args in ((rs, "matmul_rs", (y8, w8, scale, one)), (ag, "ag_matmul", (x8, v8, scale, one))):
        fused = ficco_jax.overlap(fn, schedule=sched)
        assert [r.op for r in ficco_jax.explain(fused, *args).sites] == [op]
        assert rel_err(jax.jit(fused)(*args), jax.jit(fn)(*args)) < 1e-3, op


def test_overlap_reports_e5m2_pair_as_near_miss(mesh1d, rng):
    x8 = random(rng, (8 * M_ROWS, K), F32).astype(jnp.float8_e5m2)
    w1, w2 = _mlp_weights(rng, mesh1d, jnp.float8_e5m2)
    scales = (jnp.float32(1.0), jnp.float32(1.0))
    fn = jax.shard_map(_fp8_mlp, mesh=mesh1d, in_specs=(P("tp"), P(None, "tp"), P("tp", None), P(), P()),
                       out_specs=(P(None, "tp"), P("tp")))
    report = ficco_jax.explain(ficco_jax.overlap(fn, schedule="xla/ring/c2"), x8, w1, w2, *scales)
    assert any("e5m2 x float8_e5m2" in r.reason for r in report.near_misses), str(report)


# ------------------------------------------------------------------------------------------------
# GPUs without FP8 tensor cores
# ------------------------------------------------------------------------------------------------
class _Device:
    def __init__(self, capability):
        self.compute_capability = capability


@pytest.mark.parametrize("capabilities,supported", [(["9.0", "9.0"], True), (["8.9"], True), (["9.0", "8.0"], False),
                                                    ([None], False)])
def test_fp8_support_follows_compute_capability(monkeypatch, capabilities, supported):
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device(c) for c in capabilities])
    assert extension.fp8_matmuls_supported("gpu") is supported


@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
def test_fp8_without_fp8_tensor_cores(monkeypatch, mesh2d, rng):
    """An explicit copy-engine FP8 schedule is an error that names the requirement; 'auto' leaves
    copy engines out and still computes the op."""
    from helpers import prefer_copy_engines

    monkeypatch.setattr(extension, "fp8_matmuls_supported", lambda platform=None: False)
    a, w, scales = _scaled_inputs(rng, "ag_matmul", mesh2d)
    specs = _fp8_specs("ag_matmul", mesh2d)
    with pytest.raises(TypeError, match="FP8 tensor cores"):
        run_sharded(mesh2d, _fp8_call("ag_matmul", "dma/direct/c1", None), specs, a, w, *scales)
    asked = prefer_copy_engines(monkeypatch)
    got = run_sharded(mesh2d, _fp8_call("ag_matmul", "auto", F32), specs, a, w, *scales)
    want = run_sharded(mesh2d, _fp8_reference_f32("ag_matmul", F32), specs, a.astype(F32), w.astype(F32), *scales)
    assert asked and all("dma" not in comms for _, comms in asked)
    assert rel_err(got, want) < TOLERANCE["float32"]


def test_expert_ops_refuse_fp8_with_the_way_out(mesh1d, rng):
    x = random(rng, (64, 2, 4, 16), F32).astype(jnp.float8_e4m3fn)
    w = random(rng, (16, 16, 8), F32).astype(jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="FP8 operands are taken by ag_matmul and matmul_rs.*dequantize x"):
        run_sharded(mesh1d, lambda x, w: ficco_jax.a2a_matmul(x, w, "tp"), ((P("tp"), P("tp")), P("tp")), x, w)


# The fast tier runs the first two: one on XLA's collectives, one on copy engines.
WRAP_SCHEDULES = ["xla/ring/c2"] + (["dma/direct/c2/columns", "dma/direct/c1", "dma/direct/c2/grouped"]
                                    if extension.available() else []) + ["xla/direct/c1"]


@pytest.mark.sweep(first=2)
@pytest.mark.parametrize("schedule", WRAP_SCHEDULES)
def test_wrap_orders_of_a_mixed_precision_step(mesh1d, rng, schedule):
    """The README's two wrap orders for bf16 weights with f32 accumulation, on a training step
    (value_and_grad, then SGD): both overlap the forward and the backward sites, and both compute
    JAX's gradients (the f32 cotangent times the widened bf16 weight, each gradient rounded to
    bf16 once): equal to the plain step's bit for bit but where a sum runs in another order."""
    layer = mixed_precision_mlp(mesh1d)
    loss = lambda x, w1, w2: jnp.sum(layer(x, w1, w2) ** 2)  # noqa: E731
    x, w1, w2 = (jnp.asarray(rng.standard_normal(s) * c, jnp.bfloat16)
                 for s, c in (((64, 32), 1.0), ((32, 64), 0.1), ((64, 32), 0.1)))
    plain = jax.value_and_grad(loss, argnums=(0, 1, 2))
    outside = ficco_jax.overlap(plain, schedule=schedule)
    inside = jax.value_and_grad(ficco_jax.overlap(loss, schedule=schedule), argnums=(0, 1, 2))

    report = ficco_jax.explain(outside, x, w1, w2)
    assert [r.op for r in report.sites] == ["ag_matmul", "matmul_rs"] * 2 and not report.near_misses, str(report)
    backward_gather, backward_scatter = report.sites[2:]
    assert "operands in float32" in backward_gather.shapes, str(report)
    assert "partials rounded to bfloat16" in backward_scatter.shapes, str(report)
    if schedule.startswith("dma"):  # copy engines do not round f32 products: the same steps on XLA's collectives
        assert backward_scatter.schedule.startswith(f"xla/direct/{schedule.split('/')[2]}"), str(report)
    for fn in (outside, inside):
        assert str(jax.make_jaxpr(fn)(x, w1, w2)).count("ficco_linear") == 4

    (loss_ref, grads_ref) = jax.jit(plain)(x, w1, w2)
    for fn in (outside, inside):
        value, grads = jax.jit(fn)(x, w1, w2)
        assert value.dtype == F32 and rel_err(value, loss_ref) < TOLERANCE["float32"]
        for name, g, r in zip(("x", "w1", "w2"), grads, grads_ref):
            assert g.dtype == jnp.bfloat16
            if name == "x" and "/ring/" in schedule:
                # x's gradient is a reduce-scatter of bf16 partials (in JAX's program too): a ring
                # sums them hop by hop in bf16, as NCCL's does; XLA's CPU collective sums in f32.
                assert rel_err(g, r) < TOLERANCE["bfloat16"]
            else:
                assert same_bits(g, r) > 0.99 and rel_err(g, r) < 1e-3, (name, same_bits(g, r), rel_err(g, r))

    def sgd_step(grad_fn, lr=0.5):
        def step(x, w1, w2):
            value, (_, g1, g2) = grad_fn(x, w1, w2)
            return value, [(w.astype(F32) - lr * g.astype(F32)).astype(w.dtype) for w, g in ((w1, g1), (w2, g2))]
        return jax.jit(step)

    _, want = sgd_step(plain)(x, w1, w2)
    whole_step = jax.jit(ficco_jax.overlap(sgd_step(plain), schedule=schedule))
    for step in (sgd_step(outside), sgd_step(inside), whole_step):
        _, got = step(x, w1, w2)
        for g, r in zip(got, want):
            assert same_bits(g, r) > 0.99, same_bits(g, r)


@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
def test_a_column_schedule_where_the_backward_scatter_rows_do_not_divide(mesh1d, rng):
    """3 rows per reduce-scatter block on 8 devices: the forward reduce-scatter cuts its columns, the
    backward one (bf16 partials of f32 products, XLA's collectives) cannot cut rows and takes "auto",
    and the step equals the plain one."""
    layer = mixed_precision_mlp(mesh1d)
    loss = lambda x, w1, w2: jnp.sum(layer(x, w1, w2) ** 2)  # noqa: E731
    x, w1, w2 = (jnp.asarray(rng.standard_normal(s) * c, jnp.bfloat16)
                 for s, c in (((24, 32), 1.0), ((32, 64), 0.1), ((64, 32), 0.1)))
    plain = jax.value_and_grad(loss, argnums=(0, 1, 2))
    fused = ficco_jax.overlap(plain, schedule="dma/direct/c2/columns")
    shown = [r.schedule for r in ficco_jax.explain(fused, x, w1, w2).sites]
    assert shown[1] == "dma/direct/c2/columns" and shown[3].endswith("(auto)"), shown
    (value, grads), (value_ref, grads_ref) = jax.jit(fused)(x, w1, w2), jax.jit(plain)(x, w1, w2)
    assert rel_err(value, value_ref) < TOLERANCE["float32"]
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) < TOLERANCE["bfloat16"]


def _moe_layer(mesh, widened: bool):
    """Dispatch, expert matmuls and combine with bf16 weights and f32 accumulation; `widened`:
    the same numerics with the operands widened to f32 (XLA's CPU backend has no batched bf16 x
    bf16 -> f32 dot, so the plain program runs only in that form there)."""
    def matmul(spec, a, w):
        if widened:
            return jnp.einsum(spec, a.astype(F32), w.astype(F32))
        return jnp.einsum(spec, a, w, preferred_element_type=F32)

    def body(x, w_in, w_out):
        received = jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)
        h = jax.nn.relu(matmul("pecd,edf->pecf", received, w_in)).astype(jnp.bfloat16)
        return jax.lax.all_to_all(matmul("pecf,efd->pecd", h, w_out), "tp", 0, 0, tiled=True)

    return jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3, out_specs=P("tp"))


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("schedule", ["xla/direct/c2"] + (["dma/direct/c1"] if extension.available() else []))
def test_wrap_orders_of_a_mixed_precision_moe_step(mesh1d, rng, schedule):
    """The expert-parallel ops likewise: JAX's backward of a bf16 MoE layer with f32 accumulation
    multiplies the exchanged f32 cotangent by a bf16 expert weight (a dispatch site) and rounds a
    product to bf16 before an all_to_all (a combine site, out of the layout the combine matcher
    takes here); both wrap orders give JAX's gradients bit for bit."""
    n, e, c, d, f = 8, 2, 4, 16, 8
    x = random(rng, (n * n, e, c, d), jnp.bfloat16)
    w_in, w_out = random(rng, (n * e, d, f), F32) * 0.2, random(rng, (n * e, f, d), F32) * 0.2
    w_in, w_out = w_in.astype(jnp.bfloat16), w_out.astype(jnp.bfloat16)

    def loss(layer):
        return lambda *a: jnp.sum(layer(*a) ** 2)

    mixed = jax.value_and_grad(loss(_moe_layer(mesh1d, widened=False)), argnums=(0, 1, 2))
    outside = ficco_jax.overlap(mixed, schedule=schedule)
    inside = jax.value_and_grad(ficco_jax.overlap(loss(_moe_layer(mesh1d, widened=False)), schedule=schedule),
                                argnums=(0, 1, 2))
    report = ficco_jax.explain(outside, x, w_in, w_out)
    assert [r.op for r in report.sites] == ["a2a_matmul", "matmul_a2a", "a2a_matmul"], str(report)
    assert "float32[8,2,4,16] all_to_all · w bfloat16" in report.sites[2].shapes, str(report)
    value_ref, grads_ref = jax.jit(jax.value_and_grad(loss(_moe_layer(mesh1d, widened=True)), argnums=(0, 1, 2)))(
        x, w_in, w_out)
    for fn in (outside, inside):
        value, grads = jax.jit(fn)(x, w_in, w_out)
        assert rel_err(value, value_ref) < TOLERANCE["float32"]
        for g, r in zip(grads, grads_ref):
            assert g.dtype == jnp.bfloat16 and same_bits(g, r) > 0.99, same_bits(g, r)


def test_mixed_precision_sites_overlap_cannot_take_say_why(mesh1d, rng):
    """A gathered bf16 tensor times an f32 weight (JAX converts both to f32 after the gather: the
    op would gather f32) and a bf16 product cast up before its reduce-scatter stay as written,
    each with its reason and its fix."""
    def body(x, w_f32, y, w2):
        h = jnp.dot(jax.lax.all_gather(x, "tp", tiled=True), w_f32)
        z = jnp.dot(y, w2).astype(F32)
        return h, jax.lax.psum_scatter(z, "tp", tiled=True)

    fn = jax.shard_map(body, mesh=mesh1d, in_specs=(P("tp"), P(None, "tp"), P(None, "tp"), P("tp", None)),
                       out_specs=(P(None, "tp"), P("tp")))
    x, y = random(rng, (64, 32), jnp.bfloat16), random(rng, (64, 64), jnp.bfloat16)
    w_f32, w2 = random(rng, (32, 64), F32), random(rng, (64, 32), jnp.bfloat16)
    report = ficco_jax.explain(ficco_jax.overlap(fn, schedule="xla/ring/c2"), x, w_f32, y, w2)
    assert not report.sites, str(report)
    gather, scatter = report.near_misses
    assert "the op would gather float32" in gather.reason and "give both operands one dtype" in gather.reason
    assert "cast to float32 before the reduce-scatter" in scatter.reason
    assert "preferred_element_type=float32" in scatter.reason


# ------------------------------------------------------------------------------------------------
# FP8: vmap, forward mode, second derivatives
# ------------------------------------------------------------------------------------------------
BATCH = 2


def _batched_spec(spec, axis):
    return spec if axis is None else P(*[*spec][:axis], None, *[*spec][axis:])


def _fp8_batched_program(mesh, op, body, in_axes, out_specs):
    """jit(shard_map(body)) of (a, w, sa, sw), a batch of BATCH in dimension in_axes[0] of a (and 0 of
    w where in_axes[1] is 0)."""
    (a_spec, w_spec, s_spec, _), _ = _fp8_specs(op, mesh)
    in_specs = (_batched_spec(a_spec, in_axes[0]), _batched_spec(w_spec, in_axes[1]), s_spec, s_spec)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _fp8_batched_inputs(rng, op, mesh, in_axes):
    elements = [_scaled_inputs(rng, op, mesh) for _ in range(BATCH)]
    a = jnp.stack([e[0] for e in elements], axis=in_axes[0])
    w = elements[0][1] if in_axes[1] is None else jnp.stack([e[1] for e in elements])
    return a, w, elements[0][2]


def _fp8_sin_grads(call):
    """The gradients of sum(sin(op)) in (a, w, sa, sw)."""
    return jax.grad(lambda *v: jnp.sum(jnp.sin(call(*v).astype(F32))), argnums=(0, 1, 2, 3))


@pytest.mark.sweep
@pytest.mark.parametrize("in_axes", [(0, None), (1, None), (0, 0)], ids=["batch-0", "batch-1", "batched-weights"])
@pytest.mark.parametrize("op", list(OPS))
def test_fp8_under_vmap(mesh2d, rng, op, in_axes):
    """vmap of an FP8 op on copy engines and of its gradient: a batch of inputs against one weight
    is one executor call per op (the backward's op included); a batch of weights runs one call per
    element. Equal to the op run per element, and to the reference."""
    a, w, scales = _fp8_batched_inputs(rng, op, mesh2d, in_axes)
    axes = (*in_axes, None, None)
    (a_spec, w_spec, _, _), out_spec = _fp8_specs(op, mesh2d)
    ours, ref = _fp8_call(op, "dma/direct/c2", F32), _fp8_reference_f32(op, F32)

    def per_element(fn):
        def run(a, w, sa, sw):
            one = [fn(jnp.take(a, i, axis=in_axes[0]), w if in_axes[1] is None else w[i], sa, sw) for i in range(BATCH)]
            return jax.tree.map(lambda *r: jnp.stack(r), *one)
        return run

    out_specs = P(None, *out_spec)
    got = _fp8_batched_program(mesh2d, op, jax.vmap(ours, in_axes=axes), in_axes, out_specs)
    assert rel_err(got(a, w, *scales), _fp8_batched_program(mesh2d, op, per_element(ours), in_axes, out_specs)(
        a, w, *scales)) < TOLERANCE["float32"]
    want = _fp8_batched_program(mesh2d, op, jax.vmap(ref, in_axes=axes), in_axes, out_specs)(
        a.astype(F32), w.astype(F32), *scales)
    assert rel_err(got(a, w, *scales), want) < TOLERANCE["float32"]
    calls = 1 if in_axes[1] is None else BATCH
    assert ffi_calls(got.lower(a, w, *scales).compile().as_text()) == calls

    grad_specs = (P(None, *a_spec), P(None, *w_spec), P(None), P(None))  # batch-leading
    got = _fp8_batched_program(mesh2d, op, jax.vmap(_fp8_sin_grads(ours), in_axes=axes), in_axes, grad_specs)
    each = _fp8_batched_program(mesh2d, op, per_element(_fp8_sin_grads(ours)), in_axes, grad_specs)(a, w, *scales)
    want = _fp8_batched_program(mesh2d, op, jax.vmap(_fp8_sin_grads(ref), in_axes=axes), in_axes, grad_specs)(
        a.astype(F32), w.astype(F32), *scales)
    for g, e, r in zip(got(a, w, *scales), each, want):
        if g.dtype == F32:  # the scales': sums over every element of both operands, in another order
            assert rel_err(g, e) < TOLERANCE["float32"] and rel_err(g, r) < 10 * TOLERANCE["float32"]
        else:  # the FP8 operands': the f32 reference's rounded once to FP8
            assert same_bits(g, e) > 0.99 and same_bits(g, r.astype(g.dtype)) > 0.99
    assert ffi_calls(got.lower(a, w, *scales).compile().as_text()) == 2 * calls


@pytest.mark.parametrize("op", list(OPS))
def test_fp8_grad_of_vmap(mesh2d, rng, op):
    """grad of vmap of an FP8 op (a batch of inputs against one weight and one pair of scales):
    one executor call per op and direction, no loop, and the FP8 weight's gradient is the
    reference's rounded once to FP8 (a loop over the batch would round each element's and sum them in FP8)."""
    a, w, scales = _fp8_batched_inputs(rng, op, mesh2d, (0, None))
    (a_spec, w_spec, _, _), _ = _fp8_specs(op, mesh2d)
    grad_specs = (P(None, *a_spec), w_spec, P(), P())

    def program(call):
        loss = lambda *v: jnp.sum(jnp.sin(jax.vmap(call, in_axes=(0, None, None, None))(*v).astype(F32)))  # noqa: E731
        return _fp8_batched_program(mesh2d, op, jax.grad(loss, argnums=(0, 1, 2, 3)), (0, None), grad_specs)

    got = program(_fp8_call(op, "dma/direct/c2", F32))
    want = program(_fp8_reference_f32(op, F32))(a.astype(F32), w.astype(F32), *scales)
    for g, r in zip(got(a, w, *scales), want):
        if g.dtype == F32:
            assert rel_err(g, r) < 10 * TOLERANCE["float32"]
        else:
            assert same_bits(g, r.astype(g.dtype)) > 0.99
    text = got.lower(a, w, *scales).compile().as_text()
    assert "while" not in got.lower(a, w, *scales).as_text() and ffi_calls(text) == 2


@pytest.mark.parametrize("sched", ["dma/direct/c2", "xla/ring/c2"])
@pytest.mark.parametrize("op", list(OPS))
def test_fp8_forward_mode(mesh2d, rng, op, sched):
    """jax.jvp of an FP8 op with tangents on both FP8 operands and both scales equals JAX's jvp of
    the reference, and runs the op on copy engines for the tangent too."""
    a, w, scales = _scaled_inputs(rng, op, mesh2d)
    da, dw, _ = _scaled_inputs(rng, op, mesh2d)
    d_scales = (jnp.float32(0.3), jnp.float32(-0.7))
    specs, out_spec = _fp8_specs(op, mesh2d)

    def program(call):
        body = lambda *v: jax.jvp(call, v[:4], v[4:])  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=specs * 2, out_specs=(out_spec, out_spec)))

    got = program(_fp8_call(op, sched, F32))(a, w, *scales, da, dw, *d_scales)
    f32 = [v.astype(F32) for v in (a, w)] + list(scales) + [v.astype(F32) for v in (da, dw)] + list(d_scales)
    want = program(_fp8_reference_f32(op, F32))(*f32)
    for g, r in zip(got, want):
        assert rel_err(g, r) < TOLERANCE["float32"]
    if sched.startswith("dma"):
        assert ffi_calls(program(_fp8_call(op, sched, F32)).lower(a, w, *scales, da, dw, *d_scales)
                         .compile().as_text()) >= 2


@pytest.mark.parametrize("op", list(OPS))
def test_fp8_second_derivatives(mesh2d, rng, op):
    """Forward over reverse (a Hessian-vector product in the scales, tangents on every operand) and
    reverse over reverse equal JAX's on the reference."""
    a, w, scales = _scaled_inputs(rng, op, mesh2d)
    da, dw, _ = _scaled_inputs(rng, op, mesh2d)
    d_scales = (jnp.float32(0.3), jnp.float32(-0.7))
    specs, _ = _fp8_specs(op, mesh2d)

    def loss(call):
        return lambda *v: jax.lax.psum(jnp.sum(jnp.sin(call(*v).astype(F32))), ("dp", "tp"))

    def hvp(call):
        body = lambda *v: jax.jvp(jax.grad(loss(call), argnums=(2, 3)), v[:4], v[4:])[1]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=specs * 2, out_specs=P()))

    def grad_grad(call):
        body = jax.grad(lambda *v: jax.grad(loss(call), argnums=2)(*v), argnums=(2, 3))
        return jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=specs, out_specs=P()))

    f32 = [v.astype(F32) for v in (a, w)] + list(scales)
    for got, want in [(hvp(_fp8_call(op, "dma/direct/c1", F32))(a, w, *scales, da, dw, *d_scales),
                       hvp(_fp8_reference_f32(op, F32))(*f32, da.astype(F32), dw.astype(F32), *d_scales)),
                      (grad_grad(_fp8_call(op, "dma/direct/c1", F32))(a, w, *scales),
                       grad_grad(_fp8_reference_f32(op, F32))(*f32))]:
        for g, r in zip(got, want):  # second derivatives of sin summed over every element: f32 order, amplified
            assert abs(float(g) - float(r)) <= 10 * TOLERANCE["float32"] * abs(float(r)) + 1e-6


@pytest.mark.parametrize("op", list(OPS))
def test_fp8_traces_its_lowering_once(monkeypatch, mesh2d, rng, op):
    """A forward FP8 call traces its schedule's steps once; differentiated, the forward is still
    traced once (its equation's results are typed from the op's shapes), and the transpose (the
    other op of the pair) once."""
    pair, traced = table.TENSOR_PARALLEL, []
    for lowering in ("gather_xla", "scatter_xla"):
        def counted(*args, _lowering=lowering, **kwargs):
            traced.append(_lowering)
            return getattr(type(pair), _lowering)(pair, *args, **kwargs)
        monkeypatch.setattr(pair, lowering, counted)
    a, w, scales = _scaled_inputs(rng, op, mesh2d)
    specs, out_spec = _fp8_specs(op, mesh2d)
    own, other = ("gather_xla", "scatter_xla") if op == "ag_matmul" else ("scatter_xla", "gather_xla")
    run_sharded(mesh2d, _fp8_call(op, "xla/ring/c2", F32), (specs, out_spec), a, w, *scales)
    assert traced == [own]
    traced.clear()
    grads = jax.grad(lambda a, w: jnp.sum(run_sharded(mesh2d, _fp8_call(op, "xla/ring/c2", F32), (specs, out_spec),
                                                      a, w, *scales)), argnums=(0, 1))
    grads(a, w)
    assert traced == [own, other]


@pytest.mark.parametrize("wrapped", [False, True], ids=["op", "overlap"])
def test_matmuls_keep_the_precision_their_call_asked_for(mesh1d, wrapped):
    """`with jax.default_matmul_precision("highest")` around a call holds for the op's matmuls, forward
    and backward, as for JAX's own dots: the op's matmuls are traced again when it is lowered, outside
    that block, and must carry the precision of the call, not the default (TF32 for f32 on GPUs)."""
    def body(x, w):
        if wrapped:
            return jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w
        return ficco_jax.ag_matmul(x, w, "tp", schedule="xla/ring/c2")

    fn = jax.shard_map(body, mesh=mesh1d, in_specs=(P("tp"), P()), out_specs=P("tp"))
    fn = ficco_jax.overlap(fn, schedule="xla/ring/c2") if wrapped else fn
    x, w = jnp.ones((16, 8)), jnp.ones((8, 6))

    def dots(precision):
        def step(x, w):
            with jax.default_matmul_precision(precision):
                return jnp.sum(jnp.sin(fn(x, w)))
        text = jax.jit(jax.value_and_grad(step, argnums=(0, 1))).lower(x, w).as_text()
        return [line for line in text.splitlines() if "dot_general" in line]

    highest = dots("highest")
    assert highest and all("HIGHEST" in line for line in highest), highest
    assert not any("HIGHEST" in line for line in dots("default"))
