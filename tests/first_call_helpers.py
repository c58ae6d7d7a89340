"""Rank functions for test_first_call_agreement.py: a group's first call of a kind, different on one rank."""

from __future__ import annotations

from collections.abc import Callable

import torch

import spmd


def _outcome(fn: Callable[..., object], *args: object) -> str:
    try:
        return f"no error: {fn(*args)}"
    except Exception as error:  # noqa: BLE001 - the error is the outcome
        return f"{type(error).__name__}: {' | '.join(str(error).splitlines())}"


def first_calls_that_disagree() -> dict[str, str]:
    """Each case on a new group (a disagreement leaves its group unusable), then a matching all_reduce on it."""
    one = spmd.get_rank() == 1
    cases = {
        "float64": lambda g: spmd.all_reduce(t := torch.ones(4, dtype=torch.float64 if one else torch.float32), group=g) or t.tolist(),
        "int32": lambda g: spmd.all_reduce(t := torch.ones(4, dtype=torch.int32 if one else torch.float32), group=g) or t.tolist(),
        "max": lambda g: spmd.all_reduce(t := torch.arange(4.0), op=spmd.ReduceOp.MAX if one else spmd.ReduceOp.SUM, group=g)
        or t.tolist(),
        "root": lambda g: spmd.broadcast(t := torch.full((4,), float(spmd.get_rank())), src=1 if one else 0, group=g) or t.tolist(),
        "splits": lambda g: _all_to_all(g, [1, 3] if one else [2, 2]),
    }
    out = {}
    for name, call in cases.items():
        g = spmd.new_group([0, 1])
        out[name] = _outcome(call, g)
        out[name + "_next"] = _outcome(spmd.all_reduce, torch.ones(2), spmd.ReduceOp.SUM, g)
    out["agreed"] = _outcome(lambda: spmd.all_reduce(t := torch.ones(3)) or t.tolist())
    return out


def _all_to_all(group: object, splits: list[int]) -> list[float]:
    out = torch.zeros(4)
    spmd.all_to_all_single(out, torch.arange(4.0), input_split_sizes=splits, output_split_sizes=[2, 2], group=group)
    return out.tolist()


def async_first_call_that_disagrees(late_s: float) -> dict[str, object]:
    """An async all_reduce of a new shape, float32 on rank 0 and int32 on rank 1 (which calls ``late_s`` later):
    how long the call took to return, and what waiting on its Work raised."""
    import time

    group = spmd.new_group([0, 1])
    spmd.barrier(group=group)
    if spmd.get_rank() == 1:
        time.sleep(late_s)
    t = torch.ones(4, dtype=torch.int32 if spmd.get_rank() == 1 else torch.float32)
    start = time.monotonic()
    work = spmd.all_reduce(t, group=group, async_op=True)
    returned_after = time.monotonic() - start
    return {"returned_after": returned_after, "wait": _outcome(work.wait)}


def async_new_shapes_then_more(late_s: float) -> dict[str, object]:
    """Rank 1 arrives ``late_s`` late. Two async calls of shapes new to the group, then a blocking one, a barrier
    and a broadcast: how long the first async call took to return, and every result next to the one-process value."""
    import time

    group = spmd.new_group([0, 1])
    spmd.barrier(group=group)
    rank, size = spmd.get_rank(), spmd.get_world_size()
    if rank == 1:
        time.sleep(late_s)
    summed = torch.full((5,), float(rank + 1))
    gathered = torch.zeros(2 * size, dtype=torch.int64)
    start = time.monotonic()
    first = spmd.all_reduce(summed, group=group, async_op=True)
    returned_after = time.monotonic() - start
    second = spmd.all_gather_into_tensor(gathered, torch.tensor([rank, 10 * rank]), group=group, async_op=True)
    blocking = torch.full((5,), 2.0 * (rank + 1))
    spmd.all_reduce(blocking, group=group)  # (queued behind the two: submitted in the same order on every rank)
    spmd.barrier(group=group)
    broadcast = torch.tensor([float(rank)] * 3)
    spmd.broadcast(broadcast, src=1, group=group)
    first.wait()
    second.wait()
    ranks = range(size)
    return {
        "returned_after": returned_after,
        "summed": (summed.tolist(), [float(sum(r + 1 for r in ranks))] * 5),
        "gathered": (gathered.tolist(), [v for r in ranks for v in (r, 10 * r)]),
        "blocking": (blocking.tolist(), [float(sum(2 * (r + 1) for r in ranks))] * 5),
        "broadcast": (broadcast.tolist(), [1.0] * 3),
        "later": _outcome(lambda: spmd.all_reduce(t := torch.ones(5), group=group) or t.tolist()),
    }


def p2p_mismatch_then_ops() -> str:
    """Rank 0 sends float32, rank 1 receives int32 (the same bytes); then both call matching all_reduces until
    one raises (the always-on check runs every 0.2 s; bounded at 20 s): what it raised. (The receive itself
    raises if the check ran between its data's arrival and its return: that is the outcome then.)"""
    import time

    group = spmd.new_group([0, 1])
    if spmd.get_rank() == 0:
        first = _outcome(spmd.send, torch.ones(4), 1, group)
    else:
        first = _outcome(spmd.recv, torch.zeros(4, dtype=torch.int32), 0, group)
    if not first.startswith("no error"):
        return first
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        outcome = _outcome(spmd.all_reduce, torch.ones(2), spmd.ReduceOp.SUM, group)
        if not outcome.startswith("no error"):
            return outcome
    return "no error within 20 s"
