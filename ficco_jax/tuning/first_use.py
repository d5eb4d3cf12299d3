"""A cost profile measured on first use, for GPUs that no shipped profile describes exactly.

`schedule="auto"` prices schedules with a machine profile (cost_model). Shipped profiles were
fitted by `calibrate` on known machines; any other device kind or group size gets one measured
here the first time an op is resolved on it, then cached per device kind and group size
(config.PROFILE_CACHE_DIR), so later processes read it. What is measured, on the group's first
devices, bf16, each probe timed by in-jit loop differencing (timing.py):

- the matmul rate: [rows, 4096] @ [4096, 4096] at two row counts (peak and decomposition loss);
- NCCL transfers: XLA's all-gather at two shard sizes (latency and ingress bandwidth);
- copy-engine transfers: a copy-engine all-gather of the larger shard (ingress bandwidth);
- op times: ag_matmul and matmul_rs, plain and on copy engines, at two sizes, to which the
  op-level costs (a copy-engine call's fixed device and host cost, per-copy latency, contention)
  are fitted as `calibrate` fits them (fitting.fit_to_ops).

About 20 s on 2 x H100 (2026-11-27) when device time differenced loops of 1 and 1 + R ops; its loops
of R and 2R ops add a compile and longer loops to each timing. Announced by one line on stderr and
closed by another, which gives the time it took.
FICCO_PROFILE_MEASURE=0 skips it (config.PROFILE_MEASURE). Only one process measures: a program
run by several processes would pick schedules from timings that differ between them, so there
the shipped profiles apply (a cached profile measured by a one-process run is not read either).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import sys
import tempfile
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import config
from ..lowering import dma
from ..schedule import Schedule, local_shapes
from . import cost_model, fitting, timing

#: Bumped when what a profile holds, or how the model reads it, changes: older caches are measured again.
MODEL_VERSION = 1
_AXIS = "g"
_INNER = 4096


@dataclasses.dataclass(frozen=True)
class Probe:
    """One timed program. `what`: "gemm" (shape: rows, K, N on one device), "nccl" / "dma" (an
    all-gather, shape: shard bytes per device), "op" (`op` under `schedule`, shape: global M, K, N)."""
    what: str
    shape: tuple[int, ...]
    op: str = ""
    schedule: str = ""


#: The probes, in the order they run (dma probes are left out where copy engines cannot run).
PROBES = (
    Probe("gemm", (1024, _INNER, _INNER)), Probe("gemm", (8192, _INNER, _INNER)),
    Probe("nccl", (2 << 20,)), Probe("nccl", (32 << 20,)), Probe("dma", (32 << 20,)),
    *(Probe("op", shape, op, sched) for op in ("ag_matmul", "matmul_rs") for sched in ("none", "dma/direct/c1")
      for shape in ((2048, _INNER, _INNER), (8192, _INNER, _INNER))),
)

#: timer(probe, devices) -> seconds per run of the probe's program.
Timer = Callable[[Probe, Sequence], float]


def cache_path(device_kind: str, axis_size: int, with_dma: bool = True) -> str:
    """Where the profile of `axis_size` devices of `device_kind` is cached; one measured without the
    copy-engine probes (`with_dma` False) has a file of its own, since its copy-engine terms are the
    fit's guesses and must not price copy engines for a process that can use them."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"
    return os.path.join(config.PROFILE_CACHE_DIR, f"{slug}_x{axis_size}{'' if with_dma else '_no-dma'}.json")


_memo: dict[tuple[str, int, bool], dict | None] = {}


