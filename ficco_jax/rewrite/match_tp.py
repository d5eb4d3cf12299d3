"""The tensor-parallel patterns of a `shard_map` body: all_gather → matmul, matmul → psum_scatter
and matmul → psum.

Three patterns are recognised in a body's jaxpr (the body of a `shard_map`, or a scan / cond /
while / jit / checkpoint body nested inside one):

- ``all_gather(x, tiled) → dot_general`` where the gathered dimension is a free (row) dimension of
  the matmul: becomes ``ag_matmul``. Every matmul that reads the gathered tensor the same way
  (q/k/v or gate/up projections written separately) is served by that one op, its weights side by
  side (ag_matmul's list form): one pipeline of chunk copies feeds every weight's chunk matmuls.
  If the gathered tensor has other users (matmuls of another form, the residuals of a backward
  pass), the op also returns it, so nothing is gathered twice. A gather whose result is only
  transposed before its matmuls (the backward of a vmapped matmul) is the gather of the transposed
  operand.
- ``dot_general → psum_scatter(tiled)`` where the scattered dimension is a free dimension of one
  operand and the product has no other user: becomes ``matmul_rs``. Transposes (and one rounding
  cast) between the two are the op's output order (vmap of a matmul, as Equinox's
  ``jax.vmap(linear)``, writes the batch dimension last, then transposes it into place). A sum of
  several matmuls' products of one form (JAX's backward of the matmuls of one gathered tensor)
  becomes one ``matmul_rs`` of their operands side by side along K.
- ``dot_general → psum`` over one axis, the product read by nobody else and the sum read on (a
  row-parallel matmul's all-reduce): becomes ``matmul_psum``. The activation is the operand with
  more free elements (the lhs on a tie); a sum the body only returns (data parallelism's weight
  gradients) and a psum of anything but a matmul are not sites.

The ops take 2-D operands, so each site is canonicalised: the activation's gathered (scattered)
dimension goes first, its other free dimensions are flattened into rows after it, its contracted
dimensions into K; the weight becomes [K, N]. The device index of a tiled gather/scatter is the
outermost part of the gathered dimension, so keeping that dimension first keeps the device blocks
of the 2-D rows contiguous: for x[b, s, d] gathered on s, rows = (s, b), and the tiled 2-D gather
of [s·b, d] concatenates the devices' [s·b] blocks, i.e. gathers s. The result is reshaped to
[n·s, b, N] and transposed back to the dot's own output order.

FP8, as JAX recipes write it: ``all_gather(x8) → convert → multiply by a scalar scale → dot`` with
the other operand dequantized the same way (``convert(w8) * w_scale``) becomes the FP8 ag_matmul of
x8 and w8 with their scales (the gather moves FP8 bytes); ``dot(dequantized y8, dequantized w8) →
psum_scatter`` the FP8 matmul_rs. The result dtype is the dot's. Mixed precision (bf16 operands,
``preferred_element_type=jnp.float32``) passes `out_dtype` to the op. JAX's backward of such a
matmul multiplies the f32 cotangent by the bf16 weight, a dot of two dtypes that JAX computes on
both converted to its result dtype: the site converts them so too (the gathered operand must
already have that dtype, or the op would move other bytes than the program); and it rounds the
product to bf16 before the reduce-scatter (``dot → convert_element_type → psum_scatter``): the
op's result dtype, so its partials are rounded and summed as the program's are.

Everything not matched is reported as a near-miss with the reason, and left as written.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
import numpy as np

from .. import config, ops
from ..lowering.xla import narrowing
from . import dequant
from .jaxpr_util import fmt, free_dims, is_var, reshape, single_axis, transpose
from .site import (MatchContext, Site, SiteRecord, collective_problem, converted_operands, dot_dtype_problem,
                   moved_dtype_problem)

AG, RS, AR = "ag_matmul", "matmul_rs", "matmul_psum"
OPS = (AG, RS, AR)
_DOT = "dot_general"
_CONVERT = "convert_element_type"


@dataclasses.dataclass(kw_only=True)
class TensorSite(Site):
    """An ag_matmul, matmul_rs or matmul_psum site: the dot's operands as the op's 2-D [rows, K] · [K, N]."""

    op_calls = {AG: (ops.ag_matmul, "return_gathered"), RS: (ops.matmul_rs, None), AR: (ops.matmul_psum, None)}

    act_side: int  # which dot operand is the activation (0 lhs, 1 rhs)
    act_dim: int  # gathered / scattered dimension of the activation; matmul_psum: its first free one
    # ag_matmul: the other matmuls reading the gathered tensor as `dot` does (same activation
    # layout and numerics), each with its own weight: one op of the weights side by side.
    more_dots: tuple = ()
    # matmul_rs: for each dimension of the scattered tensor, the dot's output dimension it is
    # (transposes between the matmul and the reduce-scatter); None: the dot's own order.
    out_order: tuple | None = None
    # ag_matmul: the transpose the program applies to the gathered tensor before its matmuls (the
    # backward of a vmapped matmul), applied to the operand before the gather instead; and the
    # variable of the gathered tensor in that order, which the op returns where it is read elsewhere.
    in_order: tuple | None = None
    gathered: object = None

    @property
    def dots(self) -> tuple:
        return (self.dot, *self.more_dots)

    def _layout(self, dot=None):
        """Shapes of activation and weight, their contracted dims, and their other free dims (of
        `dot`'s weight; the first dot's by default)."""
        dot = dot or self.dot
        (lc, rc), _ = dot.params["dimension_numbers"]
        contract = (tuple(lc), tuple(rc))
        act_shape = self.collective.invars[0].aval.shape if self.op == AG else dot.invars[self.act_side].aval.shape
        if self.in_order is not None:
            act_shape = tuple(act_shape[d] for d in self.in_order)
        w_aval = dot.invars[1 - self.act_side].aval
        ca, cw = contract[self.act_side], contract[1 - self.act_side]
        fa = [d for d in free_dims(len(act_shape), ca) if d != self.act_dim]
        fw = free_dims(len(w_aval.shape), cw)
        return act_shape, w_aval.shape, list(ca), list(cw), fa, fw

    def _columns(self, dot) -> int:
        _, w_shape, _, _, _, fw = self._layout(dot)
        return math.prod(w_shape[d] for d in fw)

    def _depth(self, dot) -> int:
        """K of `dot`: the product of its activation's contracted dimensions."""
        a_shape, _, ca, _, _, _ = self._layout(dot)
        return math.prod(a_shape[d] for d in ca)

    def op_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        a_shape, _, _, _, fa, _ = self._layout()
        rows = a_shape[self.act_dim] * math.prod(a_shape[d] for d in fa)
        if self.op == RS:  # several matmuls summed: their operands side by side along K
            k = sum(self._depth(dot) for dot in self.dots)
            return (rows, k), (k, self._columns(self.dot))
        k = self._depth(self.dot)
        return (rows, k), (k, sum(self._columns(dot) for dot in self.dots))

    def weight_atom(self):
        return self.fp8_weight if self.fp8_weight is not None else self.dot.invars[1 - self.act_side]

    def weight_layout(self):
        """[K, N] from the weight's contracted then free dims; column-major: the free ones major."""
        _, _, _, cw, _, fw = self._layout()
        return tuple(cw + fw), tuple(range(len(cw), len(cw) + len(fw))) + tuple(range(len(cw)))

    @property
    def w_col_major(self) -> bool:
        # Several weights are put side by side into a new array, which the op reads row-major.
        return not self.more_dots and super().w_col_major

    def operands(self, read: Callable):
        _, _, ca, _, fa, _ = self._layout()
        (rows, k), _ = self.op_shapes()
        if self.more_dots and self.op == RS:  # sum_i y_i @ w_i == [y_1 .. y_n] @ [w_1; ..; w_n]
            acts, weights = [], []
            for dot in self.dots:
                _, _, ca_i, _, fa_i, _ = self._layout(dot)
                k_i = self._depth(dot)
                acts.append(reshape(transpose(read(dot.invars[self.act_side]), [self.act_dim] + fa_i + ca_i), (rows, k_i)))
                weights.append(self._weight_2d(read(dot.invars[1 - self.act_side]), dot, k_i))
            return jnp.concatenate(acts, axis=1), jnp.concatenate(weights, axis=0)
        if self.more_dots:  # the op's list form: one [K, N_i] weight per matmul
            weight = [self._weight_2d(read(dot.invars[1 - self.act_side]), dot, k) for dot in self.dots]
        else:
            weight = self._weight_2d(read(self.weight_atom()), self.dot, k)
        act_atom = self.fp8_act if self.fp8_act is not None else self.dot.invars[self.act_side]
        act = read(self.collective.invars[0] if self.op == AG else act_atom)
        if self.in_order is not None:
            act = transpose(act, self.in_order)
        return reshape(transpose(act, [self.act_dim] + fa + ca), (rows, k)), weight

    def _weight_2d(self, w, dot, k: int):
        _, _, _, cw, _, fw = self._layout(dot)
        n_cols = self._columns(dot)
        if self.w_col_major:  # [N, K] as stored (a bitcast), then one 2-D transpose, which XLA reads as a bitcast
            return transpose(reshape(transpose(w, fw + cw), (n_cols, k)), (1, 0))
        return reshape(transpose(w, cw + fw), (k, n_cols))

    def write_outputs(self, out, collective_out, write: Callable) -> None:
        a_shape, _, ca, _, fa, _ = self._layout()
        lead = {AG: a_shape[self.act_dim] * self.axis_size, RS: a_shape[self.act_dim] // self.axis_size}.get(
            self.op, a_shape[self.act_dim])
        products = out if self.more_dots and self.op == AG else (out,)
        for dot, product in zip(self.dots, products):
            _, w_shape, _, _, _, fw = self._layout(dot)
            rest = [a_shape[d] for d in fa] + [w_shape[d] for d in fw]
            product = transpose(reshape(product, (lead, *rest)), self._out_perm(fa, fw))
            if self.out_order is not None:
                product = transpose(product, self.out_order)
            write((dot if self.op == AG else self.collective).outvars[0], product)
        if collective_out is not None:
            gathered = reshape(collective_out, (lead, *[a_shape[d] for d in fa + ca]))
            write(self.gathered or self.collective.outvars[0], transpose(gathered, np.argsort([self.act_dim] + fa + ca)))

    def _out_perm(self, fa, fw) -> list[int]:
        """Permutation from the op's [act_dim, *fa, *fw] layout to the dot's output order."""
        mine = [("a", self.act_dim)] + [("a", d) for d in fa] + [("w", d) for d in fw]
        act_free = [("a", d) for d in sorted([self.act_dim] + fa)]
        w_free = [("w", d) for d in fw]
        dot_order = act_free + w_free if self.act_side == 0 else w_free + act_free
        return [mine.index(label) for label in dot_order]


