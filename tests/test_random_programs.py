"""Generated programs (hypothesis): every program that runs without overlap() runs with it, gives
the same values and types, and explain() reports it without raising, on 8 CPU devices.

Two families of programs are generated, each on every mesh layout (tp only, (dp, tp) in both axis
orders, tp of one device):
- global view under explicit sharding: operands unsharded or split on rows, columns or batch over
  one axis or two (specs with and without their trailing unsharded entries), an optional reshard
  before the matmul, an optional reshape, a matmul with or without batch dimensions and with or
  without out_sharding=, an optional reshard after. Reshards and out_shardings are drawn mostly as
  one axis taken off or put on one dimension, the resharding a site is, so that sites are found;
- shard_map bodies: all_gather then (or not) a matmul, a matmul (or not) then psum_scatter, over
  tp, dp or both, on any dimension, with optional reshapes and batch dimensions, on meshes with
  explicit or auto axes.
Operands are f32 or bf16 (bf16 with or without an f32 result); inputs are random, never zero.

A drawn program that does not run as written (jax refuses a sharding or a shape that does not
divide; the CPU backend lacks a dot) is rejected while it is drawn, so every test body runs a
program that runs. Each example compiles the program as written and as rewritten under a forced
schedule (copy-engine ones where the extension is built), checks that every site explain() finds
takes that schedule or says why it does not, then that overlap() with "auto" (the plain path on
CPU) equals the program too. Each test fails unless some of its programs ran an overlapped site, so
a rewrite that did nothing fails it. Reproducible and bounded for CI as test_property.py:
`derandomize=True` and 25 examples per mesh and family, mostly XLA compile time. Ten more shard_map
programs per mesh, each with a matmul before a reduce-scatter over devices, run their copy-engine
reduce-scatters on group channels (config.CHANNEL_BYTES set).
"""
import dataclasses
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, event, given, settings, strategies as st  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, reshard  # noqa: E402

from ficco_jax import explain, overlap  # noqa: E402
from ficco_jax.rewrite.overlap import Report  # noqa: E402
from ficco_jax.runtime import extension  # noqa: E402
from helpers import TOLERANCE, examples, rel_err, runs_given  # noqa: E402

_PERMUTED = [5, 2, 7, 0, 3, 6, 1, 4]  # device ordinals differ from ranks
MESH_LAYOUTS = {  # name -> (shape, axis names, device order)
    "tp8": ((8,), ("tp",), range(8)),
    "dp2xtp4": ((2, 4), ("dp", "tp"), _PERMUTED),
    "dp4xtp2": ((4, 2), ("dp", "tp"), range(8)),
    "tp2xdp4": ((2, 4), ("tp", "dp"), _PERMUTED),  # tp is the slow mesh axis
    "dp8xtp1": ((8, 1), ("dp", "tp"), range(8)),  # the tp collectives move nothing
}
SIZES = (8, 16)  # every dimension divides over every axis and every pair of axes
DTYPES = (("float32", False), ("bfloat16", False), ("bfloat16", True))  # (operand dtype, f32 result)
# Forced schedules: "auto" keeps the plain path on CPU, so these make the rewritten ops run. A
# schedule a site's shapes refuse falls back to "auto" there.
SCHEDULES = ("xla/ring/c1", "xla/ring/c2", "xla/bidirectional/c2",
             *(("dma/direct/c1", "dma/ring/c2", "dma/direct/c2/columns") if extension.available() else ()))