def profile(device_kind: str, axis_size: int, *, with_dma: bool = True, timer: Timer | None = None,
            devices=None) -> dict | None:
    """The measured profile of `axis_size` devices of `device_kind`: from the cache, else measured
    now on `devices` (default: this process's first `axis_size` devices) and cached; the copy-engine
    probes only `with_dma` (the caller knows whether copy engines can run here). None where
    measuring is off (config.PROFILE_MEASURE), for a group of one, where several processes run the
    program, or where this process has fewer than `axis_size` such devices."""
    key = (device_kind, axis_size, with_dma)
    if key in _memo:
        return _memo[key]
    if not config.PROFILE_MEASURE or axis_size < 2 or jax.process_count() > 1:
        return None
    path = cache_path(device_kind, axis_size, with_dma)
    found = _read(path)
    if found is None:
        devices = list(devices or jax.local_devices())[:axis_size]
        if len(devices) < axis_size or any(d.device_kind != device_kind for d in devices):
            return None
        try:
            found = cost_model.check_profile(measure(devices, timer or device_seconds, with_dma=with_dma),
                                             "measured on first use")
        except Exception as exc:  # noqa: BLE001 - a profile that cannot be measured here is not an error of the op
            print(f"ficco_jax: the cost profile could not be measured here ({type(exc).__name__}: {exc}); "
                  f"auto uses a shipped or the default profile in this process", file=sys.stderr)
            _memo[key] = None
            return None
        try:
            _write(path, found)
            print(f"ficco_jax: cost profile cached in {path}", file=sys.stderr)
        except OSError as exc:
            print(f"ficco_jax: the measured cost profile could not be cached in {path} ({exc}); it serves this "
                  f"process only (FICCO_PROFILE_CACHE names another folder)", file=sys.stderr)
    _memo[key] = found
    return found


