"""What surrounds the submission of every op: the cross-rank checks, flight recording, and waiting.

``begin`` (``begin_sized`` for ops whose buffers must match in size across
ranks) runs before the backend gets the op, ``complete`` right after: it
records the op, attaches the timeout, group and entry to the Work, and waits
for it unless the caller asked for an async op (a backend's own handle is
waited on directly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spmd.comm import deferral
from spmd.comm.backend import Backend
from spmd.comm.group import ProcessGroup
from spmd.comm.health import desync
from spmd.comm.health.watchdog import adopt_announcements, diagnose
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import NativeWork, NativeWorkAdapter, Timeout, Work, seconds
from spmd.debug.recorder import Entry, recorder, shapes_and_dtypes
from spmd.debug.signatures import disagreement
from spmd.errors import CollectiveDesyncError, CollectiveError, CollectiveTimeoutError

#: Whether a call shape new to its group is compared across its ranks (before the op on Gloo, before its
#: result is handed back elsewhere). Always on; benchmarks/mismatch_check_cost.py turns it off to time it.
agree_first_calls = True


class Unagreed:
    """A call shape new to its group, on a backend that survives a size mismatch (MPI, UCC, ...): its
    signature was posted before the op; ``complete`` hands the result back only once every rank's agrees."""

    __slots__ = ("entry", "root", "splits", "timeout")

    def __init__(self, entry: Entry, root: int | None, splits: tuple[Sequence[int], Sequence[int]] | None, timeout: Timeout) -> None:
        self.entry, self.root, self.splits, self.timeout = entry, root, splits, timeout

    def agree(self, group: ProcessGroup) -> None:
        """Wait (bounded) for every rank's signature of this call; a disagreement breaks the group and raises."""
        entry = self.entry
        limit = group.timeout_s if self.timeout is None else seconds(self.timeout)
        try:
            desync.compare(group, entry, self.root, self.splits, limit)
        except CollectiveDesyncError as error:
            _break_on_disagreement(group, entry, error)
            raise _diagnosed(group, entry, error) from None
        except CollectiveTimeoutError as error:  # the op finished here (a root's send); a peer never called it
            group.mark_unusable(f"{entry.op} #{entry.seq} was never called by every rank ({str(error).splitlines()[0]}); "
                                "destroy it and create a new group, or restart the job")
            raise


#: What ``begin`` hands ``complete``: the recorded entry, or the op, its tensors' shapes and dtypes
#: (``recorder.shapes_and_dtypes``, computed once per op) and reduce op to record; or for all_to_all_single
#: the op, its tensors, no reduce op, no peer and its splits (``recorder.start``'s arguments).
Call = (Entry | Unagreed | tuple[str, tuple[torch.Size, ...], tuple[torch.dtype, ...], ReduceOp | None]
        | tuple[str, Sequence[torch.Tensor], None, None, tuple[Sequence[int], Sequence[int]]])


