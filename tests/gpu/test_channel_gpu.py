"""Group channels on GPUs (xla_ffi/runtime/channel.h): programs with two copy-engine calls, at least
one on its group's channel, run to the end and equal the plain path, with their matmul plans timed
during the launch (cold) or before it (warm), and with one hardware queue per device
(CUDA_DEVICE_MAX_CONNECTIONS=1) or the default. Each case is a child process (tests/channel_program.py)
under the watchdog, so a stop ends it with a report instead of hanging the suite."""
import os
import subprocess
import sys

import pytest

from gpu_common import GPU_MARKS

pytestmark = GPU_MARKS

PROGRAM = os.path.join(os.path.dirname(os.path.dirname(__file__)), "channel_program.py")


@pytest.mark.parametrize("mode", ["cold", "warm"])
@pytest.mark.parametrize("connections", [None, "1"])
def test_channel_calls_in_one_program_run_to_the_end(mode, connections):
    env = {**os.environ, "FICCO_CHANNEL_BYTES": str(8 << 20), "FICCO_WATCHDOG_S": "15"}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if connections is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    done = subprocess.run([sys.executable, PROGRAM, mode], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "PASS" in done.stdout, (done.returncode, done.stdout[-1500:], done.stderr[-3000:])
