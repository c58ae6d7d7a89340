"""Rounds through the rank slots: the building blocks of every shm collective.

In round r each rank may write its slot for r (two per rank, used in alternate rounds), publishes
``arrive = r``, waits for the ranks it reads from, reads, and publishes ``ack = r``; a slot is
rewritten only once every rank acked the round that last used it. Each counter is written by its
own rank only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from spmd_shm.peers import Peers, Steps, any_below
from spmd_shm.segment import ACK, ARRIVE, REDUCED, Segment
from spmd_shm.work import ShmWork


class Rounds:
    """This rank's view of the collective slots and round counters of its group."""

    def __init__(self, segment: Segment, peers: Peers, notify: Callable[[Iterable[int]], None]) -> None:
        lay = self.lay = segment.layout
        self.peers = peers
        self.n, self.me, self.others = peers.n, peers.me, peers.others
        self._notify = notify  # after a publish: counts a move and wakes the sleeping ones of the ranks given
        i64, n = segment.i64, peers.n
        self.arrive = [i64(lay.ctrl_at(r, ARRIVE)) for r in range(n)]
        self.ack = [i64(lay.ctrl_at(r, ACK)) for r in range(n)]
        self.reduced = [i64(lay.ctrl_at(r, REDUCED)) for r in range(n)]
        data = segment.bytes
        #: Each slot's header line: the bytes its rank wrote for this round, and the op's signature.
        self.slot_size = [[i64(lay.slot_at(r, p)) for p in (0, 1)] for r in range(n)]
        self.slot_sig = [[i64(lay.slot_at(r, p) + 8) for p in (0, 1)] for r in range(n)]
        self.slot = [
            [data[lay.slot_at(r, p) + 64 : lay.slot_at(r, p) + 64 + lay.slot_bytes] for p in (0, 1)] for r in range(n)
        ]
        self.mm = segment.mm
        #: Offset in the segment of each rank's slot data, per parity (for struct packing of small tables).
        self.slot_data = [[lay.slot_at(r, p) + 64 for p in (0, 1)] for r in range(n)]
        self.round = 0
        self._views: dict[tuple[int, int, torch.dtype, int, int], torch.Tensor] = {}

    def names(self, ranks: list[int]) -> str:
        return self.peers.names(ranks)

    def begin_round(self, work: ShmWork, what: str) -> Steps:
        """Start the next round; returns it once this rank's slot for it is free to write."""
        r = self.round = self.round + 1
        if r > 2 and self.lagging(self.ack, r - 2):
            yield from self.peers.wait_counters(work, self.ack, self.others, r - 2, what)
        return r

    def lagging(self, words: list[Any], at_least: int) -> bool:
        """Whether another rank's counter in ``words`` is still below ``at_least`` (checked before a wait:
        in step the ranks never wait, and then no wait's generator is started)."""
        return any_below(words, self.others, at_least)

    def publish(self, r: int) -> None:
        """This rank's slot for round ``r`` is written: readers may go."""
        self.arrive[self.me].value = r
        self._notify(self.others)

    def await_arrival(self, work: ShmWork, r: int, ranks: list[int], what: str) -> Steps:
        """Wait until every rank of ``ranks`` published round ``r``."""
        yield from self.peers.wait_counters(work, self.arrive, ranks, r, what)

    def publish_reduced(self, r: int) -> None:
        """This rank's slice of round ``r`` is reduced, in place in its slot: the others may copy it."""
        self.reduced[self.me].value = r
        self._notify(self.others)

    def await_reduced(self, work: ShmWork, r: int, ranks: list[int], what: str) -> Steps:
        """Wait until every rank of ``ranks`` reduced its slice of round ``r``."""
        yield from self.peers.wait_counters(work, self.reduced, ranks, r, what)

    def view(self, q: int, r: int, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
        """Elements ``start:start+count`` (of ``dtype``) of rank ``q``'s slot for round ``r`` (views cached:
        slicing a tensor costs about a microsecond, a small collective only a few)."""
        key = (q, r & 1, dtype, start, count)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= 4096:
                self._views.clear()
            size = dtype.itemsize
            found = self._views[key] = self.slot[q][r & 1][start * size : (start + count) * size].view(dtype)
        return found

    def finish_round(self, r: int) -> None:
        """This rank is done reading round ``r``: its writers may reuse their slots."""
        self.ack[self.me].value = r
        self._notify(self.others)
