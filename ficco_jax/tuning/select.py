"""The cost model's pick of a schedule (`schedule="auto"`): which comm kinds can run here, which
profile describes this machine, and the predicted-fastest valid schedule."""
from __future__ import annotations

import contextlib
import functools
import logging
import numbers
from typing import Sequence

import jax
import numpy as np

from ..runtime import extension, ipc, topology as topology_lib
from .. import config
from ..schedule import A2A_OPS, Schedule, check_shapes
from . import cost_model, first_use

log = logging.getLogger("ficco_jax")

#: Profiles shipped for known machines: (device-kind substring, axis size) -> profile name.
_KNOWN_PROFILES = {("H200", 2): "h200x2", ("H200", 4): "h200x4", ("H200", 8): "h200x8",
                   ("H100 80GB HBM3", 2): "h100x2"}

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
        if (platform == "gpu" and extension.cuda_built()) or (platform == "cpu" and extension.available()):
            comms += ("dma",)
    except ImportError as exc:
        log.warning("ficco_jax: copy-engine schedules unavailable: %s", exc)
    return comms


def dma_reaches(site, platform: str | None = None) -> bool:
    """Whether copy engines reach every peer of `site` (a `topology.SiteTopology`; None: one
    process): groups inside one process, or across processes of one host through CUDA IPC."""
    if site is None or site.in_process:
        return True
    return site.kind == topology_lib.SAME_HOST_MULTI_PROCESS and ipc.supported(platform)


def profile_name_for(device_kind: str, axis_size: int) -> str | None:
    """The shipped profile for `axis_size` devices of `device_kind`; failing that, the one of the
    same GPU with the nearest group size (ratio of sizes), whose per-GPU terms (matmul rate,
    decomposition loss, copy-engine bandwidth) still hold while the model scales the transfers
    with the group; None for a GPU no profile was calibrated on.

    Evidence for the nearest-size rule (2026-11-22, 2 x H200, 76 verified op times replayed with
    `accuracy --replay`): the h200x4 profile, fitted to 4-GPU times only, predicted them with an RMS
    log error of 6.6 %, h200x8 13 %, the conservative default 23 %. With its own profile a group
    size does better still: on 22 held-out 2-GPU cases (same machine and day, replayed) h200x2's pick was within 5 % of the best measured in 21, h200x4's
    in 16, the default's in 15 (RMS log errors 8.5 %, 19.5 %, 25.4 %)."""
    same_gpu = {size: name for (needle, size), name in _KNOWN_PROFILES.items() if needle in device_kind}
    if not same_gpu or axis_size < 1:
        return None
    if axis_size in same_gpu:
        return same_gpu[axis_size]
    nearest = min(same_gpu, key=lambda size: (abs(np.log(size / axis_size)), size))
    return same_gpu[nearest]


def profile_for(axis_size: int, device_kind: str | None = None) -> dict:
    """The profile of `axis_size` devices of this machine's GPUs, or of `device_kind`: the shipped
    one calibrated for exactly them; else, for this machine's GPUs, one measured on first use and
    cached (first_use.py; off with FICCO_PROFILE_MEASURE=0); else the same GPU's shipped profile of
    the nearest group size (`profile_name_for`); else the conservative default."""
    here = device_kind is None
    kind = jax.devices()[0].device_kind if here else device_kind
    name = profile_name_for(kind, axis_size)
    shipped = None
    if name is not None:
        with contextlib.suppress(FileNotFoundError):
            shipped = cost_model.load_profile(name)
    if shipped is not None and shipped.get("axis_size", axis_size) == axis_size:
        return shipped
    if here and jax.default_backend() == "gpu":
        measured = first_use.profile(kind, axis_size, with_dma="dma" in available_comms())
        if measured is not None:
            return {**cost_model.DEFAULT_PROFILE, **measured}
    if shipped is not None:
        _log_profile_stand_in(kind, axis_size, name)
        return shipped
    return cost_model.default_profile()


@functools.lru_cache(maxsize=None)
def _log_profile_stand_in(kind: str, axis_size: int, name: str) -> None:
    log.info("ficco_jax: no profile calibrated for %d x %s; the cost model uses %s (same GPU, another group "
             "size; `python -m ficco_jax calibrate` makes an exact one)", axis_size, kind, name)


def select_schedule(op: str, shapes, dtype, axis_size: int, profile=None,
                    comms: Sequence[str] | None = None, out_dtype=None) -> Schedule:
    """The predicted-fastest valid schedule, or `Schedule(comm="none")` when overlap does not pay.

    `profile`: the machine profile the cost model prices with: None (this machine's, `profile_for`),
    a shipped profile's name (e.g. "h200x4"), a JSON file's path, or a dict of a profile's entries
    (those it lacks from the default profile), checked as `python -m ficco_jax rank --profile` checks
    it (cost_model.resolve_profile)."""
    _check_inputs(op, shapes, axis_size)
    profile = cost_model.resolve_profile(profile, "select_schedule: profile")
    comms = tuple(comms or available_comms())
    if op in A2A_OPS:
        pick = _expert_pick(comms, axis_size)
        if pick.comm != "dma":
            return pick
        # A small MoE layer's blocks move in less time than a copy-engine call costs the host.
        profile = profile if profile is not None else profile_for(axis_size)
        plain = Schedule(comm="none")
        return min((pick, plain), key=lambda s: cost_model.predict(op, s, shapes, dtype, axis_size, profile, out_dtype))
    profile = profile if profile is not None else profile_for(axis_size)
    ranked = cost_model.rank(op, shapes, dtype, axis_size, candidates(op, axis_size, comms, dtype), profile,
                             out_dtype)
    return ranked[0][1]


def _check_inputs(op: str, shapes, axis_size) -> None:
    """The checks the ops make of their shapes and axis, made before any candidate is ranked: a bad
    input is named, where the ranking would only find that no candidate is valid."""
    if not isinstance(axis_size, numbers.Integral) or isinstance(axis_size, bool):
        raise TypeError(f"select_schedule: axis_size must be an int (the devices along the op's mesh axis), "
                        f"found {axis_size!r}")
    if axis_size < 1:
        raise ValueError(f"select_schedule: axis_size={axis_size} must be >= 1 (the devices along the op's mesh axis)")
    check_shapes(op, shapes, int(axis_size))


def candidates(op: str, axis_size: int, comms: Sequence[str], dtype) -> list[Schedule]:
    """The schedules `auto` and `autotune` choose among: the design space on `comms`, where FP8
    reduce-scatters keep row chunks (the profiles' executor costs were fitted to bf16 matmuls, and
    an FP8 matmul into a column slice runs other cuBLASLt kernels; a named column schedule runs)."""
    points = Schedule.enumerate(op, axis_size, comms)
    if config.is_fp8(dtype):
        points = [p for p in points if p.gemm != "columns"]
    return points


def _expert_pick(comms: Sequence[str], axis_size: int) -> Schedule:
    """The expert-parallel ops' overlapped schedule: every peer block at once (the per-peer blocks of a
    MoE layer are small, so one chunk), on copy engines where they can run (over as many copy streams
    as peers, up to the largest choice), else as XLA ppermutes. `select_schedule` keeps the plain path
    instead where the cost model prices it faster than the copy engines."""
    if axis_size == 1:
        return Schedule(comm="none")
    if "dma" in comms:
        streams = max(s for s in config.COPY_STREAM_CHOICES if s <= axis_size - 1)
        return Schedule(comm="dma", order="direct", chunks=1, copy_streams=streams)
    return Schedule(comm="xla", order="direct", chunks=1)
