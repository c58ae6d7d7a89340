"""Module-level functions that tests run on every rank of a World (they are pickled by reference)."""

from __future__ import annotations

import time

import torch

import spmd


def expect_error(fn_name: str) -> str:
    """Run one bad call on every rank; return the error type and message."""
    try:
        CALLS[fn_name]()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


CALLS = {
    "bad_dst": lambda: spmd.reduce(torch.ones(2), dst=5),
    "bad_group_src": lambda: spmd.broadcast(torch.ones(2), group_src=-1),
    "wrong_output_size": lambda: spmd.all_gather_into_tensor(torch.empty(3), torch.ones(2)),
    "wrong_rs_input": lambda: spmd.reduce_scatter_tensor(torch.empty(2), torch.ones(5)),
    "mixed_dtypes": lambda: spmd.all_gather_into_tensor(torch.empty(4, dtype=torch.int32), torch.ones(2)),
    "bitwise_on_float": lambda: spmd.all_reduce(torch.ones(2), op=spmd.ReduceOp.BAND),
    "avg_on_int": lambda: spmd.all_reduce(torch.ones(2, dtype=torch.int64), op=spmd.ReduceOp.AVG),
    "bad_splits": lambda: spmd.all_to_all_single(torch.empty(4), torch.ones(4), input_split_sizes=[1, 1]),
    "send_to_self": lambda: spmd.send(torch.ones(1), dst=spmd.get_rank()),
    "list_length": lambda: spmd.all_gather([torch.empty(2)], torch.ones(2)),
    "not_a_tensor": lambda: spmd.all_reduce([1.0, 2.0]),  # type: ignore[arg-type]
}


def skip_a_collective(timeout: float) -> str:
    """Rank 0 calls all_reduce on a short-timeout group that rank 1 never joins in."""
    group = spmd.new_group([0, 1], timeout=timeout)
    spmd.all_reduce(torch.ones(1), group=group)  # both ranks connect
    if spmd.get_rank() != 0:
        return "skipped"  # rank 1 skips the next call
    start = time.monotonic()
    try:
        spmd.all_reduce(torch.ones(4), group=group)
    except spmd.CollectiveTimeoutError as error:
        return f"{time.monotonic() - start:.2f}|{error}"
    return "no error"


def subgroup_ranks() -> tuple[int, list[int], int]:
    """new_group and split_group rank bookkeeping."""
    group = spmd.new_group([1, 2])
    split = spmd.split_group(color=spmd.get_rank() // 2)
    members = spmd.get_process_group_ranks(split)
    local = -1 if group is spmd.GroupMember.NON_GROUP_MEMBER else spmd.get_rank(group)
    return local, members, spmd.get_global_rank(split, 0)


def async_overlap() -> list[float]:
    """Several async all_reduces in flight at once, waited out of order."""
    tensors = [torch.full((1000,), float(spmd.get_rank() + k)) for k in range(5)]
    works = [spmd.all_reduce(t, async_op=True) for t in tensors]
    for work in reversed(works):
        work.wait()
    return [t[0].item() for t in tensors]


def never_meet(timeout: float) -> str:
    """Rank 0 alone uses a fresh group: its backend cannot even be created."""
    group = spmd.new_group([0, 1], timeout=timeout)
    if spmd.get_rank() != 0:
        return "skipped"
    try:
        spmd.all_reduce(torch.ones(4), group=group)
    except spmd.CollectiveTimeoutError as error:
        return str(error)
    return "no error"
