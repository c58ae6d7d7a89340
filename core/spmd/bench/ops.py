"""The spmd side of each benchmarked op: ``make(nbytes) -> call()`` over preallocated buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch

import spmd

Maker = Callable[[int], Callable[[], object]]
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single", "sendrecv")


#: The one buffer of each role ("data": an in-place op's, "in", "out") in this process; see ``buffer``.
_BUFFERS: dict[str, torch.Tensor] = {}


def buffer(role: str, count: int, fill: float | None = 1.0) -> torch.Tensor:
    """A float32 buffer of ``count`` elements for ``role``, the same tensor for every side of a comparison.

    Where a buffer lies in memory changes an op's time by up to 5 % here (two
    tensors of one size, same op, same backend: 573 vs 613 us at 4 MiB on MPI),
    so sides with buffers of their own differed by that much for no reason of
    their own. Sharing one buffer per role takes that out of every ratio; it is
    replaced when the size changes (one size is measured at a time). ``fill``
    (None: left as it is) is written on each call.
    """
    tensor = _BUFFERS.get(role)
    if tensor is None or tensor.numel() != count:
        tensor = _BUFFERS[role] = torch.empty(count)
    if fill is not None:
        tensor.fill_(fill)
    return tensor


def elements(nbytes: int, multiple: int = 1) -> int:
    """float32 elements in about ``nbytes``: at least ``multiple``, and a multiple of it (one share per rank)."""
    n = max(nbytes // 4, 1)
    return max(n - n % multiple, multiple)


def spmd_ops(world_size: int, rank: int) -> dict[str, Maker]:
    """Makers for every op, float32 buffers allocated once per size."""
    n_ranks = world_size

    def all_reduce(nbytes: int) -> Callable[[], object]:
        t = buffer("data", elements(nbytes, 1))
        return lambda: spmd.all_reduce(t)

    def broadcast(nbytes: int) -> Callable[[], object]:
        t = buffer("data", elements(nbytes, 1))
        return lambda: spmd.broadcast(t, src=0)

    def all_gather(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n_ranks)
        out, inp = buffer("out", total, None), buffer("in", total // n_ranks)
        return lambda: spmd.all_gather_into_tensor(out, inp)

    def reduce_scatter(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n_ranks)
        out, inp = buffer("out", total // n_ranks, None), buffer("in", total)
        return lambda: spmd.reduce_scatter_tensor(out, inp)

    def all_to_all(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n_ranks)
        out, inp = buffer("out", total, None), buffer("in", total)
        return lambda: spmd.all_to_all_single(out, inp)

    def sendrecv(nbytes: int) -> Callable[[], object]:
        """Ping-pong between ranks 0 and 1 (others idle); one call = one round trip / 2 reported."""
        t = buffer("data", elements(nbytes, 1))

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
