"""A short job that exits normally (with or without destroy_process_group): must exit 0.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python exit_script.py destroy|keep
"""

import sys

import torch

import spmd

spmd.init("ucc", timeout=30)
rank, world = spmd.get_rank(), spmd.get_world_size()
spmd.all_reduce(torch.ones(4))
work = spmd.all_reduce(torch.ones(1 << 20), async_op=True)
spmd.broadcast(torch.ones(8), src=0)
peer = (rank + 1) % world
recv = spmd.irecv(torch.empty(16), src=(rank - 1) % world)
spmd.isend(torch.ones(16), dst=peer).wait()
recv.wait()
work.wait()
group = spmd.new_group(list(range(world)))
spmd.all_reduce(torch.ones(3), group=group)
if sys.argv[1] == "destroy":
    spmd.destroy_process_group()
