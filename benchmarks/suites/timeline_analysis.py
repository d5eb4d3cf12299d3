"""Device activity of traced training steps: event classes, interval arithmetic, exposed communication.

Pure functions over the events of a JAX profiler trace (the perfetto_trace.json.gz that
`perfetto_timeline.load` reads). On GPUs, CUPTI puts each device in a process named
`/device:GPU:N` with one thread per CUDA stream (`Stream #N(Compute,MemcpyP2P)`): kernels by
their (demangled) names, copies as `MemcpyP2P`, `MemcpyD2D`, `MemcpyH2D`, ... Each event is
classed by its name:

    nccl     kernels of NCCL (and XLA's own collective kernels): communication on the SMs
    copy     peer memcpys, and device-to-device ones off XLA's kernel streams: the copy engines
    gemm     matmul kernels (cuBLAS / cuBLASLt / CUTLASS / nvjet)
    compute  every other kernel
    other    memsets, host<->device copies, and device-to-device copies on a stream that runs
             kernels (XLA's own buffer copies, not communication)

Communication is nccl + copy; compute is gemm + compute. A step's exposed communication is the
time where some communication runs and no compute does: |U(comm) - U(compute)|, with U the union
of intervals. Times are microseconds.
"""
from __future__ import annotations

import bisect
import dataclasses
import re

COMPUTE = ("gemm", "compute")
COMM = ("nccl", "copy")
#: Gaps in the union of compute intervals longer than this are reported as idle (where XLA's
#: scheduler or command buffers break around custom calls).
IDLE_GAP_US = 20.0
#: Copies closer than this on the copy streams (and of one HLO op) form one row of the table.
COPY_GROUP_GAP_US = 20.0
#: Stream threads of a device process; other threads (e.g. "CUPTI overhead") are left out.
STREAM_THREAD = re.compile(r"^Stream\b", re.I)

# XLA's own collective kernels by their op's name at a word's start ("small_reduce_fusion" is not one).
_NCCL = re.compile(r"nccl|(?<![a-z])(all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                   r"collective[-_]?permute)", re.I)
_MEMCPY = re.compile(r"memcpy|memcopy", re.I)
_HOST_COPY = re.compile(r"h2d|d2h|htod|dtoh|host", re.I)
_LOCAL_COPY = re.compile(r"d2d|dtod", re.I)
_PEER_COPY = re.compile(r"p2p|ptop|peer", re.I)
_GEMM = re.compile(r"gemm|nvjet|cublas|cutlass|xmma|matmul", re.I)
_ATTENTION = re.compile(r"sdpa|flash|fmha|attention", re.I)  # cuDNN's fused attention: compute, not GEMM
_MEMSET = re.compile(r"memset", re.I)


@dataclasses.dataclass(frozen=True)
class Activity:
    """One event of a device stream: [start, end) in microseconds."""
    start: float
    end: float
    name: str
    lane: str          # the stream (thread name)
    label: str = ""    # the HLO op that issued it, where the trace says
    cls: str = "other"


