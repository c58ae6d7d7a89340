"""What every rank runs for one backend: each op over the size sweep, spmd and the raw peer alternating."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

import spmd
from spmd import hookspecs
from spmd.bench.ops import spmd_ops
from spmd.bench.report import human
from spmd.bench.timing import (
    AFTER_WORK_IDLE_S,
    PeerContext,
    iterations_for,
    summarize,
    time_after_work,
    time_interleaved,
)
from spmd.registry import Registry

BENCH_PEERS: Registry[str, Callable[[PeerContext], Mapping[str, Callable[[int], Callable[[], object]]]]] = Registry(
    hookspecs.spmd_bench_peers, "bench peer", keys=None, expected="a factory peer(ctx) -> {op: make(nbytes) -> call()}")


def raw_peer(backend: str, ctx: PeerContext) -> dict[str, Callable[[int], Callable[[], object]]] | None:
    """The raw-library makers a plugin offers for ``backend`` (``spmd_bench_peers``), or None."""
    entry = BENCH_PEERS.find(backend)
    return dict(entry.spec(ctx)) if entry is not None else None


def _agree_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    spmd.all_reduce(t, op=spmd.ReduceOp.MAX)
    return float(t.item())


def run(backend: str, ops: list[str], sizes: list[int], budget_s: float, vs_raw: bool, progress: bool) -> list[dict[str, Any]]:
    """Measure; every rank returns the same list (rank 0's medians).

    Each op and size is timed twice: back to back (alternating with the raw
    peer, ``median_s``), and as a training loop calls it, after a barrier and
    a millisecond of idle (``after_work_median_s``): a backend whose progress
    engine sleeps between calls pays its wake-up only there.
    """
    rank, world = spmd.get_rank(), spmd.get_world_size()
    ours_all = spmd_ops(world, rank)
    raw_all = None
    if vs_raw:
        import torch.distributed as tdist

        from spmd.comm.state import get_state

        store = tdist.PrefixStore("bench-raw/", get_state().store)
        raw_all = raw_peer(backend, PeerContext(rank, world, store, 120.0))
    results = []
    copy_s: dict[int, float] = {}
    for op in ops:
        if op == "sendrecv" and world < 2:
            continue
        for nbytes in sizes:
            if progress and rank == 0:
                print(f"\r[{backend}] {op:24s} {human(nbytes):>9s}   ", end="", file=sys.stderr, flush=True)
            ours = ours_all[op](nbytes)
            raw = raw_all[op](nbytes) if raw_all and op in raw_all else None
            sides = [ours] + ([raw] if raw is not None else [])
            for side in sides:
                side()  # warm-up: connections, staging buffers, page faults
            start = spmd_time(ours)
            iters = iterations_for(_agree_max(start), budget_s / len(sides))
            logs = time_interleaved(sides, iters, sync=spmd.barrier)
            after_iters = iterations_for(_agree_max(start) + AFTER_WORK_IDLE_S, budget_s / len(sides), lo=5, hi=100)
            after = time_after_work(ours, after_iters, spmd.barrier)
            if nbytes not in copy_s:
                copy_s[nbytes] = _copy_reference(nbytes, budget_s / 4, rank)
            scale = 0.5 if op == "sendrecv" else 1.0  # ping-pong: report one direction
            row: dict[str, Any] = {"backend": backend, "op": op, "bytes": nbytes, "world_size": world, "threads": torch.get_num_threads()}
            row.update({k: (v * scale if k != "n" else v) for k, v in summarize(logs[0]).items()})
            row["after_work_median_s"] = summarize(after)["median_s"] * scale
            row["copy_median_s"] = copy_s[nbytes]
            if raw is not None:
                raw_stats = summarize(logs[1])
                row["raw_median_s"] = raw_stats["median_s"] * scale
                row["ratio_vs_raw"] = row["median_s"] / row["raw_median_s"]
            results.append(row)
    if progress and rank == 0:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)
    return results


def _copy_reference(nbytes: int, budget_s: float, rank: int) -> float:
    """Median seconds of a ``copy_`` of ``nbytes`` between two private tensors on rank 0, in this
    process's torch threads, while the other ranks wait: what memory alone allows, measured in the
    same run as the ops it is compared with (``of copy_`` in the tables)."""
    median = 0.0
    if rank == 0:
        src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)  # the ops' dtype (torch copies uint8 slower)
        dst = torch.empty_like(src)
        call = lambda: dst.copy_(src)  # noqa: E731
        call()
        iters = iterations_for(spmd_time(call), budget_s, lo=5, hi=200)
        median = summarize(time_interleaved([call], iters)[0])["median_s"]
    spmd.barrier()
    return median


def spmd_time(call: Callable[[], object]) -> float:
    import time

    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ops", required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--vs-raw", action="store_true")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", default="1", help="torch threads per rank, or 'default' to leave torch's own count")
    args = parser.parse_args(argv)
    if args.threads != "default":
        torch.set_num_threads(int(args.threads))
    spmd.init(args.backend, timeout=120)
    try:
        results = run(args.backend, args.ops.split(","), [int(s) for s in args.sizes.split(",")], args.budget, args.vs_raw, args.progress)
        if spmd.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(results, f)
    finally:
        spmd.destroy_process_group()


if __name__ == "__main__":
    main()
