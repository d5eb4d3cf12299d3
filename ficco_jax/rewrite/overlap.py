"""`overlap(fn)`: rewrite the collective+matmul sites inside every `shard_map` of `fn` into ficco ops.

``overlap(fn)(*args)`` computes exactly ``fn(*args)``. It traces `fn` to a jaxpr once per argument
signature (Python options such as bools, strings and callables are static, as jax.jit's static
arguments; see arguments.py), finds ``all_gather → matmul``, ``matmul → psum_scatter`` and
``matmul → psum`` sites inside each `shard_map` body (also inside scan / cond / while / jit /
checkpoint bodies nested there; see match_tp.py for the matching rules), and evaluates the jaxpr
again with each site replaced by ``ag_matmul`` / ``matmul_rs`` / ``matmul_psum`` and everything
else bound as it was written. The expert-parallel
forms ``all_to_all → expert matmul`` and ``expert matmul → all_to_all`` (4-D per-peer blocks,
match_ep.py) become ``a2a_matmul`` / ``matmul_a2a`` the same way. Outside every shard_map, code
written on global arrays with explicit shardings (``AxisType.Explicit`` mesh axes) has the same
tensor-parallel sites, implied by its ``reshard`` / ``out_sharding``; each becomes its op inside
a shard_map over the mesh (match_global.py). Every site is a `site.Site`; `matchers.find_sites`
finds them, and this module only resolves schedules and re-binds.

Arguments: `fn` is traced over copies of its arguments rebuilt from their leaves, objects shared
between paths kept shared (arguments.py); what `fn` writes into them in place (an NNX Variable
assigned, as ``optimizer.update(model, grads)`` does; a dict entry) is an output of the rewritten
program and written back into the caller's objects on each call (effects.py). A jax Ref argument
is updated by the program itself.

Composition: the result is an ordinary traceable function, so ``jit(overlap(f))``,
``grad(overlap(f))`` (the ops' transposes overlap the backward pass) and ``overlap(grad(f))``
(the backward collectives are in the traced jaxpr and are rewritten too) all work, and so does
``shard_map(overlap(body))`` (traced under the manual axes, `body` is a shard_map body). `fn` is
traced as often as jax.jit traces it, once per signature, in every wrap form (``overlap(overlap(f))``
too): a function with no site runs the jaxpr that trace made, as jit runs it. Every equation is
bound under its own names (``jax.named_scope``, ``jax.named_call``) and traceback, and an op under
those of the matmul it replaces, so profiles and HLO metadata name the rewritten program's
operations as the program's own. A function that cannot be traced (Python control flow on an array's
value) runs as written when called outside any transformation, with a warning. A trace is keyed by
the arguments and by the context (the `jax.set_mesh` mesh, the default matmul precision).

``explain(fn, *args)`` returns the sites and near-misses as a `Report`; the same records are
logged at DEBUG level on the ``"ficco_jax"`` logger when a signature is first traced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jex
import numpy as np

from .. import jax_compat
from ..runtime import topology
from ..schedule import Schedule
from .arguments import CallArgs
from .effects import Effects, replaced_leaves, write_back
from .jaxpr_util import open_jaxpr, sub_jaxprs, written_as
from .matchers import ALL_OPS, find_sites
from .options import AUTOTUNE_LATER, Options
from .site import SiteRecord

__all__ = ["overlap", "explain", "Report", "SiteRecord"]

logger = logging.getLogger("ficco_jax")

_SHARD_MAP = "shard_map"
# Sub-jaxprs of these are user-written custom derivatives: rewriting their primal body alone
# would make it disagree with the rule the user wrote, so their sites are only reported.
_CUSTOM_RULES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")


class Report(list):
    """The `SiteRecord`s of one traced function: rewritten sites, then near-misses (those of an
    `overlap`-wrapped function it calls follow, their `where` prefixed with ``overlap(name)/``);
    `untraceable` says why a function that could not be traced runs as written."""

    def __init__(self, records=(), untraceable: str = ""):
        super().__init__(records)
        self.untraceable = untraceable

    @property
    def sites(self) -> list[SiteRecord]:
        """Every site matched: overlapped or keeping the plain path."""
        return [r for r in self if r.rewritten]

    @property
    def overlapped(self) -> list[SiteRecord]:
        return [r for r in self if r.overlapped]

    @property
    def plain_path(self) -> list[SiteRecord]:
        return [r for r in self if r.rewritten and r.plain_path]

    @property
    def near_misses(self) -> list[SiteRecord]:
        return [r for r in self if not r.rewritten]

    @property
    def awaiting_autotune(self) -> bool:
        """Whether a site's schedule is measured when the function is called (explain() measures nothing)."""
        return any(r.schedule == AUTOTUNE_LATER for r in self.sites if not r.nested_in)

    def __str__(self) -> str:
        if self.untraceable:
            return f"ficco_jax.overlap: {self.untraceable}"
        if not self:
            return ("ficco_jax.overlap: no all_gather/psum_scatter/all_to_all found inside a shard_map, and no "
                    "matmul next to a resharding in explicitly sharded code")
        header = ("", "op", "where", "axis", "shapes", "op operands", "schedule / why not")
        rows = [(_mark(r), r.op, f"{r.where} at {r.source}" if r.source else r.where,
                 r.axis_name, r.shapes, r.matmul_2d, _outcome(r)) for r in self]
        widths = [max(len(str(row[c])) for row in (header, *rows)) for c in range(len(header) - 1)]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + str(row[-1])
                 for row in (header, *rows)]
        return "\n".join([self.summary(), *lines])

    def summary(self) -> str:
        """``2 site(s): 1 overlapped, 1 keeps the plain path; 3 near-miss(es)``, and which nested
        overlap() calls rewrite sites of their own."""
        text = (f"{len(self.sites)} site(s): {len(self.overlapped)} overlapped, {len(self.plain_path)} "
                f"{'keeps' if len(self.plain_path) == 1 else 'keep'} the plain path; "
                f"{len(self.near_misses)} near-miss(es)")
        nested = sorted({r.nested_in for r in self if r.nested_in})
        if nested:
            text += (f" (including those of the nested {', '.join(f'overlap({n})' for n in nested)}, "
                     f"which rewrite{'s' if len(nested) == 1 else ''} them when called)")
        return text


