"""One of two processes that share one GPU as a 2-device group (tests/gpu/test_shared_gpu.py starts
both): each process owns one JAX device, both on the same GPU, so every copy-engine call of the mesh
axis crosses processes (CUDA IPC, the host mailbox) as on a host with one process per GPU, and a
machine with a single GPU runs the cross-process executor and its symmetric sites for real. The
references are computed with numpy from inputs both processes make from seeds: no XLA collective
runs (NCCL refuses two ranks on one GPU). Some programs are jitted once and called under the mesh of
both device orders in turn, each against its own order's reference. Times mean nothing here (two contexts share the GPU).

    python tests/gpu/shared_gpu_worker.py PROCESS_ID PORT OUT_JSON [CHAIN_LAUNCHES]
    python tests/gpu/shared_gpu_worker.py PROCESS_ID PORT --left-early [all_gather | reduce_scatter]

CHAIN_LAUNCHES (default 6): launches of the captured chain, each checked (a soak: hundreds).
Writes {"checks": {name: "ok" | error}, "handlers_per_launch": ...} and exits 1 if a check failed.

--left-early: after three right launches of a symmetric all_gather (or reduce_scatter, whose sum
makes the check inside its own kernel), process 1's next launch fails before its call counts itself
(an injected fault), as a launch that ended early on its device would, and it runs on. Its following
launch would pair with process 0's call of the launch it left; the launch check must stop both (the
watchdog reports them and ends each process). A launch that returns prints "RETURNED" and whether its
result is right, and the worker exits 3.
"""
import json
import os
import sys
import traceback


