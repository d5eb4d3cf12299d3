"""Find the collective+matmul sites of a `shard_map` body and rebuild them as ficco_jax ops.

Two patterns are recognised in a body's jaxpr (the body of a `shard_map`, or a scan / cond /
while / jit / checkpoint body nested inside one):

- ``all_gather(x, tiled) → dot_general`` where the gathered dimension is a free (row) dimension of
  the matmul: becomes ``ag_matmul``. If the gathered tensor has other users (other matmuls, the
  residuals of a backward pass), the op also returns it, so nothing is gathered twice.
- ``dot_general → psum_scatter(tiled)`` where the scattered dimension is a free dimension of one
  operand and the product has no other user: becomes ``matmul_rs``.

The ops take 2-D operands, so each site is canonicalised: the activation's gathered (scattered)
dimension goes first, its other free dimensions are flattened into rows after it, its contracted
dimensions into K; the weight becomes [K, N]. The device index of a tiled gather/scatter is the
outermost part of the gathered dimension, so keeping that dimension first keeps the device blocks
of the 2-D rows contiguous: for x[b, s, d] gathered on s, rows = (s, b), and the tiled 2-D gather
of [s·b, d] concatenates the devices' [s·b] blocks, i.e. gathers s. The result is reshaped to
[n·s, b, N] and transposed back to the dot's own output order.

Everything not matched is reported as a near-miss with the reason, and left as written.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jex
import numpy as np

AG, RS = "ag_matmul", "matmul_rs"
_GATHER = "all_gather"
_SCATTER = ("reduce_scatter", "psum_scatter")
_DOT = "dot_general"


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """One collective next to a matmul: rewritten (``reason == ""``) or a near-miss."""

    op: str  # "ag_matmul" | "matmul_rs"
    where: str  # path of the equation: "shard_map@0/scan@2/eqn 5"
    axis_name: str
    shapes: str  # the site as written: "x float32[2,16,32] gathered dim 1 · w float32[32,16]"
    matmul_2d: str  # the canonical 2-D operands handed to the op, "" for near-misses
    schedule: str  # the schedule chosen, "" for near-misses
    reason: str = ""  # why it was not rewritten, "" if it was

    @property
    def rewritten(self) -> bool:
        return not self.reason


def _fmt(aval) -> str:
    return f"{np.dtype(aval.dtype).name}[{','.join(str(d) for d in aval.shape)}]"


def _is_var(atom) -> bool:
    return not isinstance(atom, jex.Literal)


def _single_axis(params) -> str | None:
    names = params["axis_name"]
    names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
    return names[0] if len(names) == 1 else None


def _collective_problem(params, tiled_key="tiled") -> str | None:
    if not params.get(tiled_key, False):
        return "untiled collective (adds or removes an axis); only tiled=True maps onto the ops"
    if params.get("axis_index_groups") is not None:
        return "axis_index_groups is set; the ops work on a whole mesh axis"
    if _single_axis(params) is None:
        return f"collective over several mesh axes {params['axis_name']}; the ops take one axis"
    return None


def _dot_problem(dot) -> str | None:
    """Why this dot_general cannot become a 2-D op matmul, whatever its collective."""
    (_, _), (lb, rb) = dot.params["dimension_numbers"]
    if lb or rb:
        return "matmul has batch dimensions (e.g. per-head weights); the ops take 2-D weights"
    lhs, rhs = (v.aval for v in dot.invars)
    out = dot.outvars[0].aval
    if not (lhs.dtype == rhs.dtype == out.dtype):
        return (f"operand/result dtypes differ ({np.dtype(lhs.dtype).name} x {np.dtype(rhs.dtype).name}"
                f" -> {np.dtype(out.dtype).name}); the ops compute in the operands' dtype")
    precision = dot.params.get("precision")
    if precision is not None and precision != _default_precision():
        return f"explicit precision={precision} differs from the default the ops' matmuls use"
    if dot.invars[0] is dot.invars[1]:
        return "both matmul operands are the same tensor"
    return None


def _default_precision():
    """The precision a matmul written without one gets now (jax_default_matmul_precision applies)."""
    one = jax.ShapeDtypeStruct((1, 1), np.float32)
    return jax.make_jaxpr(jax.lax.dot)(one, one).eqns[0].params.get("precision")


def _free_dims(ndim: int, contracting: Sequence[int]) -> list[int]:
    return [d for d in range(ndim) if d not in contracting]


# --------------------------------------------------------------------------------------------
# The two site kinds: where they run, and how they rebuild their outputs
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Site:
    op: str
    axis_name: str
    axis_size: int
    exec_index: int  # the equation index at which the fused op runs
    skip: tuple[int, ...]  # equations it replaces
    act_side: int  # which dot operand is the activation (0 lhs, 1 rhs)
    act_dim: int  # gathered / scattered dimension of the activation
    dot: Any
    collective: Any
    record: SiteRecord
    schedule: Any = "auto"
    return_gathered: bool = False
    mesh: Any = None  # the enclosing shard_map's concrete mesh, where it has one (locates the peers)

    # the 2-D layout -------------------------------------------------------------------------
    def _layout(self):
        (lc, rc), _ = self.dot.params["dimension_numbers"]
        contract = (tuple(lc), tuple(rc))
        act_aval = self.dot.invars[self.act_side].aval if self.op == RS else self.collective.invars[0].aval
        w_aval = self.dot.invars[1 - self.act_side].aval
        ca, cw = contract[self.act_side], contract[1 - self.act_side]
        fa = [d for d in _free_dims(len(act_aval.shape), ca) if d != self.act_dim]
        fw = _free_dims(len(w_aval.shape), cw)
        return act_aval.shape, w_aval.shape, list(ca), list(cw), fa, fw

    def shapes_2d(self) -> tuple[tuple[int, int], tuple[int, int]]:
        a_shape, w_shape, ca, cw, fa, fw = self._layout()
        rows = a_shape[self.act_dim] * math.prod(a_shape[d] for d in fa)
        k = math.prod(a_shape[d] for d in ca)
        return (rows, k), (k, math.prod(w_shape[d] for d in fw))

    def _out_perm(self, fa, fw) -> list[int]:
        """Permutation from the op's [act_dim, *fa, *fw] layout to the dot's output order."""
        mine = [("a", self.act_dim)] + [("a", d) for d in fa] + [("w", d) for d in fw]
        act_free = sorted([self.act_dim] + fa)
        ordered = [("a", d) for d in act_free], [("w", d) for d in fw]
        dot_order = ordered[0] + ordered[1] if self.act_side == 0 else ordered[1] + ordered[0]
        return [mine.index(label) for label in dot_order]

    def run(self, read: Callable, write: Callable, call_op: Callable) -> None:
        """Compute this site's outputs from the environment and write them into it."""
        a_shape, w_shape, ca, cw, fa, fw = self._layout()
        (rows, k), (_, n_cols) = self.shapes_2d()
        w2 = _reshape(_transpose(read(self.dot.invars[1 - self.act_side]), cw + fw), (k, n_cols))
        if self.op == AG:
            x = read(self.collective.invars[0])
            x2 = _reshape(_transpose(x, [self.act_dim] + fa + ca), (rows, k))
            result = call_op(self, x2, w2)
            out2, gathered2 = result if self.return_gathered else (result, None)
            lead = a_shape[self.act_dim] * self.axis_size
        else:
            y = read(self.dot.invars[self.act_side])
            y2 = _reshape(_transpose(y, [self.act_dim] + fa + ca), (rows, k))
            out2, gathered2 = call_op(self, y2, w2), None
            lead = a_shape[self.act_dim] // self.axis_size
        rest = [a_shape[d] for d in fa] + [w_shape[d] for d in fw]
        out = _transpose(_reshape(out2, (lead, *rest)), self._out_perm(fa, fw))
        if self.op == AG:
            write(self.dot.outvars[0], out)
            if gathered2 is not None:
                g = _reshape(gathered2, (lead, *[a_shape[d] for d in fa + ca]))
                write(self.collective.outvars[0], _transpose(g, np.argsort([self.act_dim] + fa + ca)))
        else:
            write(self.collective.outvars[0], out)


