"""Equinox models as their users write them: ``eqx.nn.Linear`` layers applied with ``jax.vmap``
inside a shard_map. vmap of a matmul writes its product with the batch dimension last and
transposes it into place before the collective; overlap() rewrites both sides of the MLP anyway,
and the result and gradients equal the program as written (8 CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ficco_jax import explain, overlap

eqx = pytest.importorskip("equinox")

SCHEDULES = ("xla/ring/c2", "dma/direct/c2")
T, D, F, TP = 32, 8, 16, 4  # tokens, model, ffn, tensor-parallel size
RTOL = 1e-5


class MLP(eqx.Module):
    """Megatron MLP per device: column-parallel up (weight [F/tp, D]), row-parallel down ([D, F/tp])."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k_up, k_down = jax.random.split(key)
        self.up = eqx.nn.Linear(D, F, use_bias=False, key=k_up)
        self.down = eqx.nn.Linear(F, D, use_bias=False, key=k_down)

    def __call__(self, x):
        g = jax.lax.all_gather(x, "tp", tiled=True)  # sequence-parallel tokens gathered
        h = jax.nn.gelu(jax.vmap(self.up)(g))
        return jax.lax.psum_scatter(jax.vmap(self.down)(h), "tp", tiled=True)


@pytest.fixture
def mesh(mesh1d):
    return jax.sharding.Mesh(np.asarray(mesh1d.devices)[:TP], ("tp",))


def _sharded_mlp(mesh):
    """(the shard_map of MLP over `mesh`, taking the model and the tokens; the model, the tokens)."""
    model = MLP(jax.random.key(0))
    specs = MLP(jax.random.key(0))
    specs = eqx.tree_at(lambda m: (m.up.weight, m.down.weight), specs, (P("tp", None), P(None, "tp")))
    fn = jax.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(specs, P("tp")), out_specs=P("tp"))
    return fn, model, jax.random.normal(jax.random.key(1), (T, D), jnp.float32)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape and np.abs(w).max() > 0
        assert np.linalg.norm(g - w) <= RTOL * np.linalg.norm(w), np.abs(g - w).max()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_vmapped_linear_mlp_overlaps_both_sides(mesh, schedule):
    fn, model, x = _sharded_mlp(mesh)
    fused = overlap(fn, schedule=schedule)
    report = explain(fused, model, x)
    assert [r.op for r in report.overlapped] == ["ag_matmul", "matmul_rs"], str(report)
    assert not report.near_misses, str(report)
    _assert_close(jax.jit(fused)(model, x), jax.jit(fn)(model, x))
    loss = lambda f: lambda m, x: jnp.sum(jnp.sin(f(m, x)))  # noqa: E731
    grads = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1)))(model, x)  # noqa: E731
    _assert_close(grads(fused), grads(fn))


def test_vmapped_linear_training_step_is_rewritten_in_the_backward_too(mesh):
    """overlap of the gradient function: the backward's collectives are in the traced jaxpr."""
    fn, model, x = _sharded_mlp(mesh)
    step = jax.grad(lambda m, x: jnp.sum(jnp.sin(fn(m, x))), argnums=(0, 1))
    fused = overlap(step, schedule="xla/ring/c2")
    report = explain(fused, model, x)
    assert sorted(r.op for r in report.overlapped) == ["ag_matmul", "ag_matmul", "matmul_rs", "matmul_rs"], str(report)
    _assert_close(jax.jit(fused)(model, x), jax.jit(step)(model, x))
