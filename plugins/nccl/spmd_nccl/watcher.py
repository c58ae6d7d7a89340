"""The watcher: one daemon thread per communicator that notices completion, timeouts and async errors.

It polls the events of outstanding ops (marking them complete and dropping
their tensors), checks ``ncclCommGetAsyncError``, and aborts the communicator
when an op outlives the group timeout. A timeout raises the kernel's
CollectiveTimeoutError; after an abort the group's CUDA ops raise instead of
hanging. It also issues queued isend/irecv that nobody waits on, once nothing
new was posted for ``P2P_FLUSH_DELAY``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, Protocol

import torch

from spmd_nccl import library as nccl
from spmd_nccl.cuda import allow_queries_during_other_threads_captures, on_device
from spmd_nccl.errors import NcclError
from spmd_nccl.work import NcclWork


class Watched(Protocol):
    """The communicator's state the watcher polls and aborts (a Communicator; a Protocol keeps this module below it)."""

    lib: nccl.NcclLibrary
    handle: ctypes.c_void_p | None
    device: torch.device
    timeout_s: float
    group: str
    lock: threading.RLock
    error: BaseException | None
    _works_lock: threading.Lock
    _outstanding: list[NcclWork]
    _pending: list[Any]
    _wake: threading.Event
    _stopped: bool

    def where(self) -> str: ...

    def abort(self, error: BaseException) -> None: ...

    def _abort_locked(self, error: BaseException) -> None: ...

    def _flush_locked(self) -> None: ...

    def _async_state(self) -> int: ...

log = logging.getLogger("spmd.nccl")

#: Seconds after the last isend/irecv was posted before the watcher issues the queue by itself
#: (for a send nobody waits on). Measured from the last post, so a burst posted together
#: (irecv, isend) is never split: split, each rank's lone irecv could block its stream.
P2P_FLUSH_DELAY = 0.05
#: The watcher's poll interval while ops are outstanding, and its idle check interval.
POLL_INTERVAL = 0.002
IDLE_INTERVAL = 0.5


def watch(comm: Watched) -> None:
    """The thread's body: poll until the communicator is stopped, closed or aborted."""
    try:
        torch.cuda.set_device(comm.device)
        allow_queries_during_other_threads_captures()
    except Exception as error:  # noqa: BLE001 - a watcher that cannot start must not kill the job
        log.warning("spmd-nccl watcher for %s could not start: %s", comm.where(), error)
        return
    last_async_check = 0.0
    while not comm._stopped:
        busy = bool(comm._outstanding or comm._pending)
        comm._wake.wait(POLL_INTERVAL if busy else IDLE_INTERVAL)
        comm._wake.clear()
        if comm._stopped or comm.handle is None:
            return
        try:
            poll_once(comm)
            now = time.monotonic()
            if now - last_async_check > 0.05:
                last_async_check = now
                check_async_error(comm)
        except Exception as error:  # noqa: BLE001 - keep watching; the op's waiter sees the failure
            log.debug("spmd-nccl watcher: %s", error)


def poll_once(comm: Watched) -> None:
    """Flush a stale point-to-point queue, complete the finished Works, abort at the first late one."""
    now = time.monotonic()
    pending = comm._pending
    if pending and now - pending[-1].posted_at >= P2P_FLUSH_DELAY and not any(p.captured for p in pending):
        if comm.lock.acquire(blocking=False):
            try:
                if comm._pending and not any(p.captured for p in comm._pending):
                    with on_device(comm.device):
                        comm._flush_locked()
            finally:
                comm.lock.release()
    with comm._works_lock:
        works = list(comm._outstanding)
    done: list[NcclWork] = []
    late: NcclWork | None = None
    for work in works:
        if work.done or (work.cuda_event is not None and work.cuda_event.query()):
            done.append(work)
        elif late is None and now - work.issued_at > comm.timeout_s:
            late = work
    if done:
        finished = set(map(id, done))
        with comm._works_lock:
            comm._outstanding = [w for w in comm._outstanding if id(w) not in finished]
        if comm.error is None:
            for work in done:
                work.succeeded()
    if late is not None:
        comm.abort(TimeoutError(  # spmd words it for each op that fails with it (op, group, sequence number)
            f"NCCL: an op of group {comm.group!r} outlived the group timeout ({comm.timeout_s:.1f} s); "
            "spmd-nccl's watcher aborted the communicator (ncclCommAbort)"
        ))


def check_async_error(comm: Watched) -> None:
    """Abort the communicator when ncclCommGetAsyncError reports a failure (unless NCCL is busy)."""
    if not comm.lock.acquire(blocking=False):
        return  # the program's thread is inside NCCL; it sees errors itself
    try:
        if comm.handle is None:
            return
        state = comm._async_state()
        if state not in (nccl.ncclSuccess, nccl.ncclInProgress):
            comm._abort_locked(NcclError(
                f"NCCL reported an asynchronous error on {comm.where()}: {comm.lib.describe(state, comm.handle)}",
                state,
            ))
    finally:
        comm.lock.release()

