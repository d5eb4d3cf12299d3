"""Collectives and overlapped matmuls on the GPU's copy engines (the ficco_jax FFI executor).

Everything here runs inside ``jax.shard_map`` under ``jax.jit`` on a ``jax.sharding.Mesh`` whose
groups lie inside this process, or, on GPUs and opt-in (FICCO_CROSS_PROCESS_DMA=1, not yet run on
a GPU), span processes of this host (CUDA IPC, ipc.py).
Each op is one XLA custom call per device; the extension
(xla_ffi/) pulls the peers' chunks with copy engines while the chunk matmuls run on the SMs.
On CPU the same executor runs with memcpy and reference loops (what the tests exercise).

Public:
  ``all_gather(x, axis_name, *, axis=0, tiled=True, schedule=None)``
  ``reduce_scatter(x, axis_name, *, scatter_dimension=0, tiled=True, schedule=None)``
  ``ag_matmul_dma(x, w, axis_name, schedule) -> (out, gathered)``   (raw, no VJP; ops.py wraps it)
  ``matmul_rs_dma(y, w, axis_name, schedule) -> out``               (raw, no VJP; ops.py wraps it)
  ``check_supported(op, dtype)``, ``available()``, ``cuda_built()``

How a call finds its peers (computed at LOWERING time, when the concrete mesh is known):
  * groups: the mesh's device array with the op's axis moved last, reshaped to (-1, n); each row
    is one group, members in rank order (rank = index along the axis), written as device
    ordinals (``Device.local_hardware_id`` on GPUs, ``Device.id`` on CPU: what the FFI's
    ``DeviceOrdinal`` reports there) into the ``groups`` attribute, for this process's groups
    only; ``local_ordinals`` repeats them and ``ipc_job`` is 0. At run time each handler finds
    its own ordinal in ``local_ordinals``: that gives its group and rank.
    A group across processes of this host (CUDA build on GPUs) is written with global device ids
    in ``groups``, each member's ordinal in this process or -1 in ``local_ordinals``, and the
    job id naming the host mailbox in ``ipc_job``; the executor then meets its peers there and
    reaches their buffers through CUDA IPC (xla_ffi/ipc.h). Any other spanning group (other
    hosts, or CPU) is refused with an error pointing at comm='xla' (topology.py says which
    processes and hosts it reaches).
  * op_id: a process-wide counter drawn when the op is traced (bound), unique per call site, so
    two ops of one program never share a rendezvous.
  * occurrence: counted by the executor per device and launch (RunId): the same call site run
    many times in one launch (lax.scan, fori_loop) meets its peers once per execution.

Attributes of every FFI target (one struct, ``OpAttrs`` in xla_ffi/handlers.h):
  op_id, groups (flat i64 array), local_ordinals (same length), ipc_job, group_size, chunks,
  order (0 ring, 1 direct),
  gemm (0 per_chunk, 1 grouped), copy_streams, timeout_ms (config.RENDEZVOUS_TIMEOUT_S),
  skip_own_rows, transfer (0 pull, 1 push: senders write into their peers, in-process groups only),
  fault: -1 none, else mode*1000 + rank with mode 1 = "skip:<rank>" (that rank errors without
  joining any rendezvous) and 2 = "fail:<rank>" (it joins the exchange, then errors before its
  transfers); from config.FAULT_INJECTION, read at trace time. Debug only.

Transfer order: rank r pulls from r-1 first, then r-2, ... (ring distance 1, 2, ...). ``direct``
spreads the peers over ``copy_streams`` copy streams (peer slot s on stream s % copy_streams);
``ring`` pulls one peer at a time on one stream. Both pull from the owner directly: on an
NVSwitch node every owner is one hop away, so "ring" is an issue order, not relaying.
matmul_rs with ``gemm="grouped"``: one matmul per peer block (its chunks still move
separately) and one reduction per block once all its chunks landed.
``transfer="push"`` turns the roles round (xla_ffi/executor.h): each sender's copy streams write
its chunks into the peers (rank r to r+1 first), after the receiver's entry event, and a second
meeting hands the chunk events to the receivers. Groups inside one process only (a ValueError
across processes). Opt-in: on 2 x H200 it timed level with pulls (median 1.3 % slower over 36
(op, shape, schedule) pairs, session 7), so `auto` does not enumerate it.
"""
from __future__ import annotations

