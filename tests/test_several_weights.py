"""One gathered tensor read by several matmuls (q/k/v, gate/up written separately) is one
ag_matmul site: the op of several weights (`ag_matmul(x, [w1, w2, w3], axis)`), forward and
backward equal to the program as written, in shard_map bodies and global-view code (8 CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

import ficco_jax
from ficco_jax import explain, overlap

SCHEDULES = ("xla/ring/c2", "dma/direct/c2")
B, S, D, H, DH, F = 2, 16, 8, 4, 2, 12  # batch, sequence, model, heads, head dim, ffn
RTOL = 1e-5


@pytest.fixture
def mesh(mesh1d):
    return jax.sharding.Mesh(np.asarray(mesh1d.devices)[:4], ("tp",))


def _random(seed, *shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape and np.abs(w).max() > 0
        assert np.linalg.norm(g - w) <= RTOL * np.linalg.norm(w), np.abs(g - w).max()


def _grads(fn, n):
    loss = lambda *a: sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(fn(*a)))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=tuple(range(n))))


# --------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_op_takes_a_list_of_weights(mesh, schedule):
    x, w1, w2, w3 = _random(0, (S, D), (D, 3), (D, 5), (D, 2))
    specs = (P("tp"), P(None, "tp"), P(None, "tp"), P(None, "tp"))

    def run(op):
        return jax.shard_map(lambda x, *ws: tuple(op(x, list(ws), "tp")), mesh=mesh, in_specs=specs,
                             out_specs=(P(None, "tp"),) * 3)

    x, w1, w2, w3 = x, *(jnp.tile(w, (1, 4)) for w in (w1, w2, w3))  # N_i per device: 3, 5, 2
    op = run(lambda x, ws, axis: ficco_jax.ag_matmul(x, ws, axis, schedule=schedule))
    ref = run(ficco_jax.ag_matmul_ref)
    _assert_close(jax.jit(op)(x, w1, w2, w3), jax.jit(ref)(x, w1, w2, w3))
    _assert_close(_grads(op, 4)(x, w1, w2, w3), _grads(ref, 4)(x, w1, w2, w3))


def test_op_refuses_weights_that_do_not_fit_side_by_side(mesh):
    x, w1, w2 = _random(0, (S, D), (D, 4), (D + 4, 4))
    body = lambda x, a, b: tuple(ficco_jax.ag_matmul(x, [a, b], "tp"))  # noqa: E731
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(),) * 2, check_vma=False)
    with pytest.raises(ValueError, match=r"every weight of the list must be \[K, N_i\] of one K and dtype"):
        fn(x, w1, w2)


# --------------------------------------------------------------------------------------------
# The rewrite: shard_map bodies
# --------------------------------------------------------------------------------------------
def attention_qkv(x, wq, wk, wv):
    """Sequence-parallel q/k/v projections, each its own matmul of the gathered sequence."""
    g = jax.lax.all_gather(x, "tp", axis=1, tiled=True)
    q, k, v = (jnp.einsum("bsd,dhk->bshk", g, w) for w in (wq, wk, wv))
    return jnp.einsum("bqhk,bshk->bhqs", q, k), v


def swiglu(x, w_gate, w_up, w_down):
    """Sequence-parallel SwiGLU MLP: gate and up read one gathered x; down reduce-scatters."""
    g = jax.lax.all_gather(x, "tp", axis=1, tiled=True)
    h = jax.nn.silu(jnp.einsum("bsd,df->bsf", g, w_gate)) * jnp.einsum("bsd,df->bsf", g, w_up)
    return jax.lax.psum_scatter(jnp.einsum("bsf,fd->bsd", h, w_down), "tp", scatter_dimension=1, tiled=True)


BODIES = {
    "qkv": (attention_qkv, (P(None, "tp"), *[P(None, "tp")] * 3), (P(None, "tp"), P(None, None, "tp")),
            lambda: _random(1, (B, S, D), *[(D, H, DH)] * 3), 3),
    "swiglu": (swiglu, (P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp")), P(None, "tp"),
               lambda: _random(2, (B, S, D), (D, F), (D, F), (F, D)), 2),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("body", BODIES)
def test_shard_map_matmuls_of_one_gather_are_one_site(mesh, body, schedule):
    fn, in_specs, out_specs, make_args, weights = BODIES[body]
    block = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    args = make_args()
    fused = overlap(block, schedule=schedule)
    report = explain(fused, *args)
    [ag] = [r for r in report.sites if r.op == "ag_matmul"]
    assert ag.overlapped and f"{weights} weights" in ag.shapes and "also used by" not in ag.shapes, str(report)
    assert not [r for r in report.near_misses if r.op == "ag_matmul"], str(report)
    _assert_close(jax.jit(fused)(*args), jax.jit(block)(*args))
    _assert_close(_grads(fused, len(args))(*args), _grads(block, len(args))(*args))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("body", BODIES)
def test_backward_sum_of_input_gradients_is_one_site(mesh, body, schedule):
    """overlap of the gradient function: JAX's backward sums the matmuls' input gradients, then
    reduce-scatters; that is one matmul_rs of their operands side by side."""
    fn, in_specs, out_specs, make_args, weights = BODIES[body]
    block = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    args = make_args()
    loss = lambda *a: sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(block(*a)))  # noqa: E731
    step = jax.value_and_grad(loss, argnums=tuple(range(len(args))))
    fused = overlap(step, schedule=schedule)
    report = explain(fused, *args)
    summed = [r for r in report.overlapped if r.op == "matmul_rs" and r.shapes.startswith(f"{weights} matmuls summed")]
    assert len(summed) == 1 and not [r for r in report.near_misses if r.op == "matmul_rs"], str(report)
    _assert_close(jax.jit(fused)(*args), jax.jit(step)(*args))


def test_matmul_of_another_form_reads_the_gathered_tensor_the_op_returns(mesh):
    def body(x, w1, w2, w3t):
        g = jax.lax.all_gather(x, "tp", tiled=True)
        return g @ w1, g @ w2, w3t @ g.T  # the third reads g as its rhs: another form

    block = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P(None, "tp"), P("tp")),
                          out_specs=(P(None, "tp"), P(None, "tp"), P("tp")))
    args = _random(3, (S, D), (D, 8), (D, 8), (8, D))
    fused = overlap(block, schedule="xla/ring/c2")
    [site] = explain(fused, *args).sites
    assert "2 weights" in site.shapes and "also used by 1 more" in site.shapes, site.shapes
    _assert_close(jax.jit(fused)(*args), jax.jit(block)(*args))


# --------------------------------------------------------------------------------------------
# The rewrite: global view (explicit shardings)
# --------------------------------------------------------------------------------------------
def test_global_view_matmuls_of_one_reshard_are_one_site():
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])

    def projections(x, wq, wk, wv):
        g = reshard(x, P(None, None, None))
        q, k, v = (jnp.einsum("bsd,dhk->bshk", g, w) for w in (wq, wk, wv))
        return jnp.einsum("bqhk,bshk->bhqs", q, k, out_sharding=P(None, "tp", None, None)), v

    with jax.set_mesh(mesh):
        x, wq, wk, wv = _random(4, (B, S, D), *[(D, H, DH)] * 3)
        args = [jax.device_put(x, NamedSharding(mesh, P(None, "tp", None)))]
        args += [jax.device_put(w, NamedSharding(mesh, P(None, "tp", None))) for w in (wq, wk, wv)]
        for schedule in SCHEDULES:
            fused = overlap(projections, schedule=schedule)
            [site] = explain(fused, *args).sites
            assert site.overlapped and "3 weights" in site.shapes, site.shapes
            got, want = jax.jit(fused)(*args), jax.jit(projections)(*args)
            assert [jax.typeof(v) for v in got] == [jax.typeof(v) for v in want]
            _assert_close(got, want)
            _assert_close(_grads(fused, 4)(*args), _grads(projections, 4)(*args))
