"""`overlap(fn)` and `explain(fn, *args)`: find all-gather -> matmul, matmul -> reduce-scatter and
all-to-all <-> expert-matmul sites in a function's jaxpr (shard_map bodies, and the bodies nested
in them; global-view code with explicit shardings) and rewrite them into the ficco_jax ops."""
from __future__ import annotations

from .site import SiteRecord
from .overlap import Report, explain, overlap

__all__ = ["overlap", "explain", "Report", "SiteRecord"]
