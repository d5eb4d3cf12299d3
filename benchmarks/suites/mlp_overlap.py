"""Forward + backward of a sequence-parallel MLP with and without `ficco_jax.overlap`, side by side.

Usage: python benchmarks/suites/mlp_overlap.py [TOKENS HIDDEN FFN]
(default: Llama-70B, the anchor shape llama70b_mlp_up_M8k: 8192 tokens, hidden 8192, ffn 28672)
Times as `bench` does (harness.device_time: in-jit loop differencing); checks loss and gradients first.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax.tools.bench import ANCHOR_SHAPES
from ficco_jax.tools import harness

T, H, F = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else ANCHOR_SHAPES["llama70b_mlp_up_M8k"]
dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
mesh = Mesh(np.array(jax.local_devices()), ("tp",))
specs = (P("tp", None), P(None, "tp"), P("tp", None))


def mlp(x, w_up, w_down):  # as a user writes it: gather, matmul, act, matmul, scatter
    h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w_up
    return jax.lax.psum_scatter(jax.nn.gelu(h) @ w_down, "tp", scatter_dimension=0, tiled=True)


def loss(x, w_up, w_down):
    out = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("tp", None))(x, w_up, w_down)
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


plain = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
overlapped = jax.jit(ficco_jax.overlap(jax.value_and_grad(loss, argnums=(0, 1, 2))))
keys = jax.random.split(jax.random.PRNGKey(0), 3)
args = [jax.device_put((jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0])).astype(dtype), NamedSharding(mesh, p))
        for k, s, p in zip(keys, [(T, H), (H, F), (F, H)], specs)]

print(ficco_jax.explain(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args))
(l0, g0), (l1, g1) = plain(*args), overlapped(*args)
errs = [float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(a.astype(jnp.float32))) for a, b in zip(g0, g1)]
print(f"loss plain {float(l0):.6f} overlap {float(l1):.6f}; grad rel err {['%.2e' % e for e in errs]}")


def make(step):
    def body(x, w_up, w_down):
        def one(_, x):
            l, _g = step(x, w_up, w_down)
            return jax.lax.dynamic_update_slice(x, l.astype(x.dtype).reshape(1, 1), (0, 0))
        return jax.lax.fori_loop(0, r_holder[0], one, x)
    return body


r_holder = [1]


def timed(step):
    def mk(r):
        r_holder[0] = r
        return jax.jit(make(step))
    return harness.device_time(mk, args)


t_plain, t_over = timed(jax.value_and_grad(loss, argnums=(0, 1, 2))), timed(ficco_jax.overlap(jax.value_and_grad(loss, argnums=(0, 1, 2))))
print(f"MLP fwd+bwd T={T} H={H} F={F} {jnp.dtype(dtype).name} on {len(jax.local_devices())} x {jax.devices()[0].device_kind}: "
      f"plain {t_plain['median_s'] * 1e3:.3f} ms (±{t_plain['spread_s'] * 1e3:.3f}), overlap {t_over['median_s'] * 1e3:.3f} ms "
      f"(±{t_over['spread_s'] * 1e3:.3f}), speedup {t_plain['median_s'] / t_over['median_s']:.2f}x; {harness.method()}")
