"""torch.distributed initialised first, no spmd.init: spmd's fully_shard joins that world, as torch's
fully_shard joins (or starts) the default group (pytorch/examples' FSDP2 example calls only
torch.distributed.init_process_group)."""

import json

import torch
import torch.distributed as tdist

import spmd
from spmd.fsdp import fully_shard

tdist.init_process_group("gloo")  # env:// from the launcher
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(model[0])
fully_shard(model)
loss = model(torch.ones(3, 4)).sum()
loss.backward()
grad = model[1].weight.grad.full_tensor()
report = {"spmd": [spmd.get_rank(), spmd.get_world_size()], "torch": [tdist.get_rank(), tdist.get_world_size()],
          "local_rows": model[0].weight.to_local().shape[0], "grad_sum": round(float(grad.sum()), 5)}
print("REPORT " + json.dumps(report), flush=True)
spmd.destroy_process_group()
if tdist.is_initialized():
    tdist.destroy_process_group()
