"""`python -m ficco_jax bench`: ficco_jax schedules side by side with JAX's own options.

For each op and shape, on all local devices (one 1-D mesh axis "tp"), in one run: every selected
ficco_jax schedule, JAX sequential (the plain collective then the matmul), JAX's shard-level
ring (`ppermute`), XLA's windowed einsum (GPU only, in a child process with its flags), the GEMM
alone, the collective alone and the ideal bound max(GEMM, collective). Every variant's result is
checked against the reference before it is timed. Times: see `harness.method()` (tuning/timing.py).
`matmul_psum` (the row-parallel matmul's all-reduce) is timed against JAX's matmul + psum; XLA's
windowed einsum has no all-reduce form, so it has no such row.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import config
from ..lowering import xla as xla_lowering
from ..ops import api, measure
from ..ops.measure import AXIS, op_body, sharded
from ..schedule import A2A_OPS, Schedule, local_shapes
from ..tuning import select
from . import bench_moe
from .harness import BOUND_STEPS, Row, bound_rows, extension_info, fitting_schedules, listed_schedules, verify_then_time_each
from . import harness
from .report import git_commit, markdown_table, plot_speedups, progress_printer

#: The file of named layer shapes (M tokens, K, N) every benchmark reads, peers included.
SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchor_shapes.json")


def load_shape_sets(path: str = SHAPES_FILE) -> dict[str, dict[str, tuple[int, int, int]]]:
    """{set name: {shape name: (M, K, N)}} as `path` lists them, in its order."""
    with open(path) as fh:
        sets = json.load(fh)["sets"]
    return {name: {shape: tuple(dims) for shape, dims in group["shapes"].items()} for name, group in sets.items()}


#: Names `--shape` accepts for a set of shapes: "anchors" (the anchor shapes of BENCHMARKS.md),
#: "llama405b" (Llama-3-405B layers at 8192 tokens, for tp=8).
SHAPE_SETS = load_shape_sets()
ANCHOR_SHAPES = SHAPE_SETS["anchors"]
LLAMA405B_SHAPES = SHAPE_SETS["llama405b"]
#: The default on CPU devices: every variant runs, the times mean nothing.
CPU_SHAPES = {"tiny_M256_K128_N256": (256, 128, 256)}


# ------------------------------------------------------------------------------------------------
# One (op, shape): every variant
# ------------------------------------------------------------------------------------------------
def variants(op, shapes, dtype, n, schedules) -> tuple[list, object]:
    """([(label, schedule)], auto's pick) of one (op, per-device shapes): JAX sequential, the listed
    schedules, JAX's ring, and the schedule "auto" would pick on a GPU of this machine's profile
    (on CPU "auto" means no overlap), each once. FP8 leaves JAX's ring out unless it is listed
    (`xla/ring`): its chunk-sized FP8 dots are new problems for XLA's autotuning (33-49 s per anchor on
    2 x H100, 2026-11-27), for a path that was slower than the FP8 ops in every case measured then."""
    selected = select.select_schedule(op, shapes, dtype, n)
    out = [("jax_seq", "ref")] + [(f"ficco:{s}", s) for s in schedules]
    if Schedule(comm="xla", order="ring") not in schedules and not config.is_fp8(dtype):
        out.append(("jax_ring", Schedule(comm="xla", order="ring")))
    if selected not in schedules:
        out.append((f"ficco:{selected}", selected))
    return out, selected


def bench_shape(op, name, M, K, N, dtype, mesh, schedules, progress, rounds: int = 1, unfit=()) -> list[Row]:
    """The rows of one (op, layer shape): JAX sequential, the listed schedules, JAX's ring (`variants`
    says when), auto's pick, each verified then timed, and the bounds; with `rounds` > 1 every one of them timed that
    many times in all, interleaved (`harness.retime_case`); then a row saying why for each listed schedule
    that does not fit the shape (`unfit`: `harness.fitting_schedules`)."""
    n = mesh.shape["tp"]
    shapes = local_shapes(op, M, K, N, n)
    args, body_of = case_inputs(op, shapes, dtype, mesh)
    listed, selected = variants(op, shapes, dtype, n, schedules)
    rows = [(Row(op, name, M, K, N, label, selected=(sched == selected)), sched) for label, sched in listed]
    timers = harness.variant_timers(verify_then_time_each(rows, mesh, args, dtype, progress, body_of=body_of), args)
    case = [row for row, _ in rows] + _bounds(op, name, M, K, N, dtype, mesh, progress, timers)
    if rounds > 1:
        harness.retime_case(case, timers, rounds - 1, progress)
    return case + harness.unfit_rows(Row(op, name, M, K, N, ""), unfit)


def case_inputs(op, shapes, dtype, mesh, seed: int = 0):
    """(operands, body_of) of one case of per-device `shapes`: random `dtype` operands and
    `measure.op_body`; FP8: quantized operands and bodies calling the scaled ops (`fp8_inputs`)."""
    if config.is_fp8(dtype):
        return fp8_inputs(op, shapes, dtype, mesh, seed=seed)
    return measure.make_inputs(op, shapes, dtype, mesh, seed=seed), op_body


def gemm_alone(op, M, K, N, dtype, n) -> tuple:
    """(gemm, per-device shapes) of a case's GEMM alone: the op's whole per-device product, [M, K] @ w
    for the all-gather (its gathered rows), [M, N/n] @ w otherwise; XLA's FP8 dot as JAX sequential
    runs it on FP8 operands (`fp8_gemm`)."""
    shapes = local_shapes(op, M, K, N, n)
    full_a = (M, K) if op == "ag_matmul" else (M, N // n)
    gemm = fp8_gemm(fp8_scales(shapes)) if config.is_fp8(dtype) else (lambda a, w: a @ w)
    return gemm, (full_a, shapes[1])


def _bounds(op, name, M, K, N, dtype, mesh, progress, timers=None) -> list[Row]:
    """GEMM alone (full size, every device at once), the collective alone, and the ideal max of the two."""
    n = mesh.shape["tp"]
    if op == "ag_matmul":  # all-gathers x [M/n, K] per device into [M, K]
        coll_shape, coll_dtype = (M, K), dtype
        collective = lambda x: jax.lax.all_gather(x, "tp", axis=0, tiled=True)  # noqa: E731
    elif op == "matmul_psum":  # all-reduces every device's [M, K] product
        coll_shape, coll_dtype = (M * n, K), dtype
        collective = lambda y: jax.lax.psum(y, "tp")  # noqa: E731
    else:  # reduce-scatters every device's [M, K] product (an FP8 matmul's partials are bf16)
        coll_shape, coll_dtype = (M * n, K), "bfloat16" if config.is_fp8(dtype) else dtype
        collective = lambda y: jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)  # noqa: E731
    gemm, gemm_shapes = gemm_alone(op, M, K, N, dtype, n)
    return bound_rows(Row(op, name, M, K, N, ""), mesh, dtype, progress, gemm=gemm, gemm_shapes=gemm_shapes,
                      collective=collective, collective_shape=coll_shape, spec=P("tp", None),
                      collective_dtype=coll_dtype, timers=timers)


# ------------------------------------------------------------------------------------------------
# FP8 operands: e4m3 with per-tensor scales, bf16 results
# ------------------------------------------------------------------------------------------------
def fp8_scales(shapes) -> tuple[float, float]:
    """(x_scale, w_scale) of an FP8 case of per-device `shapes`: 1, and w's 1/sqrt(K) as a power of two."""
    return 1.0, 2.0 ** -round(np.log2(np.sqrt(shapes[0][-1])))


