"""Set-up agreement: every rank of a group passes the same signature (a model's parameters, a plan, a schedule),
or every rank raises the same error naming the first difference.

Strategies call it once at set-up, so ranks that would otherwise exchange
the wrong bytes and train on garbage without an error stop at once instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmd.comm.group import ProcessGroup
from spmd.comm.objects import all_gather_object
from spmd.errors import SpmdError


def verify_agreement(entries: Sequence[object], group: ProcessGroup, who: str, what: str, fix: str) -> None:
    """Raise the same error on every rank of ``group`` unless every rank passed equal ``entries`` (a set-up's
    signature: a strategy's parameters, a plan, a schedule), naming the first entry that differs."""
    if group.size == 1:
        return
    mine = list(entries)
    everyone: list[object] = [None] * group.size
    all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        assert isinstance(theirs, list) and isinstance(reference, list)
        detail = f"rank 0 has {len(reference)} entries, group rank {rank} has {len(theirs)}"
        for index, (ours_entry, their_entry) in enumerate(zip(reference, theirs)):
            if ours_entry != their_entry:
                detail = f"entry #{index}: rank 0 has {ours_entry}, group rank {rank} has {their_entry}"
                break
        raise SpmdError(f"{who}: the ranks of group {group.name!r} {what}: {detail}. {fix}")