import functools
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _ext, config, ipc, topology
from .schedule import Schedule

__all__ = [
    "all_gather", "reduce_scatter", "all_gather_ref", "reduce_scatter_ref", "ag_matmul_dma",
    "matmul_rs_dma", "check_supported", "available", "cuda_built",
]

available = _ext.available
cuda_built = _ext.cuda_built

_TARGETS = {
    "ag_matmul": "ficco_ag_matmul",
    "matmul_rs": "ficco_matmul_rs",
    "all_gather": "ficco_all_gather",
    "reduce_scatter": "ficco_reduce_scatter",
}
_FAULT_MODES = {"skip": 1, "fail": 2}

# ------------------------------------------------------------------------------------------------
# op ids
# ------------------------------------------------------------------------------------------------
_op_ids = itertools.count(1)
_op_id_lock = threading.Lock()


def _next_op_id() -> int:
    with _op_id_lock:
        return next(_op_ids)


# ------------------------------------------------------------------------------------------------
# Checks and attributes
# ------------------------------------------------------------------------------------------------
def check_supported(op: str, dtype) -> None:
    """Raise TypeError for a dtype the executor lacks, ImportError if the extension is unusable."""
    name = jnp.dtype(dtype).name
    if op in ("ag_matmul", "matmul_rs", "reduce_scatter") and name not in config.DMA_DTYPES:
        raise TypeError(
            f"{op}: comm='dma' handles dtypes {config.DMA_DTYPES}, found {name}; "
            f"cast the operands or use comm='xla'"
        )
    _ext.ensure_loaded()


def _check_axis_name(op: str, axis_name) -> None:
    if not isinstance(axis_name, str):
        raise TypeError(
            f"{op}: comm='dma' needs axis_name to be one mesh axis name (a str), found {axis_name!r}; "
            f"a tuple of axes is not supported (merge them into one mesh axis, or use comm='xla')"
        )


def _axis_size(axis_name: str, op: str = "dma") -> int:
    try:
        return int(jax.lax.psum(1, axis_name))
    except NameError as exc:
        raise ValueError(
            f"{op}: axis {axis_name!r} is not bound here; call it inside jax.shard_map over a mesh "
            f"with that axis ({exc})"
        ) from exc


def _check_not_empty(op: str, x) -> None:
    if 0 in x.shape:
        raise ValueError(
            f"{op}: x has an empty dimension: found shape {tuple(x.shape)}, every dimension must be >= 1; "
            f"skip the call, or use jax.lax for empty arrays"
        )


def _fault_code() -> int:
    spec = config.FAULT_INJECTION.strip()
    if not spec:
        return -1
    mode, _, rank = spec.partition(":")
    if mode not in _FAULT_MODES or not rank.isdigit():
        raise ValueError(
            f"config.FAULT_INJECTION={config.FAULT_INJECTION!r}: expected '', 'skip:<rank>' or 'fail:<rank>'"
        )
    return _FAULT_MODES[mode] * 1000 + int(rank)


