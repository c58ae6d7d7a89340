"""Run a spmd training function on N Ray workers: ``spmd.integrations.ray.run(train_fn, num_workers=N)``.

The way Ray Train starts torch workers (``TorchConfig``): one actor per worker
in a placement group, worker 0 picks an address and a free port on its node
for the job's store, and every worker gets torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR,
MASTER_PORT), so ``spmd.init()`` inside ``train_fn`` works unchanged. A worker
that raises or dies stops the group; with ``max_restarts`` the whole group
starts again on new actors (``SPMD_RESTART_COUNT`` counts), and a ``train_fn``
that resumes from its own checkpoint continues where it was. See docs/ray.md.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from spmd.errors import MissingDependencyError, WorkerFailedError, WorkerTimeoutError, first_line

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as error:  # pragma: no cover - depends on what is installed
    raise MissingDependencyError(
        f"spmd.integrations.ray needs Ray ({error}): pip install 'spmd[ray]'") from error

__all__ = ["run"]

log = logging.getLogger("spmd.integrations.ray")
R = TypeVar("R")

#: Seconds between checks on the workers while they train.
POLL_S = 0.2
#: Seconds to wait, once one worker failed, for the others' errors: a killed worker is the cause, not its peers'
#: broken collectives, and its death may be noticed after them.
SETTLE_S = 2.0


class _Worker:
    """One rank: an actor process that takes the rank environment and runs the training function."""

    def where(self) -> tuple[str, str, int]:
        """This worker's node address, node id and process id."""
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

    def free_port(self) -> int:
        """A free TCP port on this node, for the job's store (worker 0 hosts it)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def run(self, env: dict[str, str], backend: str | None, fn: Callable[..., Any], config: Any) -> Any:
        """Set the rank environment, join the job if asked (``backend``), and run ``fn``."""
        import spmd

        os.environ.update(env)
        if backend is not None:  # as TorchConfig(backend=...): the group is ready when fn starts
            spmd.init(backend)
        try:
            return _call(fn, config)
        finally:
            if backend is not None and spmd.is_initialized():
                spmd.destroy_process_group()


def _call(fn: Callable[..., Any], config: Any) -> Any:
    """``fn(config)``, or ``fn()`` for a function without parameters (as Ray Train's train loops)."""
    try:
        takes_config = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C callable: assume it takes the config
        takes_config = True
    return fn(config) if takes_config else fn()


@dataclass
class _Placed:
    """A started group: its placement group, actors in rank order and where each runs."""

    group: Any
    actors: list[Any]
    places: list[tuple[str, str, int]]

    def stop(self) -> None:
        """Kill every actor (the Ray way to end a worker) and free the placement group's resources."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.group)

    def describe(self, rank: int) -> str:
        address, _, pid = self.places[rank]
        return f"pid {pid} on {address}"


def _actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options for one worker's resources ({"CPU": 1, "GPU": 1, "custom": 2})."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), "resources": rest or None}


def _start(num_workers: int, resources: Mapping[str, float], strategy: str, start_timeout: float) -> _Placed:
    """Reserve the workers' resources and start one actor per worker, ranks contiguous per node."""
    group = placement_group([dict(resources)] * num_workers, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=start_timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise WorkerTimeoutError(
            f"the Ray cluster could not place {num_workers} workers with {dict(resources)} each ({strategy}) within "
            f"{start_timeout:.0f} s; it has {ray.available_resources()} free. Ask for fewer workers or resources, "
            "add nodes, or raise start_timeout") from None
    worker_cls = ray.remote(_Worker)
    actors: list[Any] = [worker_cls.options(**_actor_options(resources), scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote() for i in range(num_workers)]
    placed = _Placed(group, actors, [])
    refs = [actor.where.remote() for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=start_timeout)
    if len(ready) < len(refs):
        missing = [i for i, ref in enumerate(refs) if ref not in ready]
        placed.stop()
        raise WorkerTimeoutError(
            f"Ray workers {missing} of {num_workers} did not start within {start_timeout:.0f} s (their resources "
            "were reserved); see the Ray logs (ray status, /tmp/ray/session_latest/logs) or raise start_timeout")
    try:
        places = ray.get(refs)
    except RayActorError as error:
        placed.stop()
        raise WorkerTimeoutError(f"a Ray worker died while starting: {first_line(error)}") from error
    nodes = list(dict.fromkeys(node for _, node, _ in places))  # in order of first appearance
    order = sorted(range(num_workers), key=lambda i: nodes.index(places[i][1]))
    return _Placed(group, [actors[i] for i in order], [places[i] for i in order])


def _environments(placed: _Placed, attempt: int, extra: Mapping[str, str]) -> list[dict[str, str]]:
    """torchrun's variables for each rank; the store at a free port on worker 0's node."""
    port = ray.get(placed.actors[0].free_port.remote(), timeout=60)
    nodes = list(dict.fromkeys(node for _, node, _ in placed.places))
    envs = []
    for rank, (_, node, _) in enumerate(placed.places):
        same_node = [r for r, place in enumerate(placed.places) if place[1] == node]
        envs.append({**extra,
                     "RANK": str(rank), "WORLD_SIZE": str(len(placed.places)),
                     "LOCAL_RANK": str(same_node.index(rank)), "LOCAL_WORLD_SIZE": str(len(same_node)),
                     "NODE_RANK": str(nodes.index(node)), "GROUP_RANK": str(nodes.index(node)),
                     "MASTER_ADDR": placed.places[0][0], "MASTER_PORT": str(port),
                     "SPMD_RESTART_COUNT": str(attempt)})
    return envs


def _failure(placed: _Placed, rank: int, error: Exception, attempt: int) -> WorkerFailedError:
    """The named error for one rank's failure: what it raised, or that its process died."""
    where = f"rank {rank} of {len(placed.actors)} ({placed.describe(rank)}, attempt {attempt})"
    if isinstance(error, RayTaskError):
        cause = error.cause if isinstance(error.cause, BaseException) else error
        what = f"{where} raised {type(cause).__name__}: {first_line(cause)}"
    else:
        what = f"{where} died: its worker process exited or was killed ({first_line(error)})"
    failure = WorkerFailedError(what, rank)
    failure.__cause__ = error  # Ray's error carries the worker's traceback
    return failure


def _pick(failures: dict[int, WorkerFailedError]) -> WorkerFailedError:
    """The failure to report: a worker that died (its peers' errors follow from it), else the lowest rank."""
    died = [r for r, f in failures.items() if " died: " in str(f)]
    rank = min(died or failures)
    others = [f"rank {r}: {str(f).split(') ', 1)[-1]}" for r, f in sorted(failures.items()) if r != rank]
    chosen = failures[rank]
    if not others:
        return chosen
    combined = WorkerFailedError(f"{chosen}; also failed: {'; '.join(others)}", rank)
    combined.__cause__ = chosen.__cause__
    return combined


def _wait(placed: _Placed, refs: list[Any], attempt: int, deadline: float | None) -> list[Any]:
    """Every rank's return value, or the first failure once the others had SETTLE_S to report theirs."""
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    pending, failures = list(refs), {}
    settle_until: float | None = None
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
        for ref in ready:
            try:
                ray.get(ref)
            except (RayTaskError, RayActorError) as error:
                failures[rank_of[ref]] = _failure(placed, rank_of[ref], error, attempt)
                settle_until = settle_until or time.monotonic() + SETTLE_S
        if settle_until is not None and time.monotonic() >= settle_until:
            break
        if deadline is not None and time.monotonic() >= deadline:
            running = sorted(rank_of[ref] for ref in pending)
            raise WorkerTimeoutError(f"Ray workers (ranks {running}) still running at the run's timeout; stopped them")
    if failures:
        raise _pick(failures)
    return ray.get(refs)


def run(
    train_fn: Callable[..., R],
    config: Any = None,
    *,
    num_workers: int,
    backend: str | None = None,
    resources_per_worker: Mapping[str, float] | None = None,
    placement_strategy: str = "PACK",
    max_restarts: int = 0,
    start_timeout: float = 60.0,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> list[R]:
    """Run ``train_fn(config)`` on ``num_workers`` Ray actors as one spmd job; their return values in rank order.

    ``train_fn`` calls ``spmd.init()`` as under ``spmd run``; or pass ``backend`` (``"gloo"``,
    ``"cpu:gloo,cuda:nccl"``) and the group is ready when it starts, as with Ray Train's
    ``TorchConfig`` (it then checks ``spmd.is_initialized()`` before its own init). Each worker
    reserves ``resources_per_worker`` (default one CPU) in a placement group (``placement_strategy``:
    PACK, SPREAD, STRICT_PACK, STRICT_SPREAD). A worker that raises or dies ends the attempt:
    after ``max_restarts`` new groups it raises ``WorkerFailedError`` naming the rank. Not placed or
    started within ``start_timeout`` seconds, or still running after ``timeout`` (None: no limit;
    a hung collective ends at spmd's own timeout): ``WorkerTimeoutError``. ``env`` is added to
    every worker's environment. Connects with ``ray.init()`` (``RAY_ADDRESS``) if not connected.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be 0 or more, got {max_restarts}")
    if not ray.is_initialized():
        ray.init()  # Ray's convention: the cluster at RAY_ADDRESS, or a local one
    resources = dict(resources_per_worker or {"CPU": 1})
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(max_restarts + 1):
        placed = _start(num_workers, resources, placement_strategy, start_timeout)
        try:
            envs = _environments(placed, attempt, dict(env or {}))
            refs = [actor.run.remote(envs[rank], backend, train_fn, config) for rank, actor in enumerate(placed.actors)]
            return _wait(placed, refs, attempt, deadline)
        except WorkerFailedError as error:
            if attempt == max_restarts:
                if max_restarts:
                    raise WorkerFailedError(f"{error} (after {max_restarts} restarts, the max_restarts given)",
                                            error.rank) from error
                raise
            log.warning("spmd.integrations.ray: %s; restarting the group on new workers (%d of %d)",
                        error, attempt + 1, max_restarts)
        finally:
            placed.stop()
    raise AssertionError("unreachable: the last attempt returns or raises")
