"""The workers' store on etcd (``spmd run --rdzv-backend etcd --rdzv-conf worker_store=etcd``).

By default each round's node 0 hosts its workers' store (a TCPStore in that
agent). With ``worker_store=etcd`` the workers keep their keys (progress,
dumps, announcements, backend rendezvous) on the job's etcd cluster too, so no
agent's process holds any of the job's state. The agent hands its workers an
``etcd://`` URL in ``SPMD_AGENT_STORE``: the endpoints, the round's key prefix
and the connection settings, never a password (that stays in
``SPMD_ETCD_PASSWORD`` or ``password_file=``).
"""

from __future__ import annotations

import base64
import urllib.parse
from collections.abc import Mapping

from spmd.errors import SpmdError
from spmd.launch.etcd_client import EtcdClient, parse_endpoints
from spmd.launch.etcd_security import security_from_conf
from spmd.launch.etcd_store import EtcdStore

SCHEME = "etcd://"
#: What ``--rdzv-conf worker_store=`` takes: ``node`` (round node 0's agent hosts a TCPStore) or ``etcd``.
CHOICES = ("node", "etcd")
#: The ``--rdzv-conf`` keys a worker needs to reach etcd as its agent does.
_CONNECTION = ("protocol", "cacert", "cert", "key", "user", "password_file")
#: Seconds each request of a worker's client may take, per endpoint tried.
REQUEST_TIMEOUT = 5.0


def choice(conf: Mapping[str, str]) -> str:
    """``--rdzv-conf worker_store=`` (default ``node``), or an SpmdError naming the choices."""
    value = conf.get("worker_store", "node").strip().lower()
    if value not in CHOICES:
        raise SpmdError(f"--rdzv-conf worker_store={value}: use {' or '.join(CHOICES)}")
    return value


def url(endpoint_text: str, conf: Mapping[str, str], prefix: bytes) -> str:
    """The URL that tells a worker where its store's keys live (``open_store`` reads it)."""
    endpoints = ",".join(f"{host}:{port}" for host, port in parse_endpoints(endpoint_text))
    query = {key: conf[key] for key in _CONNECTION if conf.get(key)}
    if "https://" in endpoint_text:
        query.setdefault("protocol", "https")
    return f"{SCHEME}{endpoints}/{base64.urlsafe_b64encode(prefix).decode()}?{urllib.parse.urlencode(query)}"


def _parts(text: str) -> tuple[str, bytes, dict[str, str]]:
    parsed = urllib.parse.urlsplit(text)
    query = {key: values[-1] for key, values in urllib.parse.parse_qs(parsed.query).items()}
    return parsed.netloc, base64.urlsafe_b64decode(parsed.path.lstrip("/")), query


def address(text: str) -> tuple[str, int] | None:
    """The first etcd endpoint of a worker-store URL (where the job's store is reached from), else None."""
    if not text.startswith(SCHEME):
        return None
    return parse_endpoints(_parts(text)[0])[0]


def open_store(text: str, timeout: float) -> EtcdStore:
    """The store a worker-store URL names: etcd keys under its prefix, reached as the agent reaches them."""
    endpoints, prefix, query = _parts(text)
    security = security_from_conf(query, endpoints)
    client = EtcdClient(parse_endpoints(endpoints), timeout=min(REQUEST_TIMEOUT, timeout), security=security)
    return EtcdStore(client, prefix, timeout)
