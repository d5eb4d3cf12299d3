"""The Markdown tables of collectives_vs_nccl.py: the collective alone, and beside a matmul."""

NCCL = "nccl"


def result_name(collective: str) -> str:
    """The JSON file collectives_vs_nccl.py writes for `collective`."""
    return "a2a_vs_nccl.json" if collective == "all_to_all" else f"{collective}_vs_nccl.json"


def _ms(row):
    return f"{row['median_ms']:.3f}" if row and "median_ms" in row else "—"


def a2a_table(rows) -> str:
    """The table of the collective alone (the all_to_all's, or --collective's)."""
    lines = [f"| block MiB | NCCL ms | dma schedule | dma ms | dma/NCCL | NCCL GB/s | dma GB/s |",
             "|---|---|---|---|---|---|---|"]
    for size in sorted({r["block_mib"] for r in rows}):
        nccl = next(r for r in rows if r["block_mib"] == size and r["variant"] == NCCL)
        for r in (r for r in rows if r["block_mib"] == size and r["variant"] != NCCL):
            ratio = f"{r['median_ms'] / nccl['median_ms']:.2f}" if "median_ms" in r and "median_ms" in nccl else "—"
            gb = lambda x: f"{x['gbps']:.1f}" if "gbps" in x else "—"
            note = f" ({r['note']})" if r.get("note") else ""
            lines.append(f"| {size:g} | {_ms(nccl)} | {r['schedule']}{note} | {_ms(r)} | {ratio} | {gb(nccl)} | {gb(r)} |")
    return "\n".join(lines)


def overlap_table(rows) -> str:
    lines = ["| block MiB | matmul | matmul alone ms | comm | a2a alone ms | pair ms | max bound | sum bound | hidden |",
             "|---|---|---|---|---|---|---|---|---|"]
    for size in sorted({r["block_mib"] for r in rows}):
        get = lambda v: next((r for r in rows if r["block_mib"] == size and r["variant"] == v), None)
        mm = get("matmul_alone")
        for label in ("nccl", "dma"):
            pair, alone, lo, hi = get(f"pair_{label}"), get(f"a2a_alone_{label}"), get(f"bound_max_{label}"), get(f"bound_sum_{label}")
            hidden = "—"
            if pair and "median_ms" in pair and lo and hi and hi["median_ms"] > lo["median_ms"]:
                # Fraction of the shorter op hidden under the longer one: 0 serial, 1 perfect overlap.
                hidden = f"{(hi['median_ms'] - pair['median_ms']) / (hi['median_ms'] - lo['median_ms']):.0%}"
            note = f" ({pair['note']})" if pair and pair.get("note") else ""
            lines.append(f"| {size:g} | {'x'.join(map(str, mm['matmul']))} | {_ms(mm)} | {label}{note} | {_ms(alone)} | "
                         f"{_ms(pair)} | {_ms(lo)} | {_ms(hi)} | {hidden} |")
    return "\n".join(lines)
