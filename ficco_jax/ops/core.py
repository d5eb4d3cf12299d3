"""What every op shares: its axis, its operand checks, and how cotangents are made to look like their
primals under shard_map."""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from .. import config
from ..schedule import Schedule

ScheduleArg = Union[str, Schedule]

#: The operand names of each op, as its signature and its error messages say them.
OPERAND_NAMES = {"ag_matmul": ("x", "w"), "matmul_rs": ("y", "w"), "a2a_matmul": ("x", "w"), "matmul_a2a": ("y", "w"),
                 "matmul_psum": ("y", "w")}
#: The ops that take FP8 operands (with x_scale= and w_scale=; ops/scaled.py).
FP8_OPS = ("ag_matmul", "matmul_rs")


def axis_size(axis_name, op: str) -> int:
    """The size of mesh axis `axis_name`, which must be bound (inside jax.shard_map)."""
    if not isinstance(axis_name, str):
        raise TypeError(
            f"{op}: axis_name must be one mesh axis name (a str), found {axis_name!r}; "
            f"ops over several mesh axes are not supported yet"
        )
    try:
        return int(lax.axis_size(axis_name))
    except NameError as exc:
        raise ValueError(
            f"{op}: axis {axis_name!r} is not bound here; call {op} inside jax.shard_map over a mesh "
            f"with that axis ({exc})"
        ) from exc


def as_out_dtype(op: str, out_dtype):
    """`out_dtype` (not None) as the numpy dtype of the result: a floating-point dtype, canonical as
    JAX makes it (float64 is float32 while jax_enable_x64 is off, with a warning, as plain JAX)."""
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError as exc:
        raise TypeError(f"{op}: out_dtype must be a dtype such as jnp.float32, found {out_dtype!r}") from exc
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: out_dtype must be a floating-point dtype (e.g. jnp.float32), found {dtype}")
    canonical = jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if canonical != dtype:
        warnings.warn(f"{op}: out_dtype {dtype} is not available while jax_enable_x64 is off; the result is "
                      f"{canonical}, as in plain JAX. Set jax.config.update('jax_enable_x64', True) for {dtype}",
                      stacklevel=5)  # the caller of the public op
    return canonical


def check_out_dtype(op: str, out_dtype, operand_dtype):
    """`out_dtype` as a numpy dtype: None means the operands' dtype; else a floating-point dtype."""
    if out_dtype is None:
        return None
    dtype = as_out_dtype(op, out_dtype)
    return None if dtype == jnp.dtype(operand_dtype) else dtype


def check_arrays(op: str, a, w) -> None:
    """Both operands arrays (anything with a shape and a dtype)."""
    for name, v in zip(OPERAND_NAMES[op], (a, w)):
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise TypeError(
                f"{op}: {name} must be a jax or numpy array, found {type(v).__name__}; wrap it in jnp.asarray"
            )


def check_operands(op: str, a, w) -> None:
    """Both operands arrays of one floating-point dtype, not FP8 (ops/scaled.py takes FP8 pairs)."""
    names = OPERAND_NAMES[op]
    check_arrays(op, a, w)
    for name, v in zip(names, (a, w)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(
                f"{op}: {name} must be a floating-point array, found dtype {v.dtype}; "
                f"cast it, e.g. {name}.astype(jnp.bfloat16)"
            )
    fp8 = [config.is_fp8(v.dtype) for v in (a, w)]
    if op in FP8_OPS and any(fp8) and not all(fp8):
        raise TypeError(one_fp8_operand(op, a, w))
    for name, is_fp8 in zip(names, fp8):
        if is_fp8:
            raise TypeError(
                f"{op}: FP8 operands are taken by {' and '.join(FP8_OPS)} (with x_scale= and w_scale=); {op} takes "
                f"bf16, f16 or f32: dequantize {name} first, e.g. {name}.astype(jnp.bfloat16) * scale"
            )
    if a.dtype != w.dtype:
        raise TypeError(
            f"{op}: {names[0]} and w must have the same dtype, found {a.dtype} and {w.dtype}; "
            f"cast one of them (e.g. w.astype({names[0]}.dtype))"
        )


def one_fp8_operand(op: str, a, w) -> str:
    """The message for an FP8 op (FP8_OPS) called with one FP8 operand and one of another dtype."""
    names, dtypes = OPERAND_NAMES[op], (a.dtype, w.dtype)
    quantized, plain = (0, 1) if config.is_fp8(a.dtype) else (1, 0)
    fp8, fp8_dtype, other = names[quantized], dtypes[quantized], names[plain]
    return (f"{op}: both operands must be FP8 {config.FP8_DTYPES} (with x_scale= and w_scale=) or neither, found "
            f"{names[0]} {a.dtype} and w {w.dtype}; quantize {other} as well (e.g. {other}.astype(jnp.{fp8_dtype}) "
            f"with its scale) or dequantize {fp8} (e.g. {fp8}.astype(jnp.bfloat16) * scale)")


def varying_axes(v) -> frozenset:
    """Mesh axes along which `v` varies inside shard_map (empty outside it, or on old JAX)."""
    return _aval_axes(jax.typeof(v))


def _aval_axes(aval) -> frozenset:
    vma = getattr(aval, "vma", None)  # jax < 0.10
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def without_varying(aval, axis_name: str):
    """`aval` no longer varying over `axis_name` (a sum over it): what psum's result is typed."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and hasattr(mat, "varying"):
        return aval.update(manual_axis_type=mat.update(varying=frozenset(mat.varying) - {axis_name}))
    vma = getattr(aval, "vma", None)  # jax < 0.10
    return aval if vma is None else aval.update(vma=frozenset(vma) - {axis_name})


def like_primal(ct, dtype, primal_axes: frozenset, *, sum_first: bool = True):
    """Cast a cotangent to its primal's dtype and sum it over mesh axes the primal was
    replicated on: what JAX's own AD does when a replicated operand meets a varying one. The
    order matters where the cast rounds (an f32 gradient of a bf16 weight): a shard_map body's
    AD casts first (the cast is the matmul's transpose, the sum the transpose of the broadcast
    before it), the partitioner of global-view code sums first (`sum_first`)."""
    extra = tuple(sorted(varying_axes(ct) - primal_axes))
    if not extra:
        return ct.astype(dtype)
    return lax.psum(ct, extra).astype(dtype) if sum_first else lax.psum(ct.astype(dtype), extra)


def like_aval(ct, aval, *, sum_first: bool = True):
    """`like_primal` for an operand known by its abstract value (a transpose rule's view)."""
    return like_primal(ct, aval.dtype, _aval_axes(aval), sum_first=sum_first)


#: Set while overlap() binds the op of a global-view site: the program it replaces is partitioned
#: by JAX, which sums a mixed-precision backward's f32 partials and then casts the sum, where the
#: AD of a shard_map body casts each partial and sums the casts. The op's backward follows the
#: program it replaces (ops/run.py reads this when the op is called, and it is a static argument of
#: the op from there on).
_PARTITIONER_NUMERICS = contextvars.ContextVar("ficco_partitioner_numerics", default=False)


@contextlib.contextmanager
def partitioner_numerics():
    """Ops bound inside have the backward numerics of JAX's partitioner (sum, then cast)."""
    token = _PARTITIONER_NUMERICS.set(True)
    try:
        yield
    finally:
        _PARTITIONER_NUMERICS.reset(token)


def sums_before_cast() -> bool:
    """Whether an op bound here sums its backward's partials before casting them."""
    return _PARTITIONER_NUMERICS.get()