def begin(
    group: ProcessGroup,
    op: str,
    tensors: Sequence[torch.Tensor],
    reduce_op: ReduceOp | None = None,
    root: int | None = None,
    splits: tuple[Sequence[int], Sequence[int]] | None = None,
    timeout: Timeout = None,
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
        desync.check(group, entry, root, splits, None if timeout is None else seconds(timeout))
        return entry
    if splits is not None:  # recorded with the entry: the always-on check compares them across ranks
        return (op, tensors, None, None, splits)
    return (op, *shapes_and_dtypes(tensors), reduce_op)


def begin_sized(
    group: ProcessGroup,
    op: str,
    tensors: Sequence[torch.Tensor],
    reduce_op: ReduceOp | None,
    root: int | None,
    splits: tuple[Sequence[int], Sequence[int]] | None,
    backend: Backend,
    timeout: Timeout,
    async_op: bool,
    splits_given: bool = False,
) -> tuple[Call | Work, Backend]:
    """``begin`` for an op whose ranks' buffers must match in size: on a backend that aborts on a
    mismatch, a call shape new to the group is first compared across its ranks.

    ``splits_given``: all_to_all_single's split sizes came from the caller, not
    from its tensors' shapes. One rank may then change its own rows while the
    others' calls stay the same, so such a call is compared at every call (a
    per-rank cache would send only that rank into the comparison).

    Returns what ``complete`` needs (or, for an op refused by the cross-rank
    check, the failed Work to hand the caller instead of submitting) and the
    backend to submit to: the group's ``deferral.Gate`` while an async call's
    comparison is pending (it queues the ops and submits them, in order, once
    the ranks agreed), so an async call returns at once on every backend.
    """
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    if len(tensors) == 1:  # shapes_and_dtypes, inline: this runs once per op (and the recorder reuses them)
        tensor = tensors[0]
        shapes, dtypes = (tensor.shape,), (tensor.dtype,)
    else:
        shapes, dtypes = shapes_and_dtypes(tensors)
    if group.size > 1 and agree_first_calls and not desync.on:
        if splits is None:
            shape: tuple = (op, shapes, dtypes, reduce_op, root)
        else:
            shape = (op, shapes, dtypes, reduce_op, root, tuple(map(tuple, splits)))
        if shape not in group.agreed_calls:
            entry = recorder.start(group.name, group.next_seq(), op, tensors, reduce_op, None, splits)
            if not backend.aborts_on_size_mismatch:  # the op may run; its result is handed back once agreed
                desync.post(group, entry, root)
                if not splits_given:
                    group.agreed_calls.add(shape)
                return Unagreed(entry, root, splits, timeout), backend
            if async_op:  # compared in the gate's thread; this op and the group's next ones queue behind it
                gate = deferral.gate_for(group, backend, tensors[0].device)
                gate.check_first(lambda: _check_first_call(group, entry, root, splits, timeout, True))
                if not splits_given:
                    group.agreed_calls.add(shape)
                return entry, gate  # type: ignore[return-value]  # (a Gate stands in for the backend)
            refused = _check_first_call(group, entry, root, splits, timeout, async_op)
            if refused is not None:
                return refused, backend
            if not splits_given:
                group.agreed_calls.add(shape)
            return entry, backend
    if desync.on or splits is not None:
        return begin(group, op, tensors, reduce_op, root, splits, timeout), backend
    return (op, shapes, dtypes, reduce_op), backend  # begin's common case, without its frame


def _diagnosed(group: ProcessGroup, entry: Entry, error: CollectiveDesyncError) -> CollectiveDesyncError:
    """``error`` as it stands when every rank's call was compared (it names them all); when another check found
    the disagreement first (``found_elsewhere``: the peers may be stuck inside the backend), with the watchdog's
    diagnosis and every rank's flight recorder dumped, as a failed op's error has."""
    if not getattr(error, "found_elsewhere", False):
        return error
    return CollectiveDesyncError(f"{error}{diagnose(group, entry, 'failed')}")


def _break_on_disagreement(group: ProcessGroup, entry: Entry, error: CollectiveDesyncError) -> None:
    """As the always-on check would a moment later, but at once, on every rank: the group is given up."""
    calls = "; ".join(line.strip() for line in str(error).splitlines()[1:1 + group.size])
    _, found, splits = str(error).partition("; all_to_all_single splits disagree: ")
    calls += f"; splits disagree: {splits}" if found else ""
    group.mark_unusable(disagreement(entry.seq, group.name, f" ({calls}); destroy it and create a new group, or restart the job"))


def _complete_unagreed(work: Work | NativeWork, group: ProcessGroup, op: str, call: Unagreed, async_op: bool,
                       after: Callable[[], None] | None, timeout: Timeout, result: torch.Tensor | None) -> Work | None:
    """``complete`` for a call shape new to the group: the op's Work is followed by the agreement of every
    rank's signature (waited in the caller's thread, or where the op completes for callbacks and futures),
    so a mismatched first call fails on every rank instead of handing back garbage. An op that failed
    skips the comparison: its own error (a dead peer, a timeout) stands."""
    if not async_op:
        complete(work, group, op, call.entry, False, None, timeout)
        call.agree(group)
        if after is not None:
            after()
        return None
    done = complete(work, group, op, call.entry, True, None, timeout, result)
    assert done is not None
    agreed = done.then(lambda: call.agree(group))
    if after is not None:
        agreed = agreed.then(after)
    agreed._entry, agreed._group = call.entry, group
    if result is not None:
        agreed._value = [result]
    return agreed


def _check_first_call(group: ProcessGroup, entry: Entry, root: int | None, splits: tuple[Sequence[int], Sequence[int]] | None,
                      timeout: Timeout, async_op: bool) -> Work | None:
    """All ranks compare a call shape new to this group before the backend sees it (see ``Backend.aborts_on_size_mismatch``).

    The call waits for the other ranks' shapes (a store round trip once per
    shape; an async call runs this in its group's ``deferral.Gate`` thread
    instead, with ``async_op`` True). A disagreement is a CollectiveDesyncError naming
    every rank's call, on every rank before any issued the op (raised, or for an
    async op returned as its failed Work); the group is then unusable, as after any mismatch. A rank that never makes the call ends the wait as the
    op's own timeout would, with the same diagnosis (the op, its group and
    sequence number, the ranks that never arrived), and leaves the group
    unusable: raised, or for an async op returned as the failed Work. A group
    given up while this rank waits (a peer's call raised, the always-on check
    found its ranks out of step) ends the wait at once, with that reason.
    """
    limit = group.timeout_s if timeout is None else seconds(timeout)
    try:
        desync.check(group, entry, root, splits, limit)
    except CollectiveDesyncError as found:
        error = _diagnosed(group, entry, found)
        entry.finish(error)
        _break_on_disagreement(group, entry, found)
        if not async_op:
            raise error from None
        refused = _failed_call(group, entry, limit)
        refused._finish(None, error)  # (an async call's failure is its Work's, as on every backend)
        return refused
    except CollectiveTimeoutError:
        ended = _failed_call(group, entry, limit)
        failure = ended._timed_out(limit, own_deadline=True)
    except CollectiveError as given_up:  # the group was given up while this rank waited (see desync.check)
        ended = _failed_call(group, entry, limit)
        ended._finish(None, given_up)
        failure = ended._explain(given_up)  # (with the diagnosis and the dumps, as any failed op's)
    else:
        return None
    if not async_op:
        raise failure from None
    ended._finish(None, failure)
    return ended


def _failed_call(group: ProcessGroup, entry: Entry, limit: float | None) -> Work:
    """The Work of a call that the pre-op check ended: its error is explained like a submitted op's."""
    work = Work()
    work.default_timeout, work._entry, work._group = limit, entry, group
    return work


def _record(group: ProcessGroup, call: Call, done: bool = False) -> Entry:
    """The op's flight-recorder entry: ``begin``'s, or recorded now (``done``: as already completed)."""
    if isinstance(call, Entry):
        return call
    if isinstance(call, Unagreed):
        return call.entry
    seq = group.seq  # group.next_seq(), inline: this runs once per op
    group.seq = seq + 1
    if len(call) == 4:
        return recorder.start(group.name, seq, call[0], (), call[3], done=done, shaped=(call[1], call[2]))
    return recorder.start(group.name, seq, *call, done=done)


def complete(
    work: Work | NativeWork,
    group: ProcessGroup,
    op: str,
    call: Call,
    async_op: bool,
    after: Callable[[], None] | None = None,
    timeout: Timeout = None,
    result: torch.Tensor | None = None,
    describe: Callable[[], str] | None = None,
) -> Work | None:
    """Record the submitted op, attach its timeout (the group's unless ``timeout``), group and entry to ``work``; wait unless ``async_op``.

    ``result``: the op's output tensor; an async Work's value (``result()``,
    ``get_future().value()``) is then ``[result]``, as torch's Work's.
    ``describe``: makes the op's description for an error, where the group's
    description of ``op`` is not enough (a point-to-point op names its peer).

    The hot path of every op: a few attribute stores, no closures. The
    description and the diagnosis of a failure are derived from the group and
    the entry only when an error needs them (``Work.description``, ``Work._explain``).
    An async Work is handed to the watchdog with its deadline (now + the
    timeout): if nobody waits on it and it outlives that, the watchdog fails it
    (see ``spmd.comm.work`` for the order in which timeouts nest).
    """
    if type(call) is Unagreed:
        return _complete_unagreed(work, group, op, call, async_op, after, timeout, result)
    if not isinstance(work, Work):  # the backend returned its own handle (the NativeWork protocol)
        if not async_op and not hasattr(work, "wait_stream"):
            if type(call) is tuple and len(call) == 4 and work.poll() and work.error() is None:
                # Done at submission (spmd-shm's small ops, when the peers were there first): recorded
                # as completed in one Record, as a kernel Work that already succeeded is below.
                seq = group.seq
                group.seq = seq + 1
                recorder.completed(group.name, seq, call[0], call[1], call[2], call[3])
                if after is not None:
                    after()
                return None
            _wait_here(work, group, op, call, after, timeout, describe)
            return None
        work = NativeWorkAdapter(work)  # (Work.from_native also checks the methods: not on the hot path)
    succeeded = work._is_done and work._error is None
    if succeeded and type(call) is tuple and len(call) == 4 and (after is None or not async_op):
        # Already succeeded (Work.completed(), a fast worker thread): recorded as completed in one
        # Record (see spmd.debug.recorder), and a synchronous op needs nothing more.
        seq = group.seq  # group.next_seq(), inline: this runs once per op
        group.seq = seq + 1
        record = recorder.completed(group.name, seq, call[0], call[1], call[2], call[3])
        if not async_op:
            if after is not None:
                after()
            return None
        work.default_timeout = group.timeout_s if timeout is None else seconds(timeout)
        work._entry, work._group = record, group
        if result is not None and work._value is None:
            work._value = [result]
        return work
    # Otherwise an Entry: the Work finishes it (one that already succeeded is recorded as completed).
    entry = _record(group, call, done=succeeded)
    if succeeded and not async_op and after is None and entry is not call:
        return None
    limit = group.timeout_s if timeout is None else seconds(timeout)
    work.default_timeout = limit
    work._entry = entry
    work._group = group
    if work._is_done:  # finished before it had an entry to finish (no-op if recorded as completed above)
        entry.finish(work._error)
    if describe is not None:  # point-to-point: "isend to rank 3 (tag 0)"
        work._describe = describe
    elif op != entry.op:
        work._describe = lambda: group.describe(op)
    if async_op:
        if after is not None:
            work = work.then(after)
            work._entry, work._group = entry, group
        if result is not None and work._value is None:
            work._value = [result]  # (kept by _finish, which stores only a value that is not None)
        if not work._is_done:  # (a finished Work has nothing left to age)
            recorder.watch(entry, work, limit)
        return work
    if not work._is_done:
        blocked = group.blocked
        blocked.add(work)  # (given up with the group: fail_pending ends this wait)
        if group.unusable is not None:  # given up between the submission and the line above: fail_pending missed it
            work._expire(group.refusal())
        try:
            work.wait()  # the synchronous path waits natively, with no callback hop
        finally:
            blocked.discard(work)
    elif work._error is not None:
        work.wait()  # raises it, explained
    if after is not None:
        after()
    return None


def _wait_here(
    native: NativeWork, group: ProcessGroup, op: str, call: Call, after: Callable[[], None] | None, timeout: Timeout,
    describe: Callable[[], str] | None = None,
) -> None:
    """A synchronous op on a backend's own handle: record it, wait on the handle itself, done.

    The hot path of every blocking collective on Gloo, MPI and UCX: no kernel
    Work is made unless the op fails or runs out of time, when one is, so the
    error is explained exactly as a waited Work's would be.
    """
    entry = _record(group, call)
    limit = group.timeout_s if timeout is None else seconds(timeout)
    blocked = group.blocked
    blocked.add(native)  # (given up with the group: fail_pending aborts it, ending this wait)
    if group.unusable is not None:  # given up between the submission and the line above: fail_pending missed it
        native.abort()
    try:
        finished = native.wait(limit)
    finally:
        blocked.discard(native)
    if finished and native.error() is None:
        entry.finish(None)
        if after is not None:
            after()
        return None
    work = NativeWorkAdapter(native)
    work.default_timeout, work._entry, work._group = limit, entry, group
    if describe is not None:  # point-to-point: "isend to rank 3 (tag 0)"
        work._describe = describe
    elif op != entry.op:
        work._describe = lambda: group.describe(op)
    if finished and group.unusable is None:
        adopt_announcements()  # failed: a peer that gave the group up and left (closing its connections)?
    if finished and group.unusable is not None:  # aborted, or broken by a peer that gave the group up
        given_up = group.refusal()
        work._finish(None, given_up)
        raise work._explain(given_up)
    if not native.poll():
        raise work._timed_out(limit, own_deadline=True)
    work.wait()  # finished with an error: raises it, explained
    return None
