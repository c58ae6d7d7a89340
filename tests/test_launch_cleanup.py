"""`spmd run` leaves nothing behind: no worker, nor anything a worker started (a child, a grandchild, a
double-forked orphan, a child in its own session), outlives the agent, whether it exits normally, on
a failure, on SIGTERM or SIGKILL; its temp directories go with it, and temp --tee logs stay bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import alive, clean_env, wait_for

SCRIPTS = Path(__file__).parent / "launch_scripts"
SPMD = [sys.executable, "-m", "spmd"]


def _start(tmp_path: Path, *args: str, stdout=subprocess.PIPE, **env: str) -> tuple[subprocess.Popen, Path]:
    """An agent of ``spmd run --tee 3 ARGS`` in a session of its own, with TMPDIR ``tmp_path/tmp``; (agent, TMPDIR).
    The work folder ``tmp_path/work`` is there for the script."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    (tmp_path / "work").mkdir()
    agent = subprocess.Popen([*SPMD, "run", "--tee", "3", *args], env=clean_env(TMPDIR=str(temp), **env), stdout=stdout,
                             stderr=subprocess.PIPE, start_new_session=True)
    return agent, temp


def _spawned(agent: subprocess.Popen, work: Path) -> dict[str, int]:
    """The pids rank 0 of ``spawner.py`` wrote (itself and its helpers), once it has."""
    wait_for(lambda: (work / "pids0.json").exists() or agent.poll() is not None, 60, "the worker to start its helpers")
    assert agent.poll() is None, agent.communicate()[1].decode()
    pids = json.loads((work / "pids0.json").read_text())
    assert all(alive(pid) for pid in pids.values()), pids
    return pids


def _reaper_of(agent: subprocess.Popen) -> int:
    """The pid of the agent's reaper process (its child running reaper.py)."""
    for name in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == agent.pid and b"reaper.py" in cmdline:
            return int(name)
    raise AssertionError(f"agent {agent.pid} has no reaper process")


def _kill_all(agent: subprocess.Popen, pids: dict[str, int]) -> None:
    """Whatever the test's outcome, nothing it started runs on (the workers have sessions of their own)."""
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids.values():
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    agent.wait(10)


def test_kill_9_of_the_agent_takes_every_process_its_worker_started_and_its_temp_dirs(tmp_path):
    """PDEATHSIG ends the worker; the reaper process ends its helpers (they lived on, re-parented to init)
    and removes the run directory and the temp --tee logs (they were left in TMPDIR)."""
    work = tmp_path / "work"
    agent, temp = _start(tmp_path, str(SCRIPTS / "spawner.py"), str(work), "wait")
    pids: dict[str, int] = {}
    try:
        pids = _spawned(agent, work)
        pids["reaper"] = _reaper_of(agent)
        made = sorted(p.name for p in temp.iterdir())
        assert len(made) == 2 and made[0].startswith("none_") and made[1].startswith("spmd-run-none-"), made  # the logs, the run dir
        agent.kill()
        agent.wait(10)
        wait_for(lambda: not any(alive(pid) for pid in pids.values()), 10, "the worker, its helpers and the reaper to be gone")
        wait_for(lambda: not any(temp.iterdir()), 10, "the agent's temp directories to be removed")
    finally:
        _kill_all(agent, pids)


@pytest.mark.parametrize(("how", "signum", "code"), [("wait", signal.SIGTERM, 128 + signal.SIGTERM), ("wait", signal.SIGINT, 128 + signal.SIGINT),
                                                     ("exit0", None, 0), ("exit3", None, 3)])
