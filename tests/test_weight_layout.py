"""w's layout: a copy-engine matmul reads a weight that is a transpose as the stored array's bytes.

The input gradient of each op multiplies by w transposed (ops/table.transpose_w), a user writes
``x @ v.T``, and JAX's own backward of ``x @ w`` contracts w's last dimension: the ops take such a
weight column-major (`w_col_major`, lowering/dma/registry.py), so that XLA hands over the stored
array (a bitcast) instead of writing the transpose out before the call. Checked on the compiled
CPU program (no copy and no byte-moving transpose writes any matmul call's w), and against the
plain-JAX reference, values and gradients, on the CPU backend of the executor (whose matmuls read
a column-major w as cuBLASLt's do: device/gemm.cc).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from ficco_jax import dma
from helpers import TOLERANCE, ffi_calls, random, rel_err, weight_writers

pytestmark = pytest.mark.skipif(not dma.available(), reason="the ficco_jax extension is not built")

TP = 4
SCHEDULE = "dma/direct/c2"
# Per device: x [m, K] (gathered to [TP*m, K]), a weight [K, N]; y [TP*m, N], a weight [N, K]; K != N
# so that a transposed index shows. The expert ops: x [TP, E, C, D] and a weight [E, D, F].
M, K, N = 4, 12, 8
E, C, D, F = 2, 4, 8, 6


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:TP]), ("tp",))


# ------------------------------------------------------------------------------------------------
# The compiled program: what writes each copy-engine matmul's w
# ------------------------------------------------------------------------------------------------
def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _specs(op, stored=False):
    """((operand spec, weight spec), result spec) of one op in a shard_map over `tp`; with
    `stored`, the weight's is that of the array it is the transpose of."""
    (a, w), out = {"ag_matmul": ((P("tp", None), P(None, "tp")), P(None, "tp")),
                   "matmul_rs": ((P(None, "tp"), P("tp", None)), P("tp", None)),
                   "matmul_psum": ((P(None, "tp"), P("tp", None)), P(None, None)),
                   "a2a_matmul": ((P("tp"), P("tp")), P("tp")),
                   "matmul_a2a": ((P("tp"), P("tp")), P("tp"))}[op]
    if stored and len(w) == 2:  # the expert weights are split over E, which no transpose moves
        w = P(w[1], w[0])
    return (a, w), out


def _global_shapes(op):
    """(operand, weight as the op takes it) globally."""
    return {"ag_matmul": ((TP * M, K), (K, TP * N)),
            "matmul_rs": ((TP * M, TP * N), (TP * N, K)),
            "matmul_psum": ((TP * M, TP * N), (TP * N, K)),
            "a2a_matmul": ((TP * TP, E, C, D), (TP * E, D, F)),
            "matmul_a2a": ((TP * TP, E, C, F), (TP * E, F, D))}[op]


def _transpose(op, w):
    """The stored array a weight is the transpose of (and the transpose itself): w.T, or per expert."""
    return jnp.swapaxes(w, 1, 2) if w.ndim == 3 else w.T


def _loss(mesh, op, fn, stored: bool, **kwargs):
    """sum(op(a, w) * cot) in a shard_map; with `stored` the argument is the array w is the
    transpose of, and the body reads its transpose (``x @ v.T``)."""
    (a_spec, w_spec), out_spec = _specs(op, stored)

    def body(a, w, cot):
        w = _transpose(op, w) if stored else w
        return jnp.sum(fn(a, w, "tp", **kwargs) * cot)[None]  # this device's part of the sum

    parts = jax.shard_map(body, mesh=mesh, in_specs=(a_spec, w_spec, out_spec), out_specs=P("tp"))
    return lambda a, w, cot: jnp.sum(parts(a, w, cot))


def _arguments(mesh, op, rng, stored: bool, dtype="float32"):
    a_shape, w_shape = _global_shapes(op)
    a, w = random(rng, a_shape, dtype), random(rng, w_shape, dtype)
    ref = getattr(ficco_jax, f"{op}_ref")
    (a_spec, w_spec), out_spec = _specs(op)
    out = jax.eval_shape(jax.shard_map(lambda a, w: ref(a, w, "tp"), mesh=mesh, in_specs=(a_spec, w_spec),
                                       out_specs=out_spec), a, w)
    cot = random(rng, out.shape, dtype)
    return a, (_transpose(op, w) if stored else w), cot


