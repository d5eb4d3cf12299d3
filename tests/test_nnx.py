"""overlap() on Flax NNX training steps and on functions that update their arguments in place, with
forced schedules so that the sites are rewritten on CPU (8 devices, a (dp 2, tp 4) mesh).

Each training form runs several steps overlapped and plain from the same initial state; the
losses, the parameters and the optimizer state must agree, and the parameters must have moved.
"""
import dataclasses
import os
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from ficco_jax.rewrite import explain, overlap  # noqa: E402
from helpers import TOLERANCE, rel_err, runs_given  # noqa: E402

SCHEDULES = ["xla/ring/c2", "dma/direct/c2", "dma/direct/c2/columns"]
T, D_IN, D, F = 64, 8, 16, 32  # tokens, input width, hidden, ffn
STEPS = 3
LEARNING_RATE = 0.05
RTOL = TOLERANCE["float32"]


class TensorParallelMLP(nnx.Module):
    """Sequence-parallel Megatron MLP in a shard_map: the tokens, split over (dp, tp), are gathered
    over tp before the column-parallel w1 (all_gather → dot), and the row-parallel w2's partial
    sums are reduce-scattered back onto them (dot → psum_scatter)."""

    def __init__(self, mesh, rngs: nnx.Rngs):
        self.mesh = mesh
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (D, F)) / np.sqrt(D))
        self.b1 = nnx.Param(0.1 * jax.random.normal(rngs.params(), (F,)))
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (F, D)) / np.sqrt(F))

    def __call__(self, x):
        def block(w1, b1, w2, x):
            h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1 + b1
            return jax.lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", scatter_dimension=0, tiled=True)

        tokens = P(("dp", "tp"))
        return jax.shard_map(block, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp"), P("tp", None), tokens),
                             out_specs=tokens)(self.w1[...], self.b1[...], self.w2[...], x)


