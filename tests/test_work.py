"""Work: constructors, timed waits, errors and futures."""

import concurrent.futures
import threading
import time

import pytest
import torch

import spmd


def test_completed_work():
    work = spmd.Work.completed(7)
    assert work.is_completed() and work.wait() and work.result() == 7
    assert work.exception() is None
    assert work.get_future().wait() == 7


def test_from_concurrent_future_carries_value_and_error():
    ok: concurrent.futures.Future = concurrent.futures.Future()
    work = spmd.Work.from_future(ok)
    assert not work.is_completed()
    ok.set_result("x")
    assert work.wait(1) and work.result() == "x"

    bad: concurrent.futures.Future = concurrent.futures.Future()
    failing = spmd.Work.from_future(bad)
    bad.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        failing.wait(1)
    assert isinstance(failing.exception(), ValueError)


def test_from_torch_future():
    fut = torch.futures.Future()
    work = spmd.Work.from_future(fut)
    threading.Timer(0.05, lambda: fut.set_result(3)).start()
    assert work.wait(5) and work.result() == 3


def test_wait_honours_timeout_and_names_the_op():
    work = spmd.Work.from_future(concurrent.futures.Future())
    work.description = "all_reduce on group 'world' (seq 4)"
    with pytest.raises(spmd.CollectiveTimeoutError, match=r"all_reduce on group 'world' \(seq 4\) did not complete within 0.1 s"):
        work.wait(0.1)


def test_default_timeout_applies_when_none_given():
    work = spmd.Work.from_future(concurrent.futures.Future())
    work.default_timeout = 0.05
    with pytest.raises(spmd.CollectiveTimeoutError):
        work.wait()


def test_get_future_and_callbacks_fire_once_done():
    src: concurrent.futures.Future = concurrent.futures.Future()
    work = spmd.Work.from_future(src)
    seen = []
    work.add_done_callback(lambda w: seen.append(w.result()))
    fut = work.get_future()
    src.set_result(5)
    assert fut.wait() == 5 and seen == [5]


def test_a_callback_that_raises_does_not_stop_the_others_or_the_completing_thread(caplog):
    work = spmd.Work()
    ran: list[str] = []

    def bad(_: spmd.Work) -> None:
        raise RuntimeError("a bug in a user's callback")

    work.add_done_callback(bad)
    future = work.get_future()
    work.add_done_callback(lambda w: ran.append("second"))
    finisher = threading.Thread(target=work._finish, args=(5, None))  # as a backend's progress thread does
    finisher.start()
    finisher.join(5)
    assert not finisher.is_alive() and ran == ["second"]
    assert future.wait() == 5
    assert "a bug in a user's callback" in caplog.text


def test_a_work_list_waits_no_longer_than_its_parts_deadlines():
    parts = [spmd.Work(), spmd.Work()]  # never finish
    parts[0].default_timeout, parts[1].default_timeout = 0.2, 0.4
    for part in parts:
        part.description = "all_reduce on group 'g'"
    batch = spmd.comm.work.WorkList(parts)
    start = time.monotonic()
    with pytest.raises(spmd.CollectiveTimeoutError, match="all_reduce on group 'g'"):
        batch.wait()
    assert 0.3 < time.monotonic() - start < 5


def test_then_runs_after_once_on_success_and_not_on_failure():
    ok: concurrent.futures.Future = concurrent.futures.Future()
    ran: list[str] = []
    chained = spmd.Work.from_future(ok).then(lambda: ran.append("after"))
    fired = threading.Event()
    chained.add_done_callback(lambda work: fired.set())
    assert not chained.is_completed()
    ok.set_result(None)  # completes in this thread: the callback path runs ``after``
    assert fired.wait(1) and chained.wait(1) and ran == ["after"]
    assert chained.wait(1) and ran == ["after"]  # once

    bad: concurrent.futures.Future = concurrent.futures.Future()
    skipped: list[str] = []
    failing = spmd.Work.from_future(bad).then(lambda: skipped.append("after"))
    threading.Timer(0.05, bad.set_exception, args=(ValueError("boom"),)).start()
    with pytest.raises(ValueError, match="boom"):
        failing.wait(2)  # the waiting path: waits on the inner Work natively
    assert skipped == []


def test_then_step_that_raises_fails_the_work():
    def broken() -> None:
        raise RuntimeError("decompress failed")

    chained = spmd.Work.completed().then(broken)
    with pytest.raises(RuntimeError, match="decompress failed"):
        chained.wait(1)


class FakeNative:
    """A backend handle that implements only the public NativeWork protocol."""

    def __init__(self):
        self.done = threading.Event()
        self.failure = None
        self.aborted = False

    def finish(self, failure=None):
        self.failure = failure
        self.done.set()

    def poll(self):
        return self.done.is_set()

    def wait(self, timeout):
        return self.done.wait(timeout)

    def abort(self):
        self.aborted = True

    def error(self):
        return self.failure


