"""spmd DDP over MPI (under a real mpiexec) matches torch DDP over Gloo after 20 steps."""

import sys
from pathlib import Path

import pytest
from mpi_launch import MPIEXEC, SKIP_REASON

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import ddp_helpers  # noqa: E402 - the kernel's DDP parity helpers

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason=SKIP_REASON or "mpiexec not found")


@pytest.mark.parametrize("case", ["plain", "no_sync", "unused"])
def test_ddp_over_mpi_matches_torch_ddp(spmd_world, case):
    results = spmd_world(2, "mpi", launcher=MPIEXEC).run(ddp_helpers.parity, case, timeout=120)
    assert all(r["changed"] for r in results)
