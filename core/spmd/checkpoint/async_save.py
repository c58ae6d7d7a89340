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

import atexit
import logging
import os
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from spmd.checkpoint.metadata import CheckpointError, Metadata
from spmd.checkpoint.planner import Box
from spmd.checkpoint.ranks import private_ranks
from spmd.checkpoint.save import execute, prepare
from spmd.checkpoint.stateful import expand_stateful
from spmd.checkpoint.storage import checkpoint_location
from spmd.comm.teardown import register_before_destroy


class SaveFuture:
    """The outcome of one ``async_save``: ``result(timeout)``/``wait(timeout)`` raise if the save failed."""

    def __init__(self, future: Future, checkpoint_id: str) -> None:
        self._future = future
        self.checkpoint_id = checkpoint_id
        #: Whether the caller asked for the outcome; a failure nobody asked for is raised by the next save or load.
        self.observed = False

    def result(self, timeout: float | None = None) -> Metadata | None:
        """Block until the save is committed (or failed, then raise); rank 0 gets the committed metadata."""
        self.observed = True
        return self._future.result(timeout)

    wait = result

    def done(self) -> bool:
        """Whether the save has finished, committed or failed."""
        return self._future.done()

    def unasked_error(self) -> BaseException | None:
        """The error of a finished save whose caller never asked for its outcome (result/exception), else None."""
        if self.observed or not self._future.done():
            return None
        return self._future.exception()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the save raised, or None."""
        self.observed = True
        return self._future.exception(timeout)


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
_pending: SaveFuture | None = None
_stager = Stager()
_lock = threading.Lock()


def wait_pending(timeout: float | None = None) -> None:
    """Wait for the previous async save to finish; if it failed and nobody asked its future, raise its error here.

    A training loop that calls ``async_save`` every N steps and never looks at
    the futures still learns of a failed save: at the next save or load, on
    every rank (a failed save fails on every rank), instead of at the restart
    that finds the checkpoint missing. ``timeout``: seconds to wait, then
    ``CheckpointError`` (the save goes on; it is reported as unfinished).
    """
    pending = _pending
    if pending is None:
        return
    try:
        pending._future.exception(timeout)  # wait for it, without counting as asked
    except FutureTimeout:
        pending.observed = True
        raise CheckpointError(
            f"the async_save to {pending.checkpoint_id!r} is still running after {timeout:.0f} s; tearing down the "
            "process group now would make it fail. Wait for its future (future.result()) before "
            "destroy_process_group, or raise the group's timeout (spmd.init(timeout=...), SPMD_TIMEOUT)"
        ) from None
    error = pending.unasked_error()
    if error is not None:
        pending.observed = True
        raise CheckpointError(f"the previous async_save to {pending.checkpoint_id!r} failed (its future was never "
                              f"asked): {error}") from error


def _finish_before_destroy(timeout_s: float) -> None:
    """``destroy_process_group``'s wait: the pending save finishes on the groups it uses, or a named error says why not."""
    wait_pending(timeout_s)


register_before_destroy(_finish_before_destroy)


@atexit.register
def _exit_non_zero_on_unobserved_failure() -> None:
    """At exit (the save thread has been joined by then), a failed async save nobody asked about: print it, exit 1.

    atexit cannot change the exit status otherwise; ``os._exit`` skips the
    handlers registered before this one (logging's is flushed here first).
    """
    pending = _pending
    error = pending.unasked_error() if pending is not None else None
    if pending is not None and error is not None:
        print(f"spmd.checkpoint: the last async_save to {pending.checkpoint_id!r} failed and its future was never "
              f"asked; exiting with status 1: {error}", file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


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
    global _executor, _pending
    with _lock:
        wait_pending()
        ranks = private_ranks(process_group)
        checkpoint_id = checkpoint_location(checkpoint_id, storage_writer, "async_save")
        job = prepare(expand_stateful(state_dict), checkpoint_id, ranks, stage=_stager)
        try:
            _stager.synchronize()
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spmd-async-save")
            _pending = SaveFuture(_executor.submit(execute, job, ranks), str(checkpoint_id))
        except BaseException:
            job.release()  # execute never runs: drop rank 0's claim on the id now
            raise
        return _pending
