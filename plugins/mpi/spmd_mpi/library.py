"""Loading MPI: ``mpi4py.MPI`` is imported by the first backend, never at import time.

Importing it loads libmpi and initialises MPI (with ``MPI_THREAD_MULTIPLE`` and
spmd's MPI tuning defaults), so it happens once, under a lock, when a group
first uses the ``mpi`` backend; the reduction tables are built then too.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from spmd.errors import BackendUnavailableError
from spmd_mpi import probe, work
from spmd_mpi.mapping import build_tables

#: The mpi4py.MPI module, imported by the first backend (never at import time).
MPI: Any = None
_LOAD_LOCK = threading.Lock()

#: MPI tuning set before MPI_Init unless already in the environment. MPICH's default
#: MPI_Ireduce_scatter_block algorithm measured 3x slower than the blocking call at
#: 1 MiB on 2-3 ranks; pairwise exchange matches it at every size from 256 KiB up.
#: Only MPICH reads MPIR_CVAR_* variables.
MPI_DEFAULTS = {"MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM": "sched_pairwise"}


def load_mpi() -> Any:
    """Import mpi4py.MPI (initialising MPI with thread support) and build the lookup tables."""
    global MPI
    if MPI is not None:
        return MPI
    with _LOAD_LOCK:
        if MPI is not None:
            return MPI
        reason = probe.mpi4py_missing()
        if reason is not None:
            raise BackendUnavailableError(reason)
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.threads = True
            mpi4py.rc.thread_level = "multiple"
            for name, value in MPI_DEFAULTS.items():
                os.environ.setdefault(name, value)  # read by MPI_Init; yours win
        try:
            from mpi4py import MPI as mpi
        except (ImportError, RuntimeError) as error:
            raise BackendUnavailableError(
                f"mpi4py could not load an MPI library ({error}); install one with: {probe.INSTALL_HINT}"
            ) from error
        if mpi.Is_finalized():
            raise BackendUnavailableError("MPI was already finalised in this process; it cannot be used again")
        if not mpi.Is_initialized():
            mpi.Init_thread(mpi.THREAD_MULTIPLE)
        if mpi.Query_thread() < mpi.THREAD_MULTIPLE:
            raise BackendUnavailableError(
                "spmd-mpi needs MPI_THREAD_MULTIPLE (waits and async ops test requests from several "
                f"threads) but this MPI provides level {mpi.Query_thread()}. If you initialised MPI "
                "yourself, leave mpi4py.rc.thread_level at 'multiple'; otherwise use an MPI built with "
                f"thread support ({probe.INSTALL_HINT})"
            )
        build_tables(mpi)
        work.MPI = mpi  # MpiWork's waits read it as work.py's own global (no lookup through here)
        MPI = mpi
    return MPI


def library_version() -> str:
    """The first line of ``MPI_Get_library_version`` (after the backend loaded MPI)."""
    mpi = load_mpi()
    return str(mpi.Get_library_version()).strip().splitlines()[0].strip()
