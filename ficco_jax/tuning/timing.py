"""Device time of a sharded op, without host dispatch.

Method ("in-jit loop differencing"): the op is run R times inside one jitted `fori_loop`, each
iteration writing one element of its output into its input (a true data dependency, O(1) cost,
so XLA can neither hoist nor overlap iterations). The wall time of R and 2R iterations, each
the median of several launches, gives `(t(2R) - t(R)) / R`: launch, dispatch and the final
synchronisation cancel, and so does the start of every launch, where a GPU at its power limit
still runs at its boost clock. R is TARGET_S over the time of one launch of one op (dispatch and
sync included, so R ops take at most about TARGET_S): on large ops both loops outlast that start,
some tens of milliseconds. Differencing a loop of one op and a loop of a few timed the start alone:
on 2 x H200 (2026-11-28) XLA's FP8 dot of [4096, 24576] @ [24576, 12288] took 1.33-1.41 ms per op
from loops of 1 and 5, 1.91-2.00 from loops of 10 and 20 and 1.98-2.00 over one loop of 40 (its
clock swung between 1485 and 1965 MHz under the power cap), where bf16 dots and the copy-engine
ops agreed across all three within their spread. On CPU the numbers are host-memcpy times and
not meaningful.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

import jax
import numpy as np
from jax import lax

#: Estimates per measurement: at least MIN_ESTIMATES; more, up to MAX_ESTIMATES, while their
#: half-range exceeds AGREE of their median (copy-engine ops on 4xH200: median spread 4.5 %, p90 18 %).
MIN_ESTIMATES, MAX_ESTIMATES, AGREE = 3, 7, 0.03
#: R = TARGET_S / the time of one launch of one op (which bounds the op from above); the longer
#: loop runs at most MAX_REPEATS iterations.
TARGET_S, MAX_REPEATS = 0.05, 200
#: Timed launches per loop and estimate (each after an untimed one); loops this long vary little.
LAUNCHES = 3

_LOOP = ("device time per op: R and 2R iterations inside one jit (fori_loop with a data dependency), "
         f"(t(2R)-t(R))/R, R = {TARGET_S * 1e3:.0f} ms / the time of one launch of one op, "
         f"t = median wall time of {LAUNCHES} launches after warm-up (where the differences' median is not "
         "positive, t(2R)/2R instead, an upper bound)")
METHOD = (f"{_LOOP}; median of {MIN_ESTIMATES} such estimates, up to {MAX_ESTIMATES} while they spread by "
          f"more than {AGREE * 100:.0f} %")
#: The same with adaptive=False (what several processes timing one program use).
METHOD_FIXED = f"{_LOOP}; median of {MIN_ESTIMATES} such estimates (a fixed count)"


def outside_trace(fn: Callable):
    """`fn()` run in a thread of its own and its result (or its exception). An op's schedule is often
    resolved while the user's function is traced, inside its shard_map and under its context mesh;
    a timed program is a program of its own, on a mesh of its own, and jax keeps the trace and the
    context mesh per thread, so a fresh thread starts outside both (no private jax state swapped)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ficco-timing") as pool:
        return pool.submit(fn).result()


def chain(step: Callable, repeats: int) -> Callable:
    """A body running `step(a, *rest)` `repeats` times, feeding one output element back into `a`.

    The whole output passes an optimization barrier before its element is taken: without it XLA
    computes only what that element needs, and a program made of chunks (a decomposed schedule, a
    concatenation of matmuls) loses every chunk but one (2 x H100: xla/bidirectional/c2/grouped
    matmul_rs on [8192,14336]@[14336,8192] timed at 1.51 ms, its matmul alone takes 2.66).
    """

    def body(a, *rest):
        def one(_, a):
            out = step(a, *rest)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out = lax.optimization_barrier(out)
            corner = out[(slice(0, 1),) * out.ndim].astype(a.dtype)
            corner = corner.reshape((1,) * a.ndim)
            return lax.dynamic_update_slice(a, corner, (0,) * a.ndim)

        return lax.fori_loop(0, repeats, one, a)

    return body


