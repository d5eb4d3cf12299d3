"""Every test runs on 8 virtual CPU devices (set before JAX is imported), or on the GPUs there are.

The suite needs the compiled extension `ficco_jax._ffi` with its CPU executor (the README's install
command builds it): without it, the session stops with an error before any test runs, instead of the
extension's tests skipping. For an install made without the extension on purpose, set
FICCO_TESTS_WITHOUT_EXTENSION=1: its tests then skip, each saying why.
"""
import os
import zlib

#: The virtual CPU devices every CPU test needs; added to XLA_FLAGS that a user set for other reasons.
CPU_DEVICES = 8
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()
# Eight virtual devices' handler threads share the CI machine's two cores: a rank can be off the
# CPU for seconds while its peers wait in a host meeting, longer than the 5 s meant for GPUs. Tests
# of the timeout itself set their own (tests/test_executor_faults.py).
os.environ.setdefault("FICCO_RENDEZVOUS_TIMEOUT_S", "60")
# Several GPU tests run their programs in child processes (tests/gpu): the suite's own process must not
# hold most of each GPU's memory, as JAX's default preallocation (75 %) does, or the children run out
# ("Failed to allocate Scratch 0 for all-reduce" in the mixed step's child after 119 tests in-process).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

#: Set to 1 to run the suite on an install without the compiled extension (its tests skip).
WITHOUT_EXTENSION = "FICCO_TESTS_WITHOUT_EXTENSION"


def extension_problem() -> str | None:
    """None where `ficco_jax._ffi` is built, current and serves every FFI target on CPU; else what is wrong."""
    from ficco_jax.runtime import extension

    try:
        extension.ensure_loaded()
    except ImportError as exc:
        return str(exc)
    from ficco_jax import _ffi

    targets = {name: set(platforms) for name, platforms in _ffi.registrations().items()}
    without_cpu = sorted(name for name, platforms in targets.items() if "cpu" not in platforms)
    if not targets or without_cpu:
        return (f"ficco_jax: the compiled extension lacks the CPU executor the tests run on: FFI targets "
                f"without a 'cpu' handler: {without_cpu or 'no target registered at all'}")
    return None


def pytest_sessionstart(session):
    if jax.default_backend() == "cpu" and jax.device_count() < CPU_DEVICES:
        pytest.exit(f"the CPU tests run on {CPU_DEVICES} virtual devices, and JAX has {jax.device_count()}: XLA_FLAGS="
                    f"{os.environ.get('XLA_FLAGS', '')!r} sets fewer; drop its --xla_force_host_platform_device_count "
                    f"(the suite adds ={CPU_DEVICES} where it is missing)", returncode=pytest.ExitCode.USAGE_ERROR)
    if os.environ.get(WITHOUT_EXTENSION, "") not in ("", "0"):
        return
    problem = extension_problem()
    if problem:
        pytest.exit(f"{problem}\nThe tests need it: install with `pip install -e \".[test]\"` (it builds the "
                    f"extension), or set {WITHOUT_EXTENSION}=1 to run without it (its tests skip).",
                    returncode=pytest.ExitCode.USAGE_ERROR)


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
