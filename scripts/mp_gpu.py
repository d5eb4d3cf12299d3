"""Copy engines across the processes of one host (CUDA IPC): checks, then timings.

One process of an N-process job on one host, one device each (scripts/mp_gpu_launch.sh starts
them; it is the way to run this). The mesh's one axis "tp" spans every process, so every
comm="dma" call goes through the host mailbox and CUDA IPC (xla_ffi/ipc.h).

  1. setup      jax.distributed on localhost; the site's topology; on GPUs the staging buffer
                every device exports to its peers (ipc.staging_info: size, legacy-IPC capable,
                cudaIpcGetMemHandle accepted: PASS / FAIL), and, for the record, how XLA's own
                allocation under an input looks to CUDA IPC (never exported: not capable on the
                first GPU run, which is why the data goes through the staging buffer).
  2. checks     every dma schedule of ag_matmul and matmul_rs (direct and ring), and of
                dma.all_gather / dma.reduce_scatter, against the reference on random bf16
                inputs, at a small shape and one anchor shape; dma.all_to_all, a2a_matmul and
                matmul_a2a at a small shape (their staging pieces differ): PASS / FAIL per schedule.
  3. timings    the anchor shapes (M, K, N): the model's best dma schedules, or those of
                --schedules (verified first, the fastest measured kept), and JAX sequential (all_gather / psum_scatter + dot
                by XLA), with ficco_jax.timing.device_time.
  (--trace OP:SCHEDULE:M,K,N) a GPU timeline of one op in every process: JAX's profiler records 20
                calls in a loop into $OUT/trace_p<i>/ (scripts/perfetto_timeline.py prints it), after
                the first checks.
  4. report     rank 0 collects every process's results through the jax.distributed key-value
                store, writes $OUT/<--json> and prints a table; exit status 1 if any check failed.

On CPU (the smoke test of this script: 2 processes, tiny shapes) copy engines cannot reach the
other process: every dma schedule must be *refused* with a clear error (that is its PASS), and
the timings use the best comm that can run (xla).

Every step logs to stderr ("[p<i> +<seconds>s] ..."); a failing check, and any exception a step
raises, is a FAIL line (and a failed check in the JSON), and the run goes on. All processes take the same decisions (the budget check is agreed through the store),
so no process waits in a collective that another skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

#: (M, K, N) timed on GPUs (bench.ANCHOR_SHAPES' names); the first one is also checked.
GPU_TIMED = {"llama70b_qkv_M8k": (8192, 8192, 10240), "llama70b_mlp_up_M8k": (8192, 8192, 28672),
             "llama70b_mlp_up_M2k": (2048, 8192, 28672), "gpt3_175b_mlp_M4k": (4096, 12288, 49152)}
GPU_CHECKED = {"small_M1k_K512_N1k": (1024, 512, 1024), "llama70b_qkv_M8k": (8192, 8192, 10240)}
CPU_TIMED = {"tiny_M64_K32_N64": (64, 32, 64)}
CPU_CHECKED = {"tiny_M64_K32_N64": (64, 32, 64)}
DTYPE = "bfloat16"
#: Relative Frobenius error allowed against the f32 reference (bf16 inputs and outputs).
TOLERANCE = 2e-2
#: How many of the model's best dma schedules are timed per shape (the fastest measured is kept).
TIMED_CANDIDATES = 2
OPS = ("ag_matmul", "matmul_rs")
#: Per-device all-to-all blocks (n, E_local, C, d) and the expert matmul's f, for the a2a checks.
A2A_E, A2A_C, A2A_D, A2A_F = 2, 128, 256, 256
#: The staging buffer size the setup step asks for (it grows later as calls need).
STAGING_PROBE_BYTES = 64 << 20

_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[p{jax.process_index() if _INITIALISED else '?'} +{time.monotonic() - _T0:6.1f}s] {msg}",
          file=sys.stderr, flush=True)


_INITIALISED = False


# ------------------------------------------------------------------------------------------------
# Agreement between the processes (the key-value store)
# ------------------------------------------------------------------------------------------------
class Store:
    def __init__(self, timeout_s: float):
        from jax._src import distributed  # the client of jax.distributed.initialize; no public getter

        self.client = distributed.global_state.client
        self.timeout_ms = int(timeout_s * 1000)
        self.steps = 0

    def agree(self, decide) -> object:
        """Rank 0's `decide()`, the same in every process (budget checks must not diverge)."""
        self.steps += 1
        key = f"ficco_mp_gpu/decision/{self.steps}"
        if jax.process_index() == 0:
            value = json.dumps(decide())
            self.client.key_value_set(key, value)
            return json.loads(value)
        return json.loads(self.client.blocking_key_value_get(key, self.timeout_ms))

    def gather(self, name: str, record: dict) -> list[dict] | None:
        """Every process's `record` (on rank 0; None elsewhere). A missing process gives None in its place."""
        self.client.key_value_set(f"ficco_mp_gpu/{name}/{jax.process_index()}", json.dumps(record))
        if jax.process_index() != 0:
            return None
        out, until = [], time.monotonic() + self.timeout_ms / 1000  # one deadline for all of them
        for p in range(jax.process_count()):
            wait_ms = max(1000, int((until - time.monotonic()) * 1000))
            try:
                out.append(json.loads(self.client.blocking_key_value_get(f"ficco_mp_gpu/{name}/{p}", wait_ms)))
            except Exception as exc:  # noqa: BLE001 - that process died or is stuck: say so, keep going
                out.append({"process": p, "missing": f"{type(exc).__name__}: {str(exc)[:200]}"})
        return out


