"""The in-process rendezvous (xla_ffi/runtime/registry.h) checks who arrives at one key, through the
extension's test-only entry point: ranks of groups of different sizes under one key (two calls
sharing an op id) are an error naming both sizes, never an index past the first arrival's slot."""
import threading
import time

import pytest

from ficco_jax.runtime import extension

pytestmark = pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")


def _arrive_in_thread(**kwargs):
    from ficco_jax import _ffi

    result = {}

    def run():
        try:
            _ffi.testing.rendezvous_arrive(**kwargs)
            result["ok"] = True
        except RuntimeError as exc:
            result["error"] = str(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


@pytest.mark.parametrize("first, second, second_rank", [(2, 8, 6), (8, 2, 1), (4, 5, 4)])
def test_ranks_of_groups_of_different_sizes_at_one_key_are_an_error(first, second, second_rank):
    run_id, op_id = 7_000_000 + first * 100 + second, 3_000_000_000 + first * 100 + second
    waiting, waiting_result = _arrive_in_thread(run_id=run_id, op_id=op_id, group_size=first, rank=0, timeout_s=1.0)
    time.sleep(0.2)  # the first arrival sizes the slot
    late, late_result = _arrive_in_thread(run_id=run_id, op_id=op_id, group_size=second, rank=second_rank,
                                          timeout_s=1.0)
    late.join(10)
    waiting.join(10)
    message = late_result.get("error", "")
    assert f"a group of {first} devices" in message and f"to a group of {second}" in message, late_result
    assert "share an op id" in message, message
    # The first arrival's group never completed: it times out naming its missing ranks.
    assert "missing ranks" in waiting_result.get("error", ""), waiting_result


def test_a_group_that_arrives_whole_meets():
    """The check lets a consistent group through (the test above would pass on a rendezvous that
    refused everything)."""
    threads = [_arrive_in_thread(run_id=11, op_id=3_100_000_000, group_size=3, rank=r, timeout_s=5.0)
               for r in range(3)]
    for thread, _ in threads:
        thread.join(10)
    assert all(result.get("ok") for _, result in threads), [result for _, result in threads]
