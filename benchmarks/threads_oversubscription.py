"""Thread oversubscription: each backend's ops with torch's default thread count against one thread per rank.

    python benchmarks/threads_oversubscription.py                    # ucc, gloo, shm; 2 ranks
    python benchmarks/threads_oversubscription.py --backends shm --sizes 4,1048576 --reps 6

The ranks start without ``OMP_NUM_THREADS`` (as under mpiexec, srun or any launcher that does
not set it), so torch uses a thread per core in every rank: 2 ranks x 2 threads on a 2-core host.
Each rank times every op and size at torch's default thread count and at one thread
(``torch.set_num_threads``, same processes), in blocks of calls that alternate (the order flips
every repetition), so load from elsewhere on the host hits both alike. It prints each mode's
median per call, their ratio default/one, and the lowest and highest ratio of a repetition's
pair of blocks (the spread). Goal (issue 38): ratio <= 1.5 in every row, for every backend.

``torch.set_num_threads`` sets the calling thread's count; a thread of the backend's own (a
progress thread, the kernel's runner of generic algorithms) keeps the count it had at its first
parallel op. So this compares the calling thread's count, where synchronous ops progress; the
exact comparison, each rank started at one thread or at the default, is
``spmd bench collectives --threads 1`` against ``--threads default`` (separate runs, noisier).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from spmd.bench.launch import relaunch_locally, rendezvous_env
from spmd.bench.timing import iterations_for_bytes

SIZES = "4,65536,262144,1048576,16777216"


def _block(spmd, call, iters: int, threads: int) -> list[float]:  # type: ignore[no-untyped-def]
    """``iters`` timed calls with this rank's torch at ``threads`` threads (both ranks in step)."""
    torch.set_num_threads(threads)
    spmd.barrier()
    call()  # the first call after a switch is not timed
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def worker(backend: str, ops: list[str], sizes: list[int], reps: int) -> None:
    import spmd
    from spmd.bench.ops import spmd_ops

    default = torch.get_num_threads()
    spmd.init(backend, timeout=300)
    rank = spmd.get_rank()
    makers = spmd_ops(spmd.get_world_size(), rank)
    if rank == 0:
        print(f"{backend}: torch's default here is {default} threads per rank, {os.cpu_count()} CPUs, "
              f"{spmd.get_world_size()} ranks; medians per call (sendrecv: one way)")
        print(f"  {'op':10s} {'bytes':>9s} {'one thread':>11s} {'default':>11s} {'ratio':>6s} {'spread':>12s}")
    for op in ops:
        for nbytes in sizes:
            call = makers[op](nbytes)
            for _ in range(3):
                call()  # warm-up: connections, buffers, page faults
            iters = iterations_for_bytes(nbytes, volume=16 << 20, lo=20, hi=300)
            one: list[float] = []
            many: list[float] = []
            ratios = []
            for rep in range(reps):
                order = (1, default) if rep % 2 == 0 else (default, 1)
                blocks = {threads: _block(spmd, call, iters, threads) for threads in order}
                one += blocks[1]
                many += blocks[default]
                ratios.append(statistics.median(blocks[default]) / statistics.median(blocks[1]))
            torch.set_num_threads(default)
            if rank == 0:
                scale = 0.5e6 if op == "sendrecv" else 1e6
                a, b = statistics.median(one) * scale, statistics.median(many) * scale
                print(f"  {op:10s} {nbytes:9d} {a:9.1f}us {b:9.1f}us {b / a:6.2f} {min(ratios):5.2f}-{max(ratios):<5.2f}", flush=True)
    spmd.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="ucc,gloo,shm")
    parser.add_argument("--ops", default="all_reduce,sendrecv")
    parser.add_argument("--sizes", default=SIZES, help="comma-separated bytes")
    parser.add_argument("--reps", type=int, default=4, help="pairs of blocks (one thread, default) per op and size")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(os.environ["SPMD_BENCH_BACKEND"], args.ops.split(","), [int(s) for s in args.sizes.split(",")], args.reps)
        return
    status = 0
    for backend in args.backends.split(","):
        env = rendezvous_env(omp_num_threads=None, base={**os.environ, "SPMD_BENCH_BACKEND": backend})
        argv = [os.path.abspath(__file__), *sys.argv[1:]]
        status = status or relaunch_locally(args.world_size, argv=argv, env=env)
    sys.exit(status)


if __name__ == "__main__":
    main()
