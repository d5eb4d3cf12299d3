"""A site of global-view code (match_global.py): the site match_tp.py finds in the per-device body
of the program's matmul and collective, run inside a ``jax.shard_map`` over the mesh with the
operands' own shardings as in_specs and the results' as out_specs."""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax

from .. import config, ops
from . import match_tp
from .jaxpr_util import fmt, open_jaxpr
from .shardings import mesh_of, spec_of, typed
from .site import MatchContext, Site

AG, RS, AR = match_tp.AG, match_tp.RS, match_tp.AR
# The per-device body of a global site is matched as a shard_map body, except that a sum it
# returns is read on by the program (match_global decides that on the program itself).
_LOCAL_MATCHERS = {**match_tp.MATCHERS, "psum": match_tp.match_all_reduce, "psum_invariant": match_tp.match_all_reduce}
_LOCAL_EQN = re.compile(r"(^|; )eqn \d+: ")


@dataclasses.dataclass(kw_only=True)
class GlobalSite(Site):
    """A global-view site: its op runs on the local blocks inside a shard_map over the mesh.

    `local` is the same site as match_tp.py finds it in the shard_map body; this site moves the
    global operands into that body and the results out of it.
    """

    local: Site
    shard_mesh: object  # the mesh the shard_map is over (the types' abstract mesh)
    reads: tuple  # global variables handed to the shard_map, with their in_specs
    in_specs: tuple
    writes: tuple  # global variables it defines, with their out_specs
    out_specs: tuple
    local_in: tuple  # the body's inputs and outputs, in the order of reads / writes
    local_out: tuple
    # Whether jax can infer the replication the out_specs state. The out_specs are the program's
    # own types, which the matcher checked the body computes; but a gathered operand is equal on
    # every device of its axis while its type says it varies, so an output computed from it (or
    # the gathered rows the op also returns) has a replication that is asserted, not inferred.
    check_vma: bool = True
    # The dtype the program casts the scattered product to after its reduction (a mixed-precision
    # backward rounds the f32 sum to bf16): the op sums f32 partials, as the partitioner does,
    # and its result is cast after the shard_map.
    cast_after: object = None
    more_dots: tuple = ()  # the program's other dots the op serves (an ag_matmul of several weights)

    @property
    def dots(self) -> tuple:
        return (self.dot, *self.more_dots)

    def op_shapes(self):
        return self.local.op_shapes()

    def run(self, read: Callable, write: Callable) -> None:
        """Run the local site in a shard_map; the outputs have exactly the global types written."""
        self.local.schedule, self.local.record = self.schedule, self.record

        def body(*blocks):
            env, out = dict(zip(self.local_in, blocks)), {}
            self.local.run(env.__getitem__, out.__setitem__)
            return tuple(out[v] for v in self.local_out)

        fn = jax.shard_map(body, mesh=self._shard_map_mesh(), in_specs=self.in_specs, out_specs=self.out_specs,
                           check_vma=self.check_vma)
        # Differentiated, the op's backward sums and then casts, as the partitioner does this program's.
        with ops.partitioner_numerics():
            results = fn(*[read(v) for v in self.reads])
        for var, value in zip(self.writes, results):
            write(var, value if self.cast_after is None else value.astype(self.cast_after))

    def _shard_map_mesh(self):
        # The types' abstract mesh: copy-engine calls find their devices from the run
        # (lowering/dma/groups.py), so the rewritten program holds no device and runs under every mesh
        # of this shape, as the written one does. Across processes a group checks that it runs on the
        # devices it was lowered for, which the lowering then needs: the concrete mesh where known.
        concrete = self.mesh
        if (jax.process_count() > 1 and isinstance(concrete, jax.sharding.Mesh)
                and concrete.abstract_mesh == self.shard_mesh):
            return concrete
        return self.shard_mesh


def _specs(values) -> tuple:
    return tuple(spec_of(v.aval) for v in values)


def _trace_local(mesh, local_fn: Callable, reads, writes, check_vma: bool):
    """The jaxpr of a shard_map of `local_fn` over `mesh`, from the blocks of `reads` to those of `writes`."""
    return jax.make_jaxpr(jax.shard_map(local_fn, mesh=mesh, in_specs=_specs(reads), out_specs=_specs(writes),
                                        check_vma=check_vma))(*[v.aval for v in reads])


