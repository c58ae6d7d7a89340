"""Joining spmd and torch.distributed: the ``"spmd"`` c10d backend, torch's default group, and the reverse.

One rule, in ``spmd.init``: if torch.distributed is already initialised,
spmd joins its world (rank, world size and store) and leaves it alone;
otherwise, unless ``torch_interop=False`` or ``SPMD_TORCH_INTEROP=0``, it
initialises torch's default group with backend ``"spmd"`` on its own world.
``torch.distributed.new_group`` then creates spmd groups too, and
``torch.distributed.init_process_group("spmd")`` works as an entry point.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as tdist
from torch.distributed import distributed_c10d as c10d

from spmd import settings
from spmd.comm import state
from spmd.comm.group import ProcessGroup
from spmd.comm.init import check_backends, default_timeout, end_world, start_world
from spmd.interop.process_group import SpmdProcessGroup

#: The name torch.distributed knows spmd's backend by.
BACKEND_NAME = "spmd"

#: Set while spmd owns torch's default group (spmd.destroy_process_group tears it down too).
_owned = False
#: Set while spmd's world is the one torch.distributed.init_process_group("spmd") started.
_torch_started = False


def started_by_torch() -> bool:
    """True when torch.distributed.init_process_group("spmd") started spmd (spmd.init then returns that world)."""
    return _torch_started and state.is_initialized()


def interop_requested(torch_interop: bool | None) -> bool:
    """``torch_interop`` if given, else SPMD_TORCH_INTEROP (on unless "0", "false", "no" or "off"; spmd.settings)."""
    if torch_interop is not None:
        return torch_interop
    return settings.current().torch_interop


def register() -> None:
    """Register backend ``"spmd"`` with torch.distributed (once per process)."""
    if BACKEND_NAME.upper() in tdist.Backend._plugins:
        return
    tdist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def torch_world() -> tuple[int, int, tdist.Store] | None:
    """torch.distributed's rank, world size and store when it is initialised (spmd then joins it), else None."""
    if not tdist.is_initialized():
        return None
    store = c10d._get_default_store()
    return tdist.get_rank(), tdist.get_world_size(), tdist.PrefixStore("spmd/", store)


def attach(world: ProcessGroup, store: tdist.Store, timeout: timedelta) -> None:
    """Initialise torch.distributed's default group as backend ``"spmd"`` over ``world``."""
    global _owned
    register()
    tdist.init_process_group(
        BACKEND_NAME,
        store=tdist.PrefixStore("torch/", store),
        rank=world.rank,
        world_size=world.size,
        timeout=timeout,
    )
    _owned = True


def detach() -> None:
    """Destroy torch.distributed's default group if spmd created it."""
    global _owned, _torch_started
    _torch_started = False
    if _owned:
        _owned = False
        if tdist.is_initialized():
            tdist.destroy_process_group()


def _create(options: Any, pg_options: Any) -> SpmdProcessGroup:
    """c10d's creator for backend "spmd": the world group, or a spmd group for ``torch.distributed.new_group``."""
    ranks = list(options.global_ranks_in_group)
    rank, size = int(options.group_rank), int(options.group_size)
    global _torch_started
    timeout = options.timeout if isinstance(options.timeout, timedelta) else None
    if not state.is_initialized():
        # torch.distributed.init_process_group("spmd") came first: start spmd on torch's store.
        backend = pg_options if isinstance(pg_options, (str, dict)) else None
        if timeout is None or timeout == c10d.default_pg_timeout:  # torch's default, not the caller's: spmd's
            timeout = default_timeout()  # (SPMD_TIMEOUT, else 10 min)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is out of range for world size {size}: ranks are 0..{size - 1}")
        world = start_world(options.store, rank, size, timeout, check_backends(backend), on_end=detach)
        _torch_started = True
        return SpmdProcessGroup(world, end_world=end_world)  # torch's destroy_process_group ends this world too
    current = state.get_state()
    world = current.world
    if not tdist.is_initialized() and (not ranks or ranks == list(world.ranks)):
        if (rank, size) != (world.rank, world.size):
            raise ValueError(
                f"torch.distributed.init_process_group('spmd', rank={rank}, world_size={size}): spmd's world is already "
                f"running as rank {world.rank} of {world.size}; call spmd.destroy_process_group() first to start another"
            )
        return SpmdProcessGroup(world)  # torch's default group is spmd's world
    members = ranks or list(range(size))
    name = f"torch/{options.group_id}"
    group = ProcessGroup(
        name,
        members,
        world.ranks[world.rank],
        current.store,
        timeout if timeout is not None and timeout != c10d.default_pg_timeout else world.timeout,
        world.backend_map,
        world.options,
        parent=world,
    )
    current.groups[name] = group
    return SpmdProcessGroup(group)
