"""overlap() / explain() on programs written as the README shows them: a shard_map'd Megatron MLP
called with Python options, integer matmuls, and what explain() says of each site (8 CPU devices)."""
import dataclasses
import enum
import json
import logging
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from ficco_jax import config
from ficco_jax.rewrite import explain, overlap
from ficco_jax.schedule import Schedule
from ficco_jax.tuning import policy

XLA = Schedule(comm="xla", chunks=1, order="ring")
T, D, F = 64, 16, 32  # tokens, hidden, ffn
PARAM_SPECS = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}


def megatron_mlp(mesh, params, x, use_bias=True, act="gelu"):
    """Sequence-parallel Megatron MLP: x [T/n, D] gathered, w1 column- and w2 row-parallel,
    the output reduce-scattered back onto the tokens. `use_bias` and `act` are Python options."""
    activation = act if callable(act) else {"gelu": jax.nn.gelu, "tanh": jnp.tanh}[act]

    def block(params, x):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ params["w1"]
        if use_bias:
            h = h + params["b1"]
        return jax.lax.psum_scatter(activation(h) @ params["w2"], "tp", scatter_dimension=0, tiled=True)

    return jax.shard_map(block, mesh=mesh, in_specs=(PARAM_SPECS, P("tp")), out_specs=P("tp"))(params, x)


def mlp_inputs(seed=0, dtype=jnp.float32):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    params = {"w1": jax.random.normal(k1, (D, F)) / np.sqrt(D), "b1": jax.random.normal(k2, (F,)),
              "w2": jax.random.normal(k3, (F, D)) / np.sqrt(F)}
    return jax.tree.map(lambda a: a.astype(dtype), params), jax.random.normal(k4, (T, D)).astype(dtype)