# ------------------------------------------------------------------------------------------------
# The backward of every op reads w^T without writing it
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "a2a_matmul", "matmul_a2a"])
def test_backward_reads_the_transposed_weight_in_place(mesh, rng, op):
    """The input gradient is the pair's other op with w transposed: XLA passes w's own buffer."""
    fn = functools.partial(getattr(ficco_jax, op), schedule=SCHEDULE)
    grad = jax.value_and_grad(_loss(mesh, op, fn, stored=False), argnums=(0, 1))
    writers = weight_writers(_compiled(grad, *_arguments(mesh, op, rng, stored=False)))
    assert all(not moves for moves in writers.values()), writers
    assert sorted(col for _, col in writers) == [0, 1], writers  # the forward row-major, the backward not


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_psum", "a2a_matmul", "matmul_a2a"])
def test_a_transposed_weight_is_read_in_place_with_w_col_major(mesh, rng, op):
    """``op(x, v.T, w_col_major=True)``: forward and backward read v as stored."""
    fn = functools.partial(getattr(ficco_jax, op), schedule=SCHEDULE, w_col_major=True)
    grad = jax.value_and_grad(_loss(mesh, op, fn, stored=True), argnums=(0, 1))
    writers = weight_writers(_compiled(grad, *_arguments(mesh, op, rng, stored=True)))
    assert 1 in [col for _, col in writers] and len(writers) >= 1 + (op != "matmul_psum"), writers
    assert all(not moves for moves in writers.values()), writers


def test_row_major_request_of_a_transpose_writes_it_out(mesh, rng):
    """The check can fail: `op(x, v.T)` without w_col_major makes XLA write v.T before the call."""
    fn = functools.partial(ficco_jax.ag_matmul, schedule=SCHEDULE)
    writers = weight_writers(_compiled(_loss(mesh, "ag_matmul", fn, stored=True),
                                       *_arguments(mesh, "ag_matmul", rng, stored=True)))
    assert [col for _, col in writers] == [0] and all(writers.values()), writers


# ------------------------------------------------------------------------------------------------
# Numerics: w read column-major equals the reference, values and gradients
# ------------------------------------------------------------------------------------------------
_NUMERIC_CASES = [(op, sched) for op, scheds in {
    "ag_matmul": ("dma/direct/c2", "dma/ring/c4/grouped", "dma/direct/c2/push"),
    "matmul_rs": ("dma/direct/c2", "dma/direct/c4/grouped/s2", "dma/direct/c2/columns"),
    "matmul_psum": ("dma/direct/c2", "dma/direct/c4/columns"),
    "a2a_matmul": ("dma/direct/c2", "dma/ring/c4/grouped"),
    "matmul_a2a": ("dma/direct/c2", "dma/direct/c1/push"),
}.items() for sched in scheds]


@pytest.mark.sweep
@pytest.mark.parametrize("op,sched", _NUMERIC_CASES)
def test_w_col_major_matches_the_reference(mesh, rng, op, sched):
    fn = functools.partial(getattr(ficco_jax, op), schedule=sched, w_col_major=True)
    ref = getattr(ficco_jax, f"{op}_ref")
    args = _arguments(mesh, op, rng, stored=True)
    got = jax.jit(jax.value_and_grad(_loss(mesh, op, fn, stored=True), argnums=(0, 1)))(*args)
    want = jax.jit(jax.value_and_grad(_loss(mesh, op, ref, stored=True), argnums=(0, 1)))(*args)
    assert abs(float(got[0]) - float(want[0])) <= TOLERANCE["float32"] * abs(float(want[0])) + 1e-4
    for g, r in zip(got[1], want[1]):
        assert rel_err(g, r) < TOLERANCE["float32"]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "a2a_matmul", "matmul_a2a"])
def test_w_col_major_forward_in_bfloat16(mesh, rng, op):
    (a_spec, v_spec), out_spec = _specs(op, stored=True)
    a, v, _ = _arguments(mesh, op, rng, stored=True, dtype="bfloat16")

    def run(fn, **kwargs):
        body = lambda a, v: fn(a, _transpose(op, v), "tp", **kwargs)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(a_spec, v_spec), out_specs=out_spec))(a, v)

    got = run(getattr(ficco_jax, op), schedule=SCHEDULE, w_col_major=True)
    want = run(getattr(ficco_jax, f"{op}_ref"))
    assert rel_err(got, want) < TOLERANCE["bfloat16"]


