"""The DMA executor on 8 virtual CPU devices: rendezvous, chunk indexing, ordering, joins.

Origin-coded exact tests come first (every value says which rank and element it came from),
then random f32/bf16 against the plain-JAX references, for every dma schedule.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax import config, dma  # noqa: E402
from ficco_jax.lowering.dma import groups, registry  # noqa: E402
from ficco_jax.runtime import extension as _ext  # noqa: E402
from ficco_jax.schedule import Schedule  # noqa: E402
from helpers import ffi_calls, ffi_position, max_rel_err, operands_and_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")

# max |out - ref| / max |ref|, per dtype (bf16: a few roundings of the f32 result).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}
POISON = -7777.0


def _meshes():
    devices = np.array(jax.devices()[:8])
    permuted = devices[[5, 2, 7, 0, 3, 6, 1, 4]].reshape(2, 4)  # ordinals != tp ranks
    return {"1d": Mesh(devices, ("tp",)), "2d": Mesh(permuted, ("dp", "tp"))}


MESHES = _meshes()
#: Two devices, the group the shipped 2-GPU profiles pick column chunks for; ordinals differ from ranks.
PAIR = Mesh(np.array(jax.devices()[:8])[[6, 3]], ("tp",))


def _all_axes(mesh):
    return mesh.axis_names if len(mesh.axis_names) > 1 else mesh.axis_names[0]


def _poison_heap(*shapes):
    """Fill freshly freed host buffers with POISON so that a missing write shows up as POISON."""
    for shape in shapes:
        jax.block_until_ready(jnp.full(shape, POISON, jnp.float32)).delete()


def _run(mesh, fn, in_specs, *args):
    """Run fn per device; every output is concatenated over all devices along dim 0."""
    spec = P(_all_axes(mesh))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=True))
    return jax.tree.map(np.asarray, f(*args))


def _origin_coded(mesh, rows, cols):
    """Global [devices*rows, cols]: block of mesh position p holds p*1000 + element index."""
    n_dev = mesh.devices.size
    index = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    return np.concatenate([p * 1000 + index for p in range(n_dev)])


def _schedules(op, n):
    return Schedule.enumerate(op, n, comms=("dma",))


def _cases(op, dtypes):
    """(mesh, dtype, schedule, channel): every f32 point is also pushed and run symmetric, and a matmul_rs
    point pulled on its group's channel (`channel`: config.CHANNEL_BYTES = CHANNEL_BYTES) as well as with
    meetings."""
    for mesh_name, mesh in MESHES.items():
        n = mesh.shape["tp"]
        for dtype in dtypes:
            for sched in _schedules(op, n):
                # bf16 on the 1-D mesh only at c1/c8 to keep the suite fast.
                if dtype == jnp.bfloat16 and mesh_name == "1d" and sched.chunks not in (1, 8):
                    continue
                name = f"{mesh_name}-{jnp.dtype(dtype).name}-{sched}"
                yield pytest.param(mesh_name, dtype, sched, False, id=name)
                # Every point pushed and met as well (f32; bf16 changes the rounding, not the indexing).
                if dtype == jnp.float32 and sched.transfer == "pull":
                    for transfer in ("push", "symmetric"):
                        moved = sched.replace(transfer=transfer)
                        yield pytest.param(mesh_name, dtype, moved, False,
                                           id=f"{mesh_name}-{jnp.dtype(dtype).name}-{moved}")
                    if op == "matmul_rs":
                        yield pytest.param(mesh_name, dtype, sched, True, id=f"{name}-channel")


#: The group channel's limit the channel tests set (config.CHANNEL_BYTES; 0, its default, is off).
CHANNEL_BYTES = 8 << 20


@pytest.fixture
def channel(request, monkeypatch):
    """Small matmul_rs calls traced in the test run on their group's channel when the test's
    `channel` parameter is true (config.CHANNEL_BYTES = CHANNEL_BYTES), else they meet."""
    if request.param:
        monkeypatch.setattr(config, "CHANNEL_BYTES", CHANNEL_BYTES)
    return request.param


# ------------------------------------------------------------------------------------------------
# Origin-coded, exact
# ------------------------------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
@pytest.mark.parametrize("sched", ["dma/direct/c1", "dma/ring/c2", "dma/direct/c4/s2", "dma/direct/c8/s4",
                                   "dma/direct/c1/push", "dma/direct/c4/s2/push", "dma/direct/c8/s4/push",
                                   "dma/ring/c2/symmetric", "dma/direct/c8/s4/symmetric"])
def test_all_gather_origin_coded(mesh_name, sched):
    mesh = MESHES[mesh_name]
    if mesh.shape["tp"] < 8 and "/s4" in sched:
        sched = sched.replace("/s4", "/s2")
    x = _origin_coded(mesh, 8, 3)
    _poison_heap(x.shape, (len(x) * 8, 3))
    out = _run(mesh, lambda a: dma.all_gather(a, "tp", schedule=sched), P(_all_axes(mesh)), x)
    ref = _run(mesh, lambda a: jax.lax.all_gather(a, "tp", tiled=True), P(_all_axes(mesh)), x)
    np.testing.assert_array_equal(out, ref)
    # Decode origins directly for mesh position 0: its gathered rows are the tp group of position 0.
    n = mesh.shape["tp"]
    np.testing.assert_array_equal(out[: 8 * n] // 1000, np.repeat(np.arange(n), 8)[:, None] * np.ones((1, 3)))


@pytest.mark.sweep
@pytest.mark.parametrize("channel", [False, True], indirect=True)
@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
@pytest.mark.parametrize("sched", ["dma/direct/c1", "dma/direct/c2/grouped/s2", "dma/direct/c4/s2",
                                   "dma/direct/c1/push", "dma/direct/c2/grouped/s2/push", "dma/direct/c4/push",
                                   "dma/direct/c1/symmetric", "dma/direct/c2/grouped/s2/symmetric"])
def test_matmuls_origin_coded(mesh_name, sched, channel):
    """With w = identity both ops are exact in f32: out = gathered rows, and sums of coded blocks."""
    mesh = MESHES[mesh_name]
    n = mesh.shape["tp"]
    x = _origin_coded(mesh, 32, 4)
    eye = np.tile(np.eye(4, dtype=np.float32), (1, n))  # w [4, 4n]: each device gets I_4
    spec, wspec = P(_all_axes(mesh)), P(None, "tp")
    s = Schedule.parse(sched)
    _poison_heap((len(x) * n, 4))

    out, gathered = _run(mesh, lambda a, w: dma.ag_matmul_dma(a, w, "tp", s), (spec, wspec), x, eye)
    ref = _run(mesh, lambda a: jax.lax.all_gather(a, "tp", tiled=True), spec, x)
    np.testing.assert_array_equal(gathered, ref)
    np.testing.assert_array_equal(out, ref)

    rs = _run(mesh, lambda a, w: dma.matmul_rs_dma(a, w, "tp", s), (spec, wspec), x, eye)
    rs_ref = _run(mesh, lambda a: jax.lax.psum_scatter(a, "tp", scatter_dimension=0, tiled=True), spec, x)
    np.testing.assert_array_equal(rs, rs_ref)


@pytest.mark.sweep
@pytest.mark.parametrize("channel", [False, True], indirect=True)
@pytest.mark.parametrize("mesh_name", ["1d", "2d", "pair"])
@pytest.mark.parametrize("sched", ["dma/direct/c2/columns", "dma/direct/c4/columns/s2", "dma/direct/c4/columns/push",
                                   "dma/direct/c4/columns/s2/symmetric"])
def test_column_chunks_origin_coded(mesh_name, sched, channel):
    """gemm=columns: chunk j of a block is its columns [j N/c, (j+1) N/c), all of its rows. With w = identity
    the reduce-scatter is exact, so every column of every coded block must land in its place."""
    mesh = PAIR if mesh_name == "pair" else MESHES[mesh_name]
    n = mesh.shape["tp"]
    x = _origin_coded(mesh, 32, 8)
    eye = np.tile(np.eye(8, dtype=np.float32), (n, 1))  # w [8n, 8]: each device gets I_8
    spec = P(_all_axes(mesh))
    _poison_heap((len(x), 8))
    y_spec = P(_all_axes(mesh), None)
    rs = _run(mesh, lambda a, w: dma.matmul_rs_dma(a, w, "tp", Schedule.parse(sched)), (y_spec, P("tp", None)),
              x, eye)
    rs_ref = _run(mesh, lambda a: jax.lax.psum_scatter(a, "tp", scatter_dimension=0, tiled=True), spec, x)
    np.testing.assert_array_equal(rs, rs_ref)


@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
def test_column_chunks_gradients(mesh_name, rng):
    """matmul_rs on column chunks under jax.grad: its backward, an all-gather then matmul, cuts rows into as
    many chunks (ops/resolve.transposed_schedule), and both gradients equal the reference's."""
    mesh = MESHES[mesh_name]
    n = mesh.shape["tp"]
    y = jnp.asarray(rng.standard_normal((mesh.devices.size * 8, 12 * n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((12 * n, 16)), jnp.float32)
    specs = (P(None, "tp") if mesh_name == "1d" else P("dp", "tp"), P("tp", None))
    out_spec = P("tp") if mesh_name == "1d" else P(("dp", "tp"))

    def loss(fn, a, b):
        f = jax.shard_map(lambda a, b: fn(a, b, "tp"), mesh=mesh, in_specs=specs, out_specs=out_spec)
        return jnp.sum(jnp.sin(f(a, b)) ** 2)

    ours = functools.partial(ficco_jax.matmul_rs, schedule="dma/direct/c4/columns")
    got = jax.jit(jax.value_and_grad(functools.partial(loss, ours), argnums=(0, 1)))(y, w)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, ficco_jax.matmul_rs_ref), argnums=(0, 1)))(y, w)
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    for g, r in zip(got[1], want[1]):
        assert max_rel_err(g, r) < 1e-5
    text = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1))).lower(y, w).as_text()
    calls = {name: attrs for name, attrs in re.findall(r"custom_call @(ficco_\w+)\(.*?\{(.*)", text)}
    assert set(calls) == {"ficco_matmul_rs", "ficco_ag_matmul"}, sorted(calls)
    assert "gemm = 2 : i64" in calls["ficco_matmul_rs"] and "chunks = 4 : i64" in calls["ficco_matmul_rs"]
    assert "gemm = 0 : i64" in calls["ficco_ag_matmul"] and "chunks = 4 : i64" in calls["ficco_ag_matmul"]


