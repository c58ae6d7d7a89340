"""MpiBackend: every collective native through MPI's non-blocking operations.

Each op starts an MPI non-blocking call (``Iallreduce``, ``Ibcast``, ...) on
the tensor's own memory (a raw buffer over ``tensor.data_ptr()``, no copy)
and returns an ``MpiWork`` whose wait polls ``MPI_Test`` with back-off, so
every wait honours its timeout (MPI's own ``MPI_Wait`` blocks forever).

Data movement sends bytes, so every dtype moves (float8, uint64, ...).
Reductions use the MPI datatype of the tensor's dtype; float16 and bfloat16,
which MPI has no standard type for, are reduced in a pooled float32 staging
buffer and rounded back once. bool reduces with MPI's logical ops. AVG is a
SUM that the kernel divides (``supports_avg = False``).

Communicators: the world group uses a duplicate of ``MPI_COMM_WORLD``;
every other group (``new_group``, ``split_group``, mesh dimensions) gets
``MPI_Comm_create_group`` over its members only. Creating one is collective
over the group's members; a store rendezvous first makes a missing member a
timeout error instead of a hang.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.comm.backend import Backend, BackendContext
from spmd.comm.buffers import BufferPool
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError
from spmd_mpi import probe

#: The mpi4py.MPI module, imported by the first backend (never at import time).
MPI: Any = None
_LOAD_LOCK = threading.Lock()

#: Seconds a wait tests back to back (yielding between tests only when oversubscribed)
#: before it starts sleeping. MPI progresses only inside MPI calls, so ops want steady tests.
SPIN_S = float(os.environ.get("SPMD_MPI_SPIN_US", "2000")) * 1e-6
#: Extra spinning per byte moved (1 ns/B, i.e. 1 GB/s): large ops need steady tests to
#: progress (MPI advances only inside MPI calls), so they back off only after that long.
SPIN_S_PER_BYTE = 1e-9
#: Longest sleep between two tests once a wait has backed off.
MAX_SLEEP_S = 1e-3
#: Ops up to this size keep the base spin budget.
_SPIN_FREE_BYTES = int(SPIN_S / SPIN_S_PER_BYTE) // 8
#: Tests before a wait starts yielding the CPU between them (when it yields at all).
_PURE_SPINS = 16


def _oversubscribed() -> bool:
    """True when this node runs more ranks than it has cores (or it cannot tell).

    Then waits yield the CPU between tests so a descheduled peer can run;
    otherwise they spin, as MPI's own blocking calls do. ``SPMD_MPI_YIELD=1/0``
    forces either.
    """
    forced = os.environ.get("SPMD_MPI_YIELD")
    if forced:
        return forced not in ("0", "false", "no")
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value) > (os.cpu_count() or 1)
    return True  # unknown: yielding costs a syscall per test, spinning oversubscribed costs ms


#: Whether waits yield between tests (decided once, at import).
_YIELD = _oversubscribed()

#: MPI tuning set before MPI_Init unless already in the environment. MPICH's default
#: MPI_Ireduce_scatter_block algorithm measured 3x slower than the blocking call at
#: 1 MiB on 2-3 ranks; pairwise exchange matches it at every size from 256 KiB up.
#: Only MPICH reads MPIR_CVAR_* variables.
MPI_DEFAULTS = {"MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM": "sched_pairwise"}

#: id(ReduceOp) -> {torch.dtype: (MPI datatype, MPI op)} for every pair MPI reduces natively.
_REDUCE: dict[int, dict[torch.dtype, tuple[Any, Any]]] = {}
#: dtypes MPI has no type for: reduced in float32 staging buffers.
_STAGED = frozenset({torch.float16, torch.bfloat16})

#: Serialises MPI_Test on one request between threads (a waiter and the watcher).
_TEST_LOCK = threading.Lock()
_acquire, _release = _TEST_LOCK.acquire, _TEST_LOCK.release

_yield = os.sched_yield if hasattr(os, "sched_yield") else (lambda: time.sleep(0))
_monotonic = time.monotonic
_sleep = time.sleep


def load_mpi() -> Any:
    """Import mpi4py.MPI (initialising MPI with thread support) and build the lookup tables."""
    global MPI
    if MPI is not None:
        return MPI
    with _LOAD_LOCK:
        if MPI is not None:
            return MPI
        reason = probe.mpi4py_missing()
        if reason is not None:
            raise BackendUnavailableError(reason)
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.threads = True
            mpi4py.rc.thread_level = "multiple"
            for name, value in MPI_DEFAULTS.items():
                os.environ.setdefault(name, value)  # read by MPI_Init; yours win
        try:
            from mpi4py import MPI as mpi
        except (ImportError, RuntimeError) as error:
            raise BackendUnavailableError(
                f"mpi4py could not load an MPI library ({error}); install one with: {probe.INSTALL_HINT}"
            ) from error
        if mpi.Is_finalized():
            raise BackendUnavailableError("MPI was already finalised in this process; it cannot be used again")
        if not mpi.Is_initialized():
            mpi.Init_thread(mpi.THREAD_MULTIPLE)
        if mpi.Query_thread() < mpi.THREAD_MULTIPLE:
            raise BackendUnavailableError(
                "spmd-mpi needs MPI_THREAD_MULTIPLE (waits and async ops test requests from several "
                f"threads) but this MPI provides level {mpi.Query_thread()}. If you initialised MPI "
                "yourself, leave mpi4py.rc.thread_level at 'multiple'; otherwise use an MPI built with "
                f"thread support ({probe.INSTALL_HINT})"
            )
        _build_tables(mpi)
        MPI = mpi
    return MPI


def _build_tables(mpi: Any) -> None:
    types = {
        torch.float32: mpi.FLOAT,
        torch.float64: mpi.DOUBLE,
        torch.complex64: mpi.C_FLOAT_COMPLEX,
        torch.complex128: mpi.C_DOUBLE_COMPLEX,
        torch.int8: mpi.INT8_T,
        torch.int16: mpi.INT16_T,
        torch.int32: mpi.INT32_T,
        torch.int64: mpi.INT64_T,
        torch.uint8: mpi.UINT8_T,
        torch.uint16: mpi.UINT16_T,
        torch.uint32: mpi.UINT32_T,
        torch.uint64: mpi.UINT64_T,
    }
    ops = {
        ReduceOp.SUM: mpi.SUM,
        ReduceOp.PRODUCT: mpi.PROD,
        ReduceOp.MIN: mpi.MIN,
        ReduceOp.MAX: mpi.MAX,
        ReduceOp.BAND: mpi.BAND,
        ReduceOp.BOR: mpi.BOR,
        ReduceOp.BXOR: mpi.BXOR,
    }
    # On bool, SUM/MAX/BOR mean "any", PRODUCT/MIN/BAND "all", BXOR parity (as the kernel's).
    bool_ops = {
        ReduceOp.SUM: mpi.LOR,
        ReduceOp.MAX: mpi.LOR,
        ReduceOp.BOR: mpi.LOR,
        ReduceOp.PRODUCT: mpi.LAND,
        ReduceOp.MIN: mpi.LAND,
        ReduceOp.BAND: mpi.LAND,
        ReduceOp.BXOR: mpi.LXOR,
    }
    bitwise = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    for op, mpi_op in ops.items():
        table: dict[torch.dtype, tuple[Any, Any]] = {}
        for dtype, mpi_type in types.items():
            if dtype.is_complex and op not in (ReduceOp.SUM, ReduceOp.PRODUCT):
                continue  # complex numbers have no order; MPI has no complex MIN/MAX
            if (dtype.is_floating_point or dtype.is_complex) and op in bitwise:
                continue
            table[dtype] = (mpi_type, mpi_op)
        table[torch.bool] = (mpi.C_BOOL, bool_ops[op])
        _REDUCE[id(op)] = table


def library_version() -> str:
    """The first line of ``MPI_Get_library_version`` (after the backend loaded MPI)."""
    mpi = load_mpi()
    return str(mpi.Get_library_version()).strip().splitlines()[0].strip()


# -- Work ------------------------------------------------------------------------------
class MpiWork(Work):
    """A Work over an MPI request: waits poll ``Test`` with back-off and honour the timeout.

    Holds the tensors (``keep``) whose memory MPI reads or writes until the
    request completes, then runs ``after(ok)`` (a staging copy-back) once.
    """

    # Class-level defaults: each instance sets only what differs (creation is on the hot path).
    _after: Callable[[bool], None] | None = None
    _claimed = False
    _watched = False
    _spin_s = SPIN_S

    def __init__(
        self, request: Any, keep: object = None, after: Callable[[bool], None] | None = None, nbytes: int = 0
    ) -> None:
        Work.__init__(self)  # (copying its fields via __dict__.update measured slower: 3.11 inline values)
        self._request = request
        self._keep = keep
        if after is not None:
            self._after = after
        if nbytes > _SPIN_FREE_BYTES:
            self._spin_s = SPIN_S + nbytes * SPIN_S_PER_BYTE

    def _try(self) -> int:
        """Test once: 0 still running, 1 finished, 2 another thread is finishing it."""
        if self._is_done:
            return 1
        error = None
        _acquire()
        try:
            if self._claimed:
                return 2
            try:
                if not self._request.Test():
                    return 0
            except MPI.Exception as failure:
                error = failure
            self._claimed = True
        finally:
            _release()
        self._complete(error)
        return 1

    def _complete(self, error: Any) -> None:
        """Finish once MPI is done: run ``after``, drop the buffers, wake waiters and callbacks."""
        after = self._after
        self._request = self._keep = None
        if error is None and after is None:
            self._finish(None, None)
            return
        self._after = None
        failure: BaseException | None = None
        if error is not None:
            text = error.Get_error_string() if hasattr(error, "Get_error_string") else str(error)
            failure = CollectiveError(f"{self.description} failed in MPI: {text}")
        if after is not None:
            try:
                after(failure is None)
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                failure = failure or exc
        self._finish(None, failure)

    def _wait_native(self, timeout: float | None) -> bool:
        """Test until done, spinning first, then sleeping with back-off; False at the timeout.

        The test loop is written out (not calls to ``_try``): it is the hot path
        of every synchronous op.
        """
        if self._is_done:
            return True
        request = self._request
        spins = 0
        deadline = spin_until = 0.0
        delay = 1e-6
        mine = False
        error = None
        while True:
            _acquire()
            try:
                if self._claimed:
                    break  # another thread is finishing it
                try:
                    done = request.Test()
                except MPI.Exception as failure:
                    done, error = True, failure
                if done:
                    self._claimed = mine = True
                    break
            finally:
                _release()
            if spins < _PURE_SPINS:
                spins += 1
                if spins == _PURE_SPINS:
                    now = _monotonic()
                    deadline = float("inf") if timeout is None else now + timeout
                    spin_until = now + self._spin_s
                continue
            now = _monotonic()
            if now >= deadline:
                return False
            if now < spin_until:
                if _YIELD:
                    _yield()  # lets a peer rank on the same core run
            else:
                _sleep(min(delay, deadline - now))
                delay = min(delay * 2, MAX_SLEEP_S)
        if mine:
            self._complete(error)
            return True
        if timeout is not None and spins >= _PURE_SPINS:
            timeout = max(0.0, deadline - _monotonic())
        return Work._wait_native(self, timeout)  # woken by the thread that finishes it

    def is_completed(self) -> bool:
        if not self._is_done:
            self._try()
        return self._is_done

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        if not self._is_done and not self._watched:
            self._watched = True
            _WATCHER.add(self)  # someone must test the request for the callback to fire
        Work.add_done_callback(self, callback)


class _Watcher:
    """One daemon thread that tests the requests of Works with callbacks (futures, batches).

    It calls into MPI only while it has Works to watch, and stops at exit
    before MPI is finalised.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._works: list[MpiWork] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    def add(self, work: MpiWork) -> None:
        with self._cond:
            self._works.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="spmd-mpi-watcher", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=2)

    def _loop(self) -> None:
        busy_since = _monotonic()
        delay = 1e-6
        while True:
            with self._cond:
                while not self._works and not self._stopping:
                    self._cond.wait()
                    busy_since, delay = _monotonic(), 1e-6
                if self._stopping:
                    return
                works = list(self._works)
            done = [w for w in works if w._try() != 0]
            if done:
                with self._cond:
                    self._works = [w for w in self._works if not any(w is d for d in done)]
                busy_since, delay = _monotonic(), 1e-6
            elif _monotonic() - busy_since < SPIN_S:
                _yield()  # the watcher always yields: it competes with this rank's own threads
            else:
                _sleep(delay)
                delay = min(delay * 2, MAX_SLEEP_S)


