"""Which ficco_jax call kills the process on this GPU machine, and where? One small case per child
process (iota mesh over all local GPUs, rendezvous timeout 1 s), run with Python's faulthandler and
FICCO_SEGV_TRACE=1 (the extension prints the native stack on SIGSEGV/SIGABRT).

    python3 scripts/segv_probe.py            # every case, a summary line each
    python3 scripts/segv_probe.py CASE       # one case in this process
"""
import os
import subprocess
import sys
import time

CASES = ("healthy", "skip", "fail", "partial")


def child(case: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from ficco_jax import config, dma

    devices = jax.local_devices()
    n = len(devices)
    mesh = Mesh(np.array(devices if case != "partial" else devices[: n // 2]), ("tp",))
    if case in ("skip", "fail"):
        config.FAULT_INJECTION = f"{case}:1"
    body = lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c1")
    if case == "partial":  # a group of all n devices compiled for, launched on n/2 (as gpu_faults does)
        full = Mesh(np.array(devices), ("tp",))
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_faults

        attrs = dict(gpu_faults._library_attributes(full, jnp.zeros((n * 2, 3), jnp.float32)), op_id=np.int64(2 * 10**9),
                     timeout_ms=np.int64(1000), fault=np.int64(-1))
        body = lambda a: jax.ffi.ffi_call("ficco_all_gather", jax.ShapeDtypeStruct((n * a.shape[0], a.shape[1]), a.dtype))(a, **attrs)
    m = mesh.shape["tp"]
    x = jax.device_put(jnp.arange(m * 2 * 3, dtype=jnp.float32).reshape(m * 2, 3), NamedSharding(mesh, P("tp")))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    print(f"[{case}] compiling", flush=True)
    compiled = f.lower(x).compile()
    print(f"[{case}] running", flush=True)
    t0 = time.monotonic()
    try:
        out = jax.block_until_ready(compiled(x))
        print(f"[{case}] returned after {time.monotonic() - t0:.2f} s, sum {float(out.sum())}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"[{case}] raised after {time.monotonic() - t0:.2f} s: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    config.FAULT_INJECTION = ""
    print(f"[{case}] process still alive", flush=True)


def run_cases(script: str, cases, timeout_s: float = 90, **env_extra) -> None:
    """Run `script CASE` for each case in a child process with faulthandler and the extension's
    native stack on a crash (FICCO_SEGV_TRACE=1), rendezvous timeout 1 s; print each exit status
    and the end of its output (more of it when the child failed). XLA's own log lines are dropped."""
    env = dict(os.environ, FICCO_SEGV_TRACE="1", FICCO_RENDEZVOUS_TIMEOUT_S="1", PYTHONFAULTHANDLER="1", **env_extra)
    for case in cases:
        p = subprocess.run([sys.executable, "-X", "faulthandler", os.path.abspath(script), case], env=env,
                           capture_output=True, text=True, timeout=timeout_s)
        lines = [l for l in (p.stdout + p.stderr).splitlines() if not l.startswith(("E1", "W1", "I1"))]
        print(f"== {case}: exit {p.returncode}")
        print("\n".join(lines[-45:]) if p.returncode else "\n".join(lines[-4:]))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
        sys.exit(0)
    run_cases(__file__, CASES)
