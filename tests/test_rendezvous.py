"""The agents' rendezvous rounds, in one process over a real store."""

from __future__ import annotations

import threading

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
