"""The copy-engine collectives against NCCL, summed up from collectives_vs_nccl.py's JSONs: per
collective and schedule, the fixed cost and the rate of a line fitted to its times, dma/NCCL at each
block size, the smallest block from which it is at most NCCL's time (at that size and every larger
one measured), and the value of `config.DMA_COLLECTIVE_MIN_BYTES` that this run supports.

    python benchmarks/peers/collectives_fit.py DIR [--out FILE]

DIR holds any of a2a_vs_nccl.json, all_gather_vs_nccl.json and reduce_scatter_vs_nccl.json (the
`collectives` suite of benchmarks/run.py writes all three, then runs this). The line is least squares
of median time against block bytes over the sizes measured: its intercept is the call's fixed cost
(device time, the method the JSONs name), the inverse of its slope the bytes per second one peer's
block moves at. `schedule="auto"` runs a standalone collective on its default schedule from
DMA_COLLECTIVE_MIN_BYTES, so the value proposed is the largest of the three collectives' crossovers
on that schedule (none of them gets slower than NCCL); a collective with no crossover among the sizes
measured proposes none. Writes FILE (default DIR/collectives_fit.json); the table comes last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collectives_tables import NCCL, result_name  # noqa: E402

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all")
DEFAULT = "default"
MIB = 2**20


def line(sizes_mib, times_ms) -> dict | None:
    """Least squares time = fixed + bytes / rate over at least two sizes; None with fewer."""
    if len(sizes_mib) < 2:
        return None
    slope, intercept = np.polyfit(np.asarray(sizes_mib, float) * MIB, np.asarray(times_ms, float) * 1e-3, 1)
    return {"fixed_us": float(intercept * 1e6), "gbps": float(1 / slope / 1e9) if slope > 0 else None}


def crossover(ratios: dict[float, float]) -> float | None:
    """The smallest size (MiB) from which every ratio measured is at most 1; None if there is none."""
    out = None
    for size in sorted(ratios, reverse=True):
        if ratios[size] > 1:
            break
        out = size
    return out


def summarize(result: dict) -> list[dict]:
    """One entry per dma schedule of one collective's JSON."""
    timed = [r for r in result["a2a"] if "median_ms" in r]
    nccl = {r["block_mib"]: r["median_ms"] for r in timed if r["variant"] == NCCL}
    out = []
    for variant in dict.fromkeys(r["variant"] for r in timed if r["variant"] != NCCL):
        rows = sorted((r for r in timed if r["variant"] == variant), key=lambda r: r["block_mib"])
        ratios = {r["block_mib"]: r["median_ms"] / nccl[r["block_mib"]] for r in rows if nccl.get(r["block_mib"])}
        out.append({"collective": result["collective"], "variant": variant, "schedule": rows[0]["schedule"],
                    "ms": {r["block_mib"]: r["median_ms"] for r in rows}, "over_nccl": ratios,
                    "fit": line([r["block_mib"] for r in rows], [r["median_ms"] for r in rows]),
                    "at_most_nccl_from_mib": crossover(ratios)})
    return out


def proposal(entries: list[dict], collectives: list[str], n_devices: int) -> dict:
    """DMA_COLLECTIVE_MIN_BYTES from the default schedule's crossovers, and why; none from one device,
    whose "NCCL" rows are XLA's local copy."""
    if n_devices < 2:
        return {"min_bytes": None, "why": "one device: XLA's collective is a local copy there, not NCCL; "
                                          "the threshold needs a group of 2+ GPUs"}
    default = {e["collective"]: e for e in entries if e["variant"] == DEFAULT}
    missing = [c for c in collectives if c not in default]
    never = [c for c, e in default.items() if e["at_most_nccl_from_mib"] is None]
    if missing or never:
        why = (f"no default-schedule rows for {', '.join(missing)}" if missing else
               f"the default schedule is slower than NCCL at every size measured for {', '.join(never)}")
        return {"min_bytes": None, "why": why}
    worst = max(default.values(), key=lambda e: e["at_most_nccl_from_mib"])
    mib = worst["at_most_nccl_from_mib"]
    return {"min_bytes": int(mib * MIB), "why": f"{worst['collective']} on {worst['schedule']} is at most NCCL's time "
                                                f"from {mib:g} MiB per peer"}


def table(entries: list[dict]) -> str:
    sizes = sorted({s for e in entries for s in e["over_nccl"]})
    head = "| collective | schedule | " + " | ".join(f"{s:g} MiB" for s in sizes) + " | fixed us | GB/s | <= NCCL from |"
    lines = [head, "|" + "---|" * (len(sizes) + 5)]
    for e in entries:
        cells = [f"{e['over_nccl'][s]:.2f}" if s in e["over_nccl"] else "—" for s in sizes]
        fit = e["fit"] or {}
        fixed = f"{fit['fixed_us']:.1f}" if fit else "—"
        gbps = f"{fit['gbps']:.0f}" if fit.get("gbps") else "—"
        cross = f"{e['at_most_nccl_from_mib']:g} MiB" if e["at_most_nccl_from_mib"] is not None else "never"
        lines.append(f"| {e['collective']} | {e['schedule']} | " + " | ".join(cells) + f" | {fixed} | {gbps} | {cross} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="where collectives_vs_nccl.py wrote its JSONs")
    parser.add_argument("--out", default=None, help="the summary JSON (default DIR/collectives_fit.json)")
    args = parser.parse_args(argv)
    results = {}
    for collective in COLLECTIVES:
        path = os.path.join(args.dir, result_name(collective))
        if os.path.isfile(path):
            with open(path) as fh:
                results[collective] = json.load(fh)
    if not results:
        raise SystemExit(f"collectives_fit: none of {', '.join(map(result_name, COLLECTIVES))} in {args.dir}; run "
                         f"benchmarks/peers/collectives_vs_nccl.py --out {args.dir} first")
    entries = [e for result in results.values() for e in summarize(result)]
    first = next(iter(results.values()))
    summary = {key: first.get(key) for key in ("device", "n_devices", "jax", "commit", "date", "method",
                                                "xla_flags", "times_meaningful")}
    summary.update(entries=entries, proposal=proposal(entries, list(results), summary["n_devices"] or 0))
    with open(args.out or os.path.join(args.dir, "collectives_fit.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    p = summary["proposal"]
    meaningful = "" if summary["times_meaningful"] else " (CPU: times NOT meaningful)"
    print(f"{summary['n_devices']} x {summary['device']}, commit {summary['commit']}, {summary['date']}{meaningful}\n"
          f"method: {summary['method']}\n"
          f"XLA_FLAGS: {summary['xla_flags'] or '(none)'}\n"
          f"DMA_COLLECTIVE_MIN_BYTES: " + (f"{p['min_bytes']} ({p['why']})" if p["min_bytes"] else f"none ({p['why']})")
          + "\n\ndma time / NCCL time per block size per peer, and the line fitted to the dma times:\n")
    print(table(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
