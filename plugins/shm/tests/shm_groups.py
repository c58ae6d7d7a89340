"""Helpers for the shm tests' worker functions: groups whose backends are built with other settings."""

from __future__ import annotations

import spmd
from spmd.comm.group import ProcessGroup


def group_with_slots(slot_bytes: int) -> ProcessGroup:
    """A new shm group of every rank whose slots hold ``slot_bytes`` (read when the backend is made)."""
    from spmd_shm import backend

    default, backend.SLOT_BYTES = backend.SLOT_BYTES, slot_bytes
    try:
        group = spmd.new_group(list(range(spmd.get_world_size())), backend="shm")
        spmd.barrier(group=group)  # every rank built its backend (with these slots) before the default comes back
    finally:
        backend.SLOT_BYTES = default
    return group
