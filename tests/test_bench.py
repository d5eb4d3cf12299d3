"""`python -m ficco_jax bench` / `demo`: they run on 8 CPU devices and write verified, well-formed results."""
import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ficco_jax.schedule import Schedule, local_shapes
from ficco_jax.tools import bench, harness
from ficco_jax.tuning import timing

ROW_KEYS = {"op", "shape", "M", "K", "N", "variant", "median_ms", "spread_ms", "verified", "rel_err", "selected", "note"}


@pytest.mark.slow
def test_bench_writes_verified_json_and_table(tmp_path):
    result = bench.run(["ag_matmul", "matmul_rs"], {"t": (64, 32, 64)}, "float32",
                       "xla/ring/c2,xla/direct/c1,none", str(tmp_path), windowed=False)
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert {"device", "platform", "n_devices", "dtype", "jax", "commit", "date", "method", "rows"} <= set(on_disk)
    assert "NOT meaningful" in on_disk["method"]
    for row in on_disk["rows"]:
        assert ROW_KEYS <= set(row)
    timed = [r for r in on_disk["rows"] if r["variant"].startswith(("ficco:", "jax_"))]
    assert {r["variant"] for r in timed} >= {"ficco:xla/ring/c2", "ficco:xla/direct/c1", "jax_seq"}
    for r in timed:  # every timed variant was checked against the reference first
        assert r["verified"] is True and r["rel_err"] < harness.TOLERANCE["float32"], r
        assert r["median_ms"] is not None and r["median_ms"] > 0
    for op in ("ag_matmul", "matmul_rs"):
        # The plain path is JAX sequential's program: verified, then given that timing, not a second one.
        seq, plain, ring = (next(r for r in timed if r["op"] == op and r["variant"] == v)
                            for v in ("jax_seq", "ficco:none", "ficco:xla/ring/c2"))
        assert plain["median_ms"] == seq["median_ms"] and plain["note"] == "the program of jax_seq: its timing"
        assert ring["note"] == "" and plain["rel_err"] is not None
        ideal = next(r for r in on_disk["rows"] if r["op"] == op and r["variant"] == "ideal")
        bounds = [r["median_ms"] for r in on_disk["rows"] if r["op"] == op and r["variant"] in ("gemm_alone", "collective_alone")]
        assert ideal["median_ms"] == max(bounds)
    table = (tmp_path / "bench.md").read_text()
    assert "| ag_matmul |" in table and "| matmul_rs |" in table and "Method:" in table


def test_a_wrong_variant_is_reported_not_timed(tmp_path, monkeypatch):
    real = bench.op_body

    def corrupt(op, schedule):  # a deliberately wrong "schedule": the check must catch it
        body = real(op, schedule)
        # 1e-3 relative: 10x the f32 check's threshold (1e-4), so loosening that check fails this test
        return body if schedule == "ref" else (lambda a, w: body(a, w) * (1 + 1e-3))

    monkeypatch.setattr(bench, "op_body", corrupt)
    result = bench.run(["ag_matmul"], {"t": (64, 32, 64)}, "float32", "xla/ring/c1", str(tmp_path), windowed=False)
    row = next(r for r in result["rows"] if r["variant"] == "ficco:xla/ring/c1")
    assert row["verified"] is False and row["median_ms"] is None and row["note"].startswith("WRONG RESULT")


def test_device_time_differencing_sees_repeats():
    import jax
    import jax.numpy as jnp

    # Ops of a fraction of a millisecond: R of them outweigh a loaded CPU's launch-to-launch jitter.
    a = jnp.ones((384, 384), jnp.float32) * 0.5
    t = timing.device_time(lambda r: jax.jit(timing.chain(lambda a: a @ a * 0.01, r)), (a,), target_s=0.02)
    assert t["median_s"] > 0 and t["repeats"] >= 2


def test_device_time_leaves_out_the_boost_at_the_start_of_each_launch(monkeypatch):
    """A GPU at its power limit runs a launch's first milliseconds at its boost clock. Modelled here: a
    launch costs 3 ms of dispatch, then ops of 1 ms for its first 8 ms and 1.5 ms after (as XLA's FP8
    dot on 2 x H200: about 1.35 ms for its first five or so, 2 ms once the clock came down). A loop of
    1 op against one of five would time the boost (1 ms); loops of R and 2R, both past the boost,
    time the op as a long run of them takes it."""
    def launch(r):
        boost_ops = min(r, 8)
        return 3e-3 + boost_ops * 1e-3 + (r - boost_ops) * 1.5e-3

    monkeypatch.setattr(timing, "wall_time", lambda fn, args, launches, spans=None: launch(fn))
    t = timing.device_time(lambda r: r, ())
    assert t["repeats"] == 12  # one launch of one op takes 4 ms: R = 50 ms / 4 ms
    assert abs(t["median_s"] - 1.5e-3) < 1e-9 and t["resolved"] is True
    assert timing.repeats_for(1e-9) == timing.MAX_REPEATS // 2


