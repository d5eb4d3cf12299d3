"""Expert parallelism: dma.all_to_all, a2a_matmul (dispatch) and matmul_a2a (combine).

Every schedule of both ops (none, xla, dma: the CPU backend of the executor) against the
plain-JAX reference on the 1-D mesh (tp=8) and on the tp axis of the permuted 2-D mesh (2, 4),
in f32 and bf16, with gradients; dma.all_to_all exactly against jax.lax.all_to_all on
origin-coded values.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule, dma
from helpers import TOLERANCE, operands_and_reference, random, rel_err

pytestmark = pytest.mark.skipif(not dma.available(), reason="the ficco_jax extension is not built")

# Per device: x [n, E, C, D] and w [E, D, F] (dispatch); y [n, E, C, F] and w [E, F, D] (combine).
# C = 4 so chunk counts 1, 2 and 4 divide it (8 does not: filtered out at generation).
E, C, D, F = 2, 4, 8, 6
OPS = ("a2a_matmul", "matmul_a2a")


def _mesh(request, tp):
    return request.getfixturevalue("mesh1d" if tp == 8 else "mesh2d")


def _tokens_spec(mesh):
    """The leading (peer-block) axis of x split over every mesh axis, tp fastest."""
    return P(tuple(a for a in mesh.axis_names if a != "tp") + ("tp",))


def _specs(mesh):
    return (_tokens_spec(mesh), P("tp")), _tokens_spec(mesh)


def _global_shapes(op, mesh):
    tp, devices = mesh.shape["tp"], mesh.devices.size
    a_inner, w_in, w_out = (D, D, F) if op == "a2a_matmul" else (F, F, D)
    return (devices * tp, E, C, a_inner), (tp * E, w_in, w_out)


def _run(mesh, body, *args):
    in_specs, out_specs = _specs(mesh)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return f(*[jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)])


def _fn(op):
    return {"a2a_matmul": (ficco_jax.a2a_matmul, ficco_jax.a2a_matmul_ref),
            "matmul_a2a": (ficco_jax.matmul_a2a, ficco_jax.matmul_a2a_ref)}[op]


def _cases(tps=(8, 4)):
    for tp in tps:
        for sched in Schedule.enumerate("a2a_matmul", tp):
            if C % sched.chunks == 0:  # invalid points filtered here, not skipped in the test
                yield pytest.param(tp, sched, id=f"tp{tp}-{sched}")
                if sched.comm == "dma" and sched.transfer == "pull":  # every dma point pushed and symmetric as well
                    for transfer in ("push", "symmetric"):
                        moved = sched.replace(transfer=transfer)
                        yield pytest.param(tp, moved, id=f"tp{tp}-{moved}")


# ------------------------------------------------------------------------------------------------
# Both ops, every schedule, against the reference
# ------------------------------------------------------------------------------------------------
def _both(fns):
    def body(x, w1, y, w2):
        return fns[0](x, w1, "tp"), fns[1](y, w2, "tp")
    return body


def _both_specs(mesh):
    in_specs, out_spec = _specs(mesh)
    return in_specs * 2, (out_spec, out_spec)


def _both_sharded(mesh, fns):
    return jax.jit(jax.shard_map(_both(fns), mesh=mesh, in_specs=_both_specs(mesh)[0], out_specs=_both_specs(mesh)[1]))


#: Both references in one program: one object, which helpers.operands_and_reference computes once per
#: mesh and dtype (inputs of both ops, and the float32 reference from the same rounded inputs).
BOTH_REFERENCES = _both([_fn(op)[1] for op in OPS])


def _operands_and_reference(mesh, dtype):
    shapes = tuple(tuple(s) for op in OPS for s in _global_shapes(op, mesh))
    return operands_and_reference(mesh, BOTH_REFERENCES, _both_specs(mesh), shapes, dtype)


def _forward_cases():
    """f32: every schedule on both meshes; bf16 (rounding, not indexing): every schedule on the
    tp axis of the 2-D mesh, whose compiles are cheaper, and every dma schedule on tp=8 too."""
    for case in _cases():
        tp, sched = case.values
        yield pytest.param(*case.values, "float32", id=f"{case.id}-float32")
        if tp == 4 or sched.comm == "dma":
            yield pytest.param(*case.values, "bfloat16", id=f"{case.id}-bfloat16")


@pytest.mark.sweep
@pytest.mark.parametrize("tp,sched,dtype", list(_forward_cases()))
def test_every_schedule_matches_reference(request, tp, sched, dtype):
    mesh = _mesh(request, tp)
    args, want = _operands_and_reference(mesh, dtype)
    got = _both_sharded(mesh, [functools.partial(_fn(op)[0], schedule=sched) for op in OPS])(*args)
    for op, g, w in zip(OPS, got, want):
        assert g.dtype == jnp.dtype(dtype), op
        assert rel_err(g, w) < TOLERANCE[dtype], op


def _gradient_cases():
    """Every none/xla schedule on the 2-D mesh; for dma one schedule per (order, gemm, streams>1):
    the executor's indexing is covered by the forward cases, and each gradient compiles 4 programs."""
    seen = set()
    for case in _cases(tps=(4,)):
        _, sched = case.values
        kind = (sched.comm, sched.order, sched.gemm, sched.copy_streams > 1, sched.transfer)
        if sched.comm == "dma" and (kind in seen or sched.chunks == 1):
            continue
        seen.add(kind)
        yield case