def measure(devices: Sequence, timer: Timer, probes: Sequence[Probe] = PROBES, *, with_dma: bool = True) -> dict:
    """A profile fitted to the probes' times on `devices` (one group), as `calibrate` fits one; the
    copy-engine probes only `with_dma`."""
    n, kind = len(devices), devices[0].device_kind
    probes = [p for p in probes if with_dma or not (p.what == "dma" or "dma" in p.schedule)]
    print(f"ficco_jax: no cost profile ships for {n} x {kind}; measuring one ({len(probes)} timings, "
          f"once per machine; FICCO_PROFILE_MEASURE=0 skips it) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    seconds = timing.outside_trace(lambda: {probe: timer(probe, devices) for probe in probes})
    fitted = fit(kind, n, seconds)
    dma_terms = (f", copy engines {fitted['dma_ingress_gbps']:.0f} GB/s, a copy-engine call "
                 f"{fitted['dma_call_us']:.0f} us on the GPU" if with_dma else " (copy engines not measured: "
                 "they cannot run in this process)")
    print(f"ficco_jax: measured in {time.perf_counter() - start:.1f} s: matmul "
          f"{fitted['peak_tflops']['bfloat16']:.0f} TFLOP/s, NCCL {fitted['xla_ingress_gbps']:.0f} GB/s{dma_terms}",
          file=sys.stderr, flush=True)
    return fitted


def fit(device_kind: str, n: int, seconds: dict[Probe, float]) -> dict:
    """The profile of the probes' `seconds`: the standalone terms by fitting.fit_profile, the op-level
    costs by fitting.fit_to_ops."""
    char = {"device": device_kind, "n_devices": n, "dtype": "bfloat16", "commit": config.COMMIT or "",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "decomposition": [], "transfers": [], "contention": {}}
    observations = []
    for probe, t in seconds.items():
        if probe.what == "gemm":
            rows, k, cols = probe.shape
            char["decomposition"].append({"chunks": 1, "rows": rows, "K": k, "N": cols, "ms": t * 1e3})
        elif probe.what == "nccl":
            char["transfers"].append({"comm": "nccl", "shard_bytes": probe.shape[0], "ms": t * 1e3})
        elif probe.what == "dma":
            ingress = (n - 1) * probe.shape[0] / t / 1e9
            char["transfers"].append({"comm": "dma_s1", "shard_bytes": probe.shape[0], "ingress_gbps": ingress})
        else:
            observations.append((probe.op, Schedule.parse(probe.schedule), local_shapes(probe.op, *probe.shape, n),
                                 "bfloat16", n, t))
    fitted = fitting.fit_profile(char)
    if observations:
        fitted, _ = fitting.fit_to_ops(fitted, observations)
    fitted.update(name=f"{device_kind} x{n} (measured)", model_version=MODEL_VERSION,
                  source=f"measured on first use on {char['date']} by ficco_jax.tuning.first_use "
                         f"({len(seconds)} timings; {timing.METHOD})")
    return fitted


def device_seconds(probe: Probe, devices: Sequence) -> float:
    """Seconds per run of the probe's program on `devices` (timing.device_time), on a mesh of its
    own (one device for a matmul); `measure` calls it outside the caller's trace."""
    devices = devices[:1] if probe.what == "gemm" else devices
    make, args = _program(probe, Mesh(np.array(devices), (_AXIS,)))
    return timing.device_time(make, args)["median_s"]


def _program(probe: Probe, mesh: Mesh):
    """(make(R) -> jitted R runs, args) of a probe on `mesh` (one device for a matmul)."""
    key = jax.random.PRNGKey(0)
    if probe.what == "gemm":
        rows, k, cols = probe.shape
        a = _put(jax.random.normal(key, (rows, k), jnp.bfloat16), mesh, P())
        b = _put(jax.random.normal(key, (k, cols), jnp.bfloat16), mesh, P())
        return (lambda r: jax.jit(timing.chain(jnp.dot, r))), (a, b)
    n = mesh.shape[_AXIS]
    if probe.what in ("nccl", "dma"):
        rows = max(1, probe.shape[0] // (2 * _INNER))
        x = _put(jax.random.normal(key, (n * rows, _INNER), jnp.bfloat16), mesh, P(_AXIS))
        gather = ((lambda v: lax.all_gather(v, _AXIS, tiled=True)) if probe.what == "nccl" else
                  (lambda v: dma.all_gather(v, _AXIS, schedule=Schedule.parse("dma/direct/c1"))))
        step = jax.shard_map(gather, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS))
        return (lambda r: jax.jit(timing.chain(step, r))), (x,)
    (a_shape, w_shape) = local_shapes(probe.op, *probe.shape, n)
    schedule = Schedule.parse(probe.schedule)
    if probe.op == "ag_matmul":
        specs = (P(_AXIS), P(None, _AXIS))
        body = (lambda x, w: jnp.dot(lax.all_gather(x, _AXIS, tiled=True), w)) if schedule.comm == "none" else \
            (lambda x, w: dma.ag_matmul_dma(x, w, _AXIS, schedule, gathered_needed=False)[0])
        out_spec = P(None, _AXIS)
        global_shapes = ((n * a_shape[0], a_shape[1]), (w_shape[0], n * w_shape[1]))
    else:
        specs = (P(None, _AXIS), P(_AXIS))
        body = (lambda y, w: lax.psum_scatter(jnp.dot(y, w), _AXIS, scatter_dimension=0, tiled=True)) \
            if schedule.comm == "none" else (lambda y, w: dma.matmul_rs_dma(y, w, _AXIS, schedule))
        out_spec = P(_AXIS)
        global_shapes = ((a_shape[0], n * a_shape[1]), (n * w_shape[0], w_shape[1]))
    a = _put(jax.random.normal(key, global_shapes[0], jnp.bfloat16), mesh, specs[0])
    w = _put(jax.random.normal(key, global_shapes[1], jnp.bfloat16), mesh, specs[1])
    step = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec)
    return (lambda r: jax.jit(timing.chain(step, r))), (a, w)


def _put(value, mesh, spec):
    return jax.device_put(value, NamedSharding(mesh, spec))


def _read(path: str) -> dict | None:
    try:
        with open(path) as fh:
            found = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or found.get("model_version") != MODEL_VERSION:
        return None
    try:
        return cost_model.check_profile(found, path)
    except ValueError:  # damaged, or fitted to bad timings: measured again
        return None


def _write(path: str, found: dict) -> None:
    """Atomically (concurrent first uses on one machine each write a whole file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(found, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)
