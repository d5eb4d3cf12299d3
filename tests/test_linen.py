"""A Flax Linen Llama-style block given ficco_jax.dot_general (nn.Dense / nn.DenseGeneral's
`dot_general=`), its parameters and activations placed by logical axis rules on a ("data", "model")
Auto mesh, trained a few optax steps under jax.jit(in_shardings, out_shardings): losses, parameters
and gradients equal the same program with jax.lax.dot_general, and the compiled step holds the
ops the shardings imply (sequence-parallel: all-gather -> q/k/v and gate/up projections,
reduce-scatter after the attention output and down projections)."""
import collections
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")
from flax import linen as nn  # noqa: E402

import ficco_jax  # noqa: E402

from helpers import TOLERANCE, random, rel_err  # noqa: E402

# Activations between sublayers are sharded over "model" along the sequence (sequence parallel);
# inside a sublayer the hidden / head dims are.
RULES = (("batch", "data"), ("seq", "model"), ("embed", None), ("mlp", "model"), ("heads", "model"),
         ("head_dim", None), ("full_seq", None))
STEPS = 3
BATCH, SEQ, EMBED, HEADS, HEAD_DIM, MLP = 4, 16, 32, 8, 4, 64


class Block(nn.Module):
    """RMS norm -> attention (q/k/v and output by DenseGeneral) -> RMS norm -> SwiGLU MLP (Dense)."""
    mesh: Mesh
    dot_general: object

    def constrain(self, x, names):
        return nn.with_logical_constraint(x, names, mesh=self.mesh, rules=RULES)

    def dense(self, features, names, axis=-1, name=None):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        return nn.DenseGeneral(features, axis=axis, use_bias=False, kernel_init=init, dot_general=self.dot_general,
                               name=name)

    def linear(self, features, names, name):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        return nn.Dense(features, use_bias=False, kernel_init=init, dot_general=self.dot_general, name=name)

    @nn.compact
    def __call__(self, x):
        x = self.constrain(x, ("batch", "seq", "embed"))
        h = nn.RMSNorm(name="norm_attn")(x)
        q, k, v = (self.constrain(self.dense((HEADS, HEAD_DIM), ("embed", "heads", "head_dim"), name=n)(h),
                                  ("batch", "full_seq", "heads", "head_dim")) for n in "qkv")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        out = self.dense(EMBED, ("heads", "head_dim", "embed"), axis=(-2, -1), name="o")(attn)
        x = x + self.constrain(out, ("batch", "seq", "embed"))
        h = nn.RMSNorm(name="norm_mlp")(x)
        gate = self.linear(MLP, ("embed", "mlp"), "gate")(h)
        up = self.linear(MLP, ("embed", "mlp"), "up")(h)
        hidden = self.constrain(nn.silu(gate) * up, ("batch", "full_seq", "mlp"))
        down = self.linear(EMBED, ("mlp", "embed"), "down")(hidden)
        return x + self.constrain(down, ("batch", "seq", "embed"))


@pytest.fixture(scope="module")
def mesh():
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]]
    return Mesh(devices.reshape(2, 4), ("data", "model"))


def _trainer(mesh, dot_general):
    """(params, opt_state, jitted step) of the block with `dot_general`, initialised alike."""
    model = Block(mesh, dot_general)
    x_sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq", "embed"), RULES))
    tx = optax.sgd(0.1, momentum=0.9)  # adam would turn rounding-level gradient differences into sign flips

    def init(x):
        params = nn.meta.unbox(model.init(jax.random.key(0), x))
        return params, tx.init(params)

    x_abstract = jax.ShapeDtypeStruct((BATCH, SEQ, EMBED), jnp.float32)
    abstract = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x_abstract)
    param_specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    params, opt_state = jax.jit(init, out_shardings=(param_specs, None))(jnp.zeros((BATCH, SEQ, EMBED)))
    opt_shardings = jax.tree.map(lambda a: a.sharding, opt_state)
    jitted = jax.jit(step, in_shardings=(param_specs, opt_shardings, x_sharding, x_sharding),
                     out_shardings=(param_specs, opt_shardings, None, param_specs))
    return params, opt_state, jitted


def _train(mesh, dot_general, batches):
    params, opt_state, step = _trainer(mesh, dot_general)
    losses, grads = [], None
    for x, y in batches:
        params, opt_state, loss, grads = step(params, opt_state, x, y)
        losses.append(float(loss))
    return losses, params, grads, step.lower(params, opt_state, *batches[0]).compile().as_text()


def _tree_err(got, want):
    return max(jax.tree.leaves(jax.tree.map(rel_err, got, want)))


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(2026)
    return [(random(rng, (BATCH, SEQ, EMBED), jnp.float32), random(rng, (BATCH, SEQ, EMBED), jnp.float32))
            for _ in range(STEPS)]


@pytest.fixture(scope="module")
def plain_run(mesh, batches):
    """The block trained with jax.lax.dot_general: (losses, params, last gradients, compiled step)."""
    return _train(mesh, lax.dot_general, batches)


@pytest.mark.parametrize("schedule", ["xla/ring/c2", "dma/direct/c2"])
def test_linen_block_trains_as_plain(mesh, batches, plain_run, schedule):
    losses, params, grads, compiled = _train(mesh, partial(ficco_jax.dot_general, schedule=schedule), batches)
    want_losses, want_params, want_grads, _ = plain_run
    np.testing.assert_allclose(losses, want_losses, rtol=TOLERANCE["float32"])
    assert _tree_err(grads, want_grads) < TOLERANCE["float32"]
    assert _tree_err(params, want_params) < TOLERANCE["float32"]
    targets = _counts(compiled)
    if schedule.startswith("dma"):
        # the forward's sites (test_forward_sites), and the backward's where the partitioner shards alike
        assert targets["ficco_ag_matmul"] >= 5 and targets["ficco_matmul_rs"] >= 2, targets
    else:
        assert not any(name.startswith("ficco_") for name in targets), targets


def _counts(compiled: str) -> collections.Counter:
    """The ficco custom calls and XLA collectives of a compiled program."""
    collectives = r"\s(all-gather|reduce-scatter|all-reduce|collective-permute)(?:-start)?\("
    return (collections.Counter(re.findall(r'custom_call_target="(ficco_\w+)"', compiled))
            + collections.Counter(re.findall(collectives, compiled)))


@pytest.mark.parametrize("schedule", ["dma/direct/c2", "xla/ring/c2", "none"])
def test_forward_sites(mesh, plain_run, schedule):
    """The forward pass: q, k, v, gate and up are all-gather -> matmul sites, o and down matmul ->
    reduce-scatter sites; nothing else communicates. With schedule "none" each is the plain
    collective and the matmul (XLA's own partitioning of the block gathers the sequence once per
    sublayer and all-reduces where it scatters)."""
    model = Block(mesh, partial(ficco_jax.dot_general, schedule=schedule))
    params = plain_run[1]  # placed by the logical axis rules
    compiled = jax.jit(model.apply).lower(params, jnp.zeros((BATCH, SEQ, EMBED))).compile().as_text()
    counts = _counts(compiled)
    if schedule == "xla/ring/c2":  # the chunks move by collective-permutes, and nothing else moves
        assert counts["collective-permute"] > 0 and set(counts) == {"collective-permute"}, counts
    else:
        want = {"dma/direct/c2": {"ficco_ag_matmul": 5, "ficco_matmul_rs": 2},
                "none": {"all-gather": 5, "reduce-scatter": 2}}[schedule]
        assert counts == collections.Counter(want)
