"""A rank that fails or never arrives makes its peers fail with a timeout naming it: no hang,
and the process stays usable (the next call succeeds). The faults are armed for the whole process
through the extension's test-only entry point (`inject_fault`, xla_ffi/testing/faults.h) and apply
to every copy-engine call until they are disarmed."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from ficco_jax import config, dma  # noqa: E402
from ficco_jax.runtime import extension as _ext  # noqa: E402
from helpers import ffi_position  # noqa: E402
from ficco_jax.schedule import Schedule  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")

TIMEOUT_S = 0.5


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(config, "RENDEZVOUS_TIMEOUT_S", TIMEOUT_S)


@pytest.fixture
def inject_fault():
    """inject_fault("skip:2") arms a fault for the calls that follow, inject_fault("") disarms it;
    disarmed after the test whatever happens."""
    faults = _ext.testing()
    yield faults.inject_fault
    faults.inject_fault("")


def _mesh():
    return Mesh(np.array(jax.devices()[:8]), ("tp",))


def _gather_fn(mesh):
    return jax.jit(jax.shard_map(lambda a: dma.all_gather(a, "tp", schedule="dma/direct/c2/s2"),
                                 mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def _matmul_rs_fn(mesh):
    sched = Schedule.parse("dma/direct/c2/s2")
    return jax.jit(jax.shard_map(lambda a, w: dma.matmul_rs_dma(a, w, "tp", sched),
                                 mesh=mesh, in_specs=(P("tp"), P("tp", None)), out_specs=P("tp")))


@pytest.mark.parametrize("fault", ["skip:2", "fail:2"])
def test_missing_rank_times_out_then_recovers(fault, short_timeout, inject_fault):
    mesh = _mesh()
    x = jnp.arange(8 * 16 * 3, dtype=jnp.float32).reshape(8 * 16, 3)
    inject_fault(fault)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"missing ranks \[2\]|injected fault .* on rank 2") as info:
        np.asarray(_gather_fn(mesh)(x))
    assert time.monotonic() - start < 10 * TIMEOUT_S + 5, "the failure took far longer than the timeout"

    inject_fault("")
    out = np.asarray(_gather_fn(mesh)(x))
    np.testing.assert_array_equal(out, np.tile(np.asarray(x), (8, 1)))


def test_peers_report_the_missing_rank(short_timeout, inject_fault, capfd):
    """Every waiting rank's error names the missing rank and the phase (checked on matmul_rs). XLA
    raises the first error, the faulty rank's own; every failed call also writes its error to
    stderr at once, where the waiting ranks' are read."""
    mesh = _mesh()
    rng = np.random.default_rng(5)
    y = jnp.asarray(rng.standard_normal((8 * 16, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8 * 4, 2)), jnp.float32)
    inject_fault("fail:5")
    with pytest.raises(Exception, match=r"missing ranks \[5\]|on rank 5"):
        np.asarray(_matmul_rs_fn(mesh)(y, w))
    inject_fault("")
    expected = jax.jit(jax.shard_map(lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True), mesh=mesh,
                                     in_specs=(P("tp"), P("tp", None)), out_specs=P("tp")))(y, w)
    np.testing.assert_allclose(np.asarray(_matmul_rs_fn(mesh)(y, w)), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # Read after the next call: XLA may raise before the last waiting rank's timeout has passed.
    waiting = [line for line in capfd.readouterr().err.splitlines() if "rendezvous timed out" in line]
    assert sorted(int(re.search(r", rank (\d+):", line).group(1)) for line in waiting) == [0, 1, 2, 3, 4, 6, 7], waiting
    assert all("phase done" in line and "missing ranks [5]" in line for line in waiting), waiting


def test_bad_fault_spec_is_rejected(inject_fault):
    with pytest.raises(ValueError, match="skip:<rank>"):
        inject_fault("explode:1")
    x = jnp.arange(8 * 4 * 2, dtype=jnp.float32).reshape(8 * 4, 2)  # nothing was armed: the op runs
    np.testing.assert_array_equal(np.asarray(_gather_fn(_mesh())(x)), np.tile(np.asarray(x), (8, 1)))


# ------------------------------------------------------------------------------------------------
# Every public op on copy engines, a 2-D mesh group, the error's arrival time, and the process
# staying usable: the program that failed runs correctly once the fault is disarmed, and so does
# a fresh trace.
# ------------------------------------------------------------------------------------------------
#: Slack over the rendezvous timeout for the error to reach Python: the peers' wait ends at the
#: timeout; the rest is unwinding the launch (no compile: the programs are compiled beforehand).
ARRIVAL_SLACK_S = 2.0


def _mesh2d():
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]]  # ordinals != ranks
    return Mesh(devices.reshape(2, 4), ("dp", "tp"))