def _collective_schedule(op: str, schedule, n: int, rows: int) -> Schedule:
    """The schedule of a standalone collective: default direct, one chunk, one copy stream.

    One stream: on 4 x H200 (2026-11-22) one copy stream pulled 313 GB/s per GPU in an all-gather
    of 64 MiB shards and two streams 181 GB/s; the all_to_all of 64 MiB blocks took 0.632 ms on
    one stream and 1.084 ms on two (NCCL 0.706 ms)."""
    if schedule is None:
        schedule = Schedule(comm="dma", order="direct", chunks=1, copy_streams=1)
    elif isinstance(schedule, str):
        schedule = Schedule.parse(schedule)
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"{op}: schedule must be None, a comm='dma' ficco_jax.Schedule or its string form; "
            f"found {type(schedule).__name__}"
        )
    if schedule.comm != "dma":
        raise ValueError(f"{op}: dma.{op} runs comm='dma' schedules only, found {schedule}")
    problem = schedule._problem("ag_matmul", n)  # same transfer rules: ring/direct, stream counts
    if problem is not None:
        raise ValueError(f"{op}: schedule {schedule} is not valid: {problem}")
    if rows % schedule.chunks:
        valid = [c for c in config.CHUNK_CHOICES if rows % c == 0]
        raise ValueError(
            f"{op}: {rows} rows per block must divide by schedule.chunks={schedule.chunks}; "
            f"valid chunk counts for this shape: {valid}"
        )
    return schedule


def _match_varying(*values):
    """Make every operand vary over the union of the operands' manual axes (check_vma)."""
    def varying(v):
        aval = jax.typeof(v)
        mat = getattr(aval, "mat", None)
        return frozenset(getattr(mat, "varying", ()) or getattr(aval, "vma", ()) or ())

    union = frozenset().union(*(varying(v) for v in values))
    out = []
    for v in values:
        missing = tuple(sorted(union - varying(v), key=str))
        out.append(jax.lax.pcast(v, missing, to="varying") if missing else v)
    return out


# ------------------------------------------------------------------------------------------------
# Primitives: abstract eval at trace time, groups at lowering time
# ------------------------------------------------------------------------------------------------
def _aval(like, shape, dtype=None):
    return like.update(shape=tuple(shape), dtype=dtype or like.dtype, sharding=like.sharding.update(
        spec=jax.sharding.PartitionSpec(*([None] * len(shape)))) if hasattr(like.sharding, "update") else like.sharding)


def _abstract_ag_matmul(x, w, *, axis_size, **_):
    n, (m, k), cols = axis_size, x.shape, w.shape[1]
    return [_aval(x, (n * m, cols)), _aval(x, (n * m, k))]


def _abstract_matmul_rs(y, w, *, axis_size, **_):
    n, m, cols = axis_size, y.shape[0] // axis_size, w.shape[1]
    return [_aval(y, (m, cols)), _aval(y, (n - 1, m, cols)), _aval(y, (n - 1, m, cols))]


def _abstract_all_gather(x, *, axis_size, **_):
    return [_aval(x, (axis_size * x.shape[0], *x.shape[1:]))]


def _abstract_reduce_scatter(x, *, axis_size, **_):
    m = x.shape[0] // axis_size
    return [_aval(x, (m, *x.shape[1:])), _aval(x, (axis_size - 1, m, *x.shape[1:]))]


