"""`spmd run --rdzv-backend etcd`: the etcd client and store against a real etcd, and whole jobs that lose a node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as tdist
from launch_helpers import clean_env, wait_for

from spmd.errors import RendezvousUnreachableError
from spmd.launch.etcd_client import EtcdClient, parse_endpoints
from spmd.launch.etcd_store import EtcdStore
from spmd.launch.rendezvous import Rendezvous
from spmd.testing.ports import free_port

SCRIPTS = Path(__file__).parent / "launch_scripts"
SPMD = [sys.executable, "-m", "spmd"]


def _store(server, prefix: str = "/t/", timeout: float = 5.0) -> EtcdStore:
    return EtcdStore(EtcdClient(parse_endpoints(server.endpoint), timeout=2.0), prefix.encode(), timeout)


def test_store_answers_as_tcpstore_does(etcd_server):
    """The same calls on a real TCPStore and on etcd give the same answers (compare_set's odd cases included)."""
    etcd = _store(etcd_server)
    tcp = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5))
    calls = [
        ("add", "n", 3), ("add", "n", 0), ("add", "n", -1),
        ("compare_set", "c", "", "first"), ("compare_set", "c", "", "second"), ("compare_set", "c", "first", "third"),
        ("compare_set", "missing", "x", "y"), ("check", ["c"]), ("check", ["c", "nope"]),
        ("set", "s", "v"), ("get", "s"), ("get", "c"), ("get", "n"), ("delete_key", "s"), ("check", ["s"]),
    ]
    for name, *args in calls:
        mine, theirs = getattr(etcd, name)(*args), getattr(tcp, name)(*args)
        assert mine == theirs, (name, args, mine, theirs)
    etcd.close(revoke=True)


