"""The builtin ``c10d`` rendezvous backend: one agent hosts a TCPStore at ``--rdzv-endpoint``.

Node 0 (or the only node) hosts it; the agents' rounds and the workers' job
keys both live there, so the job cannot re-form once that agent is gone
(``--rdzv-backend etcd`` can).
"""

from __future__ import annotations

from collections.abc import Iterable

from spmd.launch.args import RunConfig
from spmd.launch.rdzv_backends import RendezvousBackend, RendezvousBackendSpec
from spmd.launch.rendezvous import (
    Membership,
    Rendezvous,
    connect_store,
    free_port,
    local_address_towards,
)
from spmd.markers import hookimpl


class C10dRendezvous(RendezvousBackend):
    """The agents' TCPStore, hosted by this agent or reached at the endpoint."""

    def __init__(self, config: RunConfig) -> None:
        if config.standalone:
            self.endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
            self.store, self.hosting = connect_store(self.endpoint, config.rdzv_timeout, host_it=True)
            self.local_address = "127.0.0.1"
            return
        assert config.rdzv_endpoint is not None
        self.endpoint = config.rdzv_endpoint
        # node 0 hosts; so does the only node of a one-node job: a port already taken by
        # something else must be an error at once, not a wait on a stranger's socket
        host_it = True if config.node_rank == 0 or config.max_nodes == 1 else (False if config.node_rank else None)
        self.store, self.hosting = connect_store(self.endpoint, config.rdzv_timeout, host_it)
        host, _, port = self.endpoint.rpartition(":")
        self.local_address = local_address_towards(host, int(port))

    def round_store(self, rdzv: Rendezvous, membership: Membership) -> tuple[str, bool]:
        return self.endpoint, self.hosting  # the workers keep their keys in the agents' store


@hookimpl
def spmd_rendezvous_backends() -> Iterable[RendezvousBackendSpec]:
    return [RendezvousBackendSpec("c10d", C10dRendezvous, "a TCPStore hosted by node 0's agent at --rdzv-endpoint (torchrun's c10d and static)")]
