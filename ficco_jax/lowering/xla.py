"""Plain-JAX lowering of every `comm="none"` and `comm="xla"` schedule, for every op.

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

The expert-parallel ops:

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

from ..schedule import Schedule



def _shift_perm(n: int, shift: int) -> list[tuple[int, int]]:
    """ppermute pairs sending rank j's value to rank j + shift (mod n)."""
    return [(j, (j + shift) % n) for j in range(n)]


def narrowing(operand_dtype, out_dtype) -> bool:
    """Whether `out_dtype` is a floating dtype with fewer bits than the floating operands' dtype
    (f32 operands, a bf16 result): the matmul then runs in the operands' dtype and its result is
    rounded, ``(a @ w).astype(out)``, which is what ``convert_element_type(dot_general(...))``
    computes in JAX's program."""
    return (out_dtype is not None and all(jnp.issubdtype(d, jnp.floating) for d in (operand_dtype, out_dtype))
            and jnp.finfo(out_dtype).bits < jnp.finfo(operand_dtype).bits)


def product(a: jax.Array, w: jax.Array, out_dtype=None, scales=None) -> jax.Array:
    """The matmul of every TP schedule: ``a @ w`` with its result in `out_dtype` (None: the
    operands' dtype; f32 for bf16 operands is mixed precision: f32 accumulation; a narrower dtype,
    bf16 from f32 operands, is the product in the operands' dtype rounded, as JAX's backward of a
    mixed-precision matmul computes it, see `narrowing`). With `scales` = (a_scale, w_scale)
    the operands are FP8 and the result is ``(a.astype(f32) * a_scale) @ (w.astype(f32) * w_scale)``
    in `out_dtype` (bf16 by default): on GPUs one FP8 dot (XLA's cuBLASLt FP8 matmul, f32
    accumulation) with both scales applied to its result; XLA's CPU backend has no FP8 dot, so
    there the operands are widened first."""
    if scales is None:
        if narrowing(a.dtype, out_dtype):
            return jnp.matmul(a, w).astype(out_dtype)
        return jnp.matmul(a, w, preferred_element_type=out_dtype)
    out, f32 = jnp.dtype(out_dtype or jnp.bfloat16), jnp.float32
    scale = scales[0].astype(f32) * scales[1].astype(f32)

    def fp8_dot(a, w, scale):
        return (jnp.matmul(a, w, preferred_element_type=f32) * scale).astype(out)

    def widened(a, w, scale):
        return (jnp.matmul(a.astype(f32), w.astype(f32), preferred_element_type=f32) * scale).astype(out)

    return lax.platform_dependent(a, w, scale, cpu=widened, default=fp8_dot)


def _matmul_blocks(chunk_list: list[jax.Array], w: jax.Array, gemm: str, mm) -> jax.Array:
    """One shard's rows times w: one matmul per chunk, or one for the whole shard (grouped)."""
    if gemm == "grouped" or len(chunk_list) == 1:
        rows = chunk_list[0] if len(chunk_list) == 1 else jnp.concatenate(chunk_list, axis=0)
        return mm(rows, w)
    return jnp.concatenate([mm(c, w) for c in chunk_list], axis=0)


# ------------------------------------------------------------------------------------------------
# all-gather -> matmul
# ------------------------------------------------------------------------------------------------
def ag_matmul(x: jax.Array, w: jax.Array, axis_name: str, schedule: Schedule, n: int, out_dtype=None,
              scales=None):
    """(all_gather(x, tiled) @ w, all_gather(x, tiled)) by the steps of `schedule`; the matmuls
    are `product(., w, out_dtype, scales)`."""
    def mm(a, b):
        return product(a, b, out_dtype, scales)

    if schedule.comm == "none" or n == 1:
        gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
        return mm(gathered, w), gathered
    idx = lax.axis_index(axis_name)
    m = x.shape[0]
    # (source-rank offset, chunks of that shard) per step; the offset is relative to idx.
    steps = _ag_steps(x, axis_name, schedule, n)
    out = jnp.zeros((n * m, w.shape[1]), dtype=jax.eval_shape(mm, x, w).dtype)
    gathered = jnp.zeros((n * m, x.shape[1]), dtype=x.dtype)
    for offset, rows_at, chunk_list in steps:
        src = (idx + offset) % n
        block = _matmul_blocks(chunk_list, w, schedule.gemm, mm)
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
    chunks = _cut_rows(x, c)
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
def matmul_rs(y: jax.Array, w: jax.Array, axis_name: str, schedule: Schedule, n: int, out_dtype=None,
              scales=None):
    """psum_scatter(y @ w, scatter_dimension=0, tiled) by the steps of `schedule`; the matmuls are
    `product(., w, out_dtype, scales)`, so the partials that move have the product's dtype."""
    def mm(a, b):
        return product(a, b, out_dtype, scales)

    if schedule.comm == "none" or n == 1:
        return lax.psum_scatter(mm(y, w), axis_name, scatter_dimension=0, tiled=True)
    idx = lax.axis_index(axis_name)
    m = y.shape[0] // n
    c = schedule.chunks
    q = m // c
    dtype = jax.eval_shape(mm, y, w).dtype

    def partial(target, j0, j1):
        """Rows [j0*q, j1*q) of `target`'s output block, as this device's partial sum."""
        rows = lax.dynamic_slice_in_dim(y, (target * m + j0 * q).astype(jnp.int32), (j1 - j0) * q, axis=0)
        if schedule.gemm == "grouped" or j1 - j0 == 1:
            return mm(rows, w)
        return jnp.concatenate([mm(rows[k * q:(k + 1) * q], w) for k in range(j1 - j0)])

    if schedule.order == "direct":
        # The sum in f32 at least (a bf16 partial per peer is summed once, not rounded n-1 times),
        # in the partials' own dtype where that is wider (f64 under x64).
        wide = jnp.promote_types(dtype, jnp.float32)
        acc = partial(idx, 0, c).astype(wide)
        for s in range(1, n):
            sent = partial((idx + s) % n, 0, c)
            acc = acc + lax.ppermute(sent, axis_name, _shift_perm(n, s)).astype(wide)
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


