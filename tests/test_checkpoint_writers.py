"""A save that reports success is never lost: one writer per checkpoint id (a second fails at once, a dead
one's claim is taken over), async_save survives destroy_process_group or the job exits non-zero (gloo, mpi,
ucc), a killed save's leftovers go at the next save, and a commit is reported on every rank."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import checkpoint_helpers as h
import pytest

import spmd.checkpoint as dcp
from spmd.checkpoint import cleanup
from spmd.checkpoint.claim import CLAIM_FILE
from spmd.checkpoint.metadata import METADATA_FILE
from spmd.testing.ports import free_port

SCRIPT = pathlib.Path(__file__).parent / "fault_scripts" / "checkpoint_writer.py"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _writer(*args: str, **env: str) -> subprocess.Popen:
    """One process of the writer script (a world of one: no spmd.init)."""
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _data_dirs(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("data-"))


def _committed_dir(path: str) -> str:
    return json.loads(pathlib.Path(path, METADATA_FILE).read_text())["data_dir"]


def test_a_second_saver_of_one_id_fails_at_once_and_the_first_commits_whole(spmd_world, tmp_path):
    """Saver A has written its data and waits before its commit; saver B (this process, then a 2-rank job) of the
    same id fails at once with CheckpointInUseError naming A's pid, and writes nothing; a save beside it does not
    touch A's data; A then commits and its checkpoint loads whole."""
    path, beside = str(tmp_path / "ckpt"), str(tmp_path / "other")
    holder = _writer("hold", path, "1")
    try:
        _wait_for(f"{path}.ready", holder)
        start = time.monotonic()
        with pytest.raises(dcp.CheckpointInUseError, match=f"pid {holder.pid}") as raised:
            dcp.save(h.writer_state(2), checkpoint_id=path)
        assert time.monotonic() - start < 2.0
        assert "being saved by another writer" in str(raised.value) and "another checkpoint_id" in str(raised.value)
        for outcome in spmd_world(2, "gloo").run(h.save_or_error, path, 3, timeout=60):
            assert outcome.startswith("CheckpointInUseError") and f"pid {holder.pid}" in outcome, outcome
        held = _data_dirs(path)
        assert len(held) == 1  # A's alone: neither B wrote a data directory
        dcp.save(h.writer_state(4), checkpoint_id=beside)  # a sibling's commit looks at A's id: A's claim is live
        cleanup.wait()
        assert _data_dirs(path) == held
    finally:
        pathlib.Path(f"{path}.go").touch()
        out, err = holder.communicate(timeout=60)
    assert holder.returncode == 0 and "saved" in out, err
    assert h.same_state(h.load_writer_state(path), h.writer_state(1))
    assert sorted(os.listdir(path)) == [held[0], METADATA_FILE]  # the claim is dropped after the commit
    assert h.same_state(h.load_writer_state(beside), h.writer_state(4))


def test_fsspec_storages_claim_with_create_if_absent(tmp_path):
    """Through fsspec (memory://): a save while the id is claimed fails; once released, it saves and loads."""
    pytest.importorskip("fsspec")
    from spmd.checkpoint.claim import take

    url = f"memory://{tmp_path.name}/ckpt"
    claim = take(dcp.open_storage(url), url)
    with pytest.raises(dcp.CheckpointInUseError, match="being saved by another writer"):
        dcp.save(h.writer_state(1), checkpoint_id=url)
    claim.release()
    dcp.save(h.writer_state(1), checkpoint_id=url)
    assert h.same_state(h.load_writer_state(url), h.writer_state(1))
    assert CLAIM_FILE not in dcp.open_storage(url).listdir()


