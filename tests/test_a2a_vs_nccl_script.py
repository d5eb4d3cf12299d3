"""benchmarks/peers/collectives_vs_nccl.py on 4 virtual CPU devices with tiny blocks, in a subprocess: the script
the GPU run uses cannot rot. Every variant must verify bit-exact and be timed, the JSON must hold
what the summary reads, and the all_to_all table must come last. (CPU times mean nothing.)"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from ficco_jax.runtime import extension as _ext

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "collectives_vs_nccl.py"


@pytest.mark.slow
@pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")
def test_a2a_vs_nccl_script_on_cpu(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(SCRIPT), "--sizes", "0.015625,0.0625", "--overlap-sizes", "0.0625",
           "--matmul", "32,64,48", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads((tmp_path / "a2a_vs_nccl.json").read_text())
    assert result["n_devices"] == 4 and not result["times_meaningful"] and "NOT meaningful" in result["method"]
    assert result["skipped"] == []

    a2a = result["a2a"]
    schedules = [r["schedule"] for r in a2a if r["block_mib"] == 0.0625]
    assert schedules == ["nccl", "dma/direct/c1 (default)", "dma/direct/c1/s2", "dma/direct/c1/s3"]
    assert len(a2a) == 8
    for row in a2a:
        assert row["bit_exact"] and row["median_ms"] > 0 and row["gbps"] > 0, row
        assert row["gbps"] == pytest.approx(3 * row["block_mib"] * 2**20 / (row["median_ms"] * 1e-3) / 1e9)

    overlap = {r["variant"]: r for r in result["overlap"]}
    assert set(overlap) == {"matmul_alone", "pair_nccl", "pair_dma", "a2a_alone_nccl", "bound_max_nccl",
                            "bound_sum_nccl", "a2a_alone_dma", "bound_max_dma", "bound_sum_dma"}
    assert overlap["matmul_alone"]["matmul"] == [32, 64, 48]
    for label in ("nccl", "dma"):
        pair = overlap[f"pair_{label}"]
        assert pair["bit_exact"] and pair["matmul_rel_err"] < 1e-2 and pair["median_ms"] > 0, pair
        mm, alone = overlap["matmul_alone"]["median_ms"], overlap[f"a2a_alone_{label}"]["median_ms"]
        assert overlap[f"bound_max_{label}"]["median_ms"] == max(mm, alone)
        assert overlap[f"bound_sum_{label}"]["median_ms"] == pytest.approx(mm + alone)

    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 8 + 1 + 2, done.stderr  # a2a variants, the matmul alone, two pairs
    tail = done.stdout.strip().splitlines()
    assert tail[-1].startswith("| 0.0625 |") and "| block MiB | NCCL ms | dma schedule |" in done.stdout


@pytest.mark.sweep(first=1)
@pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_the_script_times_all_gather_and_reduce_scatter_pulled_and_pushed(tmp_path, collective):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(SCRIPT), "--collective", collective, "--sizes", "0.0625", "--overlap-sizes", "",
           "--schedules", "default,dma/direct/c2/push", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads((tmp_path / f"{collective}_vs_nccl.json").read_text())
    assert result["collective"] == collective and result["overlap"] == [] and result["skipped"] == []
    rows = result["a2a"]
    assert [r["schedule"] for r in rows] == ["nccl", "dma/direct/c1 (default)", "dma/direct/c2/push"]
    for row in rows:
        assert "note" not in row and row["median_ms"] > 0, row
        if collective == "all_gather":  # NCCL's is the reference itself
            assert row["bit_exact"] if row["variant"] != "nccl" else "bit_exact" not in row and row["checked"], row
        else:  # every variant, NCCL's too, against psum_scatter in float32
            assert 0 <= row["rel_err"] < 1e-2, row
    assert f"{collective} alone:" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("| 0.0625 |")

    bad = subprocess.run(cmd + ["--overlap-sizes", "0.0625"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--overlap-sizes is for all_to_all only" in bad.stdout + bad.stderr


@pytest.mark.parametrize("n, streams", [(2, []), (3, [2]), (4, [2, 3]), (8, [2, 7])])
def test_default_variants_are_valid_for_the_group(n, streams):
    # A schedule may not have more copy streams than peers (an s2 on 2 devices is invalid, an error
    # row at every size): on 2 devices the default list is the default schedule alone.
    script = _load(SCRIPT)
    variants = script.dma_variants("", n)
    assert variants == ["default"] + [f"dma/direct/c1/s{s}" for s in streams]
    assert all(script.Schedule.parse(v).copy_streams <= n - 1 for v in variants[1:])


def _load(path):
    """A script of benchmarks/peers as a module (that folder is not a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fit_module():
    return _load(SCRIPT.parent / "collectives_fit.py")


def _result(collective, nccl_ms, dma_ms):
    rows = [{"block_mib": s, "variant": "nccl", "schedule": "nccl", "median_ms": t} for s, t in nccl_ms.items()]
    rows += [{"block_mib": s, "variant": "default", "schedule": "dma/direct/c1 (default)", "median_ms": t}
             for s, t in dma_ms.items()]
    return {"collective": collective, "a2a": rows}


def test_the_fit_finds_fixed_cost_rate_and_the_crossover():
    fit = _fit_module()
    # dma: 20 us + 1 MiB per 0.01 ms (about 105 GB/s); NCCL: 5 us + 1 MiB per 0.02 ms.
    sizes = (0.25, 1.0, 4.0, 16.0)
    result = _result("all_gather", {s: 0.005 + 0.02 * s for s in sizes}, {s: 0.020 + 0.01 * s for s in sizes})
    entry, = fit.summarize(result)
    assert entry["fit"]["fixed_us"] == pytest.approx(20.0)
    assert entry["fit"]["gbps"] == pytest.approx(2**20 / 0.01e-3 / 1e9)
    assert entry["over_nccl"][0.25] > 1 and entry["over_nccl"][4.0] < 1
    assert entry["at_most_nccl_from_mib"] == 4.0  # 1 MiB: 30 us against 25


def test_the_crossover_is_where_every_larger_size_is_at_most_nccl():
    fit = _fit_module()
    assert fit.crossover({0.25: 0.9, 1.0: 1.1, 4.0: 0.8, 16.0: 0.7}) == 4.0  # a faster small size alone is noise
    assert fit.crossover({1.0: 0.9, 4.0: 1.01}) is None
    assert fit.crossover({1.0: 1.0, 4.0: 0.5}) == 1.0


def test_the_threshold_proposed_keeps_every_collective_at_most_nccl():
    fit = _fit_module()
    sizes = (1.0, 4.0, 16.0)
    gather = _result("all_gather", {s: 1.0 for s in sizes}, {1.0: 0.9, 4.0: 0.9, 16.0: 0.9})
    scatter = _result("reduce_scatter", {s: 1.0 for s in sizes}, {1.0: 1.5, 4.0: 0.9, 16.0: 0.9})
    entries = fit.summarize(gather) + fit.summarize(scatter)
    proposal = fit.proposal(entries, ["all_gather", "reduce_scatter"], n_devices=2)
    assert proposal["min_bytes"] == 4 << 20 and "reduce_scatter" in proposal["why"]
    slow = fit.summarize(_result("all_to_all", {s: 1.0 for s in sizes}, {s: 2.0 for s in sizes}))
    everything = ["all_gather", "reduce_scatter", "all_to_all"]
    assert fit.proposal(entries + slow, everything, n_devices=2)["min_bytes"] is None
    assert fit.proposal(entries, everything, n_devices=2)["min_bytes"] is None  # no all_to_all rows
    one = fit.proposal(entries, ["all_gather", "reduce_scatter"], n_devices=1)
    assert one["min_bytes"] is None and "one device" in one["why"]


def test_the_fit_says_what_is_missing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT.parent / "collectives_fit.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "collectives_vs_nccl.py --out" in done.stderr