def _transpose(x, perm):
    perm = tuple(int(p) for p in perm)
    return x if perm == tuple(range(len(perm))) else jax.lax.transpose(x, perm)


def _reshape(x, shape):
    shape = tuple(int(d) for d in shape)
    return x if tuple(x.shape) == shape else jax.lax.reshape(x, shape)


# --------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------
def find_sites(jaxpr, axis_sizes: dict, where: str, ops: Sequence[str]) -> tuple[list[_Site], list[SiteRecord]]:
    """Sites and near-misses of one jaxpr (not of its sub-jaxprs); `axis_sizes` maps mesh axes."""
    eqns = jaxpr.eqns
    ctx = _MatchContext.of(jaxpr, axis_sizes, where)

    sites: list[_Site] = []
    misses: list[SiteRecord] = []
    taken_dots: set[int] = set()
    for i, eqn in enumerate(eqns):
        name = eqn.primitive.name
        if name == _GATHER:
            site_or_miss = _match_gather(ctx, i, AG in ops)
        elif name in _SCATTER:
            site_or_miss = _match_scatter(ctx, i, RS in ops, taken_dots)
        else:
            continue
        if isinstance(site_or_miss, _Site):
            sites.append(site_or_miss)
            taken_dots.add(eqns.index(site_or_miss.dot))
        else:
            misses.append(site_or_miss)
    return sites, misses