def _program(mesh, op, transfer="pull"):
    """A freshly traced and compiled program running `op`, with its inputs and the expected output;
    transfer="push" runs the push form of each schedule."""
    import ficco_jax

    def sched(text):
        return text + ("/push" if transfer == "push" else "")

    spec = P(tuple(mesh.axis_names))
    n, devices = mesh.shape["tp"], mesh.devices.size
    rng = np.random.default_rng(11)  # random values: a stale or misplaced block shows in the comparison
    x = jnp.asarray(rng.standard_normal((devices * 16, 4)), jnp.float32)  # 16 rows per device
    if op == "ag_matmul":
        w = jnp.asarray(rng.standard_normal((4, n * 2)), jnp.float32)
        body = lambda a, b: ficco_jax.ag_matmul(a, b, "tp", schedule=sched("dma/ring/c2"))
        in_specs, out_spec = (spec, P(None, "tp")), P(mesh.axis_names[:-1] or None, "tp")
        ref = lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b
    elif op == "matmul_rs":
        w = jnp.asarray(rng.standard_normal((4 * n, 3)), jnp.float32)
        body = lambda a, b: ficco_jax.matmul_rs(a, b, "tp", schedule=sched("dma/direct/c2/s2"))
        in_specs, out_spec = (spec, P("tp", None)), spec
        ref = lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True)
    else:
        w = None
        body = (lambda a: dma.reduce_scatter(a, "tp", schedule=sched("dma/direct/c1/s2"))) if op == "reduce_scatter" \
            else (lambda a: dma.all_gather(a, "tp", schedule=sched("dma/direct/c2/s2")))
        ref = (lambda a: jax.lax.psum_scatter(a, "tp", tiled=True)) if op == "reduce_scatter" \
            else (lambda a: jax.lax.all_gather(a, "tp", tiled=True))
        in_specs, out_spec = (spec,), spec
    args = (x,) if w is None else (x, w)
    make = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
    compiled = make(body).lower(*args).compile()
    expected = np.asarray(make(ref)(*args))
    return compiled, args, expected


OPS_AND_TRANSFERS = [(op, transfer) for op in ("ag_matmul", "matmul_rs", "all_gather", "reduce_scatter")
                     for transfer in ("pull", "push")] + [("matmul_rs on its channel", "pull")]


