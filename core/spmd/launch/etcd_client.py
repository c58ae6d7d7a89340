"""A small etcd v3 client over etcd's JSON gateway (``POST /v3/...``), with a timeout on every call.

etcd serves its gRPC API as JSON on the client port (keys and values in
base64, 64-bit integers as strings), so ``spmd run --rdzv-backend etcd`` needs
no gRPC or protobuf package: http.client is enough. Several endpoints fail
over: a call tries each once, starting with the last one that answered.
"""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spmd.errors import RendezvousUnreachableError, SpmdError


class EtcdRequestError(SpmdError):
    """etcd answered a request with an error (a lease that expired, a malformed request)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


#: gRPC status etcd gives for a lease it does not know (expired or revoked).
NOT_FOUND = 5


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
    """``host:port[,host:port...]`` (an optional ``http://`` each) as (host, port) pairs; SpmdError if malformed."""
    found = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        bare = item.removeprefix("http://")
        if bare.startswith("https://"):
            raise SpmdError(f"--rdzv-endpoint {item!r}: TLS to etcd is not supported yet; use an http:// client URL")
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


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(unb64(item["key"]), unb64(item.get("value", "")), int(item.get("mod_revision", 0)), int(item.get("lease", 0)))


class EtcdClient:
    """Calls to one etcd cluster at ``endpoints``, each bounded by ``timeout`` seconds per endpoint tried."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout: float = 5.0) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._first = 0  # the endpoint that answered last

    def describe(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers; the decoded reply."""
        data = json.dumps(body).encode()
        failures = []
        for i in range(len(self.endpoints)):
            index = (self._first + i) % len(self.endpoints)
            host, port = self.endpoints[index]
            connection = http.client.HTTPConnection(host, port, timeout=self.timeout)
            try:
                connection.request("POST", f"/v3/{path}", data, {"Content-Type": "application/json"})
                response = connection.getresponse()
                status, raw = response.status, response.read()
            except (OSError, http.client.HTTPException) as error:  # refused, unreachable, timed out, cut off
                failures.append(f"{host}:{port}: {error or type(error).__name__}")
                continue
            finally:
                connection.close()
            self._first = index
            return self._decode(path, status, raw, f"{host}:{port}")
        raise RendezvousUnreachableError(
            f"no etcd endpoint answered /v3/{path} within {self.timeout:g} s ({'; '.join(failures)}); "
            f"check that etcd runs at --rdzv-endpoint {self.describe()} and that this node can reach it"
        )

    @staticmethod
    def _decode(path: str, status: int, raw: bytes, where: str) -> dict[str, Any]:
        try:
            reply = json.loads(raw.decode() or "{}")
        except ValueError:
            reply = {"error": raw[:200].decode(errors="replace")}
        if status != 200 or "error" in reply:
            message = reply.get("message") or reply.get("error") or f"HTTP {status}"
            code = reply.get("code")
            if status == 404 and code is None:
                message = f"{where} has no /v3/{path}: is it an etcd v3 server (3.4 or newer)?"
            raise EtcdRequestError(f"etcd at {where} refused /v3/{path}: {message}", code)
        return reply.get("result", reply)  # (streaming calls wrap their first message in "result")

    # -- keys ----------------------------------------------------------------------------------
    def get(self, key: bytes) -> KeyValue | None:
        reply = self.call("kv/range", {"key": b64(key)})
        kvs = reply.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

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

