"""transfer="symmetric" on GPUs in one process (xla_ffi/runtime/symmetric.h): every op against plain
JAX over repeated calls with new values, a site run many times in one launch, and a chain of sites
that XLA captures in a command buffer and replays without the handlers; and a device that ends a
launch early is stopped by the launch check, not paired with its peer's next launch. Skips without 2 GPUs;
tests/gpu/test_shared_gpu.py runs symmetric sites across two processes on one GPU."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from ficco_jax import dma
from ficco_jax.runtime import extension
from gpu_common import GPU_MARKS, GPUS
from helpers import max_rel_err

pytestmark = GPU_MARKS

SCHEDULES = ["dma/direct/c1/symmetric", "dma/direct/c2/symmetric", "dma/direct/c4/grouped/symmetric"]
BF16_TOL = 2e-2


def _mesh():
    return Mesh(np.array(GPUS), ("tp",))


def _random(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_the_matmuls_over_repeated_calls(sched):
    mesh = _mesh()
    n = mesh.shape["tp"]
    x, w1, w2 = _random(1, (n * 512, 1024)), _random(2, (1024, n * 512)), _random(3, (n * 512, 1024))

    def mlp(fns):
        def body(x, w1, w2):
            return fns[1](fns[0](x, w1, "tp"), w2, "tp")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
                                     out_specs=P("tp")))

    ours = mlp((lambda a, b, ax: ficco_jax.ag_matmul(a, b, ax, schedule=sched),
                lambda a, b, ax: ficco_jax.matmul_rs(a, b, ax, schedule=sched)))
    ref = mlp((ficco_jax.ag_matmul_ref, ficco_jax.matmul_rs_ref))
    for i in range(20):
        xi = x * (1 + 0.1 * i)
        assert max_rel_err(ours(xi, w1, w2), ref(xi, w1, w2)) < BF16_TOL, (sched, i)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_the_collectives_over_repeated_calls(sched):
    mesh = _mesh()
    n = mesh.shape["tp"]
    x = _random(4, (n * n * 256, 512), jnp.float32)
    cases = [(lambda a: dma.all_gather(a, "tp", schedule=sched), lambda a: jax.lax.all_gather(a, "tp", tiled=True)),
             (lambda a: dma.reduce_scatter(a, "tp", schedule=sched), lambda a: jax.lax.psum_scatter(a, "tp", tiled=True)),
             (lambda a: dma.all_to_all(a, "tp", 0, 0, schedule=sched),
              lambda a: jax.lax.all_to_all(a, "tp", 0, 0, tiled=True))]
    for ours, ref in cases:
        run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))  # noqa: E731
        f, g = run(ours), run(ref)
        for i in range(10):
            np.testing.assert_allclose(np.asarray(f(x + i)), np.asarray(g(x + i)), rtol=1e-5, atol=1e-5)


def test_a_site_in_a_scan():
    mesh = _mesh()
    n = mesh.shape["tp"]
    ws = _random(5, (8, 1024, n * 1024), jnp.float32) / 32
    x = _random(6, (n * 256, 1024), jnp.float32)

    def stack(fn):
        def body(x, ws):
            return jax.lax.scan(lambda h, w: (jnp.tanh(fn(h, w)), None), x, ws)[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, None, "tp")), out_specs=P("tp")))

    ours = stack(lambda h, w: dma.reduce_scatter(ficco_jax.ag_matmul(h, w, "tp", schedule="dma/direct/c2/symmetric"),
                                                 "tp", schedule="dma/direct/c1/symmetric"))
    ref = stack(lambda h, w: jax.lax.psum_scatter(jax.lax.all_gather(h, "tp", tiled=True) @ w, "tp", tiled=True))
    with jax.default_matmul_precision("highest"):
        for i in range(5):
            np.testing.assert_allclose(np.asarray(ours(x + i, ws)), np.asarray(ref(x + i, ws)), rtol=1e-4, atol=1e-4)


def test_a_chain_of_sites_is_replayed_from_a_command_buffer():
    """16 sites between matmuls: XLA captures them (their handlers are command-buffer compatible) and
    replays the graph on later launches, the devices ordering every copy by their counters. Each
    device scales what it gathered by its rank + 1 before the reduce-scatter, so that every sum
    needs its peers' partials (equal partials would let a sum of its own block pass)."""
    mesh = _mesh()
    n = mesh.shape["tp"]
    layers = 8
    ws = [_random(10 + i, (512, 512), jnp.float32) / 24 for i in range(layers)]

    def chain(gather, scatter):
        def body(a):
            rank = (jax.lax.axis_index("tp") + 1).astype(a.dtype)
            for w in ws:
                a = scatter(gather(a) * rank) @ w
            return a
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))

    ours = chain(lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c1/symmetric"),
                 lambda a: dma.reduce_scatter(a, "tp", schedule="dma/direct/c2/symmetric"))
    ref = chain(lambda a: jax.lax.all_gather(a, "tp", tiled=True), lambda a: jax.lax.psum_scatter(a, "tp", tiled=True))
    x = _random(7, (n * 256, 512), jnp.float32)
    testing = extension.testing()
    handlers = []
    with jax.default_matmul_precision("highest"):
        for i in range(8):
            before = testing.host_time()["calls"]
            got = np.asarray(ours(x * (1 + i)))
            handlers.append(testing.host_time()["calls"] - before)
            np.testing.assert_allclose(got, np.asarray(ref(x * (1 + i))), rtol=1e-4, atol=1e-4)
    assert min(handlers[2:]) < 2 * layers * n, handlers  # replayed: fewer handler calls than calls


