"""cuBLASLt chunk matmuls reading w column-major (`w_col_major`: the weight is a transpose of the
stored array) for bf16, f16 and f32 operands, against XLA's dots of the same operands: each op
given ``v.T`` with w_col_major (its forward reads w column-major, its backward row-major), and
given w as stored (its backward's input gradient reads w^T column-major). The CPU tests
(tests/test_weight_layout.py) check the compiled programs and the CPU executor.

Skips unless at least two CUDA GPUs are visible and ficco_jax._ffi was built with CUDA.
"""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from gpu_common import GPU_MARKS, GPUS, copy_engine_targets

pytestmark = GPU_MARKS

# Per device: rows m, inner K, columns N; K != N so that a transposed index shows, and the medium
# shape spans several cuBLASLt tiles.
SHAPES = {"small": (64, 96, 160), "medium": (512, 1536, 1024)}
TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
SCHEDULES = ("dma/direct/c2", "dma/ring/c4/grouped", "dma/direct/c2/push", "dma/direct/c2/columns")


def _mesh():
    return Mesh(np.array(GPUS), ("tp",))


def _rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _specs(op):
    """((operand, stored weight v), result) specs: the op reads v.T, sharded as its w."""
    return {"ag_matmul": ((P("tp", None), P("tp", None)), P(None, "tp")),
            "matmul_rs": ((P(None, "tp"), P(None, "tp")), P("tp", None))}[op]


def _operands(op, shape, dtype, seed):
    n, (m, k, cols) = len(GPUS), SHAPES[shape]
    rng = np.random.default_rng(seed)
    if op == "ag_matmul":  # x [n*m, K], v [n*N, K]: w = v.T [K, n*N]
        a, v = rng.standard_normal((n * m, k)), rng.standard_normal((n * cols, k)) / np.sqrt(k)
    else:  # y [n*m, n*K], v [N, n*K]: w = v.T [n*K, N]
        a, v = rng.standard_normal((n * m, n * k)), rng.standard_normal((cols, n * k)) / np.sqrt(n * k)
    return jnp.asarray(a, dtype), jnp.asarray(v, dtype)


def _run(op, fn, a, v, cot=None, given_transposed=True):
    """op(a, v.T) in a shard_map (`given_transposed=False`: v.T computed outside, the op given it
    as stored); with `cot`, (sum(out * cot), its gradients with respect to a and v)."""
    (a_spec, v_spec), out_spec = _specs(op)
    if given_transposed:
        body = lambda a, v: fn(a, v.T, "tp")  # noqa: E731
    else:
        body, v, v_spec = lambda a, w: fn(a, w, "tp"), v.T, P(*reversed(tuple(v_spec)))  # noqa: E731
    f = jax.shard_map(body, mesh=_mesh(), in_specs=(a_spec, v_spec), out_specs=out_spec)
    if cot is None:
        return jax.jit(f)(a, v), copy_engine_targets(jax.jit(f), a, v)
    loss = lambda a, v: jnp.sum(f(a, v).astype(jnp.float32) * cot)  # noqa: E731
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return grads(a, v), copy_engine_targets(grads, a, v)


def _cases():
    for op in ("ag_matmul", "matmul_rs"):
        for shape in SHAPES:
            for dtype in TOL:
                for sched in SCHEDULES:
                    if op == "matmul_rs" and "/ring/" in sched:  # direct-only on copy engines
                        continue
                    if op != "matmul_rs" and sched.endswith("/columns"):  # a reduce-scatter's column chunks
                        continue
                    yield pytest.param(op, shape, dtype, sched, id=f"{op}-{shape}-{dtype}-{sched}")


@pytest.mark.parametrize("given_transposed", [True, False], ids=["v.T", "w"])
@pytest.mark.parametrize("op,shape,dtype,sched", list(_cases()))
def test_transposed_weight_read_column_major_gpu(op, shape, dtype, sched, given_transposed):
    a, v = _operands(op, shape, dtype, zlib.crc32(f"{op}{shape}{dtype}{sched}".encode()))
    fn = functools.partial(getattr(ficco_jax, op), schedule=sched, w_col_major=given_transposed)
    ref = getattr(ficco_jax, f"{op}_ref")
    run = functools.partial(_run, op, given_transposed=given_transposed)
    with jax.default_matmul_precision("float32"):  # the executor's f32 matmuls are full f32
        want, _ = run(ref, a, v)
        got, forward = run(fn, a, v)
        assert _rel_err(got, want) < TOL[dtype], "forward"
        cot = jnp.asarray(np.random.default_rng(1).standard_normal(want.shape), jnp.float32)
        ((got_loss, got_grads), backward), ((want_loss, want_grads), _) = run(fn, a, v, cot), run(ref, a, v, cot)
    # On copy engines both ways: the backward's input gradient is the other op (its transpose).
    assert forward == {f"ficco_{op}"} and backward == {"ficco_ag_matmul", "ficco_matmul_rs"}, (forward, backward)
    assert _rel_err(got_loss, want_loss) < TOL[dtype], "loss"
    for name, g, r in zip(("d operand", "d weight"), got_grads, want_grads):
        assert _rel_err(g, r) < TOL[dtype], name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_expert_ops_read_transposed_weights_gpu(dtype):
    """a2a_matmul / matmul_a2a given swapaxes(v, 1, 2) with w_col_major: each expert's matrix column-major."""
    n, e, c, d, f = len(GPUS), 2, 64, 96, 160
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((n * n, e, c, d)), dtype)
    v = jnp.asarray(rng.standard_normal((n * e, f, d)) / np.sqrt(d), dtype)  # stored [E, f, d]: w = [E, d, f]
    spec = P("tp")
    with jax.default_matmul_precision("float32"):
        for op in ("a2a_matmul", "matmul_a2a"):
            a = x if op == "a2a_matmul" else jnp.asarray(rng.standard_normal((n * n, e, c, f)), dtype)
            stored = v if op == "a2a_matmul" else jnp.swapaxes(v, 1, 2)  # matmul_a2a: w [E, f, d] = swap of [E, d, f]

            def run(fn):
                body = lambda a, s: fn(a, jnp.swapaxes(s, 1, 2), "tp")  # noqa: E731
                return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(spec, spec), out_specs=spec))(a, stored)

            got = run(functools.partial(getattr(ficco_jax, op), schedule="dma/direct/c2", w_col_major=True))
            want = run(getattr(ficco_jax, f"{op}_ref"))
            assert _rel_err(got, want) < TOL[dtype], op