def main(process_id: int, port: int, out_path: str, chain_launches: int = 6) -> int:
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import ficco_jax
    from ficco_jax import dma
    from ficco_jax.runtime import extension

    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    me = jax.local_devices()[0]
    checks, result = {}, {"process": process_id, "devices": [str(d) for d in jax.devices()]}

    def shard(p, tag, shape):  # the block process p holds: a seed both processes know
        return np.random.default_rng(1000 * p + tag).standard_normal(shape).astype(np.float32)

    def global_array(tag, shape, spec):
        """The array whose shard of process p is shard(p, tag, shape), split over tp on `spec`'s axis."""
        axis = list(spec).index("tp")
        gshape = list(shape)
        gshape[axis] *= 2
        local = jax.device_put(shard(process_id, tag, shape), me)
        return jax.make_array_from_single_device_arrays(tuple(gshape), NamedSharding(mesh, spec), [local])

    def check(name, body):
        """Runs `body` (which raises where a result is wrong) and records it as check `name`."""
        try:
            body()
            checks[name] = "ok"
        except Exception:  # noqa: BLE001
            checks[name] = traceback.format_exc()[-1500:]
        print(f"[p{process_id}] {name}: {'ok' if checks[name] == 'ok' else 'FAIL'}", file=sys.stderr, flush=True)

    def expect_close(got, want, what):
        err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
        if err > 1e-4:
            raise AssertionError(f"{what}: relative error {err:.2e}")

    def run(name, fn, specs, out_spec, args, expected):
        def body():
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False))
            for i in range(10):  # repeated calls: a stale block of an earlier call would show
                scaled = [a * (1 + i) for a in args]
                got = np.asarray(f(*scaled).addressable_shards[0].data)
                expect_close(got, expected * (1 + i) ** len(args), f"call {i}")
        check(name, body)

    m, k, n = 64, 96, 32
    x0, x1 = shard(0, 1, (m, k)), shard(1, 1, (m, k))
    for sched in ("dma/direct/c1", "dma/direct/c1/symmetric", "dma/direct/c2/symmetric", "dma/direct/c4/grouped/symmetric"):
        x = global_array(1, (m, k), P("tp"))
        run(f"all_gather {sched}", lambda a: dma.all_gather(a, "tp", schedule=sched), (P("tp"),), P("tp"), [x],
            np.concatenate([x0, x1]))
        y = global_array(2, (2 * m, k), P("tp"))
        y_sum = shard(0, 2, (2 * m, k)) + shard(1, 2, (2 * m, k))
        run(f"reduce_scatter {sched}", lambda a: dma.reduce_scatter(a, "tp", schedule=sched), (P("tp"),), P("tp"),
            [y], y_sum[process_id * m:(process_id + 1) * m])
        w = global_array(3, (k, n), P(None, "tp"))
        run(f"ag_matmul {sched}", lambda a, b: ficco_jax.ag_matmul(a, b, "tp", schedule=sched),
            (P("tp"), P(None, "tp")), P(None, "tp"), [x, w], np.concatenate([x0, x1]) @ shard(process_id, 3, (k, n)))
        yy = global_array(4, (2 * m, n), P(None, "tp"))
        w2 = global_array(5, (n, k), P("tp"))
        partial = sum(shard(p, 4, (2 * m, n)) @ shard(p, 5, (n, k)) for p in (0, 1))
        run(f"matmul_rs {sched}", lambda a, b: ficco_jax.matmul_rs(a, b, "tp", schedule=sched),
            (P(None, "tp"), P("tp")), P("tp"), [yy, w2], partial[process_id * m:(process_id + 1) * m])

    # One compiled program, both device orders: each function is jitted once, without a mesh of its own,
    # and called under the mesh [d0, d1] and [d1, d0] in turn (jax.set_mesh), as a step is reused under
    # another device order; process p then holds position order.index(p), and each call must give the
    # reference of its own order (the group's ranks and peers come from the run, not the trace).
    def in_both_orders(name, fn, specs, out_spec, tags_shapes, expected_for):
        def body():
            f = jax.jit(jax.shard_map(fn, in_specs=specs, out_specs=out_spec, check_vma=False))
            for order in ([0, 1], [1, 0], [0, 1], [1, 0]):
                ordered = Mesh(np.array(jax.devices())[order], ("tp",))
                args = [jax.make_array_from_single_device_arrays(
                    tuple(d * (2 if i == list(spec).index("tp") else 1) for i, d in enumerate(shape)),
                    NamedSharding(ordered, spec), [jax.device_put(shard(process_id, tag, shape), me)])
                    for (tag, shape), spec in zip(tags_shapes, specs)]
                with jax.set_mesh(ordered):
                    got = np.asarray(f(*args).addressable_shards[0].data)
                expect_close(got, expected_for(order, order.index(process_id)), f"order {order}")
        check(name, body)

    for sched in ("dma/direct/c1", "dma/direct/c2/symmetric"):
        in_both_orders(f"all_gather {sched}, both device orders", lambda a: dma.all_gather(a, "tp", schedule=sched),
                       (P("tp"),), P("tp"), [(1, (m, k))],
                       lambda order, pos: np.concatenate([shard(order[0], 1, (m, k)), shard(order[1], 1, (m, k))]))
        in_both_orders(f"reduce_scatter {sched}, both device orders",
                       lambda a: dma.reduce_scatter(a, "tp", schedule=sched), (P("tp"),), P("tp"), [(2, (2 * m, k))],
                       lambda order, pos: (shard(0, 2, (2 * m, k)) + shard(1, 2, (2 * m, k)))[pos * m:(pos + 1) * m])
        in_both_orders(f"ag_matmul {sched}, both device orders",
                       lambda a, b: ficco_jax.ag_matmul(a, b, "tp", schedule=sched), (P("tp"), P(None, "tp")),
                       P(None, "tp"), [(1, (m, k)), (3, (k, n))],
                       lambda order, pos: np.concatenate([shard(order[0], 1, (m, k)), shard(order[1], 1, (m, k))])
                       @ shard(process_id, 3, (k, n)))

    # A reduce-scatter whose sum is too wide to make its waits itself (device/reduce.cu, kWaitingBlocks):
    # 2048 x 1024 f32 per block, its waits in a kernel of their own.
    big = global_array(6, (2 * 2048, 1024), P("tp"))
    big_sum = shard(0, 6, (2 * 2048, 1024)) + shard(1, 6, (2 * 2048, 1024))
    run("reduce_scatter dma/direct/c2/symmetric, a wide sum",
        lambda a: dma.reduce_scatter(a, "tp", schedule="dma/direct/c2/symmetric"), (P("tp"),), P("tp"), [big],
        big_sum[process_id * 2048:(process_id + 1) * 2048])

    # A chain of symmetric sites between matmuls: XLA captures it in a command buffer, and the later
    # launches replay it without calling the handlers. Per layer both devices gather the same two
    # blocks and scale them by their rank + 1 (so that each sum needs its peer's partial), so the
    # reduce-scatter gives each its own block 1 + 2 times: a <- (3 a) @ w, linear in x.
    layers = 4
    ws = [shard(0, 10 + i, (k, k)) / np.sqrt(k) for i in range(layers)]

    def chain(a):
        rank = (jax.lax.axis_index("tp") + 1).astype(a.dtype)
        for w_np in ws:
            gathered = dma.all_gather(a, "tp", schedule="dma/direct/c1/symmetric") * rank
            a = dma.reduce_scatter(gathered, "tp", schedule="dma/direct/c2/symmetric") @ jnp.asarray(w_np)
        return a

    expected = shard(process_id, 1, (m, k))
    for w_np in ws:
        expected = (3 * expected) @ w_np
    try:
        testing = extension.testing()
        f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
        x = global_array(1, (m, k), P("tp"))
        handlers = []
        for i in range(chain_launches):
            before = testing.host_time()["calls"]
            got = np.asarray(f(x * (1 + i % 7)).addressable_shards[0].data)
            handlers.append(testing.host_time()["calls"] - before)
            want = expected * (1 + i % 7)
            err = float(np.max(np.abs(got - want)) / float(np.max(np.abs(want))))
            if err > 1e-4:
                raise AssertionError(f"launch {i}: relative error {err:.2e}")
        result["handlers_per_launch"] = handlers[:20]
        result["chain_launches"] = chain_launches
        checks["captured chain"] = "ok"
    except Exception:  # noqa: BLE001
        checks["captured chain"] = traceback.format_exc()[-1500:]
    print(f"[p{process_id}] captured chain: {checks['captured chain'][:400]} {result.get('handlers_per_launch')}",
          file=sys.stderr, flush=True)
    result["checks"] = checks
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1)
    return 0 if all(v == "ok" for v in checks.values()) else 1


