"""Dumps of the flight recorder: one JSON file per rank, in a versioned format.

Format (``version`` 1)::

    {"version": 1, "rank": 0, "world_size": 3, "host": "...", "pid": 123,
     "time": 1764441234.5, "reason": "...",
     "groups": {"world": [0, 1, 2], "group1": [0, 2]},
     "progress": {"world": {"last_started": 7, "last_started_op": "all_reduce",
                            "last_completed": 6, "last_completed_op": "all_reduce"}},
     "entries": [{"group", "seq", "op", "shapes", "dtypes", "reduce_op", "peer",
                  "t_start", "t_end", "state", "error"}, ...]}

``seq`` is -1 for point-to-point ops (``peer`` is the other global rank). A
reader must reject a higher major version.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from spmd import settings
from spmd.debug.recorder import recorder

dump_format_version = 1


def trace_dir() -> Path:
    return Path(settings.current().trace_dir)


def dump(reason: str = "requested", directory: str | os.PathLike | None = None) -> Path | None:
    """Write this rank's flight recorder to ``<dir>/rank<N>.json``; returns the path (None before init).

    What it says of the world comes from ``recorder.world_view``, which ``spmd.comm.init`` sets.
    """
    view = recorder.world_view() if recorder.world_view is not None else None
    if view is None:
        return None
    rank, world_size, groups = view
    folder = Path(directory) if directory is not None else trace_dir()
    folder.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "version": dump_format_version,
        "rank": rank,
        "world_size": world_size,
        # which run and attempt (spmd run / torchrun set these): analysis leaves out dumps of other ones
        "run": [os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "reason": reason,
        "groups": groups,
        "progress": {
            name: {"last_started": p[0], "last_started_op": p[1], "last_completed": p[2], "last_completed_op": p[3]}
            for name, p in recorder.progress.items()
        },
        "entries": recorder.snapshot(),
    }
    path = folder / f"rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)
    return path
