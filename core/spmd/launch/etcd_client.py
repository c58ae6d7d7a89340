"""A small etcd v3 client over etcd's JSON gateway (``POST /v3/...``), with a timeout on every call.

etcd serves its gRPC API as JSON on the client port (keys and values in
base64, 64-bit integers as strings), so ``spmd run --rdzv-backend etcd`` needs
no gRPC or protobuf package: http.client is enough. Several endpoints fail
over: a call tries each once, starting with the last one that answered. Each
thread keeps one connection per endpoint open (https handshakes are not free).
With a user (``etcd_security``), the client authenticates once
(``/v3/auth/authenticate``), sends the token in the ``Authorization`` header,
and authenticates again when etcd says the token expired.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spmd.errors import RendezvousAuthError, RendezvousUnreachableError, SpmdError
from spmd.launch.etcd_security import PASSWORD_ENV, EtcdSecurity


class EtcdRequestError(SpmdError):
    """etcd answered a request with an error (a lease that expired, a malformed request)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


#: gRPC status etcd gives for a lease it does not know (expired or revoked).
NOT_FOUND = 5
#: Seconds before a broken watch is opened again.
WATCH_RETRY = 0.05
#: gRPC statuses of etcd's auth errors: a wrong password or no user, no permission, an expired token.
INVALID_ARGUMENT, PERMISSION_DENIED, UNAUTHENTICATED = 3, 7, 16


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``host:port[,host:port...]`` (an optional ``http://`` or ``https://`` each) as (host, port) pairs; SpmdError if malformed."""
    found = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        bare = item.removeprefix("http://").removeprefix("https://")  # (https: etcd_security.security_from_conf)
        host, _, port = bare.rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise SpmdError(f"--rdzv-endpoint {text!r}: write etcd's client URLs as host:port[,host:port...], e.g. etcd0:2379,etcd1:2379")
        found.append((host.strip("[]"), int(port)))
    if not found:
        raise SpmdError("--rdzv-endpoint is empty: name the etcd cluster's client URLs as host:port[,host:port...]")
    return tuple(found)


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd returns it."""

    key: bytes
    value: bytes
    mod_revision: int
    lease: int
    version: int = 0  # puts since the key was created (1 after the first)


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(unb64(item["key"]), unb64(item.get("value", "")), int(item.get("mod_revision", 0)), int(item.get("lease", 0)),
                    int(item.get("version", 0)))


class EtcdClient:
    """Calls to one etcd cluster at ``endpoints``, each bounded by ``timeout`` seconds per endpoint tried."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout: float = 5.0, security: EtcdSecurity | None = None) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.security = security or EtcdSecurity()
        self._ssl = self.security.ssl_context()
        self._first = 0  # the endpoint that answered last
        self._local = threading.local()  # this thread's open connections, by endpoint index
        self._token: str | None = None  # etcd's auth token for ``security.user``

    def describe(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def _connection(self, index: int) -> http.client.HTTPConnection:
        pool: dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault("pool", {})
        if index not in pool:
            host, port = self.endpoints[index]
            if self._ssl is not None:
                pool[index] = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._ssl)
            else:
                pool[index] = http.client.HTTPConnection(host, port, timeout=self.timeout)
        return pool[index]

    def _drop(self, index: int) -> None:
        connection = self._local.__dict__.get("pool", {}).pop(index, None)
        if connection is not None:
            connection.close()

    def _post(self, index: int, path: str, data: bytes, token: str | None) -> tuple[int, bytes]:
        """One request on this thread's connection to endpoint ``index``; a connection the server closed is reopened once."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        for attempt in (0, 1):
            connection = self._connection(index)
            try:
                connection.request("POST", f"/v3/{path}", data, headers)
                response = connection.getresponse()
                return response.status, response.read()
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self._drop(index)  # an idle kept-alive connection the server closed: once more on a fresh one
                if attempt:
                    raise
            except BaseException:
                self._drop(index)
                raise
        raise AssertionError("unreachable")

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers; the decoded reply."""
        if self.security.user and self._token is None and path != "auth/authenticate":
            self.authenticate()
        try:
            return self._call(path, body, self._token)
        except EtcdRequestError as error:
            if error.code != UNAUTHENTICATED or not self.security.user or path == "auth/authenticate":
                raise
        self.authenticate()  # the token expired (etcd drops idle ones): a fresh one, and the call once more
        return self._call(path, body, self._token)

    def _call(self, path: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        data = json.dumps(body).encode()
        failures = []
        for i in range(len(self.endpoints)):
            index = (self._first + i) % len(self.endpoints)
            host, port = self.endpoints[index]
            try:
                status, raw = self._post(index, path, data, token)
            except (OSError, http.client.HTTPException) as error:  # refused, unreachable, timed out, cut off, TLS refused
                failures.append(f"{self.security.scheme}://{host}:{port}: {error or type(error).__name__}")
                continue
            self._first = index
            return self._decode(path, status, raw, f"{host}:{port}", self.security.user)
        raise RendezvousUnreachableError(
            f"no etcd endpoint answered /v3/{path} within {self.timeout:g} s ({'; '.join(failures)}); "
            f"check that etcd runs at --rdzv-endpoint {self.describe()} and that this node can reach it"
        )

    def authenticate(self) -> None:
        """Get a token for ``security.user``; RendezvousAuthError naming the endpoint and user if etcd refuses."""
        user = self.security.user
        try:
            reply = self._call("auth/authenticate", {"name": user, "password": self.security.password or ""}, None)
        except EtcdRequestError as error:
            if error.code != INVALID_ARGUMENT:
                raise
            raise RendezvousAuthError(f"{error}: etcd refused the password of user {user!r}; check --rdzv-conf user= "
                                      f"and the password (${PASSWORD_ENV} or password_file=)") from error
        self._token = reply.get("token") or None

    @staticmethod
    def _decode(path: str, status: int, raw: bytes, where: str, user: str | None = None) -> dict[str, Any]:
        try:
            reply = json.loads(raw.decode() or "{}")
        except ValueError:
            reply = {"error": raw[:200].decode(errors="replace")}
        if status != 200 or "error" in reply:
            message = reply.get("message") or reply.get("error") or f"HTTP {status}"
            code = reply.get("code")
            if status == 404 and code is None:
                message = f"{where} has no /v3/{path}: is it an etcd v3 server (3.4 or newer)?"
            if code == PERMISSION_DENIED or (code == INVALID_ARGUMENT and "user name is empty" in message):
                who = f"user {user!r}" if user else "a client without a user (etcd has auth enabled: pass --rdzv-conf user=NAME)"
                raise RendezvousAuthError(f"etcd at {where} refused /v3/{path} for {who}: {message}; the job's keys need a role "
                                          "granting readwrite on the job's key prefix (docs/rendezvous.md)")
            raise EtcdRequestError(f"etcd at {where} refused /v3/{path}: {message}", code)
        return reply.get("result", reply)  # (streaming calls wrap their first message in "result")

    # -- keys ----------------------------------------------------------------------------------
    def get(self, key: bytes) -> KeyValue | None:
        reply = self.call("kv/range", {"key": b64(key)})
        kvs = reply.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def wait_for(self, key: bytes, timeout: float) -> KeyValue | None:
        """``key`` once it exists, waiting at most ``timeout`` seconds on a watch (no polling); None if it did not appear.

        A range, then, if the key is missing, a watch from the revision after it on a connection of its own:
        a thousand agents waiting for one key cost etcd a thousand idle streams, not a thousand reads every 20 ms.
        A stream that breaks early is opened again (after a range) until the time is up.
        """
        deadline = time.monotonic() + timeout
        while True:
            reply = self.call("kv/range", {"key": b64(key)})
            kvs = reply.get("kvs") or []
            left = deadline - time.monotonic()
            if kvs or left <= 0:
                return _kv(kvs[0]) if kvs else None
            found = self._watch_once(key, int(reply.get("header", {}).get("revision", 0)) + 1, left)
            if found is not None:
                return found
            time.sleep(min(WATCH_RETRY, max(0.0, deadline - time.monotonic())))

    def _watch_once(self, key: bytes, start: int, timeout: float) -> KeyValue | None:
        """The first put of ``key`` from revision ``start`` on, within ``timeout`` s; None when the time ran out or the stream broke."""
        if self.security.user and self._token is None:
            self.authenticate()
        host, port = self.endpoints[self._first]
        if self._ssl is not None:
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
        else:
            connection = http.client.HTTPConnection(host, port, timeout=timeout)
        headers = {"Content-Type": "application/json", **({"Authorization": self._token} if self._token else {})}
        body = json.dumps({"create_request": {"key": b64(key), "start_revision": str(start), "filters": ["NODELETE"]}}).encode()
        try:
            connection.request("POST", "/v3/watch", body, headers)
            response = connection.getresponse()
            if response.status != 200:
                return None
            for line in response:  # one JSON message per line: "created", then events
                events = json.loads(line or b"{}").get("result", {}).get("events") or []
                if events:
                    return _kv(events[0]["kv"])
        except (OSError, http.client.HTTPException, ValueError):
            pass  # timed out, or the stream broke: the caller looks again
        finally:
            connection.close()
        return None

    def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        reply = self.call("kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        return [_kv(item) for item in reply.get("kvs") or []]

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("kv/put", body)

    def delete_prefix(self, prefix: bytes) -> int:
        reply = self.call("kv/deleterange", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        return int(reply.get("deleted", 0))

    def put_if(self, key: bytes, value: bytes, *, mod_revision: int, lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Put ``key`` only if its mod revision is ``mod_revision`` (0: only if absent); (done, the key as it is when not)."""
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        compare = {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
        reply = self.call("kv/txn", {
            "compare": [compare],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": b64(key)}}],
        })
        if reply.get("succeeded"):
            return True, None
        kvs = (reply.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return False, (_kv(kvs[0]) if kvs else None)

    def bump_if_prefixed(self, key: bytes, value_prefix: bytes) -> tuple[KeyValue | None, KeyValue | None]:
        """If ``key``'s value starts with ``value_prefix``, put it again unchanged (its version goes up by one, atomically,
        whoever else does the same): (the key before this put, None); else (None, the key as it is, or None if absent)."""
        compares = [{"key": b64(key), "target": "VALUE", "result": "GREATER", "value": b64(value_prefix[:-1])},
                    {"key": b64(key), "target": "VALUE", "result": "LESS", "value": b64(prefix_end(value_prefix))}]
        reply = self.call("kv/txn", {
            "compare": compares,
            "success": [{"request_put": {"key": b64(key), "ignore_value": True, "ignore_lease": True, "prev_kv": True}}],
            "failure": [{"request_range": {"key": b64(key)}}],
        })
        response = (reply.get("responses") or [{}])[0]
        if reply.get("succeeded"):
            return _kv(response.get("response_put", {})["prev_kv"]), None
        kvs = response.get("response_range", {}).get("kvs") or []
        return None, (_kv(kvs[0]) if kvs else None)

    # -- leases ---------------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        return int(self.call("lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its TTL in seconds now (0: it has expired)."""
        return int(self.call("lease/keepalive", {"ID": str(lease)}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` and delete its keys (one that has expired already is fine)."""
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except EtcdRequestError as error:
            if error.code != NOT_FOUND:
                raise

