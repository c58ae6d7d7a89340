"""one_torch_thread: a transport's own kernels run serially in the thread that progresses it, and the
program's thread count is left as it was (spmd.comm.threads; the spmd-ucc and spmd-shm engines)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import spmd
from spmd.comm.threads import _uses_openmp, one_torch_thread

needs_openmp = pytest.mark.skipif(not _uses_openmp(), reason="torch's intra-op threads are not OpenMP here")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@needs_openmp
def test_inside_one_thread_after_the_count_it_had(two_threads) -> None:
    with one_torch_thread():
        assert torch.get_num_threads() == 1
        with one_torch_thread():  # nested: the inner block leaves the outer one's count
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


@needs_openmp
def test_the_count_comes_back_after_an_error(two_threads) -> None:
    with pytest.raises(ZeroDivisionError), one_torch_thread():
        _ = 1 / 0
    assert torch.get_num_threads() == 2


@needs_openmp
def test_another_threads_count_is_untouched(two_threads) -> None:
    """The program's compute thread keeps its count while a progress thread is inside the block."""
    inside, leave, counts = threading.Event(), threading.Event(), []

    def progress() -> None:
        with one_torch_thread():
            inside.set()
            leave.wait(10)

    torch.ones(1 << 16).add_(1)  # this thread's count is settled (torch reads it at the first parallel op)
    thread = threading.Thread(target=progress)
    thread.start()
    try:
        assert inside.wait(10)
        counts.append(torch.get_num_threads())
    finally:
        leave.set()
        thread.join(10)
    assert counts == [2]


@needs_openmp
def test_a_thread_started_inside_the_block_gets_the_programs_count(two_threads) -> None:
    """Only the calling thread's OpenMP count changes: torch's process-wide default, which a new thread
    reads at its first parallel op, stays the program's."""
    from spmd.comm import threads

    with one_torch_thread():
        pass
    if threads._set is torch.set_num_threads:
        pytest.skip("this process's first OpenMP runtime is not torch's: the block falls back to torch.set_num_threads")
    counts: list[int] = []
    with one_torch_thread():
        thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
        thread.start()
        thread.join(10)
    assert counts == [2]


def test_a_thread_at_one_stays_at_one() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with one_torch_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# -- the engines: their rounds run inside one_torch_thread, in the caller's thread and in their own ----------
def _ucc_rounds() -> list[tuple[bool, int]]:
    """(in the caller's thread?, torch threads) seen by an op that the ucc engine advances: waited, then not waited."""
    from spmd_ucc.engine import Pending

    engine = spmd.comm.state.get_state().world.backend("cpu").engine
    seen: list[tuple[bool, int]] = []

    class Probe(Pending):
        def __init__(self, in_background: bool) -> None:
            self.in_background = in_background

        def advance(self) -> bool:
            mine = threading.current_thread() is threading.main_thread()
            seen.append((mine, torch.get_num_threads()))
            return not (self.in_background and mine)

        def complete(self) -> None:
            pass

    waited = Probe(False)
    engine.register(waited)
    assert engine.wait_until(lambda: waited.settled, time.monotonic() + 10)
    unwaited = Probe(True)
    engine.register(unwaited)
    engine.wants_callback(unwaited)  # nobody waits: the engine's thread progresses it
    deadline = time.monotonic() + 10
    while not unwaited.settled and time.monotonic() < deadline:
        time.sleep(0.001)
    return seen


def _shm_rounds() -> list[tuple[bool, int]]:
    """The same for the shm engine: a step function it runs, waited, then not waited."""
    engine = spmd.comm.state.get_state().world.backend("cpu").engine
    seen: list[tuple[bool, int]] = []

    def steps(in_background: bool):  # type: ignore[no-untyped-def]
        while True:
            mine = threading.current_thread() is threading.main_thread()
            seen.append((mine, torch.get_num_threads()))
            if not (in_background and mine):
                return
            yield

    waited = engine.submit("coll", engine.new_work(), steps(False))
    assert waited.wait(10)
    unwaited = engine.submit("coll", engine.new_work(), steps(True))
    deadline = time.monotonic() + 10
    while not unwaited.done and time.monotonic() < deadline:
        time.sleep(0.001)
    return seen


def thread_counts(backend: str) -> dict:
    """With torch at 2 threads: what the engine's rounds see, and the caller's count and results after real ops."""
    torch.set_num_threads(2)
    n, me = spmd.get_world_size(), spmd.get_rank()
    rounds = _ucc_rounds() if backend == "ucc" else _shm_rounds()
    sync = torch.full((1 << 18,), float(me + 1))  # 1 MiB: above torch's grain size, a parallel add at 2 threads
    spmd.all_reduce(sync)
    later = torch.full((1 << 18,), float(me + 1))
    spmd.all_reduce(later, async_op=True).wait()
    expected = float(sum(range(1, n + 1)))
    return {"rounds": rounds, "caller_after": torch.get_num_threads(),
            "sums": [bool(torch.all(sync == expected)), bool(torch.all(later == expected))]}


def _usable(backend: str) -> str | None:
    from spmd.comm.registry import backends

    entry = next((e for e in backends().entries() if e.spec.name == backend), None)
    return "not installed" if entry is None else entry.spec.unavailable_reason()


@needs_openmp
@pytest.mark.parametrize("backend", ["ucc", "shm"])
def test_engine_rounds_run_on_one_thread_and_leave_the_callers_count(spmd_world, backend: str) -> None:
    reason = _usable(backend)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    for result in spmd_world(2, backend).run(thread_counts, backend, timeout=60):
        rounds = result["rounds"]
        assert {mine for mine, _ in rounds} == {True, False}, f"the caller's thread and the engine's both progressed: {rounds}"
        assert all(count == 1 for _, count in rounds), f"torch threads inside the engine's rounds: {rounds}"
        assert result["caller_after"] == 2
        assert result["sums"] == [True, True]


def generic_thread_counts() -> dict:
    """With torch at 2 threads: what a generic algorithm sees on the kernel's runner thread, and a real one's result."""
    torch.set_num_threads(2)
    backend = spmd.comm.state.get_state().world.backend("cpu")
    seen: list[int] = []
    assert backend._run_generic(lambda channel: seen.append(torch.get_num_threads())).wait(10)
    n, me = spmd.get_world_size(), spmd.get_rank()
    t = torch.full((1 << 18,), float(me + 1))
    spmd.all_reduce(t)  # p2p's all_reduce is the kernel's generic ring: reductions on the runner thread
    return {"seen": seen, "caller_after": torch.get_num_threads(), "sum": bool(torch.all(t == float(sum(range(1, n + 1)))))}


@needs_openmp
def test_generic_algorithms_run_on_one_thread(spmd_world) -> None:
    for result in spmd_world(2, "p2p").run(generic_thread_counts, timeout=60):
        assert result == {"seen": [1], "caller_after": 2, "sum": True}