class Model(nnx.Module):
    """Two residual tensor-parallel MLP blocks between plain input and output layers; `tied`
    makes the blocks share one w1 Variable."""

    def __init__(self, mesh, seed: int, tied: bool = False):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Linear(D_IN, D, rngs=rngs)
        self.blocks = nnx.List([TensorParallelMLP(mesh, rngs) for _ in range(2)])
        if tied:
            self.blocks[1].w1 = self.blocks[0].w1
        self.head = nnx.Linear(D, D_IN, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # flax 0.12: the model's Params are updated in place
    return loss


def batch(mesh, seed):
    kx, ky = jax.random.split(jax.random.key(seed))
    place = NamedSharding(mesh, P(("dp", "tp")))
    return (jax.device_put(jax.random.normal(kx, (T, D_IN)), place),
            jax.device_put(jax.random.normal(ky, (T, D_IN)), place))


# --------------------------------------------------------------------------------------------
# The training forms. `wrap` is overlap(..., schedule) or the identity (the plain run); `train`
# returns the losses of STEPS steps and leaves the trained state in `model` and `optimizer`;
# `wrapped` gives the function the form passes to overlap, with its arguments, for explain().
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Form:
    train: Callable
    wrapped: Callable


def jit_of_overlapped_step(wrap, model, optimizer, x, y):
    step = nnx.jit(wrap(train_step))
    return [step(model, optimizer, x, y) for _ in range(STEPS)]


def overlapped_jitted_step(wrap, model, optimizer, x, y):
    step = wrap(nnx.jit(train_step))
    return [step(model, optimizer, x, y) for _ in range(STEPS)]


def overlap_inside_jit(wrap, model, optimizer, x, y):
    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = wrap(nnx.value_and_grad(loss_fn))(model, x, y)
        optimizer.update(model, grads)
        return loss

    return [step(model, optimizer, x, y) for _ in range(STEPS)]


def state_loss(graphdef):
    """The loss as a function of the model's state (nnx.split's), for plain JAX transformations."""
    return lambda params, x, y: loss_fn(nnx.merge(graphdef, params), x, y)


def split_merge(wrap, model, optimizer, x, y):
    graphdef, params = nnx.split(model)
    loss_and_grad = jax.jit(wrap(jax.value_and_grad(state_loss(graphdef))))
    tx = optax.adam(LEARNING_RATE)
    opt_state, losses = tx.init(params), []
    for _ in range(STEPS):
        loss, grads = loss_and_grad(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(loss)
    nnx.update(model, params)
    return losses


FORMS = {
    "nnx.jit(overlap(step))": Form(
        jit_of_overlapped_step, lambda model, optimizer, x, y: (train_step, (model, optimizer, x, y))),
    "overlap(nnx.jit(step))": Form(
        overlapped_jitted_step, lambda model, optimizer, x, y: (nnx.jit(train_step), (model, optimizer, x, y))),
    "overlap inside nnx.jit": Form(
        overlap_inside_jit, lambda model, optimizer, x, y: (nnx.value_and_grad(loss_fn), (model, x, y))),
    "split/merge, jax.jit(overlap(value_and_grad))": Form(
        split_merge, lambda model, optimizer, x, y: (jax.value_and_grad(state_loss(nnx.graphdef(model))),
                                                     (nnx.state(model), x, y))),
}


def train(form, wrap, mesh, tied=False):
    model = Model(mesh, seed=0, tied=tied)
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    losses = FORMS[form].train(wrap, model, optimizer, *batch(mesh, 1))
    return np.asarray(losses), model, optimizer


def assert_close(got, want):
    """Within RTOL (relative Frobenius norm); exactly equal where `want` is all zeros or integer."""
    if not jnp.issubdtype(jnp.asarray(want).dtype, jnp.floating) or not np.any(want):
        np.testing.assert_array_equal(got, want)
    else:
        assert rel_err(got, want) <= RTOL


def moved(now, before) -> bool:
    return float(np.linalg.norm(np.asarray(now) - np.asarray(before))) > 1e-3 * float(np.linalg.norm(now))


def assert_same_training(overlapped, plain, initial):
    (losses, model, optimizer), (want_losses, want_model, want_optimizer) = overlapped, plain
    assert_close(losses, want_losses)
    params, want, start = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (model, want_model, initial))
    assert len(params) == len(want) == len(start)
    for got, expected, first in zip(params, want, start):
        assert_close(got, expected)
        assert moved(expected, first)  # the step trained: a run that drops the updates cannot pass
    for got, expected in zip(jax.tree.leaves(nnx.state(optimizer)), jax.tree.leaves(nnx.state(want_optimizer))):
        assert_close(got, expected)


def assert_rewritten(form, schedule, mesh):
    model = Model(mesh, seed=0)
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    fn, args = FORMS[form].wrapped(model, optimizer, *batch(mesh, 1))
    report = explain(overlap(fn, schedule=schedule), *args)
    # Two blocks: each forward gather and scatter, and their transposes in the backward pass.
    assert len(report.sites) >= 4, str(report)
    assert all(runs_given(r, schedule) for r in report.sites), str(report)


@pytest.mark.sweep
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("form", list(FORMS))
def test_training_forms_match_plain(mesh2d, form, schedule):
    assert_rewritten(form, schedule, mesh2d)
    overlapped = train(form, lambda f: overlap(f, schedule=schedule), mesh2d)
    plain = train(form, lambda f: f, mesh2d)
    assert_same_training(overlapped, plain, Model(mesh2d, seed=0))


@pytest.mark.parametrize("form", [f for f in FORMS if not f.startswith("split/merge")])
def test_tied_weights_stay_one_variable(mesh2d, form):
    # overlap traces fn over copies of the model: a shared Variable must stay one object there,
    # or nnx.value_and_grad returns a gradient per copy and the optimizer, which holds one state
    # for it, cannot apply them. (nnx.split state holds it once: split/merge has nothing to keep.)
    overlapped = train(form, lambda f: overlap(f, schedule=SCHEDULES[0]), mesh2d, tied=True)
    plain = train(form, lambda f: f, mesh2d, tied=True)
    assert_same_training(overlapped, plain, Model(mesh2d, seed=0, tied=True))
    model = overlapped[1]
    assert model.blocks[0].w1 is model.blocks[1].w1


# --------------------------------------------------------------------------------------------
# Plain JAX: a dict entry replaced and a jax Ref written, in place
# --------------------------------------------------------------------------------------------
def scatter_matmul(mesh):
    def body(y, w):
        return jax.lax.psum_scatter(y @ w, "tp", scatter_dimension=0, tiled=True)

    return jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P(("dp", "tp")))


def accumulate(mesh):
    matmul_rs = scatter_matmul(mesh)

    def fn(state, y):
        out = matmul_rs(y, state["w"])
        state["total"][...] = state["total"][...] + out.sum(axis=0)  # a jax Ref
        state["w"] = state["w"] - 0.01 * jnp.outer(y.sum(axis=0), out.sum(axis=0))
        state["calls"] = state["calls"] + 1
        return out

    return fn


