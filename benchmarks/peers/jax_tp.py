"""JAX peers of ag_matmul and matmul_rs: what a JAX user can write without ficco_jax.

    python3 benchmarks/peers/jax_tp.py [--shape S] [--out DIR]              # seq, ring, xla
    python3 benchmarks/peers/jax_tp.py --windowed [--shape S] [--out DIR]   # XLA's collective matmul

Every local device on one mesh axis "tp", bf16. Per shape (M, K, N):
  seq     shard_map: lax.all_gather then dot (AG); dot then lax.psum_scatter (RS): XLA runs the
          collective (NCCL on GPUs) and then the GEMM
  ring    shard_map: the shard-level collective matmul of the JAX documentation, a ppermute ring
          with one matmul per step (AG) or a rotating accumulator (RS)
  xla     jit over global arrays, the output sharding constrained; XLA's SPMD partitioner
          chooses. With --windowed the XLA flags of its windowed-einsum collective matmul are set
          (threshold 0, multi-streamed), which is XLA's own overlap; the variant is then "xla_windowed"
  gemm_only   every device's full-M GEMM [M, K] @ [K, N/n] at once; ag_only: lax.all_gather alone
Each variant is checked against seq (relative Frobenius error) before it is timed. Times: device
time by in-jit loop differencing as `bench` times (ficco_jax.tools.harness.method()), so host dispatch is excluded.
Writes DIR/jax_tp.json (jax_tp_windowed.json) and a .md table, printed last. On CPU (e.g. 8
virtual devices) every variant runs; the times mean nothing there.
"""
from __future__ import annotations

import os
import sys

WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                  "--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_use_memcpy_local_p2p=true")
if "--windowed" in sys.argv:  # XLA reads its flags when the backend starts: before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + WINDOWED_FLAGS).strip()

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import shapes  # noqa: E402
from ficco_jax.tools import harness  # noqa: E402
from ficco_jax.tuning import timing  # noqa: E402

AX = "tp"


def ag_seq(x, w):
    return lax.all_gather(x, AX, tiled=True) @ w


def ag_ring(x, w):
    """Step i multiplies the shard that started on device (me + i) % n, then passes it on."""
    n, me, m = lax.axis_size(AX), lax.axis_index(AX), x.shape[0]
    out = jnp.zeros((n * m, w.shape[1]), x.dtype)
    shard = x
    for i in range(n):
        out = lax.dynamic_update_slice(out, shard @ w, (((me + i) % n) * m, 0))
        if i < n - 1:
            shard = lax.ppermute(shard, AX, [(j, (j - 1) % n) for j in range(n)])
    return out


def rs_seq(y, w):
    return lax.psum_scatter(y @ w, AX, scatter_dimension=0, tiled=True)


def rs_ring(y, w):
    """The partial sum for block b travels the ring and ends on device b, each device adding its part."""
    n, me = lax.axis_size(AX), lax.axis_index(AX)
    m = y.shape[0] // n
    acc = None
    for i in range(n):
        block = (me + i + 1) % n
        part = lax.dynamic_slice(y, (block * m, 0), (m, y.shape[1])) @ w
        acc = part if acc is None else acc + part
        if i < n - 1:
            acc = lax.ppermute(acc, AX, [(j, (j - 1) % n) for j in range(n)])
    return acc


def layer(mesh, dims, seed=0):
    """Inputs and specs of both ops: AG x[M, K] rows sharded, w[K, N] columns; RS y[M, N] columns, w2[N, K] rows."""
    M, K, N = dims
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    put = lambda key, shape, spec, scale=1.0: jax.device_put(  # noqa: E731
        (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16), NamedSharding(mesh, spec))
    ag = ((put(keys[0], (M, K), P(AX, None)), put(keys[1], (K, N), P(None, AX), K ** -0.5)),
          (P(AX, None), P(None, AX)), P(None, AX))
    rs = ((put(keys[2], (M, N), P(None, AX)), put(keys[3], (N, K), P(AX, None), N ** -0.5)),
          (P(None, AX), P(AX, None)), P(AX, None))
    return {"ag": ag, "rs": rs}


