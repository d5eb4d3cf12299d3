"""`python -m ficco_jax characterize` and `calibrate`: the losses that decomposition and overlap
cause, measured on this machine, and a machine profile fitted to them for the cost model.

(a) decomposition loss: c chunk matmuls [M/c, K] @ [K, N] against one [M, K] @ [K, N];
(b) contention: a matmul's slowdown while an all-gather of the same group runs beside it, with
    NCCL (XLA's async all-gather, SM-based) and with copy engines (lowering/dma/probe.py: the executor's
    matmuls with and without its copy streams pulling every peer's shard in the same call, since
    a ficco call joins XLA's stream before it returns and so never runs beside another matmul);
(c) transfer cost: all-gather time by shard size for copy engines (1..k streams) and NCCL,
    fitted to latency + size / bandwidth;
(d) FP8 rate: the executor's FP8 matmul (e4m3 x e4m3 -> bf16, cuBLASLt) by row count, each
    product verified first (gemm_rates.py); `calibrate` fits peak_tflops["float8_e4m3fn"] to it.
All times by `timing.device_time` (in-jit loop differencing). On CPU they are not meaningful.
"""
from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import dma
from ..lowering.dma import probe
from ..schedule import Schedule
from ..tuning import select, timing
from ..tuning.fitting import nccl_contention
from . import gemm_rates, harness
from .report import git_commit, plot_characterization, progress_printer

GPU_GRID = {"rows": [512, 1024, 2048, 4096, 8192], "kn": [(8192, 7168), (8192, 2560), (12288, 12288)],
            "chunks": [1, 2, 4, 8], "shard_mib": [1, 4, 16, 64]}
CPU_GRID = {"rows": [64, 128], "kn": [(64, 64)], "chunks": [1, 2, 4], "shard_mib": [0.0625, 0.25]}
#: Row counts and (K, N) of the FP8 rate (a line in rows, as the bf16 peak is fitted).
GPU_FP8 = {"rows": [1024, 2048, 4096, 8192], "kn": (8192, 7168)}
CPU_FP8 = {"rows": [32, 64], "kn": (64, 48)}


def _rand(shape, dtype, seed=0, device=None):
    a = (jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) / np.sqrt(shape[-1])).astype(dtype)
    return jax.device_put(a, device) if device is not None else a


def chunk_matmuls(c: int):
    """a @ w as c matmuls of a's row chunks, for timing. The products are not concatenated (a copy
    the decomposition does not make); each chunk's corner is added into the first, and the timing
    chain keeps every product live (timing.chain)."""
    def step(a, w):
        q = a.shape[0] // c
        ys = [a[j * q:(j + 1) * q] @ w for j in range(c)]
        return ys[0].at[0, 0].add(sum(y[0, 0] for y in ys[1:])) if c > 1 else ys[0]
    return step


def decomposition(grid, dtype, progress) -> list[dict]:
    dev = jax.local_devices()[0]
    rows_out = []
    for k, n_cols in grid["kn"]:
        w = _rand((k, n_cols), dtype, 1, dev)
        for rows in grid["rows"]:
            a = _rand((rows, k), dtype, 2, dev)
            base = None
            for c in grid["chunks"]:
                if rows % c:
                    continue
                progress(f"decomposition rows={rows} K={k} N={n_cols} c={c}")

                step = chunk_matmuls(c)
                t = harness.device_time(lambda r, step=step: jax.jit(timing.chain(step, r)), (a, w))["median_s"]
                base = t if c == 1 else base
                rows_out.append({"rows": rows, "K": k, "N": n_cols, "chunks": c, "ms": t * 1e3,
                                 "loss": t / base - 1.0 if base else 0.0})
    return rows_out


def transfers(grid, dtype, progress) -> list[dict]:
    n = len(jax.local_devices())
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    itemsize = jnp.dtype(dtype).itemsize
    comms = select.available_comms()
    out = []
    for mib in grid["shard_mib"]:
        cols = 1024
        rows = max(int(mib * 2**20 / (cols * itemsize)), n)
        x = jax.device_put(_rand((rows * n, cols), dtype), NamedSharding(mesh, P("tp", None)))
        variants = [("nccl", lambda v: jax.lax.all_gather(v, "tp", axis=0, tiled=True))]
        if "dma" in comms:
            for s in (1, 2) if n > 2 else (1,):
                variants.append((f"dma_s{s}", lambda v, s=s: dma.all_gather(
                    v, "tp", schedule=Schedule(comm="dma", order="direct", copy_streams=s))))
        for name, body in variants:
            progress(f"transfer {name} shard {mib} MiB")
            make = lambda r, body=body: jax.jit(jax.shard_map(timing.chain(body, r), mesh=mesh,
                                                              in_specs=(P("tp", None),), out_specs=P("tp", None)))
            t = harness.device_time(make, (x,))["median_s"]
            nbytes = rows * cols * itemsize
            out.append({"comm": name, "shard_bytes": nbytes, "ms": t * 1e3,
                        "ingress_gbps": (n - 1) * nbytes / t / 1e9})
    return out


