"""The builtin ``etcd`` rendezvous backend: the agents meet on an etcd v3 cluster, which no agent hosts.

``spmd run --rdzv-backend etcd --rdzv-endpoint etcd0:2379[,etcd1:2379]`` runs
the same numbered rounds as ``c10d`` on etcd keys (``etcd_store.EtcdStore``).
The workers still need a c10d store: each round's node 0 hosts a fresh
TCPStore for that round and publishes its address in the round's keys, so
when that node dies the survivors' next round elects another host.

The job's keys live under ``job_prefix(rdzv_id, token)``, which holds a hash
of the job token (``--rdzv-token``) when there is one. etcd lets any client
with read access list keys, so the token alone hides nothing: on a shared
etcd, enable auth and give each job a user whose role grants readwrite on
exactly that prefix (the operator does, with etcd's root user; see
docs/rendezvous.md). spmd does not create roles itself: that needs root's
password on every node, the one credential a job must not hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as tdist

from spmd.comm.tcp_store import host_tcp_store
from spmd.launch import worker_store
from spmd.launch.args import RunConfig
from spmd.launch.etcd_client import EtcdClient, parse_endpoints
from spmd.launch.etcd_security import security_from_conf
from spmd.launch.etcd_store import EtcdStore
from spmd.launch.rdzv_backends import RendezvousBackend, RendezvousBackendSpec
from spmd.launch.rendezvous import Membership, Rendezvous, local_address_towards
from spmd.markers import hookimpl

#: Seconds each request to etcd may take, per endpoint tried.
REQUEST_TIMEOUT = 5.0


def job_prefix(rdzv_id: str, token: str | None) -> bytes:
    """The etcd key prefix of job ``rdzv_id``: ``/spmd/<id>/``, or ``/spmd/<id>/job-<sha256(token)>/`` with a token."""
    if not token:
        return f"/spmd/{rdzv_id}/".encode()
    return f"/spmd/{rdzv_id}/job-{hashlib.sha256(token.encode()).hexdigest()}/".encode()


class EtcdRendezvous(RendezvousBackend):
    """The job's rounds on etcd under ``job_prefix``; this agent hosts the workers' store in rounds where it is node 0
    (or, with ``--rdzv-conf worker_store=etcd``, the workers keep theirs on etcd too: ``spmd.launch.worker_store``)."""

    wakes_waiters = True  # (EtcdStore.wait is a watch)

    def __init__(self, config: RunConfig) -> None:
        if config.rdzv_endpoint is None:
            raise ValueError("--rdzv-backend etcd needs --rdzv-endpoint")  # (args.to_config refuses this first)
        endpoints = parse_endpoints(config.rdzv_endpoint)
        security = security_from_conf(dict(config.rdzv_conf), config.rdzv_endpoint)
        self.client = EtcdClient(endpoints, timeout=min(REQUEST_TIMEOUT, config.rdzv_timeout), security=security)
        self.endpoint = self.client.describe()
        self._etcd = EtcdStore(self.client, job_prefix(config.rdzv_id, config.rdzv_token), config.rdzv_timeout)
        self.store = self._etcd
        host, port = endpoints[0]
        self.local_address = local_address_towards(host, port)
        self.timeout = config.rdzv_timeout
        self._hosted: tdist.TCPStore | None = None  # this agent's round store, while it is the round's node 0
        conf = dict(config.rdzv_conf)
        self._worker_store = worker_store.choice(conf)
        self._worker_url = lambda round_: worker_store.url(
            config.rdzv_endpoint or "", conf, self._etcd.prefix + f"workers/round{round_}/".encode())

    def round_store(self, rdzv: Rendezvous, membership: Membership) -> tuple[str, bool]:
        self._hosted = None  # the last round's store (its workers are stopped) goes
        if self._worker_store == "etcd":  # the workers keep their keys on etcd as well: no agent hosts a store, and
            # node 0, as it would as the host, waits for the others to leave and then deletes the job's keys
            return self._worker_url(membership.round), membership.node_rank == 0
        if membership.node_rank == 0:
            hosted = host_tcp_store(self.local_address, 0, None, timedelta(seconds=self.timeout), wait_for_workers=False, multi_tenant=False)
            self._hosted = hosted
            rdzv.set(membership.round, "store", f"{self.local_address}:{hosted.port}")
            return f"{self.local_address}:{hosted.port}", True
        return rdzv.get(membership.round, "store"), False  # waits for node 0 to publish it

    def close(self, last: bool) -> None:
        self._hosted = None
        self._etcd.close(revoke=last)


@hookimpl
def spmd_rendezvous_backends() -> Iterable[RendezvousBackendSpec]:
    return [RendezvousBackendSpec("etcd", EtcdRendezvous, "an etcd v3 cluster at --rdzv-endpoint (no agent hosts the rendezvous; "
                                  "each round's node 0 hosts that round's worker store)")]
