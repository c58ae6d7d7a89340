"""Jobs across hosts on the ``spmd_hosts`` test bed: nodes whose hostname resolves to loopback, no GLOO_SOCKET_IFNAME.

Each node is its own network and UTS namespace (spmd.testing.hosts); these tests
skip where the machine cannot make one (not root, no iproute2, no netem).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as tdist
from launch_helpers import clean_env

from spmd.comm.address import binding_for_store, binding_towards, is_loopback, store_endpoint
from spmd.errors import BackendUnavailableError
from spmd.testing.ports import free_port

EXAMPLES = Path(__file__).parent.parent / "examples"
SCRIPTS = Path(__file__).parent / "launch_scripts"
SPMD = [sys.executable, "-m", "spmd"]
#: A small, short training run: the same flags on one host and on two.
TRAIN = ["--log-every", "1", "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "4", "--context", "16",
         "--corpus-chars", "20000"]
STEP = re.compile(r"^step\s+(\d+)\s+loss ([0-9.]+)", re.M)


def losses(stdout: str) -> list[tuple[int, str]]:
    """The (step, loss) lines rank 0 printed, as printed."""
    return [(int(step), loss) for step, loss in STEP.findall(stdout)]


def run_env() -> dict[str, str]:
    """The test's environment for a job, without any interface override (the point of these tests)."""
    env = clean_env(OMP_NUM_THREADS="1")
    for name in ("GLOO_SOCKET_IFNAME", "SPMD_SOCKET_IFNAME"):
        env.pop(name, None)
    return env


def on_two_nodes(hosts, tmp_path: Path, steps: int, *extra: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start `spmd run --nnodes 2 --nproc-per-node 2` of examples/train.py on the test bed's two nodes."""
    node0, node1 = hosts.nodes
    port = free_port()
    base = [*SPMD, "run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"{node0.address}:{port}",
            "--rdzv-id", "hosts", "--rdzv-timeout", "20", *extra]
    return [
        node.popen([*base, "--node-rank", str(i), str(EXAMPLES / "train.py"), "--steps", str(steps), *TRAIN,
                    "--out", str(tmp_path / f"node{i}.pt")],
                   env=env or run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        for i, node in enumerate(hosts.nodes)
    ]


def one_host_four_ranks(tmp_path: Path, steps: int) -> str:
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "4", str(EXAMPLES / "train.py"), "--steps", str(steps), *TRAIN,
                          "--out", str(tmp_path / "one.pt")], env=run_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def finish(agents: list[subprocess.Popen], timeout: float = 120) -> list[tuple[str, str]]:
    return [agent.communicate(timeout=timeout) for agent in agents]


# -- the kernel's helper, on real stores and a real route ----------------------------------------


def test_the_store_endpoint_is_read_through_every_prefix():
    from datetime import timedelta

    server = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5))
    wrapped = tdist.PrefixStore("cpu/", tdist.PrefixStore("job/", server))
    assert store_endpoint(wrapped) == ("127.0.0.1", server.port)
    assert store_endpoint(tdist.HashStore()) is None
    loopback = binding_for_store(wrapped)
    assert loopback.address is None and "loopback" in loopback.reason  # one host: nothing changes
    assert is_loopback("127.0.1.1") and is_loopback("localhost") and not is_loopback("10.0.0.1")


