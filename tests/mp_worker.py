"""One process of the two-process CPU test (tests/test_multiprocess.py launches two of these).

    python tests/mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON

Each process owns 4 virtual CPU devices; the global mesh has 8. Every check runs in both
processes (SPMD: both trace and run the same programs) and records "ok" or its error in
OUT_JSON; the exit status is 1 if any check failed.

"auto" is made to behave as on a GPU with the CUDA build (on CPU `policy.choose` short-cuts
to comm="none", and the cost model prefers no overlap at these tiny shapes): a stand-in model
picks comm="dma" when the site allows it, else comm="xla". What is tested is the topology
decision around the model, not the model.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import traceback

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

# Rows per device, contraction, columns per device: tiny, integer-valued, exact in float32.
M, K, N = 8, 16, 8


def main(process_id: int, num_processes: int, port: int, out_path: str) -> int:
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=60,
                               shutdown_timeout_seconds=30)
    jax.config.update("jax_default_matmul_precision", "highest")
    import ficco_jax
    from ficco_jax.runtime import topology
    from ficco_jax.tuning import policy

    records = _capture_log()
    _gpu_like_auto(policy)
    devices = np.array(jax.devices())  # sorted by process: process p holds devices[4p:4p+4]
    mesh8 = Mesh(devices, ("tp",))
    mesh2x4 = Mesh(devices.reshape(2, 4), ("dp", "tp"))
    rng = np.random.default_rng(7)
    checks = {}

    def check(name, fn):
        records.clear()
        try:
            fn()
            checks[name] = "ok"
        except Exception:  # report every failure, keep checking
            checks[name] = traceback.format_exc(limit=6)

    # -- topology ------------------------------------------------------------------------------
    def topology_of_meshes():
        site = topology.describe(mesh8, "tp")
        assert site.kind == topology.SAME_HOST_MULTI_PROCESS, site  # both processes on this host
        assert [g.processes for g in site.groups] == [(0, 1)]
        members = site.groups[0].members
        assert [m.process_index for m in members] == [0] * 4 + [1] * 4
        here = [m for m in members if m.process_index == process_id]
        assert [m.local_ordinal for m in here] == [0, 1, 2, 3], members
        assert all(m.local_ordinal is None for m in members if m.process_index != process_id)
        assert len({m.host for m in members}) == 1
        inner = topology.describe(mesh2x4, "tp")
        assert inner.kind == topology.IN_PROCESS and [g.processes for g in inner.groups] == [(0,), (1,)]
        assert topology.describe(mesh2x4, "dp").kind == topology.SAME_HOST_MULTI_PROCESS
        with topology.hosts_overridden({0: "node-a", 1: "node-b"}):
            assert topology.describe(mesh8, "tp").kind == topology.MULTI_HOST
        # Trace time: without jax.set_mesh the devices are not visible, so the answer is unknown.
        assert topology.for_axis("tp").kind == topology.UNKNOWN
        with jax.set_mesh(mesh2x4):
            assert topology.for_axis("tp").kind == topology.IN_PROCESS

    check("topology", topology_of_meshes)

    # -- the ops over a tp axis that spans the two processes: auto falls back to xla ----------
    def ops_across_processes(use_set_mesh):
        def run():
            for op in ("ag_matmul", "matmul_rs"):
                lowered = _check_op(op, mesh8, rng, "auto", ficco_jax, use_set_mesh)
                assert "ficco_" not in lowered, f"{op}: a copy-engine custom call across processes"
                text = "\n".join(records)
                assert "so xla/" in text and "comm='dma' cannot reach every peer from here" in text, text
                if use_set_mesh:
                    assert ("processes of one host: copy engines reach them only through CUDA IPC "
                            "(GPUs with the CUDA build, opt-in with FICCO_CROSS_PROCESS_DMA=1") in text, text
                else:
                    assert "jax.set_mesh" in text, text
        return run

    check("ops_across_processes_set_mesh", ops_across_processes(True))
    check("ops_across_processes_no_set_mesh", ops_across_processes(False))

    def resolved_schedule_query():
        with jax.set_mesh(mesh8):
            chosen = ficco_jax.ops.resolve_schedule("ag_matmul", "auto", ((M, K), (K, N)), jnp.float32, 8,
                                                    axis_name="tp")
        assert chosen.comm == "xla", chosen
        with jax.set_mesh(mesh2x4):
            chosen = ficco_jax.ops.resolve_schedule("ag_matmul", "auto", ((M, K), (K, N)), jnp.float32, 4,
                                                    axis_name="tp")
        assert chosen.comm == "dma", chosen

    check("resolved_schedule_query", resolved_schedule_query)

    # -- explicit dma across processes: a clear error, at trace time or at lowering -------------
    def explicit_dma_refused(use_set_mesh):
        def run():
            for op in ("ag_matmul", "matmul_rs"):
                try:
                    _check_op(op, mesh8, rng, "dma/direct/c2/s1", ficco_jax, use_set_mesh)
                except ValueError as err:
                    msg = str(err)
                    for part in (f"{op}: mesh axis 'tp' spans several processes", "processes [0, 1]",
                                 "devices [0, 1, 2, 3, 2048, 2049, 2050, 2051]", "comm='xla'"):
                        assert part in msg, (part, msg)
                else:
                    raise AssertionError(f"{op}: comm='dma' across processes was not refused")
        return run

    check("explicit_dma_refused_set_mesh", explicit_dma_refused(True))
    check("explicit_dma_refused_no_set_mesh", explicit_dma_refused(False))

    # -- tp within each process, dp over the processes: copy engines stay in use ----------------
    def ops_within_process():
        for op in ("ag_matmul", "matmul_rs"):
            lowered = _check_op(op, mesh2x4, rng, "auto", ficco_jax, True)
            assert f"ficco_{op}" in lowered, f"{op}: 'auto' did not keep comm='dma' for in-process groups"
            lowered = _check_op(op, mesh2x4, rng, "dma/direct/c2/s1", ficco_jax, False)
            assert f"ficco_{op}" in lowered

    check("ops_within_process", ops_within_process)

    # -- overlap(f) over the spanning axis ------------------------------------------------------
    def overlap_across_processes():
        report = _check_overlap(mesh8, rng, ficco_jax)
        assert len(report.sites) == 2 and all(r.schedule.startswith("xla/") for r in report.sites), str(report)

    check("overlap_across_processes", overlap_across_processes)
    def overlap_within_process():  # groups inside this process keep copy engines
        report = _check_overlap(mesh2x4, rng, ficco_jax)
        assert all(r.schedule.startswith("dma/") for r in report.sites), str(report)

    check("overlap_within_process", overlap_within_process)

    with open(out_path, "w") as fh:
        json.dump({"process": process_id, "checks": checks}, fh, indent=1)
    jax.distributed.shutdown()
    return 0 if all(v == "ok" for v in checks.values()) else 1


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _capture_log() -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("ficco_jax")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    return records


def _gpu_like_auto(policy) -> None:
    """A stand-in model: comm="dma" (direct, 2 chunks) where allowed, else comm="xla" (ring, 2 chunks)."""
    from ficco_jax.schedule import Schedule

    def select_schedule(op, shapes, dtype, axis_size, profile=None, comms=None, out_dtype=None):
        comms = tuple(comms or ("none", "xla", "dma"))
        return Schedule.parse("dma/direct/c2/s1" if "dma" in comms else "xla/ring/c2")

    policy.select_schedule = select_schedule
    policy.MODEL_ON_CPU = True  # "auto" decides as on a GPU: over the comms that can run


def _global(mesh, spec, value):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])


def _assert_shards_equal(name, got, want):
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=f"{name} {shard.index}")


def _op_problem(op, mesh, rng):
    """Integer-valued operands (exact in float32), their specs and the host reference of
    value = a @ b and of the gradients of sum(value * c)."""
    tp = mesh.shape["tp"]
    batch = tuple(a for a in mesh.axis_names if a != "tp")
    dp = mesh.size // tp
    ints = lambda *shape: rng.integers(-3, 4, size=shape).astype(np.float32)  # noqa: E731
    if op == "ag_matmul":
        a, b = ints(dp * tp * M, K), ints(K, tp * N)
        specs = (P((*batch, "tp"), None), P(None, "tp")), P(batch or None, "tp")
    else:
        a, b = ints(dp * tp * M, tp * N), ints(tp * N, K)
        specs = (P(batch or None, "tp"), P("tp", None)), P((*batch, "tp"), None)
    c = ints(a.shape[0], b.shape[1])
    return a, b, c, specs, {"value": a @ b, "da": c @ b.T, "db": a.T @ c}


def _check_op(op, mesh, rng, schedule, ficco_jax, use_set_mesh) -> str:
    """Run `op` (value and gradients) on `mesh`, compare with the host reference; return the
    lowered program's text."""
    a, b, c, (in_specs, out_spec), want = _op_problem(op, mesh, rng)
    fn = getattr(ficco_jax, op)
    body = jax.shard_map(lambda a, b: fn(a, b, "tp", schedule=schedule), mesh=mesh, in_specs=in_specs,
                         out_specs=out_spec)
    ga, gb, gc = _global(mesh, in_specs[0], a), _global(mesh, in_specs[1], b), _global(mesh, out_spec, c)

    def loss(a, b, c):
        return jnp.sum(body(a, b) * c)

    value_and_grads = jax.jit(lambda a, b, c: (body(a, b), jax.grad(loss, argnums=(0, 1))(a, b, c)))
    with (jax.set_mesh(mesh) if use_set_mesh else _nothing()):
        lowered = value_and_grads.lower(ga, gb, gc).as_text()
        value, (da, db) = value_and_grads(ga, gb, gc)
    _assert_shards_equal(f"{op} value", value, want["value"])
    _assert_shards_equal(f"{op} d{op[0]}", da, want["da"])
    _assert_shards_equal(f"{op} dw", db, want["db"])
    return lowered


