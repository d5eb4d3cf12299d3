"""ficco_jax.overlap / explain: the jaxpr rewrite of collective+matmul sites (8 CPU devices)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import logging

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ficco_jax.schedule import Schedule
from ficco_jax.rewrite import explain, overlap

XLA = Schedule(comm="xla", chunks=1, order="ring")
RTOL = 1e-5  # f32, relative to the norm of the reference
B, S, D, F, H = 4, 64, 32, 64, 8  # global batch, tokens, hidden, ffn, heads (D // H per head)
COLLECTIVES = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "psum_scatter": "reduce_scatter"}


@pytest.fixture
def mesh(mesh2d):
    return mesh2d


def _random(key, *shapes):
    keys = jax.random.split(jax.random.key(key), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) / np.sqrt(s[-1]) for k, s in zip(keys, shapes)]


def assert_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        assert np.linalg.norm(a - e) <= RTOL * np.linalg.norm(e), np.abs(a - e).max()


def count_collectives(closed) -> dict:
    """Plain all_gather / reduce_scatter equations anywhere in the jaxpr (sub-jaxprs included)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in COLLECTIVES:
                counts[COLLECTIVES[eqn.primitive.name]] += 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (jex.Jaxpr, jex.ClosedJaxpr)):
                        walk(sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub)

    walk(closed.jaxpr)
    return counts


def assert_rewritten(fn, *args, sites=None, **kw):
    """Every rewritten site removes one plain collective; returns the report."""
    wrapped = overlap(fn, schedule=XLA, **kw)
    report = explain(wrapped, *args)
    before = count_collectives(jax.make_jaxpr(fn)(*args))
    after = count_collectives(jax.make_jaxpr(wrapped)(*args))
    done = {"all_gather": 0, "reduce_scatter": 0}
    for r in report.sites:
        done["all_gather" if r.op == "ag_matmul" else "reduce_scatter"] += 1
    assert after == {k: before[k] - done[k] for k in before}, (before, after, str(report))
    if sites is not None:
        assert len(report.sites) == sites, str(report)
    return report


# --------------------------------------------------------------------------------------------
# Models written with plain all_gather / psum_scatter / einsum
# --------------------------------------------------------------------------------------------
def mlp_body(x, w1, w2t):
    """Sequence-parallel MLP: x [b, s/n, D]; w1 [D, F/n]; w2t [D, F/n] (transposed weight)."""
    g = jax.lax.all_gather(x, "tp", axis=1, tiled=True)
    h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", g, w1))
    o = jnp.einsum("bsf,df->bsd", h, w2t)
    return jax.lax.psum_scatter(o, "tp", scatter_dimension=1, tiled=True)


def attention_body(x, wq, wk, wv, wo):
    """Sequence-parallel attention: x [b, s/n, D]; wq/wk/wv [D, H/n, dh]; wo [H/n, dh, D]."""
    g = jax.lax.all_gather(x, "tp", axis=1, tiled=True)
    q, k, v = (jnp.einsum("bsd,dhk->bshk", g, w) for w in (wq, wk, wv))
    p = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    o = jnp.einsum("bhqs,bshk->bqhk", p, v)
    return jax.lax.psum_scatter(jnp.einsum("bqhk,hkd->bqd", o, wo), "tp", scatter_dimension=1, tiled=True)


X_SPEC = P("dp", "tp", None)
MLP_SPECS = (X_SPEC, P(None, "tp"), P(None, "tp"))
ATTN_SPECS = (X_SPEC, *[P(None, "tp", None)] * 3, P("tp", None, None))


def mlp_args(seed=0):
    return _random(seed, (B, S, D), (D, F), (D, F))


