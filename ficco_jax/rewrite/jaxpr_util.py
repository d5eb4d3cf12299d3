"""Small jaxpr helpers shared by the matchers and the interpreter: atoms, avals, sub-jaxprs, and the
transposes/reshapes that move operands between a dot's layout and an op's."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Sequence

import jax
import jax.extend.core as jex
import numpy as np
from jax.extend import source_info_util as _source_info

from .. import jax_compat


def fmt(aval) -> str:
    """`float32[2,16,32]`: how reports show a shape."""
    return f"{np.dtype(aval.dtype).name}[{','.join(str(d) for d in aval.shape)}]"


def fmt_shapes(shapes: Sequence[Sequence[int]]) -> str:
    """`[64,32]·[32,16]`: the operand shapes an op is called with."""
    return "·".join(f"[{','.join(str(d) for d in shape)}]" for shape in shapes)


# The frameworks a model is written with: a site's line is the innermost frame outside them, the
# user's (a Dense layer's matmul is written in flax's linear.py, called from the user's model).
_FRAMEWORKS = ("jax", "jaxlib", "flax", "equinox", "haiku", "optax")
_OWN_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ficco_jax/


def _framework_dirs() -> tuple[str, ...]:
    """The package directories of the frameworks loaded now (looked up, never imported), and ficco_jax's."""
    dirs = [_OWN_PACKAGE]
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) if module is not None else None
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)))
    return tuple(d + os.sep for d in dirs)


def source_line(eqn) -> str:
    """`file:line:column (function)` of the user code that wrote `eqn`: the innermost frame outside jax,
    the model frameworks and ficco_jax; "" where the jaxpr kept none."""
    info = getattr(eqn, "source_info", None)
    if info is None:
        return ""
    try:
        frames = list(jax_compat.user_frames(info.traceback))
        excluded = _framework_dirs()
        user = [f for f in frames if not os.path.abspath(f.file_name).startswith(excluded)]
        frame = (user or frames or [None])[0]
        if frame is None:
            return ""
        column = f":{frame.start_column}" if frame.start_column else ""
        return f"{frame.file_name}:{frame.start_line}{column} ({frame.function_name})"
    except Exception:  # noqa: BLE001 - a report line must never fail the user's function
        return ""


def written_as(eqn) -> contextlib.ExitStack:
    """A context that binds as `eqn` was bound: its names (``jax.named_scope``, ``jax.named_call``,
    a jitted function's) under the current ones, its traceback, and its context (eqn.ctx), as
    jax.core.eval_jaxpr binds each equation; so the profile and the HLO metadata of a rewritten
    program name its operations as the program as written does."""
    stack = contextlib.ExitStack()
    info = getattr(eqn, "source_info", None)
    if info is not None:
        names = _source_info.current_name_stack() + info.name_stack
        stack.enter_context(_source_info.user_context(info.traceback, name_stack=names))
    stack.enter_context(eqn.ctx.manager)
    return stack


def is_var(atom) -> bool:
    return not isinstance(atom, jex.Literal)


def single_axis(params) -> str | None:
    """The one mesh axis a collective runs over, or None when it names several (psum names them "axes")."""
    names = params["axis_name"] if "axis_name" in params else params["axes"]
    names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
    return names[0] if len(names) == 1 else None


def free_dims(ndim: int, contracting: Sequence[int]) -> list[int]:
    return [d for d in range(ndim) if d not in contracting]


def default_precision():
    """The precision a matmul written without one gets now (jax_default_matmul_precision applies)."""
    one = jax.ShapeDtypeStruct((1, 1), np.float32)
    return jax.make_jaxpr(jax.lax.dot)(one, one).eqns[0].params.get("precision")


def transpose(x, perm):
    """`jax.lax.transpose`, binding nothing for the identity so untouched layouts stay as written,
    and a reshape where it only moves dimensions of size one (a batch of one sequence before its
    tokens): the same values in the same order, which XLA reads as a bitcast instead of a copy."""
    perm = tuple(int(p) for p in perm)
    if perm == tuple(range(len(perm))):
        return x
    moved = [d for d in perm if x.shape[d] != 1]
    if moved == sorted(moved):
        return jax.lax.reshape(x, tuple(x.shape[d] for d in perm))
    return jax.lax.transpose(x, perm)


def reshape(x, shape):
    """`jax.lax.reshape`, binding nothing when the shape already matches."""
    shape = tuple(int(d) for d in shape)
    return x if tuple(x.shape) == shape else jax.lax.reshape(x, shape)


def is_jaxpr(value) -> bool:
    return isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr))


def sub_jaxprs(params) -> dict:
    """The parameters of an equation that hold a jaxpr or a non-empty sequence of jaxprs."""
    subs = {}
    for key, value in params.items():
        if is_jaxpr(value) or (isinstance(value, (tuple, list)) and value and all(is_jaxpr(v) for v in value)):
            subs[key] = value
    return subs


def open_jaxpr(jaxpr) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a closed or an open jaxpr."""
    return (jaxpr.jaxpr, jaxpr.consts) if isinstance(jaxpr, jex.ClosedJaxpr) else (jaxpr, ())
