"""Module-level functions that tests run on every rank of a World (they are pickled by reference)."""

from __future__ import annotations

import time

import torch

import spmd
from spmd.polling import poll


def expect_error(fn_name: str) -> str:
    """Run one bad call on every rank, on a fresh group; return the error, then what the group's next op gave.

    A collective that raised leaves its group unusable (its peers may be inside
    it), so each case gets its own group and the pooled world stays usable.
    """
    group = spmd.new_group([0, 1])
    try:
        CALLS[fn_name](group)
    except Exception as error:  # noqa: BLE001 - the error is the result
        raised = f"{type(error).__name__}: {error}"
    else:
        return "no error"
    try:
        spmd.all_reduce(torch.ones(1), group=group, timeout=5.0)
    except spmd.SpmdError as error:
        return f"{raised}\nthen {type(error).__name__}: {str(error).splitlines()[0]}"
    return f"{raised}\nthen the group still works"


CALLS = {
    "bad_dst": lambda g: spmd.reduce(torch.ones(2), dst=5, group=g),
    "bad_group_src": lambda g: spmd.broadcast(torch.ones(2), group_src=-1, group=g),
    "wrong_output_size": lambda g: spmd.all_gather_into_tensor(torch.empty(3), torch.ones(2), group=g),
    "wrong_rs_input": lambda g: spmd.reduce_scatter_tensor(torch.empty(2), torch.ones(5), group=g),
    "mixed_dtypes": lambda g: spmd.all_gather_into_tensor(torch.empty(4, dtype=torch.int32), torch.ones(2), group=g),
    "bitwise_on_float": lambda g: spmd.all_reduce(torch.ones(2), op=spmd.ReduceOp.BAND, group=g),
    "avg_on_int": lambda g: spmd.all_reduce(torch.ones(2, dtype=torch.int64), op=spmd.ReduceOp.AVG, group=g),
    "bad_splits": lambda g: spmd.all_to_all_single(torch.empty(4), torch.ones(4), input_split_sizes=[1, 1], group=g),
    "send_to_self": lambda g: spmd.send(torch.ones(1), dst=spmd.get_rank(), group=g),
    "list_length": lambda g: spmd.all_gather([torch.empty(2)], torch.ones(2), group=g),
    "not_a_tensor": lambda g: spmd.all_reduce([1.0, 2.0], group=g),  # type: ignore[arg-type]
    "unpicklable": lambda g: spmd.all_gather_object([None, None], lambda: None, group=g),
}


def one_rank_raises(timeout: float) -> list[str]:
    """Rank 0's all_gather fails its own size check while rank 1's is valid; both then all_reduce.

    Returns what each call gave this rank: a value, or the error's type and
    first line. Rank 1's all_gather must not complete with rank 0's later
    all_reduce (on MPI it did, giving both ranks wrong numbers).
    """
    group = spmd.new_group([0, 1], timeout=timeout)
    rank = spmd.get_rank()
    spmd.barrier(group=group)  # the backend exists on both ranks
    outcomes = []
    calls = [
        lambda: spmd.all_gather_into_tensor(torch.empty(3 if rank == 0 else 4), torch.full((2,), float(rank)), group=group),
        lambda: spmd.all_reduce(torch.full((4,), float(rank + 1)), group=group),
        lambda: spmd.all_reduce(torch.full((4,), float(rank + 1)), group=group),
    ]
    for call in calls:
        start = time.monotonic()
        try:
            call()
            outcomes.append("returned")
        except (spmd.SpmdError, ValueError) as error:
            outcomes.append(f"{type(error).__name__} after {time.monotonic() - start:.1f} s: {str(error).splitlines()[0]}")
    return outcomes


