"""Where /dev/shm is short of room (a container's default 64 MiB): the segment shrinks to fit, with a warning,
and where not even the smallest fits every rank gets the same named error at once (never a SIGBUS or a hang).

Each job runs in its own mount namespace whose /dev/shm is a small tmpfs (root only; skipped elsewhere)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "room_script.py"


def _in_small_shm(size: str, nproc: int) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give a job its own small /dev/shm")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "sh",
               sys.executable, "-m", "spmd", "run", "--nproc-per-node", str(nproc), str(SCRIPT)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SPMD_BACKEND", None)
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def _results(out: subprocess.CompletedProcess[str]) -> list[dict]:
    found = [json.loads(line.partition("RESULT ")[2]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(found, key=lambda r: r["rank"])


def test_a_small_dev_shm_shrinks_the_segment_and_the_results_stay_right():
    out = _in_small_shm("8m", 2)  # the full segment of 2 ranks is about 20 MiB
    results = _results(out)
    assert out.returncode == 0 and len(results) == 2, out.stdout + out.stderr[-3000:]
    for r in results:
        assert r["backend"] == "shm" and r["1"] and r[str(1 << 18)] and r[str(1 << 22)], r
    assert "had no room for group 'world'" in out.stderr and "--shm-size" in out.stderr, out.stderr[-3000:]


def test_no_room_at_all_is_the_same_named_error_on_every_rank_at_once():
    out = _in_small_shm("256k", 2)
    results = _results(out)
    assert out.returncode != 0 and len(results) == 2, out.stdout + out.stderr[-3000:]
    for r in results:
        assert r["error"] == "BackendUnavailableError", r
        assert "needs a shared segment of at least" in r["message"] and "SPMD_BACKEND=gloo" in r["message"], r
        assert r["elapsed"] < 20, r  # (not the rank-0-never-came timeout: 30 s)
