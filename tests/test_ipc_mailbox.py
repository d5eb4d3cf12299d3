"""The host mailbox (xla_ffi/runtime/ipc_mailbox.h) between real processes, on CPU.

Groups across processes of one host meet there once per call phase; on GPUs the posts carry
CUDA IPC ids (not testable here), but the protocol itself is integers in /dev/shm: these tests
run it across processes with origin-coded posts (rank * 1000 + post), ranks at uneven speeds,
and a missing rank (an error naming it, within the timeout, and at once for a late arrival).

    python tests/test_ipc_mailbox.py JOB:TOKEN RANK N POSTS [MEMBERS] [TIMEOUT_S] [SKIP] [PHASE_SHIFT]
        (one rank; prints JSON)

Every post carries its tag (op id, phase, the rank's call ordinal, the launch); in these workers
round k is call k + 1 of launch 1000 + k, phase k % 3. SKIP = k: this rank fails round k before
posting (its call ordinal still counts it) and goes on to round k + 1, as a process whose call
failed before meeting does; PHASE_SHIFT = k: its round-k post names the next phase.
"""
import json
import os
import random
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
    # (buffer_export within the table's 1024 ids, event ids within its 2048: a peer's post beyond
    # them is refused as corrupt; the signature carries the full origin.)
    return dict(op_id=k, signature=[member, rank, k, rank * 1000 + k], buffer_export=(rank * 300 + k) % 1024,
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


def _worker(job: str, rank: int, n: int, posts: int, members, timeout_s: float, skip: int = -1,
            phase_shift: int = -1, delay_s: float = 0.0) -> dict:
    # As ipc.register does, without importing jax there (its start-up would skew the ranks' arrival).
    job_text, _, token = job.partition(":")
    job_id = int(job_text)
    _ffi.ipc_register_mailbox(job_id, token, float(os.environ.get("FICCO_CROSS_PROCESS_FIRST_MEETING_S", "0")))
    time.sleep(delay_s)
    rng = random.Random(rank)
    seen, errors = [], []
    for k in range(posts):
        if k == skip:
            continue
        if rng.random() < 0.2:  # uneven speeds: some ranks run ahead by a post, others lag
            time.sleep(rng.random() * 2e-3)
        p = _post(rank, k, members[rank])
        start = time.monotonic()
        try:
            got = _ffi.testing.mailbox_exchange(job_id, members, rank, p["op_id"], p["signature"], p["buffer_export"],
                                                p["buffer_offset"], p["event_ids"], timeout_s,
                                                phase=(k + (k == phase_shift)) % 3, call=k + 1, run_id=1000 + k)
        except RuntimeError as exc:
            errors.append({"post": k, "message": str(exc), "after_s": time.monotonic() - start})
            break
        seen.append([list(map(lambda v: list(v) if isinstance(v, (list, tuple)) else v, g)) for g in got])
    return {"rank": rank, "seen": seen, "errors": errors}


def _launch(job, ranks, n, posts, members, timeout_s, skip=None, phase_shift=None, first_meeting_s=0.0,
            delay=None):
    """Runs `ranks` as processes; skip / phase_shift: {rank: round} (see the module's docstring);
    first_meeting_s: config.CROSS_PROCESS_FIRST_MEETING_S of every rank; delay: {rank: seconds} it
    sleeps before its first post."""
    skip, phase_shift, delay = skip or {}, phase_shift or {}, delay or {}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), job, str(r), str(n), str(posts),
                               ",".join(map(str, members)), str(timeout_s), str(skip.get(r, -1)),
                               str(phase_shift.get(r, -1)), str(delay.get(r, 0.0))],
                              env={**os.environ, "FICCO_CROSS_PROCESS_FIRST_MEETING_S": str(first_meeting_s)},
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
    """A fresh job's proposal "<id>:<token>", as ipc.job_id() agrees on it; its segment removed after."""
    from ficco_jax.runtime import ipc

    job = ipc._propose()
    yield job
    try:
        os.unlink("/dev/shm/ficco_jax_" + job.partition(":")[2])
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
                [sys.executable, os.path.abspath(__file__), job, str(rank), "2", str(posts),
                 ",".join(map(str, members)), "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "FICCO_CROSS_PROCESS_FIRST_MEETING_S": "0"})))
    for members, rank, p in procs:
        out, err = p.communicate(timeout=WORKER_TIMEOUT_S)
        assert p.returncode == 0, err[-3000:]
        _assert_posts(json.loads(out.strip().splitlines()[-1]), members, posts)


def test_a_rank_that_failed_a_call_before_posting_is_never_paired_with_its_peers_previous_call(job):
    """Rank 1 fails round 1 before posting and posts round 2 next. Paired by number alone, its
    round-2 post would be taken for round 1 by its peers, mixing two launches' data; the tags make
    both ranks fail at that post, each naming both tags, and nobody sees a round-2 post in round 1."""
    members = [0, 1]
    res0, res1 = _launch(job, [0, 1], 2, 3, members, 10.0, skip={1: 1})
    for res in (res0, res1):
        assert len(res["seen"]) == 1, res  # round 0 only
        _assert_posts({**res, "errors": []}, members, 1)
        (error,) = res["errors"]
        message = error["message"]
        assert "out of step" in message, message
        assert "call 2 of the group, launch 1001" in message and "call 3 of the group, launch 1002" in message, message
        assert error["after_s"] < 5.0, error  # at once, not after the timeout


def test_a_rank_late_to_its_first_meeting_is_waited_for_a_late_one_later_is_not(job):
    """Processes reach their first call as far apart as their start-up differs: a rank 3 s late with a
    1 s timeout meets its peer at the first post (the first-meeting timeout, 20 s here), and the
    later posts run; the same lateness at a later post is an error naming the rank."""
    start = time.monotonic()
    for res in _launch(job, [0, 1], 2, 3, [0, 1], 1.0, first_meeting_s=20.0, delay={1: 3.0}):
        _assert_posts(res, [0, 1], 3)
    assert time.monotonic() - start < 60


def test_a_post_of_another_phase_is_an_error_naming_both_phases(job):
    """Rank 0's round-1 post names the next phase ('release' where its peer posts 'done'): a
    release read as an exchange would index events it does not carry."""
    res0, res1 = _launch(job, [0, 1], 2, 2, [0, 1], 10.0, phase_shift={0: 1})
    for res in (res0, res1):
        (error,) = res["errors"]
        assert "phase 'done' of call 2" in error["message"] and "phase 'release' of call 2" in error["message"], error


def _exchange_in_child(job: str, timeout_s: float = 5.0):
    """One rank-0 post of a one-member group in a fresh process: the error text, or "" if it ran."""
    code = (f"from ficco_jax import _ffi\njob = int({job!r}.partition(':')[0])\n"
            f"_ffi.ipc_register_mailbox(job, {job!r}.partition(':')[2], 0.0)\n"
            f"try:\n    _ffi.testing.mailbox_exchange(job, [0], 0, 1, [1], -1, 0, [], {timeout_s})\n    print('')\n"
            f"except RuntimeError as exc:\n    print(str(exc).replace(chr(10), ' '))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""


def test_the_mailbox_name_is_a_random_token_not_the_job_id(job):
    from ficco_jax.runtime import ipc

    job_text, _, token = job.partition(":")
    number = ipc.register(job)
    name = _ffi.mailbox_name(number)
    assert name == "/ficco_jax_" + token and len(token) == 32, name
    assert format(number, "x") not in name, name
    with pytest.raises(ValueError, match="already has the segment"):
        ipc.register(f"{job_text}:{'0' * 32}")
    with pytest.raises(ValueError, match="lowercase hex"):
        ipc.register("5:not-a-token")
    assert _exchange_in_child(ipc._propose()) == ""  # registered, created, used
    unregistered = _ffi.testing.mailbox_exchange  # a job nobody registered: an error, no segment
    with pytest.raises(RuntimeError, match="no host mailbox is registered for job 12345"):
        unregistered(12345, [0], 0, 1, [1], -1, 0, [], 1.0)


@pytest.mark.parametrize("made_by", ["this user, mode 0644", "another user"])
def test_a_segment_someone_else_made_is_refused(job, made_by):
    """A segment that exists under the job's name before the job makes it is used only if it is this
    user's with mode 0600 (then a peer of the job made it): a pre-created one could feed IPC handles
    and pointers to every process of the job."""
    path = "/dev/shm/ficco_jax_" + job.partition(":")[2]
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.fchmod(fd, 0o644)
    if made_by == "another user":
        if os.geteuid() != 0:
            os.close(fd)
            pytest.skip("making a segment owned by another user needs root")
        os.fchmod(fd, 0o600)
        os.fchown(fd, 65534, 65534)
    os.close(fd)
    message = _exchange_in_child(job)
    assert "host mailbox /ficco_jax_" in message and "expected uid" in message and "mode 0600" in message, message
    assert ("mode 0644" in message) if made_by.endswith("0644") else ("owned by uid 65534" in message), message


def test_a_segment_whose_creator_never_finished_is_an_error_not_a_hang(job):
    """This user's segment, mode 0600, never sized or given its header (its creator died at once)."""
    path = "/dev/shm/ficco_jax_" + job.partition(":")[2]
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    start = time.monotonic()
    message = _exchange_in_child(job)
    assert "creator died" in message and time.monotonic() - start < 30, message


@pytest.mark.parametrize("field, value, named", [
    ("num_events", 10**6, "num_events = 1000000; expected 0 to 128"),
    ("signature_len", -1, "signature_len = -1; expected 0 to 16"),
    ("buffer_export", 5000, "buffer_export = 5000; expected -1 to 1023"),
    ("buffer_offset", -8, "buffer_offset = -8; expected >= 0"),
    ("buffer_bytes", -1, "buffer_bytes = -1"),
])
def test_a_corrupt_post_is_refused_before_anything_in_it_is_used(job, field, value, named):
    """Rank 1's post written straight into the segment, as another process could, with one field out
    of range: rank 0 fails naming the field, the value and the range, instead of indexing with it."""
    import mmap
    import struct

    layout = dict(_ffi.testing.mailbox_layout())
    formats = {"num_events": "<i", "signature_len": "<q", "buffer_export": "<q", "buffer_offset": "<q",
               "buffer_bytes": "<q", "op_id": "<q", "phase": "<i", "call": "<Q", "run_id": "<q", "posted": "<Q"}
    worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), job, "0", "2", "1", "0,1", "20"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "FICCO_CROSS_PROCESS_FIRST_MEETING_S": "0"})
    path = "/dev/shm/ficco_jax_" + job.partition(":")[2]
    deadline = time.monotonic() + 60
    while not (os.path.exists(path) and os.path.getsize(path) > layout["rank_box"]):
        assert time.monotonic() < deadline and worker.poll() is None, "rank 0 never made the segment"
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 has claimed group entry 0 and waits for rank 1's post 1
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as shm:
        box = layout["rank_box"]
        post = box + layout["data1"]
        # The tag of rank 0's round 0 (call 1, launch 1000, phase 0, op 0): only the field differs.
        fields = {"op_id": 0, "phase": 0, "call": 1, "run_id": 1000, "signature_len": 4, "buffer_export": 1,
                  "buffer_offset": 0, "buffer_bytes": 0, "num_events": 4, field: value}
        for name, v in fields.items():
            struct.pack_into(formats[name], shm, post + layout[name], v)
        struct.pack_into(formats["posted"], shm, box + layout["posted"], 1)
    out, err = worker.communicate(timeout=WORKER_TIMEOUT_S)
    assert worker.returncode == 0, err[-3000:]
    (error,) = json.loads(out.strip().splitlines()[-1])["errors"]
    assert named in error["message"] and "rank 1 of group [0, 1]" in error["message"], error


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
    job_ = sys.argv[1]
    rank_, n_, posts_ = (int(a) for a in sys.argv[2:5])
    members_ = [int(m) for m in sys.argv[5].split(",")] if len(sys.argv) > 5 else list(range(n_))
    timeout_ = float(sys.argv[6]) if len(sys.argv) > 6 else 30.0
    skip_ = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    shift_ = int(sys.argv[8]) if len(sys.argv) > 8 else -1
    delay_ = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0
    print(json.dumps(_worker(job_, rank_, n_, posts_, members_, timeout_, skip_, shift_, delay_)))
