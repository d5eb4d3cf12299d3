"""Where a collective's peers live: in this process, in another process of this host, or on another host.

Copy engines (``comm="dma"``) reach the devices of this process and, through CUDA IPC on GPUs,
those of the other processes of this host (ipc.py); every other peer is reached through XLA's
collectives (``comm="xla"`` or ``"none"``: NCCL on GPUs, gloo on CPU). This module answers, for
one op site (a mesh axis), which case it is in:

  * ``in_process``: every group of the axis lies inside one process (dma runs);
  * ``same_host_multi_process``: some group spans processes, all on one host (dma runs through
    CUDA IPC with the CUDA build on GPUs; elsewhere, e.g. on CPU, xla, and a log line says so);
  * ``multi_host``: some group spans hosts (xla);
  * ``unknown``: several processes, and the devices of the axis cannot be seen (at trace time
    inside ``shard_map`` without ``jax.set_mesh``): treated like ``multi_host``, conservatively.

Every process classifies a site from the members' processes and hosts alone, never from its own
index, so all processes of an SPMD program reach the same schedule (a mismatch would deadlock).

Host identity: each process publishes a host id once through the ``jax.distributed`` key-value
store and reads the others' (``config.HOST_ID`` / ``FICCO_HOST_ID`` overrides the published id,
default ``socket.gethostname()``); `hosts_overridden` replaces the whole map in tests. JAX devices
carry ``process_index`` but no host, so the exchange is the only way to tell hosts apart.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
from typing import Iterator, Mapping, Sequence

import jax
import numpy as np

from .. import config, jax_compat

log = logging.getLogger("ficco_jax")

IN_PROCESS = "in_process"
SAME_HOST_MULTI_PROCESS = "same_host_multi_process"
MULTI_HOST = "multi_host"
UNKNOWN = "unknown"
#: Kinds from the most to the least local; a site is as remote as its most remote group.
KINDS = (IN_PROCESS, SAME_HOST_MULTI_PROCESS, MULTI_HOST, UNKNOWN)

_KV_PREFIX = "ficco_jax/host_id/"


@dataclasses.dataclass(frozen=True)
class Member:
    """One device of a group: its global id, its process, its host, and its ordinal in its process."""

    device_id: int
    process_index: int
    host: str
    local_ordinal: int | None  # Device.local_hardware_id; None where this process cannot address it


@dataclasses.dataclass(frozen=True)
class Group:
    """The devices of one group along the axis, in rank order (rank = index along the axis)."""

    members: tuple[Member, ...]

    @property
    def processes(self) -> tuple[int, ...]:
        return tuple(sorted({m.process_index for m in self.members}))

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({m.host for m in self.members}))

    @property
    def kind(self) -> str:
        if len(self.processes) == 1:
            return IN_PROCESS
        return SAME_HOST_MULTI_PROCESS if len(self.hosts) == 1 else MULTI_HOST

    def __str__(self) -> str:
        return (f"devices {[m.device_id for m in self.members]} on processes {list(self.processes)}"
                f" (hosts {list(self.hosts)})")


@dataclasses.dataclass(frozen=True)
class SiteTopology:
    """The groups of one mesh axis and how far apart their members are.

    `groups` is empty when the devices are not known (`kind` is then ``in_process`` for a
    single-process program and ``unknown`` otherwise); `source` says where the answer came from.
    """

    axis_name: str | None
    groups: tuple[Group, ...]
    source: str  # "single process" | "mesh" | "unknown: <why>"

    @property
    def kind(self) -> str:
        if not self.groups:
            return IN_PROCESS if self.source == "single process" else UNKNOWN
        return max((g.kind for g in self.groups), key=KINDS.index)

    @property
    def in_process(self) -> bool:
        return self.kind == IN_PROCESS

    def spanning_groups(self) -> tuple[Group, ...]:
        """The groups whose members are in more than one process."""
        return tuple(g for g in self.groups if g.kind != IN_PROCESS)

    def groups_of(self, process_index: int) -> tuple[Group, ...]:
        """The groups entirely in process `process_index` (the ones its dma executor runs)."""
        return tuple(g for g in self.groups if g.processes == (process_index,))

    def why_not_in_process(self) -> str:
        """One sentence for a log line or an error: which group reaches which processes and hosts."""
        if self.kind == UNKNOWN:
            return self.source
        spanning = self.spanning_groups()
        if not spanning:
            return "every group is inside one process"
        first = spanning[0]
        more = f" (and {len(spanning) - 1} more group(s))" if len(spanning) > 1 else ""
        if first.kind == SAME_HOST_MULTI_PROCESS:
            reach = ("processes of one host: copy engines reach them only through CUDA IPC "
                     "(GPUs with the CUDA build, opt-in with FICCO_CROSS_PROCESS_DMA=1, docs/multiprocess.md)")
        else:
            reach = "several hosts"
        return f"group {first}{more} spans {reach}"


# ------------------------------------------------------------------------------------------------
# Describing a site
# ------------------------------------------------------------------------------------------------
def describe(mesh: jax.sharding.Mesh, axis_name: str) -> SiteTopology:
    """The groups of `axis_name` in the concrete `mesh`: the device array with that axis moved
    last, reshaped to (-1, n), one row per group, members in rank order."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    n = mesh.shape[axis_name]
    rows = np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), -1).reshape(-1, n)
    return describe_groups(rows, axis_name)