def _dot_problem(dot) -> str | None:
    """Why this dot_general cannot become a 2-D op matmul, whatever its collective."""
    (_, _), (lb, rb) = dot.params["dimension_numbers"]
    if lb or rb:
        return "matmul has batch dimensions (e.g. per-head weights); the ops take 2-D weights"
    problem = dot_dtype_problem(dot, convert_operands=True)
    if problem is None and dot.invars[0] is dot.invars[1]:
        problem = "both matmul operands are the same tensor"
    return problem


# --------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------
def match_gather(ctx: MatchContext, i: int) -> TensorSite | SiteRecord:
    gather = ctx.eqns[i]
    axis = gather.params["all_gather_dimension"]
    x, g = gather.invars[0], gather.outvars[0]
    shapes = f"x {fmt(x.aval)} gathered dim {axis}"
    problem = ctx.not_enabled(AG) or collective_problem(gather.params)
    if problem:
        return ctx.miss(AG, i, shapes, problem)
    if config.is_fp8(x.aval.dtype):
        return _match_scaled_gather(ctx, i, shapes)
    in_order, moved = None, set()
    readers = ctx.users.get(g, [])
    if len(readers) == 1 and g not in ctx.outputs and ctx.eqns[readers[0][0]].primitive.name == "transpose":
        # gather then transpose (the backward of a vmapped matmul) is the gather of the transposed operand
        t = readers[0][0]
        in_order = tuple(ctx.eqns[t].params["permutation"])
        g, axis, moved = ctx.eqns[t].outvars[0], in_order.index(axis), {t}
        shapes += f", transposed {in_order}"
    uses = ctx.users.get(g, [])
    dot_reasons, taken = [], []  # taken: (equation, operand position) of the matmuls the op serves
    for j, pos in uses:
        dot = ctx.eqns[j]
        if dot.primitive.name != _DOT:
            continue
        (lc, rc), _ = dot.params["dimension_numbers"]
        problem = _dot_problem(dot)
        if problem is None and axis in (lc, rc)[pos]:
            problem = "the matmul contracts over the gathered dimension (a weight-gradient matmul)"
        if problem is None and j in ctx.taken_dots:
            problem = "the matmul already belongs to another site (both of its operands are gathered)"
        w, first_use = dot.invars[1 - pos], min(k for k, _ in uses)
        problem = problem or moved_dtype_problem(dot, pos, "gathered tensor", "gather", "gather")
        if problem is None and not taken:
            problem = ctx.weight_problem(w, first_use, "gathered tensor's")
        if problem:
            dot_reasons.append(f"eqn {j}: {problem}")
        elif not taken:
            taken.append((j, pos))
            exec_index = first_use
        elif same_form(ctx.eqns[taken[0][0]], taken[0][1], dot, pos) and is_var(w):
            # The op runs once this weight is computed too (a pvary of it can follow the first
            # matmul), where nothing has read the gathered tensor or a served product yet.
            later = max(exec_index, ctx.defined_at[w] + 1)
            if not _read_before(ctx, [g] + [ctx.eqns[k].outvars[0] for k, _ in (*taken, (j, pos))], later,
                                {k for k, _ in (*taken, (j, pos))}):
                taken.append((j, pos))
                exec_index = later
    if not taken:
        if dot_reasons:
            return ctx.miss(AG, i, shapes, "; ".join(dot_reasons))
        return ctx.miss(AG, i, shapes, f"the gathered tensor feeds no matmul directly ({ctx.readers_text(g)})")
    (j, pos), dots = taken[0], [ctx.eqns[k] for k, _ in taken]
    served = {k for k, _ in taken}
    site = TensorSite(op=AG, **ctx.axis(gather), exec_index=exec_index, skip=tuple(sorted({i, *moved, *served})),
                      dot=dots[0], more_dots=tuple(dots[1:]), collective=gather, act_side=pos, act_dim=axis,
                      in_order=in_order, gathered=g,
                      returns_collective=g in ctx.outputs or any(k not in served for k, _ in uses),
                      operand_dtype=converted_operands(dots[0]))
    more = sum(k not in served for k, _ in uses) + (g in ctx.outputs)
    also = f" (gathered x also used by {more} more)" if site.returns_collective else ""
    weights = ", ".join(fmt(dot.invars[1 - pos].aval) for dot in dots)
    products = ", ".join(fmt(dot.outvars[0].aval) for dot in dots)
    what = f"w {weights}" if len(dots) == 1 else f"{len(dots)} weights w {weights}"
    return ctx.found(site, i, f"{shapes} · {what}{_numerics(site)} -> {products}{also}")