# ------------------------------------------------------------------------------------------------
# Inputs, references, errors (local shards only: no collective that a failing process could skip)
# ------------------------------------------------------------------------------------------------
def local_rel_err(got, want) -> float:
    """Relative Frobenius error over this process's shards of two arrays of one sharding."""
    wants = {str(s.index): s.data for s in want.addressable_shards}
    num = den = 0.0
    for shard in got.addressable_shards:
        g = np.asarray(jnp.asarray(shard.data, jnp.float32), np.float64)
        w = np.asarray(jnp.asarray(wants[str(shard.index)], jnp.float32), np.float64)
        if not np.all(np.isfinite(g)):
            return float("inf")
        num += float(np.sum((g - w) ** 2))
        den += float(np.sum(w ** 2))
    return float(np.sqrt(num) / max(np.sqrt(den), 1e-30))


def collective_inputs(mesh, M, K, seed):
    """x [n*M, K] sharded on rows (every device its own [M, K] block), random bf16."""
    n = mesh.shape["tp"]
    x = jax.random.normal(jax.random.PRNGKey(seed), (n * M, K), jnp.float32).astype(DTYPE)
    return jax.device_put(x, NamedSharding(mesh, P("tp", None)))


def collective_fn(mesh, which: str, schedule):
    from ficco_jax import dma

    if which == "all_gather":
        body = ((lambda x: jax.lax.all_gather(x, "tp", tiled=True)) if schedule == "ref"
                else (lambda x: dma.all_gather(x, "tp", schedule=schedule)))
    else:
        body = ((lambda x: jax.lax.psum_scatter(x.astype(jnp.float32), "tp", tiled=True)) if schedule == "ref"
                else (lambda x: dma.reduce_scatter(x, "tp", schedule=schedule)))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))


def dma_schedules(op: str, n: int):
    """Every dma schedule the design space enumerates for `op` (ring is direct on one stream there)."""
    from ficco_jax.schedule import Schedule

    return list(Schedule.enumerate(op, n, ("dma",)))


def collective_schedules(n: int):
    """The distinct transfer points of the standalone collectives: order x chunks x streams, and
    the ring issue order they also accept."""
    seen, out = set(), []
    for s in dma_schedules("ag_matmul", n):
        key = (s.order, s.chunks, s.copy_streams)
        if key not in seen:
            seen.add(key)
            out.append(str(s).replace("/grouped", ""))
    return out + ["dma/ring/c1", "dma/ring/c4"]


# ------------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------------
class Run:
    def __init__(self, args, mesh, store):
        self.args, self.mesh, self.store = args, mesh, store
        self.n = mesh.shape["tp"]
        self.checks: list[dict] = []
        self.timings: list[dict] = []
        self.notes: list[str] = []
        from ficco_jax import ipc

        self.ipc = ipc.supported()
        self.staging: dict | None = None  # ipc.staging_info() of the setup step (GPUs)
        self.deadline = time.time() - (time.monotonic() - _T0) + args.budget_s  # from the process's start

    def time_left(self) -> float:
        return self.deadline - time.time()

    def go(self, what: str, need_s: float) -> bool:
        ok = self.store.agree(lambda: self.time_left() > need_s)
        if not ok:
            log(f"SKIP {what}: budget (--budget-s) nearly spent")
            self.notes.append(f"skipped {what}: budget")
        return ok

    def record(self, kind, name, op, shape, schedule, rel_err=None, error=None, expect_refusal=False, seconds=0.0):
        if expect_refusal:
            passed = error is not None and "CUDA IPC" in error
            status = "PASS (refused as expected: no CUDA IPC here)" if passed else "FAIL (expected a refusal)"
        elif error is not None:
            passed, status = False, f"FAIL: {error.splitlines()[0][:300]}"
        else:
            passed = rel_err < TOLERANCE
            status = f"PASS rel_err={rel_err:.2e}" if passed else f"FAIL rel_err={rel_err:.3g} >= {TOLERANCE}"
        log(f"{'PASS' if passed else 'FAIL'} {kind} {op} {name} {schedule}: {status} ({seconds:.1f} s)")
        self.checks.append({"kind": kind, "op": op, "shape": name, "MKN": shape, "schedule": str(schedule),
                            "passed": passed, "rel_err": rel_err, "error": error, "status": status,
                            "seconds": seconds})

    def record_setup(self, what, passed, detail, error=None):
        log(f"{'PASS' if passed else 'FAIL'} setup {what}: {detail}")
        self.checks.append({"kind": "setup", "op": what, "shape": "-", "MKN": None, "schedule": "-",
                            "passed": passed, "rel_err": None, "error": error, "status": detail, "seconds": 0.0})

    def step(self, what, fn, *args):
        """fn(*args) as one step: an exception it raises is a FAIL line and a failed check, not the
        end of the run (a failing schedule is caught inside the step already; this catches the
        rest: inputs, references, schedule resolution)."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            text = f"{type(exc).__name__}: {exc}"
            if os.environ.get("FICCO_MP_TRACEBACK"):
                log(traceback.format_exc())
            log(f"FAIL step {what}: {text.splitlines()[0][:300] if text else ''}")
            self.checks.append({"kind": "step", "op": what, "shape": "-", "MKN": None, "schedule": "-",
                                "passed": False, "rel_err": None, "error": text[:4000],
                                "status": f"FAIL: {text.splitlines()[0][:300]}", "seconds": 0.0})

    # -- setup -------------------------------------------------------------------------------
    def check_staging(self):
        """The staging buffer peers in other processes read (xla_ffi/ipc.h): allocated here, so that
        a failure shows before any op runs, and reported with its size and exportability."""
        from ficco_jax import ipc

        x = collective_inputs(self.mesh, 8, 8, seed=0)
        info, error = self.attempt(lambda: ipc.describe_pointer(x.addressable_shards[0].data))
        log(f"for the record, XLA's allocation under an input buffer (never exported): {info or error}")
        if not self.ipc:
            self.notes.append("ipc.supported() is False on GPUs (FICCO_CROSS_PROCESS_DMA unset?): no staging")
            return
        info, error = self.attempt(lambda: ipc.staging_info(nbytes=STAGING_PROBE_BYTES))
        if info is None:
            self.record_setup("staging", False, f"FAIL: {error.splitlines()[0][:300]}", error)
            self.notes.append("the staging buffer could not be allocated or described: every dma check will fail")
            return
        passed = bool(info.get("ipc_capable")) and not info.get("export_error")
        detail = (f"{info['bytes'] / 2**20:.0f} MiB at {info['base']:#x}, generation {info['generation']}, "
                  f"ipc_capable={info['ipc_capable']}, cudaIpcGetMemHandle: {info['export_error'] or 'ok'}")
        self.record_setup("staging", passed, detail, None if passed else detail)
        self.staging = info
        if not passed:
            self.notes.append("the staging buffer cannot be exported: every dma check will fail")

    def attempt(self, fn):
        """(result, None) or (None, error text) of fn(): a failing schedule must not stop the run."""
        try:
            return fn(), None
        except Exception as exc:  # noqa: BLE001
            text = f"{type(exc).__name__}: {exc}"
            log("  error: " + text.replace("\n", " | ")[:1500])
            if os.environ.get("FICCO_MP_TRACEBACK"):
                log(traceback.format_exc())
            return None, text[:4000]

    # -- checks ------------------------------------------------------------------------------
    def check_ops(self, name, dims):
        from ficco_jax import bench

        M, K, N = dims
        for op in OPS:
            if not self.go(f"checks {op} {name}", 25):
                return
            args = bench.make_inputs(op, M, K, N, DTYPE, self.mesh, seed=1)
            want = bench.sharded(self.mesh, op, bench.op_body(op, "ref"))(*[a.astype(jnp.float32) for a in args])
            for sched in dma_schedules(op, self.n):
                start = time.monotonic()
                got, error = self.attempt(lambda: jax.block_until_ready(
                    bench.sharded(self.mesh, op, bench.op_body(op, sched))(*args)))
                rel = None if got is None else local_rel_err(got, want)
                self.record("op", name, op, dims, sched, rel, error, expect_refusal=not self.ipc,
                            seconds=time.monotonic() - start)
            del args, want

    def check_collectives(self, name, dims):
        M, K, _ = dims
        rows = M // self.n  # rows per device block, as the layer's x shard
        for which in ("all_gather", "reduce_scatter"):
            if not self.go(f"checks dma.{which} {name}", 20):
                return
            x = collective_inputs(self.mesh, rows if which == "all_gather" else M, K, seed=2)
            want = collective_fn(self.mesh, which, "ref")(x)
            for sched in collective_schedules(self.n):
                start = time.monotonic()
                got, error = self.attempt(lambda: jax.block_until_ready(collective_fn(self.mesh, which, sched)(x)))
                rel = None if got is None else local_rel_err(got, want)
                self.record("collective", name, f"dma.{which}", dims, sched, rel, error,
                            expect_refusal=not self.ipc, seconds=time.monotonic() - start)
            del x, want

    def check_a2a(self, name):
        """dma.all_to_all (one staging piece), a2a_matmul (one piece) and matmul_a2a (one piece per
        send slot) against jax.lax.all_to_all references, small blocks, bf16."""
        from ficco_jax import a2a, dma
        from ficco_jax.schedule import Schedule

        n = self.n
        scheds = [Schedule(comm="dma", order="direct", chunks=1), Schedule(comm="dma", order="ring", chunks=2),
                  Schedule(comm="dma", order="direct", chunks=2, gemm="grouped")]
        if n > 2:
            scheds.append(Schedule(comm="dma", order="direct", chunks=2, copy_streams=2))
        spec = P("tp")
        key = jax.random.split(jax.random.PRNGKey(4), 3)
        x = jax.device_put(jax.random.normal(key[0], (n * n, A2A_E, A2A_C, A2A_D)).astype(DTYPE),
                           NamedSharding(self.mesh, spec))
        w_up = jax.device_put((jax.random.normal(key[1], (n * A2A_E, A2A_D, A2A_F)) / A2A_D ** 0.5).astype(DTYPE),
                              NamedSharding(self.mesh, spec))
        w_down = jax.device_put((jax.random.normal(key[2], (n * A2A_E, A2A_F, A2A_D)) / A2A_F ** 0.5).astype(DTYPE),
                                NamedSharding(self.mesh, spec))
        y = jax.device_put(jnp.ones((n * n, A2A_E, A2A_C, A2A_F), DTYPE) * 0.5, NamedSharding(self.mesh, spec))

        def smap(body, nargs):
            return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(spec,) * nargs, out_specs=spec))

        cases = {
            "dma.all_to_all": ((x,), lambda s: (lambda v: jax.lax.all_to_all(v, "tp", 0, 0, tiled=True)) if s == "ref"
                               else (lambda v: dma.all_to_all(v, "tp", 0, 0, schedule=s))),
            "a2a_matmul": ((x, w_up), lambda s: (lambda v, w: a2a.a2a_matmul_ref(v, w, "tp")) if s == "ref"
                           else (lambda v, w: a2a.a2a_matmul(v, w, "tp", schedule=s))),
            "matmul_a2a": ((y, w_down), lambda s: (lambda v, w: a2a.matmul_a2a_ref(v, w, "tp")) if s == "ref"
                           else (lambda v, w: a2a.matmul_a2a(v, w, "tp", schedule=s))),
        }
        dims = (n, A2A_E, A2A_C, A2A_D)
        for op, (args, body) in cases.items():
            if not self.go(f"checks {op} {name}", 15):
                return
            want = smap(body("ref"), len(args))(*[a.astype(jnp.float32) for a in args])
            # dma.all_to_all's chunks cut the blocks' first dimension: 1 here (x [n, E, C, d] per device).
            op_scheds = scheds if op != "dma.all_to_all" else list(dict.fromkeys(
                s.replace(chunks=1, gemm="per_chunk") for s in scheds))
            for sched in op_scheds:
                start = time.monotonic()
                got, error = self.attempt(lambda: jax.block_until_ready(smap(body(sched), len(args))(*args)))
                rel = None if got is None else local_rel_err(got, want)
                self.record("a2a", name, op, dims, sched, rel, error, expect_refusal=not self.ipc,
                            seconds=time.monotonic() - start)

    # -- a timeline ---------------------------------------------------------------------------
    def trace(self, spec: str):
        """JAX's profiler over 20 calls of one op in a jitted loop (every process records its own)."""
        from ficco_jax import bench
        from ficco_jax.schedule import Schedule

        op, sched, (M, K, N) = parse_trace(spec)
        where = os.path.join(self.args.out, f"trace_p{jax.process_index()}")
        bench.record_timeline(self.mesh, op, "ref" if sched == "ref" else Schedule.parse(sched), M, K, N, 20, where,
                              dtype=DTYPE, seed=5)
        log(f"traced {spec} into {where}")

    # -- timings -----------------------------------------------------------------------------
    def device_time(self, make, args) -> dict:
        """timing.device_time with one repeat count for every process: it derives the count from
        each process's own first launch, and processes that loop a different number of times run
        different collectives (a mismatch: NCCL/gloo abort or hang, the mailbox times out)."""
        from ficco_jax import timing

        small = make(1)
        jax.block_until_ready(small(*args))
        start = time.perf_counter()
        jax.block_until_ready(small(*args))
        t1 = time.perf_counter() - start
        repeats = self.store.agree(lambda: int(min(200, max(4, 0.02 / max(t1, 1e-7)))))
        # target_s so large that device_time takes max_repeats, the agreed count, everywhere; and a fixed
        # number of estimates (the adaptive count differs between processes: session 4, 2 x H200, rank 0
        # took a 4th estimate whose NCCL launches rank 1 never joined).
        return timing.device_time(make, args, target_s=1e9, max_repeats=repeats, adaptive=False)

    def time_shape(self, name, dims):
        from ficco_jax import bench, cost_model, heuristics, ops, topology
        from ficco_jax.schedule import Schedule

        M, K, N = dims
        for op in OPS:
            if not self.go(f"timings {op} {name}", 30):
                return
            shapes = bench.local_shapes(op, M, K, N, self.n)
            args = bench.make_inputs(op, M, K, N, DTYPE, self.mesh, seed=3)
            want = bench.sharded(self.mesh, op, bench.op_body(op, "ref"))(*[a.astype(jnp.float32) for a in args])
            with jax.set_mesh(self.mesh):
                auto = str(ops.resolve_schedule(op, "auto", shapes, DTYPE, self.n, axis_name="tp"))
                site = topology.for_axis("tp")
            comms, why = heuristics.allowed_comms(DTYPE, site)
            comm = "dma" if "dma" in comms else "xla"
            ranked = cost_model.rank(op, shapes, DTYPE, self.n, Schedule.enumerate(op, self.n, (comm,)),
                                     heuristics.profile_for(self.n))
            candidates = [s for _, s in ranked[:TIMED_CANDIDATES]]
            if self.args.schedules and comm == "dma":  # the same schedules a one-process bench timed
                candidates = self.args.schedules
            row = {"op": op, "shape": name, "MKN": dims, "auto": auto, "comm_timed": comm,
                   "why_not_dma": why, "candidates": {}}
            for label, sched in [("jax_seq", "ref")] + [(str(s), s) for s in candidates]:
                make = lambda r, sched=sched: bench.sharded(self.mesh, op, bench.op_body(op, sched), r)  # noqa: E731
                got, error = self.attempt(lambda: jax.block_until_ready(make(None)(*args)))
                rel = None if got is None else local_rel_err(got, want)
                entry = {"rel_err": rel, "error": error}
                if error is None and rel < TOLERANCE:
                    t, error = self.attempt(lambda: self.device_time(make, args))
                    if t is not None:
                        entry.update(median_ms=t["median_s"] * 1e3, spread_ms=t["spread_s"] * 1e3)
                    entry["error"] = error
                elif error is None:
                    entry["error"] = f"WRONG RESULT rel_err={rel:.3g}; not timed"
                log(f"TIME {op} {name} {label}: " + (f"{entry['median_ms']:.3f} ms" if "median_ms" in entry
                                                     else str(entry["error"])[:300]))
                row["candidates"][label] = entry
            timed = {k: v for k, v in row["candidates"].items() if k != "jax_seq" and "median_ms" in v}
            if timed:
                best = min(timed, key=lambda k: timed[k]["median_ms"])
                row["best"] = best
                row["best_ms"] = timed[best]["median_ms"]
                seq = row["candidates"]["jax_seq"].get("median_ms")
                row["speedup_vs_jax_seq"] = seq / row["best_ms"] if seq and row["best_ms"] > 0 else None
            self.timings.append(row)
            del args, want


