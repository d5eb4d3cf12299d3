"""Plain-JAX lowering of every `comm="none"` and `comm="xla"` schedule.

These run anywhere JAX runs (CPU, GPU, several hosts): the chunked steps are `ppermute`s that XLA
lowers to its own collectives (NCCL on GPUs), and the chunk matmuls are ordinary dots issued in
the schedule's order, so XLA's scheduler can overlap step s's transfer with step s-1's matmul.
This is also ficco_jax's multi-node path.

Naming: n devices on the axis, this device's rank `idx`, m rows per shard (ag) or per output
block (rs), c chunks per shard, q = m / c rows per chunk.

    ring, ag (shards move right; at step s this device holds the shard of rank idx - s):

        step:      0            1              ...   n-1
        transfer:  -> send c0..c(c-1) to idx+1  (chunk j of step s+1 travels while
        matmul:    own c0..   (idx-1) c0..            chunk j+1 of step s multiplies)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .schedule import Schedule


def _shift_perm(n: int, shift: int) -> list[tuple[int, int]]:
    """ppermute pairs sending rank j's value to rank j + shift (mod n)."""
    return [(j, (j + shift) % n) for j in range(n)]


def _chunk_rows(a: jax.Array, chunks: int) -> list[jax.Array]:
    q = a.shape[0] // chunks
    return [a[j * q:(j + 1) * q] for j in range(chunks)]


def _matmul_blocks(chunk_list: list[jax.Array], w: jax.Array, gemm: str) -> jax.Array:
    """One shard's rows times w: one matmul per chunk, or one for the whole shard (grouped)."""
    if gemm == "grouped" or len(chunk_list) == 1:
        rows = chunk_list[0] if len(chunk_list) == 1 else jnp.concatenate(chunk_list, axis=0)
        return rows @ w
    return jnp.concatenate([c @ w for c in chunk_list], axis=0)


# ------------------------------------------------------------------------------------------------
# all-gather -> matmul
# ------------------------------------------------------------------------------------------------
def ag_matmul(x: jax.Array, w: jax.Array, axis_name: str, schedule: Schedule, n: int):
    """(all_gather(x, tiled) @ w, all_gather(x, tiled)) by the steps of `schedule`."""
    if schedule.comm == "none" or n == 1:
        gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
        return gathered @ w, gathered
    idx = lax.axis_index(axis_name)
    m = x.shape[0]
    # (source-rank offset, chunks of that shard) per step; the offset is relative to idx.
    steps = _ag_steps(x, axis_name, schedule, n)
    out = jnp.zeros((n * m, w.shape[1]), dtype=_result_dtype(x, w))
    gathered = jnp.zeros((n * m, x.shape[1]), dtype=x.dtype)
    for offset, rows_at, chunk_list in steps:
        src = (idx + offset) % n
        block = _matmul_blocks(chunk_list, w, schedule.gemm)
        # int32 throughout: with jax_enable_x64 a Python int would become int64 beside the int32
        # axis index, and dynamic_update_slice wants one index type.
        start = (src * m + rows_at).astype(jnp.int32)
        zero = jnp.int32(0)
        out = lax.dynamic_update_slice(out, block.astype(out.dtype), (start, zero))
        gathered = lax.dynamic_update_slice(gathered, jnp.concatenate(chunk_list, axis=0), (start, zero))
    return out, gathered


def _ag_steps(x, axis_name, schedule: Schedule, n: int):
    """Yield (source offset, first row inside the shard, chunks) in the order the matmuls run."""
    c = schedule.chunks
    chunks = _chunk_rows(x, c)
    q = x.shape[0] // c
    steps = [(0, 0, chunks)]
    if schedule.order == "direct":
        # Every peer's shard at once: n - 1 independent permutes, one per distance.
        for s in range(1, n):
            received = [lax.ppermute(ch, axis_name, _shift_perm(n, s)) for ch in chunks]
            steps.append((-s, 0, received))
        return steps
    if schedule.order == "ring":
        cur = chunks
        for s in range(1, n):
            cur = [lax.ppermute(ch, axis_name, _shift_perm(n, 1)) for ch in cur]
            steps.append((-s, 0, cur))
        return steps
    # bidirectional: the first half of the chunks travel right, the second half left.
    half = c // 2
    right, left = chunks[:half], chunks[half:]
    for s in range(1, n):
        right = [lax.ppermute(ch, axis_name, _shift_perm(n, 1)) for ch in right]
        left = [lax.ppermute(ch, axis_name, _shift_perm(n, -1)) for ch in left]
        steps.append((-s, 0, right))
        steps.append((s, half * q, left))
    return steps


# ------------------------------------------------------------------------------------------------
# matmul -> reduce-scatter
# ------------------------------------------------------------------------------------------------
def matmul_rs(y: jax.Array, w: jax.Array, axis_name: str, schedule: Schedule, n: int):
    """psum_scatter(y @ w, scatter_dimension=0, tiled) by the steps of `schedule`."""
    if schedule.comm == "none" or n == 1:
        return lax.psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)
    idx = lax.axis_index(axis_name)
    m = y.shape[0] // n
    c = schedule.chunks
    q = m // c
    dtype = _result_dtype(y, w)

    def partial(target, j0, j1):
        """Rows [j0*q, j1*q) of `target`'s output block, as this device's partial sum."""
        rows = lax.dynamic_slice_in_dim(y, (target * m + j0 * q).astype(jnp.int32), (j1 - j0) * q, axis=0)
        if schedule.gemm == "grouped" or j1 - j0 == 1:
            return (rows @ w).astype(dtype)
        return jnp.concatenate([(rows[k * q:(k + 1) * q] @ w).astype(dtype) for k in range(j1 - j0)])

    if schedule.order == "direct":
        acc = partial(idx, 0, c).astype(jnp.float32)
        for s in range(1, n):
            sent = partial((idx + s) % n, 0, c)
            acc = acc + lax.ppermute(sent, axis_name, _shift_perm(n, s)).astype(jnp.float32)
        return acc.astype(dtype)
    if schedule.order == "ring":
        return _rs_chain(partial, idx, n, 0, c, direction=-1, axis_name=axis_name)
    half = c // 2
    left = _rs_chain(partial, idx, n, 0, half, direction=-1, axis_name=axis_name)
    right = _rs_chain(partial, idx, n, half, c, direction=+1, axis_name=axis_name)
    return jnp.concatenate([left, right], axis=0)


def _rs_chain(partial, idx, n, j0, j1, *, direction, axis_name):
    """Accumulate chunks [j0, j1) of the output block along a ring moving in `direction`.

    The partial sum travels `direction` each step and picks up the next device's contribution;
    at step i this device adds its partial for the rank the sum ends at, idx - direction*(i+1),
    so after n - 1 hops the sum arrives complete at its owner.
    """
    acc = None
    for i in range(n):
        target = (idx - direction * (i + 1)) % n
        part = partial(target, j0, j1)
        acc = part if acc is None else acc + part
        if i < n - 1:
            acc = lax.ppermute(acc, axis_name, _shift_perm(n, direction))
    return acc


def _result_dtype(a, w):
    return jnp.result_type(a.dtype, w.dtype)
