"""benchmarks/peers/tp_table.py: bench's results and the peers' in one table, one machine only; run.py
printing it where `compare`, or `bench` and `peers`, ran; the `compare` suite end to end on CPU."""
import dataclasses
import json
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TABLE = REPO / "benchmarks" / "peers" / "tp_table.py"
sys.path.insert(0, str(REPO / "benchmarks"))
from peers import tp_table  # noqa: E402 - benchmarks/ is not a package

DEVICE = "NVIDIA H100 80GB HBM3"


def _bench(device=DEVICE, n=2):
    def row(op, variant, ms, selected=False):
        return {"op": op, "shape": "qkv", "M": 8192, "K": 8192, "N": 10240, "variant": variant, "median_ms": ms,
                "selected": selected}
    rows = []
    for op, scale in (("ag_matmul", 1.0), ("matmul_rs", 1.1)):
        rows += [row(op, "jax_seq", 1.25 * scale), row(op, "jax_ring", 1.2 * scale),
                 row(op, "ficco:dma/direct/c1", 1.02 * scale, selected=op == "ag_matmul"),
                 row(op, "ficco:dma/direct/c2", 1.01 * scale, selected=op == "matmul_rs"),
                 row(op, "ficco:xla/ring/c2", None), row(op, "gemm_alone", 1.0 * scale), row(op, "ideal", 1.0 * scale)]
    return {"device": device, "n_devices": n, "dtype": "bfloat16", "platform": "gpu", "commit": "abc1234",
            "date": "2026-11-28", "method": "device time", "rows": rows}


QKV = {"shape": "qkv", "M": 8192, "K": 8192, "N": 10240}


def _torch(device=DEVICE, n=2, dtype="bfloat16", **dims):
    return {"peer": "pytorch", "torch": "2.11", "device": device, "n": n, "dtype": dtype, "commit": "abc1234",
            "method": "CUDA events",
            "rows": [{**QKV, **dims, "ag_seq": 1.3, "ag_async_tp": 0.99, "rs_seq": 1.4, "rs_async_tp": 1.2}]}


def _windowed(device=DEVICE, n=2):
    return {"peer": "jax", "device": device, "n": n, "dtype": "bfloat16", "commit": "abc1234", "method": "device time",
            "rows": [{**QKV, "ag_xla_windowed": 1.5, "rs_xla_windowed": 1.6}]}


def test_one_row_per_case_with_every_peer():
    ag, rs = tp_table.rows(_bench(), _torch(), _windowed())
    assert (ag["op"], ag["JAX seq"], ag["XLA windowed"], ag["PyTorch seq"], ag["PyTorch async-TP"]) == \
        ("ag_matmul", 1.25, 1.5, 1.3, 0.99)
    # auto: the selected variant; best: the fastest timed one (a variant without a time is no candidate)
    assert (ag["ficco auto (pick)"], ag["pick"], ag["ficco best (schedule)"], ag["best"]) == \
        (1.02, "dma/direct/c1", 1.01, "dma/direct/c2")
    assert ag["fastest"] == "PyTorch async-TP" and rs["fastest"] == "ficco auto"  # a tie with best goes to auto
    assert (ag["auto_fastest"], rs["auto_fastest"]) == (False, True)
    assert rs["ficco auto (pick)"] == pytest.approx(1.111) and rs["pick"] == "dma/direct/c2"
    text = tp_table.markdown(_bench(), _torch(), _windowed())
    assert "| ag_matmul | qkv 8192,8192,10240 | 1.000 | 1.250 | 1.500 | 1.300 | 0.990 | 1.020 (dma/direct/c1) |" in text
    assert "1.020x | PyTorch async-TP |" in text and "2 x NVIDIA H100 80GB HBM3" in text
    assert "torch_tp at `abc1234`; CUDA events" in text and "jax_tp --windowed at `abc1234`" in text


