"""Point-to-point through the segment: a ring of packets per ordered pair of ranks.

The sender copies a message packet by packet into its ring to the receiver, waiting only for free
packets; the receiver drains them into the matching posted recv, or keeps them aside until that
recv is posted, so a sender never waits for its receiver to call recv.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from spmd.errors import CollectiveError
from spmd_shm.peers import CHECK_PERIOD, Peers, Steps
from spmd_shm.segment import PACKET_HEADER, Segment
from spmd_shm.work import ShmWork

_HEADER = struct.Struct("<qqqq")  # tag, total bytes, offset, length


class Recv:
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
        self.claimed: Recv | None = None

    def complete(self) -> None:
        self.done = True
        if self.claimed is not None:
            _deliver(self, self.claimed)


def _deliver(stash: _Stash, recv: Recv) -> None:
    if stash.buf.numel() != recv.buf.numel():
        recv.work.finish(_size_error(recv, stash.buf.numel()))
    else:
        recv.buf.copy_(stash.buf)
        recv.work.finish(None)


def _size_error(recv: Recv, total: int) -> CollectiveError:
    return CollectiveError(
        f"shm: group rank {recv.src} sent {total} bytes with tag {recv.tag}, but the matching recv on this rank "
        f"has room for exactly {recv.buf.numel()} bytes; send and recv must use tensors of the same size and dtype"
    )


class Rings:
    """This rank's outgoing and incoming packet rings, its posted recvs and early messages (progress thread)."""

    def __init__(self, segment: Segment, peers: Peers, notify: Callable[[Iterable[int]], None]) -> None:
        self.peers = peers
        self.seg = segment
        lay = self.lay = segment.layout
        n, me = peers.n, peers.me
        self.me = me
        self._notify = notify  # after producing or consuming packets: counts a move and wakes the peer if it sleeps
        i64 = segment.i64
        # my outgoing rings (I write produced) and incoming ones (I write consumed)
        self.out_produced = [i64(lay.pair_at(me, d)) for d in range(n)]
        self.out_consumed = [i64(lay.pair_at(me, d) + 64) for d in range(n)]
        self.in_produced = [i64(lay.pair_at(s, me)) for s in range(n)]
        self.in_consumed = [i64(lay.pair_at(s, me) + 64) for s in range(n)]
        self.sent = [0] * n
        self.received = [0] * n
        self._posted: list[list[Recv]] = [[] for _ in range(n)]
        self._unexpected: list[list[_Stash]] = [[] for _ in range(n)]
        self._incoming: list[Recv | _Stash | None] = [None] * n
        #: Posted recvs not yet complete: watched for aborts, deadlines and dead senders.
        self.waiting: list[Recv] = []
        self._next_check = 0.0  # time.monotonic() of the next check_recvs that looks
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self._ranks = [[q] for q in range(n)]  # [q], made once (a gate's rank list)

    def send_steps(self, work: ShmWork, data: torch.Tensor, dst: int, tag: int) -> Steps:
        """Copy ``data`` (bytes) into the ring to ``dst`` packet by packet, waiting for free packets."""
        total, sent, first = data.numel(), 0, True
        consumed, k_max = self.out_consumed[dst], self.lay.packets
        while first or sent < total:
            first = False
            if self.sent[dst] - consumed.value >= k_max:  # the ring is full: wait for the receiver
                what = f"send to {self.peers.label[dst]} (tag {tag}, {total} bytes)"
                yield from self.peers.wait_for(work, lambda: [dst] if self.sent[dst] - consumed.value >= k_max else [], what)
            sent += self.write_packet(data, dst, tag, sent)

    def has_room(self, dst: int) -> bool:
        """Whether the ring to ``dst`` has a free packet."""
        return self.sent[dst] - self.out_consumed[dst].value < self.lay.packets

    def write_packet(self, data: torch.Tensor, dst: int, tag: int, sent: int) -> int:
        """Copy the packet of ``data`` (bytes) that starts at byte ``sent`` into the ring to ``dst``, which
        has room, and publish it; returns its payload length."""
        lay, total, k = self.lay, data.numel(), self.sent[dst]
        off = lay.packet_at(self.me, dst, k % lay.packets)
        length = min(lay.packet_bytes, total - sent)
        _HEADER.pack_into(self.seg.mm, off, tag, total, sent, length)
        if length:
            self._payload(off, length).copy_(data if length == total else data[sent : sent + length])
        self.sent[dst] = k + 1
        self.out_produced[dst].value = k + 1
        self._notify((dst,))
        return length

    def _payload(self, off: int, length: int) -> torch.Tensor:
        """The first ``length`` payload bytes of the packet at ``off`` (views cached: slicing costs a
        microsecond, a small message only a few)."""
        key = (off, length)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 4096:
                self._views.clear()
            view = self._views[key] = self.seg.bytes[off + PACKET_HEADER : off + PACKET_HEADER + length]
        return view

    def post(self, recv: Recv) -> None:
        """Take a recv: delivered from an early message if one with its tag is here, else posted."""
        src = recv.src
        for i, stash in enumerate(self._unexpected[src]):
            if stash.tag == recv.tag:
                del self._unexpected[src][i]
                if stash.done:
                    _deliver(stash, recv)
                else:
                    stash.claimed = recv
                    self.waiting.append(recv)
                return
        self._posted[src].append(recv)
        self.waiting.append(recv)
        recv.work.gate = self._gate(src)

    def _match(self, src: int, tag: int, total: int) -> Recv | _Stash:
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

    def drain(self, src: int) -> bool:
        """Take every packet ``src`` has produced for this rank; True if there was any."""
        produced = self.in_produced[src].value
        if self.received[src] >= produced:
            return False
        lay, mm = self.lay, self.seg.mm
        while self.received[src] < produced:
            off = lay.packet_at(src, self.me, self.received[src] % lay.packets)
            tag, total, offset, length = _HEADER.unpack_from(mm, off)
            target = self._incoming[src]
            if offset == 0 or target is None:
                target = self._incoming[src] = self._match(src, tag, total)
            if length:
                buf = target.buf
                (buf if length == buf.numel() else buf[offset : offset + length]).copy_(self._payload(off, length))
            self.received[src] += 1
            if offset + length >= total:
                self._incoming[src] = None
                target.complete()
        self.in_consumed[src].value = self.received[src]
        self._notify((src,))
        if self._posted[src]:  # still waiting: their callers poll for the next packet alone
            gate = self._gate(src)
            for recv in self._posted[src]:
                recv.work.gate = gate
        return True

    def _gate(self, src: int) -> tuple[list[Any], list[int], int]:
        """A recv from ``src`` can move once ``src`` produced a packet past those taken (see ``ShmWork.gate``):
        a caller waiting for it polls that one word between full passes of the engine."""
        return (self.in_produced, self._ranks[src], self.received[src] + 1)

    def _missing(self, recv: Recv) -> Callable[[], list[int]]:
        """``[src]`` while ``recv`` still waits for its sender (after taking what the sender wrote)."""
        return lambda: [] if recv.work.done or self.drain(recv.src) and recv.work.done else [recv.src]

    def pending(self) -> bool:
        """Whether a posted recv still waits (the completed ones are dropped from ``waiting`` here)."""
        waiting = self.waiting
        if waiting and any(r.work.done for r in waiting):
            waiting = self.waiting = [r for r in waiting if not r.work.done]
        return bool(waiting)

    def check_recvs(self) -> None:
        """Fail recvs that were aborted, ran out of time, or whose sender is gone (at most every
        ``CHECK_PERIOD`` seconds: a waiting caller progresses every microsecond or two)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_PERIOD
        pending = [r for r in self.waiting if not r.work.done]
        self.waiting = pending
        for recv in pending:
            src = recv.src
            what = f"recv from {self.peers.label[src]} (tag {recv.tag})"
            try:
                self.peers.check(recv.work, self._missing(recv), what)
            except BaseException as error:  # noqa: BLE001 - delivered to the waiter
                if recv in self._posted[src]:
                    self._posted[src].remove(recv)
                recv.work.finish(error)

    def fail_all(self, refusal: BaseException) -> None:
        """Fail every posted recv with ``refusal`` (the group is given up)."""
        for recv in self.waiting:
            recv.work.finish(refusal)
        self.waiting = []
        for posted in self._posted:
            posted.clear()