def _read_before(ctx: MatchContext, variables, index: int, replaced: set) -> bool:
    """Whether an equation before `index` other than the `replaced` ones reads one of `variables`."""
    return any(k < index and k not in replaced for v in variables for k, _ in ctx.users.get(v, []))


def same_form(first, first_pos: int, dot, pos: int) -> bool:
    """Whether `dot` reads the gathered tensor as `first` does (same side, same contracted
    dimensions in the same order, same dtypes and precision): then both take one 2-D operand and
    their weights go side by side into one op."""
    (lc1, rc1), _ = first.params["dimension_numbers"]
    (lc2, rc2), _ = dot.params["dimension_numbers"]
    dtypes = [tuple(v.aval.dtype for v in (*e.invars, *e.outvars)) for e in (first, dot)]
    return (pos == first_pos and tuple((lc1, rc1)[pos]) == tuple((lc2, rc2)[pos]) and dtypes[0] == dtypes[1]
            and first.params.get("precision") == dot.params.get("precision")
            and first.params.get("preferred_element_type") == dot.params.get("preferred_element_type"))


def match_scatter(ctx: MatchContext, i: int) -> TensorSite | SiteRecord:
    scatter = ctx.eqns[i]
    dim, v = scatter.params["scatter_dimension"], scatter.invars[0]
    shapes = f"y {fmt(v.aval)} scattered dim {dim}"
    summed = _summed_products(ctx, v)
    if summed is not None:
        return _match_summed_scatter(ctx, i, shapes, *summed)
    j, rounding, moves, order = _product_of(ctx, v)
    problem = (ctx.not_enabled(RS) or collective_problem(scatter.params) or _scatter_source_problem(ctx, j)
               or _rounding_problem(ctx, rounding))
    if problem is None and any(ctx.read_elsewhere(ctx.eqns[k].invars[0]) for k in moves):
        problem = "the matmul's product is read elsewhere before its transpose to the reduce-scatter"
    if problem is None and ctx.read_elsewhere(v):
        problem = "the matmul's full product has other users, so it is computed anyway"
    if problem is None and j in ctx.taken_dots:
        problem = "the matmul already consumes an ag_matmul site (all_gather→matmul→reduce-scatter)"
    problem = problem or _dot_problem(ctx.eqns[j])
    if problem:
        return ctx.miss(RS, i, shapes, problem)
    dot = ctx.eqns[j]
    (lc, rc), _ = dot.params["dimension_numbers"]
    free = [(0, d) for d in free_dims(len(dot.invars[0].aval.shape), lc)]
    free += [(1, d) for d in free_dims(len(dot.invars[1].aval.shape), rc)]
    side, act_dim = free[order[dim]]
    w = dot.invars[1 - side]
    if not is_var(w) or not is_var(dot.invars[side]):
        return ctx.miss(RS, i, shapes, "a matmul operand is a literal")
    fp8 = dequant.scaled_operands(ctx, dot.invars[side], w)
    skip = tuple(sorted({j, i, *moves} | ({rounding} if rounding is not None else set())))
    site = TensorSite(op=RS, **ctx.axis(scatter), exec_index=j, skip=skip, dot=dot, collective=scatter,
                      act_side=side, act_dim=act_dim, operand_dtype=converted_operands(dot),
                      rounded_to=None if rounding is None else v.aval.dtype, out_order=tuple(order), **fp8)
    y, w = (fp8["fp8_act"], fp8["fp8_weight"]) if fp8 else (dot.invars[side], w)
    return ctx.found(site, i, f"y {fmt(y.aval)} scattered dim {act_dim} · w {fmt(w.aval)}{' (FP8, scaled)' if fp8 else ''}"
                              f"{_numerics(site)} -> {fmt(scatter.outvars[0].aval)}")