def wall_time(fn: Callable, args, launches: int, spans: list | None = None) -> float:
    """Median wall seconds of `launches` runs of `fn(*args)` after one warm-up run (which compiles),
    each to `block_until_ready`; with `spans`, the (start, end) of the timed runs appended to it."""
    jax.block_until_ready(fn(*args))  # warm-up (compiles)
    times = []
    start = time.monotonic()
    for _ in range(launches):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    if spans is not None:
        spans.append((start, time.monotonic()))
    return float(np.median(times))


def _settle(fn: Callable, args, seconds: float) -> None:
    """Run `fn` back to back for `seconds`, counted from the end of its first run (which compiles):
    the GPU takes the clock and power state of this load (a GPU at its power limit runs slower than
    one just out of an idle compile)."""
    jax.block_until_ready(fn(*args))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        jax.block_until_ready(fn(*args))


def repeats_for(t1: float, target_s: float = TARGET_S, max_repeats: int = MAX_REPEATS) -> int:
    """R for an op of which one launch took `t1` seconds (dispatch and sync included: an upper bound
    of the op): `target_s / t1`, at least 2, and the 2R-loop at most `max_repeats` iterations."""
    return int(min(max_repeats // 2, max(2, target_s / max(t1, 1e-7))))


def device_time(make: Callable[[int], Callable], args, *, target_s: float = TARGET_S,
                launches: int = LAUNCHES, max_repeats: int = MAX_REPEATS, repeats: int | None = None,
                adaptive: bool = True, spans: list | None = None, settle_s: float = 0.0) -> dict:
    """Seconds per op of `make(R)` (a jitted fn running the op R times), by loop differencing.

    Returns {"median_s", "spread_s", "repeats", "estimates", "resolved"}: the median of the
    differences and their half-range; MIN_ESTIMATES of them, more (up to MAX_ESTIMATES) while they
    disagree. A time is never 0 or negative: where the differences' median is (an op too small for
    the loops to tell apart, seen on CPU), it is the 2R-loop's wall time per op instead, dispatch
    included, and `resolved` is False.
    `repeats`: R itself, else sized from one launch of one op (`repeats_for`).
    `adaptive=False`: exactly MIN_ESTIMATES. Programs run by several processes need that (and one
    `repeats` for all of them): each process would decide from its own timings, and a process that
    launches its collectives more often than its peers waits for them forever. `spans`, where given,
    receives the (start, end) `time.monotonic()` readings of every run of timed launches (warm-ups
    and compiles left out), for what the GPUs did meanwhile (tools/gpu_monitor.py). `settle_s`: run
    the 2R-loop back to back for that long before the estimates (`_settle`).
    """
    if repeats is None:
        repeats = repeats_for(wall_time(make(1), args, 1, spans), target_s, max_repeats)  # an upper bound suffices
    short, long = make(repeats), make(2 * repeats)
    if settle_s > 0:
        _settle(long, args, settle_s)
    estimates, bounds = [], []
    while len(estimates) < MIN_ESTIMATES or (adaptive and len(estimates) < MAX_ESTIMATES and _disagree(estimates)):
        t_long = wall_time(long, args, launches, spans)
        estimates.append((t_long - wall_time(short, args, launches, spans)) / repeats)
        bounds.append(t_long / (2 * repeats))
    median = float(np.median(estimates))
    if median <= 0:  # R more ops cost nothing measurable: report the long loop per op, an upper bound
        median, estimates = float(np.median(bounds)), bounds
    return {"median_s": median, "spread_s": (max(estimates) - min(estimates)) / 2, "repeats": repeats,
            "estimates": len(estimates), "resolved": estimates is not bounds}


def _disagree(estimates) -> bool:
    middle = float(np.median(estimates))
    return middle > 0 and (max(estimates) - min(estimates)) / 2 > AGREE * middle
