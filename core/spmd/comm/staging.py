"""Contiguous stand-ins for non-contiguous tensors and the follow-up steps that undo them.

Staged copies come from one process-wide pool of reused buffers (fresh large
buffers cost page faults on every call); the fast path stages nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spmd.comm.backend import Backend
from spmd.comm.buffers import BufferPool
from spmd.comm.reduce_op import ReduceOp

pool = BufferPool()
AVG = ReduceOp.AVG  # a module constant: reading an Enum member off its class costs ~100 ns


class Contiguous:
    """A contiguous stand-in for a tensor: the tensor itself, or a pooled copy written back later."""

    def __init__(self, tensor: torch.Tensor, copy_in: bool = True, force: bool = False) -> None:
        self.original = tensor
        self._buffer: torch.Tensor | None = None
        if tensor.is_contiguous() and not force:
            self.tensor = tensor
        else:
            self._buffer = pool.acquire(tensor.numel(), tensor.dtype, tensor.device)
            self.tensor = self._buffer[: tensor.numel()].view(tensor.shape)
            if copy_in:
                self.tensor.copy_(tensor)

    @property
    def staged(self) -> bool:
        return self._buffer is not None

    def write_back(self) -> None:
        if self._buffer is not None:
            self.original.copy_(self.tensor)

    def release(self) -> None:
        if self._buffer is not None:
            pool.release(self._buffer)
            self._buffer = None


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges share bytes (an output laid over its input, torch's
    in-place ``all_gather_into_tensor(out, out[own block])``); exact for contiguous tensors,
    conservative otherwise. Such an input is staged: no backend sees aliased buffers."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes and a.nbytes > 0 and b.nbytes > 0


def sequence(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    """One callable running the given steps in order; None when there is nothing to do."""
    todo = [step for step in steps if step is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run


def staging_steps(*staged: Contiguous, write_back: tuple[Contiguous, ...] = ()) -> list[Callable[[], None]]:
    """Write-back and release steps for the staged stand-ins only (none on the fast path)."""
    steps: list[Callable[[], None]] = [s.write_back for s in write_back if s.staged]
    steps += [s.release for s in staged if s.staged]
    return steps


def average(tensor: torch.Tensor, size: int) -> Callable[[], None]:
    def divide() -> None:
        tensor.div_(size)

    return divide


def native_op(backend: Backend, op: ReduceOp) -> ReduceOp:
    """AVG becomes SUM for backends that cannot average (the kernel divides afterwards)."""
    if op is AVG and not backend.supports_avg:
        return ReduceOp.SUM
    return op


def unpack_blocks(items: Sequence[torch.Tensor], packed: torch.Tensor, blocks: int) -> None:
    """Copy equal blocks of a flat buffer back into the caller's list of tensors."""
    if packed.numel():
        for item, block in zip(items, packed.chunk(blocks)):
            item.copy_(block.view(item.shape))
