"""all_to_all_single runs natively through the slots: blocks larger than a slot's region go in several
rounds, and ranks whose splits (or ops) disagree get a named error instead of wrong rows."""

from __future__ import annotations

import pytest
import torch
from shm_groups import group_with_slots

import spmd

#: Small slots, so that the test's blocks need several rounds.
SLOT_BYTES = 4096
#: (dtype, columns): rows of 12, 6 and 7 bytes, so chunks end inside rows and inside elements.
CASES = [(torch.float32, 3), (torch.int16, 3), (torch.bool, 7)]


def _splits(n: int) -> list[list[int]]:
    """splits[i][j]: rows rank i sends rank j: uneven, one pair empty, some blocks larger than a region."""
    return [[0 if (i, j) == (0, n - 1) else 37 + 150 * ((i + 2 * j) % 3) for j in range(n)] for i in range(n)]


def _input(rank: int, rows: int, dtype: torch.dtype, cols: int) -> torch.Tensor:
    values = torch.randint(-1000, 1000, (rows, cols), generator=torch.Generator().manual_seed(1234 + rank))
    return values.to(dtype)


def exchange_in_rounds() -> list[str]:
    """On each rank: every case through 4 KiB slots; the failures, and how many rounds each case took."""
    from spmd_shm.all_to_all import region_bytes

    n, me = spmd.get_world_size(), spmd.get_rank()
    group = group_with_slots(SLOT_BYTES)
    rounds = group.backend("cpu").engine.rounds
    splits, problems = _splits(n), []
    for dtype, cols in CASES:
        inputs = [_input(i, sum(splits[i]), dtype, cols) for i in range(n)]
        expected = torch.cat([inputs[j].split(splits[j])[me] for j in range(n)])
        out = torch.zeros_like(expected)
        before = rounds.round
        spmd.all_to_all_single(out, inputs[me], [splits[j][me] for j in range(n)], splits[me], group=group)
        if not torch.equal(out, expected):
            problems.append(f"{dtype}: wrong rows at {(out != expected).nonzero()[:3].tolist()}")
        row = cols * inputs[me].element_size()
        largest = max(splits[i][j] * row for i in range(n) for j in range(n) if i != j)
        needed = -(-largest // region_bytes(SLOT_BYTES, n))
        if rounds.round - before != needed or needed < 2:
            problems.append(f"{dtype}: {rounds.round - before} rounds through the slots, expected {needed} (>= 2)")
    spmd.destroy_process_group(group)
    return problems


def test_all_to_all_single_goes_through_the_slots_in_rounds(spmd_world) -> None:
    assert spmd_world(3, "shm").run(exchange_in_rounds) == [[], [], []]


def disagreeing_calls(kind: str) -> str:
    """Rank 0 sends rank 1 one row where rank 1 expects two (``splits``), or calls all_reduce on as many
    bytes as rank 1's all_to_all_single (``op``); the error this rank gets, then the next op's."""
    group = spmd.new_group([0, 1], backend="shm", timeout=5.0)
    spmd.barrier(group=group)
    me = spmd.get_rank()
    try:
        if kind == "splits":
            sends = ([2, 1], [2, 2])[me]
            spmd.all_to_all_single(torch.zeros(4), torch.ones(sum(sends)), [2, 2], sends, group=group)
        elif me == 0:
            spmd.all_reduce(torch.ones(4), group=group)
        else:
            spmd.all_to_all_single(torch.zeros(4), torch.ones(4), group=group)
        first = "no error"
    except spmd.SpmdError as error:
        first = f"{type(error).__name__}: {error}"
    try:
        spmd.all_reduce(torch.ones(4), group=group)
        after = "no error"
    except spmd.SpmdError as error:
        after = f"{type(error).__name__}: {error}"
    return f"{first}\n--\n{after}"


@pytest.mark.parametrize("kind", ["splits", "op"])
def test_disagreeing_ranks_get_a_named_error_not_rows(spmd_world, kind: str) -> None:
    world = spmd_world(2, "shm")
    try:
        results = world.run(disagreeing_calls, kind, timeout=60)
    finally:
        world.kill()  # the world's groups are given up: do not pool it
    for result in results:
        first, after = result.split("\n--\n")
        assert first != "no error" and after != "no error", results
        if kind == "splits":
            assert "splits disagree: ranks [0] sends 4 bytes to ranks [1], which expects 8 bytes" in first, results
        else:
            assert "all_to_all_single" in first and "all_reduce" in first, results
