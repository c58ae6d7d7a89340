"""How spmd measures: alternate the sides call by call, take medians, report nccl-tests bandwidths.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md`` there): ``algbw = size / time``
and ``busbw = algbw * factor``, with factor ``2(n-1)/n`` for all_reduce,
``(n-1)/n`` for all_gather, reduce_scatter and all_to_all, and 1 for
broadcast and send/recv. ``size`` is the bytes of the largest buffer of the
op on one rank: the tensor for all_reduce and broadcast, the output of
all_gather, the input of reduce_scatter and all_to_all, the message of send/recv.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from spmd.specs import PeerContext as PeerContext


def size_sweep(min_bytes: int = 4, max_bytes: int = 64 << 20, factor: int = 4) -> list[int]:
    """4 B .. 64 MiB, multiplying by ``factor`` (2 doubles, 4 is the default)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    if sizes and sizes[-1] != max_bytes and max_bytes > min_bytes:
        sizes.append(max_bytes)
    return sizes


def stepped_sweep(max_bytes: int = 64 << 20, min_bytes: int = 4) -> list[int]:
    """4 B, 64 B, 1 KiB, 16 KiB, then from 256 KiB every power of 4 up to ``max_bytes`` (not added if off the grid).

    Few small sizes (latency barely changes there) and every large one (where
    bandwidth does): the sweep of the side-by-side scripts in ``benchmarks/``.
    ``min_bytes`` drops the smaller sizes without moving the grid.
    """
    sizes, size = [], 4
    while size <= max_bytes:
        if size >= min_bytes:
            sizes.append(size)
        size *= 16 if size < 256 << 10 else 4
    return sizes


def iterations_for_bytes(nbytes: int, volume: int = 8 << 20, lo: int = 3, hi: int = 200) -> int:
    """How many calls of ``nbytes`` move about ``volume`` bytes, clamped to ``lo``..``hi``.

    A count fixed before measuring, so that every rank makes the same number
    of calls without agreeing on a time estimate first (``iterations_for``).
    """
    return max(lo, min(hi, volume // max(nbytes, 1)))


BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def bus_factor(op: str, world_size: int) -> float:
    return BUS_FACTORS[op](world_size) if world_size > 1 else 1.0


def time_interleaved(sides: Sequence[Callable[[], object]], iters: int, sync: Callable[[], object] | None = None) -> list[list[float]]:
    """Per-call seconds of every side, rotating the order each round.

    Alternating call by call makes machine noise and position effects (the
    call right after another is measurably slower on a loaded host) hit every
    side alike, which is what makes a ratio between them meaningful.
    """
    logs: list[list[float]] = [[] for _ in sides]
    if sync is not None:
        sync()
    for i in range(iters):
        for k in range(len(sides)):
            j = (i + k) % len(sides)
            start = time.perf_counter()
            sides[j]()
            logs[j].append(time.perf_counter() - start)
    return logs


#: The idle time before each call of the "after work" measurement: long enough that progress
#: threads and polling loops have gone to sleep, as between a training step's collectives.
AFTER_WORK_IDLE_S = 0.001


def time_after_work(call: Callable[[], object], iters: int, sync: Callable[[], object], idle_s: float = AFTER_WORK_IDLE_S) -> list[float]:
    """Per-call seconds of ``call`` made as a training loop makes it: after ``sync`` (a barrier, so
    every rank starts together) and ``idle_s`` of other work, not right after the previous call."""
    times = []
    for _ in range(iters):
        sync()
        time.sleep(idle_s)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def iterations_for(estimate_s: float, budget_s: float, lo: int = 5, hi: int = 400) -> int:
    """How many calls fit a time budget, given one warm call's duration."""
    return max(lo, min(hi, int(budget_s / max(estimate_s, 1e-6))))


def summarize(samples: Sequence[float]) -> dict[str, float]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples), "n": len(samples)}