def contention(dtype, progress, rows=4096, k=8192, n_cols=7168, shard_mib=64) -> dict:
    """Matmul time alone vs beside an all-gather (NCCL, and copy engines where available)."""
    n = len(jax.local_devices())
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:
        rows, k, n_cols, shard_mib = 64, 64, 64, 0.0625
    a = jax.device_put(_rand((rows * n, k), dtype), NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(_rand((k, n_cols * n), dtype, 1), NamedSharding(mesh, P(None, "tp")))
    x_rows = max(int(shard_mib * 2**20 / (1024 * jnp.dtype(dtype).itemsize)), 1)
    x = jax.device_put(_rand((x_rows * n, 1024), dtype, 2), NamedSharding(mesh, P("tp", None)))
    specs = (P("tp", None), P(None, "tp"), P("tp", None))

    def timed(gather, matmul=True):
        def step(a, w, x):
            if not matmul:
                return gather(x)
            y = a @ w
            if gather is None:
                return y
            g = gather(x)  # independent of the matmul: XLA may run the two at once
            return y + g[:1, :1].astype(y.dtype)
        make = lambda r: jax.jit(jax.shard_map(timing.chain(step, r), mesh=mesh, in_specs=specs, out_specs=specs[0]))
        return harness.device_time(make, (a, w, x))["median_s"] * 1e3

    progress("contention: matmul alone")
    result = {"rows": rows, "K": k, "N": n_cols, "shard_bytes": x_rows * 1024 * jnp.dtype(dtype).itemsize,
              "matmul_ms": timed(None)}
    if "dma" in select.available_comms():
        result.update(_dma_contention(a, w, x, mesh, specs, progress))
    progress("contention: all-gather alone")
    result["nccl_alone_ms"] = timed(lambda v: jax.lax.all_gather(v, "tp", axis=0, tiled=True), matmul=False)
    progress("contention: matmul + NCCL all-gather")
    result["matmul_plus_nccl_ms"] = timed(lambda v: jax.lax.all_gather(v, "tp", axis=0, tiled=True))
    # XLA may serialize the all-gather with the matmul (it did on 4 x H200). Its collective-permutes
    # are asynchronous and scheduled beside independent compute (what comm="xla" schedules rely
    # on): the same bytes moved as n-1 ppermutes give a second, concurrent NCCL probe.
    progress("contention: NCCL ppermutes alone")
    result["nccl_p2p_alone_ms"] = timed(_ppermute_gather(n), matmul=False)
    progress("contention: matmul + NCCL ppermutes")
    result["matmul_plus_nccl_p2p_ms"] = timed(_ppermute_gather(n))
    return result


def _ppermute_gather(n: int):
    """x's shard from every peer by n-1 independent ppermutes (NCCL send/recv on GPUs). Not
    concatenated (a copy an all-gather does not make): every received shard's corner is added in."""
    def gather(v):
        got = [jax.lax.ppermute(v, "tp", [(i, (i + d) % n) for i in range(n)]) for d in range(1, n)]
        return v.at[0, 0].add(sum(g[0, 0] for g in got)) if got else v
    return gather


def _dma_contention(a, w, x, mesh, specs, progress, repeats: int = 4) -> dict:
    """The executor's matmuls with and without copy engines pulling every peer's x meanwhile
    (lowering/dma/probe.py: one custom call, so the copies really run beside the matmuls)."""

    def timed(pull):
        body = lambda a, w, x: probe.matmuls_beside_pulls(a, w, x, "tp", repeats=repeats, pull=pull)
        make = lambda r: jax.jit(jax.shard_map(timing.chain(body, r), mesh=mesh, in_specs=specs, out_specs=specs[0]))
        return harness.device_time(make, (a, w, x))["median_s"] * 1e3 / repeats

    progress("contention: executor matmuls alone")
    alone = timed(False)
    progress("contention: executor matmuls beside copy-engine pulls")
    return {"executor_matmul_ms": alone, "executor_matmul_beside_dma_ms": timed(True), "probe_repeats": repeats}


def fp8_rate(grid, progress) -> list[dict]:
    """The executor's FP8 matmul time per row count of one (K, N) (see gemm_rates.executor_fp8_rows)."""
    k, n_cols = grid["kn"]
    return gemm_rates.executor_fp8_rows(grid["rows"], k, n_cols, progress=progress)


PARTS = ("decomposition", "transfers", "contention", "fp8")


def check_parts(parts) -> None:
    """ValueError unless `parts` is a non-empty selection of PARTS."""
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"characterize: parts {list(parts)}: choose among {', '.join(PARTS)}")


