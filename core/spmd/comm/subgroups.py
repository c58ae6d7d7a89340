"""torch's subgroup helpers: equal-size subgroups of a group, or subgroups listed rank by rank."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from spmd.comm import state
from spmd.comm.init import new_group


def new_subgroups(
    group_size: int | None = None,
    group: Any = None,
    timeout: timedelta | float | None = None,
    backend: str | Mapping[str, str] | None = None,
    pg_options: Mapping[str, Any] | None = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Cut ``group`` (the world by default) into consecutive subgroups of ``group_size`` ranks.

    Every rank of the world calls it. Returns this rank's subgroup and the list
    of all of them (NON_GROUP_MEMBER where this rank is not in one), as torch
    does. ``group_size`` defaults to the ranks of this node (LOCAL_WORLD_SIZE).
    """
    parent = state.resolve_group(group)
    if group_size is None:
        group_size = int(os.environ.get("LOCAL_WORLD_SIZE", parent.size))
    if group_size <= 0 or parent.size % group_size:
        raise ValueError(
            f"new_subgroups: group_size {group_size} must be positive and divide the group's {parent.size} ranks"
        )
    ranks = list(parent.ranks)
    chunks = [ranks[i : i + group_size] for i in range(0, len(ranks), group_size)]
    return new_subgroups_by_enumeration(chunks, timeout, backend, pg_options, group_desc)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: timedelta | float | None = None,
    backend: str | Mapping[str, str] | None = None,
    pg_options: Mapping[str, Any] | None = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """One subgroup per list of world ranks; every rank calls it, and each rank may be in at most one list.

    Returns this rank's subgroup (None if it is in no list, as in torch) and
    all subgroups in list order.
    """
    seen: dict[int, int] = {}
    for index, ranks in enumerate(ranks_per_subgroup_list):
        for r in ranks:
            if r in seen:
                raise ValueError(
                    f"new_subgroups_by_enumeration: rank {r} is in list {seen[r]} and list {index}; "
                    "each rank may belong to one subgroup"
                )
            seen[r] = index
    me = state.get_state().world.rank
    subgroups, mine = [], None
    for index, ranks in enumerate(ranks_per_subgroup_list):
        desc = f"{group_desc}.{index}" if group_desc else None
        subgroup = new_group(list(ranks), timeout=timeout, backend=backend, pg_options=pg_options, group_desc=desc)
        subgroups.append(subgroup)
        if seen.get(me) == index:
            mine = subgroup
    return mine, subgroups
