"""A Mixtral-style MoE layer under expert parallelism, with and without `ficco_jax.overlap`.

Usage:
    python examples/moe_layer.py                              # tiny, 8 virtual CPU devices, overlap on
    python examples/moe_layer.py --compare                    # both modes, same init and data: agreement
    python examples/moe_layer.py --compare --schedule dma/direct/c2/s2
    python examples/moe_layer.py --preset mixtral-layer --compare --dtype bfloat16   # 4 x H200

The layer is written as JAX MoE code usually is, with no ficco_jax call inside. One `shard_map`
over a mesh axis "ep": every device holds tokens/ep of the batch and E/ep of the experts.

    router:   logits = x @ w_router; top-2 experts per token, gate weights renormalised over the two
    buckets:  each expert takes at most C tokens (C = capacity_factor * tokens * 2 / E, rounded up
              to a multiple of 4); choice 0 of every token is placed before any choice 1, and what
              does not fit is dropped (its gate weight is lost, as in Switch/GShard)
    dispatch: one-hot einsum tokens -> [E, C, d] = [ep, E/ep, C, d]; block p goes to rank p
              all_to_all(split 0, concat 0) -> [ep, E/ep, C, d]: the tokens every rank sent my experts
    experts:  SwiGLU: silu(h @ w_gate) * (h @ w_up) @ w_down, gate and up as one [E/ep, d, 2F] weight
    combine:  all_to_all back -> [E, C, d] at the tokens' owner; gate-weighted one-hot einsum -> [T, d]

`--overlap` runs `jit(ficco_jax.overlap(value_and_grad(loss)))`: the rewrite finds
all_to_all -> expert matmul (-> `a2a_matmul`) and expert matmul -> all_to_all (-> `matmul_a2a`)
in the forward body and in the backward one, where the gradient's all_to_alls sit on the
transposed matmuls. A few SGD steps of a regression to a fixed random target follow, so the loss
falls. On CPU "auto" picks no overlap (host collectives have nothing to hide behind): pass a
schedule to exercise the overlapped paths, e.g. `--schedule xla/ring/c2`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # CPU: 8 virtual devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    tokens: int = 256          # global tokens (batch * sequence), split over ep
    hidden: int = 32           # d
    ffn: int = 64              # F per expert
    experts: int = 16          # E in all, E/ep per device
    top_k: int = 2
    capacity_factor: float = 1.25
    steps: int = 3
    lr: float = 0.05
    dtype: str = "float32"

    def capacity(self, ep: int) -> int:
        per_device = self.tokens // ep
        c = math.ceil(self.capacity_factor * per_device * self.top_k / self.experts)
        return 4 * math.ceil(c / 4)  # so that schedules with 1, 2 or 4 chunks divide it


PRESETS = {
    "tiny": Config(),
    # One Mixtral-8x7B-sized layer over 4 GPUs (8 experts, d 4096, F 14336), 16k tokens.
    "mixtral-layer": Config(tokens=16384, hidden=4096, ffn=14336, experts=8, steps=5, dtype="bfloat16"),
}


# ------------------------------------------------------------------------------------------------
# The layer (per device, inside shard_map over "ep")
# ------------------------------------------------------------------------------------------------
def route(x, w_router, cfg: Config, capacity: int):
    """Top-k routing with a fixed capacity: (dispatch [T, E, C], combine [T, E, C]) one-hot tensors."""
    probs = jax.nn.softmax((x @ w_router).astype(jnp.float32), axis=-1)
    gate, expert = jax.lax.top_k(probs, cfg.top_k)                              # [T, k]
    gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(expert, cfg.experts, dtype=jnp.int32)              # [T, k, E]
    # Slot of each (token, choice) in its expert's bucket: choices in priority order, then tokens.
    by_priority = jnp.swapaxes(chosen, 0, 1).reshape(-1, cfg.experts)           # [k*T, E]
    slot = jnp.swapaxes((jnp.cumsum(by_priority, axis=0) - 1).reshape(cfg.top_k, -1, cfg.experts), 0, 1)
    kept = chosen * (slot < capacity)                                           # [T, k, E]
    placed = kept[..., None] * jax.nn.one_hot(slot, capacity, dtype=jnp.int32)  # [T, k, E, C]
    dispatch = jnp.sum(placed, axis=1).astype(x.dtype)
    combine = jnp.einsum("tk,tkec->tec", gate, placed.astype(jnp.float32)).astype(x.dtype)
    return dispatch, combine


def moe_layer(x, w_router, w_gate_up, w_down, *, cfg: Config, capacity: int):
    """x [T/ep, d] -> [T/ep, d]; w_gate_up [E/ep, d, 2F], w_down [E/ep, F, d] are this device's experts."""
    ep = jax.lax.axis_size("ep")
    dispatch, combine = route(x, w_router, cfg, capacity)
    buckets = jnp.einsum("tec,td->ecd", dispatch, x).reshape(ep, -1, capacity, x.shape[-1])
    received = jax.lax.all_to_all(buckets, "ep", 0, 0, tiled=True)          # tokens for my experts
    gate, up = jnp.split(jnp.einsum("pecd,edf->pecf", received, w_gate_up), 2, axis=-1)
    h = jax.nn.silu(gate) * up
    back = jax.lax.all_to_all(jnp.einsum("pecf,efd->pecd", h, w_down), "ep", 0, 0, tiled=True)
    return jnp.einsum("tec,ecd->td", combine, back.reshape(cfg.experts, capacity, -1))


