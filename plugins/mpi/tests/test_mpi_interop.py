"""torch.distributed on spmd's MPI backend (torch's API, DDP, DistributedSampler), ranks started by mpiexec."""

import pytest
from mpi_launch import MPIEXEC, SKIP_REASON

from spmd.testing.interop import TorchInteropSuite


@pytest.mark.skipif(MPIEXEC is None, reason=SKIP_REASON)
class TestMpiInterop(TorchInteropSuite):
    backend = "mpi"
    spmd_launcher = MPIEXEC
