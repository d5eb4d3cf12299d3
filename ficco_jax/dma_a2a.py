"""All-to-all on the GPU's copy engines, alone and fused with the expert matmuls (xla_ffi/a2a.h).

Public (reached as ``ficco_jax.dma.all_to_all``):
  ``all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=True, schedule=None)``
Raw fused ops (no VJP; ficco_jax/a2a.py wraps them):
  ``a2a_matmul_dma(x, w, axis_name, schedule) -> (out, received)``
  ``matmul_a2a_dma(y, w, axis_name, schedule) -> out``

Each is one custom call per device, lowered by dma.py's lowering (groups, op id, schedule
attributes); this module only adds the three targets, their abstract evaluation and the
layout of the standalone collective: the split axis is cut into n blocks and moved to the
front, the executor exchanges blocks (block p to rank p, pulling chunk by chunk), and the
received blocks are concatenated along the concat axis in rank order.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import config, dma
from .schedule import Schedule

__all__ = ["all_to_all", "all_to_all_ref", "a2a_matmul_dma", "matmul_a2a_dma"]

_NEW_TARGETS = {
    "all_to_all": "ficco_all_to_all",
    "a2a_matmul": "ficco_a2a_matmul",
    "matmul_a2a": "ficco_matmul_a2a",
}


def _abstract_all_to_all(x, **_):
    return [dma._aval(x, x.shape)]


def _abstract_a2a_matmul(x, w, **_):
    n, e, c, _d = x.shape
    return [dma._aval(x, (n, e, c, w.shape[2])), dma._aval(x, x.shape)]


def _abstract_matmul_a2a(y, w, *, axis_size, **_):
    n, e, c, _f = y.shape
    return [dma._aval(y, (n, e, c, w.shape[2])), dma._aval(y, (max(axis_size - 1, 1), e, c, w.shape[2]))]


dma._TARGETS.update(_NEW_TARGETS)
dma._PRIMITIVES.update({
    "all_to_all": dma._make_primitive("all_to_all", _abstract_all_to_all),
    "a2a_matmul": dma._make_primitive("a2a_matmul", _abstract_a2a_matmul),
    "matmul_a2a": dma._make_primitive("matmul_a2a", _abstract_matmul_a2a),
})


# ------------------------------------------------------------------------------------------------
# Raw fused ops
# ------------------------------------------------------------------------------------------------
def a2a_matmul_dma(x, w, axis_name, schedule: Schedule, *, received_needed: bool = True):
    """``(einsum("pecd,edf->pecf", all_to_all(x), w), all_to_all(x))`` on copy engines.

    x [n, E, C, d], w [E, d, f] per device (all_to_all: split 0, concat 0, tiled). With
    `received_needed=False` this device's own block of `received` is left unwritten (the caller
    drops it; the matmuls read that block from x).
    """
    _check("a2a_matmul", x, w, axis_name)
    out, received = dma._bind("a2a_matmul", (x, w), axis_name, dma._axis_size(axis_name), schedule,
                              skip_own_rows=not received_needed)
    return out, received


def matmul_a2a_dma(y, w, axis_name, schedule: Schedule):
    """``all_to_all(einsum("pecf,efd->pecd", y, w))`` on copy engines. y [n, E, C, f], w [E, f, d]."""
    _check("matmul_a2a", y, w, axis_name)
    out, _send = dma._bind("matmul_a2a", (y, w), axis_name, dma._axis_size(axis_name), schedule)
    return out


def _check(op, a, w, axis_name):
    dma._check_axis_name(op, axis_name)
    if a.dtype != w.dtype:
        raise TypeError(f"{op}: comm='dma' needs both operands in one dtype, found {a.dtype} and {w.dtype}")
    if jnp.dtype(a.dtype).name not in config.DMA_DTYPES:
        raise TypeError(f"{op}: comm='dma' handles dtypes {config.DMA_DTYPES}, found {jnp.dtype(a.dtype).name}; "
                        f"cast the operands or use comm='xla'")


# ------------------------------------------------------------------------------------------------
# Standalone all_to_all
# ------------------------------------------------------------------------------------------------
def all_to_all_ref(x, axis_name, split_axis, concat_axis, *, tiled=True):
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


def all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=True, schedule=None):
    """``jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)`` on copy engines.

    x.shape[split_axis] is cut into n blocks; block p goes to rank p, and the blocks received
    are concatenated along `concat_axis` in rank order. Any dtype (bytes are moved).
    Differentiable: the transpose is the all_to_all with the two axes swapped.
    `schedule`: a comm="dma" Schedule (or its string); its chunks cut the first dimension of a
    block after the split axis is moved to the front (for split_axis=0: x.shape[1]). Default:
    direct, one chunk, as many copy streams as useful.
    """
    dma._check_axis_name("all_to_all", axis_name)
    if not tiled:
        raise NotImplementedError("dma.all_to_all: only tiled=True is supported; use jax.lax.all_to_all")
    ndim = jnp.ndim(x)
    split_axis = dma._normalize_axis("all_to_all", split_axis, ndim)
    concat_axis = dma._normalize_axis("all_to_all", concat_axis, ndim)
    if 0 in x.shape:
        raise ValueError(f"all_to_all: x has an empty dimension, shape {tuple(x.shape)}")
    n = dma._axis_size(axis_name)
    if x.shape[split_axis] % n:
        raise ValueError(
            f"all_to_all: x.shape[{split_axis}]={x.shape[split_axis]} (the split axis) must divide by the "
            f"axis size {n} of {axis_name!r}"
        )
    sched = dma._collective_schedule("all_to_all", schedule, n, _block_rows(x.shape, split_axis, n))
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _all_to_all(x, axis_name, split_axis, concat_axis, sched):
    n = dma._axis_size(axis_name)
    (received,) = dma._bind("all_to_all", (_to_blocks(x, n, split_axis),), axis_name, n, sched)
    return _from_blocks(received, concat_axis)


def _all_to_all_fwd(x, axis_name, split_axis, concat_axis, sched):
    return _all_to_all(x, axis_name, split_axis, concat_axis, sched), None


def _all_to_all_bwd(axis_name, split_axis, concat_axis, sched, _, g):
    # all_to_all is a permutation of blocks; its transpose swaps the split and concat axes.
    n = dma._axis_size(axis_name)
    if _block_rows(g.shape, concat_axis, n) % sched.chunks:
        sched = sched.replace(chunks=1)
    return (_all_to_all(g, axis_name, concat_axis, split_axis, sched),)


_all_to_all.defvjp(_all_to_all_fwd, _all_to_all_bwd)