def test_from_native_waits_polls_and_carries_errors():
    native = FakeNative()
    work = spmd.Work.from_native(native)
    assert not work.is_completed()
    with pytest.raises(spmd.CollectiveTimeoutError, match="did not complete within 0.1 s"):
        work.wait(0.1)
    native.finish()
    assert work.is_completed() and work.wait(1) and work.exception() is None

    failing_native = FakeNative()
    failing = spmd.Work.from_native(failing_native)
    failing_native.finish(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        failing.wait(1)

    timed_out = FakeNative()
    late = spmd.Work.from_native(timed_out)
    late.default_timeout = 3.0
    timed_out.finish(TimeoutError("the backend's own clock ran out"))
    with pytest.raises(spmd.CollectiveTimeoutError, match=r"within 3.0 s \(the backend's own clock ran out\)"):
        late.wait()


def test_from_native_callbacks_and_futures_without_a_native_callback():
    """The kernel waits in a helper thread for a native handle that cannot call back."""
    native = FakeNative()
    work = spmd.Work.from_native(native)
    seen = []
    work.add_done_callback(lambda w: seen.append(w.exception()))
    future = work.get_future()
    native.finish(RuntimeError("lost a peer"))
    with pytest.raises(RuntimeError, match="lost a peer"):
        future.wait()
    assert len(seen) == 1 and "lost a peer" in str(seen[0])


def test_from_native_uses_the_native_callback_when_there_is_one():
    class WithCallback(FakeNative):
        def add_done_callback(self, fn):
            self.fn = fn

    native = WithCallback()
    work = spmd.Work.from_native(native)
    seen = []
    work.add_done_callback(lambda w: seen.append("done"))
    assert not seen
    native.finish()
    native.fn()
    assert seen == ["done"] and work.is_completed()


def test_a_native_work_is_aborted_at_its_own_deadline_not_at_a_shorter_wait():
    """``wait(timeout)`` only ends that wait (the op keeps running); its own deadline gives it up (``abort``)."""
    native = FakeNative()
    work = spmd.Work.from_native(native)
    work.default_timeout = 0.3
    with pytest.raises(spmd.CollectiveTimeoutError, match="within 0.1 s"):
        work.wait(0.1)
    assert not native.aborted
    with pytest.raises(spmd.CollectiveTimeoutError, match="within 0.3 s"):
        work.wait()
    assert native.aborted


def test_an_expired_native_work_is_aborted_and_fails_with_the_kernels_error():
    native = FakeNative()
    work = spmd.Work.from_native(native)
    work._expire(spmd.CollectiveTimeoutError("all_reduce ... did not complete within 1.0 s"))
    assert native.aborted
    with pytest.raises(spmd.CollectiveTimeoutError, match="within 1.0 s"):
        work.wait(0)
    native.finish()  # the late result is ignored
    assert isinstance(work.exception(), spmd.CollectiveTimeoutError)


def test_a_device_backends_wait_orders_the_stream_and_completes_later():
    """``wait_stream()``: wait() without a timeout returns at once (the device waits, the CPU does
    not); the Work completes when the backend reports; with a timeout, or when the backend says
    False (a barrier), the CPU waits as usual."""
    class OnDevice(FakeNative):
        ordered = 0
        on_cpu = False

        def wait_stream(self):
            self.ordered += 1
            return not self.on_cpu

        def add_done_callback(self, fn):
            self.fn = fn

    native = OnDevice()
    work = spmd.Work.from_native(native)
    assert work.wait() is True and native.ordered == 1 and not work.is_completed()
    native.finish()
    native.fn()
    assert work.is_completed() and work.exception() is None

    failed = OnDevice()
    later = spmd.Work.from_native(failed)
    failed.finish(TimeoutError("the backend aborted it"))
    with pytest.raises(spmd.CollectiveTimeoutError, match="the backend aborted it"):
        later.wait()  # already failed when it was ordered: the error is raised now

    blocking = OnDevice()
    blocking.on_cpu = True
    barrier = spmd.Work.from_native(blocking)
    with pytest.raises(spmd.CollectiveTimeoutError, match="within 0.1 s"):
        barrier.wait(0.1)  # an explicit timeout always waits on the CPU
    assert blocking.ordered == 0
    barrier.default_timeout = 0.1
    with pytest.raises(spmd.CollectiveTimeoutError, match="within 0.1 s"):
        barrier.wait()  # the backend declined to order the stream: the CPU waits, with the deadline
    assert blocking.ordered == 1


def test_from_native_names_the_missing_method():
    class Partial:
        def poll(self):
            return True

    with pytest.raises(TypeError, match="Partial is not a spmd NativeWork: it has no wait"):
        spmd.Work.from_native(Partial())


def test_an_async_collectives_future_holds_its_output_as_torchs_does():
    """``fut.value()[0]`` (torch's comm-hook idiom) works on spmd's own async collectives too."""
    spmd.init("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        t, out = torch.ones(3), torch.empty(3)
        assert spmd.all_reduce(t, async_op=True).get_future().wait()[0] is t
        assert spmd.broadcast(t, 0, async_op=True).result()[0] is t
        assert spmd.all_gather_into_tensor(out, t, async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait().tolist() == [2.0] * 3
        strided = torch.ones(3, 2)[:, 0]  # staged: the value is the caller's tensor, after the write-back
        assert spmd.all_reduce(strided, async_op=True).get_future().wait()[0] is strided
    finally:
        spmd.destroy_process_group()
