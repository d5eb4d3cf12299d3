"""What overlap() keeps of the program as written: its names (profiles and HLO metadata tell layers
apart), how often the user's function is traced, and where explain() points (8 CPU devices)."""
import collections
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from ficco_jax.rewrite import explain, overlap

SCHEDULES = ("xla/ring/c2", "dma/direct/c2")
T, D, F = 32, 16, 32  # tokens, hidden, ffn (global)
SPECS = (P("tp"), P(None, "tp"), P("tp", None))


@pytest.fixture
def mesh(mesh1d):
    return mesh1d


def _mlp_args(mesh, seed=0, tokens=T):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = ((tokens, D), (D, F), (F, D))
    return [jax.device_put(jax.random.normal(k, s, jnp.float32) / np.sqrt(s[-1]), NamedSharding(mesh, spec))
            for k, s, spec in zip(keys, shapes, SPECS)]


def _mlp_layer(x, w1, w2):
    """Sequence-parallel MLP body: all_gather → matmul → tanh → matmul → psum_scatter."""
    h = jnp.tanh(jax.lax.all_gather(x, "tp", tiled=True) @ w1)
    return jax.lax.psum_scatter(h @ w2, "tp", tiled=True)


def _labelled(how: str):
    """The MLP body with its layer labelled "my_layer" as users label layers, then a sine outside it."""
    if how == "named_scope":
        def layer(x, w1, w2):
            with jax.named_scope("my_layer"):
                return _mlp_layer(x, w1, w2)
    else:
        layer = jax.named_call(_mlp_layer, name="my_layer")

    def body(x, w1, w2):
        return jnp.sin(layer(x, w1, w2))

    return body


def _op_names(fn, *args) -> list[str]:
    """The op_name metadata of every HLO instruction of jit(fn) as lowered."""
    text = jax.jit(fn).lower(*args).as_text(dialect="hlo", debug_info=True)
    return re.findall(r'op_name="([^"]*)"', text)


def _by_primitive(names, primitives) -> collections.Counter:
    return collections.Counter(n for n in names if n.rsplit("/", 1)[-1] in primitives)


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("how", ["named_scope", "named_call"])
def test_layer_names_survive_the_rewrite(mesh, schedule, how):
    fn = jax.shard_map(_labelled(how), mesh=mesh, in_specs=SPECS, out_specs=P("tp"))
    args = _mlp_args(mesh)
    plain, overlapped = _op_names(fn, *args), _op_names(overlap(fn, schedule=schedule), *args)
    assert len(explain(overlap(fn, schedule=schedule), *args).overlapped) == 2
    # The operations the rewrite leaves as written keep their names, inside the layer and outside it.
    kept = _by_primitive(plain, ("tanh", "sin"))
    assert kept[next(n for n in kept if n.endswith("my_layer/tanh"))] == 1, plain
    assert _by_primitive(overlapped, ("tanh", "sin")) == kept, overlapped
    # The ops that replace the sites are named inside the layer too.
    site_ops = ("ficco_ag_matmul", "ficco_matmul_rs") if schedule.startswith("dma") else ("ppermute",)
    replaced = [n for n in overlapped if n.rsplit("/", 1)[-1] in site_ops]
    assert replaced and all("my_layer/" in n for n in replaced), overlapped
    assert not any(n.rsplit("/", 1)[-1] in ("all_gather", "reduce_scatter") for n in overlapped)


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------
WRAPS = {
    "overlap": lambda f, s: overlap(f, schedule=s),
    "overlap(overlap)": lambda f, s: overlap(overlap(f, schedule=s), schedule=s),
    "jit(overlap)": lambda f, s: jax.jit(overlap(f, schedule=s)),
    "overlap(jit)": lambda f, s: overlap(jax.jit(f), schedule=s),
    "jit(overlap(overlap))": lambda f, s: jax.jit(overlap(overlap(f, schedule=s), schedule=s)),
}


def _counting_mlp(mesh, traces: list):
    def body(x, w1, w2):
        traces.append(x.shape)  # a Python side effect: runs once per trace
        return _mlp_layer(x, w1, w2)

    return jax.shard_map(body, mesh=mesh, in_specs=SPECS, out_specs=P("tp"))


def _traces(mesh, wrap) -> int:
    """How often the body is traced over three calls: two with one signature, one with another."""
    traces = []
    fn = wrap(_counting_mlp(mesh, traces))
    for tokens in (T, T, 2 * T):
        jax.block_until_ready(fn(*_mlp_args(mesh, tokens=tokens)))
    return len(traces)