def _mark(record: SiteRecord) -> str:
    """The first column: ok (overlapped), = (plain path: the program as written), -- (near-miss)."""
    return "ok" if record.overlapped else "=" if record.rewritten else "--"


def _outcome(record: SiteRecord) -> str:
    if not record.rewritten:
        return record.reason
    return f"{record.schedule}; {record.note}" if record.note else record.schedule


# --------------------------------------------------------------------------------------------
# Analysis: a plan per jaxpr, mirroring its nesting
# --------------------------------------------------------------------------------------------
_PLAIN = Schedule(comm="none")


@dataclasses.dataclass
class _Plan:
    sites_at: dict = dataclasses.field(default_factory=dict)  # eqn index -> [Site] run there
    skip: set = dataclasses.field(default_factory=set)  # eqn indices the sites replace
    children: dict = dataclasses.field(default_factory=dict)  # eqn index -> {param: plan | tuple}
    changed: bool = False


@dataclasses.dataclass(frozen=True)
class _Scope:
    """What a jaxpr inherits from the equations around it."""

    where: str = ""  # path of the jaxpr, "shard_map@0/scan@2/"
    axis_sizes: dict | None = None  # mesh axes of the enclosing shard_maps; None outside all of them
    # The concrete mesh of the innermost enclosing shard_map, if it was given one (its body sees
    # only an abstract mesh), so that "auto" knows which peers share this process. Outside every
    # shard_map: the mesh of the jax.set_mesh context or of the arguments, where there is one.
    mesh: Any = None
    frozen: str | None = None  # why sites here are reported and left as written

    def inner(self, i: int, eqn) -> "_Scope":
        """The scope of the sub-jaxprs of equation `i`."""
        name = eqn.primitive.name
        axis_sizes, mesh, frozen = self.axis_sizes, self.mesh, self.frozen
        if name == _SHARD_MAP:
            axis_sizes = {**(axis_sizes or {}), **dict(eqn.params["mesh"].shape)}
            if isinstance(eqn.params["mesh"], jax.sharding.Mesh):
                mesh = eqn.params["mesh"]
        if name in _CUSTOM_RULES:
            frozen = frozen or f"inside a {name} (a user-written derivative rule): left as written"
        return _Scope(f"{self.where}{name}@{i}/", axis_sizes, mesh, frozen)


