"""spmd-ucc's conformance suite with its ranks on two "hosts" of the ``spmd_hosts`` test bed.

Each node is its own network and UTS namespace whose hostname resolves to
loopback (spmd.testing.hosts); the test skips where the machine cannot make one.
"""

from __future__ import annotations

import pytest

from spmd_ucc import probe

pytestmark = pytest.mark.skipif(probe.ucxx_missing() is not None, reason=f"ucc backend not usable here: {probe.ucxx_missing()}")


def _env() -> dict[str, str]:
    """This process's environment, less launcher and interface settings (the point: none is needed)."""
    import os

    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "SPMD_SOCKET_IFNAME"}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("UCX_")} | {"OMP_NUM_THREADS": "1"}


def test_ucc_conformance_suite_across_hosts(spmd_hosts):
    """Every op of the conformance suite on 4 ranks spread over 2 nodes (ranks alternate), and split groups."""
    from spmd.testing import World
    from spmd.testing.conformance.checks import CHECKS
    from spmd.testing.conformance.suite import run_cases

    hosts = spmd_hosts(2)
    here = hosts.attach_here()
    world = World(4, "ucc", host=here, rank_prefix=lambda rank: hosts.nodes[rank % 2].command([]), env=_env())
    try:
        failures = [f"{op}/{shape} rank {rank}: {failure}"
                    for op, shape in [*((op, "world") for op in CHECKS), ("all_reduce", "split"), ("p2p", "split")]
                    for rank, per_rank in enumerate(world.run(run_cases, op, shape, "cpu", timeout=120)) for failure in per_rank]
    finally:
        world.close()
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])
