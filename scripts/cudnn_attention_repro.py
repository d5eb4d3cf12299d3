"""Is the tp=4 cuDNN-attention crash JAX's or ours? The same attention, no ficco_jax imported.

`examples/tp_transformer.py --preset llama70b-layer --attention cudnn --compare` died with SIGSEGV on
4 x H200 (jax 0.11.2, 2026-11-22, twice: before and after ficco_jax's error-path fix) in its first
mode, which has no ficco_jax op in the program, before its first step; at --tp 1 on one H200 it
trained. This script runs the example's attention shapes per device (16 query / 2 kv heads of 128,
sequence 8192, bf16, causal) forward and backward under `jax.shard_map` over every local GPU, with
`jax.nn.dot_product_attention(implementation="cudnn")`, and imports nothing of ficco_jax. A crash
here is JAX/XLA/cuDNN's; a clean run puts the question back on the example.

    python scripts/cudnn_attention_repro.py [--seq 8192] [--heads 16] [--kv-heads 2] [--tp N]

Prints one line per stage; exit status 0 when every stage ran. Needs GPUs (cuDNN attention).
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16, help="query heads per device")
    parser.add_argument("--kv-heads", type=int, default=2, help="kv heads per device")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tp", type=int, default=None, help="devices (default: all local GPUs)")
    args = parser.parse_args()
    faulthandler.enable()  # a native crash still prints the Python stack

    if jax.default_backend() != "gpu":
        print("cudnn_attention_repro: needs GPUs (cuDNN attention); backend is", jax.default_backend())
        return 2
    devices = jax.local_devices()[: args.tp or len(jax.local_devices())]
    tp = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    shape_q = (1, args.seq, args.heads * tp, args.head_dim)   # heads sharded over tp, as in the example
    shape_kv = (1, args.seq, args.kv_heads * tp, args.head_dim)
    spec = P(None, None, "tp", None)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(key, s, jnp.bfloat16), NamedSharding(mesh, spec))
               for key, s in zip(keys, (shape_q, shape_kv, shape_kv)))

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    sharded = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    stages = [
        ("forward", jax.jit(sharded)),
        ("forward+backward", jax.jit(jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v).astype(jnp.float32)),
                                              argnums=(0, 1, 2)))),
    ]
    print(f"cudnn_attention_repro: {tp} x {devices[0].device_kind}, jax {jax.__version__}, per device "
          f"{args.heads} q / {args.kv_heads} kv heads of {args.head_dim}, seq {args.seq}, bf16, causal", flush=True)
    for name, fn in stages:
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(q, k, v))
        leaves = jax.tree.leaves(out)
        finite = all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in leaves)
        print(f"  {name}: ran in {time.perf_counter() - t0:.2f} s (compile included), finite {finite}", flush=True)
        if not finite:
            return 1
    print("cudnn_attention_repro: every stage ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
