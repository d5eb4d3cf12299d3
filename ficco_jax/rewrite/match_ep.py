"""The expert-parallel patterns of a `shard_map` body: all_to_all → expert matmul and back.

Two patterns, in the 4-D form a MoE layer under expert parallelism is written in:

- dispatch: ``r = all_to_all(x, axis, split_axis=0, concat_axis=0, tiled=True)`` with x
  [n, E, C, d], feeding ``dot_general(r, w)`` that batches r's dimension 1 (the local experts)
  with one dimension of a 3-D weight and contracts r's dimension 3 (``einsum("pecd,edf->pecf")``
  in any operand order): becomes ``a2a_matmul``. If r has other users, the op also returns it.
- combine: ``dot_general(y, w)`` of the same form, optionally followed by a transpose, whose
  result in the layout [n, E, C, d] is the only input of ``all_to_all(., 0, 0, tiled)``:
  becomes ``matmul_a2a``.

The site writes the dot's own output layout (dispatch) or the all_to_all's output (combine), so
the transposes jnp.einsum adds around its dot_general stay as they were.

Mixed precision as JAX's backward writes it, as in match_tp.py: a matmul of the exchanged f32
cotangent and a bf16 weight takes both operands converted to f32 (the received tokens must
already be f32), and a cast rounding the product to bf16 before the combine's all_to_all is the
op's result dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .. import ops
from ..lowering.xla import narrowing
from .jaxpr_util import fmt, is_var, single_axis, transpose
from .site import (MatchContext, Site, SiteRecord, collective_problem, converted_operands, dot_dtype_problem,
                   moved_dtype_problem)

A2A_MM, MM_A2A = "a2a_matmul", "matmul_a2a"
OPS = (A2A_MM, MM_A2A)
_DOT, _TRANSPOSE, _CONVERT = "dot_general", "transpose", "convert_element_type"
_TOKENS = ("p", "e", "c", "d")  # the all_to_all's layout [n, E, C, d]: peer, expert, capacity, features
_OP_OUT = ["p", "e", "c", "f"]  # the ops' output layout [n, E, C, f]


@dataclasses.dataclass(kw_only=True)
class ExpertSite(Site):
    """An a2a_matmul or matmul_a2a site: tokens [n, E, C, d] and one [E, d, f] weight per expert."""

    op_calls = {A2A_MM: (ops.a2a_matmul, "return_received"), MM_A2A: (ops.matmul_a2a, None)}

    tokens_side: int  # which dot operand holds the [n, E, C, .] tokens (0 lhs, 1 rhs)
    w_dims: tuple[int, int, int]  # the weight's (expert, contracted, free) dimensions
    tokens_labels: tuple[str, ...]  # the tokens operand's dims as p(eer) e(xpert) c(apacity) d(contracted)

    def op_shapes(self):
        """(tokens shape, weight shape) as the op takes them: [n, E, C, d], [E, d, f]."""
        tokens = self.collective.invars[0] if self.op == A2A_MM else self.dot.invars[self.tokens_side]
        w = self.dot.invars[1 - self.tokens_side].aval.shape
        return tuple(tokens.aval.shape), tuple(w[d] for d in self.w_dims)

    def dot_labels(self) -> list[str]:
        """The dot's output dimensions named as the op's: batch e, then lhs free, then rhs free."""
        tokens_free, w_free = [label for label in self.tokens_labels if label in ("p", "c")], ["f"]
        return ["e"] + (tokens_free + w_free if self.tokens_side == 0 else w_free + tokens_free)

    def weight_atom(self):
        return self.dot.invars[1 - self.tokens_side]

    def weight_layout(self):
        """[E, d, f] from the weight's (expert, contracted, free) dims; column-major per expert: [E, f, d]."""
        return tuple(self.w_dims), (0, 2, 1)

    def operands(self, read: Callable):
        tokens = self.collective.invars[0] if self.op == A2A_MM else self.dot.invars[self.tokens_side]
        return read(tokens), transpose(read(self.weight_atom()), self.w_dims)

    def write_outputs(self, out, collective_out, write: Callable) -> None:
        if self.op == MM_A2A:
            write(self.collective.outvars[0], out)
            return
        write(self.dot.outvars[0], transpose(out, [_OP_OUT.index(label) for label in self.dot_labels()]))
        if collective_out is not None:
            write(self.collective.outvars[0], collective_out)


# --------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------
def match_all_to_all(ctx: MatchContext, i: int) -> ExpertSite | SiteRecord:
    """The all_to_all at equation `i` as a dispatch site, else as a combine site, else a near-miss."""
    found = _match_dispatch(ctx, i)
    if isinstance(found, ExpertSite):
        return found
    combine = _match_combine(ctx, i)
    return combine if isinstance(combine, ExpertSite) else _merge_misses(found, combine)