def parse_trace(spec: str) -> tuple[str, str, tuple[int, int, int]]:
    """"ag_matmul:dma/direct/c1:8192,8192,10240" -> (op, schedule, (M, K, N)), or a clear error."""
    try:
        op, sched, dims = spec.split(":")
        M, K, N = (int(d) for d in dims.split(","))
    except ValueError:
        raise SystemExit(f"--trace {spec!r}: expected OP:SCHEDULE:M,K,N, e.g. ag_matmul:dma/direct/c1:8192,8192,10240")
    if op not in OPS:
        raise SystemExit(f"--trace {spec!r}: OP must be one of {OPS}")
    if sched != "ref":
        from ficco_jax.schedule import Schedule

        try:
            Schedule.parse(sched)
        except ValueError as exc:
            raise SystemExit(f"--trace {spec!r}: SCHEDULE: {exc}")
    return op, sched, (M, K, N)


def parse_schedules(spec: str) -> list:
    """"dma/direct/c1,dma/direct/c2/grouped" -> [Schedule, ...], or a clear error."""
    from ficco_jax.schedule import Schedule

    out = []
    for text in (t for t in spec.split(",") if t.strip()):
        try:
            sched = Schedule.parse(text)
        except ValueError as exc:
            raise SystemExit(f"--schedules {spec!r}: {exc}")
        if sched.comm != "dma":
            raise SystemExit(f"--schedules {spec!r}: {text!r} is not a dma schedule (JAX sequential is always timed)")
        out.append(sched)
    if not out:
        raise SystemExit(f"--schedules {spec!r}: no schedule given; e.g. dma/direct/c1,dma/direct/c2/grouped")
    return out


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def table(result: dict) -> str:
    lines = [f"mp_gpu: {result['n_processes']} processes x {result['devices_per_process']} device(s), "
             f"{result['device']} ({result['platform']}), ipc={result['ipc']}",
             f"checks: {result['passed']} passed, {result['failed']} failed (over all processes)"]
    for c in result["failed_checks"][:20]:
        lines.append(f"  FAIL p{c['process']} {c['op']} {c['shape']} {c['schedule']}: {c['status'][:160]}")
    lines.append("")
    lines.append("| op | shape (M,K,N) | auto | best timed | best ms | JAX seq ms | speedup |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in result["timings"]:
        seq = r["candidates"].get("jax_seq", {}).get("median_ms")
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        sp = r.get("speedup_vs_jax_seq")
        lines.append(f"| {r['op']} | {r['shape']} {tuple(r['MKN'])} | {r['auto']} | {r.get('best', '-')} | "
                     f"{fmt(r.get('best_ms'))} | {fmt(seq)} | {'-' if sp is None else f'{sp:.2f}x'} |")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def main() -> int:
    global _INITIALISED
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--process-id", type=int, default=int(os.environ.get("FICCO_MP_PROCESS_ID", "0")))
    parser.add_argument("--num-processes", type=int, default=int(os.environ.get("FICCO_MP_NUM_PROCESSES", "4")))
    parser.add_argument("--port", type=int, default=int(os.environ.get("FICCO_MP_PORT", "0") or 0))
    parser.add_argument("--local-device", type=int, default=None,
                        help="all GPUs visible: this process uses only this one (jax local_device_ids)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--json", default="mp_gpu.json")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip the remaining steps after this")
    parser.add_argument("--quick", action="store_true", default=bool(os.environ.get("FICCO_MP_QUICK")),
                        help="small checks only (no anchor check, one timed shape); also FICCO_MP_QUICK=1")
    parser.add_argument("--trace", default=os.environ.get("FICCO_MP_TRACE") or None, metavar="OP:SCHEDULE:M,K,N",
                        help="also record a GPU timeline of this op (JAX's profiler) after the first checks")
    parser.add_argument("--timed", default=os.environ.get("FICCO_MP_TIMED") or None, metavar="NAME[,NAME]",
                        help=f"time only these shapes of {list(GPU_TIMED)} (default: all, as the budget allows)")
    parser.add_argument("--schedules", default=os.environ.get("FICCO_MP_SCHEDULES") or None, metavar="S[,S]",
                        help=f"time these dma schedules (default: the model's best {TIMED_CANDIDATES}); "
                             "also FICCO_MP_SCHEDULES")
    args = parser.parse_args()
    if args.trace:
        parse_trace(args.trace)
    if args.schedules:  # parsed once, here: a bad list fails before any process starts
        args.schedules = parse_schedules(args.schedules)
    if not args.port:
        parser.error("--port (or FICCO_MP_PORT) is required: the coordinator's port on localhost")

    kwargs = {}
    if args.local_device is not None:
        kwargs["local_device_ids"] = [args.local_device]
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120, **kwargs)
    _INITIALISED = True
    import ficco_jax
    import ficco_jax.timing
    from ficco_jax import _ext, ipc, topology

    on_gpu = jax.default_backend() == "gpu"
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.process_count()} processes, "
        f"local devices {jax.local_devices()}, global {len(jax.devices())}; ficco_jax build {_ext.build_info()}; "
        f"ipc supported: {ipc.supported()}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    store = Store(timeout_s=120)
    run = Run(args, mesh, store)
    site = topology.describe(mesh, "tp")
    log(f"site: kind {site.kind}; {site.groups[0]}; local ordinals "
        f"{[m.local_ordinal for m in site.groups[0].members]}")
    if site.kind != topology.SAME_HOST_MULTI_PROCESS:
        run.notes.append(f"the tp axis is {site.kind}, not same_host_multi_process: IPC not exercised")

    if on_gpu:  # the staging buffer peers read, and (for the record) XLA's allocation
        run.step("setup staging", run.check_staging)

    checked = GPU_CHECKED if on_gpu else CPU_CHECKED
    timed = GPU_TIMED if on_gpu else CPU_TIMED
    if args.timed and on_gpu:
        unknown = sorted(set(args.timed.split(",")) - set(timed))
        if unknown:
            raise SystemExit(f"--timed: unknown shape names {unknown}; known: {list(timed)}")
        timed = {k: v for k, v in timed.items() if k in args.timed.split(",")}
    if args.quick:  # after --timed: the first of the shapes it kept
        checked = dict(list(checked.items())[:1])
        timed = dict(list(timed.items())[:1])
    first_checked = next(iter(checked))
    # Most informative first, in case the budget runs out: the small checks, one anchor timed,
    # the anchor checks, then the other anchors timed.
    plan = [("checks", n, d) for n, d in list(checked.items())[:1]] + \
           ([("trace", args.trace, None)] if args.trace else []) + \
           [("timings", n, d) for n, d in list(timed.items())[:1]] + \
           [("checks", n, d) for n, d in list(checked.items())[1:]] + \
           [("timings", n, d) for n, d in list(timed.items())[1:]]
    for step, name, dims in plan:
        log(f"== {step} at {name} {dims}")
        if step == "trace":
            if run.go(f"trace {name}", 40):
                run.step(f"trace {name}", run.trace, name)
            continue
        if step == "checks":
            run.step(f"checks ops {name}", run.check_ops, name, dims)
            run.step(f"checks collectives {name}", run.check_collectives, name, dims)
            if name == first_checked:
                run.step(f"checks a2a {name}", run.check_a2a, name)
        else:
            run.step(f"timings {name}", run.time_shape, name, dims)
        stats, error = run.attempt(ipc.stats)
        log(f"ipc stats: {stats if error is None else error}")

    stats, error = run.attempt(ipc.stats)
    mine = {"process": jax.process_index(), "checks": run.checks, "ipc_stats": stats if error is None else error,
            "staging": run.staging, "notes": run.notes}
    everyone = store.gather("result", mine)
    if everyone is not None:
        flat = [dict(c, process=r["process"]) for r in everyone for c in r.get("checks", [])]
        failed = [c for c in flat if not c["passed"]]
        missing = [r for r in everyone if "missing" in r]
        result = {
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
            "n_processes": jax.process_count(), "devices_per_process": len(jax.local_devices()),
            "ipc": ipc.supported(), "site_kind": site.kind, "dtype": DTYPE, "tolerance": TOLERANCE,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "local_device": args.local_device,
            "passed": len(flat) - len(failed), "failed": len(failed) + len(missing), "failed_checks": failed,
            "ipc_open_failed": any("cudaIpcOpen" in (c.get("error") or "") for c in failed),
            "missing_processes": missing, "timings": run.timings,
            "ipc_stats": {r["process"]: r.get("ipc_stats") for r in everyone},
            "staging": {r["process"]: r.get("staging") for r in everyone},
            "notes": run.notes + [n for r in everyone[1:] for n in r.get("notes", [])],
            "checks": flat, "method": ficco_jax.timing.METHOD_FIXED, "extension": _ext.build_info(),
        }
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, args.json)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
        print(table(result), flush=True)
        log(f"wrote {path}")
    ok = all(c["passed"] for c in run.checks) and (everyone is None or not result["failed"])
    try:
        store.client.wait_at_barrier("ficco_mp_gpu_end", 120_000)
        closed = ficco_jax.ipc.close() if run.ipc else 0
        log(f"ipc.close(): {closed} mappings closed")
    except Exception as exc:  # noqa: BLE001
        log(f"teardown: {type(exc).__name__}: {exc}")
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
