"""The shapes the peers are timed on, and the small helpers their scripts share.

A shape (M, K, N) is one tensor-parallel layer over n devices:
  AG: all_gather(x[M/n, K]) @ w[K, N/n]          RS: psum_scatter(y[M, N/n] @ w[N/n, K])
The named shapes and sets (the anchors: Llama-70B and GPT-3-175B layers and one small layer where
host dispatch and per-copy fixed costs dominate) are those of ficco_jax/tools/anchor_shapes.json,
the file `python -m ficco_jax bench` reads. This module imports neither torch nor jax, nor
ficco_jax: both peer families use it, from an environment that may have only one of them.
"""
from __future__ import annotations

import json
import os

#: The repository's one list of named layer shapes.
SHAPES_FILE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                            "ficco_jax", "tools", "anchor_shapes.json"))


def _load(path: str) -> dict[str, dict[str, tuple[int, int, int]]]:
    with open(path) as fh:
        sets = json.load(fh)["sets"]
    return {name: {shape: tuple(dims) for shape, dims in group["shapes"].items()} for name, group in sets.items()}


_FILE_SETS = _load(SHAPES_FILE)
ANCHORS = _FILE_SETS["anchors"]
#: For a run on CPU devices or a quick check: every variant runs, the times mean nothing.
TINY = {"tiny_M64_K32_N64": (64, 32, 64)}
SETS = {**_FILE_SETS, "tiny": TINY}
#: Every shape a name on the command line can pick.
NAMED = {name: dims for group in SETS.values() for name, dims in group.items()}


def parse(specs: list[str] | None, default: str = "anchors") -> dict[str, tuple[int, int, int]]:
    """Shape arguments -> {name: (M, K, N)}: a set name (anchors, llama405b, tiny), a shape's name, or M,K,N."""
    out: dict[str, tuple[int, int, int]] = {}
    for spec in specs or [default]:
        if spec in SETS:
            out.update(SETS[spec])
        elif spec in NAMED:
            out[spec] = NAMED[spec]
        else:
            try:
                M, K, N = (int(v) for v in spec.split(","))
            except ValueError:
                raise SystemExit(f"--shape {spec!r}: expected M,K,N, a shape name ({', '.join(NAMED)}) "
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