def run(out_dir: str, dtype: str = "bfloat16", plot: bool = False, parts=PARTS) -> dict:
    """Measure `parts` (all four by default) and write characterize.json; a part left out is an
    empty list/dict there (fit_profile then keeps the profile's values for it)."""
    check_parts(parts)
    on_cpu = jax.default_backend() == "cpu"
    grid, fp8_grid = (CPU_GRID, CPU_FP8) if on_cpu else (GPU_GRID, GPU_FP8)
    dtype = "float32" if on_cpu else dtype
    steps = ((len(grid["kn"]) * len(grid["rows"]) * len(grid["chunks"]) if "decomposition" in parts else 0)
             + (3 * len(grid["shard_mib"]) if "transfers" in parts else 0) + (7 if "contention" in parts else 0)
             + (len(fp8_grid["rows"]) if "fp8" in parts else 0))
    progress = progress_printer(steps)
    result = {
        "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
        "n_devices": len(jax.local_devices()), "dtype": dtype, "jax": jax.__version__, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": harness.method(),
        "decomposition": decomposition(grid, dtype, progress) if "decomposition" in parts else [],
        "transfers": transfers(grid, dtype, progress) if "transfers" in parts else [],
        "contention": contention(dtype, progress) if "contention" in parts else {},
        "fp8": fp8_rate(fp8_grid, progress) if "fp8" in parts else [],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "characterize.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(summary(result))
    if plot:
        plot_characterization(result, out_dir)
    return result


def summary(char: dict) -> str:
    lines = [f"Characterization on {char['n_devices']} x {char['device']} ({char['dtype']}), {char['method']}",
             "decomposition loss (time of c chunk matmuls / one matmul - 1):"]
    for r in char["decomposition"]:
        if r["chunks"] > 1:
            lines.append(f"  rows={r['rows']:>6} K={r['K']:>6} N={r['N']:>6} c={r['chunks']}: {r['loss'] * 100:+6.1f}%  ({r['ms']:.3f} ms)")
    lines.append("transfers (all-gather, ingress per device):")
    for r in char["transfers"]:
        lines.append(f"  {r['comm']:>7} shard {r['shard_bytes'] / 2**20:8.2f} MiB: {r['ms']:.3f} ms  {r['ingress_gbps']:.1f} GB/s")
    lines += fp8_summary(char.get("fp8", []))
    c = char["contention"]
    if not c:
        return "\n".join(lines)
    slowdown, how = nccl_contention(c)
    lines.append(f"contention: matmul alone {c['matmul_ms']:.3f} ms; beside NCCL all-gather {c['matmul_plus_nccl_ms']:.3f} ms"
                 + (f", beside NCCL ppermutes {c['matmul_plus_nccl_p2p_ms']:.3f} ms" if "matmul_plus_nccl_p2p_ms" in c else "")
                 + (f" -> NCCL slowdown {slowdown * 100:+.1f} % ({how})" if slowdown is not None else f" ({how})")
                 + (f"; executor matmul alone {c['executor_matmul_ms']:.3f} ms, beside copy-engine pulls "
                    f"{c['executor_matmul_beside_dma_ms']:.3f} ms" if "executor_matmul_ms" in c else ""))
    return "\n".join(lines)


def fp8_summary(rows) -> list[str]:
    if not rows:
        return []
    lines = ["FP8 executor matmul (e4m3 x e4m3 -> bf16, verified first):"]
    for r in rows:
        rate = f"{r['ms']:.3f} ms  {2 * r['rows'] * r['K'] * r['N'] / (r['ms'] * 1e-3) / 1e12:.0f} TFLOP/s" \
            if r["ms"] else r["note"]
        lines.append(f"  rows={r['rows']:>6} K={r['K']:>6} N={r['N']:>6}: {rate}")
    return lines
