"""Which part of the example makes XLA's compiler crash with cuDNN attention on several GPUs?

`examples/tp_transformer.py --attention cudnn` dies with SIGSEGV inside XLA's compile
(`backend_compile_and_load`) at tp=2 and tp=4 on H200 (jax 0.11.2; with or without command
buffers), while `scripts/cudnn_attention_repro.py` (the attention alone, forward and backward,
under shard_map) compiles and runs. This script compiles (never runs) pieces of the example on
every local GPU, each in a child process so that a crash only ends that piece:

    python scripts/cudnn_compile_bisect.py [--variants a,b,...] [--tp N]

Prints one line per piece: ok, or the signal/exit status and the child's last lines. Needs GPUs.
Found on 2 x H200 (BENCHMARKS.md, session 4): the gradient of a layer scan holding cuDNN attention
and the MLP crashes; unrolled layers or remat compile. The pieces keep the example's layer scan.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {
    "attn_fwd": "attention block (all-gather, qkv, RoPE, cuDNN attention, wo, reduce-scatter), forward",
    "attn_grad": "the attention block, forward and backward",
    "attn_grad_noslice": "forward and backward, q/k/v materialised (copies behind a barrier) first",
    "attn_grad_commfree": "forward and backward, the collectives replaced by local ops (comm_free)",
    "attn_scan_grad": "forward and backward of the block inside lax.scan over 1 layer",
    "stack_grad": "the shard_map'd decoder stack (attention + MLP in a scan), forward and backward of a sum",
    "stack_grad_unrolled": "the stack's layers in a Python loop instead of lax.scan",
    "stack_grad_commfree": "the stack with its collectives replaced by local ops (comm_free)",
    "stack_grad_remat": "the stack with jax.checkpoint around each layer",
    "stack_grad_barrier": "the stack with an optimization barrier between the attention and the MLP",
    "stack_grad_mlp_only": "the stack without attention (MLP blocks only), as a control",
    "loss_grad": "value_and_grad of the example's loss (embedding and head outside shard_map)",
    "loss_grad_no_embed": "the loss with the embedding lookup replaced by a sharded input",
    "step": "the example's whole training step (1 layer, no overlap)",
    "step_no_lhs": "the whole step with XLA's latency-hiding scheduler off",
}
FLAGS = {"step_no_lhs": "--xla_gpu_enable_latency_hiding_scheduler=false"}


def child(variant: str, tp: int, attention: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import tp_transformer as ex

    cfg = ex.PRESETS["llama70b-layer"]
    # scan=True: the example now unrolls its layers with cuDNN attention (the workaround this script
    # found); the pieces keep the layer scan that crashes, except where a variant says otherwise.
    cfg = ex.dataclasses.replace(cfg, tp=tp, layers=1, attention=attention, overlap=False, scan=True,
                                 comm_free=variant.endswith("_commfree"), remat=variant.endswith("_remat"))
    mesh = ex.make_mesh(cfg)
    if variant.startswith("step"):
        ex.build_trainer(cfg, mesh)  # lowers and compiles the jitted step
        return
    def stack_of(x, layers):
        if variant == "stack_grad_unrolled":
            for i in range(cfg.layers):
                p = jax.tree.map(lambda a, i=i: a[i], layers)
                x = x + ex.attention_block(cfg, x, p)
                x = x + ex.mlp_block(cfg, x, p)
            return x
        if variant in ("stack_grad_barrier", "stack_grad_mlp_only"):
            def layer(x, p):
                if variant == "stack_grad_barrier":
                    x = jax.lax.optimization_barrier(x + ex.attention_block(cfg, x, p))
                return x + ex.mlp_block(cfg, x, p), None
            return jax.lax.scan(layer, x, layers)[0]
        return ex.decoder_stack(cfg, x, layers)

    if variant.startswith("loss") or variant.startswith("stack_grad"):
        full = jax.eval_shape(lambda k: ex.init_params(cfg, k), jax.random.PRNGKey(0))
        sh = jax.tree.map(lambda s: NamedSharding(mesh, s), ex.param_specs(), is_leaf=lambda s: isinstance(s, P))
        p_abs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), full, sh)
        tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32, sharding=NamedSharding(mesh, P("dp", "tp")))
        x_abs = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.hidden), cfg.compute_dtype,
                                     sharding=NamedSharding(mesh, ex.ACT_SPEC))
        if variant == "loss_grad":
            jax.jit(jax.value_and_grad(ex.make_loss(cfg, mesh))).lower(p_abs, tokens, tokens).compile()
        elif variant == "loss_grad_no_embed":
            loss = ex.make_loss(cfg, mesh)

            def no_embed(params, x, targets):  # the loss after the embedding, fed x directly
                params = dict(params, embed=None)
                stack = jax.shard_map(lambda x, layers: ex.decoder_stack(cfg, x, layers), mesh=mesh,
                                      in_specs=(ex.ACT_SPEC, ex.param_specs()["layers"]), out_specs=ex.ACT_SPEC)
                h = ex.rms_norm(stack(x, params["layers"]), params["final_norm"])
                logits = jnp.einsum("bsd,dv->bsv", h, params["head"], preferred_element_type=jnp.float32)
                return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1))

            del loss
            jax.jit(jax.value_and_grad(no_embed, argnums=(0, 1))).lower(p_abs, x_abs, tokens).compile()
        else:
            stack = jax.shard_map(lambda x, layers: jnp.sum(stack_of(x, layers).astype(jnp.float32)),
                                  mesh=mesh, in_specs=(ex.ACT_SPEC, ex.param_specs()["layers"]), out_specs=P(),
                                  check_vma=False)
            jax.jit(jax.grad(stack, argnums=(0, 1))).lower(x_abs, p_abs["layers"]).compile()
        return
    params = jax.eval_shape(lambda k: ex.init_params(cfg, k), jax.random.PRNGKey(0))["layers"]
    specs = ex.param_specs()["layers"]
    one = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), t)  # noqa: E731
    layer_specs = jax.tree.map(lambda s: P(*s[1:]), specs, is_leaf=lambda s: isinstance(s, P))

    def block(x, p):
        if variant == "attn_grad_noslice":
            real = jax.nn.dot_product_attention

            def contiguous(q, k, v, **kw):
                q, k, v = jax.lax.optimization_barrier(tuple(jnp.copy(t) for t in (q, k, v)))
                return real(q, k, v, **kw)

            jax.nn.dot_product_attention, saved = contiguous, real
            try:
                return ex.attention_block(cfg, x, p)
            finally:
                jax.nn.dot_product_attention = saved
        return ex.attention_block(cfg, x, p)

    if variant == "attn_scan_grad":
        body = lambda x, ps: jnp.sum(jax.lax.scan(lambda x, p: (x + block(x, p), None), x, ps)[0]  # noqa: E731
                                     .astype(jnp.float32))
        p_abs, p_specs = params, specs
    else:
        body = lambda x, p: jnp.sum(block(x, p).astype(jnp.float32))  # noqa: E731
        p_abs, p_specs = one(params), layer_specs
    fn = body if variant == "attn_fwd" else jax.grad(body, argnums=(0, 1))
    out_specs = P() if variant == "attn_fwd" else (ex.ACT_SPEC, p_specs)
    if variant == "attn_fwd":
        fn = lambda x, p, body=body: jax.lax.psum(body(x, p), ("dp", "tp"))  # noqa: E731
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(ex.ACT_SPEC, p_specs), out_specs=out_specs)
    x_abs = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.hidden), cfg.compute_dtype,
                                 sharding=NamedSharding(mesh, ex.ACT_SPEC))
    p_abs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                         p_abs, p_specs, is_leaf=lambda s: isinstance(s, P))
    jax.jit(mapped).lower(x_abs, p_abs).compile()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tp", type=int, default=0, help="devices (default: all local GPUs)")
    parser.add_argument("--timeout-s", type=int, default=120)
    parser.add_argument("--attention", default="cudnn", help="xla: the same pieces without cuDNN (a check of this script)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tp, args.attention)
        print("compiled", flush=True)
        return 0
    tp = args.tp
    if not tp:
        import jax
        tp = len(jax.devices())
    status = 0
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            print(f"unknown variant {variant!r}; choose among {', '.join(VARIANTS)}")
            return 2
        env = dict(os.environ)
        if variant in FLAGS:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAGS[variant]).strip()
        try:
            run = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--child", variant, "--tp", str(tp),
                                  "--attention", args.attention],
                                 capture_output=True, text=True, timeout=args.timeout_s, env=env)
            verdict = "ok" if run.returncode == 0 else (f"signal {-run.returncode}" if run.returncode < 0
                                                        else f"exit {run.returncode}")
            tail = "" if run.returncode == 0 else " | " + " / ".join(
                line.strip() for line in (run.stdout + run.stderr).strip().splitlines()[-3:])[:300]
        except subprocess.TimeoutExpired:
            verdict, tail = f"timeout {args.timeout_s} s", ""
        status |= verdict != "ok"
        print(f"{variant:<20} {verdict:<10} {VARIANTS[variant]}{tail}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
