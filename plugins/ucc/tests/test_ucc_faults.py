"""A peer that dies becomes a named CollectiveError on the survivors, well before the timeout.

Shared-memory transports cannot see a dead peer; spmd-ucc's TCP sentinel
endpoints can (the kernel resets a dead process's sockets). The timeout is
set far above the expected detection time, so passing means detection, not
the timeout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmd.testing.processes import run_ranks
from spmd_ucc import probe

pytestmark = pytest.mark.skipif(probe.ucxx_missing() is not None, reason=f"ucc backend not usable here: {probe.ucxx_missing()}")

SCRIPT = Path(__file__).parent / "fault_script.py"
EXIT_SCRIPT = Path(__file__).parent / "exit_script.py"
TIMEOUT = 30.0
DETECTED_WITHIN = 8.0  # seconds; typically well under one (a busy shared machine is slower)


def run_world(scenario: str, world: int = 3, extra_env: dict[str, str] | None = None) -> dict[int, dict]:
    results = {}
    for run in run_ranks(SCRIPT, [scenario, str(TIMEOUT)], world, TIMEOUT + 30, env=extra_env):
        line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line:
            results[run.rank] = json.loads(line[len("RESULT "):])
        elif run.rank != world - 1:
            raise AssertionError(f"rank {run.rank} printed no result (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}")
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
        for run in run_ranks(EXIT_SCRIPT, [how], 2, 120):
            assert run.returncode == 0 and "terminate called" not in run.stderr, f"exit {run.returncode}:\n{run.stderr[-3000:]}"
