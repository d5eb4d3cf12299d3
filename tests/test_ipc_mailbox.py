"""The host mailbox (xla_ffi/runtime/ipc_mailbox.h) between real processes, on CPU.

Groups across processes of one host meet there once per call phase; on GPUs the posts carry
CUDA IPC ids (not testable here), but the protocol itself is integers in /dev/shm: these tests
run it across processes with origin-coded posts (rank * 1000 + post), ranks at uneven speeds,
and a missing rank (an error naming it, within the timeout, and at once for a late arrival).

    python tests/test_ipc_mailbox.py JOB RANK N POSTS [MEMBERS] [TIMEOUT_S]  (one rank; prints JSON)
"""
import json
import os
import random
import secrets
import subprocess
import sys
import time

import pytest

from ficco_jax.runtime import extension

if extension.available():
    from ficco_jax import _ffi

# Only an install made without the extension skips (tests/conftest.py); a build without the
# test-only entry points fails here, naming what is missing.
pytestmark = pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")

#: Seconds every worker gets in all.
WORKER_TIMEOUT_S = 120


def _post(rank: int, k: int, member: int):
    """What rank `rank` (global member id `member`) posts as its k-th post: every field says who and
    when, so a post of another group, another rank or another round shows."""
    return dict(op_id=k, signature=[member, rank, k, rank * 1000 + k], buffer_export=member * 10**6 + rank * 1000 + k,
                buffer_offset=7 * k + rank + 100 * member, event_ids=[member, rank, k, rank + k])


def _assert_posts(res, members, posts):
    """Worker result `res` saw, in every round, exactly its own group's posts of that round."""
    assert not res["errors"], res["errors"]
    assert len(res["seen"]) == posts
    for k, got in enumerate(res["seen"]):
        for r, (op_id, signature, buffer_export, buffer_offset, event_ids) in enumerate(got):
            want = _post(r, k, members[r])
            assert (op_id, signature, buffer_export, buffer_offset, event_ids) == (
                want["op_id"], want["signature"], want["buffer_export"], want["buffer_offset"],
                want["event_ids"]), (res["rank"], k, r)


def _worker(job: int, rank: int, n: int, posts: int, members, timeout_s: float) -> dict:
    rng = random.Random(rank)
    seen, errors = [], []
    for k in range(posts):
        if rng.random() < 0.2:  # uneven speeds: some ranks run ahead by a post, others lag
            time.sleep(rng.random() * 2e-3)
        p = _post(rank, k, members[rank])
        start = time.monotonic()
        try:
            got = _ffi.testing.mailbox_exchange(job, members, rank, p["op_id"], p["signature"], p["buffer_export"],
                                                p["buffer_offset"], p["event_ids"], timeout_s)
        except RuntimeError as exc:
            errors.append({"post": k, "message": str(exc), "after_s": time.monotonic() - start})
            break
        seen.append([list(map(lambda v: list(v) if isinstance(v, (list, tuple)) else v, g)) for g in got])
    return {"rank": rank, "seen": seen, "errors": errors}


def _launch(job, ranks, n, posts, members, timeout_s):
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(job), str(r), str(n), str(posts),
                               ",".join(map(str, members)), str(timeout_s)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ranks]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=WORKER_TIMEOUT_S)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


@pytest.fixture
def job():
    job = secrets.randbits(62) | 1
    yield job
    name = _ffi.mailbox_name(job)
    try:
        os.unlink("/dev/shm" + name)
    except FileNotFoundError:
        pass


def test_every_rank_sees_every_post_of_its_group_in_order(job):
    n, posts = 4, 300
    members = [100 + 3 * r for r in range(n)]  # member ids are global device ids, any ints
    for res in _launch(job, range(n), n, posts, members, 30.0):
        _assert_posts(res, members, posts)


@pytest.mark.slow
def test_a_missing_rank_is_named_within_the_timeout_and_a_late_one_fails_at_once(job):
    n, timeout_s = 3, 1.0
    members = [0, 1, 2]
    start = time.monotonic()
    waiting = _launch(job, [0, 1], n, 1, members, timeout_s)  # rank 2 never comes
    for res in waiting:
        (error,) = res["errors"]
        assert "rendezvous" in error["message"] and "missing ranks [2]" in error["message"], error
        assert "group of devices [0, 1, 2] across processes" in error["message"], error
        assert "op 0 (mailbox_test) phase test" in error["message"], error
        assert "FICCO_RENDEZVOUS_TIMEOUT_S" in error["message"] or "gave up" in error["message"], error
        assert error["after_s"] < timeout_s + 5.0, error
    assert time.monotonic() - start < WORKER_TIMEOUT_S
    (late,) = _launch(job, [2], n, 1, members, 30.0)  # arrives after the group gave up
    (error,) = late["errors"]
    assert "already gave up" in error["message"] and error["after_s"] < 5.0, error


@pytest.mark.slow
def test_two_groups_of_one_job_do_not_mix(job):
    """Groups [0, 1] and [2, 3] post concurrently in one segment; each sees only its own."""
    posts = 50
    procs = []
    for members in ([10, 11], [12, 13]):
        for rank in range(2):
            procs.append((members, rank, subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(job), str(rank), "2", str(posts),
                 ",".join(map(str, members)), "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for members, rank, p in procs:
        out, err = p.communicate(timeout=WORKER_TIMEOUT_S)
        assert p.returncode == 0, err[-3000:]
        _assert_posts(json.loads(out.strip().splitlines()[-1]), members, posts)



_STAGING_PROBE = """
import json
from ficco_jax import _ffi
try:
    print(json.dumps({"info": dict(_ffi.ipc_describe_staging(0, 1 << 20))}))
except RuntimeError as exc:
    print(json.dumps({"error": str(exc)}))
print(json.dumps({"stats": [dict(d) for d in _ffi.ipc_stats()]}))
"""


@pytest.mark.slow
def test_the_staging_buffer_without_a_gpu_is_an_error_not_a_crash():
    """ipc.staging_info() (the first step of benchmarks/suites/multiprocess.py) on a machine without a usable GPU:
    a RuntimeError naming the call, in a process that goes on (the GPU run's processes died
    formatting an error; this path formats one too)."""
    p = subprocess.run([sys.executable, "-c", _STAGING_PROBE], capture_output=True, text=True,
                       timeout=WORKER_TIMEOUT_S, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(line) for line in p.stdout.strip().splitlines()]
    assert "error" in lines[0], lines[0]  # no GPU visible: no staging buffer
    error = lines[0]["error"]
    assert "ipc_describe_staging" in error, error
    assert "CUDA build" in error or "cudaSetDevice" in error or "cuda" in error.lower(), error
    assert lines[1] == {"stats": []}  # nothing was allocated or exported


if __name__ == "__main__":
    job_, rank_, n_, posts_ = (int(a) for a in sys.argv[1:5])
    members_ = [int(m) for m in sys.argv[5].split(",")] if len(sys.argv) > 5 else list(range(n_))
    timeout_ = float(sys.argv[6]) if len(sys.argv) > 6 else 30.0
    print(json.dumps(_worker(job_, rank_, n_, posts_, members_, timeout_)))
