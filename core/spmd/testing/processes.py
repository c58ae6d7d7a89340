"""Run a script as the ranks of one job, each a plain process with torchrun's variables (for fault tests).

A test that kills or stalls a rank cannot use a ``World`` (its ranks run test
functions and report back); it runs a script on every rank instead, and reads
what each printed and how each ended. Every rank is waited for with a bound
and killed if it outlives it, so a hung rank fails the test instead of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from spmd.testing.ports import free_port


@dataclass
class RankRun:
    """How one rank ended: its exit code (negative: the signal that ended it) and what it printed."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


def run_ranks(script: str | Path, args: Sequence[str], world: int, timeout: float,
              env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> list[RankRun]:
    """Start ``python script *args`` as ranks 0..world-1 of a job on this host (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
    OMP_NUM_THREADS=1 and ``env`` on top of this environment); wait up to ``timeout`` seconds for each, killing any
    still running then; return every rank's outcome in rank order."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
                 "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **(env or {})})
    procs = [subprocess.Popen([sys.executable, str(script), *args], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    runs = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            runs.append(RankRun(rank, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs
