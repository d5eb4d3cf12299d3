"""Which devices a copy-engine call meets: positions written when the call is lowered, devices found
when it runs (xla_ffi/runtime/placement.h).

A compiled program runs on whatever devices it is given: JAX reuses one lowering for every mesh of
the same shape, a ``jax.export`` artifact is compiled for the devices that load it, a pipeline stage
runs on several submeshes. So the lowering writes no device a call could act on. It writes

  * ``groups``: the groups along the op's mesh axis as logical positions, in rank order: the mesh's
    position array (``arange(mesh.size)`` in the mesh's shape) with the op's axis moved last,
    reshaped to (-1, n). A position is the index of a device in the executable's device
    assignment, which for a mesh is its place in ``mesh.devices.flat``: XLA hands it to each call
    as its partition id (the call's first operand, `position_operand`), so each call finds its
    group and rank in the run, and the members of an in-process group post their devices to each
    other at their first call;
  * ``devices``: the global id of the device the lowering saw at each position (-1 where the mesh
    was abstract). A group across processes of this host (CUDA build on GPUs; ``ipc_job``, the job
    id naming the host mailbox) learns its devices there: its members post their device ids in
    the meeting of the group these ids name, which every member names alike. Any other spanning
    group (other hosts, or CPU) is refused with an error pointing at comm='xla'
    (runtime/topology.py says which processes and hosts it reaches).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.extend.mlir.dialects import stablehlo

from ...runtime import extension, ipc, topology


def position_operand():
    """The call's position, XLA's partition id (a u32 scalar): emitted inside the lowering rule."""
    return stablehlo.partition_id()


def _lowering_mesh(ctx, op: str):
    """The mesh the op is lowered under: the enclosing shard_map's (concrete or abstract), else
    jax.set_mesh's."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    mesh = getattr(axis_context, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    context_mesh = topology.context_mesh()  # jax.set_mesh's
    if context_mesh is not None:
        return context_mesh
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return mesh
    raise ValueError(
        f"{op}: comm='dma' needs the mesh of its axis when it is lowered: call it inside "
        f"jax.shard_map(..., mesh=...) under jax.jit, or inside `with jax.set_mesh(mesh):` "
        f"(found axis context {type(axis_context).__name__})"
    )


def _positions(mesh, axis_name: str) -> np.ndarray:
    """(groups, n) logical positions along `axis_name`, rank order."""
    shape = tuple(mesh.axis_sizes)
    axis = list(mesh.axis_names).index(axis_name)
    return np.moveaxis(np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape), axis, -1).reshape(
        -1, shape[axis])


def _checked_mesh(ctx, op: str, axis_name: str, axis_size: int):
    mesh = _lowering_mesh(ctx, op)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"{op}: axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    n = dict(zip(mesh.axis_names, mesh.axis_sizes))[axis_name]
    if n != axis_size:
        raise ValueError(f"{op}: axis {axis_name!r} has {n} devices in the mesh but {axis_size} when traced")
    return mesh


def group_attrs(ctx, op: str, axis_name: str, axis_size: int) -> dict:
    """The executor's group attributes: `groups` (groups, n) of positions in rank order, `devices`
    the same shape (global device ids seen at lowering, -1 under an abstract mesh), and `ipc_job`
    (0: every group is in one process)."""
    mesh = _checked_mesh(ctx, op, axis_name, axis_size)
    positions = _positions(mesh, axis_name)
    if not isinstance(mesh, jax.sharding.Mesh):
        if jax.process_count() > 1:
            raise ValueError(
                f"{op}: comm='dma' across several processes needs the devices of its mesh axis when it is "
                f"lowered, and the enclosing jax.shard_map has only an abstract mesh {dict(mesh.shape)}; run "
                f"the jitted function inside `with jax.set_mesh(mesh):` with the concrete jax.sharding.Mesh, "
                f"or use comm='xla'")
        return {"groups": positions, "devices": np.full_like(positions, -1), "ipc_job": 0}
    devices = np.array([d.id for d in mesh.devices.flat], dtype=np.int64)[positions]
    site = topology.describe(mesh, axis_name)
    if not site.spanning_groups():
        return {"groups": positions, "devices": devices, "ipc_job": 0}
    platform = mesh.devices.flat[0].platform
    if site.kind != topology.SAME_HOST_MULTI_PROCESS or not ipc.supported("gpu" if platform in ("cuda", "gpu") else platform):
        raise ValueError(topology.dma_refusal(op, site))
    job = ipc.job_id()
    extension.register_local_devices(job)
    return {"groups": positions, "devices": devices, "ipc_job": job}


def in_process_groups(ctx, op: str, axis_name: str, axis_size: int) -> dict:
    """`group_attrs` of a target without the IPC path (the contention probe): a group across
    processes is refused."""
    mesh = _checked_mesh(ctx, op, axis_name, axis_size)
    if isinstance(mesh, jax.sharding.Mesh):
        site = topology.describe(mesh, axis_name)
        if site.spanning_groups():
            raise ValueError(topology.dma_refusal(op, site, ipc_path=False))
    return group_attrs(ctx, op, axis_name, axis_size)