@pytest.mark.parametrize("schedule", ["auto", "xla/ring/c2"])  # on CPU, auto rewrites nothing
@pytest.mark.parametrize("wrap", WRAPS)
def test_traced_as_often_as_jit(mesh, wrap, schedule):
    assert _traces(mesh, jax.jit) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _traces(mesh, lambda f: WRAPS[wrap](f, schedule)) == 2


# --------------------------------------------------------------------------------------------
# Reports and warnings
# --------------------------------------------------------------------------------------------
def test_explain_counts_plain_path_sites_apart(mesh):
    fn = jax.shard_map(_mlp_layer, mesh=mesh, in_specs=SPECS, out_specs=P("tp"))
    args = _mlp_args(mesh)
    auto = explain(overlap(fn), *args)  # on CPU, auto keeps the plain path
    assert len(auto.sites) == len(auto.plain_path) == 2 and not auto.overlapped, str(auto)
    assert str(auto).splitlines()[0] == "2 site(s): 0 overlapped, 2 keep the plain path; 0 near-miss(es)"
    forced = explain(overlap(fn, schedule="xla/ring/c2"), *args)
    assert len(forced.overlapped) == 2 and not forced.plain_path, str(forced)
    assert str(forced).splitlines()[0] == "2 site(s): 2 overlapped, 0 keep the plain path; 0 near-miss(es)"


def test_explain_a_nested_overlap(mesh):
    fn = jax.shard_map(_mlp_layer, mesh=mesh, in_specs=SPECS, out_specs=P("tp"))
    args = _mlp_args(mesh)
    inner = overlap(fn, schedule="xla/ring/c2")

    def step(x, w1, w2):
        return inner(x, w1, w2) * 2.0

    report = explain(overlap(step, schedule="xla/ring/c2"), *args)
    assert [r.op for r in report.overlapped] == ["ag_matmul", "matmul_rs"], str(report)
    assert all(r.nested_in == inner.__name__ and r.where.startswith(f"overlap({inner.__name__})/") for r in report)
    assert f"nested overlap({inner.__name__})" in str(report).splitlines()[0], str(report)


def _no_site(x, w1, w2):
    """A psum_scatter of a sum, no matmul beside it: one near-miss, no site."""
    return jax.lax.psum_scatter(jnp.tanh(jax.lax.all_gather(x, "tp", tiled=True) + 1.0), "tp", tiled=True)


def test_given_schedule_that_rewrites_nothing_warns(mesh):
    args = _mlp_args(mesh)
    fn = jax.shard_map(_no_site, mesh=mesh, in_specs=SPECS, out_specs=P("tp"))
    misses = len(explain(fn, *args).near_misses)
    assert misses == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overlap(fn, schedule="xla/ring/c2")(*args)
    [warning] = [w for w in caught if "ficco_jax.overlap" in str(w.message)]
    assert re.search(rf"{_no_site.__name__} was given schedule xla/ring/c2 and nothing in it is overlapped: "
                     rf"no site found.*\({misses} near-miss\(es\)\)", str(warning.message)), str(warning.message)

    rewritten = jax.shard_map(_mlp_layer, mesh=mesh, in_specs=SPECS, out_specs=P("tp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a site overlapped, a schedule comm=none given, explain(): no warning
        overlap(rewritten, schedule="xla/ring/c2")(*args)
        overlap(rewritten, schedule="none")(*args)
        explain(overlap(fn, schedule="xla/ring/c2"), *args)


def test_flax_linen_sites_point_at_the_users_line(monkeypatch):
    nn = pytest.importorskip("flax.linen")
    from jax._src import source_info_util

    # Installed in a virtual environment, flax's files count as user code for jax; here it may sit
    # in the interpreter's own prefix, which jax skips: see the frames as a virtual environment does.
    jax_dir = source_info_util.__file__.rsplit("/_src/", 1)[0] + "/"
    monkeypatch.setattr(source_info_util, "is_user_filename", lambda name: not name.startswith(jax_dir))

    class RowParallel(nn.Module):
        @nn.compact
        def __call__(self, h):
            dot = functools.partial(jax.lax.dot_general, out_sharding=P("tp", None))
            return nn.Dense(D, use_bias=False, dot_general=dot)(h)  # the reduce-scatter site

    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        h = jax.device_put(jnp.ones((T, F)), NamedSharding(mesh, P(None, "tp")))
        kernel = jax.device_put(jnp.ones((F, D)), NamedSharding(mesh, P("tp", None)))
        report = explain(RowParallel().apply, {"params": {"Dense_0": {"kernel": kernel}}}, h)
    [site] = report.sites
    assert site.op == "matmul_rs" and "test_program_identity.py:" in site.source, str(report)
    assert "RowParallel.__call__" in site.source, str(report)