def _analyse(jaxpr, scope: _Scope, options: Options, records: list) -> _Plan:
    """The plan of `jaxpr` and its sub-jaxprs; appends every site and near-miss to `records`."""
    plan = _Plan()
    _plan_sites(plan, jaxpr, scope, options, records)
    for i, eqn in enumerate(jaxpr.eqns):
        subs = sub_jaxprs(eqn.params)
        if not subs:
            continue
        inner = scope.inner(i, eqn)
        children = {}
        for key, sub in subs.items():
            many = isinstance(sub, (tuple, list))
            plans = tuple(_analyse(open_jaxpr(s)[0], inner, options, records) for s in (sub if many else (sub,)))
            if any(p.changed for p in plans):
                children[key] = plans if many else plans[0]
        if children:
            plan.children[i] = children
            plan.changed = True
    return plan


def _plan_sites(plan: _Plan, jaxpr, scope: _Scope, options: Options, records: list) -> None:
    """The sites of `jaxpr` itself (not of its sub-jaxprs), each with its schedule, into `plan`."""
    sites, misses = find_sites(jaxpr, scope.axis_sizes, scope.where, options.ops, mesh=scope.mesh)
    for site in sites:
        site.mesh = scope.mesh
        if scope.frozen:
            records.append(dataclasses.replace(site.record, reason=scope.frozen))
            continue
        try:
            site.schedule, shown, note = options.resolve(site)
        except ValueError as err:  # shapes no schedule of the op takes: the program stays as written there
            records.append(dataclasses.replace(site.record, reason=f"the op refuses its operands: {err}"))
            continue
        site.record = dataclasses.replace(site.record, schedule=shown, note=note, plain_path=site.schedule == _PLAIN)
        records.append(site.record)
        if site.schedule == _PLAIN:
            continue  # the plain path is the program as written: leaving it adds no op, so never slower
        plan.sites_at.setdefault(site.exec_index, []).append(site)
        plan.skip.update(site.skip)
        plan.changed = True
    records.extend(misses)


# --------------------------------------------------------------------------------------------
# Evaluation: the jaxpr interpreter that applies a plan
# --------------------------------------------------------------------------------------------
def _run(plan: _Plan, jaxpr, consts, args) -> list:
    env: dict = {}

    def read(atom):
        return atom.val if isinstance(atom, jex.Literal) else env[atom]

    def write(var, value):
        env[var] = value

    for var, value in (*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)):
        write(var, value)
    for i, eqn in enumerate(jaxpr.eqns):
        for site in plan.sites_at.get(i, ()):
            with written_as(site.dot):  # the op carries the names of the matmul it replaces
                site.run(read, write)
        if i in plan.skip:
            continue
        invals = [read(v) for v in eqn.invars]
        children = plan.children.get(i)
        with written_as(eqn):
            if children is None:
                outs = _bind(eqn, invals, eqn.params)
            elif eqn.primitive.name == _SHARD_MAP:
                outs = _bind_shard_map(eqn, children["jaxpr"], invals)
            else:
                params = dict(eqn.params)
                for key, child in children.items():
                    params[key] = _rewrite_param(eqn.params[key], child)
                outs = _bind(eqn, invals, params)
        for var, value in zip(eqn.outvars, outs if eqn.primitive.multiple_results else (outs,)):
            write(var, value)
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals, params):
    # What jax.core.eval_jaxpr does per equation (under written_as): get_bind_params turns
    # sub-jaxpr params back into the callables `bind` expects.
    return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))


