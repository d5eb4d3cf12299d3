"""Which leaves of a call's arguments `overlap()` traces and which it closes over as static values.

The rule is jax.jit's, with Python options recognised without `static_argnames`: a leaf that is not
a valid JAX type (a str, a callable, any other object) and a Python bool (it steers Python control
flow, `if use_bias:`) are static; arrays are traced. Python numbers are traced when `overlap(f)` is
called outside any transformation, as `jax.jit` traces them, so a new value reuses the program. A
Python number that reaches `overlap(f)` while its other arguments are tracers was kept static by
the enclosing transformation (`jax.jit(overlap(f), static_argnames=...)`), so it stays static here.
Where a traced Python number meets Python control flow, the error says how to make it static.
Every static value is part of the trace's cache key: two calls with different options are traced
separately.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


class _ByIdentity:
    """A cache key for an unhashable static value: the value itself (kept alive), compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return id(self.value)

    def __eq__(self, other):
        return isinstance(other, _ByIdentity) and other.value is self.value


def _static_key(value):
    try:
        hash(value)
    except TypeError:
        return _ByIdentity(value)
    return type(value), value  # the type too: True == 1 == 1.0, but they are different programs


def _is_static(leaf, under_trace: bool) -> bool:
    if isinstance(leaf, bool):
        return True
    if isinstance(leaf, (np.generic, np.ndarray, jax.Array, jax.core.Tracer)):
        return False
    if isinstance(leaf, (int, float, complex)):
        return under_trace
    try:
        jax.typeof(leaf)
    except TypeError:
        return True
    return False


@dataclasses.dataclass(frozen=True)
class CallArgs:
    """The leaves of `(args, kwargs)`: the traced ones, and the static ones by position."""

    in_tree: Any
    static: tuple[tuple[int, Any], ...]  # (leaf index, value)
    traced: tuple[Any, ...]

    @classmethod
    def of(cls, args, kwargs) -> "CallArgs":
        leaves, in_tree = jax.tree.flatten((args, kwargs))
        under_trace = any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
        static = tuple((i, leaf) for i, leaf in enumerate(leaves) if _is_static(leaf, under_trace))
        positions = {i for i, _ in static}
        return cls(in_tree, static, tuple(leaf for i, leaf in enumerate(leaves) if i not in positions))

    def key(self) -> tuple:
        """What one trace is valid for: the tree, the static values, the traced leaves' types."""
        return (self.in_tree, tuple((i, _static_key(v)) for i, v in self.static),
                tuple(jax.typeof(x) for x in self.traced))

    def traced_python_numbers(self) -> list[int]:
        """Positions among the traced leaves of plain Python numbers (their values became tracers)."""
        return [i for i, leaf in enumerate(self.traced) if type(leaf) in (int, float, complex)]

    def rebuild(self, traced) -> tuple[tuple, dict]:
        """(args, kwargs) with the static leaves put back among `traced` (tracers while tracing)."""
        traced = iter(traced)
        static = dict(self.static)
        leaves = [static[i] if i in static else next(traced) for i in range(len(self.static) + len(self.traced))]
        return jax.tree.unflatten(self.in_tree, leaves)