def test_a_dead_savers_claim_is_taken_over_and_its_data_removed(tmp_path):
    """A process killed mid-save leaves its claim and data; the next save of that id (same host, pid gone) takes
    the claim over, commits, and its commit removes the dead save's data."""
    path = str(tmp_path / "ckpt")
    dead = _writer("killed", path, "1")
    dead.communicate(timeout=60)
    assert dead.returncode == 9
    claim = json.loads(pathlib.Path(path, CLAIM_FILE).read_text())
    assert claim["pid"] == dead.pid and len(_data_dirs(path)) == 1
    with pytest.raises(dcp.CheckpointError, match="partial|no checkpoint"):  # never committed
        h.load_writer_state(path)
    dcp.save(h.writer_state(2), checkpoint_id=path)
    cleanup.wait()
    assert _data_dirs(path) == [_committed_dir(path)]
    assert CLAIM_FILE not in os.listdir(path)
    assert h.same_state(h.load_writer_state(path), h.writer_state(2))


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="freezes the holder with SIGSTOP")
def test_a_frozen_savers_claim_expires_and_its_late_commit_fails(tmp_path, spmd_setenv):
    """A holder that stops heartbeating (frozen, its pid alive) loses the claim after the TTL: the next saver
    takes over and commits; the holder, thawed, finds its claim gone and fails instead of committing."""
    path = str(tmp_path / "ckpt")
    spmd_setenv("SPMD_CHECKPOINT_CLAIM_TTL", "1")
    holder = _writer("hold", path, "1", SPMD_CHECKPOINT_CLAIM_TTL="1")
    try:
        _wait_for(f"{path}.ready", holder)
        with pytest.raises(dcp.CheckpointInUseError):  # alive and heartbeating: not taken
            dcp.save(h.writer_state(2), checkpoint_id=path)
        os.kill(holder.pid, signal.SIGSTOP)
        time.sleep(1.6)  # more than the TTL since its last heartbeat
        dcp.save(h.writer_state(3), checkpoint_id=path)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        pathlib.Path(f"{path}.go").touch()
        out, err = holder.communicate(timeout=60)
    assert holder.returncode == 2 and "CheckpointInUseError" in err and "taken over" in err, (out, err)
    assert h.same_state(h.load_writer_state(path), h.writer_state(3))
    cleanup.wait()
    assert _data_dirs(path) == [_committed_dir(path)]


def test_a_killed_saves_data_at_an_id_never_saved_again_goes_at_the_next_commit_beside_it(tmp_path):
    """A job killed while saving step-2 moves on to step-3: step-3's commit removes step-2's data (never
    committed, its holder dead); step-1 and a user's directory that only looks similar are left alone."""
    parent = tmp_path / "run"
    dcp.save(h.writer_state(1), checkpoint_id=str(parent / "step-1"))
    dead = _writer("killed", str(parent / "step-2"), "2")
    dead.communicate(timeout=60)
    assert dead.returncode == 9 and len(_data_dirs(str(parent / "step-2"))) == 1
    mine = parent / "notes" / "data-0123456789ab"
    mine.mkdir(parents=True)
    (mine / "rank-00000.safetensors").write_bytes(b"x")
    (parent / "notes" / "README").write_text("mine")
    dcp.save(h.writer_state(3), checkpoint_id=str(parent / "step-3"))
    cleanup.wait()
    assert _data_dirs(str(parent / "step-2")) == [] and not (parent / "step-2" / CLAIM_FILE).exists()
    assert mine.is_dir() and (parent / "notes" / "README").exists()
    for step in (1, 3):
        assert h.same_state(h.load_writer_state(str(parent / f"step-{step}")), h.writer_state(step))


def _two_ranks(args: list[str], backend: str, timeout: float = 120) -> list[tuple[int, str, str]]:
    """The writer script as 2 ranks (mpiexec for mpi, the launcher's variables otherwise): (returncode, out, err)."""
    if backend == "mpi":
        from spmd_mpi import probe

        mpiexec, why = probe.find_mpiexec()
        if mpiexec is None:
            pytest.skip(why)
        procs = [subprocess.Popen([*probe.mpiexec_command("2", mpiexec), sys.executable, str(SCRIPT), *args],
                                  env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    else:
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port), text=True)
                 for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _lines(text: str, line: str) -> int:
    """How many times the writer script printed ``line`` (mpiexec merges both ranks' stdout and may join two lines)."""
    once = re.escape(line)
    return sum(len(re.findall(once, x.strip())) for x in text.splitlines() if re.fullmatch(f"(?:{once})+", x.strip()))


def _skip_unless_usable(backend: str) -> None:
    from spmd.comm.registry import backends

    if backend not in backends().names():
        pytest.skip(f"backend {backend!r} is not installed")
    reason = backends().get(backend).spec.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc"])
