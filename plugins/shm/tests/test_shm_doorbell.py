"""Doorbells: a publisher wakes a peer that sleeps, and only one that sleeps (spmd_shm.doorbell)."""

from __future__ import annotations

import mmap
import statistics
import threading
import time

import pytest
import torch

import spmd
from spmd_shm import futex
from spmd_shm.doorbell import Doorbells
from spmd_shm.segment import Layout, Segment


def _segment(n: int) -> Segment:
    layout = Layout(n, 4096, 4096, 2)
    return Segment(mmap.mmap(-1, layout.total), layout)


def test_ring_wakes_a_sleeper_at_once_and_leaves_an_awake_rank_alone() -> None:
    seg = _segment(2)
    rank0, rank1 = Doorbells(seg, 2, 0), Doorbells(seg, 2, 1)
    before = rank1.snapshot()
    rank0.ring([1])  # rank 1 does not sleep: its doorbell is not touched (no syscall)
    assert rank1.snapshot() == before

    woke = threading.Event()

    def sleeper() -> None:
        rank1.callers_asleep.value = 1
        bell = rank1.snapshot()
        futex.wait(rank1.my_address, bell, 10.0)  # only a ring ends this before 10 s
        rank1.callers_asleep.value = 0
        woke.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    start = time.monotonic()
    thread.start()
    time.sleep(0.05)  # the sleeper is in the futex by now (a ring before it would end the wait at once anyway)
    rank0.ring([1])
    assert woke.wait(5.0), "the ring did not wake the sleeping rank"
    assert time.monotonic() - start < 2.0
    assert rank1.snapshot() != before


def late_peer_lateness(rounds: int, delay: float) -> tuple[float, bool]:
    """Rank 1 calls all_reduce ``delay`` s after rank 0 (which spins, then sleeps on its doorbell); rank 0's
    median seconds from rank 1's call to its own return, and whether every sum was right."""
    me, right, late = spmd.get_rank(), True, []
    for i in range(rounds):
        spmd.barrier()
        stamp = torch.zeros(1, dtype=torch.float64)
        if me == 1:
            time.sleep(delay)
            stamp[0] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        value = torch.tensor([float(i + me)], dtype=torch.float64)
        both = torch.cat([value, stamp])
        spmd.all_reduce(both)
        done = time.monotonic()
        right &= both[0].item() == 2 * i + 1
        late.append(done - both[1].item())
    return statistics.median(late), right


def test_a_rank_asleep_on_its_doorbell_is_woken_by_the_late_peer(spmd_world) -> None:
    """Rank 0 sleeps (past its spin) on the doorbell; rank 1's publish must wake it, not the 50 ms cap
    on each sleep (which would make rank 0 return about 20 ms after rank 1's call)."""
    lateness, right = spmd_world(2, "shm").run(late_peer_lateness, 9, 0.03)[0]
    assert right
    assert lateness < 0.008, f"rank 0 returned {lateness * 1e3:.1f} ms after its late peer's call"


def spin_after_late_then_in_step(late_rounds: int, delay: float, in_step_rounds: int, runnable: int | None) -> tuple[float, float, bool]:
    """Rank 1 is ``delay`` s late for ``late_rounds`` all_reduces, then both ranks run ``in_step_rounds`` back to
    back: rank 0's spin (seconds) after the late ones and at the end, and whether every sum was right.
    ``runnable``: the host's runnable task count the engine reads (None: the real one)."""
    from spmd.comm.collectives import route
    from spmd_shm import engine as engine_module

    me = spmd.get_rank()
    engine = route(None, torch.ones(1), "tensor", "all_reduce")[1].engine
    real = engine_module.runnable_tasks
    if runnable is not None:
        engine_module.runnable_tasks = lambda: runnable
    right = True
    try:
        for i in range(late_rounds):
            spmd.barrier()
            if me == 1:
                time.sleep(delay)
            t = torch.tensor([float(i + me)])
            spmd.all_reduce(t)
            right &= t.item() == 2 * i + 1
        after_late = engine.spin
        for i in range(in_step_rounds):
            t = torch.tensor([float(i * me)])
            spmd.all_reduce(t)
            right &= t.item() == i
    finally:
        engine_module.runnable_tasks = real
    return after_late, engine.spin, right


