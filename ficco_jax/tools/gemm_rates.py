"""FP8 and bf16 GEMM rates on one device: the copy-engine executor's chunk matmul (cuBLASLt) beside
JAX's own dots, so an FP8 speed-up is read against the bf16 GEMM of the same shape.

Variants of one [M, K] @ [K, N] (FP8 operands e4m3, per-tensor scales; bf16 results):

    executor_fp8      the executor's FP8 matmul (contention probe, no copies)   a8 @ w8
    executor_bf16     the same probe with bf16 operands                          ab @ wb
    jax_bf16          jnp.dot(ab, wb)
    jax_fp8           jnp.dot(a8, w8, preferred_element_type=bf16)
    jax_dequant_dot   (a8.astype(bf16) * sa) @ (w8.astype(bf16) * sw), how FP8 recipes write it

ab, wb are the FP8 values in bf16 (exact), so one f32 reference checks every variant. The probe runs
R matmuls in one FFI call; its time per matmul is (T(R2) - T(R1)) / (R2 - R1), which drops the
call's fixed cost and any layout copy of w that XLA adds around the call. Every time is
`harness.device_time` (in-jit loop differencing). `benchmarks/suites/fp8_gemm.py` prints the table;
`characterize` fits the FP8 peak from `executor_fp8_rows`.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ..lowering.dma import probe
from ..runtime import extension
from ..tuning import timing
from . import harness
from .bench import provenance

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
#: Per-device (M, K, N) of the anchor layers, the shapes the FP8 table reports.
ANCHOR_GEMMS = {"M8192_K8192_N7168": (8192, 8192, 7168), "M2048_K8192_N7168": (2048, 8192, 7168),
                "M1024_K12288_N12288": (1024, 12288, 12288), "M2048_K7168_N8192": (2048, 7168, 8192),
                "M512_K8192_N7168": (512, 8192, 7168)}
#: The anchors with every dimension / 64: the same code paths on CPU, where times mean nothing.
CPU_GEMMS = {name: tuple(d // 64 for d in mkn) for name, mkn in ANCHOR_GEMMS.items()}
#: Dequantization scales: powers of two, so the scaled f32 reference is exact.
SCALES = (0.5, 2.0 ** -6)
#: Relative error (Frobenius) a bf16 result may have against the f32 reference of its FP8 values.
TOLERANCE = 1e-2
#: Probe repeat counts (R1, R2) of the difference method.
REPEATS = (2, 6)
VARIANTS = ("executor_fp8", "executor_bf16", "jax_bf16", "jax_fp8", "jax_dequant_dot")


def operands(M: int, K: int, N: int, seed: int = 0, device=None) -> dict:
    """FP8 a, w (unit normal, e4m3), their bf16 copies, the scales and the f32 reference a @ w."""
    ka, kw = jax.random.split(jax.random.PRNGKey(seed))
    device = device or jax.local_devices()[0]
    a8 = jax.device_put(jax.random.normal(ka, (M, K), jnp.float32).astype(FP8), device)
    w8 = jax.device_put(jax.random.normal(kw, (K, N), jnp.float32).astype(FP8), device)
    want = jax.jit(lambda a, w: jnp.dot(a.astype(jnp.float32), w.astype(jnp.float32),
                                        precision=lax.Precision.HIGHEST))(a8, w8)
    scales = tuple(jax.device_put(jnp.asarray(s, BF16), device) for s in SCALES)
    return {"a8": a8, "w8": w8, "ab": a8.astype(BF16), "wb": w8.astype(BF16), "scales": scales, "want": want}


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| on the device (a host copy of an 8192 x 7168 product costs seconds)."""
    got = got.astype(jnp.float32)
    err = jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30)
    return float(err) if bool(jnp.all(jnp.isfinite(got))) else float("inf")


# ------------------------------------------------------------------------------------------------
# The bodies: step(a, *rest) -> product, as timing.chain takes them
# ------------------------------------------------------------------------------------------------
def _probe_body(repeats: int):
    """The executor's matmul `repeats` times in one call, on a one-device mesh (x: a dummy block)."""
    mesh = Mesh(np.array(jax.local_devices()[:1]), ("tp",))

    def body(a, w, x):
        return probe.matmuls_beside_pulls(a, w, x, "tp", repeats=repeats, pull=False, out_dtype=BF16)

    def make(chain_repeats: int | None):
        step = body if chain_repeats is None else timing.chain(body, chain_repeats)
        return jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
    return make


def _jax_body(variant: str):
    if variant == "jax_bf16":
        return lambda a, w: jnp.dot(a, w)
    if variant == "jax_fp8":
        return lambda a, w: jnp.dot(a, w, preferred_element_type=BF16)
    return lambda a, w, sa, sw: (a.astype(BF16) * sa) @ (w.astype(BF16) * sw)


