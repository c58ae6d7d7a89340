"""The kernel's choice for a group across hosts with 2+ ranks per host: a hierarchical all_reduce (spmd.comm.hierarchical).

On the ``spmd_hosts`` test bed (each node its own network, UTS and PID namespace: a host of its own), 4 ranks
alternate over 2 nodes, so each node holds 2 ranks that are not consecutive in the group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_multihost import finish, run_env

from spmd import settings
from spmd.comm.hierarchical import host_layout
from spmd.testing.ports import free_port

SCRIPT = Path(__file__).parent / "launch_scripts" / "hierarchical.py"


def on_two_nodes(hosts, *args: str, env: dict[str, str] | None = None) -> dict[int, dict]:
    """Run the script as 4 ranks alternating over the test bed's 2 nodes; each rank's REPORT by rank."""
    port = free_port()
    ranks = [
        hosts.nodes[rank % 2].popen(
            [sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=run_env() | {"MASTER_ADDR": hosts.nodes[0].address, "MASTER_PORT": str(port), "RANK": str(rank),
                             "WORLD_SIZE": "4", "LOCAL_RANK": str(rank // 2)} | (env or {}))
        for rank in range(4)
    ]
    outs = finish(ranks, timeout=120)
    reports = {}
    for rank, (out, err) in enumerate(outs):
        line = next((x for x in out.splitlines() if x.startswith("REPORT ")), None)
        if line is not None:
            reports[rank] = json.loads(line[len("REPORT "):])
        reports.setdefault(rank, {"exit": ranks[rank].returncode, "stderr": err[-3000:]})
    return reports


def test_host_layout_groups_ranks_by_host_in_order_of_their_first_rank():
    assert host_layout(["b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [4]]


def test_all_reduce_across_two_nodes_is_hierarchical_and_equals_the_one_process_result(spmd_hosts):
    reports = on_two_nodes(spmd_hosts(2), "check", "30")
    for rank, report in reports.items():
        assert "failures" in report, (rank, report)
        assert report["failures"] == [], (rank, report["failures"])
        assert report["cases"] == 72  # 63 sync cases (see the script) and 9 async ops
        # spmd.get_backend names the network backend the group is on; its all_reduce is shm+Gloo
        assert (report["get_backend"], report["kind"]) == ("gloo", "HierarchicalBackend"), report
        assert report["describe"] == "gloo+shm (2 hosts x [2, 2] ranks)", report


def test_off_gives_the_network_backend_alone(spmd_hosts):
    reports = on_two_nodes(spmd_hosts(2), "check", "30", env={"SPMD_HIERARCHICAL_MIN_BYTES": "off"})
    for report in reports.values():
        assert report.get("failures") == [] and report["kind"] == "GlooBackend", report


def test_a_rank_killed_inside_a_hierarchical_all_reduce_is_a_named_error_on_the_others_within_the_timeout(spmd_hosts):
    hosts = spmd_hosts(2)
    timeout = 20.0
    for victim in (3, 0):  # a host's second rank, then a leader
        reports = on_two_nodes(hosts, "kill", str(timeout), str(victim))
        survivors = [r for r in range(4) if r != victim]
        for rank in survivors:
            report = reports[rank]
            assert "error" in report, (victim, rank, report)
            assert report["spmd_error"] and report["error"] in ("CollectiveError", "CollectiveTimeoutError"), (victim, report)
            assert report["elapsed"] < timeout + 2, (victim, report)
            assert report["after"] in ("CollectiveError", "CollectiveTimeoutError") and report["after_elapsed"] < 2, report


def test_the_conformance_suite_passes_across_hosts_on_the_kernels_own_choice(spmd_hosts):
    """spmd.init() with no backend: the world and the split groups across the nodes are hierarchical (every all_reduce
    of 64 B or more), everything else Gloo's."""
    from spmd.testing.conformance.suite import failures_across_hosts

    failures = failures_across_hosts(spmd_hosts(2), None, env=run_env())
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])


def test_a_stalled_rank_is_a_timeout_on_the_others(spmd_hosts):
    """The first survivor at its deadline raises the timeout (the hierarchy's step aborted); the others may learn
    from the kernel that it gave up (a CollectiveError) or see their own step broken: all within the timeout, the
    diagnosis's bounded wait for the peers' answers (up to the watchdog interval + 1 s) and a second of slack."""
    timeout = 3.0
    reports = on_two_nodes(spmd_hosts(2), "stall", str(timeout), "2")
    errors = {reports[r].get("error") for r in (0, 1, 3)}
    assert "CollectiveTimeoutError" in errors and errors <= {"CollectiveTimeoutError", "CollectiveError"}, reports
    elapsed = {r: round(reports[r]["elapsed"], 2) for r in (0, 1, 3)}
    diagnosis_s = settings.current().watchdog_interval + 1.0
    assert all(e < timeout + diagnosis_s + 1 for e in elapsed.values()), (elapsed, reports)