def _concrete_mesh(ctx, op: str):
    axis_context = getattr(ctx.module_context, "axis_context", None)
    mesh = getattr(axis_context, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.get_concrete_mesh()
    if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
        return mesh
    raise ValueError(
        f"{op}: comm='dma' needs a concrete jax.sharding.Mesh when it is lowered: call it inside "
        f"jax.shard_map(..., mesh=<jax.sharding.Mesh>) under jax.jit (found axis context "
        f"{type(axis_context).__name__})"
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


def _group_attrs(ctx, op: str, axis_name: str, axis_size: int) -> dict:
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


def _groups(ctx, op: str, axis_name: str, axis_size: int) -> np.ndarray:
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


def _lowering(ctx, *operands, op, axis_name, axis_size, op_id, schedule, timeout_ms, fault, skip_own_rows=False):
    group = _group_attrs(ctx, op, axis_name, axis_size)
    if schedule.transfer == "push" and group["ipc_job"] != 0:
        raise ValueError(
            f"{op}: schedule {schedule} pushes into the peers' buffers, but the group of mesh axis {axis_name!r} "
            f"spans processes, whose XLA buffers cannot be opened from here; use transfer='pull' "
            f"(e.g. {str(schedule.replace(transfer='pull'))!r})"
        )
    rule = jax.ffi.ffi_lowering(_TARGETS[op])
    return rule(
        ctx, *operands,
        op_id=np.int64(op_id),
        groups=group["groups"].reshape(-1),
        local_ordinals=group["local_ordinals"].reshape(-1),
        ipc_job=np.int64(group["ipc_job"]),
        group_size=np.int64(axis_size),
        chunks=np.int64(schedule.chunks),
        order=np.int64({"ring": 0, "direct": 1}[schedule.order]),
        gemm=np.int64({"per_chunk": 0, "grouped": 1}[schedule.gemm]),
        copy_streams=np.int64(schedule.copy_streams),
        timeout_ms=np.int64(timeout_ms),
        fault=np.int64(fault),
        skip_own_rows=np.int64(int(skip_own_rows)),
        transfer=np.int64({"pull": 0, "push": 1}[schedule.transfer]),
    )


def _make_primitive(op: str, abstract_eval) -> Primitive:
    prim = Primitive(_TARGETS[op])
    prim.multiple_results = True
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, _lowering)
    return prim


_PRIMITIVES = {
    "ag_matmul": _make_primitive("ag_matmul", _abstract_ag_matmul),
    "matmul_rs": _make_primitive("matmul_rs", _abstract_matmul_rs),
    "all_gather": _make_primitive("all_gather", _abstract_all_gather),
    "reduce_scatter": _make_primitive("reduce_scatter", _abstract_reduce_scatter),
}


def _bind(op: str, operands, axis_name: str, axis_size: int, schedule: Schedule, *, skip_own_rows: bool = False):
    check_supported(op, operands[0].dtype)
    operands = _match_varying(*operands)
    return _PRIMITIVES[op].bind(
        *operands, op=op, axis_name=axis_name, axis_size=axis_size, op_id=_next_op_id(), schedule=schedule,
        timeout_ms=int(round(config.RENDEZVOUS_TIMEOUT_S * 1000)), fault=_fault_code(), skip_own_rows=skip_own_rows,
    )


# ------------------------------------------------------------------------------------------------
# Raw overlapped matmuls (ops.py adds validation and the custom VJPs)
# ------------------------------------------------------------------------------------------------
def ag_matmul_dma(x, w, axis_name, schedule: Schedule, *, gathered_needed: bool = True):
    """``(all_gather(x, axis_name, tiled=True) @ w, all_gather(x, axis_name, tiled=True))`` on copy engines.

    x [m, K], w [K, N] per device -> out [n*m, N], gathered [n*m, K]. No VJP (see ops.ag_matmul).
    With `gathered_needed=False` this device's own rows of `gathered` are left unwritten (the
    caller drops it): one local copy of x fewer beside the matmuls.
    """
    _check_axis_name("ag_matmul", axis_name)
    if x.dtype != w.dtype:
        raise TypeError(f"ag_matmul: comm='dma' needs x and w of one dtype, found {x.dtype} and {w.dtype}")
    out, gathered = _bind("ag_matmul", (x, w), axis_name, _axis_size(axis_name), schedule,
                          skip_own_rows=not gathered_needed)
    return out, gathered


def matmul_rs_dma(y, w, axis_name, schedule: Schedule):
    """``psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`` on copy engines.

    y [M, N], w [N, K] per device -> [M/n, K]. No VJP (see ops.matmul_rs).
    """
    _check_axis_name("matmul_rs", axis_name)
    if y.dtype != w.dtype:
        raise TypeError(f"matmul_rs: comm='dma' needs y and w of one dtype, found {y.dtype} and {w.dtype}")
    out, _send, _recv = _bind("matmul_rs", (y, w), axis_name, _axis_size(axis_name), schedule)
    return out


# ------------------------------------------------------------------------------------------------
# Standalone collectives
# ------------------------------------------------------------------------------------------------
def all_gather_ref(x, axis_name, *, axis=0, tiled=True):
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def reduce_scatter_ref(x, axis_name, *, scatter_dimension=0, tiled=True):
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)