def accumulator_state(mesh, rng):
    replicated = NamedSharding(mesh, P())
    return {"w": jax.device_put(jnp.asarray(rng.standard_normal((F, D), np.float32)), replicated),
            "total": jax.new_ref(jax.device_put(jnp.asarray(rng.standard_normal(D, np.float32)), replicated)),
            "calls": jax.device_put(jnp.asarray(3, jnp.int32), replicated)}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dict_entries_and_refs_updated_in_place(mesh2d, rng, schedule):
    fn = accumulate(mesh2d)
    y = jnp.asarray(rng.standard_normal((T, F), np.float32))
    state = accumulator_state(mesh2d, rng)
    want = {**state, "total": jax.new_ref(state["total"][...])}
    start = {"w": state["w"], "total": state["total"][...]}
    assert len(explain(overlap(fn, schedule=schedule), state, y).sites) == 1
    fused = overlap(fn, schedule=schedule)
    for _ in range(3):
        assert_close(fused(state, y), fn(want, y))
    assert_close(state["w"], want["w"])
    assert_close(state["total"][...], want["total"][...])
    assert moved(state["w"], start["w"]) and moved(state["total"][...], start["total"])
    assert int(state["calls"]) == int(want["calls"]) == 6


def test_ref_written_under_jit(mesh2d, rng):
    # A Ref needs no write-back: its writes are equations of the rewritten program.
    matmul_rs = scatter_matmul(mesh2d)

    def fn(total, y, w):
        out = matmul_rs(y, w)
        total[...] = total[...] + out.sum(axis=0)
        return out

    y, w = (jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in ((T, F), (F, D)))
    start = jax.device_put(jnp.asarray(rng.standard_normal(D, np.float32)), NamedSharding(mesh2d, P()))
    total, want = jax.new_ref(start), jax.new_ref(start)
    for _ in range(2):
        jax.jit(overlap(fn, schedule=SCHEDULES[0]))(total, y, w)
        jax.jit(fn)(want, y, w)
    assert_close(total[...], want[...])
    assert moved(total[...], start)


# --------------------------------------------------------------------------------------------
# What cannot be carried is refused when a site is rewritten (and works as written when none is)
# --------------------------------------------------------------------------------------------
class Box:
    """A pytree registered without keys: its child has no path to be written back through."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(Box, lambda box: ((box.value,), None), lambda _, children: Box(*children))


def _adds_an_entry(state, out):
    state["extra"] = out


def _replaces_a_python_value(state, out):
    state["mode"] = "eval"


def _replaces_a_leaf_of_a_keyless_node(state, out):
    state["box"].value = out


def _updates_an_object_a_tuple_holds_twice(state, out):
    state["pair"][0]["v"] = out  # the tuple cannot hold one copy twice: fn would see two objects


@pytest.mark.parametrize("update, message", [
    (_adds_an_entry, r"changed the structure of its arguments \(added args\[0\]\['extra'\]\)"),
    (_replaces_a_python_value, r"replaced args\[0\]\['mode'\], a Python str \('train' -> 'eval'\)"),
    (_replaces_a_leaf_of_a_keyless_node, r"replaced args\[0\]\['box'\]\[<flat index 0>\], inside a pytree node "
                                         r"registered without keys"),
    (_updates_an_object_a_tuple_holds_twice, r"args\[0\]\['pair'\]\[0\] and args\[0\]\['pair'\]\[1\] are one dict, "
                                             r"which overlap would trace as two copies"),
], ids=["adds-entry", "python-value", "keyless-node", "shared-in-tuple"])
def test_uncarriable_updates_are_refused(mesh2d, rng, update, message):
    matmul_rs = scatter_matmul(mesh2d)

    def fn(state, y):
        out = matmul_rs(y, state["w"])
        update(state, out)
        return out

    w, v, boxed, y = (jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in ((F, D), (T, D), (T, D), (T, F)))

    def fresh():
        inner = {"v": v}
        return {"w": w, "mode": "train", "box": Box(boxed), "pair": (inner, inner)}

    with pytest.raises(ValueError, match=message):
        overlap(fn, schedule=SCHEDULES[0])(fresh(), y)
    # With no site rewritten, overlap calls fn itself: the update happens as written.
    state, want = fresh(), fresh()
    overlap(fn, schedule="none")(state, y)
    fn(want, y)
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got, expected)
    before = fresh()
    assert jax.tree.structure(state) != jax.tree.structure(before) or not all(
        np.array_equal(got, first) for got, first in zip(jax.tree.leaves(state), jax.tree.leaves(before)))
