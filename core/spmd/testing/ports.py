"""Free TCP ports for tests that start their own rendezvous.

A port from the kernel's ephemeral range (``ip_local_port_range``, usually
32768-60999) can be handed to some outgoing connection between the moment a
test picks it and the moment rank 0 binds it; under parallel test jobs that
happened here. Ports below that range are never auto-assigned, so picking a
free one there removes the race with other connections.
"""

from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and outside the ephemeral range (falls back to any free port)."""
    high = _ephemeral_low() - 1
    for _ in range(200):
        port = random.randint(20000, max(20001, high))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
