"""Input validation at trace time: every public op and `overlap` rejects bad input with an error
that names the op, the argument, what was expected and what was found; `schedule="auto"` always
resolves to a schedule that can run.

(test_ops.py covers ag_matmul's dtype / contraction / axis / schedule-type errors and the
unsplittable-rows message; test_dma.py the dma dtype, tiled=False and tuple-axis errors. This
file covers the rest: matmul_rs, FP8 arguments, out_dtype, chunk-count hints, copy engines under a
nested shard_map, the standalone collectives, `select_schedule`, `overlap`, and "auto".)
"""
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import logging  # noqa: E402
import re  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax import config, ops  # noqa: E402
from ficco_jax.runtime import extension as _ext, topology  # noqa: E402
from ficco_jax.tuning import policy, select  # noqa: E402
from ficco_jax.schedule import COMMS, Schedule  # noqa: E402
from helpers import ag_specs, lowered_text, prefer_copy_engines, psum_specs, rs_specs, run_sharded  # noqa: E402

needs_ext = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")


def _zeros(shape, dtype="float32"):
    return jnp.zeros(shape, dtype)


# ------------------------------------------------------------------------------------------------
# The ops: one row per mistake; the message must name the op, the argument and expected vs found
# ------------------------------------------------------------------------------------------------
def _rs(mesh, y, w, schedule="auto", axis="tp", **kwargs):
    return run_sharded(mesh, lambda y, w: ficco_jax.matmul_rs(y, w, axis, schedule=schedule, **kwargs), rs_specs(mesh),
                       y, w)


def _ag(mesh, x, w, schedule="auto", axis="tp", **kwargs):
    def body(x, w):
        out = ficco_jax.ag_matmul(x, w, axis, schedule=schedule, **kwargs)
        return out[0] if isinstance(out, tuple) else out
    return run_sharded(mesh, body, ag_specs(mesh), x, w)


# Per device on the 1-D mesh of 8: y [8*4, 8], w [8, 6] unless a case changes it.
Y, W_RS = (8 * 32, 8 * 8), (8 * 8, 6)
X, W_AG = (8 * 16, 8), (8, 8 * 6)

