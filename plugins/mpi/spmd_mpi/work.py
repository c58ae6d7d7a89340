"""MpiWork: the Work of one MPI request, completed by polling ``MPI_Test`` so every wait has a timeout.

MPI's own ``MPI_Wait`` blocks forever, so waits test the request: steadily
for a spin budget (MPI progresses only inside MPI calls), then sleeping with
back-off. Works with callbacks are tested by one watcher thread (``_Watcher``).
The spin/sleep tunables live here, beside the loop that reads them.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from spmd.errors import CollectiveError

#: The mpi4py.MPI module, bound by ``library.load_mpi`` (read only when MPI_Test raises).
MPI: Any = None

#: Seconds a wait tests back to back (yielding between tests only when oversubscribed)
#: before it starts sleeping. MPI progresses only inside MPI calls, so ops want steady tests.
SPIN_S = float(os.environ.get("SPMD_MPI_SPIN_US", "2000")) * 1e-6
#: Extra spinning per byte moved (1 ns/B, i.e. 1 GB/s): large ops need steady tests to
#: progress (MPI advances only inside MPI calls), so they back off only after that long.
SPIN_S_PER_BYTE = 1e-9
#: Longest sleep between two tests once a wait has backed off.
MAX_SLEEP_S = 1e-3
#: Ops up to this size keep the base spin budget.
_SPIN_FREE_BYTES = int(SPIN_S / SPIN_S_PER_BYTE) // 8
#: Tests before a wait starts yielding the CPU between them (when it yields at all).
_PURE_SPINS = 16


def _oversubscribed() -> bool:
    """True when this node runs more ranks than it has cores (or it cannot tell).

    Then waits yield the CPU between tests so a descheduled peer can run;
    otherwise they spin, as MPI's own blocking calls do. ``SPMD_MPI_YIELD=1/0``
    forces either.
    """
    forced = os.environ.get("SPMD_MPI_YIELD")
    if forced:
        return forced not in ("0", "false", "no")
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value) > (os.cpu_count() or 1)
    return True  # unknown: yielding costs a syscall per test, spinning oversubscribed costs ms


#: Whether waits yield between tests (decided once, at import).
_YIELD = _oversubscribed()

#: Serialises MPI_Test on one request between threads (a waiter and the watcher).
_TEST_LOCK = threading.Lock()
_acquire, _release = _TEST_LOCK.acquire, _TEST_LOCK.release

_yield = os.sched_yield if hasattr(os, "sched_yield") else (lambda: time.sleep(0))
_monotonic = time.monotonic
_sleep = time.sleep


#: Guards each MpiWork's finished flag against a concurrent add_done_callback (held for nanoseconds).
_STATE_LOCK = threading.Lock()


class MpiWork:
    """One MPI request, seen by the kernel through spmd's public ``NativeWork`` protocol.

    Waits poll ``Test`` with back-off and honour the timeout. Holds the tensors
    (``keep``) whose memory MPI reads or writes until the request completes,
    then runs ``after(ok)`` (a staging copy-back) once.
    """

    # Class-level defaults: each instance sets only what differs (creation is on the hot path).
    _after: Callable[[bool], None] | None = None
    _claimed = False
    _watched = False
    _spin_s = SPIN_S
    _finished = False
    _failure: BaseException | None = None
    _wakeup: threading.Event | None = None
    _done_fns: list[Callable[[], object]] | None = None

    def __init__(
        self, request: Any, keep: object = None, after: Callable[[bool], None] | None = None, nbytes: int = 0
    ) -> None:
        self._request = request
        self._keep = keep
        if after is not None:
            self._after = after
        if nbytes > _SPIN_FREE_BYTES:
            self._spin_s = SPIN_S + nbytes * SPIN_S_PER_BYTE

    def _try(self) -> int:
        """Test once: 0 still running, 1 finished, 2 another thread is finishing it."""
        if self._finished:
            return 1
        error = None
        _acquire()
        try:
            if self._claimed:
                return 2
            try:
                if not self._request.Test():
                    return 0
            except MPI.Exception as failure:
                error = failure
            self._claimed = True
        finally:
            _release()
        self._complete(error)
        return 1

    def _complete(self, error: Any) -> None:
        """Finish once MPI is done: run ``after``, drop the buffers, wake waiters and callbacks."""
        after = self._after
        self._request = None
        failure: BaseException | None = None
        if error is not None or after is not None:
            self._after = None
            if error is not None:
                text = error.Get_error_string() if hasattr(error, "Get_error_string") else str(error)
                failure = CollectiveError(f"MPI: {text}")
            if after is not None:
                try:
                    after(failure is None)
                except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                    failure = failure or exc
        self._keep = None  # (only now: ``after`` may write into the kept tensors)
        self._settle(failure)

    def _settle(self, failure: BaseException | None) -> None:
        """Mark the op finished (with ``failure``, or None) and wake its waiters and callbacks, once."""
        with _STATE_LOCK:
            self._failure = failure
            self._finished = True
            wakeup, fns = self._wakeup, self._done_fns
            self._done_fns = None
        if wakeup is not None:
            wakeup.set()
        for fn in fns or ():
            fn()

    # -- spmd.comm.work.NativeWork -----------------------------------------------------
    def wait(self, timeout: float | None) -> bool:
        """Test until done, spinning first, then sleeping with back-off; False at the timeout.

        The test loop is written out (not calls to ``_try``): it is the hot path
        of every synchronous op.
        """
        if self._finished:
            return True
        request = self._request
        spins = 0
        deadline = spin_until = 0.0
        delay = 1e-6
        mine = False
        error = None
        while True:
            _acquire()
            try:
                if self._claimed:
                    break  # another thread is finishing it
                try:
                    done = request.Test()
                except MPI.Exception as failure:
                    done, error = True, failure
                if done:
                    self._claimed = mine = True
                    break
            finally:
                _release()
            if spins < _PURE_SPINS:
                spins += 1
                if spins == _PURE_SPINS:
                    now = _monotonic()
                    deadline = float("inf") if timeout is None else now + timeout
                    spin_until = now + self._spin_s
                continue
            now = _monotonic()
            if now >= deadline:
                return False
            if now < spin_until:
                if _YIELD:
                    _yield()  # lets a peer rank on the same core run
            else:
                _sleep(min(delay, deadline - now))
                delay = min(delay * 2, MAX_SLEEP_S)
        if mine:
            self._complete(error)
            return True
        if timeout is not None and spins >= _PURE_SPINS:
            timeout = max(0.0, deadline - _monotonic())
        with _STATE_LOCK:  # woken by the thread that finishes it
            if self._finished:
                return True
            if self._wakeup is None:
                self._wakeup = threading.Event()
            wakeup = self._wakeup
        return wakeup.wait(timeout)

    def poll(self) -> bool:
        if not self._finished:
            self._try()
        return self._finished

    def abort(self) -> None:
        """The kernel gave up on the op: it finishes as failed now, so a wait in progress returns.
        MPI cannot cancel a collective request: it stays posted, and its buffers alive (in
        ``_ABANDONED``, not in this handle, which the caller may drop), until MPI completes it."""
        _acquire()
        try:
            if self._claimed:  # finished, or being finished by another thread
                return
            self._claimed = True
        finally:
            _release()
        _abandon(self._request, self._keep)
        self._request = self._keep = self._after = None
        self._settle(CollectiveError("MPI: spmd gave up on this op (aborted); its request stays posted"))

    def error(self) -> BaseException | None:
        return self._failure

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        with _STATE_LOCK:
            if not self._finished:
                if self._done_fns is None:
                    self._done_fns = []
                self._done_fns.append(fn)
                watch, self._watched = not self._watched, True
            else:
                watch = None
        if watch is None:
            fn()
        elif watch:
            _WATCHER.add(self)  # someone must test the request for the callback to fire


#: (request, buffers) of aborted ops: MPI may still write into the buffers until the request completes.
_ABANDONED: list[tuple[Any, object]] = []


def _abandon(request: Any, keep: object) -> None:
    """Keep an aborted op's buffers alive until MPI completes its request (tested when one more comes)."""
    with _TEST_LOCK:
        still = []
        for old_request, old_keep in _ABANDONED:
            try:
                if old_request.Test():
                    continue
            except Exception:  # noqa: BLE001 - MPI says it is over: its buffers may go
                continue
            still.append((old_request, old_keep))
        _ABANDONED[:] = still
        if request is not None:
            _ABANDONED.append((request, keep))


class _Watcher:
    """One daemon thread that tests the requests of Works with callbacks (futures, batches).

    It calls into MPI only while it has Works to watch, and stops at exit
    before MPI is finalised.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._works: list[MpiWork] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    def add(self, work: MpiWork) -> None:
        with self._cond:
            self._works.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="spmd-mpi-watcher", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=2)

    def _loop(self) -> None:
        busy_since = _monotonic()
        delay = 1e-6
        while True:
            with self._cond:
                while not self._works and not self._stopping:
                    self._cond.wait()
                    busy_since, delay = _monotonic(), 1e-6
                if self._stopping:
                    return
                works = list(self._works)
            done = [w for w in works if w._try() != 0]
            if done:
                with self._cond:
                    self._works = [w for w in self._works if not any(w is d for d in done)]
                busy_since, delay = _monotonic(), 1e-6
            elif _monotonic() - busy_since < SPIN_S:
                _yield()  # the watcher always yields: it competes with this rank's own threads
            else:
                _sleep(delay)
                delay = min(delay * 2, MAX_SLEEP_S)


_WATCHER = _Watcher()