def _bind_shard_map(eqn, child: _Plan, invals) -> list:
    """Re-issue a shard_map through the public API with the rewritten body."""
    params = eqn.params
    body, consts = open_jaxpr(params["jaxpr"])
    manual = params["newly_manual_axes"] if "newly_manual_axes" in params else params["manual_axes"]  # jax 0.11 / 0.10
    fn = jax.shard_map(lambda *args: tuple(_run(child, body, consts, args)), mesh=params["mesh"],
                       in_specs=tuple(params["in_specs"]), out_specs=tuple(params["out_specs"]),
                       axis_names=frozenset(manual), check_vma=params["check_vma"])
    return list(fn(*invals))


def _rewrite_param(sub, child):
    if isinstance(sub, (tuple, list)):
        return type(sub)(_rewrite_param(s, c) if c.changed else s for s, c in zip(sub, child))
    body, consts = open_jaxpr(sub)
    if isinstance(sub, jex.Jaxpr) and body.constvars:
        raise NotImplementedError("ficco_jax.overlap: a sub-jaxpr with constvars cannot be rewritten")
    in_avals = [v.aval for v in body.invars]
    closed = _trace_like(lambda *args: _run(child, body, consts, args), in_avals)
    if isinstance(sub, jex.ClosedJaxpr):
        return closed
    if closed.consts:
        raise NotImplementedError("ficco_jax.overlap: the rewritten body of an open-jaxpr parameter captured constants")
    return closed.jaxpr


def _trace_like(fn: Callable, in_avals) -> jex.ClosedJaxpr:
    # The one place that relies on tracing detail: jax.make_jaxpr accepts abstract values
    # (ShapedArray, varying-manual-axes types included) as arguments, and traces in the current
    # context, so a body nested in a shard_map keeps its mesh axes and vma types.
    return jax.make_jaxpr(fn)(*in_avals)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Traced:
    # What a call runs: the rewritten jaxpr, or the jaxpr as traced where nothing is rewritten
    # (fn is traced once per signature, as jax.jit traces it); None where fn cannot be traced.
    program: jex.ClosedJaxpr | None
    out_tree: Any
    # fn's outputs that are no JAX values (a str, a Python number), by position among its output
    # leaves: returned as fn returned them, not through the program
    static_out: dict
    report: Report
    effects: Effects  # the argument leaves fn replaced: `program` outputs them after fn's outputs
    rewrites: bool = False  # whether `program` differs from fn as written
    name: str = "fn"  # fn's, which the program's jit carries into profiles and HLO metadata
    call: Callable | None = None  # flat args -> flat outputs of `program`

    def __post_init__(self):
        if self.program is None:
            return
        closed = self.program

        def overlapped(*flat):
            return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)

        overlapped.__name__ = overlapped.__qualname__ = self.name
        # Always staged: the ops' equations need a traced shard_map, and eager evaluation
        # would re-issue each shard_map per call. Inside this jit a jitted fn's donations would be
        # dropped (only the outermost jit donates), so they are made this jit's own.
        self.call = jax.jit(overlapped, donate_argnums=_donated_arguments(closed.jaxpr))


def _donated_arguments(jaxpr) -> tuple[int, ...]:
    """The positions of `jaxpr`'s arguments that a jitted function called at its top level donates
    (``overlap(jax.jit(step, donate_argnums=0))``)."""
    position = {var: i for i, var in enumerate(jaxpr.invars)}
    donated = set()
    for eqn in jaxpr.eqns:
        for var, donates in zip(eqn.invars, eqn.params.get("donated_invars", ())):
            if donates and var in position:
                donated.add(position[var])
    return tuple(sorted(donated))


