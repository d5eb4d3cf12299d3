"""benchmarks/suites/multiprocess_launch.sh --cpu: the Python side of the one-process-per-GPU check, on CPU.

Two processes, one CPU device each: copy engines cannot reach the other process there, so every
dma check must be refused with a clear error (its PASS) and the timings use XLA's collectives.
Also the options the GPU runs use: a JAX-profiler timeline of one op in every process (--trace,
read back by benchmarks/suites/perfetto_timeline.py) and the choice of timed shapes.
"""
import json
import os
import subprocess
import sys

import pytest

from ficco_jax.runtime import extension as _ext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = os.path.join(REPO, "benchmarks", "suites")
LAUNCH = os.path.join(SUITES, "multiprocess_launch.sh")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "FICCO_HOST_ID")}
    env.update(extra)
    return env


@pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")
def test_launcher_on_cpu_with_a_timeline(tmp_path):
    env = _env(OUT=str(tmp_path), FICCO_PYTHON=sys.executable, FICCO_MP_TRACE="ag_matmul:xla/ring/c2:64,32,64", FICCO_MP_BUDGET_S="200")
    done = subprocess.run(["bash", LAUNCH, "--cpu"], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "mp_gpu.json").read_text())
    assert result["n_processes"] == 2 and result["failed"] == 0 and result["passed"] > 0
    refused = [c for c in result["checks"] if c["kind"] in ("op", "collective") and c["schedule"].startswith("dma")]
    assert refused and all(c["passed"] and "refused" in c["status"] for c in refused)
    assert result["timings"] and all(r["comm_timed"] == "xla" for r in result["timings"])
    assert result["extension"]["version"]
    for p in (0, 1):  # every process recorded its own timeline
        traces = list((tmp_path / f"trace_p{p}").rglob("perfetto_trace.json.gz"))
        assert traces, f"no timeline from process {p}"
    shown = subprocess.run([sys.executable, os.path.join(SUITES, "perfetto_timeline.py"),
                            str(tmp_path / "trace_p0"), "--count", "5"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "events of" in shown.stdout, shown.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--trace", "ag_matmul:dma/direct/c1"], "expected OP:SCHEDULE:M,K,N"),
    (["--trace", "conv:dma/direct/c1:8,8,8"], "OP must be one of"),
    (["--trace", "ag_matmul:dma/sideways/c1:8,8,8"], "SCHEDULE"),
    (["--schedules", "dma/direct/c1,dma/direct/cX"], "chunks 'cX' must be c<positive int>"),
    (["--schedules", "xla/ring/c2"], "is not a dma schedule"),
    (["--schedules", ","], "no schedule given"),
])
def test_bad_option_is_a_clear_error(args, message):
    done = subprocess.run([sys.executable, os.path.join(SUITES, "multiprocess.py"), "--port", "1", *args],
                          env=_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
