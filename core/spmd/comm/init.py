"""The world group as comm owns it (start, teardown), groups, and the queries, with torch.distributed's semantics.

How a user joins the world (launcher detection, torch's default group) is ``spmd.world``, above comm."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from spmd import settings
from spmd.comm import hosts, state, teardown
from spmd.comm.group import ProcessGroup, forget_group_names
from spmd.comm.health.watchdog import world_baseline
from spmd.comm.registry import backends, parse_backend_string
from spmd.comm.store_join import await_arrivals, check_resolvable, client_store, host_store
from spmd.comm.tcp_store import job_scope
from spmd.debug.recorder import recorder
from spmd.errors import BackendUnavailableError, CollectiveDesyncError, SpmdError

log = logging.getLogger("spmd")

#: Seconds ``destroy_process_group`` waits for the neighbours' last calls to compare them with this rank's.
FINAL_CHECK_S = 3.0
#: Default for every blocking call; override with init(timeout=...) or SPMD_TIMEOUT (seconds).
DEFAULT_TIMEOUT = timedelta(minutes=10)


def default_timeout() -> timedelta:
    """The world's timeout when none is given: ``SPMD_TIMEOUT`` seconds, else 10 minutes."""
    value = settings.current().timeout
    return timedelta(seconds=value) if value is not None else DEFAULT_TIMEOUT


def _agent_store(endpoint: str, timeout: timedelta) -> tdist.Store:
    """A client of the store ``spmd run``'s agents host, under this round's prefix.

    As with torchrun's agent store, the job's store then lives in the agent,
    not in rank 0: when rank 0 dies the others can still read who reached what.
    """
    host, _, port = endpoint.rpartition(":")
    try:
        client = tdist.TCPStore(host, int(port), None, False, timeout=timeout)
    except Exception as error:  # noqa: BLE001 - re-raised with what to check
        raise SpmdError(
            f"could not reach the spmd run agent's store at {endpoint} (SPMD_AGENT_STORE) within "
            f"{timeout.total_seconds():.0f} s ({error}); is the agent still running?"
        ) from error
    return tdist.PrefixStore(settings.current().store_prefix, job_scope(client))


