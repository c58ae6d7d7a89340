"""ShmBackend: spmd's Backend contract over one host's shared memory (see ``spmd_shm.engine``)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from spmd.comm.backend import Backend, BackendContext
from spmd.comm.reduce_op import ReduceOp
from spmd.errors import BackendUnavailableError
from spmd_shm import all_to_all, collectives
from spmd_shm.engine import Engine
from spmd_shm.p2p import Recv
from spmd_shm.segment import Layout, check_same_host, open_segment
from spmd_shm.work import ShmWork

#: Bytes of one collective slot (each rank has two): the chunk large collectives move per round. 1 MiB,
#: half a core's L2 here: a chunk copied in is still in cache when it is reduced or read (16 MiB
#: all_reduce, 2 ranks: 1.9-2.2 ms with 1 MiB slots, 2.2-3.3 ms with 4 MiB; see the README).
SLOT_BYTES = int(os.environ.get("SPMD_SHM_SLOT_BYTES", str(1 << 20)))
#: Payload bytes of one point-to-point packet, and packets in flight per ordered pair of ranks.
PACKET_BYTES = int(os.environ.get("SPMD_SHM_PACKET_BYTES", str(256 << 10)))
PACKETS = int(os.environ.get("SPMD_SHM_PACKETS", "4"))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 view (the kernel hands over contiguous tensors)."""
    return (tensor if tensor.dim() == 1 else tensor.reshape(-1)).view(torch.uint8)


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row (one index along dim 0) of ``tensor``; a 0-d tensor is one row."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()


class ShmBackend(Backend):
    """Collectives and point-to-point between the ranks of one host, through a shared segment.

    Every op is queued to the group's progress thread and returns at once; the returned
    ``ShmWork`` completes when this rank's part is done.
    """

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        check_same_host(ctx)
        if all_to_all.region_bytes(SLOT_BYTES, ctx.size) < 1:
            raise BackendUnavailableError(
                f"SPMD_SHM_SLOT_BYTES={SLOT_BYTES} is too small for a group of {ctx.size} ranks (all_to_all_single "
                f"needs at least {all_to_all.table_bytes(ctx.size) + ctx.size} bytes); raise it (default {1 << 20})"
            )
        layout = Layout(ctx.size, SLOT_BYTES, PACKET_BYTES, PACKETS)
        self.engine = Engine(ctx, open_segment(ctx, layout))

    def _collective(self, steps_fn, *args) -> ShmWork:  # type: ignore[no-untyped-def]
        eng = self.engine
        work = eng.new_work()
        return eng.submit("coll", work, steps_fn(eng.rounds, work, *args))

    # -- point-to-point -----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> ShmWork:
        eng, data = self.engine, _bytes(tensor)
        if eng.send_now(data, dst, tag):
            return eng.completed
        work = eng.new_work()
        return eng.submit("send", work, (dst, eng.rings.send_steps(work, data, dst, tag)))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> ShmWork:
        eng = self.engine
        work = eng.new_work()
        return eng.submit("recv", work, Recv(work, _bytes(tensor), src, tag))

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> ShmWork:
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        eng = self.engine
        if collectives.is_small(eng.rounds, flat):
            done = eng.run_now(lambda: collectives.small_all_reduce(eng.rounds, flat, op, eng.inline_wait))
            if done is not None:
                return done
        return self._collective(collectives.all_reduce, flat, op)

    def broadcast(self, tensor: torch.Tensor, src: int) -> ShmWork:
        return self._collective(collectives.broadcast, tensor.view(-1), src)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> ShmWork:
        return self._collective(collectives.reduce, tensor.view(-1), dst, op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> ShmWork:
        return self._collective(collectives.all_gather, output.view(-1), input.view(-1))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> ShmWork:
        return self._collective(collectives.reduce_scatter, output.view(-1), input.view(-1), op)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int]
    ) -> ShmWork:
        out_row, in_row = _row_bytes(output), _row_bytes(input)
        return self._collective(
            all_to_all.all_to_all_single, _bytes(output), _bytes(input),
            [rows * out_row for rows in output_split_sizes], [rows * in_row for rows in input_split_sizes],
        )

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> ShmWork:
        return self._collective(collectives.gather, None if output is None else output.view(-1), input.view(-1), dst)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int) -> ShmWork:
        return self._collective(collectives.scatter, output.view(-1), None if input is None else input.view(-1), src)

    def barrier(self) -> ShmWork:
        return self._collective(collectives.barrier)

    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        return None  # a sub-group gets its own segment (made by the factory)

    # -- lifecycle --------------------------------------------------------------------------
    def abandon(self) -> None:
        self.engine.abandon()

    def close(self) -> None:
        self.engine.close()
        super().close()
