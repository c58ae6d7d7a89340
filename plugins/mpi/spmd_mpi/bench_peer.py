"""Raw mpi4py calls: the peer spmd-mpi is measured against (``spmd bench --vs-raw``, benchmarks/).

Each maker takes its buffers from ``spmd.bench.ops.buffer`` (the torch tensors the spmd side uses too, handed to mpi4py as the
numpy views a raw mpi4py program would use) and returns a call that runs one
blocking MPI operation on a private duplicate of ``MPI_COMM_WORLD``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmd.bench.ops import buffer, elements


def raw_mpi_ops(ctx: Any = None) -> dict[str, Callable[[int], Callable[[], object]]]:
    """Makers for every benchmarked op over raw mpi4py (``ctx`` is unused: MPI has its own world)."""
    from spmd_mpi.library import load_mpi

    MPI = load_mpi()
    comm = MPI.COMM_WORLD.Dup()
    n, rank = comm.Get_size(), comm.Get_rank()
    in_place, total = MPI.IN_PLACE, MPI.SUM

    def all_reduce(nbytes: int) -> Callable[[], object]:
        a = buffer("data", elements(nbytes, 1)).numpy()
        return lambda: comm.Allreduce(in_place, a, total)

    def broadcast(nbytes: int) -> Callable[[], object]:
        a = buffer("data", elements(nbytes, 1)).numpy()
        return lambda: comm.Bcast(a, 0)

    def all_gather(nbytes: int) -> Callable[[], object]:
        count = elements(nbytes, n)
        out, inp = buffer("out", count, None).numpy(), buffer("in", count // n).numpy()
        return lambda: comm.Allgather(inp, out)

    def reduce_scatter(nbytes: int) -> Callable[[], object]:
        count = elements(nbytes, n)
        out, inp = buffer("out", count // n, None).numpy(), buffer("in", count).numpy()
        return lambda: comm.Reduce_scatter_block(inp, out, total)

    def all_to_all(nbytes: int) -> Callable[[], object]:
        count = elements(nbytes, n)
        out, inp = buffer("out", count, None).numpy(), buffer("in", count).numpy()
        return lambda: comm.Alltoall(inp, out)

    def sendrecv(nbytes: int) -> Callable[[], object]:
        a = buffer("data", elements(nbytes, 1)).numpy()
        if rank == 0:
            return lambda: (comm.Send(a, 1), comm.Recv(a, 1))
        if rank == 1:
            return lambda: (comm.Recv(a, 0), comm.Send(a, 0))
        return lambda: None

    return {
        "all_reduce": all_reduce,
        "all_gather_into_tensor": all_gather,
        "reduce_scatter_tensor": reduce_scatter,
        "broadcast": broadcast,
        "all_to_all_single": all_to_all,
        "sendrecv": sendrecv,
    }
