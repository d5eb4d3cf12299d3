"""`python -m ficco_jax characterize` and `calibrate`: the losses that decomposition and overlap
cause, measured on this machine, and a machine profile fitted to them for the cost model.

(a) decomposition loss: c chunk matmuls [M/c, K] @ [K, N] against one [M, K] @ [K, N];
(b) contention: a matmul's slowdown while an all-gather of the same group runs beside it, with
    NCCL (XLA's async all-gather, SM-based) and with copy engines (dma_probe: the executor's
    matmuls with and without its copy streams pulling every peer's shard in the same call, since
    a ficco call joins XLA's stream before it returns and so never runs beside another matmul);
(c) transfer cost: all-gather time by shard size for copy engines (1..k streams) and NCCL,
    fitted to latency + size / bandwidth.
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

from . import cost_model, heuristics, timing
from .report import git_commit, progress_printer
from .schedule import Schedule

GPU_GRID = {"rows": [512, 1024, 2048, 4096, 8192], "kn": [(8192, 7168), (8192, 2560), (12288, 12288)],
            "chunks": [1, 2, 4, 8], "shard_mib": [1, 4, 16, 64]}
CPU_GRID = {"rows": [64, 128], "kn": [(64, 64)], "chunks": [1, 2, 4], "shard_mib": [0.0625, 0.25]}


def _rand(shape, dtype, seed=0, device=None):
    a = (jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) / np.sqrt(shape[-1])).astype(dtype)
    return jax.device_put(a, device) if device is not None else a


def chunk_matmuls(c: int):
    """a @ w as c matmuls of a's row chunks, for timing. The products are not concatenated: the
    timing chain feeds back one corner element, and XLA would slice through a concatenate and
    drop every chunk but the first (it did: 4xH200 showed c chunks c times faster). Each chunk's
    corner is added in, so all c stay live."""
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
                t = timing.device_time(lambda r, step=step: jax.jit(timing.chain(step, r)), (a, w))["median_s"]
                base = t if c == 1 else base
                rows_out.append({"rows": rows, "K": k, "N": n_cols, "chunks": c, "ms": t * 1e3,
                                 "loss": t / base - 1.0 if base else 0.0})
    return rows_out


def transfers(grid, dtype, progress) -> list[dict]:
    n = len(jax.local_devices())
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    itemsize = jnp.dtype(dtype).itemsize
    comms = heuristics.available_comms()
    out = []
    for mib in grid["shard_mib"]:
        cols = 1024
        rows = max(int(mib * 2**20 / (cols * itemsize)), n)
        x = jax.device_put(_rand((rows * n, cols), dtype), NamedSharding(mesh, P("tp", None)))
        variants = [("nccl", lambda v: jax.lax.all_gather(v, "tp", axis=0, tiled=True))]
        if "dma" in comms:
            from . import dma

            for s in (1, 2) if n > 2 else (1,):
                variants.append((f"dma_s{s}", lambda v, s=s: dma.all_gather(
                    v, "tp", schedule=Schedule(comm="dma", order="direct", copy_streams=s))))
        for name, body in variants:
            progress(f"transfer {name} shard {mib} MiB")
            make = lambda r, body=body: jax.jit(jax.shard_map(timing.chain(body, r), mesh=mesh,
                                                              in_specs=(P("tp", None),), out_specs=P("tp", None)))
            t = timing.device_time(make, (x,))["median_s"]
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
        return timing.device_time(make, (a, w, x))["median_s"] * 1e3

    progress("contention: matmul alone")
    result = {"rows": rows, "K": k, "N": n_cols, "shard_bytes": x_rows * 1024 * jnp.dtype(dtype).itemsize,
              "matmul_ms": timed(None)}
    if "dma" in heuristics.available_comms():
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
    concatenated: the probe reads one corner of the result, and XLA would slice through a
    concatenate and drop the transfers; every received shard's corner is added in instead."""
    def gather(v):
        got = [jax.lax.ppermute(v, "tp", [(i, (i + d) % n) for i in range(n)]) for d in range(1, n)]
        return v.at[0, 0].add(sum(g[0, 0] for g in got)) if got else v
    return gather


def nccl_contention(c: dict) -> tuple[float | None, str]:
    """(matmul slowdown beside NCCL transfers, how it was obtained), from the probe that ran
    concurrently: the all-gather if XLA overlapped it, else the ppermutes if those overlapped;
    (None, why) if XLA serialized both. The slowdown assumes the transfers hide under the matmul
    (t_both >= t_matmul): t_both / t_matmul - 1."""
    if c.get("matmul_ms", 0) <= 0:
        return None, "no matmul time measured"
    for both, alone, what in (("matmul_plus_nccl_ms", "nccl_alone_ms", "all-gather"),
                              ("matmul_plus_nccl_p2p_ms", "nccl_p2p_alone_ms", "ppermutes")):
        if both in c and alone in c and c[both] < 0.9 * (c["matmul_ms"] + c[alone]):
            return max(c[both] / c["matmul_ms"] - 1.0, 0.0), f"NCCL {what} beside the matmul"
    return None, "XLA ran the matmul and the NCCL transfers one after the other in both probes"