def _summed_products(ctx: MatchContext, v) -> tuple[list[int], list[int]] | None:
    """(the matmuls, the add_any equations) where `v` is a sum of matmul products that nothing
    else reads, all of one form (JAX's backward of several matmuls of one gathered tensor sums
    their input gradients before the reduce-scatter); else None."""
    dots, adds, pending = [], [], [v]
    while pending:
        var = pending.pop()
        j = ctx.producer(var)
        if var is not v and ctx.read_elsewhere(var):
            return None
        if ctx.producer_name(j) == "add_any":
            adds.append(j)
            pending.extend(ctx.eqns[j].invars)
        elif ctx.producer_name(j) == _DOT and _dot_problem(ctx.eqns[j]) is None and j not in ctx.taken_dots:
            dots.append(j)
        else:
            return None
    if not adds or len(set(dots)) != len(dots):
        return None
    first = ctx.eqns[dots[0]]
    alike = all(ctx.eqns[j].params["dimension_numbers"] == first.params["dimension_numbers"]
                and same_form(first, 0, ctx.eqns[j], 0) and same_form(first, 1, ctx.eqns[j], 1) for j in dots)
    return (sorted(dots), adds) if alike else None


def _match_summed_scatter(ctx: MatchContext, i: int, shapes: str, dots: list[int], adds: list[int]):
    """psum_scatter(y_1 @ w_1 + ... + y_n @ w_n): one matmul_rs of the operands side by side along K."""
    scatter = ctx.eqns[i]
    v = scatter.invars[0]
    problem = ctx.not_enabled(RS) or collective_problem(scatter.params)
    if problem is None and ctx.read_elsewhere(v):
        problem = "the summed products have other users, so they are computed anyway"
    if problem:
        return ctx.miss(RS, i, shapes, problem)
    first = ctx.eqns[dots[0]]
    (lc, rc), _ = first.params["dimension_numbers"]
    free = [(0, d) for d in free_dims(len(first.invars[0].aval.shape), lc)]
    free += [(1, d) for d in free_dims(len(first.invars[1].aval.shape), rc)]
    side, act_dim = free[scatter.params["scatter_dimension"]]
    if not all(is_var(a) for j in dots for a in ctx.eqns[j].invars):
        return ctx.miss(RS, i, shapes, "a matmul operand is a literal")
    site = TensorSite(op=RS, **ctx.axis(scatter), exec_index=max(dots), skip=tuple(sorted({i, *dots, *adds})),
                      dot=first, more_dots=tuple(ctx.eqns[j] for j in dots[1:]), collective=scatter, act_side=side,
                      act_dim=act_dim, operand_dtype=converted_operands(first))
    ys = ", ".join(fmt(ctx.eqns[j].invars[side].aval) for j in dots)
    ws = ", ".join(fmt(ctx.eqns[j].invars[1 - side].aval) for j in dots)
    return ctx.found(site, i, f"{len(dots)} matmuls summed, y {ys} scattered dim {act_dim} · w {ws}{_numerics(site)} "
                              f"-> {fmt(scatter.outvars[0].aval)}")