# ------------------------------------------------------------------------------------------------
# Every dma schedule, random f32 / bf16
# ------------------------------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("mesh_name,dtype,sched,channel", list(_cases("ag_matmul", (jnp.float32, jnp.bfloat16))),
                         indirect=["channel"])
def test_ag_matmul_every_schedule(mesh_name, dtype, sched, channel, rng):
    mesh = MESHES[mesh_name]
    n, m, k, cols = mesh.shape["tp"], 16, 24, 8
    x = jnp.asarray(rng.standard_normal((mesh.devices.size * m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, cols * n)), dtype)
    spec, wspec = P(_all_axes(mesh)), P(None, "tp")
    _poison_heap((mesh.devices.size * n * m, cols))
    out, gathered = _run(mesh, lambda a, b: dma.ag_matmul_dma(a, b, "tp", sched), (spec, wspec), x, w)

    def ref(a, b):
        g = jax.lax.all_gather(a, "tp", tiled=True)
        return jnp.dot(g.astype(jnp.float32), b.astype(jnp.float32)), g

    out_ref, gathered_ref = _run(mesh, ref, (spec, wspec), x, w)
    np.testing.assert_array_equal(gathered, gathered_ref)
    assert out.dtype == jnp.dtype(dtype)
    assert max_rel_err(out, out_ref) < TOLERANCE[dtype], sched


def _matmul_rs_reference(a, b):
    return jax.lax.psum_scatter(jnp.dot(a, b), "tp", scatter_dimension=0, tiled=True)


@pytest.mark.sweep
@pytest.mark.parametrize("mesh_name,dtype,sched,channel", list(_cases("matmul_rs", (jnp.float32, jnp.bfloat16))),
                         indirect=["channel"])
def test_matmul_rs_every_schedule(mesh_name, dtype, sched, channel):
    mesh = MESHES[mesh_name]
    n, m, inner, k = mesh.shape["tp"], 8, 12, 16
    specs = (P(_all_axes(mesh)), P("tp", None)), P(_all_axes(mesh))
    # y [n*m, inner] per device (rows of every target), w [inner, k]; the reference from their f32 values
    (y, w), out_ref = operands_and_reference(mesh, _matmul_rs_reference, specs,
                                             ((mesh.devices.size * n * m, inner), (inner * n, k)), jnp.dtype(dtype).name)

    def per_device(a, b):
        return dma.matmul_rs_dma(a, b, "tp", sched)

    _poison_heap((mesh.devices.size * m, k))
    out = _run(mesh, per_device, specs[0], y, w)
    assert out.dtype == jnp.dtype(dtype)
    assert max_rel_err(out, out_ref) < TOLERANCE[dtype], sched


