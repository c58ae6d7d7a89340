"""Every extension point of spmd, one documented function each.

This module is the reference for plugin authors. Each hook is called by the
plugin manager when a registry is first needed (lazily, once per process, on
every rank independently), never on the hot path: the kernel freezes what the
hooks return into registries and calls the objects directly afterwards.

A plugin implements any subset, with ``@spmd.hookimpl``, in the module named
by its entry point in the group ``spmd``::

    # pyproject.toml
    [project.entry-points.spmd]
    mybackend = "spmd_mybackend"

    # spmd_mybackend/__init__.py
    import spmd

    @spmd.hookimpl
    def spmd_backends():
        return [spmd.BackendSpec("mine", ("cpu",), factory=MyBackend)]

Implementations may accept fewer arguments than the spec, so hooks can grow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from spmd.markers import hookspec

if TYPE_CHECKING:  # annotations only: importing these at run time would load the whole kernel
    from spmd.bench.timing import PeerContext
    from spmd.comm.backend import BackendSpec
    from spmd.launch.environments import ClusterEnvironment
    from spmd.parallel.registry import StrategySpec

    #: What a bench peer factory returns: op name -> ``make(nbytes) -> call()``.
    PeerMakers = Mapping[str, Callable[[int], Callable[[], object]]]


@hookspec
def spmd_backends() -> Iterable[BackendSpec]:
    """Return the communication backends this plugin provides.

    Signature: ``spmd_backends() -> Iterable[spmd.BackendSpec]``.
    Called: the first time a backend registry is needed (``spmd.init``,
    ``spmd plugins``, ``spmd doctor``), on every rank.
    Returns: BackendSpec objects. Two specs with one name from different
    plugins are an error naming both, unless one sets ``overrides=True``.
    Must not import the backend's native library: do that in the factory.
    """


@hookspec
def spmd_sharding_rules() -> Mapping[Any, Any]:
    """Return sharding rules for DTensor operators.

    Signature: ``spmd_sharding_rules() -> Mapping[torch._ops.OpOverload, Rule]``.
    Called: the first time a DTensor op is dispatched, on every rank.
    Returns: a mapping from an aten op overload to the rule that propagates
    placements through it. A second rule for one op is a conflict.
    """


@hookspec
def spmd_strategies() -> Iterable[StrategySpec]:
    """Return parallelism strategies (DDP, FSDP, ...) that ``spmd.parallelize`` can apply by name.

    Signature: ``spmd_strategies() -> Iterable[spmd.parallel.StrategySpec]`` (``name``,
    ``apply(module, **options) -> module``, ``description``, ``overrides``).
    Called: the first time a strategy is looked up by name (``spmd.parallel.get_strategy``),
    on every rank. Two specs with one name are an error unless one sets ``overrides=True``.
    The builtin plugin ``spmd.parallel.builtin`` provides ``ddp``.

    DDP communication hooks are not specs: a plugin names its hooks at import with
    ``spmd.parallel.comm_hooks.register_hook(name, hook)`` (a hook is
    ``hook(state, bucket) -> spmd.Work``), and ``ddp.register_comm_hook(state, name)``
    finds them once the plugins are loaded.
    """


@hookspec
def spmd_schedules() -> Iterable[type]:
    """Return pipeline schedule classes.

    Signature: ``spmd_schedules() -> Iterable[type]``; each class has a unique ``name``.
    Called: the first time a schedule is looked up by name, on every rank.
    """


@hookspec
def spmd_storages() -> Iterable[Any]:
    """Return checkpoint storages.

    Signature: ``spmd_storages() -> Iterable[StorageSpec]`` (URL schemes and a factory).
    Called: the first time a checkpoint path with a scheme is opened, on every rank.
    """


@hookspec
def spmd_cluster_environments() -> Iterable[ClusterEnvironment]:
    """Return cluster environments that read rank, world size and master from the environment.

    Signature: ``spmd_cluster_environments() -> Iterable[ClusterEnvironment]``.
    Called: by ``spmd.init()`` without explicit rank/world, and by ``spmd run``,
    to detect how the process was launched (torchrun, mpiexec, srun, ...).
    Each environment has ``name``, ``priority``, ``detect() -> bool`` and
    ``launch_info() -> spmd.launch.environments.LaunchInfo`` (rank, world
    size, local rank, master address and port).
    """


@hookspec
def spmd_bench_peers() -> Mapping[str, Callable[[PeerContext], PeerMakers]]:
    """Return raw-library peers for ``spmd bench --vs-raw``, keyed by backend name.

    Signature: ``spmd_bench_peers() -> Mapping[str, Callable[[spmd.bench.PeerContext], Mapping[str, Callable]]]``.
    Called: by ``spmd bench`` in each rank after ``spmd.init``, for the backend under test only.
    Returns: per backend name, a factory that builds, for the current world, a mapping from op
    name (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``,
    ``all_to_all_single``, ``sendrecv``) to ``make(nbytes) -> call()``: ``make`` allocates buffers
    once, ``call`` runs one blocking op with the raw library under the backend (torch's
    ProcessGroupGloo, mpi4py, ucxx, ...), so spmd's overhead can be measured against it.
    """