@pytest.mark.sweep
@pytest.mark.parametrize("mesh_kind", ["1d", "2d"])
@pytest.mark.parametrize("op, transfer", OPS_AND_TRANSFERS)
@pytest.mark.parametrize("mode", ["skip", "fail"])
def test_every_op_fails_in_time_naming_the_rank_then_runs_again(op, mode, transfer, mesh_kind, short_timeout,
                                                                inject_fault, monkeypatch, capfd):
    """Every call meets its group; "matmul_rs on its channel" runs matmul_rs's small pulls on the
    group's channel instead (config.CHANNEL_BYTES set; pushes always meet). XLA raises the first
    error, often the faulty rank's own; every failed call also writes its error to stderr, where
    each peer's is read: every peer of every group names the faulty rank."""
    on_channel = op == "matmul_rs on its channel"
    if on_channel:
        op = "matmul_rs"
        monkeypatch.setattr(config, "CHANNEL_BYTES", 8 << 20)
    mesh = _mesh() if mesh_kind == "1d" else _mesh2d()
    missing = 1 if mesh_kind == "2d" else 6  # on the 2-D mesh: rank 1 of both tp groups
    program, args, expected = _program(mesh, op, transfer)
    inject_fault(f"{mode}:{missing}")
    start = time.monotonic()
    # Pulls: the peers time out waiting for the missing rank. Pushes: a rank that fails after the
    # exchange still meets its peers once (they may have written into it), so they name it at once.
    named = rf"missing ranks \[{missing}\]|injected fault '{mode}' on rank {missing}|rank {missing} \(device \d+\) failed"
    with pytest.raises(Exception, match=named):
        jax.block_until_ready(program(*args))
    elapsed = time.monotonic() - start
    inject_fault("")
    print(f"fault {mode}:{missing} {op} {mesh_kind}: error after {elapsed:.3f} s (timeout {TIMEOUT_S} s)")
    assert elapsed < TIMEOUT_S + ARRIVAL_SLACK_S, f"{op} {mode}: the error took {elapsed:.2f} s"

    # The process stays usable: the program that failed and a fresh trace run correctly; the
    # peers on the next launch (a new RunId) are unaffected by the stale call.
    np.testing.assert_allclose(np.asarray(program(*args)), expected, rtol=1e-5, atol=1e-6)
    fresh, _, _ = _program(mesh, op, transfer)
    np.testing.assert_allclose(np.asarray(fresh(*args)), expected, rtol=1e-5, atol=1e-6)
    # Read after the next calls: every handler of the failed launch has returned by then. On the
    # channel a rank that fails at its first pull has published its own data already (its matmuls
    # ran first), so its peers complete that call: only the waiting cases name it.
    if not (on_channel and mode == "fail"):
        _assert_every_peer_names(capfd.readouterr().err, mesh, missing)


def _assert_every_peer_names(stderr, mesh, missing):
    """Each peer of the faulty rank (tp - 1 per group) wrote an error naming it, on its own device."""
    own = "injected fault"
    names = re.compile(rf"missing ranks \[{missing}\]|rank {missing} \(device \d+\) (failed|did not|has not)")
    lines = [line for line in stderr.splitlines() if line.startswith("ficco_jax") and own not in line]
    naming = [line for line in lines if names.search(line)]
    groups = mesh.devices.size // mesh.shape["tp"]
    def who(line):  # the device that wrote it, or its group and rank (a rendezvous error names no device)
        device = re.search(r"on device (\d+):", line)
        if device:
            return ("device", int(device.group(1)))
        member = re.search(r"group (?:of devices )?\[([\d, ]+)\][^:]*, rank (\d+)", line)
        return ("rank", member.group(1), int(member.group(2))) if member else ("line", line)

    peers = groups * (mesh.shape["tp"] - 1)
    assert len({who(line) for line in naming}) >= peers, (peers, lines)
    assert all(names.search(line) for line in lines if "rendezvous" in line), lines


def test_a_waiting_rank_names_the_op_group_and_missing_ranks():
    """What every waiting rank reports. (With an injected fault XLA surfaces the faulty rank's own
    error first, so here the missing ranks are real: the group names 8 devices, 4 launch.)"""
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    groups = np.arange(8, dtype=np.int64)

    def gather(a):
        call = jax.ffi.ffi_call("ficco_all_gather", jax.ShapeDtypeStruct((8 * a.shape[0], a.shape[1]), a.dtype))
        return call(ffi_position(), a, ficco_abi=np.int64(_ext.CONTRACT_VERSION), op_id=np.int64(2 * 10**9),
                    groups=groups, devices=groups, ipc_job=np.int64(0),
                    group_size=np.int64(8), chunks=np.int64(1),
                    order=np.int64(1), gemm=np.int64(0), copy_streams=np.int64(1),
                    timeout_ms=np.int64(int(TIMEOUT_S * 1000)), watchdog_ms=np.int64(0), site="test",
                    skip_own_rows=np.int64(0), transfer=np.int64(0), w_col_major=np.int64(0),
                    channel_bytes=np.int64(0))

    f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    x = jnp.zeros((4 * 2, 3), jnp.float32)
    compiled = f.lower(x).compile()
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        jax.block_until_ready(compiled(x))
    elapsed = time.monotonic() - start
    message = str(info.value)
    print(f"missing ranks [4, 5, 6, 7]: error after {elapsed:.3f} s (timeout {TIMEOUT_S} s)")
    assert f"rendezvous timed out after {TIMEOUT_S} s in op {2 * 10**9} (ficco_all_gather)" in message, message
    assert "group [0, 1, 2, 3, 4, 5, 6, 7]" in message and "missing ranks [4, 5, 6, 7]" in message, message
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + ARRIVAL_SLACK_S, elapsed


