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
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from ..ops import partitioned
from . import match_tp
from .jaxpr_util import fmt, source_line
from .shardings import is_gspmd, mesh_of, split_axes
from .site import MatchContext, Site, SiteRecord

#: The ops a partitioned dot may lower to: overlap(ops=...) without all of them leaves the dots alone.
OPS = (match_tp.AG, match_tp.RS, match_tp.AR)
OP = "dot_general"
_DOT = "dot_general"


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
    it is Auto-mode: its types' mesh, else `mesh` (the one overlap() found); None otherwise."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != _DOT:
            continue
        meshes = [mesh_of(v.aval) for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape")]
        typed = next((m for m in meshes if m is not None), None)
        if typed is not None:
            return typed if is_gspmd(typed) else None
        break
    return mesh if is_gspmd(mesh) and split_axes(mesh) else None


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