def maker(mesh, body, in_specs, out_spec, global_view: bool):
    """make(R): a jitted function running the op R times with a data dependency (timing.chain)."""
    def make(repeats):
        if global_view:  # XLA's partitioner: the result's sharding is the only hint
            step = lambda a, b: lax.with_sharding_constraint(a @ b, NamedSharding(mesh, out_spec))  # noqa: E731
            return jax.jit(timing.chain(step, repeats) if repeats else step)
        step = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        return jax.jit(timing.chain(step, repeats) if repeats else step)
    return make


def rel_err(got, want) -> float:
    g, w = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(g - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30))


def measure_shape(mesh, name, dims, windowed: bool) -> dict:
    n = mesh.shape[AX]
    row = {"shape": name, "M": dims[0], "K": dims[1], "N": dims[2], "n": n}
    problems = layer(mesh, dims)
    bodies = {"ag": {"seq": ag_seq, "ring": ag_ring}, "rs": {"seq": rs_seq, "ring": rs_ring}}
    xla_name = "xla_windowed" if windowed else "xla"
    for op, (args, in_specs, out_spec) in problems.items():
        want = maker(mesh, bodies[op]["seq"], in_specs, out_spec, False)(0)(*args)
        todo = {xla_name: (None, True)} if windowed else {"seq": (bodies[op]["seq"], False),
                                                          "ring": (bodies[op]["ring"], False), xla_name: (None, True)}
        for variant, (body, global_view) in todo.items():
            make = maker(mesh, body, in_specs, out_spec, global_view)
            err = rel_err(make(0)(*args), want)
            row[f"{op}_{variant}_rel_err"] = err
            if err < 2e-2:
                row[f"{op}_{variant}"] = harness.device_time(make, args)["median_s"] * 1e3
            print(f"[jax_tp] {name} {op}_{variant}: rel err {err:.2e}, "
                  f"{row.get(f'{op}_{variant}', float('nan')):.3f} ms", file=sys.stderr, flush=True)
    if not windowed:
        row.update(alone(mesh, dims))
    return row


def alone(mesh, dims) -> dict:
    """The GEMM alone (full M, N/n, every device at once) and the all_gather alone, in ms: the
    bench's bounds (`harness.bound_rows`), so both tables' bounds are one measurement."""
    M, K, N = dims
    n = mesh.shape[AX]
    rows = harness.bound_rows(harness.Row("ag_matmul", "", M, K, N, ""), mesh, "bfloat16", lambda _: None,
                              gemm=lambda p, q: p @ q, gemm_shapes=((M, K), (K, N // n)),
                              collective=lambda v: lax.all_gather(v, AX, tiled=True), collective_shape=(M, K),
                              spec=P(AX, None))
    ms = {r.variant: r.median_ms for r in rows}
    return {"gemm_only": ms["gemm_alone"], "ag_only": ms["collective_alone"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="M,K,N, a shape name, or a set: anchors, llama405b, tiny")
    parser.add_argument("--windowed", action="store_true", help="XLA's windowed-einsum flags; times 'xla' only")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/peers"))
    args = parser.parse_args()
    name = "jax_tp_windowed" if args.windowed else "jax_tp"
    mesh = Mesh(np.array(jax.devices()), (AX,))
    n = mesh.shape[AX]
    if n < 2:
        return shapes.skipped(args.out, name, "one device: a tensor-parallel layer needs 2 or more")
    default = "anchors" if jax.default_backend() == "gpu" else "tiny"
    wanted = shapes.parse(args.shape, default)
    rows = [measure_shape(mesh, s, dims, args.windowed) for s, dims in wanted.items() if shapes.divisible(dims, n)]
    columns = (["ag_xla_windowed", "rs_xla_windowed"] if args.windowed else
               ["gemm_only", "ag_only", "ag_seq", "ag_ring", "ag_xla", "rs_seq", "rs_ring", "rs_xla"])
    device = jax.devices()[0].device_kind
    result = {"peer": "jax", "jax": jax.__version__, "n": n, "device": device, "dtype": "bfloat16",
              "platform": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "method": harness.method(), "commit": os.environ.get("FICCO_COMMIT"), "rows": rows}
    table = shapes.markdown(rows, columns, f"JAX on {n} x {device}, ms ({name})")
    shapes.write(args.out, name, result, table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
