"""Group and barrier functions the tests of tests/test_groups_and_init.py run on every rank of a World
(pickled by reference)."""

from __future__ import annotations

import time
from typing import Any

import torch

import spmd


def subgroup_ranks() -> tuple[int, list[int], int]:
    """new_group and split_group rank bookkeeping."""
    group = spmd.new_group([1, 2])
    split = spmd.split_group(color=spmd.get_rank() // 2)
    members = spmd.get_process_group_ranks(split)
    local = -1 if group is spmd.GroupMember.NON_GROUP_MEMBER else spmd.get_rank(group)
    return local, members, spmd.get_global_rank(split, 0)


def groups_named_alike() -> dict[str, Any]:
    """Names a group's ranks must agree on (4 ranks, group timeout 20 s): two overlapping new_groups with
    one group_desc, a split_group of a subgroup with a group_desc for both colours, then a new_group."""
    rank = spmd.get_rank()
    out: dict[str, Any] = {}
    first = spmd.new_group([0, 1], group_desc="tp", timeout=20)
    second = spmd.new_group([1, 2], group_desc="tp", timeout=20)
    for key, group in (("first", first), ("second", second)):
        if group is not spmd.GroupMember.NON_GROUP_MEMBER:
            t = torch.tensor([float(rank + 1)])
            spmd.all_reduce(t, group=group)
            out[key] = (group.name, t.item())
    upper = spmd.new_group([1, 2, 3], timeout=20)
    if upper is not spmd.GroupMember.NON_GROUP_MEMBER:
        halves = spmd.split_group(upper, color=0 if rank < 3 else 1, group_desc="half", timeout=20)
        t = torch.tensor([float(rank + 1)])
        spmd.all_reduce(t, group=halves)
        out["half"] = (halves.name, t.item())
    last = spmd.new_group([0, 3], timeout=20)
    if last is not spmd.GroupMember.NON_GROUP_MEMBER:
        t = torch.tensor([float(rank + 1)])
        spmd.all_reduce(t, group=last)
        out["last"] = (last.name, t.item())
    return out


def local_groups_with_one_desc() -> tuple[str, float]:
    """Ranks 0,1 and ranks 2,3 each create a group apart (use_local_synchronization) with the same
    group_desc, as spmd.checkpoint does for each group it saves over, and all_reduce on it."""
    rank = spmd.get_rank()
    group = spmd.new_group([0, 1] if rank < 2 else [2, 3], use_local_synchronization=True, group_desc="ckpt", timeout=20)
    t = torch.tensor([float(rank + 1)])
    spmd.all_reduce(t, group=group)
    return group.name, t.item()


def async_overlap() -> list[float]:
    """Several async all_reduces in flight at once, waited out of order."""
    tensors = [torch.full((1000,), float(spmd.get_rank() + k)) for k in range(5)]
    works = [spmd.all_reduce(t, async_op=True) for t in tensors]
    for work in reversed(works):
        work.wait()
    return [t[0].item() for t in tensors]


def split_group_torch_form() -> tuple[list[int] | None, float | None]:
    """torch's split_group form on 4 ranks: [[0, 2], [3]]; rank 1 is in no split and gets None."""
    group = spmd.split_group(split_ranks=[[0, 2], [3]])
    if group is None:
        return None, None
    t = torch.tensor([float(spmd.get_rank() + 1)])
    spmd.all_reduce(t, group=group)
    return spmd.get_process_group_ranks(group), t.item()


def unsorted_and_local_groups() -> tuple[int, float, list[float]]:
    """new_group(sort_ranks=False) keeps the given order; use_local_synchronization needs only members."""
    ordered = spmd.new_group([2, 0, 1], sort_ranks=False)
    t = torch.tensor([float(spmd.get_rank())])
    spmd.broadcast(t, group=ordered, group_src=0)  # group rank 0 is world rank 2
    sums = []
    if spmd.get_rank() != 1:  # rank 1 never calls: only members synchronise
        for _ in range(2):  # twice: the same members get two distinct groups
            local = spmd.new_group([0, 2], use_local_synchronization=True)
            s = torch.tensor([float(spmd.get_rank() + 1)])
            spmd.all_reduce(s, group=local)
            sums.append(s.item())
    spmd.barrier()
    return spmd.get_rank(ordered), t.item(), sums


def barrier_with_timeout(timeout: float) -> str:
    """Rank 0's barrier(timeout=) fails fast while rank 1 is elsewhere."""
    from spmd.comm.state import get_state

    store = get_state().store
    spmd.barrier()  # both ranks: the backend exists before rank 0 is left alone
    if spmd.get_rank() == 0:
        start = time.monotonic()
        try:
            spmd.barrier(timeout=timeout)
            outcome = "no error"
        except spmd.CollectiveTimeoutError as error:
            outcome = f"{time.monotonic() - start:.2f}|{error}"
        store.set("barrier_test/rank0_done", "1")
        return outcome
    store.wait(["barrier_test/rank0_done"])  # rank 1 stays away until rank 0 has timed out
    return "stayed away"  # (joining now would meet a group rank 0 gave up on: test_collective_errors)


def subgroups_objects_monitored() -> dict:
    """new_subgroups, new_subgroups_by_enumeration, send/recv_object_list and a clean monitored_barrier on 4 ranks."""
    rank = spmd.get_rank()
    mine, _ = spmd.new_subgroups(group_size=2)
    t = torch.tensor([float(rank + 1)])
    spmd.all_reduce(t, group=mine)
    listed, every = spmd.new_subgroups_by_enumeration([[0, 3], [1]])
    sender = None
    received: list = [None, None]
    if rank == 0:
        spmd.send_object_list([{"step": 7}, "adam"], dst=3)
    elif rank == 3:
        sender = spmd.recv_object_list(received, src=0)
    spmd.monitored_barrier(timeout=30)
    return {"sub_ranks": spmd.get_process_group_ranks(mine), "sub_sum": t.item(), "listed": None if listed is None else spmd.get_process_group_ranks(listed),
            "count": len(every), "sender": sender, "received": received}


def monitored_barrier_names_the_missing_rank(timeout: float) -> str:
    """Rank 1 stays away: rank 0's monitored_barrier names it (the group is unusable afterwards, as in torch)."""
    from spmd.comm.state import get_state

    store = get_state().store
    spmd.barrier()  # the backend exists before rank 0 waits alone
    if spmd.get_rank() == 0:
        try:
            spmd.monitored_barrier(timeout=timeout, wait_all_ranks=True)
            outcome = "no error"
        except spmd.CollectiveTimeoutError as error:
            outcome = str(error)
        store.set("monitored_test/rank0_done", "1")
        return outcome
    store.wait(["monitored_test/rank0_done"])  # no fixed sleep: away until rank 0 has given up
    return "stayed away"
