"""What `fn` does to its arguments: the leaves it replaced, carried out of the traced program and
written back into the caller's objects.

`overlap` traces `fn` over copies of its arguments rebuilt from their leaves (arguments.py), as
jax.jit does, so an in-place update that `fn` makes — an NNX Variable assigned, as
``optimizer.update(model, grads)`` does; a dict entry replaced — lands on the copies. After `fn`
has run, the copies are flattened again and each leaf compared by identity with the one it was
built from: every leaf `fn` replaced is an extra output of the traced program, and each call
writes it into the caller's object at the same tree path, so that the arguments hold what they
hold after ``fn(*args)``. A jax Ref (``jax.new_ref``) needs none of this: its reads and writes are
equations of the traced program, and the jitted call updates the Ref itself.

Refused, with the fix in the message, where a replaced leaf cannot be carried:

- `fn` changes the structure of an argument (adds or removes an entry, attribute or Variable,
  changes a static field or a Variable's metadata), or replaces a static leaf (a Python value,
  fixed when `fn` is traced, so its change would not happen again on later calls);
- a replaced leaf lies inside a node registered without keys: there is no path to write it through;
- an object the arguments reach twice stays two copies (a tuple holds it: see arguments.py) and
  `fn` updates it, or it is an NNX object, whose graph functions tell one object from two copies.

These are decided when `fn` is traced and raised only if a site is rewritten: where none is,
`overlap` calls `fn` itself, which is exact.
"""
from __future__ import annotations

import dataclasses

from jax.tree_util import DictKey, GetAttrKey, SequenceKey, tree_flatten_with_path, tree_structure

from .arguments import child, describe, set_child


@dataclasses.dataclass(frozen=True)
class Effects:
    """The leaves `fn` replaced in its arguments, by position among the leaves of `(args, kwargs)`."""

    positions: tuple[int, ...] = ()
    paths: tuple[tuple, ...] = ()  # key paths into (args, kwargs)
    refusal: str = ""  # why the effects cannot be carried; "" where they can


def replaced_leaves(name: str, before, static_positions, after, unshared=()) -> tuple[Effects, list]:
    """The leaves `fn` replaced (tracing time). `before` is ``tree_flatten_with_path`` of the rebuilt
    `(args, kwargs)` before `fn` ran, `after` that same `(args, kwargs)` after; `unshared` the
    shared objects traced as two copies (arguments.py). Returns the effects and the new leaves to
    output; no leaves where the effects are refused."""
    (before_pairs, before_tree), (after_pairs, after_tree) = before, tree_flatten_with_path(after)
    if after_tree != before_tree:
        return Effects(refusal=_structure_changed(name, before, after)), []
    static = set(static_positions)
    positions, paths, values = [], [], []
    for i, ((path, old), (_, new)) in enumerate(zip(before_pairs, after_pairs)):
        if new is old or (i in static and _same_value(old, new)):
            continue
        if i in static:
            return Effects(refusal=(
                f"ficco_jax.overlap: {name} replaced {describe(path)}, a Python {type(old).__name__} "
                f"({old!r} -> {new!r}) fixed when {name} is traced, so the change would not happen again on "
                f"later calls. Hold it in an array (jnp.asarray(...)) so that it is traced, or change it "
                f"outside the overlapped function")), []
        keyless = next((k for k in path if not isinstance(k, (SequenceKey, DictKey, GetAttrKey))), None)
        if keyless is not None:
            return Effects(refusal=(
                f"ficco_jax.overlap: {name} replaced {describe(path)}, inside a pytree node registered "
                f"without keys ({keyless!r}), so there is no path to write it back into the caller's "
                f"object. Register the node with jax.tree_util.register_pytree_with_keys (or "
                f"register_dataclass), or return the new value from {name}")), []
        positions.append(i)
        paths.append(path)
        values.append(new)
    for copies in unshared:
        updated = [p for p in paths if p[:len(copies.first)] == copies.first or p[:len(copies.other)] == copies.other]
        if updated or copies.observed:
            return Effects(refusal=_copies_differ(name, copies, updated)), []
    return Effects(tuple(positions), tuple(paths)), values


def _copies_differ(name: str, copies, updated) -> str:
    why = (f"{name} updates {describe(updated[0])}" if updated else
           "NNX's graph functions (split, grad, Optimizer.update) tell one shared object from two copies")
    return (f"ficco_jax.overlap: {describe(copies.first)} and {describe(copies.other)} are one "
            f"{copies.type_name}, which overlap would trace as two copies ({describe(copies.other[:-1])} cannot be "
            f"made to hold the first: {copies.why}), and {why}. Pass the object once, or hold the two "
            f"references in a list or dict instead of a tuple")


def _same_value(old, new) -> bool:
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:  # an == that raises or is not a bool is no equality to rely on
        return False


def _structure_changed(name: str, before, after) -> str:
    (before_pairs, before_tree), after_pairs = before, tree_flatten_with_path(after)[0]
    before_paths, after_paths = [p for p, _ in before_pairs], [p for p, _ in after_pairs]
    known, now = set(before_paths), set(after_paths)
    added = [p for p in after_paths if p not in known]
    removed = [p for p in before_paths if p not in now]
    if added or removed:
        found = "; ".join(filter(None, (
            "added " + ", ".join(describe(p) for p in added[:3]) if added else "",
            "removed " + ", ".join(describe(p) for p in removed[:3]) if removed else "")))
    else:
        path, node = _first_change(before_tree, after, ())
        found = (f"the static data of {describe(path)} (a {type(node).__name__}) changed: a static field, "
                 f"a node type or a Variable's metadata")
    return (f"ficco_jax.overlap: {name} changed the structure of its arguments ({found}). overlap traces "
            f"{name} over copies of its arguments and carries back the values written into their leaves "
            f"(arrays, NNX Variables), not new, removed or retyped entries. Make the structural change "
            f"before calling the overlapped function, or return the new object from {name}")


def _first_change(before_tree, node, path) -> tuple[tuple, object]:
    """The path of the outermost node of `node` whose own structure differs from `before_tree`'s."""
    tree = tree_structure(node)
    if tree.node_data() != before_tree.node_data() or len(tree.children()) != len(before_tree.children()):
        return path, node
    kids = tree_flatten_with_path(node, is_leaf=lambda kid: kid is not node)[0]  # one level down
    for ((key, *_), kid), kid_tree in zip(kids, before_tree.children()):
        if tree_structure(kid) != kid_tree:
            return _first_change(kid_tree, kid, (*path, key))
    return path, node


def write_back(name: str, arguments, effects: Effects, values) -> None:
    """Write each leaf `fn` replaced into the caller's `(args, kwargs)` at its path."""
    for path, value in zip(effects.paths, values):
        node = arguments
        for key in path[:-1]:
            node = child(node, key)
        try:
            if node is None:
                raise LookupError(f"no item or attribute at {describe(path[:-1])}")
            set_child(node, path[-1], value)
        except (AttributeError, LookupError, TypeError) as err:
            raise ValueError(
                f"ficco_jax.overlap: cannot write {describe(path)}, which {name} replaced, back into the "
                f"caller's {type(node).__name__}: {err}. Return the new value from {name} instead of "
                f"updating the argument in place") from err
