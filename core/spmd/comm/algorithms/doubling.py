"""Latency-optimal algorithms for small messages: log2(n) rounds."""

from __future__ import annotations

import torch

from spmd.comm.algorithms.channel import Channel
from spmd.comm.reduce_op import ReduceOp, finish_avg, reduce_into


def all_reduce_recursive_doubling(ch: Channel, tensor: torch.Tensor, op: ReduceOp) -> None:
    """Recursive doubling; for n not a power of two the extra ranks fold in first.

    With p the largest power of two <= n and rem = n - p, each even rank below
    2*rem hands its data to the next odd rank and waits; the p remaining ranks
    double; the odd ranks hand the result back. Every rank computes the same
    sums in the same order, so all end bitwise equal.
    """
    n, r = ch.size, ch.rank
    if n == 1 or tensor.numel() == 0:
        finish_avg(tensor, op, n)
        return
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    with ch.pool.borrow(tensor.numel(), tensor.dtype, tensor.device) as incoming:
        if r < 2 * rem:
            if r % 2 == 0:
                ch.wait(ch.send(tensor, r + 1))
                ch.wait(ch.recv(tensor, r + 1))
                finish_avg(tensor, op, n)
                return
            ch.wait(ch.recv(incoming, r - 1))
            reduce_into(tensor, incoming, op)
            vrank = r // 2
        else:
            vrank = r - rem
        mask = 1
        while mask < p:
            vpeer = vrank ^ mask
            peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
            ch.exchange(tensor, peer, incoming, peer)
            reduce_into(tensor, incoming, op)
            mask <<= 1
        if r < 2 * rem:
            ch.wait(ch.send(tensor, r - 1))
    finish_avg(tensor, op, n)


def barrier_dissemination(ch: Channel) -> None:
    """Dissemination barrier: in round k, signal rank r + 2^k and hear from r - 2^k."""
    n, r = ch.size, ch.rank
    token_out = torch.zeros(1, dtype=torch.uint8)
    token_in = torch.empty(1, dtype=torch.uint8)
    distance = 1
    while distance < n:
        ch.exchange(token_out, (r + distance) % n, token_in, (r - distance) % n)
        distance <<= 1
