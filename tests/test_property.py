"""Property tests (hypothesis): random shapes, dtypes, mesh layouts and every valid schedule equal
the plain-JAX references on 8 CPU devices; NaN and Inf propagate exactly as in the reference.

Reproducible and bounded for CI: `derandomize=True` (examples derived from the test's name, no
example database) and a small `max_examples` per test (at most conftest.FAST_EXAMPLES in the fast
tier: helpers.examples); each example compiles one program holding
both our op and its reference, so the budget below is mostly XLA compile time (about 1.5 minutes
for the whole file on 2 cores). Invalid combinations are never generated: shapes are drawn as
multiples of the drawn schedule's chunk count, and schedules come from `Schedule.enumerate`.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax import config  # noqa: E402
from ficco_jax.runtime import extension as _ext  # noqa: E402
from ficco_jax.tuning import select  # noqa: E402
from ficco_jax.schedule import COMMS, Schedule  # noqa: E402
from helpers import TOLERANCE, ag_specs, examples, rel_err, rs_specs, run_sharded  # noqa: E402

COMMS_HERE = COMMS if _ext.available() else ("none", "xla")


def _meshes() -> dict:
    d = np.array(jax.devices()[:8])
    permuted = d[[5, 2, 7, 0, 3, 6, 1, 4]]  # device ordinals differ from ranks
    return {
        "tp8": Mesh(d, ("tp",)),
        "tp4-of-4-devices": Mesh(d[4:], ("tp",)),  # the other devices idle: groups are not "all"
        "dp2xtp4": Mesh(permuted.reshape(2, 4), ("dp", "tp")),
        "dp4xtp2": Mesh(d.reshape(4, 2), ("dp", "tp")),
        "tp2xdp4": Mesh(permuted.reshape(2, 4), ("tp", "dp")),  # tp is the slow mesh axis
        "dp8xtp1": Mesh(d.reshape(8, 1), ("dp", "tp")),  # groups of one device
        "dp2xsp2xtp2": Mesh(permuted.reshape(2, 2, 2), ("dp", "sp", "tp")),
    }


MESHES = _meshes()
DTYPES = ("float32", "bfloat16", "float16")
PROPERTY = settings(max_examples=examples(60), deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

OPS = {
    "ag_matmul": (ficco_jax.ag_matmul, ficco_jax.ag_matmul_ref, ag_specs),
    "matmul_rs": (ficco_jax.matmul_rs, ficco_jax.matmul_rs_ref, rs_specs),
}


def _devices_off_tp(mesh) -> int:
    return mesh.devices.size // mesh.shape["tp"]


@st.composite
def op_cases(draw, op, mesh_name):
    """(mesh name, schedule, dtype, global operand shapes) of one valid call of `op` on that mesh.
    The mesh is a pytest parameter, not drawn: drawn, hypothesis's shrinking towards the first
    choice left tp8 with almost no ag_matmul case and no copy-engine schedule at all."""
    mesh = MESHES[mesh_name]
    n, batch = mesh.shape["tp"], _devices_off_tp(mesh)
    sched = draw(st.sampled_from(Schedule.enumerate(op, n, COMMS_HERE)))
    dtype = draw(st.sampled_from(DTYPES))
    rows = sched.chunks * draw(st.integers(1, 3))  # rows per device (ag) / per output block (rs)
    k, cols = draw(st.integers(1, 24)), draw(st.integers(1, 12))
    if sched.gemm == "columns":  # its chunks cut the output's columns
        cols = sched.chunks * draw(st.integers(1, 3))
    if op == "ag_matmul":  # x [rows, k], w [k, cols] per device
        shapes = ((batch * n * rows, k), (k, n * cols))
    else:  # y [n*rows, k], w [k, cols] per device
        shapes = ((batch * n * rows, n * k), (n * k, cols))
    return mesh_name, sched, dtype, shapes


def _check_op(op, case, seed):
    mesh_name, sched, dtype, (a_shape, w_shape) = case
    mesh = MESHES[mesh_name]
    fn, ref, specs = OPS[op]
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(a_shape, np.float32)).astype(dtype)
    w = jnp.asarray(rng.standard_normal(w_shape, np.float32)).astype(dtype)
    in_specs, out_spec = specs(mesh)

    def both(a, w):  # one program, one compile: ours and the f32 reference of the same inputs
        return fn(a, w, "tp", schedule=sched), ref(a.astype(jnp.float32), w.astype(jnp.float32), "tp")

    got, want = run_sharded(mesh, both, (in_specs, (out_spec, out_spec)), a, w)
    assert got.dtype == jnp.dtype(dtype)
    assert rel_err(got, want) < TOLERANCE[dtype], (mesh_name, str(sched), dtype, a_shape, w_shape)


# Every mesh gets its own examples (9 each, so every mesh is drawn as often as the others); dp8xtp1
# (groups of one device, the collectives do nothing) is one mesh among them, not a fifth of the draws.
@pytest.mark.sweep(first=3)
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@settings(PROPERTY, max_examples=examples(9))
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_ag_matmul_equals_reference(mesh_name, data, seed):
    _check_op("ag_matmul", data.draw(op_cases("ag_matmul", mesh_name)), seed)


@pytest.mark.sweep(first=3)
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@settings(PROPERTY, max_examples=examples(9))
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_matmul_rs_equals_reference(mesh_name, data, seed):
    _check_op("matmul_rs", data.draw(op_cases("matmul_rs", mesh_name)), seed)


# ------------------------------------------------------------------------------------------------
# Gradients (fewer examples: each compiles a forward and a backward program)
# ------------------------------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("op", sorted(OPS))
@settings(PROPERTY, max_examples=examples(4))
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_gradients_equal_reference(op, mesh_name, data, seed):
    mesh_name, sched, _, (a_shape, w_shape) = data.draw(op_cases(op, mesh_name))
    mesh = MESHES[mesh_name]
    fn, ref, specs = OPS[op]
    in_specs, out_spec = specs(mesh)
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(a_shape, np.float32))
    w = jnp.asarray(rng.standard_normal(w_shape, np.float32))
    cot = jnp.asarray(rng.standard_normal(jax.eval_shape(
        jax.shard_map(lambda a, w: ref(a, w, "tp"), mesh=mesh, in_specs=in_specs, out_specs=out_spec), a, w).shape,
        np.float32))

    def loss(body, a, w):
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(a, w) * cot)

    got = jax.jit(jax.grad(lambda a, w: loss(lambda a, w: fn(a, w, "tp", schedule=sched), a, w), (0, 1)))(a, w)
    want = jax.jit(jax.grad(lambda a, w: loss(lambda a, w: ref(a, w, "tp"), a, w), (0, 1)))(a, w)
    for g, r in zip(got, want):
        assert rel_err(g, r) < TOLERANCE["float32"], (mesh_name, str(sched))


# ------------------------------------------------------------------------------------------------
# Standalone collectives: any dtype, rank and axis; all_gather is bit-exact
# ------------------------------------------------------------------------------------------------
GATHER_DTYPES = ("float32", "bfloat16", "float16", "int8", "int32", "uint16", "bool", "complex64")


@pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")
@settings(PROPERTY, max_examples=examples(40))
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_collectives_equal_lax(data, seed):
    mesh_name = data.draw(st.sampled_from(sorted(MESHES)))
    mesh = MESHES[mesh_name]
    n = mesh.shape["tp"]
    sched = data.draw(st.sampled_from([None, *Schedule.enumerate("ag_matmul", n, ("dma",))]))
    chunks = sched.chunks if sched else 1
    rank = data.draw(st.integers(1, 3))
    shape = [data.draw(st.integers(1, 5)) for _ in range(rank)]
    axis = data.draw(st.integers(-rank, rank - 1))
    shape[axis] = n * chunks * data.draw(st.integers(1, 2))  # scatterable by n, then by chunks
    gather_dtype = data.draw(st.sampled_from(GATHER_DTYPES))
    scatter_dtype = data.draw(st.sampled_from(config.DMA_DTYPES))
    spec = P(tuple(mesh.axis_names))  # dim 0 split over every device
    shape[0] *= mesh.devices.size  # global shape: dim 0 blocks of every device
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 100, size=shape)
    if gather_dtype == "bool":
        raw = raw % 2  # about half True: values from 0..99 would make nearly all of them True
    x_gather = (jnp.asarray(raw + 1j * raw[::-1], jnp.complex64) if gather_dtype == "complex64"
                else jnp.asarray(raw.astype(np.float32)).astype(gather_dtype))
    # Small integers: every partial sum (at most 8 terms of |v| <= 8) is exact in bf16 and f16.
    x_scatter = jnp.asarray(rng.integers(-8, 9, size=shape).astype(np.float32)).astype(scatter_dtype)

    def both(xg, xs):
        return (ficco_jax.dma.all_gather(xg, "tp", axis=axis, schedule=sched),
                jax.lax.all_gather(xg, "tp", axis=axis, tiled=True),
                ficco_jax.dma.reduce_scatter(xs, "tp", scatter_dimension=axis, schedule=sched),
                jax.lax.psum_scatter(xs, "tp", scatter_dimension=axis % rank, tiled=True))

    outs = run_sharded(mesh, both, ((spec, spec), (spec,) * 4), x_gather, x_scatter)
    ag, ag_ref, rs, rs_ref = (np.asarray(o) for o in outs)
    assert ag.dtype == ag_ref.dtype
    np.testing.assert_array_equal(ag, ag_ref)
    assert rs.dtype == rs_ref.dtype
    np.testing.assert_array_equal(rs.astype(np.float32), rs_ref.astype(np.float32))


# ------------------------------------------------------------------------------------------------
# The cost model's pick is always valid (no compile: cheap, so many examples)
# ------------------------------------------------------------------------------------------------
@settings(PROPERTY, max_examples=examples(300))
@given(op=st.sampled_from(sorted(OPS)), n=st.integers(1, 8), rows=st.integers(1, 5000),
       k=st.integers(1, 16384), cols=st.integers(1, 16384),
       dtype=st.sampled_from(("float32", "bfloat16", "float16", "float64")))
def test_auto_selection_is_always_valid(op, n, rows, k, cols, dtype):
    a = (rows, k) if op == "ag_matmul" else (rows * n, k)
    shapes = (a, (k, cols))
    chosen = select.select_schedule(op, shapes, dtype, n, comms=COMMS)
    chosen.validate(op, shapes, n)


# ------------------------------------------------------------------------------------------------
# NaN / Inf: the same positions as the reference, the finite values close
# ------------------------------------------------------------------------------------------------
def _with_specials(rng, shape, nan_at, inf_at, neg_inf_at):
    v = rng.standard_normal(shape).astype(np.float32)
    for where, value in ((nan_at, np.nan), (inf_at, np.inf), (neg_inf_at, -np.inf)):
        for index in where:
            v[index] = value
    return jnp.asarray(v)


def _nonfinite_cases():
    for op in OPS:
        for mesh_name in ("tp8", "dp2xtp4"):
            n = MESHES[mesh_name].shape["tp"]
            comms = [c for c in ("xla", "dma") if c in COMMS_HERE]
            for comm in comms:
                for sched in Schedule.enumerate(op, n, (comm,)):
                    if sched.chunks in (1, 4) and sched.copy_streams in (1, 2):
                        yield pytest.param(op, mesh_name, sched, id=f"{op}-{mesh_name}-{sched}")
            yield pytest.param(op, mesh_name, Schedule(comm="none"), id=f"{op}-{mesh_name}-none")


@pytest.mark.sweep
@pytest.mark.parametrize("op,mesh_name,sched", list(_nonfinite_cases()))
def test_nan_and_inf_propagate_as_in_the_reference(op, mesh_name, sched):
    mesh = MESHES[mesh_name]
    fn, ref, specs = OPS[op]
    n, rows, k, cols = mesh.shape["tp"], 8, 6, 8 if sched.gemm == "columns" else 5  # (column chunks cut cols)
    rng = np.random.default_rng(7)
    if op == "ag_matmul":
        a_shape, w_shape = (8 * rows, k), (k, n * cols)
    else:
        a_shape, w_shape = (_devices_off_tp(mesh) * n * rows, n * k), (n * k, cols)
    # NaN in a row of a, +Inf and -Inf meeting in one output (-> NaN), a lone +Inf (-> +-Inf),
    # and 0 * Inf from a zero in w (-> NaN): every rule the reference follows.
    a = _with_specials(rng, a_shape, nan_at=[(1, 0)], inf_at=[(3, 2), (9, 1), (20, 3)],
                       neg_inf_at=[(3, 4), (30, 0)])
    w = np.array(_with_specials(rng, w_shape, nan_at=[], inf_at=[(5, 1)], neg_inf_at=[]))
    w[2, 0] = 0.0
    w = jnp.asarray(w)
    in_specs, out_spec = specs(mesh)
    got, want = run_sharded(mesh, lambda a, w: (fn(a, w, "tp", schedule=sched), ref(a, w, "tp")),
                            (in_specs, (out_spec, out_spec)), a, w)
    got, want = np.asarray(got), np.asarray(want)
    assert np.isnan(want).any() and np.isinf(want).any() and np.isfinite(want).any()  # the test can fail
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
