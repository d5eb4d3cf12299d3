"""Print a compact timeline of one device from a JAX profiler trace (perfetto_trace.json.gz).

Usage: python benchmarks/suites/perfetto_timeline.py TRACE [--device N] [--first K] [--count C] [--by-name N]

TRACE: the perfetto_trace.json.gz that `jax.profiler.trace(..., create_perfetto_trace=True)` wrote
(benchmarks/suites/trace_op.py --jax-profiler), or a directory holding one. Shows, for the process whose name
names device N (GPU:N; the host when there is no GPU), each thread's (stream's) busy time and event
count, the span from the first event to the last end (with --by-name, each thread's N names with the
most time), then C events from the K-th on in start order: start (us, relative), duration (us), the gap
since that thread's previous event, the thread and a short name.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys


def load(path: str) -> list[dict]:
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
        if not found:
            raise SystemExit(f"perfetto_timeline: no perfetto_trace.json.gz under {path}")
        path = found[-1]
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def pick_process(events: list[dict], device: int) -> tuple[int, str]:
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    # A GPU machine running JAX on its CPU still lists the GPU in the trace, with no events on it.
    busy = {e.get("pid") for e in events if e.get("ph") != "M"}
    pattern = re.compile(rf"GPU:?\s*{device}\b|gpu:?\s*{device}\b")
    for pid, name in names.items():
        if pattern.search(name) and pid in busy:
            return pid, name
    for pid, name in names.items():  # no GPU in the trace (CPU runs): the host
        if "host" in name.lower() or "cpu" in name.lower():
            return pid, name
    raise SystemExit(f"perfetto_timeline: no process for device {device} among {sorted(names.values())}")


def print_by_name(spans: list[dict], threads: dict, top: int) -> None:
    """Per thread, the `top` event names with the most time in it: how many, total us, mean us."""
    totals: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in spans:
        totals[e["tid"]][e.get("name", "")].append(e.get("dur", 0.0))
    for tid, names in totals.items():
        print(f"  {threads.get(tid, tid)!s}:")
        for name, durs in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"    {len(durs):6d} x {sum(durs) / len(durs):9.1f} us = {sum(durs):10.1f} us  {name[:70]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=60)
    parser.add_argument("--by-name", type=int, default=0, metavar="N",
                        help="also each thread's N names with the most time: count, total and mean duration")
    args = parser.parse_args(argv)
    events = load(args.trace)
    pid, pname = pick_process(events, args.device)
    threads = {e["tid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") == pid}
    spans = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") == pid), key=lambda e: e["ts"])
    print(f"{len(spans)} events of '{pname}'")
    busy, count = collections.defaultdict(float), collections.Counter()
    for e in spans:
        busy[e["tid"]] += e.get("dur", 0.0)
        count[e["tid"]] += 1
    for tid in sorted(busy, key=lambda t: -busy[t]):
        print(f"  {threads.get(tid, tid)!s:<40} {count[tid]:6d} events, busy {busy[tid]:10.1f} us")
    if not spans:
        return 0
    t0 = spans[0]["ts"]
    print(f"span {max(e['ts'] + e.get('dur', 0.0) for e in spans) - t0:.1f} us, first event to last end")
    if args.by_name:
        print_by_name(spans, threads, args.by_name)
    last_end: dict = {}
    print(f"{'start':>10} {'dur':>8} {'gap':>8}  thread / name")
    for e in spans[args.first:args.first + args.count]:
        start, dur = e["ts"] - t0, e.get("dur", 0.0)
        gap = start - last_end.get(e["tid"], start)
        last_end[e["tid"]] = start + dur
        thread = str(threads.get(e["tid"], e["tid"]))[:24]
        print(f"{start:10.1f} {dur:8.1f} {gap:8.1f}  {thread:<24} {e.get('name', '')[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
