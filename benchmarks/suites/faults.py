"""Fault injection on the executor's rendezvous, one child process per op, on GPU or CPU.

    python benchmarks/suites/faults.py                       # every op, all local devices (the GPU run)
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/suites/faults.py   # CPU smoke

For each op on copy engines (ag_matmul dma/direct/c2, matmul_rs dma/direct/c2, dma.all_gather,
dma.reduce_scatter, dma.all_to_all, a2a_matmul dma/direct/c2, matmul_a2a dma/direct/c2: the
a2a targets meet in the same executor rendezvous), on a 1-D mesh "tp" over every local device
(rotated, so device ordinals differ from ranks), one child process checks:

  (a) with a fault injected the call raises (no hang, no crash) within the rendezvous timeout +
      `--margin-s`, and the message names the faulty rank: "injected fault '<mode>' on rank r"
      (the faulty rank's own error) or "missing ranks [r]" (a waiting peer's);
  (b) in the same process, with the fault disarmed, the next call equals the plain-JAX
      reference exactly (small-integer inputs, so every matmul and sum is exact): both the
      program that failed and a freshly traced one;
  (c) the process stays usable: 20 back-to-back launches after the faults take less than the
      rendezvous timeout together and give the reference result; a plain jnp op still runs.

How the faults are armed: the extension's test-only entry point
(`ficco_jax.runtime.extension.testing().inject_fault`, xla_ffi/testing/faults.h) arms one fault
for every copy-engine call of the process until it is disarmed; the rendezvous timeout is
FICCO_RENDEZVOUS_TIMEOUT_S=<--timeout-s> in each child's environment, read at import into
config.RENDEZVOUS_TIMEOUT_S and written into the program when it is traced. Each child arms
skip:1, runs the case, disarms, runs the next calls; then the same with fail:<n-1>, and with
fail:<n-1>:4 (that rank's 4th copy-stream operation fails, after copies were enqueued: its call may
return the error only once XLA's stream waits for them, which the fault's backend checks on every
call, `copies_joined`).

One more child launches a group of n devices on only n/2 of them (a direct FFI call, as in
tests/test_executor_faults.py, with the attributes lowering/dma/registry.py itself writes for the whole group) and
checks the waiting ranks' message: op, group and "missing ranks [n/2 .. n-1]", arriving no sooner
than the timeout.

Every child runs under a subprocess timeout (`--case-timeout-s`) and the run under `--budget-s`,
so the script cannot hang; a child that dies or outlives its case timeout fails its cases with its
exit status and the tail of its stderr. A child the budget stopped before its case timeout, and a
child never started for lack of budget, are not judged: their cases are SKIPPED and the run is
INCOMPLETE, not FAIL. Prints the table (overall PASS, FAIL or INCOMPLETE), writes
$OUT/gpu_faults.json (OUT defaults to out/gpu_faults), exits 0 only if every case ran and passed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

OPS = ("all_gather", "reduce_scatter", "ag_matmul", "matmul_rs", "all_to_all", "a2a_matmul", "matmul_a2a")
PARTIAL = "partial_group"
RESULT_TAG = "RESULT "
#: Launches after the faults that must together finish within the rendezvous timeout (c).
HEALTHY_LAUNCHES = 20
#: Rows per device / per peer block of the test inputs: small, the faults are about the rendezvous.
ROWS = 32
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------------
# Child: one op, both fault modes, in one process. jax and ficco_jax are imported inside these
# functions only: the parent must never start a client (on GPUs it would take the memory the
# children need, and its config would not carry the children's environment).
# ------------------------------------------------------------------------------------------------
def _case(op, mesh):
    """(make, args, in_specs, out_spec, ref): `make()` returns a NEW body each call, so that every
    jit of it traces afresh. Inputs are small integers (-2..2), so every matmul and sum is exact in
    f32 and TF32 and results compare exactly."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ficco_jax
    from ficco_jax import dma

    n, lax = mesh.shape["tp"], jax.lax
    ints = lambda shape, seed: jax.random.randint(jax.random.PRNGKey(seed), shape, -2, 3).astype(jnp.float32)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        args, in_specs, out_spec = (ints((n * n * ROWS, 8), 0),), (P("tp"),), P("tp")  # n blocks of ROWS rows each
        make, ref = {
            "all_gather": (lambda: lambda a: dma.all_gather(a, "tp"), lambda a: lax.all_gather(a, "tp", tiled=True)),
            "reduce_scatter": (lambda: lambda a: dma.reduce_scatter(a, "tp"),
                               lambda a: lax.psum_scatter(a, "tp", tiled=True)),
            "all_to_all": (lambda: lambda a: dma.all_to_all(a, "tp", 0, 0),
                           lambda a: lax.all_to_all(a, "tp", 0, 0, tiled=True)),
        }[op]
    else:
        if op == "ag_matmul":
            args, in_specs, out_spec = (ints((n * ROWS, 16), 1), ints((16, n * 8), 2)), (P("tp"), P(None, "tp")), P(None, "tp")
        elif op == "matmul_rs":  # per device y [n*ROWS, 16], w [16, 8]
            args, in_specs, out_spec = (ints((n * ROWS, n * 16), 3), ints((n * 16, 8), 4)), (P(None, "tp"), P("tp", None)), P("tp")
        else:  # expert-parallel: per device x [n, E_local=2, C=ROWS, d=8], w [2, 8, 8]
            args, in_specs, out_spec = (ints((n * n, 2, ROWS, 8), 5), ints((n * 2, 8, 8), 6)), (P("tp"), P("tp")), P("tp")
        fn, ref_fn = getattr(ficco_jax, op), getattr(ficco_jax, f"{op}_ref")
        make = lambda: lambda a, b: fn(a, b, "tp", schedule="dma/direct/c2")
        ref = lambda a, b: ref_fn(a, b, "tp")
    args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs))
    return make, args, in_specs, out_spec, ref