def _args(variant: str, ops: dict) -> tuple:
    if variant in ("executor_bf16", "jax_bf16"):
        a, w = ops["ab"], ops["wb"]
    else:
        a, w = ops["a8"], ops["w8"]
    if variant.startswith("executor"):
        return a, w, jax.device_put(jnp.zeros((1, 8), BF16), ops["a8"].devices().pop())
    return (a, w, *ops["scales"]) if variant == "jax_dequant_dot" else (a, w)


def _want(variant: str, ops: dict):
    return ops["want"] * (SCALES[0] * SCALES[1]) if variant == "jax_dequant_dot" else ops["want"]


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------
#: XLA autotunes every distinct FP8 dot program (on H100 25-60 s for an 8192-row one). The check's
#: compile skips that (the same cuBLASLt FP8 rewrite, a heuristic algorithm); the timed ones are
#: JAX's defaults.
VERIFY_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def _device_ms(make, args) -> tuple[float, float]:
    """ms per op of `make(R)` by device_time, where the loops run R + 1 times: a one-trip loop
    compiles to another program than a longer one, and so would be autotuned a second time."""
    t = harness.device_time(lambda r: make(r + 1), args)
    return t["median_s"] * 1e3, t["spread_s"] * 1e3


def _compiled_once(fn, args):
    return jax.jit(fn).lower(*args).compile(compiler_options=VERIFY_COMPILER_OPTIONS)


def executor_ms(args, repeats=REPEATS) -> dict:
    """ms per executor matmul by the difference of two probe calls (R1 and R2 matmuls each); where
    the second call is not the slower (matmuls too small to tell apart), the second call's time per
    matmul instead, an upper bound, marked `upper_bound`."""
    r1, r2 = repeats
    (t1, s1), (t2, s2) = (_device_ms(lambda n, r=r: jax.jit(_probe_body(r)(n)), args) for r in (r1, r2))
    row = {"ms": (t2 - t1) / (r2 - r1), "spread_ms": (s1 + s2) / (r2 - r1), "call_ms": {str(r1): t1, str(r2): t2}}
    if row["ms"] <= 0:
        row.update(ms=t2 / r2, upper_bound=True)
    return row


def measure_variant(variant: str, ops: dict, repeats=REPEATS) -> dict:
    """One variant: verified against the f32 reference first, timed only if it agrees. A variant
    that fails (e.g. no extension) says why in its `note`, and the run goes on."""
    args = _args(variant, ops)
    row = {"variant": variant, "ms": None, "spread_ms": None, "rel_err": None, "verified": None, "note": ""}
    try:
        once = _probe_body(repeats[0])(None) if variant.startswith("executor") else _jax_body(variant)
        row["rel_err"] = rel_err(_compiled_once(once, args)(*args), _want(variant, ops))
        row["verified"] = row["rel_err"] < TOLERANCE
        if not row["verified"]:
            row["note"] = f"WRONG RESULT: rel err {row['rel_err']:.3g} >= {TOLERANCE}; not timed"
        elif variant.startswith("executor"):
            row.update(executor_ms(args, repeats))
        else:
            body = _jax_body(variant)
            row["ms"], row["spread_ms"] = _device_ms(lambda r: jax.jit(timing.chain(body, r)), args)
    except Exception as exc:  # noqa: BLE001 - the table says what broke
        row["note"] = f"error: {harness.error_line(exc)}"
    return row


def measure_shape(name: str, M: int, K: int, N: int, variants=VARIANTS, repeats=REPEATS, progress=None) -> dict:
    """Every variant of one shape, with TFLOP/s and the speed-ups the table reports."""
    ops = operands(M, K, N)
    rows = {}
    for variant in variants:
        if progress:
            progress(f"fp8 gemm {name} {variant}")
        if variant.startswith("executor") and not extension.available():
            rows[variant] = {"variant": variant, "ms": None, "verified": None,
                             "note": "skipped: ficco_jax._ffi is not built"}
            continue
        rows[variant] = measure_variant(variant, ops, repeats)
        ms = rows[variant]["ms"]
        rows[variant]["tflops"] = 2.0 * M * K * N / (ms * 1e-3) / 1e12 if ms else None
    return {"shape": name, "M": M, "K": K, "N": N, "variants": rows, "speedups": speedups(rows)}


def speedups(rows: dict) -> dict:
    """Time of the bf16 GEMM over the FP8 one's (above 1: FP8 faster); None where one is missing."""
    def ratio(slow, fast):
        s, f = (rows.get(v, {}).get("ms") for v in (slow, fast))
        return s / f if s and f else None
    return {"executor_fp8_over_executor_bf16": ratio("executor_bf16", "executor_fp8"),
            "executor_fp8_over_jax_bf16": ratio("jax_bf16", "executor_fp8"),
            "jax_fp8_over_jax_bf16": ratio("jax_bf16", "jax_fp8"),
            "jax_dequant_dot_over_jax_bf16": ratio("jax_bf16", "jax_dequant_dot")}


