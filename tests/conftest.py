"""Every test runs on 8 virtual CPU devices (set before JAX is imported), or on the GPUs there are."""
import os
import zlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Eight virtual devices' handler threads share the CI machine's two cores: a rank can be off the
# CPU for seconds while its peers wait in a host meeting, longer than the 5 s meant for GPUs. Tests
# of the timeout itself set their own (tests/test_executor_faults.py).
os.environ.setdefault("FICCO_RENDEZVOUS_TIMEOUT_S", "60")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def mesh1d():
    return Mesh(np.array(jax.devices()[:8]), ("tp",))


@pytest.fixture(scope="session")
def mesh2d():
    # Permuted so that device ordinals differ from tp ranks: catches rank/ordinal mix-ups.
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]]
    return Mesh(devices.reshape(2, 4), ("dp", "tp"))


@pytest.fixture
def rng(request):
    """A fresh random stream per test case (seeded from its id, so failures reproduce)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
