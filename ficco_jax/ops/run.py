"""An op of the table by name: checked, its schedule resolved for this call, its positional form run."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .core import ScheduleArg, axis_size, check_operands, check_out_dtype, sums_before_cast
from .resolve import resolve_schedule
from .table import ALL_REDUCE, PAIRS
from .tangents import all_reduce_op, gather_op, gather_op_with_side, scatter_op


def run_scheduled(op: str, a, w, axis_name: str, sched, *, with_side: bool = False, out_dtype=None,
                  w_col_major: bool = False):
    """`op` (a name of the table) with a resolved schedule: out, or (out, side) for a gather op
    with `with_side`; the matmuls' results in `out_dtype` (None: the operands' dtype); copy-engine
    calls read w column-major with `w_col_major` (lowering/dma/registry.py)."""
    sum_first = sums_before_cast()
    if op == ALL_REDUCE.name:
        return all_reduce_op(a, w, axis_name, sched, out_dtype, sum_first, w_col_major)
    pair = PAIRS[op]
    if op == pair.scatter:
        return scatter_op(pair, a, w, axis_name, sched, out_dtype, sum_first, w_col_major)
    return (gather_op_with_side if with_side else gather_op)(pair, a, w, axis_name, sched, out_dtype, sum_first,
                                                             w_col_major)


def call(op: str, a, w, axis_name: str, schedule: ScheduleArg, *, with_side=False, side_flag: str = "",
         measure: Callable | None = None, out_dtype=None, w_col_major=False):
    """`op` as the public functions run it: check the operands, resolve `schedule` for this call
    (`measure` times candidates for "autotune"), run the positional form."""
    n = axis_size(axis_name, op)
    check_operands(op, a, w)
    out_dtype = check_out_dtype(op, out_dtype, a.dtype)
    for name, flag in ((side_flag, with_side), ("w_col_major", w_col_major)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{op}: {name} must be a bool, found {flag!r}")
    sched = resolve_schedule(op, schedule, (a.shape, w.shape), a.dtype, n, axis_name=axis_name, measure=measure,
                             out_dtype=out_dtype)
    return run_scheduled(op, a, w, axis_name, sched, with_side=bool(with_side), out_dtype=out_dtype,
                         w_col_major=bool(w_col_major))
