"""Which leaves of a call's arguments `overlap()` traces and which it closes over as static values.

The rule is jax.jit's, with Python options recognised without `static_argnames`: a leaf that is not
a valid JAX type (a str, a callable, any other object) and a Python bool (it steers Python control
flow, `if use_bias:`) are static; arrays are traced. Python numbers are traced when `overlap(f)` is
called outside any transformation, as `jax.jit` traces them, so a new value reuses the program. A
Python number that reaches `overlap(f)` while its other arguments are tracers was kept static by
the enclosing transformation (`jax.jit(overlap(f), static_argnames=...)`), so it stays static here.
Where `fn` cannot be traced with its Python numbers traced (it needs their values: a loop count, a
shape, a jitted fn's static argument), it is traced again with them static, once per value.
Every static value is part of the trace's cache key: two calls with different options are traced
separately.

The leaves are rebuilt into new objects for tracing, as jax.jit does; unlike jax.jit, an object
that the arguments reach through two paths (an NNX Variable shared by two modules, tied weights; a
module passed with one of its submodules) is rebuilt once and reached through both paths again,
because what `fn` does can depend on it (NNX's split, grad and optimizer tell one shared Variable
from two copies; an update through one path shows through the other). A tuple cannot be made to
hold the rebuilt object again, so an object a tuple holds twice stays two copies, and effects.py
refuses the calls where that would show. Which paths share an object is part of the cache key too. The key paths of the leaves are how effects.py writes what `fn`
replaced back into the caller's objects; `child` / `set_child` / `describe` read, write and name
the node at a path.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
import types
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, GetAttrKey, SequenceKey, keystr, tree_flatten_with_path


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
    if isinstance(value, slice):  # unhashable before Python 3.12, and equal by value
        return slice, _static_key(value.start), _static_key(value.stop), _static_key(value.step)
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


def _stateful(leaf) -> bool:
    """Whether a static leaf is an object whose contents could change between calls unseen by the
    cache key: neither hashable by value (its class keeps object's identity hash, or has none) nor
    a function, class, module or enum member (fixed once made; a function's closure is jax.jit's
    rule too)."""
    if callable(leaf) or isinstance(leaf, (type, types.ModuleType, enum.Enum, slice, type(...), type(None))):
        return False
    return type(leaf).__hash__ in (object.__hash__, None)


def _refuse_stateful(arguments, positions) -> None:
    if not positions:
        return
    paths = [path for path, _ in tree_flatten_with_path(arguments)[0]]
    leaves = jax.tree.leaves(arguments)
    where = ", ".join(f"{describe(paths[i])} ({type(leaves[i]).__name__})" for i in positions)
    raise TypeError(
        f"ficco_jax.overlap: {where}: not a JAX type, nor hashable by value. overlap traces fn once per "
        "argument structure, as jax.jit does, and closes over such an object as a static value: the arrays "
        "it holds would be frozen into the trace, and a later change to it would not be seen. Make its "
        "class a pytree (jax.tree_util.register_dataclass or register_pytree_node_class, flax.nnx.Pytree) "
        "so that its arrays are traced; or, for an object of options only, give it __eq__ and __hash__ by "
        "value (a frozen dataclass); or call overlap(f) inside jax.jit with the argument static.")


@dataclasses.dataclass(frozen=True)
class CallArgs:
    """The leaves of `(args, kwargs)`: the traced ones, and the static ones by position."""

    in_tree: Any
    static: tuple[tuple[int, Any], ...]  # (leaf index, value)
    traced: tuple[Any, ...]
    # (first path, another path) of each object reached through two paths, outermost first
    shared: tuple[tuple[tuple, tuple], ...] = ()

    @classmethod
    def of(cls, args, kwargs) -> "CallArgs":
        leaves, in_tree = jax.tree.flatten((args, kwargs))
        under_trace = any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
        static = tuple((i, leaf) for i, leaf in enumerate(leaves) if _is_static(leaf, under_trace))
        if not under_trace:
            _refuse_stateful((args, kwargs), [i for i, leaf in static if _stateful(leaf)])
        positions = {i for i, _ in static}
        traced = [i for i in range(len(leaves)) if i not in positions]
        return cls(in_tree, static, tuple(leaves[i] for i in traced), _shared_objects((args, kwargs), leaves, traced))

    def key(self) -> tuple:
        """What one trace is valid for: the tree, the static values, the traced leaves' types, the
        shared objects."""
        return (self.in_tree, tuple((i, _static_key(v)) for i, v in self.static),
                tuple(jax.typeof(x) for x in self.traced), self.shared)

    def traced_python_numbers(self) -> list[int]:
        """Positions among the traced leaves of plain Python numbers (their values became tracers)."""
        return [i for i, leaf in enumerate(self.traced) if type(leaf) in (int, float, complex)]

    def with_numbers_static(self) -> "CallArgs":
        """The same call with its traced Python numbers static (for a `fn` that needs their values)."""
        static = dict(self.static)
        positions = [i for i in range(len(self.static) + len(self.traced)) if i not in static]
        numbers = {positions[j] for j in self.traced_python_numbers()}
        static.update((i, leaf) for i, leaf in zip(positions, self.traced) if i in numbers)
        traced = tuple(leaf for i, leaf in zip(positions, self.traced) if i not in numbers)
        return dataclasses.replace(self, static=tuple(sorted(static.items())), traced=traced)

    @property
    def static_positions(self) -> tuple[int, ...]:
        return tuple(i for i, _ in self.static)

    def leaves(self, traced) -> list:
        """Every leaf of `(args, kwargs)`: the static ones put back among `traced` (tracers while tracing)."""
        traced = iter(traced)
        static = dict(self.static)
        return [static[i] if i in static else next(traced) for i in range(len(self.static) + len(self.traced))]

    def rebuild(self, traced) -> tuple[tuple[tuple, dict], list["Unshared"]]:
        """(args, kwargs) built from `leaves(traced)`: new objects, as jax.jit builds its arguments,
        each shared object once, reached through each of its paths; and the shared objects that
        stay two copies because the node holding the second cannot hold another object (a tuple)."""
        args, kwargs = jax.tree.unflatten(self.in_tree, self.leaves(traced))
        arguments = (list(args), kwargs)  # the positional arguments can be re-linked too
        unshared = []
        for first, other in self.shared:
            node = node_at(arguments, first)
            try:
                set_child(node_at(arguments, other[:-1]), other[-1], node)
            except (AttributeError, LookupError, TypeError) as err:
                unshared.append(Unshared(first, other, type(node).__name__, isinstance(node, _nnx_graph()), str(err)))
        return (tuple(arguments[0]), kwargs), unshared


@dataclasses.dataclass(frozen=True)
class Unshared:
    """An object the arguments reach through two paths, traced as two copies."""

    first: tuple
    other: tuple
    type_name: str
    observed: bool  # an NNX object: NNX's graph functions tell one shared object from two copies
    why: str  # why the node holding `other` could not be made to hold the first copy


def _shared_objects(arguments, leaves, traced_positions) -> tuple[tuple[tuple, tuple], ...]:
    """(first path, other path) of each object other than a tuple that `arguments` reach through
    two paths; an object inside a shared one is not listed again."""
    by_identity: dict[int, list[int]] = {}
    for i in traced_positions:
        by_identity.setdefault(id(leaves[i]), []).append(i)
    groups = [g for g in by_identity.values() if len(g) > 1]
    if not groups:  # a shared object shows its leaves twice; the usual call stops here
        return ()
    paths = [path for path, _ in tree_flatten_with_path(arguments)[0]]
    reached: dict[int, tuple] = {}  # id -> (node, first path); the node is kept so its id stays its own
    shared = set()
    for i in (i for group in groups for i in group):
        node = arguments
        for depth, key in enumerate(paths[i][:-1]):
            node = child(node, key)
            if node is None:
                break  # a key that names no attribute or item: the node stays a copy, as in jax.jit
            if isinstance(node, tuple):
                continue  # immutable: a copy is the same value
            prefix = paths[i][:depth + 1]
            _, first = reached.setdefault(id(node), (node, prefix))
            if first != prefix:
                shared.add((first, prefix))
                break
    return tuple(sorted(shared, key=lambda pair: len(pair[1])))


# --------------------------------------------------------------------------------------------
# Key paths into (args, kwargs)
# --------------------------------------------------------------------------------------------
_VALUE = GetAttrKey("value")  # the key an NNX Variable gives its one child


def child(node, key):
    """The child of `node` at path key `key`, or None where the key names no item or attribute."""
    try:
        if isinstance(key, SequenceKey):
            return node[key.idx]
        if isinstance(key, DictKey):
            return node[key.key]
        if key == _VALUE and isinstance(node, _nnx_variable()):
            return node.get_raw_value()  # what it flattens to; its `.value` is a copy
        if isinstance(key, GetAttrKey):
            return getattr(node, key.name)
    except (AttributeError, LookupError, TypeError):
        pass
    return None


def node_at(root, path):
    for key in path:
        root = child(root, key)
    return root


def set_child(node, key, value) -> None:
    """Make `node` hold `value` at path key `key` (raises where `node` is immutable)."""
    if isinstance(key, SequenceKey):
        node[key.idx] = value
    elif isinstance(key, DictKey):
        node[key.key] = value
    elif key == _VALUE and isinstance(node, _nnx_variable()):
        # A Variable flattens to its raw value, and set_raw_value is the inverse; its public
        # setters (`[...] =`, set_value) would run its on_set_value hooks a second time.
        node.set_raw_value(value)
    elif isinstance(key, GetAttrKey):
        setattr(node, key.name, value)
    else:
        raise TypeError(f"{key!r} names no item or attribute (a node registered without keys)")


def _nnx_graph() -> tuple[type, ...]:
    """NNX's Variable and Pytree (Module, Optimizer, Rngs) classes where flax.nnx is loaded, looked
    up in sys.modules and never imported: an NNX object exists only once flax.nnx is loaded, and
    flax is not a dependency of ficco_jax."""
    nnx = sys.modules.get("flax.nnx")
    return (nnx.Variable, nnx.Pytree) if nnx is not None else ()


def _nnx_variable() -> tuple[type, ...]:
    return _nnx_graph()[:1]


def describe(path) -> str:
    """A key path into `(args, kwargs)` as the caller writes it: ``args[0].w1.value``."""
    if len(path) < 2:
        return "the arguments"
    head = f"args[{path[1].idx}]" if path[0].idx == 0 else f"kwargs[{path[1].key!r}]"
    return head + keystr(tuple(path[2:]))
