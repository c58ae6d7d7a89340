"""What surrounds the submission of every op: the desync check, flight recording, and waiting.

``begin`` runs before the backend gets the op, ``complete`` right after: it
records the op, attaches the timeout, group and entry to the Work, and waits
for it unless the caller asked for an async op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import NativeWork, NativeWorkAdapter, Timeout, Work, seconds
from spmd.debug import desync
from spmd.debug.recorder import Entry, recorder

#: What ``begin`` hands ``complete``: the recorded entry, or the op, tensors and reduce op to record
#: (all_to_all_single adds no peer and its splits: ``recorder.start``'s further arguments).
Call = Entry | tuple[str, Sequence[torch.Tensor], ReduceOp | None] | tuple[str, Sequence[torch.Tensor], None, None, tuple[Sequence[int], Sequence[int]]]


def begin(
    group: ProcessGroup,
    op: str,
    tensors: Sequence[torch.Tensor],
    reduce_op: ReduceOp | None = None,
    root: int | None = None,
    splits: tuple[Sequence[int], Sequence[int]] | None = None,
) -> Call:
    """What must precede submitting an op: nothing, or with the desync check on, recording and checking it.

    Recording (sequence number, flight-recorder entry) otherwise waits for
    ``complete``, which runs once the backend has the op: Python run between
    one collective's end and the next one's submission delays both ranks (the
    flight-recorder entry alone measured ~7 us there on the 2-core host), while
    run after submission it overlaps the transfer.
    """
    if desync.on:
        entry = recorder.start(group.name, group.next_seq(), op, tensors, reduce_op, None, splits)
        desync.check(group, entry, root, splits)
        return entry
    if splits is not None:  # recorded with the entry: the always-on check compares them across ranks
        return (op, tensors, None, None, splits)
    return (op, tensors, reduce_op)


def complete(
    work: Work | NativeWork,
    group: ProcessGroup,
    op: str,
    call: Call,
    async_op: bool,
    after: Callable[[], None] | None = None,
    timeout: Timeout = None,
) -> Work | None:
    """Record the submitted op, attach its timeout (the group's unless ``timeout``), group and entry to ``work``; wait unless ``async_op``.

    The hot path of every op: a few attribute stores, no closures. The
    description and the diagnosis of a failure are derived from the group and
    the entry only when an error needs them (``Work.description``, ``Work._explain``).
    An async Work is handed to the watchdog with its deadline (now + the
    timeout): if nobody waits on it and it outlives that, the watchdog fails it
    (see ``spmd.comm.work`` for the order in which timeouts nest).
    """
    if not isinstance(work, Work):  # the backend returned its own handle (the NativeWork protocol)
        if not async_op and not hasattr(work, "wait_stream"):
            _wait_here(work, group, op, call, after, timeout)
            return None
        work = NativeWorkAdapter(work)  # (Work.from_native also checks the methods: not on the hot path)
    # A Work that already succeeded (Work.completed(), a fast worker thread) is recorded as completed
    # in one step; a synchronous one then needs nothing more.
    succeeded = work._is_done and work._error is None
    if isinstance(call, Entry):
        entry = call
    else:
        seq = group.seq
        group.seq = seq + 1
        entry = recorder.start(group.name, seq, *call, done=succeeded)
        if succeeded and not async_op and after is None:
            return None
    limit = group.timeout_s if timeout is None else seconds(timeout)
    work.default_timeout = limit
    work._entry = entry
    work._group = group
    if work._is_done:  # finished before it had an entry to finish (no-op if recorded as completed above)
        entry.finish(work._error)
    if op != entry.op:  # point-to-point: "isend to rank 3 (tag 0)"
        work._describe = lambda: group.describe(op)
    if async_op:
        if after is not None:
            work = work.then(after)
            work._entry, work._group = entry, group
        if not work._is_done:  # (a finished Work has nothing left to age)
            recorder.watch(entry, work, limit)
        return work
    if not work._is_done or work._error is not None:
        work.wait()  # the synchronous path waits natively, with no callback hop
    if after is not None:
        after()
    return None


def _wait_here(native: NativeWork, group: ProcessGroup, op: str, call: Call, after: Callable[[], None] | None, timeout: Timeout) -> None:
    """A synchronous op on a backend's own handle: record it, wait on the handle itself, done.

    The hot path of every blocking collective on Gloo, MPI and UCX: no kernel
    Work is made unless the op fails or runs out of time, when one is, so the
    error is explained exactly as a waited Work's would be.
    """
    if isinstance(call, Entry):
        entry = call
    else:
        seq = group.seq
        group.seq = seq + 1
        entry = recorder.start(group.name, seq, *call)
    limit = group.timeout_s if timeout is None else seconds(timeout)
    if native.wait(limit) and native.error() is None:
        entry.finish(None)
        if after is not None:
            after()
        return None
    work = NativeWorkAdapter(native)
    work.default_timeout, work._entry, work._group = limit, entry, group
    if op != entry.op:  # point-to-point: "isend to rank 3 (tag 0)"
        work._describe = lambda: group.describe(op)
    if not native.poll():
        raise work._timed_out(limit, own_deadline=True)
    work.wait()  # finished with an error: raises it, explained
    return None
