"""The always-on check for point-to-point calls: each receive is paired with the send it got.

A send of float32 received into an int32 buffer of the same byte size, or a
send and a receive whose element counts differ where the backend does not
notice, completes with a wrong value and no error. Sends and receives
between two ranks with one tag pair up in call order (every backend keeps
them in order), so the k-th send from rank A to rank B with tag t is the k-th
receive on B from A with tag t. Every watchdog step each rank publishes the
signatures (dtype, element count) of its newest sends, per destination and
tag, and compares its receives with what their senders published; the first
difference gives the group up with both calls named, as the collective
history check does (``spmd.comm.health.history``). Costs a p2p op a counter and a deque append.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

from spmd.comm.health.history import CLOCK, PUBLISHED
from spmd.debug.recorder import recorder

P2P_KEY = "spmd/debug/p2p/{group}/{rank}"


def _signature(dtype: Any, numel: int) -> str:
    return f"{str(dtype).removeprefix('torch.')} x {numel}"


class P2PCheck:
    """One rank's side of the check; run by the watchdog thread (``step``) on the watchdog's store client."""

    def __init__(self, client: Any, lock: threading.Lock, rank: int, world_from: int) -> None:
        self.client, self.lock, self.rank, self.world_from = client, lock, rank, world_from
        self.seen: dict[str, int] = {}  # group uid -> the last p2p call number taken from the recorder
        self.sent: dict[str, dict[str, collections.deque[tuple[int, str]]]] = {}  # uid -> "dst/tag" -> newest (k, sig)
        self.pending: dict[str, dict[tuple[int, int], collections.deque[tuple[int, str]]]] = {}  # uid -> (src, tag) -> receives

    def step(self, groups: list[Any]) -> None:
        """Publish each group's new sends; compare its unchecked receives with what their senders published."""
        for group in groups:
            if group.unusable is not None or group.size < 2:
                continue
            self._record(group)
            if self.pending.get(group.uid):
                self._compare(group)

    def unchecked(self, group: Any) -> bool:
        """Whether this rank received on ``group`` what was not yet compared with its sender's call."""
        return any(self.pending.get(group.uid, {}).values())

    def _record(self, group: Any) -> None:
        new = recorder.p2p_history(group.name, after=self.seen.get(group.uid, 0))
        if not new:
            return
        self.seen[group.uid] = new[-1][0]
        sent = self.sent.setdefault(group.uid, {})
        pending = self.pending.setdefault(group.uid, {})
        published = False
        for _, op, peer, tag, k, dtype, numel in new:
            call = (k, _signature(dtype, numel))
            if op == "send":
                sent.setdefault(f"{peer}/{tag}", collections.deque(maxlen=PUBLISHED)).append(call)
                published = True
            else:
                pending.setdefault((peer, tag), collections.deque(maxlen=PUBLISHED)).append(call)
        if published:
            payload = {channel: list(calls) for channel, calls in sent.items()}
            with self.lock:
                number = int(self.client.add(CLOCK, 1))
                self.client.set(P2P_KEY.format(group=group.uid, rank=self.rank), json.dumps({"n": number, "sends": payload}))

    def _read(self, uid: str, rank: int) -> dict[str, list[list[Any]]] | None:
        key = P2P_KEY.format(group=uid, rank=rank)
        with self.lock:
            raw = self.client.get(key) if self.client.check([key]) else None
        if raw is None:
            return None
        payload = json.loads(raw)
        if payload.get("n", 0) <= self.world_from:  # left on a store that outlived an earlier world of this name
            return None
        return payload["sends"]

    def _compare(self, group: Any) -> None:
        published: dict[int, dict[str, list[list[Any]]] | None] = {}
        for (src, tag), calls in self.pending[group.uid].items():
            if not calls:
                continue
            if src not in published:
                published[src] = self._read(group.uid, src)
            theirs = {int(k): sig for k, sig in (published[src] or {}).get(f"{self.rank}/{tag}", [])}
            if not theirs:
                continue
            oldest, newest = min(theirs), max(theirs)
            while calls and calls[0][0] <= newest:
                k, mine = calls.popleft()
                if k < oldest:
                    continue  # beyond the sender's published window: no longer checkable
                if theirs.get(k, mine) != mine:
                    self._break(group, src, tag, k, theirs[k], mine)
                    return

    def _break(self, group: Any, src: int, tag: int, k: int, sent: str, received: str) -> None:
        reason = (
            f"ranks disagree on a point-to-point message of group {group.name!r}: rank {src} sent its send #{k} "
            f"to rank {self.rank} (tag {tag}) as {sent}, rank {self.rank} received it as {received} (found by the "
            "always-on mismatch check after the op ran, so the received values are wrong; a send and its receive "
            "must have the same dtype and element count)"
        )
        group.mark_unusable(reason)
        group.fail_pending()
