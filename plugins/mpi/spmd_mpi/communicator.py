"""Creating the MPI communicator of one spmd group: a duplicate of the world, or one over the members.

The world group uses a duplicate of ``MPI_COMM_WORLD``; every other group
gets ``MPI_Comm_create_group`` over its members only. Creating one is
collective over the members and has no timeout, so a store rendezvous first
makes a missing member a timeout error instead of a hang; spmd ranks that are
not MPI's (a foreign launcher, an MPI singleton) are named before that.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from spmd.comm.backend import BackendContext
from spmd.comm.store_wait import missing_keys
from spmd.errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError
from spmd_mpi import probe
from spmd_mpi.library import library_version


def world_mismatch(mpi: Any, ctx: BackendContext) -> str | None:
    """Why ``ctx``'s group cannot be made of MPI_COMM_WORLD's ranks (a foreign launcher, a singleton), or None."""
    world = mpi.COMM_WORLD
    world_size, world_rank = world.Get_size(), world.Get_rank()
    ranks = tuple(ctx.global_ranks) or tuple(range(ctx.size))
    if (world_size == 1 and ctx.size > 1) or max(ranks) >= world_size or ranks[ctx.rank] != world_rank:
        return _world_error(ctx, world_size, world_rank, ranks)
    return None


def create_communicator(mpi: Any, ctx: BackendContext) -> Any:
    """The MPI communicator of ``ctx``'s group, its ranks in the group's order (collective over the members)."""
    mismatch = world_mismatch(mpi, ctx)
    if mismatch is not None:
        raise BackendUnavailableError(mismatch)
    world = mpi.COMM_WORLD
    world_size = world.Get_size()
    ranks = tuple(ctx.global_ranks) or tuple(range(ctx.size))
    rendezvous(ctx)
    if ranks == tuple(range(world_size)):
        comm = world.Dup()
    else:
        world_group = world.Get_group()
        members = world_group.Incl(list(ranks))
        try:
            comm = world.Create_group(members, zlib.crc32(ctx.group_name.encode()) & 0x7FFF)
        finally:
            members.Free()
            world_group.Free()
    if comm.Get_rank() != ctx.rank or comm.Get_size() != ctx.size:  # pragma: no cover - MPI bug
        raise CollectiveError(f"MPI built a communicator of {comm.Get_size()} for group {ctx.group_name!r}")
    return comm


def rendezvous(ctx: BackendContext) -> None:
    """Wait (with the group timeout) until every member is here: creating a communicator has no timeout."""
    if ctx.size == 1:
        return
    ctx.store.set(f"mpi-comm/{ctx.rank}", b"1")
    missing = missing_keys(ctx.store, [f"mpi-comm/{r}" for r in range(ctx.size)], ctx.timeout.total_seconds())
    if missing:
        raise CollectiveTimeoutError(
            f"creating the MPI communicator of group {ctx.group_name!r}: group ranks {missing} did "
            f"not arrive within {ctx.timeout.total_seconds():.1f} s; every member must "
            "use the group (its first collective creates the communicator)"
        )


def _world_error(ctx: BackendContext, world_size: int, world_rank: int, ranks: Sequence[int]) -> str:
    me = ranks[ctx.rank]
    where = f"group {ctx.group_name!r} (ranks {list(ranks)}, this rank {me})"
    if world_size == 1 and ctx.size > 1:
        announced = probe.launcher_world_size()
        if probe.launched_by_mpi() and announced and announced > 1:
            right, why = probe.find_mpiexec()
            fix = f"launch with {right} -n {announced} ..." if right else why
            return (
                f"{where}: this process was started by {probe.launcher_family()} as one of "
                f"{announced} ranks, but the MPI library that mpi4py loaded ({library_version()}) "
                f"sees a world of 1. The mpiexec does not belong to this MPI library, so every rank "
                f"became a separate one-rank job; {fix}"
            )
        return (
            f"{where} has {ctx.size} ranks, but this process is an MPI singleton (MPI_COMM_WORLD has "
            f"1 rank): MPI ranks must be started by MPI's launcher. Run `mpiexec -n {ctx.size} python "
            "script.py` (or srun --mpi=pmi2/pmix) and call spmd.init() without rank/world_size; "
            "under torchrun or `spmd run` use another backend, e.g. spmd.init('gloo')"
        )
    if max(ranks) >= world_size:
        return (
            f"{where} names ranks up to {max(ranks)} but MPI_COMM_WORLD has only {world_size}: start "
            f"as many MPI ranks as spmd ranks (mpiexec -n {max(ranks) + 1})"
        )
    return (
        f"{where}: spmd rank {me} is MPI rank {world_rank}. spmd's ranks must be MPI_COMM_WORLD's; "
        "under mpiexec call spmd.init() without rank=/world_size= so both come from the MPI launcher"
    )