def _product_of(ctx: MatchContext, v) -> tuple[int, int | None, list[int], list[int]]:
    """(the equation computing the matmul product that `v` is, the convert_element_type between
    them or None, the transposes between them, and for each dimension of `v` the product's
    dimension it is). vmap of a matmul (Equinox's ``jax.vmap(linear)``) writes the product with
    its batch dimension last, then transposes it into place: the op writes that order itself.
    Where the chain ends at no matmul: the producer of `v` itself, as the program has it."""
    order, moves, rounding = list(range(len(v.aval.shape))), [], None
    j = ctx.producer(v)
    while ctx.producer_name(j) in ("transpose", _CONVERT):
        eqn = ctx.eqns[j]
        if eqn.primitive.name == "transpose":
            order = [eqn.params["permutation"][d] for d in order]
            moves.append(j)
        elif rounding is None:
            rounding = j
        else:
            break
        j = ctx.producer(eqn.invars[0])
    if ctx.producer_name(j) != _DOT:
        return ctx.producer(v), None, [], list(range(len(v.aval.shape)))
    return j, rounding, moves, order


def _numerics(site: TensorSite) -> str:
    """What explain() says of a site's conversions: operands widened, partials rounded."""
    notes = []
    if site.operand_dtype is not None:
        notes.append(f"operands in {np.dtype(site.operand_dtype).name}, as JAX converts them")
    if site.rounded_to is not None:
        notes.append(f"partials rounded to {np.dtype(site.rounded_to).name} before the sum")
    return f" ({'; '.join(notes)})" if notes else ""


