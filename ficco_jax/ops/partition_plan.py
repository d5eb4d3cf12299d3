"""Which op a partition of a dot runs, from the shardings the partitioner chose (ops/partitioned.py).

Shardings are given per dimension as tuples of mesh axis names (``()``: not sharded). For one
mesh axis A, a dot without batch dimensions is

    an lhs free dim on A, an rhs free dim on A, the result on that rhs dim  -> ag_matmul over A
    one contracting pair on A in both, the result on A along an lhs free dim -> matmul_rs over A
    one contracting pair on A in both, the result without A                  -> matmul_psum over A

and anything else the local dot: batch and free dims keep their operand's sharding, a contracting
pair sharded alike on both sides stays so and is summed, any other contracting dim is whole. A
plan states the shardings it takes and gives, which may differ from those it was offered (the
partitioner then reshards, as it does for XLA's dot).
"""
from __future__ import annotations

import dataclasses
import string

PLAIN, AG, RS, AR = "dot", "ag_matmul", "matmul_rs", "matmul_psum"


@dataclasses.dataclass(frozen=True)
class DotDims:
    """A dot_general's dimensions, by role, for operands of ranks `lhs_ndim` and `rhs_ndim`."""
    lhs_ndim: int
    rhs_ndim: int
    lhs_contract: tuple
    rhs_contract: tuple
    lhs_batch: tuple
    rhs_batch: tuple

    @classmethod
    def of(cls, dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> "DotDims":
        (lc, rc), (lb, rb) = dimension_numbers
        norm = lambda dims, ndim: tuple(int(d) % ndim for d in dims)  # noqa: E731
        return cls(lhs_ndim, rhs_ndim, norm(lc, lhs_ndim), norm(rc, rhs_ndim), norm(lb, lhs_ndim), norm(rb, rhs_ndim))

    @property
    def dimension_numbers(self):
        return (self.lhs_contract, self.rhs_contract), (self.lhs_batch, self.rhs_batch)

    @property
    def lhs_free(self) -> tuple:
        return tuple(d for d in range(self.lhs_ndim) if d not in self.lhs_contract + self.lhs_batch)

    @property
    def rhs_free(self) -> tuple:
        return tuple(d for d in range(self.rhs_ndim) if d not in self.rhs_contract + self.rhs_batch)

    def sharding_rule(self) -> tuple[str, tuple]:
        """(the einsum of this dot as a Shardy sharding rule, its reduction factors)."""
        letters = iter(string.ascii_lowercase)
        lhs, rhs = [""] * self.lhs_ndim, [""] * self.rhs_ndim
        for pairs in (zip(self.lhs_batch, self.rhs_batch), zip(self.lhs_contract, self.rhs_contract)):
            for ld, rd in pairs:
                lhs[ld] = rhs[rd] = next(letters)
        reduction = tuple(lhs[d] for d in self.lhs_contract)
        for names, free in ((lhs, self.lhs_free), (rhs, self.rhs_free)):
            for d in free:
                names[d] = next(letters)
        out = [lhs[d] for d in self.lhs_batch + self.lhs_free] + [rhs[d] for d in self.rhs_free]
        return f"{' '.join(lhs)}, {' '.join(rhs)} -> {' '.join(out)}", reduction


# A dimension's sharding as a tuple of mesh axis names (() = replicated).
def dim_axes(entry) -> tuple:
    """A PartitionSpec entry as the tuple of its mesh axes."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_entry(axes: tuple):
    """The PartitionSpec entry of a tuple of mesh axes."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one partition computes: the op, its mesh axis, the row dim (an lhs free dim) it
    gathers or scatters, and the shardings of lhs, rhs and result (tuples of per-dim axes)."""
    op: str
    axis: str | None
    row_dim: int | None
    lhs: tuple
    rhs: tuple
    out: tuple
    psum_axes: tuple = ()  # the local dot's contraction left sharded: summed over these axes


def _out_dims(dims: DotDims, lhs: list, rhs: list) -> list:
    return [lhs[d] for d in dims.lhs_batch + dims.lhs_free] + [rhs[d] for d in dims.rhs_free]


def _valid(plan_dims) -> bool:
    """No mesh axis shards two dims of one array."""
    used = [a for axes in plan_dims for a in axes]
    return len(used) == len(set(used))


def plain_plan(dims: DotDims, lhs: list, rhs: list) -> Plan:
    """The local dot: batch and free dims keep their operand's sharding (an axis used twice kept on
    its first use), contracting pairs sharded alike on both sides stay so and are summed."""
    lhs, rhs = list(lhs), list(rhs)
    for ld, rd in zip(dims.lhs_batch, dims.rhs_batch):
        rhs[rd] = lhs[ld]
    used = {a for d in dims.lhs_batch + dims.lhs_free for a in lhs[d]}
    for d in dims.rhs_free:
        rhs[d] = tuple(a for a in rhs[d] if a not in used)
        used |= set(rhs[d])
    psum = []
    for ld, rd in zip(dims.lhs_contract, dims.rhs_contract):
        if lhs[ld] and lhs[ld] == rhs[rd] and not (set(lhs[ld]) & used):
            psum += lhs[ld]
            used |= set(lhs[ld])
        else:
            lhs[ld] = rhs[rd] = ()
    return Plan(PLAIN, None, None, tuple(lhs), tuple(rhs), tuple(_out_dims(dims, lhs, rhs)), tuple(psum))


def _no_contraction_sharding(dims: DotDims, lhs: list, rhs: list):
    lhs, rhs = list(lhs), list(rhs)
    for d in dims.lhs_contract:
        lhs[d] = ()
    for d in dims.rhs_contract:
        rhs[d] = ()
    return lhs, rhs


def _gather_plan(dims: DotDims, lhs: list, rhs: list, out: list) -> Plan | None:
    """ag_matmul: lhs rows (a free dim) on axis a, rhs columns (a free dim) on a, result columns on a."""
    n_lead = len(dims.lhs_free)
    for j, rd in enumerate(dims.rhs_free):
        if len(rhs[rd]) != 1 or out[n_lead + j] != rhs[rd]:
            continue
        (axis,) = rhs[rd]
        for i, ld in enumerate(dims.lhs_free):
            if lhs[ld] == (axis,) and axis not in out[i]:
                new_lhs, new_rhs = _no_contraction_sharding(dims, lhs, rhs)
                result = _out_dims(dims, new_lhs, new_rhs)
                result[i] = ()
                plan = Plan(AG, axis, ld, tuple(new_lhs), tuple(new_rhs), tuple(result))
                if _valid(result) and _valid(new_lhs) and _valid(new_rhs):
                    return plan
    return None


def _contraction_axis(dims: DotDims, lhs: list, rhs: list):
    """(axis, lhs contracting dim) of the one contracting pair sharded on one axis alike, else None."""
    sharded = [(ld, rd) for ld, rd in zip(dims.lhs_contract, dims.rhs_contract) if lhs[ld] or rhs[rd]]
    if len(sharded) != 1:
        return None
    ((ld, rd),) = sharded
    if len(lhs[ld]) != 1 or lhs[ld] != rhs[rd]:
        return None
    return lhs[ld][0], ld, rd


def _scatter_plan(dims: DotDims, lhs: list, rhs: list, out: list) -> Plan | None:
    """matmul_rs (result rows on the contraction's axis) or matmul_psum (result without it)."""
    found = _contraction_axis(dims, lhs, rhs)
    if found is None:
        return None
    axis, lcd, rcd = found
    new_lhs, new_rhs = _no_contraction_sharding(dims, lhs, rhs)
    new_lhs = [tuple(a for a in axes if a != axis) for axes in new_lhs]
    new_rhs = [tuple(a for a in axes if a != axis) for axes in new_rhs]
    result = _out_dims(dims, new_lhs, new_rhs)
    new_lhs[lcd], new_rhs[rcd] = (axis,), (axis,)
    for i, ld in enumerate(dims.lhs_free):
        if out[i] == (axis,):
            new_lhs[ld] = ()
            result[i] = (axis,)
            plan = Plan(RS, axis, ld, tuple(new_lhs), tuple(new_rhs), tuple(result))
            return plan if _valid(result) and _valid(new_lhs) and _valid(new_rhs) else None
    if any(axis in axes for axes in out):
        return None
    plan = Plan(AR, axis, None, tuple(new_lhs), tuple(new_rhs), tuple(result))
    return plan if _valid(result) and _valid(new_lhs) and _valid(new_rhs) else None


def choose_plan(dims: DotDims, lhs: list, rhs: list, out: list, ficco: bool = True) -> Plan:
    """The plan for operand shardings `lhs`, `rhs` and the result sharding `out` the partitioner wants."""
    if ficco and not dims.lhs_batch:
        for plan in (_gather_plan(dims, lhs, rhs, out), _scatter_plan(dims, lhs, rhs, out)):
            if plan is not None:
                return plan
    return plain_plan(dims, lhs, rhs)