class _NestedReports(threading.local):
    """The reports of the `overlap`-wrapped functions that a function being traced calls: each
    rewrites its own sites, in its own trace; the enclosing one's report lists them too."""

    def __init__(self):
        self.collecting: list[list] = []

    @contextlib.contextmanager
    def collect(self):
        found: list = []
        self.collecting.append(found)
        try:
            yield found
        finally:
            self.collecting.pop()

    def add(self, name: str, report: Report) -> None:
        if self.collecting:
            self.collecting[-1].extend(
                dataclasses.replace(r, where=f"overlap({name})/{r.where}", nested_in=r.nested_in or name)
                for r in report)


_nested = _NestedReports()


# What fn raises when traced where it needs its arrays' values (Python control flow on them).
_NEEDS_VALUES = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                 jax.errors.TracerArrayConversionError)

# Output leaves that are values of the program; any other (a str, a Python number: constants of
# the trace) is returned as it is.
_COMPUTED = (jax.core.Tracer, jax.Array, np.ndarray, np.generic)


class Overlapped:
    """`fn` with its collective+matmul sites overlapped; made by `overlap`."""

    def __init__(self, fn: Callable, options: Options):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._options = options
        self._traced: dict = {}
        self._concrete_key: dict = {}  # a key without its mesh -> the key of its latest concrete trace
        self._needs_numbers: set = set()  # keys of calls traced with their Python numbers static

    def __call__(self, *args, **kwargs):
        traced, call = self._trace(CallArgs.of(args, kwargs), measure=True)
        _nested.add(self._name(), traced.report)
        if traced.program is None or (traced.effects.refusal and not traced.rewrites):
            return self._fn(*args, **kwargs)  # untraceable, or updates only fn itself can carry
        if traced.effects.refusal:
            raise ValueError(traced.effects.refusal)
        if not traced.rewrites and any(isinstance(x, jax.core.Tracer) for x in call.traced):
            # Under a transformation the program as written is inlined, equation by equation: the
            # enclosing trace holds what fn itself would have put there.
            outs = jax.core.eval_jaxpr(traced.program.jaxpr, traced.program.consts, *call.traced)
        else:
            outs = traced.call(*call.traced)
        n_out = traced.out_tree.num_leaves - len(traced.static_out)
        write_back(self._name(), (args, kwargs), traced.effects, outs[n_out:])
        computed = iter(outs[:n_out])
        leaves = [traced.static_out[i] if i in traced.static_out else next(computed)
                  for i in range(traced.out_tree.num_leaves)]
        return jax.tree.unflatten(traced.out_tree, leaves)

    def _name(self) -> str:
        return getattr(self, "__name__", "fn")

    def explain(self, *args, **kwargs) -> Report:
        return self._trace(CallArgs.of(args, kwargs))[0].report

    def __get__(self, instance, owner=None):
        """As a method (``@overlap`` on a ``def __call__(self, x)``), bound to its instance, which
        becomes the first argument (a pytree's leaves traced, as jax.jit does)."""
        return self if instance is None else functools.partial(self, instance)

    def _trace(self, call: CallArgs, measure: bool = False) -> tuple[_Traced, CallArgs]:
        """The rewrite for these arguments in this context, and the arguments it takes (`call`, or
        `call` with its Python numbers static where fn needs their values); a call (`measure`)
        redoes one that explain() made with autotune's picks left to measure."""
        # The arguments' mesh too: global-view sites run their shard_maps over it, and jax.typeof
        # (call.key) names only its abstract mesh, the same for another order of the devices. Under
        # jit the arguments are tracers, which carry no devices: there the trace made for concrete
        # arguments of the same types is taken where there is one (their mesh is the one jit runs on).
        mesh = _concrete_mesh(call.traced)
        context = (*_trace_context(), mesh)
        key = (call.key(), *context)
        if key in self._needs_numbers:
            call = call.with_numbers_static()
            key = (call.key(), *context)
        traced = self._traced.get(self._concrete_key.get(key[:-1], key) if mesh is None else key)
        if traced is None or (measure and traced.report.awaiting_autotune):
            options = self._options.measuring() if measure else self._options
            try:
                traced = self._rewrite(call, options, mesh, warn_if_unchanged=measure)
            except Exception as err:
                if call.traced_python_numbers():
                    # fn needs a number's value (range(n), a shape, a jitted fn's static argument):
                    # as a Python number, which is what fn is given outside overlap.
                    self._needs_numbers.add(key)
                    return self._trace(call, measure)
                if not isinstance(err, _NEEDS_VALUES) or any(isinstance(x, jax.core.Tracer) for x in call.traced):
                    raise
                traced = self._untraceable(err)
            self._traced[key] = traced
            if mesh is not None:
                self._concrete_key[key[:-1]] = key
        return traced, call

    def _untraceable(self, err: Exception) -> _Traced:
        """What a call does where `fn` needs its arrays' values (Python control flow on them) and is
        called outside any transformation: `fn` itself, nothing overlapped, said once."""
        why = (f"{self._name()} cannot be traced ({type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}); "
               "it runs as written, nothing in it overlapped")
        logger.warning("ficco_jax.overlap: %s", why)
        return _Traced(None, None, {}, Report(untraceable=why), Effects())

    def _warn_if_nothing_overlaps(self, options: Options, report: Report) -> None:
        """A schedule given to overlap() asks for overlap: say so where no site of the trace gets it."""
        given = options.schedule
        if not isinstance(given, Schedule) or given.comm == "none" or report.overlapped:
            return
        if report.sites:
            why = (f"its {len(report.sites)} site(s) keep the plain path "
                   f"({next(r.note or r.reason for r in report.sites)})")
        else:
            why = f"no site found ({len(report.near_misses)} near-miss(es))"
        warnings.warn(f"ficco_jax.overlap: {self._name()} was given schedule {given} and nothing in it is "
                      f"overlapped: {why}; ficco_jax.explain({self._name()}, *args) lists each site and "
                      f"near-miss with the reason", stacklevel=5)

    def _rewrite(self, call: CallArgs, options: Options, mesh, warn_if_unchanged: bool = False) -> _Traced:
        """Trace `fn` over the traced leaves of `call` (its static ones closed over) and rewrite it;
        `mesh`: the concrete mesh of its arguments or context (_concrete_mesh), or None;
        `warn_if_unchanged`: a call (not explain) warns where a given schedule overlaps nothing."""
        out_trees, static_outs, found = [], [], []
        leaves = call.traced

        def flat_fn(*flat):
            arguments, unshared = call.rebuild(flat)
            before = jax.tree_util.tree_flatten_with_path(arguments)
            out_leaves, out_tree = jax.tree.flatten(self._fn(*arguments[0], **arguments[1]))
            static_outs.append({i: v for i, v in enumerate(out_leaves) if not isinstance(v, _COMPUTED)})
            out_leaves = [v for v in out_leaves if isinstance(v, _COMPUTED)]
            # fn may have updated its (rebuilt) arguments in place: the leaves it replaced are
            # outputs too, written back into the caller's objects by __call__ (effects.py).
            effects, replaced = replaced_leaves(self._name(), before, call.static_positions, arguments, unshared)
            out_trees.append(out_tree)
            found.append(effects)
            return [*out_leaves, *replaced]

        with _nested.collect() as nested:
            closed = jax.make_jaxpr(flat_fn)(*leaves)
        records: list = []
        plan = _analyse(closed.jaxpr, _Scope(axis_sizes=_manual_axes(), mesh=mesh), options, records)
        report = Report([*records, *nested])
        for record in report:
            logger.debug("ficco_jax.overlap %s: %s %s at %s, axis %s, %s", self._name(),
                         "rewrote" if record.rewritten else "left", record.op, record.where, record.axis_name,
                         f"{record.matmul_2d} schedule {_outcome(record)}" if record.rewritten else record.reason)
        if warn_if_unchanged:
            self._warn_if_nothing_overlaps(options, report)
        # A site whose autotune pick is not measured yet is only reported: the call measures it.
        rewrites = plan.changed and not report.awaiting_autotune
        program = closed
        if rewrites:
            program = jax.make_jaxpr(lambda *flat: _run(plan, closed.jaxpr, closed.consts, flat))(*leaves)
        return _Traced(program, out_trees[0], static_outs[0], report, found[0], rewrites, self._name())