def assert_close(actual, expected, rtol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.linalg.norm(actual - expected) <= rtol * np.linalg.norm(expected)


# --------------------------------------------------------------------------------------------
# Python options: bools, strings and callables are static, as jax.jit's static arguments
# --------------------------------------------------------------------------------------------
def test_bool_and_str_keywords_outside_jit(mesh1d):
    mlp = lambda params, x, **options: megatron_mlp(mesh1d, params, x, **options)
    params, x = mlp_inputs()
    fused = overlap(mlp, schedule=XLA)
    for options in ({"use_bias": False}, {"use_bias": True}, {"act": "tanh"}, {"act": jnp.tanh, "use_bias": False}):
        assert_close(fused(params, x, **options), mlp(params, x, **options))
        assert [r.op for r in explain(fused, params, x, **options).sites] == ["ag_matmul", "matmul_rs"]
    # Two calls with different options are two programs, not one cached for the first.
    assert not np.allclose(fused(params, x, use_bias=False), fused(params, x, use_bias=True))


def test_static_argnames_under_jit(mesh1d):
    def mlp(params, x, use_bias=True):
        return megatron_mlp(mesh1d, params, x, use_bias=use_bias)

    params, x = mlp_inputs(1)
    step = jax.jit(overlap(mlp, schedule=XLA), static_argnames="use_bias")
    for use_bias in (False, True):
        assert_close(step(params, x, use_bias=use_bias), mlp(params, x, use_bias=use_bias))
    grads = jax.jit(jax.grad(lambda p, x: overlap(mlp, schedule=XLA)(p, x, use_bias=False).sum()))(params, x)
    expected = jax.grad(lambda p, x: mlp(p, x, use_bias=False).sum())(params, x)
    for name in ("w1", "w2"):
        assert_close(grads[name], expected[name])


def test_python_numbers_stay_traced_outside_jit(mesh1d):
    traced = []

    def scaled(params, x, scale):
        traced.append(type(scale))
        return megatron_mlp(mesh1d, params, x) * scale

    params, x = mlp_inputs(2)
    fused = overlap(scaled, schedule=XLA)
    assert_close(fused(params, x, 0.5), scaled(params, x, 0.5))
    calls = len(traced)
    assert_close(fused(params, x, 0.25), scaled(params, x, 0.25))
    assert len(traced) == calls + 1  # the plain call only: 0.25 reused the program traced for 0.5


def stacked(mesh, params, x, layers):
    """`layers` MLP blocks in a Python loop: an int option that must be static."""
    for _ in range(layers):
        x = x + megatron_mlp(mesh, params, x)
    return x


@pytest.mark.slow
def test_python_int_static_under_jit_and_as_fn_needs_it_outside(mesh1d):
    params, x = mlp_inputs(9)
    fn = lambda params, x, layers: stacked(mesh1d, params, x, layers)
    step = jax.jit(overlap(fn, schedule=XLA), static_argnames="layers")
    for layers in (1, 2):
        assert_close(step(params, x, layers=layers), fn(params, x, layers))
    # Outside jit: traced first, as jax.jit traces it; fn needs the value (range(layers)), so it is
    # traced again with the number static, once per value, and equals fn.
    fused = overlap(fn, schedule=XLA)
    for layers in (2, 1, 2):
        assert_close(fused(params, x, layers), fn(params, x, layers))
        assert [r.op for r in explain(fused, params, x, layers).sites] == ["ag_matmul", "matmul_rs"] * layers
    # A jitted fn with a static argument, wrapped as it is.
    jitted = jax.jit(fn, static_argnums=2)
    assert_close(overlap(jitted, schedule=XLA)(params, x, 2), fn(params, x, 2))


# --------------------------------------------------------------------------------------------
# Integer matmuls: near-misses, left as written
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["auto", XLA], ids=["auto", "xla"])
def test_integer_site_is_a_near_miss(mesh1d, schedule):
    def body(x, w):
        return jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w

    fn = jax.shard_map(body, mesh=mesh1d, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    x = jnp.arange(T * D, dtype=jnp.int32).reshape(T, D) % 7
    w = jnp.arange(D * F, dtype=jnp.int32).reshape(D, F) % 5
    report = explain(overlap(fn, schedule=schedule), x, w)
    assert not report.sites and len(report.near_misses) == 1, str(report)
    assert "int32" in report.near_misses[0].reason and "floating" in report.near_misses[0].reason
    np.testing.assert_array_equal(overlap(fn, schedule=schedule)(x, w), fn(x, w))


def test_integer_expert_sites_are_near_misses(mesh1d):
    """An expert layer on int32 tokens: dispatch and combine are both left as written."""
    n, experts, capacity, d = 8, 2, 4, 8

    def body(tokens, w_in, w_out):
        received = jax.lax.all_to_all(tokens, "tp", 0, 0, tiled=True)
        hidden = jnp.einsum("pecd,edf->pecf", received, w_in)
        return jax.lax.all_to_all(jnp.einsum("pecf,efd->pecd", hidden, w_out), "tp", 0, 0, tiled=True)

    fn = jax.shard_map(body, mesh=mesh1d, in_specs=(P("tp"),) * 3, out_specs=P("tp"))
    tokens = jnp.arange(n * n * experts * capacity * d, dtype=jnp.int32).reshape(n * n, experts, capacity, d) % 5
    w_in = jnp.arange(n * experts * d * d, dtype=jnp.int32).reshape(n * experts, d, d) % 3
    w_out = w_in[:, ::-1] % 2
    report = explain(fn, tokens, w_in, w_out)
    assert not report.sites and len(report.near_misses) == 2, str(report)
    assert all("int32 matmul" in r.reason for r in report.near_misses), str(report)
    np.testing.assert_array_equal(overlap(fn)(tokens, w_in, w_out), fn(tokens, w_in, w_out))


# --------------------------------------------------------------------------------------------
# explain(): what each site will run, and where the user wrote it
# --------------------------------------------------------------------------------------------
def test_plain_path_on_cpu_is_said(mesh1d):
    params, x = mlp_inputs(3)
    report = explain(lambda p, x: megatron_mlp(mesh1d, p, x), params, x)
    assert len(report.sites) == 2, str(report)
    for record in report.sites:
        assert record.schedule == "none (auto)" and "plain path" in record.note and "CPU" in record.note
    assert "plain path" in str(report)
    given = explain(overlap(lambda p, x: megatron_mlp(mesh1d, p, x), schedule="none"), params, x)
    assert [r.note for r in given.sites] == ["plain path: schedule comm='none' was given"] * 2, str(given)


def test_plain_path_for_a_group_of_one_device():
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    params, x = mlp_inputs(4)
    report = explain(lambda p, x: megatron_mlp(mesh, p, x), params, x)
    assert all("group of one device" in r.note for r in report.sites) and len(report.sites) == 2, str(report)


def test_plain_path_when_the_model_predicts_no_gain(mesh1d, monkeypatch):
    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)  # decide as on a GPU
    params, x = mlp_inputs(5)
    report = explain(lambda p, x: megatron_mlp(mesh1d, p, x), params, x)
    assert all("cost model predicts no gain" in r.note for r in report.sites) and report.sites, str(report)
    forced = explain(overlap(lambda p, x: megatron_mlp(mesh1d, p, x), schedule=XLA), params, x)
    assert all(r.note == "" for r in forced.sites), str(forced)


