"""The watchdog: publishes this rank's progress, serves dump requests, and explains stuck ops.

One daemon thread per process, started by ``spmd.init``. Every 0.2 s it
ages the outstanding async Works and fails those past their deadline
(``expire_overdue``), waited on or not, adopts the groups other ranks gave up
on, runs the mismatch check (``spmd.comm.health.history``) and, when any rank asked
for dumps, dumps the flight recorder; every interval it writes this rank's
per-group progress to the store. It uses its own store client,
so a main thread blocked in the store never stalls it. ``diagnose`` runs in
the waiting thread when a Work times out or fails: it reads every member's
progress and names who never arrived, who diverged, and who looks dead.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from spmd import settings
from spmd.comm.health.history import CLOCK, HistoryCheck
from spmd.comm.health.p2p_check import P2PCheck
from spmd.comm.tcp_store import own_client
from spmd.debug.dump import dump, trace_dir
from spmd.debug.recorder import Entry, recorder
from spmd.debug.signatures import comparable_signature
from spmd.errors import first_line, timeout_error
from spmd.polling import poll

PROGRESS_KEY = "spmd/debug/progress/{rank}"
DUMP_COUNTER = "spmd/debug/dump_requests"
DUMP_REASON = "spmd/debug/dump_reason"
DUMPED_KEY = "spmd/debug/dumped/{rank}"  # the last request number this rank served
UNUSABLE_COUNT = "spmd/debug/unusable_count"  # bumped whenever a rank gives up on a group (after its key is set)
UNUSABLE_KEY = "spmd/debug/unusable/{group}"  # "<number>|which rank gave up on the group, and why"
#: How often (seconds, at most) the watchdog looks for async Works past their deadline.
DEADLINE_STEP = 0.2


def _interval() -> float:
    return settings.current().watchdog_interval


class Watchdog:
    """The per-process watchdog thread."""

    def __init__(self, store: tdist.Store, rank: int, interval: float | None = None, store_host: str | None = None,
                 groups: Callable[[], list[Any]] = list) -> None:
        self.rank = rank
        #: The groups of the current world this rank belongs to, the world first (none before init or after
        #: destroy): handed in by ``spmd.comm.init``, which owns the world.
        self._groups = groups
        #: Who hosts the job's store ("rank 0's process (10.0.0.1:29500)"), for errors when it is gone.
        self.store_host = store_host
        #: Set (to the error's first line) once the store stopped answering: its host died or exited.
        self.store_lost: str | None = None
        self.interval = interval if interval is not None else _interval()
        self.client = own_client(store)
        self.lock = threading.Lock()  # one user of the client at a time: the thread or a diagnosis
        self.adopting = threading.RLock()  # one adopt_unusable at a time (re-entered from a failing callback)
        self.seen_requests = 0
        self.seen_unusable = 0
        self.beats = 0  # how many times this rank published its progress: a peer sees it move while this rank lives
        #: The store's CLOCK before this world's ranks had all arrived: announcements and histories
        #: numbered up to it are an earlier world's on the same store, ignored.
        self.world_from = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="spmd-watchdog", daemon=True)

    def start(self, baseline: tuple[int, int] | None = None) -> None:
        """Start the thread. ``baseline``: ``world_baseline`` as read before this world's ranks had
        all arrived (default: read now); what the store numbers after it is this world's."""
        with self.lock:
            self.seen_requests = int(self.client.add(DUMP_COUNTER, 0))
            self.world_from, self.seen_unusable = baseline if baseline is not None else world_baseline(self.client)
        self.history = HistoryCheck(self.client, self.lock, self.rank, self.world_from)
        self.p2p = P2PCheck(self.client, self.lock, self.rank, self.world_from)
        self.thread.start()

    def stop(self, wait_s: float = 5.0) -> None:
        """Stop the thread and wait (bounded) for its current step: a daemon thread still inside a
        store call when the interpreter finalizes aborts the process (``terminate called``)."""
        self.stopped.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(wait_s)

    def final_check(self, limit_s: float) -> str | None:
        """At shutdown: stop the thread, publish and compare every call not yet compared, waiting (at most
        ``limit_s``) for the neighbours' last calls; the reason of a disagreement found, or None. A job whose
        mismatched call came within the last check interval would otherwise exit 0."""
        self.stop()
        if not recorder.keep_history or self.store_lost is not None:
            return None
        shared = [g for g in self._groups() if g.size > 1]
        groups = [g for g in shared if g.unusable is None]
        deadline = time.monotonic() + limit_s
        try:
            found = self._compare_rest(groups, deadline)
            if len(groups) == len(shared):  # a job whose op failed does not leave together: its dead peer never would
                self._leave_together(deadline)
        except Exception:  # noqa: BLE001 - the store is gone (a peer that hosted it exited): nothing to compare
            return None
        return found

    def _compare_rest(self, groups: list[Any], deadline: float) -> str | None:
        while groups:
            self.history.step(groups)
            self.p2p.step(groups)
            for group in groups:
                if group.unusable is not None:
                    return group.unusable
            if not any(self.history.unchecked(g) or self.p2p.unchecked(g) for g in groups) or time.monotonic() >= deadline:
                return None
            time.sleep(FINAL_CHECK_POLL_S)
        return None

    def _leave_together(self, deadline: float) -> None:
        """Wait (until ``deadline``) for every rank of the world to finish its shutdown check, then let rank 0,
        which usually hosts the store, leave last: a host that left first would break the others' last reads.
        (The keys carry the world group's uid, new for each world a process makes on one store.)"""
        groups = self._groups()
        if not groups or groups[0].size < 2:
            return
        world = groups[0]
        size = world.size
        arrived, left = (f"{FINAL_CHECK_KEY}/{world.uid}/{phase}" for phase in ("arrived", "left"))
        self._wait_for_count(arrived, size, deadline, add=1)
        if self.rank != 0:
            with self.lock:
                self.client.add(left, 1)  # this rank's last read is done
            return
        self._wait_for_count(left, size - 1, deadline, add=0)

    def _wait_for_count(self, key: str, count: int, deadline: float, add: int) -> None:
        """Add ``add`` to the counter ``key``, then wait until it reaches ``count`` (or ``deadline``)."""
        with self.lock:
            self.client.add(key, add)

        def reached() -> bool:
            with self.lock:
                return int(self.client.add(key, 0)) >= count

        poll(reached, deadline - time.monotonic(), FINAL_CHECK_POLL_S)

    def _loop(self) -> None:
        step = min(self.interval, DEADLINE_STEP)
        next_publish = time.monotonic() + self.interval
        while not self.stopped.wait(step):
            try:
                expire_overdue()
                if self.store_lost is not None:
                    continue  # every store call would fail (and torch would print a C++ warning for each)
                self.adopt_unusable()
                if recorder.keep_history:
                    groups = self._groups()
                    self.history.step(groups)
                    self.p2p.step(groups)
                if time.monotonic() >= next_publish or self._dump_requested():
                    self.tick()
                    next_publish = time.monotonic() + self.interval
            except Exception as error:  # noqa: BLE001 - the store may be gone at shutdown; never kill the job
                if self.stopped.is_set():
                    return
                if store_gone(error):
                    self.store_lost = first_line(error)

    def store_lost_message(self, why: str) -> str:
        """The diagnosis when the store no longer answers: who hosted it."""
        if self.store_host is None:
            return f" (the job's store is unreachable: {why}; no view of the other ranks)"
        return (f"\n  the job's store is unreachable ({why}): it lives in {self.store_host}, which has most likely "
                "died or exited; its own log says why")

    def _dump_requested(self) -> bool:
        """Whether a rank asked for dumps since this rank last served one (one store read per step):
        a failing rank waits for its peers' dumps before it raises, and perhaps exits with the store."""
        with self.lock:
            return int(self.client.add(DUMP_COUNTER, 0)) > self.seen_requests

    def tick(self) -> None:
        """Publish this rank's progress and serve dump requests (forgetting finished async ops first)."""
        recorder.poll_outstanding()
        self.beats += 1
        payload = json.dumps({"beat": self.beats, "progress": recorder.published_progress(comparable_signature)})
        with self.lock:
            self.client.set(PROGRESS_KEY.format(rank=self.rank), payload)
            requests = int(self.client.add(DUMP_COUNTER, 0))
            reason = self.client.get(DUMP_REASON).decode() if requests > self.seen_requests else ""
        if requests > self.seen_requests:
            self.seen_requests = requests
            dump(reason or "requested by another rank")
            with self.lock:
                self.client.set(DUMPED_KEY.format(rank=self.rank), str(requests))

    # -- groups a rank gave up on ------------------------------------------------------------
    def announce_unusable(self, group: str, reason: str) -> None:
        """Tell the other ranks that this rank gave up on ``group``, unless another rank of this world
        already did: the first reason is the cause (the later ones are mostly ops it broke), so it stays."""
        key = UNUSABLE_KEY.format(group=group)
        with self.lock:  # the number tells this world's announcements from an earlier world's on the same store
            old = self.client.get(key).decode() if self.client.check([key]) else ""
            if old and int(old.partition("|")[0]) > self.world_from:
                return
            value = f"{int(self.client.add(CLOCK, 1))}|rank {self.rank} gave up on it: {reason}"
            if self.client.compare_set(key, old, value).decode() != value:
                return  # another rank's announcement came in between
            # (after the key: a reader that sees the count finds the key; this rank's own count is not taken
            # as seen, so an announcement another rank made meanwhile, maybe of another group, is still read)
            self.client.add(UNUSABLE_COUNT, 1)

    def adopt_unusable(self) -> None:
        """Mark unusable here every group another rank gave up on, and fail its pending async Works.

        One store read per watchdog step while nothing happens. A rank that
        arrives late to an op its peer abandoned then gets the named error at
        its next call instead of pairing with the abandoned op. Called by the
        watchdog thread and on the error path (``adopt_announcements``): one
        at a time, so a caller that returns has seen every announcement made before.
        """
        with self.adopting:
            with self.lock:
                count = int(self.client.add(UNUSABLE_COUNT, 0))
            if count == self.seen_unusable:
                return
            for group in self._groups():
                if group.unusable is not None:
                    continue
                key = UNUSABLE_KEY.format(group=group.uid)
                with self.lock:
                    value = self.client.get(key).decode() if self.client.check([key]) else None
                if value is None:
                    continue
                number, _, reason = value.partition("|")
                if int(number) > self.world_from:  # not left over from an earlier world of that name
                    group.mark_unusable(reason, announce=False)
                    group.fail_pending()
            self.seen_unusable = count


    # -- used from the waiting thread -------------------------------------------------------
    def request_dumps(self, reason: str) -> int:
        """Ask every rank to dump (and dump here); returns the request number."""
        with self.lock:
            self.client.set(DUMP_REASON, reason)
            request = int(self.client.add(DUMP_COUNTER, 1))
            self.seen_requests = request
        dump(reason)
        with self.lock:
            self.client.set(DUMPED_KEY.format(rank=self.rank), str(request))
        return request

    def await_dumps(self, ranks: list[int], request: int, deadline: float) -> list[int]:
        """Wait (bounded) until ``ranks`` served ``request``, so their dumps exist before this rank
        raises and perhaps exits (taking the store it hosts with it); returns those that did not."""
        waiting = [r for r in ranks if r != self.rank]

        def all_served() -> bool:
            waiting[:] = [r for r in waiting if r not in self._served(waiting, request)] if waiting else []
            return not waiting

        poll(all_served, deadline - time.monotonic(), 0.02)
        return waiting

    def _served(self, ranks: list[int], request: int) -> set[int]:
        """Those of ``ranks`` that have served dump request ``request`` (or a later one)."""
        keys = {r: DUMPED_KEY.format(rank=r) for r in ranks}
        with self.lock:
            return {r for r, key in keys.items() if self.client.check([key]) and int(self.client.get(key)) >= request}

    def await_signs_of_life(self, ranks: list[int], request: int, before: dict[int, dict[str, Any] | None], deadline: float) -> list[int]:
        """Of ``ranks``, those that until ``deadline`` neither served ``request`` nor published progress
        again since ``before`` (its beat moved): told without comparing hosts' clocks. A rank busy with its
        own failure (dumping, explaining) may answer late, but its watchdog still publishes every interval."""
        silent = [r for r in ranks if r != self.rank]
        while silent:
            progress, served = self.read_progress(silent), self._served(silent, request)
            silent = [r for r in silent if r not in served and _beat(progress.get(r)) == _beat(before.get(r))]
            if not silent or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return silent

    def read_progress(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        keys = {r: PROGRESS_KEY.format(rank=r) for r in ranks}
        out: dict[int, dict[str, Any] | None] = {}
        with self.lock:
            for r, key in keys.items():
                out[r] = json.loads(self.client.get(key)) if self.client.check([key]) else None
        return out


_watchdog: Watchdog | None = None


def store_gone(error: BaseException) -> bool:
    """Whether a store call failed because its host no longer answers (not a timeout or a missing key)."""
    if isinstance(error, tdist.DistNetworkError):
        return True
    text = str(error)
    return any(sign in text for sign in ("Broken pipe", "Connection reset", "Connection refused", "Failed to recv"))


def _beat(progress: dict[str, Any] | None) -> int:
    """A published progress's beat (-1: none published)."""
    return -1 if progress is None else int(progress.get("beat", 0))


def adopt_announcements() -> None:
    """Adopt at once, not at the watchdog's next step, the groups other ranks gave up on.

    For the error path: a peer that gives a group up and then exits (closing
    its connections) breaks this rank's op a moment after its announcement,
    and the error should name the peer's reason, not only the closed socket.
    """
    dog = _watchdog
    if dog is None or dog.store_lost is not None:
        return
    try:
        dog.adopt_unusable()
    except Exception:  # noqa: BLE001 - the store may be gone; the error stands without it
        pass


def world_baseline(store: tdist.Store) -> tuple[int, int]:
    """(the store's CLOCK, how many announcements that a rank gave a group up were made) on ``store`` now.

    Read before every rank of a world has arrived at init, it comes before
    anything that world publishes: a rank whose watchdog starts after a peer
    already gave a group up then still adopts it (read at the watchdog's start,
    that announcement was taken for an earlier world's and ignored).
    """
    return int(store.add(CLOCK, 0)), int(store.add(UNUSABLE_COUNT, 0))


def start(store: tdist.Store, rank: int, groups: Callable[[], list[Any]], store_host: str | None = None,
          baseline: tuple[int, int] | None = None) -> Watchdog | None:
    """Start the process's watchdog (unless ``SPMD_WATCHDOG=0``) over the groups ``groups()`` lists (the world
    first); ``store_host`` says who hosts ``store``, ``baseline`` is ``world_baseline(store)`` from before the
    world's ranks had all arrived."""
    global _watchdog
    if not settings.current().watchdog:
        return None
    _watchdog = Watchdog(store, rank, store_host=store_host, groups=groups)
    _watchdog.start(baseline)
    return _watchdog


#: How often the shutdown check reads the neighbours' histories while it waits for their last calls.
FINAL_CHECK_POLL_S = 0.05
#: Where the ranks count themselves done with the shutdown check (per world).
FINAL_CHECK_KEY = "spmd/debug/final"


def stop() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def current() -> Watchdog | None:
    return _watchdog


def expire_overdue(now: float | None = None) -> int:
    """Fail every outstanding async Work past its deadline; returns how many.

    Each fails with a CollectiveTimeoutError that names the op, the group,
    the sequence number and (from the diagnosis) the ranks that never arrived;
    its waiters, callbacks and futures all see that error. Runs in the
    watchdog thread every ``DEADLINE_STEP`` seconds.
    """
    overdue = recorder.poll_outstanding(time.monotonic() if now is None else now)
    for _entry, work, limit in overdue:
        work._expire(timeout_error(work.description, limit))
    return len(overdue)


def diagnose(group: Any, entry: Entry, what: str) -> str:
    """Why ``entry`` on ``group`` is stuck or failed, from every member's published progress.

    Publishes this rank's own progress first (so the others' diagnoses see it)
    and asks every rank to dump its flight recorder.
    """
    dog = _watchdog
    if dog is None:
        return " (watchdog off: no view of the other ranks; set SPMD_WATCHDOG=1)"
    if dog.store_lost is not None:
        return dog.store_lost_message(dog.store_lost)
    try:
        dog.tick()  # peers stuck for a whole timeout have published their stuck state already
        progress = dog.read_progress(list(group.ranks))
    except Exception as error:  # noqa: BLE001 - a diagnosis must not hide the original error
        first = first_line(error)
        if store_gone(error):
            dog.store_lost = first
            return dog.store_lost_message(first)
        return f" (could not read the other ranks' progress: {first})"
    # Peers serve dump requests at every watchdog step (0.2 s): allow about five, fewer with a short interval.
    answer_s = min(5 * DEADLINE_STEP, 1.5 * dog.interval + 0.2)
    # A live rank publishes every interval (a step late at most): watched that long, one that neither
    # answers nor publishes is likely dead. Told without comparing hosts' clocks.
    life_s = dog.interval + 1.0
    silent: list[int] = []
    try:
        looked = time.monotonic()
        request = dog.request_dumps(f"{what}: {entry.op} on group {group.name!r} seq {entry.seq} (rank {dog.rank})")
        # Wait (bounded) for every rank, including ranks that have not published yet: an op can fail
        # fast, before their first heartbeat. Serving the request publishes their progress too, so it
        # is read again afterwards.
        unanswered = dog.await_dumps(list(group.ranks), request, time.monotonic() + answer_s)
        if unanswered:  # (only then: a rank that answered is alive)
            silent = dog.await_signs_of_life(unanswered, request, progress, looked + life_s)
        progress = dog.read_progress(list(group.ranks))
    except Exception:  # noqa: BLE001 - the store may be gone; the diagnosis stands on what was read
        pass
    never, diverged, ahead, lines = [], [], [], []
    calls: dict[int, str] = {}  # the signature each rank gave this seq, where it published one
    collective = entry.seq >= 0  # (a point-to-point op has no sequence number to place the ranks against)
    for r in group.ranks:
        info = progress.get(r)
        if info is None:
            never.append(r)
            why = f", nor answered a dump request within {life_s:.1f} s (likely dead)" if r in silent else " (not started, or died early)"
            lines.append(f"    rank {r}: never published progress{why}")
            continue
        dead = f"; neither answered a dump request nor published progress for {life_s:.1f} s (likely dead)" if r in silent else ""
        state = info["progress"].get(group.name)
        if state is None:
            never.append(r)
            lines.append(f"    rank {r}: no op on this group yet{dead}")
            continue
        started, started_op, done, done_op = state[:4]
        if collective:  # place the rank against this op's sequence number
            if started == entry.seq and len(state) > 4 and state[4] is not None:
                calls[r] = state[4]
            if started < entry.seq:
                never.append(r)
            elif started == entry.seq and started_op != entry.op:
                diverged.append(r)
            elif started > entry.seq:
                ahead.append(r)
        last = f"last completed {done_op} #{done}" if done >= 0 else "nothing completed"
        lines.append(f"    rank {r}: last started {started_op} #{started}, {last}{dead}")
    summary = []
    if not collective:  # what matters is the peer, which must post the matching op
        peer_line = next((line.strip() for line in lines if line.strip().startswith(f"rank {entry.peer}:")), f"rank {entry.peer}: no report")
        summary.append(f"a point-to-point op with rank {entry.peer}, which must post the matching one; {peer_line} (collectives on this group)")
        never = []
    if never:
        summary.append(f"ranks that never reached seq {entry.seq}: {never}")
    if diverged:
        summary.append(f"ranks that called a different op at seq {entry.seq}: {diverged}")
    if ahead:
        summary.append(f"ranks already past it: {ahead}")
    if collective:
        calls.setdefault(dog.rank, comparable_signature(entry))
    if len(set(calls.values())) > 1:  # same seq, different arguments: the likely cause of the hang
        shown = " / ".join(f"rank {r}: {sig}" for r, sig in sorted(calls.items()))
        summary.insert(0, f"ranks disagree on seq {entry.seq}: {shown}")
    return "\n  " + "; ".join(summary or ["every rank reached it (a backend-level problem?)"]) + "\n  per rank:\n" + "\n".join(lines) + (
        f"\n  flight-recorder dumps requested on every rank; run `spmd trace analyze {_shell_path(trace_dir())}`"
    )


def _shell_path(path: Path) -> str:
    """``path`` absolute and quoted for a shell only if it needs it."""
    import shlex

    return shlex.quote(str(path.absolute()))