@pytest.mark.parametrize("long_minus_short", [0.0, -2e-4])
def test_device_time_is_never_zero_where_the_loops_do_not_differ(monkeypatch, long_minus_short):
    """An op too small for R more of it to show (a tiny op on a CPU: the two loops' medians come out
    equal, or the longer one faster) gets the longer loop's wall time per op, an upper bound, marked
    unresolved; every ratio and rate computed from a time stays finite."""
    walls = {1: 1e-3, 50: 2e-3, 100: 2e-3 + long_minus_short}
    monkeypatch.setattr(timing, "wall_time", lambda fn, args, launches, spans=None: walls[fn])
    t = timing.device_time(lambda r: r, ())
    assert t["repeats"] == 50 and t["resolved"] is False
    assert t["median_s"] == pytest.approx(walls[100] / 100) and t["spread_s"] == 0


def test_the_timing_chain_keeps_every_chunk_of_the_output():
    """A step made of chunks whose fed-back element needs only the first: every chunk's matmul is
    still computed (XLA would otherwise drop the others, and a decomposed schedule would time as
    faster than its own matmuls)."""
    import jax
    import jax.numpy as jnp

    a, w = jnp.ones((256, 128)), jnp.ones((128, 512))
    step = lambda a, w: jnp.concatenate([a[:64] @ w, a[64:128] @ w, a[128:] @ w])  # noqa: E731
    compiled = jax.jit(timing.chain(step, 3)).lower(a, w).compile().as_text()
    assert sum(" dot(" in line for line in compiled.splitlines()) == 3


