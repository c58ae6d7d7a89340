"""Communicator: one ncclComm_t on one device, with its stream, its lock, its queued point-to-point ops
and its watcher thread; every NCCL call on a group goes through it.

Creation
    One ``ncclComm_t`` per group, created on the first CUDA tensor the group
    sees, on that tensor's device (``create_communicator``; the unique id and
    the non-blocking init are in bootstrap.py). Sub-groups that keep every rank
    come from ``ncclCommSplit`` (``Communicator.split``).

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
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from spmd.comm.backend import BackendContext
from spmd.errors import CollectiveError, CollectiveTimeoutError
from spmd_nccl import library as nccl
from spmd_nccl.bootstrap import UNIQUE_ID_KEY, await_ready, exchange_unique_id
from spmd_nccl.cuda import on_device
from spmd_nccl.errors import NcclError
from spmd_nccl.mapping import BYTES
from spmd_nccl.watcher import watch
from spmd_nccl.work import NcclWork

log = logging.getLogger("spmd.nccl")

#: Seconds ``close`` gives ncclCommFinalize before it aborts instead.
CLOSE_TIMEOUT = 30.0


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
        with on_device(device):
            self.stream = torch.cuda.Stream(device=device)
        self.stream_handle = ctypes.c_void_p(self.stream.cuda_stream)
        self.lock = threading.RLock()
        self.error: BaseException | None = None
        self._works_lock = threading.Lock()
        self._outstanding: list[NcclWork] = []
        self._pending: list[_P2P] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=watch, args=(self,), name=f"spmd-nccl-watch-{group}", daemon=True)
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
        state = nccl.ncclResult_t()
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
        kind = CollectiveTimeoutError if isinstance(error, TimeoutError) else CollectiveError
        raise kind(
            f"the NCCL communicator of {self.where()} was aborted after an earlier failure, so no CUDA op "
            f"can run on this group any more: {error}. Destroy the group (spmd.destroy_process_group()) and "
            "init again to continue"
        ) from error

    # -- launching ---------------------------------------------------------------------------
    def launch(self, issue: Callable[[], None], keep_alive: object, *, cpu_wait: bool = False) -> NcclWork:
        """Run ``issue()`` (NCCL calls on ``stream_handle``) after the caller's stream; a Work for it."""
        with on_device(self.device):
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
            work.issued(event, capturing)
        if not capturing:
            self._track([work])
        return work

    def local_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the internal stream (inside ``issue``)."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src)

    def post_p2p(self, send: bool, tensor: torch.Tensor, peer: int) -> NcclWork:
        """Queue an isend/irecv; it is issued (grouped with the others) at the next flush."""
        with on_device(self.device):
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
        with on_device(self.device), self.lock:
            if self._pending:
                self._flush_locked()

    def _flush_locked(self) -> None:
        ops, self._pending = self._pending, []
        if self.handle is None:
            error = self.error or CollectiveError(f"the NCCL communicator of {self.where()} was closed")
            for op in ops:
                op.work.failed(error)
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
                op.work.failed(error)
            raise
        for op in ops:
            op.work.issued(event, op.captured)
        self._track([op.work for op in ops if not op.captured])

    def _track(self, works: list[NcclWork]) -> None:
        with self._works_lock:
            self._outstanding.extend(works)
        self._wake.set()

    # -- sub-communicators ---------------------------------------------------------------------
    def split(self, color: int, key: int, rank: int, size: int, group: str, timeout_s: float) -> Communicator:
        """``ncclCommSplit`` (collective over every rank of this communicator)."""
        with on_device(self.device), self.lock:
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
            work.failed(self.error)

    def close(self) -> None:
        """Finish (ncclCommFinalize, bounded) and destroy the communicator; abort if it cannot finish."""
        self._stopped = True
        self._wake.set()
        try:
            if self._finalize_and_destroy():
                with self._works_lock:
                    finished, self._outstanding = self._outstanding, []
                for work in finished:  # ncclCommFinalize returned: every op has completed
                    work.succeeded()
        finally:
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=2)  # no CUDA call from it while the interpreter shuts down

    def _finalize_and_destroy(self) -> bool:
        with self.lock:
            handle = self.handle
            if handle is None:
                return False
            try:
                with on_device(self.device):
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


def create_communicator(lib: nccl.NcclLibrary, ctx: BackendContext, device: torch.device, blocking: bool) -> Communicator:
    """The group's communicator on ``device``: unique id through the store, then ncclCommInitRankConfig."""
    timeout_s = ctx.timeout.total_seconds()
    deadline = time.monotonic() + timeout_s
    # Each rank counts the communicators it made for this group: the n-th one of every rank
    # uses key n, so a group re-created on the same store never reads a stale unique id.
    generation = ctx.store.add(f"{UNIQUE_ID_KEY}/made_by/{ctx.rank}", 1)
    with on_device(device):
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