@pytest.mark.slow
def test_autotune_shows_the_pick_or_when_it_is_measured(mesh1d, monkeypatch, tmp_path, caplog):
    params, x = mlp_inputs(6)
    mlp = lambda p, x: megatron_mlp(mesh1d, p, x)
    report = explain(overlap(mlp, autotune=True), params, x)  # on CPU the pick needs no measurement
    assert all(r.schedule == "none (autotune)" and "CPU" in r.note for r in report.sites), str(report)
    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)
    monkeypatch.setattr(config, "AUTOTUNE_CACHE_DIR", str(tmp_path))
    fused = overlap(mlp, autotune=True)
    report = explain(fused, params, x)
    assert report.sites and all("measured when traced under jit (autotune)" in r.schedule
                                for r in report.sites), str(report)
    assert not list(tmp_path.iterdir())  # explain() measured nothing
    with caplog.at_level(logging.WARNING, logger="ficco_jax"):
        assert_close(jax.jit(fused)(params, x), mlp(params, x))  # measures and caches each site's winner
    assert "rejected" not in caplog.text and (tmp_path / "autotune.json").exists(), caplog.text
    for report in (explain(fused, params, x), explain(overlap(mlp, autotune=True), params, x)):
        assert all(r.schedule.endswith(" (autotune)") and "measured" not in r.schedule
                   for r in report.sites), str(report)
        assert all(r.schedule.startswith("none ") == ("autotune measured it fastest" in r.note)
                   for r in report.sites), str(report)


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_an_explicit_op_autotuned_inside_shard_map_measures_outside_the_trace(mesh1d, monkeypatch, tmp_path, op):
    """schedule="autotune" on an op called in the user's shard_map: its candidates are programs of
    their own, on a mesh of their own, timed outside the trace (in the trace jax refused the
    measuring program's mesh); the result equals the reference and the winner is cached. Every
    candidate is timed for real, the plain path's time counted a second longer, so that an
    overlapped schedule wins and runs (on CPU the plain path is the fastest)."""
    import ficco_jax
    from ficco_jax.ops import api

    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)
    monkeypatch.setattr(config, "AUTOTUNE_CACHE_DIR", str(tmp_path))
    timed, time_op = [], api.time_op

    def plain_slowed(op, schedule, *args, **kwargs):
        timed.append(str(schedule))
        return time_op(op, schedule, *args, **kwargs) + (1e3 if schedule.comm == "none" else 0.0)

    monkeypatch.setattr(api, "time_op", plain_slowed)
    n = mesh1d.shape["tp"]
    kx, kw = jax.random.split(jax.random.PRNGKey(11))
    if op == "ag_matmul":
        x, w = jax.random.normal(kx, (8 * n, 16)), jax.random.normal(kw, (16, 4 * n))
        specs, out = (P("tp"), P(None, "tp")), P(None, "tp")
    else:
        x, w = jax.random.normal(kx, (8 * n, 4 * n)), jax.random.normal(kw, (4 * n, 16))
        specs, out = (P(None, "tp"), P("tp")), P("tp")
    fn, ref = getattr(ficco_jax, op), getattr(ficco_jax, f"{op}_ref")
    run = lambda body: jax.jit(jax.shard_map(body, mesh=mesh1d, in_specs=specs, out_specs=out))(x, w)  # noqa: E731
    assert_close(run(lambda x, w: fn(x, w, "tp", schedule="autotune")), run(lambda x, w: ref(x, w, "tp")))
    winners = [entry["schedule"] for entry in json.loads((tmp_path / "autotune.json").read_text()).values()]
    assert len(timed) > 1 and winners and all(w != "none" and w in timed for w in winners), (timed, winners)


