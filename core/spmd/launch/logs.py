"""Where ``spmd run`` writes its workers' output for --tee/--redirects, and how much of it it keeps.

With --log-dir the files are the user's: whole, and kept. Without it they go to a temp directory
(as torchrun's): there a file that only copies what the console shows (--tee) keeps the last
``SPMD_RUN_TEMP_LOG_MIB`` MiB of its stream (default ``spmd.launch.args.TEMP_LOG_MIB``), and the directory is removed at
the agent's exit unless some stream was redirected (--redirects: its file is the output's only copy).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Protocol

from spmd.launch.args import RunConfig


class LogFile(Protocol):
    """What a worker's output is written to: an open file, or a RotatingLog."""

    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RotatingLog:
    """A log file that keeps about its last ``limit`` bytes: at ``limit / 2`` it becomes ``<name>.1``
    (replacing the one before) and starts again, so the two files hold the newest output."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.half = path, max(limit // 2, 1)
        self.name = str(path)
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.size = 0

    def write(self, data: bytes, /) -> int:
        written = 0
        while written < len(data):
            piece = data[written:written + self.half - self.size]
            self.file.write(piece)
            self.size += len(piece)
            written += len(piece)
            if self.size >= self.half:
                self.file.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self.file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
                self.size = 0
        return written

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def make_log_root(config: RunConfig) -> Path | None:
    """This agent's log directory, made once per ``spmd run``: ``<--log-dir>/<rdzv_id>_<random>`` (as
    torchrun's), so runs and nodes that share a --log-dir never overwrite each other's files; in the
    system's temp directory without --log-dir. None when --tee and --redirects send nothing to files."""
    if not any(config.tee.values()) and not any(config.redirects.values()):
        return None
    folder = Path(tempfile.mkdtemp(prefix=f"{config.rdzv_id}_", dir=config.log_dir))
    note = ""
    if config.log_dir is None and any(config.tee.values()):
        note = (f" (--tee files keep the last {config.temp_log_bytes / 2**20:g} MiB of each stream"
                + ("" if any(config.redirects.values()) else ", and are removed at exit") + "; --log-dir keeps them whole)")
    print(f"spmd run: worker logs in {folder}/attempt_<restart>/<local rank>/{{stdout,stderr}}.log{note}", file=sys.stderr, flush=True)
    return folder


def temporary_logs(config: RunConfig) -> bool:
    """Whether the agent removes its log directory at exit: a temp one (no --log-dir) holding only --tee copies."""
    return config.log_dir is None and not any(config.redirects.values())


def open_log(config: RunConfig, path: Path, redirected: bool) -> LogFile:
    """A worker stream's log file: bounded when it is a temp copy of what the console shows."""
    if config.log_dir is None and not redirected:
        return RotatingLog(path, config.temp_log_bytes)
    return open(path, "wb")  # noqa: SIM115 - closed by the pump thread


