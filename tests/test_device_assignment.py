"""One compiled program, any devices: a copy-engine call finds its group from the run.

The property: a program that uses ficco_jax gives the plain program's result on every device
assignment JAX runs it on — the same jitted function under meshes of one shape with other device
orders (reversed, strided, swapped within an axis, a random permutation), on submeshes of one shape
(disjoint halves: pipeline stages), compiled ahead of time, and as a `jax.export` artifact loaded
and called on other devices — for every op and standalone collective, with each transfer (pull, push,
symmetric), written as explicit ops in shard_map, as overlap() of a shard_map body and as overlap()
of global-view code. Each function is traced once and run under every assignment in turn, as users
reuse a jitted step, so a group bound at trace time shows up as a wrong number here.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax import dma
from helpers import ffi_position, max_rel_err

TP = 4
DEVICES = np.arange(8)


def _orders():
    """Name -> device ids of a (dp=2, tp=4) mesh, row-major."""
    base = DEVICES.reshape(2, TP)
    return {
        "as_listed": base,
        "reversed": DEVICES[::-1].reshape(2, TP),
        "strided": DEVICES.reshape(TP, 2).T,
        "swapped_in_tp": base[:, [1, 0, 3, 2]],
        "random": np.random.default_rng(58).permutation(DEVICES).reshape(2, TP),
    }


#: Name -> device ids of a one-axis (tp=4) mesh: pipeline stages of one shape.
SUBMESHES = {"first_half": DEVICES[:4], "second_half": DEVICES[4:], "second_half_reversed": DEVICES[4:][::-1],
             "odd": DEVICES[1::2]}
ORDERS = _orders()
TRANSFERS = {"pull": "dma/direct/c2", "push": "dma/direct/c2/push", "symmetric": "dma/direct/c1/symmetric"}


def _mesh(ids, names=("dp", "tp"), explicit=False):
    devices = np.array(jax.devices())[np.asarray(ids)]
    kinds = {"axis_types": (AxisType.Explicit,) * len(names)} if explicit else {}
    return Mesh(devices, names, **kinds)


# ------------------------------------------------------------------------------------------------
# The ops: (body with the schedule, plain body, global operand shapes, in specs, out spec)
# ------------------------------------------------------------------------------------------------
M, K, N, E, C = 16, 8, 12, 2, 4


def _op_table(sched):
    return {
        "ag_matmul": (lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=sched),
                      lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w,
                      [(2 * M, K), (K, TP * N)], (P(("dp", "tp"), None), P(None, "tp")), P("dp", "tp")),
        "matmul_rs": (lambda y, w: ficco_jax.matmul_rs(y, w, "tp", schedule=sched),
                      lambda y, w: jax.lax.psum_scatter(y @ w, "tp", tiled=True),
                      [(2 * M, TP * K), (TP * K, N)], (P("dp", "tp"), P("tp", None)), P(("dp", "tp"), None)),
        "matmul_psum": (lambda y, w: ficco_jax.matmul_psum(y, w, "tp", schedule=sched),
                        lambda y, w: jax.lax.psum(y @ w, "tp"),
                        [(2 * M, TP * K), (TP * K, N)], (P("dp", "tp"), P("tp", None)), P("dp", None)),
        "all_gather": (lambda x: dma.all_gather(x, "tp", schedule=sched),
                       lambda x: jax.lax.all_gather(x, "tp", tiled=True),
                       [(2 * M, K)], (P(("dp", "tp"), None),), P("dp", None)),
        "reduce_scatter": (lambda x: dma.reduce_scatter(x, "tp", schedule=sched),
                           lambda x: jax.lax.psum_scatter(x, "tp", tiled=True),
                           [(2 * TP * M, K)], (P(("dp", "tp"), None),), P(("dp", "tp"), None)),
        "all_to_all": (lambda x: dma.all_to_all(x, "tp", 0, 0, schedule=sched),
                       lambda x: jax.lax.all_to_all(x, "tp", 0, 0, tiled=True),
                       [(2 * TP * M, K)], (P(("dp", "tp"), None),), P(("dp", "tp"), None)),
        "a2a_matmul": (lambda x, w: ficco_jax.a2a_matmul(x, w, "tp", schedule=sched),
                       lambda x, w: ficco_jax.a2a_matmul_ref(x, w, "tp"),
                       [(2 * TP * TP, E, C, K), (TP * E, K, N)], (P(("dp", "tp")), P("tp")), P(("dp", "tp"))),
        "matmul_a2a": (lambda y, w: ficco_jax.matmul_a2a(y, w, "tp", schedule=sched),
                       lambda y, w: ficco_jax.matmul_a2a_ref(y, w, "tp"),
                       [(2 * TP * TP, E, C, K), (TP * E, K, N)], (P(("dp", "tp")), P("tp")), P(("dp", "tp"))),
    }


OPS = tuple(_op_table("dma/direct/c2"))
#: Transfers an op runs with (every op pulls; the matmul ops and collectives push and have sites).
CASES = [(op, transfer) for op in OPS for transfer in TRANSFERS
         if not (transfer != "pull" and op in ("a2a_matmul", "matmul_a2a", "matmul_psum"))]


def _operands(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _submesh_case(op, sched):
    """The same op on a one-axis mesh (tp only): its specs without the dp axis."""
    fn, ref, shapes, in_specs, out_spec = _op_table(sched)[op]

    def drop_dp(spec):
        entries = []
        for e in spec:
            if isinstance(e, tuple):
                e = tuple(a for a in e if a != "dp") or None
                e = e[0] if isinstance(e, tuple) and len(e) == 1 else e
            elif e == "dp":
                e = None
            entries.append(e)
        return P(*entries)

    half = [(s[0] // 2, *s[1:]) if i == 0 else s for i, s in enumerate(shapes)]
    return fn, ref, half, tuple(drop_dp(s) for s in in_specs), drop_dp(out_spec)


@functools.lru_cache(maxsize=None)
def _programs(op, transfer, form, submesh=False):
    """(ours, reference): jitted once, run under every mesh of the case (the context mesh)."""
    sched = TRANSFERS[transfer]
    fn, ref, shapes, in_specs, out_spec = (_submesh_case(op, sched) if submesh else _op_table(sched)[op])
    if form == "overlap":  # the plain body, rewritten
        fn = ficco_jax.overlap(ref, schedule=sched)
    wrap = lambda body: jax.jit(jax.shard_map(body, in_specs=in_specs, out_specs=out_spec, check_vma=False))  # noqa: E731
    return wrap(fn), wrap(ref), shapes


def _check(ours, ref, mesh, args):
    with jax.set_mesh(mesh):
        got, want = np.asarray(ours(*args)), np.asarray(ref(*args))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.sweep
@pytest.mark.parametrize("op,transfer", CASES)
def test_a_jitted_program_is_right_under_every_device_order(op, transfer):
    ours, ref, shapes = _programs(op, transfer, "op")
    args = _operands(shapes)
    for name, ids in ORDERS.items():
        _check(ours, ref, _mesh(ids), args)


@pytest.mark.sweep
@pytest.mark.parametrize("op,transfer", [c for c in CASES if c[0] in ("ag_matmul", "matmul_rs", "all_gather")])
def test_a_stage_runs_on_every_submesh_of_its_shape(op, transfer):
    ours, ref, shapes = _programs(op, transfer, "op", submesh=True)
    args = _operands(shapes)
    for name, ids in SUBMESHES.items():
        _check(ours, ref, _mesh(ids, ("tp",)), args)


@pytest.mark.sweep
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_psum"])
@pytest.mark.parametrize("transfer", ["pull", "symmetric"])
def test_overlap_of_a_shard_map_body_is_right_under_every_device_order(op, transfer):
    if (op, transfer) not in CASES:
        pytest.skip("this op has no such transfer")
    ours, ref, shapes = _programs(op, transfer, "overlap")
    args = _operands(shapes)
    for name in ("as_listed", "strided", "swapped_in_tp", "as_listed"):
        _check(ours, ref, _mesh(ORDERS[name]), args)


def test_a_compiled_program_runs_on_the_devices_it_was_compiled_for_each_order():
    """Ahead of time: lower and compile the one jitted function under each order."""
    ours, ref, shapes = _programs("ag_matmul", "pull", "op")
    args = _operands(shapes)
    for name in ("as_listed", "reversed", "swapped_in_tp"):
        mesh = _mesh(ORDERS[name])
        with jax.set_mesh(mesh):
            compiled = ours.lower(*args).compile()
            np.testing.assert_allclose(np.asarray(compiled(*args)), np.asarray(ref(*args)), rtol=2e-5, atol=2e-5)


def test_gradients_are_right_under_every_device_order():
    sched = TRANSFERS["pull"]

    def mlp(op_ag, op_rs, x, w1, w2):
        return jnp.sum(op_rs(jax.nn.gelu(op_ag(x, w1)), w2) ** 2)

    def body(ag, rs):
        return jax.jit(jax.grad(jax.shard_map(
            lambda x, w1, w2: jax.lax.psum(mlp(ag, rs, x, w1, w2), ("dp", "tp")),
            in_specs=(P(("dp", "tp"), None), P(None, "tp"), P("tp", None)), out_specs=P()), argnums=(0, 1, 2)))

    ours = body(lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=sched),
                lambda y, w: ficco_jax.matmul_rs(y, w, "tp", schedule=sched))
    ref = body(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w,
               lambda y, w: jax.lax.psum_scatter(y @ w, "tp", tiled=True))
    args = _operands([(2 * M, K), (K, TP * N), (TP * N, K)], seed=3)
    for name in ("as_listed", "reversed", "swapped_in_tp"):
        with jax.set_mesh(_mesh(ORDERS[name])):
            for g, r in zip(ours(*args), ref(*args)):
                assert max_rel_err(g, r) < 1e-5, name


def test_global_view_reused_under_other_orders():
    """Explicit-sharding global view: the rewrite's shard_map takes the mesh of the call, not the first."""
    sched = TRANSFERS["pull"]

    def mlp(x, w1, w2):
        h = jnp.dot(x, w1, out_sharding=P("dp", "tp"))
        return jnp.dot(jax.nn.gelu(h), w2, out_sharding=P(("dp", "tp"), None))

    ours, ref = jax.jit(ficco_jax.overlap(mlp, schedule=sched)), jax.jit(mlp)
    x, w1, w2 = _operands([(2 * M, K), (K, TP * N), (TP * N, K)], seed=5)
    for name in ("as_listed", "strided", "swapped_in_tp"):
        mesh = _mesh(ORDERS[name], explicit=True)
        with jax.set_mesh(mesh):
            args = (jax.device_put(x, P(("dp", "tp"), None)), jax.device_put(w1, P(None, "tp")),
                    jax.device_put(w2, P("tp", None)))
            np.testing.assert_allclose(np.asarray(ours(*args)), np.asarray(ref(*args)), rtol=2e-5, atol=2e-5)


def test_a_position_in_no_group_is_refused():
    """A call whose position lies outside every group of its op (a program lowered for a mesh of
    another shape) says so instead of guessing a group."""
    from ficco_jax.runtime import extension

    def gather(a):
        call = jax.ffi.ffi_call("ficco_all_gather", jax.ShapeDtypeStruct((4 * a.shape[0], a.shape[1]), a.dtype))
        groups = np.arange(4, dtype=np.int64)
        return call(ffi_position(), a, ficco_abi=np.int64(extension.CONTRACT_VERSION), op_id=np.int64(3 * 10**9),
                    groups=groups, devices=groups, ipc_job=np.int64(0), group_size=np.int64(4), chunks=np.int64(1),
                    order=np.int64(1), gemm=np.int64(0), copy_streams=np.int64(1), timeout_ms=np.int64(20000),
                    watchdog_ms=np.int64(0), site="test", skip_own_rows=np.int64(0), transfer=np.int64(0),
                    w_col_major=np.int64(0), channel_bytes=np.int64(0))

    mesh = _mesh(DEVICES, ("tp",))
    f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    with pytest.raises(Exception, match=r"runs at position [4-7] of its program's devices, which is in no group"):
        jax.block_until_ready(f(np.zeros((16, 2), np.float32)))
