"""spmd-gloo against raw torch ProcessGroupGloo: same op, same sizes, alternated in one run.

    python benchmarks/collectives_vs_torch.py                  # 2 ranks, 4 B .. 64 MiB
    python benchmarks/collectives_vs_torch.py --ops all_reduce --max-bytes 4194304

Both sides use one store and preallocated, reused buffers. For each op and
size the two alternate call by call (spmd, raw, raw, spmd, ...) so machine
noise hits both alike; the table shows the median per-call time of
each, the ratio spmd/raw (below 1.0: spmd faster), and raw2/raw: a second,
identical raw Gloo group against the first, which shows how far two equal
things differ on this machine (the noise floor of the ratio). tdist/raw is
torch.distributed's own module-level API (``torch.distributed.all_reduce`` ...)
on a third Gloo group: the Python layer torch users call, measured the same
way, so spmd's overhead can be read against torch's. Size is the bytes of
the per-rank tensor for all_reduce and broadcast, of the output for
all_gather_into_tensor, and of the input for reduce_scatter_tensor and
all_to_all_single.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as tdist

from spmd.bench.launch import relaunch_locally
from spmd.bench.ops import elements
from spmd.bench.report import human
from spmd.bench.timing import iterations_for_bytes, stepped_sweep, time_interleaved

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single")


#: Each side cycles through this many buffer sets: Gloo's per-call time at some sizes
#: depends on which buffer is used (seen here: 1.5 ms vs 2.7 ms for one 1 MiB
#: all_reduce on two tensors of the same pg), so both sides get the same mix.
BUFFER_SETS = 3


def _rotating(make, call):
    sets = [make() for _ in range(BUFFER_SETS)]
    it = itertools.cycle(sets)
    return lambda: call(*next(it))


def calls(op: str, nbytes: int, world: int, pg: tdist.ProcessGroupGloo):
    """(spmd call, raw call) closures over preallocated buffers of ``nbytes``."""
    import spmd

    n = elements(nbytes)
    per = elements(nbytes, world) // world
    if op == "all_reduce":
        make = lambda: (torch.ones(n),)  # noqa: E731
        return _rotating(make, lambda a: spmd.all_reduce(a)), _rotating(make, lambda b: pg.allreduce([b]).wait())
    if op == "broadcast":
        make = lambda: (torch.ones(n),)  # noqa: E731
        opts = tdist.BroadcastOptions()
        return _rotating(make, lambda a: spmd.broadcast(a, src=0)), _rotating(make, lambda b: pg.broadcast([b], opts).wait())
    if op == "all_gather_into_tensor":
        make = lambda: (torch.empty(per * world), torch.ones(per))  # noqa: E731
        return (_rotating(make, lambda o, i: spmd.all_gather_into_tensor(o, i)),
                _rotating(make, lambda o, i: pg._allgather_base(o, i).wait()))
    if op == "reduce_scatter_tensor":
        make = lambda: (torch.empty(per), torch.ones(per * world))  # noqa: E731
        return (_rotating(make, lambda o, i: spmd.reduce_scatter_tensor(o, i)),
                _rotating(make, lambda o, i: pg._reduce_scatter_base(o, i).wait()))
    if op == "all_to_all_single":
        make = lambda: (torch.empty(per * world), torch.ones(per * world))  # noqa: E731
        opts = tdist.AllToAllOptions()
        return (_rotating(make, lambda o, i: spmd.all_to_all_single(o, i)),
                _rotating(make, lambda o, i: pg.alltoall_base(o, i, [], [], opts).wait()))
    raise ValueError(op)


def torch_api_call(op: str, nbytes: int, world: int):
    """The same op through torch.distributed's module-level API, on its default (Gloo) group."""
    n = elements(nbytes)
    per = elements(nbytes, world) // world
    if op == "all_reduce":
        return _rotating(lambda: (torch.ones(n),), lambda a: tdist.all_reduce(a))
    if op == "broadcast":
        return _rotating(lambda: (torch.ones(n),), lambda a: tdist.broadcast(a, src=0))
    if op == "all_gather_into_tensor":
        return _rotating(lambda: (torch.empty(per * world), torch.ones(per)), lambda o, i: tdist.all_gather_into_tensor(o, i))
    if op == "reduce_scatter_tensor":
        return _rotating(lambda: (torch.empty(per), torch.ones(per * world)), lambda o, i: tdist.reduce_scatter_tensor(o, i))
    if op == "all_to_all_single":
        return _rotating(lambda: (torch.empty(per * world), torch.ones(per * world)), lambda o, i: tdist.all_to_all_single(o, i))
    raise ValueError(op)


def worker(args: argparse.Namespace) -> None:
    import spmd

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timedelta(seconds=60))
    spmd.init("gloo", store=store, rank=rank, world_size=world, timeout=120, torch_interop=False)  # torch runs on Gloo here
    pg = tdist.ProcessGroupGloo(tdist.PrefixStore("raw/", store), rank, world, timedelta(seconds=120))
    # A second raw group: raw2/raw shows the noise floor (two identical Gloo groups differ too).
    pg2 = tdist.ProcessGroupGloo(tdist.PrefixStore("raw2/", store), rank, world, timedelta(seconds=120))
    # torch.distributed's API on its own default group (it lives beside spmd in one process).
    tdist.init_process_group("gloo", store=tdist.PrefixStore("tdist/", store), rank=rank, world_size=world,
                             timeout=timedelta(seconds=120))
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # all_gather_into_tensor
    barrier = lambda: pg.barrier().wait()  # noqa: E731 - the same barrier for both sides
    results = []
    for op in args.ops:
        for nbytes in stepped_sweep(args.max_bytes):
            ours, raw = calls(op, nbytes, world, pg)
            _, control = calls(op, nbytes, world, pg2)
            sides = [ours, raw, control, torch_api_call(op, nbytes, world)]
            for side in sides:
                side()  # warm-up: connections, staging buffers, page faults
            times = time_interleaved(sides, iterations_for_bytes(nbytes) * args.rounds, sync=barrier)
            med_ours, med_raw, med_ctl, med_api = (statistics.median(t) for t in times)
            results.append({"op": op, "bytes": nbytes, "spmd_s": med_ours, "raw_s": med_raw, "ratio": med_ours / med_raw,
                            "control_ratio": med_ctl / med_raw, "torch_api_ratio": med_api / med_raw})
            if rank == 0 and not args.json:
                r = results[-1]
                print(f"{op:24s} {human(nbytes):>8s} {r['spmd_s'] * 1e6:12.1f} {r['raw_s'] * 1e6:12.1f} {r['ratio']:8.3f} "
                      f"{r['control_ratio']:9.3f} {r['torch_api_ratio']:10.3f}", flush=True)
    if rank == 0 and args.json:
        print(json.dumps(results, indent=1))
    spmd.destroy_process_group()
    tdist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS))
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--rounds", type=int, default=3, help="multiplies the calls per size; the median call is reported")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    if not args.json:
        print(f"{args.world_size} ranks, Gloo; median per call, spmd and raw alternating call by call; ratio = spmd / raw; "
              "raw2/raw = control; tdist/raw = torch.distributed's API")
        print(f"{'op':24s} {'size':>8s} {'spmd us':>12s} {'raw us':>12s} {'ratio':>8s} {'raw2/raw':>9s} {'tdist/raw':>10s}")
    sys.exit(relaunch_locally(args.world_size))


if __name__ == "__main__":
    main()