def _trace_context() -> tuple:
    """What a trace depends on besides the arguments: the `jax.set_mesh` context (its devices, and
    the abstract mesh, whose axis types a shard_map in `fn` reads), the default matmul precision, and
    every configuration flag that changes what jax traces (x64, the PRNG implementation and
    partitioning, dtype promotion...: the key jax.jit itself retraces on). A function called under
    another mesh or flags is traced again, as jax.jit retraces it."""
    return (topology.context_mesh(), jax.sharding.get_abstract_mesh(), jax.config.jax_default_matmul_precision,
            jax_compat.trace_flags())


def _manual_axes() -> dict | None:
    """The manual mesh axes `fn` is traced under (``shard_map(overlap(body), ...)``: its body is a
    shard_map body), by size; None outside every shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
              if kind == jax.sharding.AxisType.Manual}
    return manual or None


def _concrete_mesh(leaves) -> jax.sharding.Mesh | None:
    """The mesh global-view sites run their shard_maps over: the jax.set_mesh context's, else the
    first argument's (copy-engine schedules find their peers in it when lowered)."""
    context = topology.context_mesh()  # also under jit
    if context is not None:
        return context
    arrays = (leaf for leaf in leaves if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer))
    meshes = (getattr(leaf.sharding, "mesh", None) for leaf in arrays)
    return next((m for m in meshes if isinstance(m, jax.sharding.Mesh) and not m.empty), None)


