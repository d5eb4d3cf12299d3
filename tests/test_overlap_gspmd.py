"""overlap(fn) on Auto-mesh (GSPMD) code: every matmul of its global code becomes
ficco_jax.dot_general, whose partitions run the op the partitioner's shardings imply; explain()
lists them. The result and gradients equal the program as written."""
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ficco_jax

from helpers import TOLERANCE, random, rel_err

SCHEDULES = ("xla/ring/c2", "dma/direct/c2")


@pytest.fixture(scope="module")
def mesh():
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]]
    return Mesh(devices.reshape(2, 4), ("data", "model"))  # Auto axes, as Mesh makes them


def _mlp(mesh):
    """A sequence-parallel MLP as GSPMD code writes it: shardings at the jit and one constraint."""
    def mlp(x, w_up, w_down):
        h = jnp.einsum("bsd,df->bsf", x, w_up)
        h = lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None, "model")))
        return jnp.einsum("bsf,fd->bsd", jax.nn.gelu(h), w_down)

    shardings = tuple(NamedSharding(mesh, s) for s in (P("data", "model", None), P(None, "model"), P("model", None)))
    return mlp, shardings


def _arguments(mesh, rng, shardings):
    shapes = ((4, 16, 32), (32, 64), (64, 32))
    return [jax.device_put(random(rng, shape, jnp.float32), s) for shape, s in zip(shapes, shardings)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_jitted_program_with_shardings(mesh, rng, schedule):
    mlp, shardings = _mlp(mesh)
    step = jax.jit(mlp, in_shardings=shardings, out_shardings=shardings[0])
    args = _arguments(mesh, rng, shardings)
    fused = ficco_jax.overlap(step, schedule=schedule)
    report = ficco_jax.explain(fused, *args)
    assert [r.op for r in report.sites] == ["dot_general", "dot_general"] and not report.near_misses, str(report)
    assert rel_err(fused(*args), step(*args)) < TOLERANCE["float32"]

    def loss(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))

    for got, want in zip(loss(fused)(*args), loss(step)(*args)):
        assert rel_err(got, want) < TOLERANCE["float32"]
    compiled = jax.jit(fused).lower(*args).compile().as_text()
    targets = collections.Counter(re.findall(r'custom_call_target="(ficco_\w+)"', compiled))
    if schedule.startswith("dma"):
        assert targets == collections.Counter({"ficco_ag_matmul": 1, "ficco_matmul_rs": 1})
    else:
        assert not targets and not re.search(r"\s(all-gather|reduce-scatter|all-reduce)(-start)?\(", compiled)


def test_explain_under_set_mesh(mesh, rng):
    """Under jax.set_mesh the types name the Auto mesh; the sites are the same."""
    mlp, shardings = _mlp(mesh)
    args = _arguments(mesh, rng, shardings)
    with jax.set_mesh(mesh):
        report = ficco_jax.explain(ficco_jax.overlap(mlp, schedule="xla/ring/c2"), *args)
    assert len(report.sites) == 2 and all(r.axis_name == "data,model" for r in report.sites), str(report)
    assert all("per partition" in r.schedule for r in report.sites)


def test_ops_left_out(mesh, rng):
    """overlap(ops=...) without every op a partition may lower to leaves the matmuls as written."""
    mlp, shardings = _mlp(mesh)
    args = _arguments(mesh, rng, shardings)
    report = ficco_jax.explain(ficco_jax.overlap(mlp, ops=("ag_matmul",)), *args)
    assert not report.sites and len(report.near_misses) == 2
    assert all("matmul_rs, matmul_psum, not in ops=" in r.reason for r in report.near_misses), str(report)


def test_one_device_mesh_is_left_alone(rng):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    mlp, shardings = _mlp(mesh)
    report = ficco_jax.explain(ficco_jax.overlap(mlp), *_arguments(mesh, rng, shardings))
    assert not report.sites


def test_code_with_shard_maps_keeps_its_global_matmuls(mesh, rng):
    """A program that writes a shard_map has chosen its parallel layers: its global matmul (a head)
    stays as written, the shard_map's sites are rewritten."""
    specs = (P("model"), P(None, "model"), P())
    x, w, head = (jax.device_put(random(rng, shape, jnp.float32), NamedSharding(mesh, spec))
                  for shape, spec in zip(((64, 32), (32, 64), (64, 16)), specs))

    def model(x, w, head):
        def block(x, w):
            return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w

        h = jax.shard_map(block, mesh=mesh, in_specs=(P("model"), P(None, "model")), out_specs=P(None, "model"))(x, w)
        return jnp.tanh(h) @ head

    report = ficco_jax.explain(ficco_jax.overlap(model, schedule="xla/ring/c2"), x, w, head)
    assert [r.op for r in report.sites] == ["ag_matmul"], str(report)
