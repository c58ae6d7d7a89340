"""spmd-ucc against spmd-gloo: all_reduce, same sizes, alternated call by call in one run.

    python benchmarks/ucc_vs_gloo.py                       # 2 ranks, 4 B .. 64 MiB, every pattern
    python benchmarks/ucc_vs_gloo.py --max-bytes 4194304 --rounds 5
    python benchmarks/ucc_vs_gloo.py --patterns idle --min-bytes 262144
    python benchmarks/ucc_vs_gloo.py --profile prof.out    # cProfile of rank 0's ucc calls

Each size is timed in four patterns. Three are how a training loop calls a
collective, after other work: right after a Gloo barrier (``gloo-barrier``:
another group's op, as DDP's buckets follow a data-loader barrier), right
after a barrier on the ucc group itself (``ucc-barrier``), and after a
barrier and 5 ms of idle (``idle``: the forward pass before a gradient
bucket; progress threads and polling loops have gone to sleep). The fourth
is calls back to back (``back-to-back``), the figure earlier versions of
this script gave alone: it flatters a backend that spins between calls.

One job runs both backends: the world group uses Gloo and a second group of
the same ranks uses ucc (``spmd.new_group(backend="ucc")``). Both sides
reuse preallocated buffers. For each size the sides alternate call by call
(ucc, gloo, gloo2, then gloo, gloo2, ucc, ...) so that machine noise (this
host is shared) hits all alike. The table shows the median latency of each
side, call by call from the moment the last rank entered to the moment the
last rank left (the ranks' CLOCK_MONOTONIC is one clock on one host), the
ratio ucc/gloo (below 1.0: ucc faster), the algorithm bandwidth (bytes /
latency), gloo2/gloo (a second, identical Gloo group against the first: the
noise floor of the ratio), and the wall ratio: the same ratio of rank 0's
per-call wall time, which also charges to a call the time rank 0 waits for
a peer still finishing the previous call of another side (Gloo's one-element
all-reduce leaves its ranks ~40 us apart, and the next call pays it). Sizes
are the bytes of the per-rank float32 tensor.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

from spmd.bench.launch import relaunch_locally
from spmd.bench.ops import elements
from spmd.bench.report import human
from spmd.bench.timing import iterations_for_bytes, stepped_sweep

#: Each side cycles through this many buffers, so a per-buffer artefact hits both alike.
BUFFER_SETS = 3


def side(group, nbytes: int):  # type: ignore[no-untyped-def]
    import spmd

    n = elements(nbytes)
    bufs = itertools.cycle([torch.ones(n) for _ in range(BUFFER_SETS)])
    return lambda: spmd.all_reduce(next(bufs), group=group)


def time_interleaved(sides, iters: int, barrier, before=None) -> list[list[tuple[float, float]]]:  # type: ignore[no-untyped-def]
    """(start, end) of every call of every side, rotating which goes first call by call;
    ``before()`` (other work) runs untimed before each call, or nothing (back to back).

    CLOCK_MONOTONIC is one clock for every process on a host, so the ranks'
    logs can be compared call by call.
    """
    logs: list[list[tuple[float, float]]] = [[] for _ in sides]
    barrier()
    for i in range(iters):
        for k in range(len(sides)):
            j = (i + k) % len(sides)
            if before is not None:
                before()
            start = time.monotonic()
            sides[j]()
            logs[j].append((start, time.monotonic()))
    return logs


def patterns(gloo, ucc) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """What runs before each timed call in each pattern (None: nothing, back to back)."""
    import spmd

    def idle() -> None:
        spmd.barrier(group=gloo)
        time.sleep(0.005)

    return {
        "gloo-barrier": lambda: spmd.barrier(group=gloo),
        "ucc-barrier": lambda: spmd.barrier(group=ucc),
        "idle": idle,
        "back-to-back": None,
    }


def medians(all_logs: list[list[list[tuple[float, float]]]]) -> tuple[list[float], list[float]]:
    """Per side: the median call as rank 0 timed it, and the median collective latency.

    The latency of call i is from the moment the last rank entered it to the
    moment the last rank left it: a rank that arrives early (because its
    previous call, of another side, ended earlier on it) waits, and that wait
    belongs to neither side, yet rank 0's wall time charges it to this one.
    """
    wall, latency = [], []
    for j in range(len(all_logs[0])):
        wall.append(statistics.median(end - start for start, end in all_logs[0][j]))
        calls = zip(*(rank_logs[j] for rank_logs in all_logs))
        latency.append(statistics.median(max(e for _, e in c) - max(s for s, _ in c) for c in calls))
    return wall, latency


def worker(args: argparse.Namespace) -> None:
    import spmd

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timedelta(seconds=60))
    spmd.init("gloo", store=store, rank=rank, world_size=world, timeout=120)
    ucc = spmd.new_group(list(range(world)), backend="ucc", group_desc="ucc")
    gloo2 = spmd.new_group(list(range(world)), backend="gloo", group_desc="gloo2")
    gloo = spmd.comm.state.get_state().world
    barrier = lambda: spmd.barrier()  # noqa: E731 - one barrier for every side
    profiler = None
    if args.profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    results = []
    chosen = {name: before for name, before in patterns(gloo, ucc).items() if name in args.patterns.split(",")}
    for nbytes, (pattern, before) in itertools.product(stepped_sweep(args.max_bytes, args.min_bytes), chosen.items()):
        sides = [side(ucc, nbytes), side(gloo, nbytes), side(gloo2, nbytes)]
        for _ in range(args.warmup):
            for run in sides:
                run()  # warm-up: connections, staging buffers, page faults
        if profiler is not None:
            inner = sides[0]

            def profiled(inner=inner):  # type: ignore[no-untyped-def]
                profiler.enable()
                inner()
                profiler.disable()

            sides[0] = profiled
        iters = iterations_for_bytes(nbytes, hi=200 if before is None else 40) * args.rounds
        logs = time_interleaved(sides, iters, barrier, before)
        store.set(f"bench/{nbytes}/{pattern}/{rank}", json.dumps(logs))
        if rank != 0:
            continue
        all_logs = [json.loads(store.get(f"bench/{nbytes}/{pattern}/{r}")) for r in range(world)]
        (w_ucc, w_gloo, w_ctl), (med_ucc, med_gloo, med_ctl) = medians(all_logs)
        row = {"bytes": nbytes, "pattern": pattern, "ucc_s": med_ucc, "gloo_s": med_gloo, "ratio": med_ucc / med_gloo,
               "ucc_GBps": nbytes / med_ucc / 1e9, "gloo_GBps": nbytes / med_gloo / 1e9,
               "control_ratio": med_ctl / med_gloo, "wall_ratio": w_ucc / w_gloo,
               "ucc_wall_s": w_ucc, "gloo_wall_s": w_gloo}
        results.append(row)
        if not args.json:
            print(f"{human(nbytes):>8s} {pattern:>13s} {med_ucc * 1e6:11.1f} {med_gloo * 1e6:11.1f} {row['ratio']:7.3f} "
                  f"{row['ucc_GBps']:8.3f} {row['gloo_GBps']:8.3f} {row['control_ratio']:9.3f} "
                  f"{row['wall_ratio']:10.3f}", flush=True)
    if rank == 0 and args.json:
        print(json.dumps(results, indent=1))
    elif rank == 0 and results:
        worst = max(results, key=lambda r: r["ratio"])
        large = [r for r in results if r["bytes"] >= 1 << 20]
        print(f"worst ucc/gloo: {worst['ratio']:.3f} ({human(worst['bytes'])}, {worst['pattern']}); goal <= 1.0")
        if large:
            worst_large = max(large, key=lambda r: r["ratio"])
            print(f"worst ucc/gloo at >= 1 MiB: {worst_large['ratio']:.3f} ({human(worst_large['bytes'])}, "
                  f"{worst_large['pattern']}); goal <= 0.5")
    if profiler is not None:
        import pstats

        profiler.dump_stats(args.profile)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    spmd.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--min-bytes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="multiplies the calls per size; the median call is reported")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls of each side per size")
    parser.add_argument("--patterns", default="gloo-barrier,ucc-barrier,idle,back-to-back",
                        help="what precedes each timed call (comma-separated; see the module docstring)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", metavar="FILE", help="cProfile rank 0's ucc calls into FILE (and print the top)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    if not args.json:
        print(f"{args.world_size} ranks, all_reduce float32 SUM, ucc and gloo alternating call by call. Median "
              "latency per call (last rank in -> last rank out); ratio = ucc / gloo (below 1: ucc faster); "
              "gloo2/gloo = control; wall ratio = the same ratio of rank 0's per-call wall time")
        print(f"{'size':>8s} {'pattern':>13s} {'ucc us':>11s} {'gloo us':>11s} {'ratio':>7s} {'ucc GB/s':>8s} {'gloo GB/s':>8s} "
              f"{'gloo2/gloo':>9s} {'wall ratio':>10s}")
    sys.exit(relaunch_locally(args.world_size))


if __name__ == "__main__":
    main()
