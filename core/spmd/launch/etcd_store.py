"""A torch Store on etcd: the agents' rendezvous keys under one job prefix, on two kinds of lease.

``add`` and ``compare_set`` are compare-and-swap transactions on the key's
modification revision, so concurrent agents never lose an update. The keys
they write (counters, first-writer-wins keys) belong to the job and hang on
the job's shared lease, which each running agent keeps alive: when every
agent of the job is gone, they expire with it. A key written by ``set`` is one
agent's own (its membership in a round, the store it hosts, a request it
makes) and hangs on that agent's lease: when the agent is SIGKILLed or cut
off, its keys vanish ``AGENT_TTL`` seconds later. The last agent to leave a
finished job deletes the job's keys at once.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from datetime import timedelta

import torch.distributed as tdist

from spmd.errors import SpmdError
from spmd.launch.etcd_client import NOT_FOUND, EtcdClient, EtcdRequestError, KeyValue, b64

#: Seconds the job's keys outlive the last agent that kept them alive.
LEASE_TTL = 30
#: Seconds an agent's own keys outlive the agent (it refreshes its lease every third of that).
AGENT_TTL = 10
#: Seconds between polls of ``get`` for a key that is not there yet.
GET_POLL = 0.02
#: How a counter's value starts (``add``): ``COUNTER<base>``, for a count of ``base + version - 1``.
COUNTER = b"\0spmd-count:"
#: Seconds of the first random pause after a lost compare-and-swap, doubling per loss up to ``CAS_BACKOFF_MAX``.
CAS_BACKOFF, CAS_BACKOFF_MAX = 0.002, 0.5


def _value(kv: KeyValue) -> bytes:
    """The value a Store user sees: a counter's count as a decimal string (as TCPStore keeps it), else the bytes stored."""
    if kv.value.startswith(COUNTER):
        return str(int(kv.value[len(COUNTER):]) + kv.version - 1).encode()
    return kv.value


class KeptLease:
    """A lease this process refreshes from a daemon thread every ``ttl / 3`` seconds until ``close()``."""

    def __init__(self, client: EtcdClient, lease: int, ttl: int, what: str) -> None:
        self.client, self.id, self.ttl, self.what = client, lease, ttl, what
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, daemon=True, name=f"spmd-etcd-{what}")
        self._thread.start()

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.client.keepalive(self.id) == 0:
                    self.lost = True  # expired: its keys are gone (the next write names it)
                    return
            except SpmdError:
                pass  # etcd unreachable for now: try again; the calls of the rendezvous report it

    def close(self, revoke: bool) -> None:
        """Stop refreshing it; ``revoke``: delete its keys now rather than after the TTL."""
        self._stop.set()
        self._thread.join(timeout=self.client.timeout + 1)
        if revoke:
            self.client.revoke(self.id)


def job_lease(client: EtcdClient, prefix: bytes, ttl: int = LEASE_TTL) -> KeptLease:
    """The job's shared lease: found under ``<prefix>lease`` (another agent's) or granted and published there."""
    key = prefix + b"lease"
    for _ in range(20):
        current = client.get(key)
        if current is not None and client.keepalive(int(current.value)) > 0:
            return KeptLease(client, int(current.value), ttl, "job-lease")  # another agent of the job holds one: share it
        fresh = client.grant(ttl)
        done, _ = client.put_if(key, str(fresh).encode(), mod_revision=current.mod_revision if current else 0, lease=fresh)
        if done:
            return KeptLease(client, fresh, ttl, "job-lease")
        client.revoke(fresh)  # another agent published one first: take theirs
    raise SpmdError(f"could not agree on the job's etcd lease at {client.describe()} in 20 tries; is another job using --rdzv-id?")