def test_an_object_that_would_be_frozen_into_the_trace_is_refused_by_path(mesh1d):
    """A plain object holding parameters is no JAX type: closed over as a static value, its arrays
    would be constants of the trace and a later change to them unseen. Refused, naming the argument
    and the fix; registered as a pytree, the same object is traced and a change shows."""
    class Params:
        def __init__(self, params):
            self.params = params

    params, x = mlp_inputs(12)
    mlp = lambda p, x: megatron_mlp(mesh1d, p.params, x)  # noqa: E731
    fused = overlap(mlp, schedule=XLA)
    with pytest.raises(TypeError, match=r"args\[0\] \(Params\): not a JAX type, nor hashable by value.*pytree"):
        fused(Params(params), x)

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Tree:
        params: dict

    tree = Tree(params)
    assert_close(fused(tree, x), mlp(tree, x))
    tree.params = jax.tree.map(lambda a: 2 * a, params)
    assert_close(fused(tree, x), mlp(tree, x))
    # Options by value stay static: a frozen dataclass, an enum member, a function.
    Act = enum.Enum("Act", "GELU TANH")
    act = lambda p, x, how, cfg: megatron_mlp(mesh1d, p, x, act={Act.GELU: "gelu", Act.TANH: "tanh"}[how],  # noqa: E731
                                              use_bias=cfg.bias)
    cfg = dataclasses.make_dataclass("Cfg", [("bias", bool)], frozen=True)(False)
    assert_close(overlap(act, schedule=XLA)(params, x, Act.TANH, cfg), act(params, x, Act.TANH, cfg))
    rows = lambda p, x, which: megatron_mlp(mesh1d, p, x)[which]  # noqa: E731  (a slice: equal by value)
    fused_rows = overlap(rows, schedule=XLA)
    for which in (slice(0, 8), slice(8, None, 2), slice(0, 8)):
        assert_close(fused_rows(params, x, which), rows(params, x, which))
    assert len(fused_rows._traced) == 2


