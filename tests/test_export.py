"""`jax.export` of a program that uses ficco_jax: serialized here, loaded in a fresh process (which
imports ficco_jax to register its targets), called on other devices than it was exported from — the
devices reversed, swapped within the tensor-parallel axis, and another submesh — and equal there to
the plain program on the same devices, forward and gradient."""
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax.runtime import extension

LOADER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import ficco_jax  # registers the targets the artifact calls
    from model import loss, SPECS
    exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    ids = [int(i) for i in sys.argv[2].split(",")]
    names = tuple(sys.argv[3].split(","))
    mesh = Mesh(np.array(jax.devices())[ids].reshape(-1, 4) if len(names) == 2 else np.array(jax.devices())[ids],
                names)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(np.load(sys.argv[4]).values(), SPECS[names])]
    with jax.set_mesh(mesh):
        got = exported.call(*args)
        want = jax.jit(jax.value_and_grad(loss(names), argnums=(0, 1, 2)))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.abs(g - w).max() <= 1e-5 * max(np.abs(w).max(), 1.0), (ids, np.abs(g - w).max())
    print("equal on devices", ids)
""")

MODEL = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    SPECS = {("dp", "tp"): (P(("dp", "tp"), None), P(None, "tp"), P("tp", None)),
             ("tp",): (P("tp", None), P(None, "tp"), P("tp", None))}
    def loss(names):
        rows = names if len(names) == 1 else ("dp", "tp")
        def body(x, w1, w2):
            h = jax.nn.gelu(jax.lax.all_gather(x, "tp", tiled=True) @ w1)
            return jax.lax.psum(jnp.sum(jax.lax.psum_scatter(h @ w2, "tp", tiled=True) ** 2), names)
        specs = SPECS[names]
        return jax.shard_map(body, in_specs=specs, out_specs=P())
""")


def _export(tmp_path, names, ids, schedule):
    sys.path.insert(0, str(tmp_path))
    try:
        (tmp_path / "model.py").write_text(MODEL)
        import model  # noqa: PLC0415 - the module the loading process imports too
        rng = np.random.default_rng(7)
        operands = {"x": rng.standard_normal((32, 8)).astype(np.float32),
                    "w1": rng.standard_normal((8, 16)).astype(np.float32),
                    "w2": rng.standard_normal((16, 8)).astype(np.float32)}
        np.savez(tmp_path / "operands.npz", **operands)
        mesh = Mesh(np.array(jax.devices())[ids].reshape(-1, 4) if len(names) == 2 else np.array(jax.devices())[ids],
                    names)
        step = jax.jit(jax.value_and_grad(ficco_jax.overlap(model.loss(names), schedule=schedule), argnums=(0, 1, 2)))
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
                  for a, s in zip(operands.values(), model.SPECS[names])]
        with jax.set_mesh(mesh):
            exported = jax.export.export(step, disabled_checks=ficco_jax.export_disabled_checks())(*shapes)
        assert any(t in exported.mlir_module() for t in extension.target_names()), "nothing was overlapped"
        path = tmp_path / "step.bin"
        path.write_bytes(exported.serialize())
        return path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("model", None)


def _load_and_call(tmp_path, path, ids, names):
    (tmp_path / "loader.py").write_text(LOADER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(tmp_path / "loader.py"), str(path), ",".join(map(str, ids)),
                           ",".join(names), str(tmp_path / "operands.npz")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal on devices" in done.stdout


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("schedule", ["dma/direct/c2", "dma/direct/c1/symmetric"])
def test_an_exported_step_is_right_on_permuted_devices_in_a_fresh_process(tmp_path, schedule):
    names = ("dp", "tp")
    path = _export(tmp_path, names, list(range(8)), schedule)
    for ids in ([7, 6, 5, 4, 3, 2, 1, 0], [1, 0, 3, 2, 5, 4, 7, 6]):
        _load_and_call(tmp_path, path, ids, names)


@pytest.mark.slow
def test_an_exported_stage_runs_on_another_submesh_in_a_fresh_process(tmp_path):
    names = ("tp",)
    path = _export(tmp_path, names, [0, 1, 2, 3], "dma/direct/c2")
    _load_and_call(tmp_path, path, [4, 5, 6, 7], names)


def test_an_artifact_of_another_contract_is_refused_by_name():
    """A call whose `ficco_abi` differs from the extension's is refused, naming both versions."""
    from helpers import ffi_position

    def gather(a):
        call = jax.ffi.ffi_call("ficco_all_gather", jax.ShapeDtypeStruct((8 * a.shape[0], a.shape[1]), a.dtype))
        groups = np.arange(8, dtype=np.int64)
        return call(ffi_position(), a, ficco_abi=np.int64(extension.CONTRACT_VERSION + 1), op_id=np.int64(4 * 10**9),
                    groups=groups, devices=groups, ipc_job=np.int64(0), group_size=np.int64(8), chunks=np.int64(1),
                    order=np.int64(1), gemm=np.int64(0), copy_streams=np.int64(1), timeout_ms=np.int64(20000),
                    watchdog_ms=np.int64(0), site="test", skip_own_rows=np.int64(0), transfer=np.int64(0),
                    w_col_major=np.int64(0), channel_bytes=np.int64(0))

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    with pytest.raises(Exception, match=rf"contract version {extension.CONTRACT_VERSION + 1}.*follows version "
                                        rf"{extension.CONTRACT_VERSION}; lower or export the program again"):
        jax.block_until_ready(f(np.zeros((16, 2), np.float32)))
