"""Contiguous stand-ins for non-contiguous tensors and the follow-up steps that undo them.

Staged copies come from one process-wide pool of reused buffers (fresh large
buffers cost page faults on every call); the fast path stages nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spmd.comm.backend import Backend
from spmd.comm.buffers import BufferPool
from spmd.comm.reduce_op import ReduceOp, divide

pool = BufferPool()
AVG = ReduceOp.AVG  # a module constant: reading an Enum member off its class costs ~100 ns
#: dtypes whose AVG the kernel divides before the sum, on every backend (as NCCL's ncclAvg does):
#: a float16 sum of n ranks' values overflows to inf where their mean fits.
PREDIVIDED = frozenset({torch.float16, *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                                         if hasattr(torch, name))})


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
    """The step that turns a SUM the backend made of an AVG into the mean."""
    return lambda: divide(tensor, size)


def native_op(backend: Backend, op: ReduceOp, dtype: torch.dtype) -> ReduceOp:
    """The op the backend gets: AVG becomes SUM where the kernel divides, before the transfer for
    ``PREDIVIDED`` dtypes (see ``predivided``), after it for backends that cannot average."""
    if op is AVG and (dtype in PREDIVIDED or not backend.supports_avg):
        return ReduceOp.SUM
    return op


def predivided(op: ReduceOp, native: ReduceOp, dtype: torch.dtype) -> bool:
    """Whether the kernel divides this AVG's inputs by the group size before the SUM (not the result after)."""
    return native is not op and dtype in PREDIVIDED


def unpack_blocks(items: Sequence[torch.Tensor], packed: torch.Tensor, blocks: int) -> None:
    """Copy equal blocks of a flat buffer back into the caller's list of tensors."""
    if packed.numel():
        for item, block in zip(items, packed.chunk(blocks)):
            item.copy_(block.view(item.shape))
