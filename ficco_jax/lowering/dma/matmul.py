"""The overlapped matmuls on copy engines, raw: no validation of shapes and no VJP (ficco_jax.ops
adds both). Each is one FFI call per device (registry.bind).

  ``ag_matmul_dma(x, w, axis_name, schedule) -> (out, gathered)``
  ``matmul_rs_dma(y, w, axis_name, schedule) -> out``
  ``a2a_matmul_dma(x, w, axis_name, schedule) -> (out, received)``
  ``matmul_a2a_dma(y, w, axis_name, schedule) -> out``

`out_dtype` is the matmuls' result dtype (None: the operands'; f32 for bf16 or f16 operands is
mixed precision: f32 results, and matmul_rs moves and sums f32 partials). `scales` = (x_scale,
w_scale) makes the TP ops FP8 matmuls: FP8 operands, per-tensor f32 scales, a bf16, f16 or f32
result (registry: the scaled targets). `w_col_major` asks XLA for w column-major (per expert for
the expert ops): where w is the transpose of a stored array, that array's buffer is read as it is
(registry, "w_col_major"); FP8 targets always take w so.
"""
from __future__ import annotations

from ...schedule import Schedule
from . import registry


def _check(op: str, a, w, axis_name, operands: str, scales=None) -> None:
    registry.check_axis_name(op, axis_name)
    # The dtypes the executor handles are checked when the op binds; FP8 operands may differ.
    if a.dtype != w.dtype and scales is None:
        raise TypeError(f"{op}: comm='dma' needs {operands} of one dtype, found {a.dtype} and {w.dtype}")


def _operands(op: str, a, w, scales):
    """(target, operands): the scaled target with its scales appended where `scales` is given."""
    return (op, (a, w)) if scales is None else (f"{op}_scaled", (a, w, *scales))


def ag_matmul_dma(x, w, axis_name, schedule: Schedule, *, gathered_needed: bool = True, out_dtype=None,
                  scales=None, w_col_major: bool = False):
    """``(all_gather(x, axis_name, tiled=True) @ w, all_gather(x, axis_name, tiled=True))`` on copy engines.

    x [m, K], w [K, N] per device -> out [n*m, N], gathered [n*m, K]. With `gathered_needed=False`
    this device's own rows of `gathered` are left unwritten (the caller drops it): one local copy
    of x fewer beside the matmuls.
    """
    _check("ag_matmul", x, w, axis_name, "x and w", scales)
    target, operands = _operands("ag_matmul", x, w, scales)
    out, gathered = registry.bind(target, operands, axis_name, registry.axis_size_of(axis_name), schedule,
                                  skip_own_rows=not gathered_needed, out_dtype=out_dtype, w_col_major=w_col_major)
    return out, gathered


def matmul_rs_dma(y, w, axis_name, schedule: Schedule, *, out_dtype=None, scales=None, w_col_major: bool = False):
    """``psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`` on copy engines.

    y [M, N], w [N, K] per device -> [M/n, K].
    """
    _check("matmul_rs", y, w, axis_name, "y and w", scales)
    target, operands = _operands("matmul_rs", y, w, scales)
    out, _send, _recv = registry.bind(target, operands, axis_name, registry.axis_size_of(axis_name), schedule,
                                      out_dtype=out_dtype, w_col_major=w_col_major)
    return out


def a2a_matmul_dma(x, w, axis_name, schedule: Schedule, *, received_needed: bool = True, out_dtype=None,
                   w_col_major: bool = False):
    """``(einsum("pecd,edf->pecf", all_to_all(x), w), all_to_all(x))`` on copy engines.

    x [n, E, C, d], w [E, d, f] per device (all_to_all: split 0, concat 0, tiled). With
    `received_needed=False` this device's own block of `received` is left unwritten (the caller
    drops it; the matmuls read that block from x).
    """
    _check("a2a_matmul", x, w, axis_name, "both operands")
    out, received = registry.bind("a2a_matmul", (x, w), axis_name, registry.axis_size_of(axis_name), schedule,
                                  skip_own_rows=not received_needed, out_dtype=out_dtype, w_col_major=w_col_major)
    return out, received


def matmul_a2a_dma(y, w, axis_name, schedule: Schedule, *, out_dtype=None, w_col_major: bool = False):
    """``all_to_all(einsum("pecf,efd->pecd", y, w))`` on copy engines. y [n, E, C, f], w [E, f, d]."""
    _check("matmul_a2a", y, w, axis_name, "both operands")
    out, _send = registry.bind("matmul_a2a", (y, w), axis_name, registry.axis_size_of(axis_name), schedule,
                               out_dtype=out_dtype, w_col_major=w_col_major)
    return out
