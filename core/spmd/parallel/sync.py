"""Start-of-training agreement: identical parameter shapes on every rank, and rank 0's values everywhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from spmd.comm.collectives import broadcast
from spmd.comm.group import ProcessGroup
from spmd.comm.objects import all_gather_object
from spmd.errors import SpmdError

#: Tensors are broadcast in flat chunks of at most this many bytes (torch DDP's default).
BROADCAST_BUCKET_BYTES = 250 << 20


def _chunks(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of tensors with one dtype and device, each at most ``limit`` bytes (or one tensor)."""
    runs: list[list[torch.Tensor]] = []
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        run: list[torch.Tensor] = []
        size = 0
        for tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if run and size + nbytes > limit:
                runs.append(run)
                run, size = [], 0
            run.append(tensor)
            size += nbytes
        if run:
            runs.append(run)
    return runs


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: ProcessGroup, limit: int = BROADCAST_BUCKET_BYTES, src: int = 0) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s, in a few large flat broadcasts."""
    tensors = [t for t in tensors if t.numel()]
    if group.size == 1 or not tensors:
        return
    for run in _chunks(tensors, limit):
        if len(run) == 1 and run[0].is_contiguous():
            broadcast(run[0], group=group, group_src=src)
            continue
        flat = _flatten_dense_tensors(run)
        broadcast(flat, group=group, group_src=src)
        if group.rank != src:
            for tensor, synced in zip(run, _unflatten_dense_tensors(flat, run)):
                tensor.copy_(synced)


def verify_shapes(named: Sequence[tuple[str, torch.Tensor]], group: ProcessGroup) -> None:
    """Raise on every rank, naming the first difference, unless all ranks hold the same parameters."""
    if group.size == 1:
        return
    mine = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    everyone: list[object] = [None] * group.size
    all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        assert isinstance(theirs, list) and isinstance(reference, list)
        detail = f"rank 0 has {len(reference)} parameters, group rank {rank} has {len(theirs)}"
        for ours_entry, their_entry in zip(reference, theirs):
            if ours_entry != their_entry:
                detail = f"rank 0 has {ours_entry}, group rank {rank} has {their_entry}"
                break
        raise SpmdError(
            "DistributedDataParallel: the ranks wrap different models (parameter name, shape, "
            f"dtype): {detail}. Build the same model on every rank before wrapping it"
        )
