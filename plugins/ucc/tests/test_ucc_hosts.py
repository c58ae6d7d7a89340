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


def _ucx_tls() -> str | None:
    """On a rank: the transports setting its UCX context was created with (after a collective made it)."""
    import torch

    import spmd
    from spmd_ucc.engine import get_engine

    t = torch.ones(3)
    spmd.all_reduce(t)
    return get_engine().config.get("TLS")


def _late_group_across(same_node: list[int], across: list[int]) -> str:
    """On a rank: a ucc group within one node first, then one across nodes; what the second raised."""
    import torch

    import spmd
    from spmd.errors import BackendUnavailableError

    first = spmd.new_group(same_node, backend="ucc")
    second = spmd.new_group(across, backend="ucc")
    t = torch.ones(2)
    if spmd.get_rank() in same_node:
        spmd.all_reduce(t, group=first)
    if spmd.get_rank() in across:
        try:
            spmd.all_reduce(t, group=second)
        except BackendUnavailableError as error:
            return str(error)
    return ""


def test_only_peers_in_another_network_namespace_count_as_across_hosts(spmd_hosts):
    """Identities read on real test-bed nodes: another node differs (same kernel), another process here does not."""
    import subprocess
    import sys

    from spmd_ucc.placement import host_identity, spans_namespaces

    hosts = spmd_hosts(2)
    probe_code = "from spmd_ucc.placement import host_identity; print(host_identity())"
    on_node = [node.run([sys.executable, "-c", probe_code], env=_env(), timeout=30).stdout.strip() for node in hosts.nodes]
    here = subprocess.run([sys.executable, "-c", probe_code], env=_env(), capture_output=True, text=True, timeout=30).stdout.strip()
    assert here == host_identity() and on_node[0] != on_node[1]
    assert not spans_namespaces(here, [here]) and spans_namespaces(on_node[0], [on_node[0], on_node[1]])
    assert not spans_namespaces(here, ["another-boot-id/" + here.partition("/")[2]])  # another kernel: UCX's own call


def test_ucc_conformance_suite_across_hosts(spmd_hosts):
    """Every op of the conformance suite on 4 ranks spread over 2 nodes (ranks alternate), and split groups."""
    from spmd.testing.conformance.suite import failures_across_hosts

    failures = failures_across_hosts(spmd_hosts(2), "ucc", env=_env())
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])


def test_ranks_across_hosts_use_no_shared_memory_and_a_late_group_across_is_a_named_error(spmd_hosts):
    """A ucc world over two nodes: each context leaves shared memory out. A gloo world whose first ucc group
    stays on node 0: its context keeps shared memory, so a later ucc group across nodes is refused by name."""
    from spmd.testing import World

    hosts = spmd_hosts(2)
    here = hosts.attach_here()
    place = {"host": here, "rank_prefix": lambda rank: hosts.nodes[rank % 2].command([]), "env": _env()}
    world = World(2, "ucc", **place)
    try:
        assert world.run(_ucx_tls, timeout=60) == ["^sm", "^sm"]
    finally:
        world.close()
    world = World(4, "gloo", **place)
    try:
        said = world.run(_late_group_across, [0, 2], [0, 1], timeout=60)
    finally:
        world.close()
    # every member of the group across says so (rank 1's own context would have been fine): none waits
    assert all("ranks in other network namespaces" in said[r] and "rank(s) [0]" in said[r] for r in (0, 1)), said
    assert said[2:] == ["", ""], said