OP_CASES = [
    # id, call(mesh), exception, regex over the message
    ("rs-int-dtype", lambda m: _rs(m, _zeros(Y, "int32"), _zeros(W_RS, "int32"), "xla/ring/c1"),
     TypeError, r"matmul_rs: y must be a floating-point array, found dtype int32.*astype"),
    ("rs-mixed-dtype", lambda m: _rs(m, _zeros(Y), _zeros(W_RS, "bfloat16"), "none"),
     TypeError, r"matmul_rs: y and w must have the same dtype, found float32 and bfloat16"),
    ("rs-mixed-dtype-dma", lambda m: _rs(m, _zeros(Y, "bfloat16"), _zeros(W_RS, "float16"), "dma/direct/c1"),
     TypeError, r"matmul_rs: y and w must have the same dtype, found bfloat16 and float16"),
    ("rs-contraction", lambda m: _rs(m, _zeros(Y), _zeros((8 * 9, 6)), "xla/ring/c1"),
     ValueError, r"matmul_rs: contraction sizes differ: y.shape\[1\]=8 but w.shape\[0\]=9"),
    ("rs-rank-3", lambda m: run_sharded(
        m, lambda y, w: ficco_jax.matmul_rs(y, w, "tp"), ((P(None, None, "tp"), P("tp", None)), P("tp")),
        _zeros((32, 2, 64)), _zeros(W_RS)),
     ValueError, r"matmul_rs: y must be 2-D per device, found shape \(32, 2, 8\)"),
    ("rs-empty", lambda m: _rs(m, _zeros((0, 64)), _zeros(W_RS)),
     ValueError, r"matmul_rs: y has an empty dimension: found shape \(0, 8\).*>= 1"),
    ("rs-axis-not-in-mesh", lambda m: _rs(m, _zeros(Y), _zeros(W_RS), axis="sp"),
     ValueError, r"matmul_rs: axis 'sp' is not bound here"),
    ("rs-rows-vs-chunks-dma", lambda m: _rs(m, _zeros((8 * 3, 64)), _zeros(W_RS), "dma/direct/c4"),
     ValueError, r"matmul_rs: rows per output block \(M / 8\) = 3 .*chunks=4.*valid chunk counts.*\[1, 3\]"),
    ("rs-dma-ring", lambda m: _rs(m, _zeros(Y), _zeros(W_RS), "dma/ring/c1"),
     ValueError, r"matmul_rs: schedule dma/ring/c1 is not valid: .*valid orders: \('direct',\)"),
    ("rs-dma-dtype", lambda m: _rs(m, _zeros(Y, "float8_e5m2fnuz"), _zeros(W_RS, "float8_e5m2fnuz"), "dma/direct/c1"),
     TypeError, r"matmul_rs: comm='dma' handles dtypes .*found float8_e5m2fnuz.*comm='xla'"),
    ("rs-fp8-unscaled", lambda m: _rs(m, _zeros(Y, "float8_e4m3fn"), _zeros(W_RS, "float8_e4m3fn"), "none"),
     TypeError, r"matmul_rs: FP8 operands .* need x_scale= and w_scale="),
    ("rs-streams-vs-peers", lambda m: _rs(m, _zeros(Y), _zeros(W_RS), "dma/direct/c1/s8"),
     ValueError, r"copy_streams=8 exceeds the 7 peers"),
    ("ag-list-operand", lambda m: run_sharded(m, lambda x, w: ficco_jax.ag_matmul([[1.0] * 8], w, "tp"),
                                              ag_specs(m), _zeros(X), _zeros(W_AG)),
     TypeError, r"ag_matmul: x must be a jax or numpy array, found list"),
    ("ag-return-gathered-not-bool", lambda m: _ag(m, _zeros(X), _zeros(W_AG), return_gathered="yes"),
     TypeError, r"ag_matmul: return_gathered must be a bool, found 'yes'"),
    ("ag-unparsable-chunks", lambda m: _ag(m, _zeros(X), _zeros(W_AG), "xla/ring/cX"),
     ValueError, r"cannot parse schedule 'xla/ring/cX': chunks 'cX' must be c<positive int>"),
    ("ag-rows-vs-chunks-dma", lambda m: _ag(m, _zeros((8 * 6, 8)), _zeros(W_AG), "dma/ring/c4"),
     ValueError, r"ag_matmul: rows per device = 6 .*chunks=4.*valid chunk counts.*\[1, 2, 3, 6\]"),
    ("ag-odd-rows-vs-chunks", lambda m: _ag(m, _zeros((8 * 15, 8)), _zeros(W_AG), "dma/direct/c2"),
     ValueError, r"ag_matmul: rows per device = 15 .*chunks=2; valid chunk counts for this shape: \[1, 3, 5, 15\]"),
    ("rs-odd-columns-vs-chunks", lambda m: _rs(m, _zeros(Y), _zeros((8 * 8, 15)), "dma/direct/c2/columns"),
     ValueError, r"matmul_rs: gemm='columns' .*w.shape\[1\]=15 .*chunks=2; valid chunk counts for this shape: "
                 r"\[3, 5, 15\]"),
    ("ag-zero-chunks-string", lambda m: _ag(m, _zeros(X), _zeros(W_AG), "dma/direct/c0"),
     ValueError, r"ag_matmul: cannot parse schedule 'dma/direct/c0': chunks=0 must be a positive int"),
    ("ag-none-with-fields", lambda m: _ag(m, _zeros(X), _zeros(W_AG), "none/direct/c2"),
     ValueError, r"ag_matmul: cannot parse schedule 'none/direct/c2': 'none' .* takes no other fields; write 'none'"),
    ("ag-fp8-out-dtype", lambda m: _ag(m, _zeros(X, "float8_e4m3fn"), _zeros(W_AG, "float8_e4m3fn"), "none",
                                       x_scale=1.0, w_scale=1.0, out_dtype="garbage"),
     TypeError, r"ag_matmul: out_dtype must be a dtype such as jnp.float32, found 'garbage'"),
    ("ag-fp8-string-scale", lambda m: _ag(m, _zeros(X, "float8_e4m3fn"), _zeros(W_AG, "float8_e4m3fn"), "none",
                                          x_scale="1", w_scale=1.0),
     TypeError, r"ag_matmul: x_scale must be a float32 scalar \(an array or a Python number\), found str '1'"),
    ("ag-fp8-w-only", lambda m: _ag(m, _zeros(X, "bfloat16"), _zeros(W_AG, "float8_e4m3fn"), "none"),
     TypeError, r"ag_matmul: both operands must be FP8 .* or neither, found x bfloat16 and w float8_e4m3fn; "
                r"quantize x as well .* or dequantize w"),
    ("rs-fp8-y-only", lambda m: _rs(m, _zeros(Y, "float8_e4m3fn"), _zeros(W_RS, "bfloat16"), "none"),
     TypeError, r"matmul_rs: both operands must be FP8 .* or neither, found y float8_e4m3fn and w bfloat16; "
                r"quantize w as well .* or dequantize y"),
]


