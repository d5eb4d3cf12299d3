"""The op table: one class per pair of ops that are each other's transpose.

A pair is a *gather* op (collective -> matmul; its side output is what the collective delivered)
and a *scatter* op (matmul -> collective):

    tensor parallel:  ag_matmul(x, w)  == all_gather(x) @ w                     (side: gathered x)
                      matmul_rs(y, w)  == psum_scatter(y @ w)
    expert parallel:  a2a_matmul(x, w) == einsum("pecd,edf->pecf", all_to_all(x), w)  (side: received x)
                      matmul_a2a(y, w) == all_to_all(einsum("pecf,efd->pecd", y, w))

with all_gather / psum_scatter / all_to_all tiled along dimension 0 (all_to_all split 0, concat 0).
One op is no pair's: `matmul_psum(y, w) == psum(y @ w)` (`AllReduce`), the tensor-parallel scatter
op followed by an all-gather of the reduced rows; its sum is every device's, so its transpose is
two local products and takes no op of a pair.
Each is the other's transpose, so both backward passes are overlapped: the input gradient of the
gather op is the scatter op of the output gradient with w transposed, and its weight gradient a
local product with the side output; the input gradient of the scatter op is the gather op of the
output gradient, whose side output also feeds the weight gradient.

`OpPair` states what a pair provides, in the order a reader follows one op: its reference (a
collective and a local product), its lowerings (comm none / xla in plain JAX, comm dma on copy
engines), its transpose and its weight gradients. The positional forms that bind a pair as
differentiable equations are in ops/tangents.py; ops/run.py runs an op of the table by name.
"""
from __future__ import annotations

import abc
from typing import ClassVar, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ..lowering import batching, dma, xla
from ..schedule import Schedule
from .core import axis_size

#: (x_scale, w_scale): the per-tensor f32 scales of FP8 operands (ops/scaled.py).
Scales = Tuple[jax.Array, jax.Array]
#: The matmuls' result dtype; None for the operands' (ops/core.check_out_dtype).
OutDtype = Optional[jnp.dtype]
Shape = Tuple[int, ...]