class EtcdStore(tdist.Store):
    """torch's Store API over etcd keys ``<prefix>keys/<key>``: ``set`` on this agent's lease, the rest on the job's."""

    def __init__(self, client: EtcdClient, prefix: bytes, timeout: float, agent_ttl: int = AGENT_TTL) -> None:
        super().__init__()
        self.client, self.prefix, self.wait_timeout = client, prefix, timeout
        self.lease = job_lease(client, prefix)
        self.own = KeptLease(client, client.grant(agent_ttl), agent_ttl, "agent-lease")

    def _key(self, key: str) -> bytes:
        return self.prefix + b"keys/" + key.encode()

    def _put_if(self, key: bytes, value: bytes, mod_revision: int) -> tuple[bool, KeyValue | None]:
        try:
            return self.client.put_if(key, value, mod_revision=mod_revision, lease=self.lease.id)
        except EtcdRequestError as error:
            raise self._lease_error(error) from error

    def _lease_error(self, error: EtcdRequestError, own: bool = False) -> SpmdError:
        if error.code == NOT_FOUND and own:
            return SpmdError(f"this agent's etcd lease expired ({error}): it was out of touch with etcd at {self.client.describe()} "
                             f"for {self.own.ttl} s, so the other agents count it as gone; start this node's agent again")
        if error.code == NOT_FOUND:
            return SpmdError(f"the job's etcd lease expired ({error}): every agent was out of touch with etcd at "
                             f"{self.client.describe()} for {self.lease.ttl} s and the job's rendezvous keys are gone; start the job again")
        return error

    # -- torch.distributed.Store ---------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        data = value.encode() if isinstance(value, str) else bytes(value)
        try:
            self.client.put(self._key(key), data, lease=self.own.id)
        except EtcdRequestError as error:
            raise self._lease_error(error, own=True) from error

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """The value, waiting (at most the store's timeout) for another agent to set it."""
        found = self.client.wait_for(self._key(key), self.wait_timeout)
        if found is None:
            raise self._missing(key, self.wait_timeout)
        return _value(found)

    def _missing(self, key: str, seconds: float) -> SpmdError:
        return SpmdError(f"rendezvous key {key!r} was not set within {seconds:g} s on etcd at "
                         f"{self.client.describe()}: the agent that should set it may have died; start the job again")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        """Until every key exists (a watch each, no polling); an SpmdError naming the first missing one after ``timeout``."""
        seconds = timeout.total_seconds() if timeout is not None else self.wait_timeout
        deadline = time.monotonic() + seconds
        for key in keys:
            if self.client.wait_for(self._key(key), max(0.0, deadline - time.monotonic())) is None:
                raise self._missing(key, seconds)

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        """Every key's value in one range request per look (over the keys' common prefix), waiting as ``get`` does."""
        full = [self._key(key) for key in keys]
        common = os.path.commonprefix(full) or b""
        deadline = time.monotonic() + self.wait_timeout
        while True:
            found = {kv.key: _value(kv) for kv in self.client.get_prefix(common)}
            missing = [key for key in full if key not in found]
            if not missing:
                return [found[key] for key in full]
            if time.monotonic() > deadline:
                raise SpmdError(f"rendezvous key {missing[0].decode()!r} was not set within {self.wait_timeout:.0f} s on etcd at "
                                f"{self.client.describe()}: the agent that should set it may have died; start the job again")
            time.sleep(GET_POLL)

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` and return the sum. A counter's value is ``COUNTER<base>`` and its count ``base + version - 1``:
        adding one is then a put that keeps the value (etcd counts the versions), so n agents arriving at once
        cost n writes, where a compare-and-swap on the sum costs O(n²) when they collide."""
        full = self._key(key)
        if amount == 1:
            before, current = self.client.bump_if_prefixed(full, COUNTER)
            if before is not None:
                return int(_value(before)) + 1
        else:
            current = self.client.get(full)
            if amount == 0 and current is not None:
                return int(_value(current) or b"0")  # a read (the rounds poll counters): no write, no revision
        for attempt in itertools.count():
            total = int(_value(current) or b"0") + amount if current is not None else amount
            version = current.version if current is not None else 0
            done, now = self._put_if(full, COUNTER + str(total - version).encode(), current.mod_revision if current is not None else 0)
            if done:
                return total
            if amount == 0 and now is not None:
                return int(_value(now) or b"0")  # another agent created it first: read it
            # Another agent changed it first: add to its value, after a random pause (agents retrying in lockstep
            # would each make etcd run a transaction per retry).
            time.sleep(random.uniform(0, min(CAS_BACKOFF_MAX, CAS_BACKOFF * 2 ** attempt)))
            current = self.client.get(full)
        raise AssertionError("unreachable")

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:  # type: ignore[override]
        """As TCPStore's: set ``desired`` if the value is ``expected`` (absent counts as ``b""``); the value now."""
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        full = self._key(key)
        current = self.client.get(full)
        while True:
            if current is None and want:
                return want  # (TCPStore answers a missing key with the expected value, unchanged)
            if current is not None and _value(current) != want:
                return _value(current)
            done, now = self._put_if(full, new, current.mod_revision if current is not None else 0)
            if done:
                return new
            current = now

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return all(self.client.get(self._key(key)) is not None for key in keys)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        full = self._key(key)
        return self.client.call("kv/deleterange", {"key": b64(full)}).get("deleted", "0") != "0"

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        self.wait_timeout = timeout.total_seconds()

    def close(self, revoke: bool) -> None:
        """Stop keeping the keys alive (this agent's expire ``AGENT_TTL`` s later); ``revoke``: delete every key of the job now."""
        self.own.close(revoke)
        self.lease.close(False)
        if revoke:
            self.client.delete_prefix(self.prefix)  # (other agents' own keys too: every agent has left)
            self.client.revoke(self.lease.id)
