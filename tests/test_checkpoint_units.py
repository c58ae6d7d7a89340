"""The checkpoint planner, metadata, schema and tiling in one process: what they plan against what torch slicing gives.

The oracle is a real tensor: ``arange`` numbers every element, ``torch.chunk`` cuts the shards as DTensor
does, and a box read back from the planned steps must equal the same box sliced from the full tensor.
"""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch

from spmd.checkpoint.metadata import DTYPES, CheckpointError, Chunk, Metadata, TensorEntry
from spmd.checkpoint.planner import (
    TensorDesc,
    chunk_name,
    covered,
    is_contiguous_box,
    plan_reads,
    plan_writes,
    span,
)
from spmd.checkpoint.schema import parse_metadata
from spmd.checkpoint.tiling import tiling_problem
from spmd.tensor.placements import Replicate, Shard
from spmd.tensor.spec import local_shape_and_offset

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _box_of(full: torch.Tensor, piece: torch.Tensor) -> Box:
    """Where ``piece`` (a view of the arange-numbered ``full``) sits: read off the numbers it holds."""
    if piece.numel() == 0:
        return (0,) * full.ndim, tuple(piece.shape)
    first = int(piece.flatten()[0])
    offsets = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), full.shape))
    return offsets, tuple(piece.shape)


def _shards(full: torch.Tensor, mesh_shape: tuple[int, ...], placements: tuple) -> dict[tuple[int, ...], Box]:
    """Each mesh coordinate's box, cut by torch.chunk in mesh-dimension order (as DTensor shards)."""
    out = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        piece = full
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                parts = torch.chunk(piece, mesh_shape[mesh_dim], dim=p.dim)
                piece = parts[coord[mesh_dim]] if coord[mesh_dim] < len(parts) else piece.narrow(p.dim, 0, 0)
        out[coord] = _box_of(full, piece)
    return out


LAYOUTS = [
    ((10, 6), (4,), (Shard(0),)),
    ((7, 5), (3,), (Shard(1),)),
    ((9, 4), (2, 3), (Shard(0), Shard(0))),  # nested: mesh dim 1 chunks mesh dim 0's piece
    ((8, 6), (2, 2), (Shard(0), Shard(1))),
    ((5, 3), (2, 2), (Replicate(), Shard(0))),
    ((3, 4), (4,), (Shard(0),)),  # more ranks than rows: an empty shard
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), LAYOUTS)
def test_local_boxes_are_torch_chunks_pieces(shape, mesh_shape, placements):
    full = torch.arange(math.prod(shape)).reshape(shape)
    mesh = SimpleNamespace(mesh=torch.empty(mesh_shape))  # only the mesh's shape is read, with an explicit coordinate
    for coord, (offsets, sizes) in _shards(full, mesh_shape, placements).items():
        got_sizes, got_offsets = local_shape_and_offset(tuple(shape), mesh, placements, list(coord))  # type: ignore[arg-type]
        assert got_sizes == sizes, coord
        if math.prod(sizes):
            assert got_offsets == offsets, coord


def _stored(full: torch.Tensor, boxes: list[Box]) -> tuple[list[Chunk], dict[Chunk, torch.Tensor]]:
    """Chunks (as metadata names them) of ``boxes`` and each chunk's data sliced from ``full``."""
    chunks, data = [], {}
    for i, (offsets, sizes) in enumerate(boxes):
        if not math.prod(sizes):
            continue
        chunk = Chunk(offsets, sizes, "data-000000000000/rank-00000.safetensors", f"c{i}", 0, math.prod(sizes) * 8)
        chunks.append(chunk)
        data[chunk] = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    return chunks, data


@pytest.mark.parametrize(("saved", "loaded"), list(itertools.permutations(range(len(LAYOUTS) - 1), 2))[:12])
def test_reads_planned_between_two_layouts_give_the_boxes_torch_slices(saved, loaded):
    """Saved under one sharding, loaded under another (same shape): every loading rank's planned reads
    assemble exactly the box torch slices from the full tensor."""
    shape = (12, 6)
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    _, save_mesh, save_placements = LAYOUTS[saved]
    _, load_mesh, load_placements = LAYOUTS[loaded]
    boxes = list(dict.fromkeys(_shards(full, save_mesh, save_placements).values()))  # replicas: one chunk
    chunks, data = _stored(full, boxes)
    assert tiling_problem(shape, [(c.offsets, c.sizes) for c in chunks]) is None
    for box in _shards(full, load_mesh, load_placements).values():
        offsets, sizes = box
        steps = plan_reads(box, chunks)
        assert covered(box, steps)
        out = torch.full(sizes, -1, dtype=torch.int64)
        for step in steps:
            out[step.target] = data[step.chunk][step.source]
        assert torch.equal(out, full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])


def test_each_chunk_is_written_once_by_a_holder_and_the_writers_spread():
    shape, mesh_shape, placements = (8, 6), (2, 2), (Replicate(), Shard(0))  # every shard held by two ranks
    full = torch.arange(math.prod(shape)).reshape(shape)
    boxes = _shards(full, mesh_shape, placements)
    per_rank = [[TensorDesc("w", shape, "F32", 4, "R,S(0)", boxes[coord])] for coord in sorted(boxes)]
    plan = plan_writes(per_rank)
    holders = {}
    for rank, (desc,) in enumerate(per_rank):
        holders.setdefault(("w", desc.box), []).append(rank)
    assert set(plan.writers) == set(holders)  # every distinct chunk, once
    for chunk, writer in plan.writers.items():
        assert writer in holders[chunk]
    assert len(set(plan.writers.values())) == len(plan.writers)  # two equal chunks, two different writers
    assert sorted(c for r in range(4) for c in plan.chunks_of(r)) == sorted(plan.writers)