def make_store(
    init_method: str | None, rank: int, world_size: int, addr: str, port: int, timeout: timedelta
) -> tuple[tdist.Store, str | None]:
    """The job's store, and who hosts it, as errors name it when it is gone (None: not known)."""
    agent = settings.current().agent_store
    if agent and init_method in (None, "env://"):
        return _agent_store(agent, timeout), f"the `spmd run` agent's process ({agent})"
    if init_method and init_method.startswith("file://"):
        path = urllib.parse.urlparse(init_method).path
        return tdist.FileStore(path, world_size), None
    if world_size == 1 and port == 0:
        return tdist.HashStore(), None
    # Under torchrun the agent already hosts the store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE),
    # as torch's own env:// knows: every rank joins it as a client instead of rank 0 failing to bind,
    # under one key prefix per restart attempt (the agent's store outlives restarts).
    torchrun_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host = rank == 0 and not torchrun_store
    try:
        if host:
            store = host_store(addr, port, timeout)
        else:
            check_resolvable(addr, port, timeout)
            store = client_store(addr, port, world_size, timeout)
        if torchrun_store:
            attempt = tdist.PrefixStore(f"spmd/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
            return attempt, f"torchrun's agent ({addr}:{port})"
        # SPMD_RDZV_TOKEN: the job's keys under the token's namespace
        return job_scope(store), "this process (rank 0)" if host else f"rank 0's process ({addr}:{port})"
    except SpmdError:
        raise  # already says what went wrong
    except Exception as error:  # noqa: BLE001 - re-raised with what to check
        role = "host" if host else "reach"
        raise SpmdError(
            f"rank {rank} could not {role} the rendezvous store at {addr}:{port} within "
            f"{timeout.total_seconds():.0f} s ({error}). Check MASTER_ADDR/MASTER_PORT, that the "
            f"port is free on the master, and that all {world_size} ranks were started"
        ) from error


def check_backends(backend: str | Mapping[str, str] | None) -> dict[str, str] | None:
    """The per-device backend map ``backend`` asks for; an unknown name, or a bare name unusable here, fails now."""
    backend_map = parse_backend_string(backend)
    if backend_map is not None:
        for name in set(backend_map.values()):
            entry = backends().get(name)  # unknown names fail now
            # A bare name ("nccl") asks for that backend alone: unusable is an error now. A
            # per-device map ("cpu:gloo,cuda:nccl") checks each device's backend on first use,
            # so it also runs on a machine without that device.
            reason = entry.spec.unavailable_reason() if isinstance(backend, str) and ":" not in backend else None
            if reason is not None:
                raise BackendUnavailableError(f"backend {name!r} (plugin {entry.plugin!r}) cannot run here: {reason}")
    return backend_map


def start_world(
    store: tdist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    backend_map: dict[str, str] | None,
    *,
    group_name: str = "world",
    pg_options: Mapping[str, Any] | None = None,
    trace_dir: str | os.PathLike | None = None,
    store_host: str | None = None,
    await_all: bool = False,
    on_end: Callable[[], None] | None = None,
) -> ProcessGroup:
    """Create the world group on ``store`` (shared by every rank), start its watchdog, and close it at exit.

    ``await_all``: first wait for every rank to arrive on the store (names a rank
    that never came). ``store_host``: who hosts the store, as errors name it.
    ``on_end`` runs at the world's teardown, before the groups close.
    """
    baseline = world_baseline(store)  # before the arrivals: what the store numbers later is this world's
    if await_all and world_size > 1:
        await_arrivals(store, rank, world_size, timeout)  # names a rank that never came, on every rank
    forget_group_names()  # a new world numbers its groups' reused names afresh, as every rank does
    if world_size > 1:
        hosts.publish(store, rank)  # (read when a choice depends on where a group's ranks run)
    world = ProcessGroup(group_name, range(world_size), rank, store, timeout, backend_map, pg_options)
    state.set_state(state.WorldState(world=world, store=store, groups={group_name: world}, on_end=on_end))
    atexit.register(_close_at_exit)
    _start_debugging(store, rank, trace_dir, store_host, baseline)
    return world


def _start_debugging(store: tdist.Store, rank: int, trace_dir: str | os.PathLike | None, store_host: str | None,
                     baseline: tuple[int, int]) -> None:
    """The watchdog thread (``baseline``: see ``watchdog.world_baseline``), the trace directory, and SIGUSR1 as an on-demand dump."""
    from spmd.comm.health import desync, watchdog
    from spmd.debug import dump

    desync.refresh()
    if trace_dir is not None:
        os.environ["SPMD_TRACE_DIR"] = str(trace_dir)
        settings.refresh()
    recorder.world_view = state.world_view  # (what a dump says of the world: debug/ sits below comm and reads no state)
    watchdog.start(store, rank, state.member_groups, store_host, baseline)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGUSR1, lambda signum, frame: dump("SIGUSR1"))


def _close_at_exit() -> None:
    """Close backends before the interpreter tears down (native threads abort otherwise).

    A teardown that fails with a named error (the last desync check, a pending
    ``async_save`` that failed) would only be printed as ignored in an atexit
    callback, with exit status 0: it is printed and the process exits with 1.
    """
    if state.is_initialized():
        try:
            end_world()
        except SpmdError as error:
            print(f"spmd: the teardown at exit failed, exiting with status 1: {type(error).__name__}: {error}",
                  file=sys.stderr)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def end_world() -> None:
    """Tear down every group and the world; a new world may start afterwards.

    Registered work finishes on the groups first (``teardown``: a pending
    ``async_save`` is waited for, within the world's timeout); if that work
    failed, its error is raised after the teardown.
    """
    from spmd.comm.health import watchdog

    current = state.get_state()
    unfinished = teardown.run_before_destroy(current.world.timeout_s)
    dog = watchdog.current()
    # the mismatch check looks once more: calls made since its last step would otherwise go unchecked
    disagreement = dog.final_check(FINAL_CHECK_S) if dog is not None else None
    if current.on_end is not None:
        current.on_end()
    watchdog.stop()
    for g in list(current.groups.values()):
        g.close()
    state.set_state(None)
    if disagreement is not None:
        raise CollectiveDesyncError(f"destroy_process_group: {disagreement}") from unfinished
    if unfinished is not None:
        raise unfinished