_WATCHER = _Watcher()


# -- the backend -------------------------------------------------------------------------
def _world_error(ctx: BackendContext, world_size: int, world_rank: int, ranks: Sequence[int]) -> str:
    me = ranks[ctx.rank]
    where = f"group {ctx.group_name!r} (ranks {list(ranks)}, this rank {me})"
    if world_size == 1 and ctx.size > 1:
        announced = probe.launcher_world_size()
        if probe.launched_by_mpi() and announced and announced > 1:
            right, why = probe.find_mpiexec()
            fix = f"launch with {right} -n {announced} ..." if right else why
            return (
                f"{where}: this process was started by {probe.launcher_family()} as one of "
                f"{announced} ranks, but the MPI library that mpi4py loaded ({library_version()}) "
                f"sees a world of 1. The mpiexec does not belong to this MPI library, so every rank "
                f"became a separate one-rank job; {fix}"
            )
        return (
            f"{where} has {ctx.size} ranks, but this process is an MPI singleton (MPI_COMM_WORLD has "
            f"1 rank): MPI ranks must be started by MPI's launcher. Run `mpiexec -n {ctx.size} python "
            "script.py` (or srun --mpi=pmi2/pmix) and call spmd.init() without rank/world_size; "
            "under torchrun or `spmd run` use another backend, e.g. spmd.init('gloo')"
        )
    if max(ranks) >= world_size:
        return (
            f"{where} names ranks up to {max(ranks)} but MPI_COMM_WORLD has only {world_size}: start "
            f"as many MPI ranks as spmd ranks (mpiexec -n {max(ranks) + 1})"
        )
    return (
        f"{where}: spmd rank {me} is MPI rank {world_rank}. spmd's ranks must be MPI_COMM_WORLD's; "
        "under mpiexec call spmd.init() without rank=/world_size= so both come from the MPI launcher"
    )