# ------------------------------------------------------------------------------------------------
# Interval arithmetic over lists of (start, end)
# ------------------------------------------------------------------------------------------------
def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly the points of `intervals` (empty ones dropped)."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def intersect(a, b) -> list[tuple[float, float]]:
    """The points in both `a` and `b`, as disjoint intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    """The points of `a` not in `b`, as disjoint intervals (one pass over both, sorted)."""
    a, b = union(a), union(b)
    out, first = [], 0
    for start, end in a:
        while first < len(b) and b[first][1] <= start:
            first += 1
        k = first
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if end > start:
            out.append((start, end))
    return out


def clip(disjoint, lo: float, hi: float) -> list[tuple[float, float]]:
    """The intervals of the sorted, disjoint `disjoint` that reach into [lo, hi] (by bisection)."""
    first = max(0, bisect.bisect_right(disjoint, (lo, float("inf"))) - 1)
    last = bisect.bisect_left(disjoint, (hi, float("-inf")))
    return disjoint[first:last + 1]


def gaps(intervals, lo: float, hi: float, longer_than: float) -> list[tuple[float, float]]:
    """The holes of `intervals` within [lo, hi] longer than `longer_than`."""
    return [(s, e) for s, e in subtract([(lo, hi)], intervals) if e - s > longer_than]


# ------------------------------------------------------------------------------------------------
# Classes
# ------------------------------------------------------------------------------------------------
def classify(name: str) -> str:
    """The class of an event by its name alone (copies on kernel streams are settled by `classify_lanes`)."""
    if _MEMCPY.search(name):
        return "other" if _HOST_COPY.search(name) else "copy"
    if _MEMSET.search(name):
        return "other"
    if _NCCL.search(name):
        return "nccl"
    return "gemm" if _GEMM.search(name) and not _ATTENTION.search(name) else "compute"


def classify_lanes(events: list[Activity]) -> list[Activity]:
    """Each event with its class. A device-to-device copy on a stream that runs kernels and no peer
    copy is XLA moving a buffer on its compute stream, not communication ("other"); the copy
    streams of ficco_jax's executor run copies only (its reductions run on XLA's stream)."""
    classed = [dataclasses.replace(e, cls=classify(e.name)) for e in events]
    kernel_lanes = {e.lane for e in classed if e.cls in COMPUTE or e.cls == "nccl"}
    copy_lanes = {e.lane for e in classed if e.cls == "copy" and _PEER_COPY.search(e.name)}
    local = lambda e: e.cls == "copy" and e.lane in kernel_lanes - copy_lanes and _LOCAL_COPY.search(e.name)  # noqa: E731
    return [dataclasses.replace(e, cls="other") if local(e) else e for e in classed]


def spans(events, classes) -> list[tuple[float, float]]:
    return [(e.start, e.end) for e in events if e.cls in classes]


# ------------------------------------------------------------------------------------------------
# One step
# ------------------------------------------------------------------------------------------------
def collective_rows(events: list[Activity], compute) -> list[dict]:
    """One row per NCCL kernel and per group of copies: where it starts (from the first event of
    `events`), how long it spans, its busy time and how much of that compute covers (hidden)."""
    t0 = min((e.start for e in events), default=0.0)
    groups: list[list[Activity]] = [[e] for e in events if e.cls == "nccl"]
    current: list[Activity] = []
    current_end = 0.0
    for e in sorted((e for e in events if e.cls == "copy"), key=lambda e: e.start):
        if current and (e.start > current_end + COPY_GROUP_GAP_US or e.label != current[0].label):
            groups.append(current)
            current = []
        current_end = max(current_end, e.end) if current else e.end
        current.append(e)
    if current:
        groups.append(current)
    rows = []
    for group in sorted(groups, key=lambda g: g[0].start):
        busy = union((e.start, e.end) for e in group)
        hidden = total(intersect(busy, clip(compute, busy[0][0], busy[-1][1])))
        rows.append({"kind": group[0].cls, "label": group[0].label or group[0].name, "events": len(group),
                     "start_us": group[0].start - t0, "span_us": max(e.end for e in group) - group[0].start,
                     "busy_us": total(busy), "hidden_us": hidden,
                     "hidden_fraction": hidden / total(busy) if total(busy) else None})
    return rows


def analyze_step(events: list[Activity]) -> dict:
    """A step's device span, compute and communication busy times, exposed communication, idle gaps
    of compute (`idle_*`) and of the whole device (`bare_*`: neither compute nor communication
    runs), and the per-collective table; `events` are one device's classed stream events."""
    if not events:
        return {"events": 0}
    lo, hi = min(e.start for e in events), max(e.end for e in events)
    compute, comm = union(spans(events, COMPUTE)), union(spans(events, COMM))
    exposed = subtract(comm, compute)
    idle = gaps(compute, lo, hi, IDLE_GAP_US)
    bare = gaps(compute + comm, lo, hi, IDLE_GAP_US)
    comm_us = total(comm)
    return {
        "events": len(events), "span_us": hi - lo,
        "compute_us": total(compute), "gemm_us": total(spans(events, ("gemm",))),
        "comm_us": comm_us, "nccl_us": total(spans(events, ("nccl",))), "copy_us": total(spans(events, ("copy",))),
        "other_us": total(spans(events, ("other",))),
        "exposed_us": total(exposed), "hidden_fraction": 1 - total(exposed) / comm_us if comm_us else None,
        "idle_gaps": len(idle), "idle_us": sum(e - s for s, e in idle),
        "bare_gaps": len(bare), "bare_us": sum(e - s for s, e in bare),
        "longest_idle": [gap_context(events, s, e, lo) for s, e in sorted(idle, key=lambda g: g[0] - g[1])[:5]],
        "exposed_intervals": [(s - lo, e - lo) for s, e in exposed],
        "collectives": collective_rows(events, compute),
    }


