"""Hosting the job's TCPStore: on loopback only when every rank is on this machine.

torch's TCPStore listens on every interface of the host, so anyone who can
reach the machine can read, write and delete the job's keys (and so stop or
derail it). When the store's address is a loopback address the job is
single-node by construction, and the store is handed a socket bound to
127.0.0.1 instead (TCPStore's ``master_listen_fd``): nothing off the machine
can connect. Multi-node jobs still listen on every interface; see the
README's security section.
"""

from __future__ import annotations

import hashlib
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from spmd import settings

LOOPBACK = ("127.0.0.1", "localhost", "::1")

#: The job token's environment variable (``spmd run --rdzv-token`` sets it for its workers).
TOKEN_ENV = "SPMD_RDZV_TOKEN"


def job_scope(store: tdist.Store, token: str | None = None) -> tdist.Store:
    """``store`` seen under the job token's namespace, if there is a token (argument, else ``SPMD_RDZV_TOKEN``).

    Every key of the job (rendezvous rounds, the shutdown request, ranks'
    progress, dump requests) then lives under ``job-<sha256(token)>/``. TCPStore
    cannot list its keys, so a client without the token cannot name one: it can
    neither read the job's state nor write into it, nor stop the job. The
    token hides the keys; it does not encrypt the traffic (see the README's
    security section).
    """
    token = token if token is not None else settings.current().rdzv_token
    if not token:
        return store
    return tdist.PrefixStore(f"job-{hashlib.sha256(token.encode()).hexdigest()}/", store)


def host_tcp_store(host: str, port: int, world_size: int | None, timeout: timedelta, **options: Any) -> tdist.TCPStore:
    """A hosting TCPStore at ``host:port`` (``port`` 0: any free port), loopback-only for a loopback ``host``."""
    if host not in LOOPBACK:
        return tdist.TCPStore(host, port, world_size, True, timeout, **options)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(4096)
        bound = listener.getsockname()[1]
        fd = listener.detach()  # the store takes the socket over (and closes it with itself)
    try:
        return tdist.TCPStore("127.0.0.1", bound, world_size, True, timeout, master_listen_fd=fd, **options)
    except BaseException:
        try:
            os.close(fd)
        except OSError:  # the store had taken the socket over and closed it already
            pass
        raise


def own_client(store: tdist.Store) -> tdist.Store:
    """A second connection to the job's store, so a background thread (the watchdog, the launcher's liveness
    beats) never queues behind the main thread.

    ``clone()`` opens a new connection for a TCPStore, and keeps the prefix of
    a PrefixStore over one; stores that cannot clone (in-process) are shared.
    """
    clone = getattr(store, "clone", None)  # (torch's type stubs do not list it)
    if clone is not None and isinstance(store, (tdist.TCPStore, tdist.PrefixStore)):
        try:
            client: tdist.Store = clone()
        except Exception:  # noqa: BLE001 - a store without clone support is shared instead
            return store
        client.set_timeout(timedelta(seconds=10))
        return client
    return store
