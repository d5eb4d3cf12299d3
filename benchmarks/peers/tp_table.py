"""One table of a tensor-parallel comparison on one machine: ficco_jax against JAX, XLA and PyTorch.

    python3 benchmarks/peers/tp_table.py BENCH_JSON [--torch TORCH_JSON] [--windowed WINDOWED_JSON]
        [--out FILE]

BENCH_JSON is `python -m ficco_jax bench`'s bench.json (ficco_jax's `auto` pick and the fastest of
the ficco schedules it measured, JAX sequential, the ideal bound), TORCH_JSON
benchmarks/peers/torch_tp.py's torch_tp.json (PyTorch sequential and async-TP), WINDOWED_JSON `jax_tp.py
--windowed`'s jax_tp_windowed.json (XLA's windowed einsum; without it, bench's own windowed rows where
it has them). Each file keeps its own timing method (device time for the JAX programs, CUDA events for
PyTorch); the table names the method and commit of every file it took a column from, bench's device
and date, and a peer that skipped itself (its file says why). Refused, with exit status 2: a file
that cannot be read, a file in another's place, files of another device, group size or dtype, or a
shape whose M,K,N differ between files: a table never mixes machines or problems. Prints the markdown
table (and writes it to FILE with --out). Needs neither jax nor torch: it reads the files alone, so
it groups bench's rows itself rather than through ficco_jax.tools.report.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

OPS = {"ag_matmul": "ag", "matmul_rs": "rs"}
#: The table's columns after op and shape.
COLUMNS = ("ideal", "JAX seq", "XLA windowed", "PyTorch seq", "PyTorch async-TP", "ficco auto (pick)",
           "ficco best (schedule)", "auto / ideal", "fastest")
#: The timed columns, by their names in "fastest"; a tie goes to the earlier one, so `auto` keeps a tie
#: (its pick "none" is JAX sequential's own program, timed once).
FASTEST = {"ficco auto": "ficco auto (pick)", "ficco best": "ficco best (schedule)", "JAX seq": "JAX seq",
           "XLA windowed": "XLA windowed", "PyTorch seq": "PyTorch seq", "PyTorch async-TP": "PyTorch async-TP"}
#: Each peer file: its "peer" field, and a key every one of its rows holds (bench.json has no "peer").
PEERS = {"torch_tp": ("pytorch", "ag_async_tp"), "jax_tp_windowed": ("jax", "ag_xla_windowed")}


class Mismatch(ValueError):
    """The files cannot go in one table (unreadable, in another's place, another machine or problem)."""


def load(path: str | None) -> dict | None:
    """The JSON object at `path` (None: no file given)."""
    if path is None:
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise Mismatch(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise Mismatch(f"{path} holds no result object")
    return data


def from_dirs(bench_dir: str, peers_dir: str, since: float | None = None) -> list[dict | None]:
    """[bench, torch_tp, jax_tp_windowed] as one run left them: bench.json in `bench_dir`, the peers'
    files in `peers_dir`; a file that is missing, or older than `since` (seconds since the epoch: the
    run's start, so an earlier run's file in the same folder is not taken), is None."""
    paths = [os.path.join(bench_dir, "bench.json")] + [os.path.join(peers_dir, f"{name}.json") for name in PEERS]
    return [load(p) if os.path.isfile(p) and (since is None or os.path.getmtime(p) >= since) else None
            for p in paths]


def _skip_reason(data: dict | None) -> str | None:
    return data.get("skipped") if data and isinstance(data.get("skipped"), str) else None


def _check(bench: dict, peers: dict[str, dict]) -> None:
    """Mismatch unless every file is what its place says and all were measured on bench's machine, in
    bench's dtype."""
    if "peer" in bench or not isinstance(bench.get("rows"), list):
        raise Mismatch("the bench file is not a bench.json; give bench.json, torch_tp.json and "
                       "jax_tp_windowed.json in their places")
    for name, data in peers.items():
        peer, key = PEERS[name]
        rows = data.get("rows")
        if data.get("peer") != peer or not isinstance(rows, list) or any(key not in r for r in rows):
            raise Mismatch(f"the {name} file is not {name}.json (its head: peer={data.get('peer')!r}); give "
                           f"bench.json, torch_tp.json and jax_tp_windowed.json in their places")
        if (data.get("device"), data.get("n")) != (bench.get("device"), bench.get("n_devices")):
            raise Mismatch(f"{name} was measured on {data.get('n')} x {data.get('device')}, bench on "
                           f"{bench.get('n_devices')} x {bench.get('device')}: one table holds one machine; "
                           f"give files of the same run")
        if data.get("dtype") != bench.get("dtype"):
            raise Mismatch(f"{name} timed {data.get('dtype')!r}, bench {bench.get('dtype')!r}: one table holds "
                           f"one dtype")


def _bench_cases(bench: dict) -> dict:
    """{(op, shape name): {"dims": (M, K, N), variant: row}} of bench's tensor-parallel cases."""
    cases: dict = {}
    for row in bench["rows"]:
        if row.get("op") in OPS:
            case = cases.setdefault((row["op"], row["shape"]), {"dims": (row["M"], row["K"], row["N"])})
            case[row["variant"]] = row
    if not cases:
        raise Mismatch("bench has no ag_matmul or matmul_rs rows")
    return cases


def _ms(row: dict | None) -> float | None:
    return None if row is None else row.get("median_ms")


def _ficco(case: dict, selected: bool) -> tuple[float | None, str, float | None]:
    """(ms, schedule, ± ms) of `auto`'s pick (selected) or of the fastest timed ficco_jax variant."""
    rows = [(v, r) for v, r in case.items() if v.startswith("ficco:") and _ms(r) is not None]
    if selected:
        rows = [(v, r) for v, r in rows if r.get("selected")]
    if not rows:
        return None, "", None
    variant, row = min(rows, key=lambda vr: vr[1]["median_ms"])
    return row["median_ms"], variant[len("ficco:"):], row.get("spread_ms")


def _peer_rows(name: str, data: dict | None, case_dims: dict) -> dict:
    """{shape name: row} of a peer file, Mismatch where a shape's M,K,N differ from bench's."""
    out = {}
    for row in (data or {}).get("rows", []):
        want = case_dims.get(row.get("shape"))
        if want is not None and (row.get("M"), row.get("K"), row.get("N")) != want:
            raise Mismatch(f"{name} timed {row['shape']} as {row.get('M')},{row.get('K')},{row.get('N')}, bench as "
                           f"{','.join(map(str, want))}: one table holds one problem per row")
        out[row.get("shape")] = row
    return out


def rows(bench: dict, torch: dict | None = None, windowed: dict | None = None) -> list[dict]:
    """One dict per (op, shape) of bench: op, shape, dims, each timed column of COLUMNS in ms (None:
    not measured), auto's pick, its spread ("auto_spread", ± ms) and the best schedule, "fastest" (a name
    of FASTEST), "auto_fastest", and "auto_within_spread": auto is not the fastest, but no further from it
    than its own spread (bench's half-range of its timings), a difference the timing cannot tell."""
    peers = {name: data for name, data in zip(PEERS, (torch, windowed)) if data and not _skip_reason(data)}
    _check(bench, peers)
    cases = _bench_cases(bench)
    dims = {shape: case["dims"] for (_, shape), case in cases.items()}
    by_shape = {name: _peer_rows(name, data, dims) for name, data in peers.items()}
    out = []
    for (op, shape), case in cases.items():
        prefix = OPS[op]
        peer = by_shape.get("torch_tp", {}).get(shape, {})
        xla = by_shape.get("jax_tp_windowed", {}).get(shape, {}).get(f"{prefix}_xla_windowed")
        auto_ms, pick, auto_spread = _ficco(case, selected=True)
        best_ms, best, _ = _ficco(case, selected=False)
        row = {"op": op, "shape": shape, "dims": case["dims"], "ideal": _ms(case.get("ideal")),
               "JAX seq": _ms(case.get("jax_seq")),
               "XLA windowed": xla if "jax_tp_windowed" in peers else _ms(case.get("xla_windowed_einsum")),
               "PyTorch seq": peer.get(f"{prefix}_seq"), "PyTorch async-TP": peer.get(f"{prefix}_async_tp"),
               "ficco auto (pick)": auto_ms, "pick": pick, "auto_spread": auto_spread,
               "ficco best (schedule)": best_ms, "best": best}
        timed = {name: row[column] for name, column in FASTEST.items() if row[column] is not None}
        row["fastest"] = min(timed, key=timed.get) if timed else None
        row["auto_fastest"] = row["fastest"] == "ficco auto"
        row["auto_within_spread"] = (not row["auto_fastest"] and auto_ms is not None and auto_spread is not None
                                     and auto_ms - auto_spread <= timed[row["fastest"]])
        out.append(row)
    return out


def _sources(bench: dict, torch: dict | None, windowed: dict | None) -> list[str]:
    lines = [f"ficco_jax, JAX sequential, ideal: bench at `{bench.get('commit')}`, {bench.get('date')}; "
             f"{bench.get('method')}"]
    for label, name, data in (("PyTorch", "torch_tp", torch), ("XLA windowed einsum", "jax_tp --windowed", windowed)):
        if _skip_reason(data):
            lines.append(f"{label}: skipped: {_skip_reason(data)}")
        elif data:
            version = f" {data['torch']}" if data.get("torch") else ""
            lines.append(f"{label}{version}: {name} at `{data.get('commit')}`; {data.get('method')}")
    if not windowed or _skip_reason(windowed):
        if any(r.get("variant") == "xla_windowed_einsum" for r in bench["rows"]):
            lines.append("XLA windowed einsum: bench's own child process per shape")
    return lines


def _cells(r: dict, meaningful: bool) -> list[str]:
    """The COLUMNS of one row as text; ratios and "fastest" only where times mean something."""
    def ms(value, name="", spread=None):
        if value is None:
            return "—"
        text = f"{value:.3f}" + (f" ± {spread:.3f}" if spread and meaningful else "")
        return f"{text} ({name})" if name else text

    auto, ideal = r["ficco auto (pick)"], r["ideal"]
    if not meaningful:
        ratio = fastest = "n/a"
    else:
        ratio, fastest = f"{auto / ideal:.3f}x" if auto and ideal else "—", r["fastest"] or "—"
        if r["auto_within_spread"]:
            fastest += " (auto within its ±)"
    return [ms(r[c]) for c in COLUMNS[:5]] + [ms(auto, r["pick"], r["auto_spread"]),
                                             ms(r["ficco best (schedule)"], r["best"]), ratio, fastest]


def meaningful(bench: dict) -> bool:
    """Whether bench's times are a GPU's (on CPU they are host loops: no ratio is drawn from them)."""
    return bench.get("platform") != "cpu"


def markdown(bench: dict, torch: dict | None = None, windowed: dict | None = None) -> str:
    table = rows(bench, torch, windowed)
    lines = [f"{bench.get('n_devices')} x {bench.get('device')}, {bench.get('dtype')}, ms. Sources:", ""]
    lines += [f"- {s}" for s in _sources(bench, torch, windowed)]
    lines += ["", "| op | shape (M,K,N) | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for r in table:
        lines.append(f"| {r['op']} | {r['shape']} {','.join(map(str, r['dims']))} | "
                     + " | ".join(_cells(r, meaningful(bench))) + " |")
    lines += ["", "ficco best: the fastest of the ficco_jax schedules bench measured (with `--schedules auto`, "
                  "auto's pick alone); fastest: the quickest of the timed columns, a tie going to the one further "
                  "left in this note's order: ficco auto, ficco best, JAX seq, XLA windowed, PyTorch seq, PyTorch "
                  "async-TP (ideal excluded); \"(auto within its ±)\": auto's time less its spread (the "
                  "half-range of bench's timings of it) reaches the fastest, a difference the timing cannot "
                  "tell; —: not measured in these files."]
    if not meaningful(bench):
        lines.append("On CPU the times are host loops of tiny shapes: no ratio is drawn from them (n/a).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", help="bench.json of python -m ficco_jax bench")
    parser.add_argument("--torch", help="torch_tp.json of benchmarks/peers/torch_tp.py")
    parser.add_argument("--windowed", help="jax_tp_windowed.json of benchmarks/peers/jax_tp.py --windowed")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    try:
        text = markdown(load(args.bench), load(args.torch), load(args.windowed))
    except Mismatch as e:
        print(f"tp_table: {e}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