def all_gather(x, axis_name, *, axis=0, tiled=True, schedule=None):
    """``jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)``, moved by copy engines.

    Any dtype (rows of bytes). Differentiable: the transpose is `reduce_scatter` on copy engines.
    `schedule`: a comm="dma" Schedule (or its string) for the transfers; default direct, one chunk.
    """
    _check_axis_name("all_gather", axis_name)
    if not tiled:
        raise NotImplementedError("dma.all_gather: only tiled=True is supported; use jax.lax.all_gather")
    axis = _normalize_axis("all_gather", axis, jnp.ndim(x))
    _check_not_empty("all_gather", x)
    n = _axis_size(axis_name, "all_gather")
    sched = _collective_schedule("all_gather", schedule, n, x.shape[axis])
    return _all_gather(x, axis_name, axis, sched)


def reduce_scatter(x, axis_name, *, scatter_dimension=0, tiled=True, schedule=None):
    """``jax.lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True)`` on copy engines.

    bf16/f16/f32, summed with f32 accumulation (one rounding). Differentiable: the transpose is
    `all_gather` on copy engines.
    """
    _check_axis_name("reduce_scatter", axis_name)
    if not tiled:
        raise NotImplementedError("dma.reduce_scatter: only tiled=True is supported; use jax.lax.psum_scatter")
    axis = _normalize_axis("reduce_scatter", scatter_dimension, jnp.ndim(x))
    _check_not_empty("reduce_scatter", x)
    n = _axis_size(axis_name, "reduce_scatter")
    if x.shape[axis] % n:
        raise ValueError(
            f"reduce_scatter: x.shape[{axis}]={x.shape[axis]} must divide by the axis size {n} of {axis_name!r}"
        )
    sched = _collective_schedule("reduce_scatter", schedule, n, x.shape[axis] // n)
    return _reduce_scatter(x, axis_name, axis, sched)


def _normalize_axis(op: str, axis: int, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{op}: axis must be an int, found {axis!r}")
    if ndim == 0:
        raise ValueError(f"{op}: x must have at least one dimension")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather(x, axis_name, axis, sched):
    front = jnp.moveaxis(x, axis, 0)
    (out,) = _bind("all_gather", (front,), axis_name, _axis_size(axis_name), sched)
    return jnp.moveaxis(out, 0, axis)


def _all_gather_fwd(x, axis_name, axis, sched):
    return _all_gather(x, axis_name, axis, sched), None


def _all_gather_bwd(axis_name, axis, sched, _, g):
    return (_reduce_scatter(g, axis_name, axis, sched),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _reduce_scatter(x, axis_name, axis, sched):
    front = jnp.moveaxis(x, axis, 0)
    out, _recv = _bind("reduce_scatter", (front,), axis_name, _axis_size(axis_name), sched)
    return jnp.moveaxis(out, 0, axis)


def _reduce_scatter_fwd(x, axis_name, axis, sched):
    return _reduce_scatter(x, axis_name, axis, sched), None


def _reduce_scatter_bwd(axis_name, axis, sched, _, g):
    return (_all_gather(g, axis_name, axis, sched),)


_reduce_scatter.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


# The all-to-all family (standalone all_to_all and the expert-parallel fused ops) lives in
# dma_a2a.py, which adds its targets to the tables above; loaded on first use.
_A2A_NAMES = ("all_to_all", "all_to_all_ref", "a2a_matmul_dma", "matmul_a2a_dma")


def __getattr__(name):
    if name in _A2A_NAMES:
        from . import dma_a2a

        return getattr(dma_a2a, name)
    raise AttributeError(f"module 'ficco_jax.dma' has no attribute {name!r}")
