"""The kernel's error for an op that failed or timed out: the backend's message plus who is stuck where."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from spmd.errors import CollectiveError, CollectiveTimeoutError, SpmdError

if TYPE_CHECKING:
    from spmd.debug.recorder import Entry


class FailedGroup(Protocol):
    """What the explanation reads of the op's group (a ProcessGroup; a Protocol keeps this module below it)."""

    unusable: str | None

    def describe(self, op: str, seq: int = -1) -> str: ...


def explain_failure(group: FailedGroup, entry: Entry, error: BaseException) -> BaseException:
    """``error`` rewritten to name the op, group and sequence number, with the watchdog's diagnosis.

    Called only on the error path (by ``Work.wait``, through ``ProcessGroup.explain_failure``), so the hot path builds no closures for it.
    """
    from spmd.comm.health.watchdog import adopt_announcements, diagnose

    if group.unusable is None:
        adopt_announcements()  # a peer that gave the group up may be why this op broke
    desc = group.describe(entry.op, entry.seq)
    if not isinstance(error, (CollectiveTimeoutError, CollectiveError)):
        if isinstance(error, SpmdError) or not isinstance(error, Exception):
            return error
        # A backend's own exception (a peer vanished, a socket closed): name the op it broke.
        error = CollectiveError(f"{desc} failed in the backend: {type(error).__name__}: {error}")
    what = "timed out" if isinstance(error, CollectiveTimeoutError) else "failed"
    text = str(error) if str(error).startswith(desc) else f"{desc} {what}: {error}"
    meanwhile = ""
    own = f"{entry.op} #{entry.seq} failed on this rank"
    if group.unusable is not None and group.unusable not in text and not group.unusable.startswith(own):
        # another rank (or this rank's watchdog) gave up on the group while this op waited
        meanwhile = f"\n  meanwhile the group was given up on: {group.unusable}"
    explained = type(error)(f"{text}{meanwhile}{diagnose(group, entry, what)}")
    # The message already carries the original one: chaining it would print the error twice.
    explained.__cause__ = None
    explained.__suppress_context__ = True
    return explained
