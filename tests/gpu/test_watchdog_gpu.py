"""The watchdog on GPUs: a peer whose events never complete and whose channel words are never set
(the injected fault "stall:1") leaves the other GPU's streams waiting; the watchdog names the op,
schedule, device, rank and that event or word on stderr and ends the process instead of letting it
hang. The same program as
tests/test_watchdog.py, on every visible GPU (one child process each case)."""
import os
import re
import signal
import subprocess
import sys

import pytest

from gpu_common import GPU_MARKS, GPUS

pytestmark = GPU_MARKS

PROGRAM = os.path.join(os.path.dirname(os.path.dirname(__file__)), "watchdog_program.py")


@pytest.mark.parametrize("op, schedule, channel", [("ag_matmul", "dma/direct/c2", False),
                                                   ("matmul_rs", "dma/direct/c2/grouped", False),
                                                   ("matmul_rs", "dma/direct/c2/grouped", True),
                                                   ("ag_matmul", "dma/direct/c1/push", False)])
def test_a_stalled_peer_is_reported_and_ends_the_process(op, schedule, channel):
    env = {**os.environ, "FICCO_WATCHDOG_S": "3", "FICCO_RENDEZVOUS_TIMEOUT_S": "120",
           "FICCO_CHANNEL_BYTES": str(8 << 20 if channel else 0)}
    done = subprocess.run([sys.executable, PROGRAM, op, schedule, "--fault", "stall:1", "--devices", str(len(GPUS))],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-3000:])
    assert "result" not in done.stdout
    assert re.search(rf"ficco_jax watchdog: op \d+ \(ficco_{op}\), {re.escape(schedule)}, on device \d+: rank \d+ "
                     r"of group \[[\d, ]+\], written at watchdog_program\.py:\d+", done.stderr), done.stderr[-3000:]
    # On the group's channel the ranks wait for a word of the stalled rank; a call that meets, its event.
    waited = (r"its 'ready' word 0 of the group's channel to reach \d+, it holds \d+" if channel
              else r"event \d+ of its 'exchange' post, not complete")
    assert re.search(r"waits for rank 1 \(device \d+\): " + waited, done.stderr), done.stderr[-3000:]