def _replication_inferred(mesh, local_fn: Callable, reads, writes) -> bool:
    """Whether jax infers the replication the types of `writes` state of `local_fn`'s results."""
    try:
        _trace_local(mesh, local_fn, reads, writes, check_vma=True)
    except Exception:  # noqa: BLE001 - jax's replication check refuses it; the body traced without it
        return False
    return True


def _local_site(mesh, local_fn: Callable, reads, writes, where: str,
                cast_after=None) -> tuple[Site, tuple, tuple] | str:
    """(the site match_tp.py finds in the shard_map body `local_fn` is, the body's inputs, its
    outputs), or why it finds none; `cast_after`: the dtype its results are cast to after it."""
    # Traced without the replication check, which would insert pvary casts between the body's
    # inputs and the site's matmul.
    try:
        traced = _trace_local(mesh, local_fn, reads, writes, check_vma=False)
    except Exception as err:  # noqa: BLE001 - a site jax cannot express per device stays as written
        return f"its per-device form does not trace ({type(err).__name__}: {(str(err).splitlines() or [''])[0]})"
    # The shard_map's results are read as the program's values: a body whose blocks do not make
    # them up (shapes, dtypes) is no form of this site.
    if [(a.shape, cast_after or a.dtype) for a in traced.out_avals] != [(v.aval.shape, v.aval.dtype) for v in writes]:
        return (f"its per-device form gives {', '.join(fmt(a) for a in traced.out_avals)}, not "
                f"{', '.join(typed(v) for v in writes)}")
    (eqn,) = traced.jaxpr.eqns
    body, _ = open_jaxpr(eqn.params["jaxpr"])
    ctx = MatchContext.of(body, dict(mesh.shape), where, (AG, RS, AR))
    for i, inner in enumerate(body.eqns):
        match = _LOCAL_MATCHERS.get(inner.primitive.name)
        if match is not None:
            found = match(ctx, i)
            if isinstance(found, Site):
                return found, tuple(body.invars), tuple(body.outvars)
            return _LOCAL_EQN.sub(r"\1", found.reason)  # the body's equation numbers mean nothing in the program
    return "the local body has no collective"  # pragma: no cover - local_fn always writes one


def local_dot(dot, x, w, side: int):
    """`dot`'s dot_general on local blocks, `x` on `side`, without the global out_sharding."""
    params = {k: v for k, v in dot.params.items() if k in ("dimension_numbers", "precision", "preferred_element_type")}
    lhs, rhs = (x, w) if side == 0 else (w, x)
    return jax.lax.dot_general(lhs, rhs, **params)


def global_site(ctx: MatchContext, local_fn: Callable, reads: tuple, writes: tuple, cast_after=None,
                 **site) -> GlobalSite | str:
    """The GlobalSite running the site found in `local_fn` (a shard_map body reading the blocks of
    `reads`, returning those of `writes`, before a cast to `cast_after` where given) over the mesh
    of `reads[0]`, or why there is none."""
    mesh = mesh_of(reads[0].aval)
    found = _local_site(mesh, local_fn, reads, writes, ctx.where, cast_after)
    if isinstance(found, str):
        return found
    local, local_in, local_out = found
    if len(local.dots) != 1 + len(site.get("more_dots", ())):
        return "its matmuls do not read the gathered tensor alike in their per-device form"
    fp8 = {}
    if local.scales is not None:  # the global values the local site's FP8 operands and scales are blocks of
        outer = dict(zip(local_in, reads))
        fp8 = {"fp8_act": outer.get(local.fp8_act), "fp8_weight": outer[local.fp8_weight],
               "scales": tuple(outer[s] for s in local.scales), "scale_casts": local.scale_casts}
    elif any(config.is_fp8(v.aval.dtype) for v in reads):
        return ("the matmul multiplies FP8 tensors as they are; the FP8 ops take them dequantized as "
                "convert → multiply by a scalar scale, with the scale")
    return GlobalSite(axis_size=int(mesh.shape[site["axis_name"]]), local=local, shard_mesh=mesh, reads=reads,
                      in_specs=_specs(reads), writes=writes, out_specs=_specs(writes), local_in=local_in,
                      local_out=local_out, check_vma=_replication_inferred(mesh, local_fn, reads, writes),
                      cast_after=cast_after, **fp8, **site)