class MpiBackend(Backend):
    """One MPI communicator for one spmd group; every collective native and non-blocking."""

    supports_avg = False  # MPI has no AVG; the kernel sums and divides

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        mpi = load_mpi()
        world = mpi.COMM_WORLD
        world_size, world_rank = world.Get_size(), world.Get_rank()
        ranks = tuple(ctx.global_ranks) or tuple(range(ctx.size))
        if (world_size == 1 and ctx.size > 1) or max(ranks) >= world_size or ranks[ctx.rank] != world_rank:
            raise BackendUnavailableError(_world_error(ctx, world_size, world_rank, ranks))
        self._rendezvous(ctx)
        if ranks == tuple(range(world_size)):
            comm = world.Dup()
        else:
            world_group = world.Get_group()
            members = world_group.Incl(list(ranks))
            try:
                comm = world.Create_group(members, zlib.crc32(ctx.group_name.encode()) & 0x7FFF)
            finally:
                members.Free()
                world_group.Free()
        if comm.Get_rank() != ctx.rank or comm.Get_size() != ctx.size:  # pragma: no cover - MPI bug
            raise CollectiveError(f"MPI built a communicator of {comm.Get_size()} for group {ctx.group_name!r}")
        self.comm = comm
        self._pool = BufferPool()
        self._buffer = mpi.buffer.fromaddress
        self._in_place = mpi.IN_PLACE
        self._byte = mpi.BYTE
        # Bound once: attribute lookups are measurable on 4-byte ops.
        self._isend, self._irecv = comm.Isend, comm.Irecv
        self._iallreduce, self._ireduce, self._ibcast = comm.Iallreduce, comm.Ireduce, comm.Ibcast
        self._iallgather, self._ireduce_scatter_block = comm.Iallgather, comm.Ireduce_scatter_block
        self._ialltoall, self._ialltoallv = comm.Ialltoall, comm.Ialltoallv
        self._igather, self._iscatter, self._ibarrier = comm.Igather, comm.Iscatter, comm.Ibarrier

    @staticmethod
    def _rendezvous(ctx: BackendContext) -> None:
        """Wait (with the group timeout) until every member is here: creating a communicator has no timeout."""
        if ctx.size == 1:
            return
        ctx.store.set(f"mpi-comm/{ctx.rank}", b"1")
        try:
            ctx.store.wait([f"mpi-comm/{r}" for r in range(ctx.size)], ctx.timeout)
        except Exception as error:  # noqa: BLE001 - the store's timeout error names no ranks
            missing = [r for r in range(ctx.size) if not ctx.store.check([f"mpi-comm/{r}"])]
            raise CollectiveTimeoutError(
                f"creating the MPI communicator of group {ctx.group_name!r}: group ranks {missing} did "
                f"not arrive within {ctx.timeout.total_seconds():.1f} s ({error}); every member must "
                "use the group (its first collective creates the communicator)"
            ) from error

    # -- buffers ---------------------------------------------------------------------
    def _bytes(self, tensor: torch.Tensor) -> Any:
        """A raw MPI buffer over the tensor's memory (contiguous, as the kernel guarantees)."""
        return self._buffer(tensor.data_ptr(), tensor.nbytes)

    def _typed(self, tensor: torch.Tensor, mpi_type: Any) -> list[Any]:
        return [self._buffer(tensor.data_ptr(), tensor.nbytes), mpi_type]

    def _stage(self, tensor: torch.Tensor, copy_in: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """A float32 copy of a float16/bfloat16 tensor in a pooled buffer: (pooled, view)."""
        n = tensor.numel()
        pooled = self._pool.acquire(n, torch.float32)
        view = pooled[:n]
        if copy_in:
            view.copy_(tensor.reshape(-1))
        return pooled, view

    def _staged_done(self, pooled: torch.Tensor, view: torch.Tensor, target: torch.Tensor | None) -> Callable[[bool], None]:
        def after(ok: bool) -> None:
            try:
                if ok and target is not None:
                    target.reshape(-1).copy_(view)
            finally:
                self._pool.release(pooled)

        return after

    # -- point-to-point ----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        nbytes = tensor.nbytes
        return MpiWork(self._isend(self._buffer(tensor.data_ptr(), nbytes), dst, tag), tensor, None, nbytes)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        nbytes = tensor.nbytes
        return MpiWork(self._irecv(self._buffer(tensor.data_ptr(), nbytes), src, tag), tensor, None, nbytes)

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        table = _REDUCE.get(id(op))
        entry = table.get(tensor.dtype) if table is not None else None
        if entry is not None:
            nbytes = tensor.nbytes
            if not nbytes:
                return Work.completed()
            request = self._iallreduce(self._in_place, [self._buffer(tensor.data_ptr(), nbytes), entry[0]], entry[1])
            return MpiWork(request, tensor, None, nbytes)
        if tensor.dtype in _STAGED and table is not None:
            if tensor.numel() == 0:
                return Work.completed()
            mpi_type, mpi_op = table[torch.float32]
            pooled, view = self._stage(tensor)
            request = self._iallreduce(self._in_place, self._typed(view, mpi_type), mpi_op)
            return MpiWork(request, (tensor, pooled), self._staged_done(pooled, view, tensor), view.nbytes)
        return super().all_reduce(tensor, op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        table = _REDUCE.get(id(op))
        if table is None or (tensor.dtype not in table and tensor.dtype not in _STAGED):
            return super().reduce(tensor, dst, op)
        if tensor.numel() == 0:
            return Work.completed()
        root = self.rank == dst
        if tensor.dtype in table:
            mpi_type, mpi_op = table[tensor.dtype]
            data = self._typed(tensor, mpi_type)
            request = self._ireduce(self._in_place, data, mpi_op, dst) if root else self._ireduce(data, None, mpi_op, dst)
            return MpiWork(request, tensor, None, tensor.nbytes)
        mpi_type, mpi_op = table[torch.float32]
        pooled, view = self._stage(tensor)
        data = self._typed(view, mpi_type)
        request = self._ireduce(self._in_place, data, mpi_op, dst) if root else self._ireduce(data, None, mpi_op, dst)
        return MpiWork(request, (tensor, pooled), self._staged_done(pooled, view, tensor if root else None), view.nbytes)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        table = _REDUCE.get(id(op))
        entry = table.get(input.dtype) if table is not None else None
        if entry is not None:
            out_bytes = output.nbytes
            if not out_bytes:
                return Work.completed()
            buffer, mpi_type = self._buffer, entry[0]
            request = self._ireduce_scatter_block(
                [buffer(input.data_ptr(), input.nbytes), mpi_type], [buffer(output.data_ptr(), out_bytes), mpi_type], entry[1]
            )
            return MpiWork(request, (output, input), None, input.nbytes)
        if input.dtype in _STAGED and table is not None:
            if output.numel() == 0:
                return Work.completed()
            mpi_type, mpi_op = table[torch.float32]
            pooled_in, view_in = self._stage(input)
            pooled_out, view_out = self._stage(output, copy_in=False)
            request = self._ireduce_scatter_block(self._typed(view_in, mpi_type), self._typed(view_out, mpi_type), mpi_op)
            release_in = self._staged_done(pooled_in, view_in, None)
            copy_out = self._staged_done(pooled_out, view_out, output)

            def after(ok: bool) -> None:
                try:
                    copy_out(ok)
                finally:
                    release_in(ok)

            return MpiWork(request, (output, input, pooled_in, pooled_out), after, view_in.nbytes)
        return super().reduce_scatter_tensor(output, input, op)

    # -- data movement -------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        nbytes = tensor.nbytes
        if not nbytes:
            return Work.completed()
        return MpiWork(self._ibcast(self._buffer(tensor.data_ptr(), nbytes), src), tensor, None, nbytes)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        nbytes = input.nbytes
        if not nbytes:
            return Work.completed()
        buffer = self._buffer
        out_bytes = output.nbytes
        request = self._iallgather(buffer(input.data_ptr(), nbytes), buffer(output.data_ptr(), out_bytes))
        return MpiWork(request, (output, input), None, out_bytes)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work:
        buffer = self._buffer
        out_data = buffer(output.data_ptr(), output.nbytes)
        in_data = buffer(input.data_ptr(), input.nbytes)
        if _even(input_split_sizes) and _even(output_split_sizes):
            if input.numel() == 0 and output.numel() == 0:
                return Work.completed()  # even splits: every rank's tensors are empty alike
            return MpiWork(self._ialltoall(in_data, out_data), (output, input), None, max(input.nbytes, output.nbytes))
        in_rows = input.shape[0] if input.dim() else input.numel()
        out_rows = output.shape[0] if output.dim() else output.numel()
        if in_rows:
            row = input.nbytes // in_rows
        else:
            row = output.nbytes // out_rows if out_rows else 0
        byte = self._byte
        request = self._ialltoallv(
            [in_data, _counts(input_split_sizes, row), byte],
            [out_data, _counts(output_split_sizes, row), byte],
        )
        return MpiWork(request, (output, input), None, max(input.nbytes, output.nbytes))

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int) -> Work:
        if input.numel() == 0:
            return Work.completed()
        out_data = None if output is None else self._bytes(output)
        return MpiWork(self._igather(self._bytes(input), out_data, dst), (output, input), None, input.nbytes * self.size)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int) -> Work:
        if output.numel() == 0:
            return Work.completed()
        in_data = None if input is None else self._bytes(input)
        return MpiWork(self._iscatter(in_data, self._bytes(output), src), (output, input), None, output.nbytes * self.size)

    def barrier(self) -> Work:
        return MpiWork(self._ibarrier())

    # -- groups --------------------------------------------------------------------------
    def split(self, ranks: Sequence[int], ctx: BackendContext) -> Backend | None:
        """A real sub-communicator (``MPI_Comm_create_group`` over the members only)."""
        return MpiBackend(ctx)

    def close(self) -> None:
        super().close()
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None and MPI is not None and not MPI.Is_finalized():
            try:
                comm.Free()
            except MPI.Exception:  # pragma: no cover - nothing useful to do at teardown
                pass


def _even(splits: Sequence[int]) -> bool:
    """True when every rank gets the same number of rows (``Ialltoall`` needs no counts)."""
    return not splits or splits.count(splits[0]) == len(splits)


def _counts(splits: Sequence[int], row_bytes: int) -> tuple[list[int], list[int]]:
    """(counts, displacements) in bytes for rows split as ``splits``."""
    counts = [s * row_bytes for s in splits]
    displs = [0] * len(counts)
    total = 0
    for i, c in enumerate(counts):
        displs[i] = total
        total += c
    return counts, displs
