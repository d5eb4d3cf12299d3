"""The tables and the picture of benchmarks/suites/step_timeline.py, from its result dict.

`markdown(result)` gives step_timeline.md: the summary (device 0, mean of the traced steps), every
device's steps, then for device 0's first traced step of each mode the longest idle gaps of
compute, the collectives summed per HLO op (most exposed first), one row per collective (NCCL
kernel or group of copies) with its hidden share, and the event names no pattern classed, with
their total time. `plot(...)` draws one step per mode, one
lane per stream, colored by class, exposed communication in red on a lane of its own (matplotlib).
"""
from __future__ import annotations

import timeline_analysis as ta

COLORS = {"gemm": "tab:blue", "compute": "tab:cyan", "nccl": "tab:orange", "copy": "tab:green",
          "other": "tab:gray"}
EXPOSED_COLOR = "tab:red"


def fmt(value, scale=1.0, digits=2, pct=False) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if pct else f"{value / scale:.{digits}f}"


def summary_table(summary: dict) -> list[str]:
    lines = ["| mode | step ms (device) | wall ms traced / untraced | compute ms | GEMM ms | comm ms | NCCL ms "
             "| copy ms | exposed ms | hidden | idle gaps > 20 us (ms) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in summary["modes"].items():
        lines.append(f"| {mode} | {fmt(r['span_us'], 1e3)} | {fmt(r['wall_ms'])} / {fmt(r.get('untraced_wall_ms'))} | "
                     f"{fmt(r['compute_us'], 1e3)} | "
                     f"{fmt(r['gemm_us'], 1e3)} | {fmt(r['comm_us'], 1e3)} | {fmt(r['nccl_us'], 1e3)} | "
                     f"{fmt(r['copy_us'], 1e3)} | {fmt(r['exposed_us'], 1e3)} | {fmt(r['hidden_fraction'], pct=True)} | "
                     f"{fmt(r['idle_gaps'], digits=0)} ({fmt(r['idle_us'], 1e3)}) |")
    return lines


def share_line(summary: dict) -> str:
    share, free = summary["overlap_share"], summary["comm_free_step_ms"]
    if share is None:
        return ("overlap share: no communication-free step given (--comm-free-ms, or --comm-free-bound after --)"
                if free is None else f"overlap share: - (the no-overlap step is not slower than {free:.2f} ms)")
    return (f"overlap share (no-overlap step - overlap step) / (no-overlap step - communication-free step "
            f"{free:.2f} ms): {share:.0%}; step times: {summary['step_time']}")


def step_rows(result: dict) -> list[str]:
    lines = ["| mode | device | step | events | span ms | compute ms | comm ms | exposed ms | hidden | compute idle gaps "
             "(ms) | device idle gaps (ms) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, res in result["modes"].items():
        for device, dev in res.get("analysis", {}).get("devices", {}).items():
            for i, s in enumerate(dev["steps"]):
                lines.append(f"| {mode} | {device} | {i} | {s['events']} | {fmt(s.get('span_us'), 1e3)} | "
                             f"{fmt(s.get('compute_us'), 1e3)} | {fmt(s.get('comm_us'), 1e3)} | "
                             f"{fmt(s.get('exposed_us'), 1e3)} | {fmt(s.get('hidden_fraction'), pct=True)} | "
                             f"{s.get('idle_gaps', '-')} ({fmt(s.get('idle_us'), 1e3)}) | "
                             f"{s.get('bare_gaps', '-')} ({fmt(s.get('bare_us'), 1e3)}) |")
    return lines


def detail_sections(mode: str, device: int, dev: dict) -> list[str]:
    """Device `device`'s first traced step of `mode`: idle gaps, collectives, default-classed names."""
    step = dev["steps"][0] if dev["steps"] else {}
    lines = [f"\n### {mode}, device {device}, first traced step", "",
             f"Longest idle gaps of compute (> {ta.IDLE_GAP_US:.0f} us):", "",
             "| at ms | us | after | before |", "|---|---|---|---|"]
    lines += [f"| {g['at_us'] / 1e3:.3f} | {g['us']:.1f} | `{g['after']}` | `{g['before']}` |"
              for g in step.get("longest_idle", [])]
    lines += ["", "Collectives by HLO op, most exposed first:", "",
              "| kind | HLO op / name | rows | busy us | exposed us | hidden |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | `{r['label'][:70]}` | {r['rows']} | {r['busy_us']:.1f} | {r['exposed_us']:.1f} | "
              f"{fmt(r['hidden_fraction'], pct=True)} |" for r in by_op(step.get("collectives", []))]
    lines += ["", "Collectives (NCCL kernels; copies grouped by HLO op and gaps under "
              f"{ta.COPY_GROUP_GAP_US:.0f} us):", "",
              "| kind | HLO op / name | events | start ms | span us | busy us | hidden us | hidden |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | `{r['label'][:70]}` | {r['events']} | {r['start_us'] / 1e3:.3f} | {r['span_us']:.1f} | "
              f"{r['busy_us']:.1f} | {r['hidden_us']:.1f} | {fmt(r['hidden_fraction'], pct=True)} |"
              for r in step.get("collectives", [])]
    lines += ["", "Events classed by default (no name pattern matched), whole trace:", "",
              "| class: name | count | total us |", "|---|---|---|"]
    lines += [f"| `{name}` | {n} | {t:.1f} |" for name, n, t in dev["unclassified"]]
    return lines


def by_op(rows: list[dict]) -> list[dict]:
    """The collective rows of a step summed per (kind, HLO op), the most exposed first."""
    ops: dict[tuple, dict] = {}
    for r in rows:
        op = ops.setdefault((r["kind"], r["label"]), {"kind": r["kind"], "label": r["label"], "rows": 0,
                                                      "busy_us": 0.0, "hidden_us": 0.0})
        op["rows"] += 1
        op["busy_us"] += r["busy_us"]
        op["hidden_us"] += r["hidden_us"]
    for op in ops.values():
        op["exposed_us"] = op["busy_us"] - op["hidden_us"]
        op["hidden_fraction"] = op["hidden_us"] / op["busy_us"] if op["busy_us"] else None
    return sorted(ops.values(), key=lambda op: -op["exposed_us"])


def most_exposed(result: dict, count: int = 5) -> list[str]:
    """For the log: each mode's most exposed collectives (device 0, first traced step)."""
    lines = []
    for mode, res in result["modes"].items():
        devices = res.get("analysis", {}).get("devices")
        if not devices or not devices[min(devices)]["steps"]:
            continue
        for op in by_op(devices[min(devices)]["steps"][0].get("collectives", []))[:count]:
            lines.append(f"{mode:>10}: {op['kind']:4} {op['label'][:60]:60} exposed {op['exposed_us']:9.1f} us of "
                         f"{op['busy_us']:9.1f} us")
    return lines


def default_classed(result: dict, count: int = 6) -> list[str]:
    """For the log: each mode's event names that no pattern named (device 0, whole trace), by time."""
    lines = []
    for mode, res in result["modes"].items():
        devices = res.get("analysis", {}).get("devices")
        for name, n, us in (devices[min(devices)]["unclassified"][:count] if devices else []):
            lines.append(f"{mode:>10}: {us / 1e3:8.2f} ms in {n:5d} x {name[:90]}")
    return lines


def markdown(result: dict) -> str:
    head = result["provenance"]
    lines = [f"# Step timeline: examples/tp_transformer.py {' '.join(result['example_options'])}", "",
             f"{head['date']}, {head['n_devices']} x {head['device']}, jax {head['jax']}, commit {head['commit']}. "
             f"{result['method']}", "", result["verdict"], "", "## Summary (device 0, mean of the traced steps)", ""]
    lines += summary_table(result["summary"]) + ["", share_line(result["summary"]), "", "## Every step", "",
                                                 f"Idle gaps: longer than {ta.IDLE_GAP_US:.0f} us; compute: no compute "
                                                 "kernel runs; device: nothing runs.", ""]
    lines += step_rows(result)
    for mode, res in result["modes"].items():
        if "error" in res:
            lines += [f"\n## {mode}", "", f"Failed: {res['error']}"]
            continue
        analysis = res["analysis"]
        lines += [f"\n## {mode}", "", f"Trace: `{res['trace_dir']}`. {analysis['verdict']}."]
        lines += [f"- {note}" for note in analysis.get("notes", [])]
        lines += [f"- host step {h['step']}: {h['wall_us'] / 1e3:.2f} ms" for h in analysis["host_steps"]]
        devices = analysis["devices"]
        if devices:
            lines += detail_sections(mode, min(devices), devices[min(devices)])
    return "\n".join(lines) + "\n"


def plot(steps_by_mode: dict, exposed_by_mode: dict, path: str, title: str) -> str:
    """One step per mode (device 0); returns what was done, for the log."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "no picture: matplotlib is not installed (pip install matplotlib); the tables have the numbers"
    shown = {mode: acts for mode, acts in steps_by_mode.items() if acts}
    if not shown:
        return "no picture: no device events to draw"
    try:
        fig, axes = plt.subplots(len(shown), 1, squeeze=False,
                                 figsize=(14, 1.5 + 0.4 * sum(len(_lanes(a)) + 2 for a in shown.values())))
        for ax, (mode, acts) in zip(axes[:, 0], shown.items()):
            _draw_step(ax, acts, exposed_by_mode.get(mode, []))
            ax.set_title(f"{mode}: device 0, first traced step", fontsize=9, loc="left")
        handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
        fig.legend(handles=handles + [Patch(color=EXPOSED_COLOR, label="exposed communication")],
                   loc="lower center", ncol=len(handles) + 1, fontsize=8)
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
        axes[-1, 0].set_xlabel("ms from the step's first device event")
        fig.tight_layout(rect=(0, 0.05, 1, 0.96))
        fig.savefig(path, dpi=110)
        plt.close(fig)
    except Exception as exc:  # noqa: BLE001 - the picture is optional; the tables are written already
        return f"no picture: drawing failed with {type(exc).__name__}: {exc}"
    return f"picture written to {path}"


def _lanes(acts) -> list[str]:
    """Streams that run compute first, then NCCL, then copies, then the rest."""
    rank = {}
    for e in acts:
        order = {"gemm": 0, "compute": 0, "nccl": 1, "copy": 2}.get(e.cls, 3)
        rank[e.lane] = min(rank.get(e.lane, 3), order)
    return sorted(rank, key=lambda lane: (rank[lane], lane))


def _draw_step(ax, acts, exposed) -> None:
    t0 = min(e.start for e in acts)
    lanes = _lanes(acts)
    for y, lane in enumerate(lanes):
        for cls, color in COLORS.items():
            bars = [((e.start - t0) / 1e3, (e.end - e.start) / 1e3) for e in acts if e.lane == lane and e.cls == cls]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, edgecolors=color, linewidth=0.3)
    ax.broken_barh([(s / 1e3, (e - s) / 1e3) for s, e in exposed], (len(lanes) - 0.4, 0.8),
                   facecolors=EXPOSED_COLOR, edgecolors=EXPOSED_COLOR, linewidth=0.3)
    ax.set_yticks(range(len(lanes) + 1), [lane[:28] for lane in lanes] + ["exposed comm"], fontsize=7)
    ax.invert_yaxis()
