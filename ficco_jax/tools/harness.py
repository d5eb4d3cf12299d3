"""What the benchmark tools share: a result row; measuring one case's variants (each verified
against the reference before it is timed); the bound rows (GEMM alone, collective alone, ideal);
timing a case's rows again in interleaved rounds; what the GPUs ran at during each timing
(`monitoring`); the dtypes and tolerances; and the schedules a `--schedules` argument names."""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import config
from ..ops.measure import op_body, sharded
from ..runtime import extension
from ..schedule import Schedule
from ..tuning import timing
from . import gpu_monitor

#: Relative error a variant may have against the f32 reference; FP8: of the same FP8 values, bf16 results.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3, "float8_e4m3fn": 1e-2}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16",
          "f32": "float32", "float32": "float32", "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}


@dataclass
class Row:
    op: str
    shape: str
    M: int
    K: int
    N: int
    variant: str
    median_ms: float | None = None
    spread_ms: float | None = None
    verified: bool | None = None
    rel_err: float | None = None
    selected: bool = False
    note: str = ""
    extra: dict = field(default_factory=dict)


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


#: What samples the GPUs while the tools time (`monitoring`); None: no clocks are recorded.
_monitor: gpu_monitor.GpuMonitor | None = None


@contextlib.contextmanager
def monitoring(monitor: gpu_monitor.GpuMonitor | None = None):
    """Inside, every `device_time` also says what the GPUs ran at while it timed (its dict's "gpus",
    tools/gpu_monitor.py), and the rows keep it (extra["gpus"], one entry per timing): on GPUs by
    default, or through `monitor`. Where nothing can be sampled (CPU) the timings go on without."""
    global _monitor
    if _monitor is not None:  # already sampling (a tool inside another's monitoring)
        yield
        return
    if monitor is None and jax.default_backend() == "gpu":
        monitor = gpu_monitor.GpuMonitor()
    if monitor is None or not monitor.start():
        yield
        return
    _monitor = monitor
    try:
        yield
    finally:
        _monitor = None
        monitor.stop()


#: Seconds each timing on an accelerator first runs its program back to back (timing._settle). On
#: 2 x H100 (2026-11-27) a timing's clock followed what ran before it: three timings of one GEMM
#: alone took 2.608, 2.708 and 2.889 ms at a mean power of 258, 648 and 690 W and SM clocks of
#: 1596, 1536 and 1460 MHz (the first right after its compile, with the GPUs idle). So every variant
#: is timed in the power state its own load brings.
SETTLE_S = 0.5
#: On CPU, where the times mean nothing, shorter loops: R = 10 ms over one launch of one op (on GPUs
#: timing.TARGET_S, 50 ms).
CPU_TARGET_S = 0.01


def device_time(make, args) -> dict:
    """timing.device_time as the tools run it: adaptive, after SETTLE_S of the program, on
    accelerators; on CPU, where the times mean nothing, a fixed count of estimates (the adaptive rule
    would retry noisy host timings to its cap) over short loops. Under `monitoring`, "gpus": the
    GPUs' clocks, power and temperature during the timed launches."""
    monitor = _monitor
    spans = [] if monitor is not None else None
    on_cpu = jax.default_backend() == "cpu"
    t = timing.device_time(make, args, adaptive=not on_cpu, spans=spans, settle_s=0.0 if on_cpu else SETTLE_S,
                           target_s=CPU_TARGET_S if on_cpu else timing.TARGET_S)
    if monitor is not None:
        t["gpus"] = monitor.window(spans)
    return t


def _keep_facts(row: Row, t: dict) -> None:
    """Add to `row` what the GPUs ran at during timing `t` (under `monitoring`), and mark it
    extra["upper_bound"] where the timing's loops did not tell R ops from 2R (timing.device_time)."""
    if t.get("gpus"):
        row.extra.setdefault("gpus", []).append(t["gpus"])
    if t.get("resolved") is False:
        row.extra["upper_bound"] = True


