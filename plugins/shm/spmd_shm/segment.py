"""The group's shared segment: who shares a host, creating and attaching it, and its layout.

The segment is a file under /dev/shm named after a random token (drawn by group rank 0 and
published through the group's store), the group and the host, so an earlier job's leftover is
never reused. Rank 0 unlinks it as soon as every rank has mapped it: the mappings stay valid and
nothing remains in /dev/shm, even if a rank is later SIGKILLed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import re
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass

import torch

from spmd import settings
from spmd.comm import hosts
from spmd.comm.backend import BackendContext
from spmd.comm.store_wait import missing_keys
from spmd.errors import BackendUnavailableError, CollectiveTimeoutError

_ALIGN = 64
#: Per rank control block: arrive (i64), ack (i64), pid (i64), state (i64), reduced (i64: the last round
#: whose slice this rank reduced in its slot) | doorbell (i32, futex word), sleep (two i32 halves: set
#: while the rank's callers, or its background thread, sleep on the doorbell).
_CTRL_BYTES = 128
ARRIVE, ACK, PID, STATE, REDUCED, DOORBELL, SLEEP = 0, 8, 16, 24, 32, 64, 72
#: STATE values (only the rank itself writes its own).
ATTACHED, BROKEN, CLOSED = 1, 2, 3
#: Per ordered pair of ranks: produced (i64, written by the sender), consumed (i64, by the receiver).
_PAIR_CTRL = 128
PACKET_HEADER = 32  # tag, total bytes, offset, length (i64 each)

log = logging.getLogger("spmd.shm")


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def shm_dir() -> str:
    """Where segments live: /dev/shm (memory-backed), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every region of the segment, the same on every rank."""

    size: int  # group size
    slot_bytes: int  # one collective slot (each rank has two, used in alternate rounds)
    packet_bytes: int  # one point-to-point packet's payload
    packets: int  # packets in flight per ordered pair

    @property
    def ctrl(self) -> int:
        return 0

    @functools.cached_property
    def slots(self) -> int:
        return _round_up(self.size * _CTRL_BYTES)

    @functools.cached_property
    def slot_stride(self) -> int:
        return _round_up(_ALIGN + self.slot_bytes)  # a header line (bytes written) + the data

    @functools.cached_property
    def pairs(self) -> int:
        return self.slots + 2 * self.size * self.slot_stride

    @functools.cached_property
    def packet_stride(self) -> int:
        return _round_up(PACKET_HEADER + self.packet_bytes)

    @functools.cached_property
    def pair_stride(self) -> int:
        return _PAIR_CTRL + self.packets * self.packet_stride

    @functools.cached_property
    def total(self) -> int:
        return self.pairs + self.size * self.size * self.pair_stride

    def ctrl_at(self, rank: int, field: int) -> int:
        return rank * _CTRL_BYTES + field

    def slot_at(self, rank: int, parity: int) -> int:
        """Offset of the slot's header line; its data starts one line later."""
        return self.slots + (2 * rank + parity) * self.slot_stride

    def pair_at(self, src: int, dst: int) -> int:
        return self.pairs + (src * self.size + dst) * self.pair_stride

    def packet_at(self, src: int, dst: int, index: int) -> int:
        return self.pair_at(src, dst) + _PAIR_CTRL + index * self.packet_stride


class Segment:
    """One mapping of the group's segment: a byte tensor over all of it, and int words in it."""

    def __init__(self, mm: mmap.mmap, layout: Layout) -> None:
        self.mm = mm
        self.layout = layout
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)

    def i64(self, offset: int) -> ctypes.c_int64:
        return ctypes.c_int64.from_buffer(self.mm, offset)

    def i32(self, offset: int) -> ctypes.c_int32:
        return ctypes.c_int32.from_buffer(self.mm, offset)


def segment_name(job: str, group: str, host: str) -> str:
    """The segment's file name: the job (where its launcher names one), a random token (a crashed earlier
    job's file is never taken for this one's), the group and the host, so that whoever finds one knows
    whose it is."""
    def part(text: str, size: int) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:size]

    job_part = f"{part(job, 32)}-" if job else ""
    return f"spmd-shm-{job_part}{secrets.token_hex(8)}-{part(group, 40)}-{part(host, 40)}"


def check_same_host(ctx: BackendContext) -> None:
    """Exchange host identities through the group's store; raise BackendUnavailableError if the group spans hosts.

    (``spmd.init()``'s own choice never picks this backend for such a group: this names the ranks that
    are elsewhere when a script asked for it by name.)
    """
    store = ctx.store
    store.set(f"shm/host/{ctx.rank}", hosts.host_identity())
    keys = [f"shm/host/{r}" for r in range(ctx.size)]
    missing = missing_keys(store, keys, ctx.timeout.total_seconds())
    if missing:
        raise CollectiveTimeoutError(f"shm: ranks {missing} of group {ctx.group_name!r} did not join its backend within "
                           f"{ctx.timeout.total_seconds():.1f} s")
    idents = [bytes(v).decode() for v in store.multi_get(keys)]
    if len(set(idents)) > 1:
        raise BackendUnavailableError(
            f"the shm backend serves only groups whose ranks share one host (and PID namespace), but group "
            f"{ctx.group_name!r} spans several: {hosts.describe(idents, list(range(ctx.size)))}. Use a network "
            "backend for this group (spmd.init() without a backend picks one; or new_group(..., backend='gloo'))"
        )


