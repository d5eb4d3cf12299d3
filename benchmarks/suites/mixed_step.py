"""A small training step that mixes XLA's own collectives (NCCL on GPUs) with copy-engine ops of
several schedules, run for many steps: the reproducer of device-side hangs, small enough to run
thousands of steps in a minute.

Each layer is a tensor + sequence-parallel MLP inside one `jax.shard_map` over a (dp, tp) mesh:
``x + matmul_rs(gelu(ag_matmul(x, w_up)), w_down)``, each layer with its own pair of schedules
(LAYER_SCHEDULES): plain ``all_gather`` / ``psum_scatter`` (XLA's collectives), copy-engine
schedules (direct and ring, 1 to 8 chunks, per-chunk and grouped matmuls) and chunked XLA
``ppermute`` steps, so that every step interleaves NCCL kernels and copy-engine calls in both
passes. The loss is ``psum``-reduced (an all-reduce), the gradients over ``dp`` too; parameters
are updated by SGD and donated, as a training loop does.

    python benchmarks/suites/mixed_step.py [--steps 1000] [--print-every 50] [--out DIR]

Prints one progress line every --print-every steps ("step i/N loss ...": a watchdog reading the
output sees the program advance), checks the first step's loss and gradients against the same step
with every site on its plain path, and ends with "mixed_step PASS" or "mixed_step FAIL: why". Runs on CPU too (8
virtual devices, tiny sizes) and on any number of GPUs that the sizes divide by.
"""
from __future__ import annotations

import argparse
import json
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
from ficco_jax.runtime import extension  # noqa: E402

#: (ag_matmul schedule, matmul_rs schedule) of each layer, cycled over --layers. "none" is the plain
#: collective (NCCL on GPUs); matmul_rs on copy engines is "direct" only.
LAYER_SCHEDULES = (
    ("none", "none"),
    ("dma/direct/c1", "dma/direct/c1"),
    ("dma/direct/c2/grouped", "none"),
    ("none", "dma/direct/c8/grouped"),
    ("dma/ring/c2", "dma/direct/c2/grouped"),
    ("xla/ring/c2", "dma/direct/c4"),
    ("dma/direct/c8/grouped", "xla/ring/c2"),
)
#: Tolerance of the first step's loss and gradients against the plain program (bf16 on GPUs, f32 on CPU).
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}


def layer_schedules(layers: int, dma: bool) -> list[tuple[str, str]]:
    """The schedules of each layer; copy-engine schedules become "none" where the extension is missing."""
    cycle = [LAYER_SCHEDULES[i % len(LAYER_SCHEDULES)] for i in range(layers)]
    return cycle if dma else [tuple("none" if s.startswith("dma") else s for s in pair) for pair in cycle]


def _local_grads(schedules):
    """The per-device (params, x) -> (loss, gradients averaged over dp) of the layer stack."""
    def layer(x, w_up, w_down, ag_schedule, rs_schedule):
        if ag_schedule == "none":
            h = jnp.dot(jax.lax.all_gather(x, "tp", axis=0, tiled=True), w_up)
        else:
            h = ficco_jax.ag_matmul(x, w_up, "tp", schedule=ag_schedule)
        h = jax.nn.gelu(h)
        if rs_schedule == "none":
            y = jax.lax.psum_scatter(jnp.dot(h, w_down), "tp", scatter_dimension=0, tiled=True)
        else:
            y = ficco_jax.matmul_rs(h, w_down, "tp", schedule=rs_schedule)
        return x + y

    def local_loss(params, x):
        for (w_up, w_down), (ag, rs) in zip(params, schedules):
            x = layer(x, w_up, w_down, ag, rs)
        total = jax.lax.psum(jnp.sum(jnp.square(x.astype(jnp.float32))), ("dp", "tp"))
        count = jax.lax.psum(x.size, ("dp", "tp"))
        return total / count

    def local_grads(params, x):
        loss, grads = jax.value_and_grad(local_loss)(params, x)
        return loss, jax.lax.pmean(grads, "dp")

    return local_grads


def _sharded(mesh: Mesh, schedules, fn, params_out: bool):
    param_spec = [(P(None, "tp"), P("tp", None)) for _ in schedules]
    out_specs = (param_spec, P()) if params_out else (P(), param_spec)
    return jax.shard_map(fn, mesh=mesh, in_specs=(param_spec, P(("dp", "tp"), None)), out_specs=out_specs,
                         check_vma=False)


def make_grads(mesh: Mesh, schedules):
    """(params, x) -> (loss, gradients): the step's backward pass alone, nothing donated."""
    return jax.jit(_sharded(mesh, schedules, _local_grads(schedules), params_out=False))


def make_step(mesh: Mesh, schedules, lr: float):
    """(params, x) -> (params, loss): one SGD step of the layer stack, donated parameters."""
    local_grads = _local_grads(schedules)

    def local_step(params, x):
        loss, grads = local_grads(params, x)
        params = jax.tree.map(lambda p, g: (p - lr * g.astype(jnp.float32)).astype(p.dtype), params, grads)
        return params, loss

    return jax.jit(_sharded(mesh, schedules, local_step, params_out=True), donate_argnums=0)


