"""NcclBackend: spmd's Backend contract over NCCL, called through ctypes.

Communicator
    One ``ncclComm_t`` per group, created on the first CUDA tensor the group
    sees, on that tensor's device. Rank 0 makes the ``ncclUniqueId`` and shares
    it through the group's store; ``ncclCommInitRankConfig`` runs non-blocking
    (``blocking=0``), so a rank that never arrives becomes a timeout and an
    abort instead of a hang. Sub-groups that keep every rank come from
    ``ncclCommSplit``; the others get a fresh unique id through their own store.

Streams
    Every op runs on the communicator's internal stream, which first waits on
    the caller's current stream. The op's Work records a CUDA event there.
    ``wait()`` makes the caller's current stream wait on that event (no CPU
    block, like torch's ProcessGroupNCCL); ``wait(timeout)`` and
    ``is_completed()`` query the event. The tensors stay referenced until the
    event has completed, so the caching allocator cannot hand their memory to
    someone else while NCCL still uses it.

Watcher
    One daemon thread per communicator polls the events of outstanding ops
    (marking them complete and dropping their tensors), checks
    ``ncclCommGetAsyncError``, and aborts the communicator when an op outlives
    the group timeout. A timeout raises the kernel's CollectiveTimeoutError;
    after an abort the group's CUDA ops raise instead of hanging.

Point-to-point
    ``ncclSend``/``ncclRecv`` block the GPU until the peer posts the matching
    call, so issuing each at once on one stream deadlocks an exchange as plain
    as a ring. isend/irecv are therefore queued and issued together in one
    ``ncclGroupStart``/``ncclGroupEnd`` at the next flush: a ``wait`` on one of
    them, the next collective, ``close``, or the watcher once nothing new was
    posted for ``P2P_FLUSH_DELAY`` (``is_completed`` never flushes: the
    kernel's watchdog calls it from another thread, mid-burst). NCCL matches
    messages between two ranks in the order they were posted; it has no tags,
    so the tag is ignored.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from spmd.comm.backend import Backend, BackendContext
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work, timeout_error
from spmd.errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError
from spmd_nccl import library as nccl
from spmd_nccl.mapping import BYTES, reduction

log = logging.getLogger("spmd.nccl")

#: Store key (under the group's prefixed store) for rank 0's ncclUniqueId.
UNIQUE_ID_KEY = "nccl/unique_id"
#: Seconds after the last isend/irecv was posted before the watcher issues the queue by itself
#: (for a send nobody waits on). Measured from the last post, so a burst posted together
#: (irecv, isend) is never split: split, each rank's lone irecv could block its stream.
P2P_FLUSH_DELAY = 0.05
#: The watcher's poll interval while ops are outstanding, and its idle check interval.
POLL_INTERVAL = 0.002
IDLE_INTERVAL = 0.5
#: Seconds ``close`` gives ncclCommFinalize before it aborts instead.
CLOSE_TIMEOUT = 30.0


class NcclError(CollectiveError):
    """NCCL returned an error; ``code`` is the ncclResult_t."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device is visible to torch, else why not (and what to install)."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch"
        return "torch.cuda.is_available() is False (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them; check nvidia-smi)"
    return None


# -- CUDA helpers ------------------------------------------------------------------------
_CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal
_thread_state = threading.local()


@functools.cache
def _capture_mode_exchange() -> Callable[..., int] | None:
    """``cudaThreadExchangeStreamCaptureMode`` of the CUDA runtime torch already loaded, if found."""
    for soname in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        try:
            fn = runtime.cudaThreadExchangeStreamCaptureMode
        except AttributeError:
            continue
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        return fn
    return None


