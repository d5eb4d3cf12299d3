"""A batch as the rows of one call: the fold that turns a batch of inputs against one weight into
one operand of a tensor-parallel op or collective, and the reorder that gives the results their
batch back. The bf16 ops fold through it in their batching rule (ops/table.TensorParallel); the
copy-engine primitives, which the FP8 ops and the standalone collectives reach, through theirs
(lowering/dma/registry.py).

A *gather* (all_gather, ag_matmul) delivers the rows of every rank, rank-major; a *scatter*
(psum_scatter, matmul_rs) sums block r of every rank's rows on rank r. Folded, every rank's rows
hold the batch batch-major, so both collectives still move whole blocks:

    gather:   [B, m, ...]    -> [B*m, ...]      result [n*B*m, ...] (rank r: B*m rows) -> [B, n*m, ...]
    scatter:  [B, n*m, ...]  -> [n*B*m, ...]    (block r holds block r of every element)
              result [B*m, ...] -> [B, m, ...]

The gather side folds for free and reorders its result (one transpose); the scatter side reorders
its input and unfolds for free. A schedule whose chunks cut m rows also cuts B*m rows.
"""
from __future__ import annotations

import jax

ROLES = ("gather", "scatter")


def fold_rows(role: str, a: jax.Array, n: int) -> jax.Array:
    """`a` with a leading batch dimension, as one input of a `role` collective over `n` ranks whose
    rows hold the batch."""
    rest = a.shape[2:]
    if role == "gather":  # [B, m, ...] -> [B*m, ...]: this device's rows, batch-major
        return a.reshape(-1, *rest)
    batch, rows = a.shape[:2]  # [B, n*m, ...] -> [n*B*m, ...]
    return a.reshape(batch, n, rows // n, *rest).swapaxes(0, 1).reshape(-1, *rest)


def unfold_rows(role: str, out: jax.Array, batch: int, n: int) -> jax.Array:
    """A result of a `role` collective over `n` ranks on a folded input, with the batch leading again."""
    rest = out.shape[1:]
    if role == "gather":  # [n*B*m, ...], rank-major -> [B, n*m, ...]
        return out.reshape(n, batch, -1, *rest).swapaxes(0, 1).reshape(batch, -1, *rest)
    return out.reshape(batch, -1, *rest)  # [B*m, ...] -> [B, m, ...]
