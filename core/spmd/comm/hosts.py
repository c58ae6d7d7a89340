"""Which host each rank runs on: asked of the ranks through the job's store, never guessed from LOCAL_WORLD_SIZE.

Every rank publishes its host identity once, when its world starts (one store
``set``). A choice that depends on where a group's ranks run (``spmd.init()``
picking a one-host backend such as spmd-shm, see ``BackendSpec.one_host``)
reads its ranks' identities then, once per process and rank: the world group's
first such choice fills the cache for every subgroup.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from spmd.comm.store_wait import missing_keys
from spmd.errors import CollectiveTimeoutError

_KEY = "spmd/hosts/{rank}"

#: Global rank -> its host identity, as read from the current world's store.
_known: dict[int, str] = {}


def host_identity() -> str:
    """This host (host name and boot id) and PID namespace: processes with equal identities share
    /dev/shm, memory and process ids (a container with its own PID namespace counts as another host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = "no-pidns"
    return f"{socket.gethostname()}|{boot}|{pidns}"


def publish(store: Any, rank: int) -> None:
    """Tell the world where global rank ``rank`` (this process) runs; forget the previous world's answers."""
    _known.clear()
    _known[rank] = host_identity()
    store.set(_KEY.format(rank=rank), _known[rank])


def identities(store: Any, ranks: Sequence[int], timeout_s: float) -> list[str]:
    """The host identity of each global rank of ``ranks``, waiting (up to ``timeout_s``) for those not yet published."""
    unknown = [r for r in dict.fromkeys(ranks) if r not in _known]
    if unknown:
        keys = [_KEY.format(rank=r) for r in unknown]
        missing = missing_keys(store, keys, timeout_s)
        if missing:
            raise CollectiveTimeoutError(
                f"ranks {[unknown[i] for i in missing]} did not say which host they run on within {timeout_s:.1f} s "
                "(each rank does so in spmd.init): they never started, or are stuck before init; check their logs"
            )
        for rank, value in zip(unknown, store.multi_get(keys)):
            _known[rank] = bytes(value).decode()
    return [_known[r] for r in ranks]


def spans_hosts(store: Any, ranks: Sequence[int], timeout_s: float) -> bool:
    """Whether the global ranks ``ranks`` run on more than one host (see ``host_identity``)."""
    return len(ranks) > 1 and len(set(identities(store, ranks, timeout_s))) > 1


def describe(idents: Sequence[str], ranks: Sequence[int]) -> str:
    """Which of ``ranks`` run where, for an error message: ``ranks [0, 1] on node-a; ranks [2] on node-b``."""
    by_host: dict[str, list[int]] = {}
    for rank, ident in zip(ranks, idents):
        name, _, rest = ident.partition("|")
        by_host.setdefault(f"{name} ({rest.rpartition('|')[2]})", []).append(rank)
    return "; ".join(f"ranks {members} on {host}" for host, members in by_host.items())
