"""Joining the job's store at ``spmd.init``, with every start-up fault named within the timeout.

torch's TCPStore, left to itself, blocks without bound on a port held by a
program that accepts connections but never answers, spends the whole DNS
timeout on an unresolvable ``MASTER_ADDR`` and then blames the variables, and
on rank 0 says only "2/3 clients joined" when a rank never started. Here:

- the master's address is resolved first, within the timeout, and a failure
  says it is the name that does not resolve;
- a client first pings the store with a few bytes of TCPStore's protocol, so
  a silent listener on ``MASTER_PORT`` is reported after the timeout instead
  of hanging forever in torch's client;
- the host does not wait for its clients inside TCPStore; instead every rank
  marks its arrival under ``spmd/arrived/<rank>`` and waits for all of them,
  so a rank that never came is named by number, on every rank that did.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from spmd.comm.tcp_store import host_tcp_store
from spmd.errors import SpmdError, first_line
from spmd.polling import poll

#: Where each rank marks its arrival (under the job's store, next to the world's other keys).
ARRIVED = "spmd/arrived/"


def _bounded(fn: Any, seconds: float, name: str) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn()`` on a daemon thread for at most ``seconds``: (finished, result, error).

    The thread is left behind if ``fn`` never returns: the caller raises. Use
    it for plain C calls only (a C++ call that returns while the interpreter
    finalizes aborts the process).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            box["error"] = error

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return False, None, None
    return True, box.get("result"), box.get("error")


def check_resolvable(addr: str, port: int, timeout: timedelta, variable: str = "MASTER_ADDR") -> None:
    """Resolve the master's address now, within ``timeout``, so a bad name fails as a bad name."""
    seconds = timeout.total_seconds()
    finished, _, error = _bounded(lambda: socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM), seconds, "spmd-resolve")
    if not finished:
        raise SpmdError(
            f"{variable}={addr!r} did not resolve within {seconds:.0f} s (DNS lookup still running): give "
            "rank 0's IP address, or a host name that every node resolves quickly"
        )
    if isinstance(error, socket.gaierror):
        raise SpmdError(
            f"{variable}={addr!r} does not resolve (DNS: {error.strerror or error}): set it to the IP address "
            "or host name of rank 0's machine, as every rank can resolve it"
        ) from error


def client_store(addr: str, port: int, world_size: int | None, timeout: timedelta) -> tdist.TCPStore:
    """A client of the store at ``addr:port``, or an error within the timeout that says what is there.

    Waits (polling, as torch's client would) for something to listen, pings it
    with a few bytes of TCPStore's protocol, and only then hands over to torch's
    client, with what is left of the timeout.
    """
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds
    def probe() -> str | None:
        found = _probe(addr, port, max(deadline - time.monotonic(), 0.1))
        return None if found == "absent" else found

    found = poll(probe, seconds, 0.02, backoff=2, max_interval=0.2)
    if found is None:
        raise SpmdError(
            f"nothing listens at {addr}:{port} after {seconds:.0f} s: rank 0, which hosts the job's store "
            "there, has not started (or failed before it could), or MASTER_ADDR/MASTER_PORT point elsewhere"
        )
    if found == "silent":
        raise SpmdError(
            f"connected to {addr}:{port}, but nothing answered there as a store within {seconds:.0f} s: another "
            "program holds that port (a listener that accepts and never replies), or rank 0's machine is stuck. "
            "Pick a free MASTER_PORT (`ss -ltnp` on rank 0's machine shows who listens)"
        )
    left = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    return tdist.TCPStore(addr, port, world_size, False, timeout=left)


#: TCPStore's wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): a client opens with
#: VALIDATE and the magic number; PING echoes a 32-bit nonce. tests/test_startup_faults.py checks
#: that a real store of the pinned torch answers this probe.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE


def _probe(addr: str, port: int, seconds: float) -> str:
    """What listens at ``addr:port``: "store" (echoed a ping), "silent" (accepted, never answered
    within ``seconds``), "absent" (nothing accepts yet: rank 0 may not have started), or "other".

    torch's client would block without bound on a silent listener; only
    silence is treated as an error, anything else is left to the client.
    """
    nonce = os.getpid() & 0xFFFFFFFF
    try:
        conn = socket.create_connection((addr, port), timeout=min(seconds, 5.0))
    except OSError:
        return "absent"
    with conn:
        try:
            conn.settimeout(seconds)
            conn.sendall(bytes([_VALIDATE]) + struct.pack("<I", _MAGIC) + bytes([_PING]) + struct.pack("<I", nonce))
            reply = conn.recv(4)
        except TimeoutError:
            return "silent"
        except OSError:
            return "other"
    return "store" if reply == struct.pack("<I", nonce) else "other"


def host_store(addr: str, port: int, timeout: timedelta) -> tdist.TCPStore:
    """Rank 0's store; it does not wait for its clients (``await_arrivals`` does, naming the absent)."""
    return host_tcp_store(addr, port, None, timeout, wait_for_workers=False)


def await_arrivals(store: tdist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Mark this rank arrived and wait for all ``world_size``; name the ranks that never came.

    Polls ``check`` (a timed-out ``wait`` would print a C++ warning). Rank 0,
    which hosts the store, waits 2 s longer than the others, so that theirs
    is the first deadline and the store is still there when they look who is
    missing.
    """
    keys = [f"{ARRIVED}{r}" for r in range(world_size)]
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds + (2.0 if rank == 0 else 0.0)
    try:
        store.set(keys[rank], "1")
        if poll(lambda: store.check(keys), deadline - time.monotonic(), 0.005, backoff=2, max_interval=0.1):
            return
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    except Exception as error:  # noqa: BLE001 - the store itself is gone
        first = first_line(error)
        raise SpmdError(
            f"rank {rank}: the job's store went away while waiting for the other ranks to arrive ({first}); "
            "rank 0 hosts it: did rank 0 exit or fail to start?"
        ) from None
    raise SpmdError(
        f"rank {rank}: only {world_size - len(missing)} of WORLD_SIZE={world_size} ranks reached spmd.init within "
        f"{seconds:.0f} s; ranks {missing} never arrived. Start every rank (one per process), or set WORLD_SIZE "
        "to the number of ranks you start"
    )
