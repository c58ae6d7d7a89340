"""1,000 agents (threads, no training) through one rendezvous round, on the agent-hosted TCPStore and on etcd.

Each simulated agent runs ``Rendezvous.join`` as ``spmd run``'s agent does. On
c10d each has its own TCPStore client (connected in its own thread, as agents
on their own hosts connect at once). On etcd the threads share one EtcdStore
(one client, which keeps a connection per thread): 1,000 stores in one process
would be 2,000 lease keep-alive threads and 1,000 lease grants, the cost of
simulating hosts here, not of the rendezvous. Prints the time of the round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as tdist

from spmd.comm.tcp_store import host_tcp_store
from spmd.launch.etcd_client import EtcdClient, parse_endpoints
from spmd.launch.etcd_store import EtcdStore
from spmd.launch.rendezvous import Membership, Rendezvous

AGENTS = 1000
TIMEOUT = 120.0


def _round(connect: Callable[[], tdist.Store], wait_on_store: bool = False) -> tuple[float, list[Membership]]:
    """Every agent connects, then (all at once) joins round 0 of one job; (seconds from the start to the last member, members)."""
    results: list[Membership | None] = [None] * AGENTS
    errors: list[BaseException] = []
    connected = threading.Barrier(AGENTS + 1, timeout=TIMEOUT)

    def agent(i: int) -> None:
        try:
            store = connect()
            connected.wait()
            rdzv = Rendezvous(store, "scale", AGENTS, AGENTS, TIMEOUT, 1.0, wait_on_store=wait_on_store)
            results[i] = rdzv.join(1, None, f"10.{i // 250}.{i % 250}.1")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            connected.abort()

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(AGENTS)]
    for t in threads:
        t.start()
    connected.wait()
    started = time.monotonic()
    for t in threads:
        t.join(TIMEOUT)
    took = time.monotonic() - started
    assert not errors, errors[:3]
    members = [m for m in results if m is not None]
    assert len(members) == AGENTS
    return took, members


def _check(members: list[Membership]) -> None:
    """One round, every agent in it once, all agreeing on who is where and on the master."""
    assert sorted(m.node_rank for m in members) == list(range(AGENTS))
    assert len({(m.round, m.num_nodes, m.hosts, m.master_addr, m.master_port) for m in members}) == 1
    first = members[0]
    assert sorted(first.hosts) == sorted(f"10.{i // 250}.{i % 250}.1" for i in range(AGENTS)) and first.world_size == AGENTS


def test_a_thousand_agents_meet_on_the_agent_hosted_store():
    server = host_tcp_store("127.0.0.1", 0, None, timedelta(seconds=TIMEOUT), wait_for_workers=False, multi_tenant=False)
    took, members = _round(lambda: tdist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=TIMEOUT)))
    _check(members)
    print(f"c10d: {AGENTS} agents through one round in {took:.1f} s")


def test_a_thousand_agents_meet_on_etcd(etcd_server):
    # The 1,000 simulated agents share this one store, its lease and the thread that keeps it alive, which
    # competes with all of them for the GIL: on a loaded 2-core host it once went 10 s (AGENT_TTL) without a
    # turn. A real agent's keep-alive has a process to itself; the simulation's gets a longer lease.
    store = EtcdStore(EtcdClient(parse_endpoints(etcd_server.endpoint), timeout=30.0), b"/scale/", TIMEOUT, agent_ttl=60)
    try:
        took, members = _round(lambda: store, wait_on_store=True)
    finally:
        store.close(revoke=True)
    _check(members)
    print(f"etcd: {AGENTS} agents through one round in {took:.1f} s")
