"""The DMA executor on real GPUs: copy-engine pulls, cuBLASLt chunk matmuls, events and joins.

Skips unless at least two CUDA GPUs are visible and ficco_jax._ffi was built with CUDA.
Run: python -m pytest tests/gpu -x -q
"""
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from ficco_jax import dma
from ficco_jax.schedule import Schedule
from gpu_common import GPU_MARKS, GPUS
from helpers import ffi_calls, max_rel_err


pytestmark = GPU_MARKS

# (rows per device m, K, N per device): small, and medium enough for several cuBLASLt tiles.
SHAPES = {"small": (64, 128, 64), "medium": (1024, 2048, 1024)}
BF16_TOL = 2e-2


def _mesh():
    return Mesh(np.array(GPUS), ("tp",))


def _poison_gpus(nbytes=256 << 20):
    """Fill and free device memory with NaN so a missing write shows up as NaN."""
    for d in GPUS:
        jax.device_put(jnp.full((nbytes // 4,), jnp.nan, jnp.float32), d).block_until_ready().delete()


def _ag(mesh, sched):
    def per_device(x, w):
        return dma.ag_matmul_dma(x, w, "tp", sched)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=(P("tp"), P("tp"))))


def _ag_ref(mesh):
    def per_device(x, w):
        g = jax.lax.all_gather(x, "tp", tiled=True)
        return jnp.dot(g, w, preferred_element_type=jnp.float32), g
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=(P("tp"), P("tp"))))


def _rs(mesh, sched):
    def per_device(y, w):
        return dma.matmul_rs_dma(y, w, "tp", sched)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp")))


def _rs_ref(mesh):
    def per_device(y, w):
        part = jnp.dot(y, w, preferred_element_type=jnp.float32)
        return jax.lax.psum_scatter(part, "tp", scatter_dimension=0, tiled=True)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp")))


def _cases(op):
    n = len(GPUS)
    for shape in SHAPES:
        for pulled in Schedule.enumerate(op, n, comms=("dma",)) if n >= 2 else []:
            for sched in (pulled, pulled.replace(transfer="push")):  # every point pulled and pushed
                cut = SHAPES[shape][2] if sched.gemm == "columns" else SHAPES[shape][0]  # what the chunks cut
                if cut % sched.chunks == 0:
                    yield pytest.param(shape, sched, id=f"{shape}-{sched}")


@pytest.mark.parametrize("shape,sched", list(_cases("ag_matmul")))
def test_ag_matmul_gpu(shape, sched):
    mesh, n = _mesh(), len(GPUS)
    m, k, cols = SHAPES[shape]
    rng = np.random.default_rng(zlib.crc32(f"{shape}{sched}".encode()))
    x = jnp.asarray(rng.standard_normal((n * m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n * cols)) / np.sqrt(k), jnp.bfloat16)
    _poison_gpus()
    out, gathered = _ag(mesh, sched)(x, w)
    out_ref, gathered_ref = _ag_ref(mesh)(x, w)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(gathered_ref))
    assert max_rel_err(out, out_ref) < BF16_TOL


@pytest.mark.parametrize("shape,sched", list(_cases("matmul_rs")))
def test_matmul_rs_gpu(shape, sched):
    mesh, n = _mesh(), len(GPUS)
    m, k, cols = SHAPES[shape]  # y [n*m, k] per device, w [k, cols]
    rng = np.random.default_rng(zlib.crc32(f"rs{shape}{sched}".encode()))
    y = jnp.asarray(rng.standard_normal((n * m, n * k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n * k, cols)) / np.sqrt(n * k), jnp.bfloat16)
    _poison_gpus()
    out = _rs(mesh, sched)(y, w)
    out_ref = _rs_ref(mesh)(y, w)
    assert max_rel_err(out, out_ref) < BF16_TOL


def _psum_fn(mesh, body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))