def fp8_inputs(op, shapes, dtype, mesh, seed: int = 0):
    """(FP8 operands, body_of) of one case: unit-normal values quantized to `dtype` (w carries its
    1/sqrt(K) as a power-of-two scale, so the f32 reference of the FP8 values is exact), and
    bodies calling the op with those scales and bf16 results ("ref": JAX sequential, `fp8_body`)."""
    a, w = measure.make_inputs(op, shapes, "float32", mesh, seed=seed)
    scales = fp8_scales(shapes)
    args = [a.astype(dtype), (w * (np.sqrt(shapes[0][-1]))).astype(dtype)]
    return args, lambda op, schedule: fp8_body(op, schedule, scales)


def fp8_gemm(scales):
    """XLA's FP8 dot as JAX sequential runs it, alone: the op's plain path (`comm="none"`) computes its
    product so, and the bound must be the same program's dot. One dot, one autotuning: XLA caches its
    search per fused dot, so JAX sequential and the GEMM alone pay for it once: JAX sequential's step took
    25-92 s per anchor in a first run on 2 x H200 (2026-11-28), the GEMM alone then about 1 s; nearly all
    of such a compile is XLA's search over Triton GEMM configurations (2 x H100, 2026-11-27)."""
    sx, sw = (jnp.float32(s) for s in scales)
    return lambda a, w: xla_lowering.product(a, w, jnp.bfloat16, (sx, sw))


