"""Waiting for store keys that may never come, without the C++ client's warning.

``Store.wait`` that runs out of time makes torch's TCPStore client log two
``socket.cpp ... waitForInput ... timed out`` lines on stderr, although the
kernel then raises its own named error. Polling ``check`` with a growing pause
says nothing; the pause stays short (<= 5 ms), so a wait ends soon after the last key is set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

#: The longest pause between two checks, in seconds.
MAX_PAUSE_S = 0.005


def missing_keys(store: Any, keys: Sequence[str], limit_s: float) -> list[int]:
    """Wait up to ``limit_s`` for every key of ``keys``; the indices of those still unset then ([] once all are)."""
    deadline = time.monotonic() + limit_s
    pause = 0.0001
    while not store.check(list(keys)):
        left = deadline - time.monotonic()
        if left <= 0:
            return [i for i, key in enumerate(keys) if not store.check([key])]
        time.sleep(min(pause, left))
        pause = min(pause * 2, MAX_PAUSE_S)
    return []
