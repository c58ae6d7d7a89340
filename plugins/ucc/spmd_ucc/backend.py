"""UccBackend: spmd's Backend contract over UCX tag messaging, with a native all-reduce.

Point-to-point: ``isend``/``irecv`` post UCX tag sends and receives straight
on the tensor's memory (a zero-copy NumPy view). UCX matches tags per worker,
not per sender, so the 64-bit UCX tag carries the group, the sender and
spmd's tag::

    bits 46..63  group id (agreed through the store; unique per job until 2**18 groups)
    bits 29..45  sender's rank in the group
    bits  0..28  spmd's tag: < 2**24 user p2p, 2**24..2**25 the kernel's generic
                 collectives, 2**28 + (seq << 10) + step for this backend's own

Collectives: all-reduce is native (recursive doubling up to
``SPMD_UCC_RING_BYTES``, else a ring whose chunks travel in segments, so each
segment is reduced and forwarded while the next ones are still moving). Each
native collective is a generator that posts requests and yields the ones it
must wait for; the engine's progress advances it, in whichever thread is
progressing, so a synchronous call runs entirely in the caller's thread and
an async one runs in the background. The other collectives are the kernel's
generic algorithms over isend/irecv.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from spmd.comm.backend import Backend, BackendContext
from spmd.comm.buffers import BufferPool
from spmd.comm.reduce_op import ReduceOp, finish_avg, reduce_into
from spmd.comm.work import NativeWork, Work
from spmd.errors import BackendUnavailableError, CollectiveError
from spmd_ucc.engine import Engine, Peer, Pending, existing_engine, get_engine
from spmd_ucc.placement import host_identity, spans_namespaces

_GID_BITS, _RANK_BITS, _TAG_BITS = 18, 17, 29
_GID_SHIFT, _RANK_SHIFT = _RANK_BITS + _TAG_BITS, _TAG_BITS
_NATIVE = 1 << 28
_SEQ_SPAN = 1 << 18
_STEP_SPAN = 1 << 10

#: All-reduce uses recursive doubling up to this many bytes, the segmented ring above
#: (None: 2 MiB for two ranks, 4 MiB for more). Measured on 2 shared cores, ws 2-4: the ring
#: moves less data, but each of its 2(n-1) steps costs a wake-up (~50-100 us here), so it
#: only wins from a few MiB; with a core per rank the crossover is likely lower.
RING_BYTES: int | None = int(os.environ["SPMD_UCC_RING_BYTES"]) if os.environ.get("SPMD_UCC_RING_BYTES") else None
#: Seconds an operation may go without progress after a peer of its group failed.
FAILURE_GRACE = float(os.environ.get("SPMD_UCC_FAILURE_GRACE", "2"))
#: Bytes per ring segment: the unit that is reduced and forwarded while the rest moves.
#: (Measured, 2 ranks, 64 MiB: 4 MiB segments 18 ms, 1 MiB 22 ms: each segment costs a round.)
SEGMENT_BYTES = int(os.environ.get("SPMD_UCC_SEGMENT_BYTES", str(4 << 20)))

Requests = tuple[Any, ...]


#: Guards each op's done flag against a concurrent add_done_callback (held for nanoseconds).
_DONE_LOCK = threading.Lock()


class EngineWork(Pending):
    """An op the process's UCX engine drives, seen by the kernel through the public
    ``spmd.comm.work.NativeWork`` protocol: ``poll``, ``wait``, ``abort``, ``error``,
    ``add_done_callback`` (the kernel wraps it into a Work)."""

    _backend: UccBackend
    _finished = False
    _failure: BaseException | None = None
    _done_fns: list[Callable[[], object]] | None = None
    _aborted = False

    def _deliver(self) -> None:
        """Mark the op finished and run the kernel's done-callbacks (once)."""
        with _DONE_LOCK:
            self._finished = True
            fns, self._done_fns = self._done_fns, None
        for fn in fns or ():
            fn()

    # -- spmd.comm.work.NativeWork -----------------------------------------------------
    def poll(self) -> bool:
        if not self._finished:
            self._backend.engine.try_progress()
        return self._finished

    def wait(self, timeout: float | None) -> bool:
        if self._finished:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._backend.engine.wait_until(lambda: self._finished or self._aborted, deadline):
            if not self._finished:  # aborted: this wait ends; the engine keeps the op (and its buffers)
                self._failure = CollectiveError("UCX: spmd gave up on this op (aborted)")
            return True
        return False

    def abort(self) -> None:
        """The kernel gave up on the op: a wait in progress returns within a progress round (50 ms).
        UCX requests are not cancelled one by one: the engine keeps the op, and its buffers, until
        UCX ends it (a failed peer ends it within FAILURE_GRACE)."""
        self._aborted = True

    def error(self) -> BaseException | None:
        return self._failure

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        with _DONE_LOCK:
            if not self._finished:
                if self._done_fns is None:
                    self._done_fns = []
                self._done_fns.append(fn)
                pending = True
            else:
                pending = False
        if pending:
            self._backend.engine.wants_callback(self)
        else:
            fn()