def test_w_col_major_must_be_a_bool(mesh, rng):
    a, w, _ = _arguments(mesh, "ag_matmul", rng, stored=False)
    (a_spec, w_spec), out_spec = _specs("ag_matmul")
    body = lambda a, w: ficco_jax.ag_matmul(a, w, "tp", schedule=SCHEDULE, w_col_major="yes")  # noqa: E731
    with pytest.raises(TypeError, match="w_col_major must be a bool, found 'yes'"):
        jax.shard_map(body, mesh=mesh, in_specs=(a_spec, w_spec), out_specs=out_spec)(a, w)


# ------------------------------------------------------------------------------------------------
# overlap(): sites whose weight is a transpose
# ------------------------------------------------------------------------------------------------
def _mlp(x, w_qkv, w_down_t):
    """Sequence-parallel block: a gathered activation times a multi-dimensional weight [d, h, k], and
    a row-parallel matmul by ``v.T`` (v stored [d, f]) reduce-scattered."""
    g = jax.lax.all_gather(x, "tp", axis=0, tiled=True)
    h = jnp.tanh(jnp.einsum("sd,dhk->shk", g, w_qkv)).reshape(g.shape[0], -1)
    return jax.lax.psum_scatter(h @ w_down_t.T, "tp", scatter_dimension=0, tiled=True)


def _mlp_args(rng):
    s, d, heads, k = TP * 4, 16, 2 * TP, 4
    return (random(rng, (s, d), "float32"), random(rng, (d, heads, k), "float32"),
            random(rng, (d, heads * k), "float32"))


def _mlp_loss(mesh):
    f = jax.shard_map(_mlp, mesh=mesh, in_specs=(P("tp", None), P(None, "tp", None), P(None, "tp")),
                      out_specs=P("tp", None))
    return lambda *args: jnp.sum(jnp.sin(f(*args)))


@pytest.mark.parametrize("wrap", ["overlap(grad)", "grad(overlap)"])
def test_overlap_reads_transposed_weights_in_place(mesh, rng, wrap):
    """JAX's input gradients (w^T of a 2-D and of a 3-D weight) and ``x @ v.T`` in the forward: no
    site's weight is written by a transpose; values and gradients are the plain program's."""
    loss, args = _mlp_loss(mesh), _mlp_args(rng)
    if wrap == "overlap(grad)":
        step = ficco_jax.overlap(jax.value_and_grad(loss, argnums=(0, 1, 2)), schedule=SCHEDULE)
    else:
        step = jax.value_and_grad(ficco_jax.overlap(loss, schedule=SCHEDULE), argnums=(0, 1, 2))
    writers = weight_writers(_compiled(step, *args))
    assert len(writers) == 4 and 1 in [col for _, col in writers], writers
    if wrap == "overlap(grad)":
        # The forward's x @ v.T is read in place; in the backward that transpose is a residual of
        # another shard_map body, whose producer the site does not see: one copy, not two.
        assert sum(bool(m) for m in writers.values()) <= 1, writers
    else:
        assert all(not moves for moves in writers.values()), writers
    got = jax.jit(step)(*args)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    assert rel_err(got[0], want[0]) < TOLERANCE["float32"]
    for g, r in zip(got[1], want[1]):
        assert rel_err(g, r) < TOLERANCE["float32"]


def _moe(x, w_in, w_out):
    received = jax.lax.all_to_all(x, "tp", 0, 0, tiled=True)
    h = jax.nn.relu(jnp.einsum("pecd,edf->pecf", received, w_in))
    return jax.lax.all_to_all(jnp.einsum("pecf,efd->pecd", h, w_out), "tp", 0, 0, tiled=True)


def test_overlap_of_expert_backward_reads_weights_in_place(mesh, rng):
    f = jax.shard_map(_moe, mesh=mesh, in_specs=(P("tp"), P("tp"), P("tp")), out_specs=P("tp"))
    loss = lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    args = (random(rng, (TP * TP, E, C, D), "float32"), random(rng, (TP * E, D, F), "float32"),
            random(rng, (TP * E, F, D), "float32"))
    step = ficco_jax.overlap(jax.value_and_grad(loss, argnums=(0, 1, 2)), schedule=SCHEDULE)
    writers = weight_writers(_compiled(step, *args))
    # Both forward sites and the backward's dispatch of the combine's cotangent (the other
    # backward matmul batches the tokens' peer dimension: a near-miss of the rewrite).
    assert sorted(col for _, col in writers) == [0, 0, 1], writers
    assert all(not moves for moves in writers.values()), writers
    got = jax.jit(step)(*args)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    for g, r in zip(got[1], want[1]):
        assert rel_err(g, r) < TOLERANCE["float32"]