# Gradients (the backward ops reuse the forward's schedule).
@pytest.mark.sweep
@pytest.mark.parametrize("tp,sched", list(_gradient_cases()))
def test_gradients_match_reference(mesh2d, rng, tp, sched):
    mesh = mesh2d
    grads = {}
    for op in OPS:
        fn, ref = _fn(op)
        a, w = [random(rng, s, "float32") for s in _global_shapes(op, mesh)]
        out_shape = jax.eval_shape(lambda a, w: _run(mesh, lambda a, w: ref(a, w, "tp"), a, w), a, w)
        cot = random(rng, out_shape.shape, "float32")

        def loss(body, a, w):
            return jnp.sum(_run(mesh, body, a, w) * cot)

        got = jax.grad(functools.partial(loss, lambda a, w: fn(a, w, "tp", schedule=sched)), argnums=(0, 1))(a, w)
        want = jax.grad(functools.partial(loss, lambda a, w: ref(a, w, "tp")), argnums=(0, 1))(a, w)
        grads[op] = [rel_err(g, r) for g, r in zip(got, want)]
    assert all(e < TOLERANCE["float32"] for errs in grads.values() for e in errs), grads


def test_dispatch_returns_received_and_its_gradient(mesh1d, rng):
    mesh = mesh1d
    x, w = [random(rng, s, "float32") for s in _global_shapes("a2a_matmul", mesh)]
    sched = Schedule(comm="xla", order="ring", chunks=2)
    spec = _tokens_spec(mesh)

    def run(body):
        f = jax.shard_map(body, mesh=mesh, in_specs=(spec, P("tp")), out_specs=(spec, spec))
        return jax.jit(f)

    def fused(x, w):
        return ficco_jax.a2a_matmul(x, w, "tp", schedule=sched, return_received=True)

    def ref(x, w):
        return ficco_jax.a2a_matmul_ref(x, w, "tp"), jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)

    for g, r in zip(run(fused)(x, w), run(ref)(x, w)):
        assert rel_err(g, r) < TOLERANCE["float32"]

    def loss(body, x, w):
        out, received = run(body)(x, w)
        return jnp.sum(out ** 2) + jnp.sum(jnp.sin(received))

    got = jax.grad(functools.partial(loss, fused), argnums=(0, 1))(x, w)
    want = jax.grad(functools.partial(loss, ref), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        assert rel_err(g, r) < TOLERANCE["float32"]


def test_dispatch_skips_its_own_block_only_when_nobody_reads_received(mesh1d, rng):
    # On copy engines the plain forward drops `received` and lowers with skip_own_rows = 1; with
    # return_received=True and in the forward of a gradient (received is the VJP's residual), 0.
    # The results are right in all three.
    import re

    mesh = mesh1d
    x, w = [random(rng, s, "float32") for s in _global_shapes("a2a_matmul", mesh)]
    sched = Schedule.parse("dma/direct/c2")
    spec = _tokens_spec(mesh)

    def lowered(body, out_specs, *args):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P("tp")), out_specs=out_specs))
        return [int(v) for v in re.findall(r"skip_own_rows = (\d+)", f.lower(*args).as_text())], f(*args)

    plain = lambda x, w: ficco_jax.a2a_matmul(x, w, "tp", schedule=sched)  # noqa: E731
    both = lambda x, w: ficco_jax.a2a_matmul(x, w, "tp", schedule=sched, return_received=True)  # noqa: E731
    ref = lambda x, w: ficco_jax.a2a_matmul_ref(x, w, "tp")  # noqa: E731
    want = _run(mesh, ref, x, w)
    flags, out = lowered(plain, spec, x, w)
    assert 1 in flags and set(flags) == {1}, flags
    assert rel_err(out, want) < TOLERANCE["float32"]
    flags, (out, received) = lowered(both, (spec, spec), x, w)
    assert 0 in flags and set(flags) == {0}, flags
    assert rel_err(out, want) < TOLERANCE["float32"]
    np.testing.assert_array_equal(received, _run(mesh, lambda x, w: jax.lax.all_to_all(x, "tp", 0, 0, tiled=True), x, w))
    grad = lambda x, w: jax.grad(lambda x: jnp.sum(plain(x, w) ** 2))(x)  # noqa: E731
    flags, dx = lowered(grad, spec, x, w)
    assert flags and set(flags) == {0}, flags  # the forward keeps its block (the residual); the rest never skip
    dx_want = _run(mesh, lambda x, w: jax.grad(lambda x: jnp.sum(ref(x, w) ** 2))(x), x, w)
    assert rel_err(dx, dx_want) < 1e-4


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("sched", ["dma/direct/c2", "dma/direct/c2/grouped", "dma/direct/c2/push"])
def test_every_local_expert_shares_one_copy_and_one_matmul_launch(mesh1d, rng, op, sched):
    """An expert block's chunk is a strided run of rows in each local expert's block: it moves as one
    copy (a 2D copy on GPUs) and is multiplied by one batched matmul, whatever the number of local
    experts; a slot written whole (gemm=grouped) moves as one copy whatever the number of chunks.
    Results equal the reference."""
    from ficco_jax.runtime import extension

    testing = extension.testing()
    mesh, tp = mesh1d, mesh1d.shape["tp"]
    schedule = Schedule.parse(sched)
    calls = {}
    for experts in (1, 4):
        a_inner, w_in, w_out = (D, D, F) if op == "a2a_matmul" else (F, F, D)
        x = random(rng, (tp * tp, experts, C, a_inner), "float32")
        w = random(rng, (tp * experts, w_in, w_out), "float32")
        fn, ref = _fn(op)
        f = jax.jit(jax.shard_map(lambda x, w: fn(x, w, "tp", schedule=schedule), mesh=mesh,
                                  in_specs=_specs(mesh)[0], out_specs=_specs(mesh)[1]))
        args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((x, w), _specs(mesh)[0])]
        jax.block_until_ready(f(*args))  # compiled
        before = testing.backend_calls()
        got = f(*args)
        jax.block_until_ready(got)
        after = testing.backend_calls()
        calls[experts] = {k: after[k] - before[k] for k in ("copy", "gemm")}
        assert rel_err(got, _run(mesh, lambda x, w: ref(x, w, "tp"), x, w)) < TOLERANCE["float32"]
    assert calls[1] == calls[4], calls
    slots = tp * (tp - 1)  # over every device of the group
    per_slot = 1 if schedule.gemm == "grouped" else schedule.chunks
    assert calls[4]["copy"] == slots * per_slot, calls  # (the dispatch's own block is not copied: nobody reads it)
    assert calls[4]["gemm"] == tp + slots * per_slot, calls  # the own block's, then one per chunk or slot


