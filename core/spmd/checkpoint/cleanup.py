"""Removal of superseded data directories in the background, after the commit that superseded them.

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

from spmd.checkpoint.storage import Storage

_queue: queue.Queue[tuple[Storage, list[str]]] = queue.Queue()
_worker: threading.Thread | None = None
_lock = threading.Lock()


def _run() -> None:
    """Remove until nothing is queued, then end (so the interpreter's exit waits only for real work)."""
    global _worker
    while True:
        with _lock:
            if _queue.empty():
                _worker = None
                return
            storage, names = _queue.get()
        try:
            for name in names:
                try:
                    storage.remove(name)
                except Exception:  # noqa: BLE001 - garbage that stays is removed by the next save's commit
                    pass
        finally:
            _queue.task_done()


def remove_later(storage: Storage, names: list[str]) -> None:
    """Remove ``names`` (top-level entries of ``storage``) in the background thread."""
    global _worker
    if not names:
        return
    with _lock:
        _queue.put((storage, names))
        if _worker is None:
            _worker = threading.Thread(target=_run, name="spmd-checkpoint-cleanup")
            _worker.start()


def wait() -> None:
    """Block until every removal handed over so far is done."""
    _queue.join()
