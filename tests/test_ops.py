"""ag_matmul / matmul_rs / matmul_psum: every none/xla schedule against the plain-JAX reference, with
gradients.

(`comm="dma"` schedules run the extension's executor and are covered by test_dma.py.)
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ficco_jax
from ficco_jax import Schedule
from ficco_jax.ops import table
from helpers import (TOLERANCE, ag_specs, global_shapes, lowered_text, operands_and_reference, prefer_copy_engines,
                     psum_specs, random, rel_err, rs_specs, run_sharded)

OPS = {
    "ag_matmul": (ficco_jax.ag_matmul, ficco_jax.ag_matmul_ref, ag_specs),
    "matmul_rs": (ficco_jax.matmul_rs, ficco_jax.matmul_rs_ref, rs_specs),
    "matmul_psum": (ficco_jax.matmul_psum, ficco_jax.matmul_psum_ref, psum_specs),
}
#: Each op's reference as a function of its operands: one object per op, which
#: helpers.operands_and_reference computes once per mesh and dtype.
REFERENCES = {op: functools.partial(lambda ref, a, w: ref(a, w, "tp"), ref) for op, (_, ref, _) in OPS.items()}
#: The executor's calls an op's copy-engine schedule makes, where they are not one of its own name.
TARGETS = {"matmul_psum": ("matmul_rs", "all_gather")}
# Rows per device chosen so every enumerated chunk count divides them.
M_ROWS, K, N_COLS = 16, 24, 8


def _cases():
    for op in OPS:
        for tp in (8, 4):  # 1-D mesh of 8; tp axis of the (2, 4) mesh
            for sched in Schedule.enumerate(op, tp, comms=("none", "xla")):
                yield pytest.param(op, tp, sched, id=f"{op}-tp{tp}-{sched}")


def _mesh(request, tp):
    return request.getfixturevalue("mesh1d" if tp == 8 else "mesh2d")


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op,tp,sched", list(_cases()))
def test_schedule_matches_reference(request, op, tp, sched, dtype):
    mesh = _mesh(request, tp)
    fn, _, specs = OPS[op]
    # The reference in float32 from the same (rounded) inputs: bf16 results must be within
    # bf16 rounding of it, f32 results within f32 rounding.
    (a, w), want = operands_and_reference(mesh, REFERENCES[op], specs(mesh),
                                          global_shapes(op, mesh, M_ROWS, K, N_COLS), dtype)
    got = run_sharded(mesh, lambda a, w: fn(a, w, "tp", schedule=sched), specs(mesh), a, w)
    assert got.dtype == jnp.dtype(dtype)
    assert rel_err(got, want) < TOLERANCE[dtype]


@pytest.mark.sweep
@pytest.mark.parametrize("op,tp,sched", [c for c in _cases() if c.values[1] == 4])
def test_gradients_match_reference(request, rng, op, tp, sched):
    mesh = _mesh(request, tp)
    fn, ref, specs = OPS[op]
    a_shape, w_shape = global_shapes(op, mesh, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, "float32"), random(rng, w_shape, "float32")
    out_shape = jax.eval_shape(lambda a, w: run_sharded(mesh, lambda a, w: ref(a, w, "tp"), specs(mesh), a, w), a, w)
    cot = random(rng, out_shape.shape, "float32")

    def loss(body, a, w):
        return jnp.sum(run_sharded(mesh, body, specs(mesh), a, w) * cot)

    got = jax.grad(functools.partial(loss, lambda a, w: fn(a, w, "tp", schedule=sched)), argnums=(0, 1))(a, w)
    want = jax.grad(functools.partial(loss, lambda a, w: ref(a, w, "tp")), argnums=(0, 1))(a, w)
    for g, r in zip(got, want):
        assert rel_err(g, r) < TOLERANCE["float32"]


def test_ag_matmul_returns_gathered_and_its_gradient(mesh2d, rng):
    a_shape, w_shape = global_shapes("ag_matmul", mesh2d, M_ROWS, K, N_COLS)
    x, w = random(rng, a_shape, "float32"), random(rng, w_shape, "float32")
    sched = Schedule(comm="xla", order="bidirectional", chunks=2)
    in_specs, out_spec = ag_specs(mesh2d)
    gathered_spec = jax.sharding.PartitionSpec(("dp", "tp"), None)  # all_gather output is typed varying

    def both(x, w):
        out, g = ficco_jax.ag_matmul(x, w, "tp", schedule=sched, return_gathered=True)
        return out, g

    def ref_both(x, w):
        g = jax.lax.all_gather(x, "tp", axis=0, tiled=True)
        return g @ w, g

    specs = (in_specs, (out_spec, gathered_spec))
    got, want = run_sharded(mesh2d, both, specs, x, w), run_sharded(mesh2d, ref_both, specs, x, w)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # a gather is exact
    assert rel_err(got[0], want[0]) < TOLERANCE["float32"]

    def loss(body, x, w):  # the gathered tensor has a second user: its cotangent must flow back
        out, g = run_sharded(mesh2d, body, specs, x, w)
        return jnp.sum(out ** 2) + jnp.sum(jnp.sin(g))

    got_g = jax.grad(functools.partial(loss, both), argnums=(0, 1))(x, w)
    want_g = jax.grad(functools.partial(loss, ref_both), argnums=(0, 1))(x, w)
    for g, r in zip(got_g, want_g):
        assert rel_err(g, r) < TOLERANCE["float32"]


@pytest.mark.parametrize("op", list(OPS))
def test_auto_schedule_matches_reference(monkeypatch, mesh1d, rng, op):
    """'auto' deciding as on a GPU, with a model that takes copy engines (on CPU the real model
    keeps these small shapes plain, which test_schedule_matches_reference covers as 'none')."""
    asked = prefer_copy_engines(monkeypatch)
    fn, ref, specs = OPS[op]
    a_shape, w_shape = global_shapes(op, mesh1d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, "float32"), random(rng, w_shape, "float32")
    text = lowered_text(mesh1d, lambda a, w: fn(a, w, "tp"), specs(mesh1d), a, w)
    assert asked and asked[-1][0] == op
    if ficco_jax.dma.available():  # the stand-in took copy engines: the executor's calls are in the program
        assert all(f"ficco_{target}" in text for target in TARGETS.get(op, (op,)))
    got = run_sharded(mesh1d, lambda a, w: fn(a, w, "tp"), specs(mesh1d), a, w)
    want = run_sharded(mesh1d, lambda a, w: ref(a, w, "tp"), specs(mesh1d), a, w)
    assert rel_err(got, want) < TOLERANCE["float32"]


@pytest.mark.parametrize("op", list(OPS))
def test_forward_traces_its_lowering_once(monkeypatch, mesh2d, rng, op):
    """A forward call traces its schedule's steps once, when it is lowered: the op's equation takes
    its results' abstract values from the op's shapes, not from a trace of the steps."""
    pair = table.ALL_REDUCE.pair if op == table.ALL_REDUCE.name else table.PAIRS[op]
    lowering = "gather_xla" if op == pair.gather else "scatter_xla"  # matmul_psum: its reduce-scatter
    traced = []

    def counted(*args, **kwargs):
        traced.append(op)
        return getattr(type(pair), lowering)(pair, *args, **kwargs)

    monkeypatch.setattr(pair, lowering, counted)
    fn, ref, specs = OPS[op]
    a_shape, w_shape = global_shapes(op, mesh2d, M_ROWS, K, N_COLS)
    a, w = random(rng, a_shape, "float32"), random(rng, w_shape, "float32")
    body = lambda a, w: fn(a, w, "tp", schedule="xla/ring/c2")  # noqa: E731
    got = run_sharded(mesh2d, body, specs(mesh2d), a, w)
    assert traced == [op]
    assert rel_err(got, run_sharded(mesh2d, lambda a, w: ref(a, w, "tp"), specs(mesh2d), a, w)) < TOLERANCE["float32"]


# ------------------------------------------------------------------------------------------------
# Shapes a schedule cannot split, and other bad input: clear errors at trace time
# ------------------------------------------------------------------------------------------------
def test_unsplittable_rows_name_shape_and_valid_chunks(mesh1d, rng):
    x = random(rng, (8 * 6, K), "float32")  # 6 rows per device: chunks=4 cannot split them
    w = random(rng, (K, 8 * N_COLS), "float32")
    sched = Schedule(comm="xla", chunks=4)
    with pytest.raises(ValueError, match=r"rows per device = 6.*\(6, 24\).*chunks=4.*valid chunk counts.*\[1, 2, 3, 6\]"):
        run_sharded(mesh1d, lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=sched), ag_specs(mesh1d), x, w)


def test_matmul_rs_rows_not_divisible_by_axis(mesh1d, rng):
    y = random(rng, (12, 8 * N_COLS), "float32")  # 12 rows cannot scatter over 8 devices
    w = random(rng, (8 * N_COLS, K), "float32")
    specs = ((jax.sharding.PartitionSpec(None, "tp"), jax.sharding.PartitionSpec("tp", None)),
             jax.sharding.PartitionSpec(None, None))
    with pytest.raises(ValueError, match=r"y.shape\[0\]=12 rows must divide by the axis size 8"):
        run_sharded(mesh1d, lambda y, w: ficco_jax.matmul_rs(y, w, "tp", schedule="xla/ring/c1"), specs, y, w)


@pytest.mark.parametrize("bad,match,exc", [
    (dict(w_dtype="bfloat16"), "same dtype", TypeError),
    (dict(k_w=K + 1), "contraction sizes differ", ValueError),
    (dict(axis="nope"), "nope", (ValueError, NameError)),
    (dict(schedule=3), "schedule must be", TypeError),
    (dict(schedule="xla/sideways/c2"), "order", ValueError),
])
def test_bad_input_is_a_clear_error(mesh1d, rng, bad, match, exc):
    x = random(rng, (8 * M_ROWS, K), "float32")
    w = random(rng, (bad.get("k_w", K), 8 * N_COLS), bad.get("w_dtype", "float32"))
    body = lambda x, w: ficco_jax.ag_matmul(x, w, bad.get("axis", "tp"), schedule=bad.get("schedule", "auto"))
    with pytest.raises(exc, match=match):
        run_sharded(mesh1d, body, ag_specs(mesh1d), x, w)


@pytest.mark.parametrize("op", ["matmul_rs", "matmul_psum"])
@pytest.mark.parametrize("sched", ["xla/direct/c1", "xla/direct/c2", "xla/ring/c2"])
def test_float64_partials_are_summed_in_float64(mesh1d, op, sched):
    """Under x64 a reduce-scatter of f64 partials keeps f64's precision on every order (the direct
    order sums in f32 at least, never narrower than the partials)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        y, w = (jnp.asarray(rng.standard_normal(shape)) for shape in ((16, 8 * K), (8 * K, 16)))
        specs = rs_specs(mesh1d) if op == "matmul_rs" else psum_specs(mesh1d)
        fn = getattr(ficco_jax, op)
        got = run_sharded(mesh1d, lambda y, w: fn(y, w, "tp", schedule=sched), specs, y, w)
        exact = np.asarray(y) @ np.asarray(w)
        assert got.dtype == jnp.float64
        assert np.abs(np.asarray(got) - exact).max() < 1e-12 * np.abs(exact).max()


@pytest.mark.parametrize("sched", ["xla/ring/c2", "xla/bidirectional/c2", "none"])
def test_grad_without_jit_and_with_x64(mesh1d, rng, sched):
    """Users differentiate un-jitted shard_maps and enable x64; neither may break the ops."""
    x, w = random(rng, (8 * M_ROWS, K), "float32"), random(rng, (K, 8 * N_COLS), "float32")
    in_specs, out_spec = ag_specs(mesh1d)

    def loss(body, x, w):
        return jnp.sum(jax.shard_map(body, mesh=mesh1d, in_specs=in_specs, out_specs=out_spec)(x, w) ** 2)

    got_fn = functools.partial(loss, lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=sched))
    want_fn = functools.partial(loss, lambda x, w: ficco_jax.ag_matmul_ref(x, w, "tp"))
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        got, want = jax.grad(got_fn, argnums=(0, 1))(x, w), jax.grad(want_fn, argnums=(0, 1))(x, w)
    finally:
        jax.config.update("jax_enable_x64", previous)
    for g, r in zip(got, want):
        assert rel_err(g, r) < TOLERANCE["float32"]
