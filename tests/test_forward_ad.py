"""Forward-mode differentiation of the five ops (jvp, jacfwd, linearize), its compositions with
reverse mode (Hessian-vector products, grad of grad, grad of jvp, inside a remat'd scan),
overlap() under jvp, and jax.vmap of the ops.

Every case against the plain-JAX reference, for comm none, xla and dma (the CPU backend of the
executor), on the permuted (dp=2, tp=4) mesh, so that replicated and varying operands meet. The
lowered programs show that forward mode runs the op itself on the tangents and that reverse mode
still runs the transposed op of the same family on copy engines.
"""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from helpers import (TOLERANCE, ag_specs, ffi_calls, global_shapes, prefer_copy_engines, psum_specs, random, rel_err,
                     rs_specs)

RTOL = TOLERANCE["float32"]
M_ROWS, K, N_COLS = 4, 6, 2       # tensor parallel, per device: x [4, 6], w [6, 2]
E, C, D, F = 2, 2, 4, 3           # expert parallel, per device: x [n, 2, 2, 4], w [2, 4, 3]
TRANSPOSE = {"ag_matmul": "matmul_rs", "matmul_rs": "ag_matmul", "a2a_matmul": "matmul_a2a",
             "matmul_a2a": "a2a_matmul", "matmul_psum": None}  # matmul_psum's backward: local matmuls
#: The executor's targets an op's copy-engine schedule calls, where they are not the op's own.
TARGETS = {"matmul_psum": ("matmul_rs", "all_gather")}
SCHEDULES = ["none", "xla/ring/c2", "xla/bidirectional/c2", "xla/direct/c2", "dma/direct/c2", "dma/ring/c2",
             "dma/direct/c1/push", "dma/direct/c2/columns"]


def _ep_specs(mesh):
    tokens = P(("dp", "tp"))
    return (tokens, P("tp")), tokens


def _ep_shapes(op, mesh):
    tp, devices = mesh.shape["tp"], mesh.devices.size
    inner, w_in, w_out = (D, D, F) if op == "a2a_matmul" else (F, F, D)
    return (devices * tp, E, C, inner), (tp * E, w_in, w_out)


OPS = {  # op -> (fn, reference, specs(mesh), global shapes(op, mesh))
    "ag_matmul": (ficco_jax.ag_matmul, ficco_jax.ag_matmul_ref, ag_specs,
                  lambda op, mesh: global_shapes(op, mesh, M_ROWS, K, N_COLS)),
    "matmul_rs": (ficco_jax.matmul_rs, ficco_jax.matmul_rs_ref, rs_specs,
                  lambda op, mesh: global_shapes(op, mesh, M_ROWS, K, N_COLS)),
    "a2a_matmul": (ficco_jax.a2a_matmul, ficco_jax.a2a_matmul_ref, _ep_specs, _ep_shapes),
    "matmul_a2a": (ficco_jax.matmul_a2a, ficco_jax.matmul_a2a_ref, _ep_specs, _ep_shapes),
    "matmul_psum": (ficco_jax.matmul_psum, ficco_jax.matmul_psum_ref, psum_specs,
                    lambda op, mesh: global_shapes(op, mesh, M_ROWS, K, N_COLS)),
}


def _local_shapes(op, tp=4):
    if op in ("ag_matmul", "matmul_rs", "matmul_psum"):
        return ((M_ROWS, K), (K, N_COLS)) if op == "ag_matmul" else ((tp * M_ROWS, N_COLS), (N_COLS, K))
    inner, w_in, w_out = (D, D, F) if op == "a2a_matmul" else (F, F, D)
    return (tp, E, C, inner), (E, w_in, w_out)


def _valid(op, text):
    sched = Schedule.parse(text)
    if sched.comm == "dma" and not ficco_jax.dma.available():
        return False
    try:
        sched.validate(op, _local_shapes(op), 4)
    except ValueError:
        return False
    return True


def _cases(comms=("none", "xla", "dma"), first_only=False):
    for op in OPS:
        taken = set()
        for text in SCHEDULES:
            comm = text.split("/")[0]
            if comm in comms and _valid(op, text) and not (first_only and comm in taken):
                taken.add(comm)
                yield pytest.param(op, text, id=f"{op}-{text}")