def overlap(fn: Callable | None = None, *, schedule="auto", autotune: bool = False,
            ops: Sequence[str] = ALL_OPS):
    """Return `fn` with every all_gather→matmul, matmul→psum_scatter, all_to_all→expert matmul
    and expert matmul→all_to_all (4-D, see match_ep.py) in its shard_maps overlapped, and the
    all-gather→matmul and matmul→reduce-scatter its explicit shardings imply outside them
    (match_global.py).

    ``overlap(f)(*args)`` equals ``f(*args)``, the in-place updates `f` makes to its arguments
    included (NNX Variables, dict entries, jax Refs). `schedule` applies to every site where it is
    valid ("auto" elsewhere, with a warning, and explain() says why there; column chunks cut the
    reduce-scatter sites, and the other sites take as many row chunks); ``autotune=True`` measures candidates per site when the
    function is first called (explain() shows a cached pick and measures nothing); `ops` chooses
    which patterns are rewritten. Usable as ``@overlap`` or ``@overlap(schedule=...)``.
    """
    options = Options.make(schedule, autotune, ops)
    if fn is None:
        return lambda f: overlap(f, schedule=schedule, autotune=autotune, ops=ops)
    if not callable(fn):
        raise TypeError(f"overlap: fn must be callable, found {type(fn).__name__} {fn!r}")
    return Overlapped(fn, options)


def explain(fn: Callable, /, *args, **kwargs) -> Report:
    """The sites `overlap(fn)` rewrites for these arguments, and the near-misses with reasons.

    `fn` may be an `overlap`-wrapped function (its options are used) or a plain one (defaults).
    """
    wrapped = fn if isinstance(fn, Overlapped) else overlap(fn)
    return wrapped.explain(*args, **kwargs)
