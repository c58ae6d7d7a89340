"""TorchWork: a c10d Work that completes from a spmd Work."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from spmd.comm.work import Work


class TorchWork(tdist.Work):
    """The c10d face of a spmd Work: ``wait`` waits natively, ``get_future`` holds the result tensors.

    torch's C++ callers (DDP's reducer, functional collectives) wait on it or on
    its future through pybind11's trampoline, so both go to the spmd Work,
    whose backend drives the transfer. The future's value is the list of
    output tensors, as c10d's own backends give it (DDP's reducer reads it).
    """

    def __init__(self, work: Work | None, result: Sequence[torch.Tensor], after: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._work = work if work is not None else Work.completed()
        self._result = list(result)
        self._after = after
        self._after_ran = after is None
        self._after_lock = threading.Lock()
        self._future: torch.futures.Future | None = None

    def _run_after(self) -> None:
        """The step after the transfer (unpacking a list), once, in whichever thread gets here first."""
        with self._after_lock:
            if self._after_ran:
                return
            self._after_ran = True
        assert self._after is not None
        self._after()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Wait for the spmd Work (its group timeout when ``timeout`` is None or zero, c10d's "none")."""
        limit = None if timeout is None or _seconds(timeout) <= 0 else _seconds(timeout)
        self._work.wait(limit)
        self._run_after()
        return True

    def is_completed(self) -> bool:
        """True once the spmd Work finished."""
        return self._work.is_completed()

    def is_success(self) -> bool:
        """True once the spmd Work finished without an error."""
        return self._work.is_completed() and self._work.exception() is None

    def exception(self) -> Any:
        """The spmd Work's error, or None."""
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        """The output tensors, after waiting."""
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Nothing to order on CPU streams: a no-op, as for c10d's future-backed Works."""

    def get_future(self) -> torch.futures.Future:
        """A torch Future that completes with the output tensors, or fails with the spmd Work's error.

        The error must reach C++ as a failed future: Python's ``Future.set_exception`` stores the
        exception as the future's *value*, which DDP's reducer unpacks as its tensors (a SIGSEGV
        when a peer died). A ``then`` whose callback raises fails its future in C++, so callers
        there get an exception from ``value()``.
        """
        if self._future is None:
            future: torch.futures.Future = torch.futures.Future()

            def forward(work: Work) -> None:
                error = work.exception()
                if error is None:
                    try:
                        self._run_after()
                    except BaseException as failure:  # noqa: BLE001 - delivered to the future
                        error = failure
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(self._result)

            self._future = future.then(_unwrap)
            self._work.add_done_callback(forward)
        return self._future


def _unwrap(future: torch.futures.Future) -> Any:
    """The value of a finished future; raises its error (so that the ``then`` future fails in C++)."""
    return future.value()


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
