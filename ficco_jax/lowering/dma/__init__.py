"""comm="dma": copy-engine collectives and overlapped matmuls through the ficco_jax FFI executor.

Everything here runs inside ``jax.shard_map`` under ``jax.jit`` on a ``jax.sharding.Mesh`` whose
groups lie inside this process, or, on GPUs and opt-in (FICCO_CROSS_PROCESS_DMA=1), span the
processes of one host (CUDA IPC, runtime/ipc.py).

  registry.py     every FFI target, its abstract evaluation and primitive; the one lowering rule
  groups.py       which devices a call meets, from the concrete mesh at lowering time
  matmul.py       the raw overlapped matmuls (ficco_jax.ops adds checks and VJPs)
  collectives.py  all_gather / reduce_scatter / all_to_all, differentiable
  probe.py        the contention probe of `characterize`
"""
from __future__ import annotations

from ...runtime.extension import available, cuda_built
from .collectives import all_gather, all_gather_ref, all_to_all, all_to_all_ref, reduce_scatter, reduce_scatter_ref
from .matmul import a2a_matmul_dma, ag_matmul_dma, matmul_a2a_dma, matmul_rs_dma
from .registry import check_supported

__all__ = [
    "all_gather", "reduce_scatter", "all_to_all", "all_gather_ref", "reduce_scatter_ref", "all_to_all_ref",
    "ag_matmul_dma", "matmul_rs_dma", "a2a_matmul_dma", "matmul_a2a_dma", "check_supported", "available",
    "cuda_built",
]
