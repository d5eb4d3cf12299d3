"""benchmarks/suites/faults.py on 4 virtual CPU devices, a subset of ops, in a subprocess: the script
the GPU run uses cannot rot. It must finish, pass, and write its JSON."""
import importlib.util
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
    assert set(cases) == {f"{op} {case}" for op in ("all_gather", "a2a_matmul")
                          for case in ("skip:1", "fail:3", "fail:3:4", "usable")} | {"partial_group 2 of 4",
                                                                                    "partial_group usable"}
    for name, case in cases.items():
        if "usable" in name:  # the script's own verdict (all_pass) holds its launches to the timeout
            assert case["equal"] and case["plain_op"] and case["launches"] > 0, case
            continue
        assert case["raised"] and case["names_rank"], case
        assert name.startswith("partial_group") or case["copies_joined"], case
        assert case["error_s"] < TIMEOUT_S + result["margin_s"], case
    for op in ("all_gather", "a2a_matmul"):
        skip, fail = cases[f"{op} skip:1"], cases[f"{op} fail:3"]
        assert "rank 1" in skip["message"] or "missing ranks [1]" in skip["message"], skip["message"]
        assert "rank 3" in fail["message"] or "missing ranks [3]" in fail["message"], fail["message"]
        assert skip["next_call_precompiled"] and skip["next_call_fresh_trace"]
    partial = cases["partial_group 2 of 4"]
    assert "missing ranks [2, 3]" in partial["message"] and "group [0, 1, 2, 3]" in partial["message"], partial
    assert partial["error_s"] >= 0.9 * TIMEOUT_S


class _StuckChild:
    """A child process that never finishes in time: communicate() times out once, then returns."""

    def __init__(self, *args, **kwargs):
        self.returncode, self._timed_out = None, False

    def communicate(self, timeout=None):
        if not self._timed_out:
            self._timed_out = True
            raise subprocess.TimeoutExpired("child", timeout)
        return "", ""

    def kill(self):
        self.returncode = -9


@pytest.mark.parametrize("budget_s,overall", [(8.0, "INCOMPLETE"), (300.0, "FAIL")])
def test_a_child_the_budget_stops_is_not_judged_a_hang(monkeypatch, budget_s, overall):
    """A child still running when --budget-s runs out was not given its case timeout: its cases are
    SKIPPED and the run INCOMPLETE. One still running at its case timeout is a hang: FAIL."""
    spec = importlib.util.spec_from_file_location("faults_script", SCRIPT)
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    monkeypatch.setattr(faults.subprocess, "Popen", _StuckChild)
    args = faults.argparse.Namespace(ops="all_gather", partial=False, timeout_s=1.0, margin_s=3.0,
                                     case_timeout_s=60.0, budget_s=budget_s)
    result = faults.run(args)
    assert result["overall"] == overall and not result["all_pass"], result
    assert len(result["cases"]) == 4  # skip, fail, fail midway, usable
    for case in result["cases"]:
        assert not case["pass"] and case.get("skipped", False) == (overall == "INCOMPLETE"), case
        assert ("a hang" in case["note"]) == (overall == "FAIL"), case["note"]
    table = faults.table(result)
    assert f"Overall: {overall}" in table
    assert ("SKIPPED" in table) == (overall == "INCOMPLETE") and ("give it more time" in table) == (overall == "INCOMPLETE")
