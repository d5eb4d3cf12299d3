"""What explicit-mode types say of shardings: each dimension's mesh axes, the mesh and its axis
types, and where a dot_general's dimensions go. Global-view matching (match_global.py) reads the
program's communication from these alone."""
from __future__ import annotations

from jax.sharding import AxisType, PartitionSpec

from .jaxpr_util import fmt, free_dims


def mesh_of(aval):
    """The mesh of `aval`'s sharding; None where the type names none (no mesh, or an empty one)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or not getattr(mesh, "axis_names", ()) else mesh


def axes_of(aval) -> tuple[tuple[str, ...], ...] | None:
    """The mesh axes of each dimension of `aval`; None where the type states no usable sharding."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None or getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        return None
    entries = list(spec) + [None] * (len(aval.shape) - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def split_axes(mesh) -> dict:
    """The mesh axes that split data (size > 1), with their types."""
    types = getattr(mesh, "axis_types", None) or (AxisType.Explicit,) * len(mesh.axis_names)
    return {a: t for a, t in zip(mesh.axis_names, types) if mesh.shape[a] > 1}


def is_explicit(mesh) -> bool:
    return mesh is not None and all(t == AxisType.Explicit for t in split_axes(mesh).values())


def is_gspmd(mesh) -> bool:
    return mesh is not None and any(t == AxisType.Auto for t in split_axes(mesh).values())


def contracted(dot) -> tuple[tuple[int, ...], tuple[int, ...]]:
    (lc, rc), _ = dot.params["dimension_numbers"]
    return tuple(lc), tuple(rc)


def batched(dot) -> tuple[tuple[int, ...], tuple[int, ...]]:
    _, (lb, rb) = dot.params["dimension_numbers"]
    return tuple(lb), tuple(rb)


def free(dot, side: int) -> list[int]:
    """The dimensions of operand `side` that are neither contracted nor batched."""
    return free_dims(len(dot.invars[side].aval.shape), contracted(dot)[side] + batched(dot)[side])


def out_dim(dot, side: int, dim: int) -> int:
    """The result dimension of free dimension `dim` of operand `side` (dot_general's order:
    batch, lhs free, rhs free)."""
    before = len(batched(dot)[0]) + (len(free(dot, 0)) if side == 1 else 0)
    return before + free(dot, side).index(dim)


def product_axes(dot, side_dims=None) -> tuple:
    """The sharding of `dot`'s result that its operands' free dimensions give, before any
    collective: operand `side`'s dimensions read from `side_dims` = (side, dims) where given."""
    dims = [axes_of(v.aval) for v in dot.invars]
    if side_dims is not None:
        dims[side_dims[0]] = side_dims[1]
    out = [dims[0][d] for d in batched(dot)[0]] + [()] * (len(dot.outvars[0].aval.shape) - len(batched(dot)[0]))
    for s in (0, 1):
        for d in free(dot, s):
            out[out_dim(dot, s, d)] = dims[s][d]
    return tuple(out)


def typed(var) -> str:
    """`float32[64@tp,32]`: a shape with its sharding, as jax.typeof shows it."""
    dims = axes_of(var.aval) or ((),) * len(var.aval.shape)
    text = [f"{n}@{'·'.join(a)}" if a else str(n) for n, a in zip(var.aval.shape, dims)]
    return f"{fmt(var.aval).split('[')[0]}[{','.join(text)}]"


def spec_of(aval) -> PartitionSpec:
    """The PartitionSpec of `aval`, as a shard_map takes it for this value's in_spec or out_spec."""
    return aval.sharding.spec
