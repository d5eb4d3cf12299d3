"""The standalone collectives on copy engines, as in jax.lax:

  ``all_gather(x, axis_name, *, axis=0, tiled=True, schedule=None)``
  ``reduce_scatter(x, axis_name, *, scatter_dimension=0, tiled=True, schedule=None)``
  ``all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=True, schedule=None)``

`schedule`: None (copy engines, direct, one chunk, one copy stream), a comm="dma" Schedule or its
string form, or "auto": copy engines where they beat XLA's own collective (NCCL on GPUs) — GPU
groups inside this process whose per-peer block is at least config.DMA_COLLECTIVE_MIN_BYTES — and
`jax.lax`'s collective elsewhere. The default stays None because a caller of ficco_jax.dma asked for
copy engines by name; "auto" is the choice for code that only wants the faster of the two.

Each moves the collective's axis to the front and makes one FFI call per device (registry.bind).
Each is linear, and its primitive says so (registry.py): forward mode (jax.jvp, jacfwd) runs the
collective on the tangent, reverse mode (jax.grad, vjp) its transpose, another of the three on
copy engines (all_gather <-> reduce_scatter, all_to_all <-> the all_to_all with the two axes
swapped); jax.vmap runs one call on the batch (registry.py, `_fold_batch`). all_to_all cuts
the split axis into n blocks moved to the front; the executor exchanges blocks (block p to rank p,
chunk by chunk), and the received blocks are concatenated along the concat axis in rank order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ... import config
from ...runtime import extension, topology
from ...schedule import Schedule, as_schedule
from .registry import axis_size_of, bind, check_axis_name, check_not_empty

def all_gather_ref(x, axis_name, *, axis=0, tiled=True):
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def reduce_scatter_ref(x, axis_name, *, scatter_dimension=0, tiled=True):
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)


def all_gather(x, axis_name, *, axis=0, tiled=True, schedule=None):
    """``jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)``, moved by copy engines.

    Any dtype (rows of bytes). Differentiable in both modes: the transpose is `reduce_scatter` on copy
    engines.
    `schedule`: a comm="dma" Schedule (or its string) for the transfers; default direct, one chunk.
    """
    axis, n = _checked("all_gather", "all_gather", x, axis_name, tiled, axis)
    if schedule == "auto" and not copy_engines_pay(x.nbytes, axis_name):
        return all_gather_ref(x, axis_name, axis=axis)
    sched = _collective_schedule("all_gather", schedule, n, x.shape[axis])
    return _all_gather(x, axis_name, axis, sched)


def reduce_scatter(x, axis_name, *, scatter_dimension=0, tiled=True, schedule=None):
    """``jax.lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True)`` on copy engines.

    bf16/f16/f32, summed with f32 accumulation (one rounding); other dtypes are a TypeError, except with
    schedule="auto", which runs `jax.lax.psum_scatter` for them. Differentiable in both modes: the transpose
    is `all_gather` on copy engines.
    """
    axis, n = _checked("reduce_scatter", "psum_scatter", x, axis_name, tiled, scatter_dimension)
    _check_divides("reduce_scatter", x, axis, n, axis_name)
    summed = jnp.dtype(x.dtype).name in config.DMA_DTYPES
    if schedule == "auto" and (not summed or not copy_engines_pay(x.nbytes // n, axis_name)):
        return reduce_scatter_ref(x, axis_name, scatter_dimension=axis)
    if not summed:  # the executor's own message names comm='xla', which this function does not take
        raise TypeError(f"dma.reduce_scatter: copy engines sum dtypes {config.DMA_DTYPES}, found "
                        f"{jnp.dtype(x.dtype).name}; cast x to one of them, or call jax.lax.psum_scatter, "
                        f"or pass schedule='auto' (which runs jax.lax.psum_scatter for this dtype)")
    sched = _collective_schedule("reduce_scatter", schedule, n, x.shape[axis] // n)
    return _reduce_scatter(x, axis_name, axis, sched)


def copy_engines_pay(block_bytes: int, axis_name: str, platform: str | None = None) -> bool:
    """Whether `schedule="auto"` moves a collective whose peers each send `block_bytes` on copy
    engines: a GPU with the CUDA build, every peer in this process, and a block of at least
    config.DMA_COLLECTIVE_MIN_BYTES (below it XLA's collective is faster)."""
    platform = platform or jax.default_backend()
    if platform != "gpu" or not extension.cuda_built():
        return False
    if topology.for_axis(axis_name).spanning_groups():
        return False
    return block_bytes >= config.DMA_COLLECTIVE_MIN_BYTES


def _checked(op: str, lax_name: str, x, axis_name, tiled, *axes):
    """The checks every standalone collective makes: one mesh axis name, tiled=True, valid array
    axes (normalised), no empty dimension. Returns the normalised axes and the group size."""
    check_axis_name(op, axis_name)
    if not tiled:
        raise NotImplementedError(f"dma.{op}: only tiled=True is supported; use jax.lax.{lax_name}")
    axes = [_normalize_axis(op, a, jnp.ndim(x)) for a in axes]
    check_not_empty(op, x)
    return (*axes, axis_size_of(axis_name, op))


def _check_divides(op: str, x, axis: int, n: int, axis_name, what: str = "") -> None:
    if x.shape[axis] % n:
        raise ValueError(
            f"{op}: x.shape[{axis}]={x.shape[axis]}{what} must divide by the axis size {n} of {axis_name!r}"
        )


def _normalize_axis(op: str, axis: int, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{op}: axis must be an int, found {axis!r}")
    if ndim == 0:
        raise ValueError(f"{op}: x must have at least one dimension")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def _along_front(op: str):
    """`op` on x with the collective's axis moved to the front, the executor's block layout."""
    def run(x, axis_name, axis, sched):
        front = jnp.moveaxis(x, axis, 0)
        out = bind(op, (front,), axis_name, axis_size_of(axis_name), sched)[0]
        return jnp.moveaxis(out, 0, axis)

    run.__name__ = run.__qualname__ = f"_{op}"
    return run


_all_gather = _along_front("all_gather")
_reduce_scatter = _along_front("reduce_scatter")


def _collective_schedule(op: str, schedule, n: int, rows: int) -> Schedule:
    """The schedule of a standalone collective: default direct, one chunk, one copy stream.

    One stream: on 4 x H200 (2026-11-22) one copy stream pulled 313 GB/s per GPU in an all-gather
    of 64 MiB shards and two streams 181 GB/s; the all_to_all of 64 MiB blocks took 0.632 ms on
    one stream and 1.084 ms on two (NCCL 0.706 ms)."""
    if schedule is None or schedule == "auto":
        schedule = Schedule(comm="dma", order="direct", chunks=1, copy_streams=1)
    schedule = as_schedule(op, schedule, "None, 'auto', a comm='dma' ficco_jax.Schedule or its string form")
    if schedule.comm != "dma":
        raise ValueError(f"{op}: dma.{op} runs comm='dma' schedules only, found {schedule}")
    if schedule.gemm == "columns":
        raise ValueError(f"{op}: dma.{op} moves row chunks; gemm='columns' cuts the output columns of matmul_rs "
                         f"and matmul_psum: use {schedule.replace(gemm='per_chunk')}")
    problem = schedule.problem("ag_matmul", n)  # same transfer rules: ring/direct, stream counts
    if problem is not None:
        raise ValueError(f"{op}: schedule {schedule} is not valid: {problem}")
    if rows % schedule.chunks:
        raise ValueError(
            f"{op}: {rows} rows per block must divide by schedule.chunks={schedule.chunks}; "
            f"{schedule.chunk_hint('ag_matmul', n, rows)}"
        )
    return schedule


def all_to_all_ref(x, axis_name, split_axis, concat_axis, *, tiled=True):
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


def all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=True, schedule=None):
    """``jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)`` on copy engines.

    x.shape[split_axis] is cut into n blocks; block p goes to rank p, and the blocks received
    are concatenated along `concat_axis` in rank order. Any dtype (bytes are moved).
    Differentiable in both modes: the transpose is the all_to_all with the two axes swapped.
    `schedule`: a comm="dma" Schedule (or its string); its chunks cut the first dimension of each
    block, x with x.shape[split_axis] cut by n: x.shape[0] // n for split_axis=0, x.shape[0]
    otherwise. Default: direct, one chunk, one copy stream.
    """
    split_axis, concat_axis, n = _checked("all_to_all", "all_to_all", x, axis_name, tiled, split_axis, concat_axis)
    _check_divides("all_to_all", x, split_axis, n, axis_name, " (the split axis)")
    if schedule == "auto" and not copy_engines_pay(x.nbytes // n, axis_name):
        return all_to_all_ref(x, axis_name, split_axis, concat_axis)
    sched = _collective_schedule("all_to_all", schedule, n, _block_rows(x.shape, split_axis, n))
    return _all_to_all(x, axis_name, split_axis, concat_axis, sched)


def _block_rows(shape, split_axis: int, n: int) -> int:
    """The first dimension of one block once the split axis is at the front (what chunks cut)."""
    rest = list(shape)
    rest[split_axis] //= n
    return rest[0] if len(rest) > 0 else 1


def _to_blocks(x, n: int, split_axis: int):
    """x -> [n, *rest]: block p = the part of x that goes to rank p."""
    shape = x.shape
    split = shape[:split_axis] + (n, shape[split_axis] // n) + shape[split_axis + 1:]
    return jnp.moveaxis(x.reshape(split), split_axis, 0)


def _from_blocks(blocks, concat_axis: int):
    """[n, *rest] -> rest with the blocks concatenated along concat_axis in rank order."""
    moved = jnp.moveaxis(blocks, 0, concat_axis)
    shape = moved.shape
    return moved.reshape(shape[:concat_axis] + (shape[concat_axis] * shape[concat_axis + 1],) + shape[concat_axis + 2:])


def _all_to_all(x, axis_name, split_axis, concat_axis, sched):
    n = axis_size_of(axis_name)
    (received,) = bind("all_to_all", (_to_blocks(x, n, split_axis),), axis_name, n, sched)
    return _from_blocks(received, concat_axis)