@needs_ext
@pytest.mark.parametrize("call,exc,pattern", [pytest.param(*c[1:], id=c[0]) for c in OP_CASES])
def test_op_rejects_bad_input(mesh1d, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(mesh1d)


def test_ops_check_their_axis_on_a_2d_mesh(mesh2d):
    """On the (dp=2, tp=4) mesh an op over 'dp' checks rows against dp's size, not tp's."""
    y, w = _zeros((3, 4 * 8)), _zeros((4 * 8, 6))  # y [3, 8] per device: 3 rows over dp=2
    specs = ((P(None, "tp"), P("tp", None)), P(None, None))
    with pytest.raises(ValueError, match=r"matmul_rs: y.shape\[0\]=3 rows must divide by the axis size 2"):
        run_sharded(mesh2d, lambda y, w: ficco_jax.matmul_rs(y, w, "dp", schedule="xla/ring/c1"), specs, y, w)


@needs_ext
def test_every_listed_chunk_count_runs(mesh1d, rng):
    """15 rows per device: the counts the message lists include the odd ones, and each of them runs."""
    x = jnp.asarray(rng.standard_normal((8 * 15, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 8 * 6)), jnp.float32)
    with pytest.raises(ValueError, match="valid chunk counts") as refused:
        _ag(mesh1d, x, w, "dma/direct/c2")
    listed = re.search(r"valid chunk counts for this shape: \[([0-9, ]+)\]", str(refused.value)).group(1)
    counts = [int(c) for c in listed.split(",")]
    assert counts == [1, 3, 5, 15]
    want = run_sharded(mesh1d, lambda x, w: ficco_jax.ag_matmul_ref(x, w, "tp"), ag_specs(mesh1d), x, w)
    for chunks in counts[1:]:
        got = _ag(mesh1d, x, w, f"dma/direct/c{chunks}")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=f"c{chunks}")


_OPS_AND_REFS = {
    "ag_matmul": (ficco_jax.ag_matmul, ficco_jax.ag_matmul_ref, ag_specs, ((8 * 16, 32), (32, 8 * 8))),
    "matmul_rs": (ficco_jax.matmul_rs, ficco_jax.matmul_rs_ref, rs_specs, ((8 * 32, 8 * 8), (8 * 8, 16))),
    "matmul_psum": (ficco_jax.matmul_psum, ficco_jax.matmul_psum_ref, psum_specs, ((8 * 32, 8 * 8), (8 * 8, 16))),
}