def _merge_misses(dispatch: SiteRecord, combine: SiteRecord) -> SiteRecord:
    """One near-miss per all_to_all: the pattern it came closer to, else both reasons."""
    if dispatch.reason.endswith("not in ops="):
        return combine
    if combine.reason.endswith("not in ops="):
        return dispatch
    if dispatch.reason == combine.reason or combine.reason.startswith("the all_to_all input comes from"):
        return dispatch  # no matmul before it: it was only ever a dispatch candidate
    if dispatch.reason.startswith("the received tokens feed no matmul"):
        return combine
    return dataclasses.replace(dispatch, op=f"{A2A_MM}|{MM_A2A}",
                               reason=f"as dispatch: {dispatch.reason}; as combine: {combine.reason}")


def _a2a_problem(ctx: MatchContext, op: str, eqn) -> str | None:
    params = eqn.params
    problem = ctx.not_enabled(op) or collective_problem(params)
    if problem:
        return problem
    shape = eqn.invars[0].aval.shape
    if len(shape) != 4:
        return f"all_to_all of a {len(shape)}-D tensor; the ops take 4-D per-peer blocks [n, E, C, d]"
    if params["split_axis"] != 0 or params["concat_axis"] != 0:
        return (f"split_axis={params['split_axis']}, concat_axis={params['concat_axis']}; the ops exchange "
                f"the leading peer-block axis (split_axis=concat_axis=0)")
    size = ctx.axis_sizes.get(single_axis(params))
    if size is not None and shape[0] != size:
        return (f"the leading dimension holds {shape[0]} blocks on an axis of {size} devices; the ops take one "
                f"block per peer (reshape it to [{size}, ...] before the all_to_all)")
    return None