PROGRAMS = settings(max_examples=examples(25), deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@functools.cache
def make_mesh(name: str, explicit: bool) -> Mesh:
    shape, names, order = MESH_LAYOUTS[name]
    devices = np.array(jax.devices()[:8])[list(order)].reshape(shape)
    return Mesh(devices, names, axis_types=((AxisType.Explicit if explicit else AxisType.Auto),) * len(names))


def _entries(mesh: Mesh) -> list:
    """What one dimension of a PartitionSpec may say on `mesh`: unsharded, one axis, two axes."""
    names = list(mesh.axis_names)
    return [None, *names, *[(a, b) for a in names for b in names if a != b]]


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _spec(entries) -> P:
    """P(*entries), trailing unsharded dimensions left out (as P('tp') for a matrix)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _padded(spec: P, rank: int) -> list:
    return list(spec) + [None] * (rank - len(spec))


@st.composite
def specs(draw, mesh: Mesh, rank: int) -> P:
    """A PartitionSpec of a rank-`rank` value, each mesh axis used once, with or without its
    trailing unsharded dimensions."""
    entries, used = [], set()
    for _ in range(rank):
        entry = draw(st.sampled_from([e for e in _entries(mesh) if not set(_axes(e)) & used]))
        entries.append(entry)
        used |= set(_axes(entry))
    return P(*entries) if draw(st.booleans()) else _spec(entries)


@st.composite
def moved(draw, mesh: Mesh, spec: P, rank: int, only: str | None = None) -> P:
    """`spec` with one mesh axis (`only`, where given) taken off one dimension (a gather) or put on
    an unsharded one (a scatter): the resharding next to a matmul that a site is."""
    entries = _padded(spec, rank)
    used = {a for e in entries for a in _axes(e)}
    changes = [(d, tuple(x for x in _axes(e) if x != a)) for d, e in enumerate(entries) for a in _axes(e)]
    changes += [(d, (a,)) for d, e in enumerate(entries) if e is None for a in mesh.axis_names if a not in used]
    changes = [(d, axes) for d, axes in changes if only is None or only in _axes(entries[d]) + axes]
    if not changes:
        return spec
    d, axes = draw(st.sampled_from(changes))
    entries[d] = _entry(axes)
    return _spec(entries)


def _only_on(spec: P, rank: int, dim: int, axis: str) -> P:
    """`spec` with `axis` splitting dimension `dim` alone and no other dimension."""
    entries = [_entry(tuple(a for a in _axes(e) if a != axis)) for e in _padded(spec, rank)]
    entries[dim] = axis
    return _spec(entries)


def _global_shape(mesh: Mesh, local: tuple, spec: P) -> tuple:
    """The shape whose blocks under `spec` are `local`."""
    return tuple(n * int(np.prod([mesh.shape[a] for a in _axes(e)], dtype=int))
                 for n, e in zip(local, _padded(spec, len(local))))


@dataclasses.dataclass(frozen=True)
class Matmul:
    """x [(b,) m, k] times w [k, n] (b a free dimension of x) or w [b, k, n] (b a batch dimension);
    the first operand is w where `w_first` (x's rows become the result's last dimensions)."""

    batch: bool
    w_first: bool

    def _subscripts(self, rank: int) -> str:
        x, w = "bmk"[3 - rank:], "bkn" if self.batch else "kn"
        rows = x[1:-1] if self.batch else x[:-1]
        out = ("b" if self.batch else "") + ("n" + rows if self.w_first else rows + "n")
        return f"{w},{x}->{out}" if self.w_first else f"{x},{w}->{out}"

    def __call__(self, x, w, **kwargs):
        return jnp.einsum(self._subscripts(x.ndim), *((w, x) if self.w_first else (x, w)), **kwargs)

    def product(self, x: list, w: list) -> list:
        """The PartitionSpec entries x's and w's entries give the product, before any collective."""
        if self.batch:
            lead, rows = [w[0] if self.w_first else x[0]], x[1:-1]
        else:
            lead, rows = [], x[:-1]
        return lead + ([w[-1], *rows] if self.w_first else [*rows, w[-1]])


@st.composite
def matmuls(draw, rank: int) -> Matmul:
    return Matmul(batch=rank == 3 and draw(st.booleans()), w_first=draw(st.booleans()))


# --------------------------------------------------------------------------------------------
# Global-view programs under explicit sharding
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GlobalProgram:
    """``y = einsum(reshape?(reshard?(x)), w, out_sharding=out); return reshard?(y)``."""

    mesh_name: str
    dtype: str
    f32_result: bool
    x_shape: tuple
    w_shape: tuple
    x_spec: P
    w_spec: P
    gather_spec: P | None  # the reshard of x before the matmul
    flatten: bool  # x [b, m, k] -> [b·m, k] before the matmul
    matmul: Matmul
    out_spec: P | None  # the matmul's out_sharding
    after_spec: P | None  # the reshard of the product

    @property
    def mesh(self) -> Mesh:
        return make_mesh(self.mesh_name, explicit=True)

    def __call__(self, x, w):
        g = x if self.gather_spec is None else reshard(x, self.gather_spec)
        if self.flatten:
            g = g.reshape(-1, g.shape[-1])
        kind = jnp.float32 if self.f32_result else None
        y = self.matmul(g, w, out_sharding=self.out_spec, preferred_element_type=kind)
        return y if self.after_spec is None else reshard(y, self.after_spec)

    def avals(self):
        return [jax.ShapeDtypeStruct(shape, self.dtype, sharding=NamedSharding(self.mesh, spec))
                for shape, spec in ((self.x_shape, self.x_spec), (self.w_shape, self.w_spec))]


@st.composite
def global_programs(draw, mesh_name: str) -> GlobalProgram:
    mesh = make_mesh(mesh_name, explicit=True)
    dtype, f32_result = draw(st.sampled_from(DTYPES))
    rank = draw(st.sampled_from((2, 3)))
    matmul = draw(matmuls(rank))
    flatten = rank == 3 and not matmul.batch and draw(st.booleans())
    b, m, k, n = (draw(st.sampled_from(SIZES)) for _ in range(4))
    x_shape = (b, m, k)[3 - rank:]
    w_shape = (b, k, n) if matmul.batch else (k, n)
    # Mostly the shapes of sites: a gather of x before the matmul, or a contraction split over one
    # axis whose product is scattered over it; else shardings drawn freely.
    pattern = draw(st.sampled_from(("column", "gather", "scatter", "free")))
    x_spec, w_spec = draw(specs(mesh, rank)), draw(specs(mesh, len(w_shape)))
    gather_spec = scatter_axis = None
    if pattern == "gather":
        gather_spec = draw(moved(mesh, x_spec, rank))
    elif pattern == "column":  # Megatron's column-parallel matmul: x's rows gathered over w's column axis
        axis = draw(st.sampled_from(mesh.axis_names))
        x_shape = x_shape[:-2] + (x_shape[-2] * mesh.shape[axis], k)  # every device holds rows to cut in chunks
        x_spec = _only_on(P(), rank, rank - 2, axis)
        w_spec, gather_spec = _only_on(P(), len(w_shape), len(w_shape) - 1, axis), P()
    elif pattern == "scatter":
        scatter_axis = draw(st.sampled_from(mesh.axis_names))
        x_spec, w_spec = _only_on(x_spec, rank, rank - 1, scatter_axis), _only_on(w_spec, len(w_shape), -2, scatter_axis)
    else:
        gather_spec = draw(st.none() | specs(mesh, rank))
    out_rank = 2 if flatten else rank
    x_entries = _padded(gather_spec or x_spec, rank)
    if flatten:
        x_entries = [_entry(_axes(x_entries[0]) + _axes(x_entries[1])), x_entries[2]]
    product = _spec(matmul.product(x_entries, _padded(w_spec, len(w_shape))))
    choice = {"none": st.none(), "moved": moved(mesh, product, out_rank, only=scatter_axis),
              "any": specs(mesh, out_rank)}
    out_spec = draw(choice[draw(st.sampled_from(tuple(choice)))])
    after_spec = draw(st.none() | moved(mesh, out_spec or product, out_rank, only=scatter_axis))
    return GlobalProgram(mesh_name, dtype, f32_result, x_shape, w_shape, x_spec, w_spec, gather_spec, flatten,
                         matmul, out_spec, after_spec)


# --------------------------------------------------------------------------------------------
# shard_map programs
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardMapProgram:
    """A shard_map over the mesh whose body is ``all_gather → reshape? → matmul?`` or
    ``matmul? → reshape? → psum_scatter``; the result's first dimension maps over every axis."""

    mesh_name: str
    explicit: bool  # the mesh's axis types (Explicit: the arguments' shardings are in their types)
    dtype: str
    f32_result: bool
    collective: str  # "all_gather" | "psum_scatter"
    axis: str | tuple  # one mesh axis, or all of them
    dim: int  # the gathered / scattered dimension
    x_shape: tuple  # global shapes
    w_shape: tuple
    x_spec: P
    w_spec: P
    matmul: Matmul | None  # None: the collective alone
    flatten: bool  # [b, m, ·] -> [b·m, ·] between the collective and the matmul

    @property
    def mesh(self) -> Mesh:
        return make_mesh(self.mesh_name, self.explicit)

    def body(self, x, w):
        kind = jnp.float32 if self.f32_result else None

        def matmul(v):
            return v if self.matmul is None else self.matmul(v, w, preferred_element_type=kind)

        def flatten(v):
            return v.reshape(-1, v.shape[-1]) if self.flatten else v

        if self.collective == "all_gather":
            return matmul(flatten(jax.lax.all_gather(x, self.axis, axis=self.dim, tiled=True)))
        y = flatten(matmul(x))
        return jax.lax.psum_scatter(y, self.axis, scatter_dimension=self.dim, tiled=True)

    def __call__(self, x, w):
        return jax.shard_map(self.body, mesh=self.mesh, in_specs=(self.x_spec, self.w_spec),
                             out_specs=P(self.mesh.axis_names))(x, w)

    def avals(self):
        sharded = [NamedSharding(self.mesh, spec) if self.explicit else None for spec in (self.x_spec, self.w_spec)]
        return [jax.ShapeDtypeStruct(self.x_shape, self.dtype, sharding=sharded[0]),
                jax.ShapeDtypeStruct(self.w_shape, self.dtype, sharding=sharded[1])]


@st.composite
def shard_map_programs(draw, mesh_name: str) -> ShardMapProgram:
    explicit = draw(st.booleans())
    mesh = make_mesh(mesh_name, explicit)
    dtype, f32_result = draw(st.sampled_from(DTYPES))
    collective = draw(st.sampled_from(("all_gather", "psum_scatter")))
    axis = draw(st.sampled_from([*mesh.axis_names, *([tuple(mesh.axis_names)] if len(mesh.axis_names) > 1 else [])]))
    rank = draw(st.sampled_from((2, 3)))
    with_matmul = draw(st.sampled_from((True, True, False)))
    matmul = draw(matmuls(rank)) if with_matmul else None
    flatten = rank == 3 and not (matmul and matmul.batch) and draw(st.booleans())
    x_local = tuple(draw(st.sampled_from(SIZES)) for _ in range(rank))
    gathered = list(x_local)
    dim = draw(st.integers(0, (2 if flatten and collective == "psum_scatter" else rank) - 1))
    if collective == "all_gather":
        gathered[dim] *= int(np.prod([mesh.shape[a] for a in _axes(axis)]))
    if flatten and collective == "all_gather":
        gathered = [gathered[0] * gathered[1], gathered[2]]
    n = draw(st.sampled_from(SIZES))
    w_local = (gathered[0], gathered[-1], n) if matmul and matmul.batch else (gathered[-1], n)
    x_spec, w_spec = draw(specs(mesh, rank)), draw(specs(mesh, len(w_local)))
    return ShardMapProgram(mesh_name, explicit, dtype, f32_result, collective, axis, dim,
                           _global_shape(mesh, x_local, x_spec), _global_shape(mesh, w_local, w_spec), x_spec,
                           w_spec, matmul, flatten)


# --------------------------------------------------------------------------------------------
# The property
# --------------------------------------------------------------------------------------------
def _inputs(program, seed: int) -> list:
    """Random operands of `program`, placed as its shardings say where they say it."""
    rng = np.random.default_rng(seed)
    values = [(jnp.asarray(rng.standard_normal(a.shape, np.float32) + 0.25).astype(a.dtype), a.sharding)
              for a in program.avals()]
    return [v if sharding is None else jax.device_put(v, sharding) for v, sharding in values]


def runs(program) -> bool:
    """Whether the program as written runs: jax traces it (its shardings and shapes) and the CPU
    backend executes it (its dot has no bf16 x bf16 -> f32 form for every operand layout)."""
    try:
        with jax.set_mesh(program.mesh):
            jax.block_until_ready(jax.jit(program)(*_inputs(program, seed=0)))
    except Exception:  # noqa: BLE001 - any refusal makes this draw no program at all
        return False
    return True


def _assert_same(got, want, dtype: str, what: str):
    assert jax.typeof(got) == jax.typeof(want), (what, jax.typeof(got), jax.typeof(want))
    assert np.abs(np.asarray(want, np.float32)).max() > 0, what
    err = rel_err(got, want)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.2e} >= {TOLERANCE[dtype]}"