def use_xla_cache(path: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache at `path` (config.XLA_CACHE_DIR by default; "none":
    off) unless the user set one: JAX then also keeps XLA's per-fusion autotuning results there, so a
    program whose GEMMs were autotuned once (an FP8 dot: 25-60 s) compiles in a fraction of a second in
    later runs. Returns the directory in use, or None. Call it before the first compile."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = config.XLA_CACHE_DIR if path is None else path
    if path in ("", "none"):
        return None
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.expanduser(path)))
    return jax.config.jax_compilation_cache_dir


def method(cpu_note: str = "NOT meaningful") -> str:
    """The timing method stamped on a result of `device_time`."""
    if jax.default_backend() == "cpu":
        return f"{timing.METHOD_FIXED}; ON CPU: {cpu_note}"
    return f"{timing.METHOD}; each timing after {SETTLE_S} s of its program running back to back"


def rounds_method(rounds: int) -> str:
    """What the method stamped on a result adds for `rounds` interleaved rounds (`retime_case`)."""
    if rounds <= 1:
        return ""
    return (f"; every timed row of a case timed in {rounds} interleaved rounds (one timing of each in turn), "
            f"the median of its {rounds} timings")


def check_resumable(flag: str, theirs: dict, ours: dict, hint: str) -> None:
    """ValueError naming every field (key of `ours`) in which the earlier run `flag` would resume
    (`theirs`) differs from this one, then `hint`; nothing when none does."""
    differ = [f"{k} {theirs.get(k)!r} (this run: {ours[k]!r})" for k in ours if theirs.get(k) != ours[k]]
    if differ:
        raise ValueError(f"{flag}: the earlier run is not comparable: " + "; ".join(differ) + f". {hint}")


def error_line(exc: BaseException, limit: int = 200) -> str:
    """`exc` in one line for a result's note: its type and the first line of its message (if any)."""
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:limit]}"


def verify_then_time(row: Row, make, args, want, dtype, time: bool = True) -> Row:
    """Fill `row`: check `make(None)(*args)` against `want`, and only if it agrees (and `time`) time
    `make(R)` (R repetitions in one jit, timing.device_time). A failing variant is reported, not fatal."""
    try:
        row.rel_err = rel_err(make(None)(*args), want)
        row.verified = row.rel_err < TOLERANCE[dtype]
        if row.verified and time:
            t = device_time(make, args)
            row.median_ms, row.spread_ms = t["median_s"] * 1e3, t["spread_s"] * 1e3
            _keep_facts(row, t)
        else:
            row.note = f"WRONG RESULT: rel err {row.rel_err:.3g}; not timed"
    except Exception as exc:  # noqa: BLE001 - the run goes on and the table says what broke
        row.note = f"error: {error_line(exc)}"
    return row


def verify_then_time_each(variants, mesh, args, dtype, progress, body_of=op_body) -> dict:
    """Measure the `(row, schedule)` pairs of one case (one op, one set of operands `args`): the
    reference is computed once in f32, then each schedule's body (`body_of(op, schedule)`, "ref":
    the plain collective then the matmul) goes through `verify_then_time`, filling its row.
    Returns {row.variant: make}, so a caller can time a variant again.

    A variant whose program is one already timed (the same lowered text: the plain path is JAX
    sequential's program) is verified and takes that timing instead of a second one, which would
    measure only the spread between two timings of one program."""
    op = variants[0][0].op
    want = sharded(mesh, op, body_of(op, "ref"))(*[a.astype(jnp.float32) for a in args])
    makers, timed = {}, {}  # timed: lowered program text -> the row that timed it
    for row, schedule in variants:
        progress(f"{row.op} {row.shape} {row.variant}")
        body = body_of(op, schedule)
        # One jitted program per repeat count: the lowering read below and the check then share its trace.
        makers[row.variant] = functools.cache(lambda r, body=body: sharded(mesh, op, body, r))
        program = _program_text(makers[row.variant], args)
        earlier = timed.get(program)
        verify_then_time(row, makers[row.variant], args, want, dtype, time=earlier is None)
        if earlier is not None and row.verified:
            row.median_ms, row.spread_ms = earlier.median_ms, earlier.spread_ms
            row.note = f"the program of {earlier.variant}: its timing"
            row.extra["timing_of"] = earlier.variant
        elif row.verified and program is not None:
            timed[program] = row
    return makers


