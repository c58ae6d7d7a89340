"""torch's DistributedDataParallel over spmd's process group when a peer dies or raises: the survivor gets a Python
exception from backward naming the failed collective (a failed spmd Work reached DDP's reducer as a future whose
*value* was the exception, and the reducer unpacked it as tensors: SIGSEGV)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_collective_errors import _launcher

from spmd.testing.processes import run_ranks

SCRIPT = Path(__file__).parent / "fault_scripts" / "torch_ddp_peer_fails.py"


def _run(backend: str, mode: str) -> list[tuple[int, str, str]]:
    launcher, reason = _launcher(backend)
    if launcher is None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if launcher:  # mpiexec starts both ranks; their outputs arrive together
        command = [part.replace("{n}", "2") for part in launcher] + [sys.executable, str(SCRIPT), backend, mode]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        return [(done.returncode, done.stdout, done.stderr)]
    return [(run.returncode, run.stdout, run.stderr) for run in run_ranks(SCRIPT, [backend, mode], 2, 120)]


@pytest.mark.parametrize("backend", ["gloo", "ucc", "mpi"])
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_torch_ddp_survivor_gets_an_exception_when_its_peer_fails(backend, mode):
    if backend == "mpi" and mode == "kill":
        pytest.skip("mpiexec ends the whole job when one rank is killed by a signal: the survivor never runs on")
    results = _run(backend, mode)
    code, out, err = results[0]
    assert code != -11 and "Segmentation fault" not in err, err[-3000:]
    survivor = next((line for line in out.splitlines() if line.startswith("SURVIVOR")), None)
    assert survivor is not None, (code, out, err[-3000:])
    assert "CollectiveError" in survivor or "CollectiveTimeoutError" in survivor, survivor
    assert "finished all steps" not in out
    if len(results) == 2:  # rank 0 exited through the script's handler; rank 1 as it was told to
        assert code == 3, (code, err[-3000:])
        assert results[1][0] == (-9 if mode == "kill" else 1), results[1]