def close_group(group: ProcessGroup) -> None:
    """Tear down one group that is not the world."""
    group.close()
    state.get_state().groups.pop(group.name, None)


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the world by default)."""
    return state.resolve_group(group).rank


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node (LOCAL_RANK, set by ``spmd run`` and torchrun), else ``fallback_rank``."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not set: launch with `spmd run` (or torchrun), or pass fallback_rank= for a single-process run"
    )


def is_available() -> bool:
    """Always True: spmd's kernel has no build-time switch (torch.distributed's ``is_available``)."""
    return True


def is_backend_available(backend: str) -> bool:
    """Whether a backend called ``backend`` is installed and its native library usable here."""
    registry = backends()
    return backend in registry.names() and registry.get(backend).spec.unavailable_reason() is None


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (the world by default)."""
    return state.resolve_group(group).size


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The world rank of ``group_rank`` in ``group``."""
    return state.resolve_group(group).global_rank(group_rank)


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """The rank inside ``group`` of world rank ``global_rank``."""
    return state.resolve_group(group).group_rank(global_rank)


def get_process_group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """The world ranks of ``group``, in group order."""
    return list(state.resolve_group(group).ranks)


def get_backend(group: ProcessGroup | None = None, device: str = "cpu") -> str:
    """The name of the backend ``group`` uses for tensors on ``device``."""
    return state.resolve_group(group).backend_name(device)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | float | None = None,
    backend: str | Mapping[str, str] | None = None,
    pg_options: Mapping[str, Any] | None = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
    sort_ranks: bool = True,
) -> Any:
    """A group of the given world ranks (all ranks if None), with torch's parameters.

    Every rank must call it, in the same order, unless
    ``use_local_synchronization``: then only the members call it (its name
    comes from the ranks, not from a world-wide count). Ranks outside the group
    get ``GroupMember.NON_GROUP_MEMBER``. Group ranks follow ``ranks`` sorted,
    or as given with ``sort_ranks=False``. ``device_id`` creates that device's
    backend now instead of on first use. Like torch, creation is collective by
    call order: ranks that create groups in different orders get mismatched
    groups and hang (then time out).
    """
    current = state.get_state()
    world = current.world
    given = list(range(world.size) if ranks is None else ranks)
    if len(set(given)) != len(given):
        raise ValueError(f"new_group: ranks {given} name a rank twice; list each rank once")
    members = sorted(given) if sort_ranks else given
    for r in members:
        if not 0 <= r < world.size:
            raise ValueError(f"new_group: rank {r} is out of range for world size {world.size}")
    if use_local_synchronization:
        if world.rank not in members:
            return state.NON_GROUP_MEMBER  # non-members need not call at all
        count = current.local_groups_created.get(tuple(members), 0) + 1
        current.local_groups_created[tuple(members)] = count
        # the members in the name: groups of other member sets, created apart, never share a name (or store keys)
        name = f"{group_desc or 'local'}[{','.join(map(str, members))}]"
        name = name if count == 1 else f"{name}#{count}"
    else:
        current.groups_created += 1
        name = agreed_name(current, "", group_desc or f"group{current.groups_created}", current.groups_created)
        if world.rank not in members:
            return state.NON_GROUP_MEMBER
    backend_map = parse_backend_string(backend) if backend is not None else world.backend_map
    group = ProcessGroup(
        name,
        members,
        world.ranks[world.rank],
        current.store,
        as_timedelta(timeout) or world.timeout,
        backend_map,
        pg_options or world.options,
        parent=world,
    )
    current.groups[name] = group
    if device_id is not None:
        group.backend(torch.device(device_id).type)
    return group


def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: timedelta | float | None = None,
    pg_options: Mapping[str, Any] | None = None,
    group_desc: str | None = None,
    backend: str | Mapping[str, str] | None = None,
    *,
    color: int | None = None,
    key: int | None = None,
) -> Any:
    """Split ``parent_pg`` (the world if None) into disjoint groups; every rank of it calls this.

    torch's form: ``split_ranks`` lists the new groups as lists of parent-group
    ranks (``[[0, 1], [2, 3]]``); a rank in none of them gets None, as in torch.
    MPI_Comm_split's form: ``color=`` puts the ranks of one colour in one group,
    ordered by ``key`` (ties by parent rank); a negative colour gets
    NON_GROUP_MEMBER. ``backend`` keeps a subset of the parent's backends.
    Each new group is named ``<group_desc or parent.splitN>.c<colour>``, the same on all its ranks.
    """
    from spmd.comm.objects import all_gather_object

    parent = state.resolve_group(parent_pg)
    if (split_ranks is None) == (color is None):
        raise ValueError(
            "split_group: pass either split_ranks (torch's form: lists of parent-group ranks, "
            "e.g. [[0, 1], [2, 3]]) or color= (MPI_Comm_split's form), not both and not neither"
        )
    if split_ranks is not None:
        my_color, my_key = _color_of(parent, split_ranks), parent.rank
    else:
        assert color is not None
        my_color, my_key = color, parent.rank if key is None else key
    backend_map = _child_backends(parent, backend)
    gathered: list[Any] = [None] * parent.size
    all_gather_object(gathered, (my_color, my_key), group=parent)
    current = state.get_state()
    serial = current.splits_created[parent.uid] = current.splits_created.get(parent.uid, 0) + 1  # (the parent's ranks only)
    name = agreed_name(current, parent.uid, group_desc or f"{parent.name}.split{serial}", serial)
    if my_color < 0:
        return None if split_ranks is not None else state.NON_GROUP_MEMBER
    members = sorted((k, i) for i, (c, k) in enumerate(gathered) if c == my_color)
    name = f"{name}.c{my_color}"
    if name in current.groups:
        raise ValueError(f"split_group: this rank already has a group named {name!r}; pass another group_desc")
    new = ProcessGroup(
        name,
        [parent.ranks[i] for _, i in members],
        parent.ranks[parent.rank],
        current.store,
        as_timedelta(timeout) or parent.timeout,
        backend_map,
        pg_options or parent.options,
        parent=parent,
    )
    current.groups[name] = new
    return new


def agreed_name(current: state.WorldState, scope: str, name: str, serial: int) -> str:
    """A new group's name, the same on every rank that makes the call: ``name``, or ``name.<serial>``
    when an earlier group of ``scope`` (new_group's: the world; split_group's: its parent) took it.

    The names taken are counted on every rank that makes the call, member or
    not: a rank's own groups differ by membership, so checking them would name
    one group differently on different ranks, and their store keys would never meet.
    """
    key = (scope, name)
    uses = current.names_used[key] = current.names_used.get(key, 0) + 1
    return name if uses == 1 and name != current.world.name else f"{name}.{serial}"


def _color_of(parent: ProcessGroup, split_ranks: Sequence[Sequence[int]]) -> int:
    """The index of the split that holds this rank (-1 if none), after checking the splits are disjoint."""
    if len(split_ranks) == 0:
        raise ValueError("split_group: split_ranks is empty; pass lists of parent-group ranks, e.g. [[0, 1], [2, 3]]")
    seen: dict[int, int] = {}
    for index, ranks in enumerate(split_ranks):
        for r in ranks:
            if not 0 <= r < parent.size:
                raise ValueError(
                    f"split_group: rank {r} in split_ranks[{index}] is out of range for group {parent.name!r} "
                    f"of size {parent.size}; split_ranks holds parent-group ranks"
                )
            if r in seen:
                raise ValueError(f"split_group: rank {r} is in split_ranks[{seen[r]}] and split_ranks[{index}]; splits must not overlap")
            seen[r] = index
    return seen.get(parent.rank, -1)


def _child_backends(parent: ProcessGroup, backend: str | Mapping[str, str] | None) -> dict[str, str] | None:
    """The child's backend map: the parent's, or the subset ``backend`` names (which must match the parent's)."""
    if backend is None:
        return parent.backend_map
    requested = parse_backend_string(backend)
    assert requested is not None
    for device, name in requested.items():
        if parent.backend_name(device) != name:
            raise ValueError(
                f"split_group: backend {name!r} for {device!r} differs from the parent group's "
                f"{parent.backend_name(device)!r}; a split keeps a subset of the parent's backends"
            )
    return requested


def as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    """A timeout given in seconds or as a timedelta, as a timedelta (None stays None)."""
    return timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
