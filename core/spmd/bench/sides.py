"""Side-by-side benchmarks: spmd and torch.distributed in one process, timed alternately.

Every ``benchmarks/*_vs_torch.py`` script runs both frameworks in the same
ranks, so machine noise hits both alike: ``init_both`` joins spmd and a torch
process group on one store (torch's keys under a prefix, spmd not posing as
torch's default group), ``alternate`` times one step of each side per round
with the order rotating, and ``summary`` gives the medians and the ratios.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any


def init_both(backend: str | None, torch_backend: str, timeout_s: float = 300.0) -> tuple[int, int]:
    """spmd on ``backend`` (None: its own choice) and torch.distributed on ``torch_backend``, from torchrun's
    variables; returns (rank, world)."""
    import torch.distributed as tdist

    import spmd

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timedelta(seconds=60))
    spmd.init(backend, store=store, rank=rank, world_size=world, timeout=timeout_s, torch_interop=False)
    tdist.init_process_group(torch_backend, store=tdist.PrefixStore("torch/", store), rank=rank, world_size=world,
                             timeout=timedelta(seconds=timeout_s))
    return rank, world


def finish_both() -> None:
    import torch.distributed as tdist

    import spmd

    spmd.destroy_process_group()
    tdist.destroy_process_group()


def alternate(steps: Mapping[str, Callable[[], object]], rounds: int, barrier: Callable[[], object]) -> dict[str, list[float]]:
    """Seconds per call of each side's step, one call per side per round, the order rotating; a barrier before each."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def all_reduce_table(sides: Mapping[str, Callable[[Any], object]], sizes: list[int], iters: int, cap: int,
                     barrier: Callable[[], object], slowest: Callable[[Any], object]) -> list[tuple[int, dict[str, float]]]:
    """``(bytes, all_reduce_sides(...))`` per size of ``sizes``: ``iters`` calls per side (0: by size, 20 to ``cap``)."""
    from spmd.bench.ops import elements

    rows = []
    for nbytes in sizes:
        count = iters or max(20, min(cap, int(2e8 // max(nbytes, 1) // 1000)))
        rows.append((nbytes, all_reduce_sides(sides, elements(nbytes), count, barrier, slowest)))
    return rows


def all_reduce_sides(sides: Mapping[str, Callable[[Any], object]], numel: int, iters: int, barrier: Callable[[], object],
                     slowest: Callable[[Any], object], warmup: int = 3) -> dict[str, float]:
    """Each side's median microseconds for an all_reduce of ``numel`` float32 elements, alternated call by call
    after ``barrier()``; every result checked against the one-process sum (rank r holds r + 1); each call's time
    is its slowest rank's (``slowest`` MAX-reduces a float64 tensor across the ranks)."""
    import torch

    import spmd

    rank, world = spmd.get_rank(), spmd.get_world_size()
    expected = float(world * (world + 1) // 2)
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters + warmup):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            t = torch.full((numel,), float(rank + 1))
            barrier()
            start = time.perf_counter()
            sides[name](t)
            elapsed = time.perf_counter() - start
            if t[0].item() != expected or t[-1].item() != expected:
                raise SystemExit(f"{name} at {numel} elements: got {t[0].item()}, expected {expected}")
            if i >= warmup:
                times[name].append(elapsed)
    medians = {}
    for name, ts in times.items():
        mine = torch.tensor(ts, dtype=torch.float64)
        slowest(mine)
        medians[name] = statistics.median(mine.tolist()) * 1e6
    return medians


def summary(times: Mapping[str, list[float]], ours: str = "spmd", theirs: str = "torch") -> tuple[dict[str, float], float, float]:
    """(median per side, ratio of medians ours/theirs, median of the per-round ratios: slow drift cancels)."""
    med = {n: statistics.median(t) for n, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times[ours], times[theirs]))
    return med, med[ours] / med[theirs], paired
