"""The suites of `benchmarks/run.py`: what each one runs, on which machine, and for how long.

A suite is a list of steps (commands run from the repository root, one after another, each with
its output in a log under the suite's out dir). `benchmarks/README.md` says the same in prose;
`python benchmarks/run.py --list` prints this table.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
from typing import Callable

SUITES_DIR = "benchmarks/suites"
PEERS_DIR = "benchmarks/peers"


@dataclasses.dataclass(frozen=True)
class Context:
    """What a suite's steps are built from."""
    python: str          # the interpreter every step runs (/opt/torch/.venv's where present)
    out: str             # this suite's out dir
    gpus: int            # GPUs found (0: a CPU-only run on 8 virtual CPU devices)
    limit_s: int         # this suite's time limit (steps that take a budget get a bit less)
    options: tuple = ()  # what followed `--` on the command line (suites that take options)


@dataclasses.dataclass(frozen=True)
class Step:
    label: str
    argv: list | None          # None: nothing to run, `note` says why
    env: dict = dataclasses.field(default_factory=dict)
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    what: str
    machine: str     # in words, for --list and the README
    min_gpus: int    # 0: also runs on a CPU-only machine
    limit_s: int     # default time limit
    steps: Callable[[Context], list]
    #: The summary's result: a regular expression (the last matching log line), or a function of the
    #: suite's out dir returning the line.
    result: str | Callable[[str], str] = ""
    takes_options: bool = False


def _py(ctx: Context, *args) -> list:
    return [ctx.python, *[str(a) for a in args]]