@dataclasses.dataclass
class _MatchContext:
    eqns: Sequence[Any]
    defined_at: dict
    users: dict
    outputs: set
    axis_sizes: dict
    where: str

    @classmethod
    def of(cls, jaxpr, axis_sizes: dict, where: str) -> "_MatchContext":
        """Definitions and users of every variable of one jaxpr (not of its sub-jaxprs)."""
        defined_at = {v: -1 for v in (*jaxpr.constvars, *jaxpr.invars)}
        users: dict[Any, list[tuple[int, int]]] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for pos, v in enumerate(eqn.invars):
                if _is_var(v):
                    users.setdefault(v, []).append((i, pos))
            for v in eqn.outvars:
                defined_at[v] = i
        outputs = {v for v in jaxpr.outvars if _is_var(v)}
        return cls(jaxpr.eqns, defined_at, users, outputs, axis_sizes, where)

    def axis_size(self, eqn) -> int:
        size = eqn.params.get("axis_size")
        return int(size) if size is not None else int(self.axis_sizes[_single_axis(eqn.params)])

    def miss(self, op, i, shapes, reason) -> SiteRecord:
        axis = self.eqns[i].params.get("axis_name")
        axis = axis[0] if isinstance(axis, (tuple, list)) and len(axis) == 1 else axis
        return SiteRecord(op, f"{self.where}eqn {i}", str(axis), shapes, "", "", reason)