def allow_queries_during_other_threads_captures() -> None:
    """Give this (background) thread the thread-local capture interaction mode, once.

    A thread in the default (global) mode that queries an event while another
    thread captures a CUDA graph invalidates that capture; torch's NCCL watchdog
    switches its thread the same way. Without a loaded CUDA runtime it does nothing.
    """
    if getattr(_thread_state, "capture_mode_set", False):
        return
    _thread_state.capture_mode_set = True
    exchange = _capture_mode_exchange()
    if exchange is not None:
        mode = ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)
        exchange(ctypes.byref(mode))


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current for the block (a no-op when it already is)."""
    if torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _background_thread() -> bool:
    return threading.current_thread() is not threading.main_thread()


# -- Work ------------------------------------------------------------------------------------
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
            if _background_thread():
                allow_queries_during_other_threads_captures()
            if self._cuda_event.query():
                self._succeeded()
        return self._is_done


@dataclass
class _P2P:
    """A queued isend/irecv: issued with the others at the next flush."""

    send: bool
    tensor: torch.Tensor  # contiguous, on the communicator's device
    peer: int
    before: torch.cuda.Event  # recorded on the caller's stream when the op was posted
    work: NcclWork
    captured: bool
    posted_at: float


# -- Communicator ------------------------------------------------------------------------
class Communicator:
    """One ``ncclComm_t`` on one device, with its stream, its lock and its watcher thread.

    Every NCCL call on the handle happens under ``lock``, so an abort from the
    watcher never races a call from the program's thread.
    """

    def __init__(
        self,
        lib: nccl.NcclLibrary,
        handle: ctypes.c_void_p,
        device: torch.device,
        rank: int,
        size: int,
        timeout_s: float,
        group: str,
        blocking: bool,
        origin: str = "ncclCommInitRankConfig",
    ) -> None:
        self.lib = lib
        self.origin = origin  # how it was made: "ncclCommInitRankConfig" (fresh unique id) or "ncclCommSplit"
        self.handle: ctypes.c_void_p | None = handle
        self.device = device
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        self.group = group
        self.blocking = blocking
        with _on_device(device):
            self.stream = torch.cuda.Stream(device=device)
        self.stream_handle = ctypes.c_void_p(self.stream.cuda_stream)
        self.lock = threading.RLock()
        self.error: BaseException | None = None
        self._works_lock = threading.Lock()
        self._outstanding: list[NcclWork] = []
        self._pending: list[_P2P] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name=f"spmd-nccl-watch-{group}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        state = "aborted" if self.error is not None else ("closed" if self.handle is None else "ok")
        return f"<Communicator group={self.group!r} rank={self.rank}/{self.size} {self.device} {state}>"

    # -- calling NCCL ------------------------------------------------------------------------
    def where(self) -> str:
        return f"group {self.group!r} (rank {self.rank} of {self.size}, {self.device})"

    def call(self, name: str, *args: Any) -> None:
        """Call ``name`` (the lock is held); raise NcclError on failure, settle ncclInProgress."""
        result = self.lib.functions[name](*args)  # type: ignore[misc]
        if result != nccl.ncclSuccess:
            self._check(result, name)

    def _check(self, result: int, what: str) -> None:
        if result == nccl.ncclInProgress:
            self._settle(what, time.monotonic() + self.timeout_s)
            return
        error = NcclError(f"{what} failed on {self.where()}: {self.lib.describe(result, self.handle)}", result)
        if result in (nccl.ncclInvalidArgument, nccl.ncclInvalidUsage) and self._async_state() in (nccl.ncclSuccess, nccl.ncclInProgress):
            raise error  # a bad call, refused before it started: the communicator is fine
        self._abort_locked(error)
        raise error

    def _async_state(self) -> int:
        if self.handle is None:
            return nccl.ncclInternalError
        state = ncclResult()
        result = self.lib.ncclCommGetAsyncError(self.handle, ctypes.byref(state))
        return state.value if result == nccl.ncclSuccess else result

    def _settle(self, what: str, deadline: float) -> None:
        """Poll a non-blocking communicator until ``what`` left ncclInProgress (or abort at the deadline)."""
        delay = 10e-6
        while True:
            state = self._async_state()
            if state == nccl.ncclSuccess:
                return
            if state != nccl.ncclInProgress:
                error = NcclError(f"{what} failed on {self.where()}: {self.lib.describe(state, self.handle)}", state)
                self._abort_locked(error)
                raise error
            if time.monotonic() >= deadline:
                error = CollectiveTimeoutError(
                    f"{what} on {self.where()} was still in progress after {self.timeout_s:.1f} s: a peer rank "
                    "has probably not reached the same call; the communicator was aborted"
                )
                self._abort_locked(error)
                raise error
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    @contextlib.contextmanager
    def group_call(self) -> Iterator[None]:
        """``ncclGroupStart`` ... ``ncclGroupEnd`` (the end runs even when the body raised)."""
        self.call("ncclGroupStart")
        try:
            yield
        finally:
            self.call("ncclGroupEnd")

    def raise_if_dead(self) -> None:
        error = self.error
        if error is None and self.handle is not None:
            return
        if error is None:
            raise CollectiveError(f"the NCCL communicator of {self.where()} was closed; create a new group")
        kind = CollectiveTimeoutError if isinstance(error, CollectiveTimeoutError) else CollectiveError
        raise kind(
            f"the NCCL communicator of {self.where()} was aborted after an earlier failure, so no CUDA op "
            f"can run on this group any more: {error}. Destroy the group (spmd.destroy_process_group()) and "
            "init again to continue"
        ) from error

    # -- launching ---------------------------------------------------------------------------
    def launch(self, issue: Callable[[], None], keep_alive: object, *, cpu_wait: bool = False) -> NcclWork:
        """Run ``issue()`` (NCCL calls on ``stream_handle``) after the caller's stream; a Work for it."""
        with _on_device(self.device):
            caller = torch.cuda.current_stream()
            capturing = torch.cuda.is_current_stream_capturing()
            work = NcclWork(self, keep_alive, cpu_wait)
            with self.lock:
                self.raise_if_dead()
                if self._pending:
                    self._flush_locked()  # program order: queued point-to-point ops go first
                self.stream.wait_stream(caller)
                issue()
                event = torch.cuda.Event()
                event.record(self.stream)
            work._issued(event, capturing)
        if not capturing:
            self._track([work])
        return work

    def local_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the internal stream (inside ``issue``)."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src)

    def post_p2p(self, send: bool, tensor: torch.Tensor, peer: int) -> NcclWork:
        """Queue an isend/irecv; it is issued (grouped with the others) at the next flush."""
        with _on_device(self.device):
            before = torch.cuda.Event()
            before.record(torch.cuda.current_stream())
            captured = torch.cuda.is_current_stream_capturing()
        work = NcclWork(self, tensor)
        with self.lock:
            self.raise_if_dead()
            self._pending.append(_P2P(send, tensor, peer, before, work, captured, time.monotonic()))
        self._wake.set()
        return work

    def flush_p2p(self) -> None:
        """Issue every queued isend/irecv now, as one NCCL group."""
        with _on_device(self.device), self.lock:
            if self._pending:
                self._flush_locked()

    def _flush_locked(self) -> None:
        ops, self._pending = self._pending, []
        if self.handle is None:
            error = self.error or CollectiveError(f"the NCCL communicator of {self.where()} was closed")
            for op in ops:
                op.work._failed(error)
            return
        try:
            for op in ops:
                self.stream.wait_event(op.before)
            with self.group_call():
                for op in ops:
                    name = "ncclSend" if op.send else "ncclRecv"
                    count = op.tensor.numel() * op.tensor.element_size()
                    self.call(name, op.tensor.data_ptr(), count, BYTES, op.peer, self.handle, self.stream_handle)
            event = torch.cuda.Event()
            event.record(self.stream)
        except BaseException as error:
            for op in ops:
                op.work._failed(error)
            raise
        for op in ops:
            op.work._issued(event, op.captured)
        self._track([op.work for op in ops if not op.captured])

    def _track(self, works: list[NcclWork]) -> None:
        with self._works_lock:
            self._outstanding.extend(works)
        self._wake.set()

    # -- sub-communicators ---------------------------------------------------------------------
    def split(self, color: int, key: int, rank: int, size: int, group: str, timeout_s: float) -> Communicator:
        """``ncclCommSplit`` (collective over every rank of this communicator)."""
        with _on_device(self.device), self.lock:
            self.raise_if_dead()
            if self._pending:
                self._flush_locked()
            child = nccl.ncclComm_t()
            config = self.lib.config(blocking=1 if self.blocking else 0)
            result = self.lib.ncclCommSplit(self.handle, color, key, ctypes.byref(child), ctypes.byref(config))
            if result not in (nccl.ncclSuccess, nccl.ncclInProgress):
                self._check(result, "ncclCommSplit")
            await_ready(self.lib, child, time.monotonic() + timeout_s, f"ncclCommSplit for group {group!r}")
            return Communicator(self.lib, child, self.device, rank, size, timeout_s, group, self.blocking, "ncclCommSplit")

    # -- failure and teardown ------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Abort the communicator (ncclCommAbort): every queued and running op fails with ``error``."""
        with self.lock:
            self._abort_locked(error)

    def _abort_locked(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        handle, self.handle = self.handle, None
        pending, self._pending = self._pending, []
        if handle is not None:
            log.warning("aborting the NCCL communicator of %s: %s", self.where(), error)
            self.lib.ncclCommAbort(handle)
        with self._works_lock:
            running, self._outstanding = self._outstanding, []
        for work in running + [op.work for op in pending]:
            work._failed(self.error)

    def close(self) -> None:
        """Finish (ncclCommFinalize, bounded) and destroy the communicator; abort if it cannot finish."""
        self._stopped = True
        self._wake.set()
        try:
            if self._finalize_and_destroy():
                with self._works_lock:
                    finished, self._outstanding = self._outstanding, []
                for work in finished:  # ncclCommFinalize returned: every op has completed
                    work._succeeded()
        finally:
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=2)  # no CUDA call from it while the interpreter shuts down

    def _finalize_and_destroy(self) -> bool:
        with self.lock:
            handle = self.handle
            if handle is None:
                return False
            try:
                with _on_device(self.device):
                    if self._pending:
                        self._flush_locked()
                    if self.lib.has("ncclCommFinalize"):
                        result = self.lib.ncclCommFinalize(handle)
                        if result not in (nccl.ncclSuccess, nccl.ncclInProgress):
                            raise NcclError(f"ncclCommFinalize failed: {self.lib.describe(result, handle)}", result)
                        self._settle("ncclCommFinalize", time.monotonic() + min(self.timeout_s, CLOSE_TIMEOUT))
                    self.handle = None
                    self.lib.ncclCommDestroy(handle)
            except BaseException as error:  # noqa: BLE001 - teardown must not raise
                log.warning("closing the NCCL communicator of %s failed (%s); aborting it", self.where(), error)
                if self.handle is not None:
                    self._abort_locked(CollectiveError(f"the communicator of {self.where()} was closed: {error}"))
                return False
        return True

    # -- the watcher thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            allow_queries_during_other_threads_captures()
        except Exception as error:  # noqa: BLE001 - a watcher that cannot start must not kill the job
            log.warning("spmd-nccl watcher for %s could not start: %s", self.where(), error)
            return
        last_async_check = 0.0
        while not self._stopped:
            busy = bool(self._outstanding or self._pending)
            self._wake.wait(POLL_INTERVAL if busy else IDLE_INTERVAL)
            self._wake.clear()
            if self._stopped or self.handle is None:
                return
            try:
                self._poll_once()
                now = time.monotonic()
                if now - last_async_check > 0.05:
                    last_async_check = now
                    self._check_async_error()
            except Exception as error:  # noqa: BLE001 - keep watching; the op's waiter sees the failure
                log.debug("spmd-nccl watcher: %s", error)

    def _poll_once(self) -> None:
        now = time.monotonic()
        pending = self._pending
        if pending and now - pending[-1].posted_at >= P2P_FLUSH_DELAY and not any(p.captured for p in pending):
            if self.lock.acquire(blocking=False):
                try:
                    if self._pending and not any(p.captured for p in self._pending):
                        with _on_device(self.device):
                            self._flush_locked()
                finally:
                    self.lock.release()
        with self._works_lock:
            works = list(self._outstanding)
        done: list[NcclWork] = []
        late: NcclWork | None = None
        for work in works:
            if work._is_done or (work._cuda_event is not None and work._cuda_event.query()):
                done.append(work)
            elif late is None and now - work._issued_at > self.timeout_s:
                late = work
        if done:
            finished = set(map(id, done))
            with self._works_lock:
                self._outstanding = [w for w in self._outstanding if id(w) not in finished]
            if self.error is None:
                for work in done:
                    work._succeeded()
        if late is not None:
            self.abort(timeout_error(
                late.description, self.timeout_s,
                f"NCCL: spmd-nccl's watcher aborted the communicator of group {self.group!r} (ncclCommAbort)",
            ))

    def _check_async_error(self) -> None:
        if not self.lock.acquire(blocking=False):
            return  # the program's thread is inside NCCL; it sees errors itself
        try:
            if self.handle is None:
                return
            state = self._async_state()
            if state not in (nccl.ncclSuccess, nccl.ncclInProgress):
                self._abort_locked(NcclError(
                    f"NCCL reported an asynchronous error on {self.where()}: {self.lib.describe(state, self.handle)}",
                    state,
                ))
        finally:
            self.lock.release()


