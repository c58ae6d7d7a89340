"""The agents' rendezvous rounds, in one process over a real store."""

from __future__ import annotations

import threading
import time

import torch.distributed as tdist

from spmd.launch.rendezvous import Rendezvous


def test_agents_restarting_together_move_the_job_one_round():
    """Every agent of a failed round calls advance_from(round) at about the same time: the job must
    go to round + 1, not further (a skipped round left agents waiting in different rounds)."""
    for trial in range(200):
        store = tdist.HashStore()
        rdzv = Rendezvous(store, f"job{trial}", 2, 2, timeout=5, last_call=0)
        rdzv.store.add("round", 5)
        start = threading.Barrier(3)
        seen: list[int] = []

        def agent(rdzv: Rendezvous = rdzv, start: threading.Barrier = start, seen: list[int] = seen) -> None:
            start.wait()
            seen.append(rdzv.advance_from(5))

        threads = [threading.Thread(target=agent) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert rdzv.current_round() == 6 and seen == [6, 6, 6], (trial, rdzv.current_round(), seen)


def test_a_late_agent_does_not_move_the_job_back():
    rdzv = Rendezvous(tdist.HashStore(), "job", 1, 1, timeout=5, last_call=0)
    rdzv.store.add("round", 7)
    assert rdzv.advance_from(5) == 7 and rdzv.current_round() == 7


def _join_in_thread(rdzv: Rendezvous, node_rank: int | None, host: str) -> tuple[threading.Thread, list]:
    result: list = []

    def body() -> None:
        try:
            result.append(rdzv.join(1, node_rank, host))
        except BaseException as error:  # noqa: BLE001 - the test reads it
            result.append(error)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, result


def test_a_surplus_agent_waits_without_disturbing_a_full_round_and_takes_a_later_one():
    """A third agent of a --nnodes 2 job does not ask the running two for a new round (every ask restarted
    the job, and the newcomer then shut an original node out, again and again); it waits, as torchrun's
    redundancy list, and takes part in a round that forms later (here after a failure)."""
    store = tdist.HashStore()
    a, b, c = (Rendezvous(store, "full", 2, 2, timeout=30, last_call=0, poll=0.01) for _ in range(3))
    first = [_join_in_thread(r, None, host) for r, host in ((a, "a"), (b, "b"))]
    for thread, _ in first:
        thread.join(30)
    assert sorted(m.node_rank for _, (m,) in first) == [0, 1]
    surplus, late = _join_in_thread(c, None, "c")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert not a.flag(0, "join"), "the surplus agent asked the full round to restart"
        time.sleep(0.01)
    assert surplus.is_alive() and not late
    a.advance_from(0)  # a failure: the job moves to round 1, which the surplus agent may join
    rejoin, back = _join_in_thread(a, None, "a")
    for thread in (rejoin, surplus):
        thread.join(30)
    assert [m.round for m in back + late] == [1, 1], (back, late)
    assert sorted(m.node_rank for m in back + late) == [0, 1]
    assert {frozenset(m.hosts) for m in back + late} == {frozenset({"a", "c"})}
