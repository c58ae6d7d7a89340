"""A multi-host test bed inside one machine: N nodes, each its own network and UTS namespace.

Every node is a network namespace with one interface, ``eth0``, on a private
/24 (``10.213.<k>.0/24``), plugged into a bridge that lives in a namespace of
its own (the "switch"), so no address or route is added to the machine's own
namespace and all traffic stays inside the test bed. Commands run on a node
through ``ip netns exec NS unshare --uts``: the node gets its own hostname
(``node0`` ...), and a private /etc/hosts bind-mounted over the real one in
that command's mount namespace maps the hostname to 127.0.1.1 -- the trap of
many containers, where "this host's address" is loopback.

    with make_hosts(2) as hosts:           # or the ``spmd_hosts`` pytest fixture
        node0, node1 = hosts.nodes
        p = node0.popen(["python", "-m", "spmd", "run", ...])
        hosts.impair(node1, delay_ms=1, loss_pct=0.1)    # netem on node1's link
        hosts.cut(node1); hosts.restore(node1)           # pull and replug its cable
        hosts.kill(node1)                                 # pull its power: every process on it SIGKILLed

Needs root, ``ip`` (iproute2) and ``unshare``/``mount`` (util-linux); ``impair``
also needs the kernel's netem qdisc. What is missing raises ``TestBedUnavailable``
(the fixture turns it into a skip). Names carry the creating process's pid,
so parallel test processes never collide, and leftovers of dead processes are
removed at the next setup.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd.errors import SpmdError
from spmd.polling import poll

#: Every namespace of the test bed starts with this (then the creating pid, "x", a serial).
PREFIX = "spmdh"
_serial = itertools.count()
#: Runs inside a node: $0 the hostname, $1 the private hosts file, then the command.
_ENTER = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


class TestBedUnavailable(SpmdError):
    """The machine cannot host the test bed (not root, no ``ip``/``unshare``, no netem): the message says what is missing."""

    __test__ = False  # not a pytest test class despite the name


def _tool(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)
    if found is None:
        raise TestBedUnavailable(f"the test bed needs `{name}` and it is not installed (iproute2 / util-linux)")
    return found


def _sh(*argv: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    """Run a setup command; a failure raises TestBedUnavailable with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise TestBedUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def hosts_unavailable() -> str | None:
    """None if this machine can make the test bed, else why not (for a skip message)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    try:
        for name in ("ip", "unshare", "mount", "hostname"):
            _tool(name)
    except TestBedUnavailable as missing:
        return str(missing)
    probe = f"{PREFIX}{os.getpid()}probe"
    made = subprocess.run([_tool("ip"), "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    subprocess.run([_tool("ip"), "netns", "del", probe], capture_output=True, timeout=10)
    return None


@dataclass
class Node:
    """One host of the test bed: its namespace, hostname, address and interfaces."""

    index: int
    netns: str
    hostname: str
    address: str
    interface: str  # inside the node: "eth0"
    switch_port: str  # its cable's other end, on the bridge
    hosts_file: Path
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run on this node: its namespace, hostname and /etc/hosts."""
        return [_tool("ip"), "netns", "exec", self.netns, _tool("unshare"), "--uts", "sh", "-c", _ENTER,
                self.hostname, str(self.hosts_file), *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this node in a new session (its process group is killed at teardown)."""
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this node to completion (text output captured); TimeoutExpired past ``timeout``."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.command(argv), timeout=timeout, text=True, **kwargs)


def _stop(process: subprocess.Popen[Any], grace: float = 3.0) -> None:
    """SIGTERM the process's group, then SIGKILL what is left after ``grace`` seconds."""
    if process.poll() is not None:
        return
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Hosts:
    """The nodes of one test bed and the switch namespace that joins them."""

    nodes: list[Node]
    switch: str
    subnet: str
    #: (interface, address) of this process's own link to the switch, once ``attach_here`` made it.
    gateway: tuple[str, str] | None = None

    def attach_here(self) -> str:
        """Plug this process's own network namespace into the switch; returns its address (``.254``) there.

        For a test that hosts something the nodes reach (a World's store and
        listener): the one addition to the machine's own namespace, a veth
        with a private /24, removed with the test bed.
        """
        if self.gateway is None:
            ip = _tool("ip")
            name, address = f"{self.switch[:-2]}g"[-15:], f"{self.subnet.rsplit('.', 1)[0]}.254"
            _sh(ip, "link", "add", name, "type", "veth", "peer", "name", "gw", "netns", self.switch)
            self.gateway = (name, address)
            _sh(ip, "-n", self.switch, "link", "set", "gw", "master", "br0")
            _sh(ip, "-n", self.switch, "link", "set", "gw", "up")
            _sh(ip, "addr", "add", f"{address}/24", "dev", name)
            _sh(ip, "link", "set", name, "up")
        return self.gateway[1]

    def _tc(self, node: Node, *args: str) -> None:
        _sh(_tool("ip"), "netns", "exec", node.netns, _tool("tc"), "qdisc", *args)

    def impair(self, node: Node, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay and drop packets leaving ``node`` (netem on its eth0); TestBedUnavailable without netem."""
        try:
            self._tc(node, "replace", "dev", node.interface, "root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%")
        except TestBedUnavailable as error:
            raise TestBedUnavailable(f"cannot add latency or loss: the kernel has no netem qdisc here ({error})") from error

    def clear(self, node: Node) -> None:
        """Remove what ``impair`` added on ``node``'s link."""
        subprocess.run([_tool("ip"), "netns", "exec", node.netns, _tool("tc"), "qdisc", "del", "dev", node.interface, "root"],
                       capture_output=True, timeout=10)

    def kill(self, node: Node) -> None:
        """Pull ``node``'s power: SIGKILL every process in its network namespace at once (agents, workers, all)."""
        listed = subprocess.run([_tool("ip"), "netns", "pids", node.netns], capture_output=True, text=True, timeout=10).stdout
        for pid in listed.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut(self, node: Node) -> None:
        """Pull ``node``'s cable: its switch port goes down, its packets go nowhere (no reset is sent)."""
        _sh(_tool("ip"), "-n", self.switch, "link", "set", "dev", node.switch_port, "down")

    def restore(self, node: Node) -> None:
        """Plug ``node``'s cable back in."""
        _sh(_tool("ip"), "-n", self.switch, "link", "set", "dev", node.switch_port, "up")

    def close(self) -> None:
        """Stop every process started on a node, then remove the namespaces and hosts files."""
        for node in self.nodes:
            for process in node.processes:
                _stop(process)
        if self.gateway is not None:
            subprocess.run([_tool("ip"), "link", "del", self.gateway[0]], capture_output=True, timeout=10)
        for name in [self.switch, *(node.netns for node in self.nodes)]:
            subprocess.run([_tool("ip"), "netns", "del", name], capture_output=True, timeout=10)
        for node in self.nodes:
            shutil.rmtree(node.hosts_file.parent, ignore_errors=True)


def _remove_leftovers() -> None:
    """Delete test-bed namespaces whose creating process is gone (a test run that was killed)."""
    listed = subprocess.run([_tool("ip"), "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):].partition("x")[0]
        if name.startswith(PREFIX) and pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            subprocess.run([_tool("ip"), "netns", "del", name], capture_output=True, timeout=10)


def _free_subnet(start: int) -> str:
    """``10.213.<k>``: the first from ``start`` that this namespace has no route into (another test bed's ``attach_here``)."""
    routes = subprocess.run([_tool("ip"), "-4", "route", "show"], capture_output=True, text=True, timeout=10).stdout
    for k in (start + i for i in range(250)):
        if f"10.213.{k % 250}." not in routes:
            return f"10.213.{k % 250}"
    raise TestBedUnavailable("every 10.213.<k>.0/24 is routed in this namespace already: too many test beds attached")


def _hosts_file(hostname: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{hostname}-"))
    path = folder / "hosts"
    path.write_text(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n::1 localhost ip6-localhost\n")
    return path


def build_hosts(n: int) -> Hosts:
    """Make a test bed of ``n`` nodes (``close()`` removes it); TestBedUnavailable if this machine cannot."""
    if not 1 <= n <= 200:
        raise ValueError(f"a test bed has 1 to 200 nodes, not {n}")
    reason = hosts_unavailable()
    if reason is not None:
        raise TestBedUnavailable(reason)
    _remove_leftovers()
    ip, serial, pid = _tool("ip"), next(_serial), os.getpid()
    tag = f"{pid}x{serial}"
    subnet = _free_subnet((pid * 7 + serial) % 250)
    hosts = Hosts(nodes=[], switch=f"{PREFIX}{tag}sw", subnet=f"{subnet}.0/24")
    try:
        _sh(ip, "netns", "add", hosts.switch)
        _sh(ip, "-n", hosts.switch, "link", "add", "br0", "type", "bridge")
        _sh(ip, "-n", hosts.switch, "link", "set", "br0", "up")
        for i in range(n):
            hostname = f"node{i}"
            node = Node(i, f"{PREFIX}{tag}n{i}", hostname, f"{subnet}.{i + 1}", "eth0", f"port{i}", _hosts_file(hostname))
            hosts.nodes.append(node)
            _sh(ip, "netns", "add", node.netns)
            _sh(ip, "link", "add", node.switch_port, "netns", hosts.switch, "type", "veth", "peer", "name", node.interface, "netns", node.netns)
            _sh(ip, "-n", hosts.switch, "link", "set", node.switch_port, "master", "br0")
            _sh(ip, "-n", hosts.switch, "link", "set", node.switch_port, "up")
            _sh(ip, "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _sh(ip, "-n", node.netns, "link", "set", node.interface, "up")
            _sh(ip, "-n", node.netns, "link", "set", "lo", "up")
        _await_links(hosts)
    except BaseException:
        hosts.close()
        raise
    return hosts


def _await_links(hosts: Hosts, timeout: float = 10.0) -> None:
    """Wait until every node's eth0 has carrier (a veth comes up asynchronously)."""
    deadline = time.monotonic() + timeout
    for node in hosts.nodes:
        if not poll(lambda node=node: "LOWER_UP" in _link_state(node), deadline - time.monotonic(), 0.05):  # type: ignore[misc]
            raise TestBedUnavailable(f"{node.hostname}'s link did not come up within {timeout:.0f} s: {_link_state(node).strip()}")


def _link_state(node: Node) -> str:
    """``ip link show`` of the node's interface, one line."""
    return subprocess.run([_tool("ip"), "-n", node.netns, "-o", "link", "show", node.interface],
                          capture_output=True, text=True, timeout=10).stdout


@contextmanager
def make_hosts(n: int = 2) -> Iterator[Hosts]:
    """A test bed of ``n`` nodes for the ``with`` block, torn down (processes included) on exit."""
    hosts = build_hosts(n)
    try:
        yield hosts
    finally:
        hosts.close()