@pytest.mark.parametrize("schedule", ["none", "xla/ring/c2", "auto"])
@pytest.mark.parametrize("op", list(_OPS_AND_REFS))
def test_float64_out_dtype_without_x64_is_float32_as_in_jax(mesh1d, rng, op, schedule):
    """With jax_enable_x64 off JAX truncates a float64 result to float32 and warns; the ops do the same
    (the result's dtype must match the reference's, or shard_map refuses the program)."""
    assert not jax.config.jax_enable_x64
    fn, ref, specs, (a_shape, w_shape) = _OPS_AND_REFS[op]
    a = jnp.asarray(rng.standard_normal(a_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    with pytest.warns(UserWarning, match=rf"{op}: out_dtype float64 is not available while jax_enable_x64 is off; "
                                         rf"the result is float32"):
        got = run_sharded(mesh1d, lambda a, w: fn(a, w, "tp", schedule=schedule, out_dtype=jnp.float64), specs(mesh1d),
                          a, w)
    want = run_sharded(mesh1d, lambda a, w: ref(a, w, "tp"), specs(mesh1d), a, w)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@needs_ext
def test_dma_in_a_nested_shard_map_runs_with_or_without_jax_set_mesh(mesh2d, rng):
    """A jax.shard_map nested in another (no mesh= of its own) lowers its body with an abstract mesh:
    the lowering needs only the mesh's shape (its calls find their devices from the run), so comm='dma'
    runs there with jax.set_mesh and without, on the permuted devices."""
    x = jnp.asarray(rng.standard_normal((2 * 4 * 6, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 4 * 8)), jnp.float32)

    def nested(op):
        inner = jax.shard_map(lambda x, w: op(x, w, "tp"), in_specs=(P("tp", None), P(None, "tp")),
                              out_specs=P(None, "tp"), axis_names={"tp"})
        return jax.jit(jax.shard_map(inner, mesh=mesh2d, in_specs=(P("dp", None), P(None, None)),
                                     out_specs=P("dp", None), axis_names={"dp"}))

    def on_copy_engines(x, w, axis):
        return ficco_jax.ag_matmul(x, w, axis, schedule="dma/direct/c2")

    want = nested(ficco_jax.ag_matmul_ref)(x, w)
    np.testing.assert_allclose(np.asarray(nested(on_copy_engines)(x, w)), np.asarray(want), rtol=1e-5, atol=1e-5)
    with jax.set_mesh(mesh2d):
        got = nested(on_copy_engines)(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# The standalone collectives
# ------------------------------------------------------------------------------------------------
def _gather(mesh, x, **kwargs):
    return run_sharded(mesh, lambda a: ficco_jax.dma.all_gather(a, kwargs.pop("axis_name", "tp"), **kwargs),
                       ((P("tp"),), P("tp")), x)


def _scatter(mesh, x, **kwargs):
    return run_sharded(mesh, lambda a: ficco_jax.dma.reduce_scatter(a, kwargs.pop("axis_name", "tp"), **kwargs),
                       ((P("tp"),), P("tp")), x)


COLLECTIVE_CASES = [
    ("ag-axis-not-in-mesh", lambda m: _gather(m, _zeros((64, 4)), axis_name="sp"),
     ValueError, r"all_gather: axis 'sp' is not bound here"),
    ("rs-axis-not-in-mesh", lambda m: _scatter(m, _zeros((512, 4)), axis_name="sp"),
     ValueError, r"reduce_scatter: axis 'sp' is not bound here"),
    ("ag-empty", lambda m: _gather(m, _zeros((0, 4))),
     ValueError, r"all_gather: x has an empty dimension: found shape \(0, 4\)"),
    ("ag-empty-inner", lambda m: _gather(m, _zeros((64, 0))),
     ValueError, r"all_gather: x has an empty dimension: found shape \(8, 0\)"),
    ("rs-empty", lambda m: _scatter(m, _zeros((512, 0))),
     ValueError, r"reduce_scatter: x has an empty dimension: found shape \(64, 0\)"),
    ("ag-axis-not-int", lambda m: _gather(m, _zeros((64, 4)), axis=1.0),
     TypeError, r"all_gather: axis must be an int, found 1.0"),
    ("rs-dim-out-of-range", lambda m: _scatter(m, _zeros((512, 4)), scatter_dimension=2),
     ValueError, r"reduce_scatter: axis 2 is out of range for an array of rank 2"),
    ("ag-schedule-type", lambda m: _gather(m, _zeros((64, 4)), schedule=3),
     TypeError, r"all_gather: schedule must be None, 'auto', a comm='dma' ficco_jax.Schedule or its string form; found int"),
    ("ag-schedule-xla", lambda m: _gather(m, _zeros((64, 4)), schedule="xla/ring/c1"),
     ValueError, r"all_gather: dma.all_gather runs comm='dma' schedules only, found xla/ring/c1"),
    ("rs-columns", lambda m: _scatter(m, _zeros((512, 4)), schedule="dma/direct/c2/columns"),
     ValueError, r"reduce_scatter: dma.reduce_scatter moves row chunks; gemm='columns' cuts the output columns of "
                 r"matmul_rs and matmul_psum: use dma/direct/c2"),
    ("ag-rows-vs-chunks", lambda m: _gather(m, _zeros((24, 4)), schedule="dma/direct/c8"),
     ValueError, r"all_gather: 3 rows per block .*schedule.chunks=8; valid chunk counts for this shape: \[1, 3\]"),
    ("ag-odd-rows-vs-chunks", lambda m: _gather(m, _zeros((8 * 15, 4)), schedule="dma/direct/c2"),
     ValueError, r"all_gather: 15 rows per block .*chunks=2; valid chunk counts for this shape: \[1, 3, 5, 15\]"),
    ("rs-not-divisible", lambda m: _scatter(m, _zeros((8 * 12, 4))),
     ValueError, r"reduce_scatter: x.shape\[0\]=12 must divide by the axis size 8"),
    ("rs-dtype", lambda m: _scatter(m, _zeros((512, 4), "complex64")),
     TypeError, r"reduce_scatter: copy engines sum dtypes .*found complex64; cast x.*schedule='auto'"),
]


@needs_ext
@pytest.mark.parametrize("call,exc,pattern", [pytest.param(*c[1:], id=c[0]) for c in COLLECTIVE_CASES])
def test_collective_rejects_bad_input(mesh1d, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(mesh1d)


@needs_ext
def test_all_to_all_chunks_cut_the_first_dimension_of_each_block(mesh1d, rng):
    """split_axis=0: a block is x.shape[0] // n rows (x (16, 6) per device: 2 rows, which chunks=3
    cannot cut though x.shape[1] = 6 divides by 3); another split axis leaves x.shape[0] whole."""
    assert "x.shape[0] // n for split_axis=0, x.shape[0]\n    otherwise" in ficco_jax.dma.all_to_all.__doc__

    def a2a(split_axis, schedule):
        return lambda a: ficco_jax.dma.all_to_all(a, "tp", split_axis, split_axis, schedule=schedule)

    def ref(split_axis):
        return lambda a: jax.lax.all_to_all(a, "tp", split_axis, split_axis, tiled=True)

    specs = ((P("tp"),), P("tp"))
    x = jnp.asarray(rng.standard_normal((8 * 16, 6)), jnp.float32)
    with pytest.raises(ValueError, match=r"all_to_all: 2 rows per block must divide by schedule.chunks=3; "
                                         r"valid chunk counts for this shape: \[1, 2\]"):
        run_sharded(mesh1d, a2a(0, "dma/direct/c3"), specs, x)
    np.testing.assert_array_equal(np.asarray(run_sharded(mesh1d, a2a(0, "dma/direct/c2"), specs, x)),
                                  np.asarray(run_sharded(mesh1d, ref(0), specs, x)))
    x = jnp.asarray(rng.standard_normal((8 * 6, 16)), jnp.float32)  # blocks (6, 2): chunks cut the 6 rows
    np.testing.assert_array_equal(np.asarray(run_sharded(mesh1d, a2a(1, "dma/direct/c3"), specs, x)),
                                  np.asarray(run_sharded(mesh1d, ref(1), specs, x)))


@needs_ext
def test_dma_across_processes_is_refused(mesh1d, monkeypatch):
    """Copy engines reach only the devices of this process: a group that spans processes must be
    refused when lowered, pointing at comm='xla'. (Faked: devices 4-7 claim to be in process 1.)"""
    real_describe = topology.describe

    def describe(mesh, axis_name):
        groups = [[SimpleNamespace(id=m.device_id, process_index=m.device_id // 4, local_hardware_id=m.local_ordinal)
                   for m in g.members] for g in real_describe(mesh, axis_name).groups]
        return topology.describe_groups(groups, axis_name)

    monkeypatch.setattr(topology, "describe", describe)
    with pytest.raises(ValueError, match=r"all_gather: mesh axis 'tp' spans several processes.*comm='xla'"):
        _gather(mesh1d, _zeros((64, 4)))
    with pytest.raises(ValueError, match=r"ag_matmul: mesh axis 'tp' spans several processes.*comm='xla'"):
        _ag(mesh1d, _zeros(X), _zeros(W_AG), "dma/direct/c1")


# ------------------------------------------------------------------------------------------------
# select_schedule: its inputs are checked as the ops check theirs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,shapes,axis_size,exc,pattern", [
    ("ag_matmul", ((16, 8), (9, 8)), 8, ValueError,
     r"ag_matmul: contraction sizes differ: x.shape\[1\]=8 but w.shape\[0\]=9"),
    ("ag_matmul", ((16, 8), (8, 8)), 0, ValueError, r"select_schedule: axis_size=0 must be >= 1"),
    ("matmul_rs", ((16, 8), (8, 8)), -2, ValueError, r"select_schedule: axis_size=-2 must be >= 1"),
    ("ag_matmul", ((16, 8), (8, 8)), 2.0, TypeError, r"select_schedule: axis_size must be an int .*found 2.0"),
    ("matmul_rs", ((12, 8), (8, 8)), 8, ValueError,
     r"matmul_rs: y.shape\[0\]=12 rows must divide by the axis size 8"),
    ("ag_matmul", ((16, 8, 2), (8, 8)), 4, ValueError,
     r"ag_matmul: x must be 2-D per device, found shape \(16, 8, 2\)"),
    ("matmul_sum", ((16, 8), (8, 8)), 4, ValueError, r"unknown op 'matmul_sum'"),
], ids=["contraction", "axis-0", "axis-negative", "axis-float", "rs-rows", "rank-3", "op"])
def test_select_schedule_names_the_bad_input(op, shapes, axis_size, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ficco_jax.select_schedule(op, shapes, "float32", axis_size)


# ------------------------------------------------------------------------------------------------
# overlap(fn)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(fn=3), TypeError, r"overlap: fn must be callable, found int"),
    (dict(ops="ag_matmul"), TypeError, r"overlap: ops must be a sequence of op names.*found the str 'ag_matmul'"),
    (dict(autotune="yes"), TypeError, r"overlap: autotune must be a bool, found 'yes'"),
    (dict(schedule=3), TypeError, r"overlap: schedule must be"),
    (dict(schedule="dma/sideways/c2"), ValueError, r"order='sideways' is not one of"),
], ids=["fn", "ops-str", "autotune", "schedule-type", "schedule-order"])
def test_overlap_rejects_bad_arguments(kwargs, exc, pattern):
    fn = kwargs.pop("fn", lambda x: x)
    with pytest.raises(exc, match=pattern):
        ficco_jax.overlap(fn, **kwargs)


# ------------------------------------------------------------------------------------------------
# schedule="auto" always resolves to a schedule that runs
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def gpu_like_auto(monkeypatch):
    """'auto' as on a GPU with the CUDA build: the cost model over every comm kind (on CPU,
    `policy.choose` short-cuts to comm='none')."""
    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_auto_avoids_dma_for_a_dtype_the_executor_lacks(gpu_like_auto, caplog, op):
    """float64 is not a copy-engine dtype; the model alone would pick dma for this large shape."""
    n, shapes = 4, ((2048, 8192), (8192, 2560)) if op == "ag_matmul" else ((8192, 2560), (2560, 8192))
    assert select.select_schedule(op, shapes, "float64", n, comms=COMMS).comm == "dma"
    with caplog.at_level(logging.INFO, logger="ficco_jax"):
        chosen = ops.resolve_schedule(op, "auto", shapes, np.float64, n)
    assert chosen.comm != "dma", chosen
    chosen.validate(op, shapes, n)
    assert "float64" in caplog.text and "comm='dma'" in caplog.text


def test_auto_with_float64_runs_end_to_end(monkeypatch, mesh1d, rng, caplog):
    """A model that wants copy engines everywhere: for float64 the filter must keep dma out, and the
    call must then run (on XLA's collectives) and be right."""
    asked = prefer_copy_engines(monkeypatch)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        x = jnp.asarray(rng.standard_normal((8 * 16, 64)), jnp.float64)
        w = jnp.asarray(rng.standard_normal((64, 8 * 8)), jnp.float64)
        with caplog.at_level(logging.INFO, logger="ficco_jax"):
            out = run_sharded(mesh1d, lambda x, w: ficco_jax.ag_matmul(x, w, "tp"), ag_specs(mesh1d), x, w)
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert asked and all("dma" not in comms for _, comms in asked), asked
    assert "float64" in caplog.text and "xla/ring/c1" in caplog.text
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) @ np.asarray(w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_auto_is_valid_for_awkward_shapes_and_axis_sizes(gpu_like_auto, op):
    """Rows that few chunk counts divide (primes, odd), every axis size 1..8, small and large K/N."""
    for n in range(1, 9):
        for rows in (1, 3, 5, 6, 7, 9, 12, 1023, 1536, 3000):
            for k, cols in ((8, 8), (4096, 4096)):
                a = (rows, k) if op == "ag_matmul" else (rows * n, k)
                shapes = (a, (k, cols))
                for dtype in ("bfloat16", "float32", "float64"):
                    chosen = ops.resolve_schedule(op, "auto", shapes, dtype, n)
                    chosen.validate(op, shapes, n)
                    if chosen.comm == "dma":
                        assert dtype in config.DMA_DTYPES


@needs_ext
def test_auto_on_a_2d_mesh_with_odd_rows_runs(monkeypatch, mesh2d, rng):
    """End to end through the executor on the (dp=2, tp=4) mesh, 3 rows per device: 'auto' resolves
    to a copy-engine schedule (stand-in model) and the program holds the executor's custom call."""
    asked = prefer_copy_engines(monkeypatch)
    x = jnp.asarray(rng.standard_normal((8 * 3, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 4 * 512)), jnp.float32)
    body = lambda x, w: ficco_jax.ag_matmul(x, w, "tp")  # noqa: E731
    assert "ficco_ag_matmul" in lowered_text(mesh2d, body, ag_specs(mesh2d), x, w)
    assert asked and all("dma" in comms for _, comms in asked), asked
    got = run_sharded(mesh2d, body, ag_specs(mesh2d), x, w)
    want = run_sharded(mesh2d, lambda x, w: ficco_jax.ag_matmul_ref(x, w, "tp"), ag_specs(mesh2d), x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


def test_every_environment_variable_is_named_in_config():
    """Convention: every environment variable of ficco_jax is named and documented in config.py;
    the extension's own (read in xla_ffi/) in config.NATIVE_ENVIRONMENT."""
    import re

    from ficco_jax import config

    root = pathlib.Path(__file__).resolve().parents[1]
    native = set()
    for path in (root / "xla_ffi").rglob("*"):
        if path.is_file():
            native |= set(re.findall(r'getenv\("(FICCO_[A-Z0-9_]+)"\)', path.read_text(errors="replace")))
    assert native, "no getenv found in xla_ffi/: the scan is broken"
    assert native <= set(config.NATIVE_ENVIRONMENT), sorted(native - set(config.NATIVE_ENVIRONMENT))
    python = set()
    package = root / "ficco_jax"
    for path in package.rglob("*.py"):
        if path.name != "config.py" or path.parent != package:
            python |= set(re.findall(r'environ(?:\.get)?\(?\[?"(FICCO_[A-Z0-9_]+)"', path.read_text()))
    with open(package / "config.py") as fh:
        in_config = set(re.findall(r'"(FICCO_[A-Z0-9_]+)"', fh.read()))
    assert python <= in_config, f"read outside config.py and not named there: {sorted(python - in_config)}"


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("name,raw,expected", [
    ("FICCO_CHANNEL_BYTES", "inf", "expected a whole number of bytes from 0 to"),
    ("FICCO_CHANNEL_BYTES", "abc", "expected a whole number of bytes"),
    ("FICCO_CHANNEL_BYTES", "1.7", "expected a whole number of bytes"),
    ("FICCO_RENDEZVOUS_TIMEOUT_S", "nan", "expected seconds from 0.001 to"),
    ("FICCO_WATCHDOG_S", "-3", "expected seconds from 0 to"),
    ("FICCO_CROSS_PROCESS_DMA", "maybe", "expected 1 or 0"), ("FICCO_PROFILE_MEASURE", "2", "expected 1 or 0"),
])
def test_a_bad_environment_variable_is_refused_at_import_by_name(name, raw, expected):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import ficco_jax.config"], capture_output=True, text=True,
                          env={**os.environ, name: raw}, timeout=120)
    assert done.returncode != 0 and f"{name}={raw!r}: {expected}" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("raw,expected", [("false", False), ("OFF", False), ("0", False), ("", False),
                                          ("true", True), ("1", True), ("yes", True)])
def test_a_switch_reads_the_words_users_write(monkeypatch, raw, expected):
    monkeypatch.setenv("FICCO_CROSS_PROCESS_DMA", raw)
    assert config._env_flag("FICCO_CROSS_PROCESS_DMA", False) is expected
