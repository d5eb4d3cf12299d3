"""A rank that fails or never arrives makes its peers fail with a timeout naming it: no hang,
and the process stays usable (the next call succeeds)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from ficco_jax import _ext, config, dma  # noqa: E402
from ficco_jax.schedule import Schedule  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")

TIMEOUT_S = 0.5


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(config, "RENDEZVOUS_TIMEOUT_S", TIMEOUT_S)


def _mesh():
    return Mesh(np.array(jax.devices()[:8]), ("tp",))


def _gather_fn(mesh):
    # Traced afresh per call (a new lambda), so the fault switch is read at each trace.
    return jax.jit(jax.shard_map(lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c2/s2"),
                                 mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def _matmul_rs_fn(mesh):
    sched = Schedule.parse("dma/direct/c2/s2")
    return jax.jit(jax.shard_map(lambda a, w: dma.matmul_rs_dma(a, w, "tp", sched),
                                 mesh=mesh, in_specs=(P("tp"), P("tp", None)), out_specs=P("tp")))


@pytest.mark.parametrize("fault", ["skip:2", "fail:2"])
def test_missing_rank_times_out_then_recovers(fault, short_timeout, monkeypatch):
    mesh = _mesh()
    x = jnp.arange(8 * 16 * 3, dtype=jnp.float32).reshape(8 * 16, 3)
    monkeypatch.setattr(config, "FAULT_INJECTION", fault)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"missing ranks \[2\]|injected fault .* on rank 2") as info:
        np.asarray(_gather_fn(mesh)(x))
    assert time.monotonic() - start < 10 * TIMEOUT_S + 5, "the failure took far longer than the timeout"

    monkeypatch.setattr(config, "FAULT_INJECTION", "")
    out = np.asarray(_gather_fn(mesh)(x))
    np.testing.assert_array_equal(out, np.tile(np.asarray(x), (8, 1)))


def test_peers_report_the_missing_rank(short_timeout, monkeypatch):
    """Every waiting rank's error names the missing rank and the phase (checked on matmul_rs)."""
    mesh = _mesh()
    y = jnp.ones((8 * 16, 4), jnp.float32)
    w = jnp.ones((8 * 4, 2), jnp.float32)
    monkeypatch.setattr(config, "FAULT_INJECTION", "fail:5")
    with pytest.raises(Exception, match=r"missing ranks \[5\]|on rank 5") as info:
        np.asarray(_matmul_rs_fn(mesh)(y, w))
    message = str(info.value)
    assert "phase done" in message or "injected fault 'fail' on rank 5" in message
    monkeypatch.setattr(config, "FAULT_INJECTION", "")
    out = np.asarray(_matmul_rs_fn(mesh)(y, w))
    np.testing.assert_allclose(out, np.full((16, 2), 4.0 * 8), rtol=0)


def test_bad_fault_spec_is_rejected(monkeypatch):
    monkeypatch.setattr(config, "FAULT_INJECTION", "explode:1")
    with pytest.raises(ValueError, match="skip:<rank>"):
        _gather_fn(_mesh())(jnp.zeros((8 * 4, 2), jnp.float32))
