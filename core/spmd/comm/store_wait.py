"""Waiting for store keys that may never come, without the C++ client's warning.

``Store.wait`` that runs out of time makes torch's TCPStore client log two
``socket.cpp ... waitForInput ... timed out`` lines on stderr, although the
kernel then raises its own named error. Polling ``check`` with a growing pause
says nothing. The pause grows to at most a tenth of the time already waited
(between 5 ms and 1 s): the wait ends soon after the last key is set, and a
long wait (a rank still loading data) costs the store host about one check per
second per waiting rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

#: Bounds of the longest pause between two checks, in seconds.
MIN_PAUSE_CAP_S, MAX_PAUSE_S = 0.005, 1.0


def missing_keys(store: Any, keys: Sequence[str], limit_s: float, check: Callable[[], None] | None = None) -> list[int]:
    """Wait up to ``limit_s`` for every key of ``keys``; the indices of those still unset then ([] once all are).

    ``check`` runs between two polls and ends the wait by raising (say, once
    the watchdog found the group's ranks out of step: waiting on is futile).
    """
    start = time.monotonic()
    deadline = start + limit_s
    pause = 0.0001
    wanted = list(keys)
    while not store.check(wanted):
        if check is not None:
            check()
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return [i for i, key in enumerate(keys) if not store.check([key])]
        time.sleep(min(pause, left))
        pause = min(pause * 2, max(MIN_PAUSE_CAP_S, 0.1 * (now - start)), MAX_PAUSE_S)
    return []
