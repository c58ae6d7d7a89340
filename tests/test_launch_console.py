"""`spmd run` on a terminal: the workers' output goes through pipes (prefixed, tailed), so the agent tells them
that a terminal shows it, and the main job draws its progress bar as it would under torchrun; in a pipe it does not."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from launch_helpers import clean_env

from spmd.launch.console import CONSOLE_VARIABLE, console_is_terminal

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _run_main_job(tmp_path: Path, on_terminal: bool) -> tuple[int, str]:
    command = [sys.executable, "-m", "spmd", "run", "--nproc-per-node", "2", str(TRAIN), "--steps", "6", "--log-every", "3",
               "--corpus-chars", "20000", "--out", str(tmp_path / "final.pt")]
    env = clean_env()
    env.pop(CONSOLE_VARIABLE, None)
    if not on_terminal:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        return done.returncode, done.stdout + done.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(command, env=env, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, start_new_session=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal's other end closed: the job is over
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        os.close(master)
    return code, out.decode(errors="replace")


def test_the_main_job_draws_its_progress_bar_on_spmd_runs_terminal(tmp_path):
    code, out = _run_main_job(tmp_path, on_terminal=True)
    assert code == 0, out[-3000:]
    assert "6/6 [" in out and "step/s" in out, out[-3000:]  # tqdm's bar, at its end
    assert "done: 6 steps" in out, out[-3000:]


def test_in_a_pipe_the_main_job_prints_lines_without_a_bar(tmp_path):
    code, out = _run_main_job(tmp_path, on_terminal=False)
    assert code == 0, out[-3000:]
    assert "step/s" not in out and "done: 6 steps" in out, out[-3000:]


def test_console_is_terminal_follows_the_stream_then_the_agents_word(spmd_setenv):
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as terminal:
            assert console_is_terminal(terminal)
    finally:
        os.close(master)
        os.close(slave)
    with open(os.devnull, "w") as null:
        spmd_setenv(CONSOLE_VARIABLE, None)
        assert not console_is_terminal(null)
        spmd_setenv(CONSOLE_VARIABLE, "1")
        assert console_is_terminal(null)
