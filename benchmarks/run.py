"""The one benchmark entry point: run named suites, each under a time limit, then a summary table.

    python benchmarks/run.py SUITE [SUITE ...] [--out DIR] [--budget SECONDS] [-- SUITE OPTIONS]
    python benchmarks/run.py --list

Suites (benchmarks/catalog.py; benchmarks/README.md says what each measures and how long it
takes): build, tests, demo, bench, peers, compare, collectives, accuracy, e2e, hang, faults, soak, load, multiprocess,
characterize, fp8, host, capture, trace, timeline. `all` runs every suite the machine can.

Each suite writes its logs and JSON under OUT/<suite>/ (OUT: --out, else $OUT, else out/) and the
run prints a table last: suite, exit status, seconds, one-line result. A suite that reaches its
time limit is stopped with a message saying so; the next suite still runs. Suites that need GPUs
are skipped, saying so, on a machine without them (no `nvidia-smi -L`, or --cpu); there the
others run on 8 virtual CPU devices. Options after `--` go to every selected suite that takes
them (e.g. `bench -- --shape 8192,8192,10240 --schedules dma`).

For every child: NCCL_NVLS_ENABLE=0 and the other multicast switches off (NVSwitch
multicast stays unused), PYTHONUNBUFFERED=1, /opt/torch/.venv/bin first on PATH where
it exists, FICCO_COMMIT from a `.commit` file beside the tree where one exists (a tree made by
`git archive` has no .git to ask). Exit status: 0 if every suite that ran exited 0.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import catalog  # noqa: E402
from peers import tp_table  # noqa: E402

VENV = "/opt/torch/.venv/bin"
FIXED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1"}
CPU_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
#: Seconds kept back from a suite's limit for killing and reporting.
MARGIN_S = 5


def parse_args(argv: list[str]) -> argparse.Namespace:
    options: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, options = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="*", metavar="SUITE", help="suite names, or all")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out", help="results dir (default $OUT, else out)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (suites share it)")
    parser.add_argument("--limit", type=float, default=None, help="seconds per suite, instead of each one's default")
    parser.add_argument("--cpu", action="store_true", help="run as on a machine without GPUs")
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    parser.add_argument("--pack", action="store_true",
                        help="at the end, pack every suite's files into OUT/results.tar.gz (for a remote GPU "
                             "machine that hands back only a few files)")
    args = parser.parse_args(argv)
    args.options = tuple(options)
    for flag in ("budget", "limit"):
        value = getattr(args, flag)
        if value is not None and not value > MARGIN_S + 1:  # (NaN fails too)
            parser.error(f"--{flag} {value:g}: give more than {MARGIN_S + 1:g} seconds (a suite is stopped "
                         f"{MARGIN_S:g} s before its limit)")
    if not args.list and not args.suites:
        parser.error("name at least one suite (or --list); known: " + ", ".join(catalog.SUITES))
    unknown = [s for s in args.suites if s not in catalog.SUITES and s != "all"]
    if unknown:
        parser.error(f"unknown suite {', '.join(unknown)}; known: {', '.join(catalog.SUITES)}, all")
    if args.suites == ["all"] or "all" in args.suites:
        args.suites = list(catalog.SUITES)
    return args


def count_gpus() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


def child_env(gpus: int) -> dict:
    env = dict(os.environ, **FIXED_ENV)
    if os.path.isdir(VENV):
        env["PATH"] = VENV + os.pathsep + env.get("PATH", "")
    commit_file = os.path.join(REPO, ".commit")
    if not env.get("FICCO_COMMIT") and os.path.isfile(commit_file):
        env["FICCO_COMMIT"] = open(commit_file).read().strip()
    if not gpus:
        env.update(CPU_ENV, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " " + CPU_ENV["XLA_FLAGS"]).strip())
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def interpreter() -> str:
    venv_python = os.path.join(VENV, "python3")
    return venv_python if os.access(venv_python, os.X_OK) else sys.executable


def list_suites() -> str:
    lines = ["| suite | machine | limit s | what |", "|---|---|---|---|"]
    for s in catalog.SUITES.values():
        lines.append(f"| {s.name} | {s.machine} | {s.limit_s} | {s.what} |")
    return "\n".join(lines)


def run_step(step, env: dict, log_path: str, seconds: float) -> tuple[int | None, float]:
    """Run one step with its output in log_path; (exit status or None if cut by the limit, seconds)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(step.argv) + "\n")
        log.flush()
        proc = subprocess.Popen(step.argv, cwd=REPO, env=dict(env, **step.env), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    return rc, time.monotonic() - start


def tail(path: str, lines: int = 12) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-lines:])


def result_line(suite, out: str, logs: list[str]) -> str:
    """The suite's own result line, else the last log line matching its pattern, else the last line."""
    if callable(suite.result):
        try:
            return suite.result(out)[:110]
        except (OSError, ValueError) as exc:
            return f"no result: {type(exc).__name__}: {exc}"[:110]
    text = [line.strip() for path in logs for line in open(path, errors="replace") if line.strip()]
    if suite.result:
        hits = [line for line in text if re.search(suite.result, line)]
        if hits:
            return hits[-1][:110]
    return text[-1][:110] if text else ""


