"""Device time of `ficco_jax.dma.all_to_all` against `jax.lax.all_to_all` (NCCL on GPU), alone and
beside an independent matmul; with `--collective all_gather|reduce_scatter`, the same for
`dma.all_gather` / `dma.reduce_scatter` against `lax.all_gather` / `lax.psum_scatter` (alone only).

    NCCL_NVLS_ENABLE=0 python benchmarks/peers/collectives_vs_nccl.py                     # GPU: 1, 4, 16, 64 MiB
    NCCL_NVLS_ENABLE=0 python benchmarks/peers/collectives_vs_nccl.py --collective all_gather \
        --schedules default,dma/direct/c1/push                           # pulls vs pushes vs NCCL
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/peers/collectives_vs_nccl.py   # CPU smoke

Every local device, one 1-D mesh axis "tp", inside jax.shard_map. Per device x [n * rows, COLS]
bf16 (split and concat axis 0): n per-peer blocks of `--sizes` MiB each (all_gather: x is one
block, reduce_scatter: x is n blocks, one per destination). Variants: NCCL
(`lax.all_to_all(tiled=True)`), dma.all_to_all with its default schedule, and its ring and
direct orders (`--schedules`). Each dma result is compared bit for bit with lax.all_to_all before
it is timed (and lax.all_to_all with an all_gather + slice); a variant that differs is reported
and not timed. all_gather: bit for bit with lax.all_gather; reduce_scatter: relative error under
1e-2 against lax.psum_scatter in float32 (the bf16 sums round differently).

"With a matmul beside it" (`--overlap-sizes`): one jitted body runs an independent bf16 matmul
(per device [M, K] @ [K, N], `--matmul`) and the all_to_all on separate data; each result's
corner is written into the other's next input, so neither can be dropped or hoisted and
iterations do not overlap each other. Measured for NCCL and dma (default schedule), beside the
matmul alone (on every device at once, as in the pair) and the all_to_all alone, so the table
shows the pair against max(matmul, a2a) (perfect overlap) and matmul + a2a (none).

Times: `ficco_jax.tools.harness.method()` (in-jit loop differencing, as `bench` times). GB/s = (n-1) x block bytes / time:
the bytes each GPU sends (and receives) per collective, what nccl-tests reports as bus
bandwidth for all_to_all, all_gather and reduce_scatter alike. On CPU the times are host memcpy/loop times and NOT meaningful. A progress line per
measurement goes to stderr; measurements left when `--budget-s` is spent are skipped and listed.
Writes $OUT/a2a_vs_nccl.json, or $OUT/<collective>_vs_nccl.json (OUT defaults to out/a2a_vs_nccl);
the Markdown table comes last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from ficco_jax import dma  # noqa: E402
from ficco_jax.schedule import Schedule  # noqa: E402
from ficco_jax.tools import harness  # noqa: E402
from ficco_jax.tools.report import git_commit  # noqa: E402
from ficco_jax.tuning import timing  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collectives_tables import NCCL, a2a_table, overlap_table, result_name  # noqa: E402

#: Elements per row of a block (4 KiB of bf16): blocks of `size` MiB hold size * 256 rows.
COLS = 2048
DTYPE = jnp.bfloat16
GPU_SIZES, CPU_SIZES = "1,4,16,64", "0.0625,0.25"
GPU_MATMUL, CPU_MATMUL = "8192,8192,7168", "128,128,128"
COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter")
#: What the standalone dma collectives run with schedule=None: direct, one chunk, one copy stream.
DEFAULT_SCHEDULE = Schedule(comm="dma", order="direct", chunks=1, copy_streams=1)
#: dma.reduce_scatter sums in float32 and rounds once; NCCL's bf16 ring sums round per step.
RS_TOLERANCE = 1e-2
#: The pair's matmul against the matmul alone: the same bf16 dot, but XLA may fuse or split it
#: differently in the two programs, so not bit for bit.
MATMUL_TOLERANCE = 1e-2


class Budget:
    """Progress lines on stderr and the time budget: `start(what)` is False once it is spent."""

    def __init__(self, seconds: float, total: int):
        self.t0, self.seconds, self.total, self.k, self.skipped = time.perf_counter(), seconds, total, 0, []

    def spent(self) -> bool:
        return time.perf_counter() - self.t0 > self.seconds

    def start(self, what: str) -> bool:
        self.k += 1
        elapsed = time.perf_counter() - self.t0
        if elapsed > self.seconds:
            self.skipped.append(what)
            sys.stderr.write(f"[{self.k:>2}/{self.total}] {elapsed:6.1f}s  SKIPPED (budget {self.seconds:.0f} s spent): {what}\n")
            return False
        sys.stderr.write(f"[{self.k:>2}/{self.total}] {elapsed:6.1f}s  {what}\n")
        sys.stderr.flush()
        return True


# ------------------------------------------------------------------------------------------------
# Bodies (per device, inside shard_map over "tp")
# ------------------------------------------------------------------------------------------------
def a2a_body(variant, collective="all_to_all"):
    schedule = None if variant == "default" else variant
    if collective == "all_gather":
        if variant == NCCL:
            return lambda x: lax.all_gather(x, "tp", tiled=True)
        return lambda x: dma.all_gather(x, "tp", schedule=schedule)
    if collective == "reduce_scatter":
        if variant == NCCL:
            return lambda x: lax.psum_scatter(x, "tp", tiled=True)
        return lambda x: dma.reduce_scatter(x, "tp", schedule=schedule)
    if variant == NCCL:
        return lambda x: lax.all_to_all(x, "tp", 0, 0, tiled=True)
    return lambda x: dma.all_to_all(x, "tp", 0, 0, schedule=schedule)


def chain_pair(step, repeats: int):
    """Like `timing.chain`, for a step of two independent results: (ya, ym) = step(xa, xm, w).
    Each result's corner goes into the other's input, so both are consumed, every iteration
    depends on the previous one, and the matmul (its operand is carried) cannot be hoisted."""

    def corner(v, like):
        return v[(slice(0, 1),) * v.ndim].astype(like.dtype).reshape((1,) * like.ndim)

    def body(xa, xm, w):
        def one(_, carry):
            xa, xm = carry
            ya, ym = step(xa, xm, w)
            return (lax.dynamic_update_slice(xa, corner(ym, xa), (0,) * xa.ndim),
                    lax.dynamic_update_slice(xm, corner(ya, xm), (0,) * xm.ndim))

        return lax.fori_loop(0, repeats, one, (xa, xm))

    return body


def sharded(mesh, body, n_args, repeats=None, pair=False):
    in_specs = (P("tp"),) * n_args
    if repeats is not None:
        body = chain_pair(body, repeats) if pair else timing.chain(body, repeats)
    out_specs = (P("tp"), P("tp")) if pair else P("tp")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def random_sharded(mesh, shape, seed, scale=1.0):
    """Random bf16 (never all zeros) of global `shape`, generated shard-wise on the devices."""
    sharding = NamedSharding(mesh, P("tp"))
    make = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * scale).astype(DTYPE), out_shardings=sharding)
    return make(jax.random.PRNGKey(seed))


@jax.jit
def rel_err(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30)


@jax.jit
def bit_equal(a, b):
    bits = lambda v: lax.bitcast_convert_type(v, jnp.uint16)
    return jnp.array_equal(bits(a), bits(b))


# ------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------
def time_ms(make, args) -> dict:
    t = harness.device_time(make, args)
    return {"median_ms": t["median_s"] * 1e3, "spread_ms": t["spread_s"] * 1e3, "repeats": t["repeats"]}


def gathered_reference(x_local):
    """all_to_all(split 0, concat 0, tiled) by another route: all_gather every x, keep block r of
    each. Checks lax.all_to_all itself, so no variant is only compared with itself."""
    n, r = lax.psum(1, "tp"), lax.axis_index("tp")
    rows = x_local.shape[0] // n
    everyone = lax.all_gather(x_local, "tp")  # [n, n * rows, COLS]
    return lax.dynamic_slice_in_dim(everyone, r * rows, rows, axis=1).reshape(x_local.shape)


def measure_a2a(mesh, size_mib, variants, budget, collective="all_to_all") -> list[dict]:
    n = mesh.shape["tp"]
    blocks = 1 if collective == "all_gather" else n  # per device: all_gather sends its one block to all
    x = random_sharded(mesh, (n * blocks * block_rows(size_mib), COLS), seed=int(size_mib * 1024))
    want = sharded(mesh, a2a_body(NCCL, collective), 1)(x)  # every dma variant is compared with this
    if collective == "reduce_scatter":
        want = sharded(mesh, lambda v: lax.psum_scatter(v.astype(jnp.float32), "tp", tiled=True), 1)(x)
    out = []
    for variant in [NCCL] + variants:
        row = {"block_mib": size_mib, "variant": variant, "schedule": resolved(variant, n, collective)}
        out.append(row)
        if not budget.start(f"{collective} {size_mib:g} MiB {row['schedule']}"):
            row["note"] = "skipped: budget spent"
            continue
        try:
            got = sharded(mesh, a2a_body(variant, collective), 1)(x)
            if collective == "reduce_scatter":  # NCCL too: its bf16 sums against the f32 reference
                row["rel_err"] = float(rel_err(got, want))
                row["bit_exact"] = False
                ok, reference = row["rel_err"] < RS_TOLERANCE, "lax.psum_scatter in float32"
            elif variant == NCCL and collective == "all_gather":
                ok, row["checked"] = True, "the reference the dma rows are compared with"
            elif variant == NCCL:
                ok = row["bit_exact"] = bool(bit_equal(want, sharded(mesh, gathered_reference, 1)(x)))
                reference = "all_gather + slice"
            else:
                ok = row["bit_exact"] = bool(bit_equal(got, want))
                reference = f"lax.{collective}"
            if not ok:
                row["note"] = "WRONG RESULT: differs from " + reference
                continue
            row.update(time_ms(lambda r: sharded(mesh, a2a_body(variant, collective), 1, r), (x,)))
            row["gbps"] = (n - 1) * size_mib * 2**20 / (row["median_ms"] * 1e-3) / 1e9
        except Exception as exc:  # noqa: BLE001 - the run goes on and the table says what broke
            row["note"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def matmul_inputs(mesh, matmul):
    n, (M, K, N) = mesh.shape["tp"], matmul
    return random_sharded(mesh, (n * M, K), seed=2), random_sharded(mesh, (n * K, N), seed=3, scale=1.0 / np.sqrt(K))


def measure_matmul(mesh, matmul, budget) -> dict:
    """The matmul alone, on every device at once (as in the pair)."""
    M, K, N = matmul
    row = {"variant": "matmul_alone", "matmul": [M, K, N]}
    if not budget.start(f"matmul alone {M}x{K}x{N} per device"):
        return dict(row, note="skipped: budget spent")
    try:
        row.update(time_ms(lambda r: sharded(mesh, lambda a, b: a @ b, 2, r), matmul_inputs(mesh, matmul)))
        row["tflops_per_device"] = 2 * M * K * N / (row["median_ms"] * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - the run goes on and the table says what broke
        row["note"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


def measure_pairs(mesh, size_mib, matmul_row, a2a_rows, budget) -> list[dict]:
    """The pair (matmul + all_to_all on separate data) for NCCL and dma, and the bounds."""
    n = mesh.shape["tp"]
    base = {"block_mib": size_mib, "matmul": matmul_row["matmul"]}
    if budget.spent():  # not even the inputs and references
        return [dict(base, variant=f"pair_{label}", note="skipped: budget spent")
                for label in ("nccl", "dma") if budget.start(f"pair {size_mib:g} MiB a2a + matmul, {label}") or True]
    xa = random_sharded(mesh, (n * n * block_rows(size_mib), COLS), seed=1)
    xm, w = matmul_inputs(mesh, tuple(matmul_row["matmul"]))
    want_a = sharded(mesh, a2a_body(NCCL), 1)(xa)
    want_m = sharded(mesh, lambda a, b: a @ b, 2)(xm, w)
    rows = [dict(matmul_row, **base)]
    for variant in (NCCL, "default"):
        row = dict(base, variant=f"pair_{'nccl' if variant == NCCL else 'dma'}",
                   schedule=resolved(variant, n))
        rows.append(row)
        if not budget.start(f"pair {size_mib:g} MiB a2a + matmul, {row['schedule']}"):
            row["note"] = "skipped: budget spent"
            continue
        step = lambda a, m, b, body=a2a_body(variant): (body(a), m @ b)
        try:
            ya, ym = sharded(mesh, step, 3, pair=True)(xa, xm, w)
            row["bit_exact"] = bool(bit_equal(ya, want_a))  # the all_to_all part
            row["matmul_rel_err"] = float(rel_err(ym, want_m))  # vs the matmul alone (same dot, may fuse apart)
            if not row["bit_exact"] or not row["matmul_rel_err"] < MATMUL_TOLERANCE:
                row["note"] = "WRONG RESULT: differs from lax.all_to_all or the matmul alone; not timed"
                continue
            row.update(time_ms(lambda r: sharded(mesh, step, 3, r, pair=True), (xa, xm, w)))
        except Exception as exc:  # noqa: BLE001
            row["note"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return rows + bounds(base, matmul_row, a2a_rows)


def bounds(base, matmul_row, a2a_rows) -> list[dict]:
    """max(matmul, a2a) (perfect overlap) and matmul + a2a (none), from the rows measured alone."""
    out = []
    for variant, label in ((NCCL, "nccl"), ("default", "dma")):
        alone = next((r for r in a2a_rows if r["variant"] == variant and "median_ms" in r), None)
        if alone is None or "median_ms" not in matmul_row:
            continue
        mm, a2a = matmul_row["median_ms"], alone["median_ms"]
        out.append(dict(base, variant=f"a2a_alone_{label}", median_ms=a2a, schedule=alone["schedule"]))
        out.append(dict(base, variant=f"bound_max_{label}", median_ms=max(mm, a2a), note="max(matmul, a2a): perfect overlap"))
        out.append(dict(base, variant=f"bound_sum_{label}", median_ms=mm + a2a, note="matmul + a2a: no overlap"))
    return out


# ------------------------------------------------------------------------------------------------
# Sizes, schedules, tables
# ------------------------------------------------------------------------------------------------
def block_rows(size_mib: float) -> int:
    rows = size_mib * 2**20 / (COLS * jnp.dtype(DTYPE).itemsize)
    if rows < 1 or rows != int(rows):
        raise ValueError(f"a2a_vs_nccl: a block of {size_mib} MiB is not a whole number of {COLS}-element bf16 rows "
                         f"({rows}); use multiples of {COLS * 2 / 2**20:g} MiB")
    return int(rows)


def resolved(variant, n, collective="all_to_all") -> str:
    """The schedule a variant runs, as a string ("nccl" for the lax collective)."""
    if variant == NCCL:
        return NCCL
    if variant == "default":  # one chunk: valid for any block
        return f"{DEFAULT_SCHEDULE} (default)"
    return str(Schedule.parse(variant))


def dma_variants(arg: str, n: int) -> list[str]:
    """The dma schedules to time: the default (one copy stream; dma's ring order is the same
    program), then two streams and every peer on its own stream where there are that many peers
    (a schedule may not have more copy streams than peers); the ones that resolve to the same
    schedule as an earlier one are dropped."""
    streams = sorted({s for s in (2, n - 1) if 2 <= s <= n - 1})
    listed = arg.split(",") if arg else ["default"] + [f"dma/direct/c1/s{s}" for s in streams]
    out, seen = [], set()
    for v in listed:
        key = resolved(v, n).replace(" (default)", "")
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def run(args) -> dict:
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    n, on_cpu = mesh.shape["tp"], jax.default_backend() == "cpu"
    sizes = [float(s) for s in (args.sizes or (CPU_SIZES if on_cpu else GPU_SIZES)).split(",")]
    overlap_sizes = (sorted(sizes)[-2:] if args.overlap_sizes is None
                     else [float(s) for s in args.overlap_sizes.split(",") if s])  # "": no pairs
    matmul = tuple(int(d) for d in (args.matmul or (CPU_MATMUL if on_cpu else GPU_MATMUL)).split(","))
    for size in sizes + overlap_sizes:
        block_rows(size)  # fail before measuring anything
    variants = dma_variants(args.schedules, n)
    if args.collective != "all_to_all":
        if args.overlap_sizes:
            raise SystemExit(f"--overlap-sizes is for all_to_all only; drop it with --collective {args.collective}")
        overlap_sizes = []
    extra = [s for s in overlap_sizes if s not in sizes]  # their all_to_all alone is measured too
    budget = Budget(args.budget_s, (len(sizes) * (1 + len(variants)) + 2 * len(extra)
                                    + (1 + 2 * len(overlap_sizes) if overlap_sizes else 0)))
    a2a_rows, overlap_rows = [], []

    def logged(rows):  # each result on stderr as it lands: a run that dies later keeps them
        for r in rows if isinstance(rows, list) else [rows]:
            sys.stderr.write("ROW " + json.dumps(r) + "\n")
        return rows

    for size in sizes:
        a2a_rows += logged(measure_a2a(mesh, size, variants, budget, args.collective))
    for size in extra:
        a2a_rows += logged(measure_a2a(mesh, size, ["default"], budget))
    matmul_row = logged(measure_matmul(mesh, matmul, budget)) if overlap_sizes else None
    for size in overlap_sizes:
        overlap_rows += logged(measure_pairs(mesh, size, matmul_row, [r for r in a2a_rows if r["block_mib"] == size], budget))
    return {
        "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "n_devices": n,
        "collective": args.collective,
        "dtype": "bfloat16", "cols": COLS, "jax": jax.__version__, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "times_meaningful": not on_cpu,
        "method": harness.method("times are host memcpy/loop times, NOT meaningful"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "gbps_definition": "(n-1) * block bytes / time: bytes each device sends per collective (nccl-tests busbw)",
        "budget_s": args.budget_s, "skipped": budget.skipped, "a2a": a2a_rows, "overlap": overlap_rows,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help=f"per-peer block MiB, bf16 (default GPU {GPU_SIZES}, CPU {CPU_SIZES})")
    parser.add_argument("--overlap-sizes", default=None,
                        help="block MiB for the pair with a matmul (default: the 2 largest of --sizes; '' for none)")
    parser.add_argument("--matmul", default=None, help=f"M,K,N per device (default GPU {GPU_MATMUL}, CPU {CPU_MATMUL})")
    parser.add_argument("--schedules", default="", help="dma variants: 'default' or schedule strings, comma-separated")
    parser.add_argument("--collective", choices=COLLECTIVES, default="all_to_all",
                        help="the collective timed alone (the pair with a matmul is all_to_all's)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the measurements left after this long")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/a2a_vs_nccl"))
    args = parser.parse_args(argv)
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, result_name(args.collective)), "w") as fh:
        json.dump(result, fh, indent=1)
    head = (f"{result['n_devices']} x {result['device']} ({result['platform']}), bf16, jax {result['jax']}, "
            f"commit {result['commit']}" + ("" if result["times_meaningful"] else " — CPU: times NOT meaningful ('NCCL' is lax.all_to_all here)"))
    if result["skipped"]:
        head += f"\nSKIPPED ({len(result['skipped'])}, budget {args.budget_s:.0f} s spent): " + "; ".join(result["skipped"])
    if result["overlap"]:
        mm = result["overlap"][0]
        rate = f", {mm['tflops_per_device']:.0f} TFLOP/s per device alone" if "tflops_per_device" in mm else ""
        print(head + f"\n\nWith a matmul beside it ({'x'.join(map(str, mm['matmul']))} per device{rate}; hidden: "
              "share of the shorter op hidden under the longer, 0% serial, 100% perfect overlap):\n")
        print(overlap_table(result["overlap"]) + "\n\nall_to_all alone:\n")
    else:
        print(head + f"\n\n{args.collective} alone:\n")
    print(a2a_table(result["a2a"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
