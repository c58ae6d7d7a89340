"""Rendezvous backends of ``spmd run``: where the agents meet, as plugins (``spmd_rendezvous_backends``).

A backend gives the agent a key-value store with torch's Store API (``add``,
``compare_set``, ``check``, ``set``, ``get``, ``delete_key``), on which the
numbered rounds of ``spmd.launch.rendezvous.Rendezvous`` run, and tells each
round's workers which c10d store to keep their job keys in. Builtin: ``c10d``
(one agent hosts a TCPStore; torchrun's ``static`` is the same) and ``etcd``
(an etcd v3 cluster; no agent hosts anything the next round needs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from spmd import hookspecs
from spmd.errors import NotProvidedError, PluginSpecError
from spmd.launch.args import RunConfig, canonical
from spmd.registry import Registry
from spmd.specs import RendezvousBackendSpec

if TYPE_CHECKING:
    import torch.distributed as tdist

    from spmd.launch.rendezvous import Membership, Rendezvous

class RendezvousBackend(ABC):
    """One agent's link to its job's rendezvous: the agents' store, and each round's store for the workers."""

    #: The agents' store (torch Store API); the rounds' keys live there.
    store: tdist.Store
    #: Where the store is, as messages name it (``host:port``, or several for etcd).
    endpoint: str
    #: The address of this node that the other nodes reach it at.
    local_address: str
    #: Whether this agent hosts the agents' store (its exit ends the rendezvous: it leaves last).
    hosting: bool = False
    #: Whether the store's ``wait`` wakes the moment a key is set, quietly (then the rounds wait on it rather than poll).
    wakes_waiters: bool = False

    @abstractmethod
    def round_store(self, rdzv: Rendezvous, membership: Membership) -> tuple[str, bool]:
        """``host:port`` of the c10d store this round's workers use, and whether this agent hosts it
        (then the agent leaves only after every other agent has read the round's outcome)."""

    def close(self, last: bool) -> None:  # noqa: B027 - optional
        """Release what the agent holds; ``last``: every other agent has left, the job's keys may go."""


RENDEZVOUS_BACKENDS: Registry[str, RendezvousBackendSpec] = Registry(
    hookspecs.spmd_rendezvous_backends, "rendezvous backend", RendezvousBackendSpec)


def open_backend(config: RunConfig) -> RendezvousBackend:
    """Connect this agent to the rendezvous that ``config.rdzv_backend`` names; an error listing the others if none does."""
    entry = RENDEZVOUS_BACKENDS.find(canonical(config.rdzv_backend))
    if entry is None:
        raise NotProvidedError(
            f"--rdzv-backend {config.rdzv_backend!r}: no plugin provides it; installed: {', '.join(RENDEZVOUS_BACKENDS.keys()) or 'none'} "
            "(`spmd plugins` lists what each plugin provides)"
        )
    backend = entry.spec.factory(config)
    if not isinstance(backend, RendezvousBackend):
        raise PluginSpecError(
            f"rendezvous backend {entry.key!r} (plugin {entry.plugin!r}): its factory returned {type(backend).__name__}, "
            "not a spmd.launch.rdzv_backends.RendezvousBackend; a factory must build an instance of a subclass of it"
        )
    return backend
