"""spmd-shm: collectives between the ranks of one host through shared memory (pure Python + torch)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import spmd

#: Above spmd-gloo's 10 (below spmd-mpi's 20 under mpiexec): ``spmd.init()`` picks shm for every CPU group whose ranks share one host
#: (``one_host``: a group across hosts gets the next usable backend, Gloo).
PRIORITY = 15


def _available() -> str | None:
    if sys.platform == "win32":
        return "shared-memory segments need a POSIX system (Linux or macOS)"
    if os.path.isdir("/dev/shm") and not os.access("/dev/shm", os.W_OK):
        return "/dev/shm is not writable by this user"
    return None


def _factory(ctx: spmd.BackendContext) -> spmd.Backend:
    from spmd_shm.backend import ShmBackend

    return ShmBackend(ctx)


@spmd.hookimpl
def spmd_backends() -> Iterable[spmd.BackendSpec]:
    return [
        spmd.BackendSpec(
            name="shm",
            devices=("cpu",),
            factory=_factory,
            priority=PRIORITY,
            one_host=True,
            available=_available,
            backend_class="spmd_shm.backend:ShmBackend",
            description="shared memory between the ranks of one host (futex wake-ups, no network)",
        )
    ]