# ------------------------------------------------------------------------------------------------
# dma.all_to_all: exact, origin-coded
# ------------------------------------------------------------------------------------------------
def _origin_coded(mesh, shape_per_device, dtype):
    """Block d of the sharded axis (device d's, over dp and tp) holds d * 10000 + flat index: every
    value says which device it came from, so a block pulled from the same tp rank of the other dp
    group shows too."""
    per = int(np.prod(shape_per_device))
    blocks = [d * 10000 + np.arange(per).reshape(shape_per_device) for d in range(mesh.devices.size)]
    return jnp.asarray(np.concatenate(blocks, axis=0), dtype)


@pytest.mark.sweep
@pytest.mark.parametrize("split_axis,concat_axis,sched", [
    (0, 0, None), (1, 0, None), (0, 2, None), (2, 1, "dma/ring/c1"), (1, 1, "dma/direct/c2/s2"),
    (0, 0, "dma/direct/c4/s4"), (1, 1, "dma/direct/c2/s2/push"), (0, 0, "dma/ring/c4/push"),
])
@pytest.mark.parametrize("mesh_name", ["mesh1d", "mesh2d"])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_dma_all_to_all_is_exact(request, mesh_name, split_axis, concat_axis, sched, dtype):
    mesh = request.getfixturevalue(mesh_name)
    tp = mesh.shape["tp"]
    if sched is not None and Schedule.parse(sched).copy_streams > tp - 1:  # fewer peers than streams
        sched = sched.replace(f"/s{Schedule.parse(sched).copy_streams}", f"/s{tp - 1}")
        assert Schedule.parse(sched).copy_streams == tp - 1
    shape = (tp * 4, 8, tp) if split_axis != 2 else (4, 8, tp * 2)
    x = _origin_coded(mesh, shape, dtype)
    spec = _tokens_spec(mesh)

    def run(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)

    got = run(lambda v: dma.all_to_all(v, "tp", split_axis, concat_axis, schedule=sched))
    want = run(lambda v: jax.lax.all_to_all(v, "tp", split_axis, concat_axis, tiled=True))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Not the identity: every device now holds values from every rank of its group.
    assert not np.array_equal(np.asarray(got), np.asarray(x)) or split_axis == concat_axis == 0 and tp == 1


