"""Choosing a schedule per op: the cost model's pick (`schedule="auto"`) or a measured one
(`schedule="autotune"`, cached on disk by op, shapes, dtype, axis size and device kind)."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
from typing import Sequence

import jax
import numpy as np

from . import config, cost_model
from .schedule import Schedule

log = logging.getLogger("ficco_jax")

#: Profiles shipped for known machines: (device-kind substring, axis size) -> profile name.
_KNOWN_PROFILES = {("H200", 2): "h200x2", ("H200", 4): "h200x4", ("H200", 8): "h200x8"}

#: How many of the model's best candidates autotune measures.
AUTOTUNE_TOP_K = 6


def available_comms(platform: str | None = None, topology=None) -> tuple[str, ...]:
    """The comm kinds that can run on `platform` (default: JAX's default backend) for an op site
    whose peers are described by `topology` (a `topology.SiteTopology`; None: all in this process).

    `dma` needs the compiled extension (its CUDA backend on GPUs, its CPU backend of memcpy and
    reference loops on CPU) and copy engines that reach every peer: every group of the site inside
    one process, or, on GPUs with the CUDA build, inside one host (CUDA IPC between its
    processes, docs/multiprocess.md). Other hosts, and other processes on CPU, take xla.
    """
    platform = platform or jax.default_backend()
    comms = ("none", "xla")
    if not dma_reaches(topology, platform):
        return comms
    try:
        from . import _ext

        if (platform == "gpu" and _ext.cuda_built()) or (platform == "cpu" and _ext.available()):
            comms += ("dma",)
    except ImportError as exc:
        log.warning("ficco_jax: copy-engine schedules unavailable: %s", exc)
    return comms


def dma_reaches(site, platform: str | None = None) -> bool:
    """Whether copy engines reach every peer of `site` (a `topology.SiteTopology`; None: one
    process): groups inside one process, or across processes of one host through CUDA IPC."""
    from . import ipc, topology as topology_lib

    if site is None or site.in_process:
        return True
    return site.kind == topology_lib.SAME_HOST_MULTI_PROCESS and ipc.supported(platform)


def profile_name_for(device_kind: str, axis_size: int) -> str | None:
    """The shipped profile for `axis_size` devices of `device_kind`; failing that, the one of the
    same GPU with the nearest group size (ratio of sizes), whose per-GPU terms (matmul rate,
    decomposition loss, copy-engine bandwidth) still hold while the model scales the transfers
    with the group; None for a GPU no profile was calibrated on.

    Evidence for the nearest-size rule (session 5, 2 x H200, 76 verified op times of
    benchmarks/2026-11-22-session5, `accuracy --replay`): the h200x4 profile, fitted to 4-GPU times
    only, predicted them with an RMS log error of 6.6 %, h200x8 13 %, the conservative default 23 %.
    With its own profile a group size does better still: on 22 held-out 2-GPU cases (session 7,
    s7x2c_accuracy.json replayed) h200x2's pick was within 5 % of the best measured in 21, h200x4's
    in 16, the default's in 15 (RMS log errors 8.5 %, 19.5 %, 25.4 %)."""
    same_gpu = {size: name for (needle, size), name in _KNOWN_PROFILES.items() if needle in device_kind}
    if not same_gpu or axis_size < 1:
        return None
    if axis_size in same_gpu:
        return same_gpu[axis_size]
    nearest = min(same_gpu, key=lambda size: (abs(np.log(size / axis_size)), size))
    return same_gpu[nearest]


def profile_for(axis_size: int, device_kind: str | None = None) -> dict:
    """The calibrated profile of this machine, or of `device_kind` (by `profile_name_for`), else the
    conservative default."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    name = profile_name_for(kind, axis_size)
    if name is not None:
        with contextlib.suppress(FileNotFoundError):
            profile = cost_model.load_profile(name)
            if profile.get("axis_size", axis_size) != axis_size:
                _log_profile_stand_in(kind, axis_size, name)
            return profile
    return cost_model.default_profile()


@functools.lru_cache(maxsize=None)
def _log_profile_stand_in(kind: str, axis_size: int, name: str) -> None:
    log.info("ficco_jax: no profile calibrated for %d x %s; the cost model uses %s (same GPU, another group "
             "size; `python -m ficco_jax calibrate` makes an exact one)", axis_size, kind, name)


def select_schedule(op: str, shapes, dtype, axis_size: int, profile=None,
                    comms: Sequence[str] | None = None) -> Schedule:
    """The predicted-fastest valid schedule, or `Schedule(comm="none")` when overlap does not pay."""
    comms = tuple(comms or available_comms())
    profile = profile or profile_for(axis_size)
    ranked = cost_model.rank(op, shapes, dtype, axis_size, Schedule.enumerate(op, axis_size, comms), profile)
    return ranked[0][1]


#: On CPU "auto" means no overlap (host collectives are memcpys). Tests set this to run the GPU
#: decision (cost model over every comm kind that can run) on CPU devices.
MODEL_ON_CPU = False


def choose(op: str, shapes, dtype, axis_size: int, *, autotune: bool = False, topology=None) -> Schedule:
    """What `schedule="auto"` / `"autotune"` resolve to at trace time.

    The candidates are only schedules that can run this call: `comm="dma"` is left out where the
    peers are not all in this process (`topology`) or the executor lacks the dtype, with a log
    line saying why, so the pick never needs correcting afterwards.
    """
    if jax.default_backend() == "cpu" and not MODEL_ON_CPU:
        # Host "collectives" are memcpys that block the host thread: nothing to overlap.
        return Schedule(comm="none")
    comms, why_not_dma = allowed_comms(dtype, topology)
    chosen = (autotune_schedule(op, shapes, dtype, axis_size, comms=comms) if autotune
              else select_schedule(op, shapes, dtype, axis_size, comms=comms))
    if why_not_dma:
        log.info("ficco_jax %s %s over axis %r: %s, so %s (XLA's collectives)", op, shapes,
                 getattr(topology, "axis_name", None), why_not_dma, chosen)
    return chosen


def allowed_comms(dtype, topology=None) -> tuple[tuple[str, ...], str]:
    """(comm kinds that can run a call of `dtype` whose peers are `topology`, why dma is not among
    them or "" when it is, or when the extension is simply not built)."""
    comms = available_comms(topology=topology)
    if not dma_reaches(topology):
        return comms, f"{topology.why_not_in_process()}; comm='dma' cannot reach every peer from here"
    name = np.dtype(dtype).name
    if "dma" in comms and name not in config.DMA_DTYPES:
        return tuple(c for c in comms if c != "dma"), f"comm='dma' handles dtypes {config.DMA_DTYPES}, not {name}"
    return comms, ""


# ------------------------------------------------------------------------------------------------
# Autotune cache
# ------------------------------------------------------------------------------------------------
def cache_key(op, shapes, dtype, axis_size, device_kind) -> str:
    dims = "x".join(",".join(str(int(d)) for d in s) for s in shapes)
    return f"{op}|{dims}|{np.dtype(dtype).name}|n{axis_size}|{device_kind}"


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
        import fcntl

        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def autotune_schedule(op, shapes, dtype, axis_size, *, cache: AutotuneCache | None = None,
                      comms: Sequence[str] | None = None) -> Schedule:
    """Measure the model's top candidates (among `comms`) once on local devices; cache and return the fastest."""
    cache = cache or AutotuneCache()
    key = cache_key(op, shapes, dtype, axis_size, jax.devices()[0].device_kind)
    if comms is not None and "dma" not in comms:
        key += "|no-dma"  # a winner measured with copy engines must not serve a call that cannot use them
    hit = cache.get(key)
    if hit is not None:
        return hit
    local = len(jax.local_devices())
    if axis_size > local:
        # Measuring runs the op on this process's devices; a group spanning processes cannot be
        # timed from one of them. The model's pick it is, said once per call site at trace time.
        chosen = select_schedule(op, shapes, dtype, axis_size, comms=comms)
        log.warning("ficco_jax autotune %s: the group of %d devices spans processes (%d local), so it cannot be "
                    "measured here; using the cost model's pick %s (not cached)", key, axis_size, local, chosen)
        return chosen
    from . import bench  # measuring needs the benchmark harness; only autotune pays for importing it

    comms = tuple(comms or available_comms())
    ranked = cost_model.rank(op, shapes, dtype, axis_size, Schedule.enumerate(op, axis_size, comms),
                             profile_for(axis_size))
    candidates = [s for _, s in ranked[:AUTOTUNE_TOP_K]]
    if Schedule(comm="none") not in candidates:
        candidates.append(Schedule(comm="none"))
    times = {str(s): bench.time_op(op, s, shapes, dtype, axis_size) for s in candidates}
    best = min(candidates, key=lambda s: times[str(s)])
    log.info("ficco_jax autotune %s: chose %s (%.3f ms) of %s", key, best, times[str(best)], times)
    cache.put(key, best, times)
    return best
