"""Which devices a copy-engine call meets, computed when the call is lowered (the concrete mesh
is known then): the groups along the op's mesh axis, in rank order, as the executor's attributes.

  * groups: the mesh's device array with the op's axis moved last, reshaped to (-1, n); each row
    is one group, members in rank order (rank = index along the axis), written as device
    ordinals (``Device.local_hardware_id`` on GPUs, ``Device.id`` on CPU: what the FFI's
    ``DeviceOrdinal`` reports there) into the ``groups`` attribute, for this process's groups
    only; ``local_ordinals`` repeats them and ``ipc_job`` is 0. At run time each handler finds
    its own ordinal in ``local_ordinals``: that gives its group and rank.
  * A group across processes of this host (CUDA build on GPUs) is written with global device ids
    in ``groups``, each member's ordinal in this process or -1 in ``local_ordinals``, and the
    job id naming the host mailbox in ``ipc_job``; the executor then meets its peers there and
    reaches their buffers through CUDA IPC. Any other spanning group (other hosts, or CPU) is
    refused with an error pointing at comm='xla' (runtime/topology.py says which processes and
    hosts it reaches).
"""
from __future__ import annotations

import jax
import numpy as np

from ...runtime import ipc, topology


def _concrete_mesh(ctx, op: str):
    axis_context = getattr(ctx.module_context, "axis_context", None)
    mesh = getattr(axis_context, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    context_mesh = topology.context_mesh()  # jax.set_mesh's
    if context_mesh is not None:
        return context_mesh
    if isinstance(mesh, jax.sharding.AbstractMesh):
        # A jax.shard_map nested in another lowers its body with the outer one's abstract mesh (JAX
        # keeps no device assignment there), so the devices come from jax.set_mesh alone.
        raise ValueError(
            f"{op}: comm='dma' needs the devices of its mesh axis when it is lowered, and the enclosing "
            f"jax.shard_map has only an abstract mesh {dict(mesh.shape)} (a shard_map nested in another, or "
            f"one without mesh=); run the jitted function inside `with jax.set_mesh(mesh):` with the concrete "
            f"jax.sharding.Mesh, or use comm='xla'"
        )
    raise ValueError(
        f"{op}: comm='dma' needs a concrete jax.sharding.Mesh when it is lowered: call it inside "
        f"jax.shard_map(..., mesh=<jax.sharding.Mesh>) under jax.jit, or inside `with jax.set_mesh(mesh):` "
        f"(found axis context {type(axis_context).__name__})"
    )


def _site(ctx, op: str, axis_name: str, axis_size: int):
    """(the concrete mesh, the topology of `axis_name` in it), checked against the traced size."""
    mesh = _concrete_mesh(ctx, op)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"{op}: axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    n = mesh.shape[axis_name]
    if n != axis_size:
        raise ValueError(f"{op}: axis {axis_name!r} has {n} devices in the mesh but {axis_size} when traced")
    return mesh, topology.describe(mesh, axis_name)


def group_attrs(ctx, op: str, axis_name: str, axis_size: int) -> dict:
    """The executor's group attributes: `groups` (groups, n) in rank order, each member's ordinal
    in this process `local_ordinals` (-1: another process), and `ipc_job` (0: in-process groups).

    In-process groups (the default path) carry device ordinals in both. Groups across processes
    of this host (CUDA build on GPUs) carry global device ids, which name the members in the host
    mailbox, and the job id that names the mailbox (ipc.job_id)."""
    mesh, site = _site(ctx, op, axis_name, axis_size)
    if not site.spanning_groups():
        groups = _local_groups(op, mesh, site, axis_name)
        return {"groups": groups, "local_ordinals": groups, "ipc_job": 0}
    platform = mesh.devices.flat[0].platform
    if site.kind != topology.SAME_HOST_MULTI_PROCESS or not ipc.supported("gpu" if platform in ("cuda", "gpu") else platform):
        raise ValueError(topology.dma_refusal(op, site))
    here = jax.process_index()
    mine = [g for g in site.groups if here in g.processes]
    if not mine:
        raise ValueError(f"{op}: no group of mesh axis {axis_name!r} has a device in this process (process {here})")
    groups = np.array([[m.device_id for m in g.members] for g in mine], dtype=np.int64)
    local = np.array([[m.local_ordinal if m.process_index == here else -1 for m in g.members] for g in mine],
                     dtype=np.int64)
    return {"groups": groups, "local_ordinals": local, "ipc_job": ipc.job_id()}


def in_process_groups(ctx, op: str, axis_name: str, axis_size: int) -> np.ndarray:
    """Device ordinals of every in-process group along `axis_name`, shape (groups, n), rank order;
    a group across processes is refused (targets without the IPC path, e.g. the contention probe)."""
    mesh, site = _site(ctx, op, axis_name, axis_size)
    if site.spanning_groups():
        raise ValueError(topology.dma_refusal(op, site, ipc_path=False))
    return _local_groups(op, mesh, site, axis_name)


def _local_groups(op: str, mesh, site, axis_name: str) -> np.ndarray:
    # Ordinals are numbered per process, and each process runs only the groups of its own devices.
    here = jax.process_index()
    local = site.groups_of(here)
    if not local:
        raise ValueError(
            f"{op}: no group of mesh axis {axis_name!r} is in this process (process {here}); its groups are "
            f"on processes {sorted({p for g in site.groups for p in g.processes})}; use comm='xla'"
        )
    # Handlers find themselves by the FFI's DeviceOrdinal: the CUDA ordinal (local) on GPUs, the
    # device id on jax's CPU client (process p's devices are p*2048+i there, not 0..3).
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    return np.array([[m.device_id if on_cpu else m.local_ordinal for m in g.members] for g in local],
                    dtype=np.int64)
