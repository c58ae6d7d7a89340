"""What the flight recorder costs: per-op recording time, and 4 B all_reduce with it on vs off.

    python benchmarks/recorder_overhead.py

Part 1 times ``recorder.start`` + ``Entry.finish`` alone (the work the kernel
adds to every op). Part 2 runs 2 ranks over Gloo and alternates, call by
call, a 4-byte ``spmd.all_reduce`` with the recorder on and off (off: entries
are not kept; sequence numbers and progress still are), and prints the
median of each and the ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

from spmd.bench.launch import relaunch_locally


def micro() -> None:
    from spmd.debug.recorder import FlightRecorder

    rec = FlightRecorder(2000)
    t = torch.ones(1)
    n = 200_000
    start = time.perf_counter()
    for i in range(n):
        rec.start("world", i, "all_reduce", (t,), None).finish(None)
    per = (time.perf_counter() - start) / n
    print(f"recorder.start + finish: {per * 1e6:.2f} us per op (single process, {n} ops)")


def worker() -> None:
    import spmd
    from spmd.debug.recorder import recorder

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timedelta(seconds=60))
    spmd.init("gloo", store=store, rank=rank, world_size=world)
    t = torch.ones(1)
    on, off = [], []
    for _ in range(200):
        spmd.all_reduce(t)
    for i in range(6000):
        enabled = (i % 2 == 0) != (i % 4 >= 2)  # rotate order: on,off,off,on,...
        recorder.enabled = enabled
        start = time.perf_counter()
        spmd.all_reduce(t)
        (on if enabled else off).append(time.perf_counter() - start)
    recorder.enabled = True
    if rank == 0:
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(f"4 B all_reduce, 2 ranks, Gloo: recorder on {m_on * 1e6:.1f} us, off {m_off * 1e6:.1f} us, on/off {m_on / m_off:.3f}")
    spmd.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:
        worker()
        return
    micro()
    sys.exit(relaunch_locally(2, argv=[os.path.abspath(__file__)]))


if __name__ == "__main__":
    main()
