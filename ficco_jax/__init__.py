"""ficco_jax: finer-grain compute-communication overlap for JAX.

Inside `jax.shard_map`, `ag_matmul`, `matmul_rs` and `matmul_psum` equal `all_gather -> matmul`,
`matmul -> psum_scatter` and `matmul -> psum` (`a2a_matmul` / `matmul_a2a` the expert-parallel
all-to-all forms), run as FiCCO schedules: the collective is cut into sub-shard chunks that move
(on the GPU's copy engines with `comm="dma"`) while the chunk matmuls run. `overlap(fn)` rewrites
those patterns in existing code; `explain(fn, *args)` says what it would rewrite. See README.md
and docs/design.md.
"""
from __future__ import annotations

from . import dma
from .ops import (a2a_matmul, a2a_matmul_ref, ag_matmul, ag_matmul_ref, dot_general, matmul_a2a, matmul_a2a_ref,
                  matmul_psum, matmul_psum_ref, matmul_rs, matmul_rs_ref)
from .rewrite import explain, overlap
from .runtime.extension import export_disabled_checks
from .schedule import Schedule
from .tuning.select import select_schedule

__version__ = "0.1.0"

__all__ = [
    "Schedule", "ag_matmul", "ag_matmul_ref", "matmul_rs", "matmul_rs_ref", "matmul_psum", "matmul_psum_ref",
    "select_schedule",
    "a2a_matmul", "a2a_matmul_ref", "matmul_a2a", "matmul_a2a_ref",
    "dot_general", "overlap", "explain", "dma", "export_disabled_checks", "__version__",
]
