"""All-to-all, gather and scatter: every pair exchanges directly."""

from __future__ import annotations

import torch

from spmd.comm.algorithms.channel import Channel
from spmd.comm.work import Work


def all_to_all_pairwise(
    ch: Channel,
    output_chunks: list[torch.Tensor],
    input_chunks: list[torch.Tensor],
) -> None:
    """Chunk i of ``input_chunks`` goes to rank i; chunk j of ``output_chunks`` comes from rank j.

    Rank r receives from r - k while sending to r + k, so no two ranks wait on
    each other in a cycle; chunks may be uneven or empty.
    """
    n, r = ch.size, ch.rank
    output_chunks[r].copy_(input_chunks[r])
    works: list[Work] = []
    for k in range(1, n):
        src = (r - k) % n
        if output_chunks[src].numel():
            works.append(ch.recv(output_chunks[src], src))
    for k in range(1, n):
        dst = (r + k) % n
        if input_chunks[dst].numel():
            works.append(ch.send(input_chunks[dst], dst))
    ch.wait(*works)


def gather_linear(ch: Channel, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> None:
    """Every rank's ``input`` lands in block r of ``output`` on ``dst``."""
    if input.numel() == 0:
        return
    if ch.rank != dst:
        ch.wait(ch.send(input, dst))
        return
    assert output is not None
    blocks = output.chunk(ch.size)
    blocks[dst].copy_(input)
    ch.wait(*(ch.recv(blocks[r], r) for r in range(ch.size) if r != dst))


def scatter_linear(ch: Channel, output: torch.Tensor, input: torch.Tensor | None, src: int) -> None:
    """Block r of ``input`` on ``src`` lands in rank r's ``output``."""
    if output.numel() == 0:
        return
    if ch.rank != src:
        ch.wait(ch.recv(output, src))
        return
    assert input is not None
    blocks = input.chunk(ch.size)
    output.copy_(blocks[src])
    ch.wait(*(ch.send(blocks[r], r) for r in range(ch.size) if r != src))
