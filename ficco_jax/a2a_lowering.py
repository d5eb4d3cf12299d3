"""Plain-JAX lowering of every `comm="none"` / `comm="xla"` schedule of the expert-parallel ops.

    a2a_matmul (dispatch):  out = einsum("pecd,edf->pecf", all_to_all(x), w)
    matmul_a2a (combine):   out = all_to_all(einsum("pecf,efd->pecd", y, w))

with ``all_to_all = lax.all_to_all(., axis_name, 0, 0, tiled=True)``: block p of the input goes to
rank p, and block p of the result came from rank p. The per-peer blocks move as ``ppermute``s
(NCCL on GPUs, also across hosts); chunks cut the capacity C of every block, so every chunk
matmul is one batched matmul over the local experts, [E, q, d] @ [E, d, f].

Naming: n ranks, this rank `idx`, shift s: the block exchanged with ranks idx ± s. Results are
first collected "by shift" (entry s = the block of rank idx - s) and put in rank order at the end.

``direct`` (n - 1 independent exchanges, one per shift; every link of an NVSwitch node at once):

    dispatch:  recv[s] = ppermute(x[idx + s], shift s);  out[idx - s] = recv[s] @ w  as it lands
    combine:   z = y[idx + s] @ w;  out[idx - s] = ppermute(z, shift s)   (shift 1 computed first)

``ring`` (neighbour steps only: the multi-host / ring-topology variant; n(n-1)/2 blocks per
device cross one link instead of n - 1 crossing n - 1 links):

    dispatch:  rank idx sends its blocks for idx+1 .. idx+n-1 to idx+1 as one bundle; each rank
               keeps the first block of the bundle it receives (it is addressed to it) and
               forwards the rest, so at step s the block of rank idx - s lands (one per step).
    combine:   the transpose: at step s each rank computes its block for idx - s (farthest
               first), prepends it to the bundle it received and passes the bundle on; after
               n - 1 steps the bundle holding every peer's block for idx has arrived.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .schedule import Schedule


def _shift_perm(n: int, shift: int) -> list[tuple[int, int]]:
    """ppermute pairs sending rank j's value to rank j + shift (mod n)."""
    return [(j, (j + shift) % n) for j in range(n)]


def _block(a: jax.Array, rank) -> jax.Array:
    """a[rank] for a traced rank."""
    return lax.dynamic_index_in_dim(a, rank.astype(jnp.int32), axis=0, keepdims=False)


def _cut(a: jax.Array, chunks: int, axis: int) -> list[jax.Array]:
    """`chunks` equal pieces of `a` along the capacity axis."""
    q = a.shape[axis] // chunks
    return [lax.slice_in_dim(a, j * q, (j + 1) * q, axis=axis) for j in range(chunks)]


def _expert_matmul(tokens: jax.Array, w: jax.Array) -> jax.Array:
    """tokens [E, q, d] @ w [E, d, f] -> [E, q, f]: one matmul per local expert, batched."""
    return jnp.einsum("ecd,edf->ecf", tokens, w)


def _matmul_chunks(chunk_list: list[jax.Array], w: jax.Array, gemm: str) -> list[jax.Array]:
    """One matmul per chunk, or one for the whole block (grouped) cut back into the same chunks."""
    if gemm == "grouped" and len(chunk_list) > 1:
        return _cut(_expert_matmul(jnp.concatenate(chunk_list, axis=1), w), len(chunk_list), axis=1)
    return [_expert_matmul(ch, w) for ch in chunk_list]


def _in_rank_order(by_shift: list[jax.Array], idx) -> jax.Array:
    """Stack blocks indexed by shift (entry s from rank idx - s) into rank order."""
    n = len(by_shift)
    ranks_to_shift = (idx - jnp.arange(n, dtype=jnp.int32)) % n
    return jnp.take(jnp.stack(by_shift), ranks_to_shift, axis=0)


