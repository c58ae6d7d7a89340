"""The world as users join it: ``spmd.init``, ``init_process_group`` and ``destroy_process_group``.

It sits above comm/, interop/ and launch/: it reads how the process was
launched (``spmd run``, torchrun, mpiexec, srun), has comm start the world
group on the job's store, and ties torch.distributed's default group to it.
comm/ knows neither launchers nor torch's default group.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from spmd import settings
from spmd.comm import state
from spmd.comm.group import ProcessGroup
from spmd.comm.init import (
    as_timedelta,
    check_backends,
    close_group,
    default_timeout,
    end_world,
    make_store,
    start_world,
)
from spmd.comm.tcp_store import job_scope
from spmd.errors import SpmdError
from spmd.interop import bridge
from spmd.launch import worker_store
from spmd.launch.environments import DEFAULT_MASTER_PORT, detect_launch

log = logging.getLogger("spmd")


def init_process_group(
    backend: str | Mapping[str, str] | None = None,
    init_method: str | None = None,
    timeout: timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: tdist.Store | None = None,
    group_name: str = "world",
    pg_options: Mapping[str, Any] | None = None,
    device_id: Any = None,
    trace_dir: str | os.PathLike | None = None,
    *,
    torch_interop: bool | None = None,
) -> ProcessGroup:
    """Join the job: rendezvous with the other ranks and create the world group.

    ``backend`` is ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, the same as a dict, or
    None for the best installed backend per device type. Rank and world size
    come from the arguments, the ``init_method`` URL (``env://``,
    ``tcp://host:port``, ``file:///path``), an explicit ``store``, or the
    launcher's environment (``spmd run``, torchrun, mpiexec, srun). A plain
    ``python script.py`` with none of those runs as a world of one. Backends
    are created lazily, on the first tensor of their device. ``trace_dir``
    is where flight-recorder dumps go (default ``$SPMD_TRACE_DIR`` or
    ``./spmd_traces``).

    torch.distributed follows: unless ``torch_interop=False`` (or
    ``SPMD_TORCH_INTEROP=0``), torch's default group becomes backend
    ``"spmd"`` on this world, so libraries that ask torch.distributed
    (``DistributedSampler``, torch's DDP, functional collectives) run on
    spmd's backend. If torch.distributed was initialised first, spmd joins
    its rank, world size and store instead.
    """
    if state.is_initialized():
        if bridge.started_by_torch():
            return state.get_state().world  # torch.distributed.init_process_group("spmd") started it
        raise SpmdError("spmd is already initialised; call spmd.destroy_process_group() before init again")
    settings.refresh()  # an entry point: variables set since import count (spmd.settings)
    timeout = as_timedelta(timeout) or default_timeout()
    backend_map = check_backends(backend if backend is not None else settings.current().backend)
    joined = bridge.torch_world() if store is None and init_method is None else None
    if joined is not None:
        torch_rank, torch_size, store = joined
        rank, world_size = (torch_rank if rank < 0 else rank), (torch_size if world_size < 0 else world_size)
    store_host: str | None = None  # a store handed in (store=, torch's): its host is not known here
    made_here = store is None
    if store is None:
        launcher_env = init_method is None and rank < 0 and world_size < 0
        if launcher_env and detect_launch() is None:
            rank, world_size, addr, port = 0, 1, "127.0.0.1", 0
            log.info("spmd.init: no launcher detected, running as a world of one")
        else:
            rank, world_size, addr, port = _resolve_world(init_method, rank, world_size)
        store, store_host = _job_store(init_method, rank, world_size, addr, port, timeout)
    elif rank < 0 or world_size < 0:
        raise ValueError("init_process_group(store=...) also needs rank= and world_size=")
    elif not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}: ranks are 0..{world_size - 1}")
    world = start_world(store, rank, world_size, timeout, backend_map, group_name=group_name, pg_options=pg_options,
                        trace_dir=trace_dir, store_host=store_host, await_all=made_here, on_end=_on_world_end)
    if joined is None and not tdist.is_initialized() and bridge.interop_requested(torch_interop):
        bridge.attach(world, store, timeout)
    return world


#: The short name spmd recommends; identical to ``init_process_group``.
init = init_process_group


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Tear down one group, or (with None) every group and the world; init may be called again.

    Tearing down the world first lets registered work finish on the groups
    (``teardown``: a pending ``async_save`` is waited for, within the world's
    timeout); if that work failed, its error is raised after the teardown.
    torch's default group goes with the world when spmd created it.
    """
    current = state.get_state()
    if group is None or group is current.world:
        end_world()
    else:
        close_group(group)


def _job_store(init_method: str | None, rank: int, world_size: int, addr: str, port: int,
               timeout: timedelta) -> tuple[tdist.Store, str | None]:
    """``comm.init.make_store``, or where ``spmd run`` keeps its workers' keys on etcd, that store."""
    global _etcd_store
    agent = settings.current().agent_store
    if agent and agent.startswith(worker_store.SCHEME) and init_method in (None, "env://"):
        etcd = _etcd_store = worker_store.open_store(agent, timeout.total_seconds())
        scoped = tdist.PrefixStore(settings.current().store_prefix, job_scope(etcd))
        return scoped, f"etcd at {etcd.client.describe()} (--rdzv-conf worker_store=etcd)"
    return make_store(init_method, rank, world_size, addr, port, timeout)


#: The etcd store this process's world runs on (``--rdzv-conf worker_store=etcd``): torch's PrefixStore
#: keeps no Python reference to the store it wraps, so the world keeps it until it ends.
_etcd_store: Any = None


def _on_world_end() -> None:
    """The world's last step: torch's default group detached, the etcd store's leases left to expire."""
    global _etcd_store
    bridge.detach()
    if _etcd_store is not None:
        store, _etcd_store = _etcd_store, None
        try:
            store.close(revoke=False)  # (its keys expire with this process's lease; the agents delete the rest)
        except Exception:  # noqa: BLE001 - etcd may be gone: nothing is left to release
            pass


def job_store_endpoint() -> tuple[str, int] | None:
    """The job's store as this process's launcher environment names it (``spmd run``'s agent, else MASTER_ADDR:PORT), or None."""
    agent = settings.current().agent_store
    on_etcd = worker_store.address(agent) if agent else None
    if on_etcd is not None:
        return on_etcd
    if agent and agent.rpartition(":")[2].isdigit():
        host, _, port = agent.rpartition(":")
        return host, int(port)
    detected = detect_launch()
    if detected is None or not detected[1].master_port or detected[1].world_size <= 1:
        return None
    return detected[1].master_addr, detected[1].master_port


def _resolve_world(init_method: str | None, rank: int, world_size: int) -> tuple[int, int, str, int]:
    """rank, world size, master address and port from arguments, URL or launcher environment."""
    detected = detect_launch() if init_method in (None, "env://") else None
    addr, port = "127.0.0.1", 0
    if detected is not None:
        _, info = detected
        rank = info.rank if rank < 0 else rank
        world_size = info.world_size if world_size < 0 else world_size
        addr, port = info.master_addr, info.master_port
    elif init_method in (None, "env://") and (os.environ.get("MASTER_ADDR") or os.environ.get("MASTER_PORT")):
        # torch's env:// with rank= and world_size= passed: the master comes from the environment.
        addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        port = int(os.environ.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
    elif init_method and init_method.startswith("tcp://"):
        url = urllib.parse.urlparse(init_method)
        query = urllib.parse.parse_qs(url.query)
        addr, port = url.hostname or "127.0.0.1", url.port or 29500
        rank = int(query["rank"][0]) if rank < 0 and "rank" in query else rank
        world_size = int(query["world_size"][0]) if world_size < 0 and "world_size" in query else world_size
    if rank < 0 or world_size < 0:
        raise SpmdError(
            "spmd.init could not tell this process's rank and world size: no launcher "
            "environment was found (RANK/WORLD_SIZE from `spmd run` or torchrun, mpiexec, srun). "
            "Launch with `spmd run --nproc-per-node N script.py`, or pass rank= and world_size="
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}: ranks are 0..{world_size - 1}")
    if port == 0 and world_size > 1 and not (init_method or "").startswith("file://") and not settings.current().agent_store:
        raise SpmdError(
            f"spmd.init(rank={rank}, world_size={world_size}) has no rendezvous address: set MASTER_ADDR and "
            "MASTER_PORT in the environment (as torch's env:// does, e.g. MASTER_ADDR=127.0.0.1 "
            "MASTER_PORT=29500), or pass init_method='tcp://host:port' or store=; or launch with "
            "`spmd run --nproc-per-node N script.py`, which sets them"
        )
    return rank, world_size, addr, port
