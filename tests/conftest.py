"""Every test runs on 8 virtual CPU devices (set before JAX is imported), or on the GPUs there are.

Two tiers. `python -m pytest tests` runs the fast one (minutes on two cores): every module, with
  * of each test marked `sweep` (a parametrized sweep: every schedule, dtype, mesh...), the cases
    that together name every part of its ids once (`sweep_cover`: each op, dtype, mesh, chunk count,
    order, transfer... at least once); of one marked `sweep(first=k)`, its first k cases (a program
    started in a child process with one argument after another: one start is enough there);
  * no test marked `slow`: more starts of a program that another test already starts in a child
    process (the benchmark suites, peers and checks count as starts of benchmarks/run.py, whose
    trace suite stays), long fits and loads;
  * at most FAST_EXAMPLES examples per Hypothesis test (the "fast" settings profile; every
    Hypothesis test names its count through helpers.examples, and carries the `hypothesis` mark).
`--tier=full` runs everything, each Hypothesis test with its own example count; `--tier=rest` runs
what the fast tier leaves out, and the Hypothesis tests again with their own counts: CI runs the
fast tier, then the rest (.ci/run). A test named on the command line by its id runs in any tier.

The suite needs the compiled extension `ficco_jax._ffi` with its CPU executor (the README's install
command builds it): without it, the session stops with an error before any test runs, instead of the
extension's tests skipping. For an install made without the extension on purpose, set
FICCO_TESTS_WITHOUT_EXTENSION=1: its tests then skip, each saying why.
"""
import os
import re
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
from hypothesis import settings  # noqa: E402
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


#: The Hypothesis examples a test runs at most in the fast tier; the full tier runs each test's own count.
FAST_EXAMPLES = 2
settings.register_profile("fast", max_examples=FAST_EXAMPLES)
settings.register_profile("full", max_examples=10_000)  # no cap: each test names its count (helpers.examples)
TIERS = ("fast", "rest", "full")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, default="fast",
                     help="fast (default): every module, a covering subset of each sweep, no slow test, few "
                          "Hypothesis examples; full: every test; rest: what full adds to fast")


def pytest_configure(config):
    settings.load_profile("fast" if config.getoption("--tier") == "fast" else "full")


def sweep_cover(ids: list[str]) -> list[bool]:
    """Which of a sweep's case ids the fast tier runs: few cases that together name every part of the
    ids, the parts being an id's words between '-' and '/' ("ag_matmul-tp4-dma/ring/c2/push-bfloat16":
    ag_matmul, tp4, dma, ring, c2, push, bfloat16). Greedy: the case naming the most parts not yet
    named, the first such in collection order, until every part is named; so the cases taken mix
    the values (an op with another op's schedule), and the choice is the same on every run."""
    parts = [set(re.split(r"[-/]", case_id)) - {""} for case_id in ids]
    named, taken = set(), [False] * len(ids)
    while True:
        gains = [0 if took else len(p - named) for p, took in zip(parts, taken)]
        best = max(range(len(ids)), key=lambda i: (gains[i], -i))
        if gains[best] == 0:
            return taken
        taken[best], named = True, named | parts[best]


def _in_fast_tier(items) -> list[bool]:
    cases = {}  # a sweep's cases by its test function
    for index, item in enumerate(items):
        if item.get_closest_marker("sweep") and hasattr(item, "callspec"):
            cases.setdefault((item.module.__name__, item.originalname), []).append(index)
    fast = [item.get_closest_marker("slow") is None for item in items]
    for indices in cases.values():
        first = items[indices[0]].get_closest_marker("sweep").kwargs.get("first")
        chosen = ([i < first for i in range(len(indices))] if first is not None
                  else sweep_cover([items[i].callspec.id for i in indices]))
        for index, taken in zip(indices, chosen):
            fast[index] = fast[index] and taken
    return fast


@pytest.hookimpl(trylast=True)  # after Hypothesis's plugin has marked its tests
def pytest_collection_modifyitems(config, items):
    tier = config.getoption("--tier")
    if tier == "full":
        return
    named = {arg for arg in config.args if "::" in arg}
    if tier == "fast":
        chosen = [in_fast or item.nodeid in named or item.nodeid.partition("[")[0] in named
                  for item, in_fast in zip(items, _in_fast_tier(items))]
    else:
        chosen = [not in_fast or item.get_closest_marker("hypothesis") is not None
                  for item, in_fast in zip(items, _in_fast_tier(items))]
    left = [item for item, take in zip(items, chosen) if not take]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item, take in zip(items, chosen) if take]


def pytest_report_header(config):
    tier = config.getoption("--tier")
    return {"fast": "tier: fast (the whole suite: --tier=full)", "rest": "tier: rest (what the fast tier leaves out)",
            "full": "tier: full"}[tier]


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