def test_add_is_atomic_across_agents(etcd_server):
    """Four clients adding at once lose no update (each add is a compare-and-swap on the key's revision)."""
    stores = [_store(etcd_server) for _ in range(4)]
    seen: list[int] = []

    def body(store: EtcdStore) -> None:
        seen.extend(store.add("count", 1) for _ in range(15))

    threads = [threading.Thread(target=body, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(seen) == list(range(1, 61)) and stores[0].add("count", 0) == 60
    assert len({s.lease.id for s in stores}) == 1  # one job, one lease
    for s in stores:
        s.close(revoke=False)


def test_get_waits_for_the_key_then_times_out_naming_it(etcd_server):
    store = _store(etcd_server, timeout=1.0)
    threading.Timer(0.3, lambda: store.set("later", b"here")).start()
    assert store.get("later") == b"here"
    started = time.monotonic()
    with pytest.raises(Exception, match="rendezvous key 'never' was not set within 1 s"):
        store.get("never")
    assert time.monotonic() - started < 3
    store.close(revoke=True)


def test_revoking_the_lease_deletes_the_jobs_keys(etcd_server):
    store = _store(etcd_server, prefix="/gone/")
    store.set("a", b"1")
    store.add("b", 2)
    client = EtcdClient(parse_endpoints(etcd_server.endpoint))
    assert len(client.get_prefix(b"/gone/")) == 3  # a, b and the lease's own key
    store.close(revoke=True)
    assert client.get_prefix(b"/gone/") == []


def test_a_killed_agents_own_keys_expire_with_its_lease_and_the_jobs_stay(etcd_server):
    """Keys an agent ``set`` hang on its own lease, which it keeps alive: alive past the TTL they stay; SIGKILLed,
    they are gone within the TTL. The job's counters stay on the job's lease, which the other agent keeps alive."""
    survivor = _store(etcd_server, prefix="/lease/")
    code = ("import sys, time\n"
            "from spmd.launch.etcd_client import EtcdClient, parse_endpoints\n"
            "from spmd.launch.etcd_store import EtcdStore\n"
            "s = EtcdStore(EtcdClient(parse_endpoints(sys.argv[1]), timeout=2.0), b'/lease/', 10.0, agent_ttl=2)\n"
            "s.set('node1', b'me'); s.add('arrivals', 1); print('ready', flush=True); time.sleep(120)\n")
    agent = subprocess.Popen([sys.executable, "-c", code, etcd_server.endpoint], env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None and agent.stdout.readline() == "ready\n"
        client = EtcdClient(parse_endpoints(etcd_server.endpoint))
        time.sleep(3)  # past the TTL: the agent's keep-alives hold its key
        assert client.get(b"/lease/keys/node1") is not None
    finally:
        agent.kill()
        agent.wait(10)
    killed = time.monotonic()
    wait_for(lambda: client.get(b"/lease/keys/node1") is None, 10, "the killed agent's key to expire")
    print(f"the killed agent's key expired {time.monotonic() - killed:.1f} s after the kill (TTL 2 s)")
    assert time.monotonic() - killed < 4
    assert survivor.add("arrivals", 0) == 1  # the job's counter outlives the agent
    survivor.close(revoke=True)


def test_two_agents_form_a_round_on_etcd(etcd_server):
    """The numbered-round rendezvous runs unchanged on etcd: two joiners agree on ranks and master."""
    results: dict[str, object] = {}

    def agent(host: str) -> None:
        store = _store(etcd_server, prefix="/r/")  # (held here: torch's PrefixStore keeps no Python reference to it)
        rdzv = Rendezvous(store, "job", 2, 2, 10, 0.1, poll=0.01)
        results[host] = rdzv.join(1, None, host)
        store.close(revoke=False)

    threads = [threading.Thread(target=agent, args=(h,)) for h in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a, b = results["a"], results["b"]
    assert {a.node_rank, b.node_rank} == {0, 1} and a.hosts == b.hosts and (a.master_addr, a.master_port) == (b.master_addr, b.master_port)


def test_endpoints_fail_over_and_an_unreachable_etcd_is_named_fast(etcd_server):
    dead = f"127.0.0.1:{free_port()}"
    client = EtcdClient(parse_endpoints(f"{dead},{etcd_server.endpoint}"), timeout=2.0)
    client.put(b"k", b"v")
    assert client.get(b"k").value == b"v"
    started = time.monotonic()
    with pytest.raises(RendezvousUnreachableError, match=f"no etcd endpoint answered .*{dead}.*check that etcd runs at --rdzv-endpoint {dead}"):
        EtcdClient(parse_endpoints(dead), timeout=2.0).get(b"k")
    assert time.monotonic() - started < 2


def test_spmd_run_with_etcd_unreachable_exits_fast_with_the_named_error():
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = subprocess.run([*SPMD, "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", dead, "--nnodes", "2", str(SCRIPTS / "report.py")],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and time.monotonic() - started < 15
    assert "no etcd endpoint answered /v3/kv/range within" in out.stderr and f"--rdzv-endpoint {dead}" in out.stderr, out.stderr


def _agents(cmd: list[str], n: int = 2) -> list[subprocess.Popen]:
    return [subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for _ in range(n)]


def test_two_agents_run_a_job_over_etcd_and_leave_no_keys(etcd_server):
    cmd = [*SPMD, "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "pair",
           "--nnodes", "2", "--nproc-per-node", "1", str(SCRIPTS / "spmd_report.py")]
    agents = _agents(cmd)
    outs = [a.communicate(timeout=60) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1] for o in outs]
    lines = sorted(line for o in outs for line in o[0].splitlines() if "REPORT " in line)
    assert len(lines) == 2 and all('"sum": 1.0' in line for line in lines)  # 0 + 1, all-reduced over both nodes
    assert EtcdClient(parse_endpoints(etcd_server.endpoint)).get_prefix(b"/spmd/pair/") == []  # the last agent revoked the job's lease


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_with_worker_store_etcd_the_workers_keep_their_keys_on_etcd_and_the_job_runs(etcd_server, backend):
    """--rdzv-conf worker_store=etcd: no agent hosts a store; the workers' spmd.init, Gloo's or shm's own rendezvous,
    the mesh's groups and the health checks all go through etcd, every sum is right, and no key is left."""
    from test_default_backend import SCRIPT, reports

    cmd = [*SPMD, "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", f"workers-{backend}",
           "--rdzv-conf", "worker_store=etcd", "--nnodes", "2", "--nproc-per-node", "2", str(SCRIPT)]
    agents = [subprocess.Popen(cmd, env=clean_env(SPMD_BACKEND=backend, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True) for _ in range(2)]
    outs = [a.communicate(timeout=90) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1][-3000:] for o in outs]
    got = reports(outs[0][0] + outs[1][0])
    assert [r["rank"] for r in got] == [0, 1, 2, 3]
    for r in got:
        assert r["store"] == "etcd" and r["world"] == backend, r
        assert r["replicate"]["sum"] == r["replicate"]["expected"] and r["shard"]["sum"] == r["shard"]["expected"], r
        assert r["world_sum"][0] == r["world_sum"][1], r
    assert EtcdClient(parse_endpoints(etcd_server.endpoint)).get_prefix(f"/spmd/workers-{backend}/".encode()) == []


def test_a_worker_store_that_is_not_node_or_etcd_is_refused(etcd_server):
    out = subprocess.run([*SPMD, "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-conf",
                          "worker_store=redis", str(SCRIPTS / "spmd_report.py")], env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "--rdzv-conf worker_store=redis: use node or etcd" in out.stderr, out.stderr[-2000:]


def test_the_survivor_reforms_the_job_after_the_store_hosting_node_is_killed(etcd_server, tmp_path):
    """Node 0 hosts round 0's worker store; SIGKILL it (agent and workers). The other agent restarts alone
    (--nnodes 1:2, --max-restarts 1) in a round it is node 0 of, hosting a new store, and finishes."""
    cmd = [*SPMD, "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "survive",
           "--nnodes", "1:2", "--last-call", "1", "--max-restarts", "1", "--nproc-per-node", "1", "--monitor-interval", "0.05",
           str(SCRIPTS / "etcd_steps.py"), str(tmp_path)]
    agents = _agents(cmd)
    try:
        try:
            wait_for(lambda: (tmp_path / "ready-0").exists() and (tmp_path / "ready-1").exists(), 30, "both nodes' workers")
        except AssertionError:
            for a in agents:
                os.killpg(a.pid, signal.SIGKILL)
            raise AssertionError([a.communicate(timeout=10) for a in agents]) from None
        host_pid = int((tmp_path / "ready-0").read_text())
        victim = next(a for a in agents if a.pid == host_pid)
        survivor = next(a for a in agents if a is not victim)
        started = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        out, err = survivor.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.communicate(timeout=10)
    assert survivor.returncode == 0, err
    done = [line for line in out.splitlines() if line.startswith("DONE")]
    assert len(done) == 1 and done[0].startswith("DONE world=1 restart=1 sum=1.0"), out
    assert "restarting the group (1/1)" in err
    print(f"survivor finished {took:.1f} s after the kill")


@pytest.mark.parametrize(("flags", "message"), [
    (["--rdzv-backend", "zk", "--rdzv-endpoint", "127.0.0.1:1"], "--rdzv-backend 'zk': no plugin provides it; installed: c10d, etcd"),
    (["--rdzv-backend", "etcd"], "--rdzv-backend etcd meets at --rdzv-endpoint: pass its address"),
])
def test_a_backend_that_cannot_be_used_is_named(flags, message):
    out = subprocess.run([*SPMD, "run", *flags, str(SCRIPTS / "report.py")], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and message in out.stderr, out.stderr