def _check_overlap(mesh, rng, ficco_jax):
    """overlap(f) of an all_gather -> matmul -> matmul -> psum_scatter block: value and gradients."""
    tp = mesh.shape["tp"]
    batch = tuple(a for a in mesh.axis_names if a != "tp")
    dp = mesh.size // tp
    ints = lambda *shape: rng.integers(-2, 3, size=shape).astype(np.float32)  # noqa: E731
    x, w1, w2 = ints(dp * tp * M, K), ints(K, tp * N), ints(tp * N, K)
    row_spec = P((*batch, "tp"), None)
    in_specs = (row_spec, P(None, "tp"), P("tp", None))

    def block(x, w1, w2):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(h @ w2, "tp", scatter_dimension=0, tiled=True)

    f = jax.shard_map(block, mesh=mesh, in_specs=in_specs, out_specs=row_spec)
    g = ficco_jax.overlap(f)
    args = [_global(mesh, s, v) for s, v in zip(in_specs, (x, w1, w2))]
    report = ficco_jax.explain(g, *args)
    assert len(report.sites) == 2, str(report)
    value = jax.jit(g)(*args)
    c = ints(x.shape[0], K)  # the output's cotangent: d sum(y * c) / dy
    grads = jax.jit(jax.grad(lambda x, w1, w2, c: jnp.sum(g(x, w1, w2) * c), argnums=(0, 1, 2)))(
        *args, _global(mesh, row_spec, c))
    _assert_shards_equal("overlap value", value, x @ w1 @ w2)
    for name, got, ref in zip(("dx", "dw1", "dw2"), grads, (c @ w2.T @ w1.T, x.T @ (c @ w2.T), (x @ w1).T @ c)):
        _assert_shards_equal(f"overlap {name}", got, ref)
    return report


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
