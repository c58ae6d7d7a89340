"""HierarchicalBackend: all_reduce across hosts as a one-host backend inside each host plus the network between hosts.

The kernel's own choice for a group across hosts passes a ``one_host`` backend
(spmd-shm) over for a network one (Gloo). Where a host holds 2+ of the
group's ranks, the group gets this composite instead: every op goes to the
network backend over the whole group (``flat``), except all_reduce of at least
``SPMD_HIERARCHICAL_MIN_BYTES``, which is a reduce inside each host (one-host
backend), an all_reduce between the hosts' leaders (network backend over one
rank per host) and a broadcast inside each host. Those steps run one op after
another on one thread per composite, in call order, so every rank submits its
steps to each part in the same order whatever the timing of its peers.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.comm.backend import Backend, BackendContext
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import NativeWork, Work
from spmd.errors import CollectiveError


def host_layout(idents: Sequence[str]) -> list[list[int]]:
    """Group-local ranks by host (``idents[r]`` is rank r's host identity), hosts in order of their first rank."""
    by_host: dict[str, list[int]] = {}
    for rank, ident in enumerate(idents):
        by_host.setdefault(ident, []).append(rank)
    return list(by_host.values())


class HierarchicalWork:
    """One hierarchical all_reduce, seen by the kernel through the ``NativeWork`` protocol."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.aborted = False
        #: The handle of the step in progress (aborted with the op).
        self.step: NativeWork | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._fns: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    # -- spmd.comm.work.NativeWork ------------------------------------------------------
    def poll(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)

    def abort(self) -> None:
        self.aborted = True
        step = self.step
        if step is not None:
            step.abort()

    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._fns.append(fn)
                return
        fn()

    # -- the composite's side ---------------------------------------------------------------
    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            fns, self._fns = self._fns, []
        for fn in fns:
            fn()


class HierarchicalBackend(Backend):
    """The network backend over the whole group, with all_reduce split into host-local and between-host steps.

    ``local`` is this rank's host's one-host backend (None when the host holds
    only this rank); ``leaders`` the network backend over the hosts' first
    ranks (None on every other rank). ``min_bytes``: smaller all_reduces go
    to ``flat`` whole.
    """

    #: The parts reduce with SUM; the kernel divides an AVG afterwards (as it does for Gloo).
    supports_avg = False

    def __init__(
        self, ctx: BackendContext, flat: Backend, local: Backend | None, leaders: Backend | None,
        hosts: list[list[int]], min_bytes: int, names: tuple[str, str],
    ) -> None:
        super().__init__(ctx)
        self.flat, self.local, self.leaders = flat, local, leaders
        self.hosts = hosts
        self.min_bytes = min_bytes
        self.names = names
        self.reduce_scatter_copies_input = flat.reduce_scatter_copies_input
        self.aborts_on_size_mismatch = flat.aborts_on_size_mismatch or (local is not None and local.aborts_on_size_mismatch)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"spmd-hier-{ctx.group_name}", daemon=True)
        self._thread.start()

    def parts(self) -> list[Backend]:
        return [b for b in (self.flat, self.local, self.leaders) if b is not None]

    def supports_reduction(self, dtype: torch.dtype, op: ReduceOp) -> bool:
        return all(part.supports_reduction(dtype, op) for part in self.parts())

    def describe(self) -> str:
        """What this composite is, for messages and ``spmd doctor``: ``gloo+shm (2 hosts x [2, 2] ranks)``."""
        return f"{self.names[0]}+{self.names[1]} ({len(self.hosts)} hosts x {[len(h) for h in self.hosts]} ranks)"

    # -- the serial thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, tensor, op = item
            del item
            if self._broken is not None:
                work.finish(CollectiveError(f"{self.describe()} of group {self.ctx.group_name!r} failed earlier "
                                            f"({self._broken}) and takes no more ops; destroy the group"))
                continue
            try:
                self._all_reduce_steps(work, tensor, op)
            except BaseException as error:  # noqa: BLE001 - delivered to the waiter
                self._broken = error
                self._abandon_parts()  # the peers' halves of the steps fail at once instead of at their timeout
                work.finish(error)
            else:
                work.finish(None)
            del work, tensor  # (released here, not at interpreter exit on this daemon thread)

    def _all_reduce_steps(self, work: HierarchicalWork, tensor: torch.Tensor, op: ReduceOp) -> None:
        if self.local is not None:
            self._step(work, f"reduce inside the host ({self.names[1]})", self.local.reduce(tensor, 0, op))
        if self.leaders is not None:
            self._step(work, f"all_reduce between the hosts' first ranks ({self.names[0]})", self.leaders.all_reduce(tensor, op))
        if self.local is not None:
            self._step(work, f"broadcast inside the host ({self.names[1]})", self.local.broadcast(tensor, 0))

    def _step(self, work: HierarchicalWork, what: str, result: Work | NativeWork) -> None:
        """Wait for one step until the op's deadline; raise a named error if it failed, timed out or was aborted."""
        handle: NativeWork = _Native(result) if isinstance(result, Work) else result
        work.step = handle
        if work.aborted:
            handle.abort()
        finished = handle.wait(max(0.0, work.deadline - time.monotonic()))
        work.step = None
        if not finished:
            handle.abort()
            raise TimeoutError(f"the hierarchical all_reduce's {what} did not finish within the group's timeout "
                               f"({self.ctx.timeout.total_seconds():.1f} s)")
        error = handle.error()
        if error is not None:
            kind = TimeoutError if isinstance(error, TimeoutError) else CollectiveError
            raise kind(f"the hierarchical all_reduce's {what} failed: {error}") from error
        if work.aborted:
            raise CollectiveError(f"the hierarchical all_reduce was aborted during its {what}")

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return self.flat.all_reduce(tensor, op)
        work = HierarchicalWork(time.monotonic() + self.ctx.timeout.total_seconds())
        self._queue.put((work, tensor, op))
        return work

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work | NativeWork:
        return self.flat.isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work | NativeWork:
        return self.flat.irecv(tensor, src, tag)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work | NativeWork:
        return self.flat.broadcast(tensor, src)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work | NativeWork:
        return self.flat.reduce(tensor, dst, op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work | NativeWork:
        return self.flat.all_gather_into_tensor(output, input)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        return self.flat.reduce_scatter_tensor(output, input, op)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int]
    ) -> Work | NativeWork:
        return self.flat.all_to_all_single(output, input, output_split_sizes, input_split_sizes)

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> Work | NativeWork:
        return self.flat.gather(output, input, dst)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int) -> Work | NativeWork:
        return self.flat.scatter(output, input, src)

    def barrier(self) -> Work | NativeWork:
        return self.flat.barrier()

    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        """The network backend's split (the kernel only asks for a sub-group that is not hierarchical itself)."""
        return self.flat.split(ranks, ctx)

    # -- lifecycle -----------------------------------------------------------------------------
    def _abandon_parts(self) -> None:
        for part in self.parts():
            try:
                part.abandon()
            except Exception:  # noqa: BLE001 - the peers still time out at their deadline
                pass

    def abandon(self) -> None:
        self._broken = self._broken or CollectiveError(f"group {self.ctx.group_name!r} was abandoned")
        self._abandon_parts()

    def close(self) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        for part in self.parts():
            part.close()
        super().close()


class _Native:
    """A step that a part returned as a ``Work``, waited on through the ``NativeWork`` calls (public Work API only)."""

    def __init__(self, work: Work) -> None:
        self.work = work
        self._event = threading.Event()
        work.add_done_callback(lambda _: self._event.set())

    def poll(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: float | None) -> bool:
        return self._event.wait(timeout)

    def abort(self) -> None:
        self._event.set()  # nothing to release through a Work; the step's own deadline still holds

    def error(self) -> BaseException | None:
        if not self.work.is_completed():
            return CollectiveError("the step was aborted before it finished")
        return self.work.exception()
