"""spmd's backend conformance suite against MPI, every world started by a real mpiexec."""

import pytest
from mpi_launch import MPIEXEC, SKIP_REASON

from spmd.testing.conformance import BackendConformance

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason=f"MPI tests need mpi4py and its mpiexec: {SKIP_REASON}")


class TestMpiConformance(BackendConformance):
    backend = "mpi"
    world_sizes = (1, 2, 3, 4)  # 3 and 4 oversubscribe a 2-core machine: waits must yield
    spmd_launcher = MPIEXEC
