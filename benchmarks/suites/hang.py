"""Runs a training program many times under a watchdog and counts the runs that completed, hung or
failed: the evidence that a training step never hangs.

    python benchmarks/suites/hang.py [--runs 6] [--steps 40] [--connections unset,1,32]
                                     [--program example|mixed] [--no-cache] [--out DIR] [-- PROGRAM OPTIONS]

Each run starts the program in a fresh process (`examples/tp_transformer.py --overlap`, schedule
`auto`, with the PROGRAM OPTIONS, e.g. `--preset llama70b-layer --attention cudnn`; or
`benchmarks/suites/mixed_step.py`), with CUDA_DEVICE_MAX_CONNECTIONS taken in turn from
--connections ("unset": CUDA's default, 8 hardware queues; NVIDIA's JAX containers set 1). A run
that prints no step line for --stall-s seconds (--start-s before its first one: compilation) is
hung: its threads' native stacks, the GPUs' resident kernels and where their warps stand are
written to hang_<run>.txt with cuda-gdb where the machine has it; the process then gets --grace-s
seconds to end by itself (ficco_jax's watchdog reports what its calls wait for and ends it:
"hung, ended by its watchdog") before it is killed ("hung"). A run that ends with an error before
that has failed. The runs share a JAX
compilation cache, so only the first one compiles (--no-cache: every run compiles, as separate
jobs do).

Writes DIR/hang.json (every run: setting, outcome, steps reached, seconds, last lines) and each
run's output to DIR/run_<i>.log, prints a table, then "hang: C/N completed, H hung, F failed" last.
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
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAMS = {
    "example": [os.path.join(REPO, "examples", "tp_transformer.py"), "--overlap", "--no-bound"],
    "mixed": [os.path.join(REPO, "benchmarks", "suites", "mixed_step.py"), "--print-every", "10"],
}
STEP_LINE = re.compile(r"step (\d+)/(\d+)")


def parse_args(argv):
    options = []
    if "--" in argv:
        at = argv.index("--")
        argv, options = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", choices=sorted(PROGRAMS), default="example")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--connections", default="unset,1,32",
                        help="CUDA_DEVICE_MAX_CONNECTIONS per run, in turn (comma-separated; 'unset' leaves it unset)")
    parser.add_argument("--start-s", type=float, default=420.0, help="seconds allowed before the first step line")
    parser.add_argument("--stall-s", type=float, default=60.0, help="seconds without a step line that count as hung")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--no-cache", action="store_true", help="no shared compilation cache: every run compiles")
    parser.add_argument("--grace-s", type=float, default=45.0,
                        help="seconds a hung run gets after its stacks are taken to end by itself (its watchdog)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out")
    args = parser.parse_args(argv)
    args.options = options
    return args


def cuda_gdb() -> str | None:
    return shutil.which("cuda-gdb") or next((p for p in ("/usr/local/cuda/bin/cuda-gdb",) if os.path.isfile(p)), None)


def dump_stuck(pid: int, path: str) -> None:
    """The native stack of every thread of `pid` and the kernels resident on its GPUs, into `path`."""
    debugger = cuda_gdb()
    with open(path, "w") as fh:
        if debugger is None:
            fh.write("no cuda-gdb on this machine: native stacks not taken\n")
            return
        command = [debugger, "-p", str(pid), "-batch", "-ex", "set pagination off", "-ex", "info cuda kernels",
                   "-ex", "info cuda blocks", "-ex", "info cuda warps", "-ex", "x/12i $pc - 64",
                   "-ex", "thread apply all bt 30"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=180)
            fh.write(done.stdout + done.stderr)
        except (OSError, subprocess.TimeoutExpired) as exc:
            fh.write(f"cuda-gdb did not finish: {exc}\n")


def run_once(argv, env, start_s, stall_s, dump_path, log_path, grace_s=0.0) -> dict:
    """One run under the watchdog: {"outcome", "steps", "seconds", "tail"}; its output into `log_path`."""
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=REPO)
    state = {"last": t0, "steps": 0, "tail": []}
    log = open(log_path, "w")

    def reader():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            state["tail"] = (state["tail"] + [line.rstrip()])[-25:]
            match = STEP_LINE.search(line)
            if match:
                state["steps"], state["last"] = int(match.group(1)), time.time()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    outcome = None
    while outcome is None:
        if proc.poll() is not None:
            thread.join(5)
            outcome = "completed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            break
        waited = time.time() - state["last"]
        if waited > (stall_s if state["steps"] else start_s):
            dump_stuck(proc.pid, dump_path)
            try:
                proc.wait(timeout=grace_s)
                outcome = f"hung, ended by its watchdog (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                outcome = "hung"
            break
        time.sleep(0.5)
    thread.join(5)
    log.close()
    return {"outcome": outcome, "steps": state["steps"], "seconds": round(time.time() - t0, 1),
            "tail": state["tail"]}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    settings = [s.strip() for s in args.connections.split(",") if s.strip()]
    cache = None if args.no_cache else (os.environ.get("JAX_COMPILATION_CACHE_DIR")
                                        or tempfile.mkdtemp(prefix="ficco_hang_cache_"))
    argv = [sys.executable, *PROGRAMS[args.program], "--steps", str(args.steps), *args.options]
    print("hang: " + " ".join(argv[1:]), flush=True)
    runs, t_start = [], time.time()
    for i in range(args.runs):
        if args.budget_s is not None and time.time() - t_start > args.budget_s:
            print(f"run {i + 1}: not started, the budget of {args.budget_s:.0f} s is spent", flush=True)
            break
        setting = settings[i % len(settings)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if cache:
            env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if setting != "unset":
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = setting
        result = run_once(argv, env, args.start_s, args.stall_s, os.path.join(args.out, f"hang_{i + 1}.txt"),
                          os.path.join(args.out, f"run_{i + 1}.log"), args.grace_s)
        runs.append({"run": i + 1, "cuda_device_max_connections": setting, **result})
        print(f"run {i + 1}: CUDA_DEVICE_MAX_CONNECTIONS={setting}: {result['outcome']} after {result['steps']} "
              f"steps, {result['seconds']:.0f} s", flush=True)
        if result["outcome"] != "completed":
            print("  last lines:\n    " + "\n    ".join(result["tail"][-8:]), flush=True)
    counts = {k: sum(r["outcome"].startswith(k) for r in runs) for k in ("completed", "hung", "failed")}
    with open(os.path.join(args.out, "hang.json"), "w") as fh:
        json.dump({"argv": argv[1:], "steps": args.steps, "stall_s": args.stall_s, "compilation_cache": bool(cache),
                   "runs": runs, **counts}, fh, indent=1)
    print(f"\n{'run':>4}  {'connections':>11}  {'outcome':<36} {'steps':>6} {'seconds':>8}")
    for r in runs:
        print(f"{r['run']:>4}  {r['cuda_device_max_connections']:>11}  {r['outcome']:<36} {r['steps']:>6} "
              f"{r['seconds']:>8.0f}")
    print(f"hang: {counts['completed']}/{len(runs)} completed, {counts['hung']} hung, {counts['failed']} failed",
          flush=True)
    return 0 if runs and counts["completed"] == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
