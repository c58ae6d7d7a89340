"""ProcessGroup: a set of ranks with one lazily created backend per device type."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from spmd import settings
from spmd.comm import hierarchical, hosts
from spmd.comm.backend import Backend, BackendContext
from spmd.comm.failures import explain_failure
from spmd.comm.registry import backends
from spmd.comm.store_wait import missing_keys
from spmd.comm.work import Timeout, Work, seconds
from spmd.debug.recorder import Entry, recorder
from spmd.debug.signatures import disagreed_seq
from spmd.errors import (
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeoutError,
    PluginSpecError,
)

_names_created: dict[str, int] = {}


def forget_group_names() -> None:
    """Start counting group names afresh (a new world)."""
    _names_created.clear()


def _unique_id(name: str) -> str:
    """``name`` the first time this process creates a group of that name, then ``name@2``, ``name@3``..."""
    count = _names_created[name] = _names_created.get(name, 0) + 1
    return name if count == 1 else f"{name}@{count}"


class ProcessGroup:
    """The ranks that take part in a collective, and the backends that move their data.

    ``ranks`` are global ranks in group order; ``rank`` is this process's rank
    inside the group. A group holds one backend per device type (``cpu``,
    ``cuda``, ...), created the first time a tensor of that device is used, so
    a CPU-only job never touches a GPU library.
    """

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        global_rank: int,
        store: tdist.Store,
        timeout: timedelta,
        backend_map: Mapping[str, str] | None,
        options: Mapping[str, Any] | None = None,
        parent: ProcessGroup | None = None,
    ) -> None:
        self.name = name
        #: ``name``, made unique when a destroyed group's name is reused (``name@2``...): every rank
        #: creates groups in the same order, so all agree on it. Store keys use it, never stale ones.
        self.uid = _unique_id(name)
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(global_rank)
        self.timeout = timeout
        self.timeout_s = timeout.total_seconds()
        self.backend_map = dict(backend_map) if backend_map is not None else None
        self.options = dict(options or {})
        self.parent = parent
        #: The job's store (the world's): the health checks keep their keys there, under their own prefixes.
        self.root_store = store
        self.store = tdist.PrefixStore(f"spmd/{self.uid}/", store)
        self._backends: dict[str, Backend] = {}
        #: The backends created so far, keyed by torch.device (filled by ``backend_for``; the
        #: collectives read it directly): ``tensor.device`` is a cheap key, while
        #: ``tensor.device.type`` costs a string conversion on every call (hot path).
        self.backends_by_device: dict[torch.device, Backend] = {}
        self._lock = threading.Lock()
        self._global_to_group = {g: i for i, g in enumerate(self.ranks)}
        self.seq = 0  # collectives issued on this group, in program order
        self.monitored_barriers = 0  # monitored_barrier calls on this group (each meets under its own store keys)
        #: Call shapes every rank agreed on (checked once each where a backend aborts on mismatches).
        self.agreed_calls: set[tuple] = set()
        #: Why no op may run on this group any more (a failed or timed-out op, or destroy), else None.
        self.unusable: str | None = None
        #: Device type -> the backend the kernel chose for it (no ``backend_map``), once asked.
        self._chosen: dict[str, str] = {}
        #: Device type -> the one-host backend that choice passed over because the group spans hosts (or None).
        self._passed_over: dict[str, str | None] = {}
        #: What this rank's threads wait on synchronously right now (a backend's NativeWork, or a
        #: Work): given up with the group (``fail_pending``), so such a wait ends too.
        self.blocked: set[Any] = set()

    # -- ranks ---------------------------------------------------------------------
    def group_rank(self, global_rank: int) -> int:
        """The group-local rank of a global rank, or a ValueError naming the group's ranks."""
        local = self._global_to_group.get(global_rank)
        if local is None:
            raise ValueError(
                f"global rank {global_rank} is not a member of group {self.name!r} "
                f"(its ranks are {list(self.ranks)}); pass one of those, or group_src/group_dst"
            )
        return local

    def global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.size:
            raise ValueError(f"group rank {group_rank} is out of range for group {self.name!r} of size {self.size}")
        return self.ranks[group_rank]

    # -- backends ------------------------------------------------------------------
    def backend_name(self, device_type: str) -> str:
        """The backend this group uses (or will use) for ``device_type``."""
        if self.backend_map is None:  # the kernel's choice: the same on every rank (from what every rank sees)
            chosen = self._chosen.get(device_type)
            if chosen is None:
                spans = lambda: hosts.spans_hosts(self.root_store, self.ranks, self.timeout_s)  # noqa: E731
                choice = backends().choose(device_type, spans)
                self._passed_over[device_type] = choice.passed_over.spec.name if choice.passed_over else None
                chosen = self._chosen[device_type] = choice.entry.spec.name
            return chosen
        name = self.backend_map.get(device_type)
        if name is None:
            configured = ", ".join(f"{d}:{b}" for d, b in self.backend_map.items())
            raise BackendUnavailableError(
                f"group {self.name!r} has no backend for {device_type!r} tensors (configured: "
                f"{configured}); init with e.g. backend='{configured},{device_type}:<name>' or "
                f"move the tensor to a configured device"
            )
        return name

    # -- failure -------------------------------------------------------------------
    def mark_unusable(self, reason: str, announce: bool = True) -> None:
        """Refuse every later op on this group with ``reason`` (the first reason stays).

        After an op failed or timed out the ranks may be out of step (its peers'
        halves may still be posted in the backend and would pair with the next
        op), so a later op could return a wrong value. Emptying
        ``backends_by_device`` sends every op to ``backend_for``, which raises:
        the hot path pays nothing for the check. With ``announce`` the other
        ranks' watchdogs learn it too (within one watchdog step, 0.2 s) and
        refuse their next op on the group as well. Each backend is then told to
        ``abandon`` the group, ending what peers wait on in it where it can.
        """
        from spmd.comm.health import watchdog

        if announce and self.unusable is None:
            # A peer that gave the group up first (and broke this rank's op by leaving) is the cause: its reason stands.
            watchdog.adopt_announcements()
        first = self.unusable is None
        if first:
            self.unusable = reason
        self.backends_by_device = {}
        if first and announce:
            dog = watchdog.current()
            if dog is not None:
                try:
                    dog.announce_unusable(self.uid, reason)
                except Exception:  # noqa: BLE001 - the store may be gone; this rank refuses regardless
                    pass
        if first:  # (after the announcement: a peer whose op breaks now finds the reason in the store)
            for backend in list(self._backends.values()):
                try:
                    backend.abandon()
                except Exception:  # noqa: BLE001 - the peers still time out at their deadline
                    pass

    def fail_pending(self) -> None:
        """Fail what is unfinished on this group with its refusal (once another rank gave up on it).

        Its async Works fail at once; a synchronous wait ends too: a Work it
        waits on fails, a backend's handle is aborted (``NativeWork.abort``:
        the backend ends a wait in progress where it can, and the waiting call
        then raises the refusal). Without this a rank inside a collective its
        peer abandoned waited out the op's whole timeout.
        """
        refusal = self.refusal()
        for work in recorder.take_group(self.name):
            work._expire(refusal)
        for waited in list(self.blocked):
            if isinstance(waited, Work):
                waited._expire(refusal)
            else:
                try:
                    waited.abort()
                except Exception:  # noqa: BLE001 - the waiter still times out at its deadline
                    pass

    @property
    def disagreed_at(self) -> int | None:
        """The sequence number of the call the ranks disagreed on, when that is why the group was given up."""
        return None if self.unusable is None else disagreed_seq(self.unusable)

    def refusal(self) -> CollectiveError:
        """The error every op on an unusable group raises."""
        return CollectiveError(f"group {self.name!r} (ranks {list(self.ranks)}) cannot be used: {self.unusable}")

    def _refuse(self) -> None:
        raise self.refusal()

    def backend(self, device_type: str, op: str | None = None, timeout: Timeout = None) -> Backend:
        """The backend for ``device_type``, created on first use.

        ``op`` is the collective that needs it (every member calls it): then the
        creation first waits, under the op's ``timeout`` (else the group's), for
        every member to arrive, and a member that never does is named in a
        CollectiveTimeoutError with the op, instead of surfacing as whatever the
        backend's own rendezvous says. Without ``op`` (point-to-point, eager
        creation) the backend's own rendezvous is all there is.
        """
        if self.unusable is not None:
            self._refuse()
        backend = self._backends.get(device_type)
        if backend is not None:
            return backend
        with self._lock:
            backend = self._backends.get(device_type)
            if backend is None:
                backend = self._create_backend(device_type, op, timeout)
                self._backends[device_type] = backend
        return backend

    def backend_for(self, tensor: torch.Tensor, op: str | None = None, timeout: Timeout = None) -> Backend:
        """The backend for ``tensor``'s device (created on first use; ``op``, ``timeout``: see ``backend``)."""
        device = tensor.device
        backend = self.backends_by_device.get(device)
        if backend is None:
            backend = self.backend(device.type, op, timeout)  # raises if the group is unusable
            self.backends_by_device[device] = backend
        return backend

    @staticmethod
    def _arrival_key(device_type: str, group_rank: int) -> str:
        return f"arrived/{device_type}/{group_rank}"

    def _await_members(self, device_type: str, backend_name: str, op: str, timeout: Timeout) -> None:
        """Wait until every member reached its first collective on this device, or name who did not.

        Each member sets one store key and waits for the others' (a store
        round trip, once per group and device), so the backend's own rendezvous
        only starts once everyone is there and cannot time out half-made (which,
        in Gloo's case, also printed C++ stack dumps from the peers' sockets).
        """
        limit = self.timeout_s if timeout is None else (seconds(timeout) or 0.0)
        keys = [self._arrival_key(device_type, r) for r in range(self.size)]
        missing = [self.ranks[r] for r in missing_keys(self.store, keys, limit)]
        if not missing:
            return
        raise CollectiveTimeoutError(
            f"{self.describe(op, self.seq)} did not complete within {limit:.1f} s: ranks {missing} never "
            f"reached their first collective on group {self.name!r} (rank {self.ranks[self.rank]} waited "
            f"for them to create the group's {device_type!r} backend {backend_name!r}). A rank may have "
            "died, be stuck elsewhere (data loading is the usual place) or call a different op; check "
            "that every rank of the group makes the same calls in the same order, or raise the timeout "
            "(timeout= on the op, new_group(timeout=...), spmd.init(timeout=...))"
        )

    def _create_backend(self, device_type: str, op: str | None = None, timeout: Timeout = None) -> Backend:
        entry = backends().get(self.backend_name(device_type))
        spec = entry.spec
        if device_type not in spec.devices:
            raise BackendUnavailableError(
                f"backend {spec.name!r} does not support {device_type!r} tensors (it supports "
                f"{', '.join(spec.devices)}); choose another with backend='{device_type}:<name>'"
            )
        reason = spec.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(
                f"backend {spec.name!r} (plugin {entry.plugin!r}) cannot run here: {reason}"
            )
        ctx = BackendContext(
            rank=self.rank,
            size=self.size,
            store=tdist.PrefixStore(f"{device_type}/", self.store),
            timeout=self.timeout,
            group_name=self.name,
            options=self.options,
            device_type=device_type,
            global_ranks=self.ranks,
        )
        problem = spec.precheck(ctx) if spec.precheck is not None else None
        if problem is not None:
            raise BackendUnavailableError(f"backend {spec.name!r} (plugin {entry.plugin!r}) cannot serve group {self.name!r}: {problem}")
        # Every creation announces this rank (a first point-to-point op too: a peer whose first
        # op is a collective waits for it); only a collective waits for every member.
        self.store.set(self._arrival_key(device_type, self.rank), op or "point-to-point")
        if op is not None:
            self._await_members(device_type, spec.name, op, timeout)
        backend = self._hierarchical(entry, ctx)
        same_backend = self.parent is not None and self.parent.backend_name(device_type) == spec.name
        if backend is None and self.parent is not None and device_type in self.parent._backends and same_backend:
            parent_backend = self.parent._backends[device_type]
            local = [self.parent.group_rank(r) for r in self.ranks]
            backend = parent_backend.split(local, ctx)
        if backend is None:
            backend = self._build(entry, ctx)
        return backend

    def _build(self, entry: Any, ctx: BackendContext) -> Backend:
        """``entry``'s backend for ``ctx``, built by its factory (a failure is a named spmd error)."""
        spec = entry.spec
        try:
            built = spec.factory(ctx)
        except Exception as error:
            raise self._creation_error(spec.name, entry.plugin, ctx.device_type, error) from error
        if not isinstance(built, Backend):
            raise PluginSpecError(
                f"backend {spec.name!r} (plugin {entry.plugin!r}): its factory returned {type(built).__name__}, "
                "not a spmd.Backend; a factory must build an instance of a spmd.comm.backend.Backend subclass"
            )
        if not hasattr(built, "ctx"):
            built.ctx = ctx  # a third-party backend that skipped super().__init__
        return built

    def _hierarchical(self, entry: Any, ctx: BackendContext) -> Backend | None:
        """The kernel's choice for a group across hosts that passed a one-host backend over, where a host holds
        2+ of its ranks: a ``HierarchicalBackend`` (``spmd.comm.hierarchical``); else None."""
        local_name = self._passed_over.get(ctx.device_type) if self.backend_map is None else None
        min_bytes = settings.current().hierarchical_min_bytes
        if local_name is None or min_bytes is None:
            return None
        layout = hierarchical.host_layout(hosts.identities(self.root_store, self.ranks, self.timeout_s))
        if len(layout) < 2 or max(len(h) for h in layout) < 2:
            return None
        local_entry = backends().get(local_name)
        mine = next(i for i, members in enumerate(layout) if self.rank in members)
        leaders = [members[0] for members in layout]
        flat = self._build(entry, ctx)
        local = leader = None
        try:
            if len(layout[mine]) > 1:
                local_ctx = self._part_ctx(ctx, f"local{mine}", layout[mine])
                problem = local_entry.spec.precheck(local_ctx) if local_entry.spec.precheck is not None else None
                if problem is not None:
                    raise BackendUnavailableError(f"backend {local_name!r} (plugin {local_entry.plugin!r}) cannot serve "
                                                  f"host {mine} of group {self.name!r}: {problem}")
                local = self._build(local_entry, local_ctx)
            if self.rank in leaders:
                leader = self._build(entry, self._part_ctx(ctx, "leaders", leaders))
        except BaseException:
            for part in (flat, local):
                if part is not None:
                    part.close()
            raise
        return hierarchical.HierarchicalBackend(ctx, flat, local, leader, layout, min_bytes, (entry.spec.name, local_name))

    def _part_ctx(self, ctx: BackendContext, part: str, members: Sequence[int]) -> BackendContext:
        """The context of one part of a hierarchical backend: the group-local ``members``, under their own store prefix."""
        return BackendContext(
            rank=list(members).index(self.rank),
            size=len(members),
            store=tdist.PrefixStore(f"{ctx.device_type}/hier/{part}/", self.store),
            timeout=self.timeout,
            group_name=f"{self.name}.{part}",
            options=self.options,
            device_type=ctx.device_type,
            global_ranks=tuple(self.ranks[r] for r in members),
        )

    def _creation_error(self, name: str, plugin: str, device_type: str, error: Exception) -> Exception:
        text = str(error)
        detail = f"backend {name!r} (plugin {plugin!r}) could not be created for {device_type!r} on group {self.name!r} (ranks {list(self.ranks)}), this rank {self.rank}: {text}"
        if "timeout" in text.lower() or isinstance(error, TimeoutError):
            return CollectiveTimeoutError(
                f"{detail}. Not every rank of the group reached its first collective on this device "
                f"within {self.timeout.total_seconds():.1f} s; check that all members call it"
            )
        return BackendUnavailableError(f"{detail}. Run `spmd doctor` to check the backend")

    def close(self) -> None:
        """Close every backend this group created; later ops on it raise (create a new group instead)."""
        with self._lock:
            created, self._backends = self._backends, {}
            self.mark_unusable("it was destroyed (destroy_process_group); create a new group with new_group()", announce=False)
        recorder.progress.pop(self.name, None)  # a new group may reuse the name: its ops start a new row
        for backend in created.values():
            backend.close()

    def describe(self, op: str, seq: int = -1) -> str:
        """``op`` on this group, for messages ("all_reduce on group 'world' (seq 12, ranks [0, 1])")."""
        if seq < 0:
            return f"{op} on group {self.name!r} (ranks {list(self.ranks)})"
        return f"{op} on group {self.name!r} (seq {seq}, ranks {list(self.ranks)})"

    def explain_failure(self, entry: Entry, error: BaseException) -> BaseException:
        """``error`` of the op recorded as ``entry``, rewritten to name it, with the watchdog's diagnosis."""
        return explain_failure(self, entry, error)

    def next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self.name!r}, ranks={list(self.ranks)}, rank={self.rank})"