def _takes_given(site, schedule: str) -> bool:
    """Whether an explain() site runs the schedule given to overlap(), or its record says why not
    (its shapes refuse it, or the executor lacks its numerics: the same steps on XLA's collectives)."""
    return (runs_given(site, schedule) or f"(given {schedule};" in site.schedule
            or site.note.startswith(f"given {schedule} does not fit this site: "))


def check_program(program, schedule: str, seed: int) -> Report:
    """`program` equals itself overlapped under `schedule` and under "auto" (values and types),
    explain() reports it, and every site it finds takes `schedule` or says why not; returns the
    report under `schedule`."""
    args = _inputs(program, seed)
    with jax.set_mesh(program.mesh):
        want = jax.jit(program)(*args)
        report = explain(overlap(program, schedule=schedule), *args)
        assert isinstance(report, Report)
        event(f"rewritten: {sorted(r.op for r in report.sites)}; near-misses: {sorted(r.op for r in report.near_misses)}")
        str(report)  # the table renders every record
        assert all(_takes_given(site, schedule) for site in report.sites), f"{schedule}\n{report}"
        _assert_same(jax.jit(overlap(program, schedule=schedule))(*args), want, program.dtype, f"{schedule}\n{report}")
        assert isinstance(explain(program, *args), Report)
        _assert_same(overlap(jax.jit(program), schedule="auto")(*args), want, program.dtype, "auto")
    return report