class OpPair(abc.ABC):
    """A gather op and a scatter op that are each other's transpose: the parts that differ between
    pairs; the references and the one comm dispatch are written once, from those parts."""

    gather: ClassVar[str]
    scatter: ClassVar[str]
    #: (axis of the scatter op's y, axis of its w) that its matmul contracts.
    contraction: ClassVar[Tuple[int, int]]

    # --- reference: a collective and a local product --------------------------------------------
    @abc.abstractmethod
    def gather_collective(self, x: jax.Array, axis_name: str) -> jax.Array:
        """The gather op's collective in plain JAX: its side output."""

    @abc.abstractmethod
    def scatter_collective(self, partials: jax.Array, axis_name: str) -> jax.Array:
        """The scatter op's collective in plain JAX; also the transpose of `gather_collective`."""

    @abc.abstractmethod
    def gather_local(self, side: jax.Array, w: jax.Array, out_dtype: OutDtype = None) -> jax.Array:
        """The gather op's output from its side output."""

    @abc.abstractmethod
    def scatter_local(self, y: jax.Array, w: jax.Array, out_dtype: OutDtype = None) -> jax.Array:
        """The scatter op's partial products, before its collective."""

    def gather_ref(self, x: jax.Array, w: jax.Array, axis_name: str, out_dtype: OutDtype = None) -> jax.Array:
        """The meaning of the gather op."""
        return self.gather_local(self.gather_collective(x, axis_name), w, out_dtype)

    def scatter_ref(self, y: jax.Array, w: jax.Array, axis_name: str, out_dtype: OutDtype = None) -> jax.Array:
        """The meaning of the scatter op."""
        return self.scatter_collective(self.scatter_local(y, w, out_dtype), axis_name)

    # --- shapes: the equations' abstract values, read without tracing a lowering -----------------
    @abc.abstractmethod
    def gather_shapes(self, x_shape: Shape, w_shape: Shape, n: int) -> Tuple[Shape, Shape]:
        """The shapes of the gather op's (out, side) over `n` devices."""

    @abc.abstractmethod
    def scatter_shape(self, y_shape: Shape, w_shape: Shape, n: int) -> Shape:
        """The shape of the scatter op's output over `n` devices."""

    # --- batching: a batch of inputs against one weight, as one call -----------------------------
    @abc.abstractmethod
    def fold_batch(self, op: str, a: jax.Array, n: int) -> jax.Array:
        """`a` with a leading batch dimension, as one input of `op` whose rows hold the batch."""

    @abc.abstractmethod
    def unfold_batch(self, op: str, out: jax.Array, batch: int, n: int) -> jax.Array:
        """A result of `op` on a folded input, with the batch leading again."""

    @abc.abstractmethod
    def fold_side(self, side: jax.Array, n: int) -> jax.Array:
        """The gather op's side output with a leading batch dimension, laid out as the op on a
        folded input delivers it (the inverse of `unfold_batch` of the gather op)."""

    # --- lowering: comm="none" / "xla", plain JAX (lowering/xla.py) ------------------------------
    @abc.abstractmethod
    def gather_xla(self, x: jax.Array, w: jax.Array, axis_name: str, sched: Schedule, n: int, out_dtype: OutDtype,
                   scales: Optional[Scales] = None) -> Tuple[jax.Array, jax.Array]:
        """(out, side) of the gather op by the steps of `sched` over `n` devices."""

    @abc.abstractmethod
    def scatter_xla(self, y: jax.Array, w: jax.Array, axis_name: str, sched: Schedule, n: int, out_dtype: OutDtype,
                    scales: Optional[Scales] = None) -> jax.Array:
        """The scatter op by the steps of `sched` over `n` devices."""

    # --- lowering: comm="dma", copy engines (lowering/dma/matmul.py) -----------------------------
    # `w_col_major`: the executor reads w column-major (per expert), as a transpose of a stored
    # array is laid out, so XLA hands that array over instead of writing the transpose first.
    @abc.abstractmethod
    def gather_dma(self, x: jax.Array, w: jax.Array, axis_name: str, sched: Schedule, side_needed: bool,
                   out_dtype: OutDtype, scales: Optional[Scales] = None,
                   w_col_major: bool = False) -> Tuple[jax.Array, jax.Array]:
        """(out, side) of the gather op on copy engines; with `side_needed=False` side may be incomplete."""

    @abc.abstractmethod
    def scatter_dma(self, y: jax.Array, w: jax.Array, axis_name: str, sched: Schedule, out_dtype: OutDtype,
                    scales: Optional[Scales] = None, w_col_major: bool = False) -> jax.Array:
        """The scatter op on copy engines."""

    # --- transpose and weight gradients ----------------------------------------------------------
    @abc.abstractmethod
    def transpose_w(self, w: jax.Array) -> jax.Array:
        """The weight of the transposed op: the gather op's input gradient is the scatter op of
        the output gradient with this weight, and the other way round. Its layout is w's with the
        matrix dimensions swapped: the transposed op reads it column-major where w is row-major
        (and row-major where w is itself a transpose), so it is never written out."""

    @abc.abstractmethod
    def gather_dw(self, side: jax.Array, g_out: jax.Array, out_dtype: OutDtype) -> jax.Array:
        """The gather op's weight gradient from its side output and its output's cotangent."""

    @abc.abstractmethod
    def scatter_dw(self, y: jax.Array, g_side: jax.Array, out_dtype: OutDtype) -> jax.Array:
        """The scatter op's weight gradient from its input and its cotangent gathered (the side
        output of the gather op that is its input gradient)."""

    # --- the one comm dispatch -------------------------------------------------------------------
    def gather_impl(self, x: jax.Array, w: jax.Array, axis_name: str, sched: Schedule, out_dtype: OutDtype,
                    side_needed: bool = True, scales: Optional[Scales] = None,
                    w_col_major: bool = False) -> Tuple[jax.Array, jax.Array]:
        """(out, side) of the gather op run by `sched`, on copy engines or in plain JAX (whose dots
        take w in any layout: `w_col_major` is the copy engines' alone)."""
        if sched.comm == "dma":
            return self.gather_dma(x, w, axis_name, sched, side_needed, out_dtype, scales, w_col_major)
        return self.gather_xla(x, w, axis_name, sched, axis_size(axis_name, self.gather), out_dtype, scales)

    def scatter_impl(self, y: jax.Array, w: jax.Array, axis_name: str, sched: Schedule, out_dtype: OutDtype,
                     scales: Optional[Scales] = None, w_col_major: bool = False) -> jax.Array:
        """The scatter op run by `sched`, as `gather_impl`."""
        if sched.comm == "dma":
            return self.scatter_dma(y, w, axis_name, sched, out_dtype, scales, w_col_major)
        return self.scatter_xla(y, w, axis_name, sched, axis_size(axis_name, self.scatter), out_dtype, scales)


