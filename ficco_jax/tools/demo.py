"""`python -m ficco_jax demo`: what this machine can show of ficco_jax.

- Two or more devices: every schedule of ag_matmul and matmul_rs is checked against the reference
  on all local devices (one group, mesh axis "tp"), then `bench`'s timing table is printed. On CPU
  the times are host memcpy and loop times, so the table computes no speed-up from them.
- One device: overlap hides a collective behind a matmul, and a group of one device has no
  collective. The demo says so, shows that "auto" keeps the plain matmul for each op, and runs
  ficco_jax's op ("auto") next to JAX's plain dot on a layer shape, both checked against the
  reference.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..ops import measure, resolve_schedule
from ..ops.measure import op_body
from ..runtime import extension
from ..schedule import local_shapes
from . import bench
from .harness import Row, verify_then_time_each
from .report import progress_printer

OPS = ("ag_matmul", "matmul_rs")
#: The layer shape of the demo: tiny on CPU, one Llama-70B QKV projection at 8192 tokens on a GPU.
CPU_SHAPES = bench.CPU_SHAPES
GPU_SHAPES = {"llama70b_qkv_M8k": bench.ANCHOR_SHAPES["llama70b_qkv_M8k"]}


def run(out_dir: str) -> dict:
    """Print the demo of this machine's local devices; write its results under `out_dir`."""
    n = len(jax.local_devices())
    on_cpu = jax.default_backend() == "cpu"
    print(f"ficco_jax demo on {n} x {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(extension_line(jax.default_backend()))
    print(f"Results are written under {out_dir}/ ({'demo.json' if n == 1 else 'bench.json, bench.md'}); "
          f"--out DIR writes them elsewhere.")
    shapes = CPU_SHAPES if on_cpu else GPU_SHAPES
    dtype = "float32" if on_cpu else "bfloat16"
    if on_cpu:
        print(f"No GPU: running on {n} CPU device{'s' * (n > 1)}. Every variant is checked against the reference;\n"
              "times on CPU are NOT meaningful (host memcpys, no copy engines, no overlap), so no speed-up is shown.")
    if n == 1:
        return one_device(shapes, dtype, out_dir, on_cpu)
    return bench.run(list(OPS), shapes, dtype, "all", out_dir, windowed=False)


def extension_line(platform: str) -> str:
    """One line on the compiled extension: its version, and whether it has its CUDA backend (without
    it, copy-engine schedules, comm="dma", run on CPU devices only)."""
    try:
        info = extension.build_info()
    except ImportError as exc:
        return f"Extension: not loaded, so no comm='dma' schedule runs here: {exc}"
    if info.get("cuda"):
        return f"Extension: ficco_jax._ffi {info.get('version')}, CUDA backend built (copy engines on GPUs)."
    where = ("on these GPUs no comm='dma' schedule runs, only xla and none"
             if platform == "gpu" else "comm='dma' runs on CPU devices only")
    return (f"Extension: ficco_jax._ffi {info.get('version')}, CUDA backend NOT built: {where}; rebuild with "
            f"FICCO_CUDA=ON (`FICCO_CUDA=ON pip install --no-build-isolation -e .`) to be told what it lacks.")


def _body(op, variant):
    """JAX's plain dot for "dot", else the op's body under that schedule ("ref", "auto", a Schedule)."""
    if variant == "dot":
        return lambda a, w: jnp.dot(a, w)
    return op_body(op, variant)


def one_device(shapes: dict, dtype: str, out_dir: str, on_cpu: bool) -> dict:
    """The one-device demo: what "auto" resolves to, and the op next to JAX's plain dot, verified."""
    print("One device: overlap hides a collective (all-gather, reduce-scatter) behind a matmul and needs two or\n"
          "more devices in a group; with one device there is no collective, and every op is one plain matmul.\n"
          "What this device shows: schedule='auto' keeps the plain path, and gives the same result as JAX's dot.")
    mesh = Mesh(np.array(jax.local_devices()[:1]), ("tp",))
    progress = progress_printer(len(OPS) * len(shapes) * 2)
    result = bench.provenance(1, dtype)
    rows, picks = [], {}
    for op in OPS:
        for name, (M, K, N) in shapes.items():
            per_device = local_shapes(op, M, K, N, 1)
            picks[(op, name)] = str(resolve_schedule(op, "auto", per_device, dtype, 1))
            case = [(Row(op, name, M, K, N, "jax_dot"), "dot"),
                    (Row(op, name, M, K, N, "ficco:auto", selected=True, note=f"auto: {picks[(op, name)]}"), "auto")]
            verify_then_time_each(case, mesh, measure.make_inputs(op, per_device, dtype, mesh), dtype, progress,
                                  body_of=_body)
            rows += [row for row, _ in case]
    result["rows"] = [asdict(r) for r in rows]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "demo.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(one_device_table(rows, picks, on_cpu))
    print(f"Written: {os.path.join(out_dir, 'demo.json')}")
    return result


def one_device_table(rows, picks: dict, on_cpu: bool) -> str:
    """The one-device table: per (op, shape) auto's schedule, JAX dot and ficco auto times, verified."""
    lines = ["", "| op | shape (M,K,N) | auto's schedule | JAX dot ms | ficco auto ms | ficco auto / JAX dot | verified |",
             "|---|---|---|---|---|---|---|"]
    by_case = {}
    for r in rows:
        by_case.setdefault((r.op, r.shape, r.M, r.K, r.N), {})[r.variant] = r
    for (op, name, M, K, N), v in by_case.items():
        dot, auto = v["jax_dot"], v["ficco:auto"]
        ms = lambda r: "—" if r.median_ms is None else f"{r.median_ms:.3f}"  # noqa: E731
        ratio = ("n/a" if on_cpu or dot.median_ms is None or auto.median_ms is None
                 else f"{auto.median_ms / dot.median_ms:.2f}x")
        ok = "yes" if dot.verified and auto.verified else f"NO: {dot.note or auto.note}"
        lines.append(f"| {op} | {name} {M},{K},{N} | {picks[(op, name)]} | {ms(dot)} | {ms(auto)} | {ratio} | {ok} |")
    lines.append("")
    lines.append("Times: ms per op, device time; —: no time (the run failed: see verified). "
                 "auto's schedule 'none' is the plain matmul: no copy, no chunking. "
                 + ("On CPU the times are not meaningful (n/a). " if on_cpu else
                    "ficco auto / JAX dot near 1.00x: the op adds nothing over JAX's dot on one device. ")
                 + "To see overlap, run on two or more GPUs, or on virtual CPU devices: "
                   "XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m ficco_jax demo")
    return "\n".join(lines) + "\n"