def _program_text(make, args) -> str | None:
    """The lowered text of `make(None)` on `args`, or None if it does not lower (verify says why)."""
    try:
        return make(None).lower(*args).as_text()
    except Exception:  # noqa: BLE001 - verify_then_time reports the error on the row
        return None


#: How `bound_rows` times the GEMM alone (a result file's "gemm_bound"; files without it: "one device").
GEMM_BOUND = "every device at once"

#: How many progress steps `bound_rows` reports (GEMM alone, collective alone; the ideal is computed).
BOUND_STEPS = 2


def gemm_program(mesh, dtype, gemm, gemm_shapes):
    """(make, args) of the GEMM alone: `make(R)` runs `gemm(a, w)` R times (timing.chain) on every
    device at once, one program under shard_map over "tp" without communication, on random
    per-device operands of `gemm_shapes` (args)."""
    n, per_device = mesh.shape["tp"], NamedSharding(mesh, P("tp"))
    keys = jax.random.split(jax.random.PRNGKey(1), len(gemm_shapes))
    args = tuple(jax.device_put(jax.random.normal(k, (n * shape[0], *shape[1:]), jnp.float32).astype(dtype),
                                per_device) for k, shape in zip(keys, gemm_shapes))
    specs = dict(mesh=mesh, in_specs=(P("tp"),) * len(gemm_shapes), out_specs=P("tp"))
    return functools.cache(lambda r: jax.jit(jax.shard_map(timing.chain(gemm, r), **specs))), args


def bound_rows(case: Row, mesh, dtype, progress, *, gemm, gemm_shapes, collective, collective_shape,
               spec, collective_dtype=None, timers: dict | None = None) -> list[Row]:
    """The bounds of a case, as rows like `case`: `gemm(a, w)` alone on every device at once with
    random per-device operands of `gemm_shapes` (one program under shard_map over "tp", no
    communication: its time is the slowest device's, which an op over the group also waits for),
    `collective(x)` alone under shard_map (a global `collective_shape` of `collective_dtype`, default
    `dtype`, sharded as `spec`), and the ideal, the max of the two. `timers`, where given, receives a
    timer for each bound (`retime_case`)."""
    gemm_make, gemm_args = gemm_program(mesh, dtype, gemm, gemm_shapes)
    x = jax.device_put(jnp.ones(collective_shape, collective_dtype or dtype) * 0.5, NamedSharding(mesh, spec))
    coll_make = functools.cache(lambda r: jax.jit(jax.shard_map(timing.chain(collective, r), mesh=mesh,
                                                                in_specs=(spec,), out_specs=spec)))
    bounds = {"gemm_alone": lambda: device_time(gemm_make, gemm_args),
              "collective_alone": lambda: device_time(coll_make, (x,))}
    rows = []
    for variant, timer in bounds.items():
        progress(f"{case.op} {case.shape} {variant} (bound: timed only)")
        t = timer()
        rows.append(replace(case, variant=variant, median_ms=t["median_s"] * 1e3, spread_ms=t["spread_s"] * 1e3,
                            extra=dict(case.extra)))
        _keep_facts(rows[-1], t)
    rows.append(replace(case, variant="ideal", median_ms=_ideal(rows), note="max(gemm_alone, collective_alone)",
                        extra=dict(case.extra)))
    if timers is not None:
        timers.update(bounds)
    return rows


def _ideal(rows) -> float:
    return max(r.median_ms for r in rows if r.variant in ("gemm_alone", "collective_alone"))


def variant_timers(makers: dict, args) -> dict:
    """{variant: timer} for the variants `verify_then_time_each` measured (its `makers`): a timer is
    a call that times its variant once more (`device_time`'s dict)."""
    return {v: (lambda make=make: device_time(make, args)) for v, make in makers.items()}


