"""The backend contract: BackendSpec (what a plugin declares), BackendContext, Backend.

A backend must implement ``isend`` and ``irecv``. Every collective it does not
implement natively comes from the generic algorithms in
``spmd.comm.algorithms``, run on the backend's own worker thread so that
``async_op=True`` is truly asynchronous. The kernel hands backends flat-able,
contiguous tensors with group-local ranks, already validated.

What an op method returns (the completion contract; a backend never touches
a Work's private state, and ``tests/test_plugins.py`` checks that it does not):

- ``Work.completed(value)`` for an op that finished synchronously;
- ``Work.from_future(future)`` for one that a ``concurrent.futures.Future`` or
  ``torch.futures.Future`` completes;
- or the backend's own handle implementing ``spmd.comm.work.NativeWork``:
  ``poll() -> bool`` (finished? never blocks), ``wait(timeout) -> bool`` (block
  up to ``timeout`` seconds, None: no limit; True once finished), ``abort()``
  (the kernel's deadline passed: give up) and ``error()`` (after finishing: the
  failure or None; a timeout the backend detected is a ``TimeoutError``), and
  optionally ``add_done_callback(fn)``. The kernel wraps it
  (``Work.from_native``) and owns the rest: deadlines (the watchdog ages every
  outstanding Work and aborts it through ``abort()``), the flight recorder,
  callbacks, futures, and errors that name the op, group and missing ranks.

Capabilities are declared in one place, the Backend subclass: the collectives
it overrides are native (``Backend.native_ops()``), the rest generic, and its
``supports_avg`` says whether it takes AVG. A spec points at that class
(``backend_class``, as ``"module:Class"`` so that nothing heavy is imported
before it is needed) for ``spmd doctor`` to read.
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.comm import algorithms
from spmd.comm.algorithms.channel import Channel
from spmd.comm.buffers import BufferPool
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.threads import one_torch_thread
from spmd.comm.work import NativeWork, Work
from spmd.specs import BackendContext
from spmd.specs import BackendSpec as BackendSpec

#: Tags at or above this value belong to the kernel's generic collectives.
COLLECTIVE_TAG_BASE = 1 << 24
_COLLECTIVE_TAG_SPAN = 1 << 24
#: All-reduce switches from recursive doubling to the ring above this many bytes.
RING_THRESHOLD_BYTES = 64 << 10

#: The collectives a backend may implement natively (the rest are generic).
COLLECTIVE_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "split",
)


class _GenericRunner:
    """One daemon thread per backend that runs generic algorithms in call order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fn = item
            try:
                fn()
            except BaseException as error:  # noqa: BLE001 - delivered to the waiter
                work._finish(None, error)
            else:
                work._finish(None, None)
            # Drop the op's closure (and its tensors) now: freed later, at interpreter exit, a
            # tensor's destructor on this daemon thread aborts the process (torch releases the
            # GIL in it, and Python kills a thread that retakes the GIL while finalizing).
            del item, work, fn

    def submit(self, fn: Callable[[], None]) -> Work:
        work = Work()
        self._queue.put((work, fn))
        return work

    def stop(self, timeout: float = 2.0) -> None:
        """Let queued ops finish, then end the thread (waits up to ``timeout`` seconds)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class Backend(abc.ABC):
    """A communication backend for one group on one device type.

    Subclasses call ``super().__init__(ctx)`` and implement ``isend``/``irecv``;
    overriding any collective in ``COLLECTIVE_OPS`` makes it native (and shown
    as such by ``spmd doctor``). Ranks are group-local. Every method returns a
    Work at once (the kernel records the op in the flight recorder when it
    returns, so a method that blocked would hide its op from hang diagnosis);
    generic collectives run on a worker thread.
    """

    #: Whether ``all_reduce``/``reduce``/``reduce_scatter_tensor`` accept ``ReduceOp.AVG``. A
    #: backend that sets False receives SUM and the kernel divides afterwards.
    supports_avg: bool = True
    #: Whether ``reduce_scatter_tensor`` works by all-reducing a copy of its input (Gloo's does):
    #: a caller whose input is scratch may all-reduce it in place instead and keep its own rank's
    #: block, which moves the same bytes without the copy and the separate output in flight.
    reduce_scatter_copies_input: bool = False
    #: Whether the native library kills the process when ranks pass buffers of different sizes
    #: (Gloo aborts in its C++ loop thread). The kernel then compares each *new* call shape across
    #: the group's ranks through the store before the op (one round trip per shape), so such a
    #: mismatch is a named error on every rank instead of a signal. all_to_all_single with explicit
    #: splits is compared at every call: one rank may change its splits while the others' stay.
    aborts_on_size_mismatch: bool = False

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    # -- identity -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def size(self) -> int:
        return self.ctx.size

    def supports_reduction(self, dtype: torch.dtype, op: ReduceOp) -> bool:
        """Whether this backend reduces ``dtype`` with ``op`` (default: every pair spmd accepts).

        A backend whose library lacks some pairs (NCCL has no bitwise reductions,
        for instance) returns False for them and raises a clear error when one is
        asked for; the conformance suite skips them.
        """
        return True

    @classmethod
    def native_ops(cls) -> frozenset[str]:
        """The collectives this class overrides (the rest are the kernel's generic ones)."""
        return frozenset(op for op in COLLECTIVE_OPS if getattr(cls, op) is not getattr(Backend, op))

    # -- required point-to-point --------------------------------------------------
    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work | NativeWork:
        """Start sending ``tensor`` to group rank ``dst``; the Work completes when it is sent."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work | NativeWork:
        """Start receiving into ``tensor`` from group rank ``src``; completes when it arrived."""

    # -- generic machinery ----------------------------------------------------------
    def _run_generic(self, algorithm: Callable[..., None], *args: Any) -> Work | NativeWork:
        state = self.__dict__
        if "_spmd_runner" not in state:
            state["_spmd_runner"] = _GenericRunner(f"spmd-generic-{self.ctx.group_name}")
            state["_spmd_pool"] = BufferPool()
            state["_spmd_seq"] = 0
        seq = state["_spmd_seq"]
        state["_spmd_seq"] = seq + 1
        timeout = self.ctx.timeout.total_seconds()
        pool = state["_spmd_pool"]
        tag = COLLECTIVE_TAG_BASE + seq % _COLLECTIVE_TAG_SPAN

        def run() -> None:
            channel = Channel(self, tag, time.monotonic() + timeout, pool)
            with one_torch_thread():  # its reductions and copies: see spmd.comm.threads
                algorithm(channel, *args)

        return state["_spmd_runner"].submit(run)

    # -- collectives: generic unless overridden --------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        """Reduce ``tensor`` across the group in place."""
        small = tensor.numel() * tensor.element_size() <= RING_THRESHOLD_BYTES or tensor.numel() < self.size
        algorithm = algorithms.all_reduce_recursive_doubling if small else algorithms.all_reduce_ring
        return self._run_generic(algorithm, tensor.view(-1), op)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work | NativeWork:
        """Copy ``src``'s tensor into every rank's."""
        return self._run_generic(algorithms.broadcast_binomial, tensor.view(-1), src)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work | NativeWork:
        """Reduce into ``dst``'s tensor; other ranks' tensors are left unchanged."""
        return self._run_generic(algorithms.reduce_binomial, tensor.view(-1), dst, op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work | NativeWork:
        """``output`` (size * input.numel() elements) gets rank r's input in block r."""
        return self._run_generic(algorithms.all_gather_ring, output.view(-1), input.view(-1))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work | NativeWork:
        """Rank r's ``output`` gets the reduction of block r of every rank's input."""
        return self._run_generic(algorithms.reduce_scatter_ring, output.view(-1), input.view(-1), op)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work | NativeWork:
        """Rows ``input_split_sizes[i]`` of input go to rank i; output rows come from each rank.

        Split sizes are always given (the kernel fills equal splits in).
        """
        out_chunks = list(output.split(list(output_split_sizes)))
        in_chunks = list(input.split(list(input_split_sizes)))
        return self._run_generic(
            algorithms.all_to_all_pairwise,
            [c.reshape(-1) for c in out_chunks],
            [c.reshape(-1) for c in in_chunks],
        )

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> Work | NativeWork:
        """On ``dst``, ``output`` (size * input.numel()) gets rank r's input in block r."""
        flat_out = None if output is None else output.view(-1)
        return self._run_generic(algorithms.gather_linear, flat_out, input.view(-1), dst)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int) -> Work | NativeWork:
        """Block r of ``src``'s input (size * output.numel()) lands in rank r's output."""
        flat_in = None if input is None else input.view(-1)
        return self._run_generic(algorithms.scatter_linear, output.view(-1), flat_in, src)

    def barrier(self) -> Work | NativeWork:
        """Complete once every rank of the group has entered the barrier."""
        return self._run_generic(algorithms.barrier_dissemination)

    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        """A backend for the sub-group ``ranks`` (group-local), or None to let the kernel build one.

        Called on the members only. Native implementations reuse connections
        (an MPI communicator split, an NCCL CommSplit).
        """
        return None

    def abandon(self) -> None:
        """The group was given up (by this rank, or by a peer and announced): end, without waiting here,
        what the peers may be blocked on in this backend, so their waits fail at once instead of at
        their timeout; for example close the group's connections (spmd-gloo). Later ops are refused
        by the kernel, and ``close`` still follows at destroy. Default: nothing (this rank's own waits
        are ended through ``NativeWork.abort``)."""
        return None

    def close(self) -> None:
        """Release resources; the generic worker thread stops."""
        runner = self.__dict__.pop("_spmd_runner", None)
        if runner is not None:
            runner.stop()
