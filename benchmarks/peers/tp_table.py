"""One table of a tensor-parallel comparison on one machine: ficco_jax against JAX, XLA and PyTorch.

    python3 benchmarks/peers/tp_table.py BENCH_JSON [--torch TORCH_JSON] [--windowed WINDOWED_JSON]
        [--out FILE]

BENCH_JSON is `python -m ficco_jax bench`'s bench.json (ficco_jax's `auto` pick and its fastest
schedule, JAX sequential, the ideal bound), TORCH_JSON benchmarks/peers/torch_tp.py's torch_tp.json
(PyTorch sequential and async-TP), WINDOWED_JSON `jax_tp.py --windowed`'s jax_tp_windowed.json (XLA's
windowed einsum; a bench run with its windowed rows needs none). Each file keeps its own timing
method (device time for the JAX programs, CUDA events for PyTorch); the table says so, and names the
device, date and commit of every file. Files from different devices or group sizes are refused: a
table never mixes machines. Prints the markdown table (and writes it to FILE with --out); exits 2
on a file that cannot be read or does not match. Needs neither jax nor torch.
"""
from __future__ import annotations

import argparse
import json
import sys

OPS = {"ag_matmul": "ag", "matmul_rs": "rs"}
#: (column, where its value comes from) after op and shape; "auto" and "best" are ficco_jax's.
COLUMNS = ("ideal", "JAX seq", "XLA windowed", "PyTorch seq", "PyTorch async-TP", "ficco auto (pick)",
           "ficco best (schedule)", "auto / ideal", "fastest")

#: The timed columns and their names in "fastest".
FASTEST = {"JAX seq": "JAX seq", "XLA windowed": "XLA windowed", "PyTorch seq": "PyTorch seq",
           "PyTorch async-TP": "PyTorch async-TP", "ficco auto (pick)": "ficco auto", "ficco best (schedule)": "ficco best"}


class Mismatch(ValueError):
    """The files cannot go in one table (another device, group size, or no rows)."""


def load(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise Mismatch(f"cannot read {path}: {e}") from None


#: What each file is, told by its head: bench.json has no "peer"; the peers say which they are.
KINDS = {"bench": None, "torch_tp": "pytorch", "jax_tp_windowed": "jax"}


def _check_same_machine(bench: dict, others: dict[str, dict]) -> None:
    for name, data in {"bench": bench, **others}.items():
        if data.get("peer") != KINDS[name] or "rows" not in data:
            raise Mismatch(f"the {name} file is not {name}.json (its head: peer={data.get('peer')!r}); "
                           f"give bench.json, torch_tp.json and jax_tp_windowed.json in their places")
    want = (bench.get("device"), bench.get("n_devices"))
    for name, data in others.items():
        have = (data.get("device"), data.get("n"))
        if have != want:
            raise Mismatch(f"{name} was measured on {have[1]} x {have[0]}, bench on {want[1]} x {want[0]}: "
                           f"one table holds one machine; give files of the same run")


def _bench_cases(bench: dict) -> dict:
    """{(op, shape name): {"M,K,N", variant: row}} of bench's tensor-parallel cases."""
    cases: dict = {}
    for row in bench.get("rows", []):
        if row["op"] in OPS:
            case = cases.setdefault((row["op"], row["shape"]), {"dims": (row["M"], row["K"], row["N"])})
            case[row["variant"]] = row
    if not cases:
        raise Mismatch("bench has no ag_matmul or matmul_rs rows")
    return cases


def _ms(row: dict | None) -> float | None:
    return None if row is None else row.get("median_ms")


def _ficco(case: dict, selected: bool) -> tuple[float | None, str]:
    """(ms, schedule) of `auto`'s pick (selected) or of the fastest verified ficco_jax variant."""
    rows = [(v, r) for v, r in case.items() if v.startswith("ficco:") and _ms(r) is not None]
    if selected:
        rows = [(v, r) for v, r in rows if r.get("selected")]
    if not rows:
        return None, ""
    variant, row = min(rows, key=lambda vr: vr[1]["median_ms"])
    return row["median_ms"], variant[len("ficco:"):]


def rows(bench: dict, torch: dict | None = None, windowed: dict | None = None) -> list[dict]:
    """One dict per (op, shape) of bench: every column of COLUMNS as ms (None: not measured)."""
    others = {name: data for name, data in (("torch_tp", torch), ("jax_tp_windowed", windowed)) if data}
    _check_same_machine(bench, others)
    by_shape = {name: {r["shape"]: r for r in data.get("rows", [])} for name, data in others.items()}
    out = []
    for (op, shape), case in _bench_cases(bench).items():
        prefix = OPS[op]
        peer = by_shape.get("torch_tp", {}).get(shape, {})
        xla = by_shape.get("jax_tp_windowed", {}).get(shape, {})
        auto_ms, pick = _ficco(case, selected=True)
        best_ms, best = _ficco(case, selected=False)
        row = {"op": op, "shape": shape, "dims": case["dims"], "ideal": _ms(case.get("ideal")),
               "JAX seq": _ms(case.get("jax_seq")),
               "XLA windowed": _ms(case.get("xla_windowed_einsum")) or xla.get(f"{prefix}_xla_windowed"),
               "PyTorch seq": peer.get(f"{prefix}_seq"), "PyTorch async-TP": peer.get(f"{prefix}_async_tp"),
               "ficco auto (pick)": auto_ms, "pick": pick, "ficco best (schedule)": best_ms, "best": best}
        timed = {label: row[c] for c, label in FASTEST.items() if row[c] is not None}
        row["fastest"] = min(timed, key=timed.get) if timed else None  # a tie goes to the earlier column
        row["auto_fastest"] = auto_ms is not None and auto_ms <= min(timed.values())  # ties included
        out.append(row)
    return out


def _cells(r: dict) -> list[str]:
    """The COLUMNS of one row as text."""
    def ms(value, name=""):
        return "—" if value is None else f"{value:.3f} ({name})" if name else f"{value:.3f}"

    auto, ideal = r["ficco auto (pick)"], r["ideal"]
    return [ms(r[c]) for c in COLUMNS[:5]] + [ms(auto, r["pick"]), ms(r["ficco best (schedule)"], r["best"]),
                                             f"{auto / ideal:.3f}x" if auto and ideal else "—", r["fastest"] or "—"]


def markdown(bench: dict, torch: dict | None = None, windowed: dict | None = None) -> str:
    table = rows(bench, torch, windowed)
    sources = [f"ficco_jax, JAX, ideal: bench at `{bench.get('commit')}`, {bench.get('date')}; {bench.get('method')}"]
    if torch:
        sources.append(f"PyTorch {torch.get('torch')}: torch_tp at `{torch.get('commit')}`; {torch.get('method')}")
    if windowed:
        sources.append(f"XLA windowed einsum: jax_tp --windowed at `{windowed.get('commit')}`; {windowed.get('method')}")
    lines = [f"{bench.get('n_devices')} x {bench.get('device')}, {bench.get('dtype')}, ms. Sources:", ""]
    lines += [f"- {s}" for s in sources] + ["", "| op | shape (M,K,N) | " + " | ".join(COLUMNS) + " |",
                                             "|---" * (len(COLUMNS) + 2) + "|"]
    for r in table:
        lines.append(f"| {r['op']} | {r['shape']} {','.join(map(str, r['dims']))} | " + " | ".join(_cells(r)) + " |")
    lines += ["", "fastest: the quickest of the timed columns (ideal excluded); —: not measured in these files."]
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
