"""The design space: enumeration, validation messages, string round trip."""
import pytest

from ficco_jax import Schedule, ops
from ficco_jax.schedule import OPS


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
    (Schedule(comm="none", chunks=2), "takes no other fields"),
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
    six_columns = r"w.shape\[1\]=6 .* must divide by schedule.chunks=4; valid chunk counts: \[2\]"
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
                                         r"valid chunk counts for this shape: \[1, 2\]"):
        Schedule.parse("xla/ring/c4").validate("matmul_psum", ((24, 4), (4, 3)), 4)


def test_matmul_rs_dma_ring_is_not_in_the_space():
    with pytest.raises(ValueError, match=r"valid orders: \('direct',\)"):
        Schedule(comm="dma", order="ring").validate("matmul_rs", ((16, 4), (4, 4)), 4)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse schedule"):
        Schedule.parse("fast please")


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
