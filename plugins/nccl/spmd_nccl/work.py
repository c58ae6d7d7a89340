"""NcclWork: the NativeWork of one NCCL op, completed through a CUDA event on the communicator's stream.

Every op runs on the communicator's internal stream, which first waits on the
caller's current stream. The op records a CUDA event there. The kernel wraps
this handle (spmd's NativeWork protocol) and owns everything else: deadlines,
the flight recorder, callbacks, futures, the error the user sees. ``wait()``
without a timeout makes the caller's current stream wait on the event (no CPU
block, like torch's ProcessGroupNCCL: ``wait_stream``); ``wait(timeout)`` and
``poll()`` query the event. The tensors stay referenced until the event has
completed, so the caching allocator cannot hand their memory to someone else
while NCCL still uses it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from spmd_nccl.cuda import allow_queries_during_other_threads_captures, in_background_thread


class Issuer(Protocol):
    """What a work reads of the communicator that issued it (a Communicator; a Protocol keeps this module below it)."""

    error: BaseException | None
    device: torch.device
    timeout_s: float
    group: str

    def flush_p2p(self) -> None: ...

    def abort(self, error: BaseException) -> None: ...


class NcclWork:
    """One NCCL op's handle: a CUDA event on the communicator's stream (spmd's NativeWork protocol).

    The communicator calls ``issued`` once the op is enqueued, and ``succeeded``
    or ``failed`` once it knows the outcome (the watcher, an abort, a close). A
    queued point-to-point op has no event until it is flushed; waiting flushes it.
    """

    def __init__(self, comm: Issuer, keep_alive: object, cpu_wait: bool = False) -> None:
        self.comm = comm
        self.keep_alive = keep_alive
        self.cpu_wait = cpu_wait  # barrier: wait() blocks the CPU (with the group timeout)
        self.cuda_event: torch.cuda.Event | None = None
        self.captured = False
        self.issued_at = 0.0
        self.done = False
        self.failure: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    # -- called by the communicator -------------------------------------------------------
    def issued(self, event: torch.cuda.Event, captured: bool) -> None:
        self.issued_at = time.monotonic()
        self.captured = captured
        if captured:
            self.keep_alive = None  # a graph's tensors belong to its memory pool, not to this handle
        self.cuda_event = event

    def succeeded(self) -> None:
        self._settle(None)

    def failed(self, error: BaseException) -> None:
        self._settle(error)

    def _settle(self, error: BaseException | None) -> None:
        with self._lock:
            if self.done:
                return
            self.done, self.failure, self.keep_alive = True, error, None
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    # -- the NativeWork protocol --------------------------------------------------------------
    def poll(self) -> bool:
        """Finished? Queries the event; never flushes queued point-to-point ops, never blocks."""
        if self.done or self.cuda_event is None or self.captured:
            return self.done
        if self.comm.error is not None:
            self.failed(self.comm.error)
        else:
            if in_background_thread():
                allow_queries_during_other_threads_captures()
            if self.cuda_event.query():
                self.succeeded()
        return self.done

    def wait_stream(self) -> bool:
        """Order the caller's current stream after the op, without blocking the CPU (a barrier blocks: False)."""
        if self.cpu_wait:
            return False
        if not self.done:
            if self.cuda_event is None:
                self.comm.flush_p2p()
            if not self.done:
                if self.comm.error is not None:
                    self.failed(self.comm.error)
                else:
                    assert self.cuda_event is not None
                    torch.cuda.current_stream(self.comm.device).wait_event(self.cuda_event)
                    if self.captured:
                        self.succeeded()  # in a graph, "done" means ordered before what follows
        return True

    def wait(self, timeout: float | None) -> bool:
        """Block the CPU until the event completes: False at ``timeout`` (the op keeps running; the
        kernel calls ``abort`` if that was its own deadline); with None, at the group's timeout abort
        the communicator, as the watcher would."""
        if self.done:
            return True
        if self.cuda_event is None:
            self.comm.flush_p2p()
            if self.done:
                return True
        assert self.cuda_event is not None
        if self.captured:  # no CPU view of a capture: order the caller after it
            torch.cuda.current_stream(self.comm.device).wait_event(self.cuda_event)
            self.succeeded()
            return True
        limit = timeout if timeout is not None else self.comm.timeout_s
        deadline = time.monotonic() + limit
        delay = 20e-6
        while True:
            if self.comm.error is not None:
                self.failed(self.comm.error)
                return True
            if self.cuda_event.query():
                if self.comm.error is not None:  # aborted kernels complete their events too
                    self.failed(self.comm.error)
                else:
                    self.succeeded()
                return True
            if time.monotonic() >= deadline:
                if timeout is not None:
                    return False
                error = TimeoutError(
                    f"NCCL: the op did not finish within {limit:.1f} s; the communicator of group "
                    f"{self.comm.group!r} was aborted (ncclCommAbort), so its later CUDA ops raise"
                )
                self.comm.abort(error)
                self.failed(error)
                return True
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def abort(self) -> None:
        """spmd gave up on the op (its deadline passed): abort the communicator, as ProcessGroupNCCL does."""
        if not self.done:
            self.comm.abort(TimeoutError(
                f"NCCL: spmd gave up on an op of group {self.comm.group!r} at its deadline; the communicator "
                "was aborted (ncclCommAbort), so its later CUDA ops raise"
            ))

    def error(self) -> BaseException | None:
        return self.failure

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the op finished (the watcher, an abort or a wait settles it)."""
        if not self.done and self.cuda_event is None:
            self.comm.flush_p2p()  # a queued op completes only once issued (e.g. inside spmd's wait_all)
        with self._lock:
            if not self.done:
                self._callbacks.append(callback)
                return
        callback()
