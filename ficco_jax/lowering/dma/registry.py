"""One registry of the copy-engine FFI targets: for every op its target name, abstract evaluation
and primitive; one lowering rule writes the executor's attributes; `bind` is the only way in.

Each op is one XLA custom call per device; the extension (xla_ffi/) moves the peers' chunks with
copy engines while the chunk matmuls run on the SMs. On CPU the same executor runs with memcpy and
reference loops (what the tests exercise).

Operands: every target's first operand is the call's position (XLA's partition id, groups.py), then
the op's own. Attributes of every FFI target, listed once in xla_ffi/ffi/attrs.h (the extension's
`contract()` gives their names and the codes of order, gemm and transfer, which `_lowering` writes;
tests/test_contract.py checks the two sides agree):
  ficco_abi (the contract's version), op_id, groups (flat i64 array of positions), devices (same
  length), ipc_job, group_size, chunks, order (ring, direct),
  gemm (per_chunk, grouped, columns), copy_streams, timeout_ms (config.RENDEZVOUS_TIMEOUT_S),
  watchdog_ms (config.WATCHDOG_S), site (where the op was written: `site_label`),
  skip_own_rows, transfer (pull; push: senders write into their peers, in-process groups only;
  symmetric: senders write into their peers' buffers of the site, no meeting per call, and the
  target is `<name>_symmetric`, whose CUDA handler is marked command-buffer compatible),
  w_col_major (1: the matmul's w, operand 1, is column-major; 0 for the collectives),
  channel_bytes (config.CHANNEL_BYTES: matmul_rs / matmul_a2a calls computing at most this much for
  their peers run on their group's channel).

  * op_id: a process-wide counter drawn when the op is traced (bound), unique per call site, so
    two ops of one program never share a rendezvous.
  * occurrence: counted by the executor per device and launch (RunId): the same call site run
    many times in one launch (lax.scan, fori_loop) meets its peers once per execution.
  * groups: see groups.py.
  * w_col_major: w's layout, chosen per call. Row-major is how XLA keeps an array; column-major
    (per expert for the expert ops' [E, inner, cols] w) is what a transpose of a row-major array
    is, byte for byte: where w is such a transpose (an op's backward multiplies by w^T, a site
    of `overlap()` by `v.T`), XLA hands over v's buffer (a bitcast) instead of writing w^T first.
    FP8 targets always take it: cuBLASLt's FP8 matmuls need the "TN" form.

Transfer order: rank r pulls from r-1 first, then r-2, ... (ring distance 1, 2, ...). ``direct``
spreads the peers over ``copy_streams`` copy streams (peer slot s on stream s % copy_streams);
``ring`` pulls one peer at a time on one stream. Both pull from the owner directly: on an
NVSwitch node every owner is one hop away, so "ring" is an issue order, not relaying.
matmul_rs with ``gemm="grouped"``: one matmul per peer block (its chunks still move
separately) and one reduction per block once all its chunks landed; with ``gemm="columns"``: chunk j
is columns [j N/c, (j+1) N/c) of every block, its own matmul and one 2D copy.
``transfer="push"`` turns the roles round: each sender's copy streams write its chunks into the
peers (rank r to r+1 first), after the receiver's entry event, and a second meeting hands the
chunk events to the receivers. Groups inside one process only (a ValueError across processes).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import os
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ... import config
from ...runtime import extension
from ...schedule import Schedule
from ..batching import fold_rows, unfold_rows
from . import groups

# ------------------------------------------------------------------------------------------------
# op ids
# ------------------------------------------------------------------------------------------------
_op_ids = itertools.count(1)
_op_id_lock = threading.Lock()


def next_op_id() -> int:
    with _op_id_lock:
        return next(_op_ids)


# ------------------------------------------------------------------------------------------------
# Checks and attributes
# ------------------------------------------------------------------------------------------------
def check_supported(op: str, dtype, out_dtype=None) -> None:
    """Raise TypeError for dtypes the executor lacks, ImportError if the extension is unusable.

    Matmul operands are bf16, f16 or f32 with a result of their dtype or f32 (mixed precision), or
    FP8 (config.FP8_DTYPES, the scaled ops) with a bf16, f16 or f32 result."""
    name = jnp.dtype(dtype).name
    if op in ("all_gather", "all_to_all"):  # those two move bytes
        extension.ensure_loaded()
        return
    fp8_ok = op in _SCALED or f"{op}_scaled" in _SCALED
    if config.is_fp8(name) and fp8_ok:
        if not extension.fp8_matmuls_supported():
            raise TypeError(f"{op}: comm='dma' with FP8 operands needs GPUs with FP8 tensor cores (compute "
                            f"capability {'.'.join(map(str, extension.FP8_MIN_CAPABILITY))}+: Ada, Hopper); "
                            f"use comm='xla' or 'none' here")
        outs = config.dma_results(name)
    elif name in config.DMA_DTYPES:
        outs = config.dma_results(name)
    else:
        handled = config.DMA_DTYPES + (config.FP8_DTYPES if fp8_ok else ())
        raise TypeError(f"{op}: comm='dma' handles dtypes {handled}, found {name}; cast the operands or use comm='xla'")
    out = jnp.dtype(out_dtype or dtype).name
    if out not in outs:
        raise TypeError(f"{op}: comm='dma' computes {name} operands into {outs}, not {out}; "
                        f"pass one of those as out_dtype or use comm='xla'")
    extension.ensure_loaded()


def check_axis_name(op: str, axis_name) -> None:
    if not isinstance(axis_name, str):
        raise TypeError(
            f"{op}: comm='dma' needs axis_name to be one mesh axis name (a str), found {axis_name!r}; "
            f"a tuple of axes is not supported (merge them into one mesh axis, or use comm='xla')"
        )


def axis_size_of(axis_name: str, op: str = "dma") -> int:
    try:
        return int(jax.lax.psum(1, axis_name))
    except NameError as exc:
        raise ValueError(
            f"{op}: axis {axis_name!r} is not bound here; call it inside jax.shard_map over a mesh "
            f"with that axis ({exc})"
        ) from exc


def check_not_empty(op: str, x) -> None:
    if 0 in x.shape:
        raise ValueError(
            f"{op}: x has an empty dimension: found shape {tuple(x.shape)}, every dimension must be >= 1; "
            f"skip the call, or use jax.lax for empty arrays"
        )


# ------------------------------------------------------------------------------------------------
# Where an op was written, for the watchdog's report
# ------------------------------------------------------------------------------------------------
_SITE = contextvars.ContextVar("ficco_site", default="")
# Frames of these packages are not where the user wrote the op.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, np)) + (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,)


@contextlib.contextmanager
def site_label(text: str):
    """Ops bound inside this context say they were written at `text` ("model.py:42 (mlp)"): the
    rewrite names the user's line of each site it replaces, which the call stack does not show."""
    token = _SITE.set(text)
    try:
        yield
    finally:
        _SITE.reset(token)


