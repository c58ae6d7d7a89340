"""A rank that dies (SIGKILL) or stalls becomes a named error on the others within timeout + 2 s,
and a job with a SIGKILLed rank leaves nothing in /dev/shm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spmd.testing.processes import run_ranks
from spmd_shm.segment import shm_dir

SCRIPT = Path(__file__).parent / "fault_script.py"
WORLD = 3


def _segments() -> set[str]:
    return {name for name in os.listdir(shm_dir()) if name.startswith("spmd-shm-")}


def run_world(scenario: str, timeout: float, cwd: Path) -> dict[int, dict]:
    """Run fault_script.py on WORLD ranks in ``cwd`` (where trace dumps land); the survivors' RESULT lines by rank.
    A scenario ending in ``_split`` runs its all_reduce through the reduce-scatter + all-gather path."""
    results = {}
    env = {"SPMD_SHM_SPLIT_RANKS": "2", "SPMD_SHM_SPLIT_BYTES": "0"} if scenario.endswith("_split") else {}
    scenario = scenario.removesuffix("_split")
    for run in run_ranks(SCRIPT, [scenario, str(timeout)], WORLD, timeout + 60, env=env, cwd=cwd):
        line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line:
            results[run.rank] = json.loads(line[len("RESULT "):])
        elif run.rank != WORLD - 1:
            raise AssertionError(f"rank {run.rank} printed no result (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}")
    return results


@pytest.mark.parametrize("scenario", ["kill_mid_all_reduce", "kill_mid_all_reduce_split", "kill_before_recv"])
def test_sigkilled_rank_is_a_named_error_and_leaves_no_segment(scenario: str, tmp_path: Path) -> None:
    before = _segments()
    timeout = 20.0
    results = run_world(scenario, timeout, tmp_path)
    assert sorted(results) == [0, 1], results
    for res in results.values():
        assert res["error"] == "CollectiveError" and res["spmd_error"], res
        # this rank saw rank 2 exit, or learnt from the survivor that saw it first; both name it
        assert "ranks [2]" in res["message"] or "reached seq 1: [2]" in res["message"], res["message"]
        assert res["elapsed"] < timeout + 2, res
        assert res["after"] == "CollectiveError" and res["after_elapsed"] < 2, res
    assert any("exited" in res["message"] for res in results.values()), results
    assert _segments() - before == set(), "the job left shared-memory segments behind"


def test_stalled_rank_is_a_timeout_naming_it(tmp_path: Path) -> None:
    """The first survivor to reach its deadline raises the timeout; the other may instead learn
    from the kernel that this rank gave up (a CollectiveError): both name the stalled rank."""
    timeout = 3.0
    results = run_world("stall", timeout, tmp_path)
    errors = {results[r]["error"] for r in (0, 1)}
    assert "CollectiveTimeoutError" in errors and errors <= {"CollectiveTimeoutError", "CollectiveError"}, results
    for r in (0, 1):
        res = results[r]
        assert res["spmd_error"] and "never reached seq 1: [2]" in res["message"], res["message"]
        # + the kernel's diagnosis: it waits up to 2 s for the ranks' flight-recorder dumps
        assert res["elapsed"] < timeout + 3, res
    assert min(results[r]["elapsed"] for r in (0, 1)) > timeout - 0.5, results


def test_a_segment_is_named_after_its_job_group_and_host_with_a_fresh_token() -> None:
    from spmd_shm.segment import segment_name

    first, second = segment_name("run 7/a", "tp:0", "node-1"), segment_name("run 7/a", "tp:0", "node-1")
    assert first.startswith("spmd-shm-run_7_a-") and first.endswith("-tp_0-node-1"), first
    assert first != second  # a random token: an earlier job's leftover is never taken for this one's
    assert segment_name("", "world", "h").startswith("spmd-shm-") and "--" not in segment_name("", "world", "h")