def test_on_a_busy_host_the_spin_shrinks_to_its_floor_while_the_peer_is_far_behind(spmd_world) -> None:
    """More tasks runnable than CPUs: a waiter that keeps sleeping long spins less and less (its core is
    left to the others), down to the floor; the sums stay right throughout."""
    from spmd_shm.engine import OVERSUBSCRIBED_SPIN_SECONDS

    busy = 64  # runnable tasks: more than any test host's CPUs
    after_late, _, right = spmd_world(2, "shm").run(spin_after_late_then_in_step, 12, 0.01, 200, busy)[0]
    assert right
    # (at most 100 us) halved 12 times: the floor, even if a short wait in a barrier between the late
    # calls doubled it once or twice
    assert after_late == OVERSUBSCRIBED_SPIN_SECONDS, after_late


def test_the_spin_policy(monkeypatch) -> None:
    """``Engine._adapt_spin`` after a wait that ended asleep: a wait within the bound makes the spin twice
    its length (at most the bound); a longer one halves it on a busy host (down to the floor) and puts it
    back at the bound where a core is idle; with equal bounds (more ranks than CPUs) nothing changes and
    the host is not even asked."""
    from types import SimpleNamespace

    from spmd_shm import engine as engine_module
    from spmd_shm.engine import Engine

    runnable = [1]
    asked = []
    monkeypatch.setattr(engine_module, "runnable_tasks", lambda: asked.append(1) or runnable[0])

    def adapted(spin: float, waited: float, lo: float = 2e-6, hi: float = 100e-6) -> float:
        state = SimpleNamespace(spin=spin, _spin_min=lo, _spin_max=hi, _cpus=2)
        Engine._adapt_spin(state, waited)  # type: ignore[arg-type]
        return state.spin

    assert adapted(2e-6, 10e-6) == 20e-6 and adapted(50e-6, 10e-6) == 50e-6 and adapted(2e-6, 90e-6) == 100e-6
    runnable[0] = 64
    assert adapted(100e-6, 5e-3) == 50e-6 and adapted(3e-6, 5e-3) == 2e-6
    runnable[0] = 2
    assert adapted(2e-6, 5e-3) == 100e-6
    asked.clear()
    assert adapted(2e-6, 5e-3, lo=2e-6, hi=2e-6) == 2e-6 and not asked


def test_with_an_idle_core_a_late_peer_leaves_the_spin_at_its_bound(spmd_world) -> None:
    """As many runnable tasks as CPUs or fewer: spinning takes no one's core, so a late peer does not shrink the
    spin (it once did, and a wait that outlasted the short spin by a slow wake-up kept it short for good)."""
    from spmd_shm.engine import SPIN_SECONDS
    from spmd_shm.peers import usable_cpus

    if usable_cpus() < 2:
        pytest.skip("2 ranks on 1 CPU are oversubscribed: their spin is bounded at almost none")
    after_late, last, right = spmd_world(2, "shm").run(spin_after_late_then_in_step, 8, 0.01, 100, 1)[0]
    assert right
    assert after_late == SPIN_SECONDS and last == SPIN_SECONDS, (after_late, last)


def test_runnable_tasks_is_the_fourth_field_of_proc_loadavg() -> None:
    from spmd_shm.peers import runnable_tasks

    try:
        with open("/proc/loadavg") as f:
            listed = f.read().split()[3]
    except OSError:
        assert runnable_tasks() is None
        return
    running, total = (int(x) for x in listed.split("/"))
    counted = runnable_tasks()
    assert counted is not None and 1 <= counted <= total  # (it changes between the two reads; this process runs)
