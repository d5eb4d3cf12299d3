"""Shared test helpers: shard_map wrappers for the ops on 1-D and 2-D meshes, and error metrics."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

#: Tolerances by dtype: relative Frobenius error against a float32 reference of the same inputs.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}


def batch_axes(mesh):
    return tuple(a for a in mesh.axis_names if a != "tp")


def rows_spec(mesh):
    """Rows split over every mesh axis, tp fastest: the per-device row block of x / of the RS output."""
    return P((*batch_axes(mesh), "tp"), None)


def ag_specs(mesh):
    b = batch_axes(mesh) or None
    return (rows_spec(mesh), P(None, "tp")), P(b, "tp")


def rs_specs(mesh):
    b = batch_axes(mesh) or None
    return (P(b, "tp"), P("tp", None)), rows_spec(mesh)


def psum_specs(mesh):
    """matmul_psum: y and w as matmul_rs takes them; the sum replicated over tp (rows split over dp)."""
    b = batch_axes(mesh) or None
    return (P(b, "tp"), P("tp", None)), P(b, None)


def _jitted(mesh, body, specs, args):
    """(jit of shard_map(body), args placed by their in_specs)."""
    in_specs, out_specs = specs
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return f, [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]


def run_sharded(mesh, body, specs, *args):
    f, placed = _jitted(mesh, body, specs, args)
    return f(*placed)


def random(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def global_shapes(op, mesh, m, k, n_cols):
    """Global (input, weight) shapes giving per-device x [m, K], w [K, N] (ag) or y [M=n*m, N], w [N, K]
    (rs, psum)."""
    tp = mesh.shape["tp"]
    dp = int(np.prod([mesh.shape[a] for a in batch_axes(mesh)])) if batch_axes(mesh) else 1
    if op == "ag_matmul":
        return (dp * tp * m, k), (k, tp * n_cols)
    return (dp * tp * m, tp * n_cols), (tp * n_cols, k)


def prefer_copy_engines(monkeypatch):
    """'auto' decides as on a GPU (over the comms that can run), with a stand-in for the cost model
    that takes copy engines wherever they are allowed (dma/direct/c1, else xla/ring/c1): on CPU the
    real model picks comm='none' for test-sized shapes, and the path under test would never run.
    Returns the list of (op, comms) the stand-in was asked about."""
    from ficco_jax.tuning import policy, select
    from ficco_jax.schedule import Schedule

    asked = []

    def select_schedule(op, shapes, dtype, axis_size, profile=None, comms=None, out_dtype=None):
        comms = tuple(comms or select.available_comms())
        asked.append((op, comms))
        return Schedule.parse("dma/direct/c1" if "dma" in comms else "xla/ring/c1")

    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)
    monkeypatch.setattr(policy, "select_schedule", select_schedule)
    return asked


def lowered_text(mesh, body, specs, *args) -> str:
    """The StableHLO text run_sharded would compile (to check which custom calls a program holds)."""
    f, placed = _jitted(mesh, body, specs, args)
    return f.lower(*placed).as_text()