def test_a_peer_faster_by_less_than_autos_spread_is_marked():
    """A peer ahead of auto by less than auto's half-range is named fastest, with the mark that the timing
    cannot tell them apart; the auto cell shows that spread. Further away than the spread: no mark."""
    bench = _bench()
    for r in bench["rows"]:
        if r.get("selected"):
            r["spread_ms"] = 0.04
    ag, rs = tp_table.rows(bench, _torch(), _windowed())
    assert ag["fastest"] == "PyTorch async-TP" and ag["auto_within_spread"] and not ag["auto_fastest"]
    assert rs["auto_fastest"] and not rs["auto_within_spread"]  # the fastest itself is never "within"
    text = tp_table.markdown(bench, _torch(), _windowed())
    assert "| 1.020 ± 0.040 (dma/direct/c1) |" in text and "| PyTorch async-TP (auto within its ±) |" in text
    for r in bench["rows"]:
        if r.get("selected"):
            r["spread_ms"] = 0.02  # 1.02 - 0.02 = 1.00 > 0.99: a real difference
    ag, _ = tp_table.rows(bench, _torch(), _windowed())
    text = tp_table.markdown(bench, _torch(), _windowed())
    assert not ag["auto_within_spread"] and "| PyTorch async-TP |" in text and "its ±) |" not in text


def test_missing_or_skipped_peers_leave_dashes():
    (ag, _) = tp_table.rows(_bench())
    assert ag["PyTorch seq"] is None and ag["XLA windowed"] is None and ag["fastest"] == "ficco best"
    assert "| 1.250 | — | — | — |" in tp_table.markdown(_bench())
    skipped = {"skipped": "no CUDA device visible to torch"}  # what a peer that cannot run writes
    text = tp_table.markdown(_bench(), skipped, _windowed())
    assert "- PyTorch: skipped: no CUDA device visible to torch" in text and "| 1.250 | 1.500 | — | — |" in text


def test_a_tie_between_auto_and_jax_sequential_is_autos():
    """auto's pick "none" is JAX sequential's program, timed once: the table and the count agree on it."""
    bench = _bench()
    for r in bench["rows"]:
        if r["variant"].startswith("ficco:dma"):
            r.update(median_ms=1.25 * (1.1 if r["op"] == "matmul_rs" else 1), selected=False)
    bench["rows"] += [dict(r, variant="ficco:none", selected=True) for r in bench["rows"] if r["variant"] == "jax_seq"]
    for row in tp_table.rows(bench):
        assert row["pick"] == "none" and row["fastest"] == "ficco auto" and row["auto_fastest"], row


def test_bench_windowed_rows_serve_without_the_peer_file():
    bench = _bench()
    bench["rows"] += [dict(r, variant="xla_windowed_einsum", median_ms=1.7) for r in bench["rows"]
                      if r["variant"] == "jax_seq"]
    (ag, _) = tp_table.rows(bench)
    assert ag["XLA windowed"] == 1.7 and "bench's own child process" in tp_table.markdown(bench)
    (ag, _) = tp_table.rows(bench, None, _windowed())  # the file given wins, and the sources say so
    assert ag["XLA windowed"] == 1.5


def test_cpu_times_draw_no_ratio():
    bench = dict(_bench(), platform="cpu")
    text = tp_table.markdown(bench)
    assert "| n/a | n/a |" in text and "On CPU the times are host loops" in text