def executor_fp8_rows(rows_list, K: int, N: int, repeats=REPEATS, progress=None) -> list[dict]:
    """The executor's FP8 matmul time at each row count of one (K, N): what `calibrate` fits the
    FP8 peak to (a line in rows, as for bf16). Unverified rows carry their note and no time."""
    out = []
    for rows in rows_list:
        if progress:
            progress(f"fp8 rate rows={rows} K={K} N={N}")
        row = measure_variant("executor_fp8", operands(rows, K, N), repeats)
        out.append({"rows": rows, "K": K, "N": N, "ms": row["ms"], "verified": row["verified"],
                    "rel_err": row["rel_err"], "note": row["note"]})
    return out


# ------------------------------------------------------------------------------------------------
# The suite's run: every shape, JSON and table
# ------------------------------------------------------------------------------------------------
#: The FP8 speed-up over the bf16 GEMM of the same shape that the executor should reach.
TARGET_SPEEDUP = 1.6


def run(out_dir: str, shapes: dict, repeats=REPEATS, progress=None, variants=VARIANTS) -> dict:
    """Measure `variants` (default: every one) of `shapes` {name: (M, K, N)}; write fp8_gemm.json (after
    each shape, so a run stopped early keeps what it measured) and fp8_gemm.md; return the result."""
    result = {**provenance(1, "float8_e4m3fn"), "out_dtype": "bfloat16", "repeats": list(repeats),
              "tolerance": TOLERANCE, "target_speedup": TARGET_SPEEDUP, "scales": list(SCALES),
              "executor_method": "probe time per matmul (T(R2) - T(R1)) / (R2 - R1)", "shapes": []}
    result.pop("rows")
    os.makedirs(out_dir, exist_ok=True)
    for name, (M, K, N) in shapes.items():
        result["shapes"].append(measure_shape(name, M, K, N, variants, repeats, progress))
        with open(os.path.join(out_dir, "fp8_gemm.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    with open(os.path.join(out_dir, "fp8_gemm.md"), "w") as fh:
        fh.write(markdown(result))
    return result


def _cell(row: dict) -> str:
    if row.get("ms") is None:
        return "—"
    bound = "≤ " if row.get("upper_bound") else ""
    return f"{bound}{row['ms']:.3f} ({row['tflops']:.0f})" if row.get("tflops") else f"{bound}{row['ms']:.3f}"


def _x(v) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown(result: dict) -> str:
    """The table: ms per matmul (TFLOP/s) of each variant, the speed-ups, and the verification."""
    lines = [f"FP8 (e4m3 x e4m3 -> bf16) vs bf16 GEMM on 1 x {result['device']} ({result['platform']}), "
             f"jax {result['jax']}, commit {result['commit']}, {result['date']}",
             f"Method: {result['method']}; executor: {result['executor_method']}, R1,R2 = "
             f"{','.join(map(str, result['repeats']))}", "",
             "| M,K,N | executor FP8 | executor bf16 | JAX bf16 | JAX FP8 | JAX dequant→dot | "
             "exec FP8 / exec bf16 | exec FP8 / JAX bf16 | JAX FP8 / JAX bf16 | dequant→dot / JAX bf16 | "
             f">= {result['target_speedup']}x |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes, verified, checked = [], 0, 0
    for s in result["shapes"]:
        v, x = s["variants"], s["speedups"]
        pair = (x["executor_fp8_over_executor_bf16"], x["executor_fp8_over_jax_bf16"])
        target = "—" if None in pair else ("yes" if min(pair) >= result["target_speedup"] else "NO")
        lines.append(f"| {s['M']},{s['K']},{s['N']} | " + " | ".join(_cell(v.get(k, {})) for k in VARIANTS)
                     + f" | {_x(pair[0])} | {_x(pair[1])} | {_x(x['jax_fp8_over_jax_bf16'])} | "
                     f"{_x(x['jax_dequant_dot_over_jax_bf16'])} | {target} |")
        for k, row in v.items():
            checked += row.get("verified") is not None
            verified += bool(row.get("verified"))
            if row.get("note"):
                notes.append(f"- {s['shape']} {k}: {row['note']}")
    lines += ["", "Cells: ms per matmul (TFLOP/s); X / Y: the speed-up of X over Y, Y's time over X's. Target: "
              "the executor's FP8 matmul at least the target over both bf16 GEMMs of the same shape.",
              f"Verified against the f32 reference of the same FP8 values (rel err < {result['tolerance']}) "
              f"before timing: {verified}/{checked} variants."]
    if result["platform"] == "cpu":
        lines.append("ON CPU: these are host loop times of tiny shapes; they mean nothing about a GPU. "
                     "The run shows that every variant computes the right product.")
    return "\n".join(lines + notes) + "\n"