ncclResult = nccl.ncclResult_t


# -- bootstrap --------------------------------------------------------------------------------
def exchange_unique_id(lib: nccl.NcclLibrary, store: Any, rank: int, timeout: timedelta, group: str, key: str = UNIQUE_ID_KEY) -> nccl.ncclUniqueId:
    """Rank 0 makes the ncclUniqueId and publishes it in ``store``; the others read it.

    The value carries a one-byte tag: ``U`` + the 128-byte id, or ``E`` + rank 0's
    error, so a failure on rank 0 is reported on every rank instead of a timeout.
    """
    if rank == 0:
        try:
            uid = lib.unique_id()
        except nccl.NcclLibraryError as error:
            store.set(key, b"E" + str(error).encode())
            raise BackendUnavailableError(f"spmd-nccl: {error}") from error
        store.set(key, b"U" + bytes(uid))
        return uid
    try:
        store.wait([key], timeout)
    except RuntimeError as error:
        raise CollectiveTimeoutError(
            f"spmd-nccl: rank {rank} of group {group!r} waited {timeout.total_seconds():.1f} s for rank 0's NCCL "
            "unique id: rank 0 has not reached its first CUDA operation on this group (every rank of a group "
            f"must take part in its first CUDA op, which creates the NCCL communicator) [{error}]"
        ) from error
    data = bytes(store.get(key))
    if data[:1] == b"E":
        raise BackendUnavailableError(f"spmd-nccl: rank 0 of group {group!r} could not create the NCCL unique id: {data[1:].decode(errors='replace')}")
    if data[:1] != b"U" or len(data) != 1 + nccl.NCCL_UNIQUE_ID_BYTES:
        raise CollectiveError(f"spmd-nccl: the store key {key!r} of group {group!r} does not hold an NCCL unique id ({len(data)} bytes)")
    return nccl.ncclUniqueId.from_buffer_copy(data[1:])