def test_an_interface_setting_that_names_no_interface_is_a_named_error(spmd_setenv):
    spmd_setenv("SPMD_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(BackendUnavailableError, match="SPMD_SOCKET_IFNAME=nosuchif0 names no interface"):
        binding_towards("10.1.2.3", 29500)
    spmd_setenv("SPMD_SOCKET_IFNAME", "lo")
    assert binding_towards("10.1.2.3", 29500).address == "127.0.0.1"


def test_the_binding_on_a_node_is_its_address_towards_the_store_not_its_hostname(spmd_hosts):
    hosts = spmd_hosts(2)
    node0, node1 = hosts.nodes
    probe = ("import socket; from spmd.comm.address import binding_towards; b = binding_towards(%r, 29500); "
             "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), b.address, b.interface)")
    out = node1.run([sys.executable, "-c", probe % node0.address], env=run_env(), timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["node1", "127.0.1.1", node1.address, node1.interface]


def test_doctor_shows_where_each_backend_binds_and_why(spmd_hosts):
    hosts = spmd_hosts(2)
    node0, node1 = hosts.nodes
    env = run_env() | {"MASTER_ADDR": node0.address, "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    out = node1.run([*SPMD, "doctor"], env=env, timeout=60)
    assert f"network: the job's store at {node0.address}:29500; this node: {node1.address} on {node1.interface}" in out.stdout, out.stdout
    assert f"gloo binds to: {node1.address} on {node1.interface} (the address this node reaches the job's store" in out.stdout
    out = node1.run([*SPMD, "doctor"], env=env | {"GLOO_SOCKET_IFNAME": node1.interface}, timeout=60)
    assert f"gloo binds to: interface {node1.interface} (GLOO_SOCKET_IFNAME" in out.stdout, out.stdout


# -- jobs across nodes ---------------------------------------------------------------------------


def test_spmd_gloo_binds_towards_the_store_without_the_launcher(spmd_hosts):
    """MASTER_ADDR/RANK/WORLD_SIZE by hand (as a scheduler sets them): no `spmd run` to set GLOO_SOCKET_IFNAME."""
    hosts = spmd_hosts(3)
    port = free_port()
    ranks = [
        node.popen([sys.executable, str(SCRIPTS / "spmd_report.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                   env=run_env() | {"MASTER_ADDR": hosts.nodes[0].address, "MASTER_PORT": str(port), "RANK": str(i),
                                    "WORLD_SIZE": "3", "LOCAL_RANK": "0", "SPMD_TIMEOUT": "10"})
        for i, node in enumerate(hosts.nodes)
    ]
    outs = finish(ranks, timeout=60)
    assert [r.returncode for r in ranks] == [0, 0, 0], [err[-2000:] for _, err in outs]
    assert all('"sum": 3.0' in out for out, _ in outs)


# -- `spmd run` jobs across nodes ---------------------------------------------------------------------------


def test_two_nodes_train_as_one_host_of_four_ranks(spmd_hosts, tmp_path):
    """No GLOO_SOCKET_IFNAME, hostnames resolving to 127.0.1.1: Gloo binds where the store was reached."""
    hosts = spmd_hosts(2)
    steps = 6
    agents = on_two_nodes(hosts, tmp_path, steps)
    outs = finish(agents)
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outs]
    across = losses(outs[0][0])
    assert [step for step, _ in across] == list(range(steps))
    assert across == losses(one_host_four_ranks(tmp_path, steps))


def test_a_slow_lossy_link_gives_the_same_result(spmd_hosts, tmp_path):
    hosts = spmd_hosts(2)
    from spmd.testing.hosts import TestBedUnavailable

    try:
        hosts.impair(hosts.nodes[1], delay_ms=1, loss_pct=0.1)
    except TestBedUnavailable as reason:
        pytest.skip(str(reason))
    steps = 4
    agents = on_two_nodes(hosts, tmp_path, steps)
    outs = finish(agents)
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outs]
    assert losses(outs[0][0]) == losses(one_host_four_ranks(tmp_path, steps))


def test_a_cut_link_ends_the_job_with_a_named_error_on_the_other_node(spmd_hosts, tmp_path):
    """node1's cable is pulled mid-job: node0's ranks raise CollectiveTimeoutError (naming the op, group and the
    ranks that never arrived) within the group timeout (SPMD_TIMEOUT) and 2.5 s, and node0's agent ends the job
    a few seconds later, naming node 1 as gone."""
    hosts = spmd_hosts(2)
    node0, node1 = hosts.nodes
    timeout_s, grace_s = 6.0, 1.0
    agents = on_two_nodes(hosts, tmp_path, 100_000, "--stop-grace", str(grace_s), env=run_env() | {"SPMD_TIMEOUT": str(timeout_s)})
    errors: list[tuple[float, str]] = []  # (when it arrived, line)
    started = threading.Event()

    def read_out() -> None:
        for line in agents[0].stdout:
            step = STEP.match(line)
            if step and int(step.group(1)) >= 2:
                started.set()

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: errors.extend((time.monotonic(), line) for line in agents[0].stderr), daemon=True)]
    for reader in readers:
        reader.start()
    assert started.wait(90), "".join(line for _, line in errors)[-3000:]
    hosts.cut(node1)
    cut_at = time.monotonic()
    try:
        agents[0].wait(timeout_s + 40)
    finally:
        hosts.restore(node1)
    ended = time.monotonic() - cut_at
    for reader in readers:
        reader.join(5)
    text = "".join(line for _, line in errors)
    named = next((when - cut_at for when, line in errors if "CollectiveTimeoutError" in line), None)
    assert agents[0].returncode != 0 and named is not None, text[-3000:]
    # the timeout, then the diagnosis' wait of up to 2 s for the cut-off ranks' signs of life
    assert named < timeout_s + 2.5, (named, text[-3000:])
    assert f"node 1 ({node1.address}) is gone: its agent stopped beating" in text, text[-3000:]
    # then the failed workers' exit (the interpreter's own teardown, 1-2 s here) and the hosting agent's look at
    # node 1's beats, which stood still since the cut: no wait for the cut-off agent's goodbye
    assert ended < named + 5, (ended, named)


# -- the Gloo conformance suite across hosts ------------------------------------------------------


def test_gloo_conformance_suite_across_hosts(spmd_hosts):
    """Every op of the conformance suite on 4 ranks spread over 2 nodes (ranks alternate), and split groups' new connections."""
    from spmd.testing.conformance.suite import failures_across_hosts

    failures = failures_across_hosts(spmd_hosts(2), "gloo", env=run_env())
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])


def test_the_default_backend_is_shm_inside_a_node_and_gloo_across_nodes(spmd_hosts, tmp_path):
    """spmd.init() with no backend on 2 nodes x 2 ranks, an HSDP-style 2 x 2 mesh: the shard groups (one node each)
    get spmd-shm, the replicate groups and the world (across the nodes) Gloo; every sum is the one-process one."""
    from test_default_backend import SCRIPT, reports

    hosts = spmd_hosts(2)
    port = free_port()
    base = [*SPMD, "run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"{hosts.nodes[0].address}:{port}",
            "--rdzv-id", "defaults", "--rdzv-timeout", "20"]
    agents = [node.popen([*base, "--node-rank", str(i), str(SCRIPT)], env=run_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path) for i, node in enumerate(hosts.nodes)]
    outs = finish(agents, timeout=90)
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outs]
    got = reports(outs[0][0] + outs[1][0])
    assert [r["rank"] for r in got] == [0, 1, 2, 3]
    for r in got:
        assert (r["world"], r["replicate"]["backend"], r["shard"]["backend"]) == ("gloo", "gloo", "shm"), r
        assert r["replicate"]["sum"] == r["replicate"]["expected"] and r["shard"]["sum"] == r["shard"]["expected"], r
        assert r["world_sum"][0] == r["world_sum"][1], r
