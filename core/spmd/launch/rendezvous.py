"""Store-based rendezvous between the agents of one job, in numbered rounds.

One agent hosts a TCPStore at the rendezvous endpoint; every agent joins the
current round by incrementing an arrival counter. The round closes when
``max_nodes`` arrived, or ``min_nodes`` arrived and ``last_call`` seconds passed
with no newcomer. Agents that arrive after it closed ask the running agents to
start a new round (elastic scale-up), unless it closed with ``max_nodes``: then
they wait, without disturbing it, for a later round (one forms after a
failure). A failure, a join request or a shutdown is a key in the round's
namespace that every agent polls.

Keys (under ``rdzv/<id>/``): ``round``; per round ``r<N>/arrivals``,
``r<N>/node<i>`` (json: host, nproc, requested node rank), ``r<N>/closed``
(number of members), ``r<N>/members`` (every member's record, in arrival order), ``r<N>/master``, ``r<N>/failed``, ``r<N>/join``,
``r<N>/done`` (a counter), ``r<N>/left`` (agents that saw every node done:
the one hosting the store leaves after them), and ``shutdown``.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as tdist

from spmd.comm.address import route_source
from spmd.comm.tcp_store import host_tcp_store
from spmd.errors import SpmdError
from spmd.polling import poll

#: Seconds between two looks at a round's arrivals, per agent waiting in it (see ``Rendezvous._pause_until``).
PAUSE_PER_AGENT = 0.001
#: The same where the store wakes the waiters at the close (etcd): the looks then only serve --last-call and shutdowns.
WATCHED_PAUSE_PER_AGENT = 0.002


@dataclass(frozen=True)
class Membership:
    """The outcome of one rendezvous round, as this agent sees it."""

    round: int
    node_rank: int
    num_nodes: int
    nprocs: tuple[int, ...]  # per node rank
    hosts: tuple[str, ...]
    master_addr: str
    master_port: int
    #: host:port of the agents' rendezvous store; workers keep their job state there (not in a
    #: store that rank 0 hosts), so it outlives any worker and a failure can still be diagnosed.
    store_endpoint: str | None = None

    @property
    def world_size(self) -> int:
        return sum(self.nprocs)

    @property
    def rank_offset(self) -> int:
        return sum(self.nprocs[: self.node_rank])


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine that ``host`` would see (for MASTER_ADDR)."""
    if host in ("localhost", "127.0.0.1", "::1", ""):
        return "127.0.0.1"
    return route_source(host, port) or socket.gethostbyname(socket.gethostname())


def connect_store(endpoint: str, timeout: float, host_it: bool | None) -> tuple[tdist.Store, bool]:
    """Host the store at ``endpoint`` if we can (or must), else connect to it; returns (store, hosting)."""
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        raise SpmdError(f"--rdzv-endpoint {endpoint!r}: write host:port, e.g. node0:29400")
    port = int(port_text)
    delta = timedelta(seconds=timeout)
    if host_it is not False:
        try:
            return host_tcp_store(host, port, None, delta, wait_for_workers=False, multi_tenant=False), True
        except Exception as error:  # noqa: BLE001 - someone else hosts it (or must)
            if host_it:
                raise SpmdError(
                    f"could not host the rendezvous store on {endpoint}: {error}; this node must host it "
                    "(node 0, or the only node): choose a free port, or an address of this machine"
                ) from error
    try:
        return tdist.TCPStore(host, port, None, False, delta), False
    except Exception as error:  # noqa: BLE001
        raise SpmdError(
            f"could not reach the rendezvous store at {endpoint} within {timeout:.0f} s ({error}); "
            "check that the node hosting it is up and the address is reachable from here"
        ) from error


