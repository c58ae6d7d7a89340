"""Removal of superseded and abandoned data directories in the background, after the commit that made them garbage.

Once rank 0 has replaced ``metadata.json``, the data of older saves at that
checkpoint id is garbage; deleting it (hundreds of MB of unlinks) need not
delay the save that made it so. The names to remove are taken at commit time,
so a later save's data directory, created afterwards, is never among them.
The worker thread is not a daemon: the interpreter finishes the removals
before it exits; a process killed meanwhile leaves them to the next save.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from spmd.checkpoint.storage import Storage

_queue: queue.Queue[Callable[[], object]] = queue.Queue()
_worker: threading.Thread | None = None
_lock = threading.Lock()


def _run() -> None:
    """Run tasks until nothing is queued, then end (so the interpreter's exit waits only for real work)."""
    global _worker
    while True:
        with _lock:
            if _queue.empty():
                _worker = None
                return
            task = _queue.get()
        try:
            task()
        except Exception:  # noqa: BLE001 - garbage that stays is removed by the next save's commit
            pass
        finally:
            _queue.task_done()


def run_later(task: Callable[[], object]) -> None:
    """Run ``task`` (a removal that may list and delete a lot) in the background thread."""
    global _worker
    with _lock:
        _queue.put(task)
        if _worker is None:
            _worker = threading.Thread(target=_run, name="spmd-checkpoint-cleanup")
            _worker.start()


def remove_later(storage: Storage, names: list[str]) -> None:
    """Remove ``names`` (top-level entries of ``storage``) in the background thread."""
    if names:
        run_later(lambda: _remove_each(storage, names))


def _remove_each(storage: Storage, names: list[str]) -> None:
    for name in names:
        try:
            storage.remove(name)
        except Exception:  # noqa: BLE001 - garbage that stays is removed by the next save's commit
            pass


def wait() -> None:
    """Block until every removal handed over so far is done."""
    _queue.join()
