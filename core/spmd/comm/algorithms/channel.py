"""The view of a backend that one running algorithm has: its tag, peers, deadline."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from spmd.comm.buffers import BufferPool
from spmd.comm.work import NativeWork, Work, as_work


class PointToPoint(Protocol):
    """What an algorithm needs of a backend: its place in the group and tagged isend/irecv.

    A Protocol so that the algorithms stand below ``spmd.comm.backend``, which runs them.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work | NativeWork: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work | NativeWork: ...


@dataclass
class Channel:
    """Point-to-point between the ranks of one group, for one collective call.

    All messages of the call carry the same tag; per (pair, tag) ordering keeps
    successive steps apart, and distinct tags keep concurrent calls apart.
    """

    backend: PointToPoint
    tag: int
    deadline: float | None
    pool: BufferPool

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    def send(self, tensor: torch.Tensor, peer: int) -> Work:
        return as_work(self.backend.isend(tensor, peer, self.tag))

    def recv(self, tensor: torch.Tensor, peer: int) -> Work:
        return as_work(self.backend.irecv(tensor, peer, self.tag))

    def wait(self, *works: Work) -> None:
        """Wait for every Work, all within the call's deadline."""
        for work in works:
            remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
            work.wait(remaining)

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Send to ``dst`` while receiving from ``src``; return when both are done."""
        receiving = self.recv(recv, src)
        sending = self.send(send, dst)
        self.wait(receiving, sending)
