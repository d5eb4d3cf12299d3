"""The cost profile measured on first use (ficco_jax/tuning/first_use.py): what it fits from the
probes' times, where it is cached, when it is measured, and that its programs run (on CPU devices,
inside a trace as when the first op is resolved)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ficco_jax import config
from ficco_jax.schedule import Schedule, local_shapes
from ficco_jax.tuning import cost_model, first_use, select

#: The machine the stub timer pretends to be.
TRUE = {**cost_model.DEFAULT_PROFILE, "peak_tflops": {"bfloat16": 780.0, "float16": 650.0, "float32": 50.0},
        "rows_half": 96.0, "xla_latency_us": 18.0, "xla_ingress_gbps": 180.0, "collective_latency_us": 18.0,
        "dma_ingress_gbps": 310.0, "dma_stream_gbps": 310.0, "dma_call_us": 15.0, "dma_host_us": 60.0,
        "dma_host_copy_us": 5.0, "dma_latency_us": 8.0, "executor_gemm_slowdown": 1.04, "contention_dma": 0.04}


def stub_timer(calls=None):
    """Seconds each probe would take on TRUE, with the same formulas the fit inverts."""
    def timer(probe, devices):
        n = len(devices)
        if calls is not None:
            calls.append(probe)
        if probe.what == "gemm":
            return cost_model.gemm_time(*probe.shape, "bfloat16", TRUE)
        if probe.what == "nccl":
            return TRUE["xla_latency_us"] * 1e-6 + (n - 1) * probe.shape[0] / (TRUE["xla_ingress_gbps"] * 1e9)
        if probe.what == "dma":
            return (n - 1) * probe.shape[0] / (TRUE["dma_ingress_gbps"] * 1e9)
        return cost_model.predict(probe.op, Schedule.parse(probe.schedule), local_shapes(probe.op, *probe.shape, n),
                                  "bfloat16", n, TRUE)
    return timer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "PROFILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "PROFILE_MEASURE", True)
    monkeypatch.setattr(first_use, "_memo", {})
    return tmp_path


def test_fit_recovers_the_machine():
    devices = jax.devices()[:2]
    fitted = first_use.measure(devices, stub_timer())
    assert fitted["peak_tflops"]["bfloat16"] == pytest.approx(780.0, rel=1e-3)
    assert fitted["rows_half"] == pytest.approx(96.0, rel=1e-2)
    assert fitted["xla_ingress_gbps"] == pytest.approx(180.0, rel=1e-3)
    assert fitted["xla_latency_us"] == pytest.approx(18.0, rel=1e-2)
    assert fitted["dma_ingress_gbps"] == pytest.approx(310.0, rel=1e-3)
    ops = fitted["fitted_to_ops"]
    assert ops["observations"] == 8 and ops["rms_log_error"] < 0.01
    assert fitted["model_version"] == first_use.MODEL_VERSION and "measured on first use" in fitted["source"]
    # The fitted profile prices the probes' ops as the machine ran them.
    for probe in first_use.PROBES:
        if probe.what == "op":
            shapes = local_shapes(probe.op, *probe.shape, 2)
            got = cost_model.predict(probe.op, Schedule.parse(probe.schedule), shapes, "bfloat16", 2, fitted)
            want = cost_model.predict(probe.op, Schedule.parse(probe.schedule), shapes, "bfloat16", 2, TRUE)
            assert got == pytest.approx(want, rel=0.03), probe


def test_measured_once_then_read_from_the_cache(cache, capsys):
    devices, kind = jax.devices()[:2], jax.devices()[0].device_kind
    calls = []
    first = first_use.profile(kind, 2, timer=stub_timer(calls), devices=devices)
    assert len(calls) == len(first_use.PROBES) and first is not None
    err = capsys.readouterr().err
    assert "measuring one" in err and "FICCO_PROFILE_MEASURE=0" in err and "cached in" in err
    path = first_use.cache_path(kind, 2)
    assert json.load(open(path))["peak_tflops"]["bfloat16"] == pytest.approx(780.0, rel=1e-3)
    first_use._memo.clear()  # a later process
    again = first_use.profile(kind, 2, timer=stub_timer(calls), devices=devices)
    assert len(calls) == len(first_use.PROBES) and again == first and capsys.readouterr().err == ""


def test_a_cache_of_another_model_version_is_measured_again(cache):
    devices, kind = jax.devices()[:2], jax.devices()[0].device_kind
    path = first_use.cache_path(kind, 2)
    first_use._write(path, {"model_version": first_use.MODEL_VERSION - 1, "peak_tflops": {"bfloat16": 1.0}})
    calls = []
    fresh = first_use.profile(kind, 2, timer=stub_timer(calls), devices=devices)
    assert calls and fresh["peak_tflops"]["bfloat16"] == pytest.approx(780.0, rel=1e-3)


def test_a_profile_measured_without_copy_engines_never_prices_them(cache, capsys):
    """Measured where copy engines cannot run, a profile's copy-engine terms are the fit's guesses:
    it is cached apart, and a process that can use copy engines measures its own."""
    devices, kind = jax.devices()[:2], jax.devices()[0].device_kind
    calls = []
    first_use.profile(kind, 2, with_dma=False, timer=stub_timer(calls), devices=devices)
    assert calls and not any(p.what == "dma" or "dma" in p.schedule for p in calls)
    assert "copy engines not measured" in capsys.readouterr().err
    calls.clear()
    with_dma = first_use.profile(kind, 2, with_dma=True, timer=stub_timer(calls), devices=devices)
    assert any(p.what == "dma" for p in calls) and with_dma["dma_ingress_gbps"] == pytest.approx(310.0, rel=1e-3)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        os.path.basename(first_use.cache_path(kind, 2, d)) for d in (True, False))


@pytest.mark.parametrize("damage", ["null", "[1, 2]", "{ not json"])
def test_a_damaged_cache_file_is_measured_again(cache, damage):
    devices, kind = jax.devices()[:2], jax.devices()[0].device_kind
    path = first_use.cache_path(kind, 2)
    with open(path, "w") as fh:
        fh.write(damage)
    calls = []
    fresh = first_use.profile(kind, 2, timer=stub_timer(calls), devices=devices)
    assert calls and fresh["peak_tflops"]["bfloat16"] == pytest.approx(780.0, rel=1e-3)
    assert json.load(open(path))["model_version"] == first_use.MODEL_VERSION


def test_a_cache_that_cannot_be_written_serves_this_process(cache, monkeypatch, capsys):
    blocker = cache / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(config, "PROFILE_CACHE_DIR", str(blocker / "profiles"))  # under a file: not a folder
    devices, kind = jax.devices()[:2], jax.devices()[0].device_kind
    found = first_use.profile(kind, 2, timer=stub_timer(), devices=devices)
    assert found["peak_tflops"]["bfloat16"] == pytest.approx(780.0, rel=1e-3)
    assert "could not be cached in" in capsys.readouterr().err


@pytest.mark.parametrize("why", ["switched off", "one device", "several processes", "too few devices",
                                 "other devices"])
def test_not_measured(cache, monkeypatch, why):
    kind, devices, axis_size = jax.devices()[0].device_kind, jax.devices()[:2], 2
    if why == "switched off":
        monkeypatch.setattr(config, "PROFILE_MEASURE", False)
    elif why == "one device":
        axis_size = 1
    elif why == "several processes":
        monkeypatch.setattr(jax, "process_count", lambda: 2)
    elif why == "too few devices":
        devices = devices[:1]
    else:
        kind = "NVIDIA H100 80GB HBM3"
    calls = []
    assert first_use.profile(kind, axis_size, timer=stub_timer(calls), devices=devices) is None
    assert calls == [] and not list(cache.iterdir())


def test_profile_for_prefers_exact_shipped_then_measured_then_nearest(monkeypatch):
    measured = {"name": "measured here", "peak_tflops": {"bfloat16": 1.0}}
    asked = []
    monkeypatch.setattr(first_use, "profile", lambda kind, n, with_dma: asked.append((kind, n, with_dma)) or measured)
    assert select.profile_for(2, "NVIDIA H200")["name"] == "h200x2"  # shipped for exactly 2
    assert select.profile_for(3, "NVIDIA H200")["name"] == "h200x4"  # another machine's kind: nearest shipped
    assert asked == []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert select.profile_for(2)["name"] == "measured here"  # this machine, no profile for its kind
    assert asked == [(jax.devices()[0].device_kind, 2, "dma" in select.available_comms())]
    monkeypatch.setattr(first_use, "profile", lambda kind, n, with_dma: None)  # measuring off
    assert select.profile_for(2)["name"] == "default"


def test_a_profile_that_cannot_be_measured_falls_back_once(cache, capsys):
    devices, kind = jax.devices()[:2], jax.devices()[0].device_kind
    calls = []

    def failing(probe, devices):
        calls.append(probe)
        raise RuntimeError("out of memory")

    assert first_use.profile(kind, 2, timer=failing, devices=devices) is None
    assert "could not be measured here (RuntimeError: out of memory)" in capsys.readouterr().err
    assert first_use.profile(kind, 2, timer=failing, devices=devices) is None and len(calls) == 1
    assert not list(cache.iterdir())


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("where", ["jit", "jit under set_mesh", "shard_map under set_mesh"])
def test_probe_programs_run_inside_a_trace(cache, where):
    """Every kind of probe builds and runs (tiny sizes, CPU devices), also when the first op is
    resolved while jit traces the user's function, under the user's explicit mesh, in a shard_map."""
    small = (first_use.Probe("gemm", (16, 32, 32)), first_use.Probe("gemm", (64, 32, 32)),
             first_use.Probe("nccl", (4096,)), first_use.Probe("nccl", (16384,)), first_use.Probe("dma", (16384,)),
             first_use.Probe("op", (16, 32, 32), "ag_matmul", "none"),
             first_use.Probe("op", (16, 32, 32), "ag_matmul", "dma/direct/c1"),
             first_use.Probe("op", (16, 32, 32), "matmul_rs", "dma/direct/c1"))
    seen = {}

    def timer(probe, devices):
        seen[probe] = first_use.device_seconds(probe, devices)
        return max(seen[probe], 1e-9)

    def user_step(x):
        seen["profile"] = first_use.measure(jax.devices()[:2], timer, small)
        return x * 2

    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    if where == "jit":
        assert float(jax.jit(user_step)(jnp.ones(()))) == 2.0
    else:
        spec = jax.sharding.PartitionSpec("dp", "tp")
        step = jax.jit(user_step if where.startswith("jit") else
                       jax.shard_map(user_step, mesh=mesh, in_specs=spec, out_specs=spec))
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.ones((8, 8)), jax.sharding.NamedSharding(mesh, spec))
            assert float(step(x).sum()) == 128.0
    assert len(seen) == len(small) + 1 and all(np.isfinite(seen[p]) for p in small)
    assert np.isfinite(seen["profile"]["peak_tflops"]["bfloat16"])