def _blocks_from(a: jax.Array, idx, first_shift: int, n: int) -> jax.Array:
    """[a[idx + first_shift], ..., a[idx + n - 1]] (rank order mod n) as one array."""
    shifts = jnp.arange(first_shift, n, dtype=jnp.int32)
    return jnp.take(a, (idx + shifts) % n, axis=0)


# ------------------------------------------------------------------------------------------------
# dispatch: all_to_all -> expert matmuls
# ------------------------------------------------------------------------------------------------
def a2a_matmul(x, w, axis_name: str, schedule: Schedule, n: int):
    """(einsum("pecd,edf->pecf", all_to_all(x), w), all_to_all(x)) by the steps of `schedule`."""
    if schedule.comm == "none" or n == 1:
        received = lax.all_to_all(x, axis_name, 0, 0, tiled=True)
        return jnp.einsum("pecd,edf->pecf", received, w), received
    idx = lax.axis_index(axis_name)
    c = schedule.chunks
    recv_by_shift = [_cut(_block(x, idx), c, axis=1)]  # shift 0: our own tokens for our experts
    if schedule.order == "direct":
        for s in range(1, n):
            sent = _cut(_block(x, (idx + s) % n), c, axis=1)
            recv_by_shift.append([lax.ppermute(ch, axis_name, _shift_perm(n, s)) for ch in sent])
    else:  # ring: one bundle per chunk, shrinking by one block per hop
        bundles = _cut(_blocks_from(x, idx, 1, n), c, axis=2)
        for _ in range(1, n):
            bundles = [lax.ppermute(b, axis_name, _shift_perm(n, 1)) for b in bundles]
            recv_by_shift.append([b[0] for b in bundles])
            bundles = [b[1:] for b in bundles]
    out_by_shift = [jnp.concatenate(_matmul_chunks(chs, w, schedule.gemm), axis=1) for chs in recv_by_shift]
    received = [jnp.concatenate(chs, axis=1) for chs in recv_by_shift]
    return _in_rank_order(out_by_shift, idx), _in_rank_order(received, idx)


# ------------------------------------------------------------------------------------------------
# combine: expert matmuls -> all_to_all
# ------------------------------------------------------------------------------------------------
def matmul_a2a(y, w, axis_name: str, schedule: Schedule, n: int):
    """all_to_all(einsum("pecf,efd->pecd", y, w)) by the steps of `schedule`."""
    if schedule.comm == "none" or n == 1:
        return lax.all_to_all(jnp.einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled=True)
    idx = lax.axis_index(axis_name)
    c = schedule.chunks

    def results_for(rank):
        """Our experts' outputs for the tokens `rank` sent us, chunk by chunk."""
        return _matmul_chunks(_cut(_block(y, rank), c, axis=1), w, schedule.gemm)

    out_by_shift = [None] * n
    if schedule.order == "direct":
        for s in range(1, n):  # the nearest peer's block first, as matmul_rs does
            sent = results_for((idx + s) % n)
            out_by_shift[s] = jnp.concatenate(
                [lax.ppermute(z, axis_name, _shift_perm(n, s)) for z in sent], axis=1)
    else:  # ring: the bundle at step s is addressed to idx + n - s; entry k came from idx - k
        bundles = None
        for s in range(1, n):
            fresh = [z[None] for z in results_for((idx + n - s) % n)]
            bundles = fresh if bundles is None else [jnp.concatenate([f, b]) for f, b in zip(fresh, bundles)]
            bundles = [lax.ppermute(b, axis_name, _shift_perm(n, 1)) for b in bundles]
        for k in range(n - 1):  # after the last hop entry k came from rank idx - 1 - k
            out_by_shift[k + 1] = jnp.concatenate([b[k] for b in bundles], axis=1)
    out_by_shift[0] = jnp.concatenate(results_for(idx), axis=1)  # own block last: nobody waits for it
    return _in_rank_order(out_by_shift, idx)