# ------------------------------------------------------------------------------------------------
# Standalone collectives, non-leading axes, gradients
# ------------------------------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("sched", [None, "dma/direct/c1/s2/push"])
def test_collectives_any_axis(mesh_name, axis, sched, rng):
    mesh = MESHES[mesh_name]
    n = mesh.shape["tp"]
    x = jnp.asarray(rng.standard_normal((mesh.devices.size * 4, 2 * n, n)), jnp.float32)
    spec = P(_all_axes(mesh))
    ag = _run(mesh, lambda a: dma.all_gather(a, "tp", axis=axis, schedule=sched), spec, x)
    ag_ref = _run(mesh, lambda a: jax.lax.all_gather(a, "tp", axis=axis, tiled=True), spec, x)
    np.testing.assert_array_equal(ag, ag_ref)
    dim = axis if axis != 0 else 1  # scatter a dimension divisible by n
    rs = _run(mesh, lambda a: dma.reduce_scatter(a, "tp", scatter_dimension=dim, schedule=sched), spec, x)
    rs_ref = _run(mesh, lambda a: jax.lax.psum_scatter(a, "tp", scatter_dimension=dim % 3, tiled=True), spec, x)
    assert max_rel_err(rs, rs_ref) < 1e-6


def test_all_gather_int_dtype():
    mesh = MESHES["1d"]
    x = jnp.arange(8 * 4 * 5, dtype=jnp.int32).reshape(32, 5)
    out = _run(mesh, lambda a: dma.all_gather(a, "tp"), P("tp"), x)
    np.testing.assert_array_equal(out, np.tile(np.asarray(x), (8, 1)))


@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
@pytest.mark.parametrize("sched", [None, "dma/direct/c4/s2/push"])
def test_collective_gradients(mesh_name, sched, rng):
    mesh = MESHES[mesh_name]
    x = jnp.asarray(rng.standard_normal((mesh.devices.size * 8, 6)), jnp.float32)
    spec = P(_all_axes(mesh))

    def loss(gather, scatter, a):
        def per_device(b):
            g = gather(b)
            return scatter(jnp.sin(g) * g)
        f = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)
        return jnp.sum(f(a) ** 2)

    ours = jax.jit(jax.grad(functools.partial(
        loss, lambda b: dma.all_gather(b, "tp", schedule=sched),
        lambda b: dma.reduce_scatter(b, "tp", schedule=sched))))(x)
    ref = jax.jit(jax.grad(functools.partial(
        loss, lambda b: jax.lax.all_gather(b, "tp", tiled=True),
        lambda b: jax.lax.psum_scatter(b, "tp", tiled=True))))(x)
    assert max_rel_err(ours, ref) < 1e-5


# ------------------------------------------------------------------------------------------------
# Occurrences, chaining and joins
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transfer", ["pull", "push"])
def test_ops_inside_scan(rng, transfer):
    """The same two call sites run 3 times in one launch: each execution meets its peers once."""
    mesh = MESHES["2d"]
    n, m, k, hidden = 4, 8, 16, 8
    x = jnp.asarray(rng.standard_normal((8 * m, k)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((3, k, hidden * n)) / 4, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((3, hidden * n, k)) / 4, jnp.float32)
    spec, specs_w = P(("dp", "tp")), (P(None, None, "tp"), P(None, "tp", None))
    s_ag, s_rs = (Schedule.parse(s).replace(transfer=transfer) for s in ("dma/ring/c2", "dma/direct/c2/s2"))

    def layers(ag, rs, a, b1, b2):
        def step(h, ws):
            out, _ = ag(h, ws[0])
            return rs(jnp.tanh(out), ws[1]), None
        return jax.lax.scan(step, a, (b1, b2))[0]

    ours = _run(mesh, functools.partial(layers, lambda h, w: dma.ag_matmul_dma(h, w, "tp", s_ag),
                                        lambda h, w: dma.matmul_rs_dma(h, w, "tp", s_rs)),
                (spec, *specs_w), x, w1, w2)
    ref = _run(mesh, functools.partial(layers, lambda h, w: (jax.lax.all_gather(h, "tp", tiled=True) @ w, None),
                                       lambda h, w: jax.lax.psum_scatter(h @ w, "tp", tiled=True)),
               (spec, *specs_w), x, w1, w2)
    assert max_rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("suffix", ["", "/push"])
def test_chained_ops_and_buffer_reuse(rng, suffix):
    """Each op reads the previous op's output, whose buffer XLA may reuse right after the call."""
    mesh = MESHES["1d"]
    x = jnp.asarray(rng.standard_normal((8 * 8, 4)), jnp.float32)

    def chain(gather, scatter, a):
        for _ in range(3):
            g = gather(a)
            a = scatter(g * 2.0) - a  # a's buffer is dead after this line
            a = a.at[0].set(a[0] + 1.0)
        return a

    ours = _run(mesh, functools.partial(chain, lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c2/s2" + suffix),
                                        lambda a: dma.reduce_scatter(a, "tp", schedule="dma/ring/c4" + suffix)),
                P("tp"), x)
    ref = _run(mesh, functools.partial(chain, lambda a: jax.lax.all_gather(a, "tp", tiled=True),
                                       lambda a: jax.lax.psum_scatter(a, "tp", tiled=True)), P("tp"), x)
    assert max_rel_err(ours, ref) < 1e-5


# ------------------------------------------------------------------------------------------------
# The FFI target directly, and errors
# ------------------------------------------------------------------------------------------------
def _direct_attrs(groups, gemm=0, copy_streams=2, w_col_major=0):
    flat = groups.reshape(-1).astype(np.int64)
    return dict(ficco_abi=np.int64(_ext.CONTRACT_VERSION), op_id=np.int64(10**9), groups=flat, devices=flat,
                ipc_job=np.int64(0),
                group_size=np.int64(groups.shape[1]), chunks=np.int64(2), order=np.int64(1), gemm=np.int64(gemm),
                copy_streams=np.int64(copy_streams), timeout_ms=np.int64(5000), watchdog_ms=np.int64(0),
                site="test_dma.py", skip_own_rows=np.int64(0), transfer=np.int64(0),
                w_col_major=np.int64(w_col_major), channel_bytes=np.int64(1 << 20))


def _direct_all_gather(groups, x, gemm=0, copy_streams=2):
    n = groups.shape[1]
    call = jax.ffi.ffi_call("ficco_all_gather", jax.ShapeDtypeStruct((n * x.shape[0], *x.shape[1:]), x.dtype))
    return call(ffi_position(), x, **_direct_attrs(groups, gemm=gemm, copy_streams=copy_streams))


def test_direct_ffi_target():
    mesh = MESHES["1d"]
    x = _origin_coded(mesh, 4, 2)
    groups = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int64)
    out = _run(mesh, lambda a: _direct_all_gather(groups, a), P("tp"), x)
    expected = np.concatenate([np.concatenate([x[4 * d: 4 * d + 4] for d in g] * 4) for g in groups])
    np.testing.assert_array_equal(out, expected)


