"""monitored_barrier: a barrier whose failure names the ranks that never arrived (torch's debugging aid).

It meets over the group's store, not the backend: a barrier made of
point-to-point messages would share the user's tag space and could hand its
token to a receive the program posted (or take the program's message), and on
Gloo a timed-out receive closes the group's connections. It does create the
group's CPU backend if none exists yet (under its timeout, naming a rank that
never comes), as torch's, which runs on Gloo: ranks that made a point-to-point
op their first on the group are waiting for every member to create it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from spmd.comm.state import resolve_group
from spmd.comm.store_wait import missing_keys
from spmd.comm.work import seconds
from spmd.errors import CollectiveTimeoutError

_RELEASED = "released"


def monitored_barrier(group: Any = None, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
    """Group rank 0 hears from every other rank within ``timeout`` (the group's by default), then releases them.

    If a rank does not arrive in time, every rank that did raises
    CollectiveTimeoutError naming it (every missing rank with
    ``wait_all_ranks``; the lowest one otherwise, as torch), and the group is
    left unusable: the missing ranks are out of step with the others.
    Each call uses its own store keys (calls are counted per group, in program order).
    """
    g = resolve_group(group)
    limit = g.timeout_s if timeout is None else seconds(timeout)
    assert limit is not None
    if g.unusable is not None:
        raise g.refusal()
    if g.backend_map is None or "cpu" in g.backend_map:
        g.backend("cpu", "monitored_barrier", limit)
    call = g.monitored_barriers
    g.monitored_barriers = call + 1
    prefix = f"monitored_barrier/{call}/"
    g.store.set(f"{prefix}{g.rank}", "arrived")
    if g.rank != 0:
        if missing_keys(g.store, [prefix + _RELEASED], limit):
            _fail(g, f"monitored_barrier on group {g.name!r}: rank {g.ranks[0]} (the group's rank 0, which releases it) did not "
                     f"release it within {limit:.1f} s; look at what that rank is doing (spmd trace analyze, py-spy dump)")
        verdict = g.store.get(prefix + _RELEASED).decode()
        if verdict:
            _fail(g, verdict)
        return
    others = [f"{prefix}{r}" for r in range(1, g.size)]
    missing = [g.ranks[1 + i] for i in missing_keys(g.store, others, limit)]
    if missing and not wait_all_ranks:
        missing = missing[:1]
    verdict = ""
    if missing:
        which = "ranks" if len(missing) > 1 else "rank"
        verdict = (f"monitored_barrier on group {g.name!r}: {which} {', '.join(map(str, missing))} did not reach it "
                   f"within {limit:.1f} s; look at what those ranks are doing (spmd trace analyze, py-spy dump)")
    g.store.set(prefix + _RELEASED, verdict)
    if verdict:
        _fail(g, verdict)


def _fail(g: Any, message: str) -> None:
    g.mark_unusable(message)
    raise CollectiveTimeoutError(message)
