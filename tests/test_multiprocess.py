"""ficco_jax under jax.distributed: two processes x 4 virtual CPU devices, one global mesh of 8.

The two-process test launches tests/mp_worker.py twice (gloo carries the cross-process
collectives); see that file for the checks. The rest checks the classification of topology.py
on stand-in devices, in this process.
"""
import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ficco_jax.runtime import extension as _ext, topology
from ficco_jax.tuning import policy, select
from ficco_jax.schedule import Schedule

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_worker.py")
#: Seconds the two workers get in all (they take about 8 s on 2 shared cores).
WORKER_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")
def test_two_processes_fall_back_to_xla_across_processes_and_keep_dma_within(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "FICCO_HOST_ID")}
    env["JAX_PLATFORMS"] = "cpu"
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), "2", str(port), str(outs[i])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the workers did not finish within {WORKER_TIMEOUT_S} s:\n" +
                    "\n".join(p.communicate()[0][-3000:] for p in procs))
    failures = []
    for i, (p, out, log) in enumerate(zip(procs, outs, logs)):
        if not out.exists():
            failures.append(f"process {i} wrote no results (exit {p.returncode}):\n{log[-3000:]}")
            continue
        checks = json.loads(out.read_text())["checks"]
        failures += [f"process {i} {name}:\n{err}" for name, err in checks.items() if err != "ok"]
        assert len(checks) == 9, checks
    assert not failures, "\n".join(failures)
    assert [p.returncode for p in procs] == [0, 0], logs


# ------------------------------------------------------------------------------------------------
# Classification on stand-in devices (no second process needed)
# ------------------------------------------------------------------------------------------------
def _dev(device_id, process_index, ordinal):
    return SimpleNamespace(id=device_id, process_index=process_index, local_hardware_id=ordinal)


HOSTS = {0: "node-a", 1: "node-a", 2: "node-b"}


@pytest.mark.parametrize("rows,kind", [
    ([[_dev(0, 0, 0), _dev(1, 0, 1)], [_dev(4, 1, 0), _dev(5, 1, 1)]], topology.IN_PROCESS),
    ([[_dev(0, 0, 0), _dev(4, 1, 0)]], topology.SAME_HOST_MULTI_PROCESS),
    ([[_dev(0, 0, 0), _dev(1, 0, 1)], [_dev(4, 1, 0), _dev(8, 2, 0)]], topology.MULTI_HOST),
], ids=["groups-in-processes", "group-over-processes-of-one-host", "one-group-over-hosts"])
def test_a_site_is_as_remote_as_its_most_remote_group(rows, kind):
    with topology.hosts_overridden(HOSTS):
        site = topology.describe_groups(rows, "tp")
    assert site.kind == kind
    assert [m.device_id for m in site.groups[0].members] == [d.id for d in rows[0]]
    allowed = select.available_comms("cpu", topology=site)
    assert ("dma" in allowed) == (kind == topology.IN_PROCESS and _ext.available())


@pytest.mark.parametrize("kind,gpu_dma", [
    (topology.IN_PROCESS, True), (topology.SAME_HOST_MULTI_PROCESS, True), (topology.MULTI_HOST, False),
])
def test_on_gpus_copy_engines_reach_the_processes_of_one_host_only(kind, gpu_dma, monkeypatch):
    from ficco_jax.runtime import ipc

    monkeypatch.setattr(ipc, "supported", lambda platform=None: platform == "gpu")  # a CUDA build
    monkeypatch.setattr(_ext, "cuda_built", lambda: True)
    rows = {topology.IN_PROCESS: [[_dev(0, 0, 0), _dev(1, 0, 1)]],
            topology.SAME_HOST_MULTI_PROCESS: [[_dev(0, 0, 0), _dev(4, 1, 0)]],
            topology.MULTI_HOST: [[_dev(0, 0, 0), _dev(8, 2, 0)]]}[kind]
    with topology.hosts_overridden(HOSTS):
        site = topology.describe_groups(rows, "tp")
    assert site.kind == kind
    assert ("dma" in select.available_comms("gpu", topology=site)) == gpu_dma
    assert select.dma_reaches(site, "gpu") == gpu_dma
    assert select.dma_reaches(site, "cpu") == (kind == topology.IN_PROCESS)  # no IPC between CPU processes


def test_why_names_the_group_the_processes_and_the_hosts():
    with topology.hosts_overridden(HOSTS):
        site = topology.describe_groups([[_dev(0, 0, 0), _dev(8, 2, None)], [_dev(1, 0, 1), _dev(9, 2, None)]], "tp")
    why = site.why_not_in_process()
    assert why == ("group devices [0, 8] on processes [0, 2] (hosts ['node-a', 'node-b']) (and 1 more group(s)) "
                   "spans several hosts"), why
    msg = topology.dma_refusal("ag_matmul", site)
    assert msg.startswith("ag_matmul: mesh axis 'tp' spans several processes: group devices [0, 8]")
    assert "comm='xla'" in msg


def test_auto_falls_back_with_a_log_line_and_keeps_what_reaches(caplog, monkeypatch):
    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)  # the GPU decision, on CPU devices
    with topology.hosts_overridden(HOSTS):
        remote = topology.describe_groups([[_dev(0, 0, 0), _dev(4, 1, None)]], "tp")
    comms, why = policy.allowed_comms("float32", remote)
    assert "dma" not in comms and "only through CUDA IPC (GPUs with the CUDA build, opt-in" in why
    shapes = ((64, 32), (32, 16))
    with caplog.at_level("INFO", logger="ficco_jax"):
        chosen = policy.choose("ag_matmul", shapes, "float32", 2, topology=remote)
    assert chosen.comm in ("xla", "none"), chosen
    assert "only through CUDA IPC" in caplog.text and f"so {chosen} " in caplog.text
    comms_here, why_here = policy.allowed_comms("float32", topology.for_axis("tp"))
    assert "dma" in comms_here and why_here == ""


def test_one_process_needs_no_mesh():
    site = topology.for_axis("tp")
    assert site.kind == topology.IN_PROCESS and site.source == "single process"


def test_cross_process_copy_engines_are_opt_in(monkeypatch):
    """Until the CUDA IPC path has run on a GPU, a CUDA build on GPUs still keeps same-host
    groups on XLA's collectives unless FICCO_CROSS_PROCESS_DMA=1 (config.CROSS_PROCESS_DMA)."""
    from ficco_jax import config
    from ficco_jax.runtime import ipc

    monkeypatch.setattr(_ext, "cuda_built", lambda: True)
    monkeypatch.setattr(_ext, "build_info", lambda: {"cuda": True, "ipc": True})
    monkeypatch.setattr(config, "CROSS_PROCESS_DMA", False)
    assert not ipc.supported("gpu")
    monkeypatch.setattr(config, "CROSS_PROCESS_DMA", True)
    assert ipc.supported("gpu") and not ipc.supported("cpu")
