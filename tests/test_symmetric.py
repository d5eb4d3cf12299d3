"""transfer="symmetric" (xla_ffi/runtime/symmetric.h): each sender writes into its peers' buffers of
the call site, set up in one meeting at the site's first call, and the devices order the copies with
counters. What is checked here, on 8 virtual CPU devices (the CPU backend runs the same composition):
no meeting after a site's first call; repeated calls, a site run many times in one launch (scan) and
two sites interleaved all agree with plain JAX, gradients included; and a rank that fails, or runs
another site, is an error naming it, never a wrong answer. The schedule sweeps of test_dma.py and
test_a2a.py run every copy-engine point in its symmetric form as well; tests/gpu/test_symmetric_gpu.py
runs these programs on GPUs, inside XLA's command buffers."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax import Schedule, config, dma  # noqa: E402
from ficco_jax.runtime import extension as _ext  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")

TIMEOUT_S = 0.5


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(config, "RENDEZVOUS_TIMEOUT_S", TIMEOUT_S)


@pytest.fixture
def inject_fault():
    faults = _ext.testing()
    yield faults.inject_fault
    faults.inject_fault("")


def _mesh(n=8):
    return Mesh(np.array(jax.devices()[:n]), ("tp",))


def _random(rng, shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def _mlp(mesh, schedule):
    """ag_matmul -> gelu -> matmul_rs over tp, and its plain-JAX twin; two sites of one program."""
    def body(fns):
        def mlp(x, w1, w2):
            return fns[1](jax.nn.gelu(fns[0](x, w1, "tp")), w2, "tp")
        return jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))

    ours = (lambda x, w, a: ficco_jax.ag_matmul(x, w, a, schedule=schedule),
            lambda y, w, a: ficco_jax.matmul_rs(y, w, a, schedule=schedule))
    return body(ours), body((ficco_jax.ag_matmul_ref, ficco_jax.matmul_rs_ref))


def _mlp_args(rng, n, m=8, d=16, f=8):
    return _random(rng, (n * m, d)), _random(rng, (d, n * f)), _random(rng, (n * f, d))


def test_the_schedule_string_round_trips_and_needs_copy_engines():
    sched = Schedule.parse("dma/direct/c2/s2/symmetric")
    assert sched.transfer == "symmetric" and str(sched) == "dma/direct/c2/s2/symmetric"
    with pytest.raises(ValueError, match="applies to comm='dma' only"):
        Schedule(comm="xla", transfer="symmetric").validate("ag_matmul", ((8, 4), (4, 8)), 8)
    with pytest.raises(ValueError, match="sets transfer a second time"):
        Schedule.parse("dma/direct/c2/push/symmetric")
    assert "symmetric" not in {s.transfer for s in Schedule.enumerate("ag_matmul", 8)}  # opt-in, not enumerated


@pytest.mark.parametrize("sched", ["dma/direct/c1/symmetric", "dma/direct/c4/s2/symmetric",
                                   "dma/direct/c2/grouped/symmetric"])
def test_a_site_meets_its_group_once_then_never(sched):
    """The site's first call meets its group (one post per rank); every later call meets nobody."""
    mesh, rng = _mesh(), np.random.default_rng(1)
    ours, ref = _mlp(mesh, sched)
    f, g = jax.jit(ours), jax.jit(ref)
    args = _mlp_args(rng, 8)
    testing = _ext.testing()
    before = testing.host_meetings()
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(g(*args)), rtol=1e-5, atol=1e-5)
    # Each of the two sites meets once per rank at its first call to learn its group's devices
    # (xla_ffi/runtime/placement.h), and once to set up the site.
    assert testing.host_meetings() - before == 2 * 2 * 8, "each site meets twice per rank, at its first call"
    before = testing.host_meetings()
    for i in range(5):
        shifted = tuple(a + i for a in args)  # new values each call: a stale block would show
        np.testing.assert_allclose(np.asarray(f(*shifted)), np.asarray(g(*shifted)), rtol=1e-5, atol=1e-5)
    assert testing.host_meetings() == before, "a symmetric call met its group after the site's first call"


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_site_run_many_times_in_one_launch(n):
    """lax.scan runs each site once per layer: the counters advance per execution. The symmetric form
    moves the same bytes as pulls, so the results are equal bit for bit."""
    mesh, rng = _mesh(n), np.random.default_rng(2)
    layers = 6
    ws = _random(rng, (layers, 16, 16 * n)) / 4
    x = _random(rng, (8 * n, 16))

    def body(fn):
        def stack(x, ws):
            def layer(h, w):
                return jnp.tanh(fn(h, w)), None
            return jax.lax.scan(layer, x, ws)[0]
        return jax.jit(jax.shard_map(stack, mesh=mesh, in_specs=(P("tp"), P(None, None, "tp")), out_specs=P("tp")))

    def ag_rs(transfer):  # [m, d] -> gathered rows @ w -> scattered back: [m, d]
        return lambda h, w: dma.reduce_scatter(ficco_jax.ag_matmul(h, w, "tp", schedule="dma/direct/c2" + transfer),
                                               "tp", schedule="dma/direct/c1" + transfer)

    def ag_rs_ref(h, w):
        return jax.lax.psum_scatter(jax.lax.all_gather(h, "tp", tiled=True) @ w, "tp", tiled=True)

    got = np.asarray(body(ag_rs("/symmetric"))(x, ws))
    np.testing.assert_array_equal(got, np.asarray(body(ag_rs(""))(x, ws)))
    np.testing.assert_allclose(got, np.asarray(body(ag_rs_ref)(x, ws)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sched", ["dma/direct/c1/symmetric", "dma/direct/c2/s2/symmetric"])
def test_gradients_through_symmetric_sites(sched):
    """The backward ops take the forward's schedule: their sites are symmetric too."""
    mesh, rng = _mesh(4), np.random.default_rng(3)
    ours, ref = _mlp(mesh, sched)
    args = _mlp_args(rng, 4)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))  # noqa: E731
    (v, grads), (v_ref, grads_ref) = loss(ours)(*args), loss(ref)(*args)
    np.testing.assert_allclose(float(v), float(v_ref), rtol=1e-5)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_a_call_enqueues_one_count_its_posts_and_one_end(op, chunks, rng):
    """What a symmetric call enqueues per device, n = 4 (s = 3 send and receive slots, k = 2 copy
    streams): one count, which also waits until every target freed its slot (no wait per send); one
    post per mark (a reduce-scatter marks every chunk, an all-gather each slot once); no event per
    transfer (the site's words mark them); the receiver's waits in one counter wait per slot before its
    copy-out (all-gather), or with the sum (reduce-scatter: none of their own; on CUDA in the sum's kernel
    where the sum is small); one end. The result equals plain JAX's."""
    n, s, k = 4, 3, 2
    mesh = _mesh(n)
    x = _random(rng, (n * 8 * n, 6))
    sched = f"dma/direct/c{chunks}/s{k}/symmetric"
    ours, ref = {"all_gather": (lambda a: dma.all_gather(a, "tp", schedule=sched),
                                lambda a: jax.lax.all_gather(a, "tp", tiled=True)),
                 "reduce_scatter": (lambda a: dma.reduce_scatter(a, "tp", schedule=sched),
                                    lambda a: jax.lax.psum_scatter(a, "tp", tiled=True))}[op]
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))  # noqa: E731
    f = run(ours)
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(run(ref)(x)), rtol=1e-5, atol=1e-5)
    testing = _ext.testing()
    before = testing.backend_calls()
    np.testing.assert_allclose(np.asarray(f(x + 1)), np.asarray(run(ref)(x + 1)), rtol=1e-5, atol=1e-5)
    calls = {key: (value - before[key]) / n for key, value in testing.backend_calls().items() if not key.endswith("_s")}
    if op == "reduce_scatter":
        # count, s * chunks posts, end; events: the entry, each copy stream's last work
        assert calls["counter"] == 2 + s * chunks and calls["reduce"] == chunks, calls
        assert calls["record"] == 1 + k and calls["wait"] == 2 * k, calls
    else:
        # count, s posts, s waits before the copy-outs, end; events: also one per copy-out
        assert calls["counter"] == 2 + 2 * s, calls
        assert calls["record"] == 1 + k + s and calls["wait"] == 2 * k + 1 + s, calls