def current_site() -> str:
    """The label of `site_label`, else the innermost caller outside jax, numpy and ficco_jax."""
    label = _SITE.get()
    if label:
        return label
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return ""


def channel_bytes() -> int:
    """config.CHANNEL_BYTES, checked."""
    value = config.CHANNEL_BYTES
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"config.CHANNEL_BYTES={value!r} must be an integer >= 0 "
                         "(bytes; 0: every call meets its peers)")
    return int(value)


def watchdog_ms() -> int:
    """config.WATCHDOG_S as the executor's attribute: milliseconds, 0 for off (a positive value
    under 1 ms waits 1 ms: it must not turn the watchdog off)."""
    return _limit_ms("WATCHDOG_S", 0.0, "0 turns the watchdog off")


def timeout_ms() -> int:
    """config.RENDEZVOUS_TIMEOUT_S as the executor's attribute: milliseconds, at least 1."""
    return _limit_ms("RENDEZVOUS_TIMEOUT_S", config.MIN_RENDEZVOUS_TIMEOUT_S,
                     "how long a call waits for its peers; the default is 5")


def _limit_ms(name: str, low: float, what: str) -> int:
    """config.`name` (seconds) in whole milliseconds, within [low, config.MAX_LIMIT_S] (set directly,
    it bypassed the environment's check), else a ValueError naming it. A positive value is at least
    1 ms: the executor reads 0 as no limit."""
    value = getattr(config, name)
    if not low <= value <= config.MAX_LIMIT_S:  # (NaN fails too)
        raise ValueError(f"config.{name}={value!r} must be from {low:g} to {config.MAX_LIMIT_S:g} seconds ({what})")
    return max(int(round(value * 1000)), 1 if value > 0 else 0)