def test_direct_ffi_target_refuses_column_chunks_of_a_gather():
    mesh = MESHES["1d"]
    groups = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int64)
    with pytest.raises(Exception, match="gemm=columns cuts the columns of a reduce-scatter's blocks"):
        _run(mesh, lambda a: _direct_all_gather(groups, a, gemm=2), P("tp"), np.zeros((32, 2), np.float32))


@pytest.mark.parametrize("copy_streams", [9, 2**32])
def test_direct_ffi_target_refuses_more_copy_streams_than_a_device_has(copy_streams):
    mesh = MESHES["1d"]
    groups = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int64)
    x = np.random.default_rng(0).standard_normal((32, 2)).astype(np.float32)
    with pytest.raises(Exception, match=rf"copy_streams={copy_streams}: a device has at most 8 copy streams"):
        _run(mesh, lambda a: _direct_all_gather(groups, a, copy_streams=copy_streams), P("tp"), x)


@pytest.mark.parametrize("x_dtype, w_dtype, found", [
    (jnp.bfloat16, jnp.bfloat16, "bfloat16"), (jnp.float8_e4m3fn, jnp.bfloat16, "bfloat16"),
    (jnp.float32, jnp.float8_e4m3fn, "float32"),
])
def test_direct_fp8_target_refuses_operands_that_are_not_fp8(x_dtype, w_dtype, found):
    """The scaled targets multiply FP8 operands; any other dtype is refused by name, not multiplied."""
    mesh = MESHES["1d"]
    groups = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int64)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 8)), x_dtype)
    w = jnp.asarray(rng.standard_normal((8, 4)), w_dtype)
    scale = jnp.ones((), jnp.float32)

    def body(a, b):
        call = jax.ffi.ffi_call("ficco_ag_matmul_scaled", (jax.ShapeDtypeStruct((4 * a.shape[0], 4), jnp.bfloat16),
                                                           jax.ShapeDtypeStruct((4 * a.shape[0], 8), a.dtype)))
        return call(ffi_position(), a, b, scale, scale, **_direct_attrs(groups, w_col_major=1))[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"), check_vma=False))
    with pytest.raises(Exception, match=rf"unsupported dtype {found}; expected float8_e4m3fn or float8_e5m2"):
        jax.block_until_ready(f(x, w))


def test_direct_ffi_target_device_not_in_groups():
    mesh = MESHES["1d"]
    groups = np.array([[0, 1, 2, 3]], np.int64)  # positions 4..7 are in no group
    with pytest.raises(Exception, match="is in no group of this op"):
        _run(mesh, lambda a: _direct_all_gather(groups, a), P("tp"), np.zeros((32, 2), np.float32))


def test_clear_errors():
    mesh = MESHES["1d"]
    with pytest.raises(TypeError, match="copy engines sum dtypes"):
        _run(mesh, lambda a: dma.reduce_scatter(a, "tp"), P("tp"), np.zeros((64, 2), np.int32))
    with pytest.raises(NotImplementedError, match="tiled=True"):
        _run(mesh, lambda a: dma.all_gather(a, "tp", tiled=False), P("tp"), np.zeros((64, 2), np.float32))
    with pytest.raises(TypeError, match="one mesh axis name"):
        _run(MESHES["2d"], lambda a: dma.all_gather(a, ("dp", "tp")), P(("dp", "tp")), np.zeros((64, 2), np.float32))


def test_push_across_processes_is_refused_at_lowering(monkeypatch):
    """A group across processes (ipc_job != 0) can only pull: the lowering says so and names the
    pulled schedule. (Real spanning groups need GPUs; here the group attributes are forged.)"""
    real = groups.group_attrs

    def spanning(*args, **kwargs):
        return dict(real(*args, **kwargs), ipc_job=7)

    monkeypatch.setattr(groups, "group_attrs", spanning)
    with pytest.raises(ValueError, match=r"pushes into the peers' buffers.*spans processes.*'dma/direct/c2'"):
        _run(MESHES["1d"], lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c2/push"), P("tp"),
             np.ones((64, 2), np.float32))


def _skip_case(rng):
    """(mesh, n, schedule, x, w, in_specs) of the own-rows skip tests: random f32 x [n*m, K], w [K, n*cols]."""
    mesh = MESHES["1d"]
    n, m, k, cols = mesh.shape["tp"], 8, 16, 4
    x = jnp.asarray(rng.standard_normal((n * m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, cols * n)), jnp.float32)
    return mesh, n, Schedule.parse("dma/direct/c2"), x, w, (P("tp", None), P(None, "tp"))


def test_ag_matmul_skips_its_own_rows_only_when_nobody_reads_gathered(rng):
    # The plain forward drops `gathered`: its own rows are not copied in (skip_own_rows = 1). The
    # forward of a gradient (gathered is the VJP's residual) and return_gathered=True read it: 0.
    import re

    import ficco_jax

    mesh, n, sched, x, w, specs = _skip_case(rng)

    def plain(a, b):
        return ficco_jax.ag_matmul(a, b, "tp", schedule=sched)

    def with_gathered(a, b):
        out, g = ficco_jax.ag_matmul(a, b, "tp", schedule=sched, return_gathered=True)
        return out, g

    def grad_x(a, b):
        return jax.grad(lambda a: jnp.sum(plain(a, b) ** 2))(a)

    def flags(fn, out_specs):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_specs))
        text = f.lower(x, w).as_text()
        return [int(v) for v in re.findall(r"skip_own_rows = (\d+)", text)], f(x, w)

    def ref(a, b):
        return jnp.dot(jax.lax.all_gather(a, "tp", tiled=True), b)

    want = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=specs, out_specs=P(None, "tp")))(x, w)
    skip, out = flags(plain, P(None, "tp"))
    assert skip == [1], skip
    assert max_rel_err(out, want) < TOLERANCE[jnp.float32]
    skip, (out, gathered) = flags(with_gathered, (P(None, "tp"), P("tp", None)))  # every device's gathered, stacked
    assert skip == [0], skip
    np.testing.assert_array_equal(gathered, np.concatenate([np.asarray(x)] * n))
    assert max_rel_err(out, want) < TOLERANCE[jnp.float32]
    skip, dx = flags(grad_x, P("tp", None))
    assert skip and all(s == 0 for s in skip), skip  # the forward keeps its rows (the residual); the rest is matmul_rs
    dx_want = jax.jit(jax.shard_map(lambda a, b: jax.grad(lambda a: jnp.sum(ref(a, b) ** 2))(a), mesh=mesh,
                                    in_specs=specs, out_specs=P("tp", None)))(x, w)
    assert max_rel_err(dx, dx_want) < 1e-4


