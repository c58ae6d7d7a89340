"""Work: the handle of an operation that may still be running."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from spmd.errors import CollectiveError, CollectiveTimeoutError

Timeout = float | timedelta | None


def seconds(timeout: Timeout) -> float | None:
    """Normalise a timeout given as seconds or a timedelta; None means no limit."""
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return timeout


class Work:
    """The handle of an operation: wait for it, poll it, or chain on its future.

    Backends rarely subclass it: ``Work.completed()`` covers operations that
    finished synchronously and ``Work.from_future()`` wraps a
    ``concurrent.futures.Future`` or ``torch.futures.Future``. Subclass only to
    bridge a native handle that has its own timed wait (as spmd-gloo does).

    ``wait()`` with no timeout uses the default the kernel attached (the
    group's timeout), so nothing that goes through the kernel waits forever.
    """

    #: Set by the kernel: the timeout ``wait()`` uses when called without one.
    default_timeout: float | None = None
    #: Set by the kernel: what this Work is, for error messages ("all_reduce on group 'world' #12").
    description: str = "operation"

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Work], None]] = []
        self._lock = threading.Lock()

    # -- constructors -------------------------------------------------------------
    @classmethod
    def completed(cls, value: Any = None) -> Work:
        """A Work that has already finished with ``value``."""
        work = cls()
        work._finish(value, None)
        return work

    @classmethod
    def failed(cls, error: BaseException) -> Work:
        """A Work that has already failed with ``error``."""
        work = cls()
        work._finish(None, error)
        return work

    @classmethod
    def from_future(cls, future: concurrent.futures.Future | torch.futures.Future) -> Work:
        """A Work that completes when ``future`` does (value or exception carried over)."""
        work = cls()
        if isinstance(future, concurrent.futures.Future):

            def on_done(f: concurrent.futures.Future) -> None:
                if f.cancelled():
                    work._finish(None, CollectiveError(f"{work.description} was cancelled"))
                    return
                error = f.exception()
                work._finish(None if error else f.result(), error)

            future.add_done_callback(on_done)
        else:

            def on_torch_done(f: torch.futures.Future) -> None:
                try:
                    work._finish(f.value(), None)
                except BaseException as error:  # noqa: BLE001 - carried to the waiter
                    work._finish(None, error)

            future.add_done_callback(on_torch_done)
        return work

    # -- completion (for subclasses and the kernel) ------------------------------
    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._value, self._error = value, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def _wait_native(self, timeout: float | None) -> bool:
        """Block until done or ``timeout`` seconds pass; return whether it finished."""
        return self._done.wait(timeout)

    # -- public API ---------------------------------------------------------------
    def wait(self, timeout: Timeout = None) -> bool:
        """Block until the operation finishes; raise its error, or CollectiveTimeoutError.

        ``timeout`` is seconds or a timedelta; None means the kernel's default
        for this Work (the group timeout). Returns True, like torch's Work.
        """
        limit = seconds(timeout)
        if limit is None:
            limit = self.default_timeout
        if not self._wait_native(limit):
            raise CollectiveTimeoutError(
                f"{self.description} did not complete within {limit:.1f} s. A peer rank may "
                "have skipped this call, died, or be stuck elsewhere; check that every rank "
                "of the group reaches the same collectives in the same order, or raise the "
                "timeout (spmd.init(timeout=...))"
            )
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the operation finished without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the operation failed with, or None (also None while it runs)."""
        return self._error

    def result(self) -> Any:
        """The value the operation produced (after ``wait``)."""
        self.wait()
        return self._value

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        """Call ``callback(work)`` once the operation finishes (at once if it has)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` that completes with this Work's value or error."""
        future: torch.futures.Future = torch.futures.Future()

        def forward(work: Work) -> None:
            if work._error is not None:
                future.set_exception(work._error)
            else:
                future.set_result(work._value)

        self.add_done_callback(forward)
        return future

    def __repr__(self) -> str:
        state = "pending"
        if self.is_completed():
            state = "failed" if self._error else "completed"
        return f"<Work {self.description} {state}>"


class WorkList(Work):
    """One Work that finishes when all of its parts have (used for batched p2p)."""

    def __init__(self, works: list[Work], value: Any = None) -> None:
        super().__init__()
        self._works = works
        self._final_value = value
        self._remaining = len(works)
        self._count_lock = threading.Lock()
        if not works:
            self._finish(value, None)
        for work in works:
            work.add_done_callback(self._part_done)

    def _part_done(self, work: Work) -> None:
        if work.exception() is not None:
            self._finish(None, work.exception())
            return
        with self._count_lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish(self._final_value, None)
