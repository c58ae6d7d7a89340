"""Agents' heartbeats in the round's keys: how an agent tells a node that is gone from one that is slow.

Each agent bumps ``r<N>/beat<node rank>`` every ``BEAT_S`` seconds from a
daemon thread on its own store client, so it beats while its main thread
waits for workers to stop. Another agent that watches a node's counter and
sees it stand still for ``SILENT_S`` seconds takes the node as gone (killed,
its machine down, or its link cut): no clocks of two hosts are compared.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as tdist

from spmd.comm.tcp_store import own_client

#: Seconds between two beats of one agent.
BEAT_S = 0.25
#: Seconds a node's counter must stand still, while watched, for its agent to count as gone.
SILENT_S = 2.0


def beat_key(round_: int, node_rank: int) -> str:
    """The counter a node's agent bumps in round ``round_`` (under the rendezvous' prefix)."""
    return f"r{round_}/beat{node_rank}"


class Heartbeat:
    """This agent's beats for one round, from a daemon thread; ``stop()`` ends them (at exit, or the round's end)."""

    def __init__(self, store: tdist.Store, round_: int, node_rank: int) -> None:
        self.key = beat_key(round_, node_rank)
        self.client = own_client(store)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="spmd-agent-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.client.add(self.key, 1)  # the first beat before the workers start: watchers see it at once
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stopped.wait(BEAT_S):
            try:
                self.client.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the main thread reports that
                return

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(2 * BEAT_S + 1.0)


class Watch:
    """Watches some nodes' counters in one round; ``silent()`` names those that stood still ``SILENT_S`` seconds."""

    def __init__(self, store: tdist.Store, round_: int, nodes: list[int], silent_s: float = SILENT_S) -> None:
        self.store, self.round, self.silent_s = store, round_, silent_s
        self.seen: dict[int, tuple[int, float]] = {n: (self._count(n), time.monotonic()) for n in nodes}
        self.next_look = time.monotonic()

    def due(self) -> bool:
        """Whether a look is due: callers look at most four times per ``silent_s`` (each look reads every node's key)."""
        now = time.monotonic()
        if now < self.next_look:
            return False
        self.next_look = now + self.silent_s / 4
        return True

    def _count(self, node: int) -> int:
        return int(self.store.add(beat_key(self.round, node), 0))

    def silent(self, nodes: list[int] | None = None) -> list[int]:
        """Of ``nodes`` (default: all watched), those whose counter has not moved for ``silent_s`` seconds."""
        now, gone = time.monotonic(), []
        for node in self.seen if nodes is None else nodes:
            count = self._count(node)
            last, since = self.seen.get(node, (count, now))
            if count != last or node not in self.seen:
                self.seen[node] = (count, now)
            elif now - since >= self.silent_s:
                gone.append(node)
        return gone
