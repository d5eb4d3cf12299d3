"""The public ops and their machinery, top to bottom:

  partitioned.py  dot_general for Auto-mode (GSPMD/Shardy) code: custom_partitioning, lowered per
              partition to the op the partitioner's shardings imply (partition_plan.py: which op)
  api.py      ag_matmul / matmul_rs / matmul_psum / a2a_matmul / matmul_a2a and their references
  measure.py  running one op on local devices to time it (autotune, the benchmark tools)
  scaled.py   the FP8 forms of the tensor-parallel ops: their tangent maps and positional forms
  run.py      an op by name: checks, schedule resolution, its positional form
  tangents.py the tangent maps of a pair and the positional forms binding them: forward mode
              runs the op, reverse mode its transpose
  linear.py   the primitive carrying a tangent map (evaluation, transpose, jvp, batching)
  table.py    one class per pair of ops: reference, lowering per comm, transpose, weight gradients;
              matmul_psum's record, composed from the tensor-parallel pair
  resolve.py  one schedule resolution for every op, topology-aware
  core.py     axis, operand checks, cotangents shaped like their primals
"""
from __future__ import annotations

from .api import (a2a_matmul, a2a_matmul_ref, ag_matmul, ag_matmul_ref, matmul_a2a, matmul_a2a_ref, matmul_psum,
                  matmul_psum_ref, matmul_rs, matmul_rs_ref)
from .core import partitioner_numerics
from .partitioned import dot_general
from .resolve import on_xla, resolve_schedule

__all__ = ["ag_matmul", "matmul_rs", "matmul_psum", "a2a_matmul", "matmul_a2a", "ag_matmul_ref", "matmul_rs_ref",
           "dot_general", "matmul_psum_ref", "a2a_matmul_ref", "matmul_a2a_ref", "on_xla", "partitioner_numerics",
           "resolve_schedule"]
