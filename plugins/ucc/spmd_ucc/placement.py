"""Which peers share this process's network namespace, and the UCX setting for ranks that do not.

UCX takes two processes with the same boot id for one node and moves data
between them through shared memory and CMA. Processes in different network
namespaces of one kernel (containers, the ``spmd_hosts`` test bed) pass that
test, but the shared-memory transports wake a waiting peer through a socket
that does not cross namespaces: every wait then ends only at the engine's
50 ms poll limit (26 ms per small all-reduce measured, against 1 ms over TCP).
So when a group spans network namespaces, spmd-ucc leaves those transports out.
"""

from __future__ import annotations

import os

#: The UCX transports that treat "same boot id" as "same host" (UCX's ``sm`` alias: posix, sysv, cma, knem, xpmem).
SHARED_MEMORY_OFF = "^sm"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def host_identity() -> str:
    """This process's "host" for UCX: the kernel's boot id and the network namespace it runs in."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "?"
    return f"{_read('/proc/sys/kernel/random/boot_id')}/{netns}"


def spans_namespaces(mine: str, theirs: list[str]) -> bool:
    """Whether a peer runs on this kernel (same boot id) but in another network namespace."""
    boot = mine.partition("/")[0]
    return any(other.partition("/")[0] == boot and other != mine for other in theirs)