def gap_context(events: list[Activity], start: float, end: float, t0: float) -> dict:
    """An idle gap of compute with the compute event that ends at its start and the one after it."""
    compute = [e for e in events if e.cls in COMPUTE]
    before = max((e for e in compute if e.end <= start), key=lambda e: e.end, default=None)
    after = min((e for e in compute if e.start >= end), key=lambda e: e.start, default=None)
    name = lambda e: (e.label or e.name)[:60] if e else ""  # noqa: E731
    return {"at_us": start - t0, "us": end - start, "after": name(before), "before": name(after)}


def unclassified(events: list[Activity]) -> list[tuple[str, int, float]]:
    """(name, count, total us) of the events classed "compute" or "other" whose names no pattern
    named, largest first: what to check when a class looks wrong."""
    totals: dict[str, list] = {}
    for e in events:
        if e.cls == "other" or (e.cls == "compute" and not _GEMM.search(e.name)):
            entry = totals.setdefault(f"{e.cls}: {e.name[:80]}", [0, 0.0])
            entry[0] += 1
            entry[1] += e.end - e.start
    return sorted(((k, n, t) for k, (n, t) in totals.items()), key=lambda r: -r[2])


# ------------------------------------------------------------------------------------------------
# From a trace's events to each device's activity per step
# ------------------------------------------------------------------------------------------------
_GPU_PROCESS = re.compile(r"GPU:?\s*(\d+)", re.I)


def device_activities(trace_events: list[dict]) -> tuple[dict[int, list[Activity]], list[str]]:
    """Each GPU's stream events, classed, by device ordinal; and notes on what was left out (events
    on threads that are not streams). Empty on a trace with no GPU process (CPU runs)."""
    meta = [e for e in trace_events if e.get("ph") == "M"]
    named = lambda e: str((e.get("args") or {}).get("name", ""))  # noqa: E731
    gpus = {e.get("pid"): int(m.group(1)) for e in meta if e.get("name") == "process_name"
            and (m := _GPU_PROCESS.search(named(e)))}
    threads = {(e.get("pid"), e.get("tid")): named(e) for e in meta
               if e.get("name") == "thread_name" and e.get("pid") in gpus}
    by_device: dict[int, list[Activity]] = {}
    left_out: dict[str, int] = {}
    for e in trace_events:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        lane = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        by_device.setdefault(gpus[e["pid"]], []).append(Activity(
            float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")), lane,
            str((e.get("args") or {}).get("hlo_op", ""))))
    for device, events in by_device.items():
        # Threads named by stream where CUPTI names them so; every thread where none is.
        if any(STREAM_THREAD.search(e.lane) for e in events):
            for e in events:
                if not STREAM_THREAD.search(e.lane):
                    left_out[f"GPU:{device} {e.lane}"] = left_out.get(f"GPU:{device} {e.lane}", 0) + 1
            events = [e for e in events if STREAM_THREAD.search(e.lane)]
        by_device[device] = classify_lanes(events)
    notes = [f"left out {n} events on thread '{lane}' (not a stream)" for lane, n in sorted(left_out.items())]
    return dict(sorted(by_device.items())), notes


def step_windows(trace_events: list[dict], marker: re.Pattern) -> list[tuple[int, float, float]]:
    """(step, start, end) of the host events whose name `marker` matches (group 1: the step)."""
    found = []
    for e in trace_events:
        m = marker.match(str(e.get("name", ""))) if e.get("ph") == "X" else None
        if m:
            found.append((int(m.group(1)), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return sorted(found)


def split_steps(events: list[Activity], windows, slack_us: float) -> tuple[list[list[Activity]], str]:
    """The events of each step window, widened by `slack_us` on each side (by start time), and how
    they were split. Where the windows miss more than 1 % of the events (host and device clocks
    apart), the device's own idle gaps split them instead: the len(windows) - 1 longest."""
    per_step = [[e for e in events if lo - slack_us <= e.start <= hi + slack_us] for _, lo, hi in windows]
    missed = len(events) - sum(map(len, per_step))
    if not events or not windows or missed <= 0.01 * len(events):
        return per_step, f"host step annotations ({missed} events outside them)"
    ordered = sorted(events, key=lambda e: e.start)
    end, cuts = ordered[0].end, []
    for i, e in enumerate(ordered[1:], 1):
        cuts.append((e.start - end, i))
        end = max(end, e.end)
    at = sorted(i for _, i in sorted(cuts, reverse=True)[:len(windows) - 1])
    bounds = [0, *at, len(ordered)]
    return ([ordered[a:b] for a, b in zip(bounds, bounds[1:])],
            f"the device's longest idle gaps (the host step annotations missed {missed} of {len(events)} events)")