def _dma_contention(a, w, x, mesh, specs, progress, repeats: int = 4) -> dict:
    """The executor's matmuls with and without copy engines pulling every peer's x meanwhile
    (dma_probe: one custom call, so the copies really run beside the matmuls)."""
    from . import dma_probe

    def timed(pull):
        body = lambda a, w, x: dma_probe.matmuls_beside_pulls(a, w, x, "tp", repeats=repeats, pull=pull)
        make = lambda r: jax.jit(jax.shard_map(timing.chain(body, r), mesh=mesh, in_specs=specs, out_specs=specs[0]))
        return timing.device_time(make, (a, w, x))["median_s"] * 1e3 / repeats

    progress("contention: executor matmuls alone")
    alone = timed(False)
    progress("contention: executor matmuls beside copy-engine pulls")
    return {"executor_matmul_ms": alone, "executor_matmul_beside_dma_ms": timed(True), "probe_repeats": repeats}


PARTS = ("decomposition", "transfers", "contention")


def check_parts(parts) -> None:
    """ValueError unless `parts` is a non-empty selection of PARTS."""
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"characterize: parts {list(parts)}: choose among {', '.join(PARTS)}")


def run(out_dir: str, dtype: str = "bfloat16", plot: bool = False, parts=PARTS) -> dict:
    """Measure `parts` (all three by default) and write characterize.json; a part left out is an
    empty list/dict there (fit_profile then keeps the profile's values for it)."""
    check_parts(parts)
    on_cpu = jax.default_backend() == "cpu"
    grid = CPU_GRID if on_cpu else GPU_GRID
    dtype = "float32" if on_cpu else dtype
    steps = ((len(grid["kn"]) * len(grid["rows"]) * len(grid["chunks"]) if "decomposition" in parts else 0)
             + (3 * len(grid["shard_mib"]) if "transfers" in parts else 0) + (7 if "contention" in parts else 0))
    progress = progress_printer(steps)
    result = {
        "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
        "n_devices": len(jax.local_devices()), "dtype": dtype, "jax": jax.__version__, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": timing.METHOD + ("; ON CPU: NOT meaningful" if on_cpu else ""),
        "decomposition": decomposition(grid, dtype, progress) if "decomposition" in parts else [],
        "transfers": transfers(grid, dtype, progress) if "transfers" in parts else [],
        "contention": contention(dtype, progress) if "contention" in parts else {},
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "characterize.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(summary(result))
    if plot:
        plot_characterization(result, out_dir)
    return result


def fit_profile(char: dict) -> dict:
    """A cost-model profile fitted to a characterization (see cost_model's docstring)."""
    profile = cost_model.default_profile()
    profile.update(name=f"{char['device']} x{char['n_devices']}", device_kind=char["device"],
                   axis_size=char["n_devices"], calibrated=char["date"], commit=char["commit"])
    single = [r for r in char["decomposition"] if r["chunks"] == 1]
    if single:  # t = launch + 2 K N (rows + rows_half) / peak: linear in rows per (K, N)
        peaks, halves = [], []
        for k, n_cols in {(r["K"], r["N"]) for r in single}:
            pts = sorted((r["rows"], r["ms"] * 1e-3) for r in single if (r["K"], r["N"]) == (k, n_cols))
            if len(pts) < 2:
                continue
            slope, icpt = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
            peaks.append(2 * k * n_cols / slope / 1e12)
            halves.append(max((icpt - profile["gemm_launch_us"] * 1e-6) / slope, 0.0))
        if peaks:
            profile["peak_tflops"] = {**profile["peak_tflops"], char["dtype"]: float(np.median(peaks))}
            profile["rows_half"] = float(np.median(halves))
    pts = sorted((r["shard_bytes"], r["ms"] * 1e-3) for r in char["transfers"] if r["comm"] == "nccl")
    if len(pts) >= 2:
        n = char["n_devices"]
        slope, icpt = np.polyfit([(n - 1) * b for b, _ in pts], [t for _, t in pts], 1)
        profile["xla_ingress_gbps"] = float(1.0 / slope / 1e9) if slope > 0 else profile["xla_ingress_gbps"]
        profile["xla_latency_us"] = float(max(icpt, 1e-6) * 1e6)
    dma_s1 = [r for r in char["transfers"] if r["comm"] == "dma_s1"]
    if dma_s1:
        # A standalone copy-engine all-gather of a small shard is bound by the call's host work
        # (rendezvous, events), not by the copy's latency: a line through all sizes would put
        # that host cost into the per-copy latency. The bandwidth comes from the largest shard;
        # the latency and the call's costs are fitted to op times (`fit_to_ops`).
        profile["dma_ingress_gbps"] = float(max(dma_s1, key=lambda r: r["shard_bytes"])["ingress_gbps"])
        profile["dma_stream_gbps"] = profile["dma_ingress_gbps"]  # that was one copy stream
    dma_pts = [r for r in char["transfers"] if r["comm"] == "dma_s2"]
    if dma_pts:  # several copy streams share the ingress less well than one
        profile["dma_multistream_gbps"] = float(max(dma_pts, key=lambda r: r["shard_bytes"])["ingress_gbps"])
    c = char["contention"]
    if c.get("matmul_ms", 0) > 0:
        slowdown, _ = nccl_contention(c)
        if slowdown is not None:
            profile["contention_xla"] = float(slowdown)
    if c.get("executor_matmul_ms", 0) > 0:
        profile["contention_dma"] = float(max(c["executor_matmul_beside_dma_ms"] / c["executor_matmul_ms"] - 1.0, 0.0))
    return profile


#: What `fit_to_ops` searches: the costs no standalone probe isolates.
OP_FIT_GRID = {
    "executor_gemm_slowdown": (1.0, 1.04, 1.08, 1.12),
    "dma_call_us": (5.0, 15.0, 30.0, 60.0, 100.0),
    "dma_host_us": (60.0, 100.0, 150.0, 200.0, 300.0, 400.0),
    "dma_host_copy_us": (0.0, 5.0, 10.0, 20.0),
    "dma_latency_us": (8.0, 15.0, 30.0),
    "contention_dma": (0.0, 0.04, 0.08, 0.15),
}


def _schedule_of(variant: str) -> Schedule | None:
    """A recorded row's schedule: bench rows say "jax_seq" / "ficco:<schedule>", accuracy rows the
    schedule itself ("none" for JAX sequential); bounds and baselines ("gemm_alone", ...) are None."""
    if variant in ("jax_seq", "none"):
        return Schedule(comm="none")
    text = variant[len("ficco:"):] if variant.startswith("ficco:") else variant
    try:
        return Schedule.parse(text)
    except ValueError:
        return None


def recorded_op_rows(result: dict, where: str = "result"):
    """(row, schedule, n, dtype) for every verified, timed ag_matmul / matmul_rs row of a `bench` or
    `accuracy` JSON result: JAX sequential (schedule none) and every ficco schedule."""
    n = result.get("n_devices") or result.get("axis_size")
    if not n or not ("rows" in result or "cases" in result):
        raise ValueError(f"{where} is neither a bench nor an accuracy JSON (no rows/cases, n_devices/axis_size)")
    dtype = result.get("dtype", "bfloat16")
    rows = result["rows"] if "rows" in result else [r for c in result["cases"] for r in c.get("rows", [])]
    for r in rows:
        if not r.get("verified") or not r.get("median_ms") or r.get("op") not in ("ag_matmul", "matmul_rs"):
            continue
        sched = _schedule_of(r.get("variant", ""))
        if sched is not None:
            yield r, sched, n, dtype


def op_observations(bench_result: dict) -> list[tuple]:
    """[(op, schedule, local shapes, dtype, n, measured s)] from a `bench` (or `accuracy`) JSON: the
    verified times of JAX sequential (schedule none) and of every ficco schedule."""
    from .bench import local_shapes

    return [(r["op"], sched, local_shapes(r["op"], r["M"], r["K"], r["N"], n), dtype, n, r["median_ms"] * 1e-3)
            for r, sched, n, dtype in recorded_op_rows(bench_result)]


def fit_to_ops(profile: dict, observations, grid=None) -> tuple[dict, float]:
    """Grid-search the profile's op-level costs (executor GEMM slowdown, copy-engine call and host
    cost, per-copy latency, contention) to minimise the RMS log error of the predicted vs measured
    op times. Returns (profile, rms log error); the profile records what it was fitted to."""
    import itertools

    grid = grid or OP_FIT_GRID
    if not observations:
        raise ValueError("fit_to_ops: no verified op times to fit (a bench JSON with ficco and jax_seq rows)")
    keys = list(grid)
    best, best_err = None, float("inf")
    measured = np.log([o[5] for o in observations])
    for values in itertools.product(*(grid[k] for k in keys)):
        trial = {**profile, **dict(zip(keys, values))}
        pred = np.log([cost_model.predict(op, s, sh, dt, n, trial) for op, s, sh, dt, n, _ in observations])
        err = float(np.sqrt(np.mean((pred - measured) ** 2)))
        if err < best_err:
            best, best_err = trial, err
    best = dict(best)
    best["fitted_to_ops"] = {"observations": len(observations), "rms_log_error": round(best_err, 4),
                             "parameters": {k: best[k] for k in keys}}
    return best, best_err


def summary(char: dict) -> str:
    lines = [f"Characterization on {char['n_devices']} x {char['device']} ({char['dtype']}), {char['method']}",
             "decomposition loss (time of c chunk matmuls / one matmul - 1):"]
    for r in char["decomposition"]:
        if r["chunks"] > 1:
            lines.append(f"  rows={r['rows']:>6} K={r['K']:>6} N={r['N']:>6} c={r['chunks']}: {r['loss'] * 100:+6.1f}%  ({r['ms']:.3f} ms)")
    lines.append("transfers (all-gather, ingress per device):")
    for r in char["transfers"]:
        lines.append(f"  {r['comm']:>7} shard {r['shard_bytes'] / 2**20:8.2f} MiB: {r['ms']:.3f} ms  {r['ingress_gbps']:.1f} GB/s")
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


def plot_characterization(char: dict, out_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'ficco_jax[plot]'")
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
