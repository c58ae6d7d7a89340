"""What the watchdog and the always-on mismatch check keep in the job's store: which announcements and call histories
belong to this world, and which announcement of a group stands."""

from __future__ import annotations

import json
import threading

import torch.distributed as tdist

from spmd.comm.health.history import CLOCK, HISTORY_KEY, HistoryCheck


def test_histories_are_told_apart_by_the_stores_clock_not_by_wall_time():
    """A history an earlier world left under the same group name is ignored, a later one is read, whatever
    wall times they carry (hosts' clocks differ: a neighbour whose clock ran behind was ignored for good)."""
    store = tdist.HashStore()
    store.add(CLOCK, 5)  # an earlier world published up to 5
    key = HISTORY_KEY.format(group="world", rank=1)
    store.set(key, json.dumps({"n": 5, "t": 1e12, "calls": [[0, "all_reduce old"]]}))
    check = HistoryCheck(store, threading.Lock(), rank=0, world_from=int(store.add(CLOCK, 0)))
    assert check._read("world", 1) == {}
    number = int(store.add(CLOCK, 1))
    store.set(key, json.dumps({"n": number, "t": 0.0, "calls": [[0, "all_reduce new"]]}))
    assert check._read("world", 1) == {0: "all_reduce new"}


class _Group:
    """What the watchdog's adoption reads and calls of a ProcessGroup."""

    def __init__(self, uid: str) -> None:
        self.uid, self.unusable = uid, None

    def mark_unusable(self, reason: str, announce: bool = True) -> None:
        self.unusable = self.unusable or reason

    def fail_pending(self) -> None:
        pass


def test_a_ranks_own_announcement_does_not_hide_one_another_rank_made_just_before():
    """Rank 1 gives up group g2, then rank 0 gives up g1: rank 0 still adopts g2 (its own announcement
    counted as seen covered rank 1's too, so g2 stayed usable on rank 0)."""
    from spmd.comm.health import watchdog

    store = tdist.HashStore()
    g1, g2 = _Group("g1"), _Group("g2")
    rank0, rank1 = (watchdog.Watchdog(store, rank, groups=lambda: [g1, g2]) for rank in (0, 1))
    for dog in (rank0, rank1):
        dog.world_from, dog.seen_unusable = watchdog.world_baseline(store)
    rank1.announce_unusable("g2", "its op failed")
    g1.mark_unusable("this rank's op failed")
    rank0.announce_unusable("g1", "this rank's op failed")
    rank0.adopt_unusable()
    assert g2.unusable == "rank 1 gave up on it: its op failed"


def test_the_first_announcement_of_a_group_stays():
    """Rank 1 gives up g first, then rank 0 (its op broke by it): the store keeps rank 1's reason, the cause."""
    from spmd.comm.health import watchdog

    store = tdist.HashStore()
    rank0, rank1 = watchdog.Watchdog(store, 0), watchdog.Watchdog(store, 1)
    for dog in (rank0, rank1):
        dog.world_from, dog.seen_unusable = watchdog.world_baseline(store)
    rank1.announce_unusable("g", "the cause")
    rank0.announce_unusable("g", "broken by it")
    assert store.get(watchdog.UNUSABLE_KEY.format(group="g")).decode().endswith("|rank 1 gave up on it: the cause")