def fp8_body(op: str, schedule, scales):
    """The per-device body of the FP8 `op` under `schedule`. "ref" is JAX sequential: on FP8 operands
    the op's plain path (the all-gather or reduce-scatter around XLA's FP8 dot, `fp8_gemm`), on f32
    operands the meaning in f32 (the check's reference: the dequantize-then-dot)."""
    sx, sw = (jnp.float32(s) for s in scales)
    fn = api.ag_matmul if op == "ag_matmul" else api.matmul_rs

    def ref(a, w):
        if a.dtype == jnp.float32:
            meaning = api.ag_matmul_ref if op == "ag_matmul" else api.matmul_rs_ref
            return meaning(a, w, AXIS, x_scale=sx, w_scale=sw, out_dtype=jnp.float32)
        return fn(a, w, AXIS, schedule=Schedule(comm="none"), x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16)

    if schedule == "ref":
        return ref
    return lambda a, w: fn(a, w, AXIS, schedule=schedule, x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16)


# ------------------------------------------------------------------------------------------------
# XLA windowed einsum: its flags must be set before the backend starts, so it runs in a child
# ------------------------------------------------------------------------------------------------
WINDOWED_FLAGS = "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true"
#: How long bench waits for one windowed-einsum child: starting JAX, compiling and timing one shape
#: take seconds to a minute alone; past this the child is killed and its row says why.
WINDOWED_TIMEOUT_S = 300.0
#: What the child prints on stderr as it reaches each step, so a child that never finishes names the
#: step it was in.
WINDOWED_STEP = "_windowed step:"


def windowed_einsum_child(op, M, K, N, dtype) -> dict:
    """Runs in the child: GSPMD-sharded matmul whose collective XLA turns into a windowed einsum."""
    _child_step("starting the backend")
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    _child_step(f"allocating the operands on {mesh.shape['tp']} {jax.default_backend()} devices")
    args = measure.make_inputs(op, local_shapes(op, M, K, N, mesh.shape["tp"]), dtype, mesh)
    out_spec = P(None, "tp") if op == "ag_matmul" else P("tp", None)
    sharding = NamedSharding(mesh, out_spec)

    def make(r):
        def loop(a, w):
            def one(_, a):
                out = jax.lax.with_sharding_constraint(a @ w, sharding)
                return jax.lax.dynamic_update_slice(a, out[:1, :1].astype(a.dtype), (0, 0))
            return jax.lax.fori_loop(0, r, one, a)
        return jax.jit(loop, out_shardings=args[0].sharding)

    _child_step("compiling and timing")
    t = harness.device_time(make, args)
    return {"median_ms": t["median_s"] * 1e3, "spread_ms": t["spread_s"] * 1e3}


def _child_step(what: str) -> None:
    print(f"{WINDOWED_STEP} {what}", file=sys.stderr, flush=True)


def windowed_command(op, M, K, N, dtype) -> list[str]:
    return [sys.executable, "-m", "ficco_jax", "_windowed", op, str(M), str(K), str(N), dtype]


