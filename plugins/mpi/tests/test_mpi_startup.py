"""MPI's start-up calls (communicator creation) have no timeout: spmd's does, and names the rank that never came."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_mpi import probe

SCRIPT = Path(__file__).parent / "late_rank_script.py"


def _rank0_line(what: str) -> str:
    path, why = probe.find_mpiexec()
    if path is None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([*probe.mpiexec_command(2, path), sys.executable, str(SCRIPT), what], env=env,
                          capture_output=True, text=True, timeout=120)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT 0 ")), None)
    assert line is not None, (done.returncode, done.stdout, done.stderr[-3000:])
    return line


def test_a_rank_late_to_init_is_named_within_the_timeout():
    _, _, seconds, what = _rank0_line("init").split(" ", 3)
    assert what.startswith("SpmdError") and "ranks [1] never arrived" in what, what
    assert float(seconds) < 4.0 + 3.0, seconds  # (the store's own connect and the first wait: timeout + 2 s, +1 for load)


def test_a_rank_late_to_a_new_groups_communicator_is_named_within_the_timeout():
    _, _, seconds, what = _rank0_line("group").split(" ", 3)
    assert what.startswith("CollectiveTimeoutError") and "ranks [1] never reached their first collective" in what, what
    assert "group1" in what, what
    assert float(seconds) < 4.0 + 2.0, seconds
