"""The large-message all_reduce (reduce-scatter of slices, then all-gather) gives, bit for bit, what the
whole-chunk path gives: the rank-order reduction, the same on every rank, at every chunk and slice edge."""

from __future__ import annotations

import torch
from shm_groups import group_with_slots

import spmd
from spmd.comm.reduce_op import ReduceOp

#: 4 KiB slots: 3000 elements go in several chunks, the last one too short to split evenly.
SLOT_BYTES = 4096
NUMEL = 3000
CASES = [(torch.float32, ReduceOp.SUM), (torch.float32, ReduceOp.AVG), (torch.float32, ReduceOp.MIN),
         (torch.bfloat16, ReduceOp.SUM), (torch.int64, ReduceOp.PRODUCT), (torch.bool, ReduceOp.MAX)]


def _input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(99 + rank))
    if dtype == torch.int64:
        return (values * 3).round().to(dtype)
    return values.to(dtype) if dtype != torch.bool else values > 0.5


def _bits(t: torch.Tensor) -> bytes:
    return t.view(torch.uint8).numpy().tobytes()


def both_paths() -> list[tuple[str, bytes, bytes, tuple[int, int]]]:
    """Each case all-reduced with the split path (from 0 bytes on 2 ranks) and with the whole-chunk one (threshold
    unreachable): (case, split result's bytes, whole result's, rounds in which this rank reduced a slice on each path)."""
    from spmd_shm import collectives

    group = group_with_slots(SLOT_BYTES)
    rounds = group.backend("cpu").engine.rounds
    me, results = spmd.get_rank(), []
    defaults = collectives.SPLIT_BYTES, collectives.SPLIT_RANKS
    collectives.SPLIT_RANKS = 2
    try:
        for dtype, op in CASES:
            got = {}
            for path, threshold in (("split", 0), ("whole", 1 << 62)):
                collectives.SPLIT_BYTES = threshold
                before = rounds.reduced[me].value
                t = _input(me, dtype)
                spmd.all_reduce(t, op=op, group=group)
                got[path] = (_bits(t), rounds.reduced[me].value - before)
            results.append((f"{dtype} {op.name}", got["split"][0], got["whole"][0], (got["split"][1], got["whole"][1])))
    finally:
        collectives.SPLIT_BYTES, collectives.SPLIT_RANKS = defaults
    spmd.destroy_process_group(group)
    return results


def test_split_all_reduce_is_the_whole_chunk_one_bit_for_bit(spmd_world) -> None:
    per_rank = spmd_world(3, "shm").run(both_paths)
    for case, split, whole, slices in (row for rows in per_rank for row in rows):
        assert slices[0] >= 3 and slices[1] == 0, f"{case}: rounds with a reduced slice (split, whole): {slices}; expected >= 3 and 0"
        assert split == whole, case
    for i, (case, split, _, _) in enumerate(per_rank[0]):
        for rows in per_rank[1:]:
            assert rows[i][1] == split, f"{case}: ranks disagree"
    # and the whole-chunk path is the real thing: an exact integer sum checked independently
    products = [row for row in per_rank[0] if row[0] == "torch.int64 PRODUCT"][0][1]
    assert products == _bits(_input(0, torch.int64) * _input(1, torch.int64) * _input(2, torch.int64))


def different_paths() -> str:
    """Rank 0 all-reduces 64 KiB through the split path, rank 1 through the whole-chunk one (settings that
    differ between ranks): the error this rank gets."""
    from spmd_shm import collectives

    group = spmd.new_group([0, 1], backend="shm", timeout=5.0)
    spmd.barrier(group=group)
    defaults = collectives.SPLIT_BYTES, collectives.SPLIT_RANKS
    collectives.SPLIT_BYTES, collectives.SPLIT_RANKS = (0, 2) if spmd.get_rank() == 0 else defaults
    try:
        spmd.all_reduce(torch.ones(1 << 14), group=group)
        return "no error"
    except spmd.SpmdError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        collectives.SPLIT_BYTES, collectives.SPLIT_RANKS = defaults


def test_ranks_that_choose_different_paths_get_a_named_error(spmd_world) -> None:
    world = spmd_world(2, "shm")
    try:
        results = world.run(different_paths, timeout=60)
    finally:
        world.kill()  # its new group was given up
    for result in results:
        assert "chose different all_reduce paths" in result and "SPMD_SHM_SPLIT_BYTES" in result, results
