"""What `overlap()` was asked for (which ops, which schedule) and what each site gets of it: the
schedule handed to the site's op, how `explain()` shows it, and, where the site keeps the plain
path (`comm="none"`: the collective, then the matmul, nothing overlapped), why."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence


from .. import ops
from ..ops.measure import time_op
from ..schedule import Schedule, overlap_shape_problem
from ..tuning import policy
from .matchers import ALL_OPS
from .site import Site

logger = logging.getLogger("ficco_jax")

#: How explain() shows an autotuned site whose pick needs a measurement.
AUTOTUNE_LATER = "measured when traced under jit (autotune)"


class _WouldMeasure(Exception):
    """Autotune's pick for a site needs timing runs, which explain() does not make."""


def _refuse_to_measure(*_args, **_kwargs):
    raise _WouldMeasure


def plain_path_note(site: Site, chosen: Schedule, how: str = "auto") -> str:
    """Why `chosen` keeps the plain path at `site` ("" when it overlaps).

    `how` the schedule was chosen: "given" (the user's), "auto" (the cost model) or "autotune"."""
    if chosen.comm != "none":
        return ""
    if how == "given":
        return "plain path: schedule comm='none' was given"
    # Shapes no overlapped schedule can take come first: forcing a schedule would not change them.
    reason = (overlap_shape_problem(site.op, site.op_shapes(), site.axis_size)
              or policy.plain_path_reason(site.axis_size))
    if reason:
        return f"plain path: {reason}"
    if how == "autotune":
        return "plain path: autotune measured it fastest for this site"
    return "plain path: the cost model predicts no gain from overlapping this site"


@dataclasses.dataclass(frozen=True)
class Options:
    schedule: Any  # "auto" | "autotune" | Schedule
    ops: tuple[str, ...]
    # Times autotune's candidates; None while explaining, which runs no timing jobs.
    measure: Callable | None = dataclasses.field(default=None, compare=False)

    def measuring(self) -> "Options":
        """These options for a call: autotune measures its candidates during the analysis, outside
        every shard_map body (a timing job cannot run inside the op's own trace there)."""
        return dataclasses.replace(self, measure=time_op)

    @classmethod
    def make(cls, schedule, autotune: bool, ops: Sequence[str]) -> "Options":
        if isinstance(ops, str) or not isinstance(ops, (tuple, list, set, frozenset)):
            raise TypeError(
                f"overlap: ops must be a sequence of op names from {ALL_OPS}, found "
                f"{'the str ' if isinstance(ops, str) else ''}{ops!r}; write ops=({ops!r},)"
            )
        if not isinstance(autotune, bool):
            raise TypeError(f"overlap: autotune must be a bool, found {autotune!r}")
        unknown = [op for op in ops if op not in ALL_OPS]
        if unknown:
            raise ValueError(f"overlap: unknown ops {unknown}; valid ops: {ALL_OPS}")
        if autotune:
            schedule = "autotune"
        elif isinstance(schedule, str) and schedule not in ("auto", "autotune"):
            schedule = Schedule.parse(schedule)
        elif not isinstance(schedule, (str, Schedule)):
            raise TypeError(f"overlap: schedule must be 'auto', 'autotune', a Schedule or its string; found {schedule!r}")
        return cls(schedule, tuple(ops))

    def resolve(self, site: Site) -> tuple[Any, str, str]:
        """The schedule handed to the op at `site`, how to show it, and the plain-path note."""
        if hasattr(site, "defer_schedule"):  # the op is picked at compile time (match_gspmd.py)
            return site.defer_schedule(self.schedule)
        # The axis locates the peers, so "auto" keeps copy engines for in-process groups of a
        # multi-process program.
        where = {"axis_name": site.axis_name, "mesh": site.mesh, "out_dtype": site.out_dtype}
        args = (site.op_shapes(), site.dtype, site.axis_size)
        refused = ""  # why the given schedule does not fit this site
        if self.schedule == "autotune":
            return self._autotune(site, args, where)
        if isinstance(self.schedule, Schedule):
            given = self.schedule.for_op(site.op)  # column chunks: row chunks at a gather site
            try:
                try:
                    chosen = ops.resolve_schedule(site.op, given, *args, **where)
                    shown = str(given) if given == self.schedule else f"{given} (given {self.schedule}; {site.op} cuts rows)"
                    return chosen, shown, plain_path_note(site, chosen, how="given")
                except TypeError as err:
                    # Numerics the executor lacks (bf16 partials rounded from f32 products): the same
                    # steps on XLA's collectives, which cut rows (where the rows allow, else "auto").
                    if given.comm != "dma":
                        raise
                    chosen = ops.resolve_schedule(site.op, ops.on_xla(given), *args, **where)
                    why = str(err).split(": ", 1)[-1].split(";")[0]
                    return chosen, f"{chosen} (given {self.schedule}; {why})", ""
            except ValueError as err:
                # The other sites keep the given schedule; this one says why it does not.
                logger.warning("ficco_jax.overlap: schedule %s does not fit the %s site at %s: using 'auto' "
                               "there instead (%s)", self.schedule, site.op, site.record.where, err)
                refused = f"given {self.schedule} does not fit this site: {err}"
        chosen = ops.resolve_schedule(site.op, "auto", *args, **where)
        return chosen, f"{chosen} (auto)", refused or plain_path_note(site, chosen)

    def _autotune(self, site: Site, args, where) -> tuple[Any, str, str]:
        """Autotune's pick at `site`: measured now when the options measure; else known where that
        needs no timing run (a cached winner, a plain path it never measures), or "autotune"."""
        try:
            chosen = ops.resolve_schedule(site.op, "autotune", *args, **where,
                                          measure=self.measure or _refuse_to_measure)
        except _WouldMeasure:
            return "autotune", AUTOTUNE_LATER, ""
        return chosen, f"{chosen} (autotune)", plain_path_note(site, chosen, how="autotune")
