"""ag_matmul with gemm="xla_dot": copy-engine transfers in split calls, XLA's own dots between them.

On the CPU backend the calls run synchronously, so these tests check the protocol (one open call
per device and site, waits by step, the join in the finish), the indexing of chunks, gradients,
repeated executions of one site (scan), several sites in one program, faults, and the schedule's
place in the design space. Whether XLA keeps each dot after its wait on a GPU stream is for the
GPU run (tests/gpu, bench).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax import _ext, config  # noqa: E402
from ficco_jax.schedule import XLA_DOT, Schedule  # noqa: E402
from helpers import TOLERANCE, ag_specs, lowered_text, random, rel_err, rows_spec, run_sharded  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")

SCHEDULES = ["dma/direct/c1/xladot", "dma/direct/c2/xladot", "dma/direct/c4/xladot/s2", "dma/ring/c2/xladot"]


@pytest.fixture(scope="module")
def meshes():
    d = np.array(jax.devices()[:8])
    return {"tp8": Mesh(d, ("tp",)), "dp2xtp4": Mesh(d[[5, 2, 7, 0, 3, 6, 1, 4]].reshape(2, 4), ("dp", "tp"))}


def _batch(mesh) -> int:
    return mesh.devices.size // mesh.shape["tp"]


@pytest.mark.parametrize("mesh_name", ["tp8", "dp2xtp4"])
@pytest.mark.parametrize("sched", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_equals_reference(meshes, mesh_name, sched, dtype):
    mesh = meshes[mesh_name]
    n, rng = mesh.shape["tp"], np.random.default_rng(1)
    x = random(rng, (_batch(mesh) * n * 8, 24), dtype)  # 8 rows per device
    w = random(rng, (24, n * 5), dtype)

    def both(x, w):
        out, gathered = ficco_jax.ag_matmul(x, w, "tp", schedule=sched, return_gathered=True)
        return out, gathered, ficco_jax.ag_matmul_ref(x.astype(jnp.float32), w.astype(jnp.float32), "tp")

    (in_specs, out_spec) = ag_specs(mesh)
    gathered_spec = rows_spec(mesh)  # every device's [n*m, K] block, stacked
    out, gathered, want = run_sharded(mesh, both, (in_specs, (out_spec, gathered_spec, out_spec)), x, w)
    assert out.dtype == jnp.dtype(dtype)
    assert rel_err(out, want) < TOLERANCE[dtype], sched
    # the gathered operand is the plain all-gather, bit for bit
    ref_gathered = run_sharded(mesh, lambda x: jax.lax.all_gather(x, "tp", tiled=True), ((in_specs[0],), gathered_spec), x)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(ref_gathered))


def test_program_has_one_start_one_finish_and_a_wait_per_peer_chunk(meshes):
    mesh = meshes["tp8"]
    rng = np.random.default_rng(2)
    x, w = random(rng, (8 * 8, 16), "float32"), random(rng, (16, 8 * 4), "float32")
    text = lowered_text(mesh, lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule="dma/direct/c2/xladot"),
                        ag_specs(mesh), x, w)
    assert text.count("ficco_ag_start") == 1 and text.count("ficco_ag_finish") == 1
    assert text.count("ficco_ag_wait") == 7 * 2  # (n - 1) peers x 2 chunks
    assert "ficco_ag_matmul" not in text  # the executor's fused call is not used
    assert text.count("stablehlo.dot_general") == 1 + 7 * 2  # own shard + one per peer chunk


@pytest.mark.parametrize("sched", ["dma/direct/c2/xladot", "dma/ring/c1/xladot"])
def test_gradients_equal_reference(meshes, sched):
    mesh = meshes["dp2xtp4"]
    rng = np.random.default_rng(3)
    x, w = random(rng, (2 * 4 * 8, 12), "float32"), random(rng, (12, 4 * 6), "float32")
    cot = random(rng, (2 * 4 * 8, 4 * 6), "float32")
    in_specs, out_spec = ag_specs(mesh)

    def loss(fn):
        def f(x, w):
            y = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(x, w)
            return jnp.sum(jnp.sin(y) * cot)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    got = loss(lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=sched))(x, w)
    want = loss(lambda x, w: ficco_jax.ag_matmul_ref(x, w, "tp"))(x, w)
    for g, r in zip(got, want):
        assert rel_err(g, r) < TOLERANCE["float32"]


def test_repeated_and_interleaved_sites(meshes):
    """A site run three times by lax.scan (one open call per execution) and a second site in the
    same body: every call opens, waits and finishes under its own key."""
    mesh = meshes["tp8"]
    rng = np.random.default_rng(4)
    x = random(rng, (8 * 4, 16), "float32")
    ws = random(rng, (3, 16, 8 * 2), "float32")
    vs = random(rng, (3, 16, 8 * 2), "float32")

    def body(op, x, ws, vs):
        def layer(h, wv):
            w, v = wv
            a = op(h, w, "tp")
            b = op(h, v, "tp")
            # back to [rows, 16]: keep the local rows and mix the two results
            rows = jax.lax.dynamic_slice_in_dim(a + 0.5 * b, jax.lax.axis_index("tp") * h.shape[0], h.shape[0])
            return jnp.tanh(rows @ jnp.ones((rows.shape[1], 16), rows.dtype) / 4 + h), None
        return jax.lax.scan(layer, x, (ws, vs))[0]

    specs = ((P("tp", None), P(None, None, "tp"), P(None, None, "tp")), P("tp", None))
    ours = lambda x, w, v: body(lambda a, b, ax: ficco_jax.ag_matmul(a, b, ax, schedule="dma/direct/c2/xladot"), x, w, v)  # noqa: E731
    ref = lambda x, w, v: body(ficco_jax.ag_matmul_ref, x, w, v)  # noqa: E731
    got = run_sharded(mesh, ours, specs, x, ws, vs)
    want = run_sharded(mesh, ref, specs, x, ws, vs)
    assert rel_err(got, want) < TOLERANCE["float32"]


@pytest.mark.parametrize("mode", ["skip", "fail"])
def test_a_missing_rank_times_out_naming_it_then_the_op_runs_again(meshes, monkeypatch, mode):
    mesh = meshes["tp8"]
    monkeypatch.setattr(config, "RENDEZVOUS_TIMEOUT_S", 0.5)
    rng = np.random.default_rng(5)
    x, w = random(rng, (8 * 4, 8), "float32"), random(rng, (8, 8 * 2), "float32")

    def program():  # traced and compiled now: the fault switch is read at trace time
        return jax.jit(jax.shard_map(lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule="dma/direct/c2/xladot"),
                                     mesh=mesh, in_specs=ag_specs(mesh)[0], out_specs=ag_specs(mesh)[1])
                       ).lower(x, w).compile()

    want = np.asarray(run_sharded(mesh, lambda x, w: ficco_jax.ag_matmul_ref(x, w, "tp"), ag_specs(mesh), x, w))
    monkeypatch.setattr(config, "FAULT_INJECTION", f"{mode}:3")
    faulty = program()
    monkeypatch.setattr(config, "FAULT_INJECTION", "")
    start = time.monotonic()
    with pytest.raises(Exception, match=rf"missing ranks \[3\]|injected fault '{mode}' on rank 3"):
        jax.block_until_ready(faulty(x, w))
    assert time.monotonic() - start < 0.5 + 4.0
    np.testing.assert_allclose(np.asarray(program()(x, w)), want, rtol=1e-5, atol=1e-6)


def test_schedule_text_validation_and_not_enumerated():
    s = Schedule.parse("dma/direct/c4/xladot/s2")
    assert s.gemm == XLA_DOT and s.copy_streams == 2 and str(s) == "dma/direct/c4/xladot/s2"
    s.validate("ag_matmul", ((64, 8), (8, 16)), 8)
    with pytest.raises(ValueError, match="implemented for ag_matmul with comm='dma' only"):
        Schedule.parse("dma/direct/c2/xladot").validate("matmul_rs", ((64, 8), (8, 16)), 8)
    with pytest.raises(ValueError, match="implemented for ag_matmul with comm='dma' only"):
        Schedule.parse("xla/ring/c2/xladot").validate("ag_matmul", ((64, 8), (8, 16)), 8)
    for op in ("ag_matmul", "matmul_rs"):
        assert all(s.gemm != XLA_DOT for s in Schedule.enumerate(op, 8)), "auto must not pick it before GPU timings"


def test_overlap_with_xla_dots_keeps_them_for_all_gathers_only(meshes):
    """overlap(f, schedule=...xladot): ag sites get XLA's dots, reduce-scatter sites the executor's."""
    mesh = meshes["tp8"]
    rng = np.random.default_rng(6)
    x, w1, w2 = random(rng, (8 * 4, 16), "float32"), random(rng, (16, 8 * 4), "float32"), random(rng, (8 * 4, 16), "float32")
    in_specs = (P("tp", None), P(None, "tp"), P("tp", None))

    def block(x, w1, w2):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(jnp.tanh(h) @ w2, "tp", scatter_dimension=0, tiled=True)

    f = jax.shard_map(block, mesh=mesh, in_specs=in_specs, out_specs=P("tp", None))
    g = ficco_jax.overlap(f, schedule="dma/direct/c2/xladot")
    report = ficco_jax.explain(g, x, w1, w2)
    assert sorted((r.op, r.schedule) for r in report.sites) == [("ag_matmul", "dma/direct/c2/xladot"),
                                                               ("matmul_rs", "dma/direct/c2")], str(report)
    assert rel_err(jax.jit(g)(x, w1, w2), jax.jit(f)(x, w1, w2)) < TOLERANCE["float32"]