def open_segment(ctx: BackendContext, layout: Layout) -> Segment:
    """Create (rank 0) or attach the group's segment, wait until every rank attached, then unlink it.

    Rank 0 reserves the segment's memory up front (``posix_fallocate``): where /dev/shm is short of room
    (a container's 64 MiB default) it shrinks the slots and packets until the segment fits, and publishes
    the layout it chose with the segment's name; where even the smallest does not fit, every rank raises
    the same named error at once (a write to an unreserved page of a full tmpfs would be a SIGBUS).
    """
    store = ctx.store
    deadline = time.monotonic() + ctx.timeout.total_seconds()
    if ctx.rank == 0:
        path = os.path.join(shm_dir(), segment_name(settings.job_id(), ctx.group_name, socket.gethostname()))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                fitted = _reserve(fd, layout, ctx.group_name)
                if fitted is None:
                    problem = _no_room(layout, ctx.group_name)
                    store.set("shm/segment", "error|" + problem)
                    raise BackendUnavailableError(problem)
                layout = fitted
                mm = mmap.mmap(fd, layout.total)
            finally:
                os.close(fd)
            segment = Segment(mm, layout)
            _attach(segment, 0)
            store.set("shm/segment", f"{path}|{layout.slot_bytes}|{layout.packet_bytes}")
            _await_attached(segment, ctx, deadline)
        finally:
            os.unlink(path)
        return segment
    store.wait(["shm/segment"], ctx.timeout)
    published = store.get("shm/segment").decode()
    if published.startswith("error|"):
        raise BackendUnavailableError(published.partition("|")[2])
    path, slot_bytes, packet_bytes = published.rsplit("|", 2)
    layout = Layout(layout.size, int(slot_bytes), int(packet_bytes), layout.packets)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as error:
        raise BackendUnavailableError(
            f"shared segment {path} of group {ctx.group_name!r} vanished before this rank attached: group rank 0 "
            "gave up waiting (its timeout) or died; check that every rank creates the group in time"
        ) from error
    try:
        mm = mmap.mmap(fd, layout.total)
    finally:
        os.close(fd)
    segment = Segment(mm, layout)
    _attach(segment, ctx.rank)
    return segment


#: The smallest slot and packet a segment shrinks to where /dev/shm is short of room.
MIN_SLOT_BYTES, MIN_PACKET_BYTES = 64 << 10, 16 << 10


def _reserve(fd: int, layout: Layout, group: str) -> Layout | None:
    """Size the file and reserve its memory: ``layout``, or (no room) the largest halving of its slots and
    packets that fits; None if not even the smallest does."""
    wanted = layout
    while True:
        os.ftruncate(fd, layout.total)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, layout.total)
            break
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            os.ftruncate(fd, 0)  # (gives back what the failed reservation took)
            if layout.slot_bytes <= MIN_SLOT_BYTES and layout.packet_bytes <= MIN_PACKET_BYTES:
                return None
            layout = Layout(layout.size, max(MIN_SLOT_BYTES, layout.slot_bytes // 2),
                            max(MIN_PACKET_BYTES, layout.packet_bytes // 2), layout.packets)
    if layout != wanted:
        log.warning("shm: %s had no room for group %r's %d MiB segment: it uses %d KiB slots and %d KiB packets instead "
                    "of %d KiB and %d KiB (%d MiB; large messages take more rounds). Give /dev/shm more room (docker "
                    "run --shm-size=1g, or a larger tmpfs) for full speed", shm_dir(), group, wanted.total >> 20,
                    layout.slot_bytes >> 10, layout.packet_bytes >> 10, wanted.slot_bytes >> 10,
                    wanted.packet_bytes >> 10, layout.total >> 20)
    return layout


def _no_room(layout: Layout, group: str) -> str:
    """The error when not even the smallest segment fits in /dev/shm."""
    smallest = Layout(layout.size, MIN_SLOT_BYTES, MIN_PACKET_BYTES, layout.packets)
    try:
        stats = os.statvfs(shm_dir())
        free = f"{stats.f_bavail * stats.f_frsize / 2**20:.1f} MiB free"
    except OSError:
        free = "too little room"
    return (f"shm: {shm_dir()} has {free}, but group {group!r} of {layout.size} ranks needs a shared segment of at least "
            f"{smallest.total / 2**20:.1f} MiB ({layout.total / 2**20:.1f} MiB at full speed); give /dev/shm more room (docker run "
            "--shm-size=1g, or a larger tmpfs), or use a network backend: SPMD_BACKEND=gloo, or spmd.init('gloo')")


def _attach(segment: Segment, rank: int) -> None:
    lay = segment.layout
    segment.i64(lay.ctrl_at(rank, PID)).value = os.getpid()
    segment.i64(lay.ctrl_at(rank, STATE)).value = ATTACHED


def _await_attached(segment: Segment, ctx: BackendContext, deadline: float) -> None:
    lay = segment.layout
    states = [segment.i64(lay.ctrl_at(r, STATE)) for r in range(ctx.size)]
    delay = 1e-4
    while True:
        missing = [r for r, s in enumerate(states) if s.value == 0]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"shm: group ranks {missing} of group {ctx.group_name!r} did not attach the shared segment within "
                f"{ctx.timeout.total_seconds():.1f} s; they may have died or be stuck before their first collective"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
