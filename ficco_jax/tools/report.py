"""Presenting benchmark results: progress line, Markdown tables, plots, provenance."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict

from .. import config


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


def markdown_table(result: dict) -> str:
    """One line per (op, shape): bounds, JAX's options, ficco auto and best, speedups."""
    by_case = defaultdict(dict)
    for r in result["rows"]:
        by_case[(r["op"], r["shape"], r["M"], r["K"], r["N"])][r["variant"]] = r
    lines = [
        f"Device: {result['n_devices']} x {result['device']} ({result['platform']}), dtype {result['dtype']}, "
        f"jax {result['jax']}, commit {result['commit']}, {result['date']}",
        f"Method: {result['method']}", "",
        "| op | shape (M,K,N) | GEMM alone | collective alone | ideal | JAX seq | JAX ring | XLA windowed | "
        "ficco auto | ficco best | best / seq | best / ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
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
            f"{(seq / best['median_ms']) if best and seq else float('nan'):.2f}x | "
            f"{(best['median_ms'] / ideal) if best and ideal else float('nan'):.3f}x |")
        failures += [f"{op} {shape} {k}: {r['note']}" for k, r in v.items() if r.get("note", "").startswith(("WRONG", "error"))]
    lines.append("")
    lines.append("ficco best: the fastest ficco variant, ± the half-range of its timing estimates; "
                 "best / ideal: its time over max(GEMM alone, collective alone) (the target: at most 1.05x).")
    verified = [r for r in result["rows"] if r.get("verified") is not None]
    lines.append(f"Verified against the reference before timing: {sum(bool(r['verified']) for r in verified)}/{len(verified)} variants.")
    lines += [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def plot_speedups(result: dict, out_dir: str) -> list[str]:
    """PNG per op: speedup over JAX sequential of every ficco schedule, per shape."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'ficco_jax[plot]'", file=sys.stderr)
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
