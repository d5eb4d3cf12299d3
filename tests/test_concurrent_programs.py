"""Two host threads dispatching two different copy-engine programs at once, on the same devices
(CPU, 8 virtual devices): every call pairs only with calls of its own program and launch, and
every result equals plain JAX's, iteration after iteration. Plain JAX runs the same pair cleanly,
so a failure here is ficco_jax's."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import threading  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax import dma  # noqa: E402
from ficco_jax.runtime import extension as _ext  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")

ITERATIONS = 40


def _programs(mesh):
    """(program, args, expected) for an ag_matmul, a matmul_rs and an all_gather on `mesh`, each a
    separate executable, with random inputs (a block of another program or launch shows)."""
    rng = np.random.default_rng(3)
    n = mesh.shape["tp"]
    x = jnp.asarray(rng.standard_normal((n * 8, 6)), jnp.float32)
    w_ag = jnp.asarray(rng.standard_normal((6, n * 2)), jnp.float32)
    w_rs = jnp.asarray(rng.standard_normal((6 * n, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((n * 8, 6 * n)), jnp.float32)

    def make(body, in_specs, out_specs):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    cases = [
        (lambda a, b: ficco_jax.ag_matmul(a, b, "tp", schedule="dma/ring/c2"),
         lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b, (P("tp"), P(None, "tp")), P(None, "tp"),
         (x, w_ag)),
        (lambda a, b: ficco_jax.matmul_rs(a, b, "tp", schedule="dma/direct/c2/s2"),
         lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True), (P(None, "tp"), P("tp", None)), P("tp"),
         (y, w_rs)),
        (lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c2/s2"),
         lambda a: jax.lax.all_gather(a, "tp", tiled=True), (P("tp"),), P("tp"), (x,)),
    ]
    out = []
    for body, ref, in_specs, out_specs, args in cases:
        program = make(body, in_specs, out_specs)
        expected = np.asarray(make(ref, in_specs, out_specs)(*args))
        jax.block_until_ready(program(*args))  # compiled before the threads start
        out.append((program, args, expected))
    return out


@pytest.mark.parametrize("pair", [(0, 1), (0, 2), (1, 2)])
def test_two_threads_two_programs_every_result_exact(pair):
    mesh = Mesh(np.array(jax.devices()[:8]), ("tp",))
    programs = _programs(mesh)
    errors = []
    barrier = threading.Barrier(2)

    def run(index):
        program, args, expected = programs[index]
        try:
            barrier.wait()
            for i in range(ITERATIONS):
                got = np.asarray(program(*args))
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5,
                                           err_msg=f"program {index}, iteration {i}")
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread's program
            errors.append(f"program {index}: {type(exc).__name__}: {str(exc)[:600]}")

    threads = [threading.Thread(target=run, args=(index,)) for index in pair]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    assert not errors, errors