def test_repeated_faults_do_not_accumulate(short_timeout, inject_fault):
    """Five failed launches in a row, then healthy ones: nothing stale blocks or slows them."""
    mesh = _mesh()
    program, args, expected = _program(mesh, "all_gather")
    inject_fault("fail:0")
    for _ in range(5):
        with pytest.raises(Exception, match=r"missing ranks \[0\]|on rank 0"):
            jax.block_until_ready(program(*args))
    inject_fault("")
    start = time.monotonic()
    for _ in range(20):
        out = program(*args)
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert time.monotonic() - start < TIMEOUT_S, "healthy launches after faults waited on something"


@pytest.mark.sweep
@pytest.mark.parametrize("op, transfer", OPS_AND_TRANSFERS[:-1])
@pytest.mark.parametrize("at", [2, 4, 7])
def test_a_transfer_failing_midway_returns_only_after_xlas_stream_waits_for_what_was_enqueued(
        op, transfer, at, short_timeout, inject_fault):
    """Rank 3 fails at its at-th copy-stream operation, after copies into its or its peers' buffers were
    enqueued. XLA frees a failed call's buffers, so the handler may return its error only once XLA's
    stream waits for every one of those copies (the fault's backend checks it on each call and
    counts the calls that did not); then the program runs again correctly."""
    mesh = _mesh()
    program, args, expected = _program(mesh, op, transfer)
    before = _ext.testing().unjoined_copy_calls()
    inject_fault(f"fail:3:{at}")
    with pytest.raises(Exception, match=r"missing ranks \[3\]|injected fault 'fail' on rank 3|rank 3 \(device \d+\) failed"):
        jax.block_until_ready(program(*args))
    inject_fault("")
    assert _ext.testing().unjoined_copy_calls() == before, "a failed call returned before its copies were joined"
    np.testing.assert_allclose(np.asarray(program(*args)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transfer", ["pull", "push"])
@pytest.mark.parametrize("at", range(20, 32))
def test_a_failure_inside_the_join_still_joins_every_copy_stream(at, transfer, short_timeout, inject_fault):
    """all_gather c2/s2: 8 ranks, 7 slots on 2 copy streams, about 24 copy-stream operations before
    the join, which records the tail of each stream for XLA's stream to wait on. Rank 3 fails at each
    operation from the 20th to the 31st, the join's records among them: a join that stopped at its
    first failed record, or skipped the stream whose record failed, left copies unjoined when the
    handler returned (pulled, the 25th: 4 copies on stream 0)."""
    mesh = _mesh()
    program, args, expected = _program(mesh, "all_gather", transfer)
    before = _ext.testing().unjoined_copy_calls()
    inject_fault(f"fail:3:{at}")
    try:
        jax.block_until_ready(program(*args))  # a fault past the call's last operation never strikes
    except Exception as exc:  # noqa: BLE001 - any rank's error; the check below is the point
        assert re.search(r"missing ranks \[3\]|injected fault 'fail' on rank 3|rank 3 \(device \d+\) failed",
                         str(exc)), exc
    inject_fault("")
    assert _ext.testing().unjoined_copy_calls() == before, "a failed call returned before its copies were joined"
    np.testing.assert_array_equal(np.asarray(program(*args)), expected)