def describe_groups(rows: Sequence[Sequence[jax.Device]], axis_name: str | None = None) -> SiteTopology:
    """The topology of explicit groups of devices (one sequence of devices per group)."""
    rows = [list(r) for r in rows]
    processes = {d.process_index for r in rows for d in r}
    # Hosts matter only to tell same-host from multi-host; skip the exchange when no group spans.
    spans = any(len({d.process_index for d in r}) > 1 for r in rows)
    host = host_ids(sorted(processes)) if spans else {p: "" for p in processes}
    groups = tuple(
        Group(tuple(Member(int(d.id), int(d.process_index), host[d.process_index], d.local_hardware_id)
                    for d in r))
        for r in rows)
    return SiteTopology(axis_name, groups, "mesh")


def context_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh of the enclosing ``jax.set_mesh`` context; None outside one.

    ``jax.sharding.get_mesh()`` answers outside tracing (and while a program is lowered), but
    refuses while a function is traced, pointing at the abstract mesh, which has no devices. A
    site's topology is made of devices, so while tracing this reads the same context through the
    getter it wraps (``jax_compat.concrete_mesh_while_tracing``).
    """
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside a trace
        mesh = jax_compat.concrete_mesh_while_tracing()
    return mesh if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty else None


def for_axis(axis_name: str | None, mesh: jax.sharding.Mesh | None = None) -> SiteTopology:
    """The topology of `axis_name` as far as it can be known at trace time.

    One process: every group is in it, whatever the mesh. Several: the concrete mesh given, or
    the one of the enclosing ``jax.set_mesh`` context; without one (``shard_map(mesh=...)`` shows
    its body only an abstract mesh) the answer is ``unknown``.
    """
    if jax.process_count() == 1:
        return SiteTopology(axis_name, (), "single process")
    if mesh is None:
        mesh = context_mesh()
    if axis_name is None:
        why = "the op's mesh axis is not known here"
    elif not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
        why = ("the devices of the mesh are not visible at trace time (shard_map shows its body an "
               "abstract mesh); enter `with jax.set_mesh(mesh):` around the jit so ficco_jax can see them")
    elif axis_name not in mesh.axis_names:
        why = f"the context mesh {mesh.axis_names} has no axis {axis_name!r}"
    else:
        return describe(mesh, axis_name)
    return SiteTopology(axis_name, (), f"{jax.process_count()} processes and {why}")


# ------------------------------------------------------------------------------------------------
# Host identity
# ------------------------------------------------------------------------------------------------
_override: dict[int, str] | None = None
_cache: dict[int, str] = {}
_published = False


def local_host_id() -> str:
    """This process's host id: config.HOST_ID if set, else the host name."""
    return config.HOST_ID or socket.gethostname()


@contextlib.contextmanager
def hosts_overridden(hosts: Mapping[int, str]) -> Iterator[None]:
    """Use `hosts` (process index -> host id) instead of the key-value exchange (tests)."""
    global _override
    previous, _override = _override, dict(hosts)
    try:
        yield
    finally:
        _override = previous


def host_ids(processes: Sequence[int]) -> dict[int, str]:
    """process index -> host id for `processes`, through the jax.distributed key-value store.

    Every process publishes its id once and reads the others' (blocking up to
    config.HOST_EXCHANGE_TIMEOUT_S per process). A process that does not answer gets a host id of
    its own ("?process-<i>"), i.e. counts as another host: the schedule is the same (xla), only the
    log line is less precise.
    """
    if _override is not None:
        return {p: _override.get(p, f"?process-{p}") for p in processes}
    here = jax.process_index()
    client = _kv_client()
    if client is None:
        return {p: (local_host_id() if p == here else f"?process-{p}") for p in processes}
    _publish(client, here)
    for p in processes:
        if p not in _cache:
            try:
                _cache[p] = client.blocking_key_value_get(
                    f"{_KV_PREFIX}{p}", int(config.HOST_EXCHANGE_TIMEOUT_S * 1000))
            except Exception as exc:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED) on timeout
                log.warning("ficco_jax: process %d did not publish its host id within %.0f s (%s); "
                            "counting it as another host", p, config.HOST_EXCHANGE_TIMEOUT_S, exc)
                return {q: _cache.get(q, f"?process-{q}") for q in processes}
    return {p: _cache[p] for p in processes}


def _kv_client():
    return jax_compat.distributed_client()


def _publish(client, here: int) -> None:
    global _published
    if _published:
        return
    mine = local_host_id()
    client.key_value_set(f"{_KV_PREFIX}{here}", mine)
    _cache[here] = mine
    _published = True


# ------------------------------------------------------------------------------------------------
# The refusal of comm="dma"
# ------------------------------------------------------------------------------------------------
_INSTEAD = {
    "all_gather": "jax.lax.all_gather (XLA's collective)",
    "reduce_scatter": "jax.lax.psum_scatter (XLA's collective)",
}


def dma_refusal(op: str, site: SiteTopology, ipc_path: bool = True) -> str:
    """The error for an explicit comm="dma" on a site whose groups span processes where copy
    engines cannot reach them: other hosts, or other processes without CUDA IPC (CPU backend, a
    build without CUDA, or an op without the IPC path: `ipc_path=False`)."""
    instead = _INSTEAD.get(op, "comm='xla' (e.g. schedule='xla/ring/c2'), or schedule='auto', which falls back by itself")
    if site.kind == SAME_HOST_MULTI_PROCESS:
        reach = ("comm='dma' reaches other processes of this host only through CUDA IPC, on GPUs with the CUDA "
                 "build" + ("" if ipc_path else f" and for the ops that have it ({op} does not)") +
                 f"; here: platform {jax.default_backend()!r}")
    else:
        reach = "comm='dma' reaches the devices of this host only"
    return (f"{op}: mesh axis {site.axis_name!r} spans several processes: {site.why_not_in_process()}. "
            f"{reach} (this is process {jax.process_index()}); "
            f"use {instead}; comm='xla' runs on XLA's collectives (NCCL)")
