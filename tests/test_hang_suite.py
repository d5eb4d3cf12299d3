"""The hang suite's watchdog (benchmarks/suites/hang.py) and the many-step reproducer it and
tests/gpu run (benchmarks/suites/mixed_step.py), on CPU: a run that stops printing step lines is
counted as hung and killed, one that exits cleanly as completed, one that errors as failed; the
mixed step trains and matches its plain program."""
import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import pytest

from ficco_jax.runtime import extension

REPO = pathlib.Path(__file__).resolve().parents[1]
SUITES = REPO / "benchmarks" / "suites"


def _hang_module():
    spec = importlib.util.spec_from_file_location("hang_suite", SUITES / "hang.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("program, outcome, steps", [
    ("print('step 1/3', flush=True); import time; time.sleep(60)", "hung", 1),
    ("import sys, time; print('step 1/3', flush=True); time.sleep(3); sys.exit(134)",
     "hung, ended by its watchdog (exit 134)", 1),
    ("print('step 1/2'); print('step 2/2')", "completed", 2),
    ("print('step 1/2', flush=True); raise SystemExit(3)", "failed (exit 3)", 1),
])
def test_outcomes(tmp_path, program, outcome, steps):
    hang = _hang_module()
    start = time.monotonic()
    result = hang.run_once([sys.executable, "-c", program], dict(os.environ), start_s=30, stall_s=1.5,
                           dump_path=str(tmp_path / "dump.txt"), log_path=str(tmp_path / "run.log"), grace_s=4)
    assert result["outcome"] == outcome and result["steps"] == steps, result
    assert time.monotonic() - start < 20
    assert "step 1/" in (tmp_path / "run.log").read_text()
    if outcome.startswith("hung"):  # the stacks of a hung run are taken (or it says why not) before it is killed
        assert (tmp_path / "dump.txt").read_text()


@pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")
def test_mixed_step_trains_like_its_plain_program(tmp_path):
    done = subprocess.run([sys.executable, str(SUITES / "mixed_step.py"), "--steps", "6", "--print-every", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "step 6/6" in done.stdout and "mixed_step PASS" in done.stdout
    import json
    result = json.loads((tmp_path / "mixed_step.json").read_text())
    assert result["first_step_rel_diff"] < 1e-4 and result["first_step_gradient_rel_diff"] < 1e-4
    assert result["losses"][-1] < result["losses"][0]  # it trains
    assert any(a.startswith("dma") for pair in result["schedules"] for a in pair)
