"""Point-to-point: send/recv, isend/irecv, batch_isend_irecv."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from spmd.comm.backend import COLLECTIVE_TAG_BASE
from spmd.comm.checks import check_tensor, resolve_root
from spmd.comm.group import ProcessGroup
from spmd.comm.lifecycle import complete
from spmd.comm.staging import Contiguous, sequence, staging_steps
from spmd.comm.state import resolve_group
from spmd.comm.work import Timeout, Work, WorkList
from spmd.debug.recorder import recorder

#: What the current point-to-point ops are for ("RECV_F of stage 2, microbatch 3"), set by ``p2p_context``.
_context: contextvars.ContextVar[str | None] = contextvars.ContextVar("spmd_p2p_context", default=None)


@contextlib.contextmanager
def p2p_context(label: str) -> Iterator[None]:
    """Label the point-to-point ops started inside: the flight recorder and a timeout name ``label``.

    The pipeline runtime wraps each transfer in one, so a hang reads "rank 1
    waits in RECV_F of stage 2, microbatch 3, from rank 0". Costs one
    context-variable set and reset per block.
    """
    token = _context.set(label)
    try:
        yield
    finally:
        _context.reset(token)


def _describe(g: ProcessGroup, what: str, peer: int, tag: int, context: str | None) -> str:
    """The op's description for errors ("isend to rank 3 (tag 0) on group 'world' ..."); made only when needed."""
    if context is None:
        return g.describe(f"{what} rank {g.ranks[peer]} (tag {tag})")
    verb = "waits in" if what.startswith("irecv") else "sends in"
    direction = "from" if what.startswith("irecv") else "to"
    return g.describe(f"rank {g.ranks[g.rank]} {verb} {context}, {direction} rank {g.ranks[peer]} (tag {tag})")


def _check_tag(tag: int, op: str) -> None:
    if not 0 <= tag < COLLECTIVE_TAG_BASE:
        raise ValueError(f"{op}: tag {tag} is outside 0..{COLLECTIVE_TAG_BASE - 1}; higher tags are reserved for collectives")


def _peer(g: ProcessGroup, rank: int | None, group_rank: int | None, what: str, op: str) -> int:
    peer = resolve_root(g, rank, group_rank, what, op)
    if peer == g.rank:
        raise ValueError(f"{op}: {what} is this rank itself ({g.ranks[peer]}); a rank cannot {op} to itself")
    return peer


def _start(op: str, what: str, tensor: torch.Tensor, g: ProcessGroup, peer: int, tag: int, timeout: Timeout, async_op: bool,
           context: str | None) -> Work | None:
    """Submit one send or receive and hand it to ``complete`` (which waits unless ``async_op``); a
    non-contiguous tensor travels through a contiguous stand-in (written back after a receive)."""
    entry = recorder.start(g.name, -1, op, (tensor,), None, g.ranks[peer])
    if context is not None:
        entry.context = context
    if recorder.keep_history:
        recorder.note_p2p(g.name, op, g.ranks[peer], tag, tensor)
    after = None
    backend = g.backend_for(tensor)
    if tensor.is_contiguous():  # the fast path: nothing staged, nothing to run afterwards
        work = backend.isend(tensor, peer, tag) if op == "send" else backend.irecv(tensor, peer, tag)
    else:
        staged = Contiguous(tensor, copy_in=op == "send")
        if op == "send":
            work = backend.isend(staged.tensor, peer, tag)
            after = sequence(*staging_steps(staged))
        else:
            work = backend.irecv(staged.tensor, peer, tag)
            after = sequence(*staging_steps(staged, write_back=(staged,)))
    describe = functools.partial(_describe, g, what, peer, tag, context)
    return complete(work, g, op, entry, async_op, after, timeout=timeout, describe=describe)


def _send(tensor: torch.Tensor, dst: int | None, group: ProcessGroup | None, tag: int, group_dst: int | None, timeout: Timeout, async_op: bool) -> Work | None:
    g = resolve_group(group)
    check_tensor(tensor, "tensor", "isend")
    _check_tag(tag, "isend")
    return _start("send", "isend to", tensor, g, _peer(g, dst, group_dst, "dst", "isend"), tag, timeout, async_op, _context.get())


def _recv(tensor: torch.Tensor, src: int | None, g: ProcessGroup, tag: int, group_src: int | None, timeout: Timeout, async_op: bool) -> Work | None:
    check_tensor(tensor, "tensor", "irecv")
    _check_tag(tag, "irecv")
    if src is None and group_src is None:
        raise ValueError("irecv: receiving from any source is not supported; pass src= (the sender's rank)")
    return _start("recv", "irecv from", tensor, g, _peer(g, src, group_src, "src", "irecv"), tag, timeout, async_op, _context.get())


def start_checked(op: str, tensor: torch.Tensor, group: ProcessGroup, peer: int, tag: int, context: str) -> Work:
    """``isend`` (op "send") or ``irecv`` (op "recv") to group rank ``peer`` under ``p2p_context(context)``,
    for a caller that checked the group, peer and tag once (the pipeline runtime: per transfer, the
    checks and the context block cost as much as the kernel's own recording)."""
    check_tensor(tensor, "tensor", "isend" if op == "send" else "irecv")
    work = _start(op, "isend to" if op == "send" else "irecv from", tensor, group, peer, tag, None, True, context)
    assert work is not None
    return work


def isend(tensor: torch.Tensor, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None, *, timeout: Timeout = None) -> Work:
    """Start sending ``tensor`` to ``dst``; keep the tensor unchanged until the Work completes."""
    work = _send(tensor, dst, group, tag, group_dst, timeout, True)
    assert work is not None
    return work


def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None, *, timeout: Timeout = None) -> Work:
    """Start receiving into ``tensor`` from ``src``; read it only after the Work completes."""
    work = _recv(tensor, src, resolve_group(group), tag, group_src, timeout, True)
    assert work is not None
    return work


def send(tensor: torch.Tensor, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None, *, timeout: Timeout = None) -> None:
    """Send ``tensor`` to ``dst`` and wait until it is sent (on the backend's own handle: no Work is made)."""
    _send(tensor, dst, group, tag, group_dst, timeout, False)


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None, *, timeout: Timeout = None) -> int:
    """Receive into ``tensor`` from ``src``; returns the sender's global rank."""
    g = resolve_group(group)
    _recv(tensor, src, g, tag, group_src, timeout, False)
    return src if src is not None else g.ranks[group_src or 0]


@dataclass
class P2POp:
    """One point-to-point operation for ``batch_isend_irecv``: ``P2POp(spmd.isend, t, peer)``."""

    op: Callable[..., Work]
    tensor: torch.Tensor
    peer: int | None = None
    group: ProcessGroup | None = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            raise ValueError("P2POp: op must be spmd.isend or spmd.irecv")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Start every op in the list (receives first, so paired batches cannot deadlock)."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: the list of P2POp is empty")
    ordered = sorted(p2p_op_list, key=lambda p: p.op is isend)
    works: dict[int, Work] = {}
    for p in ordered:
        if p.op is isend:
            works[id(p)] = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        else:
            works[id(p)] = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
    return [works[id(p)] for p in p2p_op_list]


def wait_all(works: Sequence[Work]) -> None:
    """Wait for every Work of a batch."""
    WorkList(list(works)).wait()
