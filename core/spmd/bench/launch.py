"""Start the ranks of a measurement on this host: env rendezvous, one process per rank.

``spmd bench`` and the side-by-side scripts in ``benchmarks/`` all start
their ranks the same way: pick a free port, hand every process torchrun's
variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``) and one OpenMP thread, wait for all of them and pass on the
worst exit code. The ranks inherit stdout and stderr, so their output
reaches the caller's terminal as it is written. A launcher prefix such as
``mpiexec -n 2`` replaces the per-rank processes: it starts the ranks itself.

    # a benchmark script that re-runs itself as N ranks
    if "RANK" in os.environ:
        worker(args)
    else:
        sys.exit(relaunch_locally(args.world_size))
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spmd.testing.ports import free_port

#: The variables that say which rank a process is; a launcher's children must not inherit the parent's.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def rendezvous_env(*, port: int | None = None, omp_num_threads: str | None = "1", base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for ranks on this host: ``base`` (default: ours) less its rank variables, plus the rendezvous.

    ``MASTER_ADDR`` is 127.0.0.1 and ``MASTER_PORT`` a free port below the
    kernel's ephemeral range (``spmd.testing.ports.free_port``) unless
    ``port`` is given. ``OMP_NUM_THREADS`` defaults to 1: N ranks on one host
    each spinning up a thread per core measure the oversubscription, not the op.
    ``omp_num_threads=None`` leaves it unset, as a launcher that does not set it
    would: each rank's torch then uses a thread per core.
    """
    drop = RANK_VARIABLES if omp_num_threads is not None else (*RANK_VARIABLES, "OMP_NUM_THREADS")
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in drop}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port() if port is None else port)})
    if omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = omp_num_threads
    return env


def launch_local(cmd: Sequence[str], world_size: int, *, launcher: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, timeout: float | None = None) -> list[int]:
    """Run ``cmd`` as ``world_size`` ranks on this host and return the exit codes.

    Without ``launcher``: ``world_size`` processes, each with ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE`` on top of ``env`` (default:
    ``rendezvous_env()``). With ``launcher`` (a full command prefix, such as
    ``["mpiexec", "-n", "2"]``): one process, ``launcher + cmd``, which starts
    the ranks itself; its exit code is the one returned. On a timeout, or if
    the caller is interrupted, every process still running is killed, and
    the error (``subprocess.TimeoutExpired``, ``KeyboardInterrupt``) propagates.
    """
    base = dict(rendezvous_env() if env is None else env)
    if launcher:
        procs = [subprocess.Popen([*launcher, *cmd], env=base)]
    else:
        procs = [subprocess.Popen(list(cmd), env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size)})
                 for r in range(world_size)]
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def exit_status(codes: Sequence[int]) -> int:
    """One exit status for a set of ranks: the first failure's (a signal N as 128 + N), or 0."""
    failed = next((c for c in codes if c), 0)
    return 128 - failed if failed < 0 else failed


def relaunch_locally(world_size: int, *, argv: Sequence[str] | None = None, launcher: Sequence[str] | None = None,
                     env: Mapping[str, str] | None = None) -> int:
    """Run this script again as ``world_size`` ranks on this host; return the exit status for ``sys.exit``.

    ``argv`` defaults to this process's (the script's absolute path and its
    arguments), run with this interpreter. The caller tells the rank
    processes from itself by ``RANK`` in the environment (or, under a
    ``launcher`` such as mpiexec, by the launcher's own variables). Blocks
    until every rank has exited; their output goes straight to ours.
    """
    args = [os.path.abspath(sys.argv[0]), *sys.argv[1:]] if argv is None else list(argv)
    return exit_status(launch_local([sys.executable, *args], world_size, launcher=launcher, env=env))


def run_as_ranks(worker: Callable[[Any], object], args: Any, world_size: int) -> None:
    """A side-by-side benchmark's entry: as a rank (``RANK`` set), run ``worker(args)``; otherwise start
    ``world_size`` ranks of this script here and exit with the worst of their exit codes."""
    if "RANK" in os.environ:
        worker(args)
        return
    sys.exit(relaunch_locally(world_size))