def test_dma_all_to_all_gradient(mesh2d, rng):
    x = random(rng, (8 * 4, 3, 4), "float32")
    spec = _tokens_spec(mesh2d)

    def apply(fn, x):
        return jax.jit(jax.shard_map(fn, mesh=mesh2d, in_specs=spec, out_specs=spec))(x)

    ref = functools.partial(apply, lambda v: jax.lax.all_to_all(v, "tp", 0, 1, tiled=True))
    cot = random(rng, jax.eval_shape(ref, x).shape, "float32")

    def loss(fn, x):
        return jnp.sum(jnp.sin(apply(fn, x)) * cot)

    got = jax.grad(functools.partial(loss, lambda v: dma.all_to_all(v, "tp", 0, 1)))(x)
    want = jax.grad(functools.partial(loss, lambda v: jax.lax.all_to_all(v, "tp", 0, 1, tiled=True)))(x)
    assert rel_err(got, want) < TOLERANCE["float32"]


# ------------------------------------------------------------------------------------------------
# Bad shapes and schedules: ValueError naming the dimension
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,a_shape,w_shape,sched,match", [
    ("a2a_matmul", (4, 2, 4), (2, 8, 6), "none", r"x must be 4-D per device \[n, E_local, C, d\]"),
    ("a2a_matmul", (3, 2, 4, 8), (2, 8, 6), "none", r"x.shape\[0\]=3 \(dimension 0, peer blocks\) must equal the axis size 4"),
    ("a2a_matmul", (4, 2, 4, 8), (3, 8, 6), "none", r"x.shape\[1\]=2 \(dimension 1, E_local\) but w.shape\[0\]=3"),
    ("matmul_a2a", (4, 2, 4, 6), (2, 5, 8), "none", r"y.shape\[3\]=6 \(dimension 3\) but w.shape\[1\]=5"),
    ("matmul_a2a", (4, 2, 4, 6), (2, 6), "none", r"w must be 3-D"),
    ("a2a_matmul", (4, 2, 6, 8), (2, 8, 6), "xla/direct/c4",
     r"capacity per peer block \(dimension 2, C\) = 6 .* must divide by schedule.chunks=4; valid chunk counts for this shape: \[1, 2, 3, 6\]"),
    ("matmul_a2a", (4, 2, 4, 6), (2, 6, 8), "xla/bidirectional/c2", r"valid orders: \('ring', 'direct'\)"),
])
def test_bad_shapes_raise_naming_the_dimension(mesh2d, op, a_shape, w_shape, sched, match):
    fn = _fn(op)[0]
    spec = _tokens_spec(mesh2d)
    a = jnp.zeros((8 * a_shape[0], *a_shape[1:]), jnp.float32)
    w = jnp.zeros((4 * w_shape[0], *w_shape[1:]), jnp.float32)
    body = jax.shard_map(lambda a, w: fn(a, w, "tp", schedule=sched), mesh=mesh2d,
                         in_specs=(spec, P("tp")), out_specs=spec)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(body, a, w)


