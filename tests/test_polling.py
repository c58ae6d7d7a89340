"""spmd.polling: bounded polling for a condition another thread brings about."""

from __future__ import annotations

import threading
import time

import pytest

from spmd.errors import WaitTimeoutError
from spmd.polling import poll, wait_until


def test_poll_returns_the_first_truthy_answer_as_soon_as_another_thread_sets_it():
    box: list[str] = []
    setter = threading.Timer(0.1, box.append, ("set",))
    start = time.monotonic()
    setter.start()
    assert poll(lambda: box[:1], timeout=5.0, interval=0.01) == ["set"]
    assert time.monotonic() - start < 2.0  # not the timeout
    setter.join()


def test_poll_returns_the_last_falsy_answer_at_the_deadline_after_checking_there():
    calls: list[float] = []

    def never() -> int:
        calls.append(time.monotonic())
        return 0

    start = time.monotonic()
    assert poll(never, timeout=0.3, interval=0.05) == 0
    assert 0.3 <= calls[-1] - start < 1.0 and len(calls) >= 3


def test_poll_checks_once_with_no_time_left():
    calls = []
    assert poll(lambda: calls.append(1), timeout=0) is None and calls == [1]


def test_the_pause_grows_by_the_backoff_up_to_its_cap():
    times: list[float] = []
    poll(lambda: times.append(time.monotonic()), timeout=0.6, interval=0.02, backoff=2, max_interval=0.08)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps[1] >= gaps[0] * 1.5  # grows
    assert max(gaps) < 0.08 + 0.05  # and stops at the cap (plus scheduling slack)


def test_wait_until_names_what_did_not_happen():
    with pytest.raises(WaitTimeoutError, match="the answer did not happen within 0.1 s"):
        wait_until(lambda: None, 0.1, 0.02, what="the answer")


def test_a_check_that_raises_ends_the_wait():
    def gone() -> bool:
        raise RuntimeError("the peer exited")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the peer exited"):
        poll(gone, timeout=5.0)
    assert time.monotonic() - start < 1.0
