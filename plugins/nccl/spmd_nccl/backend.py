"""NcclBackend: spmd's Backend contract over NCCL, called through ctypes.

The backend checks the tensors and says which NCCL calls each op makes; the
machinery around it has one module per job:

    library.py       finding and loading libnccl; its ctypes types and signatures
    mapping.py       torch dtypes and ReduceOps to NCCL's, by library version
    errors.py        NcclError
    cuda.py          is a CUDA device visible; the current device; capture mode for threads
    bootstrap.py     the unique id through the store; waiting out a non-blocking init
    communicator.py  one ncclComm_t: its stream and lock, launching ops, queued p2p, teardown
    work.py          NcclWork: completion through a CUDA event
    watcher.py       the thread that completes Works, times out ops and reports async errors

The classes and functions that used to live here stay importable from here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from spmd.comm.backend import Backend, BackendContext
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import NativeWork, Work
from spmd.errors import BackendUnavailableError
from spmd_nccl import library as nccl
from spmd_nccl.bootstrap import await_ready, exchange_unique_id
from spmd_nccl.communicator import Communicator, create_communicator
from spmd_nccl.cuda import (
    allow_queries_during_other_threads_captures,
    cuda_unavailable_reason,
    on_device,
)
from spmd_nccl.errors import NcclError
from spmd_nccl.mapping import BYTES, UnsupportedReduction, reduction
from spmd_nccl.work import NcclWork

__all__ = [
    "BackendContext",
    "Communicator",
    "NcclBackend",
    "NcclError",
    "NcclWork",
    "allow_queries_during_other_threads_captures",
    "await_ready",
    "create_communicator",
    "cuda_unavailable_reason",
    "exchange_unique_id",
]


def _row_bytes(tensor: torch.Tensor) -> int:
    rows = tensor.shape[0] if tensor.dim() else 1
    return (tensor.numel() // rows) * tensor.element_size() if rows else 0


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (no copy; the tensor is contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


class NcclBackend(Backend):
    """NCCL for one group's CUDA tensors; every collective native."""

    supports_avg = True  # ncclAvg (NCCL >= 2.10)

    def __init__(self, ctx: BackendContext, communicator: Communicator | None = None) -> None:
        super().__init__(ctx)
        try:
            self.lib = nccl.load()
        except nccl.NcclLibraryError as error:
            raise BackendUnavailableError(f"spmd-nccl: {error}") from error
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(
                f"spmd-nccl: NCCL {self.lib.version_string} loaded from {self.lib.path}, but no CUDA device is visible: {reason}"
            )
        self._blocking = bool(ctx.options.get("nccl_blocking", False))
        self._comm = communicator
        self._create_lock = threading.Lock()

    # -- the communicator ----------------------------------------------------------------------
    @property
    def communicator(self) -> Communicator | None:
        """The NCCL communicator, once the first CUDA op created it."""
        return self._comm

    def _communicator(self, device: torch.device) -> Communicator:
        comm = self._comm
        if comm is None:
            with self._create_lock:
                if self._comm is None:
                    self._comm = create_communicator(self.lib, self.ctx, device, self._blocking)
                comm = self._comm
        if comm.device != device:
            raise ValueError(
                f"spmd-nccl: group {self.ctx.group_name!r} has its NCCL communicator on {comm.device} (made by its "
                f"first CUDA op), but this tensor is on {device}. Use one GPU per rank: call "
                "torch.cuda.set_device(local_rank) before the first op and keep the group's tensors there"
            )
        comm.raise_if_dead()
        return comm

    def _prepare(self, op: str, *tensors: torch.Tensor | None) -> Communicator:
        device: torch.device | None = None
        for tensor in tensors:
            if tensor is None:
                continue
            if tensor.device.type != "cuda":
                raise TypeError(
                    f"spmd-nccl {op}: got a {tensor.device.type} tensor; NCCL moves CUDA tensors only. Move it "
                    "with .cuda(), or give that device its own backend: spmd.init('cpu:gloo,cuda:nccl')"
                )
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                raise ValueError(f"spmd-nccl {op}: tensors on {device} and {tensor.device}; put them on one GPU")
            if not tensor.is_contiguous():
                raise ValueError(f"spmd-nccl {op}: the kernel passed a non-contiguous tensor (shape {tuple(tensor.shape)})")
        assert device is not None
        return self._communicator(device)

    # -- point-to-point ----------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work | NativeWork:
        comm = self._prepare("isend", tensor)
        if tensor.numel() == 0:
            return Work.completed()
        return comm.post_p2p(True, _bytes(tensor), dst)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work | NativeWork:
        comm = self._prepare("irecv", tensor)
        if tensor.numel() == 0:
            return Work.completed()
        return comm.post_p2p(False, _bytes(tensor), src)

    # -- reductions ----------------------------------------------------------------------------------
    def supports_reduction(self, dtype: torch.dtype, op: ReduceOp) -> bool:
        try:
            reduction(dtype, op, self.lib.version)
        except UnsupportedReduction:
            return False
        return True

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        comm = self._prepare("all_reduce", tensor)
        plan = reduction(tensor.dtype, op, self.lib.version)
        if tensor.numel() == 0:
            return Work.completed()
        data = tensor.reshape(-1).view(plan.view_dtype)
        ptr, count = data.data_ptr(), data.numel()

        def issue() -> None:
            comm.call("ncclAllReduce", ptr, ptr, count, plan.nccl_dtype, plan.nccl_op, comm.handle, comm.stream_handle)

        return comm.launch(issue, tensor)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work | NativeWork:
        comm = self._prepare("reduce", tensor)
        plan = reduction(tensor.dtype, op, self.lib.version)
        if tensor.numel() == 0:
            return Work.completed()
        data = tensor.reshape(-1).view(plan.view_dtype)
        ptr, count = data.data_ptr(), data.numel()
        out = ptr if self.rank == dst else None  # NULL off the root: NCCL leaves other ranks' tensors alone

        def issue() -> None:
            comm.call("ncclReduce", ptr, out, count, plan.nccl_dtype, plan.nccl_op, dst, comm.handle, comm.stream_handle)

        return comm.launch(issue, tensor)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        comm = self._prepare("reduce_scatter_tensor", output, input)
        plan = reduction(input.dtype, op, self.lib.version)
        if output.numel() == 0:
            return Work.completed()
        out = output.reshape(-1).view(plan.view_dtype)
        inp = input.reshape(-1).view(plan.view_dtype)
        out_ptr, in_ptr, count = out.data_ptr(), inp.data_ptr(), out.numel()

        def issue() -> None:
            comm.call("ncclReduceScatter", in_ptr, out_ptr, count, plan.nccl_dtype, plan.nccl_op, comm.handle, comm.stream_handle)

        return comm.launch(issue, (output, input))

    # -- data movement ---------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work | NativeWork:
        comm = self._prepare("broadcast", tensor)
        if tensor.numel() == 0:
            return Work.completed()
        ptr, count = tensor.data_ptr(), tensor.numel() * tensor.element_size()

        def issue() -> None:
            comm.call("ncclBroadcast", ptr, ptr, count, BYTES, src, comm.handle, comm.stream_handle)

        return comm.launch(issue, tensor)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work | NativeWork:
        comm = self._prepare("all_gather_into_tensor", output, input)
        if input.numel() == 0:
            return Work.completed()
        in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
        count = input.numel() * input.element_size()

        def issue() -> None:
            comm.call("ncclAllGather", in_ptr, out_ptr, count, BYTES, comm.handle, comm.stream_handle)

        return comm.launch(issue, (output, input))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work | NativeWork:
        comm = self._prepare("all_to_all_single", output, input)
        in_row, out_row = _row_bytes(input), _row_bytes(output)
        if input.numel() == 0 and output.numel() == 0:
            return Work.completed()
        inp, out = _bytes(input), _bytes(output)
        sends, recvs, offset = [], [], 0
        for size in input_split_sizes:
            sends.append((offset, size * in_row))
            offset += size * in_row
        offset = 0
        for size in output_split_sizes:
            recvs.append((offset, size * out_row))
            offset += size * out_row
        me = self.rank

        def issue() -> None:
            with comm.group_call():
                for peer in range(self.size):
                    if peer == me:
                        continue
                    (s_off, s_len), (r_off, r_len) = sends[peer], recvs[peer]
                    if s_len:
                        comm.call("ncclSend", inp.data_ptr() + s_off, s_len, BYTES, peer, comm.handle, comm.stream_handle)
                    if r_len:
                        comm.call("ncclRecv", out.data_ptr() + r_off, r_len, BYTES, peer, comm.handle, comm.stream_handle)
            (s_off, s_len), (r_off, _) = sends[me], recvs[me]
            if s_len:
                comm.local_copy(out[r_off:r_off + s_len], inp[s_off:s_off + s_len])

        return comm.launch(issue, (output, input))

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> Work | NativeWork:
        comm = self._prepare("gather", output, input)
        if input.numel() == 0:
            return Work.completed()
        inp = _bytes(input)
        block = inp.numel()
        out = _bytes(output) if output is not None else None
        me = self.rank

        def issue() -> None:
            with comm.group_call():
                if me != dst:
                    comm.call("ncclSend", inp.data_ptr(), block, BYTES, dst, comm.handle, comm.stream_handle)
                else:
                    assert out is not None
                    for peer in range(self.size):
                        if peer != me:
                            comm.call("ncclRecv", out.data_ptr() + peer * block, block, BYTES, peer, comm.handle, comm.stream_handle)
            if me == dst:
                assert out is not None
                comm.local_copy(out[me * block:(me + 1) * block], inp)

        return comm.launch(issue, (output, input))

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int) -> Work | NativeWork:
        comm = self._prepare("scatter", output, input)
        if output.numel() == 0:
            return Work.completed()
        out = _bytes(output)
        block = out.numel()
        inp = _bytes(input) if input is not None else None
        me = self.rank

        def issue() -> None:
            with comm.group_call():
                if me != src:
                    comm.call("ncclRecv", out.data_ptr(), block, BYTES, src, comm.handle, comm.stream_handle)
                else:
                    assert inp is not None
                    for peer in range(self.size):
                        if peer != me:
                            comm.call("ncclSend", inp.data_ptr() + peer * block, block, BYTES, peer, comm.handle, comm.stream_handle)
            if me == src:
                assert inp is not None
                comm.local_copy(out, inp[me * block:(me + 1) * block])

        return comm.launch(issue, (output, input))

    def barrier(self) -> Work | NativeWork:
        """A one-byte all-reduce whose ``wait()`` blocks the CPU (with the group timeout)."""
        comm = self._comm
        device = comm.device if comm is not None else torch.device("cuda", torch.cuda.current_device())
        comm = self._communicator(device)
        with on_device(device):
            token = torch.zeros(1, dtype=torch.uint8, device=device)
        ptr = token.data_ptr()

        def issue() -> None:
            comm.call("ncclAllReduce", ptr, ptr, 1, BYTES, 0, comm.handle, comm.stream_handle)

        return comm.launch(issue, token, cpu_wait=True)

    # -- groups and teardown ---------------------------------------------------------------------------
    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        """ncclCommSplit when the sub-group keeps every rank of this one; else None (fresh unique id).

        ncclCommSplit is collective over the whole parent communicator, but spmd
        calls ``split`` on the sub-group's members only (at their first CUDA op
        on it), so a sub-group that leaves ranks out bootstraps its own
        communicator through its own store instead.
        """
        comm = self._comm
        if comm is None or comm.error is not None or not self.lib.has("ncclCommSplit"):
            return None
        if sorted(ranks) != list(range(self.size)):
            return None
        child = comm.split(0, ctx.rank, ctx.rank, ctx.size, ctx.group_name, ctx.timeout.total_seconds())
        return NcclBackend(ctx, communicator=child)

    def close(self) -> None:
        super().close()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()
