"""A copy into a device's buffers waits until that device's XLA stream has reached the call.

XLA gives a custom call's result and scratch buffers memory that the work before the call used
(buffer assignment reuses it once that work is done, in the order of the device's XLA stream).
Copy streams are not XLA's stream: a pull that started as soon as the peer's data was ready would
write while this device still runs the work before the call, into memory that work reads. The
program below makes that window wide and visible: the last device runs a long matmul over a
temporary `t` before the copy-engine op (a `cond` on the device's index, so the other devices reach
the op at once); `t` has the byte size of the op's landing buffer and is dead after the matmul,
so XLA may place the landing buffer where `t` was. If a pull lands early, the matmul reads the
pulled values instead of `t`, and its sum differs from the plain program's.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ficco_jax import dma
from ficco_jax.schedule import Schedule
from gpu_common import GPU_MARKS, GPUS

pytestmark = GPU_MARKS

ROWS, INNER, COLS = 4096, 4096, 1024  # per device: x [ROWS, INNER] (ag) / y [n * ROWS, COLS] (rs)
SLOW_COLS = 65536  # the last device's long matmul: t [.., INNER] @ [INNER, SLOW_COLS], ~ms on an H100
REPEATS = 3


def _program(mesh, op, schedule):
    n = mesh.shape["tp"]

    def per_device(x, w, t, big):
        t = t * 1.5 + 1.0  # a temporary of the landing buffer's size, dead after the cond
        slow = lambda t: jnp.sum(jnp.dot(t, big, preferred_element_type=jnp.float32))
        fast = lambda t: jnp.sum(t[:8].astype(jnp.float32))
        s = jax.lax.cond(jax.lax.axis_index("tp") == n - 1, slow, fast, t)
        x = x + (s * 0).astype(x.dtype)  # the op comes after the cond in every schedule XLA may pick
        if op == "ag_matmul":
            if schedule is None:
                out = jnp.dot(jax.lax.all_gather(x, "tp", tiled=True), w, preferred_element_type=jnp.float32)
            else:
                out = dma.ag_matmul_dma(x, w, "tp", schedule, gathered_needed=False, out_dtype=jnp.float32)[0]
        else:
            if schedule is None:
                out = jax.lax.psum_scatter(jnp.dot(x, w, preferred_element_type=jnp.float32), "tp",
                                           scatter_dimension=0, tiled=True)
            else:
                out = dma.matmul_rs_dma(x, w, "tp", schedule, out_dtype=jnp.float32)
        return out, s[None]

    x_spec, w_spec = (P("tp"), P(None, "tp")) if op == "ag_matmul" else (P(None, "tp"), P("tp", None))
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(x_spec, w_spec, P("tp"), P()),
                                 out_specs=(P("tp"), P("tp"))))


def _operands(op, n, key):
    kx, kw, kt, kb = jax.random.split(key, 4)
    bf16 = jnp.bfloat16
    if op == "ag_matmul":  # landing buffer: the gathered x, [n * ROWS, INNER] per device
        x = 100 * jax.random.normal(kx, (n * ROWS, INNER), bf16)
        w = jax.random.normal(kw, (INNER, n * COLS), bf16)
        t_rows = n * ROWS
    else:  # landing buffer: the peers' partial blocks, (n - 1) x [ROWS, COLS] f32 per device
        x = 100 * jax.random.normal(kx, (n * ROWS, n * INNER), bf16)
        w = jax.random.normal(kw, (n * INNER, COLS), bf16)
        t_rows = max(1, (n - 1) * ROWS * COLS * 4 // (INNER * 2))
    t = jax.random.uniform(kt, (n * t_rows, INNER), bf16, 1.0, 2.0)
    big = jax.random.uniform(kb, (INNER, SLOW_COLS), bf16, -1.0, 1.0)
    return x, w, t, big


@pytest.mark.parametrize("op,schedule", [
    ("ag_matmul", "dma/direct/c1"), ("ag_matmul", "dma/direct/c4"), ("ag_matmul", "dma/direct/c1/push"),
    ("matmul_rs", "dma/direct/c1"), ("matmul_rs", "dma/direct/c8/grouped"),
])
def test_copies_wait_for_the_written_device(op, schedule):
    mesh = Mesh(np.array(GPUS), ("tp",))
    n = len(GPUS)
    operands = _operands(op, n, jax.random.PRNGKey(7))
    plain = _program(mesh, op, None)
    ficco = _program(mesh, op, Schedule.parse(schedule))
    ref_out, ref_s = plain(*operands)
    for i in range(REPEATS):
        out, s = ficco(*operands)
        s, ref = np.asarray(s, np.float64), np.asarray(ref_s, np.float64)
        rel = np.abs(s - ref) / np.maximum(np.abs(ref), 1e-30)
        assert np.all(rel < 1e-4), (f"call {i}: the work before the op read values a copy wrote too early: "
                                    f"sums {s} vs plain {ref}")
        err = float(jnp.max(jnp.abs(out - ref_out)) / jnp.max(jnp.abs(ref_out)))
        assert err < 2e-2, f"call {i}: op result off by {err:.3g}"
