"""Work that must finish before ``destroy_process_group`` closes the groups, registered by the layers above comm.

comm knows nothing of checkpoints; ``spmd.checkpoint`` registers a callback
here that waits for a pending ``async_save`` (whose exchanges run on a group
that the teardown would close under it). Callbacks run in registration order,
each one bounded by the caller; the first error is raised once the groups are
torn down anyway, so a failed callback never leaves the process initialised.
"""

from __future__ import annotations

from collections.abc import Callable

#: ``callback(timeout_s)``: finish (or fail, raising a named error) within ``timeout_s`` seconds.
BeforeDestroy = Callable[[float], None]

_callbacks: list[BeforeDestroy] = []


def register_before_destroy(callback: BeforeDestroy) -> None:
    """Run ``callback(timeout_s)`` at the start of every ``destroy_process_group()`` of the world (once per registration)."""
    if callback not in _callbacks:
        _callbacks.append(callback)


def unregister_before_destroy(callback: BeforeDestroy) -> None:
    """Stop running ``callback`` at teardown."""
    if callback in _callbacks:
        _callbacks.remove(callback)


def run_before_destroy(timeout_s: float) -> BaseException | None:
    """Run every callback; the first error one raised (the rest still run), or None."""
    first: BaseException | None = None
    for callback in list(_callbacks):
        try:
            callback(timeout_s)
        except Exception as error:  # noqa: BLE001 - raised by destroy_process_group after the teardown
            first = first if first is not None else error
    return first