@pytest.mark.parametrize("wrap", ["checkpoint", "scan"])
def test_ag_matmul_skip_path_under_remat_and_scan_gradients(rng, wrap):
    # Under jax.checkpoint the forward is recomputed in the backward pass, and inside lax.scan the
    # residuals are stacked: in both the backward must read a gathered x whose own rows were written
    # (the forward rule's call), never the plain call's (own rows skipped). Wrong rows would show
    # up in dw = gathered.T @ g.
    import ficco_jax

    mesh, _, sched, x, w, specs = _skip_case(rng)

    def op(a, b, fused):
        if fused:
            return ficco_jax.ag_matmul(a, b, "tp", schedule=sched)
        return jnp.dot(jax.lax.all_gather(a, "tp", tiled=True), b)

    def loss(a, b, fused):
        if wrap == "checkpoint":
            return jnp.sum(jnp.tanh(jax.checkpoint(lambda a, b: op(a, b, fused))(a, b)))
        def step(carry, scale):
            return carry + jnp.sum(jnp.tanh(op(a * scale, b, fused))), None
        return jax.lax.scan(step, jnp.zeros_like(a[0, 0]), jnp.array([1.0, 0.5, -0.25]))[0]  # carry varies like a

    def grads(fused):
        f = jax.shard_map(lambda a, b: jax.grad(lambda a, b: loss(a, b, fused), argnums=(0, 1))(a, b),
                          mesh=mesh, in_specs=specs, out_specs=(P("tp", None), P(None, "tp")))
        return jax.jit(f)(x, w)

    for got, want in zip(grads(True), grads(False)):
        assert max_rel_err(got, want) < 1e-4, wrap


# ------------------------------------------------------------------------------------------------
# vmap and forward mode of the collectives
# ------------------------------------------------------------------------------------------------
#: collective -> (copy engines, jax.lax), on a per-device element [n, n] (every dimension divides by n).
COLLECTIVES = {
    "all_gather": (lambda v: dma.all_gather(v, "tp", axis=1), lambda v: jax.lax.all_gather(v, "tp", axis=1, tiled=True)),
    "reduce_scatter": (lambda v: dma.reduce_scatter(v, "tp"), lambda v: jax.lax.psum_scatter(v, "tp", tiled=True)),
    "all_to_all": (lambda v: dma.all_to_all(v, "tp", 0, 1), lambda v: jax.lax.all_to_all(v, "tp", 0, 1, tiled=True)),
}
BATCH = 3


def _batched_program(body, in_axis):
    """jit(shard_map(body)) on the 2-D mesh of x [devices*n, n] per element with a batch of BATCH
    in dimension `in_axis`; results batch-leading, concatenated over the devices in dimension 1
    (the element's rows moved next to the batch: same values per element whatever in_axis is)."""
    mesh, devices = MESHES["2d"], _all_axes(MESHES["2d"])
    spec = P(*[None if d == in_axis else (devices if d == (1 if in_axis == 0 else 0) else None) for d in range(3)])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(None, devices), check_vma=True))


def _batched_input(rng, in_axis):
    n, devices = MESHES["2d"].shape["tp"], MESHES["2d"].devices.size
    return jnp.moveaxis(jnp.asarray(rng.standard_normal((BATCH, devices * n, n)) + 2.0, jnp.float32), 0, in_axis)


def _per_element(fn, in_axis):
    """fn once per batch element (BATCH separate calls), stacked: the reference of vmap(fn)."""
    return lambda xb: jnp.stack([fn(jnp.take(xb, i, axis=in_axis)) for i in range(BATCH)])


def _grad_of(fn):
    def loss(v):
        y = fn(v)
        return jnp.sum(jnp.sin(y) * y)
    return jax.grad(loss)


@pytest.mark.sweep
@pytest.mark.parametrize("in_axis", [0, 1, 2])
@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collective_under_vmap_is_one_call(name, in_axis, rng):
    """vmap of a collective, the batch in any dimension: one executor call on the whole batch (its
    gradient: one more, the transpose), equal to the collective run per element and to jax.lax's."""
    ours, ref = COLLECTIVES[name]
    xb = _batched_input(rng, in_axis)
    for transform in (lambda f: f, _grad_of):
        got = _batched_program(jax.vmap(transform(ours), in_axes=in_axis), in_axis)
        per_element = _batched_program(_per_element(transform(ours), in_axis), in_axis)(xb)
        want = _batched_program(jax.vmap(transform(ref), in_axes=in_axis), in_axis)(xb)
        assert max_rel_err(got(xb), per_element) < 1e-6 and max_rel_err(got(xb), want) < TOLERANCE[jnp.float32]
        expected = 1 if transform is not _grad_of else 2
        assert ffi_calls(got.lower(xb).compile().as_text()) == expected


def test_a_loop_of_calls_is_counted(monkeypatch, rng):
    """The count of the test above sees a loop: with the batch left unfolded, one call per element."""
    monkeypatch.setattr(registry, "_fold_batch", lambda *args: None)
    xb = _batched_input(rng, 0)
    f = _batched_program(jax.vmap(COLLECTIVES["all_gather"][0]), 0)
    assert ffi_calls(f.lower(xb).compile().as_text()) == BATCH
    assert max_rel_err(f(xb), _batched_program(jax.vmap(COLLECTIVES["all_gather"][1]), 0)(xb)) < 1e-6


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collective_forward_mode(name, rng):
    """jax.jvp of a collective: the collective on the tangent too (two calls), equal to jax.lax's."""
    ours, ref = COLLECTIVES[name]
    x, t = (jnp.take(_batched_input(rng, 0), 0, axis=0) for _ in range(2))

    def program(fn):
        body = lambda v, dv: jnp.stack(jax.jvp(fn, (v,), (dv,)))  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=MESHES["2d"], in_specs=(P(_all_axes(MESHES["2d"])),) * 2,
                                     out_specs=P(None, _all_axes(MESHES["2d"]))))

    assert max_rel_err(program(ours)(x, t), program(ref)(x, t)) < TOLERANCE[jnp.float32]
    assert ffi_calls(program(ours).lower(x, t).compile().as_text()) == 2




