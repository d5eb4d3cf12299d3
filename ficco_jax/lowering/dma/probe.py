"""The contention probe of `characterize` (xla_ffi/exec/probe.cc): `repeats` matmuls a @ w on XLA's
stream, with or without the copy engines pulling every peer's x meanwhile.

    matmuls_beside_pulls(a, w, x, axis_name, repeats=R, pull=True)  -> a @ w
    (pull=False: the same R matmuls and the same call overhead, no transfers)

The time of pull=True over pull=False is the matmul's slowdown under copy-engine traffic
(copies shorter than the matmuls assumed). Inside `jax.shard_map` under `jax.jit`, like every
copy-engine op; the group along `axis_name` is found when the call is lowered (groups.py).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from ... import config
from . import registry
from .groups import in_process_groups

_TARGET = "ficco_contention_probe"


def _abstract(a, w, x, *, axis_size, out_dtype, **_):
    return [registry.aval(a, (a.shape[0], w.shape[1]), out_dtype),
            registry.aval(x, (axis_size * x.shape[0], *x.shape[1:]))]


def _lowering(ctx, a, w, x, *, axis_name, axis_size, op_id, repeats, pull, timeout_ms, watchdog_ms, out_dtype):
    group = in_process_groups(ctx, "contention_probe", axis_name, axis_size)
    w_col_major = config.is_fp8(ctx.avals_in[0].dtype)  # FP8: as the scaled ops; else as XLA keeps w
    return registry.ffi_call_with_position(
        ctx, _TARGET, (a, w, x), registry.operand_layouts(ctx.avals_in, w_col_major),
        op_id=np.int64(op_id), groups=group["groups"].reshape(-1), devices=group["devices"].reshape(-1),
        group_size=np.int64(axis_size),
        timeout_ms=np.int64(timeout_ms), watchdog_ms=np.int64(watchdog_ms), repeats=np.int64(repeats),
        pull=np.int64(int(pull)), w_col_major=np.int64(int(w_col_major)))


_PRIMITIVE = Primitive(_TARGET)
_PRIMITIVE.multiple_results = True
_PRIMITIVE.def_abstract_eval(_abstract)
mlir.register_lowering(_PRIMITIVE, _lowering)


def matmuls_beside_pulls(a, w, x, axis_name: str, *, repeats: int, pull: bool, out_dtype=None):
    """`a @ w` (computed `repeats` times), while the copy engines all-gather x along `axis_name` if `pull`.

    FP8 a and w (unscaled) measure the FP8 matmul rate; `out_dtype` is then bf16, f16 or f32."""
    registry.check_axis_name("contention_probe", axis_name)
    fp8 = config.is_fp8(a.dtype)
    if (a.dtype != w.dtype and not fp8) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"contention_probe: a and w need one dtype and repeats an int >= 1; found "
                         f"{a.dtype}, {w.dtype}, repeats={repeats!r}")
    out_dtype = np.dtype(out_dtype or ("bfloat16" if fp8 else a.dtype))
    registry.check_supported("ag_matmul", a.dtype, out_dtype)
    a, w, x = registry.match_varying(a, w, x)
    out, _gathered = _PRIMITIVE.bind(
        a, w, x, axis_name=axis_name, axis_size=registry.axis_size_of(axis_name, "contention_probe"),
        op_id=registry.next_op_id(), repeats=repeats, pull=bool(pull),
        timeout_ms=registry.timeout_ms(), watchdog_ms=registry.watchdog_ms(),
        out_dtype=out_dtype)
    return out
