"""Predicted time of a schedule from a machine profile.

The model replays a schedule as a small event simulation on one device:

- transfers: each copy stream moves its chunks one after the other; a transfer of b bytes takes
  `latency + b / bandwidth`, where concurrent streams share the device's ingress
  (`dma_ingress_gbps` for one copy stream, `dma_multistream_gbps` in total for several) —
  copy engines (comm="dma") or NCCL steps (comm="xla"). The executor moves a block that
  `gemm=grouped` writes whole in one copy; the model still charges it a transfer per chunk, as
  the shipped profiles' fits (to op times taken when such blocks moved chunk by chunk) assume;
- chunk matmuls: issued on one stream in schedule order, each after its chunk has landed; a
  matmul of r rows costs `launch + 2*r*K*N / (peak * r / (r + rows_half))`. `rows_half` is the
  decomposition loss: the row count at which a matmul runs at half its peak rate (thin matmuls
  under-fill the GPU); `calibrate` fits it from measured chunk-matmul times;
- contention: a matmul running beside transfers is slowed by `contention_dma` (copy engines
  steal no SMs: a few %) or `contention_xla` (NCCL kernels take SMs);
- `xla_overlaps`: whether XLA runs its collectives beside its matmuls at all on this machine
  (`characterize`'s contention probe). Where it ran them one after the other, an `xla` schedule
  costs its chunk matmuls plus its transfers, one after the other;
- the executor's chunk matmuls (cuBLASLt) run `executor_gemm_slowdown` times slower than XLA's
  own autotuned GEMMs, which the `none` and `xla` schedules use (alone they are as fast, 2026-11-22 on H200:
  what the fit puts here is the slowdown inside a copy-engine call, e.g. from copies beside them), and
  lose `executor_rows_half` rows where XLA's lose `rows_half` (profiles without it: the same loss);
  both are fitted to op times, not to the characterization's XLA dots;
- a fixed cost per copy-engine call on the GPU, `dma_call_us` (event waits, the join), and its
  host time, `dma_host_us` (two host rendezvous) plus `dma_host_copy_us` per enqueued copy
  ((n - 1) x chunks of them): the host work overlaps earlier
  GPU work, so it only bounds the time from below — what makes copy-engine overlap lose on
  small operations.

The expert ops are priced as the tensor-parallel op that moves and multiplies the same blocks: the
dispatch (`a2a_matmul`) as `ag_matmul`, the combine (`matmul_a2a`) as `matmul_rs` without its sum.

`matmul_psum` is priced as what it runs: its schedule's `matmul_rs`, then the all-gather of the
reduced rows (one copy-engine call, one stream, for comm="dma"; XLA's all-gather for "xla"),
which nothing overlaps; its plain path is the matmul and XLA's all-reduce, a reduce-scatter's
and an all-gather's worth of traffic.

A profile is a dict (see `profiles/*.json`); `default_profile()` is conservative for unknown
machines, `load_profile(name_or_path)` reads a calibrated one.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import numpy as np

from ..schedule import Schedule

_PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")

#: Conservative defaults (an H100/H200-class GPU on NVSwitch), used when no profile matches.
DEFAULT_PROFILE = {
    "name": "default",
    "device_kind": "unknown",
    "peak_tflops": {"bfloat16": 650.0, "float16": 650.0, "float32": 50.0},
    "rows_half": 256.0,
    "gemm_launch_us": 6.0,
    "executor_gemm_slowdown": 1.0,
    "hbm_gbps": 3000.0,
    "dma_latency_us": 12.0,
    "dma_call_us": 10.0,
    "dma_host_us": 100.0,
    "dma_host_copy_us": 0.0,
    "dma_ingress_gbps": 250.0,
    "dma_stream_gbps": 150.0,
    "dma_multistream_gbps": 150.0,
    "xla_latency_us": 20.0,
    "xla_ingress_gbps": 250.0,
    "collective_latency_us": 25.0,
    "contention_dma": 0.03,
    "contention_xla": 0.12,
    # Every machine characterized so far (2, 4 and 8 x H200, 2 x H100; jax 0.11.2) ran XLA's
    # matmul and NCCL transfers one after the other.
    "xla_overlaps": False,
}


def default_profile() -> dict:
    return dict(DEFAULT_PROFILE)


def load_profile(name_or_path: str) -> dict:
    """A profile by file path or by name in ficco_jax/tuning/profiles (e.g. "h200x4"); "default" is the
    conservative one."""
    if name_or_path == "default" and not os.path.exists(name_or_path):
        return default_profile()
    path = name_or_path if os.path.exists(name_or_path) else os.path.join(_PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        shipped = sorted(f[:-5] for f in os.listdir(_PROFILE_DIR) if f.endswith(".json")) if os.path.isdir(_PROFILE_DIR) else []
        raise FileNotFoundError(f"no machine profile {name_or_path!r}; shipped profiles: {shipped}; "
                                f"make one with `python -m ficco_jax calibrate --out FILE`")
    with open(path) as fh:
        profile = json.load(fh)
    return check_profile({**DEFAULT_PROFILE, **profile} if isinstance(profile, dict) else profile, path)


def resolve_profile(profile, what: str) -> dict | None:
    """The profile that `profile` gives, checked: None stays None (the caller's default); a name or a
    path is loaded as `load_profile` reads it; a dict is taken as a file's contents would be (entries
    it lacks from DEFAULT_PROFILE). Whatever the model cannot price with is a clear error that starts
    with `what` (e.g. "rank --profile"): ValueError for a bad profile, OSError for a file that cannot
    be read, TypeError for another kind of value. The command line's --profile and select_schedule's
    `profile=` both go through here."""
    if profile is None:
        return None
    if isinstance(profile, (str, os.PathLike)):
        name = os.fspath(profile)
        try:
            return load_profile(name)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{what} {name}: not a JSON profile ({exc}); expected a shipped profile name (e.g. "
                             f"h200x4) or a JSON file that `python -m ficco_jax calibrate --out FILE` wrote") from exc
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from exc
        except OSError as exc:
            raise type(exc)(f"{what}: {exc}") from exc
    if isinstance(profile, Mapping):
        if not profile:
            raise ValueError(f"{what}: the profile is empty; expected a machine profile (a dict like "
                             f"ficco_jax/tuning/profiles/h200x4.json), a shipped profile name (e.g. 'h200x4'), "
                             f"'default', a JSON path, or None for this machine's")
        try:
            return check_profile({**DEFAULT_PROFILE, **profile}, "given as a dict")
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from exc
    raise TypeError(f"{what}: expected a profile name, a JSON path, a dict or None, found {type(profile).__name__}")


#: The profile's rates, which the model divides by (positive), and its other numbers (at least 0).
_RATES = ("hbm_gbps", "dma_ingress_gbps", "dma_stream_gbps", "dma_multistream_gbps", "xla_ingress_gbps")
_TERMS = ("rows_half", "gemm_launch_us", "executor_gemm_slowdown", "dma_latency_us", "dma_call_us", "dma_host_us",
          "dma_host_copy_us", "xla_latency_us", "collective_latency_us", "contention_dma", "contention_xla")


def check_profile(profile, source: str) -> dict:
    """`profile` itself where the model can price schedules with it, else a ValueError that names
    `source` (its file, or how it was made) and the first bad entry."""
    def bad(what):
        return ValueError(f"machine profile {source}: {what}; make one with `python -m ficco_jax calibrate --out FILE`")

    if not isinstance(profile, dict):
        raise bad(f"expected a JSON object, found {type(profile).__name__}")
    peaks = profile.get("peak_tflops")
    if not isinstance(peaks, dict) or "bfloat16" not in peaks:
        raise bad(f"peak_tflops must map dtypes to TFLOP/s, bfloat16 among them; found {peaks!r}")
    entries = ([(f"peak_tflops.{k}", v, True) for k, v in peaks.items()] + [(k, profile.get(k), True) for k in _RATES]
               + [(k, profile.get(k), False) for k in _TERMS])
    for key, value, rate in entries:
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))
        if not number or value < 0 or (rate and value == 0):
            raise bad(f"{key} = {value!r}, expected a finite number {'> 0' if rate else '>= 0'}")
    return profile


def _peak_tflops(dtype: str, peaks: Mapping) -> float:
    """The dtype's matmul peak in the profile; FP8 without one of its own: twice bf16's (Hopper's
    dense FP8 rate is twice its bf16 rate)."""
    if dtype in peaks:
        return peaks[dtype]
    if dtype.startswith("float8"):
        return peaks.get("float8_e4m3fn", 2 * peaks["bfloat16"])
    return peaks["float32"]


def gemm_time(rows: int, k: int, n_cols: int, dtype: str, profile: Mapping, executor: bool = False) -> float:
    """Seconds for a [rows, k] @ [k, n_cols] matmul, decomposition loss included (by XLA, or by
    the copy-engine executor's cuBLASLt when `executor`)."""
    peak = _peak_tflops(dtype, profile["peak_tflops"]) * 1e12
    flops = 2.0 * rows * k * n_cols
    rows_half = profile.get("executor_rows_half", profile["rows_half"]) if executor else profile["rows_half"]
    compute = flops * (rows + rows_half) / (rows * peak)
    itemsize = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    memory = itemsize * (rows * k + k * n_cols + rows * n_cols) / (profile["hbm_gbps"] * 1e9)
    slowdown = profile["executor_gemm_slowdown"] if executor else 1.0
    return profile["gemm_launch_us"] * 1e-6 + max(compute * slowdown, memory)


def _transfer_time(nbytes: float, streams: int, comm: str, profile: Mapping) -> float:
    if comm == "dma":
        # Several copy streams per device share its ingress, and on NVSwitch they got less of it
        # in total than one stream did (dma_multistream_gbps is that total).
        total = profile["dma_ingress_gbps"] if streams == 1 else profile["dma_multistream_gbps"]
        bw = min(profile["dma_stream_gbps"], total / streams) * 1e9
        return profile["dma_latency_us"] * 1e-6 + nbytes / bw
    return profile["xla_latency_us"] * 1e-6 + nbytes / (profile["xla_ingress_gbps"] * 1e9 / streams)


def predict(op: str, schedule: Schedule, shapes: Sequence[Sequence[int]], dtype, axis_size: int,
            profile: Mapping | None = None, out_dtype=None) -> float:
    """Predicted seconds of `op` under `schedule` for per-device `shapes` on `axis_size` devices;
    `dtype` is the operands' (the matmul rate), `out_dtype` the result's (None: the same), which
    matmul_rs moves and sums."""
    profile = profile or DEFAULT_PROFILE
    dtype = np.dtype(dtype).name
    schedule.validate(op, shapes, axis_size)
    if op == "matmul_psum":
        return _predict_all_reduce(schedule, shapes, dtype, axis_size, profile, out_dtype)
    if op in ("a2a_matmul", "matmul_a2a"):
        op, shapes = _expert_as_tensor_parallel(op, shapes, axis_size)
    (a0, a1), (_, w1) = shapes
    n = axis_size
    moved_dtype = dtype if op == "ag_matmul" or out_dtype is None else np.dtype(out_dtype).name
    itemsize = np.dtype(moved_dtype).itemsize
    if op == "ag_matmul":
        m, k, cols, moved_cols = a0, a1, w1, a1  # moves x rows [., K]; matmul [., K] @ [K, N]
    else:
        m, k, cols, moved_cols = a0 // n, a1, w1, w1  # moves output rows [., K_out]
    if n == 1:
        # A group of one has nothing to move; a copy-engine call still costs its own launch, events
        # and a local copy (about 16 us on one H100, 2026-11-24), so the plain path ranks first.
        extra = profile["dma_call_us"] * 1e-6 if schedule.comm == "dma" else 0.0
        return gemm_time(m, k, cols, dtype, profile) + extra
    coll = profile["collective_latency_us"] * 1e-6 + (n - 1) * m * moved_cols * itemsize / (profile["xla_ingress_gbps"] * 1e9)
    plain = coll + gemm_time(n * m, k, cols, dtype, profile)
    if schedule.comm == "none":
        return plain
    device_time = _simulate(op, schedule, m, k, cols, moved_cols * itemsize, n, dtype, profile)
    if schedule.comm == "xla":  # run one after the other, its parts cost at least the plain path's
        return device_time if profile["xla_overlaps"] else max(device_time, plain)
    copies = (n - 1) * schedule.chunks  # each enqueued with its event on the host
    host = profile["dma_host_us"] + profile.get("dma_host_copy_us", 0.0) * copies
    return max(device_time + profile["dma_call_us"] * 1e-6, host * 1e-6)


def _expert_as_tensor_parallel(op: str, shapes, n: int):
    """An expert op as the tensor-parallel op that moves and multiplies the same: each peer block is
    E_local x C rows; the dispatch (a2a_matmul) receives it before multiplying it, as ag_matmul does,
    and the combine (matmul_a2a) multiplies then sends it, as matmul_rs does, without the sum. The
    executor multiplies a block's local experts in one batched matmul, priced as one of E_local x C
    rows."""
    (_, e_local, capacity, inner), (_, _, cols) = shapes
    rows = e_local * capacity
    if op == "a2a_matmul":
        return "ag_matmul", ((rows, inner), (inner, cols))
    return "matmul_a2a", ((n * rows, inner), (inner, cols))


def _predict_all_reduce(schedule: Schedule, shapes, dtype: str, n: int, profile: Mapping, out_dtype) -> float:
    """matmul_psum: the plain matmul + all-reduce, or its matmul_rs schedule + the all-gather."""
    (rows, k), (_, cols) = shapes
    itemsize = np.dtype(out_dtype or dtype).itemsize
    block_bytes = rows * cols * itemsize / n  # what each device holds of the sum after the reduce-scatter
    if schedule.comm == "none":
        # A ring all-reduce moves a reduce-scatter's and an all-gather's worth.
        traffic = 2 * (n - 1) * block_bytes / (profile["xla_ingress_gbps"] * 1e9) if n > 1 else 0.0
        latency = profile["collective_latency_us"] * 1e-6 if n > 1 else 0.0
        return gemm_time(rows, k, cols, dtype, profile) + latency + traffic
    scattered = predict("matmul_rs", schedule, shapes, dtype, n, profile, out_dtype)
    return scattered + all_gather_time(block_bytes, n, schedule.comm, profile)


def all_gather_time(block_bytes: float, n: int, comm: str, profile: Mapping) -> float:
    """Seconds of an all-gather of `block_bytes` per device over `n` devices: on copy engines one
    call pulling the n - 1 blocks on one copy stream (dma.all_gather's default), bounded below by
    its host work; else XLA's all-gather. A group of one moves nothing (a copy-engine call still
    costs its own launch, as in `predict`)."""
    if n == 1:
        return profile["dma_call_us"] * 1e-6 if comm == "dma" else 0.0
    if comm == "dma":
        device = profile["dma_call_us"] * 1e-6 + (n - 1) * _transfer_time(block_bytes, 1, "dma", profile)
        host = (profile["dma_host_us"] + profile.get("dma_host_copy_us", 0.0) * (n - 1)) * 1e-6
        return max(device, host)
    return profile["collective_latency_us"] * 1e-6 + (n - 1) * block_bytes / (profile["xla_ingress_gbps"] * 1e9)


def _simulate(op, s: Schedule, m, k, cols, row_bytes, n, dtype, profile) -> float:
    c = s.chunks
    q = m // c
    streams = s.copy_streams if s.comm == "dma" and s.order == "direct" else (2 if s.order == "bidirectional" else 1)
    if s.comm == "xla" and s.order == "direct":
        streams = n - 1
    contention = 1.0 + (profile["contention_dma"] if s.comm == "dma" else profile["contention_xla"])
    ex = s.comm == "dma"  # chunk matmuls by the executor's cuBLASLt, else by XLA
    chunk_bytes = q * row_bytes
    # Transfers: (peer step, chunk) items dealt round-robin over streams; a ring moves one step
    # after the other, so every item waits for the previous one on its single stream.
    items = [(step, j) for step in range(1, n) for j in range(c)]
    stream_free = [0.0] * streams
    arrival = {}
    per_item = _transfer_time(chunk_bytes, streams, s.comm, profile)
    if s.comm == "xla" and not profile["xla_overlaps"]:
        matmuls = gemm_time(m, k, cols, dtype, profile) + (n - 1) * (c // group_of(s)) * gemm_time(
            q * group_of(s), k, cols, dtype, profile)
        return matmuls + -(-len(items) // streams) * per_item
    if op in ("matmul_rs", "matmul_a2a"):
        return _simulate_rs(s, m, q, k, cols, n, dtype, profile, contention, streams, per_item, ex, row_bytes // cols,
                            summed=op == "matmul_rs")
    for i, (step, j) in enumerate(items):
        lane = ((step - 1) % streams) if s.comm == "dma" else (i % streams)
        start = stream_free[lane]
        stream_free[lane] = start + per_item
        arrival[(step, j)] = stream_free[lane]
    # Matmuls: own shard first (no wait), then peers in order.
    t = gemm_time(m, k, cols, dtype, profile, ex) * contention
    group = group_of(s)
    for step in range(1, n):
        for j0 in range(0, c, group):
            ready = max(arrival[(step, j)] for j in range(j0, j0 + group))
            t = max(t, ready) + gemm_time(q * group, k, cols, dtype, profile, ex) * contention
    return t


def group_of(s: Schedule) -> int:
    """Chunks per matmul: all of a peer's (gemm=grouped) or one."""
    return s.chunks if s.gemm == "grouped" else 1


def _simulate_rs(s, m, q, k, cols, n, dtype, profile, contention, streams, per_item, ex, itemsize,
                 summed: bool = True) -> float:
    """matmul_rs (`summed`: the received partials are added to the own block's), or the combine of the
    expert ops, which sends its blocks without a sum. gemm=columns: a chunk is all m rows of a block and
    a c-th of its columns, so its matmul reads a c-th of the weight."""
    c = s.chunks
    group = group_of(s)

    def chunks_gemm(count: int) -> float:  # the matmul of `count` consecutive chunks of one block
        if s.gemm == "columns":
            return gemm_time(m, k, cols * count // c, dtype, profile, ex) * contention
        return gemm_time(q * count, k, cols, dtype, profile, ex) * contention

    t = 0.0
    produced = {}
    for step in range(1, n):  # partials for peers first, in distance order
        for j0 in range(0, c, group):
            t += chunks_gemm(group)
            for j in range(j0, j0 + group):
                produced[(step, j)] = t
    stream_free = [0.0] * streams
    arrival = {}
    for i, key in enumerate(sorted(produced, key=produced.get)):
        lane = i % streams
        start = max(stream_free[lane], produced[key])
        stream_free[lane] = start + per_item
        arrival[key] = stream_free[lane]  # by symmetry, also when the peers' chunk `key` lands here
    last_arrival = max(arrival.values(), default=0.0)

    def sum_time(rows: int, reads: int) -> float:  # memory-bound: `reads` blocks of `rows` rows read
        return reads * rows * cols * itemsize / (profile["hbm_gbps"] * 1e9) + profile["gemm_launch_us"] * 1e-6

    if not summed:
        return max(t + gemm_time(m, k, cols, dtype, profile, ex) * contention, last_arrival)
    if ex and s.gemm != "grouped" and c > 1 and n > 1:
        # The executor multiplies our own block after the transfers in two halves, each adding the
        # first received partial in its epilogue; on more than 2 devices a sum per half adds the
        # other n - 2, or, for column halves, one sum of the block after both (exec/scatter.cc,
        # SumInMatmuls).
        for first, end in ((0, c // 2), (c // 2, c)):
            t = max(t, max(arrival[(step, j)] for step in range(1, n) for j in range(first, end)))
            t += chunks_gemm(end - first)
            if n > 2 and s.gemm != "columns":
                t += sum_time((end - first) * q, n - 1)
        if n > 2 and s.gemm == "columns":
            t = max(t, last_arrival) + sum_time(m, n - 1)
        return max(t, last_arrival)
    own_done = t + gemm_time(m, k, cols, dtype, profile, ex) * contention
    # Summing the received partials is memory-bound (n blocks read per row). XLA adds each chunk as it
    # arrives, all but the last chunk's sum hiding behind later transfers: one chunk's sum is left.
    # The executor (gemm=grouped, or one chunk) sums the whole block after its own block's matmul: on
    # 2 x H100 (2026-11-27) that sum was what the reduce-scatter anchors lost to the ideal, 47-65 us
    # per call after the last matmul.
    return max(own_done, last_arrival) + sum_time(m if ex else q, n)


def rank(op: str, shapes, dtype, axis_size: int, candidates: Sequence[Schedule], profile=None, out_dtype=None):
    """[(predicted seconds, schedule)] for the candidates, fastest first."""
    scored = []
    for sched in candidates:
        try:
            scored.append((predict(op, sched, shapes, dtype, axis_size, profile, out_dtype), sched))
        except ValueError:
            continue
    scored.sort(key=lambda pair: (pair[0], str(pair[1])))
    if not scored:
        raise ValueError(f"{op}: no candidate schedule is valid for shapes {shapes} on {axis_size} devices")
    return scored