def _program(mesh, op, body):
    """jit(shard_map(body)) over the op's specs: a function of the global (a, w)."""
    in_specs, out_specs = OPS[op][2](mesh)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _operands(mesh, op, rng, count=2):
    """`count` random (a, w)-shaped arrays, placed as the op's in_specs say (never zeros)."""
    in_specs = OPS[op][2](mesh)[0]
    shapes = OPS[op][3](op, mesh)
    return [jax.device_put(random(rng, s, "float32"), NamedSharding(mesh, spec))
            for _ in range(count // 2) for s, spec in zip(shapes, in_specs)]


def _pair(mesh, op, sched):
    """(the op under `sched`, its reference) as programs of the global (a, w)."""
    fn, ref = OPS[op][:2]
    return (_program(mesh, op, lambda a, w: fn(a, w, "tp", schedule=sched)),
            _program(mesh, op, lambda a, w: ref(a, w, "tp")))


def _assert_close(got, want, rtol=RTOL):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, r) < rtol


# ------------------------------------------------------------------------------------------------
# jvp and jacfwd
# ------------------------------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", list(_cases()))
def test_jvp_matches_reference(mesh2d, rng, op, sched):
    """Tangents in both operands, in the input alone and in the weight alone (symbolic zeros)."""
    a, w, da, dw = _operands(mesh2d, op, rng, 4)
    got_fn, want_fn = _pair(mesh2d, op, sched)
    _assert_close(jax.jvp(got_fn, (a, w), (da, dw)), jax.jvp(want_fn, (a, w), (da, dw)))
    _assert_close(jax.jvp(lambda a: got_fn(a, w), (a,), (da,)), jax.jvp(lambda a: want_fn(a, w), (a,), (da,)))
    _assert_close(jax.jvp(lambda w: got_fn(a, w), (w,), (dw,)), jax.jvp(lambda w: want_fn(a, w), (w,), (dw,)))


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", list(_cases(first_only=True)))
def test_jacfwd_matches_reference(mesh2d, rng, op, sched):
    """jacfwd vmaps the tangents: the tangent equation runs once per basis direction."""
    a, w = _operands(mesh2d, op, rng)
    got_fn, want_fn = _pair(mesh2d, op, sched)
    _assert_close(jax.jacfwd(got_fn, argnums=(0, 1))(a, w), jax.jacfwd(want_fn, argnums=(0, 1))(a, w))


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", list(_cases(first_only=True)))
def test_linearize_evaluates(mesh2d, rng, op, sched):
    a, w, da, dw = _operands(mesh2d, op, rng, 4)
    got_fn, want_fn = _pair(mesh2d, op, sched)
    (got_out, got_lin), (want_out, want_lin) = jax.linearize(got_fn, a, w), jax.linearize(want_fn, a, w)
    _assert_close((got_out, got_lin(da, dw)), (want_out, want_lin(da, dw)))


# ------------------------------------------------------------------------------------------------
# Compositions with reverse mode
# ------------------------------------------------------------------------------------------------
def _loss(fn):
    return lambda a, w: jnp.sum(jnp.sin(fn(a, w)))


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", list(_cases()))
def test_hvp_matches_reference(mesh2d, rng, op, sched):
    """Hessian-vector product: jvp of grad, through a loss that is not quadratic in the output."""
    a, w, da, dw = _operands(mesh2d, op, rng, 4)
    got_fn, want_fn = _pair(mesh2d, op, sched)

    def hvp(fn):
        return jax.jvp(jax.grad(_loss(fn), argnums=(0, 1)), (a, w), (da, dw))

    _assert_close(hvp(got_fn), hvp(want_fn))


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", list(_cases(comms=("xla", "dma"), first_only=True)))
def test_second_order_compositions(mesh2d, rng, op, sched):
    """grad of grad, jvp of jvp and grad of jvp (reverse over forward)."""
    a, w, da, dw = _operands(mesh2d, op, rng, 4)
    got_fn, want_fn = _pair(mesh2d, op, sched)

    def grad_grad(fn):
        inner = jax.grad(_loss(fn), argnums=0)
        return jax.grad(lambda a, w: jnp.sum(inner(a, w) ** 2), argnums=(0, 1))(a, w)

    def jvp_jvp(fn):
        first = lambda a, w: jax.jvp(fn, (a, w), (da, dw))[1]
        return jax.jvp(first, (a, w), (dw.sum() + a, w * 0.5))

    def grad_jvp(fn):
        return jax.grad(lambda a, w: jnp.sum(jnp.sin(jax.jvp(fn, (a, w), (da, dw))[1])), argnums=(0, 1))(a, w)

    for composed in (grad_grad, jvp_jvp, grad_jvp):
        _assert_close(composed(got_fn), composed(want_fn))


# ------------------------------------------------------------------------------------------------
# The programs: forward mode runs the op on the tangents, reverse mode its transpose, on copy engines
# ------------------------------------------------------------------------------------------------
PLAIN_COLLECTIVES = ("stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
                     "stablehlo.collective_permute")


@pytest.mark.skipif(not ficco_jax.dma.available(), reason="the ficco_jax extension is not built")
@pytest.mark.parametrize("op", list(OPS))
def test_both_modes_stay_on_copy_engines(mesh2d, rng, op):
    a, w, da, dw = _operands(mesh2d, op, rng, 4)
    got_fn, _ = _pair(mesh2d, op, "dma/direct/c2")
    jvp_text = jax.jit(lambda a, w, da, dw: jax.jvp(got_fn, (a, w), (da, dw))).lower(a, w, da, dw).as_text()
    grad_text = jax.jit(jax.grad(_loss(got_fn), argnums=(0, 1))).lower(a, w).as_text()
    for target in TARGETS.get(op, (op,)):
        assert jvp_text.count(f"ficco_{target}") >= 2  # the primal and the tangent
    if TRANSPOSE[op] is not None:
        assert f"ficco_{TRANSPOSE[op]}" in grad_text  # the backward is the transposed op, overlapped
    for text in (jvp_text, grad_text):
        assert not [c for c in PLAIN_COLLECTIVES if c in text]


# ------------------------------------------------------------------------------------------------
# Side outputs and overlap()
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,sched", [c for c in _cases(first_only=True) if c.values[0] in ("ag_matmul", "a2a_matmul")])
def test_side_output_tangents(mesh2d, rng, op, sched):
    """return_gathered / return_received: tangents of both outputs, and an HVP through both."""
    a, w, da, dw = _operands(mesh2d, op, rng, 4)
    fn, _, specs, _ = OPS[op]
    flag = "return_gathered" if op == "ag_matmul" else "return_received"
    collective = ((lambda x: jax.lax.all_gather(x, "tp", axis=0, tiled=True)) if op == "ag_matmul"
                  else (lambda x: jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)))
    local = (lambda s, w: s @ w) if op == "ag_matmul" else (lambda s, w: jnp.einsum("pecd,edf->pecf", s, w))
    in_specs, out_spec = specs(mesh2d)
    side_spec = P(("dp", "tp"), None) if op == "ag_matmul" else P(("dp", "tp"))

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=in_specs, out_specs=(out_spec, side_spec)))

    got_fn = program(lambda a, w: fn(a, w, "tp", schedule=sched, **{flag: True}))
    want_fn = program(lambda a, w: (local(collective(a), w), collective(a)))
    _assert_close(jax.jvp(got_fn, (a, w), (da, dw)), jax.jvp(want_fn, (a, w), (da, dw)))

    def hvp(fn):
        loss = lambda a, w: jnp.sum(jnp.sin(fn(a, w)[0])) + jnp.sum(jnp.cos(fn(a, w)[1]) * fn(a, w)[1])
        return jax.jvp(jax.grad(loss, argnums=(0, 1)), (a, w), (da, dw))

    _assert_close(hvp(got_fn), hvp(want_fn))


