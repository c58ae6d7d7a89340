"""The progress engine of one group's shm backend: a thread that drives every op of this rank.

Collectives run one at a time, in call order, as generators over *rounds*: in round r each rank
may write its slot (two per rank, used in alternate rounds), publishes ``arrive = r``, waits for
the ranks it reads from, reads, and publishes ``ack = r``; a slot is rewritten only once every
rank acked the round that last used it. Point-to-point messages travel in packets through a ring
per ordered pair of ranks; the receiver drains them into the matching posted recv, or keeps them
aside until that recv is posted, so a sender never waits for its receiver to call recv.

Each counter is written by one rank only. A waiting caller polls for ``Engine.spin`` seconds, then
sleeps on its own doorbell word (a futex), which a writer changes and wakes only while the sleep
word says someone sleeps there (``spmd_shm.doorbell``): two ranks on two cores never steal each
other's core, and ranks in step make no syscall. Every wait has a deadline and watches the peers it waits for
(aborted, closed or exited), so a dead peer is a named error, not a hang.
"""

from __future__ import annotations

import collections
import os
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch

from spmd.comm.backend import BackendContext
from spmd.errors import CollectiveError
from spmd_shm import futex
from spmd_shm.doorbell import LEAVING, Doorbells, fence
from spmd_shm.segment import (
    ACK,
    ARRIVE,
    BROKEN,
    CLOSED,
    PACKET_HEADER,
    PID,
    STATE,
    Segment,
)
from spmd_shm.work import ShmWork

#: Seconds a waiting caller keeps polling (after its last progress) before it sleeps on its doorbell,
#: while the group's ranks fit the CPUs this process may use: long enough to cover a peer's own
#: per-op Python (20 us spins slept at most ops of a back-to-back loop: 4 B all_reduce 120 vs 20 us
#: median on the 2-core host). With more ranks than CPUs a spinner would hold the core its peer
#: needs, so it sleeps almost at once.
SPIN_SECONDS = float(os.environ.get("SPMD_SHM_SPIN_US", "100")) * 1e-6
OVERSUBSCRIBED_SPIN_SECONDS = 2e-6
#: Longest single sleep: deadlines, aborts and dead peers are noticed at least this often.
SLEEP_CAP = 0.05
#: While the program waited for an op this recently (seconds), the background thread polls every
#: TICK seconds rather than sleeping on the doorbell (see ``Engine._loop``).
RECENT_DRIVE = 0.02
TICK = 0.005
#: Seconds between checks that the awaited peers' processes still exist.
LIVENESS_PERIOD = 0.05

_HEADER = struct.Struct("<qqqq")  # tag, total bytes, offset, length
Steps = Generator[None, None, Any]


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _alive(pid: int) -> bool:
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


class _Recv:
    """A posted recv: where the bytes go, or the error to report once its message is drained."""

    __slots__ = ("work", "buf", "src", "tag", "error")

    def __init__(self, work: ShmWork, buf: torch.Tensor, src: int, tag: int) -> None:
        self.work, self.buf, self.src, self.tag = work, buf, src, tag
        self.error: BaseException | None = None

    def complete(self) -> None:
        self.work.finish(self.error)


class _Stash:
    """A message that arrived before its recv was posted: kept here, copied when the recv comes."""

    __slots__ = ("buf", "tag", "done", "claimed")

    def __init__(self, tag: int, total: int) -> None:
        self.buf = torch.empty(total, dtype=torch.uint8)
        self.tag = tag
        self.done = False
        self.claimed: _Recv | None = None

    def complete(self) -> None:
        self.done = True
        if self.claimed is not None:
            _deliver(self, self.claimed)


def _deliver(stash: _Stash, recv: _Recv) -> None:
    if stash.buf.numel() != recv.buf.numel():
        recv.work.finish(_size_error(recv, stash.buf.numel()))
    else:
        recv.buf.copy_(stash.buf)
        recv.work.finish(None)


def _size_error(recv: _Recv, total: int) -> CollectiveError:
    return CollectiveError(
        f"shm: group rank {recv.src} sent {total} bytes with tag {recv.tag}, but the matching recv on this rank "
        f"has room for exactly {recv.buf.numel()} bytes; send and recv must use tensors of the same size and dtype"
    )


