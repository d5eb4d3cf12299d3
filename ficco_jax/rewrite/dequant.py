"""FP8 operands as JAX recipes write them, for the matchers of both views (match_tp.py in
shard_map bodies, match_global.py in explicit-sharding code).

A recipe quantizes a tensor to FP8 with a per-tensor scale and dequantizes it right before the
matmul: ``convert(v8) * scale`` (the scale a scalar, possibly broadcast, cast or marked varying
first). The FP8 ops take v8 and the scale instead, so the matmul runs in FP8 and a gather moves
FP8 bytes. This module finds such operands and says why a candidate is not one.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .. import config
from .jaxpr_util import is_var
from .site import MatchContext, cast_scale

CONVERT, MUL, DOT = "convert_element_type", "mul", "dot_general"
# What a scale may pass through between the scalar and the multiply: shape, dtype and the
# varying-axes type (pvary; pcast in newer jax) change, its value does not.
_SCALE_PASSES = ("broadcast_in_dim", CONVERT, "pvary", "pcast")
_E5M2 = "float8_e5m2"


@dataclasses.dataclass(frozen=True)
class Dequantized:
    """A dot operand the program computes as convert(v8) * scale, with a scalar scale."""

    v8: Any  # the FP8 tensor
    scale: Any  # the scalar the multiply's scale is broadcast or cast from
    dtype: Any  # the dequantized dtype
    eqns: tuple[int, int]  # the convert's and the multiply's equation indices
    # the dtypes the program casts the scalar to on its way to the multiply, first to last: a cast
    # that rounds (an f32 scale cast to bf16, as flax's dequantize writes it) changes its value
    scale_casts: tuple = ()

    def rebuild(self, v8, scale):
        """The dequantization on blocks, written as the recipes write it."""
        return v8.astype(self.dtype) * cast_scale(scale, self.scale_casts).astype(self.dtype)


def _scale_atom(ctx: MatchContext, atom):
    """(The scalar a dequantizing multiply scales by: the value `atom` broadcasts or casts from,
    itself if neither; the dtypes it is cast to on the way, first to last), or None if that is not
    one value."""
    casts = []
    j = ctx.producer(atom)
    while j >= 0 and ctx.eqns[j].primitive.name in _SCALE_PASSES:
        if ctx.eqns[j].primitive.name == CONVERT:
            casts.append(ctx.eqns[j].params["new_dtype"])
        atom = ctx.eqns[j].invars[0]
        j = ctx.producer(atom)
    return (atom, tuple(reversed(casts))) if atom.aval.shape == () else None


def dequantized(ctx: MatchContext, atom) -> Dequantized | None:
    """`atom` as convert(FP8) * scalar, else None."""
    j = ctx.producer(atom)
    if j < 0 or ctx.eqns[j].primitive.name != MUL:
        return None
    mul = ctx.eqns[j]
    for pos in (0, 1):
        c = ctx.producer(mul.invars[pos])
        if c >= 0 and ctx.eqns[c].primitive.name == CONVERT and config.is_fp8(ctx.eqns[c].invars[0].aval.dtype):
            found = _scale_atom(ctx, mul.invars[1 - pos])
            if found is not None:
                scale, casts = found
                return Dequantized(ctx.eqns[c].invars[0], scale, atom.aval.dtype, (c, j), casts)
    return None


def _e5m2_pair(a: Dequantized, b: Dequantized) -> bool:
    return str(a.v8.aval.dtype) == str(b.v8.aval.dtype) == _E5M2


def scaled_operands(ctx: MatchContext, act, w) -> dict:
    """The FP8 fields of a site whose dot multiplies two dequantized FP8 tensors (not both e5m2);
    {} for any other dot, which the op takes as written."""
    a, b = dequantized(ctx, act), dequantized(ctx, w)
    if a is None or b is None or _e5m2_pair(a, b):
        return {}
    return {"fp8_act": a.v8, "fp8_weight": b.v8, "scales": (a.scale, b.scale),
            "scale_casts": (a.scale_casts, b.scale_casts)}


def fp8_dots(ctx: MatchContext, g) -> tuple[list, list[str]]:
    """The matmuls reading FP8 `g` dequantized by a scalar scale, [(dot index, operand position,
    Dequantized)], and why the other convert → multiply → matmul paths from `g` are not such."""
    found, reasons = [], []
    for c, _ in ctx.users.get(g, []):
        if ctx.eqns[c].primitive.name != CONVERT:
            continue
        for m, _ in ctx.users.get(ctx.eqns[c].outvars[0], []):
            for j, pos in ctx.users.get(ctx.eqns[m].outvars[0], []) if ctx.eqns[m].primitive.name == MUL else ():
                if ctx.eqns[j].primitive.name != DOT:
                    continue
                deq = dequantized(ctx, ctx.eqns[j].invars[pos])
                if deq is None or deq.eqns != (c, m):
                    reasons.append(f"eqn {j}: the FP8 gathered tensor's scale is not one scalar; the FP8 ops take "
                                   f"per-tensor scales")
                else:
                    found.append((j, pos, deq))
    return found, reasons


def gather_problem(ctx: MatchContext, deq: Dequantized, w_deq: Dequantized | None, first_use: int) -> str | None:
    """Why the FP8 gathered tensor's dequantization and matmul cannot be taken into the FP8 op,
    where the op runs at `first_use` (the gathered tensor's first reader)."""
    for k in deq.eqns:
        v = ctx.eqns[k].outvars[0]
        if ctx.read_elsewhere(v):
            readers = ctx.readers_text(v) + (", and it is a result of the program" if v in ctx.outputs else "")
            return (f"the dequantized gathered tensor has other users ({readers}); the FP8 op returns the "
                    f"gathered FP8 tensor, not its dequantized form")
    if w_deq is None:
        return "the matmul's other operand is not an FP8 tensor dequantized by a scalar scale"
    if _e5m2_pair(deq, w_deq):
        return "float8_e5m2 x float8_e5m2 matmuls are not supported"
    for atom, what in ((w_deq.v8, "FP8 weight"), (deq.scale, "activation's scale"), (w_deq.scale, "weight's scale")):
        if is_var(atom) and ctx.defined_at[atom] >= first_use:
            return f"the {what} is computed after the gathered tensor's first use"
    return None