@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collective_of_a_replicated_input(name, rng):
    """An input the same on every device of the axis (in_specs without it, check_vma=True): the
    result still varies over the axis, as jax.lax's does, so that JAX neither returns one device's
    result for all nor transposes it as replicated: values and gradients equal jax.lax's."""
    ours, ref = COLLECTIVES[name]
    mesh = MESHES["2d"]
    x = jnp.asarray(rng.standard_normal((2 * 4, 4)) + 2.0, jnp.float32)  # per device [4, 4]: varies over dp only

    def program(fn):
        def body(v):
            loss = lambda u: jnp.sum(jnp.sin(fn(u)) * (1.0 + jax.lax.axis_index("tp")))  # noqa: E731
            return fn(v)[None], jax.grad(loss)(v)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=(P(("dp", "tp")), P("dp")),
                                     check_vma=True))

    for got, want in zip(program(ours)(x), program(ref)(x)):
        assert max_rel_err(got, want) < TOLERANCE[jnp.float32]

@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collective_under_vmap_over_one_device(name, rng):
    """An axis of size 1 is a legal group: the batch folds into the rows as on n devices, although
    the scatter side's scratch blocks are empty (n - 1 = 0); values and gradients equal jax.lax's."""
    ours, ref = COLLECTIVES[name]
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    xb = jnp.asarray(rng.standard_normal((BATCH, 4, 2)) + 2.0, jnp.float32)
    for transform in (lambda f: f, _grad_of):
        def program(fn):
            return jax.jit(jax.shard_map(jax.vmap(transform(fn)), mesh=mesh, in_specs=P(), out_specs=P(),
                                         check_vma=False))
        assert max_rel_err(program(ours)(xb), program(ref)(xb)) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collective_under_vmap_of_an_empty_batch(name):
    """vmap over a batch of 0 elements: empty results of jax.lax's shapes, no call."""
    ours, ref = COLLECTIVES[name]
    mesh = MESHES["1d"]
    xb = jnp.ones((0, 8 * 8, 8), jnp.float32)

    def program(fn):
        return jax.jit(jax.shard_map(jax.vmap(fn), mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp")))

    got, want = program(ours)(xb), program(ref)(xb)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert ffi_calls(program(ours).lower(xb).compile().as_text()) == 0


def test_matmul_rs_under_vmap_over_one_device(rng):
    """As above for the raw matmul_rs, whose send and recv blocks are empty over one device."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    y, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((BATCH, 4, 6), (6, 5)))
    sched = Schedule(comm="dma", order="direct", chunks=2)
    got, want = (jax.jit(jax.shard_map(jax.vmap(body, in_axes=(0, None)), mesh=mesh, in_specs=(P(), P()),
                                       out_specs=P(), check_vma=False))(y, w)
                 for body in (lambda a, b: dma.matmul_rs_dma(a, b, "tp", sched),
                              lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True)))
    assert max_rel_err(got, want) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("in_axis", [0, 1])
def test_raw_matmuls_under_vmap_fold_into_rows(in_axis, rng):
    """vmap of the raw tensor-parallel matmuls (no ficco_jax.ops above them to fold the batch): the
    batch joins the rows of one call, the results reordered; equal to jax.lax's."""
    mesh, sched = MESHES["1d"], Schedule(comm="dma", order="direct", chunks=2)
    x, w = rng.standard_normal((BATCH, 8 * 4, 6)), rng.standard_normal((6, 8 * 2))
    y, w2 = rng.standard_normal((BATCH, 8 * 4, 8 * 2)), rng.standard_normal((8 * 2, 6))
    x, w, y, w2 = (jnp.asarray(v, jnp.float32) for v in (x, w, y, w2))
    x_spec = P(None, "tp") if in_axis == 0 else P("tp")
    cases = [  # (ours, reference, operands, in_specs, out_specs)
        (lambda a, b: dma.ag_matmul_dma(a, b, "tp", sched),
         lambda a, b: (jax.lax.all_gather(a, "tp", tiled=True) @ b, jax.lax.all_gather(a, "tp", tiled=True)),
         (jnp.moveaxis(x, 0, in_axis), w), (x_spec, P(None, "tp")), (P(None, None, "tp"), P())),
        (lambda a, b: dma.matmul_rs_dma(a, b, "tp", sched),
         lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True),
         (jnp.moveaxis(y, 0, in_axis), w2), (P(None, None, "tp"), P("tp")), P(None, "tp")),
    ]
    for ours, ref, operands, in_specs, out_specs in cases:
        def program(body):
            return jax.jit(jax.shard_map(jax.vmap(body, in_axes=(in_axis, None)), mesh=mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False))
        for got, want in zip(jax.tree.leaves(program(ours)(*operands)), jax.tree.leaves(program(ref)(*operands))):
            assert max_rel_err(got, want) < TOLERANCE[jnp.float32]
        assert ffi_calls(program(ours).lower(*operands).compile().as_text()) == 1


# ------------------------------------------------------------------------------------------------
# The host's part of a call
# ------------------------------------------------------------------------------------------------
def events_out_of_the_pool(testing) -> int:
    """How many events of the CPU devices' pool are out of it once the watchdog has swept every call
    (testing.watched_calls() == 0): then each finished call's events are back, and what is still out
    belongs to failed calls of earlier tests, for good. The wait is for the watchdog's thread to get
    the CPU; the count it returns does not depend on when it did."""
    deadline = time.monotonic() + 300  # a bound for a machine stalled for minutes, not a measurement
    while testing.watched_calls():
        assert time.monotonic() < deadline, f"the watchdog still watches {testing.watched_calls()} calls after 300 s"
        time.sleep(0.005)
    return testing.events_made() - testing.events_free()


@pytest.mark.parametrize("sched", ["dma/direct/c2", "dma/direct/c2/push"])
def test_a_call_meets_its_group_twice_and_gives_its_events_back(sched):
    """In one process a call off its group's channel (every call, with config.CHANNEL_BYTES = 0)
    waits for its group on the host twice (exchange, then done or pushed): the release of its events
    is an announcement nobody waits for. Run after run, the events go back to the pool once every
    rank has announced: none stays out."""
    testing = _ext.testing()
    mesh = MESHES["1d"]
    n = mesh.shape["tp"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n * 4, 3)), jnp.float32)
    spec = P("tp")
    f = jax.jit(jax.shard_map(lambda a: dma.all_gather(a, "tp", schedule=sched), mesh=mesh, in_specs=spec,
                              out_specs=spec, check_vma=True))
    ref = np.asarray(jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "tp", tiled=True), mesh=mesh,
                                           in_specs=spec, out_specs=spec))(x))
    np.testing.assert_array_equal(np.asarray(f(x)), ref)  # compiled, first plans made

    before, time_before = testing.host_meetings(), testing.host_time()
    np.testing.assert_array_equal(np.asarray(f(x)), ref)
    assert testing.host_meetings() - before == 2 * n
    # The host-time counters see one handler per device, whose time holds its meetings' time.
    spent = {k: v - time_before[k] for k, v in testing.host_time().items()}
    assert spent["calls"] == n, spent
    assert 0 < spent["meeting_s"] < spent["handler_s"], spent

    out_before = events_out_of_the_pool(testing)
    for _ in range(100):
        np.testing.assert_array_equal(np.asarray(f(x)), ref)
    # Each run records at least one event per device and peer chunk, plus one to start: one run's kept
    # out of the pool would leave n * ((n - 1) * 2 + 1) more out. (How far the pool grows meanwhile
    # depends on when the watchdog's thread runs, so it is not asserted.)
    assert events_out_of_the_pool(testing) == out_before


