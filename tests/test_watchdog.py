"""The watchdog: a copy-engine call whose wait cannot complete is reported on stderr — op, where it
was written, schedule, device, rank, and the peer event or channel word it waits for — and the process ends; a
healthy program is never reported. The stalls are injected ("stall:<rank>", the extension's
test-only inject_fault: the events that rank records on XLA's stream never complete) in a child
process, since the watchdog ends it.
tests/gpu/test_watchdog_gpu.py runs the same program on GPUs."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ficco_jax import config
from ficco_jax.lowering.dma import registry
from ficco_jax.runtime import extension as _ext

pytestmark = pytest.mark.skipif(not _ext.available(), reason="ficco_jax._ffi is not built")

PROGRAM = os.path.join(os.path.dirname(__file__), "watchdog_program.py")
WATCHDOG_S = 1.0
#: The most a report may take: the watchdog's limit, the program's start (import, compile) and slack.
DEADLINE_S = 90


def run_program(op, schedule, *extra, fault="stall:1", watchdog_s=WATCHDOG_S, devices=4, timeout=DEADLINE_S,
                channel_bytes=None):
    env = {**os.environ, "FICCO_WATCHDOG_S": str(watchdog_s),
           "FICCO_RENDEZVOUS_TIMEOUT_S": "120"}  # the host meetings must not end the stall first
    if channel_bytes is not None:
        env["FICCO_CHANNEL_BYTES"] = str(channel_bytes)
    start = time.monotonic()
    done = subprocess.run([sys.executable, PROGRAM, op, schedule, "--fault", fault, "--cpu", "--devices", str(devices),
                           *extra],
                          capture_output=True, text=True, env=env, timeout=timeout)
    return done, time.monotonic() - start


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("op, schedule, target, channel", [
    ("ag_matmul", "dma/direct/c2", "ficco_ag_matmul", False),
    ("ag_matmul", "dma/ring/c4/grouped", "ficco_ag_matmul", False),
    ("matmul_rs", "dma/direct/c2/grouped/s2", "ficco_matmul_rs", True),  # on the group's channel
    ("matmul_rs", "dma/direct/c2/grouped/s2", "ficco_matmul_rs", False),
    ("matmul_rs", "dma/direct/c2/push", "ficco_matmul_rs", False),  # pushes always meet
    ("all_gather", "dma/direct/c1", "ficco_all_gather", False),
    ("overlap", "dma/direct/c2", "ficco_ag_matmul", False),
])
def test_a_stalled_peer_is_reported_and_ends_the_process(op, schedule, target, channel):
    done, _ = run_program(op, schedule, channel_bytes=8 << 20 if channel else None)
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-3000:])
    assert "calling" in done.stdout and "result" not in done.stdout
    err = done.stderr
    head = re.search(r"ficco_jax watchdog: op \d+ \((\w+)\), (\S+), on device (\d+): rank (\d+) of group "
                     r"\[0, 1, 2, 3\], written at \S*watchdog_program\.py:(\d+)\S* \([^)]+\), started [\d.]+ s ago", err)
    assert head, err[-3000:]
    assert head.group(1) == target and head.group(2) == schedule
    if op == "overlap":  # a rewritten site is named by the line of the collective it replaced
        with open(PROGRAM) as fh:
            line = next(i for i, text in enumerate(fh, 1) if "the site overlap rewrites" in text)
        assert int(head.group(5)) == line, (line, head.group(0))
    # What the ranks wait for of the stalled rank is named: its event, by rank, device and phase, or
    # on the group's channel its word, with the value awaited and the value it holds.
    if channel:
        assert re.search(r"waits for rank 1 \(device 1\): its 'ready' word 0 of the group's channel to reach "
                         r"(\d+), it holds (\d+)", err), err
        # Each reader names only the words of rank 1's send slot for it: slot s = reader - 2 (mod 4),
        # 2 chunks per slot, so words 2s and 2s + 1; the other slots' words are for the other readers.
        named = {}
        for block in re.split(r"\n  op \d+ ", err)[1:]:
            reader = int(re.search(r"rank (\d+) of group", block).group(1))
            named[reader] = sorted(int(w) for w in re.findall(r"rank 1 \(device 1\): its 'ready' word (\d+)", block))
        assert named and all(words == [2 * ((r - 2) % 4), 2 * ((r - 2) % 4) + 1] for r, words in named.items()), named
    else:
        assert re.search(r"waits for rank 1 \(device 1\): event \d+ of its 'exchange' post, not complete", err), err
    assert "ending the process" in err and "FICCO_WATCHDOG_S" in err


@pytest.mark.slow
@pytest.mark.parametrize("op, schedule", [("ag_matmul", "dma/direct/c2/symmetric"),
                                          ("matmul_rs", "dma/direct/c1/s2/symmetric")])
def test_a_stalled_peer_of_a_symmetric_site_is_reported(op, schedule):
    """A symmetric call registers nothing per call (a command buffer may replay it without its
    handler): the watchdog reads the counters its devices post as its calls start and end, and names
    the site whose call started and did not finish, with every rank's counts of it in this process."""
    done, _ = run_program(op, schedule)
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-3000:])
    err = done.stderr
    head = re.search(r"ficco_jax watchdog: op \d+ \((\w+)\), (\S+), on device (\d+): rank (\d+) of group "
                     r"\[0, 1, 2, 3\], written at \S*watchdog_program\.py:\d+\S* \([^)]+\): its call (\d+) started "
                     r"[\d.]+ s ago and has not finished", err)
    assert head, err[-3000:]
    assert head.group(1) == f"ficco_{op}" and head.group(2) == schedule
    assert "Symmetric sites of this process with a call in flight:" in err, err
    # The stalled rank's device never reaches the call its peers are in: its counts say so, once.
    call = int(head.group(5))
    assert len(re.findall(rf"rank 1 \(device 1\): started call {call - 1}, finished {call - 1}; has not started "
                          rf"call {call}, which its peers are in", err)) == 1, err
    assert len(re.findall(rf"rank [023] \(device [023]\): started call {call}, finished {call - 1}; waits for its "
                          rf"peers' counters of that call", err)) == 3, err
    assert "ending the process" in err