# ------------------------------------------------------------------------------------------------
# FP8: the same attribute, always column-major
# ------------------------------------------------------------------------------------------------
def test_fp8_targets_are_lowered_column_major(monkeypatch, mesh):
    """A scaled call asks for w column-major whatever its caller passes (cuBLASLt's FP8 matmuls
    need the "TN" form); lowered only: FP8 matmuls run on GPUs."""
    from ficco_jax.runtime import extension
    monkeypatch.setattr(extension, "fp8_matmuls_supported", lambda platform=None: True)
    x = jnp.zeros((TP * M, K), jnp.float8_e4m3fn)
    w = jnp.zeros((K, TP * N), jnp.float8_e4m3fn)
    body = lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=SCHEDULE, x_scale=jnp.float32(1),  # noqa: E731
                                            w_scale=jnp.float32(1))
    text = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                 out_specs=P(None, "tp"))).lower(x, w).as_text()
    call = next(line for line in text.splitlines() if "ficco_ag_matmul_scaled" in line)
    assert "w_col_major = 1" in call and "dense<[0, 1]>" in call, call


# ------------------------------------------------------------------------------------------------
# overlap(): weights that are transposes of other shapes and rank
# ------------------------------------------------------------------------------------------------
def _gathered(x):
    return jax.lax.all_gather(x, "tp", axis=0, tiled=True)


#: name -> (body(x, v), (x spec, v spec), (x shape, v shape)) per program: a site whose weight is v
#: transposed, of a square v (a layout read the wrong way round would give x @ v, silently), of a
#: 4-D v whose dimensions move both across and within the contracted and free groups, reshaped
#: after the transpose, and transposed outside a remat and jit body that holds the site.
_TRANSPOSED_WEIGHTS = {
    "square": (lambda x, v: _gathered(x) @ v.T, (P("tp", None), P("tp", None)), ((TP * 4, 16), (16, 16))),
    "4d-moved-across-groups": (
        lambda x, v: jnp.einsum("sd,dbac->sbac", _gathered(x), jnp.transpose(v, (3, 1, 0, 2))).reshape(TP * 4, -1),
        (P("tp", None), P(None, "tp", None, None)), ((TP * 4, 8), (3, TP, 2, 8))),
    "transposed-then-reshaped": (
        lambda x, v: jnp.einsum("sd,dtf->stf", _gathered(x), v.T.reshape(8, 2, -1)).reshape(TP * 4, -1),
        (P("tp", None), P("tp", None)), ((TP * 4, 8), (2 * TP * 4, 8))),
    "outside-remat-and-jit": (
        lambda x, v: jax.checkpoint(jax.jit(lambda x, w: _gathered(x) @ w))(x, v.T),
        (P("tp", None), P("tp", None)), ((TP * 4, 16), (16, 16))),
}


@pytest.mark.sweep
@pytest.mark.parametrize("wrap", ["overlap(grad)", "grad(overlap)"])
@pytest.mark.parametrize("name", list(_TRANSPOSED_WEIGHTS))
def test_overlap_of_transposed_weights_matches_the_plain_program(mesh, rng, name, wrap):
    """Whatever layout a site asks for its weight, values and gradients are the plain program's
    (with every weight taken row-major while the executor reads it column-major, each case fails)."""
    body, specs, shapes = _TRANSPOSED_WEIGHTS[name]
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))
    loss = lambda x, v: jnp.sum(jnp.sin(f(x, v)))  # noqa: E731
    args = [random(rng, shape, "float32") for shape in shapes]
    plain = jax.value_and_grad(loss, argnums=(0, 1))
    if wrap == "overlap(grad)":
        step = ficco_jax.overlap(plain, schedule=SCHEDULE)
    else:
        step = jax.value_and_grad(ficco_jax.overlap(loss, schedule=SCHEDULE), argnums=(0, 1))
    assert ffi_calls(_compiled(step, *args)) >= 2  # the site and its backward run on copy engines
    got, want = jax.jit(step)(*args), jax.jit(plain)(*args)
    assert rel_err(got[0], want[0]) < TOLERANCE["float32"]
    for g, r in zip(got[1], want[1]):
        assert rel_err(g, r) < TOLERANCE["float32"]
