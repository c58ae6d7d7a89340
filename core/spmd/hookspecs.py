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
from spmd.specs import (
    BackendSpec,
    ClusterEnvironment,
    CommHook,
    PeerContext,
    PeerMakers,
    RendezvousBackendSpec,
    StorageSpec,
    StrategySpec,
)

if TYPE_CHECKING:  # torch's operator types, for the annotation alone (importing torch here would be slow)
    from torch._ops import OpOverload, OpOverloadPacket


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
def spmd_sharding_rules() -> Mapping[OpOverload | OpOverloadPacket, Any]:
    """Return sharding rules for DTensor operators.

    Signature: ``spmd_sharding_rules() -> Mapping[torch._ops.OpOverload | OpOverloadPacket,
    spmd.tensor.Rule | spmd.tensor.Decompose]`` (a packet covers all its overloads).
    Called: the first time a DTensor op is dispatched (and by ``spmd plugins``), on every rank.

    A rule is ``rule(call: spmd.tensor.OpCall) -> spmd.tensor.Sharding`` and
    decides ONE mesh dimension at a time: ``call.inputs`` holds a TensorArg
    (global shape, dtype, ``placement`` on this mesh dimension, ``placements``
    on all) per DTensor argument, ``call.outputs`` the outputs' global shapes
    (from the op on meta tensors: the op needs a meta/fake kernel),
    ``call.args``/``call.kwargs`` the arguments with DTensors replaced by
    TensorArgs. It returns ``Sharding(inputs=[placement per DTensor input],
    outputs=[placement per tensor output], rewrite=None)``; spmd redistributes
    the inputs, runs the op on the local shards and wraps the outputs.
    Results are cached per signature, so a rule must be a pure function of
    the call. ``spmd.tensor.Decompose(fn)`` instead runs ``fn(*args, **kwargs)``
    on the DTensors themselves. Ready rules: ``spmd.tensor.pointwise_rule``,
    ``linear_pointwise_rule``, ``replicate_rule``. Check a rule with
    ``spmd.testing.rules.check_sharding``. Two plugins with a rule for one op
    is an error naming both, unless one maps the op to ``spmd.Overriding(rule)``:
    that rule replaces the other (a builtin one, say). A rule registered at run
    time (``spmd.plugins.manager().register(plugin)``) is used from the next
    dispatch on. The standard rules are the builtin plugin ``spmd.tensor.rules``;
    docs/dtensor.md has a worked example.
    """


@hookspec
def spmd_strategies() -> Iterable[StrategySpec]:
    """Return parallelism strategies (DDP, FSDP, ...) that ``spmd.parallel.get_strategy`` finds by name.

    Signature: ``spmd_strategies() -> Iterable[spmd.parallel.StrategySpec]`` (``name``,
    ``apply(module, **options) -> module``, ``description``, ``overrides``).
    Called: the first time a strategy is looked up by name (``spmd.parallel.get_strategy``),
    on every rank. Two specs with one name are an error unless one sets ``overrides=True``.
    The builtin plugin ``spmd.parallel.builtin`` provides ``ddp``, ``fsdp``, ``tp``.
    """


@hookspec
def spmd_comm_hooks() -> Mapping[str, CommHook]:
    """Return DDP communication hooks by name.

    Signature: ``spmd_comm_hooks() -> Mapping[str, spmd.parallel.comm_hooks.CommHook]``; a hook is
    ``hook(state, bucket) -> spmd.Work`` and, when the Work completes, ``bucket.buffer()`` holds
    the group's average.
    Called: the first time a hook is looked up by name (``ddp.register_comm_hook(state, "name")``,
    ``spmd.parallel.comm_hooks.get_hook``), on every rank. Two plugins with one name are an error
    unless one maps it to ``spmd.Overriding(hook)``. The builtin plugin ``spmd.parallel.builtin``
    provides ``allreduce``, ``fp16_compress`` (``fp16``) and ``bf16_compress`` (``bf16``); code may
    add one at run time with ``spmd.parallel.comm_hooks.register_hook(name, hook)``.
    """


@hookspec
def spmd_schedules() -> Iterable[type]:
    """Return pipeline schedule classes.

    Signature: ``spmd_schedules() -> Iterable[type[spmd.pipeline.Schedule]]``; each class has a
    unique str ``name`` and a classmethod ``programs(num_stages, stages_per_rank, n_microbatches)
    -> {rank: [spmd.pipeline.Action, ...]}`` (stage s on rank s % ranks).
    Called: the first time a schedule is looked up by name (``spmd.pipeline.get_schedule``), on
    every rank. Every program is validated once (``spmd.pipeline.validate``) before it runs; two
    classes with one name are an error unless one sets ``overrides = True``. The builtin plugin
    ``spmd.pipeline.builtin`` provides ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb_h1``;
    docs/pipeline.md has a worked example.
    """