def overlapped_sites(programs, schedules=SCHEDULES, examples=PROGRAMS) -> list:
    """check_program on drawn `programs`, each under one of `schedules`: the sites that ran an
    overlapped schedule, over all the examples (a test asserts there were some, so that a rewrite
    that did nothing would fail it)."""
    found = []

    @examples
    @given(data=st.data(), schedule=st.sampled_from(schedules), seed=st.integers(0, 2**16))
    def check(data, schedule, seed):
        report = check_program(data.draw(programs.filter(runs)), schedule, seed)
        found.extend(site for site in report.sites if not site.schedule.startswith("none"))

    check()
    return found


@pytest.mark.hypothesis
@pytest.mark.sweep(first=2)
@pytest.mark.parametrize("mesh_name", sorted(MESH_LAYOUTS))
def test_global_view_programs(mesh_name):
    assert overlapped_sites(global_programs(mesh_name)), "no drawn program had a site that overlapped"


@pytest.mark.hypothesis
@pytest.mark.sweep(first=2)
@pytest.mark.parametrize("mesh_name", sorted(MESH_LAYOUTS))
def test_shard_map_programs(mesh_name):
    assert overlapped_sites(shard_map_programs(mesh_name)), "no drawn program had a site that overlapped"


def _has_channel_site(program) -> bool:
    """Whether `program` has a copy-engine reduce-scatter over an axis of 2+ devices: the partials
    the channel moves."""
    return (program.collective == "psum_scatter" and program.matmul is not None
            and int(np.prod([program.mesh.shape[a] for a in _axes(program.axis)])) > 1)


