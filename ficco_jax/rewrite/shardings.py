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


def spec_of_axes(dims) -> PartitionSpec:
    """The PartitionSpec whose dimensions are split over `dims` (as `axes_of` gives them): an
    unsharded dimension `()` is None, one axis its name, several their tuple."""
    return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims])


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


# How a resharding next to a matmul reads as the collective an op runs
def gathered_axis(before, after) -> tuple[int, str] | str | None:
    """(dimension, axis) where `after` is `before` with one axis taken off one dimension; a text
    when axes move between dimensions (an all-to-all); None when no axis is taken off."""
    removed = [(d, a) for d, (b, c) in enumerate(zip(before, after)) for a in b if a not in c]
    if not removed:
        return None
    added = [a for b, c in zip(before, after) for a in c if a not in b]
    if added:
        return f"is an all-to-all: axes {sorted(set(added))} move to other dimensions"
    if len(removed) > 1 or before[removed[0][0]] != (removed[0][1],):
        return (f"removes {[a for _, a in removed]} from dimensions {spec_of_axes(before)}; the op gathers one axis "
                f"of one dimension")
    changed = [d for d, (b, c) in enumerate(zip(before, after)) if b != c]
    return removed[0] if changed == [removed[0][0]] else "changes the sharding of other dimensions too"


def scattered_dim(y_dims, target_dims, axis: str) -> int | str:
    """The row dimension a reduce-scatter over `axis` splits to turn the product's sharding
    `y_dims` into `target_dims`, or why the resharding is not one such scatter."""
    scattered = [d for d, (a, b) in enumerate(zip(y_dims, target_dims)) if axis in b and axis not in a]
    if not scattered:
        return (f"the contraction is split over {axis!r} and the result is not scattered over it along one row "
                f"dimension (an all-reduce, e.g. a data-parallel weight gradient); the op reduce-scatters: an "
                f"out_sharding= with {axis!r} on a row dimension makes it matmul_rs")
    rest_same = all(a == b for d, (a, b) in enumerate(zip(y_dims, target_dims)) if d not in scattered)
    if len(scattered) != 1 or target_dims[scattered[0]] != (axis,) or y_dims[scattered[0]] or not rest_same:
        return (f"the product, sharded {spec_of_axes(y_dims)} by its operands, becomes {spec_of_axes(target_dims)}: "
                f"more than a scatter over {axis!r} of one unsharded row dimension, which the op does")
    return scattered[0]