def await_ready(lib: nccl.NcclLibrary, handle: ctypes.c_void_p, deadline: float, what: str) -> None:
    """Poll a new non-blocking communicator until it is ready; abort it at the deadline."""
    state = ncclResult()
    delay = 50e-6
    while True:
        result = lib.ncclCommGetAsyncError(handle, ctypes.byref(state))
        status = state.value if result == nccl.ncclSuccess else result
        if status == nccl.ncclSuccess:
            return
        if status != nccl.ncclInProgress:
            detail = lib.describe(status, handle)
            lib.ncclCommAbort(handle)
            raise NcclError(f"{what} failed: {detail}", status)
        if time.monotonic() >= deadline:
            lib.ncclCommAbort(handle)
            raise CollectiveTimeoutError(
                f"{what} did not finish in time: not every rank of the group reached its first CUDA operation "
                "(which creates the NCCL communicator); the half-made communicator was aborted"
            )
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)


def create_communicator(lib: nccl.NcclLibrary, ctx: BackendContext, device: torch.device, blocking: bool) -> Communicator:
    """The group's communicator on ``device``: unique id through the store, then ncclCommInitRankConfig."""
    timeout_s = ctx.timeout.total_seconds()
    deadline = time.monotonic() + timeout_s
    # Each rank counts the communicators it made for this group: the n-th one of every rank
    # uses key n, so a group re-created on the same store never reads a stale unique id.
    generation = ctx.store.add(f"{UNIQUE_ID_KEY}/made_by/{ctx.rank}", 1)
    with _on_device(device):
        uid = exchange_unique_id(lib, ctx.store, ctx.rank, ctx.timeout, ctx.group_name, f"{UNIQUE_ID_KEY}/{generation}")
        handle = nccl.ncclComm_t()
        config = lib.config(blocking=1 if blocking else 0)
        result = lib.ncclCommInitRankConfig(ctypes.byref(handle), ctx.size, uid, ctx.rank, ctypes.byref(config))
        what = f"ncclCommInitRankConfig for group {ctx.group_name!r} (rank {ctx.rank} of {ctx.size}, {device})"
        if result not in (nccl.ncclSuccess, nccl.ncclInProgress):
            detail = lib.describe(result, handle if handle.value else None)
            if handle.value:
                lib.ncclCommAbort(handle)
            raise NcclError(f"{what} failed: {detail}", result)
        await_ready(lib, handle, deadline, what)
        return Communicator(lib, handle, device, ctx.rank, ctx.size, timeout_s, ctx.group_name, blocking)


