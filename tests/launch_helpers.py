"""Helpers shared by the `spmd run` tests (agent, output forwarding, end-to-end runs)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds; an AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