@pytest.mark.slow
def test_the_report_comes_after_the_limit_not_before():
    """The limit counts from the start of the call's device work: with a 6 s limit the report
    cannot come before 6 s (nor much after: it ends the process)."""
    done, seconds = run_program("ag_matmul", "dma/direct/c2", watchdog_s=6.0)
    assert done.returncode == -signal.SIGABRT, done.stderr[-2000:]
    started = re.search(r"started ([\d.]+) s ago and has not finished \(limit 6\.0 s", done.stderr)
    assert started and 6.0 <= float(started.group(1)) < 6.0 + 5.0, done.stderr[-2000:]
    assert seconds >= 6.0


@pytest.mark.slow
def test_healthy_calls_are_never_reported():
    """Many back-to-back launches with a 1 s limit: every call finishes, nothing is reported."""
    done, _ = run_program("matmul_rs", "dma/direct/c4/grouped", "--calls", "200", fault="")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "watchdog" not in done.stderr
    assert re.search(r"result -?[\d.e+-]+", done.stdout)


@pytest.mark.slow
def test_watchdog_off_waits_instead_of_reporting():
    """FICCO_WATCHDOG_S=0: the stalled call waits (here until this test stops it), with no report:
    the program reached the call, and well past the 1 s limit of the other tests it still waits."""
    env = {**os.environ, "FICCO_WATCHDOG_S": "0", "FICCO_RENDEZVOUS_TIMEOUT_S": "120"}
    child = subprocess.Popen([sys.executable, PROGRAM, "ag_matmul", "dma/direct/c2", "--fault", "stall:1", "--cpu",
                              "--devices", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and "calling" not in (child.stdout.readline() or "calling"):
            pass
        assert child.poll() is None, "the program ended before its stalled call"
        time.sleep(5 * WATCHDOG_S)
        assert child.poll() is None, "the stalled call did not wait"
    finally:
        child.kill()
        out, err = child.communicate()
    assert "result" not in out and "watchdog" not in err, err[-2000:]


@pytest.mark.slow
def test_a_failing_call_writes_its_error_to_stderr():
    """A call that fails says so on stderr at once, besides the exception JAX raises later (which a
    peer stuck in one of XLA's own collectives could keep from ever coming)."""
    done, _ = run_program("ag_matmul", "dma/direct/c2", fault="fail:2")
    assert done.returncode != 0
    assert re.search(r"ficco_jax: op \d+ \(ficco_ag_matmul\) on device 2: injected fault 'fail' on rank 2",
                     done.stderr), done.stderr[-2000:]


@pytest.mark.parametrize("name,value,attribute", [
    ("WATCHDOG_S", -1.0, "watchdog_ms"), ("WATCHDOG_S", float("nan"), "watchdog_ms"),
    ("RENDEZVOUS_TIMEOUT_S", -1.0, "timeout_ms"), ("RENDEZVOUS_TIMEOUT_S", 0.0, "timeout_ms"),
    ("RENDEZVOUS_TIMEOUT_S", float("nan"), "timeout_ms"), ("RENDEZVOUS_TIMEOUT_S", 1e12, "timeout_ms"),
])
def test_a_limit_out_of_range_is_refused_by_name(monkeypatch, name, value, attribute):
    """Refused in Python, naming the setting (the executor would only say "bad schedule attributes",
    or, for a huge timeout, overflow its clock into one already past)."""
    monkeypatch.setattr(config, name, value)
    with pytest.raises(ValueError, match=rf"config.{name}={value!r} must be from "):
        getattr(registry, attribute)()


@pytest.mark.parametrize("seconds,ms", [(0.0, 0), (0.0004, 1), (0.0016, 2), (60.0, 60000)])
def test_a_positive_watchdog_under_a_millisecond_still_watches(monkeypatch, seconds, ms):
    """The executor reads 0 ms as no watchdog: a positive setting never rounds down to it."""
    monkeypatch.setattr(config, "WATCHDOG_S", seconds)
    assert registry.watchdog_ms() == ms


def test_the_site_names_the_users_line_and_the_rewrite_names_the_collective():
    assert registry.current_site().startswith("test_watchdog.py:")
    with registry.site_label("model.py:12 (mlp)"):
        assert registry.current_site() == "model.py:12 (mlp)"
    assert registry.current_site().startswith("test_watchdog.py:")