@pytest.mark.parametrize("schedule", ["auto", "xla/ring/c2"] + (["dma/direct/c2"] if ficco_jax.dma.available() else []))
def test_overlap_under_jvp(mesh2d, rng, schedule, monkeypatch):
    """An all_gather -> matmul -> psum_scatter block rewritten by overlap(), under jvp and jacfwd
    ("auto" decides as on a GPU, where it overlaps: on CPU it keeps the plain path)."""
    if schedule == "auto":
        prefer_copy_engines(monkeypatch)
    in_specs, out_spec = (P(("dp", "tp"), None), P(None, "tp"), P("tp", None)), P(("dp", "tp"), None)
    x = random(rng, (8 * M_ROWS, K), "float32")
    w1, w2 = random(rng, (K, 4 * N_COLS), "float32"), random(rng, (4 * N_COLS, K), "float32")
    dx, dw1, dw2 = (random(rng, v.shape, "float32") for v in (x, w1, w2))

    def block(x, w1, w2):
        h = jnp.tanh(jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1)
        return jax.lax.psum_scatter(h @ w2, "tp", scatter_dimension=0, tiled=True)

    plain = jax.jit(jax.shard_map(block, mesh=mesh2d, in_specs=in_specs, out_specs=out_spec))
    fused = jax.jit(jax.shard_map(ficco_jax.overlap(block, schedule=schedule), mesh=mesh2d, in_specs=in_specs,
                                  out_specs=out_spec))
    args, tangents = (x, w1, w2), (dx, dw1, dw2)
    assert str(jax.make_jaxpr(fused)(*args)) != str(jax.make_jaxpr(plain)(*args)), "overlap rewrote nothing"
    _assert_close(jax.jvp(fused, args, tangents), jax.jvp(plain, args, tangents))
    _assert_close(jax.jacfwd(fused, argnums=1)(*args), jax.jacfwd(plain, argnums=1)(*args))