@pytest.mark.slow
@pytest.mark.parametrize("other", [{"device": "NVIDIA H200"}, {"n": 4}, {"dtype": "float8_e4m3fn"}, {"M": 4096}])
def test_files_of_another_machine_or_problem_are_refused(tmp_path, other):
    (tmp_path / "bench.json").write_text(json.dumps(_bench()))
    (tmp_path / "torch.json").write_text(json.dumps(_torch(**other)))
    done = subprocess.run([sys.executable, str(TABLE), str(tmp_path / "bench.json"), "--torch",
                           str(tmp_path / "torch.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "one table holds one" in done.stderr and done.stdout == ""


@pytest.mark.slow
def test_a_file_in_the_wrong_place_is_named(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps(_bench()))
    done = subprocess.run([sys.executable, str(TABLE), str(tmp_path / "bench.json"), "--windowed",
                           str(tmp_path / "bench.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "jax_tp_windowed file is not jax_tp_windowed.json" in done.stderr
    (tmp_path / "jax_tp.json").write_text(json.dumps(dict(_windowed(), rows=[{**QKV, "ag_seq": 1.3}])))
    done = subprocess.run([sys.executable, str(TABLE), str(tmp_path / "bench.json"), "--windowed",
                           str(tmp_path / "jax_tp.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "jax_tp_windowed file is not jax_tp_windowed.json" in done.stderr
    done = subprocess.run([sys.executable, str(TABLE), str(tmp_path / "nope.json")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "cannot read" in done.stderr and "nope.json" in done.stderr


def test_run_prints_the_table_where_bench_and_peers_ran(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import run  # noqa: PLC0415 - benchmarks/ is not a package

    (tmp_path / "bench").mkdir()
    (tmp_path / "peers").mkdir()
    (tmp_path / "bench" / "bench.json").write_text(json.dumps(_bench()))
    (tmp_path / "peers" / "jax_tp_windowed.json").write_text(json.dumps(_windowed()))
    assert run.comparison_table(str(tmp_path), ["bench"], since=0) is None
    table = run.comparison_table(str(tmp_path), ["bench", "peers"], since=0)
    assert "| 1.250 | 1.500 | — | — |" in table  # windowed in its column, PyTorch not run
    assert (tmp_path / "tp_table.md").read_text() == table
    (tmp_path / "peers" / "torch_tp.json").write_text(json.dumps(_torch(n=8)))
    assert run.comparison_table(str(tmp_path), ["bench", "peers"], since=0).startswith("No comparison table: torch_tp")
    # an earlier run's files in the same folder are not this run's results
    assert run.comparison_table(str(tmp_path), ["bench", "peers"], since=time.time() + 60) is None
    (tmp_path / "peers" / "torch_tp.json").unlink()
    (tmp_path / "bench" / "bench.json").write_text(json.dumps(dict(_bench(), rows=[{"op": "ag_matmul", "shape": "q"}])))
    assert "malformed (KeyError" in run.comparison_table(str(tmp_path), ["bench", "peers"], since=0)


def test_run_prints_the_compare_suites_table(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import catalog  # noqa: PLC0415 - benchmarks/ is not a package
    import run  # noqa: PLC0415

    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "bench.json").write_text(json.dumps(_bench()))
    (tmp_path / "compare" / "torch_tp.json").write_text(json.dumps(_torch()))
    table = run.comparison_table(str(tmp_path), ["build", "compare"], since=0)
    assert "| 1.250 | — | 1.300 | 0.990 |" in table  # PyTorch in its columns, XLA windowed not run
    assert catalog._compare_result(str(tmp_path / "compare")) == \
        "auto the fastest in 1 of 2 cases, within its spread of the fastest in 0 more; peers: torch_tp"


@pytest.mark.slow
def test_compare_starts_without_an_earlier_runs_files(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import catalog  # noqa: PLC0415 - benchmarks/ is not a package

    for name in ("bench", "torch_tp", "jax_tp_windowed", "keep"):
        (tmp_path / f"{name}.json").write_text("{}")
    ctx = catalog.Context(python=sys.executable, out=str(tmp_path), gpus=2, limit_s=480)
    labels = [step.label for step in catalog.SUITES["compare"].steps(ctx)]
    assert labels == ["bench", "torch_tp", "jax_tp_windowed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.json"]
    bench, note = catalog.SUITES["compare"].steps(dataclasses.replace(ctx, limit_s=200))
    assert "--budget-s" in bench.argv and int(bench.argv[bench.argv.index("--budget-s") + 1]) == 80
    assert note.argv is None and "leaves no time for the peers" in note.note


@pytest.mark.slow
def test_the_compare_suite_runs_on_cpu(tmp_path):
    """`run.py compare --cpu`: bench at a tiny shape, the peers skipped saying why, the table, the summary."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "compare", "--cpu", "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "need 2 or more GPUs: skipped" in done.stdout
    table = (tmp_path / "tp_table.md").read_text()
    assert table in done.stdout and "| ag_matmul | tiny_M256_K128_N256 256,128,256 |" in table
    assert done.stdout.rstrip().splitlines()[-1].startswith("| compare | 0 |")
    assert "cases on CPU (times meaningless); peers: none |" in done.stdout.rstrip().splitlines()[-1]
