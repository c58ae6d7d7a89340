"""spmd's backend conformance suite, run against ucc for world sizes 1 to 4.

The ranks are World worker processes, so ucxx is loaded there and never in
the pytest process (which may have loaded mpi4py, whose UCX clashes with it).
"""

import pytest

from spmd.testing.conformance import BackendConformance
from spmd_ucc import probe

pytestmark = pytest.mark.skipif(probe.ucxx_missing() is not None, reason=f"ucc backend not usable here: {probe.ucxx_missing()}")


class TestUccConformance(BackendConformance):
    backend = "ucc"