def peer_gives_up_while_inside(timeout: float) -> str:
    """Rank 1 is inside an all_reduce (a call shape its group already agreed on, so in the backend)
    when rank 0's own call raises and gives the group up: rank 1's wait must end then, not at its timeout."""
    group = spmd.new_group([0, 1], timeout=timeout)
    t = torch.ones(4)
    spmd.all_reduce(t, group=group)  # the backend exists and the call shape is agreed
    if spmd.get_rank() == 0:
        from spmd.comm.health import watchdog

        dog = watchdog.current()
        assert dog is not None

        def peer_inside() -> bool:  # rank 1's watchdog published that it started the group's second call
            row = (dog.read_progress([1])[1] or {}).get("progress", {}).get(group.name)
            return row is not None and row[0] >= 1

        assert poll(peer_inside, 30, 0.02), "rank 1 never published its second all_reduce"
        try:
            spmd.all_gather_into_tensor(torch.empty(3), torch.ones(2), group=group)
        except ValueError as error:
            return f"ValueError: {error}"
        return "no error"
    start = time.monotonic()
    try:
        spmd.all_reduce(t, group=group)
    except spmd.SpmdError as error:
        return f"{type(error).__name__} after {time.monotonic() - start:.1f} s: {str(error).splitlines()[0]}"
    return "returned"


def skip_a_collective(timeout: float) -> str:
    """Rank 0 calls all_reduce on a short-timeout group that rank 1 never joins in."""
    group = spmd.new_group([0, 1], timeout=timeout)
    spmd.all_reduce(torch.ones(1), group=group)  # both ranks connect
    if spmd.get_rank() != 0:
        return "skipped"  # rank 1 skips the next call
    start = time.monotonic()
    try:
        spmd.all_reduce(torch.ones(4), group=group)
    except spmd.CollectiveTimeoutError as error:
        return f"{time.monotonic() - start:.2f}|{error}"
    return "no error"


def unwaited_async_op(group_timeout: float, op_timeout: float | None) -> str:
    """Rank 0 starts an async all_reduce that nobody waits on; rank 1 never joins it.

    Returns ``"elapsed|callback elapsed|error"`` on rank 0: how long until the
    Work's future failed, until its callback ran, and the future's error.
    Rank 1 stays alive (its watchdog publishes progress) until rank 0 is done.
    """
    from spmd.comm.state import get_state

    store = get_state().store
    group = spmd.new_group([0, 1], timeout=group_timeout)
    spmd.all_reduce(torch.ones(1), group=group)  # both ranks connect
    if spmd.get_rank() != 0:
        store.wait(["unwaited/rank0_done"])
        return "skipped"
    try:
        start = time.monotonic()
        work = spmd.all_reduce(torch.ones(4), group=group, async_op=True, timeout=op_timeout)
        called: list[float] = []
        work.add_done_callback(lambda w: called.append(time.monotonic() - start))
        future = work.get_future()
        poll(future.done, 60, 0.02)
        elapsed = time.monotonic() - start
        try:
            future.wait()
            return "no error"
        except Exception as error:  # noqa: BLE001 - the error is the result
            return f"{elapsed:.2f}|{called[0] if called else -1:.2f}|{type(error).__name__}: {error}"
    finally:
        store.set("unwaited/rank0_done", "1")


def sync_op_timeout(group_timeout: float, op_timeout: float) -> str:
    """Rank 0's all_reduce(timeout=op_timeout) on a group with a longer timeout, rank 1 not joining."""
    from spmd.comm.state import get_state

    store = get_state().store
    group = spmd.new_group([0, 1], timeout=group_timeout)
    spmd.all_reduce(torch.ones(1), group=group)
    if spmd.get_rank() != 0:
        store.wait(["sync_op_timeout/rank0_done"])
        return "skipped"
    start = time.monotonic()
    try:
        spmd.all_reduce(torch.ones(4), group=group, timeout=op_timeout)
        return "no error"
    except spmd.CollectiveTimeoutError as error:
        return f"{time.monotonic() - start:.2f}|{error}"
    finally:
        store.set("sync_op_timeout/rank0_done", "1")


def never_meet(timeout: float) -> tuple[str, str]:
    """Rank 0 alone uses a fresh group: its backend cannot even be created.

    Returns rank 0's error and what reached its stderr (file descriptor 2,
    where C++ writes) during the call and half a second after.
    """
    import os
    import tempfile

    group = spmd.new_group([0, 1], timeout=timeout)
    if spmd.get_rank() != 0:
        return "skipped", ""
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            try:
                spmd.all_reduce(torch.ones(4), group=group)
                message = "no error"
            except spmd.CollectiveTimeoutError as error:
                message = str(error)
            time.sleep(0.5)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return message, captured.read().decode(errors="replace")


