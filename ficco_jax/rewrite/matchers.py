"""`find_sites`: every matcher family over one jaxpr, as one list of sites and one of near-misses."""
from __future__ import annotations

from typing import Sequence

from . import match_ep, match_global, match_gspmd, match_tp
from .site import MatchContext, Site, SiteRecord

# Tensor-parallel first, then expert-parallel: the order explain() lists a body's sites in.
# Each family maps a collective primitive to its matcher.
FAMILIES = (match_tp.MATCHERS, match_ep.MATCHERS)
# Outside every shard_map the collectives are implied by the explicit shardings of the types.
GLOBAL_FAMILIES = match_global.FAMILIES
ALL_OPS = (*match_tp.OPS, *match_ep.OPS)


def find_sites(jaxpr, axis_sizes: dict | None, where: str, ops: Sequence[str],
               mesh=None) -> tuple[list[Site], list[SiteRecord]]:
    """Sites and near-misses of one jaxpr (not of its sub-jaxprs). `axis_sizes` maps the mesh axes
    of the enclosing shard_maps; None: the jaxpr is global-view code outside all of them, whose
    dots on an Auto mesh (the types', else `mesh`) the partitioner decides (match_gspmd.py)."""
    ctx = MatchContext.of(jaxpr, axis_sizes or {}, where, ops)
    auto_mesh = None if axis_sizes is not None else match_gspmd.auto_mesh(jaxpr, mesh)
    if auto_mesh is not None:
        found = match_gspmd.find(ctx, auto_mesh)
        return [s for s in found if isinstance(s, Site)], [r for r in found if not isinstance(r, Site)]
    sites: list[Site] = []
    misses: list[SiteRecord] = []
    for matchers in FAMILIES if axis_sizes is not None else GLOBAL_FAMILIES:
        for i, eqn in enumerate(ctx.eqns):
            match = matchers.get(eqn.primitive.name)
            found = None if match is None else match(ctx, i)
            if isinstance(found, Site):
                sites.append(found)
                # A matmul feeds one op only: a later collective beside it is a near-miss.
                ctx.taken_dots.update(ctx.eqns.index(dot) for dot in found.dots)
            elif found is not None:
                misses.append(found)
    return sites, misses
