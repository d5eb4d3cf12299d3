"""The contention probe of `characterize` (xla_ffi/probe.cc) on 8 CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ficco_jax import dma_probe
from helpers import random, rel_err


@pytest.mark.parametrize("pull", [False, True])
def test_probe_computes_the_matmul_with_or_without_pulls(mesh2d, rng, pull):
    specs = (P(("dp", "tp"), None), P(), P(("dp", "tp"), None))  # w replicated: out rows follow a
    a, w, x = random(rng, (8 * 16, 24), "float32"), random(rng, (24, 8), "float32"), random(rng, (8 * 4, 6), "float32")
    args = [jax.device_put(v, NamedSharding(mesh2d, s)) for v, s in zip((a, w, x), specs)]
    body = lambda a, w, x: dma_probe.matmuls_beside_pulls(a, w, x, "tp", repeats=3, pull=pull)
    got = jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=specs, out_specs=P(("dp", "tp"), None)))(*args)
    want = jax.jit(jax.shard_map(lambda a, w, x: a @ w, mesh=mesh2d, in_specs=specs,
                                 out_specs=P(("dp", "tp"), None)))(*args)
    assert rel_err(got, want) < 1e-5


def test_probe_rejects_bad_repeats(mesh1d):
    a = jnp.ones((8 * 4, 4), jnp.float32)
    body = lambda a: dma_probe.matmuls_beside_pulls(a, a[:4], a, "tp", repeats=0, pull=True)
    with pytest.raises(ValueError, match="repeats an int >= 1"):
        jax.jit(jax.shard_map(body, mesh=mesh1d, in_specs=P("tp"), out_specs=P("tp")))(a)
