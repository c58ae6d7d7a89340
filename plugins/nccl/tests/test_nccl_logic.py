"""The backend's host-side logic without a GPU: a fake NCCL and fake CUDA streams and events.

What runs on the device (the NCCL kernels, real events) is covered by
test_nccl_gpu.py on a GPU machine; this file covers what spmd-nccl decides on
the host: stream ordering, event-based completion, timeouts and aborts, async
errors, queued point-to-point flushed as one NCCL group, ncclInProgress
settling, and teardown.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

pytest.importorskip("spmd_nccl", reason="spmd-nccl is not installed (pip install -e plugins/nccl)")

import torch.distributed as tdist  # noqa: E402

import spmd
from spmd.comm.work import NativeWorkAdapter, Work, WorkList
from spmd.errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError  # noqa: E402
from spmd_nccl import backend as nb  # noqa: E402
from spmd_nccl import communicator, library, mapping  # noqa: E402


# -- fakes ---------------------------------------------------------------------------------
class FakeStream:
    count = 0

    def __init__(self, device: Any = None, name: str = "internal") -> None:
        FakeStream.count += 1
        self.cuda_stream = 0x1000 + FakeStream.count
        self.name = name
        self.log: list[tuple[str, Any]] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", event))


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.done


class FakeCuda:
    def __init__(self) -> None:
        self.caller = FakeStream(name="caller")
        self.capturing = False


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.caller)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
    return fake


class FakeLib:
    """Enough of NcclLibrary for the Communicator: records calls, returns scripted results."""

    version = library.version_code(2, 32, 3)
    version_string = "2.32.3"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.results: dict[str, list[int]] = {}  # name -> results to return, in order (then success)
        self.async_states: list[int] = []  # what ncclCommGetAsyncError reports next (then success)
        self.lock = threading.Lock()
        names = ["ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
                 "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd", "ncclCommSplit"]
        self.functions = {name: self._recorder(name) for name in names}

    def _recorder(self, name: str) -> Any:
        def call(*args: Any) -> int:
            with self.lock:
                self.calls.append((name, args))
                queue = self.results.get(name)
                return queue.pop(0) if queue else library.ncclSuccess

        return call

    def names(self) -> list[str]:
        with self.lock:
            return [name for name, _ in self.calls]

    def issued(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The calls other than the watcher's ncclCommGetAsyncError polls."""
        with self.lock:
            return [(name, args) for name, args in self.calls if name != "ncclCommGetAsyncError"]

    def has(self, name: str) -> bool:
        return True

    def describe(self, result: int, comm: Any = None) -> str:
        return f"{library.RESULT_NAMES[result]}: fake"

    def config(self, **values: Any) -> ctypes.Structure:
        return library.make_config(self.version, **values)

    def ncclCommGetAsyncError(self, handle: Any, state: Any) -> int:  # noqa: N802 - NCCL's name
        with self.lock:
            self.calls.append(("ncclCommGetAsyncError", ()))
            state._obj.value = self.async_states.pop(0) if self.async_states else library.ncclSuccess
        return library.ncclSuccess

    def unique_id(self) -> library.ncclUniqueId:
        return library.ncclUniqueId.from_buffer_copy(os.urandom(library.NCCL_UNIQUE_ID_BYTES))

    def ncclCommInitRankConfig(self, comm: Any, nranks: int, uid: Any, rank: int, config: Any) -> int:  # noqa: N802
        comm._obj.value = 0xC0 + rank
        return self._recorder("ncclCommInitRankConfig")(nranks, bytes(uid), rank, config._obj.blocking)

    def ncclCommAbort(self, handle: Any) -> int:  # noqa: N802
        return self._recorder("ncclCommAbort")(handle)

    def ncclCommFinalize(self, handle: Any) -> int:  # noqa: N802
        return self._recorder("ncclCommFinalize")(handle)

    def ncclCommDestroy(self, handle: Any) -> int:  # noqa: N802
        return self._recorder("ncclCommDestroy")(handle)


@pytest.fixture
def lib() -> FakeLib:
    return FakeLib()


@pytest.fixture
def comms(cuda: FakeCuda, lib: FakeLib) -> Iterator[list[nb.Communicator]]:
    made: list[nb.Communicator] = []
    yield made
    for comm in made:
        comm._stopped = True
        comm._wake.set()
        comm._thread.join(timeout=5)


