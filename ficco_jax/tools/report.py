"""Presenting results: progress line, Markdown tables, plots (bench, accuracy, characterize), provenance."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict

from .. import config
from ..schedule import A2A_OPS
from . import gpu_monitor


def git_commit() -> str:
    """The checkout's commit (+dirty); config.COMMIT overrides it where no .git travels (device runs)."""

    if config.COMMIT:
        return config.COMMIT
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def progress_printer(total: int):
    """A one-line progress display on stderr: [k/total] elapsed  what is running now."""
    state = {"k": 0, "t0": time.perf_counter()}

    def progress(what: str) -> None:
        state["k"] += 1
        elapsed = time.perf_counter() - state["t0"]
        end = "\n" if not sys.stderr.isatty() else ""
        sys.stderr.write(f"\r[{state['k']:>3}/{total}] {elapsed:6.1f}s  {what:<70.70}{end}")
        sys.stderr.flush()

    return progress


def _fmt(v):
    return "—" if v is None else f"{v:.3f}"


def _ratio(seq, best, ideal, meaningful: bool) -> str:
    """The "best / seq | best / ideal" cells: speed-up over JAX sequential and distance to the ideal."""
    if not meaningful:
        return "n/a | n/a"
    return (f"{(seq / best['median_ms']) if best and seq else float('nan'):.2f}x | "
            f"{(best['median_ms'] / ideal) if best and ideal else float('nan'):.3f}x")


#: What the bench table's units and marks mean, printed under it.
TABLE_LEGEND = (
    "Times: ms per op, device time (median of the estimates). In ficco auto and ficco best the schedule follows "
    "in parentheses, as --schedules writes it: (none) is comm=\"none\", the plain collective then the matmul, "
    "no overlap; e.g. (dma/direct/c4/s2) is copy engines, every peer at once, 4 chunks, 2 copy streams. "
    "—: no time: XLA windowed is run on GPUs only (not for FP8 or matmul_psum); a variant that failed or was "
    "skipped is listed below.")


def steps_line(steps: dict) -> str:
    """The progress line's count, said by kind (bench.planned_steps): it counts more runs than variants."""
    kinds = [(steps.get("variants", 0), "variants (each verified, then timed)"),
             (steps.get("bounds", 0), "bounds timed alone (GEMM alone, collective alone: no result to verify)"),
             (steps.get("windowed", 0), "XLA windowed einsum timings (own process)"),
             (steps.get("rounds", 0), "extra timing rounds (--rounds)")]
    return (f"Runs (the progress count): {sum(k for k, _ in kinds)} = "
            + " + ".join(f"{k} {what}" for k, what in kinds if k) + ".")


