"""MpiBackend: every collective native through MPI's non-blocking operations.

Each op starts an MPI non-blocking call (``Iallreduce``, ``Ibcast``, ...) on
the tensor's own memory (a raw buffer over ``tensor.data_ptr()``, no copy)
and returns an ``MpiWork`` whose wait polls ``MPI_Test`` with back-off, so
every wait honours its timeout (MPI's own ``MPI_Wait`` blocks forever).

Data movement sends bytes, so every dtype moves (float8, uint64, ...).
Reductions use the MPI datatype of the tensor's dtype; float16 and bfloat16,
which MPI has no standard type for, are reduced in a pooled float32 staging
buffer and rounded back once. bool reduces with MPI's logical ops. AVG is a
SUM that the kernel divides (``supports_avg = False``).

The machinery around the backend has one module per job:

    library.py       importing mpi4py.MPI on first use (thread support, MPI defaults)
    mapping.py       torch dtypes and ReduceOps to MPI datatypes and ops
    work.py          MpiWork (the polling, timed wait and its tunables) and the watcher thread
    communicator.py  the group's communicator: Dup of the world or Create_group, after a rendezvous
    probe.py         facts about the installation and launcher, without loading libmpi

``load_mpi``, ``library_version`` and ``MpiWork`` stay importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.comm.backend import Backend, BackendContext
from spmd.comm.buffers import BufferPool
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import NativeWork, Work
from spmd_mpi import library, mapping
from spmd_mpi.communicator import create_communicator
from spmd_mpi.library import library_version, load_mpi
from spmd_mpi.work import MpiWork

__all__ = ["MpiBackend", "MpiWork", "library_version", "load_mpi"]

# Bound by assignment, not by import: CPython 3.11 compiles ``name.get(...)`` on an
# imported name as an attribute load plus a call, no method call (measurable per op).
_REDUCE = mapping.REDUCE
_STAGED = mapping.STAGED


class MpiBackend(Backend):
    """One MPI communicator for one spmd group; every collective native and non-blocking."""

    supports_avg = False  # MPI has no AVG; the kernel sums and divides

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        mpi = load_mpi()
        comm = create_communicator(mpi, ctx)
        self.comm = comm
        self._pool = BufferPool()
        self._buffer = mpi.buffer.fromaddress
        self._in_place = mpi.IN_PLACE
        self._byte = mpi.BYTE
        # Bound once: attribute lookups are measurable on 4-byte ops.
        self._isend, self._irecv = comm.Isend, comm.Irecv
        self._iallreduce, self._ireduce, self._ibcast = comm.Iallreduce, comm.Ireduce, comm.Ibcast
        self._iallgather, self._ireduce_scatter_block = comm.Iallgather, comm.Ireduce_scatter_block
        self._ialltoallv = comm.Ialltoallv
        self._igather, self._iscatter, self._ibarrier = comm.Igather, comm.Iscatter, comm.Ibarrier

    # -- buffers ---------------------------------------------------------------------
    def _bytes(self, tensor: torch.Tensor) -> Any:
        """A raw MPI buffer over the tensor's memory (contiguous, as the kernel guarantees)."""
        return self._buffer(tensor.data_ptr(), tensor.nbytes)

    def _typed(self, tensor: torch.Tensor, mpi_type: Any) -> list[Any]:
        return [self._buffer(tensor.data_ptr(), tensor.nbytes), mpi_type]

    def _stage(self, tensor: torch.Tensor, copy_in: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """A float32 copy of a float16/bfloat16 tensor in a pooled buffer: (pooled, view)."""
        n = tensor.numel()
        pooled = self._pool.acquire(n, torch.float32)
        view = pooled[:n]
        if copy_in:
            view.copy_(tensor.reshape(-1))
        return pooled, view

    def _staged_done(self, pooled: torch.Tensor, view: torch.Tensor, target: torch.Tensor | None) -> Callable[[bool], None]:
        def after(ok: bool) -> None:
            try:
                if ok and target is not None:
                    target.reshape(-1).copy_(view)
            finally:
                self._pool.release(pooled)

        return after

    # -- point-to-point ----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work | NativeWork:
        nbytes = tensor.nbytes
        return MpiWork(self._isend(self._buffer(tensor.data_ptr(), nbytes), dst, tag), tensor, None, nbytes)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work | NativeWork:
        nbytes = tensor.nbytes
        return MpiWork(self._irecv(self._buffer(tensor.data_ptr(), nbytes), src, tag), tensor, None, nbytes)

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        table = _REDUCE.get(op)
        entry = table.get(tensor.dtype) if table is not None else None
        if entry is not None:
            nbytes = tensor.nbytes
            if not nbytes:
                return Work.completed()
            request = self._iallreduce(self._in_place, [self._buffer(tensor.data_ptr(), nbytes), entry[0]], entry[1])
            return MpiWork(request, tensor, None, nbytes)
        if tensor.dtype in _STAGED and table is not None:
            if tensor.numel() == 0:
                return Work.completed()
            mpi_type, mpi_op = table[torch.float32]
            pooled, view = self._stage(tensor)
            request = self._iallreduce(self._in_place, self._typed(view, mpi_type), mpi_op)
            return MpiWork(request, (tensor, pooled), self._staged_done(pooled, view, tensor), view.nbytes)
        return super().all_reduce(tensor, op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work | NativeWork:
        table = _REDUCE.get(op)
        if table is None or (tensor.dtype not in table and tensor.dtype not in _STAGED):
            return super().reduce(tensor, dst, op)
        if tensor.numel() == 0:
            return Work.completed()
        root = self.rank == dst
        if tensor.dtype in table:
            mpi_type, mpi_op = table[tensor.dtype]
            data = self._typed(tensor, mpi_type)
            request = self._ireduce(self._in_place, data, mpi_op, dst) if root else self._ireduce(data, None, mpi_op, dst)
            return MpiWork(request, tensor, None, tensor.nbytes)
        mpi_type, mpi_op = table[torch.float32]
        pooled, view = self._stage(tensor)
        data = self._typed(view, mpi_type)
        request = self._ireduce(self._in_place, data, mpi_op, dst) if root else self._ireduce(data, None, mpi_op, dst)
        return MpiWork(request, (tensor, pooled), self._staged_done(pooled, view, tensor if root else None), view.nbytes)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        table = _REDUCE.get(op)
        entry = table.get(input.dtype) if table is not None else None
        if entry is not None:
            out_bytes = output.nbytes
            if not out_bytes:
                return Work.completed()
            buffer, mpi_type = self._buffer, entry[0]
            request = self._ireduce_scatter_block(
                [buffer(input.data_ptr(), input.nbytes), mpi_type], [buffer(output.data_ptr(), out_bytes), mpi_type], entry[1]
            )
            return MpiWork(request, (output, input), None, input.nbytes)
        if input.dtype in _STAGED and table is not None:
            if output.numel() == 0:
                return Work.completed()
            mpi_type, mpi_op = table[torch.float32]
            pooled_in, view_in = self._stage(input)
            pooled_out, view_out = self._stage(output, copy_in=False)
            request = self._ireduce_scatter_block(self._typed(view_in, mpi_type), self._typed(view_out, mpi_type), mpi_op)
            release_in = self._staged_done(pooled_in, view_in, None)
            copy_out = self._staged_done(pooled_out, view_out, output)

            def after(ok: bool) -> None:
                try:
                    copy_out(ok)
                finally:
                    release_in(ok)

            return MpiWork(request, (output, input, pooled_in, pooled_out), after, view_in.nbytes)
        return super().reduce_scatter_tensor(output, input, op)

    # -- data movement -------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work | NativeWork:
        nbytes = tensor.nbytes
        if not nbytes:
            return Work.completed()
        return MpiWork(self._ibcast(self._buffer(tensor.data_ptr(), nbytes), src), tensor, None, nbytes)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work | NativeWork:
        nbytes = input.nbytes
        if not nbytes:
            return Work.completed()
        buffer = self._buffer
        out_bytes = output.nbytes
        request = self._iallgather(buffer(input.data_ptr(), nbytes), buffer(output.data_ptr(), out_bytes))
        return MpiWork(request, (output, input), None, out_bytes)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work | NativeWork:
        buffer = self._buffer
        out_data = buffer(output.data_ptr(), output.nbytes)
        in_data = buffer(input.data_ptr(), input.nbytes)
        # Always MPI_Ialltoallv: whether one rank's splits happen to be even says nothing about its
        # peers', and MPI_Ialltoall on one rank against MPI_Ialltoallv on another never matches (a rank
        # with nothing to exchange must still take part).
        in_rows = input.shape[0] if input.dim() else input.numel()
        out_rows = output.shape[0] if output.dim() else output.numel()
        if in_rows:
            row = input.nbytes // in_rows
        else:
            row = output.nbytes // out_rows if out_rows else 0
        byte = self._byte
        request = self._ialltoallv(
            [in_data, _counts(input_split_sizes, row), byte],
            [out_data, _counts(output_split_sizes, row), byte],
        )
        return MpiWork(request, (output, input), None, max(input.nbytes, output.nbytes))

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> Work | NativeWork:
        if input.numel() == 0:
            return Work.completed()
        out_data = None if output is None else self._bytes(output)
        return MpiWork(self._igather(self._bytes(input), out_data, dst), (output, input), None, input.nbytes * self.size)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int) -> Work | NativeWork:
        if output.numel() == 0:
            return Work.completed()
        in_data = None if input is None else self._bytes(input)
        return MpiWork(self._iscatter(in_data, self._bytes(output), src), (output, input), None, output.nbytes * self.size)

    def barrier(self) -> Work | NativeWork:
        return MpiWork(self._ibarrier())

    # -- groups --------------------------------------------------------------------------
    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        """A real sub-communicator (``MPI_Comm_create_group`` over the members only)."""
        return MpiBackend(ctx)

    def close(self) -> None:
        super().close()
        comm, self.comm = getattr(self, "comm", None), None
        mpi = library.MPI
        if comm is not None and mpi is not None and not mpi.Is_finalized():
            try:
                comm.Free()
            except mpi.Exception:  # pragma: no cover - nothing useful to do at teardown
                pass



def _counts(splits: Sequence[int], row_bytes: int) -> tuple[list[int], list[int]]:
    """(counts, displacements) in bytes for rows split as ``splits``."""
    counts = [s * row_bytes for s in splits]
    displs = [0] * len(counts)
    total = 0
    for i, c in enumerate(counts):
        displs[i] = total
        total += c
    return counts, displs
