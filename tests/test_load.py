"""Load: 160 op sites (80 layers x ag_matmul + matmul_rs) per program, two programs interleaved
(a lax.scan over the layers: 2 call sites run 80 times per launch; and the unrolled loop: 160
distinct call sites), run for a bounded number of steps on 8 CPU devices with the dma executor;
host memory must stay flat after warm-up and the results equal the references.

The full 10,000-step run is `python benchmarks/run.py load` (GPU; 10,000 steps: `-- --steps 10000`).

The fast tier runs the same on 8 layers for a few steps (the program, the call count and the
references, with the memory bound of the whole run); the 80-layer run is in the full tier.

Tolerance: after warm-up the run makes STEPS_AFTER_WARMUP x 2 programs x 160 = 38,400 op calls;
RSS_TOLERANCE_MIB = 16 flags any leak of more than ~440 bytes per op call (16 MiB / 38,400), while
leaving room for allocator noise (measured on CPU: +1.3 MiB over 200 post-warm-up steps).
On jax 0.10.2's CPU client, programs with collectives dispatched ahead deadlock inside XLA itself
(plain lax collectives too), so this test blocks every step (`sync_every=1`); see RELIABILITY.md.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from ficco_jax.runtime import extension as _ext  # noqa: E402

WARMUP, STEPS_AFTER_WARMUP = 80, 120
RSS_TOLERANCE_MIB = 16.0


def _load_test_module():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "suites" / "load.py"
    spec = importlib.util.spec_from_file_location("ficco_load_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("layers, warmup, after", [
    pytest.param(8, 4, 8, id="16-sites"),
    pytest.param(80, WARMUP, STEPS_AFTER_WARMUP, id="160-sites", marks=pytest.mark.slow)])
def test_sites_interleaved_memory_flat(layers, warmup, after):
    load = _load_test_module()
    cfg = load.LoadConfig(steps=warmup + after, layers=layers, comm="dma", rows=8, d_model=64, d_ff=128,
                          dtype="float32", programs=("scan", "unrolled"), interval=min(40, after), warmup=warmup,
                          rss_tolerance_mib=RSS_TOLERANCE_MIB, devices=8,
                          sync_every=1 if jax.default_backend() == "cpu" else 0)
    result = load.run(cfg, log=print)
    assert result["finite"]
    assert result["op_calls"] == cfg.steps * 2 * 2 * layers
    assert result["rss_growth_after_warmup_mib"] < RSS_TOLERANCE_MIB, result["samples"]
    assert all(d < 1e-4 for d in result["reference_diff_end"].values()), result["reference_diff_end"]
    assert result["verdict"] == "PASS"