# ------------------------------------------------------------------------------------------------
# expert parallel: all-to-all -> expert matmul, expert matmul -> all-to-all
# ------------------------------------------------------------------------------------------------


def _block(a: jax.Array, rank) -> jax.Array:
    """a[rank] for a traced rank."""
    return lax.dynamic_index_in_dim(a, rank.astype(jnp.int32), axis=0, keepdims=False)


def _cut_rows(a: jax.Array, chunks: int) -> list[jax.Array]:
    return _cut(a, chunks, 0)


def _cut(a: jax.Array, chunks: int, axis: int) -> list[jax.Array]:
    """`chunks` equal pieces of `a` along the capacity axis."""
    q = a.shape[axis] // chunks
    return [lax.slice_in_dim(a, j * q, (j + 1) * q, axis=axis) for j in range(chunks)]


def einsum(spec: str, a: jax.Array, b: jax.Array, out_dtype=None) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` with its result in `out_dtype` (None: the operands'; a narrower
    dtype rounds the result, as `product`). XLA's CPU backend has no batched bf16 x bf16 -> f32
    dot, so there the operands are widened first."""
    if out_dtype is None or jnp.dtype(out_dtype) == a.dtype:
        return jnp.einsum(spec, a, b)
    if narrowing(a.dtype, out_dtype):
        return jnp.einsum(spec, a, b).astype(out_dtype)
    return lax.platform_dependent(
        a, b, cpu=lambda a, b: jnp.einsum(spec, a.astype(out_dtype), b.astype(out_dtype)),
        default=lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=out_dtype))


def _expert_matmul(tokens: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """tokens [E, q, d] @ w [E, d, f] -> [E, q, f]: one matmul per local expert, batched."""
    return einsum("ecd,edf->ecf", tokens, w, out_dtype)


def _matmul_chunks(chunk_list: list[jax.Array], w: jax.Array, gemm: str, out_dtype=None) -> list[jax.Array]:
    """One matmul per chunk, or one for the whole block (grouped) cut back into the same chunks."""
    if gemm == "grouped" and len(chunk_list) > 1:
        return _cut(_expert_matmul(jnp.concatenate(chunk_list, axis=1), w, out_dtype), len(chunk_list), axis=1)
    return [_expert_matmul(ch, w, out_dtype) for ch in chunk_list]


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
def a2a_matmul(x, w, axis_name: str, schedule: Schedule, n: int, out_dtype=None):
    """(einsum("pecd,edf->pecf", all_to_all(x), w), all_to_all(x)) by the steps of `schedule`,
    the matmuls' results in `out_dtype` (None: the operands')."""
    if schedule.comm == "none" or n == 1:
        received = lax.all_to_all(x, axis_name, 0, 0, tiled=True)
        return einsum("pecd,edf->pecf", received, w, out_dtype), received
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
    out_by_shift = [jnp.concatenate(_matmul_chunks(chs, w, schedule.gemm, out_dtype), axis=1) for chs in recv_by_shift]
    received = [jnp.concatenate(chs, axis=1) for chs in recv_by_shift]
    return _in_rank_order(out_by_shift, idx), _in_rank_order(received, idx)


# ------------------------------------------------------------------------------------------------
# combine: expert matmuls -> all_to_all
# ------------------------------------------------------------------------------------------------
def matmul_a2a(y, w, axis_name: str, schedule: Schedule, n: int, out_dtype=None):
    """all_to_all(einsum("pecf,efd->pecd", y, w)) by the steps of `schedule`, the matmuls' results
    (what moves) in `out_dtype` (None: the operands')."""
    if schedule.comm == "none" or n == 1:
        out = einsum("pecf,efd->pecd", y, w, out_dtype)
        return lax.all_to_all(out, axis_name, 0, 0, tiled=True)
    idx = lax.axis_index(axis_name)
    c = schedule.chunks

    def results_for(rank):
        """Our experts' outputs for the tokens `rank` sent us, chunk by chunk."""
        return _matmul_chunks(_cut(_block(y, rank), c, axis=1), w, schedule.gemm, out_dtype)

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
