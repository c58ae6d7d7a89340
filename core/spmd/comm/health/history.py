"""The always-on mismatch check: every rank compares each group's op history with a neighbour's.

A collective whose ranks disagree (SUM on one, MAX on the other; float32
against int32; 4 elements against 1000) often completes on every rank with a
wrong value and no error. Desync mode (``SPMD_DESYNC_CHECK=1``) stops such a
call before it runs, at a store round trip per op. This check costs the hot
path one deque append per op: the flight recorder keeps each group's recent
Entries, and every watchdog step (0.2 s) each rank publishes the signatures
of the calls it made since its last step (op, dtypes, shapes where they must
match, reduce op, all_to_all_single's splits) and compares them, sequence number by sequence number,
with those of the next rank of the group (a ring: any disagreement shows
between some pair of neighbours). At the first difference the group is
marked unusable with both calls named, the other ranks learn it through the
watchdog's announcement, and the next op on the group raises on every rank.

What it cannot do: stop the mismatched op itself (its result may be wrong),
or the ops that complete in the watchdog step before the error is found; an
op whose mismatch makes the backend abort the process (Gloo, buffers of
different byte sizes) is beyond it. Desync mode is the strict check.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

from spmd.debug.recorder import recorder
from spmd.debug.signatures import call_signature, disagreement, pair_split_mismatch

HISTORY_KEY = "spmd/debug/history/{group}/{rank}"
#: The store's logical clock: numbers published call histories and announcements that a rank gave a group up
#: (spmd.comm.health.watchdog), in store order, so a rank tells this world's from an earlier world's on the same
#: store without comparing hosts' wall clocks.
CLOCK = "spmd/debug/clock"
#: Calls per group in each published payload (each step publishes the newest ones).
PUBLISHED = 256


class HistoryCheck:
    """One rank's side of the check; run by the watchdog thread (``step``) on the watchdog's store client."""

    def __init__(self, client: Any, lock: threading.Lock, rank: int, world_from: int) -> None:
        self.client = client
        self.lock = lock
        self.rank = rank
        self.world_from = world_from  # histories numbered up to it are an earlier world's (see watchdog.CLOCK)
        self.calls: dict[str, collections.deque[tuple[int, str]]] = {}  # group uid -> its newest (seq, signature)s
        self.checked: dict[str, int] = {}  # group uid -> the highest seq compared with the neighbour

    def step(self, groups: list[Any]) -> None:
        """Publish each group's new calls and compare with the neighbour's (one set and one get per active group)."""
        for group in groups:
            if group.unusable is not None or group.size < 2:
                continue
            mine = self._record(group)
            if mine is None:
                continue
            neighbour = group.ranks[(group.rank + 1) % group.size]
            theirs = self._read(group.uid, neighbour)
            if theirs:
                self._compare(group, neighbour, mine, theirs)

    def unchecked(self, group: Any) -> bool:
        """Whether this rank made calls on ``group`` that were not yet compared with the neighbour's."""
        calls = self.calls.get(group.uid)
        return calls is not None and bool(calls) and calls[-1][0] > self.checked.get(group.uid, -1)

    def _record(self, group: Any) -> collections.deque[tuple[int, str]] | None:
        """This rank's newest calls on ``group``, updated and published; None if it made none yet."""
        calls = self.calls.get(group.uid)
        last = calls[-1][0] if calls else -1
        new = [(e.seq, call_signature(e)) for e in recorder.history(group.name, after=last)]
        if calls is None:
            if not new:
                return None
            calls = self.calls[group.uid] = collections.deque(maxlen=PUBLISHED)
        if new:
            calls.extend(new)
            with self.lock:
                number = int(self.client.add(CLOCK, 1))
                self.client.set(HISTORY_KEY.format(group=group.uid, rank=self.rank), json.dumps({"n": number, "calls": list(calls)}))
        return calls

    def _read(self, uid: str, rank: int) -> dict[int, str]:
        key = HISTORY_KEY.format(group=uid, rank=rank)
        with self.lock:
            raw = self.client.get(key) if self.client.check([key]) else None
        if raw is None:
            return {}
        payload = json.loads(raw)
        if payload.get("n", 0) <= self.world_from:  # left on a store that outlived an earlier world of this name
            return {}
        return {int(seq): signature for seq, signature in payload["calls"]}

    def _compare(self, group: Any, neighbour: int, mine: collections.deque[tuple[int, str]], theirs: dict[int, str]) -> None:
        done = self.checked.get(group.uid, -1)
        for seq, signature in list(mine):
            if seq <= done or seq not in theirs:
                continue
            if theirs[seq] != signature:
                other = theirs[seq]
                why = None
                if " splits " in signature and signature.partition(" splits ")[0] == other.partition(" splits ")[0]:
                    # all_to_all_single: splits differ by rank; each must send what the other expects
                    why = pair_split_mismatch(signature, group.rank, other, group.ranks.index(neighbour), group.ranks)
                    if why is None:
                        continue
                self._break(group, seq, signature, neighbour, other, why)
                return
        self.checked[group.uid] = max(done, min(mine[-1][0], max(theirs)))

    def _break(self, group: Any, seq: int, signature: str, neighbour: int, other: str, why: str | None = None) -> None:
        splits = f"; all_to_all_single splits disagree: {why}" if why else ""
        reason = disagreement(seq, group.name, (
            f": rank {self.rank} called {signature}, "
            f"rank {neighbour} called {other}{splits} (found by the always-on mismatch check after the op ran, so its "
            "result may be wrong on any rank; every rank must make the same collective calls in the same order "
            "with matching dtypes and shapes; SPMD_DESYNC_CHECK=1 stops a mismatched call before it runs)"
        ))
        group.mark_unusable(reason)
        group.fail_pending()