class TensorParallel(OpPair):
    """ag_matmul and matmul_rs: rows gathered and scattered along dimension 0; FP8 forms with scales."""

    gather, scatter, contraction = "ag_matmul", "matmul_rs", (1, 0)

    def gather_collective(self, x, axis_name):
        return lax.all_gather(x, axis_name, axis=0, tiled=True)

    def scatter_collective(self, partials, axis_name):
        return lax.psum_scatter(partials, axis_name, scatter_dimension=0, tiled=True)

    def gather_local(self, side, w, out_dtype=None):
        return xla.product(side, w, out_dtype)

    def scatter_local(self, y, w, out_dtype=None):
        return xla.product(y, w, out_dtype)

    def gather_shapes(self, x_shape, w_shape, n):
        rows = n * x_shape[0]
        return (rows, w_shape[1]), (rows, x_shape[1])

    def scatter_shape(self, y_shape, w_shape, n):
        return (y_shape[0] // n, w_shape[1])

    def fold_batch(self, op, a, n):  # the rows hold the batch (lowering/batching.py)
        return batching.fold_rows("gather" if op == self.gather else "scatter", a, n)

    def unfold_batch(self, op, out, batch, n):
        return batching.unfold_rows("gather" if op == self.gather else "scatter", out, batch, n)

    def fold_side(self, side, n):  # [B, n*m, K] -> rank-major [n*B*m, K]: as a scatter input is folded
        return batching.fold_rows("scatter", side, n)

    def gather_xla(self, x, w, axis_name, sched, n, out_dtype, scales=None):
        return xla.ag_matmul(x, w, axis_name, sched, n, out_dtype, scales)

    def scatter_xla(self, y, w, axis_name, sched, n, out_dtype, scales=None):
        return xla.matmul_rs(y, w, axis_name, sched, n, out_dtype, scales)

    def gather_dma(self, x, w, axis_name, sched, side_needed, out_dtype, scales=None, w_col_major=False):
        return dma.ag_matmul_dma(x, w, axis_name, sched, gathered_needed=side_needed, out_dtype=out_dtype,
                                 scales=scales, w_col_major=w_col_major)

    def scatter_dma(self, y, w, axis_name, sched, out_dtype, scales=None, w_col_major=False):
        return dma.matmul_rs_dma(y, w, axis_name, sched, out_dtype=out_dtype, scales=scales, w_col_major=w_col_major)

    def transpose_w(self, w):
        return w.T

    def gather_dw(self, side, g_out, out_dtype):
        return xla.product(side.T, g_out, out_dtype)

    def scatter_dw(self, y, g_side, out_dtype):
        return xla.product(y.T, g_side, out_dtype)


class ExpertParallel(OpPair):
    """a2a_matmul and matmul_a2a: blocks [n, E_local, C, .] exchanged by an all_to_all along
    dimension 0, one matmul per local expert; no FP8 forms (ops/core.check_operands refuses them)."""

    gather, scatter, contraction = "a2a_matmul", "matmul_a2a", (3, 1)

    def gather_collective(self, x, axis_name):
        return lax.all_to_all(x, axis_name, 0, 0, tiled=True)

    def scatter_collective(self, partials, axis_name):
        return lax.all_to_all(partials, axis_name, 0, 0, tiled=True)

    def gather_local(self, side, w, out_dtype=None):
        return xla.einsum("pecd,edf->pecf", side, w, out_dtype)

    def scatter_local(self, y, w, out_dtype=None):
        return xla.einsum("pecf,efd->pecd", y, w, out_dtype)

    def gather_shapes(self, x_shape, w_shape, n):
        return (*x_shape[:3], w_shape[2]), tuple(x_shape)

    def scatter_shape(self, y_shape, w_shape, n):
        return (*y_shape[:3], w_shape[2])

    def fold_batch(self, op, a, n):  # [B, n, E, C, d] -> [n, E, B*C, d]: the batch joins the capacity
        moved = jnp.moveaxis(a, 0, 2)
        return moved.reshape(*moved.shape[:2], -1, moved.shape[-1])

    def unfold_batch(self, op, out, batch, n):  # [n, E, B*C, f] -> [B, n, E, C, f]
        ranks, experts, capacity, cols = out.shape
        return jnp.moveaxis(out.reshape(ranks, experts, batch, capacity // batch, cols), 2, 0)

    def fold_side(self, side, n):  # received tokens: the batch joins the capacity, as for the input
        return self.fold_batch(self.gather, side, n)

    def gather_xla(self, x, w, axis_name, sched, n, out_dtype, scales=None):
        _no_scales(self.gather, scales)
        return xla.a2a_matmul(x, w, axis_name, sched, n, out_dtype)

    def scatter_xla(self, y, w, axis_name, sched, n, out_dtype, scales=None):
        _no_scales(self.scatter, scales)
        return xla.matmul_a2a(y, w, axis_name, sched, n, out_dtype)

    def gather_dma(self, x, w, axis_name, sched, side_needed, out_dtype, scales=None, w_col_major=False):
        _no_scales(self.gather, scales)
        return dma.a2a_matmul_dma(x, w, axis_name, sched, received_needed=side_needed, out_dtype=out_dtype,
                                  w_col_major=w_col_major)

    def scatter_dma(self, y, w, axis_name, sched, out_dtype, scales=None, w_col_major=False):
        _no_scales(self.scatter, scales)
        return dma.matmul_a2a_dma(y, w, axis_name, sched, out_dtype=out_dtype, w_col_major=w_col_major)

    def transpose_w(self, w):
        return jnp.swapaxes(w, 1, 2)

    def gather_dw(self, side, g_out, out_dtype):
        return xla.einsum("pecd,pecf->edf", side, g_out, out_dtype)

    def scatter_dw(self, y, g_side, out_dtype):
        return xla.einsum("pecf,pecd->efd", y, g_side, out_dtype)


class AllReduce:
    """matmul_psum, ``psum(y @ w, axis)``, composed from a tensor-parallel pair: its scatter op by
    the schedule (the partial products reduce-scattered behind the chunk matmuls), then one
    all-gather of the reduced rows by the same comm (copy engines: `dma.all_gather`, direct, one
    chunk; xla: XLA's all-gather, typed invariant as psum's result is). comm "none" is the psum."""

    name: ClassVar[str] = "matmul_psum"

    def __init__(self, pair: TensorParallel):
        self.pair = pair

    def reference(self, y: jax.Array, w: jax.Array, axis_name: str, out_dtype: OutDtype = None) -> jax.Array:
        """The meaning of matmul_psum."""
        return lax.psum(self.pair.scatter_local(y, w, out_dtype), axis_name)

    def shape(self, y_shape: Shape, w_shape: Shape, n: int) -> Shape:
        return (y_shape[0], w_shape[1])

    def impl(self, y: jax.Array, w: jax.Array, axis_name: str, sched: Schedule, out_dtype: OutDtype,
             w_col_major: bool = False) -> jax.Array:
        """matmul_psum run by `sched` (`w_col_major` as in `OpPair.gather_dma`)."""
        if sched.comm == "none":
            return self.reference(y, w, axis_name, out_dtype)
        reduced = self.pair.scatter_impl(y, w, axis_name, sched, out_dtype, w_col_major=w_col_major)
        if sched.comm == "dma":
            return dma.all_gather(reduced, axis_name)
        return lax.all_gather(reduced, axis_name, axis=0, tiled=True, to="invarying")

    def dy(self, ct: jax.Array, w: jax.Array, out_dtype: OutDtype) -> jax.Array:
        """The input gradient from the (replicated) cotangent of the sum: ``ct @ w^T``, local."""
        return self.pair.scatter_local(ct, self.pair.transpose_w(w), out_dtype)

    def dw(self, y: jax.Array, ct: jax.Array, out_dtype: OutDtype) -> jax.Array:
        """The weight gradient: ``y^T @ ct``, local."""
        return self.pair.scatter_dw(y, ct, out_dtype)


def _no_scales(op: str, scales) -> None:
    if scales is not None:
        raise TypeError(f"{op}: has no FP8 form; dequantize the operands first (e.g. x.astype(jnp.bfloat16) * scale)")


TENSOR_PARALLEL = TensorParallel()
EXPERT_PARALLEL = ExpertParallel()

ALL_REDUCE = AllReduce(TENSOR_PARALLEL)

#: op name -> its pair.
PAIRS: dict[str, OpPair] = {name: pair for pair in (TENSOR_PARALLEL, EXPERT_PARALLEL)
                            for name in (pair.gather, pair.scatter)}


def reference(op: str):
    """The plain-JAX meaning of `op`: a function (a, w, axis_name, out_dtype=None) -> out."""
    if op == ALL_REDUCE.name:
        return ALL_REDUCE.reference
    pair = PAIRS[op]
    return pair.gather_ref if op == pair.gather else pair.scatter_ref
