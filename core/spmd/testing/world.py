"""World: N real worker processes, initialised once, that run test functions on demand.

Starting a process that imports torch costs about a second, so a World is
started once per (backend, world size) and runs many functions. A function
runs on every rank at once; its per-rank return values come back as a list.
An exception on any rank fails the run with that rank's traceback; a run that
outlives its timeout kills the world (the pool starts a fresh one) and names
the ranks that never finished.

``launcher`` starts the ranks through a job launcher instead of one
subprocess each: ``World(4, "mpi", launcher=["mpiexec", "-n", "{n}"])`` runs
one ``mpiexec`` whose processes take their rank from the launcher's
environment (through the cluster-environment plugins); ``{n}`` in any
argument becomes the world size.

``host`` is the address the ranks reach the test's store and listener at,
``rank_prefix(rank)`` an argv prefix per rank: with the ``spmd_hosts`` test
bed, ``World(4, "gloo", host=hosts.attach_here(), rank_prefix=lambda r:
hosts.nodes[r % 2].command([]))`` spreads the ranks over two nodes.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from spmd.comm.tcp_store import host_tcp_store

#: Seconds a collective may block inside a test world before it raises.
DEFAULT_COLLECTIVE_TIMEOUT = 30.0
#: Seconds the other ranks get to finish once one rank has failed.
FAILURE_GRACE = 3.0


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class WorldTimeout(AssertionError):
    """A run did not finish on every rank in time; the world was killed."""


class World:
    """N worker processes joined in one spmd job over ``backend``."""

    def __init__(
        self,
        world_size: int,
        backend: str | None,
        *,
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 60.0,
        launcher: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        rank_prefix: Callable[[int], Sequence[str]] | None = None,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.launcher = tuple(launcher) if launcher else None
        self.alive = False
        self._procs: list[subprocess.Popen] = []
        self._rank_procs: list[subprocess.Popen] = []  # the process that hosts each rank
        self._conns: list[Connection] = []
        authkey = secrets.token_bytes(16)
        self._store = host_tcp_store(host, 0, world_size, timedelta(seconds=start_timeout), wait_for_workers=False)
        self._listener = Listener((host, 0), authkey=authkey)
        worker_env = dict(os.environ)
        worker_env.setdefault("OMP_NUM_THREADS", "1")
        worker_env.update(env or {})
        host, port = self._listener.address

        def worker_cmd(rank: int) -> list[str]:
            return [
                sys.executable, "-m", "spmd.testing._worker",
                f"{host}:{port}", authkey.hex(), str(rank), str(world_size),
                backend or "", str(self._store.port), str(collective_timeout),
            ]

        try:
            if self.launcher is None:
                for rank in range(world_size):
                    prefix = list(rank_prefix(rank)) if rank_prefix is not None else []
                    self._procs.append(subprocess.Popen([*prefix, *worker_cmd(rank)], env=worker_env))
                self._rank_procs = list(self._procs)
            else:
                # One launcher process runs every rank; rank -1 tells workers to ask their environment.
                prefix = [arg.replace("{n}", str(world_size)) for arg in self.launcher]
                self._procs.append(subprocess.Popen([*prefix, *worker_cmd(-1)], env=worker_env))
                self._rank_procs = self._procs * world_size
            deadline = time.monotonic() + start_timeout
            self._conns = self._accept_all(deadline)
            self._collect(list(range(world_size)), deadline, "start-up")
            self.alive = True
        except BaseException:
            self.close()
            raise

    def _accept_all(self, deadline: float) -> list[Connection]:
        """Accept one connection per rank; fail early if a worker dies, or at the deadline."""
        conns: dict[int, Connection] = {}

        def accept() -> None:
            try:
                while len(conns) < self.world_size:
                    conn = self._listener.accept()
                    conns[conn.recv()] = conn
            except OSError:
                pass  # the listener was closed: start-up gave up

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            dead = [r for r, p in enumerate(self._rank_procs) if p.poll() is not None and r not in conns]
            if dead or time.monotonic() > deadline:
                self._listener.close()
                reason = f"ranks {dead} exited during start-up" if dead else "start-up timed out"
                raise WorldTimeout(f"could not start a world of {self.world_size} on {self.backend!r}: {reason}")
        return [conns[r] for r in range(self.world_size)]

    # -- running -----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        if not self.alive:
            raise RuntimeError("this World was closed or killed; start a new one")
        # Pickled apart from the envelope so the worker can extend sys.path before unpickling.
        message = ("run", pickle.dumps((fn, args, kwargs)), list(sys.path))
        for conn in self._conns:
            conn.send(message)
        return self._collect(list(range(self.world_size)), time.monotonic() + timeout, getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, ranks: list[int], deadline: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        retire = False
        pending: dict[Any, int] = {self._conns[r]: r for r in ranks}
        while pending:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + FAILURE_GRACE)
            if now >= deadline:
                break
            for conn in wait(list(pending), timeout=deadline - now):
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()  # type: ignore[union-attr,call-arg]
                except (EOFError, OSError):
                    code = self._rank_procs[rank].poll()
                    errors[rank] = f"worker process exited (code {code}) without reporting"
                    continue
                if status in ("ok", "ok-retire"):
                    results[rank] = payload
                    retire = retire or status == "ok-retire"
                else:
                    errors[rank] = str(payload)
        if pending or errors:
            stuck = sorted(pending.values())
            self.kill()
            report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            if stuck and not errors:
                raise WorldTimeout(f"{what}: ranks {stuck} did not finish in time (world of {self.world_size} killed)")
            suffix = f"\n(ranks {stuck} were still running and were killed)" if stuck else ""
            raise RankFailure(f"{what} failed on ranks {sorted(errors)}:{report}{suffix}")
        if retire:  # a rank's world group is unusable after a caught failure: the next test gets a new world
            self.kill()
        return [results[r] for r in ranks]

    # -- teardown ----------------------------------------------------------------------
    def kill(self) -> None:
        """Stop every worker at once (used after a failure or timeout)."""
        self.alive = False
        if self.launcher is not None:
            self._stop_launched()
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._release()

    def _stop_launched(self) -> None:
        """Stop a launcher and the processes it started (launchers may detach them).

        The launcher gets SIGTERM, which job launchers forward to their ranks;
        whatever of its process tree is left after a grace period is killed.
        """
        for proc in self._procs:
            if proc.poll() is not None:
                continue
            tree = _descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
            for pid, started in tree:
                if _start_time(pid) != started:
                    continue  # gone (or its pid now belongs to another process)
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def close(self) -> None:
        """Ask workers to exit cleanly, then kill what remains."""
        try:
            if self.alive:
                for conn in self._conns:
                    try:
                        conn.send(("exit",))
                    except OSError:
                        pass
                for proc in self._procs:
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        finally:
            self.kill()

    def _release(self) -> None:
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._conns = []
        self._listener.close()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a process from a later one with its pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[19]


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``pid``; empty where /proc is missing."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            started = _start_time(child)
            if started is not None:
                found.append((child, started))
            todo.append(child)
    return found