def test_every_collective_on_a_2d_mesh():
    """Two tp groups of four with ordinals out of rank order: each group's sites are its own."""
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]].reshape(2, 4)
    mesh = Mesh(devices, ("dp", "tp"))
    rng = np.random.default_rng(4)
    x = _random(rng, (8 * 8, 6))
    spec = P(("dp", "tp"))
    sched = "dma/direct/c2/s2/symmetric"
    # (ours, plain JAX, the tolerance: moved bytes are exact, a sum is within f32 rounding)
    cases = [(lambda a: dma.all_gather(a, "tp", schedule=sched), lambda a: jax.lax.all_gather(a, "tp", tiled=True), 0),
             (lambda a: dma.reduce_scatter(a, "tp", schedule=sched),
              lambda a: jax.lax.psum_scatter(a, "tp", tiled=True), 1e-5),
             (lambda a: dma.all_to_all(a.reshape(4, 2, 6), "tp", 0, 0, schedule="dma/direct/c1/s2/symmetric").reshape(8, 6),
              lambda a: jax.lax.all_to_all(a.reshape(4, 2, 6), "tp", 0, 0, tiled=True).reshape(8, 6), 0)]
    for ours, ref, rtol in cases:
        run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))  # noqa: E731
        for i in range(3):
            np.testing.assert_allclose(np.asarray(run(ours)(x + i)), np.asarray(run(ref)(x + i)), rtol=rtol,
                                       atol=rtol)


