"""No hang over many training steps: benchmarks/suites/mixed_step.py (a step mixing XLA's NCCL
collectives with copy-engine ops of several schedules, forward and backward) for 1200 steps under
each CUDA_DEVICE_MAX_CONNECTIONS a user runs with — CUDA's default (unset: 8 hardware queues), 1
(NVIDIA's JAX containers) and 32 — in a child process with a deadline, so that a hang fails the
test instead of stopping the suite."""
import os
import subprocess
import sys

import pytest

from gpu_common import GPU_MARKS

pytestmark = GPU_MARKS

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks", "suites",
                      "mixed_step.py")
STEPS = 1200


@pytest.mark.parametrize("connections", ["unset", "1", "32"])
def test_many_steps_complete(connections):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if connections != "unset":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    try:
        done = subprocess.run([sys.executable, SCRIPT, "--steps", str(STEPS), "--print-every", "200"],
                              capture_output=True, text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired as hung:
        out = hung.stdout.decode() if isinstance(hung.stdout, bytes) else (hung.stdout or "")
        pytest.fail(f"hung: no exit within 300 s; last output:\n{out[-2000:]}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in done.stdout and "mixed_step PASS" in done.stdout
