"""The matmuls of Auto-mode (GSPMD / Shardy) programs: each becomes ``ficco_jax.dot_general``.

On a mesh whose axes are ``AxisType.Auto`` (``jax.jit`` with in/out shardings,
``with_sharding_constraint``, Flax Linen's logical axes) the program states no shardings in its
types: the partitioner chooses them at compile time, after JAX. So no pattern is matched here,
and none is guessed: every floating-point ``dot_general`` of global code on such a mesh (with more
than one device) is bound as ``ficco_jax.dot_general`` (ops/partitioned.py), a custom-partitioned
dot whose partition callback sees the shardings the partitioner chose and lowers to ag_matmul,
matmul_rs, matmul_psum or the local dot accordingly. The schedule overlap() is given goes to
that op as given; which op runs, and whether the given schedule fits it, is known only there
(a schedule an op refuses runs as "auto" there, with a warning).

A program is Auto-mode where the types' mesh has Auto axes, or, where the types name no mesh (no
``jax.set_mesh``), where the concrete mesh overlap() found (the context's or the arguments') has.
Code that writes shard_maps (in this jaxpr or one nested in it) has chosen where it communicates:
its parallel layers are those shard_maps (match_tp.py's sites), and its global matmuls (an
embedding, an output head) stay as written; ``ficco_jax.dot_general`` can be given to them directly.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from ..ops import partitioned
from . import match_tp
from .jaxpr_util import fmt, open_jaxpr, source_line, sub_jaxprs
from .shardings import is_gspmd, mesh_of, split_axes
from .site import MatchContext, Site, SiteRecord

#: The ops a partitioned dot may lower to: overlap(ops=...) without all of them leaves the dots alone.
OPS = (match_tp.AG, match_tp.RS, match_tp.AR)
OP = "dot_general"
_DOT = "dot_general"
_SHARD_MAP = "shard_map"


@dataclasses.dataclass(kw_only=True)
class PartitionedDotSite(Site):
    """A dot of an Auto-mode program, run as ficco_jax.dot_general with the schedule given to overlap()."""

    def op_shapes(self):
        return tuple(v.aval.shape for v in self.dot.invars)

    def weight_atom(self):
        return self.dot.invars[1]

    def defer_schedule(self, given) -> tuple:
        """(schedule handed to the op, how explain() shows it, note): the given one, resolved per
        partition by the op the partitioner's shardings imply ("autotune" measures nothing there:
        "auto")."""
        schedule = "auto" if given == "autotune" else given
        return schedule, f"{schedule} (per partition)", ("the op is picked at compile time from the partitioner's "
                                                        "shardings: ag_matmul, matmul_rs, matmul_psum or the local dot")

    def run(self, read: Callable, write: Callable) -> None:
        params = self.dot.params
        lhs, rhs = (read(v) for v in self.dot.invars)
        out = partitioned.dot_general(lhs, rhs, params["dimension_numbers"], params["precision"],
                                      params["preferred_element_type"], schedule=self.schedule)
        write(self.dot.outvars[0], out)


def auto_mesh(jaxpr, mesh) -> object | None:
    """The Auto mesh (with more than one device) the global code `jaxpr` is partitioned over, if
    it is Auto-mode and writes no shard_map: its types' mesh, else `mesh` (the one overlap()
    found); None otherwise."""
    if _writes_shard_map(jaxpr):
        return None
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != _DOT:
            continue
        meshes = [mesh_of(v.aval) for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape")]
        typed = next((m for m in meshes if m is not None), None)
        if typed is not None:
            return typed if is_gspmd(typed) else None
        break
    return mesh if is_gspmd(mesh) and split_axes(mesh) else None


def _writes_shard_map(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == _SHARD_MAP:
            return True
        for sub in sub_jaxprs(eqn.params).values():
            if any(_writes_shard_map(open_jaxpr(j)[0]) for j in (sub if isinstance(sub, (tuple, list)) else (sub,))):
                return True
    return False


def find(ctx: MatchContext, mesh) -> list[Site | SiteRecord]:
    """A site per floating-point dot_general of `ctx`'s jaxpr, global code on the Auto mesh `mesh`."""
    missing = [op for op in OPS if ctx.not_enabled(op)]
    axes = ",".join(split_axes(mesh))
    found: list[Site | SiteRecord] = []
    for j, eqn in enumerate(ctx.eqns):
        if eqn.primitive.name != _DOT or j in ctx.taken_dots:
            continue
        lhs, rhs = (v.aval for v in eqn.invars)
        shapes = f"{fmt(lhs)} · {fmt(rhs)} -> {fmt(eqn.outvars[0].aval)}"
        where = f"{ctx.where}eqn {j}"
        if not (jnp.issubdtype(lhs.dtype, jnp.floating) and jnp.issubdtype(rhs.dtype, jnp.floating)):
            continue  # integer dots are no matmul sites
        if missing:
            found.append(SiteRecord(OP, where, axes, shapes, "", "",
                                    f"the partitioner may lower it to {', '.join(missing)}, not in ops=",
                                    source=source_line(eqn)))
            continue
        site = PartitionedDotSite(op=OP, axis_name=axes, axis_size=mesh.size, exec_index=j, skip=(j,), dot=eqn,
                                  collective=eqn)
        site.record = SiteRecord(OP, where, axes, shapes, "", "", source=source_line(eqn))
        ctx.taken_dots.add(j)
        found.append(site)
    return found