def test_every_exit_of_the_agent_stops_what_its_worker_left_and_removes_its_temp_dirs(tmp_path, how, signum, code):
    """The worker's helpers are gone by the time the agent has exited: those in its process group, the
    orphan the agent adopted as subreaper, and the one in a session of its own (it outlived a successful job)."""
    work = tmp_path / "work"
    agent, temp = _start(tmp_path, "--stop-grace", "1", str(SCRIPTS / "spawner.py"), str(work), how)
    pids: dict[str, int] = {}
    try:
        pids = _spawned(agent, work) if how == "wait" else {}
        if signum is not None:
            agent.send_signal(signum)
        _, err = agent.communicate(timeout=60)
        pids = pids or json.loads((work / "pids0.json").read_text())
        assert agent.returncode == code, err.decode()
        assert [name for name, pid in pids.items() if alive(pid)] == [], err.decode()
        assert list(temp.iterdir()) == []
    finally:
        _kill_all(agent, pids)


def test_tee_without_log_dir_keeps_a_bounded_tail_and_removes_it_at_exit(tmp_path):
    """A worker prints 20 MB under --tee with no --log-dir: its temp log holds at most the bound (1 MiB here),
    and the newest output; the console gets every line; the logs are gone after the job (1 GB was left once)."""
    lines, work = 200_000, tmp_path / "work"  # lines of 100 bytes
    console = open(tmp_path / "console", "wb")  # noqa: SIM115 - (read while the worker waits)
    agent, temp = _start(tmp_path, "--rdzv-id", "flood", str(SCRIPTS / "flood.py"), str(lines), str(work), stdout=console, SPMD_RUN_TEMP_LOG_MIB="1")
    try:
        wait_for(lambda: (work / "printed").exists() or agent.poll() is not None, 60, "the worker to print")
        (root,) = temp.glob("flood_*")
        log = root / "attempt_0" / "0" / "stdout.log"
        last = f"line {lines - 1:>12} ".encode()
        wait_for(lambda: last in log.read_bytes(), 30, "the last line to reach the log file")
        kept = [log, log.with_name("stdout.log.1")]
        assert sum(p.stat().st_size for p in kept) <= 2**20
        assert b"line            0 " not in b"".join(p.read_bytes() for p in kept)
        (work / "go").touch()
        _, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, err.decode()
        out = (tmp_path / "console").read_bytes()
        assert out.count(b"[rank0]: line ") == lines and last in out
        assert b"keep the last 1 MiB" in err and list(temp.iterdir()) == []
    finally:
        console.close()
        _kill_all(agent, {})


def test_an_orphan_that_exits_during_the_job_is_reaped(tmp_path):
    """Orphans become the agent's children (subreaper), so it must reap them: none stays a zombie till the end."""
    agent, _ = _start(tmp_path, str(SCRIPTS / "short_orphan.py"))
    try:
        _, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, err.decode()
    finally:
        _kill_all(agent, {})


def test_a_rotating_log_holds_the_newest_bytes_within_its_bound(tmp_path):
    """Written in chunks of every size, the two files together are the newest bytes: at least half the bound, at most all of it."""
    import random

    from spmd.launch.logs import RotatingLog

    rng = random.Random(0)
    written = b""
    log = RotatingLog(tmp_path / "stdout.log", 1000)
    for _ in range(300):
        chunk = rng.randbytes(rng.choice([0, 1, 7, 499, 500, 501, 1000, 2500]))
        log.write(chunk)
        written += chunk
        log.flush()
        older = tmp_path / "stdout.log.1"
        kept = (older.read_bytes() if older.exists() else b"") + (tmp_path / "stdout.log").read_bytes()
        assert kept == written[len(written) - len(kept):] and len(kept) <= 1000
        assert len(kept) >= min(500, len(written))
    log.close()


def test_a_bad_temp_log_bound_is_named(monkeypatch):
    import argparse

    from spmd.launch.args import build_parser, to_config

    ns = build_parser(argparse.ArgumentParser()).parse_args(["x.py"])
    for text in ("0", "-1", "lots"):
        monkeypatch.setenv("SPMD_RUN_TEMP_LOG_MIB", text)
        with pytest.raises(SystemExit, match=f"SPMD_RUN_TEMP_LOG_MIB='{text}': give the MiB"):
            to_config(ns)
    monkeypatch.setenv("SPMD_RUN_TEMP_LOG_MIB", "0.5")
    assert to_config(ns).temp_log_bytes == 2**19
