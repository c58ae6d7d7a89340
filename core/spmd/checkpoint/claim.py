"""One writer per checkpoint id: the claim file a save takes before it writes anything, and drops after.

Rank 0 creates ``save-claim.json`` at the checkpoint's root with
``Storage.create_exclusive``; a second saver of the same id (another job, or
another process) finds it and fails at once with ``CheckpointInUseError``
naming the holder, instead of the two deleting each other's data. The claim
holds the job's identity (run id, host, pid, the time) and a heartbeat that
a thread refreshes every ``ttl / 4`` seconds while the save runs.

A claim is stale, and the next saver takes it over, when its holder is gone:
on the same machine (host name, boot and pid namespace) its process no longer
exists; from anywhere, its heartbeat is older than the TTL
(``SPMD_CHECKPOINT_CLAIM_TTL`` seconds, default 120). A takeover removes the
stale file and creates its own; rank 0 re-reads the claim just before it
commits, so if two savers took one stale claim in the same instant, one
commits and the other fails.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from spmd import settings
from spmd.checkpoint.metadata import CheckpointError
from spmd.checkpoint.storage import Storage, open_storage

log = logging.getLogger("spmd.checkpoint")

CLAIM_FILE = "save-claim.json"
#: Seconds without a heartbeat after which a claim held from another machine is taken over.
DEFAULT_TTL = 120.0


class CheckpointInUseError(CheckpointError):
    """Another save holds the checkpoint id (its claim names the job, host and pid); nothing was written."""


def claim_ttl() -> float:
    """The claim TTL in seconds: ``SPMD_CHECKPOINT_CLAIM_TTL`` or ``DEFAULT_TTL``."""
    return settings.current().checkpoint_claim_ttl


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is not taken for the holder."""
    stat = _read_text(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split()[19] if stat else ""


def machine() -> str:
    """This machine as a claim names it: host name, boot id and pid namespace (pids mean something only within one)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{_read_text('/proc/sys/kernel/random/boot_id')}/{namespace}"


@dataclass
class Holder:
    """What a claim file says: who holds the checkpoint id, since when, and its last heartbeat."""

    token: str
    job: str
    machine: str
    pid: int
    started: str
    time: float
    heartbeat: float
    #: The data directory the holder's save writes (a takeover leaves it alone: the holder may only be frozen).
    data_dir: str = ""
    #: The holder's restart attempt of ``job`` (``spmd run``/torchrun's restart count), -1 where not known.
    attempt: int = -1

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def parse(cls, data: Any) -> Holder | None:
        """The holder a claim file names, or None if it is not a claim (empty, or cut short by a crash)."""
        try:
            return cls(**json.loads(bytes(data)))
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        age = time.time() - self.heartbeat
        host = self.machine.split("/", 1)[0]
        return (f"job {self.job or '(no run id)'}, host {host}, pid {self.pid}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.time))}, last heartbeat {age:.0f} s ago")

    def dead(self) -> str | None:
        """Why the holder is certainly gone (its process on this machine no longer exists), else None."""
        if self.machine != machine():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return f"its process {self.pid} on this host is gone"
        except PermissionError:  # alive, another user's
            pass
        if self.started and _process_start(self.pid) not in ("", self.started):
            return f"its pid {self.pid} now belongs to another process"
        return None

    def stale(self, ttl: float) -> str | None:
        """Why the holder is gone (so its claim may be taken over), or None if it may still be saving."""
        dead = self.dead()
        if dead is not None:
            return dead
        job, attempt = settings.job_id(), _attempt()
        if self.job and self.job == job and 0 <= self.attempt < attempt:
            # the launcher restarts a job only once every worker of the earlier attempt has stopped (or died with its node)
            return f"it was saved by attempt {self.attempt} of this job, which was restarted since (this is attempt {attempt})"
        age = time.time() - self.heartbeat
        return f"its last heartbeat was {age:.0f} s ago (more than the {ttl:.0f} s TTL)" if age > ttl else None


def _attempt() -> int:
    """This process's restart attempt of its job (0 for the first; spmd run and torchrun count them)."""
    counted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return settings.current().restart_count or (int(counted) if counted.isdigit() else 0)


def _new_holder(data_dir: str) -> Holder:
    now = time.time()
    return Holder(uuid.uuid4().hex, settings.job_id(), machine(), os.getpid(), _process_start(os.getpid()), now, now, data_dir,
                  _attempt())


def read_holder(storage: Storage, path: str = CLAIM_FILE) -> Holder | None:
    """The holder of the claim file ``path``, or None when there is none (or it is unreadable)."""
    try:
        return Holder.parse(storage.read(path))
    except OSError:
        return None


class Claim:
    """A held claim on one checkpoint id: ``verify`` before the commit, ``release`` after (or on failure)."""

    def __init__(self, storage: Storage, url: str, holder: Holder, ttl: float, spared: tuple[str, ...] = ()) -> None:
        self.storage = storage
        self.holder = holder
        #: Data directories of the saves this claim took over: this save's commit does not remove them (a holder
        #: frozen between its last check and its commit may still name one); a later commit does.
        self.spared = spared
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(url, ttl / 4), name="spmd-checkpoint-claim",
                                      daemon=True)
        self._beat.start()

    def _heartbeat(self, url: str, interval: float) -> None:
        """Refresh the heartbeat until released, through a storage of its own (one thread per instance)."""
        storage = open_storage(url)
        while not self._stop.wait(interval):
            try:
                current = read_holder(storage)
                if current is None or current.token != self.holder.token:
                    return  # taken over: verify() fails the commit
                self.holder.heartbeat = time.time()
                storage.write_atomic(CLAIM_FILE, self.holder.to_json())
            except Exception:  # noqa: BLE001 - a missed beat only ages the claim; the next one may succeed
                pass

    def verify(self) -> None:
        """Raise ``CheckpointInUseError`` if another saver took the claim over (this save was judged dead)."""
        current = read_holder(self.storage)
        if current is None or current.token != self.holder.token:
            now = current.describe() if current is not None else "nobody"
            raise CheckpointInUseError(f"this save's claim on the checkpoint was taken over (it is now held by {now}); "
                                       "its heartbeat stopped for longer than SPMD_CHECKPOINT_CLAIM_TTL")

    def release(self) -> None:
        """Stop the heartbeat and remove the claim file if it is still this save's."""
        self._stop.set()
        self._beat.join()
        try:
            current = read_holder(self.storage)
            if current is not None and current.token == self.holder.token:
                self.storage.remove(CLAIM_FILE)
        except Exception:  # noqa: BLE001 - a claim left behind is stale once this process is gone
            pass