@pytest.mark.hypothesis
@pytest.mark.sweep(first=2)
@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
@pytest.mark.parametrize("mesh_name", sorted(MESH_LAYOUTS))
def test_shard_map_programs_with_group_channels(mesh_name, monkeypatch):
    """The same, with the copy-engine reduce-scatters of small partials on their group's channels
    (config.CHANNEL_BYTES set while the programs are traced; xla_ffi/runtime/channel.h): programs
    with a matmul then a reduce-scatter over devices, whose partials the channel moves (its words
    are set) wherever a site ran on copy engines."""
    from ficco_jax import config

    monkeypatch.setattr(config, "CHANNEL_BYTES", 8 << 20)
    on_channel = []

    @settings(PROGRAMS, max_examples=examples(10))
    @given(data=st.data(), schedule=st.sampled_from(("dma/direct/c1", "dma/ring/c2", "dma/direct/c2/grouped")),
           seed=st.integers(0, 2**16))
    def check(data, schedule, seed):
        program = data.draw(shard_map_programs(mesh_name).filter(_has_channel_site).filter(runs))
        words = extension.testing().backend_calls()["set_word"]
        report = check_program(program, schedule, seed)
        sites = [r for r in report.sites if r.op in ("matmul_rs", "matmul_a2a") and r.schedule.startswith("dma/")]
        event(f"sites on a channel: {len(sites)}")
        if sites:
            assert extension.testing().backend_calls()["set_word"] > words, str(report)
        on_channel.extend(sites)

    check()
    assert on_channel, "no drawn program ran a reduce-scatter on its group's channel"