def gradient_error(got, want) -> float:
    """The largest relative error (in norm) of one gradient against the plain program's."""
    return max(float(jnp.linalg.norm((g.astype(jnp.float32) - w.astype(jnp.float32)).ravel()))
               / max(float(jnp.linalg.norm(w.astype(jnp.float32).ravel())), 1e-30)
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def init(mesh: Mesh, layers: int, tokens: int, hidden: int, ffn: int, dtype, seed: int = 0):
    """Random parameters (scaled so activations stay O(1)) and one random input batch."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * layers + 1)
    up, down = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp", None))
    params = [(jax.device_put((jax.random.normal(keys[2 * i], (hidden, ffn)) / np.sqrt(hidden)).astype(dtype), up),
               jax.device_put((jax.random.normal(keys[2 * i + 1], (ffn, hidden)) / np.sqrt(ffn)).astype(dtype), down))
              for i in range(layers)]
    dp = mesh.shape["dp"]
    x = jax.random.normal(keys[-1], (dp * tokens, hidden)).astype(dtype)
    return params, jax.device_put(x, NamedSharding(mesh, P(("dp", "tp"), None)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=len(LAYER_SCHEDULES))
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: every device; "
                                                            "CPU: 4 of a (2, 4) mesh)")
    parser.add_argument("--tokens", type=int, default=None, help="rows per dp replica (default 4096 on GPUs, 64 on CPU)")
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 on GPUs, 32 on CPU")
    parser.add_argument("--ffn", type=int, default=None, help="default 4096 on GPUs, 64 on CPU")
    parser.add_argument("--sync-every", type=int, default=1,
                        help="block on the loss every this many steps (1: as a training loop that logs each loss)")
    parser.add_argument("--print-every", type=int, default=50)
    parser.add_argument("--out", default=None, help="write mixed_step.json here")
    args = parser.parse_args(argv)

    gpu = jax.default_backend() == "gpu"
    devices = jax.devices()
    tp = args.tp or (len(devices) if gpu else min(4, len(devices)))
    if len(devices) % tp:
        parser.error(f"--tp {tp} must divide the device count {len(devices)}")
    tokens, hidden, ffn = (args.tokens or (4096 if gpu else 64), args.hidden or (2048 if gpu else 32),
                           args.ffn or (4096 if gpu else 64))
    dtype = jnp.bfloat16 if gpu else jnp.float32
    mesh = Mesh(np.array(devices).reshape(len(devices) // tp, tp), ("dp", "tp"))
    schedules = layer_schedules(args.layers, dma=extension.available())
    print(f"mixed_step: {args.layers} layers on mesh dp={mesh.shape['dp']} x tp={tp} ({devices[0].device_kind}), "
          f"x [{tokens}, {hidden}] per replica, ffn {ffn}, {jnp.dtype(dtype).name}; schedules (ag, rs) per layer: "
          + ", ".join(f"{a}+{r}" for a, r in schedules), flush=True)

    # The first step's loss and gradients against the same step with every site on its plain path
    # (same inputs): the forward and the backward ops of every schedule checked.
    params, x = init(mesh, args.layers, tokens, hidden, ffn, dtype)
    want, want_grads = make_grads(mesh, [("none", "none")] * args.layers)(params, x)
    _, got_grads = make_grads(mesh, schedules)(params, x)
    grad_err = gradient_error(got_grads, want_grads)
    step = make_step(mesh, schedules, lr=1e-2)
    params, got = step(params, x)
    first_err = abs(float(got) - float(want)) / max(abs(float(want)), 1e-30)
    ok = max(first_err, grad_err) <= TOLERANCE[jnp.dtype(dtype).name]
    print(f"step 1/{args.steps} loss {float(got):.6f} (plain program {float(want):.6f}, rel diff {first_err:.2e}; "
          f"gradients' largest rel diff {grad_err:.2e})", flush=True)

    t0, losses = time.perf_counter(), [float(got)]
    loss = got
    for i in range(2, args.steps + 1):
        params, loss = step(params, x)
        if i % args.sync_every == 0 or i == args.steps:
            loss.block_until_ready()
        if i % args.print_every == 0 or i == args.steps:
            losses.append(float(loss))
            print(f"step {i}/{args.steps} loss {losses[-1]:.6f} ({(time.perf_counter() - t0) / (i - 1) * 1e3:.2f} "
                  f"ms/step)", flush=True)
    finite = bool(np.isfinite(losses).all())
    verdict = "PASS" if ok and finite else ("FAIL: the first step's loss or gradients differ from the plain "
                                            "program's" if not ok else "FAIL: non-finite loss")
    result = {"steps": args.steps, "layers": args.layers, "tp": tp, "dp": mesh.shape["dp"], "tokens": tokens,
              "hidden": hidden, "ffn": ffn, "dtype": jnp.dtype(dtype).name, "schedules": schedules,
              "first_step_rel_diff": first_err, "first_step_gradient_rel_diff": grad_err, "losses": losses, "seconds": time.perf_counter() - t0,
              "device": devices[0].device_kind, "verdict": verdict,
              "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mixed_step.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    print(f"mixed_step {verdict}", flush=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
