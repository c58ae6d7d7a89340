"""ShmWork: one op of the shm backend, seen by the kernel through the NativeWork protocol."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from spmd_shm.doorbell import Doorbells


class Driver(Protocol):
    """What a work asks of the engine that runs it (an Engine; a Protocol keeps this module below it)."""

    bells: Doorbells
    sleeping_callers: int

    def try_progress(self) -> bool | None: ...

    def drive(self, work: ShmWork, timeout: float | None) -> bool: ...

    def kick(self) -> None: ...

#: Guards each work's callback list against a concurrent finish (held for nanoseconds).
_LOCK = threading.Lock()


class ShmWork:
    """Finished by whichever thread progresses the engine (a waiting caller, or the engine's own);
    ``abort`` asks it to give up on the op."""

    __slots__ = ("done", "_error", "aborted", "_fns", "_engine", "deadline", "gate")

    def __init__(self, engine: Driver, deadline: float) -> None:
        #: Set once, by ``finish`` (a plain flag: its waiters progress the engine or sleep on the doorbell).
        self.done = False
        self._error: BaseException | None = None
        self.aborted = False
        self._fns: list[Callable[[], object]] | None = None
        self._engine = engine
        #: time.monotonic() after which the progress thread fails the op with a TimeoutError.
        self.deadline = deadline
        #: While the op waits for shared counters: (words, ranks, at_least), the op can go on once
        #: ``words[q].value >= at_least`` for every q in ranks (see ``Peers.wait_counters``).
        self.gate: tuple[list[Any], list[int], int] | None = None

    # -- spmd.comm.work.NativeWork ------------------------------------------------------
    def poll(self) -> bool:
        if not self.done:
            self._engine.try_progress()  # never blocks: skipped when another thread is progressing
        return self.done

    def wait(self, timeout: float | None) -> bool:
        if self.done:
            return True
        return self._engine.drive(self, timeout)

    def abort(self) -> None:
        """The kernel gave up: the progress thread fails the op at its next step (within milliseconds)."""
        if not self.done:
            self.aborted = True
            self._engine.kick()

    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        with _LOCK:
            if not self.done:
                if self._fns is None:
                    self._fns = []
                self._fns.append(fn)
                return
        fn()

    # -- the backend's side ---------------------------------------------------------------
    def finish(self, error: BaseException | None = None) -> None:
        """Complete the op (once; later calls are ignored) and run the kernel's callbacks."""
        with _LOCK:
            if self.done:
                return
            self._error = error
            self.done = True
            fns, self._fns = self._fns, None
        if self._engine.sleeping_callers:  # a caller may be asleep on the doorbell waiting for this op
            self._engine.bells.kick()
        for fn in fns or ():
            fn()
