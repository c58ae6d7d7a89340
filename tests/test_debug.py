"""Hangs become named errors: fault scenarios on Gloo and on the isend/irecv-only backend, dumps, analysis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import helpers
import spmd
from spmd.comm.backend import Backend, BackendSpec
from spmd.comm.work import Work
from spmd.debug import analyze
from spmd.debug.recorder import FlightRecorder, recorder, shapes_and_dtypes
from spmd.plugins import manager
from spmd.testing.ports import free_port

SCRIPT = Path(__file__).parent / "fault_scripts" / "fault.py"
TIMEOUT = 3.0


def run_world(scenario: str, backend: str, trace_dir: Path, extra_env: dict[str, str] | None = None) -> dict[int, dict]:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3", "OMP_NUM_THREADS": "1",
                 "SPMD_TRACE_DIR": str(trace_dir), "SPMD_WATCHDOG_INTERVAL": "0.5", **(extra_env or {})})
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), scenario, backend, str(TIMEOUT)], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    results = {}
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=60)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line:
            results[r] = json.loads(line[len("RESULT "):])
    return results


def analysis(trace_dir: Path) -> tuple[str, dict]:
    out = subprocess.run([sys.executable, "-m", "spmd", "trace", "analyze", str(trace_dir)], capture_output=True, text=True, check=True).stdout
    data = json.loads(subprocess.run([sys.executable, "-m", "spmd", "trace", "analyze", str(trace_dir), "--json"], capture_output=True, text=True, check=True).stdout)
    return out, data


BACKENDS = ["gloo", "p2p"]


def _assert_named_in_time(result: dict, kinds: tuple[str, ...]) -> None:
    assert result["error"] in kinds, result
    assert result["elapsed"] < TIMEOUT + 2, result
    assert "group 'world'" in result["message"], result["message"]
    assert "seq 1" in result["message"] or "collective #1" in result["message"], result["message"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_that_skips_a_collective(tmp_path, backend):
    results = run_world("skip", backend, tmp_path)
    for r in (0, 1):
        # The first rank to time out gives the group up; the other is then stopped with the refusal
        # (CollectiveError) unless its own timeout came first: either way rank 2 is named.
        _assert_named_in_time(results[r], ("CollectiveTimeoutError", "CollectiveError"))
        assert "all_reduce" in results[r]["message"]
        assert "ranks that never reached seq 1: [2]" in results[r]["message"]
    text, data = analysis(tmp_path)
    world = next(g for g in data["groups"] if g["name"] == "world")
    assert world["stuck_seq"] == 1
    assert "never reached #1" in world["at_stuck"]["2"]
    assert "stuck at #1" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_raises_and_exits_is_named_with_its_reason(tmp_path, backend):
    """Rank 2's call raises (a wrong output size), it gives the group up and its process ends: the others,
    whose ops break when its connections close, name rank 2's reason (they said only "connection closed",
    or the reason of whichever survivor failed first)."""
    results = run_world("raise_and_exit", backend, tmp_path)
    assert 2 not in results
    for r in (0, 1):
        assert results[r]["error"] == "CollectiveError", results[r]
        assert "rank 2 gave up on it: all_gather_into_tensor raised on rank 2" in results[r]["message"], results[r]["message"]
        assert results[r]["elapsed"] < TIMEOUT + 2, results[r]  # (the diagnosis watches the dead rank for a second or two)


def test_a_live_rank_whose_clock_runs_behind_is_not_called_dead(tmp_path):
    """Rank 2 skips collective #1 but lives, on a host whose clock is 30 s behind: the diagnosis places it
    and does not call it dead (the heartbeat's age was read across hosts' clocks: "no heartbeat for 30 s")."""
    results = run_world("skip", "gloo", tmp_path, {"FAULT_CLOCK_BEHIND_S": "30"})
    diagnosed = [results[r]["message"] for r in (0, 1) if results[r]["error"] == "CollectiveTimeoutError"]
    assert diagnosed, results
    for message in diagnosed:
        assert "ranks that never reached seq 1: [2]" in message and "rank 2: last started" in message, message
        rank2 = next(line for line in message.splitlines() if line.strip().startswith("rank 2:"))
        # (only rank 2's line: rank 0 or 1 may rightly be called dead, as the script exits each right after its error)
        assert "likely dead" not in rank2, message


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_that_exits_mid_job(tmp_path, backend):
    results = run_world("exit", backend, tmp_path)
    assert 2 not in results
    for r in (0, 1):
        _assert_named_in_time(results[r], ("CollectiveTimeoutError", "CollectiveError"))
    # (the first to fail explains it; the other may be stopped by its announcement first)
    assert any("rank 2: never published progress, nor answered a dump request" in results[r]["message"] for r in (0, 1)), results
    text, data = analysis(tmp_path)
    assert data["ranks_without_dumps"] == [2]
    assert "NO DUMP from ranks [2]" in text


def test_store_outlives_rank_0_under_spmd_run(tmp_path):
    """Under `spmd run` the job's store lives in the agent, so when rank 0 leaves, the
    others still read every rank's progress and name rank 0 as the one missing."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"SPMD_TRACE_DIR": str(tmp_path), "SPMD_WATCHDOG_INTERVAL": "0.5"})
    proc = subprocess.run([sys.executable, "-m", "spmd", "run", "--nproc-per-node", "3", str(SCRIPT), "rank0_leaves", "gloo", str(TIMEOUT)],
                          env=env, capture_output=True, text=True, timeout=120)
    results = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == [1, 2], proc.stdout + proc.stderr
    for result in results:
        _assert_named_in_time(result, ("CollectiveTimeoutError", "CollectiveError"))
        assert "ranks that never reached seq 1: [0]" in result["message"], result["message"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_that_calls_a_different_collective(tmp_path, backend):
    results = run_world("mismatch_op", backend, tmp_path)
    for r in (0, 1, 2):
        if results[r]["error"] is None:
            # Gloo may pair an all_reduce with an all_gather of equal bytes; a survivor that
            # finished early is not a hang, and the dumps must still show the divergence.
            continue
        # rank 2's all_gather is new to the group: its comparison names the disagreement (CollectiveDesyncError)
        # once the always-on check found it; the ranks inside Gloo end on the refusal or their timeout
        _assert_named_in_time(results[r], ("CollectiveTimeoutError", "CollectiveError", "CollectiveDesyncError"))
    _, data = analysis(tmp_path)
    world = next(g for g in data["groups"] if g["name"] == "world")
    assert world["divergence"]["seq"] == 1
    calls = world["divergence"]["calls"]
    assert calls["0"].startswith("all_reduce") and calls["2"].startswith("all_gather_into_tensor")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_shapes_in_debug_mode(tmp_path, backend):
    results = run_world("mismatch_shape", backend, tmp_path, {"SPMD_DESYNC_CHECK": "1"})
    for r in (0, 1, 2):
        assert results[r]["error"] == "CollectiveDesyncError", results[r]
        assert results[r]["elapsed"] < TIMEOUT + 2
        message = results[r]["message"]
        assert "ranks disagree on collective #1 of group 'world'" in message
        assert "rank 0: all_reduce(float32; 4) SUM" in message and "rank 2: all_reduce(float32; 5) SUM" in message


def test_dump_format_and_analysis_of_a_clean_run(tmp_path, spmd_setenv):
    spmd_setenv("SPMD_TRACE_DIR", str(tmp_path))
    spmd.init("gloo")
    try:
        t = torch.ones(3)
        spmd.all_reduce(t)
        spmd.broadcast(t, src=0)
        # Ops whose Work is done before the kernel attaches the recorder entry complete it too.
        spmd.all_gather_into_tensor(torch.empty(0), torch.empty(0))
        spmd.broadcast(torch.empty(0), src=0, async_op=True).wait()
        path = spmd.debug.dump("test")
    finally:
        spmd.destroy_process_group()
    data = json.loads(path.read_text())
    assert data["version"] == spmd.debug.dump_format_version == 1
    ops = [(e["op"], e["state"]) for e in data["entries"] if e["group"] == "world"][-4:]
    assert ops == [("all_reduce", "completed"), ("broadcast", "completed"),
                   ("all_gather_into_tensor", "completed"), ("broadcast", "completed")]
    assert data["progress"]["world"]["last_completed"] == data["progress"]["world"]["last_started"]
    result = analyze.analyze(analyze.load(tmp_path))
    assert result["groups"][0]["stuck_seq"] is None


def test_recorder_is_bounded_and_can_be_off():
    rec = FlightRecorder(3)
    for i in range(10):
        rec.start("g", i, "all_reduce", (torch.ones(1),))
    assert [e.seq for e in rec.entries] == [7, 8, 9]
    off = FlightRecorder(0)
    off.start("g", 0, "all_reduce", (torch.ones(1),))
    assert not off.entries and off.progress["g"][0] == 0


def test_ops_that_succeeded_when_recorded_read_back_as_completed_entries():
    """The ring keeps such ops as Records (tuples); every reader sees Entries, in order, with their fields."""
    rec = FlightRecorder(10)
    t, pair = torch.ones(2, 3), (torch.ones(4), torch.zeros(8, dtype=torch.float64))
    rec.completed("g", 0, "all_reduce", *shapes_and_dtypes((t,)), spmd.ReduceOp.SUM)
    rec.start("g", 1, "broadcast", (t,))  # still running: an Entry
    rec.completed("g", 2, "all_gather_into_tensor", *shapes_and_dtypes(pair), None)
    rec.completed("g", 3, "gather", *shapes_and_dtypes((t, t, t)), None)
    snapshot = rec.snapshot()
    assert [(e["seq"], e["op"], e["state"]) for e in snapshot] == [
        (0, "all_reduce", "completed"), (1, "broadcast", "started"), (2, "all_gather_into_tensor", "completed"), (3, "gather", "completed")]
    assert snapshot[0]["shapes"] == [[2, 3]] and snapshot[0]["reduce_op"] == "SUM" and snapshot[0]["t_end"] == snapshot[0]["t_start"]
    assert snapshot[2]["shapes"] == [[4], [8]] and snapshot[2]["dtypes"] == ["float32", "float64"]
    assert [e.seq for e in rec.history("g", after=1)] == [2, 3]
    assert [e.signature() for e in rec.history("g")][0] == "all_reduce(float32; 2x3) SUM"
    assert rec.progress["g"][:4] == [3, "gather", 3, "gather"]
    assert rec.published_progress()["g"][4] == "gather(float32,float32,float32; 2x3,2x3,2x3)"


class _FinishedAtOnce(Backend):
    """A backend whose ops have succeeded when they return (``Work.completed()``): the kernel records them as Records."""

    def isend(self, tensor, dst, tag=0):
        return Work.completed()

    def irecv(self, tensor, src, tag=0):
        return Work.completed()

    def broadcast(self, tensor, src):
        return Work.completed()


def test_ops_that_succeed_at_once_are_recorded_and_described(spmd_setenv):
    plugin = types.ModuleType("finished_at_once")
    plugin.spmd_backends = spmd.hookimpl(lambda: [BackendSpec("at-once", ("cpu",), factory=_FinishedAtOnce, description="test")])
    manager().register(plugin, name="finished-at-once")
    spmd_setenv("SPMD_WATCHDOG", "0")
    spmd.init("at-once", rank=0, world_size=1, store=torch.distributed.HashStore(), torch_interop=False)
    try:
        t = torch.ones(2)
        spmd.broadcast(t, src=0)
        work = spmd.broadcast(t, src=0, async_op=True)
        assert work.wait() and work.is_completed() and work.result() == [t]
        assert work.description == "broadcast on group 'world' (seq 1, ranks [0])", work.description
        entries = [e for e in recorder.snapshot() if e["group"] == "world"][-2:]
        assert [(e["seq"], e["op"], e["state"]) for e in entries] == [(0, "broadcast", "completed"), (1, "broadcast", "completed")]
    finally:
        spmd.destroy_process_group()
        manager().unregister(name="finished-at-once")


def test_stopping_the_watchdog_waits_for_the_store_call_in_flight():
    """A watchdog thread left inside a store call while the interpreter finalizes aborts the process,
    so ``stop`` returns only once the thread's current step is over."""
    import threading
    import time

    import torch.distributed as tdist

    from spmd.comm.health.watchdog import Watchdog

    in_call = threading.Event()

    class SlowStore(tdist.Store):
        """A store whose counter reads take 0.5 s once the watchdog runs (a store host under load)."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = tdist.HashStore()
            self.slow = False

        def add(self, key: str, value: int) -> int:
            if self.slow:
                in_call.set()
                time.sleep(0.5)
            return self.inner.add(key, value)

        def set(self, key: str, value: bytes | str) -> None:
            self.inner.set(key, value)

    store = SlowStore()
    dog = Watchdog(store, rank=0, interval=0.05)
    dog.start()
    store.slow = True
    assert in_call.wait(5.0)
    dog.stop()
    assert not dog.thread.is_alive()


def _dump_of(rank: int, entries: list[tuple[str, list[list[int]], str | None]]) -> dict:
    """A two-rank flight-recorder dump of completed ops on group 'world' (what ``spmd.debug.dump`` writes)."""
    rows = [{"group": "world", "seq": seq, "op": op, "shapes": shapes, "dtypes": ["float32"] * len(shapes), "reduce_op": reduce,
             "peer": None, "t_start": 0.0, "t_end": 0.0, "state": "completed", "error": None, "context": None}
            for seq, (op, shapes, reduce) in enumerate(entries)]
    return {"version": 1, "rank": rank, "world_size": 2, "groups": {"world": [0, 1]}, "progress": {}, "entries": rows}


def test_trace_analysis_takes_uneven_all_to_all_shapes_and_finds_the_real_divergence():
    """An uneven all_to_all_single (rows 10 and 14 each way, rows of 4) is consistent; the SUM against
    MAX at #3 is the divergence (the shapes of #0 used to be reported as the first one)."""
    common = [("all_reduce", [[4]], "SUM"), ("all_reduce", [[4]], "SUM")]
    rank0 = [("all_to_all_single", [[10, 4], [14, 4]], None), *common, ("all_reduce", [[4]], "SUM")]
    rank1 = [("all_to_all_single", [[14, 4], [10, 4]], None), *common, ("all_reduce", [[4]], "MAX")]
    result = analyze.analyze({0: _dump_of(0, rank0), 1: _dump_of(1, rank1)})
    world = next(g for g in result["groups"] if g["name"] == "world")
    assert world["divergence"]["seq"] == 3, world
    rows = _dump_of(1, [("all_to_all_single", [[14, 8], [10, 8]], None)])  # rows of 8 against rows of 4: a real one
    world = next(g for g in analyze.analyze({0: _dump_of(0, rank0[:1]), 1: rows})["groups"] if g["name"] == "world")
    assert world["divergence"]["seq"] == 0, world


def _all_reduces(rank: int, seqs: range, stuck: int | None = None, time: float = 1000.0, run: list | None = None) -> dict:
    """A dump of all_reduces on group 'world' of 2 ranks with sequence numbers ``seqs`` (``stuck`` still running)."""
    dump = _dump_of(rank, [("all_reduce", [[4]], "SUM")] * len(seqs))
    for entry, seq in zip(dump["entries"], seqs):
        entry["seq"] = seq
        entry["state"] = "started" if seq == stuck else "completed"
    dump.update(time=time, run=run or ["job", "0"])
    return dump


def test_trace_analysis_after_the_flight_recorder_ring_wrapped():
    """Rank 0 waits in #4999, rank 1 never came past #4998; each ring holds its last 2000 ops, so rank 0's no
    longer has #2999: that is no evidence of anything (it used to be reported as stuck at #2999)."""
    result = analyze.analyze({0: _all_reduces(0, range(3000, 5000), stuck=4999), 1: _all_reduces(1, range(2999, 4999))})
    world = result["groups"][0]
    assert world["stuck_seq"] == 4999 and world["divergence"] is None, world
    assert world["at_stuck"][1].startswith("never reached #4999"), world


def test_trace_analysis_leaves_out_dumps_of_an_earlier_run():
    """Today rank 0 hangs in #3 and rank 1 died without a dump; yesterday's rank1.json (of another run) must not
    stand in for it as 'ok'."""
    today = _all_reduces(0, range(4), stuck=3, time=100_000.0, run=["job-b", "0"])
    yesterday = _all_reduces(1, range(8), time=13_600.0, run=["job-a", "0"])
    result = analyze.analyze({0: today, 1: yesterday})
    assert result["ranks_without_dumps"] == [1] and list(result["stale_dumps"]) == ["1"], result
    assert "left out as stale" in analyze.render(result)


def test_a_point_to_point_timeout_is_diagnosed_by_its_peer(spmd_world):
    """A recv that times out: the diagnosis names the peer that must send, not 'ranks already past' seq -1."""
    world = spmd_world(2, "gloo")
    try:
        rank0, _ = world.run(helpers.p2p_timeout_diagnosis, 3.0)
    finally:
        world.kill()  # the timed-out receive left the group unusable
    assert "a point-to-point op with rank 1" in rank0 and "rank 1: last started all_reduce #2" in rank0, rank0
    assert "already past it" not in rank0 and "seq -1" not in rank0, rank0
