"""The collectives DTensor issues on local shards, each along one tensor dimension and one mesh dimension.

Uneven shards (``torch.chunk`` semantics) are padded to the largest piece for
the transfer and trimmed after, so every backend sees equal-sized buffers.
An active ``CommDebugMode`` counts each (through the kernel's flight recorder).
"""

from __future__ import annotations

import torch

from spmd.comm import collectives
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp


def all_gather(local: torch.Tensor, dim: int, group: ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's piece along ``dim``; ``sizes`` are the pieces' sizes in group order."""
    n = group.size
    step = max(sizes)
    local = local.contiguous()
    if local.size(dim) < step:
        pad = list(local.shape)
        pad[dim] = step - local.size(dim)
        local = torch.cat([local, local.new_zeros(pad)], dim)
    if dim == 0:
        out = local.new_empty((n * step, *local.shape[1:]))
        collectives.all_gather_into_tensor(out, local, group=group)
        if all(s == step for s in sizes):
            return out
        return torch.cat([out.narrow(0, k * step, s) for k, s in enumerate(sizes)])
    stacked = local.new_empty((n, *local.shape))
    collectives.all_gather_into_tensor(stacked, local, group=group)
    return torch.cat([stacked[k].narrow(dim, 0, s) for k, s in enumerate(sizes)], dim)


def reduce_scatter(full: torch.Tensor, dim: int, group: ProcessGroup, op: ReduceOp, sizes: list[int]) -> torch.Tensor:
    """Reduce ``full`` over the group and keep this rank's ``torch.chunk`` piece along ``dim``."""
    step = max(sizes)
    if dim == 0 and all(s == step for s in sizes):
        out = full.new_empty((step, *full.shape[1:]))
        collectives.reduce_scatter_tensor(out, full.contiguous(), op=op, group=group)
        return out
    pieces = []
    offset = 0
    for s in sizes:
        piece = full.narrow(dim, offset, s)
        offset += s
        if s < step:
            pad = list(piece.shape)
            pad[dim] = step - s
            piece = torch.cat([piece, piece.new_zeros(pad)], dim)
        pieces.append(piece)
    stacked = torch.stack(pieces)
    out = stacked.new_empty(stacked.shape[1:])
    collectives.reduce_scatter_tensor(out, stacked, op=op, group=group)
    return out.narrow(dim, 0, sizes[group.rank])


def all_reduce(local: torch.Tensor, group: ProcessGroup, op: ReduceOp) -> torch.Tensor:
    """The reduction of every rank's tensor, out of place."""
    out = local.clone(memory_format=torch.contiguous_format)
    collectives.all_reduce(out, op=op, group=group)
    return out


def all_to_all(
    local: torch.Tensor, src_dim: int, dst_dim: int, group: ProcessGroup, src_sizes: list[int], dst_sizes: list[int]
) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim): send piece k of ``dst_dim`` to rank k, gather pieces along ``src_dim``.

    Pieces are padded to one size, so every rank makes the same equal-split
    call even when some hold empty shards (an uneven all-to-all would let a
    rank with nothing to send take a different path from its peers).
    """
    me, n = group.rank, group.size
    src_step, dst_step = max(src_sizes), max(dst_sizes)
    padded_shape = list(local.shape)
    padded_shape[src_dim] = src_step
    padded_shape[dst_dim] = dst_step
    send = local.new_zeros((n, *padded_shape))
    offset = 0
    for k, size in enumerate(dst_sizes):
        send[k].narrow(src_dim, 0, local.size(src_dim)).narrow(dst_dim, 0, size).copy_(local.narrow(dst_dim, offset, size))
        offset += size
    recv = torch.empty_like(send)
    collectives.all_to_all_single(recv, send, group=group)
    pieces = [recv[k].narrow(src_dim, 0, src_sizes[k]).narrow(dst_dim, 0, dst_sizes[me]) for k in range(n)]
    return torch.cat(pieces, src_dim)


def broadcast(tensor: torch.Tensor, group: ProcessGroup, src: int) -> torch.Tensor:
    """``tensor`` from group rank ``src`` on every rank (in place)."""
    collectives.broadcast(tensor, group_src=src, group=group)
    return tensor