def windowed_env(environ=None) -> dict:
    """The child's environment: this one, XLA_FLAGS plus the windowed-einsum flags, and no
    preallocation. The child runs beside this process, whose XLA client already holds its memory
    pool on every GPU (75 % of each by default): a child that asked for its own 75 % would not get
    it, so it allocates only what its operands and programs use, from what is left."""
    environ = os.environ if environ is None else environ
    flags = (environ.get("XLA_FLAGS", "") + " " + WINDOWED_FLAGS).strip()
    return dict(environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")


def windowed_einsum(op, name, M, K, N, dtype, timeout_s: float = WINDOWED_TIMEOUT_S) -> Row:
    """The xla_windowed_einsum row of one case, timed in a child process (`windowed_command`); a
    child that fails or gives no result within `timeout_s` leaves an error row saying why."""
    cmd = windowed_command(op, M, K, N, dtype)
    row = Row(op, name, M, K, N, "xla_windowed_einsum", note=f"child process, XLA_FLAGS+={WINDOWED_FLAGS}")
    code, out, err = _run_child(cmd, windowed_env(), timeout_s)
    steps = [line[len(WINDOWED_STEP):].strip() for line in err.splitlines() if line.startswith(WINDOWED_STEP)]
    if code is None:
        row.note = (f"error: timeout: the windowed-einsum child gave no result in {timeout_s:.0f} s and was killed; "
                    f"its last step: {steps[-1] if steps else 'starting Python and importing jax'}. It runs beside "
                    f"this process, which holds its GPUs' memory pool (XLA_PYTHON_CLIENT_PREALLOCATE, "
                    f"XLA_PYTHON_CLIENT_MEM_FRACTION). Time it alone: XLA_FLAGS='{WINDOWED_FLAGS}' "
                    f"python {' '.join(cmd[1:])}; or run bench with XLA_PYTHON_CLIENT_MEM_FRACTION=0.5, or with --no-windowed")
        return row
    try:
        result = json.loads(out.strip().splitlines()[-1])
        row.median_ms, row.spread_ms = result["median_ms"], result["spread_ms"]
    except (ValueError, IndexError, KeyError, TypeError):
        last = [line for line in err.splitlines() if line.strip() and not line.startswith(WINDOWED_STEP)]
        row.note = (f"error: the windowed-einsum child exited with status {code} and no result, in step "
                    f"{steps[-1] if steps else 'start-up'!r}: {(last[-1] if last else 'no message')[:300]}")
    return row


class WindowedChildren:
    """The xla_windowed_einsum rows of one run, a child process per case. Once a child has timed
    out, the later cases are not started (each would wait as long): their rows say so."""

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = WINDOWED_TIMEOUT_S if timeout_s is None else timeout_s
        self.timed_out: str | None = None  # "op shape" of the case whose child timed out

    def row(self, op, name, M, K, N, dtype) -> Row:
        if self.timed_out:
            return Row(op, name, M, K, N, "xla_windowed_einsum",
                       note=f"skipped: the windowed-einsum child of {self.timed_out} timed out (its row says why)")
        row = windowed_einsum(op, name, M, K, N, dtype, self.timeout_s)
        if row.note.startswith("error: timeout"):
            self.timed_out = f"{op} {name}"
        return row


def _run_child(cmd, env, timeout_s) -> tuple[int | None, str, str]:
    """(exit status, stdout, stderr) of `cmd`; status None: killed, with its process group, at `timeout_s`."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------
def add_case_arguments(parser) -> None:
    """The positional arguments of a script that runs one op case: OP SCHEDULE M K N (SCHEDULE: a
    Schedule string, or "ref" where the script takes the plain-JAX reference)."""
    parser.add_argument("op", choices=("ag_matmul", "matmul_rs"))
    parser.add_argument("schedule")
    for dim in ("M", "K", "N"):
        parser.add_argument(dim, type=int)


def record_timeline(mesh, op: str, schedule, M: int, K: int, N: int, iters: int, out_dir: str | None,
                    dtype: str = "bfloat16", seed: int = 0) -> None:
    """Run `op` under `schedule` ("ref" or a Schedule) on `dtype` operands (FP8: the scaled op, as
    `bench` times it) `iters` times in one jitted loop, compiled and warmed up first, then once more
    under JAX's profiler (a Perfetto trace under `out_dir`; None: no profiler, e.g. when nsys
    records the process). The trace suite of benchmarks/ prints it."""
    inputs, body_of = case_inputs(op, local_shapes(op, M, K, N, mesh.shape["tp"]), dtype, mesh, seed=seed)
    fn = sharded(mesh, op, body_of(op, schedule), iters)
    jax.block_until_ready(fn(*inputs))  # compile and warm up outside the recording
    if out_dir is None:
        jax.block_until_ready(fn(*inputs))
        return
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn(*inputs))


def provenance(n: int, dtype) -> dict:
    """The head of a result file: device, platform, dtype, versions, commit, date, timing method."""
    return {
        "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "n_devices": n,
        "dtype": dtype, "jax": jax.__version__, "commit": git_commit(), "extension": extension_info(),
        "xla_cache": jax.config.jax_compilation_cache_dir,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": harness.method("times are host memcpy/loop times, NOT meaningful"),
        "gemm_bound": harness.GEMM_BOUND,
        "rows": [],
    }


#: The clock a time budget is read on.
budget_clock = time.monotonic


def run(ops_to_run, shapes, dtype, schedules_arg, out_dir, plot=False, windowed=True, moe_shapes=None,
        budget_s: float | None = None, resume: dict | None = None, rounds: int = 1) -> dict:
    """Bench `ops_to_run` on all local devices: ag_matmul/matmul_rs/matmul_psum on `shapes` {name: (M, K, N)},
    a2a_matmul/matmul_a2a on `moe_shapes` {name: (T, d, f, E, k)} (see bench_moe.py). FP8 `dtype`:
    each shape also in bf16 (rows of shape "<name>/bf16"), so the table holds both.

    `budget_s`: no case (op, shape) starts after this many seconds; those left are listed in the
    result's "skipped" and the table. `resume`: the bench.json of an earlier run of the same machine,
    group size, dtype, rounds and GEMM bound (else ValueError): its cases are kept, each row with the
    commit it ran at, and only the cases it lacks are measured, so a run that a budget cut is completed
    by another.
    `rounds`: how many times every variant and bound of a case is timed, interleaved (one timing of
    each in turn per round), its row the median: drift over a case's minutes then hits them alike.
    XLA's windowed einsum, timed in its own process, is timed once."""
    if rounds < 1:
        raise ValueError(f"bench --rounds {rounds}: time each variant at least once (--rounds 1 or more)")
    n = len(jax.local_devices())
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    on_cpu = jax.default_backend() == "cpu"
    comms = select.available_comms()
    if moe_shapes is None:
        moe_shapes = bench_moe.CPU_SHAPES if on_cpu else bench_moe.GPU_SHAPES
    if config.is_fp8(dtype) and any(op in A2A_OPS for op in ops_to_run):
        raise ValueError(f"bench: FP8 ({dtype}) runs the tensor-parallel ops ag_matmul and matmul_rs only; "
                         f"found {[op for op in ops_to_run if op in A2A_OPS]}")
    result = provenance(n, dtype)
    result["rounds"] = rounds
    result["method"] += harness.rounds_method(rounds)
    kept = resumed_rows(resume, result) if resume is not None else []
    done = {(r["op"], r["shape"]) for r in kept}
    tp_plan, moe_plan = [], []
    for op in ops_to_run:
        if op in A2A_OPS:
            moe_plan += [case for case in bench_moe.plan(op, moe_shapes, schedules_arg, n, comms)
                         if (op, case[1]) not in done]
            continue
        listed = listed_schedules(op, schedules_arg, n, comms)
        for name, (M, K, N) in shapes.items():
            fits, unfit = fitting_schedules(op, listed, local_shapes(op, M, K, N, n), n)
            tp_plan += [(op, label, M, K, N, fits, unfit, case_dtype)
                        for label, case_dtype in case_dtypes(name, dtype) if (op, label) not in done]
    windowed = windowed and not on_cpu
    result["steps"] = steps = planned_steps(tp_plan, moe_plan, n, dtype, windowed, rounds)
    progress = progress_printer(sum(steps.values()))
    rows = []
    os.makedirs(out_dir, exist_ok=True)
    if resume is not None:
        result["resumed"] = {"commit": resume.get("commit"), "date": resume.get("date"),
                             "cases": len(done), "measured": len(tp_plan) + len(moe_plan)}
    skipped = result["skipped"] = []
    start = budget_clock()

    def save(rows):  # after every shape, so a run stopped early keeps what it measured
        result["rows"] = kept + [asdict(r) for r in rows]
        with open(os.path.join(out_dir, "bench.json"), "w") as fh:
            json.dump(result, fh, indent=1)

    def out_of_time(op, name) -> bool:
        if budget_s is None or budget_clock() - start <= budget_s:
            return False
        if not skipped:
            print(f"bench: the time budget of {budget_s:.0f} s is spent; the cases left are not started", flush=True)
        skipped.append(f"{op} {name}")
        return True

    with harness.monitoring():  # what the GPUs ran at, per timing (gpu_monitor.py)
        children = WindowedChildren()
        for op, name, M, K, N, scheds, unfit, case_dtype in tp_plan:
            if out_of_time(op, name):
                continue
            case = bench_shape(op, name, M, K, N, case_dtype, mesh, scheds, progress, rounds, unfit)
            if has_windowed(windowed, op, case_dtype):
                progress(f"{op} {name} xla_windowed_einsum")
                case.append(children.row(op, name, M, K, N, case_dtype))
            if case_dtype != dtype:  # a row of another dtype than the run's says so (calibrate reads it)
                for row in case:
                    row.extra["dtype"] = case_dtype
            rows += case
            save(rows)
        for op, name, dims, scheds, unfit in moe_plan:
            if out_of_time(op, name):
                continue
            rows += bench_moe.bench_shape(op, name, dims, dtype, mesh, scheds, progress, rounds, unfit)
            save(rows)
    save(rows)
    table = markdown_table(result) + (fp8_table(result) if config.is_fp8(dtype) else "")
    if resume is not None:
        r = result["resumed"]
        table += (f"\nKept from an earlier run (commit {r['commit']}, {r['date']}): {r['cases']} cases, each row "
                  f"with its commit in bench.json; measured in this run: {r['measured']}.\n")
    if skipped:
        table += (f"\nNot measured (time budget): {', '.join(skipped)}. `bench` with the same options and "
                  f"`--resume {os.path.join(out_dir, 'bench.json')}` measures them and keeps these rows.\n")
    with open(os.path.join(out_dir, "bench.md"), "w") as fh:
        fh.write(table)
    written = [os.path.join(out_dir, f) for f in ("bench.json", "bench.md")]
    if plot:
        written += plot_speedups(result, out_dir)
    print(table)
    print(f"Written: {', '.join(written)}")
    return result