def test_one_function_under_two_meshes_is_traced_for_each(mesh1d):
    """jax.set_mesh is part of what a trace depends on (as for jax.jit): the same overlapped function
    called under a 1-D, then a 2-D mesh of the same devices, then a permuted one, equals fn each time."""
    def fn(x, w):
        body = lambda x, w: jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w  # noqa: E731
        return jax.shard_map(body, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))(x, w)

    kx, kw = jax.random.split(jax.random.key(13))
    x, w = np.asarray(jax.random.normal(kx, (64, 16))), np.asarray(jax.random.normal(kw, (16, 32)))
    fused = overlap(fn, schedule=XLA)
    devices = np.array(jax.devices()[:8])
    for mesh in (Mesh(devices, ("tp",)), Mesh(devices.reshape(2, 4), ("dp", "tp")),
                 Mesh(devices[::-1].reshape(2, 4), ("dp", "tp"))):
        with jax.set_mesh(mesh):
            assert_close(fused(x, w), fn(x, w))
            assert [r.op for r in explain(fused, x, w).sites] == ["ag_matmul"]


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("schedule", [XLA, Schedule.parse("dma/direct/c2")])
def test_overlap_of_a_shard_map_body(mesh1d, schedule):
    """``shard_map(overlap(block))``: `block` is traced under the shard_map's manual axes, so its
    sites are the sites of a shard_map body; values and gradients equal the plain body's."""
    def block(params, x):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ params["w1"]
        return jax.lax.psum_scatter(jax.nn.gelu(h) @ params["w2"], "tp", scatter_dimension=0, tiled=True)

    sharded = lambda body: jax.shard_map(body, mesh=mesh1d, in_specs=(PARAM_SPECS, P("tp")), out_specs=P("tp"))  # noqa: E731
    params, x = mlp_inputs(15)
    fused, plain = sharded(overlap(block, schedule=schedule)), sharded(block)
    assert_close(fused(params, x), plain(params, x))
    loss = lambda f: lambda p, x: jnp.sum(f(p, x) ** 2)  # noqa: E731
    for got, want in zip(jax.tree.leaves(jax.grad(loss(fused))(params, x)), jax.tree.leaves(jax.grad(loss(plain))(params, x))):
        assert_close(got, want)
    reports = []
    sharded(lambda p, x: (reports.append(explain(overlap(block, schedule=schedule), p, x)), block(p, x))[1])(params, x)
    assert [r.op for r in reports[0].sites] == ["ag_matmul", "matmul_rs"], str(reports[0])


def test_outputs_that_are_no_jax_values_come_back_as_fn_returned_them(mesh1d):
    params, x = mlp_inputs(16)
    fn = lambda p, x: {"y": megatron_mlp(mesh1d, p, x), "tag": "mlp", "layers": 3, "scale": 0.5}  # noqa: E731
    got, want = overlap(fn, schedule=XLA)(params, x), fn(params, x)
    assert_close(got["y"], want["y"])
    assert {k: (type(v), v) for k, v in got.items() if k != "y"} == {"tag": (str, "mlp"), "layers": (int, 3),
                                                                     "scale": (float, 0.5)}


def test_a_function_that_needs_its_values_runs_as_written_outside_jit(mesh1d, caplog):
    """Python control flow on an array's value cannot be traced: called outside any
    transformation, overlap(fn) is fn (nothing overlapped, said once, and by explain); under jit it
    fails as jax.jit(fn) fails."""
    params, x = mlp_inputs(17)

    def eager(params, x):
        y = megatron_mlp(mesh1d, params, x)
        return y if float(y.sum()) > 0 else -y

    fused = overlap(eager, schedule=XLA)
    with caplog.at_level(logging.WARNING, logger="ficco_jax"):
        assert_close(fused(params, x), eager(params, x))
        assert_close(fused(params, 2 * x), eager(params, 2 * x))
    assert caplog.text.count("eager cannot be traced (ConcretizationTypeError") == 1, caplog.text
    report = explain(fused, params, x)
    assert not report.sites and "runs as written, nothing in it overlapped" in str(report)
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.jit(fused)(params, x)


def test_overlap_decorates_a_method(mesh1d):
    """``@overlap`` on a method binds like a function (and like jax.jit): the instance is the first
    argument, its arrays traced where its class is a pytree."""
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Mlp:
        params: dict

        @overlap(schedule=XLA)
        def __call__(self, x):
            return megatron_mlp(mesh1d, self.params, x)

    params, x = mlp_inputs(14)
    layer = Mlp(params)
    assert_close(layer(x), megatron_mlp(mesh1d, params, x))
    assert [r.op for r in explain(Mlp.__call__, layer, x).sites] == ["ag_matmul", "matmul_rs"]


