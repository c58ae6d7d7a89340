"""Rank functions for the bench tests (pickled by reference)."""

import statistics
import time

import torch

import spmd


def hand_timed_all_reduce(nbytes: int, iters: int) -> float:
    """Median seconds per spmd.all_reduce of ``nbytes``, timed with a plain loop."""
    t = torch.ones(nbytes // 4)
    for _ in range(10):
        spmd.all_reduce(t)
    spmd.barrier()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        spmd.all_reduce(t)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
