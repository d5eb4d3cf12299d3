"""The contention probe of `characterize` (xla_ffi/exec/probe.cc) on 8 CPU devices, and the
scripts that show where a call's time goes: a profiler timeline of one op, and its host time."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ficco_jax.lowering.dma import probe
from helpers import random, rel_err


@pytest.mark.parametrize("pull", [False, True])
def test_probe_computes_the_matmul_with_or_without_pulls(mesh2d, rng, pull):
    specs = (P(("dp", "tp"), None), P(), P(("dp", "tp"), None))  # w replicated: out rows follow a
    a, w, x = random(rng, (8 * 16, 24), "float32"), random(rng, (24, 8), "float32"), random(rng, (8 * 4, 6), "float32")
    args = [jax.device_put(v, NamedSharding(mesh2d, s)) for v, s in zip((a, w, x), specs)]
    body = lambda a, w, x: probe.matmuls_beside_pulls(a, w, x, "tp", repeats=3, pull=pull)
    got = jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=specs, out_specs=P(("dp", "tp"), None)))(*args)
    want = jax.jit(jax.shard_map(lambda a, w, x: a @ w, mesh=mesh2d, in_specs=specs,
                                 out_specs=P(("dp", "tp"), None)))(*args)
    assert rel_err(got, want) < 1e-5


def test_probe_rejects_bad_repeats(mesh1d):
    a = jnp.ones((8 * 4, 4), jnp.float32)
    body = lambda a: probe.matmuls_beside_pulls(a, a[:4], a, "tp", repeats=0, pull=True)
    with pytest.raises(ValueError, match="repeats an int >= 1"):
        jax.jit(jax.shard_map(body, mesh=mesh1d, in_specs=P("tp"), out_specs=P("tp")))(a)


def test_trace_op_with_jax_profiler_and_its_timeline(tmp_path):
    # The no-nsys route for GPU timelines: trace_op records one run with JAX's profiler, and
    # perfetto_timeline prints that device's (here: the host's) threads and events.
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "benchmarks/suites/trace_op.py", "ag_matmul", "dma/direct/c2", "64", "32", "64", "2",
                          "--jax-profiler", str(tmp_path)], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    shown = subprocess.run([sys.executable, "benchmarks/suites/perfetto_timeline.py", str(tmp_path), "--count", "5",
                            "--by-name", "3"], cwd=root, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.splitlines()
    assert lines[0].endswith("events of '/host:CPU'") and int(lines[0].split()[0]) > 0, lines[:3]
    assert any("PjitFunction" in line or "Execute" in line for line in lines), shown.stdout[-1500:]
    assert any(line.startswith("span ") for line in lines), lines[:12]
    assert any(re.match(r"\s+\d+ x +[\d.]+ us = +[\d.]+ us ", line) for line in lines), lines[:20]


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("channel", [True, False])
def test_host_time_splits_a_call_into_handler_and_meetings(tmp_path, channel):
    # benchmarks/suites/host_time.py on 2 CPU devices: every handler counted, meetings inside it; on
    # the group's channel (FICCO_CHANNEL_BYTES set) no meetings, words instead.
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    if channel:
        env["FICCO_CHANNEL_BYTES"] = str(8 << 20)
    out = tmp_path / "host_time.json"
    run = subprocess.run([sys.executable, "benchmarks/suites/host_time.py", "matmul_rs", "dma/direct/c2", "16", "8", "16",
                          "--iters", "3", "--launches", "2", "--out", str(out)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["handlers"] == 2 * 3 * 2, result  # devices x iterations x launches
    # c2 on 2 devices, per call and device: a copy per chunk, two send matmuls and the own block's two
    # halves, whose epilogues add the received partial (no sum), the watchdog's two marks.
    calls = {kind: b["calls"] for kind, b in result["backend_us"].items()}
    assert calls["copy"] == 2 and calls["gemm"] == 4 and calls["reduce"] == 0 and calls["mark"] == 2, calls
    if channel:
        # Two ready words set as the send chunks are written and waited for by the peer, one done word
        # set after the pulls, and one waited for before this call writes its region again.
        assert result["meeting_us"] == 0, result
        assert calls["set_word"] == 3 and calls["wait_word"] == 3, calls
    else:
        assert 0 < result["meeting_us"] < result["handler_us"], result
        assert result["channel_wait_us"] == 0, result
        assert calls["set_word"] == 0 and calls["wait_word"] == 0, calls
    assert result["other_us"] > 0, result
    assert "per call and device, handler" in run.stdout and "backend calls per call and device" in run.stdout