def markdown_table(result: dict) -> str:
    """One line per (op, shape): bounds, JAX's options, ficco auto and best, speedups."""
    by_case = defaultdict(dict)
    for r in result["rows"]:
        by_case[(r["op"], r["shape"], r["M"], r["K"], r["N"])][r["variant"]] = r
    lines = [
        f"Device: {result['n_devices']} x {result['device']} ({result['platform']}), dtype {result['dtype']}, "
        f"jax {result['jax']}, commit {result['commit']}, {result['date']}",
        f"Method: {result['method']}", "",
        "| op | shape (M,K,N) | GEMM alone ms | collective alone ms | ideal ms | JAX seq ms | JAX ring ms | "
        "XLA windowed ms | ficco auto ms (schedule) | ficco best ms (schedule) | best / seq | best / ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
    meaningful = result["platform"] != "cpu"
    for (op, shape, M, K, N), v in by_case.items():
        ficco = {k: r for k, r in v.items() if k.startswith("ficco:") and r["median_ms"] is not None}
        best = min(ficco.values(), key=lambda r: r["median_ms"]) if ficco else None
        auto = next((r for r in v.values() if r.get("selected")), None)
        seq = v.get("jax_seq", {}).get("median_ms")
        ring = (v.get("jax_ring") or v.get("ficco:xla/ring/c1") or {}).get("median_ms")
        ideal = v.get("ideal", {}).get("median_ms")
        cell = lambda r: "—" if not r or r.get("median_ms") is None else f"{r['median_ms']:.3f} ({r['variant'][6:]})"
        # the best also with its spread: a best of several noisy timings is biased low, and the spread
        # says how far a 1.05x-of-ideal reading can be trusted
        spread = lambda r: "" if not r or r.get("spread_ms") is None else f" ± {r['spread_ms']:.3f}"
        lines.append(
            f"| {op} | {shape} {M},{K},{N} | {_fmt(v.get('gemm_alone', {}).get('median_ms'))} | "
            f"{_fmt(v.get('collective_alone', {}).get('median_ms'))} | {_fmt(ideal)} | {_fmt(seq)} | {_fmt(ring)} | "
            f"{_fmt(v.get('xla_windowed_einsum', {}).get('median_ms'))} | {cell(auto)} | {cell(best)}{spread(best)} | "
            f"{_ratio(seq, best, ideal, meaningful)} |")
        failures += [f"{op} {shape} {k}: {r['note']}" for k, r in v.items()
                     if r.get("note", "").startswith(("WRONG", "error", "skipped"))]
    lines.append("")
    lines.append(TABLE_LEGEND)
    lines.append("ficco best: the fastest ficco variant, ± the half-range of its timing estimates; "
                 "best / ideal: its time over max(GEMM alone, collective alone) (the target: at most 1.05x); "
                 "GEMM alone: every device's full-size matmul at once, no communication (the slowest device's time).")
    if not meaningful:
        lines.append("On CPU the times are host memcpy and loop times, not those of a GPU: no speed-up is "
                     "computed from them (n/a); what a CPU run shows is that every variant gives the right result.")
    verified = [r for r in result["rows"] if r.get("verified") is not None]
    lines.append(f"Verified against the reference before timing: {sum(bool(r['verified']) for r in verified)}/{len(verified)} variants.")
    if sum((result.get("steps") or {}).values()):
        lines.append(steps_line(result["steps"]))
    clocks = clocks_line(result["rows"])
    if clocks:
        lines.append(clocks + ".")
    lines += [f"- {f}" for f in failures]
    bounded = [f"{r['op']} {r['shape']} {r['variant']}" for r in result["rows"] if r.get("extra", {}).get("upper_bound")]
    if bounded and meaningful:
        lines.append("Upper bounds (R more ops took no measurable time; the longer loop's time per op, dispatch "
                     "included): " + ", ".join(bounded) + ".")
    suspect = above_peak(result)
    if suspect:
        lines.append("Faster than the tensor cores allow at the SM clock recorded while timed (suspect timings: "
                     "not all of the work ran, the timing caught a clock the recording missed, or the clock "
                     "reading is wrong; benchmarks/suites/timing_check.py compares the row's program with one "
                     "long loop):")
        lines += [f"- {line}" for line in suspect]
    lines += clocks_table(by_case)
    return "\n".join(lines) + "\n"


#: Dense tensor-core peak, TFLOP/s per MHz of SM clock, by device kind and operand dtype: H100 SXM and
#: H200 (132 SMs) reach 989.4 (bf16, f16) and 1979 (FP8) TFLOP/s at 1830 MHz. Kinds not listed are not
#: checked.
TENSOR_PEAK_PER_MHZ = {kind: {"bfloat16": 989.4 / 1830, "float16": 989.4 / 1830, "float8_e4m3fn": 1979 / 1830,
                              "float8_e5m2": 1979 / 1830}
                       for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200")}
#: Rows of the tensor-parallel ops (every op but the expert ones) that time no matmul; every other row of
#: theirs does a layer's whole matmul work per device, 2 M K N / n.
_NO_MATMUL = ("collective_alone", "ideal")


def above_peak(result: dict) -> list[str]:
    """The timed rows of `result` whose matmul work, 2 M K N / n per device, would need more than the
    tensor cores' dense peak at the highest SM clock recorded while the row was timed: a time no
    device can reach, so not all of the work ran, the timing caught a clock the recording missed (loops
    of 1 and 5 ops timed a launch's boost: timing.py), or the clock reading is wrong. One line each;
    none where the device kind, the dtype or the clocks are unknown."""
    peaks = TENSOR_PEAK_PER_MHZ.get(result.get("device"), {})
    lines = []
    for r in result["rows"]:
        dtype = r.get("extra", {}).get("dtype") or result["dtype"]
        clocks = [c for w in r.get("extra", {}).get("gpus", []) for c in w["sm_mhz"].values()]
        if (r["op"] in A2A_OPS or r["variant"] in _NO_MATMUL or not r.get("median_ms") or dtype not in peaks
                or not clocks):
            continue
        tflops = 2 * r["M"] * r["K"] * r["N"] / result["n_devices"] / (r["median_ms"] * 1e-3) / 1e12
        peak = peaks[dtype] * max(clocks)
        if tflops > peak:
            lines.append(f"{r['op']} {r['shape']} {r['variant']}: {r['median_ms']:.3f} ms is {tflops:.0f} TFLOP/s, "
                         f"{tflops / peak:.2f}x the dense {dtype} peak at {max(clocks):.0f} MHz ({peak:.0f})")
    return lines


def mean_clock(row: dict | None) -> float | None:
    """A row's SM clock over its timings and GPUs (extra["gpus"]), or None where none was recorded."""
    clocks = [c for w in (row or {}).get("extra", {}).get("gpus", []) for c in w["sm_mhz"].values()]
    return sum(clocks) / len(clocks) if clocks else None


def clocks_table(by_case: dict) -> list[str]:
    """Per case, the mean SM clock the GEMM alone, JAX sequential and ficco's pick ran at (where
    recorded): at a power cap an overlapped program often runs at a lower clock than the matmul
    alone, since its communication draws power beside it."""
    lines = []
    for (op, shape, M, K, N), v in by_case.items():
        auto = next((r for r in v.values() if r.get("selected")), None)
        if auto is not None and "timing_of" in auto.get("extra", {}):
            auto = v.get(auto["extra"]["timing_of"])
        cells = [mean_clock(v.get("gemm_alone")), mean_clock(v.get("jax_seq")), mean_clock(auto)]
        if any(c is not None for c in cells):
            lines.append(f"| {op} | {shape} | " + " | ".join("—" if c is None else f"{c:.0f}" for c in cells) + " |")
    if not lines:
        return []
    return ["", "SM clock while timed, MHz (mean over the timings and GPUs):", "",
            "| op | shape | GEMM alone | JAX seq | ficco auto |", "|---|---|---|---|---|"] + lines


def clocks_line(rows) -> str | None:
    """What the GPUs ran at over a run's timings (rows' extra["gpus"], recorded under
    harness.monitoring), in one line; None where nothing was recorded."""
    return gpu_monitor.summary_line([w for r in rows for w in r.get("extra", {}).get("gpus", [])])


def pyplot():
    """matplotlib.pyplot on its file-only backend, or None (saying how to install it) without it."""
    try:
        import matplotlib  # optional: the `plot` extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'ficco_jax[plot]'", file=sys.stderr)
        return None
    return plt


def plot_speedups(result: dict, out_dir: str) -> list[str]:
    """PNG per op: speedup over JAX sequential of every ficco schedule, per shape."""
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    for op in sorted({r["op"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["op"] == op]
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        seq = {r["shape"]: r["median_ms"] for r in rows if r["variant"] == "jax_seq"}
        variants = sorted({r["variant"] for r in rows if r["variant"].startswith("ficco:")})
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shapes) + 4), 4.5))
        width = 0.8 / max(len(variants), 1)
        for i, var in enumerate(variants):
            ys = []
            for s in shapes:
                r = next((r for r in rows if r["shape"] == s and r["variant"] == var), None)
                ys.append(seq[s] / r["median_ms"] if r and r["median_ms"] and seq.get(s) else 0)
            ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=var[6:])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("speedup over JAX sequential")
        ax.set_title(f"{op} on {result['n_devices']} x {result['device']}")
        if len(variants) <= 16:
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = os.path.join(out_dir, f"speedup_{op}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_accuracy(result: dict, out_dir: str) -> None:
    """accuracy.png: predicted vs measured time of every measured schedule (left), and per case
    the pick's time over the best measured (right, 5 % line)."""
    plt = pyplot()
    if plt is None:
        return
    cases = [c for c in result["cases"] if "chosen_vs_best" in c]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for op, marker in (("ag_matmul", "o"), ("matmul_rs", "s")):
        pts = [(r["median_ms"], r["extra"]["predicted_ms"]) for c in cases if c["op"] == op for r in c["rows"]
               if r["median_ms"]]
        if pts:
            left.scatter(*zip(*pts), marker=marker, s=14, label=op)
    lo = min([r["median_ms"] for c in cases for r in c["rows"] if r["median_ms"]] or [0.01])
    hi = max([r["median_ms"] for c in cases for r in c["rows"] if r["median_ms"]] or [1.0])
    left.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    left.set(xscale="log", yscale="log", xlabel="measured ms", ylabel="predicted ms", title="cost model")
    left.legend()
    labels = [f"{'AG' if c['op'] == 'ag_matmul' else 'RS'} {c['shape']}" for c in cases]
    right.bar(range(len(cases)), [c["chosen_vs_best"] for c in cases],
              color=["tab:green" if c["verdict"] == "ok" else "tab:red" for c in cases])
    right.axhline(result["criteria"]["within_best"], color="k", ls="--", lw=0.8)
    right.set_xticks(range(len(cases)), labels, rotation=90, fontsize=6)
    right.set(ylabel="pick / best measured", ylim=(0.95, max([c["chosen_vs_best"] for c in cases] + [1.1]) + 0.02),
              title="auto's pick (green: within 5 % and <= 3 % over JAX seq)")
    fig.suptitle(f"{result['axis_size']} x {result['device']}, profile {result['profile']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy.png"), dpi=110)
    plt.close(fig)