def test_where_names_the_source_line(mesh1d):
    params, x = mlp_inputs(7)
    report = explain(lambda p, x: megatron_mlp(mesh1d, p, x), params, x)
    assert all("test_user_programs.py:" in r.source and "block" in r.source for r in report), str(report)
    assert all(r.where.startswith("shard_map@") for r in report)
    assert "test_user_programs.py:" in str(report)


def test_bfloat16_sites_are_still_rewritten(mesh1d):
    """The floating-point check counts bfloat16 (not a numpy floating type) as floating."""
    params, x = mlp_inputs(8, jnp.bfloat16)
    mlp = lambda p, x: megatron_mlp(mesh1d, p, x)
    report = explain(overlap(mlp, schedule=XLA), params, x)
    assert [r.op for r in report.sites] == ["ag_matmul", "matmul_rs"] and not report.near_misses, str(report)
    assert_close(overlap(mlp, schedule=XLA)(params, x), mlp(params, x), rtol=2e-2)


# --------------------------------------------------------------------------------------------
# Never slower: a site whose schedule is the plain path is left exactly as written
# --------------------------------------------------------------------------------------------
@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("schedule", ["auto", "none"])
def test_plain_path_sites_are_left_as_written(mesh1d, schedule):
    # On CPU (and on a group of one device) auto keeps the plain path: the rewritten function must
    # be the user's program itself, not the same computation with extra ops around the sites.
    mlp = lambda params, x: megatron_mlp(mesh1d, params, x)
    params, x = mlp_inputs()
    fused = overlap(mlp, schedule=schedule)
    assert all(r.schedule.startswith("none") for r in explain(fused, params, x).sites)
    plain_jaxpr, fused_jaxpr = jax.make_jaxpr(mlp)(params, x), jax.make_jaxpr(fused)(params, x)
    assert str(fused_jaxpr) == str(plain_jaxpr)
    assert_close(fused(params, x), mlp(params, x))
    grads = jax.grad(lambda p: fused(p, x).sum())(params)
    want = jax.grad(lambda p: mlp(p, x).sum())(params)
    for name in grads:
        assert_close(grads[name], want[name])


def test_a_jitted_functions_donations_are_kept(mesh1d):
    """overlap(jax.jit(step, donate_argnums=...)) donates what step's jit donates, as step does: the
    donated arrays are consumed, the others kept."""
    def step(params, x):
        return jax.tree.map(lambda p: p * 0.5, params), megatron_mlp(mesh1d, params, x)

    jitted = jax.jit(step, donate_argnums=0)
    params, x = mlp_inputs(3)
    expected = step(params, x)
    # placed as a training loop keeps them (uncommitted arrays are not always consumed on CPU)
    params = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh1d, PARAM_SPECS[k])) for k, v in params.items()}
    fused = overlap(jitted, schedule=XLA)
    assert [r.op for r in explain(fused, params, x).sites] == ["ag_matmul", "matmul_rs"]
    new_params, out = fused(params, x)
    assert_close(out, expected[1])
    assert_close(new_params["w1"], expected[0]["w1"])
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(params)) and not x.is_deleted()


def test_a_call_under_other_jax_flags_is_traced_again(mesh1d):
    """A trace depends on jax's flags as jax.jit's does: a later call under x64 or the other
    threefry partitioning is traced anew, not served the first call's program."""
    def step(params, x, key):
        out = megatron_mlp(mesh1d, params, x)
        return out + jax.random.normal(key, out.shape, out.dtype)

    params, x = mlp_inputs(4)
    key = jax.random.key(1)
    fused = overlap(step, schedule=XLA)
    assert_close(fused(params, x, key), step(params, x, key))
    with jax.threefry_partitionable(not jax.config.jax_threefry_partitionable):
        assert_close(fused(params, x, key), step(params, x, key))
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x))
        got, want = fused(*wide, key), step(*wide, key)
        assert got.dtype == want.dtype == jnp.float64
        assert_close(got, want)