def test_cli_benches_the_all_reduced_matmul_against_matmul_plus_psum(tmp_path):
    """The command that measures matmul_psum on GPUs, on CPU devices with a tiny shape: every variant
    verified, JAX's matmul + psum and the all-reduce alone beside it, no windowed-einsum row; the
    result names the compilation cache it ran with."""
    cache = tmp_path / "xla"
    out = subprocess.run([sys.executable, "-m", "ficco_jax", "bench", "--op", "matmul_psum", "--shape", "64,32,64",
                          "--dtype", "f32", "--schedules", "xla/ring/c2,dma/direct/c2", "--out", str(tmp_path),
                          "--xla-cache", str(cache)],
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["xla_cache"] == str(cache), result["xla_cache"]
    rows = {r["variant"]: r for r in result["rows"]}
    assert {r["op"] for r in rows.values()} == {"matmul_psum"}
    assert {"jax_seq", "ficco:xla/ring/c2", "ficco:dma/direct/c2", "collective_alone", "ideal"} <= set(rows)
    assert "xla_windowed_einsum" not in rows
    for label in ("jax_seq", "ficco:xla/ring/c2", "ficco:dma/direct/c2"):
        assert rows[label]["verified"] is True and rows[label]["rel_err"] < harness.TOLERANCE["float32"], rows[label]
    assert "| matmul_psum |" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow
def test_cli_rejects_bad_shape():
    out = subprocess.run([sys.executable, "-m", "ficco_jax", "bench", "--shape", "1,2"], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode != 0 and "expected M,K,N" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("schedules,match", [("auto,dma/direct/c1", "'auto', 'all', 'dma' and 'xla' stand alone"),
                                              ("dma/direct/c2/pushy", "unknown part 'pushy'")])
def test_cli_rejects_a_bad_schedule_list_before_compiling(schedules, match):
    out = subprocess.run([sys.executable, "-m", "ficco_jax", "bench", "--schedules", schedules], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert out.returncode != 0 and match in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_bench_moe_ops_verified_side_by_side(tmp_path):
    result = bench.run(["a2a_matmul", "matmul_a2a"], {}, "float32", "xla/direct/c2,dma/direct/c1", str(tmp_path),
                       windowed=False, moe_shapes={"t": (32, 16, 24, 8, 2)})
    rows = result["rows"]
    for op in ("a2a_matmul", "matmul_a2a"):
        mine = {r["variant"]: r for r in rows if r["op"] == op}
        assert {"jax_seq", "ficco:xla/direct/c2", "ficco:dma/direct/c1", "gemm_alone", "collective_alone", "ideal"} <= set(mine)
        for label in ("jax_seq", "ficco:xla/direct/c2", "ficco:dma/direct/c1"):
            assert mine[label]["verified"] is True and mine[label]["median_ms"] > 0, mine[label]
        assert mine["ideal"]["median_ms"] == max(mine["gemm_alone"]["median_ms"], mine["collective_alone"]["median_ms"])
        assert mine["jax_seq"]["extra"] == {"experts": 8, "top_k": 2}
    assert "| a2a_matmul |" in (tmp_path / "bench.md").read_text()


def test_device_time_adds_estimates_only_while_they_disagree(monkeypatch):
    from ficco_jax.tuning import timing

    def run(walls):
        it = iter(walls)
        monkeypatch.setattr(timing, "wall_time", lambda fn, args, launches, spans=None: next(it))
        return timing.device_time(lambda r: r, (), target_s=1e-3)

    # t1 (sizing), then (big, small) pairs; repeats = 1e-3 / 1e-4 = 10, so estimate = (big - small) / 10
    agree = [1e-4] + [1.1e-3, 1e-4] * 3  # three estimates of 1e-4 s: done after three
    t = run(agree)
    assert t["estimates"] == 3 and abs(t["median_s"] - 1e-4) < 1e-12 and t["spread_s"] == 0
    noisy = [1e-4, 1.1e-3, 1e-4, 1.5e-3, 1e-4, 1.1e-3, 1e-4] + [1.1e-3, 1e-4] * 4  # one outlier (1.4e-4)
    t = run(noisy)
    assert t["estimates"] == 7  # 1.4e-4 among 1e-4s keeps the spread above 3 % to the cap
    assert abs(t["median_s"] - 1e-4) < 1e-12  # the median ignores the outlier
    settles = [1e-4, 1.1e-3, 1e-4, 1.103e-3, 1e-4, 1.1e-3, 1e-4, 1.101e-3, 1e-4]  # 1.0e-4, 1.003e-4, 1.0e-4, 1.001e-4
    t = run(settles)
    assert t["estimates"] == 3


class _FakeClock:
    """time.monotonic / time.perf_counter for timing.py that move only when a fake program runs:
    steps of a power of two seconds, so every sum of them is exact and no reading depends on the
    host's load."""
    STEP_S = 2.0 ** -10  # one launch
    COMPILE_S = 2.0 ** -2  # a program's first call

    def __init__(self):
        self.now = 0.0
        self.monotonic = self.perf_counter = lambda: self.now

    def run(self, first: bool) -> float:
        self.now += self.COMPILE_S if first else self.STEP_S
        return self.now


def test_device_time_spans_cover_the_timed_launches_not_the_warm_ups(monkeypatch):
    """What the GPUs did is read over these spans (gpu_monitor), so a compile must not fall inside one."""
    clock, calls = _FakeClock(), {}
    monkeypatch.setattr(timing, "time", clock)

    def make(r):
        def fn(a):
            calls[r] = calls.get(r, 0) + 1
            clock.run(first=calls[r] == 1)
            return a
        return fn

    spans = []
    t = timing.device_time(make, (1.0,), target_s=1e-3, adaptive=False, spans=spans)
    assert len(spans) == 1 + 2 * t["estimates"]  # the sizing run, then a (big, small) pair per estimate
    # each span is its timed launches alone (the sizing run: one), no compile inside
    launches = [1] + [timing.LAUNCHES] * (len(spans) - 1)
    assert [end - start for start, end in spans] == [k * clock.STEP_S for k in launches]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_device_time_settles_on_the_timed_program_before_its_estimates(monkeypatch):
    """settle_s: the R-repeat program runs back to back that long before any estimate, so the GPU is
    timed in the power state of this load, not that of an idle compile."""
    clock, log = _FakeClock(), []
    monkeypatch.setattr(timing, "time", clock)

    def make(r):
        def fn(a):
            log.append((r, clock.run(first=all(r != seen for seen, _ in log))))
            return a
        return fn

    spans, settle_s = [], 100 * clock.STEP_S
    t = timing.device_time(make, (1.0,), target_s=1e-3, adaptive=False, spans=spans, settle_s=settle_s)
    first_estimate = spans[1][0]  # spans[0]: the sizing run of the 1-repeat program
    before = [(r, at) for r, at in log if spans[0][1] < at < first_estimate]
    assert all(r == 2 * t["repeats"] for r, _ in before)  # only the timed program ran
    compiled_at, settling = before[0][1], [at for _, at in before[1:]]
    # after its compile, the program ran back to back until settle_s had passed, then the estimates began
    assert len(settling) == 100 and settling[-1] - compiled_at == settle_s


def test_device_time_fixed_estimates_for_several_processes(monkeypatch):
    # adaptive=False: exactly MIN_ESTIMATES however much they disagree (processes that time the same
    # collective program must launch it equally often, or the extra launch waits forever).
    from ficco_jax.tuning import timing

    walls = iter([1e-4, 1.1e-3, 1e-4, 1.5e-3, 1e-4, 1.1e-3, 1e-4] + [1.1e-3, 1e-4] * 4)
    monkeypatch.setattr(timing, "wall_time", lambda fn, args, launches, spans=None: next(walls))
    t = timing.device_time(lambda r: r, (), target_s=1e-3, adaptive=False)
    assert t["estimates"] == timing.MIN_ESTIMATES == 3 and t["spread_s"] > 0


def test_table_shows_the_best_with_its_spread_and_over_the_ideal():
    from ficco_jax.tools import report

    def row(variant, ms, spread=None, selected=False):
        return {"op": "ag_matmul", "shape": "s", "M": 8, "K": 8, "N": 8, "variant": variant, "median_ms": ms,
                "spread_ms": spread, "verified": True, "selected": selected, "note": ""}

    result = {"n_devices": 4, "device": "d", "platform": "gpu", "dtype": "bfloat16", "jax": "0", "commit": "c",
              "date": "t", "method": "m",
              "rows": [row("jax_seq", 0.8, 0.01), row("gemm_alone", 0.475), row("collective_alone", 0.36),
                       row("ideal", 0.475), row("ficco:dma/direct/c1", 0.532, 0.13, selected=True),
                       row("ficco:dma/direct/c2/grouped", 0.539, 0.09)]}
    line = next(x for x in report.markdown_table(result).splitlines() if x.startswith("| ag_matmul"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[9] == "0.532 (dma/direct/c1) ± 0.130"
    assert cells[10] == "1.50x" and cells[11] == "1.120x"  # 0.8 / 0.532 and 0.532 / 0.475


def test_progress_ends_at_its_planned_count(tmp_path, capsys):
    # xla/ring/c1 listed is JAX's ring too: counted once, as it is run once
    bench.run(["ag_matmul"], {"t": (64, 32, 64)}, "float32", "xla/ring/c1,xla/direct/c1", str(tmp_path),
              windowed=False)
    steps = [tuple(map(int, m)) for m in re.findall(r"\[\s*(\d+)/(\d+)\]", capsys.readouterr().err)]
    assert steps and steps[-1][0] == steps[-1][1] == len(steps), steps


def test_the_table_says_its_unit_its_marks_what_the_progress_counted_and_where_it_wrote(tmp_path, monkeypatch,
                                                                                          capsys):
    """The progress line counts the bounds besides the verified variants: the summary says the same
    count, by kind; the table gives its time unit and explains "(none)" and "—"; the run says where it
    wrote its files."""
    monkeypatch.setattr(harness, "device_time", lambda make, args: {"median_s": 1e-3, "spread_s": 0.0})
    result = bench.run(["ag_matmul"], {"t": (64, 32, 64)}, "float32", "xla/direct/c2,none", str(tmp_path),
                       windowed=False)
    captured = capsys.readouterr()
    k, total = re.findall(r"\[\s*(\d+)/(\d+)\]", captured.err)[-1]
    table = (tmp_path / "bench.md").read_text()
    verified = re.search(r"Verified against the reference before timing: (\d+)/(\d+) variants", table)
    runs = re.search(r"Runs \(the progress count\): (\d+) = (\d+) variants \(each verified, then timed\) \+ "
                     r"(\d+) bounds timed alone \(GEMM alone, collective alone: no result to verify\)\.", table)
    assert verified and runs, table
    assert k == total == runs.group(1) and int(runs.group(2)) + int(runs.group(3)) == int(total), (total, table)
    assert runs.group(2) == verified.group(2) and int(runs.group(3)) == harness.BOUND_STEPS, table
    assert "(bound: timed only)" in captured.err  # the counter names its extra steps as it runs them
    header = next(line for line in table.splitlines() if line.startswith("| op |"))
    assert "GEMM alone ms" in header and "ficco best ms (schedule)" in header, header
    row = next(line for line in table.splitlines() if line.startswith("| ag_matmul"))
    assert "(none)" in row and "—" in row, row  # the marks the legend explains are in this table
    legend = next(line for line in table.splitlines() if line.startswith("Times: ms per op"))
    assert "(none) is comm=\"none\", the plain collective then the matmul" in legend and "—: no time" in legend
    assert f"Written: {tmp_path / 'bench.json'}, {tmp_path / 'bench.md'}" in captured.out
    assert result["steps"] == {"variants": int(runs.group(2)), "bounds": 2, "windowed": 0, "rounds": 0}


def test_the_demo_says_where_it_writes_and_whether_the_extension_has_its_cuda_backend(tmp_path, monkeypatch, capsys):
    from ficco_jax.runtime import extension
    from ficco_jax.tools import demo

    monkeypatch.setattr(demo.bench, "run", lambda *a, **k: {})
    for info, says in (({"version": "0.1.0", "cuda": True}, "CUDA backend built"),
                       ({"version": "0.1.0", "cuda": False}, "CUDA backend NOT built")):
        monkeypatch.setattr(extension, "build_info", lambda info=info: dict(info))
        demo.run(str(tmp_path / "out"))
        out = capsys.readouterr().out
        assert says in out and f"Results are written under {tmp_path / 'out'}/ (bench.json, bench.md)" in out, out
    assert "on these GPUs no comm='dma' schedule runs" in demo.extension_line("gpu")

    def missing():
        raise ImportError("the compiled extension ficco_jax._ffi is missing")

    monkeypatch.setattr(extension, "build_info", missing)
    assert "Extension: not loaded" in demo.extension_line("cpu") and "is missing" in demo.extension_line("cpu")


def test_a_listed_schedule_that_does_not_fit_the_shape_is_a_row_saying_why(tmp_path, monkeypatch, capsys):
    """8 rows per device of ag_matmul do not split into 3 chunks: c3 is neither compiled nor timed,
    and its row, in bench.json and in the table's notes, gives the reason and the chunk counts that fit."""
    monkeypatch.setattr(harness, "device_time", lambda make, args: {"median_s": 1e-3, "spread_s": 0.0})
    result = bench.run(["ag_matmul"], {"t": (64, 32, 64)}, "float32", "xla/direct/c3,xla/direct/c2", str(tmp_path),
                       windowed=False)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    skipped = rows["ficco:xla/direct/c3"]
    assert skipped["verified"] is None and skipped["median_ms"] is None and skipped["rel_err"] is None, skipped
    assert skipped["note"].startswith("skipped: ag_matmul: rows per device = 8") and "[1, 2, 4, 8]" in skipped["note"]
    assert rows["ficco:xla/direct/c2"]["verified"] is True and result["skipped"] == []
    assert f"- ag_matmul t ficco:xla/direct/c3: {skipped['note']}" in (tmp_path / "bench.md").read_text()
    steps = [tuple(map(int, m)) for m in re.findall(r"\[\s*(\d+)/(\d+)\]", capsys.readouterr().err)]
    assert steps[-1][0] == steps[-1][1] == len(steps), steps  # the skipped schedule takes no step


@pytest.mark.slow
def test_a_time_budget_stops_new_cases_and_resume_completes_the_run(tmp_path, monkeypatch):
    """--budget-s: no case starts once the budget is spent (here a fake clock spends it after the first
    case), the rest are listed in the JSON and the table; --resume keeps the measured rows, with their
    commit, and measures only the missing cases, so the two runs add up to one complete result."""
    shapes = {"a": (64, 32, 64), "b": (32, 32, 64)}
    clock = iter(range(0, 10_000, 100))  # each reading 100 s later: the first case starts at 100, the next past 150
    monkeypatch.setattr(bench, "budget_clock", lambda: float(next(clock)))
    first = bench.run(["ag_matmul", "matmul_rs"], shapes, "float32", "xla/direct/c1", str(tmp_path / "one"),
                      windowed=False, budget_s=150)
    assert {(r["op"], r["shape"]) for r in first["rows"]} == {("ag_matmul", "a")}
    assert first["skipped"] == ["ag_matmul b", "matmul_rs a", "matmul_rs b"]
    table = (tmp_path / "one" / "bench.md").read_text()
    assert "Not measured (time budget): ag_matmul b, matmul_rs a, matmul_rs b" in table and "--resume" in table

    monkeypatch.undo()
    earlier = json.loads((tmp_path / "one" / "bench.json").read_text())
    earlier["commit"] = "abc1234"
    second = bench.run(["ag_matmul", "matmul_rs"], shapes, "float32", "xla/direct/c1", str(tmp_path / "two"),
                       windowed=False, resume=earlier)
    cases = {(r["op"], r["shape"]) for r in second["rows"]}
    assert cases == {(op, name) for op in ("ag_matmul", "matmul_rs") for name in shapes} and not second["skipped"]
    kept = [r for r in second["rows"] if (r["op"], r["shape"]) == ("ag_matmul", "a")]
    assert kept and all(r["extra"]["commit"] == "abc1234" for r in kept)
    assert second["resumed"] == {"commit": "abc1234", "date": earlier["date"], "cases": 1, "measured": 3}
    assert all(r["verified"] for r in second["rows"] if r["variant"].startswith("ficco:"))
    assert "Kept from an earlier run (commit abc1234" in (tmp_path / "two" / "bench.md").read_text()


@pytest.mark.parametrize("op, shapes", [("matmul_rs", {"t": (64, 32, 64)}), ("matmul_a2a", None)])
def test_rounds_time_every_variant_and_bound_interleaved(tmp_path, monkeypatch, capsys, op, shapes):
    """--rounds 3: after a case's first timings, two more rounds, each one timing of every variant and
    bound in turn; a row is the median of its three, the plain path follows JAX sequential's program
    and the ideal the bounds' medians."""
    ticks = iter(range(1, 10_000))  # every timing 1 ms longer than the one before it

    def fake_time(make, args):
        return {"median_s": next(ticks) * 1e-3, "spread_s": 0.0}

    monkeypatch.setattr(harness, "device_time", fake_time)
    result = bench.run([op], shapes or {}, "float32", "none,xla/direct/c1", str(tmp_path), windowed=False, rounds=3)
    rows = {r["variant"]: r for r in result["rows"]}
    timed = [v for v in rows if v.startswith(("ficco:xla", "jax_")) or v in ("gemm_alone", "collective_alone")]
    assert len(timed) >= 4, sorted(rows)
    firsts = sorted(rows[v]["extra"]["timings_ms"][0] for v in timed)
    for k in (1, 2):  # round k+1: one timing of each, one after the other, after every first timing
        block = sorted(round(rows[v]["extra"]["timings_ms"][k]) for v in timed)
        assert block == list(range(block[0], block[0] + len(timed))) and block[0] > max(firsts), (k, block)
    for v in timed:
        ts = rows[v]["extra"]["timings_ms"]
        assert len(ts) == 3 and rows[v]["median_ms"] == sorted(ts)[1] and rows[v]["spread_ms"] == (ts[-1] - ts[0]) / 2
    plain = rows["ficco:none"]
    assert plain["extra"]["timing_of"] == "jax_seq" and plain["median_ms"] == rows["jax_seq"]["median_ms"]
    assert rows["ideal"]["median_ms"] == max(rows["gemm_alone"]["median_ms"], rows["collective_alone"]["median_ms"])
    assert result["rounds"] == 3 and "3 interleaved rounds" in result["method"]
    steps = [tuple(map(int, m)) for m in re.findall(r"\[\s*(\d+)/(\d+)\]", capsys.readouterr().err)]
    assert steps[-1][0] == steps[-1][1] == len(steps), steps
    with pytest.raises(ValueError, match="not comparable: rounds 3 \\(this run: 1\\)"):
        bench.run([op], shapes or {}, "float32", "none", str(tmp_path / "again"), windowed=False, resume=result)


@pytest.mark.slow
def test_cli_rejects_zero_rounds(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ficco_jax", "bench", "--op", "ag_matmul", "--shape", "64,32,64",
                           "--rounds", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "argument --rounds: expected an integer >= 1, found '0'" in done.stderr, \
        done.stderr[-800:]


def test_a_variant_failing_without_a_message_is_reported():
    """An exception with an empty message (StopIteration, a bare AssertionError) gives a note, not a
    second error while the note is written."""
    def fails(_):
        raise StopIteration

    row = harness.verify_then_time(harness.Row("ag_matmul", "t", 1, 1, 1, "ficco:x"), fails, (), None, "float32")
    assert row.note == "error: StopIteration: " and row.median_ms is None


def test_the_gemm_bound_runs_every_device_s_matmul_in_one_program(monkeypatch):
    """GEMM alone is one program in which every device multiplies its own full-size operands, with no
    communication: an op over the group waits for its slowest device's matmul, and so does this bound."""
    n = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    seen = []

    def fake_time(make, args):
        program = make(3)
        out = program(*args)
        seen.append((args, out, program.lower(*args).as_text()))
        return {"median_s": 1e-3, "spread_s": 0.0}

    monkeypatch.setattr(harness, "device_time", fake_time)
    case = harness.Row("ag_matmul", "s", 64, 32, 48, "")
    rows = harness.bound_rows(case, mesh, "float32", lambda _: None, gemm=lambda a, w: a @ w,
                              gemm_shapes=((64, 32), (32, 24)), collective=lambda x: x * 2,
                              collective_shape=(8 * n, 4), spec=P("tp", None))
    assert [r.variant for r in rows] == ["gemm_alone", "collective_alone", "ideal"]
    (a, w), out, text = seen[0]
    for arr, local in ((a, (64, 32)), (w, (32, 24)), (out, (64, 32))):
        assert {s.data.shape for s in arr.addressable_shards} == {local}
        assert {s.device for s in arr.addressable_shards} == set(jax.devices())
    # Each device's operands differ (random per device), and nothing moves between devices.
    assert not np.array_equal(np.asarray(a.addressable_shards[0].data), np.asarray(a.addressable_shards[1].data))
    assert not any(c in text for c in ("all_gather", "all-gather", "reduce_scatter", "all_reduce", "psum"))


@pytest.mark.slow
def test_resume_refuses_a_run_of_another_kind(tmp_path):
    earlier = bench.run(["ag_matmul"], {"a": (64, 32, 64)}, "float32", "none", str(tmp_path / "one"), windowed=False)
    for key, other in (("n_devices", 2), ("dtype", "bfloat16"), ("device", "NVIDIA H100 80GB HBM3")):
        with pytest.raises(ValueError, match=f"not comparable: {key}"):
            bench.run(["ag_matmul"], {"a": (64, 32, 64)}, "float32", "none", str(tmp_path / "two"), windowed=False,
                      resume={**earlier, key: other})
    # A file from before the GEMM-alone bound ran on every device has no "gemm_bound": one device then.
    older = {k: v for k, v in earlier.items() if k != "gemm_bound"}
    with pytest.raises(ValueError, match="not comparable: gemm_bound 'one device'"):
        bench.run(["ag_matmul"], {"a": (64, 32, 64)}, "float32", "none", str(tmp_path / "two"), windowed=False,
                  resume=older)
    with pytest.raises(ValueError, match="not a bench.json"):
        bench.run(["ag_matmul"], {"a": (64, 32, 64)}, "float32", "none", str(tmp_path / "two"), resume={"cases": []})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**earlier, "n_devices": 3}))
    done = subprocess.run([sys.executable, "-m", "ficco_jax", "bench", "--op", "ag_matmul", "--shape", "64,32,64",
                           "--schedules", "none", "--no-windowed", "--out", str(tmp_path / "cli"), "--resume", str(bad)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "not comparable: n_devices 3" in done.stderr and "Traceback" not in done.stderr


def test_table_on_cpu_computes_no_speedup():
    from ficco_jax.tools import report

    rows = [{"op": "ag_matmul", "shape": "s", "M": 8, "K": 8, "N": 8, "variant": v, "median_ms": ms, "spread_ms": 0.01,
             "verified": True, "selected": v == "ficco:none", "note": ""}
            for v, ms in (("jax_seq", 0.2), ("gemm_alone", 0.01), ("collective_alone", 0.15), ("ideal", 0.15),
                          ("ficco:none", 0.18))]
    result = {"n_devices": 8, "device": "cpu", "platform": "cpu", "dtype": "float32", "jax": "0", "commit": "c",
              "date": "t", "method": "m", "rows": rows}
    table = report.markdown_table(result)
    cells = [c.strip() for c in next(x for x in table.splitlines() if x.startswith("| ag_matmul")).strip("|").split("|")]
    assert cells[10:] == ["n/a", "n/a"], cells
    assert "no speed-up" in table


# ------------------------------------------------------------------------------------------------
# XLA's windowed einsum runs in a child process beside bench: bounded, and its failures explained
# ------------------------------------------------------------------------------------------------
def _stub_child(monkeypatch, code: str):
    """Make every windowed-einsum child `python -c code` (counted in the returned list)."""
    started = []

    def command(op, M, K, N, dtype):
        started.append((op, M, K, N, dtype))
        return [sys.executable, "-c", code]

    monkeypatch.setattr(bench, "windowed_command", command)
    return started


@pytest.mark.slow
def test_a_windowed_child_that_never_answers_is_killed_and_later_cases_are_skipped(monkeypatch):
    import time

    started = _stub_child(monkeypatch, "import sys, time; print('_windowed step: compiling and timing', "
                                       "file=sys.stderr, flush=True); time.sleep(120)")
    children = bench.WindowedChildren(timeout_s=3)
    t0 = time.monotonic()
    row = children.row("ag_matmul", "qkv", 64, 32, 64, "bfloat16")
    assert time.monotonic() - t0 < 60
    assert row.median_ms is None and row.variant == "xla_windowed_einsum"
    assert row.note.startswith("error: timeout: the windowed-einsum child gave no result in 3 s"), row.note
    assert "its last step: compiling and timing" in row.note  # what it was waiting in
    for fix in ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.5", "--no-windowed", f"Time it alone: XLA_FLAGS='{bench.WINDOWED_FLAGS}' python -c"):
        assert fix in row.note, fix
    later = children.row("matmul_rs", "qkv", 64, 32, 64, "bfloat16")
    assert len(started) == 1, "a later case started a child after one timed out"
    assert later.median_ms is None and later.note.startswith("skipped: the windowed-einsum child of ag_matmul qkv")


def test_a_windowed_child_that_fails_names_its_error(monkeypatch):
    _stub_child(monkeypatch, "import sys; print('_windowed step: allocating the operands', file=sys.stderr); "
                             "print('RESOURCE_EXHAUSTED: out of memory allocating 2.5GiB', file=sys.stderr); sys.exit(1)")
    children = bench.WindowedChildren(timeout_s=60)
    row = children.row("ag_matmul", "qkv", 64, 32, 64, "bfloat16")
    assert row.median_ms is None and "status 1" in row.note and "RESOURCE_EXHAUSTED" in row.note, row.note
    assert "'allocating the operands'" in row.note and children.timed_out is None


def test_the_windowed_child_does_not_preallocate_beside_bench():
    env = bench.windowed_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                              "XLA_PYTHON_CLIENT_PREALLOCATE": "true", "PATH": "/bin"})
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and env["PATH"] == "/bin"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 " + bench.WINDOWED_FLAGS


def test_the_windowed_child_runs_on_cpu_devices():
    # The real child, with bench's command and environment: its JSON line is read into the row.
    row = bench.WindowedChildren(timeout_s=240).row("matmul_rs", "t", 64, 32, 64, "float32")
    assert row.median_ms is not None and row.median_ms > 0, row.note
    assert row.note.startswith("child process, XLA_FLAGS+=")
    assert bench.windowed_command("matmul_rs", 64, 32, 64, "float32")[1:] == [
        "-m", "ficco_jax", "_windowed", "matmul_rs", "64", "32", "64", "float32"]


@pytest.mark.parametrize("dtype, target", [("float8_e4m3fn", "ficco_ag_matmul_scaled"), ("bfloat16", "ficco_ag_matmul")])
def test_a_timeline_runs_the_program_the_bench_times(mesh1d, dtype, target):
    # trace_op.py and host_time.py record bench's program: for FP8 the scaled op on quantized operands.
    args, body_of = bench.case_inputs("ag_matmul", local_shapes("ag_matmul", 64, 32, 64, 8), dtype, mesh1d)
    assert [a.dtype.name for a in args] == [dtype, dtype]
    body = body_of("ag_matmul", Schedule.parse("dma/direct/c1"))
    program = jax.jit(jax.shard_map(body, mesh=mesh1d, in_specs=(P("tp", None), P(None, "tp")),
                                    out_specs=P(None, "tp"))).lower(*args).as_text()
    assert f"@{target}(" in program, program[-1500:]
    bench.record_timeline(mesh1d, "ag_matmul", Schedule.parse("dma/direct/c1"), 64, 32, 64, 2, None, dtype=dtype)


@pytest.mark.slow
def test_trace_op_takes_a_dtype(tmp_path):
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "benchmarks/suites/trace_op.py", "matmul_rs", "dma/direct/c2", "64", "32", "64",
                          "2", "--dtype", "fp8"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "matmul_rs dma/direct/c2 64,32,64 float8_e4m3fn x2" in run.stdout, run.stdout