def _rounding_problem(ctx: MatchContext, c: int | None) -> str | None:
    """Why the convert_element_type at equation `c` between a matmul and its reduce-scatter cannot
    become the op's result dtype: only a narrowing cast of a product nobody else reads (the
    partials rounded, as JAX's backward of a mixed-precision matmul rounds them) is one."""
    if c is None:
        return None
    src, dst = (np.dtype(a.aval.dtype) for a in (ctx.eqns[c].invars[0], ctx.eqns[c].outvars[0]))
    if ctx.read_elsewhere(ctx.eqns[c].invars[0]):
        return "the matmul's product is cast before the reduce-scatter and also read elsewhere"
    if not narrowing(src, dst):
        return (f"the {src.name} product is cast to {dst.name} before the reduce-scatter; the ops take a cast "
                f"that rounds the product to fewer bits only: compute it in {dst.name} "
                f"(preferred_element_type={dst.name}) instead of casting")
    return None


def _scatter_source_problem(ctx: MatchContext, j: int) -> str | None:
    """Why the scattered tensor (computed by equation `j`) is not a matmul's product."""
    producer = ctx.producer_name(j)
    if producer == _DOT:
        return None
    problem = f"the scattered tensor comes from {producer}, not from a matmul"
    if producer == "pvary":
        problem += " (the product does not vary over the axis)"
    if producer == "convert_element_type":
        problem += " (a dtype cast between matmul and reduce-scatter changes the reduction dtype)"
    return problem