@pytest.mark.parametrize("op, on_channel", [("matmul_rs", True), ("matmul_a2a", True), ("all_gather", False),
                                            ("reduce_scatter", False), ("all_to_all", False), ("ag_matmul", False)])
def test_small_partials_run_on_the_channel_and_the_other_calls_meet(op, on_channel, rng, monkeypatch):
    """A small matmul_rs or matmul_a2a computes its partials in its group's channel region: the group
    meets once, at its first call, to set the channel up; then no call meets, each owner sets a
    ready word per partial and each reader a done word per owner, and waits for its peers'
    (runtime/channel.h). The events go back to the pool without any announcement: none stays out.
    The gathers and collectives, whose inputs would have to be copied into a region, meet twice per
    call."""
    monkeypatch.setattr(config, "CHANNEL_BYTES", CHANNEL_BYTES)
    testing = _ext.testing()
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    n, m, k, e = 4, 8, 6, 2
    sched = Schedule.parse("dma/direct/c2/s2")
    x = jnp.asarray(rng.standard_normal((n * n * m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k * n, 5)), jnp.float32)
    bodies = {
        "all_gather": (lambda a, b: dma.all_gather(a, "tp", schedule=sched),
                       lambda a, b: jax.lax.all_gather(a, "tp", tiled=True)),
        "reduce_scatter": (lambda a, b: dma.reduce_scatter(a, "tp", schedule=sched),
                           lambda a, b: jax.lax.psum_scatter(a, "tp", tiled=True)),
        "all_to_all": (lambda a, b: dma.all_to_all(a, "tp", 0, 0, schedule=sched),
                       lambda a, b: jax.lax.all_to_all(a, "tp", 0, 0, tiled=True)),
        "ag_matmul": (lambda a, b: dma.ag_matmul_dma(a, b[:k], "tp", sched)[0],
                      lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b[:k]),
        "matmul_rs": (lambda a, b: dma.matmul_rs_dma(a, b, "tp", sched),
                      lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True)),
        # y [n, e, C, k] per device, w [e, k, 5]: this device's weight and half of it as two experts.
        "matmul_a2a": (lambda a, b: dma.matmul_a2a_dma(a.reshape(n, e, -1, k), jnp.stack([b, 0.5 * b]), "tp", sched),
                       lambda a, b: ficco_jax.matmul_a2a_ref(a.reshape(n, e, -1, k), jnp.stack([b, 0.5 * b]), "tp")),
    }
    wspec = P("tp", None) if op in ("matmul_rs", "matmul_a2a") else P()
    f, f_ref = (jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), wspec), out_specs=P("tp")))
                for body in bodies[op])
    ref = np.asarray(f_ref(x, w))
    before = testing.host_meetings()
    assert max_rel_err(f(x, w), ref) < 1e-5
    first = testing.host_meetings() - before
    calls_before, before = testing.backend_calls(), testing.host_meetings()
    out_before = events_out_of_the_pool(testing)
    for _ in range(50):
        assert max_rel_err(f(x, w), ref) < 1e-5
    calls = {key: value - calls_before[key] for key, value in testing.backend_calls().items()}
    # The first call of a compiled program also meets once per device to learn its group's devices
    # (xla_ffi/runtime/placement.h); later calls never do.
    roster = n
    if on_channel:
        # The channel's setup, unless an earlier call of this group made one large enough; then none.
        assert first in (roster, roster + n) and testing.host_meetings() == before
        # Every owner sets at least one ready word per reader, every reader one done word per owner.
        assert calls["set_word"] >= 50 * 2 * n * (n - 1), calls
        assert calls["wait_word"] >= 50 * n * (n - 1), calls
    else:
        assert first == roster + 2 * n and testing.host_meetings() - before == 50 * 2 * n
        assert calls["set_word"] == 0 and calls["wait_word"] == 0, calls
    # Kept out of the pool, each call's events would leave 50 * n * ((n - 1) * 2 + 2) more out.
    assert events_out_of_the_pool(testing) == out_before


def test_a_larger_call_grows_the_channel_and_every_size_stays_right(rng, monkeypatch):
    """A call whose partials outgrow the channel's regions makes a new generation (one meeting of the
    group); smaller calls then fit it, and one beyond config.CHANNEL_BYTES meets at every call."""
    monkeypatch.setattr(config, "CHANNEL_BYTES", CHANNEL_BYTES)
    testing = _ext.testing()
    mesh = Mesh(np.array(jax.devices()[4:8]), ("tp",))

    def matmul_rs(rows):
        y = jnp.asarray(rng.standard_normal((4 * rows, 8)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((8 * 4, 16)), jnp.float32)
        f = jax.jit(jax.shard_map(lambda a, b: dma.matmul_rs_dma(a, b, "tp", Schedule.parse("dma/direct/c1")),
                                  mesh=mesh, in_specs=(P("tp"), P("tp", None)), out_specs=P("tp")))
        ref = jax.jit(jax.shard_map(lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True), mesh=mesh,
                                    in_specs=(P("tp"), P("tp", None)), out_specs=P("tp")))(y, w)
        before = testing.host_meetings()
        assert max_rel_err(f(y, w), ref) < 1e-5
        first = testing.host_meetings() - before
        assert max_rel_err(f(y, w), ref) < 1e-5
        return first, testing.host_meetings() - before - first

    # Partials per device: 3 of 4 blocks of [rows / 4, 16] f32. Each program's first call also meets
    # once per device to learn its group (xla_ffi/runtime/placement.h): the first 4 of every count.
    assert matmul_rs(32) == (4 + 4, 0)   # 1.5 KiB: the channel is set up
    assert matmul_rs(1024) == (4 + 4, 0)  # 48 KiB: a larger generation
    assert matmul_rs(32) == (4, 0)       # fits the larger one
    big = CHANNEL_BYTES // (16 * 4 * 3) * 8  # rows of twice the channel's limit
    assert matmul_rs(big) == (4 + 8, 8)  # meets at every call: exchange and done