class Rendezvous:
    """Rounds of membership for one job id over one store."""

    def __init__(self, store: tdist.Store, run_id: str, min_nodes: int, max_nodes: int, timeout: float, last_call: float, poll: float = 0.05,
                 wait_on_store: bool = False) -> None:
        self.store = tdist.PrefixStore(f"rdzv/{run_id}/", store)
        #: Whether the store's ``wait`` returns the moment a key is set, quietly (etcd's watches; TCPStore logs each timeout).
        self.wait_on_store = wait_on_store
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.timeout, self.last_call, self.poll = timeout, last_call, poll

    # -- round bookkeeping -------------------------------------------------------------
    def current_round(self) -> int:
        return int(self.store.add("round", 0))

    def advance_from(self, round_: int) -> int:
        """Move the job from round ``round_`` to ``round_ + 1`` once, however many agents ask; return the round now.

        A compare-and-set on the store: agents that restart after the same
        failure all call this, and reading the round then adding to it let two
        of them add one each, skipping a round (agents then waited in
        different rounds until the rendezvous timed out).
        """
        self.current_round()  # the counter exists from here on (``add`` keeps it as a decimal string)
        return int(self.store.compare_set("round", str(round_), str(round_ + 1)))

    def key(self, round_: int, name: str) -> str:
        return f"r{round_}/{name}"

    def flag(self, round_: int, name: str) -> bool:
        return self.store.check([self.key(round_, name)])

    def set(self, round_: int, name: str, value: str) -> None:
        self.store.set(self.key(round_, name), value)

    def get(self, round_: int, name: str) -> str:
        return self.store.get(self.key(round_, name)).decode()

    def shutdown_requested(self) -> str | None:
        if self.store.check(["shutdown"]):
            return self.store.get("shutdown").decode()
        return None

    # -- joining ---------------------------------------------------------------------------
    def join(self, nproc: int, node_rank: int | None, host: str, is_shutdown=lambda: None) -> Membership:  # type: ignore[no-untyped-def]
        """Join the next open round and wait until it closes with this agent inside."""
        deadline = time.monotonic() + self.timeout
        while True:
            round_ = self.current_round()
            if self.flag(round_, "closed"):
                if int(self.get(round_, "closed")) < self.max_nodes:
                    # Too late for this round, which has room: ask the running agents for a new one, then wait for it.
                    self.set(round_, "join", host)
                    what = "a new round after asking to join"
                else:
                    # The round is full: leave it alone (as torchrun's redundancy list) and take a later one if one forms.
                    what = f"a place in the job (round {round_} has the most nodes, {self.max_nodes}; a later round may take this agent)"
                self._wait(lambda closed=round_: self.current_round() > closed, deadline, what)
                continue
            index = int(self.store.add(self.key(round_, "arrivals"), 1)) - 1
            self.set(round_, f"node{index}", json.dumps({"host": host, "nproc": nproc, "node_rank": node_rank}))
            members = self._wait_closed(round_, index, deadline)
            if members is None:
                continue  # arrived after the close: go round again
            return self._membership(round_, index, members)

    def _wait(self, condition, deadline: float, what: str) -> None:  # type: ignore[no-untyped-def]
        def met() -> bool:
            if condition():
                return True
            reason = self.shutdown_requested()
            if reason:
                raise SpmdError(f"rendezvous aborted: {reason}")
            return False

        if not poll(met, deadline - time.monotonic(), self.poll):
            raise SpmdError(
                f"rendezvous timed out after {self.timeout:.0f} s waiting for {what}; "
                f"are --nnodes ({self.min_nodes}:{self.max_nodes}) agents started with the same --rdzv-id?"
            )

    def _wait_closed(self, round_: int, index: int, deadline: float) -> int | None:
        last_count, last_change = -1, time.monotonic()
        while not self.flag(round_, "closed"):
            count = int(self.store.add(self.key(round_, "arrivals"), 0))
            now = time.monotonic()
            if count != last_count:
                last_count, last_change = count, now
            if count >= self.max_nodes or (count >= self.min_nodes and now - last_change >= self.last_call):
                # First writer wins; others read the same value back.
                self.store.compare_set(self.key(round_, "closed"), "", str(min(count, self.max_nodes)))
                break
            reason = self.shutdown_requested()
            if reason:
                if self.flag(round_, "closed"):  # closed with this node in it before the job ended (a slow
                    break                        # poller): a member, which then sees the failure as one
                raise SpmdError(f"rendezvous aborted: {reason}")
            if now > deadline:
                raise SpmdError(
                    f"rendezvous round {round_} timed out after {self.timeout:.0f} s with {count} of at least "
                    f"{self.min_nodes} nodes; start the missing agents with the same --rdzv-endpoint and --rdzv-id"
                )
            self._pause_until(self.key(round_, "closed"), count)
        members = int(self.get(round_, "closed"))
        return members if index < members else None

    def _member_infos(self, round_: int, index: int, members: int) -> list[dict]:
        """Every member's ``node<i>`` record: the first arrival reads them all in one call and publishes the list as
        ``members``, which the others read (each reading every record made the round O(n²) reads: 1,000 agents, 10⁶)."""
        if index == 0:
            values = self.store.multi_get([self.key(round_, f"node{i}") for i in range(members)])
            infos = [json.loads(bytes(value)) for value in values]
            self.set(round_, "members", json.dumps(infos))
            return infos
        return json.loads(self.get(round_, "members"))

    def _pause_until(self, key: str, waiting: int) -> None:
        """Sleep until ``key`` is set (with ``wait_on_store``: the store wakes us) or the next look is due. Looks come
        ``poll`` apart, slower with many agents waiting (``waiting`` ms each, at most 2 s): a thousand agents
        reading the arrivals every 50 ms would ask the store 20,000 times a second."""
        if self.wait_on_store:  # woken by the close: looks only serve --last-call and a shutdown, so fewer of them
            interval = max(self.poll, min(2.0, self.max_nodes * WATCHED_PAUSE_PER_AGENT))
        else:
            interval = max(self.poll, min(2.0, waiting * PAUSE_PER_AGENT))
        if not self.wait_on_store:
            time.sleep(interval)
            return
        try:
            self.store.wait([key], timedelta(seconds=interval))
        except Exception:  # noqa: BLE001 - not set yet (each store names its timeout differently): look again
            pass

    def _membership(self, round_: int, index: int, members: int) -> Membership:
        infos = self._member_infos(round_, index, members)
        requested = [info["node_rank"] for info in infos]
        if all(r is not None for r in requested) and sorted(requested) == list(range(members)):
            order = sorted(range(members), key=lambda i: requested[i])  # static node ranks
        else:
            order = list(range(members))  # arrival order
        node_rank = order.index(index)
        ordered = [infos[i] for i in order]
        if node_rank == 0:
            addr = ordered[0]["host"]
            self.set(round_, "master", f"{addr}:{free_port()}")
        master = self.store.get(self.key(round_, "master")).decode()  # blocks until node 0 set it
        addr, _, port = master.rpartition(":")
        return Membership(
            round=round_,
            node_rank=node_rank,
            num_nodes=members,
            nprocs=tuple(int(i["nproc"]) for i in ordered),
            hosts=tuple(i["host"] for i in ordered),
            master_addr=addr,
            master_port=int(port),
        )