# --------------------------------------------------------------------------------------------
# FP8: operands dequantized as convert(v8) * scale (rewrite/dequant.py)
# --------------------------------------------------------------------------------------------
def _match_scaled_gather(ctx: MatchContext, i: int, shapes: str) -> TensorSite | SiteRecord:
    """all_gather(x8) → convert → × x_scale → dot with convert(w8) × w_scale: the FP8 ag_matmul."""
    gather = ctx.eqns[i]
    axis, g = gather.params["all_gather_dimension"], gather.outvars[0]
    uses = ctx.users.get(g, [])
    first_use = min(k for k, _ in uses) if uses else i
    dots, reasons = dequant.fp8_dots(ctx, g)
    for j, pos, deq in dots:
        dot = ctx.eqns[j]
        (lc, rc), _ = dot.params["dimension_numbers"]
        w_deq = dequant.dequantized(ctx, dot.invars[1 - pos])
        problem = _dot_problem(dot)
        if problem is None and axis in (lc, rc)[pos]:
            problem = "the matmul contracts over the gathered dimension (a weight-gradient matmul)"
        problem = problem or dequant.gather_problem(ctx, deq, w_deq, first_use)
        if problem:
            reasons.append(f"eqn {j}: {problem}")
            continue
        site = TensorSite(op=AG, **ctx.axis(gather), exec_index=first_use, skip=tuple(sorted({i, *deq.eqns, j})),
                          dot=dot, collective=gather, act_side=pos, act_dim=axis,
                          returns_collective=ctx.read_elsewhere(g), fp8_weight=w_deq.v8, scales=(deq.scale, w_deq.scale),
                          scale_casts=(deq.scale_casts, w_deq.scale_casts))
        return ctx.found(site, i, f"{shapes} · w {fmt(w_deq.v8.aval)} (FP8, scaled) -> {fmt(dot.outvars[0].aval)}")
    if reasons:
        return ctx.miss(AG, i, shapes, "; ".join(reasons))
    return ctx.miss(AG, i, shapes, "the FP8 gathered tensor reaches no matmul as convert → multiply by a scalar "
                                   f"scale → dot ({ctx.readers_text(g)})")


