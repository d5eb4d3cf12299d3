"""Two processes that share one GPU form a 2-device group (tests/gpu/shared_gpu_worker.py): every
copy-engine call crosses processes through CUDA IPC and the host mailbox, pulled and on symmetric
sites, programs jitted once run under both device orders of the group (each must give its own
order's result: the group's devices come from the run), and a chain of symmetric sites runs inside
XLA's command buffers; and a process that ends a
launch early is stopped by the launch check, not paired with its peer's next launch. One GPU is
enough, so a single-GPU machine runs the cross-process executor for real; the tests skip without a
GPU."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from gpu_common import GPUS, ONE_GPU_MARKS

pytestmark = ONE_GPU_MARKS

WORKER = os.path.join(os.path.dirname(__file__), "shared_gpu_worker.py")
#: Seconds for both processes: two compiles of every program, then 10 calls each.
LIMIT_S = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(GPUS[0].id), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3",
            "FICCO_CROSS_PROCESS_DMA": "1", "FICCO_RENDEZVOUS_TIMEOUT_S": "120", "FICCO_WATCHDOG_S": "120",
            "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", **extra}


def _run_pair(args, env) -> tuple[list, list]:
    """Both workers with `args` after their process id and port: (their exit codes, their output)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(port), *args(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=LIMIT_S)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(f"a worker did not finish within {LIMIT_S} s:\n" + "\n".join(logs)[-4000:])
    return [proc.returncode for proc in procs], logs


def test_two_processes_on_one_gpu(tmp_path):
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    codes, logs = _run_pair(lambda i: [str(outs[i])], _env())
    for i, code in enumerate(codes):
        assert code == 0, f"worker {i} exited {code}:\n{logs[i][-4000:]}"
    for i, out in enumerate(outs):
        result = json.loads(out.read_text())
        failed = {name: error for name, error in result["checks"].items() if error != "ok"}
        assert not failed, f"worker {i}: {failed}"
        # After the first launches (the warm-up and the recording) the command buffer replays the chain:
        # its 8 calls reach no handler.
        assert min(result["handlers_per_launch"][2:]) < 8, result["handlers_per_launch"]


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_a_launch_left_early_is_reported_never_paired_with_the_next(op):
    """Process 1 ends a launch before its symmetric call (a fault), then runs on: its next launch's
    call would take process 0's data of the launch it left, and give process 0 its own. The launch
    check stops both calls (a reduce-scatter's in its sum's kernel); each process's watchdog reports
    both launches at once and ends it, and no launch after the fault returns. Command buffers off, so
    that the fault's handler runs."""
    env = _env(FICCO_WATCHDOG_S="60", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=")
    codes, logs = _run_pair(lambda i: ["--left-early", op], env)
    assert "[p1] left a launch early: True" in logs[1], logs[1][-4000:]
    for i in range(2):
        assert f"[p{i}] three launches agreed" in logs[i], logs[i][-4000:]
        assert "RETURNED" not in logs[i], logs[i][-4000:]
        assert codes[i] != 0, logs[i][-4000:]
        assert re.search(r"ficco_jax watchdog: .*its call \d+ runs in launch \d+, but rank \d \(device \d\) sent "
                         r"its data of that call in launch \d+: a launch ended early", logs[i]), logs[i][-4000:]
