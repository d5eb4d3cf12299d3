"""matmul_psum: psum(y @ w) as a matmul_rs schedule plus the all-gather of the reduced rows.

Origin-coded exact sums first, then every copy-engine schedule against the plain-JAX reference
(the none/xla schedules are in test_ops.py), then gradients in both modes with and without
check_vma, against JAX's own transpose of psum, and the row counts a schedule cannot split.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax.runtime import extension
from helpers import TOLERANCE, operands_and_reference, psum_specs, random, rel_err, run_sharded

M_ROWS, INNER, K = 16, 12, 8  # y [tp*M_ROWS, INNER] per device, w [INNER, K]
needs_extension = pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")


def _mesh(request, tp):
    return request.getfixturevalue("mesh1d" if tp == 8 else "mesh2d")


def _shapes(mesh, rows=None):
    """Global y [dp*rows, tp*INNER], w [tp*INNER, K]: per device y [rows, INNER] (rows = tp*M_ROWS)."""
    tp, dp = mesh.shape["tp"], mesh.devices.size // mesh.shape["tp"]
    rows = tp * M_ROWS if rows is None else rows
    return (dp * rows, tp * INNER), (tp * INNER, K)


def _operands(rng, mesh, dtype="float32", rows=None):
    return tuple(random(rng, shape, dtype) for shape in _shapes(mesh, rows))


def _op(sched, **kwargs):
    return lambda y, w: ficco_jax.matmul_psum(y, w, "tp", schedule=sched, **kwargs)


def _ref(**kwargs):
    return lambda y, w: ficco_jax.matmul_psum_ref(y, w, "tp", **kwargs)


REFERENCE = _ref()  # one object: helpers.operands_and_reference computes it once per mesh and dtype


def _dma_cases():
    for tp in (8, 4):
        for sched in Schedule.enumerate("matmul_psum", tp, comms=("dma",)):
            yield pytest.param(tp, sched, id=f"tp{tp}-{sched}")
        yield pytest.param(tp, Schedule.parse("dma/direct/c2/push"), id=f"tp{tp}-dma/direct/c2/push")


# ------------------------------------------------------------------------------------------------
# Exact: every device's contribution coded in its values
# ------------------------------------------------------------------------------------------------
@needs_extension
@pytest.mark.parametrize("sched", ["dma/direct/c1", "dma/direct/c4/s2", "xla/ring/c2", "xla/bidirectional/c2"])
def test_sum_of_origin_coded_blocks_is_exact(mesh1d, sched):
    """w is 1 on the diagonal of each device's block, so device r contributes (r+1) * 100 + row
    index to every row: the sum over 8 devices is exact in f32 and says which rows arrived where."""
    n, rows = 8, 8 * 4
    y = np.concatenate([np.full((rows, 2), (r + 1) * 100.0) + np.arange(rows)[:, None] for r in range(n)], axis=1)
    w = np.tile(np.eye(2, dtype=np.float32), (n, 1))  # [2n, 2]
    (in_specs, out_spec) = psum_specs(mesh1d)
    out = run_sharded(mesh1d, _op(sched), (in_specs, out_spec), jnp.asarray(y, jnp.float32), jnp.asarray(w))
    want = 100.0 * n * (n + 1) / 2 + n * np.arange(rows)[:, None] * np.ones((1, 2))
    np.testing.assert_array_equal(np.asarray(out), want)


# ------------------------------------------------------------------------------------------------
# Every copy-engine schedule, random f32 / bf16
# ------------------------------------------------------------------------------------------------
@pytest.mark.sweep
@needs_extension
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp,sched", list(_dma_cases()))
def test_copy_engine_schedule_matches_reference(request, tp, sched, dtype):
    mesh = _mesh(request, tp)
    (y, w), want = operands_and_reference(mesh, REFERENCE, psum_specs(mesh), _shapes(mesh), dtype)
    got = run_sharded(mesh, _op(sched), psum_specs(mesh), y, w)
    assert got.dtype == jnp.dtype(dtype)
    assert rel_err(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("sched", ["xla/direct/c2", pytest.param("dma/direct/c2", marks=needs_extension)])
def test_mixed_precision_moves_and_returns_f32(mesh1d, rng, sched):
    y, w = _operands(rng, mesh1d, "bfloat16")
    got = run_sharded(mesh1d, _op(sched, out_dtype=jnp.float32), psum_specs(mesh1d), y, w)
    want = run_sharded(mesh1d, _ref(out_dtype=jnp.float32), psum_specs(mesh1d), y, w)
    assert got.dtype == jnp.float32
    assert rel_err(got, want) < TOLERANCE["float32"]


# ------------------------------------------------------------------------------------------------
# Gradients: JAX's transpose of psum, with check_vma on and off
# ------------------------------------------------------------------------------------------------
GRAD_SCHEDULES = ["none", "xla/ring/c2", "xla/direct/c1", pytest.param("dma/direct/c2/s2", marks=needs_extension)]


def _shard_mapped(mesh, body, check_vma):
    in_specs, out_spec = psum_specs(mesh)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)


@pytest.mark.sweep
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("sched", GRAD_SCHEDULES)
def test_reverse_mode_matches_jax_psum_transpose(mesh2d, rng, sched, check_vma):
    """With check_vma JAX transposes psum to no collective, without it to psum (and divides the
    replicated cotangent at the shard_map boundary): the op's backward follows both."""
    y, w = _operands(rng, mesh2d)
    ct = random(rng, (y.shape[0], K), "float32")

    def loss(body, y, w):
        return jnp.sum(jnp.sin(jax.jit(_shard_mapped(mesh2d, body, check_vma))(y, w)) * ct)

    got = jax.grad(functools.partial(loss, _op(sched)), argnums=(0, 1))(y, w)
    want = jax.grad(functools.partial(loss, _ref()), argnums=(0, 1))(y, w)
    for g, r in zip(got, want, strict=True):
        assert rel_err(g, r) < TOLERANCE["float32"]


