"""ficco_jax.overlap / explain: the jaxpr rewrite of collective+matmul sites (8 CPU devices)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools
import logging

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ficco_jax.schedule import Schedule
from ficco_jax.transform import explain, overlap

XLA = Schedule(comm="xla", chunks=1, order="ring")
RTOL = 1e-5  # f32, relative to the norm of the reference
B, S, D, F, H = 4, 64, 32, 64, 8  # global batch, tokens, hidden, ffn, heads (D // H per head)
COLLECTIVES = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "psum_scatter": "reduce_scatter"}


@pytest.fixture
def mesh(mesh2d):
    return mesh2d


def _random(key, *shapes):
    keys = jax.random.split(jax.random.key(key), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) / np.sqrt(s[-1]) + 0.1 for k, s in zip(keys, shapes)]


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
    assert "also used by 2 more" in ag.shapes  # q's site returns the gathered x for k and v
    report = assert_rewritten(jax.value_and_grad(loss, (0, 1, 2, 3, 4)), *args)
    # dx is the sum of three matmuls before it is scattered: reported, not rewritten
    assert any("add" in r.reason for r in report.near_misses if r.op == "matmul_rs"), str(report)


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


@pytest.mark.parametrize("form", AG_FORMS, ids=[f[0] for f in AG_FORMS])
def test_ag_einsum_forms(mesh, form):
    spec, axis, x_shape, w_shape = form
    def body(x, w):
        g = jax.lax.all_gather(x, "tp", axis=axis, tiled=True)
        return jnp.einsum(spec, w, g) if spec.startswith("df") else jnp.einsum(spec, g, w)

    fn, x, w = _forms_fn(mesh, body, x_shape, w_shape)
    assert_rewritten(fn, x, w, sites=1)
    assert_close(overlap(fn, schedule=XLA)(x, w), fn(x, w))


@pytest.mark.parametrize("form", RS_FORMS, ids=[f[0] for f in RS_FORMS])
def test_rs_einsum_forms(mesh, form):
    spec, axis, y_shape, w_shape = form

    def body(y, w):
        out = jnp.einsum(spec, w, y) if spec.startswith("df") else jnp.einsum(spec, y, w)
        return jax.lax.psum_scatter(out, "tp", scatter_dimension=axis, tiled=True)

    fn, y, w = _forms_fn(mesh, body, y_shape, w_shape)
    report = explain(overlap(fn, schedule=XLA), y, w)
    if report.sites:
        assert_rewritten(fn, y, w, sites=1)
    else:  # einsum put a transpose between the matmul and the scatter
        assert "transpose" in report.near_misses[0].reason, str(report)
    assert_close(overlap(fn, schedule=XLA)(y, w), fn(y, w))