class UcxWork(EngineWork):
    """One UCX request (isend/irecv)."""

    def __init__(self, backend: UccBackend, req: Any, buffer: Any, peer: Peer, what: str) -> None:
        self._backend = backend
        self._req = req
        self._buffer = buffer  # what UCX reads or writes: alive until the request is done
        self._peer = peer
        self._what = what
        self._failure: BaseException | None = None
        self._born = time.monotonic()

    def advance(self) -> bool:
        if self._req.completed:
            self._failure = self._backend.request_error(self._req, self._peer, self._what)
            return True
        if self._backend.failure is None:
            return False
        if self._peer.failure is not None:  # the peer itself is gone: fail now, not at the timeout
            self._failure = CollectiveError(self._backend.failure)
        else:
            self._failure = self._backend.stalled_since_failure(self._born)
            if self._failure is None:
                return False
        self._backend.engine.bury([(self._req, self._buffer)])
        return True

    def complete(self) -> None:
        self._req = self._buffer = None
        self._deliver()


class CollectiveOp(EngineWork):
    """A native collective: a generator that yields the requests it waits for next."""

    def __init__(self, backend: UccBackend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._gen: Generator[Requests, None, None] | None = None
        self._waiting: Requests = ()
        self._posted: list[tuple[Any, Any, int]] = []  # every (request, buffer, peer): kept until the op ends
        self._failure: BaseException | None = None
        self._progressed = time.monotonic()  # when it last advanced

    # used by the algorithms
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        req = self._backend.post_send(tensor, dst, tag)
        self._posted.append((req, tensor, dst))
        return req

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        req = self._backend.post_recv(tensor, src, tag)
        self._posted.append((req, tensor, src))
        return req

    def start(self, gen: Generator[Requests, None, None]) -> CollectiveOp:
        self._gen = gen
        if not self.advance():
            self._backend.engine.register(self)
            return self
        self.complete()
        return self

    def advance(self) -> bool:
        backend = self._backend
        try:
            while True:
                for req in self._waiting:
                    if not req.completed:
                        if backend.failure is not None:
                            if backend.waits_on_lost_peer(self._posted):
                                raise CollectiveError(backend.failure)  # it waits on the dead peer
                            stalled = backend.stalled_since_failure(self._progressed)
                            if stalled is not None:
                                raise stalled
                        return False
                for req in self._waiting:
                    error = backend.request_error(req, None, self._name)
                    if error is not None:
                        raise error
                assert self._gen is not None
                try:
                    self._waiting = next(self._gen)
                except StopIteration:
                    return True
                if backend.failure is not None:
                    self._progressed = time.monotonic()
        except BaseException as error:  # noqa: BLE001 - delivered to the waiter
            self._failure = error
            self._backend.engine.bury([(req, buf) for req, buf, _ in self._posted])
            if self._gen is not None:
                self._gen.close()
            return True

    def complete(self) -> None:
        self._gen = None
        self._waiting = ()
        self._posted = []
        self._deliver()


def _agree_group_id(ctx: BackendContext) -> int:
    """A job-wide unique id for this group: rank 0 draws it from a counter in the root store."""
    store = ctx.store
    root = store
    while hasattr(root, "underlying_store"):  # PrefixStore chain -> the job's store
        root = root.underlying_store
    if ctx.rank == 0:
        gid = int(root.add("spmd_ucc/group_counter", 1))
        store.set("ucc/gid", str(gid))
    else:
        store.wait(["ucc/gid"], ctx.timeout)
        gid = int(store.get("ucc/gid"))
    return gid % (1 << _GID_BITS)


def _spans_namespaces(ctx: BackendContext) -> bool:
    """Whether a rank of this group shares this kernel but not its network namespace (every rank publishes its own).

    Each rank also says whether its UCX context, made for an earlier group, already allows
    shared memory there; if one does, every rank raises the same named error (none waits).
    """
    existing = existing_engine()
    stuck = existing is not None and existing.shared_memory_across_namespaces
    ctx.store.set(f"ucc/host/{ctx.rank}", f"{host_identity()}|{int(stuck)}")
    keys = [f"ucc/host/{r}" for r in range(ctx.size)]
    if ctx.size == 1:
        return False
    ctx.store.wait(keys, ctx.timeout)
    published = [bytes(ctx.store.get(k)).decode().rpartition("|") for k in keys]
    if not spans_namespaces(host_identity(), [identity for identity, _, _ in published]):
        return False
    stuck_ranks = [ctx.global_ranks[r] if ctx.global_ranks else r for r, (_, _, flag) in enumerate(published) if flag == "1"]
    if stuck_ranks:
        raise BackendUnavailableError(
            f"spmd-ucc: group {ctx.group_name!r} has ranks in other network namespaces of this machine (containers "
            f"or test-bed hosts), but the UCX context of rank(s) {stuck_ranks}, made for an earlier group, uses shared "
            "memory, which cannot wake a peer across namespaces. Create a ucc group that spans them first, or set "
            "UCX_TLS for the job (e.g. UCX_TLS=^sm)"
        )
    return True


def _group_uses_ucc(ctx: BackendContext) -> bool:
    """Whether the group being split off is configured with ``ucc`` for this device.

    The kernel asks the parent's backend to split whatever backend the child
    was configured with; a ucc parent must not answer for a gloo child.
    """
    try:
        from spmd.comm.state import get_state

        group = get_state().groups.get(ctx.group_name)
        return group is None or group.backend_name(ctx.device_type) == "ucc"
    except Exception:  # noqa: BLE001 - cannot tell: assume the kernel asked the right backend
        return True


class UccBackend(Backend):
    """The ``ucc`` backend for one group: UCX endpoints shared through the process's engine."""

    supports_avg = True  # AVG is SUM then a divide inside the native all-reduce

    def __init__(self, ctx: BackendContext, parent: UccBackend | None = None, members: Sequence[int] = ()) -> None:
        super().__init__(ctx)
        if ctx.size > 1 << _RANK_BITS:
            raise ValueError(f"the ucc backend supports groups of up to {1 << _RANK_BITS} ranks, not {ctx.size}")
        self.engine: Engine = get_engine(ctx.options, parent is None and _spans_namespaces(ctx))
        self.failure: str | None = None
        self.failed_at = 0.0
        self._timeout = ctx.timeout.total_seconds()
        self._global = tuple(ctx.global_ranks) or tuple(range(ctx.size))
        self._seq = 0
        self._pool = BufferPool()
        self._scratch_free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._parent = parent
        self._members = tuple(members)  # parent-local ranks of this group's members (split only)
        self._peers: list[Peer | None] = [None] * ctx.size
        if parent is None:
            # Everyone publishes its worker addresses; peers connect lazily on first use.
            sentinel = self.engine.sentinel_address or b""
            ctx.store.set(f"ucc/addr/{ctx.rank}", len(self.engine.address).to_bytes(4, "little") + self.engine.address + sentinel)
        self._gid = _agree_group_id(ctx)
        base = self._gid << _GID_SHIFT
        self._recv_base = [base | (r << _RANK_SHIFT) for r in range(ctx.size)]
        self._send_base = self._recv_base[ctx.rank]
        self.engine.add_backend(self)

    # -- peers ---------------------------------------------------------------------
    def _peer(self, rank: int) -> Peer:
        peer = self._peers[rank]
        if peer is None:
            if self._parent is not None:
                peer = self._parent._peer(self._members[rank])
            else:
                key = f"ucc/addr/{rank}"
                self.ctx.store.wait([key], self.ctx.timeout)
                blob = self.ctx.store.get(key)
                size = int.from_bytes(blob[:4], "little")
                address, sentinel = bytes(blob[4 : 4 + size]), bytes(blob[4 + size :]) or None
                peer = self.engine.peer(address, sentinel, f"rank {self._global[rank]}")
            self._peers[rank] = peer
            if peer.failure is not None:
                self.peer_failed(peer)
        return peer

    def peer_failed(self, peer: Peer) -> None:
        """Called by the engine when a peer process is gone.

        Requests to or from that peer fail at once (the engine closes its
        endpoint, which cancels them). Operations of this group that wait on
        other peers go on: a peer that finished its part of the last
        collective and exited is no error for the others. But one that makes
        no progress for ``FAILURE_GRACE`` seconds after the failure fails then
        (it most likely waits, through a live peer, for the dead one), and every
        new operation of the group fails at once.
        """
        if self.failure is None and peer in self._peers:
            self.failed_at = time.monotonic()
            self.failure = (
                f"peer {peer.label} of group {self.ctx.group_name!r} is unreachable: {peer.failure}. "
                "The group cannot complete collectives any more; destroy it (spmd.destroy_process_group)"
            )

    def waits_on_lost_peer(self, posted: list[tuple[Any, Any, int]]) -> bool:
        """Whether a request still pending among ``posted`` is to or from a peer that failed."""
        peers = self._peers
        for req, _, rank in posted:
            peer = peers[rank]
            if peer is not None and peer.failure is not None and not req.completed:
                return True
        return False

    def stalled_since_failure(self, since: float) -> CollectiveError | None:
        """The error for an operation that waited FAILURE_GRACE s, after a peer failed, without progress."""
        if self.failure is None:
            return None
        if time.monotonic() - max(since, self.failed_at) < FAILURE_GRACE:
            return None
        return CollectiveError(f"{self.failure} (no progress for {FAILURE_GRACE:g} s after that)")

    def request_error(self, req: Any, peer: Peer | None, what: str) -> BaseException | None:
        """None if the completed request succeeded, else the CollectiveError that explains it."""
        try:
            req.check_error()
        except Exception as error:  # noqa: BLE001 - translated into spmd's error
            if self.failure is not None:
                return CollectiveError(self.failure)
            if peer is not None and peer.failure is not None:
                return CollectiveError(f"{what} failed: peer {peer.label} is unreachable: {peer.failure}")
            return CollectiveError(f"{what} failed in UCX: {type(error).__name__}: {error}")
        return None

    # -- point-to-point ------------------------------------------------------------
    def post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Post a UCX tag send of ``tensor``'s bytes (contiguous; kept alive by the caller)."""
        peer = self._peers[dst] or self._peer(dst)
        if peer.failure is not None:
            raise CollectiveError(self.failure or f"peer {peer.label} is unreachable: {peer.failure}")
        return peer.ep.tag_send(self.engine.array(tensor), self.engine.Tag(self._send_base | tag))

    def post_recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """Post a UCX tag receive into ``tensor``'s bytes (contiguous; kept alive by the caller)."""
        peer = self._peers[src] or self._peer(src)
        if peer.failure is not None:
            raise CollectiveError(self.failure or f"peer {peer.label} is unreachable: {peer.failure}")
        return peer.ep.tag_recv(self.engine.array(tensor), self.engine.Tag(self._recv_base[src] | tag))

    def _p2p(self, tensor: torch.Tensor, peer_rank: int, tag: int, send: bool) -> Work | NativeWork:
        what = f"{'isend to' if send else 'irecv from'} group rank {peer_rank} (tag {tag})"
        # A failed peer elsewhere in the group does not refuse this: the kernel's generic
        # collectives are made of these, and one in flight may still complete (see peer_failed).
        buf = tensor
        try:
            req = self.post_send(buf, peer_rank, tag) if send else self.post_recv(buf, peer_rank, tag)
        except CollectiveError as error:
            return Work.failed(error)
        work = UcxWork(self, req, buf, self._peers[peer_rank], what)  # type: ignore[arg-type]
        if work.advance():
            work.complete()
        else:
            self.engine.register(work)
        return work

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work | NativeWork:
        return self._p2p(tensor, dst, tag, True)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work | NativeWork:
        return self._p2p(tensor, src, tag, False)

    # -- native collectives ----------------------------------------------------------
    def _op(self, name: str) -> tuple[CollectiveOp, int]:
        seq = self._seq
        self._seq = seq + 1
        return CollectiveOp(self, f"{name} on group {self.ctx.group_name!r}"), _NATIVE | ((seq % _SEQ_SPAN) << 10)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        if self.failure is not None:
            return Work.failed(CollectiveError(self.failure))
        n = tensor.numel()
        if self.size == 1 or n == 0:
            return Work.completed()
        flat = tensor.view(-1)
        work, tag = self._op("all_reduce")
        threshold = RING_BYTES if RING_BYTES is not None else (2 << 20 if self.size == 2 else 4 << 20)
        if n * tensor.element_size() > threshold and n >= self.size:
            return work.start(self._ring_all_reduce(work, flat, op, tag))
        return work.start(self._doubling_all_reduce(work, flat, op, tag))

    def _small_scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A reused receive buffer shaped like ``like`` (a fresh one costs more than the message)."""
        free = self._scratch_free.get((like.numel(), like.dtype))
        if free:
            return free.pop()
        if len(self._scratch_free) > 64 or like.nbytes > 4 << 20:
            self._scratch_free.clear()  # bounded: at most 64 sizes, and large ones are not kept
        return torch.empty_like(like)

    def _doubling_all_reduce(self, w: CollectiveOp, t: torch.Tensor, op: ReduceOp, tag: int) -> Generator[Requests, None, None]:
        """Recursive doubling; with n not a power of two, the first 2*rem ranks fold in pairs first.

        Same structure (and so the same, bitwise identical, results on every rank)
        as the kernel's generic algorithm, but with every receive posted before its send.
        """
        n, r = self.size, self.rank
        p = 1 << (n.bit_length() - 1)
        rem = n - p
        if r < 2 * rem and r % 2 == 0:
            back = w.recv(t, r + 1, tag | 1)
            yield (w.send(t, r + 1, tag),)
            yield (back,)
            finish_avg(t, op, n)
            return
        incoming = self._small_scratch(t)
        if r < 2 * rem:
            yield (w.recv(incoming, r - 1, tag),)
            reduce_into(t, incoming, op)
            vrank = r // 2
        else:
            vrank = r - rem
        mask, step = 1, 2
        while mask < p:
            vpeer = vrank ^ mask
            peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
            got = w.recv(incoming, peer, tag | step)
            yield (got, w.send(t, peer, tag | step))
            reduce_into(t, incoming, op)
            mask <<= 1
            step += 1
        self._scratch_free.setdefault((incoming.numel(), incoming.dtype), []).append(incoming)
        if r < 2 * rem:
            yield (w.send(t, r - 1, tag | 1),)
        finish_avg(t, op, n)

    def _ring_all_reduce(self, w: CollectiveOp, t: torch.Tensor, op: ReduceOp, tag: int) -> Generator[Requests, None, None]:
        """Ring reduce-scatter then all-gather; chunks move in segments that are pipelined.

        Step s of the reduce-scatter sends chunk (r - s) and receives chunk
        (r - 1 - s) into scratch; each received segment is reduced into place and
        sent on at once as part of step s + 1 (or of the all-gather's first
        step), while later segments are still in flight. The all-gather receives
        straight into the tensor and forwards each segment as it lands. Every
        receive is posted up front, under a tag per step, so no message waits
        for a receive and none can match the wrong one.
        """
        n, r = self.size, self.rank
        right, left = (r + 1) % n, (r - 1) % n
        chunks = list(t.tensor_split(n))
        seg = max(SEGMENT_BYTES // t.element_size(), 1)
        segments = [list(c.split(seg)) if c.numel() else [] for c in chunks]
        width = max(c.numel() for c in chunks)
        # Pooled: a fresh 64 MiB buffer costs more in page faults than the transfer. Released
        # only on success: after a failure UCX may still write into it (see Engine.bury).
        scratch = self._pool.acquire(width * (n - 1), t.dtype)
        rs: list[list[Any]] = []
        for s in range(n - 1):
            c = (r - 1 - s) % n
            space = scratch[s * width : s * width + chunks[c].numel()]
            rs.append([w.recv(part, left, tag | s % _STEP_SPAN) for part in space.split(seg)] if chunks[c].numel() else [])
        ag: list[list[Any]] = []
        for s in range(n - 1):
            c = (r - s) % n
            ag.append([w.recv(part, left, tag | (n - 1 + s) % _STEP_SPAN) for part in segments[c]])
        sends = [w.send(part, right, tag) for part in segments[r]]
        for s in range(n - 1):
            c = (r - 1 - s) % n
            space = scratch[s * width : s * width + chunks[c].numel()]
            for j, (part, got) in enumerate(zip(segments[c], space.split(seg) if chunks[c].numel() else [])):
                yield (rs[s][j],)
                reduce_into(part, got, op)
                sends.append(w.send(part, right, tag | (s + 1) % _STEP_SPAN))  # step s+1, or the all-gather's step 0
        for s in range(n - 2):
            c = (r - s) % n
            for j, part in enumerate(segments[c]):
                yield (ag[s][j],)
                sends.append(w.send(part, right, tag | (n + s) % _STEP_SPAN))
        yield tuple(req for step in ag for req in step) + tuple(sends)
        self._pool.release(scratch)
        finish_avg(t, op, n)

    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        """A sub-group that reuses this group's endpoints (no new connections)."""
        if not _group_uses_ucc(ctx):
            return None  # the sub-group was configured with another backend: let the kernel build it
        return UccBackend(ctx, parent=self, members=ranks)

    def close(self) -> None:
        super().close()
        self._peers = [None] * self.size