def after_a_timeout(timeout: float) -> list[str]:
    """Rank 1 arrives late to an all_reduce that rank 0 gave up on; both ranks then carry on.

    Returns what each of the three calls gave this rank: a value, or the error's type and
    first line. A value must be the right one; the late pairing must end in named errors.
    """
    group = spmd.new_group([0, 1], timeout=timeout)
    rank = spmd.get_rank()
    outcomes = []
    if rank == 1:
        spmd.barrier(group=group)  # the backend exists on both ranks before rank 0's timed op
        time.sleep(timeout + 2.0)  # rank 0 gives up meanwhile, and says so through the store
    else:
        spmd.barrier(group=group)
    for step in range(3):
        if rank == 1 and step == 0:
            continue  # rank 1 never made rank 0's first call
        t = torch.full((4,), float(rank + 1 + 10 * step))
        try:
            spmd.all_reduce(t, group=group)
            outcomes.append(f"value {t.tolist()}")
        except spmd.SpmdError as error:
            outcomes.append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
    return outcomes


def use_after_destroy() -> str:
    group = spmd.new_group([0, 1])
    spmd.all_reduce(torch.ones(2), group=group)
    spmd.destroy_process_group(group)
    try:
        spmd.all_reduce(torch.ones(2), group=group)
    except spmd.SpmdError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def aliased_buffers() -> dict[str, bool]:
    """Inputs laid over their outputs: each result against what the ranks' inputs say it must be."""
    rank, world = spmd.get_rank(), spmd.get_world_size()
    inputs = [torch.arange(4.0) + 10 * r for r in range(world)]  # every rank knows every rank's input
    out: dict[str, bool] = {}
    t = inputs[rank].clone()
    spmd.all_to_all_single(t, t)  # the same tensor in and out
    out["all_to_all_same_tensor"] = torch.equal(t, torch.cat([x.chunk(world)[rank] for x in inputs]))
    buf = torch.zeros(6)
    buf[:4] = inputs[rank]
    spmd.all_to_all_single(buf[2:6], buf[:4])  # the output shifted two elements over the input
    out["all_to_all_shifted"] = torch.equal(buf[2:6], torch.cat([x.chunk(world)[rank] for x in inputs]))
    gathered = torch.zeros(4 * world)
    mine = gathered[4 * rank : 4 * rank + 4]
    mine.copy_(inputs[rank])
    spmd.all_gather_into_tensor(gathered, mine)  # torch's documented in-place form
    out["all_gather_in_place"] = torch.equal(gathered, torch.cat(inputs))
    big = torch.cat(inputs) + rank  # reduce_scatter with the output inside its input
    expected = sum(torch.cat(inputs) + r for r in range(world)).chunk(world)[rank]
    spmd.reduce_scatter_tensor(big[:4], big)
    out["reduce_scatter_in_place"] = torch.equal(big[:4], expected)
    return out


def all_to_all_splits_disagree() -> str:
    """Desync mode on: rank 0 expects 1 row from rank 1, which sends 2."""
    from spmd.comm.health import desync

    rank = spmd.get_rank()
    in_splits, out_splits = ([1, 1], [1, 1]) if rank == 0 else ([2, 0], [1, 1])
    desync.on = True
    try:
        spmd.all_to_all_single(torch.zeros(2), torch.ones(2), out_splits, in_splits)
        return "no error"
    except spmd.SpmdError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        desync.on = False


def mismatched_counts(timeout: float) -> list[str]:
    """all_reduce of 4 elements on rank 0 and 1000 on rank 1, then one more all_reduce after a pause.

    Returns each call's outcome on this rank: a value's length, or the error's type and text.
    """
    group = spmd.new_group([0, 1], timeout=timeout)
    spmd.barrier(group=group)
    outcomes = []
    for n in ((4, 1000)[spmd.get_rank()], 4):
        try:
            t = torch.ones(n)
            spmd.all_reduce(t, group=group)
            outcomes.append(f"value of {t.numel()}")
        except spmd.SpmdError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
        time.sleep(timeout + 2.0)  # the peer's timeout, its announcement, and one watchdog step
    return outcomes