@pytest.mark.parametrize("check_vma", [True, False])
def test_backward_inside_the_body_matches_jax(mesh1d, rng, check_vma):
    """The per-device gradients themselves, taken inside the body (no shard_map boundary to scale
    the cotangent): ct @ w^T and y^T @ ct with check_vma, the cotangent summed first without."""
    y, w = _operands(rng, mesh1d)
    ct = random(rng, (y.shape[0], K), "float32")

    def grads(fn):
        def body(y, w, ct):
            return jax.vjp(lambda y, w: fn(y, w), y, w)[1](ct)
        in_specs = (*psum_specs(mesh1d)[0], P())
        f = jax.shard_map(body, mesh=mesh1d, in_specs=in_specs, out_specs=psum_specs(mesh1d)[0], check_vma=check_vma)
        return jax.jit(f)(y, w, ct)

    for g, r in zip(grads(_op("xla/ring/c2")), grads(_ref()), strict=True):
        assert rel_err(g, r) < TOLERANCE["float32"]


@pytest.mark.parametrize("sched", GRAD_SCHEDULES)
def test_forward_mode_and_second_order(mesh1d, rng, sched):
    y, w = _operands(rng, mesh1d)
    dy, dw = random(rng, y.shape, "float32"), random(rng, w.shape, "float32")
    f, ref = (jax.jit(_shard_mapped(mesh1d, body, True)) for body in (_op(sched), _ref()))
    got, want = jax.jvp(f, (y, w), (dy, dw)), jax.jvp(ref, (y, w), (dy, dw))
    for g, r in zip(got, want, strict=True):
        assert rel_err(g, r) < TOLERANCE["float32"]

    def hvp(fn):  # reverse over forward: the jvp's own transpose
        return jax.grad(lambda y: jnp.sum(jax.jvp(fn, (y, w), (dy, dw))[1] ** 2))(y)

    assert rel_err(hvp(f), hvp(ref)) < TOLERANCE["float32"]


def test_vmap_of_a_batch_against_one_weight(mesh1d, rng):
    y, w = _operands(rng, mesh1d)
    batch = jnp.stack([y, 2 * y + 1])
    in_specs, _ = psum_specs(mesh1d)

    def run(fn):
        body = lambda ys, w: jax.vmap(lambda y: fn(y, w))(ys)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh1d, in_specs=(P(None, *in_specs[0]), in_specs[1]),
                                     out_specs=P()))(batch, w)

    assert rel_err(run(_op("xla/ring/c2")), run(_ref())) < TOLERANCE["float32"]


# ------------------------------------------------------------------------------------------------
# Row counts an overlapped schedule cannot split
# ------------------------------------------------------------------------------------------------
def test_rows_not_dividing_by_the_axis_are_a_clear_error(mesh1d, rng):
    y, w = _operands(rng, mesh1d, rows=12)  # 12 rows cannot be reduce-scattered over 8 devices
    with pytest.raises(ValueError, match=r"matmul_psum: .*y.shape\[0\]=12 rows must divide by the axis size 8.*"
                                         r"pad y to 16 rows.*schedule='none'"):
        run_sharded(mesh1d, _op("xla/ring/c1"), psum_specs(mesh1d), y, w)


def test_auto_keeps_the_plain_path_for_such_rows(monkeypatch, mesh1d, rng):
    """'auto' deciding as on a GPU never picks a schedule the rows cannot take."""
    from ficco_jax.tuning import policy

    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)
    y, w = _operands(rng, mesh1d, rows=12)
    assert ficco_jax.ops.resolve_schedule("matmul_psum", "auto", ((12, INNER), (INNER, K)), jnp.float32, 8) == \
        Schedule(comm="none")
    got = run_sharded(mesh1d, _op("auto"), psum_specs(mesh1d), y, w)
    assert rel_err(got, run_sharded(mesh1d, _ref(), psum_specs(mesh1d), y, w)) < TOLERANCE["float32"]