@pytest.mark.parametrize("sched", ["xla/ring/c2"] + (["dma/direct/c2"] if ficco_jax.dma.available() else []))
def test_layers_in_remat_scan(mesh2d, rng, sched):
    """A residual stack of ag_matmul -> tanh -> matmul_rs layers in a scan of jax.checkpoint steps:
    there the tangents are staged and transposed as equations of the scan's body."""
    layers = 2
    in_specs = (P(("dp", "tp"), None), P(None, None, "tp"), P(None, "tp", None))
    x = random(rng, (8 * M_ROWS, K), "float32")
    w1, w2 = random(rng, (layers, K, 4 * N_COLS), "float32"), random(rng, (layers, 4 * N_COLS, K), "float32")
    dx, dw1, dw2 = (random(rng, v.shape, "float32") for v in (x, w1, w2))

    def stack(ag, rs):
        def body(x, w1, w2):
            def step(h, ws):
                return h + rs(jnp.tanh(ag(h, ws[0], "tp")), ws[1], "tp"), None
            return jax.lax.scan(jax.checkpoint(step), x, (w1, w2))[0]
        return jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=in_specs, out_specs=in_specs[0]))

    got = stack(lambda h, w, a: ficco_jax.ag_matmul(h, w, a, schedule=sched),
                lambda h, w, a: ficco_jax.matmul_rs(h, w, a, schedule=sched))
    want = stack(ficco_jax.ag_matmul_ref, ficco_jax.matmul_rs_ref)
    args, tangents = (x, w1, w2), (dx, dw1, dw2)
    _assert_close(jax.jvp(got, args, tangents), jax.jvp(want, args, tangents))

    def loss(program):  # arrays compared below (a scalar sum would hide errors in cancellation)
        return lambda *args: jnp.sum(jnp.sin(program(*args)))

    def hvp(program):
        return jax.jvp(jax.grad(loss(program), argnums=(0, 1, 2)), args, tangents)

    _assert_close(jax.grad(loss(got), argnums=(0, 1, 2))(*args), jax.grad(loss(want), argnums=(0, 1, 2))(*args))
    # Two layers of second derivatives: chunked sums in another order differ by a few f32 ulps
    # per layer, amplified (about 1e-5 seen for xla and dma schedules alike).
    _assert_close(hvp(got)[1], hvp(want)[1], rtol=5 * RTOL)


def _vmapped(mesh, op, body, in_axes):
    """jit(shard_map(vmap(body))) of a batch of 2 in dimension `in_axes[0]` of a (and of w where
    in_axes[1] is 0), the batch leading in the result."""
    (a_spec, w_spec), out_spec = OPS[op][2](mesh)

    def batched(spec, axis):
        return spec if axis is None else P(*[*spec][:axis], None, *[*spec][axis:])

    return jax.jit(jax.shard_map(jax.vmap(body, in_axes=in_axes), mesh=mesh,
                                 in_specs=(batched(a_spec, in_axes[0]), batched(w_spec, in_axes[1])),
                                 out_specs=P(None, *out_spec)))