@pytest.mark.parametrize("shape,sched", list(_cases("matmul_psum")))
def test_matmul_psum_gpu(shape, sched):
    """The public op: its matmul_rs on copy engines, then dma.all_gather of the reduced rows; and
    its gradient, against matmul + psum."""
    mesh, n = _mesh(), len(GPUS)
    m, k, cols = SHAPES[shape]  # y [n*m, k] per device, w [k, cols]
    rng = np.random.default_rng(zlib.crc32(f"psum{shape}{sched}".encode()))
    y = jnp.asarray(rng.standard_normal((n * m, n * k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n * k, cols)) / np.sqrt(n * k), jnp.bfloat16)
    op = _psum_fn(mesh, lambda y, w: ficco_jax.matmul_psum(y, w, "tp", schedule=sched, out_dtype=jnp.float32))
    ref = _psum_fn(mesh, lambda y, w: ficco_jax.matmul_psum_ref(y, w, "tp", out_dtype=jnp.float32))
    _poison_gpus()
    assert max_rel_err(op(y, w), ref(y, w)) < BF16_TOL
    ct = jnp.asarray(rng.standard_normal((n * m, cols)), jnp.float32)
    got, want = (jax.vjp(f, y, w)[1](ct) for f in (op, ref))
    for g, r in zip(got, want):
        assert max_rel_err(g, r) < BF16_TOL


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("sched", [None, "dma/direct/c2/push"])
def test_collectives_gpu(axis, sched):
    mesh, n = _mesh(), len(GPUS)
    rng = np.random.default_rng(axis)
    x = jnp.asarray(rng.standard_normal((n * 256, 4 * n, 64)), jnp.bfloat16)
    ag = jax.jit(jax.shard_map(lambda a: dma.all_gather(a, "tp", axis=axis, schedule=sched), mesh=mesh,
                               in_specs=P("tp"), out_specs=P("tp")))
    ag_ref = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "tp", axis=axis, tiled=True), mesh=mesh,
                                   in_specs=P("tp"), out_specs=P("tp")))
    np.testing.assert_array_equal(np.asarray(ag(x)), np.asarray(ag_ref(x)))
    rs = jax.jit(jax.shard_map(lambda a: dma.reduce_scatter(a, "tp", scatter_dimension=1, schedule=sched), mesh=mesh,
                               in_specs=P("tp"), out_specs=P("tp")))
    rs_ref = jax.jit(jax.shard_map(
        lambda a: jax.lax.psum_scatter(a.astype(jnp.float32), "tp", scatter_dimension=1, tiled=True),
        mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    assert max_rel_err(rs(x), rs_ref(x)) < BF16_TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rows,cols,schedule", [(3, 7, None), (16, 9, "dma/direct/c4"), (64, 256, None),
                                                (64, 256, "dma/direct/c4"), (40, 24, "dma/direct/c2")])
def test_reduce_scatter_sizes_gpu(dtype, rows, cols, schedule):
    """The sum kernel's two paths: 16-byte packs where every operand is aligned, one element at a
    time otherwise (odd sizes, chunk offsets that break the alignment), and the tail of a pack."""
    mesh, n = _mesh(), len(GPUS)
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{rows}{cols}{schedule}".encode()))
    x = jnp.asarray(rng.standard_normal((n * n * rows, cols)), dtype)
    ours = jax.jit(jax.shard_map(lambda a: dma.reduce_scatter(a, "tp", schedule=schedule), mesh=mesh,
                                 in_specs=P("tp"), out_specs=P("tp")))
    ref = jax.jit(jax.shard_map(lambda a: jax.lax.psum_scatter(a.astype(jnp.float32), "tp", tiled=True), mesh=mesh,
                                in_specs=P("tp"), out_specs=P("tp")))
    _poison_gpus(16 << 20)
    tol = 1e-6 if dtype == "float32" else BF16_TOL
    assert max_rel_err(ours(x), ref(x)) < tol


