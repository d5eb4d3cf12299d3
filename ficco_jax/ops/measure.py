"""Running one op on this process's devices to time it: random sharded operands (never zeros), the
op's body under `jax.shard_map` over a one-axis mesh ("tp"), and its device time. Autotune uses
`time_op`; the benchmark tools build on the same pieces."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..schedule import A2A_OPS
from ..tuning import timing
from .run import call
from .table import reference

#: The mesh axis every measured op runs over.
AXIS = "tp"


def specs(op: str):
    """(in_specs, out_specs) of `op` over the "tp" axis: how its global operands are sharded."""
    if op == "ag_matmul":
        return (P(AXIS, None), P(None, AXIS)), P(None, AXIS)
    if op == "matmul_rs":
        return (P(None, AXIS), P(AXIS, None)), P(AXIS, None)
    if op == "matmul_psum":
        return (P(None, AXIS), P(AXIS, None)), P(None, None)
    if op in A2A_OPS:
        return (P(AXIS), P(AXIS)), P(AXIS)
    raise ValueError(f"measure: unknown op {op!r}")


def _global_shape(local, spec, n: int) -> tuple:
    return tuple(d * n if (i < len(spec) and spec[i] == AXIS) else d for i, d in enumerate(local))


def make_inputs(op: str, local_shapes, dtype, mesh, seed: int = 0):
    """Random global operands of `op` (never zeros) whose per-device blocks have `local_shapes`,
    sharded as the op expects; the weight scaled by 1/sqrt(contracting dimension)."""
    n = mesh.shape[AXIS]
    (a_local, w_local) = local_shapes
    in_specs, _ = specs(op)
    ka, kw = jax.random.split(jax.random.PRNGKey(seed))
    a = jax.random.normal(ka, _global_shape(a_local, in_specs[0], n), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, _global_shape(w_local, in_specs[1], n), jnp.float32)
         * (1.0 / np.sqrt(a_local[-1]))).astype(dtype)
    return [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((a, w), in_specs)]


def op_body(op: str, schedule, out_dtype=None):
    """The per-device body of `op` under `schedule` ("ref": the plain-JAX reference), its matmuls'
    results in `out_dtype` (None: the operands' dtype)."""
    if schedule == "ref":
        ref = reference(op)
        return lambda a, w: ref(a, w, AXIS)
    return lambda a, w: call(op, a, w, AXIS, schedule, measure=time_op, out_dtype=out_dtype)


def sharded(mesh, op: str, body, repeats: int | None = None):
    """`body` jitted under shard_map with `op`'s specs; with `repeats`, run that many times in one
    launch with a data dependency (timing.chain), for device time."""
    in_specs, out_specs = specs(op)
    if repeats is not None:
        body, out_specs = timing.chain(body, repeats), in_specs[0]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def time_op(op: str, schedule, shapes, dtype, axis_size: int, out_dtype=None) -> float:
    """Milliseconds per call of `op` under `schedule` with per-device `shapes` on the first
    `axis_size` local devices, results in `out_dtype` (autotune's measurement)."""
    mesh = Mesh(np.array(jax.local_devices()[:axis_size]), (AXIS,))
    args = make_inputs(op, shapes, dtype, mesh)
    body = op_body(op, schedule, out_dtype)
    return timing.device_time(lambda r: sharded(mesh, op, body, r), args)["median_s"] * 1e3
