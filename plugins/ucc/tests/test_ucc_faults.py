"""A peer that dies becomes a named CollectiveError on the survivors, well before the timeout.

Shared-memory transports cannot see a dead peer; spmd-ucc's TCP sentinel
endpoints can (the kernel resets a dead process's sockets). The timeout is
set far above the expected detection time, so passing means detection, not
the timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_ucc import probe

try:
    from spmd.testing.ports import free_port  # a port outside the ephemeral range (no race)
except ImportError:  # an spmd without it
    import socket

    def free_port(host: str = "127.0.0.1") -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])

pytestmark = pytest.mark.skipif(probe.ucxx_missing() is not None, reason=f"ucc backend not usable here: {probe.ucxx_missing()}")

SCRIPT = Path(__file__).parent / "fault_script.py"
EXIT_SCRIPT = Path(__file__).parent / "exit_script.py"
TIMEOUT = 30.0
DETECTED_WITHIN = 8.0  # seconds; typically well under one (a busy shared machine is slower)


def run_world(scenario: str, world: int = 3, extra_env: dict[str, str] | None = None) -> dict[int, dict]:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                 "OMP_NUM_THREADS": "1", **(extra_env or {})})
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), scenario, str(TIMEOUT)],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = {}
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=TIMEOUT + 30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line:
            results[r] = json.loads(line[len("RESULT "):])
        elif r != world - 1:
            raise AssertionError(f"rank {r} printed no result (exit {p.returncode}):\n{out}\n{err[-3000:]}")
    return results


@pytest.mark.parametrize("scenario", ["all_reduce", "all_reduce_ring", "recv", "broadcast", "async"])
def test_dead_peer_is_a_named_error_not_a_hang(scenario):
    results = run_world(scenario)
    assert 2 not in results
    for r in (0, 1):
        res = results[r]
        assert res["error"] == "CollectiveError", res
        assert "rank 2" in res["message"] and "unreachable" in res["message"], res["message"]
        # elapsed includes the kernel's diagnosis (it collects the survivors' flight recorders)
        assert res["elapsed"] < DETECTED_WITHIN, res
        # the group is broken: the next op fails without waiting for anyone
        assert res["after"] == "CollectiveError" and res["after_elapsed"] < DETECTED_WITHIN, res


def test_a_rank_that_finishes_first_and_exits_is_no_error():
    """Its last send was delivered; the others go on exchanging and see no failure."""
    results = run_world("finish_first")
    for r in (0, 1):
        assert results[r]["error"] is None, results[r]
    assert results[1]["saw_failure"], "rank 1 should have noticed rank 2 leaving while it waited"


@pytest.mark.parametrize("how", ["destroy", "keep"])
def test_normal_exit_is_clean(how):
    """No abort at interpreter exit ("terminate called without an active exception").

    UCX torn down by the garbage collector during finalization used to abort
    about one exit in five; spmd-ucc now tears it down in an atexit hook.
    Three jobs of two ranks each, so a regression shows most of the time.
    """
    for _ in range(3):
        base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
        procs = [subprocess.Popen([sys.executable, str(EXIT_SCRIPT), how], env={**base, "RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and "terminate called" not in err, f"exit {p.returncode}:\n{err[-3000:]}"
