"""tools/gpu_monitor.py: the clocks, power and temperature a timing ran at, from a sampler standing in for
nvidia-smi; the bench's rows and table carry them, and without a sampler nothing changes."""
import json
import os
import sys
import time

import pytest

from ficco_jax.tools import bench, gpu_monitor, harness

# Prints two GPUs' samples every 2 ms, as `nvidia-smi --query-gpu=... -lms=N` does, with a header
# and a malformed line among them.
FAKE_SMI = [sys.executable, "-u", "-c", """
import time
print("index, power.draw [W], clocks.sm [MHz], sw_power_cap, temperature.gpu", flush=True)
print("[N/A]", flush=True)
k = 0
while True:
    print(f"0, 690.5, {1350 + k % 2}, Active, 60", flush=True)
    print(f"1, 600.0, 1500, Not Active, 70", flush=True)
    k += 1
    time.sleep(0.002)
"""]


def test_a_sample_line_is_parsed_and_other_lines_are_not():
    assert gpu_monitor.parse("0, 683.84, 1361, Active, 53") == (0, 683.84, 1361.0, True, 53.0)
    assert gpu_monitor.parse("1, 120.5, 1980, Not Active, 40")[3] is False
    for line in ("index, power.draw [W], clocks.sm [MHz], x, temperature.gpu", "[N/A]", "0, [N/A], 1980, Active, 40",
                 "Field 'clocks_event_reasons.sw_power_cap' is not a valid field to query.", ""):
        assert gpu_monitor.parse(line) is None


def test_a_window_summarises_the_samples_inside_its_spans():
    monitor = gpu_monitor.GpuMonitor(FAKE_SMI)
    assert monitor.start()
    try:
        t0 = time.monotonic()
        time.sleep(0.3)
        t1 = time.monotonic()
        time.sleep(0.1)
        window = monitor.window([(t0, t1)])
        assert window["samples"] > 10
        assert window["sm_mhz"] == {"0": pytest.approx(1350.5, abs=1), "1": 1500}
        assert window["power_w"] == {"0": 690.5, "1": 600.0} and window["temp_c"] == {"0": 60.0, "1": 70.0}
        assert window["capped"] == pytest.approx(0.5, abs=0.05)  # GPU 0 capped, GPU 1 not
        assert monitor.window([(t1 + 10, t1 + 20)]) is None  # no sample in that stretch
    finally:
        monitor.stop()
    line = gpu_monitor.summary_line([window, None])
    assert "SM clock 1350-1500 MHz" in line and "power cap in 50 % of samples" in line and "60-70 C" in line
    assert gpu_monitor.summary_line([None]) is None


def test_nothing_to_sample_leaves_the_timings_as_they_were(tmp_path):
    monitor = gpu_monitor.GpuMonitor([str(tmp_path / "no-such-nvidia-smi")])
    assert not monitor.start()
    with harness.monitoring(monitor):
        t = harness.device_time(lambda r: (lambda a: a + 1), (1.0,))
    assert "gpus" not in t
    with harness.monitoring():  # on CPU: no monitor at all
        assert "gpus" not in harness.device_time(lambda r: (lambda a: a + 1), (1.0,))


class CannedMonitor(gpu_monitor.GpuMonitor):
    """Stands in for the sampler: every window is the same, and the spans asked about are kept."""

    def __init__(self):
        super().__init__([])
        self.asked = []

    def start(self):
        return True

    def stop(self):
        pass

    def window(self, spans):
        self.asked.append(list(spans))
        return {"sm_mhz": {"0": 1400, "1": 1500}, "power_w": {"0": 690.0, "1": 680.0}, "temp_c": {"0": 60.0, "1": 66.0},
                "capped": 1.0, "samples": 8}


def test_bench_rows_and_table_say_what_the_gpus_ran_at(tmp_path):
    """Every timed row keeps one window per timing (variants and bounds, every round), each over the
    spans of that timing's launches, and the table says what the GPUs ran at in one line."""
    monitor = CannedMonitor()
    with harness.monitoring(monitor):
        result = bench.run(["matmul_rs"], {"a": (64, 32, 64)}, "float32", "none", str(tmp_path), windowed=False,
                           rounds=2)
    timed = [r for r in result["rows"] if r["variant"] in ("jax_seq", "jax_ring", "gemm_alone", "collective_alone")]
    assert len(timed) == 4
    for r in timed:
        assert len(r["extra"]["gpus"]) == 2 and r["extra"]["gpus"][0]["sm_mhz"] == {"0": 1400, "1": 1500}, r
    assert len(monitor.asked) == 2 * len(timed)
    for spans in monitor.asked:  # the sizing run and a (big, small) pair per estimate
        assert len(spans) >= 7 and all(start <= end for start, end in spans)
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    table = (tmp_path / "bench.md").read_text()
    assert "GPUs while timed (nvidia-smi every 50 ms, 64 samples): SM clock 1400-1500 MHz" in table
    # Per case, the clocks the GEMM alone, JAX sequential and auto's pick (here the plain path, which
    # takes JAX sequential's timing and so its clocks) ran at.
    assert "| op | shape | GEMM alone | JAX seq | ficco auto |" in table
    assert "| matmul_rs | a | 1450 | 1450 | 1450 |" in table