def _batched_operands(mesh, op, rng, in_axes):
    a_shape, w_shape = OPS[op][3](op, mesh)
    a_shape = (*a_shape[:in_axes[0]], 2, *a_shape[in_axes[0]:])
    w_shape = w_shape if in_axes[1] is None else (2, *w_shape)
    return random(rng, a_shape, "float32"), random(rng, w_shape, "float32")


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", list(_cases(comms=("xla", "dma"), first_only=True)))
def test_vmap_matches_reference(mesh2d, rng, op, sched):
    """A batch of inputs against one weight: the batch folds into the rows of one call of the op
    (no loop in the program), its results reordered."""
    fn, ref = OPS[op][:2]
    a, w = _batched_operands(mesh2d, op, rng, (0, None))

    def program(body):
        return _vmapped(mesh2d, op, body, (0, None))

    got = program(lambda a, w: fn(a, w, "tp", schedule=sched))(a, w)
    _assert_close(got, program(lambda a, w: ref(a, w, "tp"))(a, w))
    lowered = program(lambda a, w: fn(a, w, "tp", schedule=sched)).lower(a, w)
    assert "stablehlo.while" not in lowered.as_text()
    if sched.startswith("dma"):  # one executor call per target the op's schedule calls
        assert ffi_calls(lowered.compile().as_text()) == len(TARGETS.get(op, (op,)))


@pytest.mark.sweep
@pytest.mark.parametrize("in_axes", [(1, None), (0, 0)], ids=["batch-not-leading", "batched-weights"])
@pytest.mark.parametrize("op,sched", list(_cases(comms=("xla", "dma"), first_only=True)))
def test_vmap_folds_or_loops(mesh2d, rng, op, sched, in_axes):
    """A batch in another dimension of the input still folds into one call; a batch of weights
    cannot (each element has its own matmul weight) and runs the op once per element, in a loop."""
    fn, ref = OPS[op][:2]
    a, w = _batched_operands(mesh2d, op, rng, in_axes)
    got_fn = _vmapped(mesh2d, op, lambda a, w: fn(a, w, "tp", schedule=sched), in_axes)
    _assert_close(got_fn(a, w), _vmapped(mesh2d, op, lambda a, w: ref(a, w, "tp"), in_axes)(a, w))
    loops = "stablehlo.while" in got_fn.lower(a, w).as_text()
    assert loops == (in_axes[1] is not None)


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", list(_cases(comms=("xla", "dma"), first_only=True)))
def test_grad_of_vmap_folds(mesh2d, rng, op, sched):
    """grad of vmap, a batch of inputs against one weight: the tangent map, whose residuals (the
    input's rows, the delivered side output) are batched with the input while the weight's tangent
    is not, folds as well: no loop, and the weight's gradient is one product over the batch, as
    the reference's (a loop summed one gradient per element in the weight's dtype)."""
    fn, ref = OPS[op][:2]
    a, w = _batched_operands(mesh2d, op, rng, (0, None))
    (a_spec, w_spec), _ = OPS[op][2](mesh2d)

    def program(body):
        loss = lambda a, w: jnp.sum(jnp.sin(jax.vmap(body, in_axes=(0, None))(a, w)))  # noqa: E731
        return jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh2d,
                                     in_specs=(P(None, *a_spec), w_spec), out_specs=(P(None, *a_spec), w_spec)))

    got = program(lambda a, w: fn(a, w, "tp", schedule=sched))
    for g, r in zip(got(a, w), program(lambda a, w: ref(a, w, "tp"))(a, w)):
        _assert_close(g, r)
    assert "stablehlo.while" not in got.lower(a, w).as_text()


@pytest.mark.parametrize("op", ["ag_matmul", "a2a_matmul"])
def test_vmap_of_side_outputs(mesh2d, rng, op):
    """return_gathered / return_received under vmap: both results folded and reordered."""
    fn, _, specs, _ = OPS[op]
    flag = "return_gathered" if op == "ag_matmul" else "return_received"
    collective = ((lambda x: jax.lax.all_gather(x, "tp", axis=0, tiled=True)) if op == "ag_matmul"
                  else (lambda x: jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)))
    local = (lambda s, w: s @ w) if op == "ag_matmul" else (lambda s, w: jnp.einsum("pecd,edf->pecf", s, w))
    (a_spec, w_spec), out_spec = specs(mesh2d)
    side_spec = P(("dp", "tp"), None) if op == "ag_matmul" else P(("dp", "tp"))
    a, w = _batched_operands(mesh2d, op, rng, (0, None))

    def program(body):
        return jax.jit(jax.shard_map(jax.vmap(body, in_axes=(0, None)), mesh=mesh2d, in_specs=(P(None, *a_spec), w_spec),
                                     out_specs=(P(None, *out_spec), P(None, *side_spec))))

    got = program(lambda a, w: fn(a, w, "tp", schedule="xla/ring/c2", **{flag: True}))
    _assert_close(got(a, w), program(lambda a, w: (local(collective(a), w), collective(a)))(a, w))
    assert "stablehlo.while" not in got.lower(a, w).as_text()
