"""What every op shares: its axis, its operand checks, and how cotangents are made to look like their
primals under shard_map."""
from __future__ import annotations

import contextlib
import contextvars
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


def check_out_dtype(op: str, out_dtype, operand_dtype):
    """`out_dtype` as a numpy dtype: None means the operands' dtype; else a floating-point dtype."""
    if out_dtype is None:
        return None
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError as exc:
        raise TypeError(f"{op}: out_dtype must be a dtype such as jnp.float32, found {out_dtype!r}") from exc
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: out_dtype must be a floating-point dtype (e.g. jnp.float32), found {dtype}")
    return None if dtype == jnp.dtype(operand_dtype) else dtype


def check_operands(op: str, a, w) -> None:
    """Both operands arrays of one floating-point dtype."""
    names = OPERAND_NAMES[op]
    for name, v in zip(names, (a, w)):
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise TypeError(
                f"{op}: {name} must be a jax or numpy array, found {type(v).__name__}; wrap it in jnp.asarray"
            )
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(
                f"{op}: {name} must be a floating-point array, found dtype {v.dtype}; "
                f"cast it, e.g. {name}.astype(jnp.bfloat16)"
            )
        if config.is_fp8(v.dtype):  # ag_matmul / matmul_rs route FP8 to ops/scaled.py
            raise TypeError(
                f"{op}: FP8 operands are taken by ag_matmul and matmul_rs (with x_scale= and w_scale=); {op} takes "
                f"bf16, f16 or f32: dequantize {name} first, e.g. {name}.astype(jnp.bfloat16) * scale"
            )
    if a.dtype != w.dtype:
        raise TypeError(
            f"{op}: {names[0]} and w must have the same dtype, found {a.dtype} and {w.dtype}; "
            f"cast one of them (e.g. w.astype({names[0]}.dtype))"
        )


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
