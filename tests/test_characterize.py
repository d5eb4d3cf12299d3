"""`characterize` / `calibrate` on 8 CPU devices: the JSON they write and the profile fitted from it."""
import json

import pytest

from ficco_jax.tools import characterize
from ficco_jax.tuning import cost_model, fitting
from ficco_jax.schedule import Schedule


def test_characterize_writes_its_schema_and_calibrate_fits_a_profile_to_it(tmp_path, monkeypatch):
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
    # CPU times of a tiny grid are noise: the fitted rates are only positive (the fixed-row test checks the fit)
    assert profile["peak_tflops"]["float32"] > 0 and profile["rows_half"] >= 0
    # contention_dma from fixed numbers: +20 % beside the pulls, and a faster run clamped to 0
    for beside, want in ((1.2, 0.2), (0.9, 0.0)):
        fixed = {**on_disk, "contention": {**on_disk["contention"], "executor_matmul_ms": 1.0,
                                           "executor_matmul_beside_dma_ms": beside}}
        assert fitting.fit_profile(fixed)["contention_dma"] == pytest.approx(want)


#: The fixed numbers of `_fixed_characterization`: the rates and costs its rows are computed from.
PEAK_F32_TFLOPS, ROWS_HALF, LAUNCH_US = 1.0, 128.0, cost_model.DEFAULT_PROFILE["gemm_launch_us"]
NCCL_LATENCY_US, NCCL_INGRESS_GBPS, PEAK_FP8_TFLOPS = 30.0, 50.0, 500.0


def _fixed_characterization() -> dict:
    """A characterize.json of 8 devices whose times follow the fixed numbers above exactly: matmuls of
    256 x 256 taking launch + 2 K N (rows + ROWS_HALF) / peak, all-gathers taking latency + (n - 1)
    shard bytes / ingress, FP8 matmuls of 1024 x 1024 a fixed cost + 2 K N rows / PEAK_FP8_TFLOPS, and
    one unverified FP8 row whose time the fit must leave out."""
    k = n_cols = 256
    decomposition = [{"rows": rows, "K": k, "N": n_cols, "chunks": 1,
                      "ms": (LAUNCH_US * 1e-6 + 2 * k * n_cols * (rows + ROWS_HALF) / (PEAK_F32_TFLOPS * 1e12)) * 1e3}
                     for rows in (256, 512, 1024)]
    transfers = [{"comm": "nccl", "shard_bytes": b,
                  "ms": (NCCL_LATENCY_US * 1e-6 + 7 * b / (NCCL_INGRESS_GBPS * 1e9)) * 1e3} for b in (2 ** 20, 2 ** 21, 2 ** 22)]
    fp8 = [{"rows": rows, "K": 1024, "N": 1024, "verified": True,
            "ms": (1e-5 + 2 * 1024 * 1024 * rows / (PEAK_FP8_TFLOPS * 1e12)) * 1e3} for rows in (1024, 2048, 4096)]
    fp8.append({"rows": 8192, "K": 1024, "N": 1024, "verified": False, "ms": 1.0})
    return {"device": "cpu", "n_devices": 8, "date": "2026-01-01", "commit": "abc1234", "dtype": "float32",
            "decomposition": decomposition, "transfers": transfers, "contention": {}, "fp8": fp8}


def test_calibrate_recovers_the_rates_of_fixed_rows_and_the_model_prices_with_them():
    profile = fitting.fit_profile(_fixed_characterization())
    assert profile["peak_tflops"]["float32"] == pytest.approx(PEAK_F32_TFLOPS, rel=1e-9)
    assert profile["rows_half"] == pytest.approx(ROWS_HALF, rel=1e-6)
    assert profile["peak_tflops"]["float8_e4m3fn"] == pytest.approx(PEAK_FP8_TFLOPS, rel=1e-9)
    assert profile["xla_ingress_gbps"] == pytest.approx(NCCL_INGRESS_GBPS, rel=1e-9)
    assert profile["xla_latency_us"] == profile["collective_latency_us"] == pytest.approx(NCCL_LATENCY_US, rel=1e-6)
    # The plain ag_matmul on 8 devices, x [64, 256] and w [256, 32] per device, f32: the all-gather of
    # 7 blocks of 64 x 256 x 4 bytes, then the [512, 256] @ [256, 32] matmul (compute-bound at 1 TFLOP/s).
    gather_s = NCCL_LATENCY_US * 1e-6 + 7 * 64 * 256 * 4 / (NCCL_INGRESS_GBPS * 1e9)
    matmul_s = LAUNCH_US * 1e-6 + 2 * 512 * 256 * 32 * (512 + ROWS_HALF) / 512 / (PEAK_F32_TFLOPS * 1e12)
    t = cost_model.predict("ag_matmul", Schedule(comm="none"), ((64, 256), (256, 32)), "float32", 8, profile)
    assert t == pytest.approx(gather_s + matmul_s, rel=1e-6)


def test_times_that_fall_with_the_rows_fit_no_rate():
    """Noise (times that fall as the rows grow) keeps the default peak rather than a negative one."""
    char = _fixed_characterization()
    char["decomposition"] = [{**r, "ms": 1.0 / r["rows"]} for r in char["decomposition"]]
    profile = fitting.fit_profile(char)
    assert profile["peak_tflops"]["float32"] == cost_model.DEFAULT_PROFILE["peak_tflops"]["float32"]
