"""Ring algorithms: bandwidth-optimal for large messages (each rank moves 2(n-1)/n of the data)."""

from __future__ import annotations

import torch

from spmd.comm.algorithms.channel import Channel
from spmd.comm.reduce_op import ReduceOp, finish_avg, reduce_into


def _ring_reduce_scatter_inplace(ch: Channel, chunks: list[torch.Tensor], op: ReduceOp, shift: int) -> None:
    """Reduce in place so that rank r ends holding the full reduction of chunk (r + shift) % n."""
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    largest = max(c.numel() for c in chunks)
    with ch.pool.borrow(largest, chunks[0].dtype, chunks[0].device) as scratch:
        for step in range(n - 1):
            send_idx = (r + shift - 1 - step) % n
            recv_idx = (r + shift - 2 - step) % n
            incoming = scratch[: chunks[recv_idx].numel()]
            ch.exchange(chunks[send_idx], right, incoming, left)
            reduce_into(chunks[recv_idx], incoming, op)


def _ring_all_gather_inplace(ch: Channel, chunks: list[torch.Tensor], shift: int) -> None:
    """Rank r starts holding chunk (r + shift) % n; every rank ends holding all of them."""
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_idx = (r + shift - step) % n
        recv_idx = (r + shift - step - 1) % n
        ch.exchange(chunks[send_idx], right, chunks[recv_idx], left)


def all_reduce_ring(ch: Channel, tensor: torch.Tensor, op: ReduceOp) -> None:
    """Ring reduce-scatter then ring all-gather over n uneven chunks of ``tensor``."""
    if ch.size > 1 and tensor.numel() > 0:
        chunks = list(tensor.tensor_split(ch.size))
        _ring_reduce_scatter_inplace(ch, chunks, op, shift=1)
        _ring_all_gather_inplace(ch, chunks, shift=1)
    finish_avg(tensor, op, ch.size)


def reduce_scatter_ring(ch: Channel, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
    """Rank r gets the reduction of block r of every rank's ``input`` (input is n blocks)."""
    n = ch.size
    if output.numel() > 0:
        with ch.pool.borrow(input.numel(), input.dtype, input.device) as work:
            work.copy_(input)
            chunks = list(work.chunk(n)) if n > 1 else [work]
            if n > 1:
                _ring_reduce_scatter_inplace(ch, chunks, op, shift=0)
            output.copy_(chunks[ch.rank])
    finish_avg(output, op, n)


def all_gather_ring(ch: Channel, output: torch.Tensor, input: torch.Tensor) -> None:
    """Every rank's ``input`` lands in block r of every rank's ``output``."""
    if input.numel() == 0:
        return
    chunks = list(output.chunk(ch.size))
    chunks[ch.rank].copy_(input)
    if ch.size > 1:
        _ring_all_gather_inplace(ch, chunks, shift=0)