def make(comms: list[nb.Communicator], lib: FakeLib, timeout_s: float = 30.0) -> nb.Communicator:
    comm = nb.Communicator(lib, ctypes.c_void_p(0xC0FFEE), torch.device("cuda", 0), 0, 2, timeout_s, "g", False)  # type: ignore[arg-type]
    comms.append(comm)
    return comm


def all_reduce(comm: nb.Communicator, keep: object = None) -> NativeWorkAdapter:
    """An all_reduce's handle, wrapped as spmd's kernel wraps it (``work.native`` is spmd-nccl's)."""
    def issue() -> None:
        comm.call("ncclAllReduce", 0x10, 0x10, 4, 7, 0, comm.handle, comm.stream_handle)

    return Work.from_native(comm.launch(issue, keep))  # type: ignore[return-value]


def post(comm: nb.Communicator, send: bool, nbytes: int) -> NativeWorkAdapter:
    """A queued isend (or irecv) to rank 1, wrapped as the kernel wraps it."""
    return Work.from_native(comm.post_p2p(send, torch.zeros(nbytes, dtype=torch.uint8), 1))  # type: ignore[return-value]


def eventually(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


# -- streams, events, completion -------------------------------------------------------------------
def test_an_op_waits_for_the_callers_stream_and_completes_with_its_event(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    keep = torch.ones(3)
    work = all_reduce(comm, keep)
    assert comm.stream.log[0] == ("wait_stream", "caller")  # ordered after the caller's work
    name, args = lib.issued()[0]
    assert name == "ncclAllReduce" and args[-1].value == comm.stream.cuda_stream  # on the internal stream
    assert work.native.cuda_event is not None and work.native.cuda_event.stream is comm.stream
    assert not work.is_completed() and work.native.keep_alive is keep  # the tensor is held while NCCL may use it
    work.native.cuda_event.done = True
    assert eventually(work.is_completed)
    assert work.native.keep_alive is None and work.exception() is None
    assert eventually(lambda: not comm._outstanding)  # the watcher dropped it too


def test_wait_without_timeout_is_a_stream_wait(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    work = all_reduce(comm)
    start = time.perf_counter()
    assert work.wait() is True
    assert time.perf_counter() - start < 0.5
    assert cuda.caller.log == [("wait_event", work.native.cuda_event)]  # the caller's stream waits; the CPU does not
    assert not work.is_completed()


def test_the_watcher_completes_works_nobody_waits_for(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    works = [all_reduce(comm).native for _ in range(3)]
    for work in works:
        work.cuda_event.done = True
    assert eventually(lambda: all(w.done for w in works))


def test_a_shorter_wait_only_ends_that_wait(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    """A caller's ``wait(timeout)`` below the group's raises for that wait; the op and the communicator live on."""
    comm = make(comms, lib)
    work = all_reduce(comm)
    start = time.perf_counter()
    with pytest.raises(CollectiveTimeoutError, match=r"did not complete within 0\.2 s"):
        work.wait(timeout=0.2)
    assert 0.15 < time.perf_counter() - start < 3
    assert "ncclCommAbort" not in lib.names() and comm.handle is not None and comm.error is None
    work.native.cuda_event.done = True
    assert work.wait(timeout=5) is True and work.exception() is None  # the late op still completes


def test_a_cpu_wait_past_the_ops_own_deadline_aborts_and_raises_the_named_error(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    work = all_reduce(comm)
    other = all_reduce(comm)
    work.native.cpu_wait = True  # as a barrier's: wait() blocks the CPU until the group's deadline
    work.default_timeout = 0.2  # (the kernel attaches the group's timeout)
    start = time.perf_counter()
    with pytest.raises(CollectiveTimeoutError, match=r"did not complete within 0\.2 s"):
        work.wait()
    assert 0.15 < time.perf_counter() - start < 3
    assert lib.names().count("ncclCommAbort") == 1 and comm.handle is None
    assert eventually(other.is_completed) and isinstance(other.exception(), CollectiveTimeoutError)  # everything on it failed too
    with pytest.raises(CollectiveTimeoutError, match="was aborted after an earlier failure"):
        all_reduce(comm)


def test_the_watcher_aborts_an_op_that_outlives_the_group_timeout(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib, timeout_s=0.3)
    work = all_reduce(comm)
    work.wait()  # a stream wait: nobody blocks on the CPU, the watcher still notices
    # the watcher sets the communicator's error, then fails its works: wait for the second
    assert eventually(lambda: comm.error is not None and work.exception() is not None)
    assert isinstance(work.exception(), CollectiveTimeoutError)
    assert "spmd-nccl's watcher aborted the communicator" in str(work.exception())
    with pytest.raises(CollectiveTimeoutError):
        work.wait()


def test_an_async_nccl_error_aborts_and_fails_running_ops(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    work = all_reduce(comm)
    lib.async_states = [library.ncclRemoteError]
    assert eventually(work.is_completed)
    error = work.exception()
    assert isinstance(error, nb.NcclError) and error.code == library.ncclRemoteError
    assert "asynchronous error" in str(error)
    with pytest.raises(CollectiveError, match="aborted after an earlier failure") as raised:
        all_reduce(comm)
    assert not isinstance(raised.value, CollectiveTimeoutError)


def test_is_completed_queries_the_event(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    comm._stopped = True  # no watcher: only is_completed() can notice
    work = all_reduce(comm)
    assert not work.is_completed()
    work.native.cuda_event.done = True
    assert work.is_completed() and work.exception() is None


def test_wait_with_timeout_returns_once_the_event_completes(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    comm._stopped = True
    work = all_reduce(comm)
    threading.Timer(0.1, lambda: setattr(work.native.cuda_event, "done", True)).start()
    assert work.wait(timeout=5) is True
    assert comm.error is None


# -- point-to-point -----------------------------------------------------------------------------
def test_p2p_is_queued_then_issued_as_one_group_on_wait(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    send = post(comm, True, 8)
    recv = post(comm, False, 4)
    assert "ncclSend" not in lib.names()  # nothing issued yet: a ring of irecv-then-isend must not deadlock
    recv.wait()
    issued = lib.issued()
    assert [name for name, _ in issued[:4]] == ["ncclGroupStart", "ncclSend", "ncclRecv", "ncclGroupEnd"]
    assert issued[1][1][1] == 8 and issued[2][1][1] == 4  # byte counts
    assert send.native.cuda_event is recv.native.cuda_event is not None
    waits = [entry for entry in comm.stream.log if entry[0] == "wait_event"]
    assert len(waits) == 2  # each op waited for what the caller's stream had when it was posted


def test_the_watcher_flushes_p2p_nobody_waits_for(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    send = comm.post_p2p(True, torch.zeros(8, dtype=torch.uint8), 1)
    assert eventually(lambda: send.cuda_event is not None)
    assert "ncclSend" in lib.names()


def test_a_collective_issues_queued_p2p_first(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    comm._stopped = True
    comm.post_p2p(True, torch.zeros(8, dtype=torch.uint8), 1)
    all_reduce(comm)
    assert [name for name, _ in lib.issued()] == ["ncclGroupStart", "ncclSend", "ncclGroupEnd", "ncclAllReduce"]


# -- NCCL results -------------------------------------------------------------------------------------
def test_in_progress_is_polled_until_success(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    comm._stopped = True
    lib.results["ncclAllReduce"] = [library.ncclInProgress]
    lib.async_states = [library.ncclInProgress, library.ncclInProgress, library.ncclSuccess]
    all_reduce(comm)
    assert lib.names().count("ncclCommGetAsyncError") == 3
    assert comm.error is None


def test_in_progress_past_the_timeout_aborts(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib, timeout_s=0.2)
    comm._stopped = True
    lib.results["ncclAllReduce"] = [library.ncclInProgress]
    lib.async_states = [library.ncclInProgress] * 100000
    with pytest.raises(CollectiveTimeoutError, match="still in progress after 0.2 s"):
        all_reduce(comm)
    assert comm.handle is None and "ncclCommAbort" in lib.names()


def test_an_invalid_argument_fails_the_call_but_keeps_the_communicator(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    lib.results["ncclAllReduce"] = [library.ncclInvalidArgument]
    with pytest.raises(nb.NcclError, match="ncclAllReduce failed on group 'g' .*ncclInvalidArgument"):
        all_reduce(comm)
    assert comm.error is None and comm.handle is not None
    all_reduce(comm)  # still usable


def test_a_system_error_aborts(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    lib.results["ncclAllReduce"] = [library.ncclSystemError]
    with pytest.raises(nb.NcclError, match="ncclSystemError"):
        all_reduce(comm)
    assert comm.handle is None and "ncclCommAbort" in lib.names()


def test_group_end_runs_even_when_a_call_inside_fails(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    comm._stopped = True
    lib.results["ncclSend"] = [library.ncclInvalidArgument]
    work = post(comm, True, 8)
    with pytest.raises(nb.NcclError):
        work.wait()
    assert lib.issued()[-1][0] == "ncclGroupEnd"  # NCCL's group depth is per thread: never leave it open
    assert work.is_completed() and isinstance(work.exception(), nb.NcclError)


# -- capture and teardown -------------------------------------------------------------------------------
def test_ops_captured_in_a_graph_are_not_tracked(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    cuda.capturing = True
    work = all_reduce(comm, torch.ones(2))
    assert work.native.captured and work.native.keep_alive is None and not comm._outstanding
    work.wait()
    assert work.is_completed()  # "done" in a capture means: ordered before what follows
    assert cuda.caller.log[-1] == ("wait_event", work.native.cuda_event)


def test_close_finalizes_then_destroys(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    comm = make(comms, lib)
    work = all_reduce(comm)
    comm.close()
    assert lib.names()[-3:] == ["ncclCommFinalize", "ncclCommGetAsyncError", "ncclCommDestroy"]
    assert work.is_completed() and work.exception() is None
    assert comm.handle is None
    with pytest.raises(CollectiveError, match="was closed"):
        all_reduce(comm)
    comm.close()  # twice is fine


def test_close_aborts_when_finalize_cannot_finish(cuda: FakeCuda, lib: FakeLib, comms: list, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = make(comms, lib)
    monkeypatch.setattr(communicator, "CLOSE_TIMEOUT", 0.2)
    lib.results["ncclCommFinalize"] = [library.ncclInProgress]
    lib.async_states = [library.ncclInProgress] * 100000
    comm.close()
    assert "ncclCommAbort" in lib.names() and "ncclCommDestroy" not in lib.names()


# -- bootstrap ------------------------------------------------------------------------------------------
@pytest.fixture
def real_lib() -> library.NcclLibrary:
    try:
        return library.load()
    except library.NcclLibraryError as error:
        pytest.skip(f"no NCCL library: {error}")


def test_rank_0_shares_the_unique_id_through_the_store(real_lib: library.NcclLibrary) -> None:
    store = tdist.PrefixStore("spmd/world/cuda/", tdist.HashStore())
    got: dict[int, bytes] = {}

    def rank(r: int) -> None:
        got[r] = bytes(nb.exchange_unique_id(real_lib, store, r, timedelta(seconds=10), "world"))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(got) == 3 and got[0] == got[1] == got[2] and len(got[0]) == 128


def test_a_rank_0_failure_reaches_every_rank(real_lib: library.NcclLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tdist.HashStore()

    def broken() -> None:
        raise library.NcclLibraryError("ncclGetUniqueId failed: ncclSystemError: no network interface")

    monkeypatch.setattr(real_lib, "unique_id", broken)
    with pytest.raises(BackendUnavailableError, match="no network interface"):
        nb.exchange_unique_id(real_lib, store, 0, timedelta(seconds=5), "world")
    with pytest.raises(BackendUnavailableError, match="rank 0 of group 'world' could not create the NCCL unique id: .*no network interface"):
        nb.exchange_unique_id(real_lib, store, 1, timedelta(seconds=5), "world")


def test_a_missing_rank_0_is_a_named_timeout(real_lib: library.NcclLibrary) -> None:
    with pytest.raises(CollectiveTimeoutError, match="rank 1 of group 'sub' waited 0.3 s for rank 0's NCCL unique id"):
        nb.exchange_unique_id(real_lib, tdist.HashStore(), 1, timedelta(seconds=0.3), "sub")


def test_await_ready_polls_then_aborts_at_the_deadline(lib: FakeLib) -> None:
    lib.async_states = [library.ncclInProgress, library.ncclSuccess]
    nb.await_ready(lib, ctypes.c_void_p(1), time.monotonic() + 5, "init")  # type: ignore[arg-type]
    lib.async_states = [library.ncclInProgress] * 100000
    with pytest.raises(CollectiveTimeoutError, match="init did not finish in time"):
        nb.await_ready(lib, ctypes.c_void_p(1), time.monotonic() + 0.1, "init")  # type: ignore[arg-type]
    assert "ncclCommAbort" in lib.names()
    lib.async_states = [library.ncclInternalError]
    with pytest.raises(nb.NcclError, match="init failed: ncclInternalError"):
        nb.await_ready(lib, ctypes.c_void_p(1), time.monotonic() + 5, "init")  # type: ignore[arg-type]


def test_each_communicator_of_a_group_uses_a_fresh_unique_id_key(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    store = tdist.HashStore()

    def ctx(rank: int) -> Any:
        return nb.BackendContext(rank=rank, size=2, store=store, timeout=timedelta(seconds=10), group_name="g", device_type="cuda")

    for _ in range(2):  # the group is made twice on one store (destroy, then init again)
        made: dict[int, nb.Communicator] = {}
        threads = [threading.Thread(target=lambda r=r, made=made: made.__setitem__(r, nb.create_communicator(lib, ctx(r), torch.device("cuda", 0), False))) for r in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        comms.extend(made.values())
        assert made[0].origin == "ncclCommInitRankConfig"
    inits = [args for name, args in lib.issued() if name == "ncclCommInitRankConfig"]
    assert len(inits) == 4 and all(args[3] == 0 for args in inits)  # non-blocking
    first, second = {a[1] for a in inits[:2]}, {a[1] for a in inits[2:]}
    assert len(first) == len(second) == 1 and first != second  # each pair agreed on its own id
    assert store.check(["nccl/unique_id/1", "nccl/unique_id/2"])


# -- the ops' arguments --------------------------------------------------------------------------------
@pytest.fixture
def backend(cuda: FakeCuda, lib: FakeLib, comms: list, monkeypatch: pytest.MonkeyPatch) -> nb.NcclBackend:
    """An NcclBackend of rank 1 in a group of 3 over a fake communicator; CPU tensors stand in for CUDA ones."""
    comm = make(comms, lib)
    comm.rank, comm.size = 1, 3
    comm._stopped = True
    instance = object.__new__(nb.NcclBackend)
    instance.ctx = nb.BackendContext(rank=1, size=3, store=tdist.HashStore(), timeout=timedelta(seconds=10), group_name="g", device_type="cuda")
    instance.lib = lib  # type: ignore[assignment]
    instance._comm = comm
    instance._blocking = False
    instance._create_lock = threading.Lock()
    monkeypatch.setattr(nb.NcclBackend, "_prepare", lambda self, op, *tensors: self._comm)
    return instance


def _issued(lib: FakeLib, name: str) -> tuple[Any, ...]:
    found = [args for n, args in lib.issued() if n == name]
    assert len(found) == 1, lib.issued()
    return found[0]


def test_all_reduce_arguments(backend: nb.NcclBackend, lib: FakeLib) -> None:
    t = torch.zeros(6, dtype=torch.complex64)
    backend.all_reduce(t, spmd.ReduceOp.AVG)
    send, recv, count, dtype, op, handle, stream = _issued(lib, "ncclAllReduce")
    assert send == recv == t.data_ptr() and count == 12  # complex as (re, im) float pairs
    assert (dtype, op) == (mapping.ncclFloat32, mapping.ncclAvg)
    assert handle is backend.communicator.handle and stream is backend.communicator.stream_handle


def test_reduce_passes_null_off_the_root(backend: nb.NcclBackend, lib: FakeLib) -> None:
    t = torch.zeros(5, dtype=torch.bool)
    backend.reduce(t, 0, spmd.ReduceOp.BAND)
    send, recv, count, dtype, op, root, _, _ = _issued(lib, "ncclReduce")
    assert send == t.data_ptr() and recv is None and count == 5 and root == 0
    assert (dtype, op) == (mapping.ncclUint8, mapping.ncclMin)  # bool "all" as uint8 MIN


def test_reduce_scatter_counts_the_output(backend: nb.NcclBackend, lib: FakeLib) -> None:
    out, inp = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(12, dtype=torch.bfloat16)
    backend.reduce_scatter_tensor(out, inp, spmd.ReduceOp.MAX)
    send, recv, count, dtype, op, _, _ = _issued(lib, "ncclReduceScatter")
    assert (send, recv, count, dtype, op) == (inp.data_ptr(), out.data_ptr(), 4, mapping.ncclBfloat16, mapping.ncclMax)


def test_data_movement_moves_bytes(backend: nb.NcclBackend, lib: FakeLib) -> None:
    t = torch.zeros(3, dtype=torch.uint64)
    backend.broadcast(t, 2)
    assert _issued(lib, "ncclBroadcast")[:5] == (t.data_ptr(), t.data_ptr(), 24, mapping.BYTES, 2)
    out, inp = torch.zeros(9, dtype=torch.float8_e5m2), torch.zeros(3, dtype=torch.float8_e5m2)
    backend.all_gather_into_tensor(out, inp)
    assert _issued(lib, "ncclAllGather")[:4] == (inp.data_ptr(), out.data_ptr(), 3, mapping.BYTES)


def test_all_to_all_single_offsets_and_the_local_block(backend: nb.NcclBackend, lib: FakeLib) -> None:
    inp = torch.arange(12, dtype=torch.int32).reshape(6, 2)  # rows 1, 3, 2 go to ranks 0, 1, 2
    out = torch.zeros(5, 2, dtype=torch.int32)  # rows 2, 3, 0 come from ranks 0, 1, 2
    backend.all_to_all_single(out, inp, [2, 3, 0], [1, 3, 2])
    calls = lib.issued()
    row = 8  # bytes per row
    assert [n for n, _ in calls] == ["ncclGroupStart", "ncclSend", "ncclRecv", "ncclSend", "ncclGroupEnd"]
    assert calls[1][1][:4] == (inp.data_ptr(), 1 * row, mapping.BYTES, 0)
    assert calls[2][1][:4] == (out.data_ptr(), 2 * row, mapping.BYTES, 0)
    assert calls[3][1][:4] == (inp.data_ptr() + 4 * row, 2 * row, mapping.BYTES, 2)  # nothing comes from rank 2
    assert torch.equal(out[2:5], inp[1:4])  # this rank's own block is copied locally


def test_gather_and_scatter_off_and_on_the_root(backend: nb.NcclBackend, lib: FakeLib) -> None:
    inp = torch.ones(4, dtype=torch.float16)
    backend.gather(None, inp, 0)
    assert [n for n, _ in lib.issued()] == ["ncclGroupStart", "ncclSend", "ncclGroupEnd"]
    assert lib.issued()[1][1][:4] == (inp.data_ptr(), 8, mapping.BYTES, 0)
    lib.calls.clear()
    out, pieces = torch.zeros(4, dtype=torch.float16), torch.arange(12, dtype=torch.float16)
    backend.scatter(out, pieces, 1)  # this rank is the root
    sends = [args for name, args in lib.issued() if name == "ncclSend"]
    assert [(a[0] - pieces.data_ptr(), a[1], a[3]) for a in sends] == [(0, 8, 0), (16, 8, 2)]
    assert torch.equal(out, pieces[4:8])


def test_empty_tensors_complete_without_nccl(backend: nb.NcclBackend, lib: FakeLib) -> None:
    assert backend.all_reduce(torch.zeros(0), spmd.ReduceOp.SUM).is_completed()
    assert backend.broadcast(torch.zeros(0), 0).is_completed()
    assert backend.isend(torch.zeros(0), 0).is_completed()
    assert lib.issued() == []


def test_unsupported_pairs_fail_before_nccl(backend: nb.NcclBackend, lib: FakeLib) -> None:
    with pytest.raises(mapping.UnsupportedReduction, match="int16"):
        backend.all_reduce(torch.zeros(3, dtype=torch.int16), spmd.ReduceOp.SUM)
    assert lib.issued() == []


def test_waiting_for_a_batch_issues_it(cuda: FakeCuda, lib: FakeLib, comms: list) -> None:
    """spmd's wait_all waits through callbacks: registering one issues the queued ops at once."""
    comm = make(comms, lib)
    works = [post(comm, False, 4), post(comm, True, 4)]
    batch = WorkList(list(works))
    assert all(w.native.cuda_event is not None for w in works)
    assert [name for name, _ in lib.issued()] == ["ncclGroupStart", "ncclRecv", "ncclSend", "ncclGroupEnd"]
    for w in works:
        w.native.cuda_event.done = True
    batch.wait(timeout=5)
