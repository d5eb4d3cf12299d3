"""The steps of the multiprocess suite: agreement between processes, checks, a timeline, timings.

benchmarks/suites/multiprocess.py drives them (its docstring says what each step does); this
module holds the work itself. Every process runs the same steps and takes the same decisions
(budget checks are agreed through the jax.distributed key-value store), so no process waits in
a collective that another skipped.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ficco_jax import dma
from ficco_jax import ops as ficco_ops
from ficco_jax.ops import measure
from ficco_jax.runtime import ipc, topology
from ficco_jax.schedule import Schedule, local_shapes
from ficco_jax.tools.bench import ANCHOR_SHAPES, record_timeline
from ficco_jax.tuning import cost_model, policy, select, timing

#: (M, K, N) timed on GPUs, in this order as the budget allows: the large anchor shapes
#: (ficco_jax/tools/anchor_shapes.json).
GPU_TIMED = {name: ANCHOR_SHAPES[name] for name in
             ("llama70b_qkv_M8k", "llama70b_mlp_up_M8k", "llama70b_mlp_up_M2k", "gpt3_175b_mlp_M4k")}
GPU_CHECKED = {"small_M1k_K512_N1k": (1024, 512, 1024), "llama70b_qkv_M8k": ANCHOR_SHAPES["llama70b_qkv_M8k"]}
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
#: Set once jax.distributed is initialised: jax.process_index() before that would start a backend.
STATE = {"initialised": False}


def log(msg: str) -> None:
    who = jax.process_index() if STATE["initialised"] else "?"
    print(f"[p{who} +{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


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
    if which == "all_gather":
        body = ((lambda x: jax.lax.all_gather(x, "tp", tiled=True)) if schedule == "ref"
                else (lambda x: dma.all_gather(x, "tp", schedule=schedule)))
    else:
        body = ((lambda x: jax.lax.psum_scatter(x.astype(jnp.float32), "tp", tiled=True)) if schedule == "ref"
                else (lambda x: dma.reduce_scatter(x, "tp", schedule=schedule)))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))


def dma_schedules(op: str, n: int):
    """Every dma schedule the design space enumerates for `op` (ring is direct on one stream there)."""
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
        """The staging buffer peers in other processes read (xla_ffi/runtime/ipc.h): allocated here, so that
        a failure shows before any op runs, and reported with its size and exportability."""
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
        M, K, N = dims
        for op in OPS:
            if not self.go(f"checks {op} {name}", 25):
                return
            args = measure.make_inputs(op, local_shapes(op, M, K, N, self.n), DTYPE, self.mesh, seed=1)
            want = measure.sharded(self.mesh, op, measure.op_body(op, "ref"))(*[a.astype(jnp.float32) for a in args])
            for sched in dma_schedules(op, self.n):
                start = time.monotonic()
                got, error = self.attempt(lambda: jax.block_until_ready(
                    measure.sharded(self.mesh, op, measure.op_body(op, sched))(*args)))
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
            "a2a_matmul": ((x, w_up), lambda s: (lambda v, w: ficco_ops.a2a_matmul_ref(v, w, "tp")) if s == "ref"
                           else (lambda v, w: ficco_ops.a2a_matmul(v, w, "tp", schedule=s))),
            "matmul_a2a": ((y, w_down), lambda s: (lambda v, w: ficco_ops.matmul_a2a_ref(v, w, "tp")) if s == "ref"
                           else (lambda v, w: ficco_ops.matmul_a2a(v, w, "tp", schedule=s))),
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
        op, sched, (M, K, N) = parse_trace(spec)
        where = os.path.join(self.args.out, f"trace_p{jax.process_index()}")
        record_timeline(self.mesh, op, "ref" if sched == "ref" else Schedule.parse(sched), M, K, N, 20, where,
                              dtype=DTYPE, seed=5)
        log(f"traced {spec} into {where}")

    # -- timings -----------------------------------------------------------------------------
    def device_time(self, make, args) -> dict:
        """timing.device_time with one repeat count for every process: it derives the count from
        each process's own first launch, and processes that loop a different number of times run
        different collectives (a mismatch: NCCL/gloo abort or hang, the mailbox times out)."""
        small = make(1)
        jax.block_until_ready(small(*args))
        start = time.perf_counter()
        jax.block_until_ready(small(*args))
        t1 = time.perf_counter() - start
        repeats = self.store.agree(lambda: timing.repeats_for(t1))
        # The agreed count everywhere, and a fixed number of estimates (with an adaptive count, a
        # process that takes one more estimate launches collectives the others never join).
        return timing.device_time(make, args, repeats=repeats, adaptive=False)

    def candidates(self, op, shapes) -> tuple[list, dict]:
        """The schedules timed for `op` (the model's best, or --schedules) and the row's header."""
        with jax.set_mesh(self.mesh):
            auto = str(ficco_ops.resolve_schedule(op, "auto", shapes, DTYPE, self.n, axis_name="tp"))
            site = topology.for_axis("tp")
        comms, why = policy.allowed_comms(DTYPE, site)
        comm = "dma" if "dma" in comms else "xla"
        ranked = cost_model.rank(op, shapes, DTYPE, self.n, Schedule.enumerate(op, self.n, (comm,)),
                                 select.profile_for(self.n))
        chosen = [s for _, s in ranked[:TIMED_CANDIDATES]]
        if self.args.schedules and comm == "dma":  # the same schedules a one-process bench timed
            chosen = self.args.schedules
        return chosen, {"auto": auto, "comm_timed": comm, "why_not_dma": why}

    def time_candidate(self, op, sched, args, want) -> dict:
        """Verify one schedule against the reference, then time it (a wrong result is not timed)."""
        make = lambda r: measure.sharded(self.mesh, op, measure.op_body(op, sched), r)  # noqa: E731
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
        return entry

    def time_shape(self, name, dims):
        M, K, N = dims
        for op in OPS:
            if not self.go(f"timings {op} {name}", 30):
                return
            args = measure.make_inputs(op, local_shapes(op, M, K, N, self.n), DTYPE, self.mesh, seed=3)
            want = measure.sharded(self.mesh, op, measure.op_body(op, "ref"))(*[a.astype(jnp.float32) for a in args])
            chosen, header = self.candidates(op, local_shapes(op, M, K, N, self.n))
            row = {"op": op, "shape": name, "MKN": dims, **header, "candidates": {}}
            for label, sched in [("jax_seq", "ref")] + [(str(s), s) for s in chosen]:
                entry = self.time_candidate(op, sched, args, want)
                log(f"TIME {op} {name} {label}: " + (f"{entry['median_ms']:.3f} ms" if "median_ms" in entry
                                                     else str(entry["error"])[:300]))
                row["candidates"][label] = entry
            timed = {k: v for k, v in row["candidates"].items() if k != "jax_seq" and "median_ms" in v}
            if timed:
                best = min(timed, key=lambda k: timed[k]["median_ms"])
                row.update(best=best, best_ms=timed[best]["median_ms"])
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
        try:
            Schedule.parse(sched)
        except ValueError as exc:
            raise SystemExit(f"--trace {spec!r}: SCHEDULE: {exc}")
    return op, sched, (M, K, N)