def match_varying(*values, axis_name=None):
    """Make every operand vary over the union of the operands' manual axes (check_vma), and over
    `axis_name` where given: a collective's result differs per device of its axis even where its
    input is the same on every one (as jax.lax's collectives make theirs vary), so that JAX neither
    takes it for replicated nor transposes it as if it were."""
    def varying(v):
        aval = jax.typeof(v)
        mat = getattr(aval, "mat", None)
        return frozenset(getattr(mat, "varying", ()) or getattr(aval, "vma", ()) or ())

    own = frozenset() if axis_name is None else frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    union = own.union(*(varying(v) for v in values))
    out = []
    for v in values:
        missing = tuple(sorted(union - varying(v), key=str))
        out.append(jax.lax.pcast(v, missing, to="varying") if missing else v)
    return out


# ------------------------------------------------------------------------------------------------
# Primitives: abstract eval at trace time, groups at lowering time
# ------------------------------------------------------------------------------------------------
def aval(like, shape, dtype=None):
    return like.update(shape=tuple(shape), dtype=dtype or like.dtype, sharding=like.sharding.update(
        spec=jax.sharding.PartitionSpec(*([None] * len(shape)))) if hasattr(like.sharding, "update") else like.sharding)


def _abstract_ag_matmul(x, w, *scales, axis_size, out_dtype, **_):
    n, (m, k), cols = axis_size, x.shape, w.shape[1]
    return [aval(x, (n * m, cols), out_dtype), aval(x, (n * m, k))]


def _abstract_matmul_rs(y, w, *scales, axis_size, out_dtype, **_):
    n, m, cols = axis_size, y.shape[0] // axis_size, w.shape[1]
    return [aval(y, (m, cols), out_dtype), aval(y, (n - 1, m, cols), out_dtype), aval(y, (n - 1, m, cols), out_dtype)]


def _abstract_all_gather(x, *, axis_size, **_):
    return [aval(x, (axis_size * x.shape[0], *x.shape[1:]))]


def _abstract_reduce_scatter(x, *, axis_size, **_):
    m = x.shape[0] // axis_size
    return [aval(x, (m, *x.shape[1:])), aval(x, (axis_size - 1, m, *x.shape[1:]))]


def _abstract_all_to_all(x, **_):
    return [aval(x, x.shape)]


def _abstract_a2a_matmul(x, w, *, out_dtype, **_):
    n, e, c, _d = x.shape
    return [aval(x, (n, e, c, w.shape[2]), out_dtype), aval(x, x.shape)]


def _abstract_matmul_a2a(y, w, *, axis_size, out_dtype, **_):
    n, e, c, _f = y.shape
    return [aval(y, (n, e, c, w.shape[2]), out_dtype), aval(y, (max(axis_size - 1, 1), e, c, w.shape[2]), out_dtype)]


def operand_layouts(avals, w_col_major: bool):
    """The layouts the custom call asks of its operands (`avals`, w at position 1): row-major
    (None), except w where `w_col_major`: its two matrix dimensions swapped, K (the rows of w) the
    minor one: minor-to-major (0, 1) for [K, N], (1, 2, 0) per expert for [E, K, N]. XLA lays out
    the producer of w so (a transpose becomes a bitcast), or inserts one transpose."""
    if not w_col_major:
        return None
    rank = len(avals[1].shape)
    w_layout = (rank - 2, rank - 1, *range(rank - 3, -1, -1))
    return [None, w_layout] + [None] * (len(avals) - 2)


def ffi_call_with_position(ctx, target: str, operands, operand_layouts, **attributes):
    """The custom call of `target` on (the call's position, *operands) with `attributes` and the
    contract's version: the position (groups.position_operand) goes first, so each call finds its
    group from the run."""
    position_aval = jax.core.ShapedArray((), np.uint32)
    layouts = None if operand_layouts is None else [None, *operand_layouts]
    rule = jax.ffi.ffi_lowering(target, operand_layouts=layouts)
    return rule(ctx.replace(avals_in=[position_aval, *ctx.avals_in]), groups.position_operand(), *operands,
                ficco_abi=np.int64(extension.CONTRACT_VERSION), **attributes)