@pytest.mark.parametrize("value", [-1, 1.5, True, "8M"])
def test_a_bad_channel_limit_is_refused_when_the_op_is_traced(value, monkeypatch):
    monkeypatch.setattr(config, "CHANNEL_BYTES", value)
    mesh = MESHES["1d"]
    with pytest.raises(ValueError, match=r"config.CHANNEL_BYTES=.* must be an integer >= 0"):
        _run(mesh, lambda a, b: dma.matmul_rs_dma(a, b, "tp", Schedule.parse("dma/direct/c1")), (P("tp"), P("tp", None)),
             np.ones((64, 4), np.float32), np.ones((32, 2), np.float32))


def test_the_channel_notices_a_rank_that_runs_another_op_at_a_call():
    """On a channel the ranks do not meet, so the host compares each call's signature with those of
    the peers that already made the call: of two ranks the second to arrive sees the mismatch."""
    checks = _ext.testing().channel_signature_checks
    a, b = [1, 16, 8, 8], [1, 16, 8, 4]
    assert checks(2, [(0, 1, a), (1, 1, a), (0, 2, b), (1, 2, b)]) == [-1, -1, -1, -1]
    assert checks(2, [(0, 1, a), (1, 1, b)]) == [-1, 0]          # rank 1 arrives second and names rank 0
    assert checks(3, [(2, 5, a), (0, 5, a), (1, 5, b)]) == [-1, -1, 0]  # the first rank that differs
    assert checks(2, [(0, 7, a), (1, 6, b)]) == [-1, -1]          # different calls are not compared
    with pytest.raises(ValueError, match="rank 2 is not in 0 .. n-1"):
        checks(2, [(2, 1, a)])


def test_the_channel_program_of_the_gpu_tests_passes_on_cpu():
    """tests/channel_program.py, which tests/gpu/test_channel_gpu.py runs on GPUs, on 2 CPU devices."""
    program = os.path.join(os.path.dirname(__file__), "channel_program.py")
    env = {**os.environ, "FICCO_CHANNEL_BYTES": str(CHANNEL_BYTES)}
    done = subprocess.run([sys.executable, program, "cold", "--cpu"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("PASS"), (done.stdout[-1000:], done.stderr[-2000:])


def _backend_calls(f, *args):
    """The CPU backends' records, waits, copies, matmuls and sums of one run of a compiled f."""
    testing = _ext.testing()
    jax.block_until_ready(f(*args))  # compiled, plans made
    before = testing.backend_calls()
    jax.block_until_ready(f(*args))
    after = testing.backend_calls()
    return {k: after[k] - before[k] for k in after if not k.endswith("_s")}


@pytest.mark.parametrize("transfer", ["", "/push"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_a_consumer_of_whole_slots_is_given_one_copy_and_event_per_slot(op, transfer, rng):
    """A slot's chunks land in order on one copy stream, so a consumer that takes each slot whole
    (gemm=grouped), from a source written whole, needs one copy and one event per slot: cutting a
    slot into more chunks adds no copies, events or waits. Per-chunk matmuls need an event per chunk,
    and get one."""
    mesh = MESHES["1d"]
    n, m, inner, k = mesh.shape["tp"], 8, 12, 16
    spec, wspec = P("tp"), P("tp", None) if op == "matmul_rs" else P()
    if op == "ag_matmul":
        x = jnp.asarray(rng.standard_normal((n * m, inner)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((inner, k)), jnp.float32)
        body = lambda s: lambda a, b: dma.ag_matmul_dma(a, b, "tp", s)[0]  # noqa: E731
    else:
        x = jnp.asarray(rng.standard_normal((n * n * m, inner)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((inner * n, k)), jnp.float32)
        body = lambda s: lambda a, b: dma.matmul_rs_dma(a, b, "tp", s)  # noqa: E731

    calls = {}
    for sched in ("c1/grouped", "c4/grouped", "c1", "c4"):
        s = Schedule.parse(f"dma/direct/{sched}{transfer}")
        f = jax.jit(jax.shard_map(body(s), mesh=mesh, in_specs=(spec, wspec), out_specs=spec, check_vma=True))
        calls[sched] = _backend_calls(f, x, w)
    peers = n * (n - 1)  # slots, over every device of the group
    for what in ("copy", "record", "wait"):
        assert calls["c4/grouped"][what] == calls["c1/grouped"][what], (what, calls)
        assert calls["c4"][what] - calls["c1"][what] >= 3 * peers, (what, calls)


@pytest.mark.parametrize("transfer", ["", "/push"])
@pytest.mark.parametrize("devices", [2, 4])
def test_per_chunk_matmul_rs_sums_in_its_own_matmuls(devices, transfer, rng):
    """matmul_rs with per-chunk matmuls multiplies its own block in two halves after the transfers,
    each adding the first received partial in the matmul: on 2 devices no sum runs at all, on more
    one per half adds the other partials. One chunk, and gemm=grouped, keep the sum after the
    whole-block matmul. Every result equals the plain reduce-scatter's."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("tp",))
    n, m, inner, k = devices, 8, 12, 16
    y = jnp.asarray(rng.standard_normal((n * m, inner * n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((inner * n, k)), jnp.float32)
    want = jax.jit(jax.shard_map(lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True), mesh=mesh,
                                 in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp")))(y, w)
    calls = {}
    for sched in ("c4", "c1", "c4/grouped"):
        s = Schedule.parse(f"dma/direct/{sched}{transfer}")
        f = jax.jit(jax.shard_map(lambda a, b, s=s: dma.matmul_rs_dma(a, b, "tp", s), mesh=mesh,
                                  in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp"), check_vma=True))
        assert max_rel_err(f(y, w), want) < 1e-5, sched
        calls[sched] = _backend_calls(f, y, w)
    # Per device: n - 1 send blocks of 4 chunks, one matmul per chunk, and our own in two halves.
    assert calls["c4"]["gemm"] == n * ((n - 1) * 4 + 2), calls
    assert calls["c4"]["reduce"] == (0 if n == 2 else n * 2), calls
    assert calls["c1"]["gemm"] == n * n and calls["c1"]["reduce"] == n, calls
    assert calls["c4/grouped"]["gemm"] == n * n and calls["c4/grouped"]["reduce"] == n, calls