def attention_args(seed=1):
    return _random(seed, (B, S, D), *[(D, H, D // H)] * 3, (H, D // H, D))


def make_loss(mesh, body, specs):
    block = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=X_SPEC)

    def loss(x, *params):
        return jnp.mean(jnp.sin(block(x, *params)) ** 2)

    return loss


MODELS = {"mlp": (mlp_body, MLP_SPECS, mlp_args), "attention": (attention_body, ATTN_SPECS, attention_args)}


@pytest.mark.parametrize("model", MODELS)
def test_loss_and_grads_equal(mesh, model):
    body, specs, make_args = MODELS[model]
    loss, args = make_loss(mesh, body, specs), make_args()
    argnums = tuple(range(len(args)))
    ref = jax.value_and_grad(loss, argnums)(*args)
    assert_close(overlap(loss, schedule=XLA)(*args), ref[0])
    assert_close(jax.value_and_grad(overlap(loss, schedule=XLA), argnums)(*args), ref)  # grad(overlap(f))
    assert_close(overlap(jax.value_and_grad(loss, argnums), schedule=XLA)(*args), ref)  # overlap(grad(f))


def test_mlp_sites_forward_and_backward(mesh):
    loss, args = make_loss(mesh, mlp_body, MLP_SPECS), mlp_args()
    assert_rewritten(loss, *args, sites=2)
    # backward: dout is gathered (transpose of the scatter) and dx scattered (transpose of the gather)
    report = assert_rewritten(jax.value_and_grad(loss, (0, 1, 2)), *args, sites=4)
    assert [r.op for r in report.sites].count("matmul_rs") == 2


def test_attention_sites(mesh):
    loss, args = make_loss(mesh, attention_body, ATTN_SPECS), attention_args()
    report = assert_rewritten(loss, *args, sites=2)
    ag = next(r for r in report.sites if r.op == "ag_matmul")
    assert "3 weights" in ag.shapes and "also used by" not in ag.shapes  # q, k and v: one op
    report = assert_rewritten(jax.value_and_grad(loss, (0, 1, 2, 3, 4)), *args)
    # dx is the sum of three matmuls before it is scattered: one matmul_rs of their operands side by side
    assert any(r.shapes.startswith("3 matmuls summed") for r in report.sites if r.op == "matmul_rs"), str(report)


# --------------------------------------------------------------------------------------------
# Einsum forms: batch dims, transposed weights, gathers along non-leading axes, operand order
# --------------------------------------------------------------------------------------------
AG_FORMS = [  # (einsum, gathered axis of x, x shape per device, w shape)
    ("bsd,df->bsf", 1, (2, 4, 6), (6, 5)),
    ("sbd,df->sbf", 0, (4, 2, 6), (6, 5)),
    ("bsd,fd->bsf", 1, (2, 4, 6), (5, 6)),
    ("bds,df->bsf", 2, (2, 6, 4), (6, 5)),
    ("df,bsd->bfs", 1, (2, 4, 6), (6, 5)),
    ("bsd,dhk->bshk", 1, (2, 4, 6), (6, 3, 2)),
    ("bshk,hkd->bsd", 1, (2, 4, 3, 2), (3, 2, 5)),
]
RS_FORMS = [  # (einsum, scatter axis of the product, y shape per device, w shape)
    ("bsf,fd->bsd", 1, (2, 8, 6), (6, 5)),
    ("sbf,df->sbd", 0, (8, 2, 6), (5, 6)),
    ("bfs,fd->bsd", 1, (2, 6, 8), (6, 5)),
    ("df,bsf->dbs", 2, (2, 8, 6), (5, 6)),
    ("bqhk,hkd->bqd", 1, (2, 8, 3, 2), (3, 2, 5)),
]


def _forms_fn(mesh, body, x_shape, w_shape):
    n = mesh.shape["tp"]
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"), axis_names={"tp"})
    x, w = _random(3, (n * x_shape[0], *x_shape[1:]), w_shape)
    return fn, x, w


@pytest.mark.sweep(first=2)
@pytest.mark.parametrize("form", AG_FORMS, ids=[f[0] for f in AG_FORMS])
def test_ag_einsum_forms(mesh, form):
    spec, axis, x_shape, w_shape = form
    def body(x, w):
        g = jax.lax.all_gather(x, "tp", axis=axis, tiled=True)
        return jnp.einsum(spec, w, g) if spec.startswith("df") else jnp.einsum(spec, g, w)

    fn, x, w = _forms_fn(mesh, body, x_shape, w_shape)
    assert_rewritten(fn, x, w, sites=1)
    assert_close(overlap(fn, schedule=XLA)(x, w), fn(x, w))


@pytest.mark.sweep(first=2)
@pytest.mark.parametrize("form", RS_FORMS, ids=[f[0] for f in RS_FORMS])
def test_rs_einsum_forms(mesh, form):
    spec, axis, y_shape, w_shape = form

    def body(y, w):
        out = jnp.einsum(spec, w, y) if spec.startswith("df") else jnp.einsum(spec, y, w)
        return jax.lax.psum_scatter(out, "tp", scatter_dimension=axis, tiled=True)

    fn, y, w = _forms_fn(mesh, body, y_shape, w_shape)
    assert_rewritten(fn, y, w, sites=1)
    assert_close(overlap(fn, schedule=XLA)(y, w), fn(y, w))


# --------------------------------------------------------------------------------------------
# Composition: jit (outside, with shardings; inside), scan over layers, checkpoint, grad
# --------------------------------------------------------------------------------------------
L = 3  # layers


def stacked_mlp_args(seed=4):
    x, w1, w2t = _random(seed, (B, S, D), (L, D, F), (L, D, F))
    return x, w1, w2t


def scan_inside_loss(mesh, remat=False):
    """One shard_map; the layers are a lax.scan inside its body."""
    layer = jax.checkpoint(mlp_body) if remat else mlp_body

    def body(x, w1, w2t):
        return jax.lax.scan(lambda h, w: (h + layer(h, *w), None), x, (w1, w2t))[0]

    block = jax.shard_map(body, mesh=mesh, in_specs=(X_SPEC, P(None, None, "tp"), P(None, None, "tp")),
                          out_specs=X_SPEC)
    return lambda x, w1, w2t: jnp.mean(jnp.sin(block(x, w1, w2t)) ** 2)


def scan_outside_loss(mesh, remat=False):
    """lax.scan over layers at the top level; each layer is a jitted shard_map."""
    layer = jax.jit(jax.shard_map(mlp_body, mesh=mesh, in_specs=MLP_SPECS, out_specs=X_SPEC))
    layer = jax.checkpoint(layer) if remat else layer

    def loss(x, w1, w2t):
        return jnp.mean(jnp.sin(jax.lax.scan(lambda h, w: (h + layer(h, *w), None), x, (w1, w2t))[0]) ** 2)

    return loss


@pytest.mark.sweep
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("make", [scan_inside_loss, scan_outside_loss], ids=["scan_in_shard_map", "scan_of_shard_maps"])
def test_scan_over_layers(mesh, make, remat):
    loss, args = make(mesh, remat), stacked_mlp_args()
    ref = jax.value_and_grad(loss, (0, 1, 2))(*args)
    report = assert_rewritten(jax.value_and_grad(loss, (0, 1, 2)), *args)
    assert len(report.sites) >= 4 and not report.near_misses, str(report)
    assert_close(overlap(jax.value_and_grad(loss, (0, 1, 2)), schedule=XLA)(*args), ref)
    assert_close(jax.value_and_grad(overlap(loss, schedule=XLA), (0, 1, 2))(*args), ref)


def test_jit_outside_with_shardings_and_inside(mesh):
    loss, args = make_loss(mesh, mlp_body, MLP_SPECS), mlp_args()
    shardings = tuple(NamedSharding(mesh, s) for s in MLP_SPECS)
    args = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    ref = jax.value_and_grad(loss, (0, 1, 2))(*args)
    train_step = jax.jit(overlap(jax.value_and_grad(loss, (0, 1, 2)), schedule=XLA),
                         in_shardings=shardings, out_shardings=(NamedSharding(mesh, P()), shardings))
    assert_close(train_step(*args), ref)
    assert count_collectives(jax.make_jaxpr(train_step)(*args)) == {"all_gather": 0, "reduce_scatter": 0}
    inner_jit = jax.jit(loss)  # a pjit equation around the shard_map, rewritten inside
    assert_rewritten(lambda *a: inner_jit(*a), *args, sites=2)
    assert_close(jax.jit(jax.grad(overlap(inner_jit, schedule=XLA), (0, 1, 2)))(*args), ref[1])


def test_decorator_and_nested_shard_map(mesh):
    """@overlap on a function whose tp shard_map is nested in a dp shard_map."""
    def inner(*args):  # no mesh: the context's, whose dp axis the outer shard_map made manual
        return jax.shard_map(mlp_body, in_specs=(P(None, "tp"), P(None, "tp"), P(None, "tp")),
                             out_specs=P(None, "tp"), axis_names={"tp"})(*args)

    outer = jax.shard_map(inner, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P("dp"), axis_names={"dp"})

    @overlap(schedule=XLA)
    def loss(x, w1, w2t):
        return jnp.mean(jnp.sin(outer(x, w1, w2t)) ** 2)

    args = mlp_args(5)
    assert len(explain(loss, *args).sites) == 2
    # forward only: jax 0.10 itself fails to transpose this nested shard_map
    assert_close(jax.jit(loss)(*args), jax.jit(loss.__wrapped__)(*args))


# --------------------------------------------------------------------------------------------
# Near-misses are reported and left exactly as written; options
# --------------------------------------------------------------------------------------------
def near_miss_body(x, w, v):
    """x [b, s/n, D]; w [D, D]; v [b, s, D] (replicated). Nothing here maps onto the ops."""
    stacked = jax.lax.all_gather(x, "tp", axis=1, tiled=False)  # untiled
    g = jax.lax.all_gather(x, "tp", axis=1, tiled=True)
    h = jnp.einsum("bsd,de->bse", jnp.tanh(g), w)  # elementwise op between gather and matmul
    dw = jnp.einsum("bsd,bse->de", jax.lax.all_gather(x, "tp", axis=1, tiled=True), v)  # contracts the gathered dim
    o = jnp.einsum("bsd,de->bds", h + stacked.reshape(h.shape), w)  # a batched product, transposed, then scattered
    y = jnp.einsum("bsd,de->bse", v * (1.0 + jax.lax.axis_index("tp")), w)  # varying over tp
    return (jax.lax.psum_scatter(jnp.swapaxes(o, 1, 2), "tp", scatter_dimension=1, tiled=True)
            + jax.lax.psum_scatter(y, "tp", scatter_dimension=1, tiled=True) * y[:, :1]  # product used twice
            + jax.lax.psum_scatter(v, "tp", scatter_dimension=1, tiled=True) + dw.sum())  # no matmul


def test_near_misses_untouched_and_reported(mesh, caplog):
    fn = jax.shard_map(near_miss_body, mesh=mesh, in_specs=(X_SPEC, P(), P("dp")), out_specs=X_SPEC)
    x, w, v = _random(6, (B, S, D), (D, D), (B, S, D))
    with caplog.at_level(logging.DEBUG, logger="ficco_jax"):
        report = explain(fn, x, w, v)
    assert not report.sites
    reasons = " | ".join(r.reason for r in report.near_misses)
    for expected in ("untiled", "feeds no matmul", "contracts over the gathered dimension", "batch dimensions",
                     "other users", "not from a matmul"):
        assert expected in reasons, str(report)
    assert len(report) == 6 and "near-miss" in str(report)
    assert sum("left" in m for m in caplog.messages) == 6
    assert str(jax.make_jaxpr(overlap(fn))(x, w, v)) == str(jax.make_jaxpr(fn)(x, w, v))
    assert_close(overlap(fn)(x, w, v), fn(x, w, v))


def test_rewrite_leaves_the_rest_of_the_body_as_written(mesh):
    """A body with one site and unrelated code: only the site's equations change."""
    def body(x, w1, w2t):
        extra = jax.lax.all_gather(jnp.cos(x), "tp", axis=1, tiled=False).sum()
        return jax.lax.psum_scatter(jnp.einsum("bsd,df->bsf", x, w1) @ w2t.T, "tp", scatter_dimension=1, tiled=True) + extra

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", None), P(None, "tp"), P(None, "tp")), out_specs=X_SPEC)
    x, w1, w2t = _random(7, (B, S, D), (D, F), (D, F))
    report = assert_rewritten(fn, x, w1, w2t, sites=1)
    assert report.sites[0].op == "matmul_rs" and len(report.near_misses) == 1
    before, after = jax.make_jaxpr(fn)(x, w1, w2t), jax.make_jaxpr(overlap(fn, schedule=XLA))(x, w1, w2t)
    kept = {"cos", "reduce_sum", "all_gather", "add"}
    names = lambda j: sorted(e.primitive.name for e in _shard_map_body(j).eqns if e.primitive.name in kept)
    assert names(after) == names(before)
    assert_close(overlap(fn, schedule=XLA)(x, w1, w2t), fn(x, w1, w2t))


def _shard_map_body(closed):
    sm = [e for e in _all_eqns(closed.jaxpr) if e.primitive.name == "shard_map"]
    return sm[0].params["jaxpr"]


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jex.Jaxpr, jex.ClosedJaxpr)):
                    yield from _all_eqns(sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub)


def test_ops_filter_and_schedule_fallback(mesh, caplog):
    loss, args = make_loss(mesh, mlp_body, MLP_SPECS), mlp_args()
    report = assert_rewritten(loss, *args, sites=1, ops=("matmul_rs",))
    assert "ag_matmul is not in ops=" in report.near_misses[0].reason
    odd = Schedule(comm="xla", chunks=3)  # 32 rows per device do not divide by 3
    with caplog.at_level(logging.WARNING, logger="ficco_jax"):
        report = explain(overlap(loss, schedule=odd), *args)
    assert all(r.schedule.endswith("(auto)") for r in report.sites) and "using 'auto'" in caplog.text
    # Each site says why the given schedule left it, not that a schedule could be given.
    assert all(r.note.startswith(f"given {odd} does not fit this site: ") and "divide by" in r.note
               for r in report.sites), str(report)
    assert [r.schedule for r in explain(overlap(loss, schedule="xla/ring/c2"), *args).sites] == ["xla/ring/c2"] * 2
    assert_close(overlap(loss, schedule="xla/bidirectional/c2")(*args), loss(*args))
    with pytest.raises(ValueError, match="unknown ops"):
        overlap(loss, ops=("conv_matmul",))
