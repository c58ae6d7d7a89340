"""Doorbells: how a rank sleeps until a peer publishes something, and how a publisher wakes it.

Each rank has a doorbell word (the futex it sleeps on) and a sleep word: two int32 halves, one
for its waiting callers and one for its background thread, set while that side is (about to be)
asleep. A publisher stores its news, fences, and rings a peer (changes its doorbell and makes the
futex syscall) only if that peer's sleep word is set; a sleeper sets its half, fences, looks for
news once more, and only then sleeps. Either the sleeper sees the news or the publisher sees the
sleeper (the fences forbid both missing), so a rank that spins on its peers costs them no syscall.

A fence is an acquire and release of a ``threading.Lock``: CPython takes and gives it with atomic
read-modify-write instructions (``sem_trywait``/``sem_post``), full barriers on x86-64.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from spmd_shm import futex
from spmd_shm.segment import DOORBELL, SLEEP, Segment

_FENCE = threading.Lock()

#: Who changes a doorbell, in its top byte: every writer writes values only it writes, so a sleeper's
#: expected value can never come back by coincidence (the futex would then miss the change).
PROGRESS, LOCAL, LEAVING = 0, 255, 254


def fence() -> None:
    """A full memory barrier between this thread's earlier stores and its later loads."""
    _FENCE.acquire()
    _FENCE.release()


class Doorbells:
    """The doorbell and sleep words of every rank of the group, seen from rank ``me``."""

    def __init__(self, segment: Segment, n: int, me: int) -> None:
        lay = segment.layout
        self.me = me
        self.bell = [segment.i32(lay.ctrl_at(r, DOORBELL)) for r in range(n)]
        self.addr = [futex.address(b) for b in self.bell]
        self.asleep = [segment.i64(lay.ctrl_at(r, SLEEP)) for r in range(n)]  # both halves at once
        #: This rank's halves of its sleep word: its waiting callers', its background thread's.
        self.callers_asleep = segment.i32(lay.ctrl_at(me, SLEEP))
        self.thread_asleep = segment.i32(lay.ctrl_at(me, SLEEP + 4))
        self._id = (me % 250) << 24  # PROGRESS writers of different ranks never write the same value
        self._count = 0  # PROGRESS writes (under the engine's lock)
        self._local_count = 0  # LOCAL and LEAVING writes (under ``_lock``, from any thread)
        self._lock = threading.Lock()

    def ring(self, ranks: Iterable[int]) -> None:
        """After publishing something: wake those of ``ranks`` that sleep (the caller holds the engine lock)."""
        _FENCE.acquire()  # fence(), inline: twice per op
        _FENCE.release()
        asleep = self.asleep
        for q in ranks:
            if asleep[q].value:
                self._count = (self._count + 1) & 0xFFFFFF
                self.bell[q].value = self._id | self._count
                futex.wake(self.addr[q])

    def ring_all(self, ranks: Iterable[int], writer: int) -> None:
        """Wake ``ranks`` whether or not they sleep (from any thread; rare: leaving, aborting)."""
        with self._lock:
            for q in ranks:
                self._local_count = (self._local_count + 1) & 0xFFFFFF
                self.bell[q].value = (writer << 24) | self._local_count
                futex.wake(self.addr[q])

    def kick(self) -> None:
        """Wake this rank's own sleepers, if any (another thread of this process has news for them)."""
        if self.asleep[self.me].value:
            self.ring_all((self.me,), LOCAL)

    def snapshot(self) -> int:
        """This rank's doorbell now: taken before looking for news, then passed to ``sleep``."""
        return self.bell[self.me].value

    @property
    def my_address(self) -> int:
        return self.addr[self.me]
