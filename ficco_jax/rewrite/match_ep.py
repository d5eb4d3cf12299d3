"""Find the expert-parallel all_to_all+matmul sites of a `shard_map` body (see _patterns.py for
the all_gather / psum_scatter ones; transform.py runs both).

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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from .match_tp import (SiteRecord, _MatchContext, _collective_problem, _default_precision, _fmt, _is_var,
                        _single_axis)

A2A_MM, MM_A2A = "a2a_matmul", "matmul_a2a"
_A2A, _DOT, _TRANSPOSE = "all_to_all", "dot_general", "transpose"


@dataclasses.dataclass
class _A2ASite:
    """One all_to_all+matmul site; the same interface as _patterns._Site for transform.py."""

    op: str
    axis_name: str
    axis_size: int
    exec_index: int
    skip: tuple[int, ...]
    dot: Any
    collective: Any
    tokens_side: int  # which dot operand holds the [n, E, C, .] tokens (0 lhs, 1 rhs)
    w_dims: tuple[int, int, int]  # the weight's (expert, contracted, free) dimensions
    tokens_labels: tuple[str, ...]  # the tokens operand's dims as p(eer) e(xpert) c(apacity) d(contracted)
    record: SiteRecord
    schedule: Any = "auto"
    return_received: bool = False
    mesh: Any = None  # as _Site.mesh (a2a sites do not use it yet)

    def op_shapes(self):
        """(tokens shape, weight shape) as the op takes them: [n, E, C, d], [E, d, f]."""
        tokens = self.dot.invars[self.tokens_side].aval.shape if self.op == MM_A2A else self.collective.invars[0].aval.shape
        w = self.dot.invars[1 - self.tokens_side].aval.shape
        return tuple(tokens), tuple(w[d] for d in self.w_dims)

    shapes_2d = op_shapes  # the name transform.py's shared code asks every site for

    def _dot_labels(self) -> list[str]:
        """The dot's output dimensions named as the op's: batch e, then lhs free, then rhs free."""
        tokens_free, w_free = [label for label in self.tokens_labels if label in ("p", "c")], ["f"]
        return ["e"] + (tokens_free + w_free if self.tokens_side == 0 else w_free + tokens_free)

    def run(self, read: Callable, write: Callable, call_op: Callable) -> None:
        w = _transpose(read(self.dot.invars[1 - self.tokens_side]), self.w_dims)
        if self.op == A2A_MM:
            result = call_op(self, read(self.collective.invars[0]), w)
            out, received = result if self.return_received else (result, None)
            perm = [["p", "e", "c", "f"].index(label) for label in self._dot_labels()]
            write(self.dot.outvars[0], _transpose(out, perm))
            if received is not None:
                write(self.collective.outvars[0], received)
        else:
            write(self.collective.outvars[0], call_op(self, read(self.dot.invars[self.tokens_side]), w))


def _transpose(x, perm):
    import jax

    perm = tuple(int(p) for p in perm)
    return x if perm == tuple(range(len(perm))) else jax.lax.transpose(x, perm)


# --------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------
def find_a2a_sites(jaxpr, axis_sizes: dict, where: str, ops: Sequence[str]):
    """Sites and near-misses of the all_to_all patterns in one jaxpr (not its sub-jaxprs)."""
    eqns = jaxpr.eqns
    ctx = _Context.of(jaxpr, axis_sizes, where)
    sites, misses, taken_dots = [], [], set()
    for i, eqn in enumerate(eqns):
        if eqn.primitive.name != _A2A:
            continue
        found = _match_dispatch(ctx, i, A2A_MM in ops, taken_dots)
        if not isinstance(found, _A2ASite):
            combine = _match_combine(ctx, i, MM_A2A in ops, taken_dots)
            found = combine if isinstance(combine, _A2ASite) else _merge_misses(found, combine)
        if isinstance(found, _A2ASite):
            sites.append(found)
            taken_dots.add(eqns.index(found.dot))
        else:
            misses.append(found)
    return sites, misses


# The matching context is the all-gather matcher's own (same fields, same helpers).
_Context = _MatchContext


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


def _a2a_problem(eqn) -> str | None:
    params = eqn.params
    problem = _collective_problem(params)
    if problem:
        return problem
    shape = eqn.invars[0].aval.shape
    if len(shape) != 4:
        return f"all_to_all of a {len(shape)}-D tensor; the ops take 4-D per-peer blocks [n, E, C, d]"
    if params["split_axis"] != 0 or params["concat_axis"] != 0:
        return (f"split_axis={params['split_axis']}, concat_axis={params['concat_axis']}; the ops exchange "
                f"the leading peer-block axis (split_axis=concat_axis=0)")
    return None


_TOKENS = ("p", "e", "c", "d")  # the all_to_all's layout [n, E, C, d]


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
    lhs, rhs = (v.aval for v in dot.invars)
    out = dot.outvars[0].aval
    if not (lhs.dtype == rhs.dtype == out.dtype):
        return None, (f"operand/result dtypes differ ({np.dtype(lhs.dtype).name} x {np.dtype(rhs.dtype).name}"
                      f" -> {np.dtype(out.dtype).name}); the ops compute in the operands' dtype")
    precision = dot.params.get("precision")
    if precision is not None and precision != _default_precision():
        return None, f"explicit precision={precision} differs from the default the ops' matmuls use"
    return (wb, wc, wf), None


def _match_dispatch(ctx: _Context, i: int, enabled: bool, taken_dots: set):
    a2a = ctx.eqns[i]
    x, r = a2a.invars[0], a2a.outvars[0]
    shapes = f"x {_fmt(x.aval)} all_to_all"
    problem = None if enabled else f"{A2A_MM} is not in ops="
    problem = problem or _a2a_problem(a2a)
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
        if problem is None and j in taken_dots:
            problem = "the matmul is already part of another site"
        if problem is None and not _is_var(w):
            problem = "the weight is a literal"
        if problem is None and ctx.defined_at[w] >= first_use:
            problem = "the weight is computed after the received tokens' first use"
        if problem:
            reasons.append(f"eqn {j}: {problem}")
            continue
        # Through a transpose, the transpose stays (it may have other users) and reads the
        # received tokens, so the op returns them.
        site = _A2ASite(A2A_MM, _single_axis(a2a.params), ctx.axis_size(a2a), first_use, tuple(sorted({i, j})),
                        dot, a2a, pos, w_dims, tuple(labels), record=None,  # type: ignore[arg-type]
                        return_received=len(uses) > 1 or r in ctx.outputs or through)
        (tokens, w_shape) = site.op_shapes()
        site.record = SiteRecord(A2A_MM, f"{ctx.where}eqn {i}", site.axis_name,
                                 f"{shapes} · w {_fmt(w.aval)} -> {_fmt(dot.outvars[0].aval)}"
                                 + (" (received tokens also used elsewhere)" if site.return_received else ""),
                                 f"{list(tokens)}·{list(w_shape)}", "")
        return site
    if reasons:
        return ctx.miss(A2A_MM, i, shapes, "; ".join(reasons))
    others = sorted({ctx.eqns[j].primitive.name for j, _ in uses})
    return ctx.miss(A2A_MM, i, shapes, f"the received tokens feed no matmul directly (users: {others or 'none'})")


def _dot_users(ctx: _Context, r):
    """(eqn, operand position, tokens labels, through a transpose) of every matmul reading r,
    directly or through one transpose."""
    found = []
    for j, pos in ctx.users.get(r, []):
        eqn = ctx.eqns[j]
        if eqn.primitive.name == _DOT:
            found.append((j, pos, _TOKENS, False))
        elif eqn.primitive.name == _TRANSPOSE:
            labels = tuple(_TOKENS[p] for p in eqn.params["permutation"])
            found += [(k, p, labels, True) for k, p in ctx.users.get(eqn.outvars[0], []) if ctx.eqns[k].primitive.name == _DOT]
    return sorted(found)


def _match_combine(ctx: _Context, i: int, enabled: bool, taken_dots: set):
    a2a = ctx.eqns[i]
    v = a2a.invars[0]
    shapes = f"y·w {_fmt(v.aval)} all_to_all"
    problem = None if enabled else f"{MM_A2A} is not in ops="
    problem = problem or _a2a_problem(a2a)
    if problem:
        return ctx.miss(MM_A2A, i, shapes, problem)
    chain = [i]
    k = ctx.defined_at.get(v, -1) if _is_var(v) else -1
    perm = None
    if k >= 0 and ctx.eqns[k].primitive.name == _TRANSPOSE:
        perm = tuple(ctx.eqns[k].params["permutation"])
        chain.append(k)
        inner = ctx.eqns[k].invars[0]
        k = ctx.defined_at.get(inner, -1) if _is_var(inner) else -1
    if k < 0 or ctx.eqns[k].primitive.name != _DOT:
        producer = ctx.eqns[k].primitive.name if k >= 0 else "an input of the body"
        return ctx.miss(MM_A2A, i, shapes, f"the all_to_all input comes from {producer}, not from a matmul")
    dot = ctx.eqns[k]
    chain.append(k)
    for var in (dot.outvars[0], *(ctx.eqns[t].outvars[0] for t in chain[1:-1])):
        if len(ctx.users.get(var, [])) != 1 or var in ctx.outputs:
            return ctx.miss(MM_A2A, i, shapes, "the matmul's product has other users, so it is computed anyway")
    if k in taken_dots:
        return ctx.miss(MM_A2A, i, shapes, "the matmul already consumes an a2a_matmul site (all_to_all→matmul→all_to_all)")
    reasons = []
    for pos in (0, 1):
        if len(dot.invars[pos].aval.shape) != 4:
            continue
        w_dims, problem = _expert_dot(dot, pos)
        if problem is None:
            site = _A2ASite(MM_A2A, _single_axis(a2a.params), ctx.axis_size(a2a), k, tuple(sorted(chain)), dot, a2a,
                            pos, w_dims, _TOKENS, record=None)  # type: ignore[arg-type]
            labels = site._dot_labels()
            layout = [labels[p] for p in perm] if perm is not None else labels
            if layout != ["p", "e", "c", "f"]:
                reasons.append(f"the product reaches the all_to_all in layout {layout}, not [peer, expert, "
                               f"capacity, features]")
                continue
            if not all(_is_var(u) for u in dot.invars):
                reasons.append("a matmul operand is a literal")
                continue
            tokens, w_shape = site.op_shapes()
            site.record = SiteRecord(MM_A2A, f"{ctx.where}eqn {i}", site.axis_name,
                                     f"y {_fmt(dot.invars[pos].aval)} · w {_fmt(dot.invars[1 - pos].aval)} -> "
                                     f"{_fmt(v.aval)} all_to_all", f"{list(tokens)}·{list(w_shape)}", "")
            return site
        reasons.append(problem)
    return ctx.miss(MM_A2A, i, shapes, "; ".join(reasons) or "no operand of the matmul is 4-D [n, E, C, f]")