@hookspec
def spmd_storages() -> Iterable[StorageSpec]:
    """Return checkpoint storages: where ``spmd.checkpoint`` reads and writes, by URL scheme.

    Signature: ``spmd_storages() -> Iterable[spmd.checkpoint.StorageSpec]``;
    ``StorageSpec(schemes, factory, name="", description="", overrides=False)``.
    Called: the first time a checkpoint URL is opened (``save``, ``load``,
    ``spmd checkpoint ...``), on every rank; the result is cached until
    ``spmd.checkpoint.storage.reset()`` or ``spmd.plugins.reset()``.
    ``schemes`` are lower-case names without ``://``; a plain path is scheme
    ``file``. The scheme ``"*"`` serves every URL that no spec names (the
    builtin-optional ``spmd.checkpoint.fsspec_storage`` uses it when fsspec
    is installed). Two specs with one scheme are an error naming both plugins,
    unless one sets ``overrides=True``. The builtin ``spmd.checkpoint.filesystem``
    serves ``file``.

    The contract: ``factory(url) -> spmd.checkpoint.Storage`` for one
    checkpoint root; it must not do I/O that can fail for a missing directory
    (a save creates it). Paths passed to the methods are relative to the root
    and ``/``-separated (``metadata.json``, ``data-<token>/rank-00003.safetensors``).
    Subclass ``Storage`` and implement:

    - ``write(path, parts) -> int``: create or replace a file with the
      concatenation of ``parts`` (bytes-like; large, do not join them),
      creating parent directories; return the bytes written. Raise on any
      failure: the save is then rolled back on every rank.
    - ``write_atomic(path, data)``: the commit point. A reader sees the old
      file or the new one, never a part (rename over, or an object store's put).
    - ``read(path, offset=0, length=None) -> bytes-like``: a byte range
      (``load`` reads only the spans of the shards it needs);
      ``read_into(path, offset, memoryview)`` optionally, to read without a copy.
    - ``size(path) -> int``: the size of a regular file, asked before spmd
      reads a file a checkpoint names (the default reads the whole file).
      A checkpoint is untrusted input: on the read side refuse a path that
      leaves the root (``spmd.checkpoint.untrusted.check_relative``), links
      and anything but a regular file, and never block.
    - ``exists(path)``, ``listdir(path="") -> names``, ``remove(path)``
      (a file or a tree; missing is fine).
    - optionally ``create_exclusive(path, data) -> bool``: create a file only
      if it is absent (``O_EXCL``, a conditional put); rank 0 takes the save's
      claim on the id with it. The default (check, write, read back) works on
      the methods above but is not atomic.

    Each rank writes only its own files; rank 0 writes ``metadata.json`` last,
    with ``write_atomic``, then removes older ``data-*`` directories. During
    ``async_save`` the methods run in a background thread (one at a time per
    Storage object). Example (``tests/checkpoint_plugin.py`` is a complete one)::

        @spmd.hookimpl
        def spmd_storages():
            return [spmd.checkpoint.StorageSpec(("mystore",), MyStorage)]
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
def spmd_rendezvous_backends() -> Iterable[RendezvousBackendSpec]:
    """Return the rendezvous backends ``spmd run --rdzv-backend NAME`` can meet on.

    Signature: ``spmd_rendezvous_backends() -> Iterable[spmd.launch.rdzv_backends.RendezvousBackendSpec]``
    (``name``, ``factory(config: RunConfig) -> RendezvousBackend``, ``description``, ``overrides``).
    Called: by each ``spmd run`` agent before its first round. A RendezvousBackend gives the agent
    ``store`` (torch's Store API: ``add``, ``compare_set``, ``check``, ``set``, ``get``, ``delete_key``;
    the rounds of ``spmd.launch.rendezvous.Rendezvous`` run on it), ``endpoint``, ``local_address``,
    and ``round_store(rdzv, membership) -> (host:port, hosted_here)``: the c10d store of the round's
    workers. Builtin: ``c10d`` (node 0's agent hosts a TCPStore) and ``etcd`` (an etcd v3 cluster).
    Two specs with one name are an error unless one sets ``overrides=True``.
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

