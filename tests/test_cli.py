"""`python -m ficco_jax`: the listing and help of every subcommand, `rank` (and `explain`, which is no
command), the hidden `_windowed` child, and the demo on one and on eight CPU devices."""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ficco_jax.schedule import local_shapes
from ficco_jax.tools import bench, cli
from ficco_jax.tools.harness import fitting_schedules, listed_schedules
from ficco_jax.tuning import select

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = ["demo", "bench", "rank", "characterize", "calibrate", "accuracy"]
# Words that speak of how the project was built, not of what the product does.
NOT_PRODUCT_TEXT = re.compile(r"\b(issue|session|stage)s?\b", re.IGNORECASE)
# A speed-up cell of a table: "1.06x" (the demo's CPU and one-device tables must have none).
SPEEDUP = re.compile(r"\d+\.\d+x\b")


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _cli(*args, devices=8, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run([sys.executable, "-m", "ficco_jax", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_help_lists_every_public_subcommand_with_a_line_of_help():
    done = _cli("--help")
    assert done.returncode == 0, done.stderr
    for name in PUBLIC:
        assert re.search(rf"\b{name}\b", done.stdout), name
    assert "_windowed" not in done.stdout
    assert not NOT_PRODUCT_TEXT.search(done.stdout), done.stdout
    listed = {a.dest: a.help for a in _subparsers(cli.build_parser())._choices_actions}
    assert set(listed) == {"demo", "bench", "rank", "characterize", "calibrate", "accuracy"}
    assert all(listed.values()), listed


def test_every_option_of_every_subcommand_has_help():
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in _subparsers(cli.build_parser()).choices.items() for action in sub._actions
               if not action.help]
    assert not missing, missing


def test_rank_is_the_cost_models_ranking(capsys):
    argv = ["--op", "ag_matmul", "--shape", "8192,8192,10240", "--axis-size", "4", "--top", "5"]
    assert cli.main(["rank", *argv]) == 0
    ranked = capsys.readouterr().out
    assert "predicted ms" in ranked and "choice: " in ranked
    assert len([line for line in ranked.splitlines() if re.match(r"\s+\d+\.\d{3}  ", line)]) == 5
    helps = {a.dest: a.help for a in _subparsers(cli.build_parser())._choices_actions}
    assert "ficco_jax.explain(fn, *args)" in helps["rank"]


def test_explain_is_no_command_and_says_where_each_answer_is():
    """`explain` is the Python API's report of a function; on the command line it would be another
    question (an op's schedules), so the name is refused with both places to look."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["explain", "--op", "ag_matmul", "--shape", "8192,8192,10240"])
    said = str(exit_.value.code)
    assert "no such command" in said and "python -m ficco_jax rank --op" in said and "ficco_jax.explain(fn, *args)" in said
    assert "explain" not in _subparsers(cli.build_parser()).choices
    done = _cli("explain", "mymodel:fn")
    assert done.returncode != 0 and "Traceback" not in done.stderr and "python -m ficco_jax rank" in done.stderr


def test_rank_rejects_an_unknown_dtype():
    done = _cli("rank", "--op", "ag_matmul", "--shape", "64,64,64", "--dtype", "int3")
    assert done.returncode != 0 and "rank --dtype 'int3'" in done.stderr and "Traceback" not in done.stderr


def _bad_inputs(tmp):
    """(argv, what the error must say) of inputs the command line refuses without a traceback."""
    (tmp / "flat.json").write_text(json.dumps({"name": "flat", "peak_tflops": {"bfloat16": 0.0}}))
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "text.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    rank = ["rank", "--op", "ag_matmul"]
    anchors = len(bench.SHAPE_SETS["anchors"])
    return [
        ([*rank, "--shape", "64,64,64", "--axis-size", "0"], "argument --axis-size: expected an integer >= 1, found '0'"),
        ([*rank, "--shape", "0,0,0"], "--shape '0,0,0': expected M,K,N (three integers > 0"),
        ([*rank, "--shape", "anchors"], f"rank --shape 'anchors': rank takes one shape, and 'anchors' names {anchors} ("),
        ([*rank, "--shape", "llama405b"], "rank takes one shape"),
        ([*rank, "--shape", "64,64,64", "--profile", str(tmp / "text.txt")],
         f"rank --profile {tmp / 'text.txt'}: not a JSON profile (Expecting value"),
        ([*rank, "--shape", "64,64,64", "--profile", str(tmp / "text.txt")], "`python -m ficco_jax calibrate --out FILE` wrote"),
        ([*rank, "--shape", "64,64,64", "--profile", str(tmp)], "rank --profile: [Errno 21] Is a directory"),
        ([*rank, "--shape", "64,64,64", "--profile", str(tmp / "flat.json")],
         "peak_tflops.bfloat16 = 0.0, expected a finite number > 0"),
        ([*rank, "--shape", "64,64,64", "--profile", str(tmp / "list.json")], "expected a JSON object, found list"),
        (["calibrate", "--characterization", str(tmp / "missing.json")],
         f"calibrate --characterization {tmp / 'missing.json'}: cannot read it as JSON"),
        (["calibrate", "--characterization", str(tmp / "list.json"), "--out", str(tmp / "new" / "p.json")],
         f"calibrate: {tmp / 'list.json'}: cannot read it"),
        (["calibrate", "--characterization", str(tmp / "list.json"), "--out", str(tmp / "new" / "p.json")],
         "give a file that `python -m ficco_jax characterize` wrote"),
        (["accuracy", "--replay", str(tmp / "list.json")], "accuracy --replay: cannot read it"),
        (["accuracy", "--replay", str(tmp / "list.json")],
         "give a file that `python -m ficco_jax bench` (bench.json) or `accuracy` (accuracy.json) wrote"),
        (["bench", "--budget-s", "-5"], "argument --budget-s: expected a number of seconds > 0 (e.g. 600), found '-5'"),
        (["bench", "--budget-s", "0"], "argument --budget-s: expected a number of seconds > 0"),
        (["bench", "--budget-s", "nan"], "argument --budget-s: expected a number of seconds > 0"),
        (["accuracy", "--budget-s", "-1"], "argument --budget-s: expected a number of seconds > 0"),
        (["bench", "--rounds", "0"], "argument --rounds: expected an integer >= 1, found '0'"),
        (["accuracy", "--top", "-1"], "argument --top: expected an integer >= 0, found '-1'"),
        (["accuracy", "--axis-size", "1"], "argument --axis-size: expected an integer >= 2, found '1'"),
        (["_windowed", "ag_matmul", "0", "32", "16", "float32"], "argument M: expected an integer >= 1, found '0'"),
        (["bench", "--op", "moe", "--moe-shape", "0,0,0,0,0"], "--moe-shape '0,0,0,0,0': expected T,d,f,E,k (integers > 0"),
    ]


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    for argv, says in _bad_inputs(tmp_path):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        text = f"{exit_.value.code} {capsys.readouterr().err}"
        assert exit_.value.code != 0 and says in text, (argv, text)


def test_windowed_child_parses_apart_from_the_listing(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "windowed_einsum_child",
                        lambda *a: seen.append(a) or {"median_ms": 1.5, "spread_ms": 0.1})
    assert cli.main(["_windowed", "ag_matmul", "64", "32", "16", "float32"]) == 0
    assert seen == [("ag_matmul", 64, 32, 16, "float32")]
    assert json.loads(capsys.readouterr().out) == {"median_ms": 1.5, "spread_ms": 0.1}


def test_demo_on_one_device_says_there_is_nothing_to_overlap(tmp_path):
    done = _cli("demo", "--out", str(tmp_path), devices=1)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    text = " ".join(out.split())
    assert "two or more devices in a group" in text and "keeps the plain path" in text
    rows = [line for line in out.splitlines() if line.startswith(("| ag_matmul", "| matmul_rs"))]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "none" and cells[5] == "n/a" and cells[6] == "yes", row
    assert not SPEEDUP.search(out) and not NOT_PRODUCT_TEXT.search(out + done.stderr), out
    progress = re.findall(r"\[\s*(\d+)/(\d+)\]", done.stderr)
    assert progress[-1] == ("4", "4"), progress
    assert f"Results are written under {tmp_path}/ (demo.json)" in out and f"Written: {tmp_path / 'demo.json'}" in out
    assert re.search(r"^Extension: .*CUDA backend", out, re.MULTILINE) and "Times: ms per op" in out, out
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["n_devices"] == 1 and all(r["verified"] for r in result["rows"]) and len(result["rows"]) == 4


@pytest.mark.slow  # the demo runs every schedule on 8 devices: minutes of compiles (the one-device run starts it)
def test_demo_readme_command_on_eight_cpu_devices(tmp_path):
    done = _cli("demo", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "NOT meaningful" in out and "no speed-up" in out
    rows = [line for line in out.splitlines() if line.startswith(("| ag_matmul", "| matmul_rs"))]
    assert len(rows) == 2, out
    for row in rows:
        assert row.rstrip().endswith("| n/a | n/a |"), row
    assert not SPEEDUP.search("\n".join(rows)) and not NOT_PRODUCT_TEXT.search(out + done.stderr)
    # every variant of both ops was verified: JAX sequential, each schedule of "all" that fits, JAX's ring
    n, variants = 8, 0
    for op in ("ag_matmul", "matmul_rs"):
        shapes = local_shapes(op, *bench.CPU_SHAPES["tiny_M256_K128_N256"], n)
        fits, unfit = fitting_schedules(op, listed_schedules(op, "all", n, select.available_comms()), shapes, n)
        variants += len(bench.variants(op, shapes, "float32", n, fits)[0])
        assert not unfit, unfit
    verified = re.search(r"Verified against the reference before timing: (\d+)/(\d+)", out)
    assert verified and verified.groups() == (str(variants), str(variants)) and variants > 2 * 3, out
    k, total = re.findall(r"\[\s*(\d+)/(\d+)\]", done.stderr)[-1]
    assert k == total, done.stderr[-500:]