def _build(ctx):
    flag = "ON" if ctx.gpus else "AUTO"
    info = ("import json, os; from ficco_jax.runtime import extension; info = extension.build_info(); "
            "print(json.dumps(info)); json.dump(info, open(os.path.join(os.environ['OUT'], 'build_info.json'), 'w'))")
    return [Step("install", _py(ctx, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", "."),
                 env={"FICCO_CUDA": flag}),
            Step("build_info", _py(ctx, "-c", info))]


CPU_SIDE_TESTS = ["tests/test_benchmarks_entry.py", "tests/test_gpu_faults_script.py",
                  "tests/test_a2a_vs_nccl_script.py", "tests/test_mp_gpu_script.py", "tests/test_probe.py",
                  "tests/test_hang_suite.py", "tests/test_step_timeline.py"]


def _tests(ctx):
    cpu_env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    return [Step("gpu_tests", _py(ctx, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", *ctx.options)),
            Step("script_tests", _py(ctx, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CPU_SIDE_TESTS),
                 env=cpu_env)]


def _demo(ctx):
    return [Step("demo", _py(ctx, "-m", "ficco_jax", "demo", "--out", ctx.out, *ctx.options))]


#: Seconds a bench case may still take once started: the slowest seen is an FP8 anchor's first run,
#: whose JAX sequential program autotunes XLA's FP8 dot (2 x H200, 2026-11-28: that step took 25-92 s
#: of an FP8 case's 31-101 s), with some room to spare.
BENCH_CASE_S = 120


def _bench(ctx):
    """`bench` (options after --), started cases ending within the suite's limit: no case starts in its
    last BENCH_CASE_S seconds; the bench's table names the cases left and how `--resume` adds them."""
    extra = list(ctx.options) or ([] if ctx.gpus else ["--no-windowed"])
    if "--budget-s" not in extra:
        extra += ["--budget-s", max(30, ctx.limit_s - BENCH_CASE_S)]
    return [Step("bench", _py(ctx, "-m", "ficco_jax", "bench", "--out", ctx.out, *extra))]


#: Seconds `compare` keeps after bench's last case for bench's start-up and its peers: PyTorch took
#: 14-20 s and XLA's windowed einsum 37-45 s on 2 x H200 (2026-11-28).
COMPARE_PEERS_S = 100


def _compare(ctx):
    """bench on the anchors (2 interleaved rounds, no windowed child: XLA's windowed einsum is the
    peer below), PyTorch sequential and async-TP, XLA's windowed einsum; run.py then prints their one
    table (peers/tp_table.py). Every file lands in the suite's out dir; an earlier run's are removed
    first, so the table and the result line hold this run's alone. A limit too short for the peers
    after a useful bench leaves them out, saying so."""
    for name in ("bench", "torch_tp", "jax_tp_windowed"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(ctx.out, f"{name}.json"))
    budget = ctx.limit_s - BENCH_CASE_S - COMPARE_PEERS_S
    peers = ctx.gpus >= 2 and budget >= 30
    budget = budget if peers else max(30, ctx.limit_s - BENCH_CASE_S)
    steps = [Step("bench", _py(ctx, "-m", "ficco_jax", "bench", "--out", ctx.out, "--rounds", 2, "--no-windowed",
                               "--budget-s", budget, *ctx.options))]
    if peers:
        steps += [Step("torch_tp", _py(ctx, "-m", "torch.distributed.run", f"--nproc-per-node={ctx.gpus}",
                                       f"{PEERS_DIR}/torch_tp.py", "--out", ctx.out)),
                  Step("jax_tp_windowed", _py(ctx, f"{PEERS_DIR}/jax_tp.py", "--windowed", "--out", ctx.out))]
    elif ctx.gpus >= 2:
        steps.append(Step("peers", None, note=f"the suite's {ctx.limit_s} s limit leaves no time for the peers "
                                              f"(they need {BENCH_CASE_S + COMPARE_PEERS_S + 30} s or more): skipped"))
    else:
        steps.append(Step("peers", None, note="PyTorch async-TP and XLA's windowed einsum need 2 or more GPUs: skipped"))
    return steps


def _compare_result(out: str) -> str:
    """In how many cases `auto` was the fastest of the table's timed columns (and in how many more within
    its spread of the fastest), and which peers ran."""
    from peers import tp_table  # noqa: PLC0415 - benchmarks/ is on run.py's path, not a package

    bench, *peers = tp_table.from_dirs(out, out)
    if bench is None:
        raise OSError("bench wrote no bench.json")
    rows = tp_table.rows(bench, *peers)
    ran = ", ".join(name for name, data in zip(tp_table.PEERS, peers) if data and "skipped" not in data) or "none"
    if not tp_table.meaningful(bench):
        return f"{len(rows)} cases on CPU (times meaningless); peers: {ran}"
    fastest, close = sum(r["auto_fastest"] for r in rows), sum(r["auto_within_spread"] for r in rows)
    return (f"auto the fastest in {fastest} of {len(rows)} cases, within its spread of the fastest in {close} "
            f"more; peers: {ran}")


def _peers(ctx):
    budget = max(30, ctx.limit_s // 6)
    steps = []
    if ctx.gpus >= 2:
        steps.append(Step("torch_tp", _py(ctx, "-m", "torch.distributed.run", f"--nproc-per-node={ctx.gpus}",
                                          f"{PEERS_DIR}/torch_tp.py", "--out", ctx.out, *ctx.options)))
    else:
        steps.append(Step("torch_tp", None, note="PyTorch async-TP needs 2 or more GPUs: skipped"))
    steps.append(Step("jax_tp", _py(ctx, f"{PEERS_DIR}/jax_tp.py", "--out", ctx.out, *ctx.options)))
    if ctx.gpus >= 2:
        steps.append(Step("jax_tp_windowed", _py(ctx, f"{PEERS_DIR}/jax_tp.py", "--windowed", "--out", ctx.out,
                                                 *ctx.options)))
    for collective in ("all_to_all", "all_gather", "reduce_scatter"):
        steps.append(Step(f"{collective}_vs_nccl", _py(ctx, f"{PEERS_DIR}/collectives_vs_nccl.py", "--collective",
                                                       collective, "--budget-s", budget, "--out", ctx.out)))
    return steps


def _peers_result(out: str) -> str:
    """Which peers ran (rows measured) and which were skipped."""
    parts = []
    for name in ("torch_tp", "jax_tp", "jax_tp_windowed", "a2a_vs_nccl", "all_gather_vs_nccl",
                 "reduce_scatter_vs_nccl"):
        path = os.path.join(out, f"{name}.json")
        if not os.path.isfile(path):
            continue
        with open(path) as fh:
            data = json.load(fh)
        rows = data.get("rows", data.get("a2a"))
        skipped = isinstance(data.get("skipped"), str)  # a peer that could not run says why
        parts.append(f"{name} skipped" if skipped else f"{name} {len(rows or [])} rows")
    return "; ".join(parts) or "no peer wrote a result"


#: The block sizes per peer (MiB) and the schedules of the `collectives` suite: from 256 KiB, on the
#: default (pull) schedule and on a symmetric one, which meets no peer on the host per call.
COLLECTIVE_SIZES_GPU, COLLECTIVE_SIZES_CPU = "0.25,1,4,16", "0.015625,0.0625"
COLLECTIVE_SCHEDULES = "default,dma/direct/c1/symmetric"


#: XLA puts a run of command-buffer compatible thunks into a command buffer from 5 of them on; the timing
#: loop's body (one call and a corner update) holds fewer, so without this its symmetric call would run
#: uncaptured, unlike one among a model step's fusions and matmuls. NCCL's collectives and the pulled calls, which XLA
#: does not capture, are unchanged by it. On one H200 (2026-12-03) a symmetric all_gather of 256 KiB took
#: 36 us per iteration without it and 9 us with it.
CAPTURE_SMALL_BODIES = "--xla_gpu_graph_min_graph_size=1"


def _collectives(ctx):
    """collectives_vs_nccl.py for each collective at small blocks, then collectives_fit.py on them."""
    sizes = COLLECTIVE_SIZES_GPU if ctx.gpus else COLLECTIVE_SIZES_CPU
    budget = max(30, (ctx.limit_s - 30) // 3)
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {CAPTURE_SMALL_BODIES}".strip()} if ctx.gpus else {}
    steps = [Step(f"{c}_vs_nccl", _py(ctx, f"{PEERS_DIR}/collectives_vs_nccl.py", "--collective", c, "--sizes", sizes,
                                      "--schedules", COLLECTIVE_SCHEDULES, "--overlap-sizes", "", "--budget-s", budget,
                                      "--out", ctx.out), env=env)
             for c in ("all_gather", "reduce_scatter", "all_to_all")]
    return steps + [Step("collectives_fit", _py(ctx, f"{PEERS_DIR}/collectives_fit.py", ctx.out))]


def _collectives_result(out: str) -> str:
    """dma/NCCL at 1 MiB per peer (else the smallest size measured) per collective, the default schedule's
    then the others', and the threshold proposed."""
    with open(os.path.join(out, "collectives_fit.json")) as fh:
        fit = json.load(fh)
    by_collective = {}
    for e in fit["entries"]:
        ratios = {float(k): v for k, v in e["over_nccl"].items()}
        if ratios:
            size = 1.0 if 1.0 in ratios else min(ratios)
            by_collective.setdefault(f"{e['collective']} at {size:g} MiB", []).append(f"{ratios[size]:.2f}")
    p = fit["proposal"]
    parts = [f"{what} {' / '.join(r)}" for what, r in by_collective.items()]
    return ("dma/NCCL (c1 pull / c1 symmetric): " + "; ".join(parts)
            + f"; min bytes {p['min_bytes'] or 'none'}")


def _accuracy(ctx):
    extra = list(ctx.options) or ["--top", "1"]
    return [Step("accuracy", _py(ctx, "-m", "ficco_jax", "accuracy", "--budget-s", max(30, ctx.limit_s - 60),
                                 "--out", ctx.out, *extra))]


def _e2e(ctx):
    example = ["--preset", "llama70b-layer"] if ctx.gpus else ["--preset", "tiny"]
    mlp = [] if ctx.gpus else ["512", "256", "512"]
    return [Step("tp_transformer", _py(ctx, "examples/tp_transformer.py", *example, "--compare")),
            Step("mlp_overlap", _py(ctx, f"{SUITES_DIR}/mlp_overlap.py", *mlp))]


def _hang(ctx):
    """The flagship example (GPUs: the Llama-70B layer with cuDNN attention; CPU: the tiny preset) run
    after run under a watchdog, CUDA_DEVICE_MAX_CONNECTIONS unset, 1 and 32 in turn."""
    if ctx.options:
        return [Step("hang", _py(ctx, f"{SUITES_DIR}/hang.py", "--out", ctx.out, *ctx.options))]
    # On GPUs every run compiles, as separate jobs do: runs sharing a compilation cache never got
    # stuck where fresh ones did (RELIABILITY.md, "Long runs on 2 × H100 and 2 × H200").
    runs = ["--no-cache", "--runs", "9", "--steps", "40", "--budget-s", max(60, ctx.limit_s - 150)] if ctx.gpus else \
        ["--runs", "3", "--steps", "4", "--start-s", "120", "--stall-s", "60"]
    example = ["--preset", "llama70b-layer", "--attention", "cudnn"] if ctx.gpus else ["--preset", "tiny"]
    return [Step("hang", _py(ctx, f"{SUITES_DIR}/hang.py", "--out", ctx.out, *runs, "--", *example))]


def _faults(ctx):
    return [Step("faults", _py(ctx, f"{SUITES_DIR}/faults.py", "--budget-s", max(20, ctx.limit_s - 30),
                               "--out", ctx.out, *ctx.options))]


def _soak(ctx):
    return [Step("soak", _py(ctx, f"{SUITES_DIR}/soak.py", "--budget-s", max(30, ctx.limit_s // 2),
                             "--out", ctx.out, *ctx.options))]


def _load(ctx):
    if ctx.gpus:
        base = ["--steps", "600", "--comm", "dma", "--interval", "100", "--warmup", "100"]
    else:  # CPU: collectives dispatched ahead stall XLA's CPU client, so block every step
        base = ["--steps", "200", "--comm", "dma", "--layers", "8", "--d-model", "64", "--d-ff", "128",
                "--interval", "40", "--warmup", "80", "--sync-every", "1"]
    return [Step("load", _py(ctx, f"{SUITES_DIR}/load.py", *base, "--json", os.path.join(ctx.out, "load.json"),
                             *ctx.options))]


def _multiprocess(ctx):
    env = {"FICCO_MP_BUDGET_S": str(max(60, ctx.limit_s - 20))}
    if ctx.gpus:
        env["FICCO_MP_NPROC"] = str(ctx.gpus)
    return [Step("launch", ["bash", f"{SUITES_DIR}/multiprocess_launch.sh", *([] if ctx.gpus else ["--cpu"])],
                 env=env)]


def _characterize(ctx):
    return [Step("characterize", _py(ctx, "-m", "ficco_jax", "characterize", "--out", ctx.out, *ctx.options))]


def _fp8(ctx):
    return [Step("fp8_gemm", _py(ctx, f"{SUITES_DIR}/fp8_gemm.py", "--out", ctx.out, *ctx.options))]


def _fp8_result(out: str) -> str:
    """The executor's FP8 speed-up over the bf16 GEMMs (lowest and highest over the shapes) and the
    verification count, from fp8_gemm.json."""
    with open(os.path.join(out, "fp8_gemm.json")) as fh:
        data = json.load(fh)
    pairs = [(x["executor_fp8_over_executor_bf16"], x["executor_fp8_over_jax_bf16"])
             for x in (s["speedups"] for s in data["shapes"])]
    over = [min(pair) for pair in pairs if None not in pair]
    rows = [r for s in data["shapes"] for r in s["variants"].values() if r.get("verified") is not None]
    span = f"executor FP8 over bf16 {min(over):.2f}x-{max(over):.2f}x" if over else "no executor FP8 speed-up"
    return f"{span} over {len(data['shapes'])} shapes; verified {sum(bool(r['verified']) for r in rows)}/{len(rows)}"


def nsys_path() -> str | None:
    found = shutil.which("nsys")
    if found:
        return found
    for root in ("/usr/local/cuda/bin", *sorted(glob.glob("/opt/nvidia/nsight-systems/*/bin"))):
        if os.path.isfile(os.path.join(root, "nsys")):
            return os.path.join(root, "nsys")
    return None


def _trace(ctx):
    what = list(ctx.options) or (["ag_matmul", "dma/direct/c1", "8192", "8192", "10240", "20"] if ctx.gpus
                                 else ["ag_matmul", "dma/direct/c2", "64", "32", "64", "2"])
    name = "trace_" + "_".join(what[:2]).replace("/", "_")
    where = os.path.join(ctx.out, name)
    nsys = nsys_path() if ctx.gpus else None
    if nsys is None:  # JAX's profiler (CUPTI on GPUs): the route where the machine has no nsys
        return [Step("record", _py(ctx, f"{SUITES_DIR}/trace_op.py", *what, "--jax-profiler", where)),
                Step("timeline", _py(ctx, f"{SUITES_DIR}/perfetto_timeline.py", where, "--count", "40"))]
    return [Step("record", [nsys, "profile", "-t", "cuda", "-o", where, "--force-overwrite", "true",
                            ctx.python, f"{SUITES_DIR}/trace_op.py", *what]),
            Step("export", [nsys, "stats", "--report", "cuda_gpu_trace", "--format", "csv", "--output", where,
                            f"{where}.nsys-rep"]),
            Step("timeline", _py(ctx, f"{SUITES_DIR}/nsys_timeline.py", f"{where}_cuda_gpu_trace.csv", "0", "0", "40")),
            Step("cleanup", ["rm", "-f", f"{where}.nsys-rep", f"{where}.sqlite"])]  # large; the CSV holds the events


def _timeline(ctx):
    """Training steps of the flagship example traced with and without overlap (GPUs: the Llama-70B
    layer with cuDNN attention in the shard_map view; CPU: the tiny preset, host step times only)."""
    example = list(ctx.options) or (["--preset", "llama70b-layer", "--attention", "cudnn"] if ctx.gpus
                                    else ["--preset", "tiny"])
    return [Step("step_timeline", _py(ctx, f"{SUITES_DIR}/step_timeline.py", "--out", ctx.out, "--", *example))]


def _timeline_result(out: str) -> str:
    """The verdict of step_timeline.json: each mode's hidden share of its communication."""
    with open(os.path.join(out, "step_timeline.json")) as fh:
        return json.load(fh)["verdict"]


#: (op, schedule, M, K, N) of the host suite on GPUs: small calls, whose time is their host work.
HOST_CASES_GPU = (("matmul_rs", "dma/direct/c2", 1024, 1024, 1024), ("matmul_rs", "dma/direct/c1", 2048, 4096, 4096),
                  ("ag_matmul", "dma/direct/c1", 512, 1024, 1024))
HOST_CASES_CPU = (("matmul_rs", "dma/direct/c2", 64, 32, 64), ("ag_matmul", "dma/direct/c1", 64, 32, 64))
#: The group channel's limit the host suite turns on (config.CHANNEL_BYTES; off by default).
HOST_CHANNEL_BYTES = 8 << 20


def _host_file(out: str, case, path: str) -> str:
    op, schedule, m, k, n = case
    return os.path.join(out, f"host_time_{op}_{schedule.replace('/', '_')}_{m}x{k}x{n}_{path}.json")


def _host(ctx):
    """host_time.py for each case with host meetings and on the group's channel, one after the other."""
    cases = HOST_CASES_GPU if ctx.gpus else HOST_CASES_CPU
    loop = ["--iters", "40", "--launches", "20"] if ctx.gpus else ["--iters", "4", "--launches", "2"]
    steps = []
    for case in cases:
        for path, channel_bytes in (("meetings", 0), ("channel", HOST_CHANNEL_BYTES)):
            argv = _py(ctx, f"{SUITES_DIR}/host_time.py", *case, *loop, "--out", _host_file(ctx.out, case, path))
            steps.append(Step(f"{case[0]}_{case[1].replace('/', '_')}_{path}", argv,
                              env={"FICCO_CHANNEL_BYTES": str(channel_bytes)}))
    return steps


def _host_result(out: str) -> str:
    """Each case's loop wall time per call with meetings and on the channel, from host_time's JSONs."""
    parts = []
    for case in HOST_CASES_GPU + HOST_CASES_CPU:
        times = []
        for path in ("meetings", "channel"):
            name = _host_file(out, case, path)
            if os.path.isfile(name):
                with open(name) as fh:
                    times.append(json.load(fh)["wall_us"])
        if len(times) == 2:
            parts.append(f"{case[0]} {case[1].split('/', 1)[1]} {case[2]},{case[3]},{case[4]}: "
                         f"{times[0]:.1f} us per call meeting, {times[1]:.1f} on the channel")
    return "; ".join(parts) or "no host_time result"


#: (pair, bytes per block) of the capture suite: small blocks, whose calls cost their fixed cost.
CAPTURE_CASES_GPU = (("collectives", 1 << 20), ("collectives", 64 << 10), ("matmuls", 1 << 20))
CAPTURE_CASES_CPU = (("collectives", 8 << 10), ("matmuls", 8 << 10))


def _capture(ctx):
    """capture_cost.py for each case, XLA's command buffers as they are (on: symmetric calls are
    captured), then the symmetric schedule once more with them off (XLA_FLAGS
    --xla_gpu_enable_command_buffer=), to show what the capture saves."""
    loop = ["--calls", "32", "--launches", "20"] if ctx.gpus else ["--calls", "4", "--launches", "2"]
    steps = []
    for pair, nbytes in CAPTURE_CASES_GPU if ctx.gpus else CAPTURE_CASES_CPU:
        name = f"capture_{pair}_{nbytes}"
        common = ["--pair", pair, "--bytes", str(nbytes), *loop]
        steps.append(Step(name, _py(ctx, f"{SUITES_DIR}/capture_cost.py", *common,
                                    "--out", os.path.join(ctx.out, f"{name}.json"))))
        if ctx.gpus:
            steps.append(Step(f"{name}_no_command_buffers",
                              _py(ctx, f"{SUITES_DIR}/capture_cost.py", *common, "--schedules", "dma/direct/c1/symmetric",
                                  "--out", os.path.join(ctx.out, f"{name}_no_command_buffers.json")),
                              env={"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}))
    return steps


def _capture_result(out: str) -> str:
    """Microseconds per call of each schedule, per case, from capture_cost's JSONs."""
    parts = []
    for pair, nbytes in CAPTURE_CASES_GPU + CAPTURE_CASES_CPU:
        rows = []
        for suffix in ("", "_no_command_buffers"):
            name = os.path.join(out, f"capture_{pair}_{nbytes}{suffix}.json")
            if os.path.isfile(name):
                with open(name) as fh:
                    rows += [(r["schedule"] + (" (no command buffers)" if suffix else ""), r["us_per_call"])
                             for r in json.load(fh)]
        if rows:
            parts.append(f"{pair} {nbytes >> 10} KiB: " + ", ".join(f"{s} {us:.1f} us" for s, us in rows))
    return "; ".join(parts) or "no capture_cost result"


SUITES = {s.name: s for s in [
    Suite("build", "editable install with the CUDA backend (FICCO_CUDA=ON on GPUs) and the extension's build info",
          "any (CUDA toolkit on GPUs)", 0, 600, _build, r"\{.*\}"),
    # On 2 x H100 (2026-11-27) tests/gpu ran 188 of its 198 tests in 390 s, and the CPU tests of the
    # scripts take 1-2 min: the limit is one command's whole 10 minutes.
    Suite("tests", "pytest tests/gpu (skips without GPUs) and the CPU tests of the benchmark scripts",
          "any; tests/gpu need 2+ GPUs", 0, 600, _tests, r"(passed|failed|error|skipped)", takes_options=True),
    Suite("demo", "every schedule checked on all local devices, then a timing table (python -m ficco_jax demo)",
          "any", 0, 420, _demo, takes_options=True),
    Suite("bench", "ficco_jax vs JAX sequential, ring, windowed einsum and the bound (python -m ficco_jax bench)",
          "any; 2+ GPUs for real numbers", 0, 480, _bench, takes_options=True),
    Suite("peers", "PyTorch async-TP and sequential, JAX seq / ring / XLA (windowed einsum), collectives vs NCCL",
          "2+ GPUs (CPU: the JAX peers at a tiny shape)", 0, 540, _peers, _peers_result, takes_options=True),
    # On 2 x H200 (2026-11-28, 4223bb0) bench --rounds 2 took 350 s over the ten anchor cases (its budget,
    # 340 s, is this limit's), the peers 75 s: 443 s in all.
    Suite("compare", "one table of the anchors: ficco_jax's auto, JAX seq, the ideal, PyTorch seq and async-TP, "
          "XLA's windowed einsum (bench --rounds 2, the peers, peers/tp_table.py)",
          "2+ GPUs (CPU: bench at a tiny shape, the peers skipped)", 0, 560, _compare, _compare_result,
          takes_options=True),
    Suite("collectives", "copy-engine all_gather, reduce_scatter and all_to_all vs NCCL from 256 KiB per peer, "
          "pull and symmetric: dma/NCCL per size, fixed cost and rate fitted, DMA_COLLECTIVE_MIN_BYTES proposed",
          "2+ GPUs (CPU: tiny blocks)", 0, 420, _collectives, _collectives_result),
    Suite("accuracy", "held-out check of schedule='auto': its pick vs the best measured vs JAX sequential",
          "2+ GPUs", 2, 600, _accuracy, takes_options=True),
    Suite("e2e", "a Llama-70B layer with and without overlap (examples/tp_transformer.py --compare) and an MLP "
          "forward+backward", "2+ GPUs (CPU: tiny sizes)", 0, 420, _e2e, r"speedup"),
    Suite("hang", "the flagship example run after run under a watchdog (CUDA_DEVICE_MAX_CONNECTIONS unset, 1, 32 "
          "in turn): runs completed / hung / failed", "any; 2+ GPUs for the Llama-70B layer", 0, 560, _hang,
          r"^hang: \d+/\d+ completed", takes_options=True),
    Suite("faults", "fault injection on the rendezvous: errors name the rank, arrive in time, next call works",
          "any", 0, 180, _faults, r"Overall: \w+", takes_options=True),
    Suite("soak", "every dma schedule on the anchor shapes, then 2000 back-to-back calls: same result, flat memory",
          "2+ GPUs", 2, 420, _soak, r"^soak (PASS|FAIL)", takes_options=True),
    Suite("load", "160 op sites, two programs interleaved for many steps: host and device memory stay flat",
          "any; GPUs for run-ahead", 0, 360, _load, r"(PASS|FAIL)", takes_options=True),
    Suite("multiprocess", "one process per GPU (CUDA IPC): every dma schedule checked, then timed",
          "2+ GPUs (CPU: 2 processes, refusals checked)", 0, 560, _multiprocess, r"^checks: "),
    Suite("characterize", "decomposition loss, copy-engine vs NCCL contention, transfer cost, FP8 matmul rate",
          "2+ GPUs", 2, 420, _characterize, takes_options=True),
    Suite("fp8", "FP8 vs bf16 GEMMs on one GPU: the executor's FP8 and bf16 matmuls, JAX's bf16 dot, FP8 dot and "
          "dequantize-then-dot, on the per-device anchor shapes", "1+ GPU (the script alone runs on CPU)", 1, 480,
          _fp8, _fp8_result, takes_options=True),
    Suite("host", "host time per call of small copy-engine calls, meeting their group and on its channel "
          "(benchmarks/suites/host_time.py, FICCO_CHANNEL_BYTES off and on)", "2+ GPUs (CPU: tiny calls)", 0, 300,
          _host, _host_result),
    Suite("capture", "the cost of one call, calls back to back: meetings against symmetric sites, inside XLA's "
          "command buffers and without them, beside the plain path (benchmarks/suites/capture_cost.py)",
          "any; 1+ GPU for real numbers", 0, 300, _capture, _capture_result),
    Suite("trace", "a GPU timeline of one op (nsys, else JAX's profiler): OP SCHEDULE M K N [ITERS] after --",
          "any; 1+ GPU for a GPU timeline", 0, 240, _trace, r"^\d+ .*events (of|on) ", takes_options=True),
    Suite("timeline", "a device timeline of the flagship example's training steps with and without overlap: "
          "exposed communication, idle gaps, every collective's hidden share (example options after --)",
          "any; 1+ GPU for device lanes, 2+ for collectives (CPU: the tiny preset, host step times)", 0, 300,
          _timeline, _timeline_result, takes_options=True),
]}
