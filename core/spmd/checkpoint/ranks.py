"""The ranks that take part in a save: a process group, or this process alone when spmd is not initialised."""

from __future__ import annotations

import threading
from typing import Any

from spmd.comm.state import is_initialized


class Ranks:
    """This rank's index among the savers, their count, and one exchange of small Python objects."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        if group is None and not is_initialized():
            self.rank, self.size = 0, 1
        else:
            from spmd.comm.init import get_rank, get_world_size

            self.rank, self.size = get_rank(group), get_world_size(group)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (the only collective a save uses)."""
        if self.size == 1:
            return [obj]
        from spmd.comm.objects import all_gather_object

        out: list[Any] = [None] * self.size
        all_gather_object(out, obj, group=self.group)
        return out


_private: dict[tuple[int, ...], Any] = {}
_lock = threading.Lock()


def private_ranks(group: Any = None) -> Ranks:
    """Ranks over a group of the same members that only checkpointing uses (created once, collectively).

    ``async_save`` finishes in a background thread; exchanging over the
    caller's group there would interleave with the training's collectives.
    """
    if group is None and not is_initialized():
        return Ranks(None)
    from spmd.comm.init import get_process_group_ranks, new_group
    from spmd.comm.state import resolve_group

    members = tuple(get_process_group_ranks(group))
    key = (id(resolve_group(None)), *members)  # a new world (after destroy + init) gets a new group
    with _lock:
        private = _private.get(key)
        if private is None:
            private = _private[key] = new_group(
                list(members), use_local_synchronization=True, group_desc="checkpoint", sort_ranks=False
            )
    return Ranks(private)