def take(storage: Storage, url: str, data_dir: str = "") -> Claim:
    """Claim ``url`` for the save that writes ``data_dir``, taking over a stale claim; ``CheckpointInUseError`` if
    a live save holds it."""
    ttl = claim_ttl()
    holder = _new_holder(data_dir)
    spared: tuple[str, ...] = ()
    for _ in range(3):  # a claim that disappears between the create and the read is looked at again
        if storage.create_exclusive(CLAIM_FILE, holder.to_json()):
            return Claim(storage, url, holder, ttl, spared)
        current = read_holder(storage)
        if current is None:
            time.sleep(0.2)  # on a storage whose create shows an empty file first, its writer is still writing
            current = read_holder(storage)
        if current is None:
            if storage.exists(CLAIM_FILE):  # a claim file a crash cut short: its writer is gone
                storage.remove(CLAIM_FILE)
            continue
        why = current.stale(ttl)
        if why is None:
            raise CheckpointInUseError(
                f"checkpoint {url!r} is being saved by another writer ({current.describe()}); two savers of one id "
                f"would delete each other's data. Save to another checkpoint_id, or wait for that save; if that job "
                f"is dead on another host, its claim ({CLAIM_FILE}) expires {ttl:.0f} s after its last "
                f"heartbeat (SPMD_CHECKPOINT_CLAIM_TTL), or remove the file"
            )
        log.warning("checkpoint %r: taking over the claim of a save that is gone (%s; %s)", url, current.describe(), why)
        if current.data_dir and current.dead() is None:  # perhaps only frozen: its data stays until a later commit
            spared += (current.data_dir,)
        storage.remove(CLAIM_FILE)
    raise CheckpointInUseError(f"checkpoint {url!r}: could not claim it for saving ({CLAIM_FILE} kept changing)")
