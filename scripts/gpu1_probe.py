"""Error paths on ONE GPU, each in a child process (segv_probe.run_cases: FICCO_SEGV_TRACE=1,
faulthandler): the checks that need no second GPU after the iostream fix (53664fb) and the IPC
staging redesign.

  fault    : dma.all_gather on a 1-device mesh with FICCO_FAULT_INJECTION=skip:0 -> an error, alive
  mailbox  : a direct ficco_all_gather call whose group is [this device, a rank of another process
             that never comes] (ipc_job set): allocates and exports the staging buffer, waits in the
             host mailbox, must time out with "missing ranks [1]" -> an error, alive
  healthy  : afterwards, in the same child, a healthy 1-device all_gather equals its input

    python3 scripts/gpu1_probe.py
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(case: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from ficco_jax import config, dma, ipc

    dev = jax.local_devices()[:1]
    mesh = Mesh(np.array(dev), ("tp",))
    x = jnp.arange(8 * 256, dtype=jnp.float32).reshape(8, 256)
    body = lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c1")
    healthy = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    if case == "fault":
        config.FAULT_INJECTION = "skip:0"
        f = jax.jit(jax.shard_map(lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c2"), mesh=mesh,
                                  in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    else:
        sys.path.insert(0, HERE)
        import gpu_faults

        attrs = dict(gpu_faults._library_attributes(mesh, x), op_id=np.int64(3 * 10**9),
                     groups=np.array([[100, 101]], np.int64), local_ordinals=np.array([[0, -1]], np.int64),
                     ipc_job=np.int64(0x5EED), group_size=np.int64(2), timeout_ms=np.int64(1000), fault=np.int64(-1))
        call = jax.ffi.ffi_call("ficco_all_gather", jax.ShapeDtypeStruct((16, 256), jnp.float32))
        f = jax.jit(jax.shard_map(lambda a: call(a, **attrs), mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                                  check_vma=False))
    t0 = time.monotonic()
    try:
        jax.block_until_ready(f(x))
        print(f"[{case}] returned (no error) after {time.monotonic() - t0:.2f} s", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"[{case}] raised after {time.monotonic() - t0:.2f} s: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    config.FAULT_INJECTION = ""
    if case == "mailbox":
        try:
            print(f"[{case}] staging: {ipc.staging_info()}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"[{case}] staging_info: {type(exc).__name__}: {exc}", flush=True)
    out = np.asarray(healthy(x))
    print(f"[{case}] healthy call after it equal: {bool(np.array_equal(out, np.asarray(x)))}; process alive", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
        sys.exit(0)
    sys.path.insert(0, HERE)
    from segv_probe import run_cases

    run_cases(__file__, ("fault", "mailbox"), timeout_s=120, FICCO_CROSS_PROCESS_DMA="1")
