"""Functions the MPI tests run on every rank of a World (module level, so they pickle by reference)."""

from __future__ import annotations

import time

import torch

import spmd
from spmd.comm.state import get_state


def identity() -> dict:
    """What this rank sees: spmd's and MPI's rank and size, the backend, the MPI library."""
    from mpi4py import MPI

    t = torch.ones(3)
    spmd.all_reduce(t)
    return {
        "rank": spmd.get_rank(),
        "size": spmd.get_world_size(),
        "mpi_rank": MPI.COMM_WORLD.Get_rank(),
        "mpi_size": MPI.COMM_WORLD.Get_size(),
        "backend": spmd.get_backend(),
        "sum": t.tolist(),
        "thread_level": MPI.Query_thread() == MPI.THREAD_MULTIPLE,
    }


def all_reduce_error() -> str:
    """The error a collective raises where the MPI world does not match spmd's."""
    try:
        spmd.all_reduce(torch.ones(2))
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def overlapping_async(count: int) -> list[float]:
    """Many outstanding ops at once, waited in reverse order, through every completion path."""
    n = spmd.get_world_size()
    works = []
    tensors = []
    for i in range(count):
        t = torch.full((1000 * (i + 1),), float(i))
        tensors.append(t)
        works.append(spmd.all_reduce(t, async_op=True))
    futures = [w.get_future() for w in works[::3]]  # futures need the watcher thread
    for w in reversed(works):
        w.wait(timeout=30)
    for f in futures:
        f.wait()
    polled = spmd.all_reduce(torch.ones(10), async_op=True)
    deadline = time.monotonic() + 30
    while not polled.is_completed():  # completion by polling alone
        assert time.monotonic() < deadline
    out = [t[0].item() / n for t in tensors]
    ring = [spmd.P2POp(spmd.isend, torch.full((5,), float(spmd.get_rank())), (spmd.get_rank() + 1) % n),
            spmd.P2POp(spmd.irecv, got := torch.zeros(5), (spmd.get_rank() - 1) % n)]
    from spmd.comm.p2p import wait_all

    wait_all(spmd.batch_isend_irecv(ring))  # a WorkList: completes through callbacks only
    out.append(got[0].item())
    return out


def timeout_then_recover() -> str:
    """Rank 0 waits for a collective rank 1 has not started: a timeout, then it completes."""
    g = spmd.new_group(list(range(spmd.get_world_size())))
    spmd.barrier(group=g)  # both ranks create the communicator
    store = get_state().store
    message = ""
    if spmd.get_rank() == 0:
        t = torch.ones(4)
        work = spmd.all_reduce(t, group=g, async_op=True)
        started = time.monotonic()
        try:
            work.wait(timeout=0.5)
        except spmd.CollectiveTimeoutError as error:
            message = f"{time.monotonic() - started:.2f}s {error}"
        store.set("mpi-test/late", "go")
        work.wait(timeout=30)  # rank 1 joins now: the same op completes
        assert t.tolist() == [float(spmd.get_world_size())] * 4
    else:
        store.wait(["mpi-test/late"])
        spmd.all_reduce(torch.ones(4), group=g)
    return message


def imported_mpi4py_before_use() -> bool:
    import sys

    return "mpi4py.MPI" in sys.modules


def group_color(rank: int, round_: int) -> int:
    return (rank * (round_ + 1) + round_ // 3) % 2


def many_groups(rounds: int) -> int:
    """Create and use many sub-groups (each a real MPI communicator), then destroy them."""
    r = spmd.get_rank()
    total = 0
    for i in range(rounds):
        g = spmd.split_group(color=group_color(r, i), key=-r if i % 2 else r)
        t = torch.ones(1)
        spmd.all_reduce(t, group=g)
        total += int(t.item())
        spmd.destroy_process_group(g)
    return total


def fail_on(rank: int) -> None:
    t = torch.ones(2)
    spmd.all_reduce(t)
    if spmd.get_rank() == rank:
        raise ValueError(f"rank {rank} fails on purpose")
