"""The FiCCO design space: one `Schedule` per way of overlapping a collective with its matmul.

A schedule says how the communication of `ag_matmul` (all-gather then matmul) or `matmul_rs`
(matmul then reduce-scatter) is cut and overlapped with the matmul; `matmul_psum` (matmul then
all-reduce) runs its schedule as a `matmul_rs` followed by the all-gather of the reduced rows, so it
takes exactly `matmul_rs`'s schedules:

- ``comm``: who moves the data. ``"none"``: the plain collective, then the matmul (no overlap);
  ``"xla"``: chunked ``ppermute`` steps lowered by XLA (NCCL on GPUs; the multi-host path);
  ``"dma"``: the GPU's copy engines, driven by the ficco_jax XLA FFI executor.
- ``chunks``: sub-shard decomposition factor c. Each device's shard (``ag_matmul``) or each
  per-peer block of the output (``matmul_rs``) is cut into c row chunks that move and multiply
  separately. c = 1 is shard-level overlap (XLA's windowed einsum, PyTorch async-TP).
- ``order``: ``"ring"`` (one neighbour distance at a time), ``"bidirectional"`` (half of the
  chunks travel each way round the ring; xla only), ``"direct"`` (every peer at once: uses every
  link of a fully connected NVSwitch node).
- ``gemm``: ``"per_chunk"`` (one matmul per chunk as it lands) or ``"grouped"`` (chunks move
  separately but one matmul per shard once all its chunks are there); for ``matmul_rs`` (and
  ``matmul_psum``) on copy engines also ``"columns"``: the c chunks cut each output block's columns
  instead of its rows, one matmul each. A row chunk's matmul reads the whole weight for a c-th of
  the work; a column chunk's reads a c-th of it, which keeps thin blocks off the memory bound (on
  one H100, four 512-row chunks of [2048, 14336] @ [14336, 8192] took 1.047x one matmul, four column
  chunks 0.988x).
- ``copy_streams``: how many copy streams (copy engines) the transfers of a ``dma`` direct
  schedule are spread over.
- ``transfer`` (``dma`` only): ``"pull"`` (each receiver's copy streams read from the peers) or
  ``"push"`` (each sender's copy streams write into the peers; groups inside one process only).
  A probe with PyTorch streams had writes ahead of reads when every GPU receives at once (2 x H200:
  262 vs 162 GB/s at 8 MiB blocks), but through the executor pushes timed level with pulls on
  2 x H200 (2026-11-22, BENCHMARKS.md): `push` is opt-in, not enumerated (config.TRANSFER_CHOICES).
  ``"symmetric"``: each sender writes into its peers' buffers of the call site, allocated and
  exchanged once, and the devices order the copies with counters they compare themselves, so a
  call meets no peer on the host after its site's first one and XLA can capture it in its command
  buffers (CUDA graphs); it costs a buffer per site and device of the blocks it receives. The
  devices number their launches and check them with the data: a rank that ended a launch early
  is stopped and reported, never paired with its peers' next launch; after a launch of a program
  with symmetric calls fails, restart the process (docs/design.md, "Symmetric sites"). Opt-in,
  not enumerated.

Chunks cut rows (the gathered / scattered dimension), so every chunk matmul keeps the full K and
N of the shard matmul, except under ``gemm="columns"``. For the expert-parallel ops `a2a_matmul` / `matmul_a2a`
(per-peer blocks [n, E_local, C, d]) chunks cut the capacity C of every per-peer block, and
``ring`` means neighbour steps (xla: blocks relayed hop by hop; dma: one peer at a time).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterator, Sequence

from . import config

OPS = ("ag_matmul", "matmul_rs", "a2a_matmul", "matmul_a2a", "matmul_psum")
#: The expert-parallel ops: 4-D per-peer blocks [n, E_local, C, d] (ops/api.py: a2a_matmul, matmul_a2a).
A2A_OPS = ("a2a_matmul", "matmul_a2a")
COMMS = ("none", "xla", "dma")
ORDERS = ("ring", "bidirectional", "direct")
GEMMS = ("per_chunk", "grouped", "columns")
#: The ops whose blocks gemm="columns" can cut by columns: the reduce-scatter's (exec/scatter.cc).
COLUMN_OPS = ("matmul_rs", "matmul_psum")
TRANSFERS = ("pull", "push", "symmetric")
#: The most chunk counts an error lists as valid (a dimension of 720720 has 240 divisors).
MAX_LISTED_CHUNKS = 16

# Which orders each (op, comm) pair implements.
_ORDERS_FOR = {
    ("ag_matmul", "xla"): ("ring", "bidirectional", "direct"),
    ("matmul_rs", "xla"): ("ring", "bidirectional", "direct"),
    ("ag_matmul", "dma"): ("ring", "direct"),
    ("matmul_rs", "dma"): ("direct",),
    ("matmul_psum", "xla"): ("ring", "bidirectional", "direct"),
    ("matmul_psum", "dma"): ("direct",),
    ("a2a_matmul", "xla"): ("ring", "direct"),
    ("matmul_a2a", "xla"): ("ring", "direct"),
    ("a2a_matmul", "dma"): ("ring", "direct"),
    ("matmul_a2a", "dma"): ("ring", "direct"),
}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One point of the FiCCO design space (frozen and hashable: usable as a cache key)."""

    comm: str = "xla"
    chunks: int = 1
    order: str = "ring"
    gemm: str = "per_chunk"
    copy_streams: int = 1
    transfer: str = "pull"

    def __post_init__(self):
        for field in ("chunks", "copy_streams"):  # numpy integers are taken as the ints they hold
            value = getattr(self, field)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, field, int(value))
        problem = _field_problem(dataclasses.asdict(self))
        if problem is not None:
            raise ValueError(f"Schedule: {problem}")

    # ----------------------------------------------------------------------------------------
    # The design space
    # ----------------------------------------------------------------------------------------
    @staticmethod
    def enumerate(op: str, axis_size: int, comms: Sequence[str] = COMMS) -> list["Schedule"]:
        """Every valid schedule of `op` on an axis of `axis_size` devices, `comm="none"` first."""
        _check_op(op)
        return [s for s in _candidates(op, comms) if s.problem(op, axis_size) is None]

    def validate(self, op: str, shapes: Sequence[Sequence[int]], axis_size: int) -> None:
        """Raise ValueError if this schedule cannot run `op` on these per-device shapes.

        `shapes` is ``(x.shape, w.shape)`` for ``ag_matmul`` and ``(y.shape, w.shape)`` for
        ``matmul_rs``. The message names the shape, the dimension and the valid values.
        """
        _check_op(op)
        problem = self.problem(op, axis_size)
        if problem is not None:
            raise ValueError(f"{op}: schedule {self} is not valid: {problem}")
        rows = check_shapes(op, shapes, axis_size)
        if self.comm != "none":
            problem = overlap_shape_problem(op, shapes, axis_size)
            if problem is not None:
                raise ValueError(f"{op}: schedule {self} is not valid: {problem}")
        if self.gemm == "columns":
            cols = int(shapes[1][1])
            if cols % self.chunks:
                raise ValueError(
                    f"{op}: gemm='columns' cuts the output's columns: w.shape[1]={cols} (from shape "
                    f"{tuple(shapes[1])}) must divide by schedule.chunks={self.chunks}; "
                    f"{self.chunk_hint(op, axis_size, cols)}"
                )
        elif rows % self.chunks:
            what = {"ag_matmul": "rows per device", "matmul_rs": f"rows per output block (M / {axis_size})",
                    "matmul_psum": f"rows per reduce-scatter block (M / {axis_size})"}.get(
                op, "capacity per peer block (dimension 2, C)")
            raise ValueError(
                f"{op}: {what} = {rows} (from shape {tuple(shapes[0])}) must divide by "
                f"schedule.chunks={self.chunks}; {self.chunk_hint(op, axis_size, rows)}"
            )

    def chunk_counts(self, op: str, axis_size: int, length: int) -> list[int]:
        """The chunk counts that cut `length` rows (or columns) evenly and that this schedule takes
        in place of its own (`op`'s design space: even for order='bidirectional', more than one for
        gemm='grouped' or 'columns'), smallest first."""
        return [c for c in _divisors(length) if self.replace(chunks=c).problem(op, axis_size) is None]

    def chunk_hint(self, op: str, axis_size: int, length: int) -> str:
        """The fix of a chunk count that does not divide `length`: the counts that do (at most
        MAX_LISTED_CHUNKS of them), or which field to change where none does."""
        valid = self.chunk_counts(op, axis_size, length)
        if not valid:  # odd lengths under order='bidirectional', one row or column under grouped / columns
            order = "ring" if self.order == "bidirectional" else self.order
            whole = self.replace(chunks=1, gemm="per_chunk", order=order)
            return f"no chunk count that {self} can take divides {length}: use {whole}"
        shown = ", ".join(str(c) for c in valid[:MAX_LISTED_CHUNKS])
        more = f", ... ({len(valid)} in all, up to {valid[-1]})" if len(valid) > MAX_LISTED_CHUNKS else ""
        return f"valid chunk counts for this shape: [{shown}{more}]"

    def replace(self, **changes) -> "Schedule":
        return dataclasses.replace(self, **changes)

    def for_op(self, op: str) -> "Schedule":
        """This schedule as `op` takes it where one schedule is given for several ops (overlap's
        `schedule`, a forward's for its backward): column chunks cut a reduce-scatter's blocks
        alone (COLUMN_OPS), so another op takes as many row chunks."""
        return self.replace(gemm="per_chunk") if self.gemm == "columns" and op not in COLUMN_OPS else self

    def __str__(self) -> str:
        if self.comm == "none":
            return "none"
        text = f"{self.comm}/{self.order}/c{self.chunks}"
        if self.gemm != "per_chunk":
            text += f"/{self.gemm}"
        if self.copy_streams != 1:
            text += f"/s{self.copy_streams}"
        if self.transfer != "pull":
            text += f"/{self.transfer}"
        return text

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """Inverse of `str()`: ``"none"``, ``"dma/direct/c4/s2"``, ``"xla/ring/c2/grouped"``,
        ``"dma/direct/c2/columns"``, ``"dma/direct/c2/push"``, ``"dma/direct/c1/symmetric"``."""
        parts = text.strip().split("/")
        if parts == ["none"]:
            return cls(comm="none")
        if parts[0] == "none":
            raise ValueError(
                f"cannot parse schedule {text!r}: 'none' (the plain collective, then the matmul) takes no other "
                f"fields; write 'none'"
            )
        if len(parts) < 3 or not parts[2].startswith("c"):
            raise ValueError(
                f"cannot parse schedule {text!r}: expected 'none' or "
                f"COMM/ORDER/cCHUNKS[/grouped|/columns][/sSTREAMS][/push|/symmetric], "
                f"e.g. 'dma/direct/c4/s2'"
            )
        if not _is_count(parts[2][1:]):
            raise ValueError(
                f"cannot parse schedule {text!r}: chunks {parts[2]!r} must be c<positive int>, e.g. 'c4'"
            )
        fields = dict(comm=parts[0], order=parts[1], chunks=int(parts[2][1:]))
        for extra in parts[3:]:
            if extra in ("grouped", "columns"):
                field, value = "gemm", extra
            elif extra.startswith("s") and _is_count(extra[1:]):
                field, value = "copy_streams", int(extra[1:])
            elif extra in TRANSFERS:
                field, value = "transfer", extra
            else:
                raise ValueError(f"cannot parse schedule {text!r}: unknown part {extra!r}")
            if field in fields:
                raise ValueError(f"cannot parse schedule {text!r}: {extra!r} sets {field} a second time")
            fields[field] = value
        problem = _field_problem({**dataclasses.asdict(cls()), **fields})
        if problem is not None:
            raise ValueError(f"cannot parse schedule {text!r}: {problem}")
        return cls(**fields)

    # ----------------------------------------------------------------------------------------
    def problem(self, op: str, axis_size: int) -> str | None:
        """Why this point is outside the design space of `op` (None if it is inside)."""
        if axis_size < 1:
            return f"axis_size={axis_size} must be >= 1"
        if self.comm == "none":
            others = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                      if f.name != "comm" and getattr(self, f.name) != f.default]
            if others:
                return f"comm='none' takes no other fields, found {', '.join(others)}; use Schedule(comm='none')"
            return None
        orders = _ORDERS_FOR[(op, self.comm)]
        if self.order not in orders:
            return f"order={self.order!r} is not implemented for comm={self.comm!r}; valid orders: {orders}"
        if self.order == "bidirectional" and self.chunks % 2:
            return f"order='bidirectional' sends half of the chunks each way: chunks={self.chunks} must be even"
        if self.gemm in ("grouped", "columns") and self.chunks == 1:
            return f"gemm={self.gemm!r} needs chunks > 1 (with one chunk it is per_chunk)"
        if self.gemm == "columns" and (op not in COLUMN_OPS or self.comm != "dma"):
            return (f"gemm='columns' cuts the columns of a reduce-scatter's blocks on copy engines: ops {COLUMN_OPS} "
                    f"with comm='dma'; use per_chunk or grouped")
        if self.comm == "xla" and self.copy_streams != 1:
            return f"copy_streams={self.copy_streams} applies to comm='dma' only; use 1"
        if self.comm != "dma" and self.transfer != "pull":
            return f"transfer={self.transfer!r} applies to comm='dma' only; leave the default 'pull'"
        if self.comm == "dma":
            if self.order == "ring" and self.copy_streams != 1:
                return "order='ring' moves one transfer at a time: copy_streams must be 1"
            if self.copy_streams > max(axis_size - 1, 1):
                return f"copy_streams={self.copy_streams} exceeds the {axis_size - 1} peers"
        return None


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid ops: {OPS}")


