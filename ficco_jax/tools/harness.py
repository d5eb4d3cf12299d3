"""What the benchmark tools share: a result row, verifying a variant against the reference before
timing it, the dtypes and tolerances, and the schedules a `--schedules` argument names."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from ..runtime import extension
from ..schedule import Schedule
from ..tuning import timing

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16",
          "f32": "float32", "float32": "float32"}


@dataclass
class Row:
    op: str
    shape: str
    M: int
    K: int
    N: int
    variant: str
    median_ms: float | None = None
    spread_ms: float | None = None
    verified: bool | None = None
    rel_err: float | None = None
    selected: bool = False
    note: str = ""
    extra: dict = field(default_factory=dict)


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def verify_then_time(row: Row, make, args, want, dtype) -> Row:
    """Fill `row`: check `make(None)(*args)` against `want`, and only if it agrees time `make(R)`
    (R repetitions in one jit, timing.device_time). A failing variant is reported, not fatal."""
    try:
        row.rel_err = rel_err(make(None)(*args), want)
        row.verified = row.rel_err < TOLERANCE[dtype]
        if row.verified:
            t = timing.device_time(make, args)
            row.median_ms, row.spread_ms = t["median_s"] * 1e3, t["spread_s"] * 1e3
        else:
            row.note = f"WRONG RESULT: rel err {row.rel_err:.3g}; not timed"
    except Exception as exc:  # noqa: BLE001 - the run goes on and the table says what broke
        row.note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


def listed_schedules(op, schedules_arg, n, comms) -> list[Schedule]:
    """The schedules `--schedules` names for `op`: auto (none listed) | all | xla | dma | a list."""
    if schedules_arg == "all":
        return Schedule.enumerate(op, n, comms)
    if schedules_arg in ("xla", "dma"):
        return Schedule.enumerate(op, n, (schedules_arg,))
    if schedules_arg == "auto":
        return []
    try:
        return [Schedule.parse(s) for s in schedules_arg.split(",")]
    except ValueError as exc:
        raise ValueError(f"--schedules {schedules_arg!r}: {exc}. 'auto', 'all', 'dma' and 'xla' stand alone; "
                         f"a list names schedules (ficco auto's pick is timed in every run)") from None


def extension_info() -> dict | None:
    """The compiled extension's build_info (version, CUDA build, FFI ABI), None without it."""
    try:
        return dict(extension.build_info()) if extension.available() else None
    except ImportError:
        return None
