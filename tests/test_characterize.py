"""`characterize` / `calibrate` on 8 CPU devices: the JSON they write and the profile fitted from it."""
import json

import pytest

from ficco_jax.tools import characterize
from ficco_jax.tuning import cost_model, fitting
from ficco_jax.schedule import Schedule


def test_characterize_writes_schema_and_calibrate_fits_a_usable_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(characterize, "CPU_GRID", {"rows": [32, 64], "kn": [(32, 32)], "chunks": [1, 2],
                                                   "shard_mib": [0.03125, 0.0625]})
    char = characterize.run(str(tmp_path))
    on_disk = json.loads((tmp_path / "characterize.json").read_text())
    assert on_disk == json.loads(json.dumps(char))
    assert "NOT meaningful" in on_disk["method"]
    assert {(r["rows"], r["chunks"]) for r in on_disk["decomposition"]} == {(32, 1), (32, 2), (64, 1), (64, 2)}
    assert all(r["ms"] > 0 for r in on_disk["decomposition"])
    assert {r["comm"] for r in on_disk["transfers"]} >= {"nccl"}
    assert all(r["ingress_gbps"] > 0 for r in on_disk["transfers"])
    assert {"matmul_ms", "matmul_plus_nccl_ms", "nccl_alone_ms", "executor_matmul_ms",
            "executor_matmul_beside_dma_ms"} <= set(on_disk["contention"])
    assert [r["rows"] for r in on_disk["fp8"]] == characterize.CPU_FP8["rows"]
    assert all(r["verified"] is True and r["ms"] is not None for r in on_disk["fp8"])

    profile = fitting.fit_profile(on_disk)
    assert profile["axis_size"] == 8 and profile["calibrated"] == on_disk["date"]
    assert profile["peak_tflops"]["float32"] != cost_model.DEFAULT_PROFILE["peak_tflops"]["float32"]
    # the FP8 peak fitted to the fp8 rows (None where CPU loop times fall with rows: no line to fit)
    assert profile["peak_tflops"].get("float8_e4m3fn") == fitting.fp8_peak_tflops(on_disk["fp8"])
    assert profile["xla_ingress_gbps"] > 0 and profile["rows_half"] >= 0
    # contention_dma from fixed numbers: +20 % beside the pulls, and a faster run clamped to 0
    for beside, want in ((1.2, 0.2), (0.9, 0.0)):
        fixed = {**on_disk, "contention": {**on_disk["contention"], "executor_matmul_ms": 1.0,
                                           "executor_matmul_beside_dma_ms": beside}}
        assert fitting.fit_profile(fixed)["contention_dma"] == pytest.approx(want)
    # The fitted profile drives the cost model end to end.
    t = cost_model.predict("ag_matmul", Schedule(comm="xla", chunks=2), ((64, 32), (32, 16)), "float32", 8, profile)
    assert t > 0