def make_loss(cfg: Config, mesh: Mesh):
    capacity = cfg.capacity(mesh.shape["ep"])
    layer = jax.shard_map(
        lambda x, wr, wgu, wd: moe_layer(x, wr, wgu, wd, cfg=cfg, capacity=capacity), mesh=mesh,
        in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep"))

    def loss(params, x, target):
        y = x + layer(x, params["router"], params["gate_up"], params["down"])
        return jnp.mean(jnp.square((y - target).astype(jnp.float32)))

    return loss


def init(cfg: Config, key):
    dt = jnp.dtype(cfg.dtype)
    k = jax.random.split(key, 5)
    normal = lambda kk, shape, fan_in: (jax.random.normal(kk, shape, jnp.float32) / math.sqrt(fan_in)).astype(dt)
    params = {"router": normal(k[0], (cfg.hidden, cfg.experts), cfg.hidden),
              "gate_up": normal(k[1], (cfg.experts, cfg.hidden, 2 * cfg.ffn), cfg.hidden),
              "down": normal(k[2], (cfg.experts, cfg.ffn, cfg.hidden), cfg.ffn)}
    x = jax.random.normal(k[3], (cfg.tokens, cfg.hidden), jnp.float32).astype(dt)
    target = jax.random.normal(k[4], (cfg.tokens, cfg.hidden), jnp.float32).astype(dt)
    return params, x, target


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
def run(cfg: Config, mesh: Mesh, *, overlap: bool, schedule: str = "auto") -> dict:
    """SGD steps; returns {"losses", "grads" (of the first step), "step_s", "report"}."""
    grad_fn = jax.value_and_grad(make_loss(cfg, mesh))
    report = None
    if overlap:
        grad_fn = ficco_jax.overlap(grad_fn, schedule=schedule)
    shard = {"router": P(), "gate_up": P("ep"), "down": P("ep")}
    params, x, target = init(cfg, jax.random.key(0))
    params = {k: jax.device_put(v, NamedSharding(mesh, shard[k])) for k, v in params.items()}
    x, target = (jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, target))
    if overlap:
        report = ficco_jax.explain(grad_fn, params, x, target)

    @jax.jit
    def step(params, x, target):
        loss, grads = grad_fn(params, x, target)
        return loss, grads, jax.tree.map(lambda p, g: (p - cfg.lr * g).astype(p.dtype), params, grads)

    losses, times, first_grads = [], [], None
    for _ in range(cfg.steps):
        start = time.perf_counter()
        loss, grads, params = jax.block_until_ready(step(params, x, target))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        first_grads = grads if first_grads is None else first_grads
    return {"losses": losses, "grads": first_grads, "step_s": times, "report": report}


def rel_diff(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare(cfg: Config, mesh: Mesh, schedule: str) -> dict:
    """Both modes from the same init and data; the largest relative differences of losses and grads."""
    plain = run(cfg, mesh, overlap=False)
    fused = run(cfg, mesh, overlap=True, schedule=schedule)
    loss_diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(fused["losses"], plain["losses"]))
    grad_diff = max(rel_diff(fused["grads"][k], plain["grads"][k]) for k in plain["grads"])
    return {"plain": plain, "overlap": fused, "loss_rel_diff": loss_diff, "grad_rel_diff": grad_diff}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compare", action="store_true", help="run without, then with overlap; check agreement")
    parser.add_argument("--schedule", default="auto", help="auto (default), or e.g. xla/ring/c2, dma/direct/c2/s2")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, **{k: v for k, v in (("steps", args.steps), ("dtype", args.dtype)) if v})
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    ep = mesh.shape["ep"]
    if cfg.experts % ep or cfg.tokens % ep:
        sys.exit(f"moe_layer: {cfg.experts} experts and {cfg.tokens} tokens must divide by the {ep} devices")
    print(f"MoE layer: {cfg.tokens} tokens, d={cfg.hidden}, F={cfg.ffn}, {cfg.experts} experts (top-{cfg.top_k}, "
          f"capacity {cfg.capacity(ep)} per expert and device) over ep={ep} {jax.devices()[0].platform} devices, "
          f"{cfg.dtype}")
    if ep == 1:
        print("ep=1: a group of one device has no all_to_all to overlap; with overlap the layer keeps the plain "
              "matmuls, so both modes give the same losses")
    if args.compare:
        result = compare(cfg, mesh, args.schedule)
        print(result["overlap"]["report"])
        for mode in ("plain", "overlap"):
            r = result[mode]
            print(f"  {mode:8s} losses {' '.join(f'{v:.5f}' for v in r['losses'])}   "
                  f"step {1e3 * float(np.median(r['step_s'][1:] or r['step_s'])):.2f} ms")
        tol = 1e-4 if cfg.dtype == "float32" else 3e-2
        ok = result["loss_rel_diff"] < tol and result["grad_rel_diff"] < tol
        print(f"  agreement: losses within {result['loss_rel_diff']:.2e}, gradients within "
              f"{result['grad_rel_diff']:.2e} (tolerance {tol:g}): {'OK' if ok else 'MISMATCH'}")
        if jax.devices()[0].platform == "cpu":
            print("  (CPU times mean nothing: the host collectives are memcpys)")
        result["ok"] = ok
        return result
    result = run(cfg, mesh, overlap=args.overlap, schedule=args.schedule)
    if result["report"] is not None:
        print(result["report"])
    print(f"  losses {' '.join(f'{v:.5f}' for v in result['losses'])}")
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome.get("ok", True) else 1)