def _match_gather(ctx: _MatchContext, i: int, enabled: bool) -> _Site | SiteRecord:
    gather = ctx.eqns[i]
    axis = gather.params["all_gather_dimension"]
    x, g = gather.invars[0], gather.outvars[0]
    shapes = f"x {_fmt(x.aval)} gathered dim {axis}"
    problem = None if enabled else "ag_matmul is not in ops="
    problem = problem or _collective_problem(gather.params)
    if problem:
        return ctx.miss(AG, i, shapes, problem)
    uses = ctx.users.get(g, [])
    dot_reasons = []
    for j, pos in uses:
        dot = ctx.eqns[j]
        if dot.primitive.name != _DOT:
            continue
        (lc, rc), _ = dot.params["dimension_numbers"]
        problem = _dot_problem(dot)
        if problem is None and axis in (lc, rc)[pos]:
            problem = "the matmul contracts over the gathered dimension (a weight-gradient matmul)"
        w = dot.invars[1 - pos]
        first_use = min(k for k, _ in uses)
        if problem is None and _is_var(w) and ctx.defined_at[w] >= first_use:
            problem = "the weight is computed after the gathered tensor's first use"
        if problem is None and not _is_var(w):
            problem = "the weight is a literal"
        if problem:
            dot_reasons.append(f"eqn {j}: {problem}")
            continue
        site = _Site(AG, _single_axis(gather.params), ctx.axis_size(gather), first_use,
                     tuple(sorted({i, j})), pos, axis, dot, gather, record=None,  # type: ignore[arg-type]
                     return_gathered=len(uses) > 1 or g in ctx.outputs)
        (m, k), (_, n) = site.shapes_2d()
        site.record = SiteRecord(AG, f"{ctx.where}eqn {i}", site.axis_name,
                                 f"{shapes} · w {_fmt(w.aval)} -> {_fmt(dot.outvars[0].aval)}"
                                 + (f" (gathered x also used by {len(uses) - 1 + (g in ctx.outputs)} more)"
                                    if site.return_gathered else ""),
                                 f"[{m},{k}]·[{k},{n}]", "")
        return site
    if dot_reasons:
        return ctx.miss(AG, i, shapes, "; ".join(dot_reasons))
    others = sorted({ctx.eqns[j].primitive.name for j, _ in uses})
    return ctx.miss(AG, i, shapes, f"the gathered tensor feeds no matmul directly (users: {others or 'none'})")


def _match_scatter(ctx: _MatchContext, i: int, enabled: bool, taken_dots: set) -> _Site | SiteRecord:
    scatter = ctx.eqns[i]
    dim = scatter.params["scatter_dimension"]
    v = scatter.invars[0]
    shapes = f"y {_fmt(v.aval)} scattered dim {dim}"
    problem = None if enabled else "matmul_rs is not in ops="
    problem = problem or _collective_problem(scatter.params)
    j = ctx.defined_at.get(v, -1) if _is_var(v) else -1
    dot = ctx.eqns[j] if j >= 0 else None
    if problem is None and (dot is None or dot.primitive.name != _DOT):
        producer = dot.primitive.name if dot is not None else "an input of the body"
        problem = f"the scattered tensor comes from {producer}, not from a matmul"
        if producer == "pvary":
            problem += " (the product does not vary over the axis)"
        if producer == "convert_element_type":
            problem += " (a dtype cast between matmul and reduce-scatter changes the reduction dtype)"
    if problem is None and (len(ctx.users.get(v, [])) != 1 or v in ctx.outputs):
        problem = "the matmul's full product has other users, so it is computed anyway"
    if problem is None and j in taken_dots:
        problem = "the matmul already consumes an ag_matmul site (all_gather→matmul→reduce-scatter)"
    problem = problem or _dot_problem(dot)
    if problem:
        return ctx.miss(RS, i, shapes, problem)
    (lc, rc), _ = dot.params["dimension_numbers"]
    free = [(0, d) for d in _free_dims(len(dot.invars[0].aval.shape), lc)]
    free += [(1, d) for d in _free_dims(len(dot.invars[1].aval.shape), rc)]
    side, act_dim = free[dim]
    w = dot.invars[1 - side]
    if not _is_var(w) or not _is_var(dot.invars[side]):
        return ctx.miss(RS, i, shapes, "a matmul operand is a literal")
    site = _Site(RS, _single_axis(scatter.params), ctx.axis_size(scatter), j, (j, i), side, act_dim,
                 dot, scatter, record=None)  # type: ignore[arg-type]
    (m, k), (_, n) = site.shapes_2d()
    a = dot.invars[side].aval
    site.record = SiteRecord(RS, f"{ctx.where}eqn {i}", site.axis_name,
                             f"y {_fmt(a)} scattered dim {act_dim} · w {_fmt(w.aval)} -> {_fmt(scatter.outvars[0].aval)}",
                             f"[{m},{k}]·[{k},{n}]", "")
    return site
