"""Helpers shared by the `spmd run` tests (agent, output forwarding, end-to-end runs)."""

from __future__ import annotations

import os
from collections.abc import Callable

from spmd.polling import poll


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher variables a job sets for itself, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie (dead, waiting for a parent, or init, to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds; an AssertionError naming ``what`` after ``timeout`` seconds."""
    if not poll(condition, timeout, 0.01):
        raise AssertionError(f"timed out waiting for {what}")
