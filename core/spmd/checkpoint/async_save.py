"""``async_save``: copy to reused CPU staging buffers, return a future, write in a background thread.

The caller blocks only for the plan (one small exchange on a group of its
own) and the copy of the chunks this rank writes; the writing, the exchange
of outcomes and the commit run in one background thread over that private
group, so they never interleave with the training's collectives. The next
save (sync or async) and every load wait for the previous async save.

No save is lost silently: ``destroy_process_group`` waits for a pending save
(within the world's timeout) before it closes the groups the save exchanges
on, and raises if the save failed or did not finish; a process that exits
with a failed save nobody asked about exits with status 1.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from spmd.checkpoint import pending
from spmd.checkpoint.pending import SaveFuture
from spmd.checkpoint.pending import wait_pending as wait_pending
from spmd.checkpoint.planner import Box
from spmd.checkpoint.ranks import private_ranks
from spmd.checkpoint.save import execute, prepare
from spmd.checkpoint.stateful import expand_stateful
from spmd.checkpoint.storage import checkpoint_location


class Stager:
    """CPU staging buffers, one per chunk, kept and reused while the chunk's shape and dtype stay the same."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, Box], torch.Tensor] = {}

    def __call__(self, key: str, box: Box, local: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get((key, box))
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            pin = local.device.type != "cpu" and torch.cuda.is_available()
            buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            self.buffers[(key, box)] = buffer
        buffer.copy_(local, non_blocking=local.device.type != "cpu")
        return buffer

    def synchronize(self) -> None:
        """Wait for device-to-host copies issued with non_blocking."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


_executor: ThreadPoolExecutor | None = None
_stager = Stager()
_lock = threading.Lock()


def async_save(
    state_dict: Mapping[str, Any],
    checkpoint_id: str | os.PathLike | None = None,
    *,
    storage_writer: Any = None,
    process_group: Any = None,
) -> SaveFuture:
    """Start saving ``state_dict`` to ``checkpoint_id`` and return at once with a future.

    Blocks for the copy into CPU staging buffers (reused between saves, pinned
    for GPU tensors), so training may change the tensors as soon as it
    returns. It uses no collective of the caller's: its exchanges run on a
    private group over the same ranks. Every rank must call it. Stateful
    values and ``storage_writer=`` as in ``save``.

        future = spmd.checkpoint.async_save(state, checkpoint_id=f"ckpt/{step}")
        ...                                       # train on
        future.result()                           # raises if the save failed
    """
    global _executor
    with _lock:
        wait_pending()
        ranks = private_ranks(process_group)
        checkpoint_id = checkpoint_location(checkpoint_id, storage_writer, "async_save")
        job = prepare(expand_stateful(state_dict), checkpoint_id, ranks, stage=_stager)
        try:
            _stager.synchronize()
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spmd-async-save")
            future = SaveFuture(_executor.submit(execute, job, ranks), str(checkpoint_id))
        except BaseException:
            job.release()  # execute never runs: drop rank 0's claim on the id now
            raise
        pending.set_pending(future)
        return future
