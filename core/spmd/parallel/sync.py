"""Start-of-training agreement: identical parameter shapes on every rank, and rank 0's values everywhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from spmd.comm.agreement import verify_agreement
from spmd.comm.collectives import broadcast
from spmd.comm.group import ProcessGroup

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


def verify_shapes(named: Sequence[tuple[str, torch.Tensor]], group: ProcessGroup, who: str = "DistributedDataParallel") -> None:
    """Raise on every rank, naming the first difference, unless all ranks hold the same parameters in the same
    order (``who`` names the strategy in the error). Ranks that disagree would otherwise exchange the wrong
    bytes and train on garbage without an error."""
    entries = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    verify_agreement(entries, group, who, "wrap different models (parameter name, shape, dtype, order)",
                     "Build the same model on every rank, registering parameters in the same order")