def run_suite(suite, args, env: dict, gpus: int, limit_s: float) -> tuple[str, float, str]:
    """(status, seconds, result) of one suite; status is 0, another exit status, CUT or skipped."""
    if gpus < suite.min_gpus:
        why = f"needs {suite.min_gpus}+ GPUs, found {gpus}"
        print(f"== {suite.name}: skipped: {why}", flush=True)
        return "skipped", 0.0, why
    out = os.path.abspath(os.path.join(args.out, suite.name))
    os.makedirs(out, exist_ok=True)
    ctx = catalog.Context(python=interpreter(), out=out, gpus=gpus, limit_s=int(limit_s),
                          options=args.options if suite.takes_options else ())
    env = dict(env, OUT=out, FICCO_PYTHON=ctx.python)
    start, status, logs = time.monotonic(), 0, []
    print(f"== {suite.name}: {suite.what} (limit {limit_s:.0f} s, out {out})", flush=True)
    for step in suite.steps(ctx):
        if step.argv is None:
            print(f"-- {suite.name}/{step.label}: {step.note}", flush=True)
            continue
        left = limit_s - (time.monotonic() - start) - MARGIN_S
        if left < 1:
            print(f"CUT: {suite.name}/{step.label} not started: the suite's {limit_s:.0f} s limit is spent", flush=True)
            status = "CUT"
            break
        logs.append(os.path.join(out, f"{step.label}.log"))
        rc, seconds = run_step(step, env, logs[-1], left)
        print(f"-- {suite.name}/{step.label}: " + (f"exit {rc}" if rc is not None else "CUT") +
              f" after {seconds:.0f} s; log {logs[-1]}", flush=True)
        print(tail(logs[-1]), end="", flush=True)
        if rc is None:
            print(f"CUT: {suite.name}/{step.label} reached the suite's time limit of {limit_s:.0f} s and was "
                  f"stopped (raise it with --limit or --budget)", flush=True)
            status = "CUT"
            break
        if rc != 0 and status == 0:
            status = rc
    return status, time.monotonic() - start, result_line(suite, out, logs) if logs else "nothing ran"


def summary(rows: list[tuple]) -> str:
    lines = ["| suite | rc | seconds | result |", "|---|---|---|---|"]
    lines += [f"| {name} | {status} | {seconds:.0f} | {result.replace('|', '/')} |"
              for name, status, seconds, result in rows]
    return "\n".join(lines)


def write_summary(out: str, rows: list[tuple], gpus: int, env: dict, pack: bool) -> str:
    """OUT/summary.md and summary.json; with `pack`, every suite folder moved into OUT/results.tar.gz."""
    table = summary(rows)
    with open(os.path.join(out, "summary.md"), "w") as fh:
        fh.write(table + "\n")
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump({"gpus": gpus, "commit": env.get("FICCO_COMMIT"), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                   time.gmtime()), "suites": [dict(zip(("suite", "rc", "seconds", "result"), r)) for r in rows]},
                  fh, indent=1)
    if pack:
        folders = [name for name, *_ in rows if os.path.isdir(os.path.join(out, name))]
        with tarfile.open(os.path.join(out, "results.tar.gz"), "w:gz") as tar:
            for name in folders:
                tar.add(os.path.join(out, name), arcname=name)
        for name in folders:
            shutil.rmtree(os.path.join(out, name))
    return table


def comparison_table(out: str, suites: list[str], since: float) -> str | None:
    """Where `compare` ran, or `bench` and `peers` together: the tensor-parallel results they wrote
    since `since` (this run's start) in one table (peers/tp_table.py), also written to OUT/tp_table.md;
    None where neither ran or bench wrote no result in this run."""
    if "compare" in suites:
        dirs = (os.path.join(out, "compare"),) * 2
    elif {"bench", "peers"} <= set(suites):
        dirs = (os.path.join(out, "bench"), os.path.join(out, "peers"))
    else:
        return None
    try:
        files = tp_table.from_dirs(*dirs, since=since)
        if files[0] is None:
            return None
        table = tp_table.markdown(*files)
    except tp_table.Mismatch as e:
        return f"No comparison table: {e}\n"
    except (KeyError, TypeError) as e:  # a file of the right kind with a field missing or of another type
        return f"No comparison table: a result file is malformed ({type(e).__name__}: {e})\n"
    with open(os.path.join(out, "tp_table.md"), "w") as fh:
        fh.write(table)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        print(list_suites())
        return 0
    gpus = 0 if args.cpu else count_gpus()
    env = child_env(gpus)
    os.makedirs(args.out, exist_ok=True)
    if gpus:
        with open(os.path.join(args.out, "gpus.txt"), "w") as fh:
            for cmd in (["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                        ["nvidia-smi", "topo", "-m"]):
                try:
                    fh.write(subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    fh.write(f"{' '.join(cmd)}: {exc}\n")
    print(f"benchmarks: {gpus} GPU(s){'' if gpus else ' (CPU run: 8 virtual CPU devices)'}; "
          f"commit {env.get('FICCO_COMMIT', 'from git')}; out {os.path.abspath(args.out)}", flush=True)
    start, started_at, rows = time.monotonic(), time.time(), []
    for name in args.suites:
        suite = catalog.SUITES[name]
        limit = suite.limit_s if args.limit is None else args.limit
        if args.budget is not None:
            limit = min(limit, args.budget - (time.monotonic() - start))
        if limit < MARGIN_S + 1:  # only a spent --budget gets here (parse_args refuses a short --limit)
            print(f"CUT: {name} not started: --budget {args.budget:.0f} s is spent", flush=True)
            rows.append((name, "CUT", 0.0, "not started: --budget spent"))
            continue
        rows.append((name, *run_suite(suite, args, env, gpus, limit)))
    peers_table = comparison_table(args.out, args.suites, since=started_at)
    if peers_table:
        print("\n" + peers_table, end="", flush=True)
    print("\n" + write_summary(args.out, rows, gpus, env, args.pack), flush=True)
    return 0 if all(status in (0, "skipped") for _, status, _, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