def left_early(process_id: int, port: int, op: str = "all_gather") -> int:
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from ficco_jax import dma
    from ficco_jax.runtime import extension

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    me = jax.local_devices()[0]
    blocks = [np.random.default_rng(p).standard_normal((64, 32)).astype(np.float32) for p in (0, 1)]
    x = jax.make_array_from_single_device_arrays((128, 32), NamedSharding(mesh, P("tp")),
                                                 [jax.device_put(blocks[process_id], me)])
    if op == "all_gather":
        body, want = lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c1/symmetric"), np.concatenate(blocks)
    else:  # each process's block of 64 rows: its half of both processes' 32-row halves, summed
        body = lambda a: dma.reduce_scatter(a, "tp", schedule="dma/direct/c2/symmetric")  # noqa: E731
        want = (blocks[0] + blocks[1])[process_id * 32:(process_id + 1) * 32]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))

    def launch(scale):
        got = np.asarray(f(x * scale).addressable_shards[0].data)
        return bool(np.allclose(got, want * scale, rtol=1e-5, atol=1e-5))

    for i in range(3):
        if not launch(1 + i):
            print(f"[p{process_id}] launch {i} WRONG", flush=True)
            return 1
    print(f"[p{process_id}] three launches agreed", flush=True)
    if process_id == 1:
        extension.testing().inject_fault("skip:1")
        try:
            launch(4)
            print("[p1] the faulted launch RETURNED", flush=True)
            return 3
        except Exception as e:  # noqa: BLE001
            print(f"[p1] left a launch early: {'injected fault' in str(e)}", flush=True)
        extension.testing().inject_fault("")
    right = launch(5)
    print(f"[p{process_id}] RETURNED, right: {right}", flush=True)
    return 3


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if sys.argv[3:4] == ["--left-early"]:
        sys.exit(left_early(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[4:5]))
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:5])))