def _lowering(ctx, *operands, op, axis_name, axis_size, op_id, schedule, timeout_ms, watchdog_ms, site,
              channel_bytes, skip_own_rows=False, out_dtype=None, w_col_major=False):
    group = groups.group_attrs(ctx, op, axis_name, axis_size)
    if schedule.transfer == "push" and group["ipc_job"] != 0:
        raise ValueError(
            f"{op}: schedule {schedule} pushes into the peers' buffers, but the group of mesh axis {axis_name!r} "
            f"spans processes, whose XLA buffers cannot be opened from here; use transfer='pull' "
            f"(e.g. {str(schedule.replace(transfer='pull'))!r})"
        )
    target = _TARGETS[op][0] + ("_symmetric" if schedule.transfer == "symmetric" else "")
    codes = extension.contract()
    return ffi_call_with_position(
        ctx, target, operands, operand_layouts(ctx.avals_in, w_col_major),
        op_id=np.int64(op_id),
        groups=group["groups"].reshape(-1),
        devices=group["devices"].reshape(-1),
        ipc_job=np.int64(group["ipc_job"]),
        group_size=np.int64(axis_size),
        chunks=np.int64(schedule.chunks),
        order=np.int64(codes["order"][schedule.order]),
        gemm=np.int64(codes["gemm"][schedule.gemm]),
        copy_streams=np.int64(schedule.copy_streams),
        timeout_ms=np.int64(timeout_ms),
        watchdog_ms=np.int64(watchdog_ms),
        site=site,
        skip_own_rows=np.int64(int(skip_own_rows)),
        transfer=np.int64(codes["transfer"][schedule.transfer]),
        w_col_major=np.int64(int(w_col_major)),
        channel_bytes=np.int64(channel_bytes),
    )


def _make_primitive(target: str, abstract_eval) -> Primitive:
    prim = Primitive(target)
    prim.multiple_results = True
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, _lowering)
    batching.primitive_batchers[prim] = functools.partial(_batch, prim)
    return prim


# ------------------------------------------------------------------------------------------------
# Differentiation: the collectives are linear, each one's transpose another of them
# ------------------------------------------------------------------------------------------------
#: collective -> its transpose: all_gather and reduce_scatter are each other's; an exchange of
#: blocks (block p to rank p) is its own.
_TRANSPOSES = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all"}


def _again(op: str, x, params):
    """`op` on `x` with `params` as one more call: a site of its own (a fresh op id); a dtype the
    executor cannot sum (the cotangent of an FP8 all_gather) is a TypeError that says so."""
    check_supported(op, x.dtype)
    return _PRIMITIVES[op].bind(x, **{**params, "op": op, "op_id": next_op_id(), "out_dtype": np.dtype(x.dtype)})


def _linear_jvp(primals, tangents, **params):
    """Forward mode of a linear call: the call again, on the tangent."""
    outs = _PRIMITIVES[params["op"]].bind(*primals, **params)
    if type(tangents[0]) is ad.Zero:
        return outs, [ad.Zero.from_primal_value(o) for o in outs]
    return outs, _again(params["op"], tangents[0], params)


def _linear_transpose(cts, x, **params):
    """Reverse mode of a linear call: its transpose on the cotangent of its result (the other
    results are the executor's scratch blocks, which nobody reads)."""
    if type(cts[0]) is ad.Zero:
        return [None]
    return [_again(_TRANSPOSES[params["op"]], cts[0], params)[0]]


def _batch(prim: Primitive, args, dims, **params):
    """vmap of a copy-engine call (the standalone collectives and the raw matmuls of
    ficco_jax.dma reach this layer; the public ops fold their batch a layer up, ops/linear.py,
    with the same row fold): one call on the batch folded into its operand (`_fold_batch`), else
    one call per batch element in a loop (a batched weight or scale: each element has its own
    matmul). Every element's call in the loop is the same site executed again, as in any loop:
    the executor tells the executions apart by their order."""
    folded = _fold_batch(params["op"], args, dims, params["axis_size"])
    if folded is not None:
        operands, unfold = folded
        return unfold(prim.bind(*operands, **params))
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = tuple(batching.bdim_at_front(a, d, size) for a, d in zip(args, dims))
    outs = jax.lax.map(lambda xs: tuple(prim.bind(*xs, **params)), args)
    return list(outs), [0] * len(outs)


#: The collective of each target whose batch folds into its rows (lowering/batching.py).
_ROW_ROLES = {"all_gather": "gather", "ag_matmul": "gather", "reduce_scatter": "scatter", "matmul_rs": "scatter"}