# --------------------------------------------------------------------------------------------
# A matmul's all-reduce
# --------------------------------------------------------------------------------------------
def match_psum(ctx: MatchContext, i: int) -> TensorSite | SiteRecord | None:
    """A psum whose operand is a matmul's product and whose sum the body goes on computing with (a
    row-parallel matmul's all-reduce): a matmul_psum site. Not reported: other psums (a loss, a
    norm), and sums the body only returns, as data parallelism returns its weight gradients."""
    if not ctx.users.get(ctx.eqns[i].outvars[0]):
        return None
    return match_all_reduce(ctx, i)


def match_all_reduce(ctx: MatchContext, i: int) -> TensorSite | SiteRecord | None:
    """The psum at `i` of a matmul's product as a matmul_psum site, or why it is none; None where
    the psum sums no matmul's product. Whether the sum is read on is the caller's question (the
    global view asks it of the program, not of the per-device body it traces)."""
    psum = ctx.eqns[i]
    if len(psum.invars) != 1 or ctx.producer_name(ctx.producer(psum.invars[0])) != _DOT:
        return None
    v, j = psum.invars[0], ctx.producer(psum.invars[0])
    shapes = f"y {fmt(v.aval)} summed"
    problem = ctx.not_enabled(AR) or _psum_problem(psum.params)
    if problem is None and ctx.read_elsewhere(v):
        problem = "the matmul's full product has other users, so it is computed anyway"
    if problem is None and j in ctx.taken_dots:
        problem = "the matmul already consumes an ag_matmul site (all_gather→matmul→all-reduce)"
    dot = ctx.eqns[j]
    problem = problem or _dot_problem(dot)
    if problem is None and not all(is_var(a) for a in dot.invars):
        problem = "a matmul operand is a literal"
    side = _activation_side(dot)
    if problem is None and side is None:
        problem = "the matmul has no free dimension on either operand (a dot of vectors); the op takes rows"
    if problem:
        return ctx.miss(AR, i, shapes, problem)
    (lc, rc), _ = dot.params["dimension_numbers"]
    act_dim = free_dims(len(dot.invars[side].aval.shape), (lc, rc)[side])[0]
    site = TensorSite(op=AR, **ctx.axis(psum), exec_index=j, skip=(j, i), dot=dot, collective=psum,
                      act_side=side, act_dim=act_dim, operand_dtype=converted_operands(dot))
    y, w = dot.invars[side], dot.invars[1 - side]
    return ctx.found(site, i, f"y {fmt(y.aval)} · w {fmt(w.aval)}{_numerics(site)} summed -> "
                              f"{fmt(psum.outvars[0].aval)}")


def _psum_problem(params) -> str | None:
    """Why a psum cannot become matmul_psum, whatever its matmul."""
    if params.get("axis_index_groups") is not None:
        return "axis_index_groups is set; the ops work on a whole mesh axis"
    if single_axis(params) is None:
        return f"psum over several mesh axes {params['axes']}; the ops take one axis"
    return None


def _activation_side(dot) -> int | None:
    """The operand whose free dimensions become the op's rows: the one with more free elements (the
    lhs on a tie); None where neither has a free dimension."""
    (lc, rc), _ = dot.params["dimension_numbers"]
    free = [math.prod(v.aval.shape[d] for d in free_dims(len(v.aval.shape), c)) if free_dims(len(v.aval.shape), c)
            else 0 for v, c in zip(dot.invars, (lc, rc))]
    if not any(free):
        return None
    return 0 if free[0] >= free[1] else 1


# The matcher of each collective primitive this family rewrites.
MATCHERS = {"all_gather": match_gather, "reduce_scatter": match_scatter, "psum_scatter": match_scatter,
            "psum": match_psum, "psum_invariant": match_psum}
