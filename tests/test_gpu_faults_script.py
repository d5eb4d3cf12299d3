"""benchmarks/suites/faults.py on 4 virtual CPU devices, a subset of ops, in a subprocess: the script
the GPU run uses cannot rot. It must finish, pass, and write its JSON."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from ficco_jax.runtime import extension as _ext

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "suites" / "faults.py"
TIMEOUT_S = 1.0


@pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")
def test_gpu_faults_script_on_cpu(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(SCRIPT), "--ops", "all_gather,a2a_matmul", "--timeout-s", str(TIMEOUT_S),
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "Overall: PASS" in done.stdout
    result = json.loads((tmp_path / "gpu_faults.json").read_text())
    cases = {c["case"]: c for c in result["cases"]}
    assert result["all_pass"] and result["timeout_s"] == TIMEOUT_S
    assert set(cases) == {"all_gather skip:1", "all_gather fail:3", "all_gather usable", "a2a_matmul skip:1",
                          "a2a_matmul fail:3", "a2a_matmul usable", "partial_group 2 of 4", "partial_group usable"}
    for name, case in cases.items():
        if "usable" in name:
            assert case["equal"] and case["launches_s"] < TIMEOUT_S, case
            continue
        assert case["raised"] and case["names_rank"], case
        assert case["error_s"] < TIMEOUT_S + result["margin_s"], case
    for op in ("all_gather", "a2a_matmul"):
        skip, fail = cases[f"{op} skip:1"], cases[f"{op} fail:3"]
        assert "rank 1" in skip["message"] or "missing ranks [1]" in skip["message"], skip["message"]
        assert "rank 3" in fail["message"] or "missing ranks [3]" in fail["message"], fail["message"]
        assert skip["next_call_precompiled"] and skip["next_call_fresh_trace"]
    partial = cases["partial_group 2 of 4"]
    assert "missing ranks [2, 3]" in partial["message"] and "group [0, 1, 2, 3]" in partial["message"], partial
    assert partial["error_s"] >= 0.9 * TIMEOUT_S