def _fold_batch(op: str, args, dims, n: int):
    """(operands, unfold) of one call on a batch of `op`'s first operand (unfold: the call's results
    -> (results, their batch dimensions)), or None where the batch cannot fold. A collective
    moves bytes, so a batch in a dimension it neither exchanges nor cuts into chunks stays there
    (all_gather, reduce_scatter: after the rows; all_to_all: after the blocks' first dimension);
    elsewhere the batch joins the rows (lowering/batching.py), reordered after the call. The
    expert-parallel matmuls fold a layer up only (ops/table.ExpertParallel)."""
    (x, d), base = (args[0], dims[0]), op.removesuffix("_scaled")
    if d is None or any(e is not None for e in dims[1:]):
        return None
    if x.shape[d] == 0:  # an empty batch: the loop makes no call (a fold would reshape no rows into -1 of them)
        return None
    if base == "all_to_all":  # [n, rows, ...]: blocks exchanged, rows cut into chunks
        return [jnp.moveaxis(x, d, 2) if d < 2 else x], lambda outs: (outs, [max(d, 2)])
    if base in ("all_gather", "reduce_scatter") and d >= 1:  # results: [rows, ...], scratch [n-1, rows, ...]
        return [x], lambda outs: (outs, [d] + [d + 1] * (len(outs) - 1))
    role = _ROW_ROLES.get(base)
    if role is None:
        return None
    batch = x.shape[d]
    folded = fold_rows(role, jnp.moveaxis(x, d, 0), n)

    def unfold(outs):
        if role == "gather":  # every result is gathered rows
            return [unfold_rows(role, o, batch, n) for o in outs], [0] * len(outs)
        # The scratch blocks [n-1, B*m, ...]: per element, blocks of m rows. Sizes spelled out: over
        # one device there are no blocks (n-1 = 0), and -1 cannot be inferred from an empty array.
        out, *scratch = outs
        return ([unfold_rows(role, out, batch, n)] + [s.reshape(s.shape[0], batch, s.shape[1] // batch, *s.shape[2:])
                                                           for s in scratch], [0] + [1] * len(scratch))

    return [folded, *args[1:]], unfold


#: op -> (FFI target, abstract evaluation): every copy-engine target, in one table.
_TARGETS = {
    "ag_matmul": ("ficco_ag_matmul", _abstract_ag_matmul),
    "matmul_rs": ("ficco_matmul_rs", _abstract_matmul_rs),
    "all_gather": ("ficco_all_gather", _abstract_all_gather),
    "reduce_scatter": ("ficco_reduce_scatter", _abstract_reduce_scatter),
    "all_to_all": ("ficco_all_to_all", _abstract_all_to_all),
    "a2a_matmul": ("ficco_a2a_matmul", _abstract_a2a_matmul),
    "matmul_a2a": ("ficco_matmul_a2a", _abstract_matmul_a2a),
    # FP8 operands (x, w, x_scale, w_scale): config.FP8_DTYPES.
    "ag_matmul_scaled": ("ficco_ag_matmul_scaled", _abstract_ag_matmul),
    "matmul_rs_scaled": ("ficco_matmul_rs_scaled", _abstract_matmul_rs),
}
_SCALED = ("ag_matmul_scaled", "matmul_rs_scaled")
#: The targets with a matmul, whose operand 1 is its weight w.
_MATMULS = ("ag_matmul", "matmul_rs", "a2a_matmul", "matmul_a2a", *_SCALED)
_PRIMITIVES = {op: _make_primitive(target, abstract) for op, (target, abstract) in _TARGETS.items()}
for _op in _TRANSPOSES:
    ad.primitive_jvps[_PRIMITIVES[_op]] = _linear_jvp
    ad.primitive_transposes[_PRIMITIVES[_op]] = _linear_transpose


def bind(op: str, operands, axis_name: str, axis_size: int, schedule: Schedule, *, skip_own_rows: bool = False,
         out_dtype=None, w_col_major: bool = False):
    """`op` on `operands` (the scaled ops: x, w, x_scale, w_scale); `out_dtype` is the matmul
    result's dtype (None: the operands'); `w_col_major`: ask XLA for the matmul's w column-major
    (always for the FP8 targets)."""
    check_supported(op, operands[0].dtype, out_dtype)
    if op not in _MATMULS and w_col_major:
        raise ValueError(f"{op}: w_col_major is the layout of a matmul's weight; {op} has none")
    operands = match_varying(*operands, axis_name=axis_name)
    out_dtype = np.dtype(out_dtype or operands[0].dtype)
    return _PRIMITIVES[op].bind(
        *operands, op=op, axis_name=axis_name, axis_size=axis_size, op_id=next_op_id(), schedule=schedule,
        timeout_ms=timeout_ms(), watchdog_ms=watchdog_ms(), site=current_site(),
        channel_bytes=channel_bytes(), skip_own_rows=skip_own_rows, out_dtype=out_dtype,
        w_col_major=bool(w_col_major) or op in _SCALED,
    )
