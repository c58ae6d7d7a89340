"""Work: the handle of an operation that may still be running.

Timeouts nest in one order; the first one given wins:

1. ``work.wait(timeout=...)`` bounds that one wait: it raises
   CollectiveTimeoutError when it runs out, and the op keeps its own deadline.
2. The op's ``timeout=`` (every collective, ``isend``/``irecv``/``send``/``recv``,
   ``barrier``): the op's deadline. A synchronous call raises at it; an async
   Work is failed at it by the watchdog (``spmd.comm.health.watchdog.expire_overdue``)
   whether or not anyone waits, and its waiters, callbacks and futures all get
   the error naming the op, the group, the sequence number and the ranks that
   never arrived.
3. The group's timeout (``new_group(timeout=)``, ``split_group(timeout=)``).
4. The default: ``spmd.init(timeout=)``, else ``SPMD_TIMEOUT`` seconds, else 10 minutes;
   groups made without a timeout inherit their parent's.

The kernel attaches the op's deadline to every Work in ``lifecycle.complete``
(``Work.default_timeout``), so nothing that goes through the kernel waits
forever. A backend may also enforce the group timeout natively (Gloo does);
an op timeout longer than the group's is then cut short by the backend.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

from spmd.errors import CollectiveError, CollectiveTimeoutError, timeout_error

Timeout = float | timedelta | None

_log = logging.getLogger("spmd")

#: Guards every Work's completion against concurrent callback registration (held for nanoseconds).
_STATE_LOCK = threading.Lock()


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
    _description: str = "operation"
    _describe: Callable[[], str] | None = None
    #: Set by the kernel: the flight-recorder entry this Work completes and the group it ran on
    #: (from which the description and the diagnosis of a failure are made, only when needed).
    _entry: Any = None
    _group: Any = None
    _on_error: Callable[[BaseException], BaseException] | None = None
    _explained: BaseException | None = None

    @property
    def description(self) -> str:
        """What this Work is, for error messages ("all_reduce on group 'world' (seq 12, ...)")."""
        if self._describe is not None:
            return self._describe()
        entry = self._entry
        if self._group is not None and entry is not None:
            if type(entry) is tuple:  # a Record (spmd.debug.recorder): an op that had succeeded when recorded
                return self._group.describe(entry[2], entry[1])
            return self._group.describe(entry.op, entry.seq)
        return self._description

    @description.setter
    def description(self, text: str) -> None:
        self._description, self._describe = text, None

    # Completion state. Class-level defaults, so creating a Work (once per op, on the hot path)
    # stores nothing; the event and callback list are made only when someone needs them.
    _is_done: bool = False
    _event: threading.Event | None = None
    _value: Any = None
    _error: BaseException | None = None
    _callbacks: list[Callable[[Work], None]] | None = None

    # No __init__: object's, in C (a Python one that sets nothing still cost a frame per op).
    # Subclasses may call super().__init__() or not.

    # -- constructors -------------------------------------------------------------
    @classmethod
    def completed(cls, value: Any = None) -> Work:
        """A Work that has already finished with ``value``."""
        work = cls()
        if cls is Work:  # nobody else can see it yet: no lock, no event, no callbacks to run
            work._is_done = True
            if value is not None:
                work._value = value
        else:
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

    @classmethod
    def from_native(cls, native: NativeWork) -> Work:
        """A Work over a backend's own handle that implements the ``NativeWork`` protocol."""
        for name in ("poll", "wait", "abort", "error"):
            if not callable(getattr(native, name, None)):
                raise TypeError(
                    f"{type(native).__name__} is not a spmd NativeWork: it has no {name}(); a backend "
                    "returns a Work (Work.completed(), Work.from_future()) or an object with poll(), "
                    "wait(timeout), abort() and error() (see spmd.comm.work.NativeWork)"
                )
        return NativeWorkAdapter(native)

    # -- completion (for subclasses and the kernel) ------------------------------
    def _finish(self, value: Any, error: BaseException | None) -> None:
        with _STATE_LOCK:
            if self._is_done:
                return
            if value is not None:
                self._value = value
            if error is not None:
                self._error = error
            self._is_done = True
            event, callbacks = self._event, self._callbacks
            if callbacks is not None:
                self._callbacks = None
        if error is not None and self._group is not None:
            self._mark_group(error)
        entry = self._entry
        if entry is not None:
            entry.finish(error)
        if event is not None:
            event.set()
        if callbacks is not None:
            for callback in callbacks:
                try:
                    callback(self)
                except Exception:  # noqa: BLE001 - runs on the backend's thread: one bad callback must not
                    # kill it (and every later completion with it) nor keep the others from running
                    _log.exception("spmd: a done-callback of %r raised; the Work's other callbacks still run", self)

    def _expire(self, error: BaseException) -> None:
        """The kernel's deadline passed with this Work still running: fail it with ``error`` explained.

        Called by the watchdog (``spmd.comm.health.watchdog.expire_overdue``) for an
        async Work nobody waited out in time; every waiter, callback and future
        then sees the explained error (op, group, sequence number, the ranks
        that never arrived). A result the backend delivers later is ignored.
        """
        if self._is_done:
            return
        explained = self._explain(error)
        if self._entry is not None:
            self._entry.finish(error)
        self._finish(None, explained)

    def _wait_native(self, timeout: float | None) -> bool:
        """Block until done or ``timeout`` seconds pass; return whether it finished."""
        if self._is_done:
            return True
        with _STATE_LOCK:
            if self._is_done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    # -- public API ---------------------------------------------------------------
    def wait(self, timeout: Timeout = None) -> bool:
        """Block until the operation finishes; raise its error, or CollectiveTimeoutError.

        ``timeout`` is seconds or a timedelta; None means the kernel's default
        for this Work (the group timeout). Returns True, like torch's Work.
        """
        if self._is_done and self._error is None:  # finished (the common case of a wait): no timed wait to make
            return True
        limit = self.default_timeout if timeout is None else seconds(timeout)
        if not self._wait_native(limit):
            raise self._timed_out(limit, own_deadline=timeout is None)
        if self._error is not None:
            raise self._explain(self._error)
        return True

    def _timed_out(self, limit: float | None, own_deadline: bool) -> BaseException:
        """The error for a wait that ran out after ``limit`` seconds (the entry finishes with it).

        When the op's own deadline passed (``own_deadline``) its group is out of
        step and is marked unusable. A shorter timeout the caller gave one wait
        only ends that wait: the op may still finish, wait again.
        """
        error = timeout_error(self.description, limit)
        if self._entry is not None:
            self._entry.finish(error)
        if own_deadline and self._group is not None:
            self._mark_group(error)
        return self._explain(error)

    def _mark_group(self, error: BaseException) -> None:
        """A failed or timed-out op leaves its group unusable: its ranks may be out of step (unless a
        peer gave it up first: then its reason stands, see ``ProcessGroup.mark_unusable``)."""
        entry = self._entry
        what = f"{entry.op} #{entry.seq}" if entry is not None and entry.seq >= 0 else self.description
        first = str(error).split("\n", 1)[0]
        self._group.mark_unusable(
            f"{what} failed on this rank ({type(error).__name__}: {first}), so its ranks may be out of step; "
            "destroy it and create a new group, or restart the job"
        )

    def _explain(self, error: BaseException) -> BaseException:
        """The error to raise: the kernel's diagnosis of it when it has one (computed once)."""
        if self._explained is None:
            if self._on_error is not None:
                self._explained = self._on_error(error)
            elif self._group is not None and self._entry is not None:
                self._explained = self._group.explain_failure(self._entry, error)  # the error path only
            else:
                return error
        return self._explained

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._is_done

    def is_success(self) -> bool:
        """True once the operation finished without an error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the operation failed with, or None (also None while it runs)."""
        return self._error

    def result(self) -> Any:
        """The value the operation produced (after ``wait``)."""
        self.wait()
        return self._value

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        """Call ``callback(work)`` once the operation finishes (at once if it has)."""
        with _STATE_LOCK:
            if not self._is_done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback(self)

    def then(self, after: Callable[[], None]) -> Work:
        """A Work that finishes once this one has and ``after()`` ran (only on success).

        For a step that must follow the transfer (a decompression, a copy back):
        waiting on the result waits on this Work natively and then runs ``after``
        in the waiting thread; with callbacks, ``after`` runs where this Work completes.
        """
        return ThenWork(self, after)

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` that completes with this Work's value or error."""
        future: torch.futures.Future = torch.futures.Future()

        def forward(work: Work) -> None:
            if work._error is not None:
                future.set_exception(work._explain(work._error))  # the error path only
            else:
                future.set_result(work._value)

        self.add_done_callback(forward)
        return future

    def __repr__(self) -> str:
        state = "pending"
        if self.is_completed():
            state = "failed" if self._error else "completed"
        return f"<Work {self.description} {state}>"


@runtime_checkable
class NativeWork(Protocol):
    """The public completion protocol a backend may return instead of a ``Work``; the kernel wraps it.

    Implemented by the backend (spmd-gloo's c10d handle, an MPI request, a
    CUDA event...); called only by the kernel, which owns everything else: the
    deadline, the flight-recorder entry, callbacks, futures and the error the
    user sees (``Work.from_native`` is the wrapper). So a backend never touches
    a Work's private state.

    ``poll() -> bool``
        True once the op finished, successfully or not. Never blocks; the
        watchdog calls it from its own thread to age outstanding Works.
    ``wait(timeout: float | None) -> bool``
        Block until the op finished (True) or ``timeout`` seconds passed
        (False: the op keeps running). None means no limit of the kernel's;
        the backend may still bound it with its own group timeout.
    ``abort() -> None``
        The kernel gave up on the op (its own deadline passed, in a wait or in
        the watchdog): release what can be released. The op may stay
        unfinished; it is never waited on again. A ``wait(timeout)`` that
        returns False is not an abort: the caller may wait again. Also called
        while another thread is inside ``wait`` (the group was given up on
        another rank): that wait should then return soon (True, with
        ``error()`` saying it was aborted), or it runs to its own timeout.
        Memory the op may still write must stay alive after an abort.
    ``error() -> BaseException | None``
        After the op finished: why it failed, or None. A timeout the backend
        detected itself should be a ``TimeoutError`` (the kernel words it as a
        CollectiveTimeoutError naming op, group and sequence number); anything
        else becomes a CollectiveError naming the op.

    Optional: ``add_done_callback(fn)``, calling ``fn()`` once from any thread
    when the op finished. Without it, the kernel runs one helper thread per
    Work that has callbacks or a future, blocked in ``wait(None)``.

    Optional, for device backends: ``wait_stream() -> bool``. A ``wait()``
    with no timeout then orders the caller's current device stream after the
    op instead of blocking the CPU, as torch's ProcessGroupNCCL does: True when
    it did (the op's completion still reaches the kernel through ``poll`` or
    the callback, and its deadline still holds), False to block the CPU as usual.
    """

    def poll(self) -> bool: ...

    def wait(self, timeout: float | None) -> bool: ...

    def abort(self) -> None: ...

    def error(self) -> BaseException | None: ...


class NativeWorkAdapter(Work):
    """The kernel's Work around a backend's ``NativeWork`` (made by ``Work.from_native``)."""

    _hooked = False

    def __init__(self, native: NativeWork) -> None:
        self.native = native

    def _settle(self, limit: float | None = None) -> None:
        error = self.native.error()
        if error is not None and isinstance(error, TimeoutError) and not isinstance(error, CollectiveTimeoutError):
            limit = self.default_timeout if limit is None else limit
            error = timeout_error(self.description, limit, str(error).split("\n", 1)[0])
        self._finish(None, error)

    def _wait_native(self, timeout: float | None) -> bool:
        if self._is_done:
            return True
        if not self.native.wait(timeout):
            return False
        self._settle(timeout)
        return True

    def wait(self, timeout: Timeout = None) -> bool:
        if timeout is None and not self._is_done:
            wait_stream = getattr(self.native, "wait_stream", None)
            if wait_stream is not None and wait_stream():  # ordered on the device: no CPU block
                if self.native.poll():
                    self._settle()
                else:
                    self._hook()  # the entry, callbacks and futures finish when the backend reports
                    return True
        return super().wait(timeout)

    def _hook(self) -> None:
        """Have the backend tell this Work when the op finished (its callback, or a waiting thread)."""
        if not self._hooked and not self._is_done:
            self._hooked = True
            hook = getattr(self.native, "add_done_callback", None)
            if hook is not None:
                hook(self._settle)
            else:
                threading.Thread(target=self._wait_native, args=(None,), name="spmd-native-wait", daemon=True).start()

    def is_completed(self) -> bool:
        if not self._is_done and self.native.poll():
            self._settle()
        return self._is_done

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        self._hook()
        super().add_done_callback(callback)

    def _abort(self) -> None:
        """The kernel gave up on the op: let the backend release it (``NativeWork.abort``)."""
        if not self._is_done:
            try:
                self.native.abort()
            except Exception:  # noqa: BLE001 - the timeout is the error to report, not the abort's
                pass

    def _timed_out(self, limit: float | None, own_deadline: bool) -> BaseException:
        if own_deadline:  # the op's own deadline: given up (a caller's shorter wait leaves it running)
            self._abort()
        return super()._timed_out(limit, own_deadline)

    def _expire(self, error: BaseException) -> None:
        self._abort()
        super()._expire(error)


def as_work(result: Work | NativeWork) -> Work:
    """What a backend method returned, as a Work: a Work as is, a NativeWork wrapped."""
    if isinstance(result, Work):
        return result
    return Work.from_native(result)


class WorkList(Work):
    """One Work that finishes when all of its parts have (used for batched p2p)."""

    def __init__(self, works: list[Work], value: Any = None) -> None:
        super().__init__()
        self._works = works
        # Waited on without a timeout, it waits as long as its slowest part's deadline (each part's is
        # attached by the kernel), so it never waits forever either.
        limits = [w.default_timeout for w in works if w.default_timeout is not None]
        if limits:
            self.default_timeout = max(limits)
        self._describe = lambda: "; ".join(w.description for w in works[:3]) + (f" and {len(works) - 3} more" if len(works) > 3 else "")
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


class ThenWork(Work):
    """A Work that is ``inner`` followed by ``after()`` (run once, only on success).

    Waiting waits on ``inner`` natively in the caller's thread: no callback hop
    and no helper thread, so many outstanding ops cannot starve each other.
    """

    def __init__(self, inner: Work, after: Callable[[], None]) -> None:
        super().__init__()
        self.inner = inner
        self._after = after
        self._ran = threading.Lock()
        self._hooked = False
        self.default_timeout = inner.default_timeout
        self._describe = lambda: inner.description

    def _settle(self, _: Work | None = None) -> None:
        if not self._ran.acquire(blocking=False):
            return
        error = self.inner.exception()
        if error is None:
            try:
                self._after()
            except BaseException as failure:  # noqa: BLE001 - delivered to the waiter
                error = failure
        self._finish(None, error)

    def _wait_native(self, timeout: float | None) -> bool:
        if not self._is_done:
            if not self.inner._wait_native(timeout):
                return False
            self._settle()
        return super()._wait_native(timeout)

    def is_completed(self) -> bool:
        if not self._is_done and self.inner.is_completed():
            self._settle()
        return self._is_done

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        if not self._hooked:
            self._hooked = True
            self.inner.add_done_callback(self._settle)
        super().add_done_callback(callback)
