"""The shapes the peers are timed on, and the small helpers their scripts share.

A shape (M, K, N) is one tensor-parallel layer over n devices:
  AG: all_gather(x[M/n, K]) @ w[K, N/n]          RS: psum_scatter(y[M, N/n] @ w[N/n, K])
The anchors are Llama-70B and GPT-3-175B layers and one small layer where host dispatch and
per-copy fixed costs dominate. This module imports neither torch nor jax: both peer families use it.
"""
from __future__ import annotations

import json
import os

ANCHORS = {
    "llama70b_mlp_up_M8k": (8192, 8192, 28672),
    "llama70b_qkv_M8k": (8192, 8192, 10240),
    "llama70b_mlp_up_M2k": (2048, 8192, 28672),
    "gpt3_175b_mlp_M4k": (4096, 12288, 49152),
    "small_M1k_K4k_N4k": (1024, 4096, 4096),
}
#: For a run on CPU devices or a quick check: every variant runs, the times mean nothing.
TINY = {"tiny_M64_K32_N64": (64, 32, 64)}
SETS = {"anchors": ANCHORS, "tiny": TINY}


def parse(specs: list[str] | None, default: str = "anchors") -> dict[str, tuple[int, int, int]]:
    """Shape arguments -> {name: (M, K, N)}: a set name (anchors, tiny), an anchor's name, or M,K,N."""
    out: dict[str, tuple[int, int, int]] = {}
    for spec in specs or [default]:
        if spec in SETS:
            out.update(SETS[spec])
        elif spec in ANCHORS:
            out[spec] = ANCHORS[spec]
        else:
            try:
                M, K, N = (int(v) for v in spec.split(","))
            except ValueError:
                raise SystemExit(f"--shape {spec!r}: expected M,K,N, a shape name ({', '.join(ANCHORS)}) "
                                 f"or a set ({', '.join(SETS)})") from None
            out[f"M{M}_K{K}_N{N}"] = (M, K, N)
    return out


def divisible(dims: tuple[int, int, int], n: int) -> bool:
    """Whether M and N split over n devices (the layer needs both)."""
    M, _, N = dims
    return M % n == 0 and N % n == 0


def markdown(rows: list[dict], columns: list[str], title: str) -> str:
    """A Markdown table of `columns` (ms values to 3 decimals, '-' where missing)."""
    lines = [title, "", "| shape | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        cells = []
        for col in columns:
            value = row.get(col)
            cells.append(f"{value:.3f}" if isinstance(value, float) else ("-" if value is None else str(value)))
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out_dir: str, name: str, result: dict, table: str) -> str:
    """Write name.json and name.md under out_dir; returns the JSON's path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write(table + "\n")
    return path


def skipped(out_dir: str, name: str, reason: str) -> int:
    """Say clearly why a peer did not run, record it, and exit 0 (a missing peer is not a failure)."""
    print(f"{name}: SKIPPED: {reason}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump({"skipped": reason}, fh, indent=1)
    return 0
