"""Which chunks each rank writes and which byte ranges each rank reads: pure functions of the layout.

Save: every rank describes the chunk it holds of each tensor; from all ranks'
descriptions every rank computes the same plan, so no rank waits for another
to decide. A chunk held by several ranks (a replicated value) is written
once, by the holder with the fewest bytes assigned so far, largest chunks
first: the writers spread over the ranks that hold the data.
Load: a rank intersects the box it needs with every stored chunk and reads
the smallest contiguous byte span of each overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spmd.checkpoint.metadata import CheckpointError, Chunk
from spmd.tensor.placements import Partial
from spmd.tensor.spec import local_shape_and_offset

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class TensorDesc:
    """What one rank holds of one tensor: global shape and dtype, and its chunk (None: nothing)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    placements: str
    box: Box | None


def local_box(tensor: torch.Tensor) -> Box | None:
    """The box of the global tensor that this rank's data covers (a plain tensor covers all of it)."""
    from spmd.tensor.dtensor import DTensor

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.ndim, tuple(tensor.shape)
    spec = tensor._spec
    if spec.mesh.get_coordinate() is None:
        return None
    sizes, offsets = local_shape_and_offset(spec.shape, spec.mesh, spec.placements)
    return offsets, sizes


def placements_label(tensor: torch.Tensor) -> str:
    """``S(0),R`` for a DTensor (informational, shown by ``spmd checkpoint inspect``); ``-`` for a plain tensor."""
    from spmd.tensor.dtensor import DTensor

    if not isinstance(tensor, DTensor):
        return "-"
    labels = []
    for p in tensor.placements:
        labels.append(f"S({p.dim})" if p.is_shard() else "P" if isinstance(p, Partial) else "R")  # type: ignore[attr-defined]
    return ",".join(labels)


def chunk_name(key: str, box: Box, shape: Sequence[int]) -> str:
    """The chunk's name inside its safetensors file: the key, plus the offsets for a part of the tensor."""
    offsets, sizes = box
    if tuple(sizes) == tuple(shape):
        return key
    return f"{key}@{','.join(map(str, offsets))}"


@dataclass(frozen=True)
class WritePlan:
    """The global layout (every tensor's description) and, per chunk, the rank that writes it."""

    tensors: dict[str, TensorDesc]
    writers: dict[tuple[str, Box], int]

    def chunks_of(self, rank: int) -> list[tuple[str, Box]]:
        """The chunks ``rank`` writes, in key order."""
        return sorted(k for k, r in self.writers.items() if r == rank)


def plan_writes(per_rank: Sequence[Sequence[TensorDesc]]) -> WritePlan:
    """One plan from every rank's descriptions: consistent shapes checked, each chunk given one writer."""
    tensors: dict[str, TensorDesc] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank, descs in enumerate(per_rank):
        for d in descs:
            first = tensors.setdefault(d.key, d)
            if (first.shape, first.dtype) != (d.shape, d.dtype):
                raise CheckpointError(
                    f"state_dict[{d.key!r}] differs between ranks: shape {list(first.shape)} {first.dtype} on one, "
                    f"{list(d.shape)} {d.dtype} on rank {rank}; every rank must save the same global tensor"
                )
            if d.box is not None and math.prod(d.box[1]) > 0:
                holders.setdefault((d.key, d.box), []).append(rank)
    load = [0] * len(per_rank)
    writers: dict[tuple[str, Box], int] = {}

    def size(item: tuple[tuple[str, Box], list[int]]) -> tuple[int, tuple[str, Box]]:
        (key, box), _ = item
        return -math.prod(box[1]) * tensors[key].itemsize, (key, box)

    for chunk, ranks in sorted(holders.items(), key=size):
        writer = min(ranks, key=lambda r: (load[r], r))
        writers[chunk] = writer
        load[writer] += -size((chunk, ranks))[0]
    return WritePlan(tensors, writers)


@dataclass(frozen=True)
class ReadStep:
    """Read ``chunk``'s elements in ``source`` (a box relative to the chunk) into ``target`` (relative to the local data)."""

    chunk: Chunk
    source: tuple[slice, ...]
    target: tuple[slice, ...]


def plan_reads(box: Box, chunks: Sequence[Chunk]) -> list[ReadStep]:
    """The steps that fill ``box`` of the global tensor from the stored chunks that overlap it."""
    offsets, sizes = box
    steps = []
    for chunk in chunks:
        source, target = [], []
        for o, s, co, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes):
            lo, hi = max(o, co), min(o + s, co + cs)
            if hi <= lo:
                break
            source.append(slice(lo - co, hi - co))
            target.append(slice(lo - o, hi - o))
        else:
            steps.append(ReadStep(chunk, tuple(source), tuple(target)))
    return steps


def covered(box: Box, steps: Sequence[ReadStep]) -> bool:
    """Whether the steps fill every element of ``box`` (stored chunks never overlap)."""
    need = math.prod(box[1])
    return sum(math.prod(s.stop - s.start for s in step.target) for step in steps) >= need


def span(shape: Sequence[int], region: Sequence[slice]) -> tuple[int, int]:
    """The first element and one past the last of ``region`` in a row-major array of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    first = sum(s.start * st for s, st in zip(region, strides))
    last = sum((s.stop - 1) * st for s, st in zip(region, strides))
    return first, last + 1


def is_contiguous_box(shape: Sequence[int], region: Sequence[slice]) -> bool:
    """Whether ``region`` of a row-major array of ``shape`` is one contiguous run of elements."""
    partial = [d for d, (s, n) in enumerate(zip(region, shape)) if s.stop - s.start != n]
    if not partial:
        return True
    k = partial[-1]
    return all(region[d].stop - region[d].start == 1 for d in range(k))