def _compile(mesh, body, in_specs, out_spec, args):
    import jax

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec)).lower(*args).compile()


def _reference(mesh, case):
    import numpy as np

    _, args, in_specs, out_spec, ref = case
    return np.asarray(_compile(mesh, ref, in_specs, out_spec, args)(*args))


def _equal(record, key, run, expected) -> bool:
    """record[key] = whether `run()` gives `expected` exactly; an error is recorded, not raised,
    so that one failed check does not hide the others."""
    import numpy as np

    try:
        record[key] = bool(np.array_equal(np.asarray(run()), expected))
    except Exception as exc:  # noqa: BLE001
        record[key], record[f"{key}_error"] = False, f"{type(exc).__name__}: {str(exc)[:300]}"
    return record[key]


def _one_fault(op, spec, mesh, case, expected, timeout_s, margin_s) -> dict:
    """Run with `spec` armed, disarm it, run again: (a) error in time naming the rank, (b) next calls."""
    import jax

    from ficco_jax.runtime import extension

    make, args, in_specs, out_spec, _ = case
    mode, rank = spec.split(":")[:2]
    record = {"case": f"{op} {spec}", "op": op, "fault": spec, "rank": int(rank)}
    program = _compile(mesh, make(), in_specs, out_spec, args)
    unjoined = extension.testing().unjoined_copy_calls()
    extension.testing().inject_fault(spec)
    start = time.monotonic()
    try:
        jax.block_until_ready(program(*args))
        record.update(raised=False, error_s=time.monotonic() - start, message="")
    except Exception as exc:  # noqa: BLE001 - any error type counts; its message is checked
        record.update(raised=True, error_s=time.monotonic() - start, error_type=type(exc).__name__,
                      message=str(exc)[:600])
    finally:
        extension.testing().inject_fault("")
    names = re.search(rf"missing ranks \[{rank}\]|injected fault '{mode}' on rank {rank}\b", record["message"])
    record["names_rank"] = bool(names)
    record["reported_by"] = ("" if not names else "faulty rank" if "injected" in names.group(0) else "waiting peer")
    record["within_time"] = record["error_s"] < timeout_s + margin_s
    record["copies_joined"] = extension.testing().unjoined_copy_calls() == unjoined
    _equal(record, "next_call_precompiled", lambda: program(*args), expected)
    _equal(record, "next_call_fresh_trace", lambda: _compile(mesh, make(), in_specs, out_spec, args)(*args), expected)
    record["pass"] = all(record[k] for k in ("raised", "names_rank", "within_time", "copies_joined",
                                             "next_call_precompiled", "next_call_fresh_trace"))
    return record


