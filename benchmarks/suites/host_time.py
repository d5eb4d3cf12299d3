"""Where a copy-engine call's host time goes: its handlers' time from start to return, split into
meeting the group's other handlers (or, on a group channel, waiting for their hosts), the backend's
calls (event records, the watchdog's marks, waits, copies, matmuls, sums, channel words: on CUDA the
driver calls) and the rest, per call and device, beside the wall time per call of the whole loop.

Usage: python benchmarks/suites/host_time.py OP SCHEDULE M K N [--iters I] [--launches L] [--out F]

The op runs I times in one jitted loop (bench.record_timeline's program); after a warm-up launch,
L more launches are timed on the host while the extension's counters (`_ffi.testing.host_time`)
sum the handlers' time. Per call and device: `handler_us` (the host work of one device's handler,
meetings included), `meeting_us` (waiting in host meetings, a late peer included), `channel_wait_us`
(on a group channel: waiting for a peer's host to enqueue its writes, xla_ffi/runtime/channel.h), `backend_us`
(each kind of backend call: how many and their host time), `other_us` (the rest: decoding the
attributes, the watchdog's bookkeeping, the executor's own work). `wall_us`
is the loop's wall time per call: where it is close to `handler_us`, the device waits for the
host. On CPU the numbers are the CPU backend's, which runs the device work inside the handler.
"""
import argparse
import json
import time

import jax
import numpy as np
from jax.sharding import Mesh

from ficco_jax import _ffi
from ficco_jax.ops import measure
from ficco_jax.schedule import Schedule, local_shapes
from ficco_jax.tools.bench import add_case_arguments


def measure_host_time(op: str, schedule: Schedule, M: int, K: int, N: int, iters: int, launches: int) -> dict:
    """Per call: host time of one device's handler, of its meetings, and the loop's wall time."""
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    inputs = measure.make_inputs(op, local_shapes(op, M, K, N, mesh.shape["tp"]), "bfloat16", mesh)
    fn = measure.sharded(mesh, op, measure.op_body(op, schedule), iters)
    jax.block_until_ready(fn(*inputs))  # compile and warm up outside the count
    testing = _ffi.testing
    before, calls_before = testing.host_time(), testing.backend_calls()
    start = time.perf_counter()
    for _ in range(launches):
        jax.block_until_ready(fn(*inputs))
    wall = time.perf_counter() - start
    after, calls_after = testing.host_time(), testing.backend_calls()
    handlers = after["calls"] - before["calls"]
    if handlers <= 0:
        raise SystemExit(f"host_time: no copy-engine handler ran; is {schedule} a comm='dma' schedule?")
    per_handler = lambda new, old, key: (new[key] - old[key]) / handlers  # noqa: E731
    backend = {kind: {"calls": per_handler(calls_after, calls_before, kind),
                      "us": per_handler(calls_after, calls_before, kind + "_s") * 1e6}
               for kind in calls_after if not kind.endswith("_s")}
    handler_us, meeting_us, channel_wait_us = (per_handler(after, before, key) * 1e6
                                               for key in ("handler_s", "meeting_s", "channel_wait_s"))
    return {"op": op, "schedule": str(schedule), "shape": [M, K, N], "devices": mesh.shape["tp"],
            "iters": iters, "launches": launches, "handlers": int(handlers),
            "handler_us": handler_us, "meeting_us": meeting_us, "channel_wait_us": channel_wait_us,
            "backend_us": backend,
            "other_us": handler_us - meeting_us - channel_wait_us - sum(b["us"] for b in backend.values()),
            "wall_us": wall / (launches * iters) * 1e6, "device": jax.devices()[0].device_kind}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_arguments(parser)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    result = measure_host_time(args.op, Schedule.parse(args.schedule), args.M, args.K, args.N, args.iters,
                               args.launches)
    print(f"{result['op']} {result['schedule']} {args.M},{args.K},{args.N} on {result['devices']} "
          f"{result['device']}: per call and device, handler {result['handler_us']:.1f} us "
          f"(meetings {result['meeting_us']:.1f} us, channel waits {result['channel_wait_us']:.1f} us); "
          f"loop wall time {result['wall_us']:.1f} us per call")
    parts = [f"{kind} {b['calls']:.1f} x = {b['us']:.1f} us" for kind, b in result["backend_us"].items() if b["calls"]]
    print("  backend calls per call and device: " + ", ".join(parts) + f"; other {result['other_us']:.1f} us")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
