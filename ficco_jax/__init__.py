"""ficco_jax: finer-grain compute-communication overlap for JAX.

Inside `jax.shard_map`, `ag_matmul` and `matmul_rs` equal `all_gather -> matmul` and
`matmul -> psum_scatter`, run as FiCCO schedules: the collective is cut into sub-shard chunks
that move (on the GPU's copy engines with `comm="dma"`) while the chunk matmuls run.
`overlap(fn)` rewrites those patterns in existing code. See README.md.
"""
from __future__ import annotations

import importlib

from .heuristics import select_schedule
from .a2a import a2a_matmul, a2a_matmul_ref, matmul_a2a, matmul_a2a_ref
from .ops import ag_matmul, ag_matmul_ref, matmul_rs, matmul_rs_ref
from .schedule import Schedule

__version__ = "0.1.0"

__all__ = [
    "Schedule", "ag_matmul", "ag_matmul_ref", "matmul_rs", "matmul_rs_ref", "select_schedule",
    "a2a_matmul", "a2a_matmul_ref", "matmul_a2a", "matmul_a2a_ref",
    "overlap", "explain", "dma", "__version__",
]

# Loaded on first use: `dma` needs the compiled extension, `overlap`/`explain` the jaxpr rewriter.
_LAZY = {"dma": ("ficco_jax.dma", None), "overlap": ("ficco_jax.transform", "overlap"),
         "explain": ("ficco_jax.transform", "explain")}


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'ficco_jax' has no attribute {name!r}")
