"""The design space: enumeration, validation messages, string round trip."""
import re

import numpy as np
import pytest

from ficco_jax import Schedule, ops
from ficco_jax.schedule import OPS, as_schedule, local_shapes


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_enumeration_is_valid_unique_and_complete(op, n):
    points = Schedule.enumerate(op, n)
    assert points[0] == Schedule(comm="none")
    assert len(set(points)) == len(points)
    assert {p.comm for p in points} == {"none", "xla", "dma"}
    shapes = {"ag_matmul": ((8, 16), (16, 8)), "matmul_rs": ((8 * n, 16), (16, 8)),
              "matmul_psum": ((8 * n, 16), (16, 8)),
              "a2a_matmul": ((n, 2, 8, 16), (2, 16, 8)), "matmul_a2a": ((n, 2, 8, 16), (2, 16, 8))}[op]
    for p in points:
        p.validate(op, shapes, n)
        assert Schedule.parse(str(p)) == p
    orders = {p.order for p in points if p.comm == "dma"}
    # dma ring is the same program as dma direct with one copy stream: enumerated once.
    assert orders == {"direct"}
    assert Schedule(comm="dma", order="direct", copy_streams=1) in points


@pytest.mark.parametrize("kwargs,match", [
    (dict(comm="nccl"), "comm='nccl' is not one of"),
    (dict(chunks=0), "chunks=0 must be a positive int"),
    (dict(order="spiral"), "order='spiral'"),
    (dict(comm="dma", transfer="fling"), "transfer='fling' is not one of"),
])
def test_bad_fields_rejected_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


@pytest.mark.parametrize("sched,match", [
    (Schedule(comm="xla", order="bidirectional", chunks=3), "must be even"),
    (Schedule(comm="xla", gemm="grouped"), "needs chunks > 1"),
    (Schedule(comm="xla", copy_streams=2), "applies to comm='dma' only"),
    (Schedule(comm="dma", order="ring", copy_streams=2), "copy_streams must be 1"),
    (Schedule(comm="none", chunks=2), "takes no other fields, found chunks=2"),
    (Schedule(comm="xla", transfer="push"), "transfer='push' applies to comm='dma' only"),
    (Schedule(comm="none", transfer="push"), "takes no other fields"),
])
def test_invalid_points_explain_themselves(sched, match):
    with pytest.raises(ValueError, match=match):
        sched.validate("ag_matmul", ((12, 4), (4, 4)), 4)


def test_column_chunks_are_for_the_reduce_scatter_on_copy_engines():
    cols = Schedule.parse("dma/direct/c4/columns")
    assert cols.gemm == "columns" and str(cols) == "dma/direct/c4/columns"
    assert cols in Schedule.enumerate("matmul_rs", 4) and cols in Schedule.enumerate("matmul_psum", 4)
    for op in ("ag_matmul", "a2a_matmul", "matmul_a2a"):
        assert all(p.gemm != "columns" for p in Schedule.enumerate(op, 4)), op
    with pytest.raises(ValueError, match="gemm='columns' cuts the columns of a reduce-scatter's blocks"):
        cols.validate("ag_matmul", ((12, 4), (4, 4)), 4)
    with pytest.raises(ValueError, match="with comm='dma'"):
        cols.replace(comm="xla").validate("matmul_rs", ((16, 4), (4, 8)), 4)
    with pytest.raises(ValueError, match="needs chunks > 1"):
        cols.replace(chunks=1).validate("matmul_rs", ((16, 4), (4, 8)), 4)
    # The chunks cut w's columns, not the blocks' rows: 6 rows per block are fine, 6 columns are not.
    cols.validate("matmul_rs", ((24, 4), (4, 8)), 4)
    six_columns = r"w.shape\[1\]=6 .* must divide by schedule.chunks=4; valid chunk counts for this shape: \[2, 3, 6\]"
    with pytest.raises(ValueError, match=six_columns):
        cols.validate("matmul_rs", ((16, 4), (4, 6)), 4)
    # One schedule given for several ops (overlap's, a forward's for its backward): the other ops cut rows.
    assert cols.for_op("matmul_rs") == cols and cols.for_op("matmul_psum") == cols
    assert all(cols.for_op(op) == Schedule.parse("dma/direct/c4") for op in ("ag_matmul", "a2a_matmul", "matmul_a2a"))
    assert ops.on_xla(cols) == Schedule.parse("xla/direct/c4")
    for twice in ("dma/direct/c4/grouped/columns", "dma/direct/c4/s2/s4", "dma/direct/c4/push/pull"):
        with pytest.raises(ValueError, match="a second time"):
            Schedule.parse(twice)


def test_matmul_psum_takes_matmul_rs_schedules():
    assert Schedule.enumerate("matmul_psum", 4) == Schedule.enumerate("matmul_rs", 4)


@pytest.mark.parametrize("sched", ["xla/ring/c1", "dma/direct/c1"])
def test_matmul_psum_rows_not_dividing_by_the_axis_say_how_to_fix(sched):
    """The plain psum sums any rows; an overlapped schedule reduce-scatters them first."""
    Schedule.parse("none").validate("matmul_psum", ((10, 4), (4, 3)), 4)
    with pytest.raises(ValueError, match=r"y.shape\[0\]=10 rows must divide by the axis size 4.*pad y to 12 "
                                         r"rows.*schedule='none'"):
        Schedule.parse(sched).validate("matmul_psum", ((10, 4), (4, 3)), 4)


