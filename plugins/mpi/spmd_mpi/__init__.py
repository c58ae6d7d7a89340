"""spmd-mpi: MPI (through mpi4py) behind spmd's Backend contract, every collective native.

This module never imports mpi4py: importing ``mpi4py.MPI`` loads libmpi (and
the UCX the MPI wheels bundle) and initialises MPI, so it happens only in the
backend factory, the first time a group uses the ``mpi`` backend. ``spmd
plugins`` lists this plugin and ``spmd doctor`` says what to install even
where mpi4py is absent.
"""

from __future__ import annotations

from collections.abc import Iterable

import spmd
from spmd_mpi import probe


def _available() -> str | None:
    """None where MPI can run this process's job, else why not (``spmd doctor`` prints it).

    MPI ranks must be started by MPI's launcher; a process that torchrun,
    ``spmd run`` or a plain srun started as one of several ranks is an MPI
    singleton, so MPI reports itself unusable there and ``spmd.init()`` picks
    the next backend. A plain process (a world of one) may use MPI.
    """
    reason = probe.mpi4py_missing() or probe.library_missing()
    if reason is not None:
        return reason
    other = probe.foreign_launcher()
    if other is not None:
        return (
            f"this process was started by {other}, not by an MPI launcher: MPI ranks must be "
            "started with `mpiexec -n N python script.py` (or srun --mpi=pmi2/pmix); under this "
            "launcher use another backend, e.g. spmd.init('gloo')"
        )
    return None


def _factory(ctx: spmd.BackendContext) -> spmd.Backend:
    from spmd_mpi.backend import MpiBackend

    return MpiBackend(ctx)


def _precheck(ctx: spmd.BackendContext) -> str | None:
    """Before the kernel waits for the group's members: can MPI's ranks be this group's at all?

    Does not initialise MPI (MPI_Init may wait for every rank): a launcher of
    the wrong family is judged from the environment, the full world check only
    once MPI is loaded (the factory does it otherwise, after the members met).
    """
    mismatch = probe.mismatched_mpiexec()
    if mismatch is not None:
        return mismatch
    from spmd_mpi import library

    if library.MPI is None:
        return None
    from spmd_mpi.communicator import world_mismatch

    return world_mismatch(library.MPI, ctx)


def priority() -> int:
    """20 (above Gloo's 10) in a process that mpiexec started, else 5 (below it).

    One rule picks the default everywhere (``spmd doctor``, ``python script.py``,
    ``spmd run``): the highest-priority usable backend. So Gloo is the CPU
    default, as the README says, and MPI only where MPI's launcher started the
    ranks (there its native collectives are what the user asked for).
    """
    return 20 if probe.launched_by_mpi() else 5


@spmd.hookimpl
def spmd_backends() -> Iterable[spmd.BackendSpec]:
    return [
        spmd.BackendSpec(
            name="mpi",
            devices=("cpu",),
            factory=_factory,
            priority=priority(),
            available=_available,
            precheck=_precheck,
            backend_class="spmd_mpi.backend:MpiBackend",
            description=probe.describe(),
            launch=probe.launch_prefix("{nproc}"),  # how tools such as `spmd bench` start MPI ranks
        )
    ]


@spmd.hookimpl
def spmd_bench_peers():  # type: ignore[no-untyped-def]
    """The raw peer for ``spmd bench --vs-raw``: mpi4py's blocking calls on the same buffers."""
    from spmd_mpi.bench_peer import raw_mpi_ops

    return {"mpi": raw_mpi_ops}
