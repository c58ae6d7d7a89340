"""The spmd side of each benchmarked op: ``make(nbytes) -> call()`` over preallocated buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch

import spmd

Maker = Callable[[int], Callable[[], object]]
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single", "sendrecv")


def elements(nbytes: int, multiple: int = 1) -> int:
    """float32 elements in about ``nbytes``: at least ``multiple``, and a multiple of it (one share per rank)."""
    n = max(nbytes // 4, 1)
    return max(n - n % multiple, multiple)


def spmd_ops(world_size: int, rank: int) -> dict[str, Maker]:
    """Makers for every op, float32 buffers allocated once per size."""
    n_ranks = world_size

    def all_reduce(nbytes: int) -> Callable[[], object]:
        t = torch.ones(elements(nbytes, 1))
        return lambda: spmd.all_reduce(t)

    def broadcast(nbytes: int) -> Callable[[], object]:
        t = torch.ones(elements(nbytes, 1))
        return lambda: spmd.broadcast(t, src=0)

    def all_gather(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n_ranks)
        out, inp = torch.empty(total), torch.ones(total // n_ranks)
        return lambda: spmd.all_gather_into_tensor(out, inp)

    def reduce_scatter(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n_ranks)
        out, inp = torch.empty(total // n_ranks), torch.ones(total)
        return lambda: spmd.reduce_scatter_tensor(out, inp)

    def all_to_all(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n_ranks)
        out, inp = torch.empty(total), torch.ones(total)
        return lambda: spmd.all_to_all_single(out, inp)

    def sendrecv(nbytes: int) -> Callable[[], object]:
        """Ping-pong between ranks 0 and 1 (others idle); one call = one round trip / 2 reported."""
        t = torch.ones(elements(nbytes, 1))

        def ping() -> None:
            spmd.send(t, 1)
            spmd.recv(t, 1)

        def pong() -> None:
            spmd.recv(t, 0)
            spmd.send(t, 0)

        return {0: ping, 1: pong}.get(rank, lambda: None)

    return {
        "all_reduce": all_reduce,
        "all_gather_into_tensor": all_gather,
        "reduce_scatter_tensor": reduce_scatter,
        "broadcast": broadcast,
        "all_to_all_single": all_to_all,
        "sendrecv": sendrecv,
    }
