"""A program with one copy-engine op, for the watchdog's tests (tests/test_watchdog.py on CPU,
tests/gpu/test_watchdog_gpu.py on GPUs): run it in a child process with FICCO_WATCHDOG_S set; with
--fault it arms that fault (the extension's test-only inject_fault) before the op (a stall after
one healthy call). It prints "calling" before the op and "result <sum>" after it.

    python tests/watchdog_program.py OP SCHEDULE [--fault SPEC] [--devices N] [--calls K] [--cpu]
"""
import argparse
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=("ag_matmul", "matmul_rs", "all_gather", "overlap"),
                        help="an op, or 'overlap': all_gather -> dot rewritten by ficco_jax.overlap")
    parser.add_argument("schedule")
    parser.add_argument("--fault", default="", help="'stall:<rank>', 'fail:<rank>' or 'skip:<rank>'; '' for none")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--calls", type=int, default=1, help="launches of the program, back to back")
    parser.add_argument("--cpu", action="store_true", help="run on virtual CPU devices")
    args = parser.parse_args()
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import ficco_jax
    from ficco_jax.runtime import extension

    n = args.devices
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    key_x, key_w = jax.random.split(jax.random.PRNGKey(0))
    if args.op == "ag_matmul":
        body = lambda x, w: ficco_jax.ag_matmul(x, w, "tp", schedule=args.schedule)  # noqa: E731
        specs, out_spec = (P("tp", None), P(None, "tp")), P(None, "tp")
        x, w = jax.random.normal(key_x, (16 * n, 64)), jax.random.normal(key_w, (64, 8 * n))
    elif args.op == "matmul_rs":
        body = lambda y, w: ficco_jax.matmul_rs(y, w, "tp", schedule=args.schedule)  # noqa: E731
        specs, out_spec = (P(None, "tp"), P("tp", None)), P("tp", None)
        x, w = jax.random.normal(key_x, (16 * n, 8 * n)), jax.random.normal(key_w, (8 * n, 64))
    elif args.op == "all_gather":
        body = lambda x, w: ficco_jax.dma.all_gather(x, "tp", schedule=args.schedule) + w.sum()  # noqa: E731
        specs, out_spec = (P("tp", None), P()), P(None, None)
        x, w = jax.random.normal(key_x, (16 * n, 64)), jax.random.normal(key_w, ())
    else:
        def body(x, w):
            gathered = jax.lax.all_gather(x, "tp", axis=0, tiled=True)  # the site overlap rewrites
            return gathered @ w
        specs, out_spec = (P("tp", None), P(None, "tp")), P(None, "tp")
        x, w = jax.random.normal(key_x, (16 * n, 64)), jax.random.normal(key_w, (64, 8 * n))
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)
    f = jax.jit(ficco_jax.overlap(f, schedule=args.schedule) if args.op == "overlap" else f)
    if args.fault.startswith("stall"):
        # A device that stalls mid-run does so after its first calls. On GPUs the first call of a
        # shape also times its matmul plan and waits for that on the host, behind the stalled
        # stream: both handlers would then wait on the host and the report could name no event.
        jax.block_until_ready(f(x, w))
    extension.testing().inject_fault(args.fault)
    print("calling", flush=True)
    out = None
    for _ in range(args.calls):
        out = f(x, w)
    print(f"result {float(jax.block_until_ready(out).sum()):.6g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
