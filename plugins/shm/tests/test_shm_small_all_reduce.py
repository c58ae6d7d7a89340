"""The small all_reduce's plain-call path (``collectives.small_all_reduce``): the rank-order result, bit for bit
on every rank, whether the peers came in time (done inside the call), came later (its rest queued as a work),
or the call was async; and a size or op that differs on one rank is still a named error on every rank."""

from __future__ import annotations

import time

import pytest
import torch

import spmd
from spmd.comm.reduce_op import ReduceOp, reduce_into

CASES = [(torch.float32, ReduceOp.SUM), (torch.float32, ReduceOp.AVG), (torch.float64, ReduceOp.MIN),
         (torch.bfloat16, ReduceOp.SUM), (torch.int64, ReduceOp.PRODUCT), (torch.bool, ReduceOp.MAX),
         (torch.complex64, ReduceOp.SUM)]
#: How each call is made: peers in step; rank 1 late by more than the inline wait (the rest is queued);
#: async, waited afterwards.
MODES = ("in step", "late peer", "async")


def _input(rank: int, dtype: torch.dtype, numel: int = 37) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(7 + rank))
    if dtype == torch.int64:
        return (values * 3).round().to(dtype)
    if dtype == torch.complex64:
        return torch.complex(values, values.flip(0))
    return values.to(dtype) if dtype != torch.bool else values > 0.3


def _expected(world: int, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    """What one process computes: every rank's input reduced in rank order (AVG: the sum, divided once)."""
    acc = _input(0, dtype).clone()
    for q in range(1, world):
        reduce_into(acc, _input(q, dtype), op)
    if op is ReduceOp.AVG:
        acc /= world
    return acc


def small_calls() -> list[tuple[str, bytes, int]]:
    """Each case in each mode: (case, the result's bytes, how many times its rest was queued as a work)."""
    from spmd_shm import collectives

    queued = [0]
    finish = collectives._finish_small

    def counted(*args):  # type: ignore[no-untyped-def]
        queued[0] += 1
        return finish(*args)

    collectives._finish_small = counted
    me = spmd.get_rank()
    from spmd.comm.checks import route

    engine = route(None, torch.ones(1), "tensor", "all_reduce")[1].engine
    out = []
    for mode in MODES:
        for dtype, op in CASES:
            t = _input(me, dtype)
            assert collectives.is_small(engine.rounds, t)
            spmd.barrier()
            if mode == "late peer" and me == 1:
                time.sleep(0.05)  # far beyond the inline wait (at most 50 us): rank 0's rest is queued
            if mode == "async":
                work = spmd.all_reduce(t, op=op, async_op=True)
                work.wait()
            else:
                spmd.all_reduce(t, op=op)
            out.append((f"{mode} {dtype} {op.name}", t.view(-1).view(torch.uint8).numpy().tobytes(), queued[0]))
            queued[0] = 0
    collectives._finish_small = finish
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_small_all_reduce_is_the_rank_order_reduction_on_every_rank(spmd_world, world) -> None:
    per_rank = spmd_world(world, "shm").run(small_calls)
    for i, (case, got, _) in enumerate(per_rank[0]):
        dtype, op = CASES[i % len(CASES)]
        expected = _expected(world, dtype, op)
        assert got == expected.view(-1).view(torch.uint8).numpy().tobytes(), case
        for rank in range(1, world):
            assert per_rank[rank][i][1] == got, f"{case}: rank {rank} differs from rank 0"
        if case.startswith("late peer"):  # rank 0 gave up its inline wait: the queued path was taken
            assert per_rank[0][i][2] == 1, f"{case}: rank 0 queued its rest {per_rank[0][i][2]} times"


def mismatch(kind: str) -> str:
    """After agreeing calls (the kernel's first-call check has passed), rank 1 makes a different small all_reduce."""
    t = torch.ones(8)
    for _ in range(3):
        spmd.all_reduce(t)
    one = spmd.get_rank() == 1
    try:
        if kind == "size":
            spmd.all_reduce(torch.ones(9 if one else 8))
        else:
            spmd.all_reduce(torch.ones(8), op=ReduceOp.MAX if one else ReduceOp.SUM)
        spmd.all_reduce(torch.ones(8))
    except Exception as error:  # noqa: BLE001 - the error is the outcome
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("kind", ["size", "op"])
def test_a_small_all_reduce_that_differs_on_one_rank_is_a_named_error_on_every_rank(spmd_world, kind) -> None:
    world = spmd_world(2, "shm")
    try:
        outcomes = world.run(mismatch, kind, timeout=60)
    finally:
        world.kill()  # the group is given up: later tests get a fresh world
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith(("CollectiveError", "CollectiveDesyncError")), f"rank {rank}: {outcome}"
