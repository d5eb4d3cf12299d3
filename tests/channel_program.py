"""Two programs of copy-engine calls on their group's channel, for tests/gpu/test_channel_gpu.py: one
program of `ag_matmul` then `matmul_rs` (an MLP's two sites), and one of two `matmul_rs` of different
shapes and schedules. Run it in a child process with FICCO_CHANNEL_BYTES and FICCO_WATCHDOG_S set; it
prints "<program> <i> done" after each of three launches and "PASS" once every result matched the
same program on the plain path.

    python tests/channel_program.py {cold,warm} [--cpu]

cold: each program's first launch is its sites' first execution (their matmul plans are timed then,
the host waiting for the device); warm: every site ran alone first. The cold run is the one that
tests the channel's ordering: a host blocked while timing a plan has yet to enqueue the channel words
its peers' devices wait for, and a rank enqueues its device's wait for a peer's word only once that
peer's host has enqueued the write (xla_ffi/runtime/channel.h), so no device waits for work no host
will enqueue.
"""
import argparse
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("cold", "warm"))
    parser.add_argument("--cpu", action="store_true", help="on 2 virtual CPU devices, tiny shapes")
    args = parser.parse_args()
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import ficco_jax

    tokens, hidden, ffn = (64, 32, 64) if args.cpu else (4096, 2048, 4096)
    dtype = jnp.float32 if args.cpu else jnp.bfloat16
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (tokens, hidden), dtype)
    w_up = (jax.random.normal(keys[1], (hidden, ffn)) / np.sqrt(hidden)).astype(dtype)
    w_down = (jax.random.normal(keys[2], (ffn, hidden)) / np.sqrt(ffn)).astype(dtype)
    w_out = (jax.random.normal(keys[3], (hidden, hidden)) / np.sqrt(hidden)).astype(dtype)

    def jit(body, in_specs, out_specs):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    def mlp(schedules):
        ag, rs = schedules
        return jit(lambda a, u, d: ficco_jax.matmul_rs(jax.nn.gelu(ficco_jax.ag_matmul(a, u, "tp", schedule=ag)), d,
                                                     "tp", schedule=rs),
                   (P("tp"), P(None, "tp"), P("tp", None)), P("tp"))

    def two_rs(schedules):
        first, second = schedules
        # [tokens, ffn/2] @ [ffn/2, hidden] scattered, then its rows gathered back by a plain all_gather
        # and [tokens, hidden/2] @ [hidden/2, hidden] scattered again: two sites of different shapes.
        def body(h, d, o):
            y = ficco_jax.matmul_rs(h, d, "tp", schedule=first)
            z = jax.lax.all_gather(y, "tp", axis=0, tiled=True)[:, : hidden // 2]
            return ficco_jax.matmul_rs(z, o[: hidden // 2], "tp", schedule=second)
        return jit(body, (P(None, "tp"), P("tp", None), P()), P("tp"))

    h = jax.nn.gelu(x @ w_up)
    programs = {
        "mlp": (mlp, ("dma/direct/c1", "dma/direct/c1"), (x, w_up, w_down)),
        "two_rs": (two_rs, ("dma/direct/c1", "dma/direct/c2"), (h, w_down, w_out)),
    }
    for name, (make, schedules, operands) in programs.items():
        want = np.asarray(make(("none", "none"))(*operands), np.float32)
        program = make(schedules)
        if args.mode == "warm":  # each site alone first: its matmul plans are made and timed then
            if name == "mlp":
                jax.block_until_ready(jit(lambda a, u: ficco_jax.ag_matmul(a, u, "tp", schedule=schedules[0]),
                                          (P("tp"), P(None, "tp")), P(None, "tp"))(x, w_up))
            jax.block_until_ready(jit(lambda g, d: ficco_jax.matmul_rs(g, d, "tp", schedule=schedules[1]),
                                      (P(None, "tp"), P("tp", None)), P("tp"))(h, w_down))
        for i in range(3):
            got = np.asarray(program(*operands), np.float32)
            print(f"{name} {i} done", flush=True)
            scale = float(np.max(np.abs(want))) or 1.0
            if float(np.max(np.abs(got - want))) > (2e-2 if dtype == jnp.bfloat16 else 1e-4) * scale:
                print(f"FAIL: {name} launch {i} differs from the plain path", flush=True)
                return 1
    print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