def _still_usable(op, mesh, case, expected, timeout_s) -> dict:
    """(c): back-to-back healthy launches after the faults, none waiting on a stale rendezvous."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    make, args, in_specs, out_spec, _ = case
    program = _compile(mesh, make(), in_specs, out_spec, args)
    jax.block_until_ready(program(*args))
    start = time.monotonic()
    for _ in range(HEALTHY_LAUNCHES):
        out = program(*args)
    out = np.asarray(out)
    elapsed = time.monotonic() - start
    plain = float(jnp.sum(jnp.arange(10.0)))  # the default device still runs ordinary JAX
    record = {"case": f"{op} usable", "op": op, "fault": "none", "launches": HEALTHY_LAUNCHES, "launches_s": elapsed,
              "equal": bool(np.array_equal(out, expected)), "plain_op": plain == 45.0}
    record["pass"] = record["equal"] and record["plain_op"] and elapsed < timeout_s
    return record


def child_op(op, timeout_s, margin_s) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from ficco_jax import config

    assert config.RENDEZVOUS_TIMEOUT_S == timeout_s, (config.RENDEZVOUS_TIMEOUT_S, timeout_s)
    devices = jax.local_devices()
    n = len(devices)
    if n < 2:
        raise SystemExit(f"gpu_faults: needs >= 2 local devices, found {n}")
    if jax.default_backend() == "cpu":
        mesh = Mesh(np.array(devices[1:] + devices[:1]), ("tp",))  # rank r on device r+1: ordinals != ranks
    else:
        # XLA:GPU compiles only iota device assignments ("only supports IOTA device assignment"),
        # and the process died after that message on 4 x H200: the GPU runs keep the device order.
        mesh = Mesh(np.array(devices), ("tp",))
    case = _case(op, mesh)
    expected = _reference(mesh, case)
    for spec in ("skip:1", f"fail:{n - 1}", f"fail:{n - 1}:4"):
        _emit(_one_fault(op, spec, mesh, case, expected, timeout_s, margin_s))
    _emit(_still_usable(op, mesh, case, expected, timeout_s))


def _library_attributes(mesh, x) -> dict:
    """The FFI attributes lowering/dma/registry.py gives a healthy all_gather over the whole of `mesh` (spied on
    jax.ffi.ffi_lowering while it lowers), so the direct call below follows the attribute set the
    executor expects now, whatever it is, instead of a copy of it."""
    import jax
    from jax.sharding import PartitionSpec as P

    from ficco_jax import dma

    captured, real = {}, jax.ffi.ffi_lowering

    def spy(name, *a, **k):
        rule = real(name, *a, **k)

        def recording(ctx, *operands, **attrs):
            captured.update(attrs)
            return rule(ctx, *operands, **attrs)

        return recording

    jax.ffi.ffi_lowering = spy
    try:
        body = lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c1")
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))).lower(x)
    finally:
        jax.ffi.ffi_lowering = real
    if "groups" not in captured:
        raise RuntimeError("gpu_faults: could not read dma.all_gather's FFI attributes (is jax.ffi.ffi_lowering used?)")
    return captured


def child_partial(timeout_s, margin_s) -> None:
    """The group of all n devices, launched on only the first n/2: the waiting ranks name the rest."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    devices = jax.local_devices()
    n, half = len(devices), len(devices) // 2
    full, launched = Mesh(np.array(devices), ("tp",)), Mesh(np.array(devices[:half]), ("tp",))
    op_id = 2 * 10**9
    attrs = dict(_library_attributes(full, jnp.zeros((n * 2, 3), jnp.float32)), op_id=np.int64(op_id),
                 timeout_ms=np.int64(int(round(timeout_s * 1000))))

    def gather(a):
        call = jax.ffi.ffi_call("ficco_all_gather", jax.ShapeDtypeStruct((n * a.shape[0], a.shape[1]), a.dtype))
        # Every call's first operand is its position, XLA's partition id (xla_ffi/runtime/placement.h).
        return call(jax.lax.axis_index("tp").astype(jnp.uint32), a, **attrs)

    f = jax.jit(jax.shard_map(gather, mesh=launched, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    x = jnp.zeros((half * 2, 3), jnp.float32)
    compiled = f.lower(x).compile()
    start = time.monotonic()
    try:
        jax.block_until_ready(compiled(x))
        raised, message = False, ""
    except Exception as exc:  # noqa: BLE001
        raised, message = True, str(exc)[:600]
    elapsed = time.monotonic() - start
    missing = list(range(half, n))
    group = [int(g) for g in np.asarray(attrs["groups"]).reshape(-1)]
    expected_text = [f"in op {op_id} (ficco_all_gather)", f"group {group}", f"missing ranks {missing}"]
    record = {"case": f"{PARTIAL} {half} of {n}", "op": PARTIAL, "fault": f"{n - half} ranks never launch",
              "rank": missing, "raised": raised, "error_s": elapsed, "message": message, "reported_by": "waiting peers",
              "names_rank": all(t in message for t in expected_text), "expected_text": expected_text,
              "attributes": sorted(attrs), "within_time": 0.9 * timeout_s <= elapsed < timeout_s + margin_s}
    record["pass"] = raised and record["names_rank"] and record["within_time"]
    _emit(record)
    # Afterwards every device, including those the group waited for, runs a healthy all_gather.
    case = _case("all_gather", full)
    _emit(_still_usable("all_gather", full, case, _reference(full, case), timeout_s) | {"case": f"{PARTIAL} usable"})


def _emit(record: dict) -> None:
    print(RESULT_TAG + json.dumps(record), flush=True)


# ------------------------------------------------------------------------------------------------
# Parent: one child per op, bounded in time; the table and the JSON
# ------------------------------------------------------------------------------------------------
def _run_child(target, args, timeout_s, budget_cut) -> tuple[list[dict], str, bool]:
    """The child's RESULT records, a note ('' if it exited 0 in time), and whether --budget-s stopped
    it: with `budget_cut`, `timeout_s` is what was left of the budget, shorter than the case timeout,
    so a child still running then was not given its time and is not judged a hang."""
    env = dict(os.environ, FICCO_RENDEZVOUS_TIMEOUT_S=str(args.timeout_s), PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", target, "--timeout-s", str(args.timeout_s),
           "--margin-s", str(args.margin_s)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        note = "" if proc.returncode == 0 else f"child exited with status {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        if budget_cut:
            records = [json.loads(line[len(RESULT_TAG):]) for line in stdout.splitlines() if line.startswith(RESULT_TAG)]
            return records, (f"not judged: stopped after {timeout_s:.0f} s, when --budget-s {args.budget_s:g} was spent "
                             f"(the case timeout is {args.case_timeout_s:g} s)"), True
        note = f"child still running after {timeout_s:.0f} s: killed (a hang)"
    records = [json.loads(line[len(RESULT_TAG):]) for line in stdout.splitlines() if line.startswith(RESULT_TAG)]
    if note:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        note += f"; stderr tail:\n{tail}" if tail else "; no stderr"
    return records, note, False


def _expected_cases(target) -> list[str]:
    return [f"{PARTIAL}", f"{PARTIAL} usable"] if target == PARTIAL else [f"{target} skip", f"{target} fail",
                                                                          f"{target} fail midway",
                                                                          f"{target} usable"]


def run(args) -> dict:
    deadline = time.monotonic() + args.budget_s
    targets = [t for t in args.ops.split(",") if t] + ([PARTIAL] if args.partial else [])
    records = []
    for target in targets:
        left = deadline - time.monotonic()
        if left < 5:
            records += [{"case": f"{c} (budget)", "op": target, "pass": False, "skipped": True,
                         "note": f"skipped: --budget-s {args.budget_s} spent"} for c in _expected_cases(target)]
            continue
        t0 = time.monotonic()
        got, note, cut = _run_child(target, args, min(args.case_timeout_s, left), left < args.case_timeout_s)
        sys.stderr.write(f"{target}: {len(got)} results in {time.monotonic() - t0:.1f} s{'; ' + note if note else ''}\n")
        missing = len(_expected_cases(target)) - len(got)
        if note or missing > 0:
            got += [{"case": f"{c} (budget)" if cut else f"{c} (no result)", "op": target, "pass": False,
                     "skipped": cut, "note": note or "no result"} for c in _expected_cases(target)[len(got):]]
        records += got
    failed = [r for r in records if not r["pass"] and not r.get("skipped")]
    unrun = [r for r in records if r.get("skipped")]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "timeout_s": args.timeout_s, "margin_s": args.margin_s, "budget_s": args.budget_s,
            "all_pass": not failed and not unrun, "overall": "FAIL" if failed else "INCOMPLETE" if unrun else "PASS",
            "cases": records}


def table(result: dict) -> str:
    lines = [f"rendezvous timeout {result['timeout_s']} s, margin {result['margin_s']} s",
             "| case | error after (s) | names rank (by) | copies joined | next call: compiled before / fresh trace "
             "| verdict |",
             "|---|---|---|---|---|---|"]
    yes = lambda v: "—" if v is None else ("yes" if v else "NO")
    for r in result["cases"]:
        err = f"{r['error_s']:.3f}" if "error_s" in r else (f"{HEALTHY_LAUNCHES} launches in {r['launches_s']:.3f}"
                                                            if "launches_s" in r else "—")
        named = f"{yes(r.get('names_rank'))} ({r.get('reported_by') or '—'})" if "names_rank" in r else "—"
        nxt = (f"{yes(r.get('next_call_precompiled'))} / {yes(r.get('next_call_fresh_trace'))}"
               if "next_call_precompiled" in r else (f"equal {yes(r.get('equal'))}" if "equal" in r else "—"))
        verdict = "PASS" if r["pass"] else ("SKIPPED" if r.get("skipped") else "FAIL")
        note = f" ({r['note'].splitlines()[0]})" if r.get("note") else ""
        lines.append(f"| {r['case']} | {err} | {named} | {yes(r.get('copies_joined'))} | {nxt} | {verdict}{note} |")
    unrun = sum(1 for r in result["cases"] if r.get("skipped"))
    lines.append(f"\nOverall: {result['overall']}" + (f" ({unrun} case(s) not run or not judged within --budget-s "
                                                    f"{result['budget_s']:g}: give it more time)" if unrun else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--no-partial", dest="partial", action="store_false", help="skip the partial-group case")
    parser.add_argument("--timeout-s", type=float, default=1.0, help="rendezvous timeout (FICCO_RENDEZVOUS_TIMEOUT_S)")
    parser.add_argument("--margin-s", type=float, default=3.0, help="allowed delay of the error past the timeout")
    parser.add_argument("--case-timeout-s", type=float, default=60.0, help="kill a child after this long")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip the children left after this long")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/gpu_faults"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == PARTIAL:
        child_partial(args.timeout_s, args.margin_s)
        return 0
    if args.child:
        child_op(args.child, args.timeout_s, args.margin_s)
        return 0
    unknown = [t for t in args.ops.split(",") if t and t not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; valid: {OPS}")
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_faults.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(table(result))
    return 0 if result["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
