"""Fitting a machine profile for the cost model: from a characterization (`fit_profile`: matmul
rate and decomposition, transfer bandwidth and latency, contention) and from verified op times of a
`bench` or `accuracy` run (`fit_to_ops`: the op-level costs no standalone probe isolates).
`python -m ficco_jax calibrate` runs both."""
from __future__ import annotations

import itertools

import numpy as np

from ..schedule import Schedule, local_shapes
from . import cost_model


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
            if slope <= 0:  # times that fall with the rows are noise (a tiny grid on a busy host): no rate in them
                continue
            peaks.append(2 * k * n_cols / slope / 1e12)
            halves.append(max((icpt - profile["gemm_launch_us"] * 1e-6) / slope, 0.0))
        if peaks:
            profile["peak_tflops"] = {**profile["peak_tflops"], char["dtype"]: float(np.median(peaks))}
            profile["rows_half"] = float(np.median(halves))
    fp8 = fp8_peak_tflops(char.get("fp8", []))
    if fp8 is not None:
        profile["peak_tflops"] = {**profile["peak_tflops"], "float8_e4m3fn": fp8}
    pts = sorted((r["shard_bytes"], r["ms"] * 1e-3) for r in char["transfers"] if r["comm"] == "nccl")
    if len(pts) >= 2:
        n = char["n_devices"]
        slope, icpt = np.polyfit([(n - 1) * b for b, _ in pts], [t for _, t in pts], 1)
        profile["xla_ingress_gbps"] = float(1.0 / slope / 1e9) if slope > 0 else profile["xla_ingress_gbps"]
        profile["xla_latency_us"] = float(max(icpt, 1e-6) * 1e6)
        profile["collective_latency_us"] = profile["xla_latency_us"]  # the plain path's collective is that all-gather
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
        profile["xla_overlaps"] = slowdown is not None
        if slowdown is not None:
            profile["contention_xla"] = float(slowdown)
    if c.get("executor_matmul_ms", 0) > 0:
        profile["contention_dma"] = float(max(c["executor_matmul_beside_dma_ms"] / c["executor_matmul_ms"] - 1.0, 0.0))
    return profile


def fp8_peak_tflops(rows) -> float | None:
    """The FP8 matmul peak from verified executor FP8 times at two or more row counts of one
    (K, N): 2 K N / the slope of time in rows (the fixed cost drops out, as for bf16)."""
    pts = sorted((r["rows"], r["ms"] * 1e-3) for r in rows if r.get("verified") and r.get("ms"))
    if len({p[0] for p in pts}) < 2:
        return None
    slope, _ = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    k, n_cols = rows[0]["K"], rows[0]["N"]
    return float(2 * k * n_cols / slope / 1e12) if slope > 0 else None


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


#: What `fit_to_ops` searches: the costs no standalone probe isolates (then EXECUTOR_GEMM_GRID).
OP_FIT_GRID = {
    "executor_gemm_slowdown": (1.0, 1.04, 1.08, 1.12),
    "dma_call_us": (5.0, 15.0, 30.0, 60.0, 100.0),
    "dma_host_us": (60.0, 100.0, 150.0, 200.0, 300.0, 400.0),
    "dma_host_copy_us": (0.0, 5.0, 10.0, 20.0),
    "dma_latency_us": (8.0, 15.0, 30.0),
    "contention_dma": (0.0, 0.04, 0.08, 0.15),
}

#: The executor's cuBLASLt chunk matmuls, refined on a finer grid: their slowdown against XLA's
#: GEMMs and their own decomposition loss (`executor_rows_half`; XLA's `rows_half` comes from the
#: characterization). Thin chunk matmuls lose less in cuBLASLt than a line through XLA's dot times
#: says: on 2 x H100 (2026-11-27) two 512-row halves of a reduce-scatter's block took as long as
#: one 1024-row matmul.
EXECUTOR_GEMM_GRID = {
    "executor_gemm_slowdown": (1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12),
    "executor_rows_half": (0.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0),
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
        if sched is not None:  # a row of another dtype than its run's names it (bf16 beside FP8)
            yield r, sched, n, (r.get("extra") or {}).get("dtype", dtype)


def op_observations(bench_result: dict) -> list[tuple]:
    """[(op, schedule, local shapes, dtype, n, measured s)] from a `bench` (or `accuracy`) JSON: the
    verified times of JAX sequential (schedule none) and of every ficco schedule."""
    return [(r["op"], sched, local_shapes(r["op"], r["M"], r["K"], r["N"], n), dtype, n, r["median_ms"] * 1e-3)
            for r, sched, n, dtype in recorded_op_rows(bench_result)]


def fit_to_ops(profile: dict, observations, grid=None) -> tuple[dict, float]:
    """Grid-search the profile's op-level costs (executor GEMM slowdown, copy-engine call and host
    cost, per-copy latency, contention) to minimise the RMS log error of the predicted vs measured
    op times, then refine the executor's matmul costs (its slowdown and decomposition loss) on the
    finer EXECUTOR_GEMM_GRID; the two searches alternate until neither moves (at most 4 rounds), and
    the point with the lowest error any of them found is the fit. Returns (profile, rms log error);
    the profile records what it was fitted to."""
    grid = grid or OP_FIT_GRID
    if not observations:
        raise ValueError("fit_to_ops: no verified op times to fit (a bench JSON with ficco and jax_seq rows)")
    keys = [*grid, *(k for k in EXECUTOR_GEMM_GRID if k not in grid)]
    # Without its own, the executor's decomposition loss is XLA's: the same model, the key made explicit.
    current = {**profile, "executor_rows_half": profile.get("executor_rows_half", profile["rows_half"])}
    best, best_err, previous = None, float("inf"), None
    for _ in range(4):
        for search in (grid, EXECUTOR_GEMM_GRID):
            current, err = _grid_search(current, observations, search)
            if err < best_err:
                best, best_err = current, err
        point = tuple(current[k] for k in keys)
        if point == previous:
            break
        previous = point
    best = dict(best)
    best["fitted_to_ops"] = {"observations": len(observations), "rms_log_error": round(best_err, 4),
                             "parameters": {k: best[k] for k in keys}}
    return best, best_err


def _grid_search(profile: dict, observations, grid: dict) -> tuple[dict, float]:
    """The point of `grid` (every combination of its values, the rest of `profile` kept) with the
    lowest RMS log error over `observations`, and that error."""
    keys = list(grid)
    best, best_err = profile, float("inf")
    measured = np.log([o[5] for o in observations])
    for values in itertools.product(*(grid[k] for k in keys)):
        trial = {**profile, **dict(zip(keys, values))}
        pred = np.log([cost_model.predict(op, s, sh, dt, n, trial) for op, s, sh, dt, n, _ in observations])
        err = float(np.sqrt(np.mean((pred - measured) ** 2)))
        if err < best_err:
            best, best_err = trial, err
    return best, best_err
