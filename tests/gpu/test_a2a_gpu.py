"""The all-to-all targets on real GPUs: copy-engine pulls of strided per-expert chunks, cuBLASLt
expert matmuls, events and joins, for dma.all_to_all, a2a_matmul and matmul_a2a.

Skips unless at least two CUDA GPUs are visible and ficco_jax._ffi was built with CUDA.
Run: python -m pytest tests/gpu -x -q
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from ficco_jax import dma
from ficco_jax.schedule import Schedule
from gpu_common import GPU_MARKS, GPUS


pytestmark = GPU_MARKS

# Per device: x [n, E, C, d], w [E, d, f]; "medium" spans several cuBLASLt tiles per expert.
SHAPES = {"small": (2, 8, 64, 32), "medium": (4, 256, 1024, 512)}
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _mesh():
    return Mesh(np.array(GPUS), ("ep",))


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "non-finite values (an unwritten chunk?)"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _sharded(mesh, fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))


def _schedules(n):
    pulled = [s for s in Schedule.enumerate("a2a_matmul", n, comms=("dma",)) if s.chunks in (1, 4)]
    return pulled + [s.replace(transfer="push") for s in pulled]


def test_all_to_all_is_exact():
    mesh = _mesh()
    n = len(GPUS)
    x = jnp.arange(n * n * 4 * 6 * 5, dtype=jnp.float32).reshape(n * n * 4, 6, 5)
    spec = P("ep")
    # Split-axis-0 cases first: the split-axis-1 ones reshape x for the rest of the loop.
    for split, concat, sched in ((0, 0, None), (0, 1, "dma/ring/c2"), (0, 0, "dma/direct/c2/push"), (1, 0, "dma/direct/c1"),
                                 (1, 0, "dma/direct/c1/push")):
        if split == 1:
            x = x.reshape(n * n, 4 * 6, 5)  # split axis 1 (24 rows) must divide by n
        got = jax.jit(jax.shard_map(lambda v: dma.all_to_all(v, "ep", split, concat, schedule=sched),
                                    mesh=mesh, in_specs=spec, out_specs=spec))(x)
        want = jax.jit(jax.shard_map(lambda v: jax.lax.all_to_all(v, "ep", split, concat, tiled=True),
                                     mesh=mesh, in_specs=spec, out_specs=spec))(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_dma_schedule_matches_reference(shape, dtype):
    mesh = _mesh()
    n = len(GPUS)
    e, c, d, f = SHAPES[shape]
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (n * n, e, c, d), jnp.float32).astype(dtype)
    w1 = (jax.random.normal(keys[1], (n * e, d, f), jnp.float32) / np.sqrt(d)).astype(dtype)
    y = jax.random.normal(keys[2], (n * n, e, c, f), jnp.float32).astype(dtype)
    w2 = (jax.random.normal(keys[3], (n * e, f, d), jnp.float32) / np.sqrt(f)).astype(dtype)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want1 = _sharded(mesh, lambda a, w: ficco_jax.a2a_matmul_ref(a, w, "ep"))(f32(x), f32(w1))
    want2 = _sharded(mesh, lambda a, w: ficco_jax.matmul_a2a_ref(a, w, "ep"))(f32(y), f32(w2))
    for sched in _schedules(n):
        got1 = _sharded(mesh, functools.partial(ficco_jax.a2a_matmul, axis_name="ep", schedule=sched))(x, w1)
        got2 = _sharded(mesh, functools.partial(ficco_jax.matmul_a2a, axis_name="ep", schedule=sched))(y, w2)
        for _ in range(3):  # repeated calls reuse pooled events and cuBLASLt plans
            got1 = _sharded(mesh, functools.partial(ficco_jax.a2a_matmul, axis_name="ep", schedule=sched))(x, w1)
        assert _rel_err(got1, want1) < TOL[dtype], (sched, "a2a_matmul")
        assert _rel_err(got2, want2) < TOL[dtype], (sched, "matmul_a2a")


def test_moe_example_agrees_on_gpu():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "moe_layer.py"
    spec = importlib.util.spec_from_file_location("moe_layer_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for sched in ("dma/direct/c2", "xla/direct/c2", "auto"):
        result = module.main(["--compare", "--schedule", sched, "--steps", "2"])
        assert result["ok"], (sched, result["loss_rel_diff"], result["grad_rel_diff"])
        sites = result["overlap"]["report"].sites
        if sched != "auto":  # the given schedule reaches the layer's expert sites, forward and backward
            assert sites and all(r.schedule == sched for r in sites), str(result["overlap"]["report"])
