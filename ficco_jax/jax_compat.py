"""The few things ficco_jax reads from jax's private modules, in one place.

Each function here stands in for a public API that jax lacks (its docstring names which); every
other module uses the public API only, so a jax release that moves one of these names breaks this
file alone. Known to work with jax 0.10 to 0.12.
"""
from __future__ import annotations

import jax
from jax._src import config as _jax_config
from jax._src import distributed as _distributed
from jax._src import mesh as _mesh

try:
    from jax._src import source_info_util as _source_info_private
except ImportError:  # pragma: no cover - depends on the jax version
    _source_info_private = None

try:  # public since jax.extend gained source_info_util; the private module before that
    from jax.extend.source_info_util import summarize as _summarize
except ImportError:  # pragma: no cover - depends on the jax version
    try:
        from jax._src.source_info_util import summarize as _summarize
    except ImportError:
        _summarize = None


def distributed_client():
    """The key-value store client of ``jax.distributed.initialize``; None before it is called.

    Missing public API: a getter for the distributed client (``jax.distributed`` only initializes
    and shuts down).
    """
    return _distributed.global_state.client


def concrete_mesh_while_tracing():
    """The concrete mesh of the enclosing ``jax.set_mesh`` context, read while a function is traced.

    Missing public API: ``jax.sharding.get_mesh()`` refuses inside a trace (it points at the
    abstract mesh, which has no devices); this reads the same context through the getter it wraps.
    """
    return _mesh.get_concrete_mesh()


def trace_flags() -> tuple:
    """The configuration flags jax's own jit cache is keyed by (x64, PRNG, dtype promotion...).

    Missing public API: the tuple jax retraces on (``jax._src.config.trace_context``); in a jax
    without it, the flags that most change a trace, read through ``jax.config``.
    """
    if hasattr(_jax_config, "trace_context"):
        return _jax_config.trace_context()
    return tuple(getattr(jax.config, name, None) for name in ("jax_enable_x64", "jax_threefry_partitionable",
                                                               "jax_default_prng_impl", "jax_numpy_dtype_promotion"))


def summarize_source(source_info) -> str | None:
    """`file:line (function)` of a jaxpr equation's source info; None where this jax cannot say.

    Public as ``jax.extend.source_info_util.summarize``; the private module serves a jax without it.
    """
    return None if _summarize is None else _summarize(source_info)


def user_frames(traceback) -> list:
    """The frames of an equation's traceback that jax counts as the user's, innermost first; [] where
    this jax cannot say.

    Missing public API: ``jax.extend.source_info_util`` summarizes a traceback in one line but does
    not list its frames, which naming the user's line below a framework (flax's ``linear.py``,
    equinox) needs.
    """
    if _source_info_private is None or traceback is None:
        return []
    return list(_source_info_private.user_frames(traceback))
