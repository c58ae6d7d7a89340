"""Where a backend binds: this node's address on the route to the job's store, and its interface.

A host name that resolves to loopback (``127.0.1.1 node0`` in /etc/hosts, common
in containers) makes a backend that binds "this host's address" advertise an
address no other node can reach. The job's store was reached, by definition,
so the address this node uses towards the store is one the others can reach:
every backend binds there (DESIGN: Addresses). Dependency-free: the route comes
from a UDP ``connect`` (no packet is sent), the interface from ``ioctl``/procfs.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Any

from spmd import settings
from spmd.errors import BackendUnavailableError

#: The spmd setting that names the interface every backend binds to (a backend's own variable, e.g. GLOO_SOCKET_IFNAME, still wins).
SOCKET_IFNAME_ENV = "SPMD_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Binding:
    """Where backends bind on this node: ``address`` None means "the backend's own default"; ``reason`` says why."""

    address: str | None
    interface: str | None
    reason: str


def store_endpoint(store: Any) -> tuple[str, int] | None:
    """``(host, port)`` of the TCPStore under ``store``'s prefixes, or None (a file or hash store)."""
    seen = 0
    while store is not None and seen < 64:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if isinstance(host, str) and isinstance(port, int):
            return host, port
        store, seen = getattr(store, "underlying_store", None), seen + 1
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (``localhost``, 127.x, ::1)."""
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_source(host: str, port: int) -> str | None:
    """This node's address on the route to ``host:port`` (a UDP connect: no packet sent), or None with no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, target in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(target)
            except OSError:
                continue
            return str(probe.getsockname()[0])
    return None


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (SIOCGIFADDR), or None when it has none or does not exist."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    """IPv6 address -> interface, from /proc/net/if_inet6 (empty where there is none)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    except OSError:
        pass
    return found


def interface_of(address: str) -> str | None:
    """The name of this node's interface that holds ``address``, or None."""
    if ":" in address:
        return _ipv6_interfaces().get(str(ipaddress.ip_address(address)))
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def _interfaces() -> str:
    return ", ".join(name for _, name in socket.if_nameindex()) or "none"


def binding_towards(host: str, port: int) -> Binding:
    """Where to bind for a job whose store is at ``host:port``: ``SPMD_SOCKET_IFNAME``, else the route's source."""
    named = settings.current().socket_ifname
    if named:
        address = interface_address(named)
        if address is None:
            raise BackendUnavailableError(
                f"{SOCKET_IFNAME_ENV}={named} names no interface with an IPv4 address on this node (its "
                f"interfaces: {_interfaces()}); name one of those, or unset it to bind where the job's store is reached"
            )
        return Binding(address, named, f"{SOCKET_IFNAME_ENV}={named}")
    if is_loopback(host):
        return Binding(None, None, f"the job's store is on loopback ({host}): one host, the backend's default address")
    source = route_source(host, port)
    if source is None:
        return Binding(None, None, f"no route to the job's store at {host}:{port} from here: the backend's default address")
    return Binding(source, interface_of(source), f"the address this node reaches the job's store {host}:{port} from")


def binding_for_store(store: Any) -> Binding:
    """Where a backend built on ``store`` (a BackendContext's) binds: see ``binding_towards``."""
    endpoint = store_endpoint(store)
    if endpoint is None:
        if settings.current().socket_ifname:
            return binding_towards("", 0)
        return Binding(None, None, "the job's store is not a TCP store (a file or in-process store): the backend's default address")
    return binding_towards(*endpoint)
