"""The flight recorder: a bounded ring buffer of every op that passes through the kernel.

An op that had already succeeded when the kernel recorded it (every
synchronous op on a backend that finished it, the common case) is kept as a
plain tuple, a ``Record``, and turned into an ``Entry`` only when someone reads
it: building the tuple costs a third of building the Entry. Ops still running
get an Entry, which their Work finishes. Nothing touches the network on the hot
path. Progress per group (last started and last completed sequence number) is
kept alongside for the watchdog.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd import settings

STATES = ("scheduled", "started", "completed", "failed")
#: Entries kept per group for the always-on mismatch check (the watchdog reads them every 0.2 s).
HISTORY = 1024

_new_entry = object.__new__
_now = time.time

#: A completed op as the ring keeps it: (group, seq, op, shapes, dtypes, reduce_op, time). See ``entry_of``.
Record = tuple[str, int, str, Sequence[torch.Size], Sequence[torch.dtype], Any, float]


class _RareFields:
    """Defaults of the Entry fields that most ops never set (read from the class until one is set)."""

    peer: int | None = None
    error: str | None = None
    context: str | None = None  # what the op is for, e.g. a pipeline action (spmd.comm.p2p.p2p_context)
    splits: tuple[Sequence[int], Sequence[int]] | None = None  # all_to_all_single's (input, output) split sizes


class Entry(_RareFields):
    """One recorded op. ``seq`` is the group's sequence number (-1 for point-to-point).

    Made by ``FlightRecorder.start`` on the hot path of every op, so it sets
    only what every op has; the rest (``_RareFields``) keeps the class default
    until an op sets it. No ``__init__``: building one field by field in
    ``start`` saves a Python frame per op.
    """

    __slots__ = ("group", "seq", "op", "shapes", "dtypes", "reduce_op", "t_start", "t_end", "state", "_progress")

    group: str
    seq: int
    op: str
    shapes: Sequence[torch.Size]
    dtypes: Sequence[torch.dtype]
    reduce_op: Any
    t_start: float
    t_end: float | None
    state: str
    _progress: list[Any] | None  # the group's progress row (None for point-to-point)

    def finish(self, error: BaseException | None) -> None:
        if self.state != "started":
            return
        self.t_end = time.time()
        if error is None:
            self.state = "completed"
            progress = self._progress
            if progress is not None and self.seq > progress[2]:
                progress[2], progress[3] = self.seq, self.op
        else:
            self.state, self.error = "failed", f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"

    def signature(self) -> str:
        """What must agree across ranks for this op (``op dtype shapes reduce``)."""
        shapes = ",".join("x".join(map(str, s)) or "scalar" for s in self.shapes)
        dtypes = ",".join(str(d).removeprefix("torch.") for d in self.dtypes)
        reduce = f" {self.reduce_op.name}" if self.reduce_op is not None else ""
        return f"{self.op}({dtypes}; {shapes}){reduce}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "seq": self.seq,
            "op": self.op,
            "shapes": [list(s) for s in self.shapes],
            "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes],
            "reduce_op": self.reduce_op.name if self.reduce_op is not None else None,
            "peer": self.peer,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "state": self.state,
            "error": self.error,
            "context": self.context,
        }

    @classmethod
    def from_record(cls, record: Record) -> Entry:
        """The Entry of an op recorded as a ``Record`` (completed at its start time)."""
        entry = _new_entry(cls)
        entry.group, entry.seq, entry.op, entry.shapes, entry.dtypes, entry.reduce_op, entry.t_start = record
        entry.t_end, entry.state, entry._progress = record[6], "completed", None
        return entry


#: Told of every op as it is recorded: (group, seq (-1 for point-to-point), op, shapes, dtypes).
Observer = Callable[[str, int, str, Sequence[torch.Size], Sequence[torch.dtype]], None]


#: A send or receive as the always-on check keeps it: (its number among the group's point-to-point calls
#: on this rank, "send" or "recv", the peer's global rank, tag, its number among this rank's calls of that
#: op, peer and tag (a send and the receive it meets have the same), dtype, element count).
P2PCall = tuple[int, str, int, int, int, torch.dtype, int]


def shapes_and_dtypes(tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.Size, ...], tuple[torch.dtype, ...]]:
    """What a record keeps of an op's tensors: their shapes (torch.Size is immutable: no copy) and dtypes
    (hashable: the kernel keys a group's agreed call shapes with them, computed once per op)."""
    if len(tensors) == 1:  # the common cases, without a comprehension's frame
        tensor = tensors[0]
        return (tensor.shape,), (tensor.dtype,)
    if len(tensors) == 2:  # input and output
        first, second = tensors
        return (first.shape, second.shape), (first.dtype, second.dtype)
    return tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors)


