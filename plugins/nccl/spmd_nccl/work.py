"""NcclWork: the Work of one NCCL op, completed through a CUDA event on the communicator's stream.

Every op runs on the communicator's internal stream, which first waits on the
caller's current stream. The op's Work records a CUDA event there. ``wait()``
makes the caller's current stream wait on that event (no CPU block, like
torch's ProcessGroupNCCL); ``wait(timeout)`` and ``is_completed()`` query the
event. The tensors stay referenced until the event has completed, so the
caching allocator cannot hand their memory to someone else while NCCL still
uses it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from spmd.comm.work import Work, timeout_error
from spmd_nccl.cuda import allow_queries_during_other_threads_captures, in_background_thread

if TYPE_CHECKING:
    from spmd_nccl.communicator import Communicator


class NcclWork(Work):
    """A Work over a CUDA event on the communicator's stream.

    ``wait()`` makes the caller's current stream wait on the event and returns at
    once; ``wait(timeout)`` blocks the CPU until the event completes (aborting the
    communicator at the timeout); ``is_completed()`` queries the event. A queued
    point-to-point op has no event until it is flushed; waiting flushes it.
    """

    def __init__(self, comm: Communicator, keep_alive: object, cpu_wait: bool = False) -> None:
        super().__init__()
        self._comm = comm
        self._keep_alive = keep_alive
        self._cpu_wait = cpu_wait  # barrier: wait() blocks the CPU (with the group timeout)
        self._cuda_event: torch.cuda.Event | None = None
        self._captured = False
        self._issued_at = 0.0

    # -- called by the communicator -------------------------------------------------------
    def _issued(self, event: torch.cuda.Event, captured: bool) -> None:
        self._issued_at = time.monotonic()
        self._captured = captured
        if captured:
            self._keep_alive = None  # a graph's tensors belong to its memory pool, not to this Work
        self._cuda_event = event

    def _succeeded(self) -> None:
        self._keep_alive = None
        self._finish(None, None)

    def _failed(self, error: BaseException) -> None:
        self._keep_alive = None
        self._finish(None, error)

    # -- Work API ----------------------------------------------------------------------------
    def wait(self, timeout: float | timedelta | None = None) -> bool:
        if timeout is not None or self._cpu_wait:
            return super().wait(timeout)
        if not self._is_done:
            if self._cuda_event is None:
                self._comm.flush_p2p()
            if not self._is_done:
                if self._comm.error is not None:
                    self._failed(self._comm.error)
                else:
                    assert self._cuda_event is not None
                    torch.cuda.current_stream(self._comm.device).wait_event(self._cuda_event)
                    if self._captured:
                        self._succeeded()  # in a graph, "done" means ordered before what follows
                    return True
        return super().wait(0)  # finished: raise its error (explained by the kernel), or True

    def _wait_native(self, timeout: float | None) -> bool:
        if self._is_done:
            return True
        if self._cuda_event is None:
            self._comm.flush_p2p()
            if self._is_done:
                return True
        assert self._cuda_event is not None
        if self._captured:  # no CPU view of a capture: order the caller after it
            torch.cuda.current_stream(self._comm.device).wait_event(self._cuda_event)
            self._succeeded()
            return True
        limit = timeout if timeout is not None else self._comm.timeout_s
        deadline = time.monotonic() + limit
        delay = 20e-6
        while True:
            if self._comm.error is not None:
                self._failed(self._comm.error)
                return True
            if self._cuda_event.query():
                if self._comm.error is not None:  # aborted kernels complete their events too
                    self._failed(self._comm.error)
                else:
                    self._succeeded()
                return True
            if time.monotonic() >= deadline:
                error = timeout_error(
                    self.description, limit,
                    f"NCCL: the communicator of group {self._comm.group!r} was aborted (ncclCommAbort); "
                    "its later CUDA ops raise",
                )
                self._comm.abort(error)
                self._failed(error)
                return True
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        if not self._is_done and self._cuda_event is None:
            self._comm.flush_p2p()  # a queued op completes only once issued (e.g. inside spmd's wait_all)
        super().add_done_callback(callback)

    def is_completed(self) -> bool:
        if self._is_done or self._cuda_event is None or self._captured:
            return self._is_done
        if self._comm.error is not None:
            self._failed(self._comm.error)
        else:
            if in_background_thread():
                allow_queries_during_other_threads_captures()
            if self._cuda_event.query():
                self._succeeded()
        return self._is_done