def _field_problem(fields: dict) -> str | None:
    """Why these field values make no Schedule (None if they make one)."""
    for field, allowed in (("comm", COMMS), ("order", ORDERS), ("gemm", GEMMS), ("transfer", TRANSFERS)):
        if fields[field] not in allowed:
            return f"{field}={fields[field]!r} is not one of {allowed}"
    for field in ("chunks", "copy_streams"):
        value = fields[field]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{field}={value!r} must be a positive int"
    return None


def _is_count(text: str) -> bool:
    """Whether `text` is a number written in ASCII digits (str.isdigit also takes '²' and '٢')."""
    return text.isascii() and text.isdigit()


def _divisors(length: int) -> list[int]:
    """The divisors of `length` (>= 1), smallest first."""
    small = [d for d in range(1, math.isqrt(length) + 1) if length % d == 0]
    return small + [length // d for d in reversed(small) if d * d != length]


def _candidates(op: str, comms: Sequence[str]) -> Iterator[Schedule]:
    if "none" in comms:
        yield Schedule(comm="none")
    for comm in ("xla", "dma"):
        if comm not in comms:
            continue
        for order in _ORDERS_FOR[(op, comm)]:
            if comm == "dma" and order == "ring" and "direct" in _ORDERS_FOR[(op, comm)]:
                # On copy engines the executor pulls from each owner directly in either order, so
                # ring (one peer at a time on one stream) is the same program as direct with one
                # copy stream: enumerate it once. A relaying ring for topologies that are not fully
                # connected is future work; "dma/ring/..." is still accepted and validated.
                continue
            streams = config.COPY_STREAM_CHOICES if (comm == "dma" and order == "direct") else (1,)
            transfers = config.TRANSFER_CHOICES if comm == "dma" else ("pull",)
            for chunks in config.CHUNK_CHOICES:
                for gemm in GEMMS:
                    for copy_streams in streams:
                        for transfer in transfers:
                            yield Schedule(comm=comm, chunks=chunks, order=order, gemm=gemm,
                                           copy_streams=copy_streams, transfer=transfer)


def as_schedule(op: str, value, accepted: str) -> Schedule:
    """`value`, a Schedule or its string form, as a Schedule; a TypeError naming what `op` accepts
    (`accepted`) for anything else."""
    if isinstance(value, str):
        try:
            value = Schedule.parse(value)
        except ValueError as exc:
            raise ValueError(f"{op}: {exc}") from None
    if not isinstance(value, Schedule):
        raise TypeError(f"{op}: schedule must be {accepted}; found {type(value).__name__}")
    return value


def check_shapes(op: str, shapes: Sequence[Sequence[int]], axis_size: int) -> int:
    """Check ranks and contraction sizes; return the row count that chunks must divide."""
    _check_op(op)
    if len(shapes) != 2:
        raise ValueError(f"{op}: expected two shapes (input, weight), found {len(shapes)}")
    if op in A2A_OPS:
        return _check_a2a_shapes(op, shapes, axis_size)
    a, w = (tuple(int(d) for d in s) for s in shapes)
    names = ("x", "w") if op == "ag_matmul" else ("y", "w")
    for name, shape in zip(names, (a, w)):
        if len(shape) != 2:
            raise ValueError(
                f"{op}: {name} must be 2-D per device, found shape {shape}; reshape leading dimensions "
                f"into rows first (ficco_jax.overlap does this for einsum forms)"
            )
        if 0 in shape:
            raise ValueError(
                f"{op}: {name} has an empty dimension: found shape {shape}, every dimension must be >= 1; "
                f"skip the call when there is nothing to compute"
            )
    _check_contraction(op, names[0], a, w, 1, 0)
    if op == "ag_matmul":
        return a[0]
    if op == "matmul_psum":  # the plain psum sums any rows; overlap_shape_problem says where a schedule can't
        return max(a[0] // axis_size, 1)
    if a[0] % axis_size:
        raise ValueError(
            f"matmul_rs: y.shape[0]={a[0]} rows must divide by the axis size {axis_size} to be scattered"
        )
    return a[0] // axis_size


def overlap_shape_problem(op: str, shapes: Sequence[Sequence[int]], axis_size: int) -> str | None:
    """Why no overlapped schedule (comm "xla" or "dma") can run `op` on these shapes, whatever its
    chunks; None where one can. Only `matmul_psum` has such shapes: its plain path sums any rows,
    its overlapped schedules reduce-scatter them into one block per device first."""
    if op != "matmul_psum":
        return None
    rows = int(shapes[0][0])
    if rows % axis_size:
        padded = -(-rows // axis_size) * axis_size
        return (f"y.shape[0]={rows} rows must divide by the axis size {axis_size}: the overlapped all-reduce "
                f"reduce-scatters the rows into {axis_size} blocks, then all-gathers them; pad y to {padded} rows "
                f"(and slice the result) or use schedule='none' (the plain psum)")
    return None


def _check_contraction(op: str, name: str, a, w, a_dim: int, w_dim: int, where: str = "") -> None:
    if a[a_dim] != w[w_dim]:
        raise ValueError(
            f"{op}: contraction sizes differ: {name}.shape[{a_dim}]={a[a_dim]}{where} but w.shape[{w_dim}]={w[w_dim]} "
            f"({name} {a}, w {w})"
        )


def _check_a2a_shapes(op: str, shapes, axis_size: int) -> int:
    """a2a_matmul: x [n, E, C, d], w [E, d, f]; matmul_a2a: y [n, E, C, f], w [E, f, d]. Returns C."""
    a, w = (tuple(int(d) for d in s) for s in shapes)
    names = ("x", "w") if op == "a2a_matmul" else ("y", "w")
    if len(a) != 4:
        raise ValueError(
            f"{op}: {names[0]} must be 4-D per device [n, E_local, C, d] (peer block, local expert, capacity, "
            f"features), found shape {a}"
        )
    if len(w) != 3:
        raise ValueError(f"{op}: w must be 3-D per device [E_local, in, out], found shape {w}")
    if 0 in a or 0 in w:
        raise ValueError(f"{op}: an operand has an empty dimension ({names[0]} {a}, w {w})")
    if a[0] != axis_size:
        raise ValueError(
            f"{op}: {names[0]}.shape[0]={a[0]} (dimension 0, peer blocks) must equal the axis size {axis_size}"
        )
    if a[1] != w[0]:
        raise ValueError(
            f"{op}: local expert counts differ: {names[0]}.shape[1]={a[1]} (dimension 1, E_local) but "
            f"w.shape[0]={w[0]} ({names[0]} {a}, w {w})"
        )
    _check_contraction(op, names[0], a, w, 3, 1, " (dimension 3)")
    return a[2]


def local_shapes(op: str, M: int, K: int, N: int, n: int, *, caller: str | None = None):
    """Per-device (input, weight) shapes of a tensor-parallel layer (M tokens, K, N) over n devices:
    ag_matmul x [M/n, K] @ w [K, N/n]; matmul_rs and matmul_psum y [M, N/n] @ w [N/n, K]. Errors
    open with `caller` (default: `op`)."""
    if M % n or N % n:
        raise ValueError(f"{caller or op}: M={M} and N={N} must divide by the {n} devices of the tensor-parallel "
                         f"axis (M rows and N columns are split over them); pick a shape or a device count that "
                         f"divides both")
    return ((M // n, K), (K, N // n)) if op == "ag_matmul" else ((M, N // n), (N // n, K))
