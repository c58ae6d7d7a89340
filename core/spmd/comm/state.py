"""The process-wide state: the world group and every group created since init."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as tdist

from spmd.comm.group import ProcessGroup
from spmd.errors import NotInitializedError


@dataclass
class WorldState:
    world: ProcessGroup
    store: tdist.Store
    groups: dict[str, ProcessGroup] = field(default_factory=dict)
    #: new_group calls so far (every rank makes each one, member or not, so all agree on it).
    groups_created: int = 0
    #: new_group(use_local_synchronization=True) counts per member set: only members call it.
    local_groups_created: dict[tuple[int, ...], int] = field(default_factory=dict)
    #: split_group calls so far per parent group uid (every rank of the parent makes each one).
    splits_created: dict[str, int] = field(default_factory=dict)
    #: (scope, name) -> groups given that name so far, counted on every rank that made the call (see init.agreed_name).
    names_used: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Run by the world's teardown after the last checks and before the groups close (the layer
    #: above that started the world undoes what it tied to it: torch's default group).
    on_end: Callable[[], None] | None = None


_state: WorldState | None = None


def get_state() -> WorldState:
    if _state is None:
        raise NotInitializedError(
            "spmd is not initialised: call spmd.init() (or spmd.init_process_group) first, "
            "e.g. under `spmd run --nproc-per-node 2 script.py`"
        )
    return _state


def set_state(state: WorldState | None) -> None:
    global _state
    _state = state


def is_initialized() -> bool:
    """True between ``spmd.init`` and ``destroy_process_group``."""
    return _state is not None


def member_groups() -> list[ProcessGroup]:
    """The current world's groups this rank belongs to, the world first (none before init or after destroy):
    what the watchdog watches (``spmd.comm.health.watchdog`` is handed this function)."""
    current = _state
    if current is None:
        return []
    groups = {id(g): g for g in [current.world, *current.groups.values()]}  # (the world is in both)
    return list(groups.values())


def world_view() -> tuple[int, int, dict[str, list[int]]] | None:
    """(this rank, the world size, every group's ranks by name) for a flight-recorder dump, or None before init."""
    current = _state
    if current is None:
        return None
    return current.world.rank, current.world.size, {name: list(g.ranks) for name, g in current.groups.items()}


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group`` itself, or the world group when None; a non-member's group is an error."""
    state = _state if _state is not None else get_state()  # get_state() raises the not-initialised error
    if group is None:
        return state.world
    if group is NON_GROUP_MEMBER:
        raise ValueError(
            "this rank is not a member of the group it passed: new_group() returns "
            "spmd.GroupMember.NON_GROUP_MEMBER on ranks outside the group; call collectives "
            "on that group only from its members"
        )
    if not isinstance(group, ProcessGroup):
        inner = getattr(group, "spmd_group", None)  # a torch.distributed group of backend "spmd"
        if isinstance(inner, ProcessGroup):
            return inner
        raise TypeError(
            f"group must be a spmd ProcessGroup, a torch.distributed group of backend 'spmd', or None; "
            f"got {type(group).__name__}"
        )
    return group


class _NonGroupMember:
    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()


class GroupMember:
    """torch.distributed's ``GroupMember``: ``WORLD`` is None (the default group)."""

    WORLD = None
    NON_GROUP_MEMBER = NON_GROUP_MEMBER