def test_ranks_that_disagree_on_a_tensors_shape_are_named():
    with pytest.raises(CheckpointError, match=r"state_dict\['w'\] differs between ranks: shape \[4\] F32 on one, \[5\] F32 on rank 1"):
        plan_writes([[TensorDesc("w", (4,), "F32", 4, "-", ((0,), (4,)))], [TensorDesc("w", (5,), "F32", 4, "-", ((0,), (5,)))]])


@pytest.mark.parametrize("shape", [(6,), (4, 5), (3, 4, 5), (2, 1, 3, 4)])
def test_span_and_contiguity_match_the_element_numbers_torch_gives(shape):
    full = torch.arange(math.prod(shape)).reshape(shape)
    ranges = [sorted({(0, n), (0, 1), (n - 1, n), (min(1, n - 1), n)}) for n in shape]
    for region in itertools.product(*ranges):
        slices = tuple(slice(a, b) for a, b in region)
        numbers = full[slices].flatten()
        assert span(shape, slices) == (int(numbers.min()), int(numbers.max()) + 1)
        contiguous = bool(torch.equal(numbers, torch.arange(int(numbers[0]), int(numbers[0]) + numbers.numel())))
        assert is_contiguous_box(shape, slices) == contiguous, region


def _tiles_by_counting(shape, boxes) -> bool:
    """The oracle: count, element by element, how many boxes hold each element."""
    count = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return bool((count == 1).all())


@pytest.mark.parametrize("boxes", [
    [((0, 0), (2, 4)), ((2, 0), (2, 4))],  # two halves
    [((0, 0), (2, 4)), ((1, 0), (3, 4))],  # overlap, and more elements than the tensor
    [((0, 0), (2, 4))],  # a hole
    [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 3)), ((2, 3), (2, 1))],  # four tiles of two widths
    [((0, 0), (2, 2)), ((0, 1), (2, 2)), ((2, 0), (2, 4)), ((0, 3), (2, 1)), ((0, 0), (0, 4))],  # overlap, same volume
    [((0, 0), (4, 4)), ((1, 1), (0, 2))],  # the whole, and an empty box
])
def test_tiling_agrees_with_counting_each_element(boxes):
    assert (tiling_problem((4, 4), boxes) is None) == _tiles_by_counting((4, 4), boxes)


def test_a_chunks_name_carries_its_offsets_unless_it_is_the_whole_tensor():
    assert chunk_name("w", ((0, 0), (4, 4)), (4, 4)) == "w"
    assert chunk_name("w", ((2, 0), (2, 4)), (4, 4)) == "w@2,0"


def _metadata(shape=(4, 3), dtype=torch.float32) -> Metadata:
    full = torch.arange(math.prod(shape)).reshape(shape)
    boxes = list(_shards(full, (2,), (Shard(0),)).values())
    itemsize = dtype.itemsize
    chunks, begin = [], 0
    for offsets, sizes in boxes:
        end = begin + math.prod(sizes) * itemsize
        chunks.append(Chunk(offsets, sizes, "data-0123456789ab/rank-00000.safetensors", chunk_name("w", (offsets, sizes), shape), begin, end))
        begin = end
    entry = TensorEntry(shape, DTYPES[dtype], "S(0)", chunks)
    return Metadata("data-0123456789ab", {"w": entry}, {"step": 7}, world_size=2)


def test_metadata_round_trips_through_its_json():
    meta = _metadata()
    back = parse_metadata(meta.to_json())
    assert back == meta
    assert back.tensors["w"].torch_dtype == torch.float32 and back.tensors["w"].nbytes == 4 * 3 * 4


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: d["tensors"]["w"]["chunks"].pop(), r"chunks do not tile its shape \[4, 3\]: its chunks hold 6 of its 12 elements"),
    (lambda d: d["tensors"]["w"]["chunks"][0].update(end=5), r"chunks\[0\]\.begin/end span 5 bytes, but \[2, 3\] F32 needs 24"),
    (lambda d: d["tensors"]["w"]["chunks"][1].update(file="../../etc/passwd"), r"refusing a path that could point outside"),
    (lambda d: d["tensors"]["w"].update(dtype="F31"), r"dtype is 'F31', not one of"),
    (lambda d: d["tensors"]["w"]["chunks"][1].update(offsets=[3, 0]), r"reaches element 5 of dimension 0, which has 4"),
    (lambda d: d.update(data_dir="../x"), r"data_dir is '../x', not data-<12 hex digits>"),
    (lambda d: d["values"].update(w=1), r"tensors and values both hold \['w'\]"),
])
def test_damaged_metadata_is_a_named_error(damage, message):
    doc = json.loads(_metadata().to_json())
    damage(doc)
    with pytest.raises(CheckpointError, match=message):
        parse_metadata(json.dumps(doc).encode())
