"""A torch Store on etcd: the agents' rendezvous keys, under one job prefix and one shared lease.

``add`` and ``compare_set`` are compare-and-swap transactions on the key's
modification revision, so concurrent agents never lose an update. Every key
is attached to the job's lease, which each running agent keeps alive: when
every agent of the job is gone (exited or dead), the keys expire with it; the
last agent to leave a finished job revokes it at once.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as tdist

from spmd.errors import SpmdError
from spmd.launch.etcd_client import NOT_FOUND, EtcdClient, EtcdRequestError, KeyValue, b64
from spmd.polling import poll

#: Seconds the job's keys outlive the last agent that kept them alive.
LEASE_TTL = 30
#: Seconds between polls of ``get`` for a key that is not there yet.
GET_POLL = 0.02


class JobLease:
    """The job's shared lease: found under ``<prefix>lease`` or granted and published there, then kept alive."""

    def __init__(self, client: EtcdClient, prefix: bytes, ttl: int = LEASE_TTL) -> None:
        self.client, self.key, self.ttl = client, prefix + b"lease", ttl
        self.id = self._acquire()
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, daemon=True, name="spmd-etcd-lease")
        self._thread.start()

    def _acquire(self) -> int:
        for _ in range(20):
            current = self.client.get(self.key)
            if current is not None and self.client.keepalive(int(current.value)) > 0:
                return int(current.value)  # another agent of the job holds one: share it
            fresh = self.client.grant(self.ttl)
            done, _ = self.client.put_if(self.key, str(fresh).encode(), mod_revision=current.mod_revision if current else 0, lease=fresh)
            if done:
                return fresh
            self.client.revoke(fresh)  # another agent published one first: take theirs
        raise SpmdError(f"could not agree on the job's etcd lease at {self.client.describe()} in 20 tries; is another job using --rdzv-id?")

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.client.keepalive(self.id) == 0:
                    self.lost = True  # expired: the job's keys are gone (the next write names it)
                    return
            except SpmdError:
                pass  # etcd unreachable for now: try again; the calls of the rendezvous report it

    def close(self, revoke: bool) -> None:
        """Stop refreshing it; ``revoke``: delete the job's keys now rather than after the TTL."""
        self._stop.set()
        self._thread.join(timeout=self.client.timeout + 1)
        if revoke:
            self.client.revoke(self.id)


class EtcdStore(tdist.Store):
    """torch's Store API over etcd keys ``<prefix><key>``, every key under the job's lease."""

    def __init__(self, client: EtcdClient, prefix: bytes, timeout: float) -> None:
        super().__init__()
        self.client, self.prefix, self.wait_timeout = client, prefix, timeout
        self.lease = JobLease(client, prefix)

    def _key(self, key: str) -> bytes:
        return self.prefix + b"keys/" + key.encode()

    def _put_if(self, key: bytes, value: bytes, mod_revision: int) -> tuple[bool, KeyValue | None]:
        try:
            return self.client.put_if(key, value, mod_revision=mod_revision, lease=self.lease.id)
        except EtcdRequestError as error:
            raise self._lease_error(error) from error

    def _lease_error(self, error: EtcdRequestError) -> SpmdError:
        if error.code == NOT_FOUND:
            return SpmdError(f"the job's etcd lease expired ({error}): every agent was out of touch with etcd at "
                             f"{self.client.describe()} for {self.lease.ttl} s and the job's rendezvous keys are gone; start the job again")
        return error

    # -- torch.distributed.Store ---------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        data = value.encode() if isinstance(value, str) else bytes(value)
        try:
            self.client.put(self._key(key), data, lease=self.lease.id)
        except EtcdRequestError as error:
            raise self._lease_error(error) from error

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """The value, waiting (at most the store's timeout) for another agent to set it."""
        found = poll(lambda: self.client.get(self._key(key)), self.wait_timeout, GET_POLL)
        if found is None:
            raise SpmdError(f"rendezvous key {key!r} was not set within {self.wait_timeout:.0f} s on etcd at "
                            f"{self.client.describe()}: the agent that should set it may have died; start the job again")
        return found.value

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        full = self._key(key)
        current = self.client.get(full)
        while True:
            value = int(current.value or b"0") + amount if current is not None else amount
            done, now = self._put_if(full, str(value).encode(), current.mod_revision if current is not None else 0)
            if done:
                return value
            current = now  # another agent changed it first: add to its value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:  # type: ignore[override]
        """As TCPStore's: set ``desired`` if the value is ``expected`` (absent counts as ``b""``); the value now."""
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        full = self._key(key)
        current = self.client.get(full)
        while True:
            if current is None and want:
                return want  # (TCPStore answers a missing key with the expected value, unchanged)
            if current is not None and current.value != want:
                return current.value
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
        """Stop keeping the job's keys alive; ``revoke``: delete them now (the job is over)."""
        self.lease.close(revoke)
