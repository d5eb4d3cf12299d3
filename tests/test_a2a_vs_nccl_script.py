"""benchmarks/peers/collectives_vs_nccl.py on 4 virtual CPU devices with tiny blocks, in a subprocess: the script
the GPU run uses cannot rot. Every variant must verify bit-exact and be timed, the JSON must hold
what the summary reads, and the all_to_all table must come last. (CPU times mean nothing.)"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from ficco_jax.runtime import extension as _ext

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "collectives_vs_nccl.py"


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
    # A schedule may not have more copy streams than peers: on 2 devices the default list is the
    # default schedule alone (a listed s2 there was an error row at every size).
    import importlib.util
    spec = importlib.util.spec_from_file_location("collectives_vs_nccl", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    variants = script.dma_variants("", n)
    assert variants == ["default"] + [f"dma/direct/c1/s{s}" for s in streams]
    assert all(script.Schedule.parse(v).copy_streams <= n - 1 for v in variants[1:])
