"""FlatLayout: where each parameter of one FSDP unit lies in the flat shard and in the flat unsharded buffer.

Two layouts of one unit's parameters ``p_1 .. p_k`` over ``N`` ranks:

- the *shard* (rank-major): every rank holds ``[p_1 rows | pad | p_2 rows | pad | ...]``,
  ``S`` elements, where ``p_i`` contributes its ``torch.chunk`` piece of rows padded
  to ``ceil(rows_i / N)`` rows. All ranks' shards have the same size, so one
  ``all_gather_into_tensor`` and one ``reduce_scatter_tensor`` of ``N * S``
  elements move the whole unit; the padding never reaches the user.
- the *unsharded* buffer (parameter-major): ``[p_1 | p_2 | ...]`` without padding,
  so each parameter is a plain contiguous view of it.

``copy_out`` turns a gathered ``(N, S)`` buffer into the unsharded one,
``copy_in`` turns unsharded gradients into the ``(N, S)`` reduce-scatter input:
one strided copy per parameter (per rank for parameters whose rows ``N`` does
not divide).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spmd.tensor.placements import chunk_offset, chunk_sizes


@dataclass(frozen=True)
class Slot:
    """One parameter's place in both layouts."""

    shape: tuple[int, ...]
    rows: list[int]  # the torch.chunk rows of each rank
    step: int  # ceil(shape[0] / N): rows of every padded piece
    row_numel: int  # elements per row
    shard_offset: int  # where its padded piece starts in the shard
    full_offset: int  # where it starts in the unsharded buffer

    @property
    def numel(self) -> int:
        return self.shape[0] * self.row_numel

    @property
    def padded(self) -> int:
        """Elements of one rank's padded piece."""
        return self.step * self.row_numel

    @property
    def even(self) -> bool:
        return self.step * len(self.rows) == self.shape[0]


class FlatLayout:
    """The shard and unsharded layouts of a list of parameter shapes over ``world`` ranks."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], world: int) -> None:
        self.world = world
        self.slots: list[Slot] = []
        shard = full = 0
        for shape in shapes:
            rows = chunk_sizes(shape[0], world)
            step = max(rows) if rows else 0
            row_numel = math.prod(shape[1:])
            slot = Slot(tuple(shape), rows, step, row_numel, shard, full)
            self.slots.append(slot)
            shard += slot.padded
            full += slot.numel
        self.shard_numel = shard
        self.full_numel = full

    def local_view(self, flat_shard: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """Parameter ``index``'s rows on ``rank`` (its torch.chunk piece) as a view of ``flat_shard``."""
        slot = self.slots[index]
        rows = slot.rows[rank]
        return flat_shard.narrow(0, slot.shard_offset, rows * slot.row_numel).view(rows, *slot.shape[1:])

    def full_views(self, flat_full: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter as a view of the unsharded buffer."""
        return [flat_full.narrow(0, s.full_offset, s.numel).view(s.shape) for s in self.slots]

    def row_offset(self, index: int, rank: int) -> int:
        slot = self.slots[index]
        return chunk_offset(slot.shape[0], self.world, rank)

    def copy_out(self, gathered: torch.Tensor, flat_full: torch.Tensor) -> None:
        """Gathered shards ``(N * S,)`` -> the unsharded buffer (parameter-major, no padding)."""
        src = gathered.view(self.world, self.shard_numel)
        for slot in self.slots:
            if slot.even:
                dst = flat_full.narrow(0, slot.full_offset, slot.numel).view(self.world, slot.padded)
                dst.copy_(src.narrow(1, slot.shard_offset, slot.padded))
                continue
            offset = slot.full_offset
            for rank, rows in enumerate(slot.rows):
                n = rows * slot.row_numel
                if n:
                    flat_full.narrow(0, offset, n).copy_(src[rank].narrow(0, slot.shard_offset, n))
                offset += n

    def copy_in(self, grads: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        """Unsharded gradients (None: zero) -> the reduce-scatter input ``(N * S,)``, padding zeroed."""
        dst = out.view(self.world, self.shard_numel)
        for slot, grad in zip(self.slots, grads):
            piece = dst.narrow(1, slot.shard_offset, slot.padded)
            if grad is None:
                piece.zero_()
                continue
            # Row blocks of the gradient as it is (a Linear's weight gradient is often a transposed
            # view): no flattened copy of the whole gradient first.
            rest = slot.shape[1:]
            if slot.even:
                piece.view(self.world, slot.step, *rest).copy_(grad.unflatten(0, (self.world, slot.step)))
                continue
            piece.zero_()
            offset = 0
            for rank, rows in enumerate(slot.rows):
                if rows:
                    piece[rank].narrow(0, 0, rows * slot.row_numel).view(rows, *rest).copy_(grad.narrow(0, offset, rows))
                offset += rows
