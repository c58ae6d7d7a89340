"""Shared by the tests: the mpiexec that matches mpi4py's MPI, or why the MPI tests are skipped."""

from __future__ import annotations

import pytest

probe = pytest.importorskip("spmd_mpi.probe", reason="spmd-mpi is not installed: pip install -e 'plugins/mpi[mpich]'")


def _find() -> tuple[tuple[str, ...] | None, str]:
    missing = probe.mpi4py_missing() or probe.library_missing()
    if missing is not None:
        return None, missing
    path, why = probe.find_mpiexec()
    if path is None:
        return None, why
    return tuple(probe.mpiexec_command("{n}", path)), ""


#: ``("/venv/bin/mpiexec", "-n", "{n}")`` for World(launcher=...), or None with SKIP_REASON.
MPIEXEC, SKIP_REASON = _find()