def retime(rows, timers: dict, rounds: int) -> None:
    """Time each of `rows` (by its variant's timer in `timers`) `rounds` more times, interleaved:
    one timing of each in turn per round, so that drift over the minutes a case takes (clocks,
    temperature, other work on the host) hits them alike. Each row's median_ms becomes the median of
    all its timings (the first one included; all kept in extra["timings_ms"]) and spread_ms their
    half-range. A re-timing that fails leaves the row's earlier timings and says so in its note."""
    for r in rows:
        r.extra.setdefault("timings_ms", [r.median_ms])
    for _ in range(rounds):
        for r in rows:
            try:
                t = timers[r.variant]()
            except Exception as exc:  # noqa: BLE001 - keep the earlier timings; the table says why
                r.note = f"re-timing failed: {error_line(exc, 160)}"
                continue
            r.extra["timings_ms"].append(t["median_s"] * 1e3)
            _keep_facts(r, t)
    for r in rows:
        ts = r.extra["timings_ms"]
        r.median_ms = float(np.median(ts))
        r.spread_ms = float((max(ts) - min(ts)) / 2)


def retime_case(rows, timers: dict, rounds: int, progress) -> None:
    """`rounds` more rounds of timings (`retime`) over every row of one case that a timer of
    `timers` times by its own program; then the rows that took another row's timing (the plain path
    takes JAX sequential's) and the ideal follow the medians."""
    own = [r for r in rows if r.variant in timers and r.median_ms is not None and "timing_of" not in r.extra]
    for k in range(rounds):
        progress(f"{rows[0].op} {rows[0].shape}: timing round {k + 2} of {rounds + 1}")
        retime(own, timers, 1)
    by = {r.variant: r for r in rows}
    for r in rows:
        source = by.get(r.extra.get("timing_of"))
        if source is not None:
            r.median_ms, r.spread_ms = source.median_ms, source.spread_ms
            r.extra["timings_ms"] = list(source.extra.get("timings_ms", [source.median_ms]))
    if "ideal" in by:
        by["ideal"].median_ms = _ideal(rows)


def fitting_schedules(op, schedules, shapes, n) -> tuple[list[Schedule], list[tuple[Schedule, str]]]:
    """(fits, unfit) of a `--schedules` list for `op` on per-device `shapes`: the overlapped
    schedules that apply, and (schedule, why not) for each that does not (a list may name points
    another op or shape cannot take; `unfit_rows` reports them). The plain path (comm "none") is in
    neither: it is JAX sequential's program, timed as that row."""
    fits, unfit = [], []
    for s in schedules:
        try:
            s.validate(op, shapes, n)
        except ValueError as exc:
            unfit.append((s, str(exc)))
            continue
        if s.comm != "none":
            fits.append(s)
    return fits, unfit


def unfit_rows(case: Row, unfit) -> list[Row]:
    """A row like `case` for each (schedule, why not) of `unfit` (`fitting_schedules`): not
    verified, not timed, its note saying why, so the table and the result file list it."""
    return [replace(case, variant=f"ficco:{s}", note=f"skipped: {why}", extra=dict(case.extra)) for s, why in unfit]


def listed_schedules(op, schedules_arg, n, comms) -> list[Schedule]:
    """The schedules `--schedules` names for `op`: auto (none listed) | all | xla | dma | a list."""
    if schedules_arg == "all":
        return Schedule.enumerate(op, n, comms)
    if schedules_arg in ("xla", "dma"):
        return Schedule.enumerate(op, n, (schedules_arg,))
    if schedules_arg == "auto":
        return []
    try:
        return [Schedule.parse(s) for s in schedules_arg.split(",")]
    except ValueError as exc:
        raise ValueError(f"--schedules {schedules_arg!r}: {exc}. 'auto', 'all', 'dma' and 'xla' stand alone; "
                         f"a list names schedules (ficco auto's pick is timed in every run)") from None


def extension_info() -> dict | None:
    """The compiled extension's build_info (version, CUDA build, FFI ABI), None without it."""
    try:
        return dict(extension.build_info()) if extension.available() else None
    except ImportError:
        return None


def at_least(minimum: int):
    """An argparse type: an integer >= `minimum`, else a usage error that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, found {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0, else a usage error that says so."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 (e.g. 600), found {text!r}")
    return value
