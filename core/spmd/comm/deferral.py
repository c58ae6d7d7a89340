"""Deferred submission: an async call whose shape is new to its group returns at once on every backend.

On a backend that aborts the process on a size mismatch (Gloo: see
``Backend.aborts_on_size_mismatch``) such a call must be compared across the
ranks before the backend sees it, and that comparison waits for every rank.
An async call does not wait for it: the group's ops go into a ``Gate`` that
queues them in call order, and one thread runs the comparison and then hands
the queued ops to the backend in that same order (the order every rank
submits in, which the backend relies on). Once the queue is empty the group's
ops go straight to the backend again, so the common case costs nothing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from spmd.comm.backend import Backend
from spmd.comm.group import ProcessGroup
from spmd.comm.work import NativeWork, Work

#: The backend methods that submit an op (everything else the gate passes through).
SUBMITTING = frozenset({
    "all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "gather", "scatter", "barrier", "isend", "irecv",
})

#: What the thread runs before the queued ops after it: the comparison of a call new to the group;
#: None when the ranks agreed, else the failed Work to hand on (see ``lifecycle._check_first_call``).
Check = Callable[[], "Work | None"]


class Gate:
    """Stands in for a group's backend on one device while calls wait on an agreement: submitting
    methods queue, everything else is the backend's."""

    def __init__(self, backend: Backend, group: ProcessGroup, device: torch.device) -> None:
        self._backend, self._group, self._device = backend, group, device
        self._lock = threading.Lock()
        self._queue: deque[tuple[Check | None, Callable[..., Any] | None, tuple, Work | None]] = deque()
        self._running = False

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._backend, name)
        if name not in SUBMITTING:
            return attribute

        def queued(*args: Any) -> Work:
            work = Work()
            self._put(None, attribute, args, work)
            return work

        return queued

    def check_first(self, check: Check) -> None:
        """Queue the comparison of a call new to the group ahead of the ops that follow it."""
        self._put(check, None, (), None)

    def _put(self, check: Check | None, submit: Callable[..., Any] | None, args: tuple, work: Work | None) -> None:
        with self._lock:
            self._queue.append((check, submit, args, work))
            if self._running or submit is None:  # (the thread starts with the op that follows a check:
                return                           # until then the caller may still queue it)
            self._running = True
        threading.Thread(target=self._drain, name=f"spmd-deferred-{self._group.name}", daemon=True).start()

    def _drain(self) -> None:
        """Run the queue in order; once it is empty give the device back to the backend."""
        refused: Work | None = None
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    if self._group.backends_by_device.get(self._device) is self:  # (not if the group was given up)
                        self._group.backends_by_device[self._device] = self._backend
                    return
                check, submit, args, work = self._queue.popleft()
            if check is not None:
                refused = refused or _run_check(check)
                continue
            assert submit is not None and work is not None
            if refused is not None or self._group.unusable is not None:
                _fail_like(work, refused, self._group)
                continue
            try:
                _link(submit(*args), work)
            except Exception as error:  # noqa: BLE001 - the backend refused the op: its Work fails with why
                work._finish(None, error)


def _run_check(check: Check) -> Work | None:
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - a comparison that could not run refuses what follows it
        return Work.failed(error)


def _fail_like(work: Work, refused: Work | None, group: ProcessGroup) -> None:
    """Fail an op that was never submitted: with the comparison's error, or the group's refusal."""
    if refused is not None and refused._error is not None:
        work._explained = refused._explain(refused._error)  # (already explained: not again)
        work._finish(None, refused._error)
    else:
        error = group.refusal()
        work._explained = error
        work._finish(None, error)


def _link(native: Work | NativeWork, work: Work) -> None:
    """Finish ``work`` when the backend's own handle finishes, with its value or error."""
    if isinstance(native, Work):
        native.add_done_callback(lambda done: work._finish(done._value, done._error))
        return
    if callable(getattr(native, "add_done_callback", None)):
        native.add_done_callback(lambda: work._finish(None, native.error()))  # type: ignore[attr-defined]
        return

    def wait() -> None:
        native.wait(None)
        work._finish(None, native.error())

    threading.Thread(target=wait, name="spmd-deferred-wait", daemon=True).start()


def gate_for(group: ProcessGroup, backend: Backend | Gate, device: torch.device) -> Gate:
    """The group's gate on ``device``: the one queueing already, or a new one put in the backend's place."""
    if isinstance(backend, Gate):
        return backend
    gate = Gate(backend, group, device)
    group.backends_by_device[device] = gate  # type: ignore[assignment]  # (ops routed from now on queue behind it)
    return gate
