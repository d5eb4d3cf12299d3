"""``ficco_jax.dma``: the copy-engine collectives and raw overlapped matmuls (public names).

  ``all_gather(x, axis_name, *, axis=0, tiled=True, schedule=None)``
  ``reduce_scatter(x, axis_name, *, scatter_dimension=0, tiled=True, schedule=None)``
  ``all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=True, schedule=None)``
  ``ag_matmul_dma`` / ``matmul_rs_dma`` / ``a2a_matmul_dma`` / ``matmul_a2a_dma`` (raw, no VJP)
  ``check_supported(op, dtype)``, ``available()``, ``cuda_built()``

The implementation lives in ficco_jax/lowering/dma/.
"""
from __future__ import annotations

from .lowering.dma import (__all__, a2a_matmul_dma, ag_matmul_dma, all_gather, all_gather_ref, all_to_all,  # noqa: F401
                           all_to_all_ref, available, check_supported, cuda_built, matmul_a2a_dma, matmul_rs_dma,
                           reduce_scatter, reduce_scatter_ref)