# -- the backend ----------------------------------------------------------------------------------
def _row_bytes(tensor: torch.Tensor) -> int:
    rows = tensor.shape[0] if tensor.dim() else 1
    return (tensor.numel() // rows) * tensor.element_size() if rows else 0


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (no copy; the tensor is contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


class NcclBackend(Backend):
    """NCCL for one group's CUDA tensors; every collective native."""

    supports_avg = True  # ncclAvg (NCCL >= 2.10)

    def __init__(self, ctx: BackendContext, communicator: Communicator | None = None) -> None:
        super().__init__(ctx)
        try:
            self.lib = nccl.load()
        except nccl.NcclLibraryError as error:
            raise BackendUnavailableError(f"spmd-nccl: {error}") from error
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(
                f"spmd-nccl: NCCL {self.lib.version_string} loaded from {self.lib.path}, but no CUDA device is visible: {reason}"
            )
        self._blocking = bool(ctx.options.get("nccl_blocking", False))
        self._comm = communicator
        self._create_lock = threading.Lock()

    # -- the communicator ----------------------------------------------------------------------
    @property
    def communicator(self) -> Communicator | None:
        """The NCCL communicator, once the first CUDA op created it."""
        return self._comm

    def _communicator(self, device: torch.device) -> Communicator:
        comm = self._comm
        if comm is None:
            with self._create_lock:
                if self._comm is None:
                    self._comm = create_communicator(self.lib, self.ctx, device, self._blocking)
                comm = self._comm
        if comm.device != device:
            raise ValueError(
                f"spmd-nccl: group {self.ctx.group_name!r} has its NCCL communicator on {comm.device} (made by its "
                f"first CUDA op), but this tensor is on {device}. Use one GPU per rank: call "
                "torch.cuda.set_device(local_rank) before the first op and keep the group's tensors there"
            )
        comm.raise_if_dead()
        return comm

    def _prepare(self, op: str, *tensors: torch.Tensor | None) -> Communicator:
        device: torch.device | None = None
        for tensor in tensors:
            if tensor is None:
                continue
            if tensor.device.type != "cuda":
                raise TypeError(
                    f"spmd-nccl {op}: got a {tensor.device.type} tensor; NCCL moves CUDA tensors only. Move it "
                    "with .cuda(), or give that device its own backend: spmd.init('cpu:gloo,cuda:nccl')"
                )
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                raise ValueError(f"spmd-nccl {op}: tensors on {device} and {tensor.device}; put them on one GPU")
            if not tensor.is_contiguous():
                raise ValueError(f"spmd-nccl {op}: the kernel passed a non-contiguous tensor (shape {tuple(tensor.shape)})")
        assert device is not None
        return self._communicator(device)

    # -- point-to-point ----------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        comm = self._prepare("isend", tensor)
        if tensor.numel() == 0:
            return Work.completed()
        return comm.post_p2p(True, _bytes(tensor), dst)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        comm = self._prepare("irecv", tensor)
        if tensor.numel() == 0:
            return Work.completed()
        return comm.post_p2p(False, _bytes(tensor), src)

    # -- reductions ----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        comm = self._prepare("all_reduce", tensor)
        plan = reduction(tensor.dtype, op, self.lib.version)
        if tensor.numel() == 0:
            return Work.completed()
        data = tensor.reshape(-1).view(plan.view_dtype)
        ptr, count = data.data_ptr(), data.numel()

        def issue() -> None:
            comm.call("ncclAllReduce", ptr, ptr, count, plan.nccl_dtype, plan.nccl_op, comm.handle, comm.stream_handle)

        return comm.launch(issue, tensor)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        comm = self._prepare("reduce", tensor)
        plan = reduction(tensor.dtype, op, self.lib.version)
        if tensor.numel() == 0:
            return Work.completed()
        data = tensor.reshape(-1).view(plan.view_dtype)
        ptr, count = data.data_ptr(), data.numel()
        out = ptr if self.rank == dst else None  # NULL off the root: NCCL leaves other ranks' tensors alone

        def issue() -> None:
            comm.call("ncclReduce", ptr, out, count, plan.nccl_dtype, plan.nccl_op, dst, comm.handle, comm.stream_handle)

        return comm.launch(issue, tensor)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        comm = self._prepare("reduce_scatter_tensor", output, input)
        plan = reduction(input.dtype, op, self.lib.version)
        if output.numel() == 0:
            return Work.completed()
        out = output.reshape(-1).view(plan.view_dtype)
        inp = input.reshape(-1).view(plan.view_dtype)
        out_ptr, in_ptr, count = out.data_ptr(), inp.data_ptr(), out.numel()

        def issue() -> None:
            comm.call("ncclReduceScatter", in_ptr, out_ptr, count, plan.nccl_dtype, plan.nccl_op, comm.handle, comm.stream_handle)

        return comm.launch(issue, (output, input))

    # -- data movement ---------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        comm = self._prepare("broadcast", tensor)
        if tensor.numel() == 0:
            return Work.completed()
        ptr, count = tensor.data_ptr(), tensor.numel() * tensor.element_size()

        def issue() -> None:
            comm.call("ncclBroadcast", ptr, ptr, count, BYTES, src, comm.handle, comm.stream_handle)

        return comm.launch(issue, tensor)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        comm = self._prepare("all_gather_into_tensor", output, input)
        if input.numel() == 0:
            return Work.completed()
        in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
        count = input.numel() * input.element_size()

        def issue() -> None:
            comm.call("ncclAllGather", in_ptr, out_ptr, count, BYTES, comm.handle, comm.stream_handle)

        return comm.launch(issue, (output, input))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work:
        comm = self._prepare("all_to_all_single", output, input)
        in_row, out_row = _row_bytes(input), _row_bytes(output)
        if input.numel() == 0 and output.numel() == 0:
            return Work.completed()
        inp, out = _bytes(input), _bytes(output)
        sends, recvs, offset = [], [], 0
        for size in input_split_sizes:
            sends.append((offset, size * in_row))
            offset += size * in_row
        offset = 0
        for size in output_split_sizes:
            recvs.append((offset, size * out_row))
            offset += size * out_row
        me = self.rank

        def issue() -> None:
            with comm.group_call():
                for peer in range(self.size):
                    if peer == me:
                        continue
                    (s_off, s_len), (r_off, r_len) = sends[peer], recvs[peer]
                    if s_len:
                        comm.call("ncclSend", inp.data_ptr() + s_off, s_len, BYTES, peer, comm.handle, comm.stream_handle)
                    if r_len:
                        comm.call("ncclRecv", out.data_ptr() + r_off, r_len, BYTES, peer, comm.handle, comm.stream_handle)
            (s_off, s_len), (r_off, _) = sends[me], recvs[me]
            if s_len:
                comm.local_copy(out[r_off:r_off + s_len], inp[s_off:s_off + s_len])

        return comm.launch(issue, (output, input))

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> Work:
        comm = self._prepare("gather", output, input)
        if input.numel() == 0:
            return Work.completed()
        inp = _bytes(input)
        block = inp.numel()
        out = _bytes(output) if output is not None else None
        me = self.rank

        def issue() -> None:
            with comm.group_call():
                if me != dst:
                    comm.call("ncclSend", inp.data_ptr(), block, BYTES, dst, comm.handle, comm.stream_handle)
                else:
                    assert out is not None
                    for peer in range(self.size):
                        if peer != me:
                            comm.call("ncclRecv", out.data_ptr() + peer * block, block, BYTES, peer, comm.handle, comm.stream_handle)
            if me == dst:
                assert out is not None
                comm.local_copy(out[me * block:(me + 1) * block], inp)

        return comm.launch(issue, (output, input))

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int) -> Work:
        comm = self._prepare("scatter", output, input)
        if output.numel() == 0:
            return Work.completed()
        out = _bytes(output)
        block = out.numel()
        inp = _bytes(input) if input is not None else None
        me = self.rank

        def issue() -> None:
            with comm.group_call():
                if me != src:
                    comm.call("ncclRecv", out.data_ptr(), block, BYTES, src, comm.handle, comm.stream_handle)
                else:
                    assert inp is not None
                    for peer in range(self.size):
                        if peer != me:
                            comm.call("ncclSend", inp.data_ptr() + peer * block, block, BYTES, peer, comm.handle, comm.stream_handle)
            if me == src:
                assert inp is not None
                comm.local_copy(out, inp[me * block:(me + 1) * block])

        return comm.launch(issue, (output, input))

    def barrier(self) -> Work:
        """A one-byte all-reduce whose ``wait()`` blocks the CPU (with the group timeout)."""
        comm = self._comm
        device = comm.device if comm is not None else torch.device("cuda", torch.cuda.current_device())
        comm = self._communicator(device)
        with _on_device(device):
            token = torch.zeros(1, dtype=torch.uint8, device=device)
        ptr = token.data_ptr()

        def issue() -> None:
            comm.call("ncclAllReduce", ptr, ptr, 1, BYTES, 0, comm.handle, comm.stream_handle)

        return comm.launch(issue, token, cpu_wait=True)

    # -- groups and teardown ---------------------------------------------------------------------------
    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        """ncclCommSplit when the sub-group keeps every rank of this one; else None (fresh unique id).

        ncclCommSplit is collective over the whole parent communicator, but spmd
        calls ``split`` on the sub-group's members only (at their first CUDA op
        on it), so a sub-group that leaves ranks out bootstraps its own
        communicator through its own store instead.
        """
        comm = self._comm
        if comm is None or comm.error is not None or not self.lib.has("ncclCommSplit"):
            return None
        if sorted(ranks) != list(range(self.size)):
            return None
        child = comm.split(0, ctx.rank, ctx.rank, ctx.size, ctx.group_name, ctx.timeout.total_seconds())
        return NcclBackend(ctx, communicator=child)

    def close(self) -> None:
        super().close()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()
