"""The always-on mismatch check's store side: which published call histories belong to this world."""

from __future__ import annotations

import json
import threading

import torch.distributed as tdist

from spmd.debug.history import CLOCK, HISTORY_KEY, HistoryCheck


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
