"""Load test: a model with 160 op sites (80 layers x ag_matmul + matmul_rs) run for many steps with
asynchronous dispatch running ahead, two different jitted programs interleaved, memory sampled.

    python benchmarks/suites/load.py --steps 10000 --comm dma          # the full run (GPU)
    python benchmarks/suites/load.py --steps 300 --d-model 64          # a CPU smoke run (8 virtual devices)

The two programs (each step runs both, neither waits for the other):
  * "scan":     lax.scan over 80 stacked layers; 2 call sites executed 80 times per step, so the
                executor's per-launch occurrence counting is exercised 80 deep.
  * "unrolled": a Python loop over 80 layers; 160 distinct call sites (160 op ids) per step.
Each step feeds a program's output back as its next input and nothing blocks between samples,
so the host dispatches up to XLA's in-flight limit ahead of the devices.

Memory: host RSS (/proc/self/statm) and, where the backend reports it, each device's
`memory_stats()["bytes_in_use"]`, sampled every `--interval` steps after a block. Verdict: PASS if
after `--warmup` steps RSS grew by less than `--rss-tolerance-mib` and device bytes in use by less
than `--device-tolerance-mib` (max over devices), the results stayed finite, and one step of
each program equals its plain-JAX reference at the start and at the end. Exit status 0 on PASS.

CPU: on jax 0.10.2's CPU client (8 virtual devices, 2 cores) multi-device programs with
collectives dispatched ahead deadlock inside XLA itself: plain `lax.all_gather`/`psum_scatter`
programs hit XLA's rendezvous termination timeout ("only 7 of them arrived") and abort; ficco ops
report the same stall as a rendezvous timeout. So on CPU pass `--sync-every 1` (what
tests/test_load.py does); run-ahead is exercised on GPU. See RELIABILITY.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if "--cpu-devices" in sys.argv:  # must be set before jax is imported
    count = sys.argv[sys.argv.index("--cpu-devices") + 1]
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={count}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import ficco_jax  # noqa: E402
from ficco_jax import Schedule  # noqa: E402


@dataclasses.dataclass
class LoadConfig:
    steps: int = 10_000
    layers: int = 80
    comm: str = "dma"  # dma | xla | none | auto
    rows: int = 64  # rows per device of the activation
    d_model: int = 256
    d_ff: int = 512  # per-device ffn width is d_ff // n
    dtype: str = "bfloat16"
    programs: tuple = ("scan", "unrolled")
    interval: int = 500
    warmup: int = 200
    rss_tolerance_mib: float = 64.0
    device_tolerance_mib: float = 1.0
    devices: int = 0  # 0: every local device
    sync_every: int = 0  # block every N steps (0: only at samples; see "CPU" in the docstring)


def _schedules(comm: str):
    if comm == "auto":
        return "auto", "auto"
    if comm == "none":
        return Schedule(comm="none"), Schedule(comm="none")
    if comm == "xla":
        return Schedule.parse("xla/ring/c2"), Schedule.parse("xla/ring/c2")
    return Schedule.parse("dma/direct/c2"), Schedule.parse("dma/direct/c2")


def _layer(ag, rs, x, w_up, w_down):
    h = ag(x, w_up)
    return x + rs(jnp.tanh(h), w_down)


def build(cfg: LoadConfig, mesh: Mesh):
    """{name: (ours, reference)} jitted step functions, and the initial arguments."""
    n = mesh.shape["tp"]
    s_ag, s_rs = _schedules(cfg.comm)
    ours = (lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=s_ag),
            lambda y, w: ficco_jax.matmul_rs(y, w, "tp", schedule=s_rs))
    ref = (lambda x, w: ficco_jax.ag_matmul_ref(x, w, "tp"), lambda y, w: ficco_jax.matmul_rs_ref(y, w, "tp"))

    def scan_body(ops):
        def body(x, w_up, w_down):
            step = lambda h, ws: (_layer(*ops, h, ws[0], ws[1]), None)
            return jax.lax.scan(step, x, (w_up, w_down))[0]
        return body

    def unrolled_body(ops):
        def body(x, w_up, w_down):
            for layer in range(cfg.layers):
                x = _layer(*ops, x, w_up[layer], w_down[layer])
            return x
        return body

    specs = (P("tp", None), P(None, None, "tp"), P(None, "tp", None))
    make = lambda body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp", None)),
                                donate_argnums=(0,))
    make_ref = lambda body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp", None)))
    builders = {"scan": scan_body, "unrolled": unrolled_body}
    programs = {name: (make(builders[name](ours)), make_ref(builders[name](ref))) for name in cfg.programs}

    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    dtype = jnp.dtype(cfg.dtype)
    # Small weights keep 80 residual layers bounded: |x| grows by at most ~1 per layer.
    scale_up, scale_down = 1 / np.sqrt(cfg.d_model), 1 / (cfg.d_ff * cfg.layers)
    w_up = (jax.random.normal(k1, (cfg.layers, cfg.d_model, cfg.d_ff)) * scale_up).astype(dtype)
    w_down = (jax.random.normal(k2, (cfg.layers, cfg.d_ff, cfg.d_model)) * scale_down).astype(dtype)
    x = jax.random.normal(k3, (n * cfg.rows, cfg.d_model)).astype(dtype)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    return programs, put(x, specs[0]), put(w_up, specs[1]), put(w_down, specs[2])


def host_rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def device_mib(devices) -> list | None:
    values = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_in_use" not in stats:
            return None
        values.append(stats["bytes_in_use"] / 2**20)
    return values


def _max_rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _check_one_step(programs, states, weights, tol) -> dict:
    diffs = {}
    for name, (ours, ref) in programs.items():
        x = jnp.copy(states[name])  # ours donates its input
        diffs[name] = _max_rel_diff(ours(x, *weights), ref(states[name], *weights))
        assert diffs[name] < tol, f"{name}: one step differs from the reference by {diffs[name]:.3g}"
    return diffs


def run(cfg: LoadConfig, log=print) -> dict:
    devices = jax.devices()[: cfg.devices or None]
    mesh = Mesh(np.array(devices), ("tp",))
    t0 = time.monotonic()
    programs, x0, w_up, w_down = build(cfg, mesh)
    weights = (w_up, w_down)
    tol = 2e-2 if cfg.dtype in ("bfloat16", "float16") else 1e-4
    states = {name: jnp.copy(x0) for name in programs}
    start_diffs = _check_one_step(programs, states, weights, tol)  # also compiles everything
    compile_s = time.monotonic() - t0
    log(f"load_test: {len(devices)} x {devices[0].device_kind}, comm={cfg.comm}, programs={list(programs)}, "
        f"sync every {cfg.sync_every or 'sample'} steps, "
        f"{cfg.layers} layers ({2 * cfg.layers} op sites each), x [{cfg.rows}, {cfg.d_model}] per device "
        f"{cfg.dtype}; built and checked in {compile_s:.1f} s")

    samples = []
    t_start = time.monotonic()
    for step in range(1, cfg.steps + 1):
        for name, (ours, _) in programs.items():
            states[name] = ours(states[name], *weights)  # no block: dispatch runs ahead
        if cfg.sync_every and step % cfg.sync_every == 0:
            jax.block_until_ready(states)
        if step % cfg.interval == 0 or step == cfg.warmup or step == cfg.steps:
            jax.block_until_ready(states)
            sample = dict(step=step, seconds=round(time.monotonic() - t_start, 3), rss_mib=round(host_rss_mib(), 2),
                          device_mib=device_mib(devices))
            samples.append(sample)
            dev = "n/a" if sample["device_mib"] is None else f"{max(sample['device_mib']):.2f} (max over devices)"
            log(f"  step {step:6d}  {sample['seconds']:8.1f} s  host RSS {sample['rss_mib']:9.2f} MiB  "
                f"device bytes_in_use MiB {dev}")
    elapsed = time.monotonic() - t_start

    finite = all(bool(jnp.all(jnp.isfinite(s.astype(jnp.float32)))) for s in states.values())
    end_diffs = _check_one_step(programs, states, weights, tol) if finite else {}
    after = [s for s in samples if s["step"] >= min(cfg.warmup, cfg.steps)]
    rss_growth = after[-1]["rss_mib"] - after[0]["rss_mib"]
    rss_peak_growth = max(s["rss_mib"] for s in after) - after[0]["rss_mib"]
    dev_growth = None
    if after[0]["device_mib"] is not None:
        dev_growth = max(b - a for a, b in zip(after[0]["device_mib"], after[-1]["device_mib"]))
    ok = (finite and rss_growth < cfg.rss_tolerance_mib
          and (dev_growth is None or dev_growth < cfg.device_tolerance_mib))
    result = dict(
        config=dataclasses.asdict(cfg), device=f"{len(devices)} x {devices[0].device_kind}",
        platform=devices[0].platform, compile_and_check_s=round(compile_s, 2), run_s=round(elapsed, 2),
        steps_per_s=round(cfg.steps / elapsed, 2),
        op_calls=cfg.steps * len(programs) * 2 * cfg.layers, samples=samples,
        rss_growth_after_warmup_mib=round(rss_growth, 2), rss_peak_growth_after_warmup_mib=round(rss_peak_growth, 2),
        device_growth_after_warmup_mib=None if dev_growth is None else round(dev_growth, 3),
        finite=finite, reference_diff_start=start_diffs, reference_diff_end=end_diffs,
        verdict="PASS" if ok else "FAIL",
    )
    log(f"load_test: {result['op_calls']} op calls in {elapsed:.1f} s ({result['steps_per_s']} steps/s); "
        f"after step {after[0]['step']}: host RSS {rss_growth:+.2f} MiB (peak {rss_peak_growth:+.2f}, "
        f"tolerance {cfg.rss_tolerance_mib}), device "
        f"{'n/a' if dev_growth is None else f'{dev_growth:+.3f} MiB (tolerance {cfg.device_tolerance_mib})'}; "
        f"finite {finite}; reference diff start {start_diffs} end {end_diffs}")
    log(f"load_test: {result['verdict']}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = LoadConfig()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--comm", choices=("dma", "xla", "none", "auto"), default=defaults.comm)
    parser.add_argument("--rows", type=int, default=defaults.rows, help="activation rows per device")
    parser.add_argument("--d-model", type=int, default=defaults.d_model)
    parser.add_argument("--d-ff", type=int, default=defaults.d_ff)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--programs", default=",".join(defaults.programs), help="scan,unrolled (interleaved)")
    parser.add_argument("--interval", type=int, default=defaults.interval, help="steps between memory samples")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="steps before the memory baseline")
    parser.add_argument("--rss-tolerance-mib", type=float, default=defaults.rss_tolerance_mib)
    parser.add_argument("--device-tolerance-mib", type=float, default=defaults.device_tolerance_mib)
    parser.add_argument("--sync-every", type=int, default=0, help="block every N steps (CPU: 1)")
    parser.add_argument("--devices", type=int, default=0, help="size of the tp axis (default: every local device)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="virtual CPU devices (set before jax starts)")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    cfg = LoadConfig(steps=args.steps, layers=args.layers, comm=args.comm, rows=args.rows, d_model=args.d_model,
                     d_ff=args.d_ff, dtype=args.dtype, programs=tuple(args.programs.split(",")),
                     interval=args.interval, warmup=args.warmup, rss_tolerance_mib=args.rss_tolerance_mib,
                     device_tolerance_mib=args.device_tolerance_mib, devices=args.devices,
                     sync_every=args.sync_every)
    result = run(cfg)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