def test_matmul_psum_chunks_cut_the_reduce_scatter_blocks():
    with pytest.raises(ValueError, match=r"matmul_psum: rows per reduce-scatter block \(M / 4\) = 6 .*chunks=4.*"
                                         r"valid chunk counts for this shape: \[1, 2, 3, 6\]"):
        Schedule.parse("xla/ring/c4").validate("matmul_psum", ((24, 4), (4, 3)), 4)


def test_matmul_rs_dma_ring_is_not_in_the_space():
    with pytest.raises(ValueError, match=r"valid orders: \('direct',\)"):
        Schedule(comm="dma", order="ring").validate("matmul_rs", ((16, 4), (4, 4)), 4)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse schedule"):
        Schedule.parse("fast please")


@pytest.mark.parametrize("text,match", [
    ("none/direct/c2", r"'none' \(the plain collective, then the matmul\) takes no other fields; write 'none'"),
    ("none/", r"'none' .* takes no other fields"),
    ("dma/direct/c0", r"chunks=0 must be a positive int"),
    ("dma/direct/c2/s0", r"copy_streams=0 must be a positive int"),
    ("dma/sideways/c2", r"order='sideways' is not one of"),
    ("dma/direct/c\u00b2", r"chunks 'c\u00b2' must be c<positive int>"),
    ("dma/direct/c\u0662", r"chunks 'c\u0662' must be c<positive int>"),
    ("dma/direct/c2/s\u00b2", r"unknown part 's\u00b2'"),
])
def test_parse_names_the_text_it_refuses(text, match):
    with pytest.raises(ValueError, match=rf"^cannot parse schedule {re.escape(repr(text))}: {match}"):
        Schedule.parse(text)
    with pytest.raises(ValueError, match=rf"^ag_matmul: cannot parse schedule {re.escape(repr(text))}: {match}"):
        as_schedule("ag_matmul", text, "a schedule")


def test_numpy_integers_are_taken_as_ints():
    sched = Schedule(comm="dma", order="direct", chunks=np.int64(2), copy_streams=np.int32(2))
    assert sched == Schedule(comm="dma", order="direct", chunks=2, copy_streams=2)
    assert type(sched.chunks) is int and type(sched.copy_streams) is int
    assert hash(sched) == hash(Schedule.parse("dma/direct/c2/s2")) and str(sched) == "dma/direct/c2/s2"
    for bad in (2.0, True, np.float32(2), np.bool_(True), "2"):
        with pytest.raises(ValueError, match=re.escape(f"Schedule: chunks={bad!r} must be a positive int")):
            Schedule(chunks=bad)


@pytest.mark.parametrize("sched,op,shapes,hint", [
    ("xla/ring/c2", "ag_matmul", ((15, 4), (4, 4)), r"valid chunk counts for this shape: \[1, 3, 5, 15\]"),
    ("xla/ring/c2/grouped", "ag_matmul", ((15, 4), (4, 4)), r"valid chunk counts for this shape: \[3, 5, 15\]"),
    ("xla/bidirectional/c4", "ag_matmul", ((6, 4), (4, 4)), r"valid chunk counts for this shape: \[2, 6\]"),
    ("xla/bidirectional/c2", "ag_matmul", ((15, 4), (4, 4)),
     r"no chunk count that xla/bidirectional/c2 can take divides 15: use xla/ring/c1"),
    ("dma/direct/c2/columns", "matmul_rs", ((16, 4), (4, 15)), r"valid chunk counts for this shape: \[3, 5, 15\]"),
    ("dma/direct/c2/columns", "matmul_rs", ((16, 4), (4, 1)),
     r"no chunk count that dma/direct/c2/columns can take divides 1: use dma/direct/c1"),
    ("xla/ring/c17", "ag_matmul", ((720720, 4), (4, 4)),
     r"valid chunk counts for this shape: \[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, \.\.\. "
     r"\(240 in all, up to 720720\)\]"),
])
def test_chunk_hints_list_the_counts_that_divide(sched, op, shapes, hint):
    """Every divisor the schedule can take, odd ones included (not only the enumerated choices)."""
    with pytest.raises(ValueError, match=hint):
        Schedule.parse(sched).validate(op, shapes, 4)


def test_local_shapes_errors_name_the_caller():
    assert local_shapes("ag_matmul", 12, 8, 24, 3) == ((4, 8), (8, 8))
    with pytest.raises(ValueError, match=r"^ag_matmul: M=8192 and N=10240 must divide by the 3 devices"):
        local_shapes("ag_matmul", 8192, 8192, 10240, 3)
    with pytest.raises(ValueError, match=r"^rank: M=8192 and N=10240 must divide by the 3 devices"):
        local_shapes("ag_matmul", 8192, 8192, 10240, 3, caller="rank")


def test_push_round_trips_and_is_enumerated_when_chosen(monkeypatch):
    from ficco_jax import config

    text = "dma/direct/c4/grouped/s2/push"
    assert str(Schedule.parse(text)) == text
    assert Schedule.parse(text).transfer == "push"
    assert str(Schedule(comm="dma", order="direct")) == "dma/direct/c1"  # pull is the unwritten default
    assert {p.transfer for p in Schedule.enumerate("matmul_rs", 4)} == {"pull"}
    monkeypatch.setattr(config, "TRANSFER_CHOICES", ("pull", "push"))
    points = Schedule.enumerate("matmul_rs", 4)
    dma = [p for p in points if p.comm == "dma"]
    assert {p.transfer for p in dma} == {"pull", "push"}
    assert len([p for p in dma if p.transfer == "push"]) == len(dma) // 2
    assert all(p.transfer == "pull" for p in points if p.comm != "dma")
