"""The group's ranks as this rank sees them: their state and pid words, and waits that watch them.

Every wait the backend makes goes through ``Peers.wait_for``: it yields to the progress engine
until its condition holds, and raises a named error as soon as the op was aborted, ran past its
deadline, or a rank it waits for gave up, closed the group, or exited.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Generator
from typing import Any

from spmd.comm.backend import BackendContext
from spmd.errors import CollectiveError
from spmd_shm.segment import BROKEN, CLOSED, PID, STATE, Segment
from spmd_shm.work import ShmWork

#: Seconds between checks that the awaited peers' processes still exist.
LIVENESS_PERIOD = 0.05
#: Seconds between a waiting op's checks of its abort flag, deadline and the peers' states.
CHECK_PERIOD = 50e-6

#: What the engine steps: a generator that yields whenever it must wait, returns when its op is done.
Steps = Generator[None, None, Any]


def any_below(words: list[Any], ranks: list[int], at_least: int) -> bool:
    """Whether some ``words[q]`` (q in ``ranks``) is still below ``at_least``: the check before, and
    between, waits on the peers' counters (a plain loop: cheaper than a generator expression)."""
    for q in ranks:
        if words[q].value < at_least:
            return True
    return False


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def _loadavg() -> int | None:
    """/proc/loadavg, opened once (None where there is none)."""
    try:
        return os.open("/proc/loadavg", os.O_RDONLY)
    except OSError:
        return None


def runnable_tasks() -> int | None:
    """Tasks runnable on the host right now, this one included (/proc/loadavg's fourth field); None where
    the OS does not say. About 2 us: read only after a wait that already ended asleep."""
    fd = _loadavg()
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[3].partition(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a SIGKILLed rank its parent has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class Peers:
    """Group rank ``me`` of ``n``: the others' state and pid words, their names, and watched waits."""

    def __init__(self, ctx: BackendContext, segment: Segment) -> None:
        self.ctx = ctx
        lay = segment.layout
        self.n, self.me = ctx.size, ctx.rank
        self.others = [r for r in range(self.n) if r != self.me]
        self.timeout = ctx.timeout.total_seconds()
        self.state = [segment.i64(lay.ctrl_at(r, STATE)) for r in range(self.n)]
        self.pid = [segment.i64(lay.ctrl_at(r, PID)) for r in range(self.n)]
        self._next_liveness = 0.0
        #: Global ranks, where they differ from the group's (for error messages).
        self._global = list(ctx.global_ranks) if ctx.global_ranks and list(ctx.global_ranks) != list(range(self.n)) else None
        #: ``names([q])`` of every rank q, made once: the ops' descriptions use them on every call.
        self.label = [self.names([q]) for q in range(self.n)]

    def names(self, ranks: list[int]) -> str:
        """``ranks`` (group ranks) for an error message, with their global ranks when those differ."""
        if self._global is not None:
            return f"group ranks {ranks} (global ranks {[self._global[r] for r in ranks]})"
        return f"ranks {ranks}"

    def check(self, work: ShmWork, missing_fn: Callable[[], list[int]], what: str) -> None:
        """Raise if ``work`` must stop waiting: aborted, past its deadline, or an awaited peer gone."""
        if work.aborted:
            raise CollectiveError(f"shm: {what} was aborted (spmd gave up on it: its deadline passed or the group was abandoned)")
        missing = missing_fn()
        for q in missing:
            state = self.state[q].value
            if state in (BROKEN, CLOSED) and q in missing_fn():
                why = "gave up on the group (an op failed or timed out there)" if state == BROKEN else "closed the group"
                raise CollectiveError(f"shm: {self.names([q])} {why} while this rank waited for it at {what}")
        now = time.monotonic()
        if now > work.deadline:
            raise TimeoutError(f"shm: {self.names(missing)} did not arrive at {what} within {self.timeout:.1f} s")
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_PERIOD
            for q in missing:
                pid = self.pid[q].value
                if pid and not alive(pid) and q in missing_fn():
                    raise CollectiveError(
                        f"shm: {self.names([q])} (pid {pid}) exited, killed or crashed, while this rank waited for "
                        f"it at {what}; the job cannot continue on this group"
                    )

    def wait_for(self, work: ShmWork, missing_fn: Callable[[], list[int]], what: str) -> Steps:
        """Yield until ``missing_fn()`` is empty, checking deadline, abort and peers at most every
        ``CHECK_PERIOD`` seconds (a spinning waiter polls every microsecond or two)."""
        next_check = 0.0
        while missing_fn():
            now = time.monotonic()
            if now >= next_check:
                self.check(work, missing_fn, what)
                next_check = now + CHECK_PERIOD
            yield

    def wait_counters(self, work: ShmWork, words: list[Any], ranks: list[int], at_least: int, what: str) -> Steps:
        """Yield until ``words[q] >= at_least`` for every q in ``ranks`` (the common case: no yield at all)."""
        for q in ranks:
            if words[q].value < at_least:
                work.gate = (words, ranks, at_least)  # a waiting caller polls these words alone (Engine.drive)
                try:
                    yield from self.wait_for(work, lambda: [q for q in ranks if words[q].value < at_least], what)
                finally:
                    work.gate = None
                return
