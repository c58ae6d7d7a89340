"""One way to wait for a condition that another process or thread brings about: poll it, bounded.

``poll`` calls ``check`` until it returns something truthy or the time is up,
and returns its last answer (falsy on timeout), so a caller can raise its own
error or go on; ``wait_until`` raises ``WaitTimeoutError`` naming what was
awaited. ``check`` may raise to end the wait early (a peer gave up, a process
exited). The pause starts at ``interval`` and is multiplied by ``backoff`` up
to ``max_interval``; the last pause is cut to the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from spmd.errors import WaitTimeoutError

T = TypeVar("T")


def poll(check: Callable[[], T], timeout: float, interval: float = 0.05, *, backoff: float = 1.0,
         max_interval: float | None = None) -> T:
    """``check()``'s first truthy answer within ``timeout`` seconds, else its last (falsy) one; it runs at least once."""
    deadline = time.monotonic() + timeout
    pause = interval
    while True:
        value = check()
        left = deadline - time.monotonic()
        if value or left <= 0:
            return value
        time.sleep(min(pause, left))
        pause = pause * backoff if max_interval is None else min(pause * backoff, max_interval)


def wait_until(check: Callable[[], T], timeout: float, interval: float = 0.05, *, what: str, backoff: float = 1.0,
               max_interval: float | None = None) -> T:
    """``check()``'s first truthy answer within ``timeout`` seconds; ``WaitTimeoutError`` naming ``what`` if none came."""
    value = poll(check, timeout, interval, backoff=backoff, max_interval=max_interval)
    if not value:
        raise WaitTimeoutError(f"{what} did not happen within {timeout:g} s (last seen: {value!r}); "
                               "look at the process or thread that should bring it about, or allow more time")
    return value