def plot_characterization(char: dict, out_dir: str) -> None:
    """characterize.png: decomposition loss by rows (left) and all-gather ingress by shard size (right)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (k, n_cols) in sorted({(r["K"], r["N"]) for r in char["decomposition"]}):
        for c in sorted({r["chunks"] for r in char["decomposition"]} - {1}):
            pts = [(r["rows"], r["loss"] * 100) for r in char["decomposition"] if (r["K"], r["N"], r["chunks"]) == (k, n_cols, c)]
            if pts:
                ax1.plot(*zip(*pts), marker="o", label=f"K={k} N={n_cols} c={c}")
    ax1.set_xscale("log", base=2); ax1.set_xlabel("rows of the whole matmul"); ax1.set_ylabel("decomposition loss %")
    ax1.legend(fontsize=6)
    for comm in sorted({r["comm"] for r in char["transfers"]}):
        pts = [(r["shard_bytes"] / 2**20, r["ingress_gbps"]) for r in char["transfers"] if r["comm"] == comm]
        ax2.plot(*zip(*pts), marker="o", label=comm)
    ax2.set_xscale("log", base=2); ax2.set_xlabel("shard MiB"); ax2.set_ylabel("all-gather ingress GB/s"); ax2.legend()
    fig.suptitle(f"{char['n_devices']} x {char['device']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "characterize.png"), dpi=110)
    plt.close(fig)