def _expert_dot(dot, tokens_pos: int, labels=_TOKENS) -> tuple[tuple[int, int, int] | None, str | None]:
    """The weight's (expert, contracted, free) dims if `dot` is tokens[n,E,C,d] x w -> per-expert matmul.

    `labels` names the tokens operand's dimensions (a transpose may sit between the all_to_all
    and the matmul, as in the backward pass)."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    contract, batch = (lc, rc), (lb, rb)
    w_aval = dot.invars[1 - tokens_pos].aval
    expert_dim, feature_dim = labels.index("e"), labels.index("d")
    if tuple(batch[tokens_pos]) != (expert_dim,) or tuple(contract[tokens_pos]) != (feature_dim,):
        return None, (f"the matmul batches dims {tuple(batch[tokens_pos])} and contracts dims "
                      f"{tuple(contract[tokens_pos])} of the tokens (dims {''.join(labels)} of [n, E, C, d]); "
                      f"expected the experts batched and the features contracted, as einsum('pecd,edf->pecf')")
    if len(w_aval.shape) != 3:
        return None, f"the weight is {len(w_aval.shape)}-D; expected one [E, d, f] matrix per local expert"
    wb, wc = batch[1 - tokens_pos][0], contract[1 - tokens_pos][0]
    wf = next(d for d in range(3) if d not in (wb, wc))
    problem = dot_dtype_problem(dot, convert_operands=True)
    return (None, problem) if problem else ((wb, wc, wf), None)


def _match_dispatch(ctx: MatchContext, i: int) -> ExpertSite | SiteRecord:
    a2a = ctx.eqns[i]
    x, r = a2a.invars[0], a2a.outvars[0]
    shapes = f"x {fmt(x.aval)} all_to_all"
    problem = _a2a_problem(ctx, A2A_MM, a2a)
    if problem:
        return ctx.miss(A2A_MM, i, shapes, problem)
    uses = ctx.users.get(r, [])
    if not uses:
        return ctx.miss(A2A_MM, i, shapes, "the received tokens feed no matmul directly (users: none)")
    first_use = min(k for k, _ in uses)
    reasons = []
    for j, pos, labels, through in _dot_users(ctx, r):
        dot = ctx.eqns[j]
        w_dims, problem = _expert_dot(dot, pos, labels)
        w = dot.invars[1 - pos]
        if problem is None and j in ctx.taken_dots:
            problem = "the matmul is already part of another site"
        problem = (problem or ctx.weight_problem(w, first_use, "received tokens'")
                   or moved_dtype_problem(dot, pos, "received tokens", "all_to_all", "exchange"))
        if problem:
            reasons.append(f"eqn {j}: {problem}")
            continue
        # Through a transpose, the transpose stays (it may have other users) and reads the
        # received tokens, so the op returns them.
        site = ExpertSite(op=A2A_MM, **ctx.axis(a2a), exec_index=first_use, skip=tuple(sorted({i, j})), dot=dot,
                          collective=a2a, tokens_side=pos, w_dims=w_dims, tokens_labels=tuple(labels),
                          returns_collective=ctx.read_elsewhere(r) or through, operand_dtype=converted_operands(dot))
        also = " (received tokens also used elsewhere)" if site.returns_collective else ""
        return ctx.found(site, i, f"{shapes} · w {fmt(w.aval)} -> {fmt(dot.outvars[0].aval)}{also}")
    if reasons:
        return ctx.miss(A2A_MM, i, shapes, "; ".join(reasons))
    return ctx.miss(A2A_MM, i, shapes, f"the received tokens feed no matmul directly ({ctx.readers_text(r)})")


def _dot_users(ctx: MatchContext, r):
    """(eqn, operand position, tokens labels, through a transpose) of every matmul reading r,
    directly or through one transpose."""
    found = []
    for j, pos in ctx.users.get(r, []):
        eqn = ctx.eqns[j]
        if eqn.primitive.name == _DOT:
            found.append((j, pos, _TOKENS, False))
        elif eqn.primitive.name == _TRANSPOSE:
            labels = tuple(_TOKENS[p] for p in eqn.params["permutation"])
            found += [(k, p, labels, True) for k, p in ctx.users.get(eqn.outvars[0], [])
                      if ctx.eqns[k].primitive.name == _DOT]
    return sorted(found)


def _combine_chain(ctx: MatchContext, i: int):
    """(equations from the all_to_all back to its matmul, the transpose's permutation or None,
    the narrowing convert_element_type's index or None, the matmul's index or -1): the all_to_all's
    input, through at most one transpose and one cast that rounds the product (JAX's backward of a
    mixed-precision matmul casts its f32 product to bf16)."""
    chain, perm, cast = [i], None, None
    k = ctx.producer(ctx.eqns[i].invars[0])
    for _ in range(2):
        name = ctx.producer_name(k)
        if name == _TRANSPOSE and perm is None:
            perm = tuple(ctx.eqns[k].params["permutation"])
        elif name == _CONVERT and cast is None and narrowing(ctx.eqns[k].invars[0].aval.dtype,
                                                              ctx.eqns[k].outvars[0].aval.dtype):
            cast = k
        else:
            break
        chain.append(k)
        k = ctx.producer(ctx.eqns[k].invars[0])
    return chain, perm, cast, k



def _match_combine(ctx: MatchContext, i: int) -> ExpertSite | SiteRecord:
    a2a = ctx.eqns[i]
    v = a2a.invars[0]
    shapes = f"y·w {fmt(v.aval)} all_to_all"
    problem = _a2a_problem(ctx, MM_A2A, a2a)
    if problem:
        return ctx.miss(MM_A2A, i, shapes, problem)
    chain, perm, cast, k = _combine_chain(ctx, i)
    if k < 0 or ctx.eqns[k].primitive.name != _DOT:
        return ctx.miss(MM_A2A, i, shapes, f"the all_to_all input comes from {ctx.producer_name(k)}, not from a matmul")
    dot = ctx.eqns[k]
    if any(ctx.read_elsewhere(ctx.eqns[t].outvars[0]) for t in (k, *chain[1:])):
        return ctx.miss(MM_A2A, i, shapes, "the matmul's product has other users, so it is computed anyway")
    if k in ctx.taken_dots:
        return ctx.miss(MM_A2A, i, shapes, "the matmul already consumes an a2a_matmul site (all_to_all→matmul→all_to_all)")
    reasons = []
    for pos in (0, 1):
        if len(dot.invars[pos].aval.shape) != 4:
            continue
        w_dims, problem = _expert_dot(dot, pos)
        if problem:
            reasons.append(problem)
            continue
        site = ExpertSite(op=MM_A2A, **ctx.axis(a2a), exec_index=k, skip=tuple(sorted(chain + [k])), dot=dot,
                          collective=a2a, tokens_side=pos, w_dims=w_dims, tokens_labels=_TOKENS,
                          operand_dtype=converted_operands(dot),
                          rounded_to=None if cast is None else ctx.eqns[cast].outvars[0].aval.dtype)
        layout = site.dot_labels()
        layout = [layout[p] for p in perm] if perm is not None else layout
        if layout != _OP_OUT:
            reasons.append(f"the product reaches the all_to_all in layout {layout}, not [peer, expert, "
                           f"capacity, features]")
        elif not all(is_var(u) for u in dot.invars):
            reasons.append("a matmul operand is a literal")
        else:
            return ctx.found(site, i, f"y {fmt(dot.invars[pos].aval)} · w {fmt(dot.invars[1 - pos].aval)} -> "
                                      f"{fmt(v.aval)} all_to_all")
    return ctx.miss(MM_A2A, i, shapes, "; ".join(reasons) or "no operand of the matmul is 4-D [n, E, C, f]")


# The matcher of each collective primitive this family rewrites.
MATCHERS = {"all_to_all": match_all_to_all}