@pytest.mark.parametrize("how", ["destroy", "failing-destroy", "failing-exit"])
def test_an_async_save_is_whole_after_destroy_or_the_job_exits_non_zero(tmp_path, backend, how):
    """async_save, then destroy_process_group at once (the save's writes take 1 s) or the script's end: the save
    is committed and whole, or (when it failed and nobody asked its future) every rank exits non-zero."""
    _skip_unless_usable(backend)
    path = str(tmp_path / "ckpt")
    ranks = _two_ranks(["async", backend, path, how], backend)
    outputs = "\n".join(out + err for _, out, err in ranks)
    if how == "destroy":
        assert all(code == 0 for code, _, _ in ranks), outputs
        assert _lines(outputs, "destroyed") == 2, outputs
        assert h.same_state(h.load_writer_state(path), h.writer_state(2))
        assert sorted(os.listdir(path)) == [_committed_dir(path), METADATA_FILE]
        return
    assert all(code != 0 for code, _, _ in ranks), outputs
    # every rank names the failure; under mpiexec (one exit code for the job) the first rank to exit non-zero
    # makes MPICH's launcher kill the other, which may not have printed yet
    named = 1 if backend == "mpi" else 2
    assert outputs.count("No space left on device (simulated)") >= named, outputs
    assert _lines(outputs, "destroyed") == 0 and not os.path.exists(os.path.join(path, METADATA_FILE))
    if how == "failing-exit":
        assert outputs.count("exiting with status 1") >= named and _lines(outputs, "end") == 2, outputs
        assert outputs.count("failed (its future was never asked)") >= named, outputs
    else:
        assert outputs.count("CheckpointError") >= named and _lines(outputs, "end") == 0, outputs


def test_a_process_alone_whose_async_save_failed_unasked_exits_1(tmp_path):
    """Without spmd.init (no teardown to raise): the atexit hook prints the failure and exits with status 1."""
    alone = _writer("async-alone", str(tmp_path / "ckpt"))
    out, err = alone.communicate(timeout=60)
    assert alone.returncode == 1 and _lines(out, "end") == 1, (out, err)
    assert "failed and its future was never asked; exiting with status 1" in err and "No space left" in err, err


def test_a_commit_is_reported_on_every_rank_when_rank_0_dies_right_after_it(tmp_path):
    """Rank 0 commits metadata.json and is killed before the ranks' last exchange: rank 1 finds the commit and
    returns normally (it used to raise although the save was complete)."""
    path = str(tmp_path / "ckpt")
    (code0, _, err0), (code1, out1, err1) = _two_ranks(["commit-dies", "gloo", path], "gloo")
    assert code0 == 5, err0
    assert code1 == 0 and "1 committed" in out1, err1[-3000:]
    assert "rank 0's commit is there: the save is complete" in err1
    assert h.same_state(h.load_writer_state(path), h.writer_state(1))


@pytest.mark.parametrize(("attempt", "taken"), [(1, True), (0, False)])
def test_a_claim_left_by_an_earlier_attempt_of_the_same_job_is_taken_over_at_once(tmp_path, spmd_setenv, attempt, taken):
    """A node that died mid-save left a live-looking claim (another host: its pid cannot be checked; a fresh
    heartbeat). The restarted job (a later attempt of the same run id) saving that id takes it over at once; a
    save of the same attempt (or of another job) still waits for the TTL."""
    from spmd.checkpoint.claim import Holder

    path = tmp_path / "ckpt"
    path.mkdir()
    now = time.time()
    left = Holder("t0", "job-7", "other-host/boot/pid:[1]", 4242, "", now, now, "", 0)
    (path / CLAIM_FILE).write_bytes(left.to_json())
    spmd_setenv("SPMD_RUN_ID", "job-7")
    spmd_setenv("SPMD_RESTART_COUNT", str(attempt))
    if taken:
        dcp.save(h.writer_state(1), checkpoint_id=str(path))
        assert h.same_state(h.load_writer_state(str(path)), h.writer_state(1))
    else:
        with pytest.raises(dcp.CheckpointInUseError, match="job job-7, host other-host"):
            dcp.save(h.writer_state(1), checkpoint_id=str(path))