def test_dma_all_to_all_rejects_an_indivisible_split_axis(mesh1d):
    body = jax.shard_map(lambda v: dma.all_to_all(v, "tp", 1, 0), mesh=mesh1d, in_specs=P("tp"), out_specs=P("tp"))
    with pytest.raises(ValueError, match=r"x.shape\[1\]=6 \(the split axis\) must divide by the axis size 8"):
        jax.eval_shape(body, jnp.zeros((8 * 8, 6), jnp.float32))


# ------------------------------------------------------------------------------------------------
# overlap(): all_to_all → expert matmul and expert matmul → all_to_all, as MoE code writes them
# ------------------------------------------------------------------------------------------------
def _moe_body(x, w_in, w_out):
    received = jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)
    h = jax.nn.relu(jnp.einsum("pecd,edf->pecf", received, w_in))
    back = jax.lax.all_to_all(jnp.einsum("pecf,efd->pecd", h, w_out), "tp", 0, 0, tiled=True)
    return back + jnp.mean(received)  # the received tokens have a second user


def _moe_args(mesh, rng):
    x_shape, w_in_shape = _global_shapes("a2a_matmul", mesh)
    _, w_out_shape = _global_shapes("matmul_a2a", mesh)
    return [random(rng, s, "float32") for s in (x_shape, w_in_shape, w_out_shape)]


def _sharded(mesh, body, n_weights):
    spec = _tokens_spec(mesh)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) + (P("tp"),) * n_weights, out_specs=spec))


@pytest.mark.parametrize("mesh_name,sched", [("mesh1d", "xla/ring/c2"), ("mesh2d", "dma/direct/c2/s2"),
                                             ("mesh2d", "xla/direct/c4/grouped")])
def test_overlap_rewrites_dispatch_and_combine(request, rng, mesh_name, sched):
    mesh = request.getfixturevalue(mesh_name)
    fn = _sharded(mesh, _moe_body, 2)
    args = _moe_args(mesh, rng)
    fused = ficco_jax.overlap(fn, schedule=sched)
    report = ficco_jax.explain(fused, *args)
    assert [(r.op, r.schedule) for r in report.sites] == [("a2a_matmul", sched), ("matmul_a2a", sched)], str(report)
    assert "received tokens also used elsewhere" in report.sites[0].shapes
    assert rel_err(fused(*args), fn(*args)) < TOLERANCE["float32"]

    def loss(f, *a):
        return jnp.sum(jnp.sin(f(*a)))

    got = jax.grad(functools.partial(loss, fused), argnums=(0, 1, 2))(*args)
    want = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(*args)
    for g, r in zip(got, want):
        assert rel_err(g, r) < TOLERANCE["float32"]


def test_overlap_near_misses_say_why(mesh1d, rng):
    x, w_in, _ = _moe_args(mesh1d, rng)

    def one_matmul_between(x, w):  # a2a → matmul → a2a: the matmul can belong to one site only
        received = jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)
        return jax.lax.all_to_all(jnp.einsum("pecd,edf->pecf", received, w), "tp", 0, 0, tiled=True)

    fn = _sharded(mesh1d, one_matmul_between, 1)
    report = ficco_jax.explain(fn, x, w_in)
    assert [r.op for r in report.sites] == ["a2a_matmul"]
    assert "already consumes an a2a_matmul site" in report.near_misses[0].reason
    fused = ficco_jax.overlap(fn, schedule="xla/direct/c2")
    assert rel_err(fused(x, w_in), fn(x, w_in)) < TOLERANCE["float32"]

    def other_split(x, w):  # exchanges the expert axis, not the peer-block axis
        received = jax.lax.all_to_all(x, "tp", 1, 1, tiled=True)
        return jnp.einsum("pecd,edf->pecf", received, w)

    x2 = jnp.zeros((8 * 8, 8, C, D), jnp.float32)
    w2 = jnp.zeros((8 * 8, D, F), jnp.float32)
    report = ficco_jax.explain(_sharded(mesh1d, other_split, 1), x2, w2)
    assert not report.sites and "split_axis=1, concat_axis=1" in report.near_misses[0].reason

    def not_per_expert(x, w):  # one shared weight: contracts the features but batches no expert
        received = jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)
        return jnp.einsum("pecd,df->pecf", received, w[0])

    report = ficco_jax.explain(_sharded(mesh1d, not_per_expert, 1), x, w_in)
    assert not report.sites and "expected the experts batched and the features contracted" in report.near_misses[0].reason
    assert report.near_misses[0].op == "a2a_matmul"