def planned_steps(tp_plan, moe_plan, n: int, dtype, windowed: bool, rounds: int) -> dict[str, int]:
    """What the progress line counts, by kind: the variants (each verified against the reference, then
    timed), the bounds (GEMM alone and collective alone of each case, timed only: they compute no op
    result), XLA's windowed einsum (timed in its own process) and the extra timing rounds of --rounds.
    The table's summary repeats these numbers, so the count it ends at is explained there."""
    cases = len(tp_plan) + len(moe_plan)
    return {
        "variants": sum(len(variants(op, local_shapes(op, M, K, N, n), cd, n, scheds)[0])
                        for op, name, M, K, N, scheds, _, cd in tp_plan)
                    + sum(len(bench_moe.variants(op, bench_moe.local_shapes(op, *dims, n), dtype, n, scheds)[0])
                          for op, name, dims, scheds, _ in moe_plan),
        "bounds": BOUND_STEPS * cases,
        "windowed": sum(has_windowed(windowed, op, cd) for op, name, M, K, N, scheds, _, cd in tp_plan),
        "rounds": (rounds - 1) * cases,
    }


def resumed_rows(earlier: dict, ours: dict) -> list[dict]:
    """The rows of an earlier bench.json to keep, each with the commit it ran at in its `extra`;
    ValueError when that run is not comparable (another device kind, platform, group size or dtype)
    or is not a bench result."""
    if not isinstance(earlier, dict) or not isinstance(earlier.get("rows"), list):
        raise ValueError("bench --resume: not a bench.json (no 'rows' list)")
    compared = {k: ours[k] for k in ("device", "platform", "n_devices", "dtype", "rounds", "gemm_bound")}
    harness.check_resumable("bench --resume", {"rounds": 1, "gemm_bound": "one device", **earlier}, compared,
                            "Resume only a run of the same machine, devices, --dtype and --rounds, "
                            "whose GEMM-alone bound was timed the same way (gemm_bound).")
    return [dict(r, extra={**r.get("extra", {}), "commit": r.get("extra", {}).get("commit", earlier.get("commit"))})
            for r in earlier["rows"]]


