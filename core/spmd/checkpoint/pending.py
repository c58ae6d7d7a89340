"""The one ``async_save`` in flight: its future, and the wait that every save, load and teardown does first.

Below both ``save`` and ``async_save``: a save waits here for the previous
async save, ``destroy_process_group`` waits here (within the world's timeout)
before it closes the groups the save exchanges on, and a process that exits
with a failed save nobody asked about exits with status 1.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from spmd.checkpoint.metadata import CheckpointError, Metadata
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


_pending: SaveFuture | None = None


def set_pending(future: SaveFuture) -> None:
    """Make ``future`` the save in flight (the caller waited for the previous one first)."""
    global _pending
    _pending = future


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
