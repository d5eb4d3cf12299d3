"""`schedule="autotune"`: time the cost model's best candidates once on this process's devices and
cache the winner on disk, by op, shapes, dtype (and result dtype), axis size and device kind. The timing itself is
passed in (`measure`): the ops layer knows how to build and run an op; this layer only ranks,
measures through that callable and remembers."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from typing import Callable, Sequence

import jax
import numpy as np

from .. import config
from ..schedule import Schedule
from . import cost_model, timing
from .select import available_comms, candidates, profile_for, select_schedule

log = logging.getLogger("ficco_jax")

#: How many of the model's best candidates autotune measures.
AUTOTUNE_TOP_K = 6


def cache_key(op, shapes, dtype, axis_size, device_kind, out_dtype=None) -> str:
    """The cache's key of one call; the matmuls' result dtype is in it where it is not `dtype`'s."""
    dims = "x".join(",".join(str(int(d)) for d in s) for s in shapes)
    name = np.dtype(dtype).name
    out = np.dtype(out_dtype or dtype).name
    return f"{op}|{dims}|{name}|n{axis_size}|{device_kind}" + ("" if out == name else f"|out={out}")


class AutotuneCache:
    """A JSON file of measured winners; safe under concurrent processes (lock + atomic replace)."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or config.AUTOTUNE_CACHE_DIR
        self.path = os.path.join(self.directory, "autotune.json")

    def load(self) -> dict:
        try:
            with open(self.path) as fh:
                data = json.load(fh)
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
            return data
        except FileNotFoundError:
            return {}
        except (ValueError, OSError) as exc:
            log.warning("ficco_jax: autotune cache %s is unreadable (%s); starting a fresh one", self.path, exc)
            return {}

    def get(self, key: str) -> Schedule | None:
        entry = self.load().get(key)
        try:
            return Schedule.parse(entry["schedule"]) if entry else None
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, schedule: Schedule, times: dict) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with self._locked():
            data = self.load()
            data[key] = {"schedule": str(schedule), "times_ms": times}
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".autotune.", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
            os.replace(tmp, self.path)

    @contextlib.contextmanager
    def _locked(self):
        """The file's lock, waited for at most config.CACHE_LOCK_TIMEOUT_S (TimeoutError, naming it)."""
        with open(self.path + ".lock", "w") as lock:
            deadline = time.monotonic() + config.CACHE_LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.path}.lock stayed held by another process for "
                                           f"{config.CACHE_LOCK_TIMEOUT_S:g} s") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def autotune_schedule(op, shapes, dtype, axis_size, *, measure: Callable | None,
                      cache: AutotuneCache | None = None, comms: Sequence[str] | None = None,
                      out_dtype=None) -> Schedule:
    """Measure the model's top candidates (among `comms`) once on local devices; cache and return the fastest.

    `measure(op, schedule, shapes, dtype, axis_size, out_dtype=out_dtype)` returns milliseconds per
    call with `out_dtype` results (None: `dtype`; for the ops, `ficco_jax.ops.measure.time_op`)."""
    cache = cache or AutotuneCache()
    key = cache_key(op, shapes, dtype, axis_size, jax.devices()[0].device_kind, out_dtype)
    if comms is not None and "dma" not in comms:
        key += "|no-dma"  # a winner measured with copy engines must not serve a call that cannot use them
    hit = cache.get(key)
    if hit is not None:
        return hit
    local = len(jax.local_devices())
    if axis_size > local:
        # Measuring runs the op on this process's devices; a group spanning processes cannot be
        # timed from one of them. The model's pick it is, said once per call site at trace time.
        chosen = select_schedule(op, shapes, dtype, axis_size, comms=comms, out_dtype=out_dtype)
        log.warning("ficco_jax autotune %s: the group of %d devices spans processes (%d local), so it cannot be "
                    "measured here; using the cost model's pick %s (not cached)", key, axis_size, local, chosen)
        return chosen
    if measure is None:
        raise ValueError(f"autotune {key}: no `measure` callable to time the candidates with")
    comms = tuple(comms or available_comms())
    ranked = cost_model.rank(op, shapes, dtype, axis_size, candidates(op, axis_size, comms, dtype),
                             profile_for(axis_size), out_dtype)
    shortlist = [s for _, s in ranked[:AUTOTUNE_TOP_K]]
    if Schedule(comm="none") not in shortlist:
        shortlist.append(Schedule(comm="none"))
    failed: dict = {}

    def timed(schedule):
        try:
            return measure(op, schedule, shapes, dtype, axis_size, out_dtype=out_dtype)
        except RuntimeError as exc:  # one that cannot run (XLA's out-of-memory error is one) is no pick
            failed[str(schedule)] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            return None

    times = timing.outside_trace(lambda: {str(s): timed(s) for s in shortlist})
    measured = [s for s in shortlist if times[str(s)] is not None]
    if failed:
        log.warning("ficco_jax autotune %s: could not time %s", key, failed)
    if not measured:
        raise RuntimeError(f"autotune {key}: no candidate could be timed: {failed}")
    best = min(measured, key=lambda s: times[str(s)])
    log.info("ficco_jax autotune %s: chose %s (%.3f ms) of %s", key, best, times[str(best)], times)
    try:
        cache.put(key, best, times)
    except OSError as exc:  # the pick stands; only remembering it failed
        log.warning("ficco_jax autotune %s: could not cache the pick (%s); it serves this trace only "
                    "(FICCO_AUTOTUNE_CACHE names another folder)", key, exc)
    return best
