"""benchmarks/run.py, the one benchmark entry point, on CPU: it lists its suites, refuses an unknown
one clearly, skips GPU suites without GPUs, stops a suite at its time limit, and runs a cheap suite
end to end with the summary table last. The peer scripts: the PyTorch one says why it skips
where it cannot run, the JAX one runs every variant on CPU devices (its times mean nothing there)."""
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from ficco_jax.runtime import extension

REPO = pathlib.Path(__file__).resolve().parents[1]
RUN = REPO / "benchmarks" / "run.py"
SUITES = ["build", "tests", "demo", "bench", "peers", "compare", "collectives", "accuracy", "e2e", "hang", "faults",
          "soak", "load", "multiprocess", "characterize", "fp8", "host", "capture", "trace", "timeline"]


def _run(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, str(RUN), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _entry_module():
    sys.path.insert(0, str(RUN.parent))
    import run  # noqa: PLC0415 - benchmarks/ is not a package

    return run


@pytest.mark.slow
def test_the_capture_suite_runs_on_cpu(tmp_path):
    """Every schedule of each case runs, and symmetric calls meet nobody after their sites' first calls."""
    done = _run("capture", "--cpu", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [row for path in sorted((tmp_path / "capture").glob("capture_*.json")) for row in json.loads(path.read_text())]
    assert {(r["pair"], r["schedule"]) for r in rows} == {
        (pair, schedule) for pair in ("collectives", "matmuls")
        for schedule in ("none", "dma/direct/c1", "dma/direct/c1/symmetric")}
    for row in rows:
        assert row["us_per_call"] > 0, row
        assert (row["meetings_per_launch"] == 0) == (row["schedule"] != "dma/direct/c1"), row
    assert "| capture | 0 |" in done.stdout and "symmetric" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
def test_the_collectives_suite_runs_on_cpu(tmp_path):
    """The three collectives, pulled and symmetric, each verified and timed at both tiny sizes, then the
    fit over them: what a 2-GPU run reads its dma/NCCL ratios and the proposed threshold from."""
    done = _run("collectives", "--cpu", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    fit = json.loads((tmp_path / "collectives" / "collectives_fit.json").read_text())
    assert not fit["times_meaningful"] and fit["n_devices"] == 8
    assert {(e["collective"], e["variant"]) for e in fit["entries"]} == {
        (c, v) for c in ("all_gather", "reduce_scatter", "all_to_all") for v in ("default", "dma/direct/c1/symmetric")}
    for e in fit["entries"]:
        assert sorted(map(float, e["over_nccl"])) == [0.015625, 0.0625] and e["fit"] is not None, e
    assert "| collectives | 0 |" in done.stdout and "dma/NCCL (c1 pull / c1 symmetric): all_gather" in done.stdout


def test_the_collectives_suite_lets_xla_capture_its_small_loop_bodies_on_gpus():
    run = _entry_module()
    suite = run.catalog.SUITES["collectives"]
    gpu = suite.steps(run.catalog.Context(python="python", out="o", gpus=2, limit_s=420))
    cpu = suite.steps(run.catalog.Context(python="python", out="o", gpus=0, limit_s=420))
    assert [s.label for s in gpu] == [s.label for s in cpu] == [
        "all_gather_vs_nccl", "reduce_scatter_vs_nccl", "all_to_all_vs_nccl", "collectives_fit"]
    for step in gpu[:3]:
        assert "--xla_gpu_graph_min_graph_size=1" in step.env["XLA_FLAGS"]
        assert step.argv[step.argv.index("--sizes") + 1] == "0.25,1,4,16"
    assert all(not step.env for step in cpu)  # the CPU run's device count stays in XLA_FLAGS


@pytest.mark.slow
def test_lists_every_suite():
    done = _run("--list")
    assert done.returncode == 0, done.stderr
    for name in SUITES:
        assert f"| {name} |" in done.stdout, name


@pytest.mark.slow
def test_unknown_suite_is_a_clear_error():
    done = _run("demo", "benchmark-everything")
    assert done.returncode == 2
    assert "unknown suite benchmark-everything" in done.stderr and "known: build, tests" in done.stderr


@pytest.mark.slow
def test_no_suite_is_a_clear_error():
    done = _run()
    assert done.returncode == 2 and "name at least one suite" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flag,value", [("--limit", "3"), ("--limit", "0"), ("--budget", "-1"), ("--budget", "nan")])
def test_a_limit_too_short_to_run_in_is_a_clear_error(flag, value):
    done = _run("demo", "--cpu", flag, value)
    assert done.returncode == 2 and f"{flag} {float(value):g}: give more than 6 seconds" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("script,argv,says", [
    ("peers/torch_tp.py", ["--iters", "0"], "time at least one iteration"),
    ("suites/timing_check.py", ["--long", "0"], "argument --long: expected an integer >= 2, found '0'"),
])
def test_a_benchmark_script_refuses_a_count_it_cannot_time(script, argv, says):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_gpu_suites_are_skipped_on_a_cpu_machine(tmp_path):
    done = _run("accuracy", "soak", "characterize", "--cpu", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("skipped: needs 2+ GPUs") == 3
    table = done.stdout.strip().splitlines()[-5:]
    assert table[0] == "| suite | rc | seconds | result |"
    assert [row.split("|")[1].strip() for row in table[2:]] == ["accuracy", "soak", "characterize"]


def test_the_fp8_suite_needs_a_gpu_and_takes_options(tmp_path):
    run = _entry_module()
    done = _run("fp8", "--cpu", "--out", str(tmp_path))
    assert done.returncode == 0 and "fp8: skipped: needs 1+ GPUs" in done.stdout, done.stdout
    ctx = run.catalog.Context(python=sys.executable, out=str(tmp_path), gpus=1, limit_s=300, options=("--repeats", "2,8"))
    step, = run.catalog.SUITES["fp8"].steps(ctx)
    assert step.argv[1:] == ["benchmarks/suites/fp8_gemm.py", "--out", str(tmp_path), "--repeats", "2,8"]


def test_the_bench_suite_starts_no_case_in_its_last_minutes_unless_told_otherwise(tmp_path):
    """No bench case starts once less than BENCH_CASE_S of the suite's limit is left, so a started case
    ends inside it; a --budget-s among the options wins."""
    run = _entry_module()
    suite = run.catalog.SUITES["bench"]
    for options, budget in (((), suite.limit_s - run.catalog.BENCH_CASE_S),
                            (("--dtype", "fp8"), suite.limit_s - run.catalog.BENCH_CASE_S),
                            (("--budget-s", "99"), 99)):
        ctx = run.catalog.Context(python=sys.executable, out=str(tmp_path), gpus=2, limit_s=suite.limit_s,
                                  options=options)
        argv = [str(a) for a in suite.steps(ctx)[0].argv]
        assert argv.count("--budget-s") == 1 and float(argv[argv.index("--budget-s") + 1]) == budget, argv
        assert all(o in argv for o in options)


def test_a_suite_past_its_limit_is_cut(tmp_path, monkeypatch, capsys):
    run = _entry_module()
    sleepy = run.catalog.Suite("sleepy", "sleeps", "any", 0, 600, lambda ctx: [
        run.catalog.Step("nap", [sys.executable, "-c", "print('napping', flush=True); import time; time.sleep(60)"]),
        run.catalog.Step("never", [sys.executable, "-c", "print('not reached')"])])
    monkeypatch.setitem(run.catalog.SUITES, "sleepy", sleepy)
    assert run.main(["sleepy", "--cpu", "--limit", "8", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "CUT: sleepy/nap reached the suite's time limit of 8 s" in out
    assert "not reached" not in out and "napping" in (tmp_path / "sleepy" / "nap.log").read_text()
    assert out.strip().splitlines()[-1].startswith("| sleepy | CUT |")


def test_options_go_to_suites_that_take_them(tmp_path, monkeypatch):
    run = _entry_module()
    args = run.parse_args(["trace", "e2e", "--out", str(tmp_path), "--", "matmul_rs", "ref", "8", "8", "8"])
    assert args.options == ("matmul_rs", "ref", "8", "8", "8")
    ctx = run.catalog.Context(python=sys.executable, out=str(tmp_path), gpus=0, limit_s=60, options=args.options)
    record = run.catalog.SUITES["trace"].steps(ctx)[0]
    assert record.argv[2:7] == ["matmul_rs", "ref", "8", "8", "8"]
    assert not run.catalog.SUITES["e2e"].takes_options


@pytest.mark.slow
@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
def test_the_host_suite_times_calls_meeting_and_on_the_channel_on_cpu(tmp_path):
    done = _run("host", "--cpu", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    results = {path.name: json.loads(path.read_text()) for path in (tmp_path / "host").glob("host_time_*.json")}
    assert len(results) == 4, sorted(results)
    for name, result in results.items():  # the meeting runs meet, the channel's matmul_rs does not
        on_channel = name.startswith("host_time_matmul_rs") and name.endswith("_channel.json")
        assert (result["meeting_us"] == 0) == on_channel, (name, result)
        assert (result["backend_us"]["set_word"]["calls"] > 0) == on_channel, (name, result)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("| host | 0 |") and "us per call meeting" in last, done.stdout[-2000:]


def test_the_trace_suite_runs_on_cpu(tmp_path):
    done = _run("trace", "--cpu", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert (tmp_path / "trace" / "record.log").exists() and (tmp_path / "trace" / "timeline.log").exists()
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("| trace | 0 |") and "events" in last, done.stdout[-2000:]


def test_the_timeline_suite_traces_the_llama_layer_on_gpus_unless_options_replace_it(tmp_path):
    run = _entry_module()
    suite = run.catalog.SUITES["timeline"]
    ctx = run.catalog.Context(python=sys.executable, out=str(tmp_path), gpus=2, limit_s=suite.limit_s)
    step, = suite.steps(ctx)
    assert step.argv[1:] == ["benchmarks/suites/step_timeline.py", "--out", str(tmp_path), "--",
                             "--preset", "llama70b-layer", "--attention", "cudnn"]
    step, = suite.steps(dataclasses.replace(ctx, options=("--preset", "tiny", "--global-view")))
    assert step.argv[-3:] == ["--preset", "tiny", "--global-view"] and "llama70b-layer" not in step.argv


@pytest.mark.slow
def test_the_timeline_suite_runs_on_cpu_and_says_there_is_no_device_lane(tmp_path):
    done = _run("timeline", "--cpu", "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    out = tmp_path / "timeline"
    result = json.loads((out / "step_timeline.json").read_text())
    assert list(result["modes"]) == ["no-overlap", "overlap"] and result["example_options"] == ["--preset", "tiny"]
    for name, mode in result["modes"].items():
        assert mode["analysis"]["devices"] == {} and len(mode["analysis"]["host_steps"]) == 2
        assert len(mode["wall_ms"]) == 2 and list((out / f"trace_{name}").rglob("perfetto_trace.json.gz"))
    assert "no device events" in (out / "step_timeline.md").read_text()
    log = (out / "step_timeline.log").read_text()
    # no picture on CPU: without matplotlib, or with it, as there is no device lane to draw
    assert "no picture: matplotlib is not installed" in log or "no picture: no device events to draw" in log
    assert log.strip().splitlines()[-1].startswith("| overlap | - |"), log[-1500:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("| timeline | 0 |") and "no device events" in last, done.stdout[-2000:]


def test_the_torch_peer_says_why_it_skips(tmp_path):
    # Here either torch is missing or the script was not launched by torch.distributed.run.
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers" / "torch_tp.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch_tp: SKIPPED: " in done.stdout
    assert "torch" in json.loads((tmp_path / "torch_tp.json").read_text())["skipped"]


@pytest.mark.slow
def test_the_jax_peers_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers" / "jax_tp.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "jax_tp.json").read_text())
    assert result["n"] == 4 and result["method"] and [r["shape"] for r in result["rows"]] == ["tiny_M64_K32_N64"]
    row = result["rows"][0]
    for key in ("ag_seq", "ag_ring", "ag_xla", "rs_seq", "rs_ring", "rs_xla", "gemm_only", "ag_only"):
        # a device time is never 0 (timing.device_time): 0, None or inf would be a variant not timed
        assert isinstance(row[key], float) and 0 < row[key] < float("inf"), (key, row[key])
    for key in ("ag_ring", "ag_xla", "rs_ring", "rs_xla"):
        assert row[f"{key}_rel_err"] < 2e-2, key
    assert done.stdout.strip().splitlines()[-1].startswith("| tiny_M64_K32_N64 |")


@pytest.mark.slow
def test_the_timing_check_times_each_program_both_ways_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "suites" / "timing_check.py"), "matmul_rs",
                           "xla/ring/c2", "32", "64", "128", "--long", "6", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "timing_check.json").read_text())
    assert list(result["programs"]) == ["gemm_alone", "jax_seq", "ficco:xla/ring/c2"]
    for timings in result["programs"].values():
        assert len(timings["device_time_ms"]) == len(timings["long_loop_ms"]) == 3
        # On a loaded CPU a difference of two loops can come out at 0 (device time never reports less).
        assert all(t >= 0 for t in timings["device_time_ms"]) and all(t > 0 for t in timings["long_loop_ms"])
    assert "one loop of 6 ops" in result["method"] and "NOT meaningful" in result["method"]
    assert len(done.stdout.strip().splitlines()) == 3 and (tmp_path / "trace_jax_seq").is_dir()


def test_pack_leaves_the_summary_and_one_archive(tmp_path, monkeypatch):
    run = _entry_module()
    echo = run.catalog.Suite("echo", "prints", "any", 0, 60, lambda ctx: [
        run.catalog.Step("hello", [sys.executable, "-c", "print('hello from a suite')"])])
    monkeypatch.setitem(run.catalog.SUITES, "echo", echo)
    assert run.main(["echo", "soak", "--cpu", "--out", str(tmp_path), "--pack"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.tar.gz", "summary.json", "summary.md"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["suite"], s["rc"], s["result"]) for s in summary["suites"]] == [
        ("echo", 0, "hello from a suite"), ("soak", "skipped", "needs 2+ GPUs, found 0")]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert "echo/hello.log" in tar.getnames()