LEFT_EARLY = """
import sys
import jax, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from ficco_jax import dma
from ficco_jax.runtime import extension
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
f = jax.jit(jax.shard_map(lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c1/symmetric"), mesh=mesh,
                          in_specs=P("tp"), out_specs=P("tp")))
x = jax.random.normal(jax.random.PRNGKey(0), (128, 32))
for i in range(3):
    assert np.allclose(np.asarray(f(x * (1 + i))), np.tile(np.asarray(x * (1 + i)), (2, 1)))
print("three launches agreed", flush=True)


def on_device_1(out):  # device 0's part of a launch after the fault never completes: wait for device 1's
    return np.asarray([s for s in out.addressable_shards if s.device == jax.devices()[1]][0].data)


extension.testing().inject_fault("skip:1")
try:
    on_device_1(f(x * 4))
    print("the faulted launch RETURNED", flush=True)
except Exception as e:
    print("left a launch early:", "injected fault" in str(e), flush=True)
extension.testing().inject_fault("")
on_device_1(f(x * 5))
print("RETURNED", flush=True)
"""


def test_a_launch_left_early_by_one_device_is_reported_never_paired():
    """Device 1 of the group ends a launch before its symmetric call (a fault) and the program runs
    on: its next call would take device 0's data of the launch it left. The launch check stops both;
    the watchdog reports the two launches and ends the process, and no later launch returns.
    Command buffers off, so that the fault's handler runs."""
    import os
    import re
    import subprocess
    import sys
    env = {**os.environ, "FICCO_WATCHDOG_S": "60", "NCCL_NVLS_ENABLE": "0",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="}
    done = subprocess.run([sys.executable, "-c", LEFT_EARLY], capture_output=True, text=True, env=env, timeout=300)
    out = done.stdout + done.stderr
    assert "three launches agreed" in out and "left a launch early: True" in out, out[-4000:]
    assert "RETURNED" not in out and done.returncode != 0, out[-4000:]
    assert re.search(r"ficco_jax watchdog: .*runs in launch \d+, but rank \d \(device \d\) sent its data of that "
                     r"call in launch \d+: a launch ended early", out), out[-4000:]
