"""The kernel's hierarchical all_reduce across hosts against Gloo over every rank, on the multi-host test bed.

    sudo python benchmarks/hierarchical_across_hosts.py            # 2 nodes x 2 ranks, 4 B .. 4 MiB
    sudo python benchmarks/hierarchical_across_hosts.py --sizes 65536,1048576

Builds two nodes with ``spmd.testing.hosts`` (network, UTS namespaces: hosts of
their own; needs root and iproute2), starts 4 ranks alternating over them and
calls ``spmd.init()`` with no backend, so the world group is the kernel's own
choice (``HierarchicalBackend``: shm inside each node, Gloo between them,
``SPMD_HIERARCHICAL_MIN_BYTES=0``). ``flat`` is a group of the same ranks made
with ``backend="gloo"``; ``hand`` the same three steps through explicit groups
(shm per node, Gloo between the nodes' first ranks), without the composite. Calls alternate after a barrier; each call's time is
its slowest rank's; every result is checked against the one-process sum.
Prints the medians and hier/flat (the threshold goes where it crosses 1).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from spmd.bench.report import human
from spmd.bench.sides import all_reduce_table


def rank_main(sizes: list[int], iters: int) -> None:
    import spmd
    from spmd.comm.state import get_state

    torch.set_num_threads(1)
    spmd.init()
    rank, world = spmd.get_rank(), spmd.get_world_size()
    flat = spmd.new_group(list(range(world)), backend="gloo")
    spmd.all_reduce(torch.zeros(1))
    kind = type(get_state().world.backend("cpu")).__name__
    # the same steps by hand (as benchmarks/hierarchical_all_reduce.py makes them): what the composite's thread costs
    host_groups = [spmd.new_group([r for r in range(world) if r % 2 == h], backend="shm") for h in (0, 1)]
    local, leaders = host_groups[rank % 2], spmd.new_group([0, 1], backend="gloo")

    def by_hand(t: torch.Tensor) -> None:
        spmd.reduce(t, dst=rank % 2, group=local)
        if rank < 2:
            spmd.all_reduce(t, group=leaders)
        spmd.broadcast(t, src=rank % 2, group=local)

    sides = {"hier": lambda t: spmd.all_reduce(t), "flat": lambda t: spmd.all_reduce(t, group=flat), "hand": by_hand}
    rows = all_reduce_table(sides, sizes, iters, 300, lambda: spmd.barrier(group=flat),
                            lambda t: spmd.all_reduce(t, op=spmd.ReduceOp.MAX, group=flat))
    if rank == 0:
        print(f"all_reduce, {world} ranks on 2 nodes x {world // 2} (world group: {kind}; medians in us, slowest rank per call)")
        print(f"{'size':>9} | {'hier':>9} {'flat':>9} {'hand':>9} | {'hier/flat':>9} {'hier/hand':>9}")
        for nbytes, med in rows:
            print(f"{human(nbytes):>9} | {med['hier']:9.1f} {med['flat']:9.1f} {med['hand']:9.1f} | "
                  f"{med['hier'] / med['flat']:9.2f} {med['hier'] / med['hand']:9.2f}")
    sys.stdout.flush()
    spmd.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,4096,65536,1048576,4194304", help="bytes per rank, comma-separated")
    p.add_argument("--iters", type=int, default=0, help="calls per side and size (default: by size)")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # (set for the ranks this script starts)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.rank >= 0:
        rank_main(sizes, args.iters)
        return
    from spmd.testing.hosts import build_hosts
    from spmd.testing.ports import free_port

    hosts = build_hosts(2)
    try:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "SPMD_SOCKET_IFNAME")}
        env.update(OMP_NUM_THREADS="1", MASTER_ADDR=hosts.nodes[0].address, MASTER_PORT=str(port), WORLD_SIZE="4",
                   SPMD_HIERARCHICAL_MIN_BYTES="0")
        procs = [hosts.nodes[r % 2].popen([sys.executable, __file__, "--rank", str(r), "--sizes", args.sizes,
                                           "--iters", str(args.iters)], env=env | {"RANK": str(r), "LOCAL_RANK": str(r // 2)})
                 for r in range(4)]
        for proc in procs:
            proc.wait(timeout=1800)
        if any(proc.returncode for proc in procs):
            raise SystemExit(f"a rank failed: exit codes {[proc.returncode for proc in procs]}")
    except subprocess.TimeoutExpired:
        raise SystemExit("the benchmark did not finish in 30 minutes") from None
    finally:
        hosts.close()


if __name__ == "__main__":
    main()
