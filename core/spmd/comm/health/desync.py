"""Desync checks: before each collective, all ranks compare what they are about to call.

On (``SPMD_DESYNC_CHECK=1``) every collective costs one store ``set`` and a
wait on the group's other keys — a store round trip per rank, on loopback
about 0.2-1 ms per collective — so it is a debugging mode, off by default.
A mismatch raises the same error, with every rank's call side by side, on
every rank; a rank that never makes the call shows up as missing at the
group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spmd import settings
from spmd.comm.store_wait import missing_keys
from spmd.debug.recorder import Entry
from spmd.debug.signatures import call_signature, split_mismatch
from spmd.errors import CollectiveDesyncError, CollectiveError, CollectiveTimeoutError
from spmd.polling import poll


def _read_switch() -> bool:  # (at import: a malformed value is named by spmd.init, not by the import)
    return settings.at_import().desync_check


#: Whether checks are on (``SPMD_DESYNC_CHECK``; read at import and at each ``spmd.init``).
#: A plain module attribute: the kernel tests it before every collective.
on: bool = _read_switch()


def refresh() -> None:
    """Re-read ``SPMD_DESYNC_CHECK``."""
    global on
    on = settings.current().desync_check


def check(
    group: Any, entry: Entry, root: int | None = None, splits: tuple[Sequence[int], Sequence[int]] | None = None,
    timeout_s: float | None = None,
) -> None:
    """Raise CollectiveDesyncError on every rank unless all ranks of ``group`` make the same call.

    ``splits`` (all_to_all_single's input and output split sizes) are checked
    across ranks: what rank i sends to rank j is what rank j expects from i.
    Waits up to ``timeout_s`` (default: the group's) for the other ranks.
    """
    post(group, entry, root)
    compare(group, entry, root, splits, timeout_s)


def _prefix(group: Any, entry: Entry) -> str:
    return f"spmd/debug/desync/{group.uid}/{entry.seq}/"


def post(group: Any, entry: Entry, root: int | None = None) -> None:
    """Publish this rank's signature of ``entry``'s call (one store ``set``): the first half of ``check``,
    for a caller that compares only after its op ran (``compare``)."""
    group.root_store.set(_prefix(group, entry) + str(group.rank), call_signature(entry, root))


def compare(
    group: Any, entry: Entry, root: int | None = None, splits: tuple[Sequence[int], Sequence[int]] | None = None,
    timeout_s: float | None = None,
) -> None:
    """The second half of ``check``: wait for every rank's posted signature and raise CollectiveDesyncError
    on every rank unless they agree (CollectiveTimeoutError naming the ranks that never posted)."""
    limit = group.timeout_s if timeout_s is None else timeout_s
    store = group.root_store
    prefix = _prefix(group, entry)
    mine = call_signature(entry, root)  # (with the entry's splits, for all_to_all_single)
    keys = [prefix + str(r) for r in range(group.size)]
    def out_of_step() -> None:  # while this rank waits, the always-on check or a peer's failed call may give the group up
        if group.unusable is None:
            return
        if group.disagreed_at == entry.seq:  # (the always-on check, or a peer, found this very call's disagreement first)
            found = CollectiveDesyncError(f"{group.describe(entry.op, entry.seq)}: the ranks' calls disagree: {group.unusable}")
            found.found_elsewhere = True  # type: ignore[attr-defined]  # (the caller adds the diagnosis and the dumps)
            raise found
        raise CollectiveError(f"{group.describe(entry.op, entry.seq)}: stopped waiting for the other ranks' calls: "
                                  f"the group cannot be used: {group.unusable}")

    missing = [group.ranks[r] for r in missing_keys(store, keys, limit, out_of_step)]
    if missing:
        raise CollectiveTimeoutError(
            f"desync check: {entry.op} on group {group.name!r} seq {entry.seq}: ranks {missing} never made "
            f"this call within {limit:.1f} s (this rank calls {mine})"
        )
    calls = [store.get(key).decode() for key in keys]
    if on and entry.seq >= 2:  # (every call compared: every rank read seq - 2. A first-call comparison
        # after an async op may still be due on a peer: those keys stay, one per call shape)
        store.delete_key(f"spmd/debug/desync/{group.uid}/{entry.seq - 2}/{group.rank}")
    bare = {call.partition(" splits ")[0] for call in calls}
    split_problem = split_mismatch(calls, group.ranks) if splits is not None and len(bare) == 1 else None
    if len(bare) > 1 or split_problem is not None:
        # Every rank is about to raise (and maybe exit); let all finish reading first, since
        # the rank hosting the store takes it along when it exits.
        try:
            store.add(prefix + "read", 1)
            poll(lambda: int(store.add(prefix + "read", 0)) >= group.size, 2.0, 0.01)
        except Exception:  # noqa: BLE001 - a faster rank left with the store; we read what we need
            pass
        table = "\n".join(f"    rank {group.ranks[r]}: {call}" for r, call in enumerate(calls))
        raise CollectiveDesyncError(
            f"ranks disagree on collective #{entry.seq} of group {group.name!r}:\n{table}\n"
            "every rank of a group must make the same collective calls, in the same order, "
            "with matching shapes and dtypes" + (f"; all_to_all_single splits disagree: {split_problem}" if split_problem else "")
        )