def has_windowed(windowed: bool, op: str, dtype) -> bool:
    """Whether a case gets an xla_windowed_einsum row: asked for, not FP8, and an op XLA's windowed
    einsum decomposes (an all-gather or reduce-scatter beside the matmul; no all-reduce)."""
    return windowed and not config.is_fp8(dtype) and op != "matmul_psum"


def case_dtypes(name: str, dtype) -> list[tuple[str, str]]:
    """(shape label, dtype) of each case a shape gives: itself, and for FP8 also bf16 beside it."""
    return [(name, dtype), (f"{name}/bf16", "bfloat16")] if config.is_fp8(dtype) else [(name, dtype)]


def fp8_table(result: dict) -> str:
    """Per op and shape: FP8 against bf16, for JAX sequential and for ficco's best (speed-ups:
    the bf16 time over the FP8 one)."""
    times = {}
    for r in result["rows"]:
        if r["median_ms"] is not None and (r["variant"] == "jax_seq" or r["variant"].startswith("ficco:")):
            key = (r["op"], r["shape"].removesuffix("/bf16"), r["M"], r["K"], r["N"], r["shape"].endswith("/bf16"))
            best = times.setdefault(key, {})
            kind = "seq" if r["variant"] == "jax_seq" else "best"
            best[kind] = min(best.get(kind, float("inf")), r["median_ms"])
    lines = ["", f"FP8 ({result['dtype']} operands, per-tensor scales, bf16 results) against bf16, ms:", "",
             "| op | shape (M,K,N) | JAX seq bf16 | JAX seq FP8 | ficco best bf16 | ficco best FP8 | "
             "JAX seq FP8 / bf16 | ficco best FP8 / bf16 | ficco best FP8 / JAX seq bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    speedup = lambda slow, fast: "—" if slow is None or fast is None else f"{slow / fast:.2f}x"  # noqa: E731
    for (op, shape, M, K, N, is_bf16), fp8 in times.items():
        if is_bf16:
            continue
        bf16 = times.get((op, shape, M, K, N, True), {})
        cells = [bf16.get("seq"), fp8.get("seq"), bf16.get("best"), fp8.get("best")]
        lines.append(f"| {op} | {shape} {M},{K},{N} | " + " | ".join(_fmt_ms(c) for c in cells) +
                     f" | {speedup(bf16.get('seq'), fp8.get('seq'))} | {speedup(bf16.get('best'), fp8.get('best'))}"
                     f" | {speedup(bf16.get('seq'), fp8.get('best'))} |")
    lines.append("Speed-ups: the bf16 time over the FP8 one (above 1: FP8 faster). JAX seq FP8 is the "
                 "all-gather / reduce-scatter around XLA's FP8 dot, scales applied to its f32 result (the ops' "
                 "comm=\"none\"); the GEMM alone is that dot.")
    if result["platform"] == "cpu":
        lines.append("On CPU these times are host loops of tiny shapes: they mean nothing about a GPU.")
    return "\n".join(lines) + "\n"


def _fmt_ms(v) -> str:
    return "—" if v is None else f"{v:.3f}"
