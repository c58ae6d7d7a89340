"""A hierarchical all_reduce (shm inside each "host", Gloo between hosts' leaders) against flat Gloo and torch's Gloo.

    python benchmarks/hierarchical_all_reduce.py                 # 4 ranks as 2 hosts x 2, 4 B .. 16 MiB
    python benchmarks/hierarchical_all_reduce.py --nproc 4 --sizes 65536,1048576

The question issue 38 asks: for a group across hosts, is "shm inside each host,
Gloo between hosts" faster than Gloo over every rank? One host stands in for
several: ranks are cut into "hosts" of ``--per-host`` consecutive ranks, so
the links between hosts are loopback TCP for both sides, the same medium, and
only the intra-host hops differ (shm against Gloo). Three sides, alternated
call by call after a barrier on the world (a training loop's op follows
other work): ``hier`` = reduce inside the host (shm all_reduce), all_reduce
between the hosts' first ranks (Gloo), broadcast inside the host (shm);
``flat`` = spmd's Gloo all_reduce over every rank; ``torch`` = torch's own
ProcessGroupGloo over every rank. Every side's result is checked against
the one-process sum. Prints the median per side and the ratios.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as tdist

from spmd.bench.launch import run_as_ranks
from spmd.bench.report import human
from spmd.bench.sides import all_reduce_table


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--per-host", type=int, default=2, help="consecutive ranks that form one stand-in host")
    p.add_argument("--sizes", default="4,65536,1048576,16777216", help="bytes per rank, comma-separated")
    p.add_argument("--iters", type=int, default=0, help="calls per side and size (default: by size)")
    return p.parse_args()


def main(args: argparse.Namespace) -> None:
    import spmd

    torch.set_num_threads(1)
    spmd.init("gloo")
    rank, world = spmd.get_rank(), spmd.get_world_size()
    per = args.per_host
    if world % per or world // per < 2:
        raise SystemExit(f"--nproc {world} must be a multiple of --per-host {per} with at least 2 hosts")
    host_groups = [spmd.new_group(list(range(h, h + per)), backend="shm") for h in range(0, world, per)]
    local = host_groups[rank // per]
    leaders = spmd.new_group(list(range(0, world, per)), backend="gloo")
    flat = spmd.new_group(list(range(world)), backend="gloo")
    torch_gloo = tdist.new_group(backend="gloo")
    leader = rank - rank % per

    def hier(t: torch.Tensor) -> None:
        spmd.all_reduce(t, group=local)
        if rank == leader:
            spmd.all_reduce(t, group=leaders)
        spmd.broadcast(t, src=leader, group=local)

    sides = {
        "hier": hier,
        "flat": lambda t: spmd.all_reduce(t, group=flat),
        "torch": lambda t: tdist.all_reduce(t, group=torch_gloo),
    }
    rows = all_reduce_table(sides, [int(x) for x in args.sizes.split(",")], args.iters, 400, spmd.barrier,
                            lambda t: spmd.all_reduce(t, op=spmd.ReduceOp.MAX))
    if rank == 0:
        print(f"all_reduce, {world} ranks as {world // per} hosts x {per} (medians in us; slowest rank per call)")
        print(f"{'size':>9} | {'hier':>9} {'flat':>9} {'torch':>9} | {'hier/flat':>9} {'hier/torch':>10} {'flat/torch':>10}")
        for nbytes, med in rows:
            print(f"{human(nbytes):>9} | {med['hier']:9.1f} {med['flat']:9.1f} {med['torch']:9.1f} | "
                  f"{med['hier'] / med['flat']:9.2f} {med['hier'] / med['torch']:10.2f} {med['flat'] / med['torch']:10.2f}")
    sys.stdout.flush()
    spmd.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    arguments = parse()
    run_as_ranks(main, arguments, arguments.nproc)