@pytest.mark.parametrize("transfer", ["pull", "push"])
def test_back_to_back_calls_gpu(transfer):
    """200 calls in a row: event-pool reuse, occurrence counting and joins under pressure."""
    mesh, n = _mesh(), len(GPUS)
    m, k, cols = SHAPES["small"]
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((n * m, k)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((k, n * cols)) / np.sqrt(k), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((n * cols, k)) / np.sqrt(n * cols), jnp.bfloat16)
    s_ag, s_rs = Schedule.parse("dma/direct/c4/s2" if n > 2 else "dma/direct/c4"), Schedule.parse("dma/direct/c2")
    s_ag, s_rs = s_ag.replace(transfer=transfer), s_rs.replace(transfer=transfer)

    def layer(ag, rs, a, b1, b2):
        out, _ = ag(a, b1)
        return rs(out, b2)

    def build(ag, rs):
        return jax.jit(jax.shard_map(lambda a, b1, b2: layer(ag, rs, a, b1, b2), mesh=mesh,
                                     in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp")))

    ours = build(lambda a, b: dma.ag_matmul_dma(a, b, "tp", s_ag), lambda a, b: dma.matmul_rs_dma(a, b, "tp", s_rs))
    ref = build(lambda a, b: (jax.lax.all_gather(a, "tp", tiled=True) @ b, None),
                lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True))
    expected = np.asarray(ref(x, w1, w2), np.float32)
    results = [ours(x, w1, w2) for _ in range(200)]
    for i, result in enumerate(results):
        assert max_rel_err(result, expected) < BF16_TOL, f"call {i}"


@pytest.mark.parametrize("sched", ["dma/direct/c1", "dma/direct/c2", "dma/direct/c4", "dma/direct/c4/push",
                                   "dma/direct/c4/grouped", "dma/direct/c2/columns", "dma/direct/c4/columns"])
def test_fp8_matmul_rs_gpu(sched):
    """FP8 matmul_rs with bf16 results: per-chunk schedules add the received partial in the own block's
    FP8 matmuls (cuBLASLt's C, bf16), the others sum after; all equal the plain path's."""
    mesh = _mesh()
    rng = np.random.default_rng(11)
    n = len(GPUS)
    y8 = jnp.asarray(rng.standard_normal((256 * n, 512 * n)), jnp.float8_e4m3fn)
    w8 = jnp.asarray(rng.standard_normal((512 * n, 384)) / 16, jnp.float8_e4m3fn)

    def run(schedule):
        one = lambda a, b: ficco_jax.matmul_rs(a, b, "tp", x_scale=jnp.float32(0.5),  # noqa: E731
                                               w_scale=jnp.float32(0.25), out_dtype=jnp.bfloat16, schedule=schedule)
        return jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                     out_specs=P("tp")))(y8, w8)

    assert max_rel_err(run(sched), run("none")) < BF16_TOL


def test_collective_and_fp8_op_under_vmap_gpu():
    """vmap of a copy-engine collective and of an FP8 op on GPUs: one executor call on the whole
    batch (the batch joins a dimension the collective does not exchange, or the FP8 op's rows)."""
    import ficco_jax

    mesh = _mesh()
    rng = np.random.default_rng(7)
    n = len(GPUS)
    x = jnp.asarray(rng.standard_normal((3, 64 * n, 128)), jnp.bfloat16)
    gather = jax.vmap(lambda v: dma.all_gather(v, "tp", schedule="dma/direct/c1"))
    f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, None), check_vma=False))
    np.testing.assert_array_equal(np.asarray(f(x), np.float32), np.asarray(x, np.float32))
    assert ffi_calls(f.lower(x).compile().as_text()) == 1

    x8 = jnp.asarray(rng.standard_normal((3, 64 * n, 256)), jnp.float8_e4m3fn)
    w8 = jnp.asarray(rng.standard_normal((256, 64 * n)), jnp.float8_e4m3fn)

    def batched(schedule):
        one = lambda a, b: ficco_jax.ag_matmul(a, b, "tp", x_scale=jnp.float32(0.5),  # noqa: E731
                                               w_scale=jnp.float32(0.25), schedule=schedule)
        return jax.jit(jax.shard_map(jax.vmap(one, in_axes=(0, None)), mesh=mesh,
                                     in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp")))

    got = batched("dma/direct/c2")(x8, w8)
    want = batched("none")(x8, w8)
    assert max_rel_err(got, want) < BF16_TOL
    assert ffi_calls(batched("dma/direct/c2").lower(x8, w8).compile().as_text()) == 1
