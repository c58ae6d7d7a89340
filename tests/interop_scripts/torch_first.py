"""torch.distributed initialised first (on Gloo, or as backend "spmd"); spmd.init then joins its world."""

import json
import sys

import torch
import torch.distributed as tdist

import spmd

tdist.init_process_group(sys.argv[1])  # env:// from the launcher
spmd.init("gloo")
t = torch.tensor([float(spmd.get_rank() + 1)])
spmd.all_reduce(t)
u = torch.tensor([float(tdist.get_rank() + 1)])
tdist.all_reduce(u)
report = {"spmd": [spmd.get_rank(), spmd.get_world_size()], "torch": [tdist.get_rank(), tdist.get_world_size()],
          "backend": tdist.get_backend(), "sums": [t.item(), u.item()]}
print("REPORT " + json.dumps(report), flush=True)
spmd.destroy_process_group()
if tdist.is_initialized():
    tdist.destroy_process_group()
