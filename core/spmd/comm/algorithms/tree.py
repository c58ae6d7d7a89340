"""Binomial trees rooted anywhere: log2(n) rounds for broadcast and reduce."""

from __future__ import annotations

import torch

from spmd.comm.algorithms.channel import Channel
from spmd.comm.reduce_op import ReduceOp, finish_avg, reduce_into


def broadcast_binomial(ch: Channel, tensor: torch.Tensor, src: int) -> None:
    """Root ``src``'s tensor reaches every rank along a binomial tree."""
    n = ch.size
    if n == 1 or tensor.numel() == 0:
        return
    vrank = (ch.rank - src) % n
    mask = 1
    while mask < n:
        if vrank & mask:
            ch.wait(ch.recv(tensor, (vrank - mask + src) % n))
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if vrank + mask < n:
            sends.append(ch.send(tensor, (vrank + mask + src) % n))
        mask >>= 1
    ch.wait(*sends)


def reduce_binomial(ch: Channel, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
    """The reduction of every rank's tensor lands in ``dst``'s; others' are left unchanged."""
    n = ch.size
    if n == 1 or tensor.numel() == 0:
        finish_avg(tensor, op, n)
        return
    vrank = (ch.rank - dst) % n
    is_root = vrank == 0
    with ch.pool.borrow(tensor.numel(), tensor.dtype, tensor.device) as incoming, ch.pool.borrow(
        0 if is_root else tensor.numel(), tensor.dtype, tensor.device
    ) as partial:
        acc = tensor
        if not is_root:
            partial.copy_(tensor)
            acc = partial
        mask = 1
        while mask < n:
            if vrank & mask == 0:
                child = vrank | mask
                if child < n:
                    ch.wait(ch.recv(incoming, (child + dst) % n))
                    reduce_into(acc, incoming, op)
            else:
                ch.wait(ch.send(acc, (vrank - mask + dst) % n))
                break
            mask <<= 1
    if is_root:
        finish_avg(tensor, op, n)
