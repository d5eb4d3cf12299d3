"""The public ops. Inside `jax.shard_map`, each equals its plain-JAX reference for every schedule:

    ag_matmul(x, w, "tp")   == all_gather(x, "tp", axis=0, tiled=True) @ w
    matmul_rs(y, w, "tp")   == psum_scatter(y @ w, "tp", scatter_dimension=0, tiled=True)
    a2a_matmul(x, w, "ep")  == einsum("pecd,edf->pecf", all_to_all(x, "ep", 0, 0, tiled=True), w)
    matmul_a2a(y, w, "ep")  == all_to_all(einsum("pecf,efd->pecd", y, w), "ep", 0, 0, tiled=True)

Each checks its operands, resolves its `schedule` (ops/resolve.py; "autotune" times candidates with
ops/measure.py) and runs the positional form of the op table (ops/table.py). Every op is
differentiable in both modes: forward mode (jax.jvp, jax.jacfwd) runs the op itself on the
tangents with the same schedule, reverse mode (jax.grad, jax.vjp) runs the other op of its pair,
so the backward pass is overlapped too; the two compose (Hessian-vector products, grad of grad).
"""
from __future__ import annotations

from .core import ScheduleArg
from .measure import time_op
from .table import call, reference


def ag_matmul_ref(x, w, axis_name):
    """The meaning of `ag_matmul`: `all_gather(x, axis_name, axis=0, tiled=True) @ w`."""
    return reference("ag_matmul")(x, w, axis_name)


def matmul_rs_ref(y, w, axis_name):
    """The meaning of `matmul_rs`: `psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`."""
    return reference("matmul_rs")(y, w, axis_name)


def a2a_matmul_ref(x, w, axis_name):
    """The meaning of `a2a_matmul`: ``einsum("pecd,edf->pecf", all_to_all(x, axis_name, 0, 0, tiled), w)``."""
    return reference("a2a_matmul")(x, w, axis_name)


def matmul_a2a_ref(y, w, axis_name):
    """The meaning of `matmul_a2a`: ``all_to_all(einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled)``."""
    return reference("matmul_a2a")(y, w, axis_name)


def ag_matmul(x, w, axis_name: str, *, schedule: ScheduleArg = "auto", return_gathered: bool = False):
    """`all_gather(x, axis_name, axis=0, tiled=True) @ w`, overlapped by a FiCCO schedule.

    Per device: x [m, K], w [K, N] -> [n*m, N] (n = size of `axis_name`). With
    `return_gathered=True` also returns the gathered x [n*m, K], so a caller that needs it gathers
    nothing twice. `schedule` is "auto" (the cost model's pick), "autotune" (measured once, then
    cached), a `Schedule`, or its string form ("dma/direct/c4/s2"). Differentiable in both modes;
    the backward pass is itself overlapped. dtypes: any float; `comm="dma"` takes bf16, f16, f32.
    """
    return call("ag_matmul", x, w, axis_name, schedule, with_side=return_gathered, side_flag="return_gathered",
                measure=time_op)


def matmul_rs(y, w, axis_name: str, *, schedule: ScheduleArg = "auto"):
    """`psum_scatter(y @ w, axis_name, scatter_dimension=0, tiled=True)`, overlapped by a FiCCO schedule.

    Per device: y [M, N], w [N, K] -> [M/n, K] (n = size of `axis_name`; M must divide by n).
    `schedule` as in `ag_matmul`. Differentiable in both modes; the backward pass is itself overlapped.
    """
    return call("matmul_rs", y, w, axis_name, schedule, measure=time_op)


def a2a_matmul(x, w, axis_name: str, *, schedule: ScheduleArg = "auto", return_received: bool = False):
    """``einsum("pecd,edf->pecf", all_to_all(x, axis_name, 0, 0, tiled=True), w)``, overlapped.

    Per device: x [n, E_local, C, d], w [E_local, d, f] -> [n, E_local, C, f] (n = size of
    `axis_name`). With `return_received=True` also returns ``all_to_all(x)`` [n, E_local, C, d]
    (the tokens this device's experts received), so a caller that needs it moves nothing twice.
    `schedule`: "auto", a `Schedule` or its string ("xla/direct/c2", "dma/ring/c4/grouped").
    Differentiable in both modes; the backward pass is itself overlapped. `comm="dma"` takes bf16,
    f16, f32.
    """
    return call("a2a_matmul", x, w, axis_name, schedule, with_side=return_received, side_flag="return_received",
                measure=time_op)


def matmul_a2a(y, w, axis_name: str, *, schedule: ScheduleArg = "auto"):
    """``all_to_all(einsum("pecf,efd->pecd", y, w), axis_name, 0, 0, tiled=True)``, overlapped.

    Per device: y [n, E_local, C, f], w [E_local, f, d] -> [n, E_local, C, d]. `schedule` as in
    `a2a_matmul`. Differentiable in both modes; the backward pass is itself overlapped.
    """
    return call("matmul_a2a", y, w, axis_name, schedule, measure=time_op)