def test_the_clocks_table_leaves_out_what_was_not_recorded():
    from ficco_jax.tools import report

    window = lambda mhz: {"sm_mhz": {"0": mhz, "1": mhz}, "power_w": {}, "temp_c": {"0": 50}, "capped": 1, "samples": 4}  # noqa: E731
    case = {"gemm_alone": {"variant": "gemm_alone", "extra": {"gpus": [window(1500), window(1520)]}},
            "jax_seq": {"variant": "jax_seq", "extra": {}},
            "ficco:dma/direct/c1": {"variant": "ficco:dma/direct/c1", "selected": True, "extra": {"gpus": [window(1400)]}}}
    lines = report.clocks_table({("ag_matmul", "s", 1, 2, 3): case, ("matmul_rs", "t", 1, 2, 3): {}})
    assert lines[-1] == "| ag_matmul | s | 1510 | — | 1400 |" and len(lines) == 6
    assert report.clocks_table({("ag_matmul", "s", 1, 2, 3): {"jax_seq": {"extra": {}}}}) == []


def test_the_sampler_finds_the_power_cap_field_this_driver_knows(tmp_path, monkeypatch):
    """Drivers name the power-cap reason clocks_event_reasons.* (newer) or clocks_throttle_reasons.* (older):
    the monitor probes for the first one `nvidia-smi` accepts and samples with it."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!{sys.executable}
import sys, time
query = next(a for a in sys.argv if a.startswith("--query-gpu="))
if "clocks_event_reasons" in query:
    print("Field 'clocks_event_reasons.sw_power_cap' is not a valid field to query.")
    sys.exit(2)
loop = any(a.startswith("-lms") for a in sys.argv)
while True:
    print("0, 650.0, 1410, Active, 61", flush=True)
    if not loop:
        break
    time.sleep(0.005)
""")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monitor = gpu_monitor.GpuMonitor()
    command = monitor._default_command()
    assert command[0] == str(smi) and "clocks_throttle_reasons.sw_power_cap" in command[1]
    assert monitor.start()
    try:
        t0 = time.monotonic()
        time.sleep(0.2)
        window = monitor.window([(t0, time.monotonic())])
    finally:
        monitor.stop()
    assert window["sm_mhz"] == {"0": 1410} and window["capped"] == 1.0


def test_no_nvidia_smi_means_no_sampler(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_monitor.GpuMonitor()._default_command() is None and not gpu_monitor.GpuMonitor().start()


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                       "2026-11-28_h200x2")


def test_a_timing_faster_than_the_tensor_cores_allow_is_flagged():
    """Recorded runs: XLA's FP8 dot of GPT-3's whole product timed above the dense FP8 peak at the SM clock
    recorded while it ran; every other matmul row, and the collectives (no matmul), pass."""
    from ficco_jax.tools import report

    with open(os.path.join(RESULTS, "bench_fp8_resumed_3defb2f.json")) as fh:
        fp8 = json.load(fh)
    flagged = report.above_peak(fp8)
    assert [line.split(":")[0] for line in flagged] == ["ag_matmul gpt3_175b_mlp_M4k gemm_alone",
                                                        "matmul_rs gpt3_175b_mlp_M4k gemm_alone"]
    assert "1.14x the dense float8_e4m3fn peak at 1586 MHz" in flagged[1]
    table = report.markdown_table(fp8)
    assert "Faster than the tensor cores allow" in table and f"- {flagged[0]}" in table
    with open(os.path.join(RESULTS, "bench_rounds3_3defb2f.json")) as fh:
        bf16 = json.load(fh)
    assert report.above_peak(bf16) == [] and "Faster than the tensor cores allow" not in report.markdown_table(bf16)
    # the same times on a device kind without a known peak, or without recorded clocks, are not judged
    assert report.above_peak(dict(fp8, device="NVIDIA A100-SXM4-80GB")) == []
    unclocked = [dict(r, extra={k: v for k, v in r.get("extra", {}).items() if k != "gpus"}) for r in fp8["rows"]]
    assert report.above_peak(dict(fp8, rows=unclocked)) == []


def test_a_timing_the_loops_could_not_resolve_is_named_an_upper_bound():
    from ficco_jax.tools import report

    with open(os.path.join(RESULTS, "bench_rounds3_3defb2f.json")) as fh:
        bf16 = json.load(fh)
    assert "Upper bounds" not in report.markdown_table(bf16)
    row = next(r for r in bf16["rows"] if r["variant"] == "jax_seq")
    row["extra"] = dict(row.get("extra", {}), upper_bound=True)
    line = next(x for x in report.markdown_table(bf16).splitlines() if x.startswith("Upper bounds"))
    assert line.endswith(f": {row['op']} {row['shape']} jax_seq.")
    assert "Upper bounds" not in report.markdown_table(dict(bf16, platform="cpu"))  # CPU times are n/a anyway
