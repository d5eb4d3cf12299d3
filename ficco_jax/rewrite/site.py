"""The one site protocol: a collective next to a matmul that `overlap()` turns into a ficco_jax op.

Every pattern family (match_tp.py: all_gather / psum_scatter / psum; match_ep.py: all_to_all) subclasses
`Site` with the layout of its pattern: which operands the op takes and how its outputs map back
onto the variables of the jaxpr. The interpreter in overlap.py uses only what `Site` declares,
so a new family adds a subclass and its matchers, and nothing else changes. `MatchContext` is
what every matcher reads of one jaxpr; `SiteRecord` is what `explain()` reports of a site.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, ClassVar

import jax.numpy as jnp
import numpy as np

from .. import config
from ..lowering.dma.registry import site_label
from .jaxpr_util import default_precision, fmt_shapes, is_var, single_axis, source_line

logger = logging.getLogger("ficco_jax")


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """One collective next to a matmul: rewritten (``reason == ""``) or a near-miss."""

    op: str  # "ag_matmul" | "matmul_rs" | "matmul_psum" | "a2a_matmul" | "matmul_a2a"
    where: str  # path of the equation: "shard_map@0/scan@2/eqn 5"
    axis_name: str
    shapes: str  # the site as written: "x float32[2,16,32] gathered dim 1 · w float32[32,16]"
    matmul_2d: str  # the operand shapes handed to the op, "[64,32]·[32,16]"; "" for near-misses
    schedule: str  # the schedule chosen, "" for near-misses
    reason: str = ""  # why it was not rewritten, "" if it was
    source: str = ""  # the user's line that wrote the collective, "file.py:12 (fn)"; "" where jax kept none
    note: str = ""  # what the schedule means for a rewritten site: "plain path: ..." where nothing overlaps
    plain_path: bool = False  # a site whose schedule keeps the plain path: the program runs as written there
    nested_in: str = ""  # the nested overlap() whose own trace rewrites this site; "" for the function's own

    @property
    def rewritten(self) -> bool:
        return not self.reason

    @property
    def overlapped(self) -> bool:
        """A site that runs its op with an overlapping schedule."""
        return self.rewritten and not self.plain_path


@dataclasses.dataclass(kw_only=True)
class Site:
    """A matched site: where the op runs, what it replaces, and (in subclasses) its layout."""

    # op name -> (the public op, its keyword for also returning the collective's result or None)
    op_calls: ClassVar[dict[str, tuple[Callable, str | None]]] = {}

    op: str
    axis_name: str
    axis_size: int
    exec_index: int  # the equation index at which the op runs
    skip: tuple[int, ...]  # the equations it replaces
    dot: Any
    collective: Any
    record: SiteRecord | None = None
    # The collective's result has readers besides the matmul: the op returns it too, so nothing
    # is communicated twice.
    returns_collective: bool = False
    schedule: Any = "auto"
    mesh: Any = None  # the enclosing shard_map's concrete mesh, where it has one (locates the peers)
    # FP8 sites (all_gather of an FP8 tensor, dequantized, then the matmul): the jaxpr atoms of the
    # op's FP8 operands where they differ from the dot's, and of the two per-tensor scales.
    fp8_act: Any = None
    fp8_weight: Any = None
    scales: tuple | None = None
    scale_casts: tuple = ((), ())  # how the program casts each scale before it multiplies (dequant.py)
    # A dot of operands of two dtypes (the f32 cotangent times a bf16 weight in JAX's backward):
    # the dtype JAX converts both to (its result's), which the op's operands are converted to.
    operand_dtype: Any = None
    # matmul_rs: the dtype a convert_element_type rounds the product to before the reduce-scatter
    # (bf16 in JAX's backward of a mixed-precision matmul): the op's partials have it.
    rounded_to: Any = None
    # The dimensions of the stored array the weight atom is a transpose of, in the weight atom's
    # order (MatchContext.stored_dims; the identity where no transpose produced it here).
    weight_stored_dims: tuple[int, ...] | None = None

    @property
    def dots(self) -> tuple:
        """The matmul equations the op replaces (several where it takes several weights)."""
        return (self.dot,)

    def op_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(operand shape, weight shape) as the op takes them."""
        raise NotImplementedError

    def weight_atom(self):
        """The jaxpr atom the op's weight is read from."""
        raise NotImplementedError

    def weight_layout(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(perm, col_major): the permutation `operands` applies to the weight atom (before any
        reshape), and the dimensions of its result from major to minor as the ops read a
        column-major weight."""
        raise NotImplementedError

    @property
    def w_col_major(self) -> bool:
        """Whether the op reads its weight column-major: where that is the byte order of the array
        the weight is a transpose of (`x @ v.T`; JAX's input gradient `ct @ w^T`), which XLA then
        hands over as it is; row-major would make it write the transpose out."""
        perm, col_major = self.weight_layout()
        stored = self.weight_stored_dims or tuple(range(len(perm)))
        dims = [stored[p] for p in perm]  # the stored array's dimension behind each of the op's
        identity = list(range(len(dims)))
        return dims != identity and [dims[d] for d in col_major] == identity

    def operands(self, read: Callable) -> tuple[Any, Any]:
        """The op's (operand, weight), brought from the jaxpr's layout into the op's."""
        raise NotImplementedError

    def write_outputs(self, out, collective_out, write: Callable) -> None:
        """Write the op's result (and the collective's, when returned) back in the jaxpr's layout."""
        raise NotImplementedError

    @property
    def dtype(self):
        """The op's operand dtype: the FP8 one of an FP8 site, the one a mixed-dtype dot converts
        its operands to, else the dot's operands'."""
        if self.operand_dtype is not None:
            return np.dtype(self.operand_dtype)
        return (self.fp8_weight if self.fp8_weight is not None else self.dot.invars[1]).aval.dtype

    @property
    def out_dtype(self):
        """The op's result dtype where it differs from its operands' (mixed precision, FP8, a
        product rounded before its reduce-scatter), else None."""
        out = self.rounded_to if self.rounded_to is not None else self.dot.outvars[0].aval.dtype
        return None if out == self.dtype else np.dtype(out)

    def run(self, read: Callable, write: Callable) -> None:
        """Compute this site's outputs from the interpreter's environment and write them into it."""
        numerics = {"out_dtype": self.out_dtype} if self.out_dtype is not None else {}
        if self.w_col_major:
            numerics["w_col_major"] = True
        if self.scales is not None:
            x_scale, w_scale = (_scalar(cast_scale(read(s), casts)) for s, casts in zip(self.scales, self.scale_casts))
            numerics.update(x_scale=x_scale, w_scale=w_scale)
        operands = self.operands(read)
        if self.operand_dtype is not None:  # exact: the narrower operand is widened, as JAX's dot does
            operands = [[w.astype(self.operand_dtype) for w in v] if isinstance(v, list) else v.astype(self.operand_dtype)
                        for v in operands]
        # The op's executor calls name the user's line of the collective they replace.
        with site_label(self.record.source or f"overlap site {self.record.where}"):
            result = self.call_op(*operands, **numerics)
        out, collective_out = result if self.returns_collective else (result, None)
        self.write_outputs(out, collective_out, write)

    def call_op(self, operand, weight, **numerics):
        fn, side_flag = self.op_calls[self.op]
        kwargs = {side_flag: True} if self.returns_collective else {}
        try:
            return fn(operand, weight, self.axis_name, schedule=self.schedule, **kwargs, **numerics)
        except ValueError as err:
            # The schedule was validated for the site's shapes; an op that still refuses it
            # (a check only the op makes) falls back rather than failing the user's function.
            if self.schedule == "auto":
                raise
            logger.warning("ficco_jax.overlap: %s rejected %s at %s (%s); using 'auto'", self.op, self.schedule,
                           self.record.where, err)
            return fn(operand, weight, self.axis_name, schedule="auto", **kwargs, **numerics)


def cast_scale(scale, casts: tuple):
    """`scale` cast as the program casts it on its way to the dequantizing multiply (rewrite/dequant.py,
    Dequantized.scale_casts), so that it has the program's value: an f32 scale cast to bf16 is rounded."""
    for dtype in casts:
        scale = scale.astype(dtype)
    return scale


def _scalar(value):
    """A per-tensor scale as the ops take it: one f32 value."""
    return jnp.asarray(value, jnp.float32).reshape(())


# --------------------------------------------------------------------------------------------
# What a matcher reads of one jaxpr
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MatchContext:
    eqns: Any
    defined_at: dict  # variable -> index of its equation, -1 for the jaxpr's inputs
    users: dict  # variable -> [(equation index, operand position)]
    outputs: set
    axis_sizes: dict  # mesh axis -> size
    where: str  # path of this jaxpr, prefixed to every record
    ops: tuple[str, ...]  # the ops overlap() may rewrite
    taken_dots: set = dataclasses.field(default_factory=set)  # dots some site already consumes

    @classmethod
    def of(cls, jaxpr, axis_sizes: dict, where: str, ops) -> "MatchContext":
        """Definitions and users of every variable of one jaxpr (not of its sub-jaxprs)."""
        defined_at = {v: -1 for v in (*jaxpr.constvars, *jaxpr.invars)}
        users: dict[Any, list[tuple[int, int]]] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for pos, v in enumerate(eqn.invars):
                if is_var(v):
                    users.setdefault(v, []).append((i, pos))
            for v in eqn.outvars:
                defined_at[v] = i
        outputs = {v for v in jaxpr.outvars if is_var(v)}
        return cls(jaxpr.eqns, defined_at, users, outputs, axis_sizes, where, tuple(ops))

    def producer(self, atom) -> int:
        """Index of the equation that computes `atom`; -1 for an input of the jaxpr or a literal."""
        return self.defined_at.get(atom, -1) if is_var(atom) else -1

    def producer_name(self, index: int) -> str:
        return self.eqns[index].primitive.name if index >= 0 else "an input of the body"

    def read_elsewhere(self, var) -> bool:
        """Whether `var` has more than one reader (an output of the jaxpr counts as one)."""
        return len(self.users.get(var, [])) != 1 or var in self.outputs

    def readers_text(self, var) -> str:
        names = sorted({self.eqns[j].primitive.name for j, _ in self.users.get(var, [])})
        return f"users: {names or 'none'}"

    def axis(self, eqn) -> dict:
        """The axis_name / axis_size of a site built on collective `eqn`."""
        size = eqn.params.get("axis_size")
        size = int(size) if size is not None else int(self.axis_sizes[single_axis(eqn.params)])
        return {"axis_name": single_axis(eqn.params), "axis_size": size}

    def not_enabled(self, op: str) -> str | None:
        return None if op in self.ops else f"{op} is not in ops="

    def weight_problem(self, weight, first_use: int, operand: str) -> str | None:
        """Why `weight` cannot be read where the op runs (at the first use of `operand`)."""
        if not is_var(weight):
            return "the weight is a literal"
        if self.defined_at[weight] >= first_use:
            return f"the weight is computed after the {operand} first use"
        return None

    def miss(self, op: str, i: int, shapes: str, reason: str) -> SiteRecord:
        params = self.eqns[i].params
        axis = params.get("axis_name", params.get("axes"))  # psum names its axes "axes"
        axis = axis[0] if isinstance(axis, (tuple, list)) and len(axis) == 1 else axis
        return SiteRecord(op, f"{self.where}eqn {i}", str(axis), shapes, "", "", reason,
                          source=source_line(self.eqns[i]))

    def found(self, site: Site, i: int, shapes: str) -> Site:
        """`site`, with the record of the collective at equation `i` that it rewrites."""
        site.record = SiteRecord(site.op, f"{self.where}eqn {i}", site.axis_name, shapes,
                                 fmt_shapes(site.op_shapes()), "", source=source_line(self.eqns[i]))
        site.weight_stored_dims = self.stored_dims(site.weight_atom())
        return site

    def stored_dims(self, atom) -> tuple[int, ...]:
        """For each dimension of `atom`, the dimension of the array it was transposed from in this
        jaxpr: through the transposes and casts (which keep a layout) that produced it."""
        dims = tuple(range(len(atom.aval.shape)))
        j = self.producer(atom)
        while j >= 0 and self.eqns[j].primitive.name in ("transpose", "convert_element_type"):
            eqn = self.eqns[j]
            if eqn.primitive.name == "transpose":
                perm = eqn.params["permutation"]
                dims = tuple(perm[d] for d in dims)
            j = self.producer(eqn.invars[0])
        return dims


# --------------------------------------------------------------------------------------------
# Checks every family makes
# --------------------------------------------------------------------------------------------
def collective_problem(params) -> str | None:
    """Why a collective cannot become one of the ops, whatever the matmul beside it."""
    if not params.get("tiled", False):
        return "untiled collective (adds or removes an axis); only tiled=True maps onto the ops"
    if params.get("axis_index_groups") is not None:
        return "axis_index_groups is set; the ops work on a whole mesh axis"
    if single_axis(params) is None:
        return f"collective over several mesh axes {params['axis_name']}; the ops take one axis"
    return None


def converted_operands(dot):
    """The dtype JAX converts the operands of `dot` to where they have two floating-point dtypes
    (the f32 cotangent times a bf16 weight in the backward of a mixed-precision matmul): its
    result's, on CPU and GPU; None where the operands agree, or are FP8 (kept as they are)."""
    lhs, rhs = (v.aval.dtype for v in dot.invars)
    if lhs == rhs or not all(jnp.issubdtype(d, jnp.floating) and not config.is_fp8(d) for d in (lhs, rhs)):
        return None
    return np.dtype(dot.outvars[0].aval.dtype)


def moved_dtype_problem(dot, pos: int, moved: str, collective: str, verb: str) -> str | None:
    """Why a dot of operands of two dtypes cannot take operand `pos`, the one its collective moved
    (`moved`: "gathered tensor", "received tokens"), as the op's: JAX converts both operands to the
    result's dtype after the `collective`, and the op would `verb` that dtype, so the moved operand
    must already have it (the weight alone is converted)."""
    to = converted_operands(dot)
    have, weight = (np.dtype(dot.invars[k].aval.dtype) for k in (pos, 1 - pos))
    if to is None or have == to:
        return None
    return (f"JAX converts the {moved} ({have.name}) and the {weight.name} weight to {to.name} after the "
            f"{collective}; the op would {verb} {to.name}, not the {have.name} this program moves: give both "
            f"operands one dtype (e.g. the weight in {have.name}, with preferred_element_type={to.name})")


def dot_dtype_problem(dot, convert_operands: bool = False) -> str | None:
    """Why the ops' matmuls would not compute what `dot` computes: dtypes or precision. Operands
    of one dtype with a result of that dtype, or f32 from bf16 / f16 operands (mixed precision,
    `preferred_element_type=jnp.float32`), are served; with `convert_operands`, so are operands of
    two dtypes, which the site converts to the result's dtype as JAX does (`converted_operands`)."""
    lhs, rhs = (v.aval for v in dot.invars)
    out = dot.outvars[0].aval
    for aval in (lhs, rhs):
        if not jnp.issubdtype(aval.dtype, jnp.floating):
            return (f"{np.dtype(aval.dtype).name} matmul; the ops compute floating-point matmuls only, so it "
                    f"stays as written")
    mixed = out.dtype == jnp.float32 and lhs.dtype in (jnp.bfloat16, jnp.float16)
    converted = convert_operands and converted_operands(dot) is not None
    if not converted and (lhs.dtype != rhs.dtype or (out.dtype != lhs.dtype and not mixed)):
        return (f"operand/result dtypes differ ({np.dtype(lhs.dtype).name} x {np.dtype(rhs.dtype).name}"
                f" -> {np.dtype(out.dtype).name}); the ops take operands of one dtype and return it, or f32 "
                f"from bf16/f16 operands")
    precision = dot.params.get("precision")
    if precision is not None and precision != default_precision():
        return f"explicit precision={precision} differs from the default the ops' matmuls use"
    return None