def silently_mismatched(kind: str, limit: float = 12.0) -> dict[str, object]:
    """One all_reduce the ranks disagree on (``kind``: reduce_op, dtype, count or width; or, ``splits``, an
    all_to_all_single whose split sizes disagree) that the backend
    completes without an error, then the same correct all_reduce every 50 ms until one raises or
    ``limit`` seconds pass. Returns the mismatched op's outcome, every later outcome and the time
    from the mismatched op to the first error."""
    group = spmd.new_group([0, 1], timeout=5.0)
    spmd.barrier(group=group)
    rank = spmd.get_rank()
    if kind == "reduce_op":
        t, op = torch.ones(4), (spmd.ReduceOp.SUM, spmd.ReduceOp.MAX)[rank]
    elif kind == "dtype":
        t, op = (torch.ones(4), torch.ones(4, dtype=torch.int32))[rank], spmd.ReduceOp.SUM
    elif kind == "count":
        t, op = torch.ones((4, 1000)[rank]), spmd.ReduceOp.SUM
    elif kind == "width":  # float32 against float64: the same count, buffers of different sizes
        t, op = torch.ones(4, dtype=(torch.float32, torch.float64)[rank]), spmd.ReduceOp.SUM
    start = time.monotonic()
    try:
        if kind in ("gather", "rows"):
            first = f"value {_mismatched_shapes(kind, rank, group)}"
        elif kind == "splits":  # rank 0 sends rank 1 one row, rank 1 expects two: nothing overflows
            sends = ([2, 1], [2, 2])[rank]
            out = torch.zeros(4)
            spmd.all_to_all_single(out, torch.ones(sum(sends)), [2, 2], sends, group=group)
            first = f"value {out.tolist()}"
        else:
            spmd.all_reduce(t, op=op, group=group)
            first = f"value {t[:4].tolist()}"
    except spmd.SpmdError as error:
        first = f"{type(error).__name__}: {error}"
    later: list[str] = []
    error_after = None
    while time.monotonic() - start < limit:
        time.sleep(0.05)
        try:
            spmd.all_reduce(torch.ones(4), group=group)
            later.append("ok")
        except spmd.SpmdError as error:
            later.append(f"{type(error).__name__}: {error}")
            error_after = time.monotonic() - start
            break
    return {"first": first, "later": later, "error_after": error_after}


def stale_and_fresh_announcements() -> dict[str, object]:
    """An announcement left in the store by an earlier world is ignored; a fresh one is adopted."""
    from spmd.comm.health import watchdog

    dog = watchdog.current()
    assert dog is not None
    old, new = spmd.new_group([0, 1]), spmd.new_group([0, 1])
    spmd.barrier()
    if spmd.get_rank() == 0:
        with dog.lock:
            # numbered as an announcement made before this world's watchdogs started, and one made now
            dog.client.set(watchdog.UNUSABLE_KEY.format(group=old.name), f"{dog.world_from}|rank 1 gave up on it: long ago")
            number = dog.client.add(watchdog.CLOCK, 1)
            dog.client.set(watchdog.UNUSABLE_KEY.format(group=new.name), f"{number}|rank 1 gave up on it: now")
            dog.client.add(watchdog.UNUSABLE_COUNT, 1)
    poll(lambda: new.unusable is not None, 10, 0.05)
    t = torch.ones(2)
    spmd.all_reduce(t, group=old)
    return {"old": old.unusable, "old_sum": t.tolist(), "new": new.unusable}



def _mismatched_shapes(kind: str, rank: int, group: spmd.ProcessGroup) -> list[float]:
    """A gather whose ranks send 4 and 6 elements, or (``rows``) an all_to_all_single of even splits
    whose rows are 2 wide on rank 0 and 4 wide on rank 1: both once gave wrong data with no error."""
    if kind == "gather":
        n = (4, 6)[rank]
        got = [torch.zeros(n) for _ in range(2)] if rank == 0 else None
        spmd.gather(torch.full((n,), float(rank + 1)), got, dst=0, group=group)
        return torch.cat(got).tolist() if got is not None else []
    width = (2, 4)[rank]
    out = torch.zeros(2, width)
    spmd.all_to_all_single(out, torch.full((2, width), float(rank + 1)), group=group)
    return out.flatten().tolist()


