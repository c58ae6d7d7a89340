"""monitored_barrier: a barrier whose failure names the ranks that never arrived (torch's debugging aid)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from spmd.comm import p2p
from spmd.comm.state import resolve_group
from spmd.comm.work import seconds
from spmd.errors import CollectiveTimeoutError


def monitored_barrier(group: Any = None, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
    """Group rank 0 hears from every other rank within ``timeout`` (the group's by default), then releases them.

    If a rank does not arrive in time, rank 0 raises CollectiveTimeoutError
    naming it (every missing rank with ``wait_all_ranks``); the others then
    fail their own wait for the release at the group timeout. As with torch's,
    a failed monitored barrier is for diagnosing a dying job: Gloo closes the
    connection a timed-out receive was on, so the group is not usable after it.
    """
    g = resolve_group(group)
    limit = g.timeout_s if timeout is None else seconds(timeout)
    assert limit is not None
    token = torch.zeros(1)
    if g.rank != 0:
        p2p.send(token, group=g, group_dst=0)
        p2p.recv(token, group=g, group_src=0)
        return
    arrivals = [(r, p2p.irecv(torch.zeros(1), group=g, group_src=r)) for r in range(1, g.size)]
    deadline = time.monotonic() + limit
    missing: list[int] = []
    for r, work in arrivals:
        try:
            work.wait(max(deadline - time.monotonic(), 0.0))
        except CollectiveTimeoutError:
            missing.append(g.ranks[r])
            if not wait_all_ranks:
                break
    if missing:
        which = "ranks" if len(missing) > 1 else "rank"
        raise CollectiveTimeoutError(
            f"monitored_barrier on group {g.name!r}: {which} {', '.join(map(str, missing))} did not reach it "
            f"within {limit:.1f} s; look at what those ranks are doing (spmd trace analyze, py-spy dump)"
        )
    for r in range(1, g.size):
        p2p.send(token, group=g, group_dst=r)
