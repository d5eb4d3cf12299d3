"""Copy engines across the processes of one host (CUDA IPC): checks, then timings.

One process of an N-process job on one host, one device each (benchmarks/suites/multiprocess_launch.sh
starts them; it is the way to run this; the steps are in multiprocess_steps.py). The mesh's one axis "tp" spans every process, so every
comm="dma" call goes through the host mailbox and CUDA IPC (xla_ffi/runtime/ipc.h).

  1. setup      jax.distributed on localhost; the site's topology; on GPUs the staging buffer
                every device exports to its peers (ipc.staging_info: size, legacy-IPC capable,
                cudaIpcGetMemHandle accepted: PASS / FAIL), and, for the record, how XLA's own
                allocation under an input looks to CUDA IPC (never exported, and not IPC-capable on
                H200s with jax 0.11.2: why the data goes through the staging buffer).
  2. checks     every dma schedule of ag_matmul and matmul_rs (direct and ring), and of
                dma.all_gather / dma.reduce_scatter, against the reference on random bf16
                inputs, at a small shape and one anchor shape; dma.all_to_all, a2a_matmul and
                matmul_a2a at a small shape (their staging pieces differ): PASS / FAIL per schedule.
  3. timings    the anchor shapes (M, K, N): the model's best dma schedules, or those of
                --schedules (verified first, the fastest measured kept), and JAX sequential (all_gather / psum_scatter + dot
                by XLA), with ficco_jax.tuning.timing.device_time.
  (--trace OP:SCHEDULE:M,K,N) a GPU timeline of one op in every process: JAX's profiler records 20
                calls in a loop into $OUT/trace_p<i>/ (benchmarks/suites/perfetto_timeline.py prints it), after
                the first checks.
  4. report     rank 0 collects every process's results through the jax.distributed key-value
                store, writes $OUT/<--json> and prints a table; exit status 1 if any check failed.

On CPU (the smoke test of this script: 2 processes, tiny shapes) copy engines cannot reach the
other process: every dma schedule must be *refused* with a clear error (that is its PASS), and
the timings use the best comm that can run (xla).

Every step logs to stderr ("[p<i> +<seconds>s] ..."); a failing check, and any exception a step
raises, is a FAIL line (and a failed check in the JSON), and the run goes on. All processes take the same decisions (the budget check is agreed through
the store), so no process waits in a collective that another skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from ficco_jax.runtime import extension, ipc, topology  # noqa: E402
from ficco_jax.schedule import Schedule  # noqa: E402
from ficco_jax.tuning import timing  # noqa: E402

import multiprocess_steps as steps  # noqa: E402
from multiprocess_steps import (CPU_CHECKED, CPU_TIMED, DTYPE, GPU_CHECKED, GPU_TIMED,  # noqa: E402
                                TIMED_CANDIDATES, TOLERANCE, log, parse_trace)


def parse_schedules(spec: str) -> list:
    """"dma/direct/c1,dma/direct/c2/grouped" -> [Schedule, ...], or a clear error."""
    out = []
    for text in (t for t in spec.split(",") if t.strip()):
        try:
            sched = Schedule.parse(text)
        except ValueError as exc:
            raise SystemExit(f"--schedules {spec!r}: {exc}")
        if sched.comm != "dma":
            raise SystemExit(f"--schedules {spec!r}: {text!r} is not a dma schedule (JAX sequential is always timed)")
        out.append(sched)
    if not out:
        raise SystemExit(f"--schedules {spec!r}: no schedule given; e.g. dma/direct/c1,dma/direct/c2/grouped")
    return out


def table(result: dict) -> str:
    lines = [f"multiprocess: {result['n_processes']} processes x {result['devices_per_process']} device(s), "
             f"{result['device']} ({result['platform']}), ipc={result['ipc']}",
             f"checks: {result['passed']} passed, {result['failed']} failed (over all processes)"]
    for c in result["failed_checks"][:20]:
        lines.append(f"  FAIL p{c['process']} {c['op']} {c['shape']} {c['schedule']}: {c['status'][:160]}")
    lines.append("")
    lines.append("| op | shape (M,K,N) | auto | best timed | best ms | JAX seq ms | speedup |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in result["timings"]:
        seq = r["candidates"].get("jax_seq", {}).get("median_ms")
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        sp = r.get("speedup_vs_jax_seq")
        lines.append(f"| {r['op']} | {r['shape']} {tuple(r['MKN'])} | {r['auto']} | {r.get('best', '-')} | "
                     f"{fmt(r.get('best_ms'))} | {fmt(seq)} | {'-' if sp is None else f'{sp:.2f}x'} |")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--process-id", type=int, default=int(os.environ.get("FICCO_MP_PROCESS_ID", "0")))
    parser.add_argument("--num-processes", type=int, default=int(os.environ.get("FICCO_MP_NUM_PROCESSES", "4")))
    parser.add_argument("--port", type=int, default=int(os.environ.get("FICCO_MP_PORT", "0") or 0))
    parser.add_argument("--local-device", type=int, default=None,
                        help="all GPUs visible: this process uses only this one (jax local_device_ids)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--json", default="mp_gpu.json")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip the remaining steps after this")
    parser.add_argument("--quick", action="store_true", default=os.environ.get("FICCO_MP_QUICK", "") not in ("", "0"),
                        help="small checks only (no anchor check, one timed shape); also FICCO_MP_QUICK=1")
    parser.add_argument("--trace", default=os.environ.get("FICCO_MP_TRACE") or None, metavar="OP:SCHEDULE:M,K,N",
                        help="also record a GPU timeline of this op (JAX's profiler) after the first checks")
    parser.add_argument("--timed", default=os.environ.get("FICCO_MP_TIMED") or None, metavar="NAME[,NAME]",
                        help=f"time only these shapes of {list(GPU_TIMED)} (default: all, as the budget allows)")
    parser.add_argument("--schedules", default=os.environ.get("FICCO_MP_SCHEDULES") or None, metavar="S[,S]",
                        help=f"time these dma schedules (default: the model's best {TIMED_CANDIDATES}); "
                             "also FICCO_MP_SCHEDULES")
    args = parser.parse_args()
    if args.trace:
        parse_trace(args.trace)
    if args.schedules:  # parsed once, here: a bad list fails before any process starts
        args.schedules = parse_schedules(args.schedules)
    if not args.port:
        parser.error("--port (or FICCO_MP_PORT) is required: the coordinator's port on localhost")
    return args


def make_plan(args, on_gpu: bool) -> list[tuple]:
    """(step, name, dims) in order, most informative first in case the budget runs out: the small
    checks, one anchor timed, the anchor checks, then the other anchors timed."""
    checked = GPU_CHECKED if on_gpu else CPU_CHECKED
    timed = GPU_TIMED if on_gpu else CPU_TIMED
    if args.timed and on_gpu:
        unknown = sorted(set(args.timed.split(",")) - set(timed))
        if unknown:
            raise SystemExit(f"--timed: unknown shape names {unknown}; known: {list(timed)}")
        timed = {k: v for k, v in timed.items() if k in args.timed.split(",")}
    if args.quick:  # after --timed: the first of the shapes it kept
        checked = dict(list(checked.items())[:1])
        timed = dict(list(timed.items())[:1])
    checked, timed = list(checked.items()), list(timed.items())
    return ([("checks", n, d, i == 0) for i, (n, d) in enumerate(checked[:1])]
            + ([("trace", args.trace, None, False)] if args.trace else [])
            + [("timings", n, d, False) for n, d in timed[:1]]
            + [("checks", n, d, False) for n, d in checked[1:]]
            + [("timings", n, d, False) for n, d in timed[1:]])


def run_plan(run, plan) -> None:
    for step, name, dims, first in plan:
        log(f"== {step} at {name} {dims}")
        if step == "trace":
            if run.go(f"trace {name}", 40):
                run.step(f"trace {name}", run.trace, name)
            continue
        if step == "checks":
            run.step(f"checks ops {name}", run.check_ops, name, dims)
            run.step(f"checks collectives {name}", run.check_collectives, name, dims)
            if first:
                run.step(f"checks a2a {name}", run.check_a2a, name)
        else:
            run.step(f"timings {name}", run.time_shape, name, dims)
        stats, error = run.attempt(ipc.stats)
        log(f"ipc stats: {stats if error is None else error}")


def collect(run, everyone, site) -> dict:
    """Rank 0's result: every process's checks, the timings, and what the machine was."""
    flat = [dict(c, process=r["process"]) for r in everyone for c in r.get("checks", [])]
    failed = [c for c in flat if not c["passed"]]
    missing = [r for r in everyone if "missing" in r]
    return {
        "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
        "n_processes": jax.process_count(), "devices_per_process": len(jax.local_devices()),
        "ipc": ipc.supported(), "site_kind": site.kind, "dtype": DTYPE, "tolerance": TOLERANCE,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "local_device": run.args.local_device,
        "passed": len(flat) - len(failed), "failed": len(failed) + len(missing), "failed_checks": failed,
        "ipc_open_failed": any("cudaIpcOpen" in (c.get("error") or "") for c in failed),
        "missing_processes": missing, "timings": run.timings,
        "ipc_stats": {r["process"]: r.get("ipc_stats") for r in everyone},
        "staging": {r["process"]: r.get("staging") for r in everyone},
        "notes": run.notes + [n for r in everyone[1:] for n in r.get("notes", [])],
        "checks": flat, "method": timing.METHOD_FIXED, "extension": extension.build_info(),
        "commit": os.environ.get("FICCO_COMMIT"),
    }


def start(args):
    """jax.distributed on localhost, the mesh over every process, and the Run of the steps."""
    kwargs = {} if args.local_device is None else {"local_device_ids": [args.local_device]}
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120, **kwargs)
    steps.STATE["initialised"] = True
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.process_count()} processes, "
        f"local devices {jax.local_devices()}, global {len(jax.devices())}; ficco_jax build "
        f"{extension.build_info()}; ipc supported: {ipc.supported()}; "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    run = steps.Run(args, mesh, steps.Store(timeout_s=120))
    site = topology.describe(mesh, "tp")
    log(f"site: kind {site.kind}; {site.groups[0]}; local ordinals "
        f"{[m.local_ordinal for m in site.groups[0].members]}")
    if site.kind != topology.SAME_HOST_MULTI_PROCESS:
        run.notes.append(f"the tp axis is {site.kind}, not same_host_multi_process: IPC not exercised")
    return run, site


def main() -> int:
    args = parse_args()
    run, site = start(args)
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:  # the staging buffer peers read, and (for the record) XLA's allocation
        run.step("setup staging", run.check_staging)
    run_plan(run, make_plan(args, on_gpu))
    stats, error = run.attempt(ipc.stats)
    mine = {"process": jax.process_index(), "checks": run.checks, "ipc_stats": stats if error is None else error,
            "staging": run.staging, "notes": run.notes}
    everyone = run.store.gather("result", mine)
    ok = all(c["passed"] for c in run.checks)
    if everyone is not None:
        result = collect(run, everyone, site)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, args.json)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
        print(table(result), flush=True)
        log(f"wrote {path}")
        ok = ok and not result["failed"]
    try:
        run.store.client.wait_at_barrier("ficco_mp_gpu_end", 120_000)
        log(f"ipc.close(): {ipc.close() if run.ipc else 0} mappings closed")
    except Exception as exc:  # noqa: BLE001
        log(f"teardown: {type(exc).__name__}: {exc}")
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
