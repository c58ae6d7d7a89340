"""spmd.init()'s own choice of backend: spmd-shm for a CPU group whose ranks share one host, Gloo for a group
across hosts (which ranks share a host is asked through the job's store), SPMD_BACKEND to choose another."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as tdist
from launch_helpers import clean_env

from spmd.comm import hosts
from spmd.comm.registry import backends
from spmd.errors import CollectiveTimeoutError

SCRIPT = Path(__file__).parent / "launch_scripts" / "default_backends.py"


def reports(stdout: str) -> list[dict]:
    return sorted((json.loads(line.partition("REPORT ")[2]) for line in stdout.splitlines() if line.startswith("REPORT ")),
                  key=lambda r: r["rank"])


def test_a_one_host_backend_comes_first_only_for_a_group_on_one_host():
    asked = []

    def spans() -> bool:
        asked.append(1)
        return True

    assert backends().for_device("cpu").spec.name == "shm"
    assert backends().for_device("cpu", lambda: False).spec.name == "shm"
    assert backends().for_device("cpu", spans).spec.name == "gloo" and asked == [1]
    assert backends().get("shm").spec.one_host and not backends().get("gloo").spec.one_host
    # the choice also names what it passed over (the hierarchical all_reduce's part inside each host)
    across, one_host = backends().choose("cpu", lambda: True), backends().choose("cpu", lambda: False)
    assert (across.entry.spec.name, across.passed_over.spec.name) == ("gloo", "shm")
    assert (one_host.entry.spec.name, one_host.passed_over) == ("shm", None)


def test_doctor_says_when_an_all_reduce_across_hosts_is_hierarchical():
    out = subprocess.run([sys.executable, "-m", "spmd", "doctor"], capture_output=True, text=True, timeout=60,
                         env=clean_env(SPMD_HIERARCHICAL_MIN_BYTES="4096"))
    assert ("where a host holds 2+ of such a group's ranks, its all_reduce of 4096 B and more is hierarchical: "
            "shm inside each host, gloo between hosts") in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-m", "spmd", "doctor"], capture_output=True, text=True, timeout=60,
                         env=clean_env(SPMD_HIERARCHICAL_MIN_BYTES="off"))
    assert "default for cpu: shm for a group" in out.stdout and "hierarchical" not in out.stdout, out.stdout


def test_host_identities_are_read_once_and_a_rank_that_never_said_is_named():
    store = tdist.HashStore()
    hosts.publish(store, 0)
    store.set("spmd/hosts/1", hosts.host_identity())
    store.set("spmd/hosts/2", "node-b|another-boot|pid:[1]")
    assert not hosts.spans_hosts(store, [0, 1], 1.0)
    assert hosts.spans_hosts(store, [1, 2], 1.0)
    store.set("spmd/hosts/2", hosts.host_identity())  # (already read: the answer stays this world's first)
    assert hosts.spans_hosts(store, [0, 2], 1.0)
    assert "ranks [2] on node-b (pid:[1])" in hosts.describe(hosts.identities(store, [0, 2], 1.0), [0, 2])
    with pytest.raises(CollectiveTimeoutError, match=r"ranks \[3\] did not say which host"):
        hosts.identities(store, [0, 3], 0.2)


@pytest.mark.parametrize("forced", [None, "gloo"])
def test_every_group_of_a_one_host_job_gets_shm_unless_a_backend_is_set(forced):
    env = clean_env(OMP_NUM_THREADS="1") | ({"SPMD_BACKEND": forced} if forced else {})
    out = subprocess.run([sys.executable, "-m", "spmd", "run", "--nproc-per-node", "4", str(SCRIPT)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = reports(out.stdout)
    assert [r["rank"] for r in got] == [0, 1, 2, 3]
    for r in got:
        assert {r["world"], r["replicate"]["backend"], r["shard"]["backend"]} == {forced or "shm"}, r
        assert r["replicate"]["sum"] == r["replicate"]["expected"] and r["shard"]["sum"] == r["shard"]["expected"], r
        assert r["world_sum"][0] == r["world_sum"][1], r
