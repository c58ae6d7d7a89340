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


def summary(times: Mapping[str, list[float]], ours: str = "spmd", theirs: str = "torch") -> tuple[dict[str, float], float, float]:
    """(median per side, ratio of medians ours/theirs, median of the per-round ratios: slow drift cancels)."""
    med = {n: statistics.median(t) for n, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times[ours], times[theirs]))
    return med, med[ours] / med[theirs], paired