def size_mismatch_on_gloo(kind: str, timeout: float) -> dict[str, object]:
    """Calls whose buffers differ in size across the ranks, on Gloo (which aborts the process if it ever
    pairs them). ``kind``: count (4 against 1000 elements), dtype (float32 against float64), splits
    (all_to_all_single rows that disagree), or known (rank 0 repeats a shape the group already agreed
    on while rank 1 calls a new one). Returns the outcome of the mismatched call, the time it took,
    and the outcome of one correct all_reduce after it."""
    group = spmd.new_group([0, 1], timeout=timeout)
    spmd.barrier(group=group)
    rank = spmd.get_rank()

    def outcome(call) -> str:  # type: ignore[no-untyped-def]
        try:
            call()
            return "ok"
        except spmd.SpmdError as error:
            return f"{type(error).__name__}: {error}"

    if kind == "known":
        spmd.all_reduce(torch.ones(4), group=group)  # both agree on (4,) float32 SUM
    start = time.monotonic()
    if kind == "count":
        first = outcome(lambda: spmd.all_reduce(torch.ones((4, 1000)[rank]), group=group))
    elif kind == "dtype":
        first = outcome(lambda: spmd.all_reduce(torch.ones(4, dtype=(torch.float32, torch.float64)[rank]), group=group))
    elif kind == "splits":
        sends = ([2, 1], [2, 3])[rank]  # rank 0 sends rank 1 one row, rank 1 expects two
        first = outcome(lambda: spmd.all_to_all_single(torch.zeros(5), torch.ones(sum(sends)), [2, 3], sends, group=group))
    elif kind in ("gather", "rows"):
        first = outcome(lambda: _mismatched_shapes(kind, rank, group))
    else:
        first = outcome(lambda: spmd.all_reduce(torch.ones((4, 1000)[rank]), group=group))
    took = time.monotonic() - start
    after = outcome(lambda: spmd.all_reduce(torch.ones(4), group=group))
    return {"first": first, "took": took, "after": after}


def uneven_all_to_all_with_changing_local_rows(steps: int = 3) -> list[list[float]]:
    """all_to_all_single where rank 1 keeps a different number of its own rows each step while rank 0's
    splits never change: legitimate (what crosses between the ranks agrees), so it must just work."""
    group = spmd.new_group([0, 1], timeout=5.0)
    rank = spmd.get_rank()
    results = []
    for step in range(steps):
        splits = ([2, 1], [1, step + 1])[rank]  # (to rank 0, to rank 1); the same counts come back
        source = torch.arange(sum(splits), dtype=torch.float32) + 100 * rank
        out = torch.zeros(sum(splits))
        spmd.all_to_all_single(out, source, splits, splits, group=group)
        results.append(out.tolist())
    return results


def cross_rank_checks_per_all_to_all(split_sizes: bool) -> int:
    """How many of 5 more all_to_all_single calls of one shape the Gloo shape check compared across ranks.

    With even splits (none given) a shape is compared once, then known;
    explicit split sizes are compared at every call.
    """
    from spmd.comm.health import desync

    group = spmd.new_group([0, 1])
    rows = [2, 2] if split_sizes else None
    out, inp = torch.empty(4), torch.ones(4)
    spmd.all_to_all_single(out, inp, rows, rows, group=group)
    checked = []
    original = desync.check
    desync.check = lambda *args, **kwargs: (checked.append(1), original(*args, **kwargs))[1]
    try:
        for _ in range(5):
            spmd.all_to_all_single(out, inp, rows, rows, group=group)
    finally:
        desync.check = original
    assert out.tolist() == [1.0] * 4
    spmd.destroy_process_group(group)
    return len(checked)


def p2p_timeout_diagnosis(timeout: float) -> str:
    """Rank 0's recv from rank 1 times out after three all_reduces both made; rank 1, alive, never sends.
    Returns rank 0's error (its diagnosis names the peer, not the ranks' collective progress)."""
    from spmd.comm.state import get_state

    store = get_state().store
    group = spmd.new_group([0, 1], timeout=timeout)
    for _ in range(3):
        spmd.all_reduce(torch.ones(1), group=group)
    if spmd.get_rank() == 0:
        try:
            spmd.recv(torch.zeros(1), src=1, group=group)
            outcome = "no error"
        except spmd.CollectiveTimeoutError as error:
            outcome = str(error)
        store.set("p2p_diag_test/rank0_done", "1")
        return outcome
    store.wait(["p2p_diag_test/rank0_done"])
    return "stayed away"
