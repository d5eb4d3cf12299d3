"""`ficco_jax.dma.*(..., schedule="auto")`: copy engines only where they beat XLA's collective."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ficco_jax import config, dma
from ficco_jax.lowering.dma import collectives
from ficco_jax.runtime import extension
from helpers import random, rel_err

CASES = {
    "all_gather": (lambda x, s: dma.all_gather(x, "tp", schedule=s), lambda x: jax.lax.all_gather(x, "tp", tiled=True)),
    "reduce_scatter": (lambda x, s: dma.reduce_scatter(x, "tp", schedule=s),
                       lambda x: jax.lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True)),
    "all_to_all": (lambda x, s: dma.all_to_all(x, "tp", 0, 1, schedule=s),
                   lambda x: jax.lax.all_to_all(x, "tp", 0, 1, tiled=True)),
}


def _jit(mesh, body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))


@pytest.mark.parametrize("op", sorted(CASES))
def test_auto_on_cpu_is_xlas_collective_and_equals_it(mesh1d, rng, op):
    ours, ref = CASES[op]
    x = jax.device_put(random(rng, (8 * 16, 24), np.float32), NamedSharding(mesh1d, P("tp", None)))
    got = _jit(mesh1d, lambda v: ours(v, "auto"))
    assert rel_err(got(x), _jit(mesh1d, ref)(x)) < 1e-6
    # On CPU XLA's collective is the faster one: no copy-engine custom call in the program.
    assert "ficco_" not in got.lower(x).as_text()


@pytest.mark.skipif(not extension.available(), reason="needs the compiled extension")
def test_explicit_none_still_means_copy_engines(mesh1d, rng):
    x = jax.device_put(random(rng, (8 * 16, 24), np.float32), NamedSharding(mesh1d, P("tp", None)))
    assert "ficco_all_gather" in _jit(mesh1d, lambda v: dma.all_gather(v, "tp")).lower(x).as_text()


@pytest.mark.parametrize("platform,cuda,nbytes,expected", [
    ("cpu", True, 1 << 30, False),                                      # no copy engines on a CPU
    ("gpu", False, 1 << 30, False),                                     # no CUDA build
    ("gpu", True, config.DMA_COLLECTIVE_MIN_BYTES - 1, False),          # small blocks: NCCL is faster
    ("gpu", True, config.DMA_COLLECTIVE_MIN_BYTES, True),
])
def test_copy_engines_pay_only_for_large_blocks_on_a_cuda_build(monkeypatch, platform, cuda, nbytes, expected):
    monkeypatch.setattr(extension, "cuda_built", lambda: cuda)
    assert collectives.copy_engines_pay(nbytes, "tp", platform=platform) is expected


def test_auto_rejects_nothing_a_schedule_string_would_not(mesh1d, rng):
    x = jax.device_put(random(rng, (8 * 16, 24), np.float32), NamedSharding(mesh1d, P("tp", None)))
    with pytest.raises(ValueError, match="cannot parse schedule"):
        _jit(mesh1d, lambda v: dma.all_gather(v, "tp", schedule="fast"))(x)


def test_a_dtype_copy_engines_cannot_sum_is_refused_with_a_hint_that_works(mesh1d, monkeypatch):
    """int8 dma.reduce_scatter: the error names what this function takes (not comm='xla', which it
    refuses), and schedule='auto' runs XLA's psum_scatter for it, even where copy engines would pay."""
    x = jax.device_put(np.arange(8 * 16 * 4, dtype=np.int8).reshape(8 * 16, 4), NamedSharding(mesh1d, P("tp", None)))
    with pytest.raises(TypeError) as refused:
        _jit(mesh1d, lambda v: dma.reduce_scatter(v, "tp"))(x)
    hint = str(refused.value)
    assert "found int8" in hint and "comm='xla'" not in hint and "schedule='auto'" in hint, hint
    with pytest.raises(ValueError, match="runs comm='dma' schedules only"):  # what the old hint said to do
        _jit(mesh1d, lambda v: dma.reduce_scatter(v, "tp", schedule="xla/ring/c1"))(x.astype(np.float32))
    monkeypatch.setattr(collectives, "copy_engines_pay", lambda *a, **k: True)
    auto = _jit(mesh1d, lambda v: dma.reduce_scatter(v, "tp", schedule="auto"))
    want = _jit(mesh1d, lambda v: jax.lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True))(x)
    assert np.array_equal(auto(x), want) and "ficco_" not in auto.lower(x).as_text()