@pytest.mark.parametrize("mode", ["skip", "fail"])
def test_a_failed_call_names_the_rank_and_its_site_runs_no_more(mode, short_timeout, inject_fault):
    """A rank that fails leaves its peers waiting for counters it never posts: they give up after the
    timeout naming it (CPU; on GPUs the watchdog reports the site). The ranks' counters may then be
    out of step, so every later call of that site fails at once, naming the first error — never a
    pairing of one call's data with another's. A fresh trace (new sites) runs correctly."""
    mesh, rng = _mesh(), np.random.default_rng(5)
    ours, ref = _mlp(mesh, "dma/direct/c2/symmetric")
    args = _mlp_args(rng, 8)
    program = jax.jit(ours).lower(*args).compile()
    expected = np.asarray(jax.jit(ref)(*args))
    np.testing.assert_allclose(np.asarray(program(*args)), expected, rtol=1e-5, atol=1e-5)  # sites set up
    inject_fault(f"{mode}:6")
    start = time.monotonic()
    with pytest.raises(Exception, match=r"injected fault '\w+' on rank 6|rank 6 \(device 6\) did not post"):
        jax.block_until_ready(program(*args))
    assert time.monotonic() - start < TIMEOUT_S + 5
    inject_fault("")
    # The first error to stop the site is rank 6's own, or a peer's naming rank 6: the message says which
    # rank saw it, never that it failed.
    with pytest.raises(Exception, match=r"an earlier call of this copy-engine site failed in this process \(first "
                                        r"error, seen by rank \d: .*(injected fault|rank 6 \(device 6\) did not post)"):
        jax.block_until_ready(program(*args))
    fresh = jax.jit(_mlp(mesh, "dma/direct/c2/symmetric")[0])
    np.testing.assert_allclose(np.asarray(fresh(*args)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("sched", ["dma/direct/c1/symmetric", "dma/direct/c2/symmetric"])
def test_data_of_another_launch_is_an_error_not_a_wrong_answer(op, sched, short_timeout, inject_fault):
    """Every rank numbers its launches, and a sender tags its data with its number: a receiver whose
    peer is in another launch (it ended a launch early, so its calls pair with its peers' calls of
    the launch before) fails at once, naming both launches, and the site runs no more. Here the
    fault tags rank 2's data with the next launch; a reduce-scatter checks it in its sum's waits."""
    mesh, rng = _mesh(4), np.random.default_rng(11)
    ours, ref = {"all_gather": (dma.all_gather, lambda a, axis: jax.lax.all_gather(a, axis, tiled=True)),
                 "reduce_scatter": (dma.reduce_scatter, lambda a, axis: jax.lax.psum_scatter(a, axis, tiled=True))}[op]
    f, f_ref = (jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
                for body in (lambda a: ours(a, "tp", schedule=sched), lambda a: ref(a, "tp")))
    x = _random(rng, (4 * 8, 3))  # a reduce-scatter's blocks: 2 rows per rank
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(f_ref(x)), rtol=1e-5, atol=1e-6)
    inject_fault("stale:2")
    with pytest.raises(Exception, match=r"rank [013]'s call 2 of this copy-engine site runs in launch \d+, but rank 2 "
                                        r"\(device 2\) sent its data of that call in launch \d+: a launch ended "
                                        r"early on some device of the group.*restart the process"):
        jax.block_until_ready(f(x))
    inject_fault("")
    with pytest.raises(Exception, match=r"an earlier call of this copy-engine site failed in this process \(first error, "
                                        r"seen by rank [013]: .*sent its data of that call in launch"):
        jax.block_until_ready(f(x))


@pytest.mark.parametrize("at", [2, 5])
def test_a_transfer_failing_midway_returns_after_its_copies_are_joined(at, short_timeout, inject_fault):
    """As for the other transfers (test_executor_faults.py): XLA frees a failed call's buffers, so its
    handler returns only once XLA's stream waits for every copy it enqueued (the fault's backend
    counts the calls that did not)."""
    mesh, rng = _mesh(), np.random.default_rng(6)
    ours, _ = _mlp(mesh, "dma/direct/c2/s2/symmetric")
    args = _mlp_args(rng, 8)
    program = jax.jit(ours).lower(*args).compile()
    before = _ext.testing().unjoined_copy_calls()
    inject_fault(f"fail:3:{at}")
    with pytest.raises(Exception, match=r"injected fault 'fail' on rank 3|rank 3 \(device 3\) did not post"):
        jax.block_until_ready(program(*args))
    inject_fault("")
    assert _ext.testing().unjoined_copy_calls() == before, "a failed call returned before its copies were joined"


def test_ranks_in_different_sites_are_an_error_not_a_wrong_answer(short_timeout):
    """Ranks whose branch picks another site than their peers': at a site's first call the meeting
    where its group learns its devices (xla_ffi/runtime/placement.h) misses them; once both sites are set up, each site's counters wait for the ranks that
    took the other one, which never post them. Either way an error names them."""
    mesh, rng = _mesh(), np.random.default_rng(7)
    x, w = _random(rng, (8 * 8, 4)), _random(rng, (4, 8 * 4))

    def body(a, b, branch):
        return jax.lax.cond(branch[0] == 0, lambda: ficco_jax.ag_matmul(a, b, "tp", schedule="dma/direct/c1/symmetric"),
                            lambda: ficco_jax.ag_matmul(a * 2, b, "tp", schedule="dma/direct/c1/symmetric"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P(None, "tp"),
                              check_vma=False))
    split = jnp.asarray(np.repeat([0, 1], 4), jnp.int32)  # ranks 0-3 take the first site, 4-7 the second
    with pytest.raises(Exception, match=r"phase roster.*missing ranks \[(0, 1, 2, 3|4, 5, 6, 7)\]"):
        jax.block_until_ready(f(x, w, split))
    plain = jax.jit(jax.shard_map(lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b, mesh=mesh,
                                  in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
    for branch, scale in ((0, 1), (1, 2)):  # every rank sets up each site
        got = f(x, w, jnp.full((8,), branch, jnp.int32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(plain(x * scale, w)), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"did not post its 'landed' counter of call \d+ of this symmetric site"):
        jax.block_until_ready(f(x, w, split))


def test_sites_of_other_shapes_are_other_sites():
    """One jitted function called with two shapes: two traces, two sites, both right, calls alternating."""
    mesh, rng = _mesh(4), np.random.default_rng(8)
    f = jax.jit(jax.shard_map(lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c2/symmetric"), mesh=mesh,
                              in_specs=P("tp"), out_specs=P("tp")))
    small, large = _random(rng, (4 * 4, 3)), _random(rng, (4 * 16, 5))
    for _ in range(3):
        for x in (small, large):
            got = np.asarray(f(x))
            np.testing.assert_array_equal(got, np.tile(np.asarray(x), (4, 1)))


def test_overlap_rewrites_a_training_step_onto_symmetric_sites():
    """The way users write it: plain JAX collectives in a shard_map, overlap(fn, schedule=...), under
    jax.value_and_grad; every site explain() lists runs the symmetric schedule."""
    mesh, rng = _mesh(4), np.random.default_rng(9)
    x, w1, w2 = _mlp_args(rng, 4)
    plain = _mlp(mesh, "none")[1]

    def loss(x, w1, w2):
        return jnp.sum(plain(x, w1, w2) ** 2)

    sched = "dma/direct/c2/symmetric"
    step = jax.jit(jax.value_and_grad(ficco_jax.overlap(loss, schedule=sched), argnums=(1, 2)))
    want = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))(x, w1, w2)
    for _ in range(3):
        got = step(x, w1, w2)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
        for g, r in zip(got[1], want[1]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    report = ficco_jax.overlap(loss, schedule=sched).explain(x, w1, w2)
    assert report.sites and all(site.schedule == sched for site in report.sites), report


def test_a_jitted_op_batched_again_is_a_site_of_its_own():
    """vmap of a jitted function binds its traced ops again with a folded batch, under their op ids: the
    folded call moves other blocks, so it is another site, and the unbatched one keeps running."""
    mesh, rng = _mesh(4), np.random.default_rng(10)
    g = jax.jit(lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c1/symmetric"))

    def body(a, batch):
        return g(a), jax.vmap(g)(batch)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=(P("tp"), P(None, "tp"))))
    x, xs = _random(rng, (4 * 4, 3)), _random(rng, (2, 4 * 4, 3))
    for i in range(3):
        one, many = f(x + i, xs + i)
        np.testing.assert_array_equal(np.asarray(one), np.tile(np.asarray(x + i), (4, 1)))
        np.testing.assert_array_equal(np.asarray(many), np.tile(np.asarray(xs + i), (1, 4, 1)))


CHILD = """
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import ficco_jax
from ficco_jax.runtime import extension
mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
f = jax.jit(jax.shard_map(lambda a: ficco_jax.dma.all_gather(a, "tp", schedule="dma/direct/c2/symmetric"),
                          mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
x = jnp.ones((16, 3))
jax.block_until_ready(f(x))
extension.testing().inject_fault("fail:1")
try:
    jax.block_until_ready(f(x))
except Exception as e:
    print("failed as injected:", "injected fault" in str(e) or "did not post" in str(e), flush=True)
extension.testing().inject_fault("")
time.sleep(float(sys.argv[1]))
print("alive", flush=True)
"""


def test_a_call_that_failed_is_not_reported_as_stuck():
    """A failed call posts its end: the watchdog, which watches the site's counters, has nothing to
    report after it (the process lives past its limit and exits normally)."""
    import subprocess
    import sys
    env = {**os.environ, "FICCO_WATCHDOG_S": "1", "FICCO_RENDEZVOUS_TIMEOUT_S": "0.5", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run([sys.executable, "-c", CHILD, "3"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "failed as injected: True" in done.stdout and "alive" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "ficco_jax watchdog" not in done.stderr, done.stderr[-3000:]