class Engine:
    """Owns the segment's views and the progress thread; the backend submits generators to it."""

    def __init__(self, ctx: BackendContext, segment: Segment) -> None:
        self.ctx = ctx
        self.seg = segment
        lay = self.lay = segment.layout
        n, me = ctx.size, ctx.rank
        self.n, self.me = n, me
        self.others = [r for r in range(n) if r != me]
        self.timeout = ctx.timeout.total_seconds()
        self.spin = SPIN_SECONDS if n <= _usable_cpus() else min(SPIN_SECONDS, OVERSUBSCRIBED_SPIN_SECONDS)
        i64 = segment.i64
        self.arrive = [i64(lay.ctrl_at(r, ARRIVE)) for r in range(n)]
        self.ack = [i64(lay.ctrl_at(r, ACK)) for r in range(n)]
        self.pid = [i64(lay.ctrl_at(r, PID)) for r in range(n)]
        self.state = [i64(lay.ctrl_at(r, STATE)) for r in range(n)]
        self.bells = Doorbells(segment, n, me)
        data = segment.bytes
        self.slot_size = [[i64(lay.slot_at(r, p)) for p in (0, 1)] for r in range(n)]
        self.slot_sig = [[i64(lay.slot_at(r, p) + 8) for p in (0, 1)] for r in range(n)]
        self.slot = [
            [data[lay.slot_at(r, p) + 64 : lay.slot_at(r, p) + 64 + lay.slot_bytes] for p in (0, 1)] for r in range(n)
        ]
        # point-to-point: my outgoing rings (I write produced) and incoming ones (I write consumed)
        self.out_produced = [i64(lay.pair_at(me, d)) for d in range(n)]
        self.out_consumed = [i64(lay.pair_at(me, d) + 64) for d in range(n)]
        self.in_produced = [i64(lay.pair_at(s, me)) for s in range(n)]
        self.in_consumed = [i64(lay.pair_at(s, me) + 64) for s in range(n)]
        self.sent = [0] * n
        self.received = [0] * n
        self.round = 0
        self.moves = 0  # bumped by every step that changed shared state (the spin's progress signal)
        # work queues: the inbox is filled by callers, everything else belongs to the thread
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._collectives: collections.deque[tuple[ShmWork, Steps]] = collections.deque()
        self._sends: list[collections.deque[tuple[ShmWork, Steps]]] = [collections.deque() for _ in range(n)]
        self._posted: list[list[_Recv]] = [[] for _ in range(n)]
        self._unexpected: list[list[_Stash]] = [[] for _ in range(n)]
        self._incoming: list[_Recv | _Stash | None] = [None] * n
        self._waiting_recvs: list[_Recv] = []
        self.broken: BaseException | None = None
        self._stopping = False
        self._abandoned = False
        self._lock = threading.Lock()  # held by whichever thread progresses (the engine's or a waiting caller's)
        self._drivers = 0  # callers inside drive()
        self.sleeping_callers = 0  # callers of drive() asleep on the doorbell (a finish must wake them)
        self._drivers_lock = threading.Lock()
        self._last_drive = 0.0
        self._wake = threading.Event()  # set by kick(): the background thread's park or tick ends early
        self._next_liveness = 0.0
        self._seen = 0  # self.moves at the background thread's last pass
        self._views: dict[tuple[int, int, torch.dtype, int, int], torch.Tensor] = {}
        self._thread = threading.Thread(target=self._loop, name=f"spmd-shm-{ctx.group_name}", daemon=True)
        self._thread.start()

    # -- submission (any thread) ----------------------------------------------------------
    def new_work(self) -> ShmWork:
        return ShmWork(self, time.monotonic() + self.timeout)

    def submit(self, kind: str, work: ShmWork, payload: Any) -> ShmWork:
        """Queue an op for the progress thread: kind is "coll" (a generator), "send" (dst, generator) or "recv"."""
        broken = self.broken
        if broken is not None:
            work.finish(self._refusal(broken))
            return work
        self._inbox.append((kind, (work, payload)))
        # Start it here (publish this rank's part) if no thread is progressing; else make sure the
        # thread that is sees the inbox before it sleeps.
        if self.try_progress() is None:
            self.kick()
        return work

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

    # -- signalling (progress thread) ---------------------------------------------------------
    def ring(self, ranks: Iterable[int]) -> None:
        """Wake those of ``ranks`` that sleep, after publishing something they may wait for."""
        self.bells.ring(ranks)

    def global_names(self, ranks: list[int]) -> str:
        if self.ctx.global_ranks and list(self.ctx.global_ranks) != list(range(self.n)):
            return f"group ranks {ranks} (global ranks {[self.ctx.global_ranks[r] for r in ranks]})"
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
                raise CollectiveError(f"shm: {self.global_names([q])} {why} while this rank waited for it at {what}")
        now = time.monotonic()
        if now > work.deadline:
            raise TimeoutError(f"shm: {self.global_names(missing)} did not arrive at {what} within {self.timeout:.1f} s")
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_PERIOD
            for q in missing:
                pid = self.pid[q].value
                if pid and not _alive(pid) and q in missing_fn():
                    raise CollectiveError(
                        f"shm: {self.global_names([q])} (pid {pid}) exited, killed or crashed, while this rank waited for "
                        f"it at {what}; the job cannot continue on this group"
                    )

    def wait_for(self, work: ShmWork, missing_fn: Callable[[], list[int]], what: str) -> Steps:
        """Yield until ``missing_fn()`` is empty, checking deadline, abort and peers in between."""
        while missing_fn():
            self.check(work, missing_fn, what)
            yield

    def wait_counters(self, work: ShmWork, words: list[Any], ranks: list[int], at_least: int, what: str) -> Steps:
        """Yield until ``words[q] >= at_least`` for every q in ``ranks`` (the common case: no yield at all)."""
        for q in ranks:
            if words[q].value < at_least:
                yield from self.wait_for(work, lambda: [q for q in ranks if words[q].value < at_least], what)
                return

    # -- rounds (collectives' building blocks, progress thread) ---------------------------------
    def begin_round(self, work: ShmWork, what: str) -> Steps:
        """Start the next round; returns it once this rank's slot for it is free to write."""
        r = self.round = self.round + 1
        if r > 2:
            yield from self.wait_counters(work, self.ack, self.others, r - 2, what)
        return r

    def publish(self, r: int) -> None:
        self.arrive[self.me].value = r
        self.moves += 1
        self.ring(self.others)

    def await_arrival(self, work: ShmWork, r: int, ranks: list[int], what: str) -> Steps:
        yield from self.wait_counters(work, self.arrive, ranks, r, what)

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
        self.ack[self.me].value = r
        self.moves += 1
        self.ring(self.others)

    # -- point-to-point (progress thread) --------------------------------------------------
    def send_steps(self, work: ShmWork, data: torch.Tensor, dst: int, tag: int) -> Steps:
        """Copy ``data`` (bytes) into the ring to ``dst`` packet by packet, waiting for free packets."""
        lay, mm, seg = self.lay, self.seg.mm, self.seg.bytes
        total, sent, first = data.numel(), 0, True
        consumed, k_max = self.out_consumed[dst], lay.packets
        what = f"send to {self.global_names([dst])} (tag {tag}, {total} bytes)"
        while first or sent < total:
            first = False
            yield from self.wait_for(work, lambda: [dst] if self.sent[dst] - consumed.value >= k_max else [], what)
            off = lay.packet_at(self.me, dst, self.sent[dst] % k_max)
            length = min(lay.packet_bytes, total - sent)
            _HEADER.pack_into(mm, off, tag, total, sent, length)
            if length:
                seg[off + PACKET_HEADER : off + PACKET_HEADER + length].copy_(data[sent : sent + length])
            self.sent[dst] += 1
            self.out_produced[dst].value = self.sent[dst]
            self.moves += 1
            self.ring((dst,))
            sent += length

    def _post_recv(self, recv: _Recv) -> None:
        src = recv.src
        for i, stash in enumerate(self._unexpected[src]):
            if stash.tag == recv.tag:
                del self._unexpected[src][i]
                if stash.done:
                    _deliver(stash, recv)
                else:
                    stash.claimed = recv
                    self._waiting_recvs.append(recv)
                return
        self._posted[src].append(recv)
        self._waiting_recvs.append(recv)

    def _match(self, src: int, tag: int, total: int) -> _Recv | _Stash:
        posted = self._posted[src]
        for i, recv in enumerate(posted):
            if recv.tag == tag:
                del posted[i]
                if recv.buf.numel() != total:
                    recv.error = _size_error(recv, total)
                    recv.buf = torch.empty(total, dtype=torch.uint8)  # drain the message, then fail the recv
                return recv
        stash = _Stash(tag, total)
        self._unexpected[src].append(stash)
        return stash

    def _drain(self, src: int) -> bool:
        """Take every packet ``src`` has produced for this rank; True if there was any."""
        produced = self.in_produced[src].value
        if self.received[src] >= produced:
            return False
        lay, mm, seg = self.lay, self.seg.mm, self.seg.bytes
        while self.received[src] < produced:
            off = lay.packet_at(src, self.me, self.received[src] % lay.packets)
            tag, total, offset, length = _HEADER.unpack_from(mm, off)
            target = self._incoming[src]
            if offset == 0 or target is None:
                target = self._incoming[src] = self._match(src, tag, total)
            if length:
                target.buf[offset : offset + length].copy_(seg[off + PACKET_HEADER : off + PACKET_HEADER + length])
            self.received[src] += 1
            if offset + length >= total:
                self._incoming[src] = None
                target.complete()
        self.in_consumed[src].value = self.received[src]
        self.moves += 1
        self.ring((src,))
        return True

    def _recv_missing(self, recv: _Recv) -> Callable[[], list[int]]:
        """``[src]`` while ``recv`` still waits for its sender (after taking what the sender wrote)."""
        return lambda: [] if recv.work.done or self._drain(recv.src) and recv.work.done else [recv.src]

    def _check_recvs(self) -> None:
        """Fail recvs that were aborted, ran out of time, or whose sender is gone."""
        pending = [r for r in self._waiting_recvs if not r.work.done]
        self._waiting_recvs = pending
        for recv in pending:
            src = recv.src
            what = f"recv from {self.global_names([src])} (tag {recv.tag})"
            try:
                self.check(recv.work, self._recv_missing(recv), what)
            except BaseException as error:  # noqa: BLE001 - delivered to the waiter
                if recv in self._posted[src]:
                    self._posted[src].remove(recv)
                recv.work.finish(error)

    # -- the thread -----------------------------------------------------------------------
    def _accept(self, kind: str, item: tuple[ShmWork, Any]) -> None:
        work, payload = item
        if kind == "coll":
            self._collectives.append((work, payload))
        elif kind == "send":
            dst, steps = payload
            self._sends[dst].append((work, steps))
        else:
            self._post_recv(payload)

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
            self._drain(src)
        if self._collectives:
            self._advance(self._collectives)
        for dst in self.others:
            if self._sends[dst]:
                self._advance(self._sends[dst])
        if self.n == 1 and self._sends[0]:
            self._advance(self._sends[0])

    def _busy(self) -> bool:
        return bool(self._collectives or self._waiting_recvs or any(self._sends))

    def _body(self) -> None:
        """One round of progress on everything; the caller holds ``self._lock``."""
        try:
            self._step()
            if self._waiting_recvs:
                self._check_recvs()
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
        try:
            spin = self.spin
            spin_until = time.monotonic() + spin
            while not work.done:
                bell = bells.snapshot()
                moved = self.try_progress()
                if work.done:
                    break
                now = time.monotonic()
                if moved:
                    spin_until = now + spin
                    continue
                if deadline is not None and now >= deadline:
                    return False
                if now < spin_until:
                    continue
                self._sleep_caller(work, bell, SLEEP_CAP if deadline is None else max(0.0, min(SLEEP_CAP, deadline - now)))
            return True
        finally:
            self._last_drive = time.monotonic()
            with self._drivers_lock:
                self._drivers -= 1
                last = not self._drivers
            if last and (self._inbox or self._busy()):  # ops nobody waits for now: the thread takes over
                self._wake.set()

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

        While a caller drives, this thread stays parked. While the program drove an op within
        ``RECENT_DRIVE`` seconds it ticks every ``TICK`` seconds rather than sleeping on the
        doorbell: announced there, it would be woken by every ring and compete with the next
        waiting caller for the GIL and a core on each message.
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
            if time.monotonic() - self._last_drive < RECENT_DRIVE:
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
            self.state[self.me].value = CLOSED
            if self._busy():
                self.fail_all(CollectiveError(f"shm backend of group {self.ctx.group_name!r} was closed with this op pending"))
            return True
        return False

    def fail_all(self, error: BaseException) -> None:
        """This rank gives up on the group: tell the peers (state BROKEN), fail every pending op."""
        if self.broken is None:
            self.broken = error
            if self.state[self.me].value != CLOSED:
                self.state[self.me].value = BROKEN
            self.bells.ring_all(self.others, LEAVING)
        refusal = self._refusal(error)
        while self._inbox:
            kind, (work, payload) = self._inbox.popleft()
            work.finish(refusal)
        for queue in (self._collectives, *self._sends):
            while queue:
                queue.popleft()[0].finish(refusal)
        for recv in self._waiting_recvs:
            recv.work.finish(refusal)
        self._waiting_recvs = []
        for posted in self._posted:
            posted.clear()

    def abandon(self) -> None:
        """Mark this rank gone for its peers at once (their waits on it fail now) and stop taking ops."""
        if self.state[self.me].value not in (BROKEN, CLOSED):
            self.state[self.me].value = BROKEN
        self._abandoned = True
        self.kick()
        self.bells.ring_all(self.others, LEAVING)

    def close(self) -> None:
        """Stop the thread (pending ops fail), then mark this rank closed for its peers."""
        self._stopping = True
        self.kick()
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        self.state[self.me].value = CLOSED
        self.bells.ring_all(self.others, LEAVING)