def entry_of(item: Entry | Record) -> Entry:
    """The Entry of a ring or history item (an Entry, or a completed op's ``Record``)."""
    return Entry.from_record(item) if isinstance(item, tuple) else item


def seq_of(item: Entry | Record) -> int:
    """The sequence number of a ring or history item, without building its Entry."""
    return item[1] if isinstance(item, tuple) else item.seq


class FlightRecorder:
    """The per-process ring buffer and per-group progress."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: collections.deque[Entry | Record] = collections.deque(maxlen=max(capacity, 1))
        self.enabled = capacity > 0
        # group -> [last started seq, its op, last completed seq, its op, the last started Entry or Record,
        #           the group's last HISTORY Entries and Records (for the always-on mismatch check, spmd.comm.health.history)]
        self.progress: dict[str, list[Any]] = {}
        #: Whether each group's recent Entries are kept for the mismatch check (``SPMD_HISTORY_CHECK``).
        self.keep_history = settings.at_import().history_check
        #: group -> [point-to-point calls so far, the last HISTORY of them as P2PCall tuples, calls so far per
        #: (op, peer, tag)]: what the always-on check pairs with the peers' calls (spmd.comm.health.p2p_check)
        self.p2p_calls: dict[str, list[Any]] = {}
        #: (this rank, the world size, every group's ranks by name) or None: what a dump says of the world
        #: (``spmd.comm.init`` sets it; this package sits below comm and reads none of its state).
        self.world_view: Callable[[], tuple[int, int, dict[str, list[int]]] | None] | None = None
        # async (entry, work, monotonic deadline, timeout) for the watchdog to poll and age
        self.outstanding: list[tuple[Entry, Any, float | None, float | None]] = []
        self.lock = threading.Lock()
        #: Told of each op as it is recorded (``spmd.tensor.CommDebugMode`` counts them); empty: one test per op.
        self.observers: list[Observer] = []

    def start(self, group: str, seq: int, op: str, tensors: Sequence[torch.Tensor], reduce_op: Any = None, peer: int | None = None,
              splits: tuple[Sequence[int], Sequence[int]] | None = None, *, done: bool = False,
              shaped: tuple[tuple[torch.Size, ...], tuple[torch.dtype, ...]] | None = None) -> Entry:
        """Record an op that started (or, with ``done``, one that already completed without error).

        The hot path of every op, in one frame: the Entry is built here and
        only the fields this op has are stored. ``shaped``: the tensors'
        ``shapes_and_dtypes``, when the caller has them already (``tensors`` is then not read).
        """
        entry = _new_entry(Entry)
        entry.group, entry.seq, entry.op, entry.reduce_op = group, seq, op, reduce_op
        entry.shapes, entry.dtypes = shaped if shaped is not None else shapes_and_dtypes(tensors)
        if peer is not None:
            entry.peer = peer
        if splits is not None:
            entry.splits = splits
        entry.t_start = now = _now()
        if done:
            entry.t_end, entry.state = now, "completed"
        else:
            entry.t_end, entry.state = None, "started"
        if self.enabled:
            self.entries.append(entry)
        if self.observers:
            for observe in self.observers:
                observe(group, seq, op, entry.shapes, entry.dtypes)
        if seq >= 0:
            progress = self.progress.get(group)
            if progress is None:
                self.progress[group] = progress = [seq, op, -1, None, entry, collections.deque(maxlen=HISTORY)]
            else:
                progress[0], progress[1], progress[4] = seq, op, entry
            if done and seq > progress[2]:
                progress[2], progress[3] = seq, op
            if self.keep_history:
                progress[5].append(entry)
            entry._progress = progress
        else:
            entry._progress = None
        return entry

    def completed(self, group: str, seq: int, op: str, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype],
                  reduce_op: Any) -> Record:
        """Record a collective that already succeeded, as a ``Record``: ``start(..., done=True)`` for
        the hot path of every synchronous op, at a third of its cost (no Entry, no peer or splits)."""
        record: Record = (group, seq, op, shapes, dtypes, reduce_op, _now())
        if self.enabled:
            self.entries.append(record)
        if self.observers:
            for observe in self.observers:
                observe(group, seq, op, shapes, dtypes)
        progress = self.progress.get(group)
        if progress is None:
            self.progress[group] = progress = [seq, op, seq, op, record, collections.deque(maxlen=HISTORY)]
        else:
            progress[0], progress[1], progress[4] = seq, op, record
            if seq > progress[2]:
                progress[2], progress[3] = seq, op
        if self.keep_history:
            progress[5].append(record)
        return record

    def note_p2p(self, group: str, op: str, peer: int, tag: int, tensor: torch.Tensor) -> None:
        """Keep a send or receive (``op``) for the always-on check of what its peer's matching call carried."""
        row = self.p2p_calls.get(group)
        if row is None:
            row = self.p2p_calls[group] = [0, collections.deque(maxlen=HISTORY), {}]
        row[0] = number = row[0] + 1
        channels, channel = row[2], (op, peer, tag)
        channels[channel] = k = channels.get(channel, 0) + 1  # (counted here: a call the deque dropped keeps its number)
        row[1].append((number, op, peer, tag, k, tensor.dtype, tensor.numel()))

    def p2p_history(self, group: str, after: int = 0) -> list[P2PCall]:
        """The group's most recent point-to-point calls (at most HISTORY) numbered above ``after``, oldest first."""
        row = self.p2p_calls.get(group)
        if row is None:
            return []
        return [call for call in list(row[1]) if call[0] > after]  # (one C-level copy: safe beside the appending thread)

    def history(self, group: str, after: int = -1) -> list[Entry]:
        """The group's most recent Entries (at most HISTORY) whose sequence number is above ``after``, oldest first."""
        row = self.progress.get(group)
        if row is None:
            return []
        items = list(row[5])  # (one C-level copy: safe beside the appending thread)
        return [entry_of(item) for item in items if seq_of(item) > after]

    def published_progress(self, signature: Callable[[Entry], str] = Entry.signature) -> dict[str, list[Any]]:
        """``progress`` for the store: the last started Entry replaced by its ``signature``."""
        return {group: [*row[:4], signature(entry_of(row[4]))] for group, row in list(self.progress.items())}

    def watch(self, entry: Entry, work: Any, limit: float | None = None) -> None:
        """Remember an async op and its deadline (``limit`` seconds from now; None: none) for the watchdog."""
        deadline = None if limit is None else time.monotonic() + limit
        with self.lock:
            self.outstanding.append((entry, work, deadline, limit))

    def poll_outstanding(self, now: float | None = None) -> list[tuple[Entry, Any, float | None]]:
        """Forget the async ops that finished; with ``now`` (monotonic), also take out and return
        those past their deadline, as (entry, work, timeout in seconds), for the watchdog to fail."""
        with self.lock:
            pending = self.outstanding
            self.outstanding = []
        still, overdue = [], []
        for item in pending:
            entry, work, deadline, limit = item
            if work.is_completed():
                continue
            if now is not None and deadline is not None and now >= deadline:
                overdue.append((entry, work, limit))
            else:
                still.append(item)
        with self.lock:
            self.outstanding.extend(still)
        return overdue

    def take_group(self, group: str) -> list[Any]:
        """Take out and return the unfinished async Works of ``group`` (to fail them at once)."""
        with self.lock:
            mine = [item for item in self.outstanding if item[0].group == group]
            self.outstanding = [item for item in self.outstanding if item[0].group != group]
        return [work for _, work, _, _ in mine if not work.is_completed()]

    def snapshot(self) -> list[dict[str, Any]]:
        return [entry_of(e).to_dict() for e in list(self.entries)]

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.enabled = capacity > 0
        self.entries = collections.deque(self.entries, maxlen=max(capacity, 1))


recorder = FlightRecorder(settings.at_import().flight_recorder)
