"""The progress engine of one group's shm backend: who drives this rank's ops, and when it sleeps.

Collectives (``spmd_shm.collectives`` over ``spmd_shm.rounds``) run one at a time, in call order;
sends (``spmd_shm.p2p``) in order per destination; all are generators the engine steps. A caller
that waits for an op steps them in its own thread; a background thread per group steps the ops
nobody waits for and drains incoming messages. A waiting caller polls for ``Engine.spin`` seconds,
then sleeps on its own doorbell word (a futex), which a writer changes and wakes only while the
sleep word says someone sleeps there (``spmd_shm.doorbell``): two ranks on two cores never steal
each other's core, and ranks in step make no syscall. Every wait has a deadline and watches the
peers it waits for (``spmd_shm.peers``), so a dead peer is a named error, not a hang.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from spmd.comm.backend import BackendContext
from spmd.comm.threads import one_torch_thread
from spmd.errors import CollectiveError
from spmd_shm import futex
from spmd_shm.doorbell import LEAVING, Doorbells, fence
from spmd_shm.p2p import Rings
from spmd_shm.peers import Peers, Steps, any_below, runnable_tasks, usable_cpus
from spmd_shm.rounds import Rounds
from spmd_shm.segment import BROKEN, CLOSED, Segment
from spmd_shm.work import ShmWork

#: The longest a waiting caller keeps polling (after its last progress) before it sleeps on its
#: doorbell, while the group's ranks fit the CPUs this process may use: long enough to cover a peer's
#: own per-op Python (20 us spins slept at most ops of a back-to-back loop: 4 B all_reduce 120 vs 20 us
#: median on the 2-core host). With more ranks than CPUs a spinner would hold the core its peer
#: needs, so it sleeps almost at once. Within those bounds the spin adapts (``Engine._adapt_spin``).
SPIN_SECONDS = float(os.environ.get("SPMD_SHM_SPIN_US", "100")) * 1e-6
OVERSUBSCRIBED_SPIN_SECONDS = 2e-6
#: Longest single sleep: deadlines, aborts and dead peers are noticed at least this often.
SLEEP_CAP = 0.05
#: While the program submitted or waited for an op this recently (seconds), the background thread
#: polls every TICK seconds rather than sleeping on the doorbell (see ``Engine._loop``).
RECENT_USE = 0.02
TICK = 0.005


#: Seconds between full progress passes while a waiting caller polls its op's gate (see ``ShmWork.gate``):
#: the other queued ops, incoming messages and the op's own deadline checks move at least this often.
GATED_POLL = 50e-6


class Engine:
    """Owns the group's rounds, rings and progress thread; the backend submits generators to it."""

    def __init__(self, ctx: BackendContext, segment: Segment) -> None:
        self.ctx = ctx
        self.seg = segment
        peers = self.peers = Peers(ctx, segment)
        n, me = self.n, self.me = peers.n, peers.me
        self.others = peers.others
        self._cpus = usable_cpus()
        self._spin_max = SPIN_SECONDS if n <= self._cpus else min(SPIN_SECONDS, OVERSUBSCRIBED_SPIN_SECONDS)
        self._spin_min = min(self._spin_max, OVERSUBSCRIBED_SPIN_SECONDS)
        self.spin = self._spin_max  # seconds a waiting caller polls before it sleeps (adapted per wait)
        self.bells = Doorbells(segment, n, me)
        self.moves = 0  # bumped by every step that changed shared state (the spin's progress signal)
        self.rounds = Rounds(segment, peers, self._published)
        self.rings = Rings(segment, peers, self._published)
        # work queues: the inbox is filled by callers, everything else belongs to the thread
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._collectives: collections.deque[tuple[ShmWork, Steps]] = collections.deque()
        self._sends: list[collections.deque[tuple[ShmWork, Steps]]] = [collections.deque() for _ in range(n)]
        self.broken: BaseException | None = None
        self._stopping = False
        self._abandoned = False
        self._lock = threading.Lock()  # held by whichever thread progresses (the engine's or a waiting caller's)
        self._drivers = 0  # callers inside drive()
        self.sleeping_callers = 0  # callers of drive() asleep on the doorbell (a finish must wake them)
        self._drivers_lock = threading.Lock()
        self._last_use = 0.0  # time.monotonic() of the program's last submit or drive
        self._wake = threading.Event()  # set by kick(): the background thread's park or tick ends early
        self._seen = 0  # self.moves at the background thread's last pass
        #: What an op that completed inside its call returns (a finished work holds no per-op state).
        self.completed = ShmWork(self, 0.0)
        self.completed.done = True
        self._thread = threading.Thread(target=self._loop, name=f"spmd-shm-{ctx.group_name}", daemon=True)
        self._thread.start()

    # -- submission (any thread) ----------------------------------------------------------
    def new_work(self) -> ShmWork:
        return ShmWork(self, time.monotonic() + self.peers.timeout)

    def submit(self, kind: str, work: ShmWork, payload: Any) -> ShmWork:
        """Queue an op for the progress thread: kind is "coll" (a generator), "send" (dst, generator) or "recv"."""
        broken = self.broken
        if broken is not None:
            work.finish(self._refusal(broken))
            return work
        self._last_use = time.monotonic()  # (an op that completes here is never driven: see _loop)
        if not self._inbox and self._start_now(kind, work, payload):
            return work
        self._inbox.append((kind, (work, payload)))
        # Start it here (publish this rank's part) if no thread is progressing; else make sure the
        # thread that is sees the inbox before it sleeps.
        if self.try_progress() is None:
            self.kick()
        return work

    def _start_now(self, kind: str, work: ShmWork, payload: Any) -> bool:
        """Take an op here in the caller's thread, with no hand-over through the inbox (the common case,
        and the cheapest) and step the queue it joins once: a collective or send that nothing is
        queued before publishes its part now, a recv takes what already arrived. False if another
        thread is progressing the engine (the op then goes through the inbox)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._inbox:  # (queued by another thread meanwhile: keep the order)
                return False
            self._accept(kind, (work, payload))
            try:
                with one_torch_thread():
                    if kind == "coll":
                        self._advance(self._collectives)
                    elif kind == "send":
                        self._advance(self._sends[payload[0]])
                    else:
                        self.rings.drain(payload.src)
            except BaseException as error:  # noqa: BLE001 - as in _body
                self.fail_all(error)
            return True
        finally:
            self._lock.release()

    def run_now(self, start: Callable[[], Callable[[ShmWork], Steps] | None]) -> ShmWork | None:
        """Run a small collective's plain ``start`` here, in the caller's thread, when no other collective
        is queued and no thread is progressing: ``self.completed`` if it finished (no work object, no
        generator, no queue), else a work whose generator is the rest ``start`` returned, queued. None
        (nothing run) if the op must take the general path (``submit``)."""
        if self._inbox or self._collectives or self.broken is not None:
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._inbox or self._collectives:
                return None
            self._last_use = time.monotonic()
            try:
                rest = start()
            except BaseException as error:  # noqa: BLE001 - as in _advance: the waiter gets it, the group is done
                work = self.new_work()
                work.finish(error)
                self.fail_all(error)
                return work
            if rest is None:
                return self.completed
            work = self.new_work()
            self._collectives.append((work, rest(work)))
            return work
        finally:
            self._lock.release()

    def send_now(self, data: torch.Tensor, dst: int, tag: int) -> bool:
        """Write a message that fits one packet straight into the ring to ``dst``, here in the caller's
        thread, when the ring has room and no earlier send to ``dst`` is queued (the common small send:
        no generator, no queue); False if it must be queued instead."""
        if self._inbox or self._sends[dst] or data.numel() > self.seg.layout.packet_bytes or self.broken is not None:
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._inbox or self._sends[dst] or not self.rings.has_room(dst):
                return False
            self._last_use = time.monotonic()
            with one_torch_thread():
                self.rings.write_packet(data, dst, tag, 0)
            return True
        finally:
            self._lock.release()

    @property
    def inline_wait(self) -> float:
        """Seconds a small op started in the caller's thread polls for its peers before it is queued as a
        work (whose waiter then polls and sleeps, ``drive``): the adaptive spin, at most ``GATED_POLL``
        (an op submitted asynchronously returns at most that late; its deadline and the peers' health
        need no check so soon)."""
        return min(self.spin, GATED_POLL)

    @property
    def drivers(self) -> int:
        """How many callers are inside ``drive`` (waiting for an op by progressing)."""
        return self._drivers

    def kick(self) -> None:
        """Wake this rank's background thread and sleeping callers (from any thread of this process)."""
        self.bells.kick()
        self._wake.set()

    def _refusal(self, cause: BaseException) -> CollectiveError:
        return CollectiveError(
            f"shm backend of group {self.ctx.group_name!r} failed earlier and takes no more ops "
            f"({str(cause).splitlines()[0] if str(cause) else type(cause).__name__}); destroy the group and create a new one"
        )

    def _published(self, ranks: Iterable[int]) -> None:
        """A step changed shared state that ``ranks`` may wait for: count the move, wake those that sleep."""
        self.moves += 1
        self.bells.ring(ranks)

    # -- the thread -----------------------------------------------------------------------
    def _accept(self, kind: str, item: tuple[ShmWork, Any]) -> None:
        work, payload = item
        if kind == "coll":
            self._collectives.append((work, payload))
        elif kind == "send":
            dst, steps = payload
            self._sends[dst].append((work, steps))
        else:
            self.rings.post(payload)

    def _advance(self, queue: collections.deque[tuple[ShmWork, Steps]]) -> None:
        while queue:
            work, steps = queue[0]
            try:
                next(steps)
                return
            except StopIteration:
                queue.popleft()
                self.moves += 1
                work.finish(None)
            except BaseException as error:  # noqa: BLE001 - delivered to the waiter, and the group is done
                queue.popleft()
                work.finish(error)
                self.fail_all(error)

    def _step(self) -> None:
        inbox = self._inbox
        while inbox:
            self._accept(*inbox.popleft())
        for src in self.others:
            self.rings.drain(src)
        if self._collectives:
            self._advance(self._collectives)
        for dst in self.others:
            if self._sends[dst]:
                self._advance(self._sends[dst])
        if self.n == 1 and self._sends[0]:
            self._advance(self._sends[0])

    def _busy(self) -> bool:
        return bool(self._collectives or any(self._sends) or self.rings.pending())

    def _body(self) -> None:
        """One round of progress on everything; the caller holds ``self._lock``. The copies and reductions
        run on one torch thread: a parallel region's spinning threads would hold the core a peer needs."""
        try:
            with one_torch_thread():
                self._step()
                if self.rings.waiting:
                    self.rings.check_recvs()  # drains a sender's packets too
        except BaseException as error:  # noqa: BLE001 - a bug must not hang the ranks: fail everything
            self.fail_all(error)
        if self._abandoned and self.broken is None:
            self.fail_all(CollectiveError(f"group {self.ctx.group_name!r} was abandoned"))

    def try_progress(self) -> bool | None:
        """Progress once if no other thread is (never blocks): whether anything moved, None if busy elsewhere."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            moves = self.moves
            self._body()
            return self.moves != moves
        finally:
            self._lock.release()

    def drive(self, work: ShmWork, timeout: float | None) -> bool:
        """A caller waits for ``work`` by progressing itself (no hand-off to the progress thread):
        poll for ``self.spin`` seconds after each move, then sleep on the doorbell. True once done."""
        bells = self.bells
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._drivers_lock:
            self._drivers += 1
        slept = False
        try:
            spin = self.spin
            started = time.monotonic()
            spin_until = full_poll_at = started + spin
            while not work.done:
                bell = bells.snapshot()
                gate = work.gate
                if gate is not None and any_below(*gate) and time.monotonic() < full_poll_at:
                    continue  # (the op's counters alone: a poll in a fraction of a microsecond)
                moved = self.try_progress()
                if work.done:
                    break
                now = time.monotonic()
                full_poll_at = now + GATED_POLL
                if moved:
                    spin_until = now + spin
                    continue
                if deadline is not None and now >= deadline:
                    return False
                if now < spin_until:
                    continue
                slept = True
                self._sleep_caller(work, bell, SLEEP_CAP if deadline is None else max(0.0, min(SLEEP_CAP, deadline - now)))
            if slept:
                self._adapt_spin(time.monotonic() - started)
            return True
        finally:
            self._last_use = time.monotonic()
            with self._drivers_lock:
                self._drivers -= 1
                last = not self._drivers
            if last and (self._inbox or self._busy()):  # ops nobody waits for now: the thread takes over
                self._wake.set()

    def _adapt_spin(self, waited: float) -> None:
        """After a wait that ended asleep: had it ended within the longest spin, spin about twice that
        long next time (a wake-up costs more than the spin would have). If not, the peers were late;
        where more tasks are runnable than this process has CPUs, others need the cores, and half the
        spin, down to almost none, leaves the core to them (a 4 B all_reduce on 2 ranks with a third
        process busy on the 2-core host: 236 us spinning 100 us each wait, ~Gloo's 70 us sleeping at
        once); where a core is idle anyway, spinning costs nobody anything and the spin stays long (a
        wait whose sleep took longer than the spin, the wake-up itself, must not shrink it: once
        short, every wait would sleep and the spin would never recover)."""
        if self._spin_max == self._spin_min:  # (more ranks than CPUs: nothing to adapt)
            return
        if waited < self._spin_max:
            self.spin = min(self._spin_max, max(self.spin, 2 * waited))
            return
        runnable = runnable_tasks()
        if runnable is not None and runnable <= self._cpus:
            self.spin = self._spin_max
        else:
            self.spin = max(self._spin_min, self.spin / 2)

    def _sleep_caller(self, work: ShmWork, bell: int, cap: float) -> None:
        """Sleep on the doorbell (until a ring, a finish or ``cap`` s), announced in the sleep word."""
        bells = self.bells
        with self._drivers_lock:
            self.sleeping_callers += 1
            bells.callers_asleep.value = 1
        try:
            fence()  # the sleep word is visible before the last look for news (see spmd_shm.doorbell)
            if not self.try_progress() and not work.done:
                futex.wait(bells.my_address, bell, cap)
        finally:
            with self._drivers_lock:
                self.sleeping_callers -= 1
                if not self.sleeping_callers:
                    bells.callers_asleep.value = 0

    def _loop(self) -> None:
        """The background progress: ops nobody waits for, incoming messages, deadlines.

        While a caller drives, this thread stays parked. While the program submitted or drove an
        op within ``RECENT_USE`` seconds it ticks every ``TICK`` seconds rather than sleeping on
        the doorbell: announced there, it would be woken by every ring and compete with the
        program for the GIL and a core on each message (small ops that complete at submission,
        never driven, were 13 us per 4 B all_reduce instead of 6).
        """
        bells, wake = self.bells, self._wake
        while True:
            wake.clear()
            if self._drivers and not self._stopping:  # a caller is progressing: stay out of its way
                wake.wait(SLEEP_CAP)
                continue
            bell = bells.snapshot()
            with self._lock:
                if self._pass():
                    return
                moved = self.moves != self._seen or bool(self._inbox)
                busy = self._busy()
            if moved:
                continue
            if time.monotonic() - self._last_use < RECENT_USE:
                wake.wait(TICK)
                continue
            bells.thread_asleep.value = 1
            try:
                fence()  # announced before the last look for news (see spmd_shm.doorbell)
                with self._lock:
                    if self._pass():
                        return
                    moved = self.moves != self._seen or bool(self._inbox)
                if not moved:
                    futex.wait(bells.my_address, bell, SLEEP_CAP if busy else 1.0)
            finally:
                bells.thread_asleep.value = 0

    def _pass(self) -> bool:
        """One pass of the background thread (holding the lock); True when it must exit (closing)."""
        self._seen = self.moves
        self._body()
        if self._stopping and not self._inbox:
            self.peers.state[self.me].value = CLOSED
            if self._busy():
                self.fail_all(CollectiveError(f"shm backend of group {self.ctx.group_name!r} was closed with this op pending"))
            return True
        return False

    def fail_all(self, error: BaseException) -> None:
        """This rank gives up on the group: tell the peers (state BROKEN), fail every pending op."""
        if self.broken is None:
            self.broken = error
            if self.peers.state[self.me].value != CLOSED:
                self.peers.state[self.me].value = BROKEN
            self.bells.ring_all(self.others, LEAVING)
        refusal = self._refusal(error)
        while self._inbox:
            kind, (work, payload) = self._inbox.popleft()
            work.finish(refusal)
        for queue in (self._collectives, *self._sends):
            while queue:
                queue.popleft()[0].finish(refusal)
        self.rings.fail_all(refusal)

    def abandon(self) -> None:
        """Mark this rank gone for its peers at once (their waits on it fail now) and stop taking ops."""
        state = self.peers.state[self.me]
        if state.value not in (BROKEN, CLOSED):
            state.value = BROKEN
        self._abandoned = True
        self.kick()
        self.bells.ring_all(self.others, LEAVING)

    def close(self) -> None:
        """Stop the thread (pending ops fail), then mark this rank closed for its peers."""
        self._stopping = True
        self.kick()
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        self.peers.state[self.me].value = CLOSED
        self.bells.ring_all(self.others, LEAVING)
