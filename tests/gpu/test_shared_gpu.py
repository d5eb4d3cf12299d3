"""Two processes that share one GPU form a 2-device group (tests/gpu/shared_gpu_worker.py): every
copy-engine call crosses processes through CUDA IPC and the host mailbox, pulled and on symmetric
sites, and a chain of symmetric sites runs inside XLA's command buffers. One GPU is enough, so a
single-GPU machine runs the cross-process executor for real; the test skips without a GPU."""
import json
import os
import socket
import subprocess
import sys

from gpu_common import GPUS, ONE_GPU_MARKS

pytestmark = ONE_GPU_MARKS

WORKER = os.path.join(os.path.dirname(__file__), "shared_gpu_worker.py")
#: Seconds for both processes: two compiles of every program, then 10 calls each.
LIMIT_S = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_on_one_gpu(tmp_path):
    port = _free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(GPUS[0].id), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3",
           "FICCO_CROSS_PROCESS_DMA": "1", "FICCO_RENDEZVOUS_TIMEOUT_S": "120", "FICCO_WATCHDOG_S": "120",
           "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(port), str(outs[i])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=LIMIT_S)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(f"a worker did not finish within {LIMIT_S} s:\n" + "\n".join(logs)[-4000:])
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, f"worker {i} exited {proc.returncode}:\n{logs[i][-4000:]}"
    for i, out in enumerate(outs):
        result = json.loads(out.read_text())
        failed = {name: error for name, error in result["checks"].items() if error != "ok"}
        assert not failed, f"worker {i}: {failed}"
        # After the first launches (the warm-up and the recording) the command buffer replays the chain:
        # its 8 calls reach no handler.
        assert min(result["handlers_per_launch"][2:]) < 8, result["handlers_per_launch"]
