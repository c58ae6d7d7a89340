"""Gloo point-to-point Works under spmd's contract: done once done, and a short wait is only a short wait.

c10d's Gloo send/recv Work says it is completed only after someone waited on it, and a timed wait
that expires makes Gloo close every connection of the group. spmd-gloo hides both.
"""

from __future__ import annotations

import time

import torch

import spmd
from spmd.polling import poll


def isend_completes_without_a_wait() -> float | None:
    """Rank 0 polls is_completed() of an isend that rank 1 received at once; the seconds it took (None: never, in 5 s)."""
    group = spmd.new_group([0, 1], timeout=6.0)
    if spmd.get_rank() == 0:
        work = spmd.isend(torch.ones(4), dst=1, group=group)
        start = time.monotonic()
        if not poll(work.is_completed, 5, 0.01):
            return None
        took = time.monotonic() - start
        work.wait()
    else:
        spmd.recv(torch.zeros(4), src=0, group=group)
        took = 0.0
    time.sleep(7)  # past the group timeout: the watchdog must not fail the finished isend
    spmd.barrier(group=group)
    return took


def a_short_wait_then_a_full_one() -> str:
    """Rank 1's wait(timeout=0.3) on an irecv runs out; rank 0 sends a second later; the next wait gets it."""
    group = spmd.new_group([0, 1], timeout=10.0)
    spmd.barrier(group=group)
    if spmd.get_rank() == 0:
        time.sleep(1.0)
        spmd.send(torch.tensor([7.0]), dst=1, group=group)
        outcome = "sent"
    else:
        got = torch.zeros(1)
        work = spmd.irecv(got, src=0, group=group)
        try:
            work.wait(timeout=0.3)
            return "the short wait did not time out"
        except spmd.CollectiveTimeoutError:
            pass
        work.wait()
        outcome = f"got {got.item()}"
    t = torch.ones(1)
    spmd.all_reduce(t, group=group)  # the group is still usable on both ranks
    return f"{outcome}, then all_reduce {t.item()}"


def test_a_finished_isend_is_completed_without_a_wait(spmd_world):
    took = spmd_world(2, "gloo").run(isend_completes_without_a_wait, timeout=60)
    assert took[0] is not None and took[0] < 5, took


def test_a_short_wait_on_a_receive_leaves_the_group_usable(spmd_world):
    assert spmd_world(2, "gloo").run(a_short_wait_then_a_full_one, timeout=60) == ["sent, then all_reduce 2.0", "got 7.0, then all_reduce 2.0"]
