"""The public ops and their machinery, top to bottom:

  api.py      ag_matmul / matmul_rs / a2a_matmul / matmul_a2a and their references
  measure.py  running one op on local devices to time it (autotune, the benchmark tools)
  table.py    one record per pair of ops (reference, lowering per comm, backward), their forms
  tangents.py the tangent maps of a pair: forward mode runs the op, reverse mode its transpose
  resolve.py  one schedule resolution for every op, topology-aware
  linear.py   the primitive carrying a tangent map (evaluation, transpose, jvp, batching)
  core.py     axis, operand checks, the generic custom-JVP forms
"""
from __future__ import annotations

from .api import (a2a_matmul, a2a_matmul_ref, ag_matmul, ag_matmul_ref, matmul_a2a, matmul_a2a_ref, matmul_rs,
                  matmul_rs_ref)
from .resolve import resolve_schedule

__all__ = ["ag_matmul", "matmul_rs", "a2a_matmul", "matmul_a2a", "ag_matmul_ref", "matmul_rs_ref",
           "a2a_matmul_ref", "matmul_a2a_ref", "resolve_schedule"]
